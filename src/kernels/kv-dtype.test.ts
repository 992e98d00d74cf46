/**
 * The half-precision KV cache's numerics (src/kvcache/kv-layout.ts, `--kv-cache-dtype`): the
 * reference rounding `roundKv` against the IEEE definition (nearest, ties to even, f16 saturating),
 * the exact widening tables, and the WebAssembly KV write (`kvStore`) and widening attention reads
 * against them — bit for bit where the result is exact, within the f32 attention tolerance where
 * it sums.
 */
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { assertAllClose } from "./assert-all-close.js";
import * as ref from "./reference.js";
import { kvWidening, roundKv } from "./reference.js";
import { WasmKernels } from "./wasm-kernels.js";

const F16 = 1;
const BF16 = 2;

/** Deterministic f32 values spread over many binades (2^-30 … 2^20), both signs. */
function spread(n: number, seed: number): Float32Array {
  const a = new Float32Array(n);
  let s = seed >>> 0 || 1;
  const next = (): number => {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    return (s >>> 0) / 4294967296;
  };
  for (let i = 0; i < n; i++) a[i] = (next() < 0.5 ? -1 : 1) * 2 ** (next() * 50 - 30) * (1 + next());
  return a;
}

/** Values whose rounding is decided by a rule: exact ties, the saturation edge, subnormals, specials. */
const EDGES = Float32Array.of(
  0,
  -0,
  1,
  -2,
  1 + 2 ** -11, // f16 tie between 0x3c00 and 0x3c01: to even (0x3c00)
  1 + 3 * 2 ** -11, // tie between 0x3c01 and 0x3c02: to even (0x3c02)
  1 + 2 ** -8, // bf16 tie: to even
  1 + 3 * 2 ** -8, // bf16 tie: to even (up)
  65504,
  65519,
  65520, // IEEE rounds this to infinity; the KV write saturates
  1e9,
  -1e9,
  2 ** -24, // smallest f16 subnormal
  2 ** -25, // exactly half of it: ties to even, 0
  1.5 * 2 ** -25, // past half: the smallest subnormal
  3 * 2 ** -25, // tie between subnormals 1 and 2: to even (2)
  2 ** -14 - 2 ** -24, // largest subnormal
  2 ** -30,
  Number.POSITIVE_INFINITY,
  Number.NEGATIVE_INFINITY,
  Number.NaN,
);

describe("KV dtype rounding (reference)", () => {
  it("roundKv() to f16 rounds to nearest with ties to even, saturates at ±65504, keeps NaN", () => {
    const want = [
      0x0000, 0x8000, 0x3c00, 0xc000, 0x3c00, 0x3c02, 0x3c04, 0x3c0c, 0x7bff, 0x7bff, 0x7bff, 0x7bff, 0xfbff,
      0x0001, 0x0000, 0x0001, 0x0002, 0x03ff, 0x0000, 0x7bff, 0xfbff, 0x7e00,
    ];
    assert.deepEqual(
      Array.from(EDGES, (x) => roundKv(x, F16)),
      want,
    );
  });

  it("roundKv() to bf16 rounds to nearest with ties to even and keeps infinities and NaN", () => {
    const got = Array.from(EDGES, (x) => roundKv(x, BF16));
    assert.equal(got[2], 0x3f80);
    assert.equal(got[6], 0x3f80); // 1 + 2^-8: a tie, down to the even 0x3f80
    assert.equal(got[7], 0x3f82); // 1 + 3·2^-8: a tie, up to the even 0x3f82
    assert.equal(got[19], 0x7f80);
    assert.equal(got[20], 0xff80);
    assert.ok(Number.isNaN(kvWidening(BF16)[got[21] as number] as number));
  });

  it("roundKv() returns the nearest representable value (ties to the even one) for values over 50 binades", () => {
    const values = spread(20_000, 11);
    for (const [code, max] of [
      [F16, 65504],
      [BF16, Number.MAX_VALUE],
    ] as const) {
      const wide = kvWidening(code);
      for (const x of values) {
        if (Math.abs(x) > max) continue;
        const h = roundKv(x, code);
        const err = Math.abs((wide[h] as number) - x);
        // Neighbours of the same sign: neither is closer; at a tie the chosen one is even.
        for (const n of [h - 1, h + 1]) {
          if ((n & 0x7fff) === 0x7fff || (n & 0x8000) !== (h & 0x8000) || n < 0) continue;
          const v = wide[n] as number;
          if (!Number.isFinite(v)) continue;
          const other = Math.abs(v - x);
          assert.ok(err <= other, `x=${x} dtype ${code}: ${h} (err ${err}) but ${n} is closer (${other})`);
          if (err === other) assert.equal(h & 1, 0, `x=${x}: a tie went to the odd ${h}`);
        }
      }
    }
  });

  it("kvWidening() is exact: every finite f16 and every non-NaN bf16 rounds back to its own bits", () => {
    for (const code of [F16, BF16]) {
      const wide = kvWidening(code);
      for (let h = 0; h < 65536; h++) {
        const v = wide[h] as number;
        if (Number.isNaN(v) || (code === F16 && !Number.isFinite(v))) continue;
        assert.equal(roundKv(v, code), h, `dtype ${code} bits ${h.toString(16)} → ${v}`);
      }
    }
    assert.equal(kvWidening(F16)[0x3c00], 1);
    assert.equal(kvWidening(F16)[0x0001], 2 ** -24);
    assert.equal(kvWidening(F16)[0xfbff], -65504);
  });
});

for (const [threads, backend] of [
  [1, "wasm"],
  [2, "wasm"],
  [1, "native"],
  [2, "native"],
] as const) {
  describe(`KV dtype on WasmKernels (${threads} thread${threads === 1 ? "" : "s"}, ${backend})`, () => {
    let k: WasmKernels;
    before(async () => {
      const initialBytes = backend === "native" ? 64 << 20 : 1 << 20;
      k = await WasmKernels.create({ threads, parallelMinWork: 0, initialBytes, backend });
      await k.ready();
      assert.equal(k.name, backend);
    });
    after(async () => {
      await k.close();
    });

    const u16 = (n: number): Uint16Array => {
      const at = k.allocBytes(n * 2);
      return new Uint16Array(k.buffer(), at, n);
    };

    it("WasmKernels.storeKv() writes exactly the reference's bits for f32, f16 and bf16", () => {
      const [numLayers, numKvHeads, headDim, pageSize] = [2, 3, 8, 4];
      const kvDim = numKvHeads * headDim;
      const rows = 10;
      const src = spread(rows * kvDim, 5);
      src.set(EDGES, 3);
      // Again from the starts of rows 2 and 3, so every edge also lands in the first 16 values of a
      // row (the native kernel's vector of 16 on AVX-512; the rest of a row is rounded one by one).
      src.set(EDGES.subarray(0, 16), 2 * kvDim);
      src.set(EDGES.subarray(16), 3 * kvDim);
      const kk = k.placeF32(src);
      const vv = k.placeF32(spread(rows * kvDim, 6));
      const sequences = [
        { blockTable: Int32Array.of(3, 0), rowStart: 0, rows: 6, startPos: 1 },
        { blockTable: Int32Array.of(1, 2), rowStart: 6, rows: 4, startPos: 3 },
      ];
      const numPages = 4;
      const n = numPages * numLayers * 2 * pageSize * kvDim;
      for (const code of [0, F16, BF16]) {
        const got = code === 0 ? k.allocF32(n) : u16(n);
        const want = code === 0 ? new Float32Array(n) : new Uint16Array(n);
        for (let layer = 0; layer < numLayers; layer++) {
          const args = [sequences, 2, layer, numLayers, numKvHeads, headDim, pageSize, code] as const;
          k.storeKv(got, kk, vv, ...args);
          ref.storeKv(want, kk, vv, ...args);
        }
        assert.deepEqual(Array.from(got), Array.from(want), `dtype ${code}`);
        assert.ok(got.some((x) => x !== 0));
      }
      assert.equal(k.fallbackCalls, 0);
    });

    it("WasmKernels.pagedAttentionBatch() widens every finite f16 and every bf16 exactly (one-token attention returns V)", () => {
      // One token of context: softmax weight 1, so the output is V widened to f32, bit for bit.
      const headDim = 2048;
      const seqs = 32; // 32 × 2048 = every 16-bit pattern once
      const pageFloats = 2 * headDim;
      const sequences = Array.from({ length: seqs }, (_, i) => ({
        blockTable: Int32Array.of(i),
        rowStart: i,
        rows: 1,
        startPos: 0,
      }));
      const q = k.placeF32(spread(seqs * headDim, 9));
      for (const code of [F16, BF16]) {
        const pool = u16(seqs * pageFloats);
        for (let p = 0; p < seqs; p++) {
          for (let d = 0; d < headDim; d++) {
            pool[p * pageFloats + d] = 0x3c00; // K: anything finite
            pool[p * pageFloats + headDim + d] = p * headDim + d; // V: every pattern
          }
        }
        const out = k.allocF32(seqs * headDim);
        k.pagedAttentionBatch(
          out,
          q,
          pool,
          sequences,
          seqs,
          new Float64Array(headDim + 1),
          0,
          1,
          1,
          1,
          headDim,
          1,
          code,
        );
        const wide = kvWidening(code);
        for (let bits = 0; bits < 65536; bits++) {
          const want = wide[bits] as number;
          if (Number.isNaN(want) || !Number.isFinite(want)) continue;
          // === (not Object.is): 0 + 1·(−0) is +0.
          assert.ok(
            out[bits] === want,
            `dtype ${code} bits 0x${bits.toString(16)}: ${out[bits]}, want ${want}`,
          );
        }
      }
      assert.equal(k.fallbackCalls, 0);
    });

    it("WasmKernels.pagedAttentionBatch() over f16 and bf16 pools matches the reference for GQA groups 1, 3, 4, split contexts and batches", () => {
      const cases = [
        // numHeads, numKvHeads, headDim, pageSize, rows, startPos
        [3, 3, 8, 4, 1, 0],
        [9, 3, 64, 16, 1, 37],
        [8, 2, 10, 3, 5, 6],
        [4, 1, 6, 5, 7, 0],
        [9, 3, 64, 16, 9, 40],
        [9, 3, 64, 16, 1, 1000],
        [8, 2, 12, 16, 1, 2047],
      ] as const;
      const numLayers = 2;
      for (const code of [F16, BF16]) {
        for (const [numHeads, numKvHeads, headDim, pageSize, rows, startPos] of cases) {
          const ctx = startPos + rows;
          const pageFloats = numLayers * 2 * pageSize * numKvHeads * headDim;
          const numPages = Math.ceil(ctx / pageSize) + 3;
          const pool = u16(numPages * pageFloats);
          const values = spread(pool.length, ctx);
          for (let i = 0; i < pool.length; i++)
            pool[i] = roundKv(Math.max(-4, Math.min(4, values[i] as number)), code);
          // Pages in reverse order, the last three of the pool left unread.
          const table = Int32Array.from({ length: Math.ceil(ctx / pageSize) }, (_, i) => numPages - 4 - i);
          const rowStart = 1;
          const qFloats = (rowStart + rows) * numHeads * headDim;
          const q = k.placeF32(spread(qFloats, numHeads).map((x) => Math.max(-2, Math.min(2, x))));
          const scratch = new Float64Array(headDim + ctx);
          for (let layer = 0; layer < numLayers; layer++) {
            const got = k.allocF32(qFloats);
            const want = new Float32Array(qFloats);
            const shape = [layer, numLayers, numHeads, numKvHeads, headDim, pageSize, code] as const;
            const one = [{ blockTable: table, rowStart, rows, startPos }];
            k.pagedAttentionBatch(got, q, pool, one, 1, scratch, ...shape);
            ref.pagedAttentionBatch(want, q, pool, one, 1, scratch, ...shape);
            assertAllClose(got, want, {
              rtol: 1e-4,
              atol: 1e-5,
              message: `dtype ${code} heads ${numHeads}/${numKvHeads} d=${headDim} page=${pageSize} rows=${rows} start=${startPos} layer=${layer}`,
            });
          }
        }
      }
      assert.equal(k.fallbackCalls, 0);
    });
  });
}
