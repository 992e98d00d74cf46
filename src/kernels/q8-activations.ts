/**
 * For tests of the int8 kernels: activation rows quantised to Q8_0-like blocks as the WebAssembly
 * kernels' `quantizeRowsQ8` documents (per 32 values d = amax/127 in f32, q = x·(1/d) rounded to
 * nearest, ties to even), written independently of the kernels, so an emulation of the int8
 * algorithm can be built on it (wasm-weights.test.ts, wasm-kquants.test.ts).
 */

/** Round to nearest, ties to even (f32x4.nearest). */
export function nearestEven(v: number): number {
  const r = Math.round(v);
  return Math.abs(v - Math.trunc(v)) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/** x [rows][inDim] (inDim a multiple of 32) as int8 quants and one f32 scale per 32-value block. */
export function q8Activations(
  x: Float32Array,
  rows: number,
  inDim: number,
): { q: Int8Array; d: Float64Array } {
  const fr = Math.fround;
  const nb = inDim / 32;
  const q = new Int8Array(rows * inDim);
  const d = new Float64Array(rows * nb);
  for (let b = 0; b < rows * nb; b++) {
    let amax = 0;
    for (let j = 0; j < 32; j++) amax = Math.max(amax, Math.abs(x[b * 32 + j] as number));
    const db = fr(amax / 127);
    const id = db !== 0 ? fr(1 / db) : 0;
    d[b] = db;
    for (let j = 0; j < 32; j++) q[b * 32 + j] = nearestEven(fr((x[b * 32 + j] as number) * id));
  }
  return { q, d };
}

/**
 * x [rows][inDim] (inDim a multiple of 256) as ggml's `block_q8_K` quantises it for the k-quant dot
 * products (quantize_row_q8_K_ref; the native kernels, native/src/kquants.c): per 256 values
 * max = the value of largest |x| (the first of equals), iscale = −127/max in f32,
 * q = min(127, round-to-nearest-even(iscale·x)), d = 1/iscale; an all-zero block has d = 0.
 */
export function q8KActivations(
  x: Float32Array,
  rows: number,
  inDim: number,
): { q: Int8Array; d: Float64Array } {
  const fr = Math.fround;
  const nb = inDim / 256;
  const q = new Int8Array(rows * inDim);
  const d = new Float64Array(rows * nb);
  for (let b = 0; b < rows * nb; b++) {
    let amax = 0;
    let max = 0;
    for (let j = 0; j < 256; j++) {
      const v = x[b * 256 + j] as number;
      if (Math.abs(v) > amax) {
        amax = Math.abs(v);
        max = v;
      }
    }
    if (amax === 0) continue;
    const iscale = fr(-127 / max);
    for (let j = 0; j < 256; j++)
      q[b * 256 + j] = Math.min(127, nearestEven(fr(iscale * (x[b * 256 + j] as number))));
    d[b] = fr(1 / iscale);
  }
  return { q, d };
}
