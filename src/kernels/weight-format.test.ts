/**
 * The weight formats against bytes worked out by hand from ggml's published reference algorithms
 * (quantize_row_q8_0_ref, quantize_row_q4_0_ref) and IEEE round-to-nearest-even: each expected block
 * below is written out literally, never produced by the functions under test.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import {
  bf16BitsToF32,
  decodeWeight,
  encodeWeight,
  f16BitsToF32,
  f32ToBf16Bits,
  f32ToF16Bits,
  quantizeQ4_0,
  quantizeQ8_0,
  weightBytes,
} from "./weight-format.js";

/** A 32-value block, zero but for the given positions. */
function block(values: Record<number, number>): Float32Array {
  const x = new Float32Array(32);
  for (const [i, v] of Object.entries(values)) x[Number(i)] = v;
  return x;
}

const hex = (b: Uint8Array): string => Buffer.from(b).toString("hex");

test("f32 → f16 rounds to nearest, ties to even, with subnormals, overflow, signed zero and NaN", () => {
  const cases: [number, number][] = [
    [1, 0x3c00],
    [1 + 2 ** -11, 0x3c00], // halfway between 0x3c00 (even) and 0x3c01
    [1 + 3 * 2 ** -11, 0x3c02], // halfway between 0x3c01 (odd) and 0x3c02
    [1 + 2 ** -11 + 2 ** -20, 0x3c01], // just above halfway
    [65504, 0x7bff],
    [65519, 0x7bff],
    [65520, 0x7c00], // halfway to 2^16: rounds to even, which is infinity
    [2 ** -14, 0x0400],
    [2 ** -24, 0x0001],
    [2 ** -25, 0x0000], // halfway between 0 and the smallest subnormal: even is 0
    [3 * 2 ** -25, 0x0002], // halfway between 1 and 2 units
    [2 ** -14 - 2 ** -25, 0x0400], // the largest subnormal plus half a unit: rounds up to the normal
    [-0, 0x8000],
    [-2, 0xc000],
    [Number.POSITIVE_INFINITY, 0x7c00],
    [1e-30, 0x0000],
  ];
  for (const [x, bits] of cases) assert.equal(f32ToF16Bits(x), bits, `f16(${x})`);
  assert.equal(f32ToF16Bits(Number.NaN) & 0x7e00, 0x7e00, "NaN stays a NaN");
  assert.equal(f16BitsToF32(0x3c01), 1 + 2 ** -10);
  assert.equal(f16BitsToF32(0x0001), 2 ** -24);
  assert.equal(f16BitsToF32(0xfbff), -65504);
});

test("f32 → bf16 rounds to nearest, ties to even; NaN stays NaN", () => {
  const cases: [number, number][] = [
    [1, 0x3f80],
    [1 + 2 ** -8, 0x3f80], // tie, even down
    [1 + 3 * 2 ** -8, 0x3f82], // tie, odd up
    [1 + 2 ** -8 + 2 ** -20, 0x3f81],
    [-0, 0x8000],
    [3.4e38, 0x7f80], // rounds past the largest bf16 to infinity
  ];
  for (const [x, bits] of cases) assert.equal(f32ToBf16Bits(x), bits, `bf16(${x})`);
  assert.ok(Number.isNaN(bf16BitsToF32(f32ToBf16Bits(Number.NaN))));
  assert.equal(bf16BitsToF32(0x3f81), 1 + 2 ** -7);
});

test("Q8_0: d = amax/127 as f16, q = roundf(x·(1/d)) with ties away from zero", () => {
  // amax 127 → d = 1 (f16 0x3c00, stored little-endian 00 3c); ±0.5 → ±1, 1.5 → 2, -2.5 → -3.
  const a = block({ 0: 127, 1: 0.5, 2: -0.5, 3: 1.5, 4: -2.5, 5: -127, 31: 64 });
  assert.equal(hex(quantizeQ8_0(a)), `003c7f01ff02fd81${"00".repeat(25)}40`);
  // Negative max: amax 254 → d = 2 (0x4000), id = 0.5: -254 → -127, 3 → 1.5 → 2, -1 → -0.5 → -1.
  const b = block({ 0: -254, 1: 3, 2: -1 });
  assert.equal(hex(quantizeQ8_0(b)), `0040 81 02 ff${"00".repeat(29)}`.replaceAll(" ", ""));
  // All zeros (and a negative zero): d = 0, id = 0, every q is 0.
  assert.equal(hex(quantizeQ8_0(block({ 7: -0 }))), "00".repeat(34));
  // amax 1: d = 1/127 → f16 0x2008 (1.0078125 · 2^-7); the quants use the f32 d: 1 → 127, -0.25 → -31.75 → -32.
  assert.equal(
    hex(quantizeQ8_0(block({ 0: 1, 1: -0.25 }))),
    `0820 7f e0${"00".repeat(30)}`.replaceAll(" ", ""),
  );
  // Two blocks are two independent 34-byte records.
  const two = new Float32Array(64);
  two.set(a, 0);
  two.set(b, 32);
  assert.equal(hex(quantizeQ8_0(two)), hex(quantizeQ8_0(a)) + hex(quantizeQ8_0(b)));
});

test("Q4_0: d = max/-8 (max by |x|, first on a tie), q = min(15, trunc(x/d + 8.5)), low nibbles first", () => {
  // max -8 → d = 1 (0x3c00): -8 → 0; 7.6 → 16.1 → clamped to 15; 0.5 → 9; -0.5 → 8; -1.5 → 7;
  // 0 → 8; element 16 = 3 → 11 and 17 = 7.6 → 15 are the high nibbles of bytes 0 and 1.
  const a = block({ 0: -8, 1: 7.6, 2: 0.5, 3: -0.5, 4: -1.5, 16: 3, 17: 7.6 });
  assert.equal(hex(quantizeQ4_0(a)), `003c b0 ff 89 88 87${"88".repeat(11)}`.replaceAll(" ", ""));
  // Positive max 8 → d = -1 (0xbc00), id = -1: 8 → 0.5 → 0; -7 → 15.5 → 15; 4 → 4.5 → 4.
  const b = block({ 0: 8, 1: -7, 2: 4 });
  assert.equal(hex(quantizeQ4_0(b)), `00bc 80 8f 84${"88".repeat(13)}`.replaceAll(" ", ""));
  // |4| = |-4|: the first wins, max = 4, d = -0.5 (0xb800), id = -2: 4 → 0; -4 → 16.5 → 15.
  const c = block({ 0: 4, 1: -4 });
  assert.equal(hex(quantizeQ4_0(c)), `00b8 80 8f${"88".repeat(14)}`.replaceAll(" ", ""));
  // All zeros: max stays 0.0f, so d = 0/-8 is -0 (f16 0x8000, stored 00 80), id = 0, and every
  // q = trunc(8.5) = 8: every byte is 0x88.
  assert.equal(hex(quantizeQ4_0(new Float32Array(32))), `0080${"88".repeat(16)}`);
});

test("dequantised blocks are q·d and (q-8)·d from hand-written bytes", () => {
  // Q8_0: d = 0.5 (0x3800), q = [2, -3, 127, -128, 0, ...].
  const q8 = new Uint8Array(34);
  q8.set([0x00, 0x38, 2, 0xfd, 0x7f, 0x80]);
  const a = decodeWeight({ dtype: "q8_0", shape: [32], bytes: q8 });
  assert.deepEqual(Array.from(a.subarray(0, 5)), [1, -1.5, 63.5, -64, 0]);
  // Q4_0: d = -2 (0xc000); byte 0 = 0x3f → element 0 q 15 → -14, element 16 q 3 → 10.
  const q4 = new Uint8Array(18).fill(0x88);
  q4.set([0x00, 0xc0, 0x3f]);
  const b = decodeWeight({ dtype: "q4_0", shape: [32], bytes: q4 });
  assert.equal(b[0], -14);
  assert.equal(b[16], 10);
  assert.equal(b[1], -0, "(8 - 8)·(-2) is -0 in f32, as in C");
});

test("encodeWeight keeps each format's size and decodes back within its rounding", () => {
  const n = 64;
  const x = Float32Array.from({ length: n }, (_, i) => Math.sin(i * 0.7) * 0.05);
  for (const dtype of ["f32", "f16", "bf16", "q8_0", "q4_0"] as const) {
    const t = encodeWeight(x, [2, 32], dtype);
    assert.equal(t.bytes.byteLength, weightBytes(dtype, n), dtype);
    const back = decodeWeight(t);
    const tol = { f32: 0, f16: 1e-4, bf16: 4e-4, q8_0: 0.05 / 127, q4_0: 0.05 / 8 }[dtype];
    for (let i = 0; i < n; i++)
      assert.ok(Math.abs((back[i] as number) - (x[i] as number)) <= tol, `${dtype}[${i}]`);
  }
  assert.throws(() => encodeWeight(new Float32Array(48), [3, 16], "q8_0"), /multiple of 32/);
});
