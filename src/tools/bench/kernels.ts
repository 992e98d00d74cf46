/**
 * Benchmark: the WebAssembly SIMD kernels (src/kernels/wasm-kernels.ts) against the TypeScript
 * reference as kernels, next to the memory-bandwidth roofline measured in the same run (issue #7).
 * The forward pass on both kernel sets is `kvfence bench model --kernels both`; the guards' cost
 * on the wasm kernels is `kvfence bench tag-check --kernels wasm`.
 *
 * Parts:
 * - `micro`: matvec 576x1536 and 2048x2048, matmul 64x576x1536 (cache-warm, as docs/benchmarks.md §3.2),
 *   GFLOP/s for ts, wasm on 1 thread and wasm on 2 threads.
 * - `roofline`: read bandwidth of 1 GiB of touched memory, native `memchr` on 1 and on 2 threads
 *   (src/tools/bench/roofline.ts); with `--model`, the roofline in tokens/s: bandwidth / bytes of weights one
 *   decode token reads (all linear weights and the LM head).
 * - `pass`: the bare wasm decode weight pass (every linear weight and the LM head once, matvecs only).
 * - `gemm8`: the batch-8 decode GEMM, 8 rows × 576 against 128 weight rows that stay in L2 and
 *   against the 49,152 rows of the 135M shape's LM head (113 MB, from DRAM), GFLOP/s on 1 and 2
 *   threads for the fused multiply-add build and the plain one: the first is the tile's compute
 *   ceiling, the gap to the second what reading the weights into L2 costs.
 *
 * - `attention`: the attention of one decode token at 4,096 tokens per KV cache dtype (f32, f16,
 *   bf16), interleaved (src/tools/bench/kv-attention.ts).
 *
 * Every figure is the median over timed repetitions after warm-up (the spread is printed).
 *
 * Run: `node dist/src/tools/bench/kernels.js [--model DIR] [--threads 1|2] [--parts micro,roofline,pass,gemm8,attention]
 * [--json]` (the model: `node dist/src/cli/main.js gen-model --like smollm2-135m --seed 1 /tmp/smol`).
 */
import { parseArgs } from "node:util";
import { referenceKernels } from "../../kernels/kernels.js";
import { WasmKernels } from "../../kernels/wasm-kernels.js";
import { loadModelConfig } from "../../model/config-loader.js";
import { loadWeights } from "../../model/load-model.js";
import type { ModelConfig, ModelWeights } from "../../model/model-config.js";
import { attentionByDtype } from "./kv-attention.js";
import { weightBytes } from "./model.js";
import { BandwidthProbe } from "./roofline.js";

interface Spread {
  median: number;
  min: number;
  max: number;
}

function spread(xs: number[]): Spread {
  const s = [...xs].sort((a, b) => a - b);
  return { median: s[Math.floor(s.length / 2)] as number, min: s[0] as number, max: s.at(-1) as number };
}

function nowMs(): number {
  return Number(process.hrtime.bigint()) / 1e6;
}

/** Times `fn` `reps` times after `warm` warm-up calls; milliseconds per call. */
function timeIt(fn: () => void, reps: number, warm: number): Spread {
  for (let i = 0; i < warm; i++) fn();
  const t: number[] = [];
  for (let i = 0; i < reps; i++) {
    const t0 = nowMs();
    fn();
    t.push(nowMs() - t0);
  }
  return spread(t);
}

function fill(a: Float32Array, seed: number): Float32Array {
  let s = seed >>> 0 || 1;
  for (let i = 0; i < a.length; i++) {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    a[i] = (s >>> 0) / 4294967296 - 0.5;
  }
  return a;
}

const fmt = (x: number, d = 1): string => x.toFixed(d);
const fmtS = (s: Spread, f: (x: number) => number, d = 1): string => {
  const a = f(s.min);
  const b = f(s.max);
  return `${fmt(f(s.median), d)} (${fmt(Math.min(a, b), d)}–${fmt(Math.max(a, b), d)})`;
};

// ---------------------------------------------------------------------------------------------

async function micro(log: (l: string) => void, results: Record<string, unknown>): Promise<void> {
  const shapes: [string, number, number, number, number][] = [
    ["matvec 576x1536", 1, 1536, 576, 200],
    ["matvec 2048x2048", 1, 2048, 2048, 50],
    ["matmul 64x576x1536", 64, 576, 1536, 3],
  ];
  const k1 = await WasmKernels.create({ threads: 1 });
  const k2 = await WasmKernels.create({ threads: 2 });
  await k2.ready();
  log("kernel                 | ts GFLOP/s      | wasm 1 thread    | wasm 2 threads");
  for (const [name, rows, inDim, outDim, inner] of shapes) {
    const flops = 2 * rows * inDim * outDim * inner;
    const row: string[] = [];
    const entry: Record<string, Spread> = {};
    for (const [label, kern] of [
      ["ts", referenceKernels],
      ["wasm1", k1],
      ["wasm2", k2],
    ] as const) {
      const x = fill(kern.allocF32(rows * inDim), 1);
      const w = fill(kern.allocF32(inDim * outDim), 2);
      const out = kern.allocF32(rows * outDim);
      const reps = label === "ts" ? 3 : 7;
      const t = timeIt(
        () => {
          for (let i = 0; i < inner; i++) kern.matmul(out, x, w, rows, inDim, outDim);
        },
        reps,
        1,
      );
      entry[label] = t;
      row.push(fmtS(t, (ms) => flops / ms / 1e6));
    }
    results[name] = entry;
    log(`${name.padEnd(22)} | ${row.join(" | ")}`);
  }
  await k1.close();
  await k2.close();
}

// ---------------------------------------------------------------------------------------------

async function gemm8(log: (l: string) => void, results: Record<string, unknown>): Promise<void> {
  const shapes: [string, number, number][] = [
    ["8x576x128, weights in L2", 128, 400],
    ["8x576x49152, from DRAM", 49152, 2],
  ];
  log("batch-8 GEMM            | build              | wasm 1 thread    | wasm 2 threads");
  for (const fma of [true, false]) {
    const kernels = [
      await WasmKernels.create({ threads: 1, fma }),
      await WasmKernels.create({ threads: 2, fma }),
    ];
    await (kernels[1] as WasmKernels).ready();
    const build = (kernels[0] as WasmKernels).fma ? "fused multiply-add" : "multiply, then add";
    for (const [name, outDim, inner] of shapes) {
      const flops = 2 * 8 * 576 * outDim * inner;
      const row: string[] = [];
      const entry: Record<string, Spread> = {};
      for (const [i, kern] of kernels.entries()) {
        const x = fill(kern.allocF32(8 * 576), 1);
        const w = fill(kern.allocF32(576 * outDim), 2);
        const out = kern.allocF32(8 * outDim);
        const t = timeIt(
          () => {
            for (let r = 0; r < inner; r++) kern.matmul(out, x, w, 8, 576, outDim);
          },
          7,
          1,
        );
        entry[`wasm${i + 1}`] = t;
        row.push(fmtS(t, (ms) => flops / ms / 1e6).padEnd(16));
      }
      results[`${name} (${build})`] = entry;
      log(`${name.padEnd(23)} | ${build.padEnd(18)} | ${row.join(" | ")}`);
    }
    for (const k of kernels) await k.close();
  }
}

// ---------------------------------------------------------------------------------------------

/** Read bandwidth (GB/s) of 1 GiB of touched memory with native memchr on 1 and 2 threads. */
async function roofline(log: (l: string) => void): Promise<{ one: Spread; two: Spread }> {
  const probe = await BandwidthProbe.start(1 << 30);
  try {
    const one = timeIt(() => probe.measure(1), 7, 1);
    const two = timeIt(() => probe.measure(2), 7, 1);
    const gbs = (ms: number) => probe.bytes / ms / 1e6;
    log(
      `read bandwidth, native memchr over 1 GiB: 1 thread ${fmtS(one, gbs)} GB/s, 2 threads ${fmtS(two, gbs)} GB/s`,
    );
    return { one: mapSpread(one, gbs), two: mapSpread(two, gbs) };
  } finally {
    await probe.close();
  }
}

function mapSpread(s: Spread, f: (x: number) => number): Spread {
  const a = f(s.min);
  const b = f(s.max);
  return { median: f(s.median), min: Math.min(a, b), max: Math.max(a, b) };
}

// ---------------------------------------------------------------------------------------------

/** The bare decode weight pass: one matvec over every linear weight and the LM head; ms per pass. */
function weightPass(k: WasmKernels, config: ModelConfig, w: ModelWeights, reps: number): Spread {
  const h = config.hiddenSize;
  const q = config.numHeads * config.headDim;
  const kv = config.numKvHeads * config.headDim;
  const inter = config.intermediateSize;
  const x = fill(k.allocF32(Math.max(h, q, inter)), 3);
  const y = k.allocF32(Math.max(config.vocabSize, inter));
  return timeIt(
    () => {
      for (const l of w.layers) {
        k.matmul(y, x, l.q, 1, h, q);
        k.matmul(y, x, l.k, 1, h, kv);
        k.matmul(y, x, l.v, 1, h, kv);
        k.matmul(y, x, l.o, 1, q, h);
        k.matmul(y, x, l.gate, 1, h, inter);
        k.matmul(y, x, l.up, 1, h, inter);
        k.matmul(y, x, l.down, 1, inter, h);
      }
      k.matmul(y, x, w.lmHead, 1, h, config.vocabSize);
    },
    reps,
    2,
  );
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      model: { type: "string" },
      threads: { type: "string", default: "2" },
      parts: { type: "string", default: "micro,roofline" },
      "matvec-chunk": { type: "string", default: "0" },
      json: { type: "boolean", default: false },
    },
  });
  const parts = new Set((values.parts ?? "").split(","));
  for (const part of parts) {
    if (!["micro", "roofline", "pass", "gemm8", "attention"].includes(part)) {
      throw new Error(
        `Unknown part: ${part}; use micro, roofline, pass, gemm8 or attention (the forward pass is \`kvfence bench model\`, the guards \`kvfence bench tag-check\`)`,
      );
    }
  }
  const threads = values.threads === "1" ? 1 : 2;
  const log = (l: string) => {
    if (!values.json) console.log(l);
  };
  const results: Record<string, unknown> = { node: process.version };
  if (parts.has("micro")) {
    const m: Record<string, unknown> = {};
    results.micro = m;
    await micro(log, m);
  }
  if (parts.has("gemm8")) {
    const g: Record<string, unknown> = {};
    results.gemm8 = g;
    await gemm8(log, g);
  }
  if (parts.has("attention")) results.attention = await attentionByDtype(log, { threads });
  let bw: { one: Spread; two: Spread } | null = null;
  if (parts.has("roofline")) bw = await roofline(log);
  const dir = values.model;
  if (dir === undefined) {
    if (parts.has("pass")) throw new Error("The pass part needs a model: none given; pass --model DIR");
  } else {
    const config = loadModelConfig(dir);
    const weights = loadWeights(dir, config);
    const wBytes = weightBytes(weights);
    log(`model ${dir}: ${fmt(wBytes / 1e6, 0)} MB of weights per decode token`);
    if (bw !== null) {
      const r1 = mapSpread(bw.one, (g) => (g * 1e9) / wBytes);
      const r2 = mapSpread(bw.two, (g) => (g * 1e9) / wBytes);
      log(
        `roofline (weights / measured bandwidth): 1 thread ${fmtS(r1, (x) => x)} tok/s, 2 threads ${fmtS(r2, (x) => x)} tok/s`,
      );
      results.roofline = {
        bandwidthGBs: bw,
        tokensPerSecond1: r1,
        tokensPerSecond2: r2,
        weightBytes: wBytes,
      };
    }
    if (parts.has("pass")) {
      const k = await WasmKernels.create({
        threads,
        initialBytes: wBytes + (1 << 26),
        matvecChunk: Number(values["matvec-chunk"]),
      });
      await k.ready();
      const t = weightPass(k, config, k.placeWeights(weights), 15);
      log(
        `bare wasm weight pass (${threads} thread${threads > 1 ? "s" : ""}): ${fmtS(t, (ms) => 1000 / ms)} passes/s (${fmtS(t, (x) => x, 2)} ms)`,
      );
      results.weightPass = mapSpread(t, (ms) => 1000 / ms);
      if (k.fallbackCalls !== 0) log(`  WARNING: ${k.fallbackCalls} kernel calls fell back to TypeScript`);
      await k.close();
    }
  }
  if (values.json) console.log(JSON.stringify(results, null, 2));
}

await main();
