/**
 * `chooseKernels`: which fast kernel set a process runs (`--kernels native|wasm|auto|ts`,
 * docs/kernels.md). `auto` (the default) takes the native kernels where the addon loads and passes
 * a start-up self-test against the reference kernels, else the WebAssembly ones, and says why in
 * one sentence for the log; `native` insists (an error saying why when it cannot), `wasm` and `ts`
 * are taken as asked.
 *
 * The self-test runs the native set on one thread over a small memory: a matmul of a few rows in
 * every weight format (against reference.ts on the same weights, with the wasm parity tests'
 * tolerances: rtol 1e-4 for f32/f16/bf16, the activation-quantisation bound for the int8 formats),
 * attention over an f16 KV pool, rmsnorm, rope and swiglu. It takes a few milliseconds and runs
 * once a process.
 */
import { loadNativeAddon } from "./kernel-backend.js";
import * as ref from "./reference.js";
import { WasmKernels } from "./wasm-kernels.js";
import {
  decodeMatrixRange,
  encodeWeight,
  f32ToF16Bits,
  isKQuant,
  type KQuantDType,
  type Matrix,
  QK_K,
  WEIGHT_DTYPES,
  type WeightDType,
  type WeightTensor,
  weightBytes,
} from "./weight-format.js";

export type KernelsRequest = "native" | "wasm" | "auto" | "ts";

export interface KernelsChoice {
  readonly kernels: "native" | "wasm" | "ts";
  /** The native ISA level, or null. */
  readonly isa: string | null;
  /** One line for the log: which kernels and why. */
  readonly message: string;
}

/** What `nativeSelfTest` found: the native ISA level, or why the native kernels cannot run. */
export type SelfTestResult = { isa: string } | { error: string };

let selfTest: Promise<SelfTestResult> | undefined;

/**
 * The kernels for `requested`; throws (with the reason) when native was asked for and cannot run.
 * `ranElsewhere`: this process's self-test, run by another of its threads (a prestarted node
 * thread, src/node/prestart-workers.ts), or undefined if that thread could not: it runs here then.
 */
export async function chooseKernels(
  requested: KernelsRequest,
  ranElsewhere?: Promise<SelfTestResult | undefined>,
): Promise<KernelsChoice> {
  if (requested === "ts")
    return { kernels: "ts", isa: null, message: "TypeScript reference kernels (--kernels ts)" };
  if (requested === "wasm")
    return { kernels: "wasm", isa: null, message: "WebAssembly kernels (--kernels wasm)" };
  selfTest ??= ranElsewhere?.then((r) => r ?? nativeSelfTest()) ?? nativeSelfTest();
  const native = await selfTest;
  if ("isa" in native)
    return { kernels: "native", isa: native.isa, message: `native kernels (${native.isa})` };
  if (requested === "native") throw new Error(`--kernels native cannot run: ${native.error}`);
  return { kernels: "wasm", isa: null, message: `WebAssembly kernels: ${native.error}` };
}

/** The native ISA level where the addon loads and computes as the reference does, else why not. */
export async function nativeSelfTest(isa?: string): Promise<SelfTestResult> {
  const loaded = loadNativeAddon();
  if ("error" in loaded) return { error: loaded.error };
  let k: WasmKernels | undefined;
  try {
    k = await WasmKernels.create({
      backend: "native",
      threads: 1,
      initialBytes: 8 << 20,
      ...(isa === undefined ? {} : { isa }),
    });
    const failure = checkKernels(k);
    return failure === null ? { isa: k.isa } : { error: `the native addon failed its self-test: ${failure}` };
  } catch (err) {
    return { error: `the native addon failed its self-test: ${(err as Error).message}` };
  } finally {
    await k?.close();
  }
}

/** Deterministic values in [-scale, scale). */
function spread(a: Float32Array, seed: number, scale = 1): Float32Array {
  let s = seed >>> 0 || 1;
  for (let i = 0; i < a.length; i++) {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    a[i] = ((s >>> 0) / 4294967296 - 0.5) * 2 * scale;
  }
  return a;
}

/** The first output farther than rtol·|want| + atol from the reference, or null. */
function far(got: Float32Array, want: Float32Array, rtol: number, atol: number, what: string): string | null {
  for (let i = 0; i < want.length; i++) {
    const g = got[i] as number;
    const w = want[i] as number;
    if (!(Math.abs(g - w) <= rtol * Math.abs(w) + atol))
      return `${what}: element ${i} is ${g}, the reference ${w}`;
  }
  return null;
}

/** What the kernels got wrong, or null. */
function checkKernels(k: WasmKernels): string | null {
  const rows = 5;
  const inDim = 64;
  const outDim = 24;
  const x = spread(k.allocF32(rows * inDim), 1);
  for (const dtype of WEIGHT_DTYPES) {
    const w = k.placeMatrix(
      dtype === "f32"
        ? spread(new Float32Array(outDim * inDim), 2, 0.5)
        : encodeWeight(spread(new Float32Array(outDim * inDim), 2, 0.5), [outDim, inDim], dtype),
    );
    for (const r of [1, rows]) {
      const got = k.allocF32(r * outDim);
      const want = new Float32Array(r * outDim);
      k.matmul(got, x, w, r, inDim, outDim);
      ref.matmul(want, x, w, r, inDim, outDim);
      const failure = checkMatmul(got, want, x, w, dtype, { rows: r, inDim, outDim });
      if (failure !== null) return failure;
    }
  }
  // The k-quants (read from GGUF files, never encoded: made from bytes), rows of one 256-weight block.
  const kx = spread(k.allocF32(rows * QK_K), 9);
  for (const dtype of ["q4_K", "q5_K", "q6_K"] as const) {
    const w = k.placeMatrix(kQuantWeight(dtype, outDim));
    for (const r of [1, rows]) {
      const got = k.allocF32(r * outDim);
      const want = new Float32Array(r * outDim);
      k.matmul(got, kx, w, r, QK_K, outDim);
      ref.matmul(want, kx, w, r, QK_K, outDim);
      const failure = checkMatmul(got, want, kx, w, dtype, { rows: r, inDim: QK_K, outDim });
      if (failure !== null) return failure;
    }
  }
  const n = 40;
  const a = spread(k.allocF32(2 * n), 3, 3);
  const weight = spread(k.allocF32(n), 4);
  const got = k.allocF32(2 * n);
  const want = new Float32Array(2 * n);
  k.rmsnorm(got, a, weight, n, 1e-5, 2);
  ref.rmsnorm(want, a, weight, n, 1e-5, 2);
  let failure = far(got, want, 1e-5, 1e-6, "rmsnorm");
  if (failure !== null) return failure;
  k.swiglu(got, a, weight, n);
  ref.swiglu(want, a, weight, n);
  failure = far(got.subarray(0, n), want.subarray(0, n), 1e-5, 1e-6, "swiglu");
  if (failure !== null) return failure;
  const headDim = 8;
  const cos = k.allocF64(32 * (headDim / 2));
  const sin = k.allocF64(32 * (headDim / 2));
  ref.ropeTables(cos, sin, 32, headDim, 10000);
  const positions = k.allocI32(2);
  positions.set([3, 17]);
  const ropeGot = spread(k.allocF32(2 * 2 * headDim), 5);
  const ropeWant = Float32Array.from(ropeGot);
  k.rope(ropeGot, positions, cos, sin, 2, 2, headDim);
  ref.rope(ropeWant, positions, cos, sin, 2, 2, headDim);
  failure = far(ropeGot, ropeWant, 1e-5, 1e-6, "rope");
  if (failure !== null) return failure;
  failure = checkAttention(k);
  if (failure !== null) return failure;
  return k.fallbackCalls === 0
    ? null
    : `${k.fallbackCalls} call(s) ran on the reference, not the native kernels`;
}

/** Attention over an f16 KV pool written by the kernels' own KV write, GQA group 2, three pages. */
function checkAttention(k: WasmKernels): string | null {
  const [numHeads, numKvHeads, headDim, pageSize, numLayers, rows] = [4, 2, 8, 4, 1, 3];
  const kvDim = numKvHeads * headDim;
  const numPages = 4;
  const pool = new Uint16Array(k.buffer(), k.allocBytes(numPages * numLayers * 2 * pageSize * kvDim * 2));
  const poolView = pool.subarray(0, numPages * numLayers * 2 * pageSize * kvDim);
  const seq = { blockTable: Int32Array.from([2, 0, 3]), rowStart: 0, rows: 9, startPos: 0 };
  const kv = spread(k.allocF32(9 * kvDim), 6);
  const vv = spread(k.allocF32(9 * kvDim), 7);
  k.storeKv(poolView, kv, vv, [seq], 1, 0, numLayers, numKvHeads, headDim, pageSize, 1);
  const q = spread(k.allocF32((6 + rows) * numHeads * headDim), 8);
  const got = k.allocF32(q.length);
  const want = new Float32Array(q.length);
  const step = [{ blockTable: seq.blockTable, rowStart: 6, rows, startPos: 6 }];
  const scratch = new Float64Array(headDim + 16);
  const shape = [0, numLayers, numHeads, numKvHeads, headDim, pageSize, 1] as const;
  k.pagedAttentionBatch(got, q, poolView, step, 1, scratch, ...shape);
  ref.pagedAttentionBatch(want, q, poolView, step, 1, scratch, ...shape);
  return far(got, want, 1e-4, 1e-5, "attention on an f16 KV");
}

/** [outDim][256] k-quant blocks: deterministic bytes, then d (and dmin) set to 0.01 (and 0.005). */
function kQuantWeight(dtype: KQuantDType, outDim: number): WeightTensor {
  const bytes = Uint8Array.from(spread(new Float32Array(weightBytes(dtype, outDim * QK_K)), 10), (v) =>
    Math.floor((v + 1) * 128),
  );
  const size = weightBytes(dtype, QK_K);
  for (let o = 0; o < bytes.length; o += size) {
    for (const [at, v] of dtype === "q6_K"
      ? [[208, 0.01]]
      : [
          [0, 0.01],
          [2, 0.005],
        ]) {
      const h = f32ToF16Bits(v as number);
      bytes[o + (at as number)] = h & 255;
      bytes[o + (at as number) + 1] = h >> 8;
    }
  }
  return { dtype, shape: [outDim, QK_K], bytes };
}

/**
 * f32/f16/bf16: rtol 1e-4; the block formats: the bound activation quantisation implies
 * (wasm-weights.test.ts), over the activation blocks of 32 values, or 256 for the k-quants (the
 * native kernels quantise their activations as ggml's q8_K).
 */
function checkMatmul(
  got: Float32Array,
  want: Float32Array,
  x: Float32Array,
  w: Matrix,
  dtype: WeightDType,
  dims: { rows: number; inDim: number; outDim: number },
): string | null {
  const what = `matmul on ${dtype} weights, ${dims.rows} row(s)`;
  if (dtype !== "q8_0" && dtype !== "q4_0" && !isKQuant(dtype)) return far(got, want, 1e-4, 1e-5, what);
  const block = isKQuant(dtype) ? QK_K : 32;
  // The weights widened to f32, [outDim][inDim] (the reference's own decoding).
  const wf = decodeMatrixRange(w, 0, dims.outDim * dims.inDim, new Float32Array(dims.outDim * dims.inDim));
  for (let r = 0; r < dims.rows; r++) {
    for (let j = 0; j < dims.outDim; j++) {
      let bound = 1e-6;
      for (let b = 0; b < dims.inDim; b += block) {
        let amax = 0;
        for (let i = b; i < b + block; i++) amax = Math.max(amax, Math.abs(x[r * dims.inDim + i] as number));
        for (let i = b; i < b + block; i++) {
          const wv = Math.abs(wf[j * dims.inDim + i] as number);
          bound += (wv * amax) / 254 + 1e-5 * wv * Math.abs(x[r * dims.inDim + i] as number);
        }
      }
      const diff = Math.abs((got[r * dims.outDim + j] as number) - (want[r * dims.outDim + j] as number));
      if (!(diff <= bound))
        return `${what}: element ${r * dims.outDim + j} is off by ${diff} (bound ${bound})`;
    }
  }
  return null;
}
