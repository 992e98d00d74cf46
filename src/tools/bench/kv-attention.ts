/**
 * The `attention` part of `node dist/src/tools/bench/kernels.js`: the WebAssembly attention of one
 * decode token at a long context over every layer of the 135M shape (30 layers, 9 query and 3 KV
 * heads of 64, 16-token pages), once per KV cache dtype (f32, f16, bf16; src/kvcache/kv-layout.ts),
 * in interleaved rounds. It isolates what the dtype changes in a decode step: the bytes of K/V the
 * attention reads and the widening it does (`kvLoad4` in src/kernels/assembly/index.ts). The
 * pools hold resident random K/V rounded to each dtype (pages never written would be read from the
 * kernel's shared zero page, all of it cache-hot). On a shared machine the fastest round is the
 * least disturbed one; the median and the range are printed too.
 */
import { roundKv } from "../../kernels/reference.js";
import { WasmKernels } from "../../kernels/wasm-kernels.js";
import { KV_DTYPES, kvDtypeCode } from "../../kvcache/kv-layout.js";

const SHAPE = { numLayers: 30, numHeads: 9, numKvHeads: 3, headDim: 64, pageSize: 16 };

export interface AttentionPartOptions {
  readonly threads: 1 | 2;
  /** Context of the decode token. Default 4096. */
  readonly context?: number;
  /** Interleaved rounds. Default 15. */
  readonly rounds?: number;
}

/** Milliseconds of attention per decode token, per dtype: min, median, max over the rounds. */
export async function attentionByDtype(
  log: (line: string) => void,
  options: AttentionPartOptions,
): Promise<Record<string, { min: number; median: number; max: number }>> {
  const { numLayers, numHeads, numKvHeads, headDim, pageSize } = SHAPE;
  const ctx = options.context ?? 4096;
  const rounds = options.rounds ?? 15;
  const pages = Math.ceil((ctx + 1) / pageSize);
  const elements = pages * numLayers * 2 * pageSize * numKvHeads * headDim;
  const k = await WasmKernels.create({ threads: options.threads, initialBytes: elements * 8 + (64 << 20) });
  await k.ready();
  try {
    const table = Int32Array.from({ length: pages }, (_, i) => i);
    const q = k.allocF32(numHeads * headDim);
    for (let i = 0; i < q.length; i++) q[i] = Math.cos(i) * 0.5;
    const out = k.allocF32(numHeads * headDim);
    const seq = [{ blockTable: table, rowStart: 0, rows: 1, startPos: ctx }];
    const scratch = new Float64Array(1);
    const arms = KV_DTYPES.map((dtype) => {
      const code = kvDtypeCode(dtype);
      let pool: Float32Array | Uint16Array;
      if (code === 0) {
        pool = k.allocF32(elements);
        for (let i = 0; i < elements; i++) pool[i] = Math.sin(i) * 0.5;
      } else {
        const at = k.allocBytes(elements * 2);
        pool = new Uint16Array(k.buffer(), at, elements);
        for (let i = 0; i < elements; i++) pool[i] = roundKv(Math.sin(i) * 0.5, code);
      }
      const run = (): number => {
        const t0 = process.hrtime.bigint();
        for (let l = 0; l < numLayers; l++)
          k.pagedAttentionBatch(
            out,
            q,
            pool,
            seq,
            1,
            scratch,
            l,
            numLayers,
            numHeads,
            numKvHeads,
            headDim,
            pageSize,
            code,
          );
        return Number(process.hrtime.bigint() - t0) / 1e6;
      };
      run();
      return { dtype, run, ms: [] as number[] };
    });
    for (let r = 0; r < rounds; r++) for (const a of arms) a.ms.push(a.run());
    const result: Record<string, { min: number; median: number; max: number }> = {};
    log(
      `attention of one decode token at ${ctx} tokens, ${numLayers} layers, ${options.threads} thread(s), ${rounds} interleaved rounds:`,
    );
    const f32 = arms[0] as (typeof arms)[number];
    const minOf = (a: (typeof arms)[number]): number => Math.min(...a.ms);
    for (const a of arms) {
      const s = [...a.ms].sort((x, y) => x - y);
      const r = {
        min: s[0] as number,
        median: s[Math.floor(s.length / 2)] as number,
        max: s.at(-1) as number,
      };
      result[a.dtype] = r;
      log(
        `  KV ${a.dtype.padEnd(4)} ${((pages * numLayers * 2 * pageSize * numKvHeads * headDim * (code(a.dtype) === 0 ? 4 : 2)) / 1e6).toFixed(0)} MB: min ${r.min.toFixed(2)} ms, median ${r.median.toFixed(2)} [${r.min.toFixed(2)}–${r.max.toFixed(2)}]; min ×${(minOf(a) / minOf(f32)).toFixed(2)} of f32`,
      );
    }
    if (k.fallbackCalls !== 0) log(`  WARNING: ${k.fallbackCalls} kernel calls fell back to TypeScript`);
    return result;
  } finally {
    await k.close();
  }
}

function code(dtype: (typeof KV_DTYPES)[number]): number {
  return kvDtypeCode(dtype);
}
