/**
 * llama.cpp's Q5_0 and Q5_1 tensors, widened exactly at load into formats the kernels run. A
 * Q4_K_M or Q5_K_M file holds them where a matrix's rows are not whole 256-weight k-quant blocks
 * (llama.cpp's `llama_tensor_get_type` falls back from Q4_K to Q5_0 and from Q5_K to Q5_1): every
 * matrix read by SmolLM2's hidden size of 576 or Qwen2.5-0.5B's 896, so those files need them.
 *
 * Both hold 32-weight blocks (ggml's `block_q5_0` / `block_q5_1`): an f16 scale d (Q5_1: then an f16
 * minimum m), 4 bytes of the weights' fifth bits, 16 bytes of their low nibbles (weight j in the
 * low nibble of byte j, weight j + 16 in its high nibble; its fifth bit is bit j, resp. j + 16, of
 * the 32-bit word). Q5_0's weight is d·(q − 16), Q5_1's d·q + m, for q in 0…31.
 *
 * - Q5_0 → Q8_0, exactly: the same f16 scale and the 5-bit values q − 16 (−16…15) as int8 — 34
 *   bytes a block for 22 (the Q8_0 kernels run it; 1.55× the bytes).
 * - Q5_1 → f32, exactly: d·q is exact in f32 (11 × 5 significant bits) and the sum with m rounds
 *   once, as ggml's own `dequantize_row_q5_1` computes it (4 bytes a weight for 0.75).
 */
import { f16BitsToF32 } from "../kernels/weight-format.js";

/** Bytes of one 32-weight block. */
export const Q5_BLOCK_BYTES = { Q5_0: 22, Q5_1: 24 } as const;

const QK = 32;
const Q8_0_BLOCK_BYTES = 34;

/** The 32 5-bit values of the block at `at` (its nibbles after `nibbles` bytes of header, its high bits at `high`). */
function unpack(src: Uint8Array, high: number, nibbles: number, out: Uint8Array): void {
  const qh = (src[high]! | (src[high + 1]! << 8) | (src[high + 2]! << 16) | (src[high + 3]! << 24)) >>> 0;
  for (let j = 0; j < 16; j++) {
    const byte = src[nibbles + j]!;
    out[j] = (byte & 0x0f) | (((qh >>> j) & 1) << 4);
    out[j + 16] = (byte >> 4) | (((qh >>> (j + 16)) & 1) << 4);
  }
}

/** Q5_0 blocks as Q8_0 blocks (the same weights, exactly), in a fresh buffer (shared when `shared`). */
export function q5_0ToQ8_0(src: Uint8Array, elements: number, shared: boolean): Uint8Array {
  const blocks = elements / QK;
  const size = blocks * Q8_0_BLOCK_BYTES;
  const out = new Uint8Array(shared ? new SharedArrayBuffer(size) : new ArrayBuffer(size));
  const q = new Uint8Array(QK);
  for (let b = 0; b < blocks; b++) {
    const s = b * Q5_BLOCK_BYTES.Q5_0;
    const o = b * Q8_0_BLOCK_BYTES;
    out[o] = src[s]!;
    out[o + 1] = src[s + 1]!;
    unpack(src, s + 2, s + 6, q);
    for (let j = 0; j < QK; j++) out[o + 2 + j] = (q[j]! - 16) & 0xff;
  }
  return out;
}

/** Q5_1 blocks as f32 weights (exactly as ggml dequantises them), in a fresh buffer (shared when `shared`). */
export function q5_1ToF32(src: Uint8Array, elements: number, shared: boolean): Float32Array {
  const out = new Float32Array(shared ? new SharedArrayBuffer(4 * elements) : new ArrayBuffer(4 * elements));
  const q = new Uint8Array(QK);
  const one = new Float32Array(1);
  for (let b = 0; b < elements / QK; b++) {
    const s = b * Q5_BLOCK_BYTES.Q5_1;
    const d = f16BitsToF32(src[s]! | (src[s + 1]! << 8));
    const m = f16BitsToF32(src[s + 2]! | (src[s + 3]! << 8));
    unpack(src, s + 4, s + 8, q);
    for (let j = 0; j < QK; j++) {
      // ggml: y = x·d + m in f32 (x·d exact); the one rounding is the sum's.
      one[0] = q[j]! * d;
      out[b * QK + j] = one[0]! + m;
    }
  }
  return out;
}
