/**
 * llama.cpp's k-quant weight formats Q4_K, Q5_K and Q6_K, as the GGUF files people download hold
 * them (Q4_K_M and Q5_K_M files mix them with F32 norms), and their exact dequantisation to f32.
 * kvfence reads these formats and never writes them (docs/weights.md).
 *
 * A block covers 256 consecutive weights of a row (QK_K; a row's length must be a multiple of 256).
 * The layouts are ggml's `block_q4_K`, `block_q5_K` and `block_q6_K` (ggml-common.h), and the
 * arithmetic that of ggml's `dequantize_row_q4_K` / `_q5_K` / `_q6_K` (ggml-quants.c), each product
 * and difference rounded to f32 in the same order, so the values are ggml's bit for bit (checked
 * against ggml's own output in k-quants.test.ts):
 *
 * - `q4_K`, 144 bytes: d (f16), dmin (f16), 12 bytes of eight 6-bit scales and eight 6-bit mins,
 *   then 128 bytes of nibbles. Sub-block s (32 weights) has scale sc_s and min m_s (below); the
 *   weights 64g … 64g+31 are the low nibbles of bytes 32g … 32g+31 (sub-block 2g), 64g+32 … 64g+63
 *   their high nibbles (sub-block 2g+1). weight = (d·sc_s)·q − (dmin·m_s).
 * - `q5_K`, 176 bytes: d, dmin, the same 12 scale bytes, qh[32], then qs[128] as q4_K's nibbles;
 *   weight l of sub-block s takes bit s of qh[l] as its fifth bit (q + 16). Same formula.
 * - `q6_K`, 210 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), 16 int8 scales, then d (f16).
 *   Per 128-weight half n (ql from 64n, qh from 32n, scales from 8n), for l < 32: weights l, l+32,
 *   l+64, l+96 are ql[l] low, ql[l+32] low, ql[l] high, ql[l+32] high nibble, each with the next two
 *   bits of qh[l] (bits 0–1, 2–3, 4–5, 6–7) on top, minus 32; their scales are sc[l/16 + 0, 2, 4, 6]
 *   (16-weight sub-blocks). weight = (d·sc)·q.
 *
 * The 6-bit scales and mins of q4_K/q5_K (ggml's `get_scale_min_k4`): for s < 4, sc = b[s] & 63 and
 * m = b[s+4] & 63; for s ≥ 4, sc = (b[s+4] & 15) | (b[s−4] >> 6) << 4 and
 * m = (b[s+4] >> 4) | (b[s] >> 6) << 4.
 */

export type KQuantDType = "q4_K" | "q5_K" | "q6_K";

/** Weights per k-quant block (QK_K). */
export const QK_K = 256;

/** Bytes of one block of each k-quant format. */
export const K_BLOCK_BYTES: Readonly<Record<KQuantDType, number>> = { q4_K: 144, q5_K: 176, q6_K: 210 };

export function isKQuant(dtype: string): dtype is KQuantDType {
  return dtype === "q4_K" || dtype === "q5_K" || dtype === "q6_K";
}

/** Sub-block s's 6-bit scale (`min` false) or min (`min` true) of the 12 scale bytes at b[o]. */
function scaleMin(b: Uint8Array, o: number, s: number, min: boolean): number {
  if (s < 4) return (b[o + s + (min ? 4 : 0)] as number) & 63;
  const hi = (b[o + s - (min ? 0 : 4)] as number) >> 6;
  const lo = b[o + s + 4] as number;
  return ((min ? lo >> 4 : lo & 15) | (hi << 4)) >>> 0;
}

/**
 * Dequantises `blocks` blocks of `dtype` from bytes[at…] into out[to…] (256 values each), exactly
 * as ggml; `half` is the table of every f16's value (weight-format.ts `f16ValueTable`).
 */
export function decodeKQuantBlocks(
  dtype: KQuantDType,
  bytes: Uint8Array,
  at: number,
  blocks: number,
  out: Float32Array,
  to: number,
  half: Float32Array,
): void {
  const size = K_BLOCK_BYTES[dtype];
  for (let i = 0; i < blocks; i++) {
    const o = at + i * size;
    const y = to + i * QK_K;
    if (dtype === "q6_K") decodeQ6K(bytes, o, out, y, half);
    else decodeQ45K(bytes, o, out, y, half, dtype === "q5_K");
  }
}

const fr = Math.fround;

function decodeQ45K(
  b: Uint8Array,
  o: number,
  out: Float32Array,
  y: number,
  half: Float32Array,
  five: boolean,
): void {
  const d = half[(b[o] as number) | ((b[o + 1] as number) << 8)] as number;
  const dmin = half[(b[o + 2] as number) | ((b[o + 3] as number) << 8)] as number;
  const sc = o + 4;
  const qh = o + 16;
  const qs = o + (five ? 48 : 16);
  for (let g = 0; g < 4; g++) {
    const d1 = fr(d * scaleMin(b, sc, 2 * g, false));
    const m1 = fr(dmin * scaleMin(b, sc, 2 * g, true));
    const d2 = fr(d * scaleMin(b, sc, 2 * g + 1, false));
    const m2 = fr(dmin * scaleMin(b, sc, 2 * g + 1, true));
    const q = qs + 32 * g;
    const y1 = y + 64 * g;
    for (let l = 0; l < 32; l++) {
      const v = b[q + l] as number;
      const h = five ? (b[qh + l] as number) >> (2 * g) : 0;
      out[y1 + l] = fr(fr(d1 * ((v & 15) + ((h & 1) << 4))) - m1);
      out[y1 + 32 + l] = fr(fr(d2 * ((v >> 4) + ((h & 2) << 3))) - m2);
    }
  }
}

function decodeQ6K(b: Uint8Array, o: number, out: Float32Array, y: number, half: Float32Array): void {
  const d = half[(b[o + 208] as number) | ((b[o + 209] as number) << 8)] as number;
  for (let n = 0; n < 2; n++) {
    const ql = o + 64 * n;
    const qh = o + 128 + 32 * n;
    const sc = o + 192 + 8 * n;
    const yn = y + 128 * n;
    for (let l = 0; l < 32; l++) {
      const s = sc + (l >> 4);
      const lo = b[ql + l] as number;
      const hi = b[ql + l + 32] as number;
      const h = b[qh + l] as number;
      const d0 = fr(d * (((b[s] as number) << 24) >> 24));
      const d2 = fr(d * (((b[s + 2] as number) << 24) >> 24));
      const d4 = fr(d * (((b[s + 4] as number) << 24) >> 24));
      const d6 = fr(d * (((b[s + 6] as number) << 24) >> 24));
      out[yn + l] = fr(d0 * (((lo & 15) | ((h & 3) << 4)) - 32));
      out[yn + l + 32] = fr(d2 * (((hi & 15) | (((h >> 2) & 3) << 4)) - 32));
      out[yn + l + 64] = fr(d4 * (((lo >> 4) | (((h >> 4) & 3) << 4)) - 32));
      out[yn + l + 96] = fr(d6 * (((hi >> 4) | (((h >> 6) & 3) << 4)) - 32));
    }
  }
}
