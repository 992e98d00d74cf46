/**
 * llama.cpp's Q5_0 / Q5_1 tensors widened at load (gguf-q5.ts) against ggml's own dequantisation:
 * testing/fixtures/kquant-blocks.json holds blocks made by ggml's quantiser and the f32 values
 * ggml's to_float gives for them (scripts/kquant-fixtures.mjs); the widened weights must decode to
 * the same bits. A hand-made block of each pins the layout (the fifth bits) independently, and the
 * committed Q4_K_M / Q5_K_M fixtures load their Q5_0 / Q5_1 matrices as Q8_0 / f32.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { decodeWeight, f32ToF16Bits, matrixDType } from "../kernels/weight-format.js";
import { packageRoot } from "../lib/package-root.js";
import { Q5_BLOCK_BYTES, q5_0ToQ8_0, q5_1ToF32 } from "./gguf-q5.js";
import { openModel } from "./load-model.js";

interface Case {
  dtype: string;
  rows: number;
  cols: number;
  blocks: string;
  dequantized: string;
}

const root = packageRoot();
const fixture = JSON.parse(readFileSync(join(root, "testing/fixtures/kquant-blocks.json"), "utf8")) as {
  ggmlCommit: string;
  cases: Case[];
};

const bits = (a: Float32Array): Uint32Array => new Uint32Array(a.buffer, a.byteOffset, a.length);

/** The widened weights of `bytes` (Q5_0 or Q5_1) as f32. */
function widened(dtype: "q5_0" | "q5_1", bytes: Uint8Array, elements: number, shared = false): Float32Array {
  if (dtype === "q5_1") return q5_1ToF32(bytes, elements, shared);
  return decodeWeight({ dtype: "q8_0", shape: [elements], bytes: q5_0ToQ8_0(bytes, elements, shared) });
}

for (const dtype of ["q5_0", "q5_1"] as const) {
  test(`${dtype === "q5_0" ? "q5_0ToQ8_0" : "q5_1ToF32"}() of ggml's ${dtype} blocks gives ggml's dequantised values bit for bit`, () => {
    const c = fixture.cases.find((f) => f.dtype === dtype) ?? assert.fail(`no ${dtype} case in the fixture`);
    const bytes = new Uint8Array(Buffer.from(c.blocks, "base64"));
    const expected = new Float32Array(new Uint8Array(Buffer.from(c.dequantized, "base64")).buffer);
    const n = c.rows * c.cols;
    assert.equal(bytes.length, (n / 32) * Q5_BLOCK_BYTES[dtype === "q5_0" ? "Q5_0" : "Q5_1"]);
    for (const shared of [false, true]) {
      const got = widened(dtype, bytes, n, shared);
      let differ = 0;
      for (let i = 0; i < n; i++) if (bits(got)[i] !== bits(expected)[i]) differ++;
      assert.equal(differ, 0, `${differ} of ${n} values differ from ggml ${fixture.ggmlCommit}`);
    }
  });
}

test("q5_0ToQ8_0() and q5_1ToF32() of a hand-made block: low nibbles first, fifth bits from the 32-bit word", () => {
  const [d0, d1] = [f32ToF16Bits(0.5) & 0xff, f32ToF16Bits(0.5) >> 8];
  const [m0, m1] = [f32ToF16Bits(-2) & 0xff, f32ToF16Bits(-2) >> 8];
  // q_j = j for j < 32: low nibbles j & 15 (weight j in byte j's low nibble, j + 16 in its high), fifth bits 16…31 set.
  const qh = [0x00, 0x00, 0xff, 0xff];
  const qs = Array.from({ length: 16 }, (_, j) => j | (j << 4));
  const q5_0 = Uint8Array.from([d0, d1, ...qh, ...qs]);
  const q5_1 = Uint8Array.from([d0, d1, m0, m1, ...qh, ...qs]);
  assert.deepEqual(
    [...widened("q5_0", q5_0, 32)],
    Array.from({ length: 32 }, (_, j) => 0.5 * (j - 16)),
  );
  assert.deepEqual(
    [...widened("q5_1", q5_1, 32)],
    Array.from({ length: 32 }, (_, j) => 0.5 * j - 2),
  );
});

test("openModel() loads a Q4_K_M file's Q5_0 matrices as Q8_0 and a Q5_K_M file's Q5_1 ones as f32", async () => {
  for (const [file, format] of [
    ["kvfence-tiny-q4_k_m.gguf", "q8_0"],
    ["kvfence-tiny-q5_k_m.gguf", "f32"],
  ] as const) {
    const model = await openModel(join(root, "testing/fixtures", file));
    for (const layer of model.weights.layers) assert.equal(matrixDType(layer.gate), format, file);
  }
});
