/**
 * The k-quant dequantisation (k-quants.ts) against ggml's own: testing/fixtures/kquant-blocks.json
 * holds blocks made by ggml's quantiser (ggml_quantize_chunk, as llama-quantize) and the f32 values
 * ggml's to_float gives for them (scripts/kquant-fixtures.mjs, from ggml's source); the TypeScript
 * values must be the same bits. A hand-worked block of each format pins the layout independently.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { K_BLOCK_BYTES, type KQuantDType } from "./k-quants.js";
import {
  decodeRange,
  decodeWeight,
  encodeWeight,
  f32ToF16Bits,
  type WeightTensor,
  weightBytes,
} from "./weight-format.js";

interface Case {
  dtype: KQuantDType;
  rows: number;
  cols: number;
  blocks: string;
  dequantized: string;
}

// dist/src/kernels/ → the repository's testing/fixtures/ (this project cannot import src/lib).
const fixture = JSON.parse(
  readFileSync(new URL("../../../testing/fixtures/kquant-blocks.json", import.meta.url), "utf8"),
) as { ggmlCommit: string; cases: Case[] };

const bits = (a: Float32Array): Uint32Array => new Uint32Array(a.buffer, a.byteOffset, a.length);

// The fixture's Q5_0 / Q5_1 cases are the GGUF loader's (src/model/gguf-q5.test.ts).
for (const c of fixture.cases.filter((f) => f.dtype in K_BLOCK_BYTES)) {
  test(`decodeWeight() of ggml's ${c.dtype} blocks gives ggml's dequantised values bit for bit`, () => {
    const bytes = new Uint8Array(Buffer.from(c.blocks, "base64"));
    const raw = Buffer.from(c.dequantized, "base64");
    const expected = new Float32Array(new Uint8Array(raw).buffer);
    assert.equal(bytes.length, weightBytes(c.dtype, c.rows * c.cols));
    assert.equal(expected.length, c.rows * c.cols);
    const t: WeightTensor = { dtype: c.dtype, shape: [c.rows, c.cols], bytes };
    const got = decodeWeight(t);
    let differ = 0;
    for (let i = 0; i < got.length; i++) if (bits(got)[i] !== bits(expected)[i]) differ++;
    assert.equal(differ, 0, `${differ} of ${got.length} values differ from ggml ${fixture.ggmlCommit}`);
    // A range (one row from the middle, at an offset in out) decodes alone to the same values.
    const out = new Float32Array(c.cols + 7);
    decodeRange(t, 3 * c.cols, c.cols, out, 7);
    assert.deepEqual(bits(out.subarray(7)), bits(expected.subarray(3 * c.cols, 4 * c.cols)));
  });
}

const f16 = (x: number): [number, number] => {
  const h = f32ToF16Bits(x);
  return [h & 0xff, h >> 8];
};

test("decodeWeight() of a hand-made q4_K and q5_K block: 6-bit scales and mins, nibbles, fifth bits", () => {
  const b = new Uint8Array(K_BLOCK_BYTES.q4_K);
  b.set([...f16(0.5), ...f16(0.25)]); // d, dmin
  // Sub-block 1: scale 3, min 5 (bytes 1 and 5, low 6 bits). Sub-block 6: scale 0b10_0111 = 39
  // (low 4 bits in byte 10, top 2 in byte 2's top bits), min 0b11_0001 = 49 (byte 10's high
  // nibble, byte 6's top bits).
  b[4 + 1] = 3;
  b[4 + 5] = 5;
  b[4 + 10] = 0x17;
  b[4 + 2] = 0b10 << 6;
  b[4 + 6] = 0b11 << 6;
  b[16 + 0] = 0x9f; // weight 0 (sub-block 0, scale 0, min 0): 15·0 − 0; weight 32 (sub-block 1): 9
  b[16 + 64 + 2] = 0x0c; // weight 128 + 2 (sub-block 4: scale (b[12] & 15) | (b[0] >> 6) << 4 = 0)
  b[16 + 96 + 4] = 0x60; // weight 192 + 32 + 4 (sub-block 7): 6
  b[16 + 96 + 5] = 0x08; // weight 192 + 5 (sub-block 6): 8
  const q4 = decodeWeight({ dtype: "q4_K", shape: [256], bytes: b });
  assert.equal(q4[0], 0);
  assert.equal(q4[32], 0.5 * 3 * 9 - 0.25 * 5);
  assert.equal(q4[192 + 5], 0.5 * 39 * 8 - 0.25 * 49);
  assert.equal(q4[192 + 32 + 4], 0); // sub-block 7: scale and min 0
  assert.equal(q4[100], 0); // sub-block 3: nothing set
  // q5_K: the same scales, qh between them and the nibbles; weight l of sub-block s gains
  // 16 from bit s of qh[l].
  const b5 = new Uint8Array(K_BLOCK_BYTES.q5_K);
  b5.set(b.subarray(0, 16));
  b5.set(b.subarray(16), 48);
  b5[16 + 5] = 1 << 6; // qh[5] bit 6: weight 192 + 5 gains 16
  b5[16 + 0] = 1 << 1; // qh[0] bit 1: weight 32 gains 16
  const q5 = decodeWeight({ dtype: "q5_K", shape: [256], bytes: b5 });
  assert.equal(q5[32], 0.5 * 3 * (9 + 16) - 0.25 * 5);
  assert.equal(q5[192 + 5], 0.5 * 39 * (8 + 16) - 0.25 * 49);
  assert.equal(q5[0], 0);
});

test("decodeWeight() of a hand-made q6_K block: low nibbles, two high bits, −32, int8 scales", () => {
  const b = new Uint8Array(K_BLOCK_BYTES.q6_K);
  b.set(f16(0.125), 208); // d
  b[192 + 0] = 2; // scale of weights 0–15
  b[192 + 7] = 0xfd; // −3: weights 112–127 (l = 16–31 of the fourth quarter of the first half)
  b[192 + 9] = 4; // second half, weights 144–159 (l = 16–31 of its first quarter)
  b[0] = 0x05; // ql[0] low: weight 0 = 5 | (qh[0] & 3) << 4
  b[128] = 0b10; // qh[0] bits 0–1 = 2: weight 0 = 5 + 32 − 32 = 5
  b[32 + 20] = 0xa0; // ql[52] high nibble: weight 96 + 20 = 10 | (qh[20] >> 6) << 4
  b[128 + 20] = 0b01 << 6; // → 10 + 16 − 32 = −6
  b[64 + 17] = 0x01; // second half, ql[64 + 17] low: weight 128 + 17 = 1 | (qh[32 + 17] & 3) << 4
  const q6 = decodeWeight({ dtype: "q6_K", shape: [256], bytes: b });
  assert.equal(q6[0], 0.125 * 2 * 5);
  assert.equal(q6[96 + 20], 0.125 * -3 * -6);
  assert.equal(q6[128 + 17], 0.125 * 4 * (1 - 32));
  assert.equal(q6[1], 0.125 * 2 * -32);
});

test("k-quants: byte sizes, ranges that are not whole 256-blocks refused, encodeWeight() refuses them", () => {
  assert.equal(weightBytes("q4_K", 512), 288);
  assert.equal(weightBytes("q5_K", 512), 352);
  assert.equal(weightBytes("q6_K", 512), 420);
  const t: WeightTensor = { dtype: "q4_K", shape: [2, 256], bytes: new Uint8Array(288) };
  assert.throws(
    () => decodeRange(t, 32, 256, new Float32Array(256)),
    /32 values is not a whole number of 256-value blocks/,
  );
  assert.throws(
    () => encodeWeight(new Float32Array(256), [256], "q6_K"),
    /encodeWeight: kvfence reads q6_K from GGUF files but does not quantise to it; choose one of f32, f16, bf16, q8_0, q4_0/,
  );
});
