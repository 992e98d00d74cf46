/**
 * The in-memory weight formats: a weight matrix is `{ dtype, shape, bytes }`, its bytes exactly as
 * they sit in the file, so a bf16 or f16 checkpoint stays at 2 bytes a weight and a quantised one at
 * its block size; the kernels widen or dequantise as they read (docs/weights.md).
 *
 * - `f32`: 4-byte little-endian IEEE floats.
 * - `f16`, `bf16`: 2-byte halves. f32 → f16 and f32 → bf16 round to nearest, ties to even, as
 *   llama.cpp's `GGML_FP32_TO_FP16` and PyTorch's `.to(torch.bfloat16)` do.
 * - `q8_0`, `q4_0`: llama.cpp's GGUF blocks of 32 weights along a row (the last dimension, which
 *   must be a multiple of 32). `block_q8_0` is 34 bytes: the scale d as f16, then 32 int8 q;
 *   weight = q·d. `block_q4_0` is 18 bytes: d as f16, then 16 bytes whose low nibbles are weights
 *   0–15 and high nibbles weights 16–31; weight = (q − 8)·d.
 *
 * Quantisation follows ggml's reference functions (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`
 * in ggml-quants.c, the ones llama-quantize uses to make files) operation for operation in f32, so
 * the same weights give the same bytes:
 * - Q8_0: amax = max |x|; d = amax / 127; id = d ? 1/d : 0; q = roundf(x·id) (ties away from zero).
 * - Q4_0: max = the x of largest |x| (the first one on a tie); d = max / −8; id = d ? 1/d : 0;
 *   q = min(15, trunc(x·id + 8.5)).
 * The scale stored is d rounded to f16, while the quants were computed with the f32 d (as ggml
 * does). Dequantisation (q·d with d widened from f16) is exact in f32.
 *
 * - `q4_K`, `q5_K`, `q6_K`: llama.cpp's k-quants in blocks of 256 weights along a row (k-quants.ts),
 *   read from GGUF files and dequantised exactly as ggml; kvfence never quantises to them, so
 *   `encodeWeight` (and `kvfence quantize`, `--quantize`) refuse them.
 */
import { decodeKQuantBlocks, isKQuant, K_BLOCK_BYTES, type KQuantDType, QK_K } from "./k-quants.js";

export { isKQuant, type KQuantDType, QK_K } from "./k-quants.js";

export type WeightDType = "f32" | "f16" | "bf16" | "q8_0" | "q4_0" | KQuantDType;

/** The formats kvfence converts weights to (`encodeWeight`): every `WeightDType` but the k-quants. */
export const WEIGHT_DTYPES: readonly WeightDType[] = ["f32", "f16", "bf16", "q8_0", "q4_0"];

/** A weight tensor in its stored format, row-major `[out][in]` for a matrix. */
export interface WeightTensor {
  readonly dtype: WeightDType;
  readonly shape: readonly number[];
  /** The tensor's bytes in `dtype`'s layout (for f32/f16/bf16 aligned to the element size). */
  readonly bytes: Uint8Array;
}

/** Weights per quantisation block (QK8_0 = QK4_0 = 32). */
export const QK = 32;
export const Q8_0_BLOCK_BYTES = 34;
export const Q4_0_BLOCK_BYTES = 18;

export function isQuantized(dtype: WeightDType): dtype is "q8_0" | "q4_0" {
  return dtype === "q8_0" || dtype === "q4_0";
}

/** Weights per block of `dtype`: 1, 32 (q8_0, q4_0) or 256 (the k-quants); rows hold whole blocks. */
export function blockWeights(dtype: WeightDType): number {
  return isKQuant(dtype) ? QK_K : dtype === "q8_0" || dtype === "q4_0" ? QK : 1;
}

/** Bytes of `elements` weights in `dtype` (a multiple of `blockWeights(dtype)`). */
export function weightBytes(dtype: WeightDType, elements: number): number {
  switch (dtype) {
    case "f32":
      return elements * 4;
    case "f16":
    case "bf16":
      return elements * 2;
    case "q8_0":
      return (elements / QK) * Q8_0_BLOCK_BYTES;
    case "q4_0":
      return (elements / QK) * Q4_0_BLOCK_BYTES;
    case "q4_K":
    case "q5_K":
    case "q6_K":
      return (elements / QK_K) * K_BLOCK_BYTES[dtype];
  }
}

/** Bytes of one row of `cols` weights (the stride between matrix rows). */
export function rowBytes(dtype: WeightDType, cols: number): number {
  return weightBytes(dtype, cols);
}

// -----------------------------------------------------------------------------------------------
// halves

const f32Box = new Float32Array(1);
const u32Box = new Uint32Array(f32Box.buffer);

/** The f32 nearest to `x`, as bits. */
function f32Bits(x: number): number {
  f32Box[0] = x;
  return u32Box[0] as number;
}

/** IEEE half bits of `x` (rounded to f32 first), round to nearest, ties to even; NaN stays NaN. */
export function f32ToF16Bits(x: number): number {
  const b = f32Bits(x);
  const sign = (b >>> 16) & 0x8000;
  const exp = (b >>> 23) & 0xff;
  const mant = b & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant === 0 ? 0 : 0x200 | (mant >>> 13));
  if (exp > 112) {
    // A normal half (or overflow to infinity): 13 mantissa bits go; a carry moves into the exponent.
    let h = ((exp - 112) << 10) | (mant >>> 13);
    const rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem === 0x1000 && (h & 1) === 1)) h++;
    return h >= 0x7c00 ? sign | 0x7c00 : sign | h;
  }
  // A subnormal half (units of 2^-24): value = m · 2^(exp-150), so h = m >> (126 - exp), rounded.
  const shift = 126 - exp;
  if (shift > 24) return sign;
  const m = mant | (exp === 0 ? 0 : 0x800000);
  let h = m >>> shift;
  const rem = m & ((1 << shift) - 1);
  const half = 1 << (shift - 1);
  if (rem > half || (rem === half && (h & 1) === 1)) h++;
  return sign | h;
}

let f16Table: Float32Array | undefined;

/** A 65,536-entry table of every half's value (256 KiB, built on first use). */
export function f16ValueTable(): Float32Array {
  if (f16Table !== undefined) return f16Table;
  const table = new Float32Array(65536);
  for (let h = 0; h < 65536; h++) {
    const sign = h & 0x8000 ? -1 : 1;
    const exp = (h >> 10) & 0x1f;
    const frac = h & 0x3ff;
    if (exp === 0) table[h] = sign * frac * 2 ** -24;
    else if (exp === 31) table[h] = frac === 0 ? sign * Number.POSITIVE_INFINITY : Number.NaN;
    else table[h] = sign * (1 + frac / 1024) * 2 ** (exp - 15);
  }
  f16Table = table;
  return table;
}

export function f16BitsToF32(h: number): number {
  return f16ValueTable()[h & 0xffff] as number;
}

/** bf16 bits of `x` (rounded to f32 first): the top half, round to nearest, ties to even; NaN stays NaN. */
export function f32ToBf16Bits(x: number): number {
  const b = f32Bits(x);
  if ((b & 0x7f800000) === 0x7f800000 && (b & 0x7fffff) !== 0) return (b >>> 16) | 0x40;
  return ((b + 0x7fff + ((b >>> 16) & 1)) >>> 16) & 0xffff;
}

export function bf16BitsToF32(h: number): number {
  u32Box[0] = (h & 0xffff) << 16;
  return f32Box[0] as number;
}

// -----------------------------------------------------------------------------------------------
// blocks

function checkBlocks(n: number, what: string, block = QK): void {
  if (n % block !== 0) {
    throw new RangeError(`${what}: ${n} values is not a whole number of ${block}-value blocks`);
  }
}

/** roundf: to nearest, ties away from zero (C's roundf, unlike Math.round). */
function roundAway(x: number): number {
  return x < 0 ? -Math.floor(-x + 0.5) : Math.floor(x + 0.5);
}

/** Q8_0 blocks of `x` (length a multiple of 32), as ggml's quantize_row_q8_0_ref. */
export function quantizeQ8_0(x: Float32Array, out?: Uint8Array): Uint8Array {
  checkBlocks(x.length, "quantizeQ8_0");
  const nb = x.length / QK;
  const y = out ?? new Uint8Array(nb * Q8_0_BLOCK_BYTES);
  const fr = Math.fround;
  for (let i = 0; i < nb; i++) {
    let amax = 0;
    for (let j = 0; j < QK; j++) amax = Math.max(amax, Math.abs(x[i * QK + j] as number));
    const d = fr(amax / 127);
    const id = d !== 0 ? fr(1 / d) : 0;
    const o = i * Q8_0_BLOCK_BYTES;
    const h = f32ToF16Bits(d);
    y[o] = h & 0xff;
    y[o + 1] = h >>> 8;
    for (let j = 0; j < QK; j++) y[o + 2 + j] = roundAway(fr((x[i * QK + j] as number) * id)) & 0xff;
  }
  return y;
}

/** Q4_0 blocks of `x` (length a multiple of 32), as ggml's quantize_row_q4_0_ref. */
export function quantizeQ4_0(x: Float32Array, out?: Uint8Array): Uint8Array {
  checkBlocks(x.length, "quantizeQ4_0");
  const nb = x.length / QK;
  const y = out ?? new Uint8Array(nb * Q4_0_BLOCK_BYTES);
  const fr = Math.fround;
  for (let i = 0; i < nb; i++) {
    let amax = 0;
    let max = 0;
    for (let j = 0; j < QK; j++) {
      const v = x[i * QK + j] as number;
      if (amax < Math.abs(v)) {
        amax = Math.abs(v);
        max = v;
      }
    }
    const d = fr(max / -8);
    const id = d !== 0 ? fr(1 / d) : 0;
    const o = i * Q4_0_BLOCK_BYTES;
    const h = f32ToF16Bits(d);
    y[o] = h & 0xff;
    y[o + 1] = h >>> 8;
    for (let j = 0; j < QK / 2; j++) {
      const x0 = fr((x[i * QK + j] as number) * id);
      const x1 = fr((x[i * QK + QK / 2 + j] as number) * id);
      const q0 = Math.min(15, Math.trunc(fr(x0 + 8.5)));
      const q1 = Math.min(15, Math.trunc(fr(x1 + 8.5)));
      y[o + 2 + j] = q0 | (q1 << 4);
    }
  }
  return y;
}

// -----------------------------------------------------------------------------------------------
// tensors

const elementsOf = (shape: readonly number[]): number => shape.reduce((a, b) => a * b, 1);

/** Encodes f32 values as a tensor of `dtype` (rounding as described in the module header). */
export function encodeWeight(data: Float32Array, shape: readonly number[], dtype: WeightDType): WeightTensor {
  const n = elementsOf(shape);
  if (n !== data.length)
    throw new RangeError(`encodeWeight: shape [${shape}] holds ${n} values, data ${data.length}`);
  const frozen = Object.freeze([...shape]);
  switch (dtype) {
    case "f32":
      return { dtype, shape: frozen, bytes: new Uint8Array(data.buffer, data.byteOffset, data.byteLength) };
    case "f16":
    case "bf16": {
      const out = new Uint16Array(n);
      const enc = dtype === "f16" ? f32ToF16Bits : f32ToBf16Bits;
      for (let i = 0; i < n; i++) out[i] = enc(data[i] as number);
      return { dtype, shape: frozen, bytes: new Uint8Array(out.buffer) };
    }
    case "q8_0":
    case "q4_0":
      if ((shape[shape.length - 1] ?? 0) % QK !== 0) {
        throw new RangeError(
          `encodeWeight: ${dtype} needs rows of a multiple of ${QK} values; shape [${shape}] has rows of ${shape[shape.length - 1]}`,
        );
      }
      return { dtype, shape: frozen, bytes: dtype === "q8_0" ? quantizeQ8_0(data) : quantizeQ4_0(data) };
    case "q4_K":
    case "q5_K":
    case "q6_K":
      throw new RangeError(
        `encodeWeight: kvfence reads ${dtype} from GGUF files but does not quantise to it; choose one of ${WEIGHT_DTYPES.join(", ")}`,
      );
  }
}

/**
 * Values [start, start + n) of the tensor (flat, row-major) widened/dequantised into
 * out[at..at + n); for the block formats start and n must be multiples of the block (32, or 256
 * for the k-quants). Allocates nothing.
 */
export function decodeRange(
  t: WeightTensor,
  start: number,
  n: number,
  out: Float32Array,
  at = 0,
): Float32Array {
  const b = t.bytes;
  switch (t.dtype) {
    case "f32":
      for (let i = 0; i < n; i++) {
        const o = (start + i) * 4;
        u32Box[0] =
          ((b[o] as number) |
            ((b[o + 1] as number) << 8) |
            ((b[o + 2] as number) << 16) |
            ((b[o + 3] as number) << 24)) >>>
          0;
        out[at + i] = f32Box[0] as number;
      }
      return out;
    case "f16": {
      const table = f16ValueTable();
      for (let i = 0; i < n; i++) {
        const o = (start + i) * 2;
        out[at + i] = table[(b[o] as number) | ((b[o + 1] as number) << 8)] as number;
      }
      return out;
    }
    case "bf16":
      for (let i = 0; i < n; i++) {
        const o = (start + i) * 2;
        out[at + i] = bf16BitsToF32((b[o] as number) | ((b[o + 1] as number) << 8));
      }
      return out;
    case "q8_0":
    case "q4_0": {
      checkBlocks(start, "decodeRange");
      checkBlocks(n, "decodeRange");
      const q8 = t.dtype === "q8_0";
      const table = f16ValueTable();
      for (let i = 0; i < n / QK; i++) {
        const o = (start / QK + i) * (q8 ? Q8_0_BLOCK_BYTES : Q4_0_BLOCK_BYTES);
        const d = table[(b[o] as number) | ((b[o + 1] as number) << 8)] as number;
        const dst = at + i * QK;
        if (q8) {
          for (let j = 0; j < QK; j++) out[dst + j] = (((b[o + 2 + j] as number) << 24) >> 24) * d;
        } else {
          for (let j = 0; j < QK / 2; j++) {
            const q = b[o + 2 + j] as number;
            out[dst + j] = ((q & 15) - 8) * d;
            out[dst + QK / 2 + j] = ((q >> 4) - 8) * d;
          }
        }
      }
      return out;
    }
    case "q4_K":
    case "q5_K":
    case "q6_K":
      checkBlocks(start, "decodeRange", QK_K);
      checkBlocks(n, "decodeRange", QK_K);
      decodeKQuantBlocks(
        t.dtype,
        b,
        (start / QK_K) * K_BLOCK_BYTES[t.dtype],
        n / QK_K,
        out,
        at,
        f16ValueTable(),
      );
      return out;
  }
}

/** The whole tensor as f32 (a fresh array; an f32 tensor is copied too). */
export function decodeWeight(t: WeightTensor): Float32Array {
  const n = elementsOf(t.shape);
  return decodeRange(t, 0, n, new Float32Array(n));
}

/** Values in the tensor (the product of its shape). */
export function weightElements(t: WeightTensor): number {
  return elementsOf(t.shape);
}

// -----------------------------------------------------------------------------------------------
// matrices: an f32 matrix may stay a plain Float32Array (a view into the file, no copy)

/** A weight matrix: a Float32Array is f32; anything else is a `WeightTensor`. */
export type Matrix = Float32Array | WeightTensor;

export function matrixDType(m: Matrix): WeightDType {
  return m instanceof Float32Array ? "f32" : m.dtype;
}

/** The matrix's bytes in its stored format. */
export function matrixBytes(m: Matrix): Uint8Array {
  return m instanceof Float32Array ? new Uint8Array(m.buffer, m.byteOffset, m.byteLength) : m.bytes;
}

/** Number of values in the matrix. */
export function matrixElements(m: Matrix): number {
  return m instanceof Float32Array ? m.length : elementsOf(m.shape);
}

/** Values [start, start + n) of the matrix (flat) as f32 into out[at..at + n); see `decodeRange`. */
export function decodeMatrixRange(
  m: Matrix,
  start: number,
  n: number,
  out: Float32Array,
  at = 0,
): Float32Array {
  if (m instanceof Float32Array) {
    for (let i = 0; i < n; i++) out[at + i] = m[start + i] as number;
    return out;
  }
  return decodeRange(m, start, n, out, at);
}

/** The matrix as f32: a Float32Array is returned as is, a tensor decoded into a fresh array. */
export function decodeMatrix(m: Matrix): Float32Array {
  return m instanceof Float32Array ? m : decodeWeight(m);
}

/** The matrix in `dtype` (f32 becomes a Float32Array); a matrix already in `dtype` is returned as is. */
export function convertMatrix(m: Matrix, shape: readonly number[], dtype: WeightDType): Matrix {
  if (matrixDType(m) === dtype) return m;
  const values = decodeMatrix(m);
  return dtype === "f32" ? values : encodeWeight(values, shape, dtype);
}
