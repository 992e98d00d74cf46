/**
 * The WebAssembly matmul on every weight format against the reference kernels, which dequantise to
 * f32 (src/kernels/weight-format.ts) and multiply in doubles.
 *
 * f16 and bf16 weights are widened inside the kernel, so the result is the f32 one: rtol 1e-4.
 * Q8_0 and Q4_0 weights are multiplied as int8 against Q8_0-quantised activations (as llama.cpp
 * does); the stated tolerance is the bound that quantisation of x implies: each x value moves by at
 * most half its block's scale d_x = amax/127, so |got − want| ≤ Σ_k |w_k|·d_x(k)/2, plus f32
 * rounding (1e-5 of Σ|x_k·w_k|). The bound is computed here from x and the dequantised weights.
 */
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { assertAllClose } from "./assert-all-close.js";
import { nativeAddon } from "./kernel-backend.js";
import { q8Activations } from "./q8-activations.js";
import * as ref from "./reference.js";
import { WasmKernels } from "./wasm-kernels.js";
import { decodeMatrix, encodeWeight, type WeightDType, type WeightTensor } from "./weight-format.js";

function fill(a: Float32Array, seed: number, scale = 1): Float32Array {
  let s = seed >>> 0 || 1;
  for (let i = 0; i < a.length; i++) {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    a[i] = ((s >>> 0) / 4294967296 - 0.5) * 2 * scale;
  }
  return a;
}

/** A weight of `dtype` placed in the kernels' memory. */
function weight(
  k: WasmKernels,
  outDim: number,
  inDim: number,
  dtype: WeightDType,
  seed: number,
): WeightTensor {
  const t = encodeWeight(fill(new Float32Array(outDim * inDim), seed, 0.5), [outDim, inDim], dtype);
  return k.placeMatrix(t) as WeightTensor;
}

/** Half the Q8_0 activation scale of the block of x holding each value (amax/127/2). */
function halfScales(x: Float32Array, rows: number, inDim: number): Float32Array {
  const out = new Float32Array(rows * inDim);
  for (let b = 0; b < (rows * inDim) / 32; b++) {
    let amax = 0;
    for (let j = 0; j < 32; j++) amax = Math.max(amax, Math.abs(x[b * 32 + j] as number));
    out.fill(amax / 127 / 2, b * 32, b * 32 + 32);
  }
  return out;
}

/** Asserts |got − want| within the activation-quantisation bound for every output. */
function assertQuantClose(
  got: Float32Array,
  want: Float32Array,
  x: Float32Array,
  w: Float32Array,
  dims: { rows: number; inDim: number; outDim: number; label: string },
): void {
  const { rows, inDim, outDim, label } = dims;
  const half = halfScales(x, rows, inDim);
  for (let r = 0; r < rows; r++) {
    for (let j = 0; j < outDim; j++) {
      let bound = 1e-6;
      let mag = 0;
      for (let kk = 0; kk < inDim; kk++) {
        const wv = Math.abs(w[j * inDim + kk] as number);
        bound += wv * (half[r * inDim + kk] as number);
        mag += wv * Math.abs(x[r * inDim + kk] as number);
      }
      bound += 1e-5 * mag;
      const diff = Math.abs((got[r * outDim + j] as number) - (want[r * outDim + j] as number));
      if (!(diff <= bound)) {
        assert.fail(
          `${label}: row ${r} col ${j}: got ${got[r * outDim + j]}, want ${want[r * outDim + j]}, |diff| ${diff} > bound ${bound}`,
        );
      }
    }
  }
}

/**
 * The int8 algorithm written out independently: each 32-block of x quantised as the kernels
 * document (d = amax/127 in f32, q = nearest-even(x·(1/d))), each weight block read from its bytes
 * (f16 d, int8 q or nibbles − 8), and Σ_blocks d_w·d_x·Σ q_w·q_x in doubles; plus Σ of the terms'
 * magnitudes, the scale of the f32 accumulation error.
 */
function int8Reference(
  x: Float32Array,
  w: WeightTensor,
  rows: number,
  inDim: number,
  outDim: number,
): { out: Float64Array; scale: Float64Array } {
  const nb = inDim / 32;
  const { q: qx, d: dx } = q8Activations(x, rows, inDim);
  const q8 = w.dtype === "q8_0";
  const bs = q8 ? 34 : 18;
  const bytes = w.bytes;
  const f16 = (o: number): number =>
    decodeMatrix({ dtype: "f16", shape: [1], bytes: bytes.subarray(o, o + 2) })[0] as number;
  const out = new Float64Array(rows * outDim);
  const scale = new Float64Array(rows * outDim);
  for (let r = 0; r < rows; r++) {
    for (let j = 0; j < outDim; j++) {
      let sum = 0;
      let mag = 0;
      for (let b = 0; b < nb; b++) {
        const o = (j * nb + b) * bs;
        const dw = f16(o);
        let isum = 0;
        for (let e = 0; e < 32; e++) {
          const qw = q8
            ? ((bytes[o + 2 + e] as number) << 24) >> 24
            : e < 16
              ? ((bytes[o + 2 + e] as number) & 15) - 8
              : ((bytes[o + 2 + e - 16] as number) >> 4) - 8;
          isum += qw * (qx[r * inDim + b * 32 + e] as number);
        }
        sum += dw * (dx[r * nb + b] as number) * isum;
        mag += Math.abs(dw * (dx[r * nb + b] as number)) * 127 * 127 * 32;
      }
      out[r * outDim + j] = sum;
      scale[r * outDim + j] = mag;
    }
  }
  return { out, scale };
}

const HALF_SHAPES: [number, number, number][] = [
  [1, 1, 1],
  [1, 37, 13],
  [2, 37, 13],
  [3, 5, 7],
  [4, 33, 41],
  [7, 66, 19],
  [8, 37, 13],
  [17, 66, 9],
  [16, 35, 8],
  [1, 576, 193],
  [64, 120, 200],
  [131, 40, 101],
];

/** Batch sizes 1–9 and the edges of qTile16's 16-row groups and of the 64-row chunks. */
const TILE_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 31, 33, 70];

const QUANT_SHAPES: [number, number, number][] = [
  [1, 32, 5],
  [1, 576, 193],
  [2, 64, 9],
  [3, 96, 7],
  [4, 64, 41],
  [5, 32, 13],
  [6, 128, 19],
  [7, 128, 19],
  [8, 576, 35],
  [13, 576, 35],
  [64, 128, 200],
  [131, 64, 101],
  // qTile16's groups of 4, 8 and 16 rows, their padding and the row chunks (64) they meet
  ...TILE_ROWS.map((r): [number, number, number] => [r, 96, 11]),
];

for (const [threads, fma, backend] of [
  [1, true, "wasm"],
  [2, true, "wasm"],
  [2, false, "wasm"],
  [1, false, "native"],
  [2, false, "native"],
] as const) {
  const build = backend === "native" ? "native" : fma ? "relaxed SIMD" : "plain SIMD";
  describe(`WasmKernels on f16/bf16/Q8_0/Q4_0 weights (${threads} thread${threads === 1 ? "" : "s"}, ${build})`, () => {
    let k: WasmKernels;
    before(async () => {
      // The native memory does not grow: it is made big enough at once.
      const initialBytes = backend === "native" ? 64 << 20 : 1 << 20;
      k = await WasmKernels.create({ threads, parallelMinWork: 0, initialBytes, fma, backend });
      await k.ready();
      assert.equal(k.name, backend);
      if (backend === "wasm") assert.equal(k.fma, fma);
    });
    after(async () => {
      await k.close();
    });

    for (const dtype of ["f16", "bf16"] as const) {
      it(`matmul() on ${dtype} weights equals the reference on the widened weights`, () => {
        for (const [rows, inDim, outDim] of HALF_SHAPES) {
          const x = fill(k.allocF32(rows * inDim), rows * 7 + inDim);
          const w = weight(k, outDim, inDim, dtype, outDim * 3 + 1);
          const got = k.allocF32(rows * outDim);
          const want = new Float32Array(rows * outDim);
          k.matmul(got, x, w, rows, inDim, outDim);
          ref.matmul(want, x, decodeMatrix(w), rows, inDim, outDim);
          assertAllClose(got, want, {
            rtol: 1e-4,
            atol: 1e-5,
            message: `${dtype} ${rows}x${inDim}x${outDim}`,
          });
        }
        assert.equal(k.fallbackCalls, 0);
      });
    }

    for (const dtype of ["q8_0", "q4_0"] as const) {
      it(`matmul() on ${dtype} weights is within the activation-quantisation bound of the dequantised reference`, () => {
        for (const [rows, inDim, outDim] of QUANT_SHAPES) {
          const x = fill(k.allocF32(rows * inDim), rows * 5 + inDim, 2);
          const w = weight(k, outDim, inDim, dtype, outDim * 11 + 2);
          const got = k.allocF32(rows * outDim);
          const want = new Float32Array(rows * outDim);
          const wf = decodeMatrix(w);
          k.matmul(got, x, w, rows, inDim, outDim);
          ref.matmul(want, x, wf, rows, inDim, outDim);
          assertQuantClose(got, want, x, wf, {
            rows,
            inDim,
            outDim,
            label: `${dtype} ${rows}x${inDim}x${outDim}`,
          });
        }
        assert.equal(k.fallbackCalls, 0);
      });

      it(`matmul() on ${dtype} weights computes exactly the int8 algorithm (an independent emulation, to f32 rounding)`, () => {
        for (const [rows, inDim, outDim] of QUANT_SHAPES) {
          const x = fill(k.allocF32(rows * inDim), rows * 13 + inDim, 3);
          x[0] = 40; // an outlier: its block's other values quantise coarsely, as real activations' do
          const w = weight(k, outDim, inDim, dtype, outDim * 17 + 5);
          const got = k.allocF32(rows * outDim);
          k.matmul(got, x, w, rows, inDim, outDim);
          const { out, scale } = int8Reference(x, w, rows, inDim, outDim);
          for (let i = 0; i < rows * outDim; i++) {
            const diff = Math.abs((got[i] as number) - (out[i] as number));
            assert.ok(
              diff <= 1e-6 * (scale[i] as number) + 1e-6,
              `${dtype} ${rows}x${inDim}x${outDim} [${i}]: got ${got[i]}, emulated ${out[i]}`,
            );
          }
        }
      });

      it(`matmulEach() on ${dtype} weights runs the segments as one job`, () => {
        const inDim = 96;
        const outDims = [45, 7, 100];
        for (const rows of [1, 2, 5, 8, 17]) {
          const x = fill(k.allocF32(rows * inDim), rows);
          const ws = outDims.map((o, i) => weight(k, o, inDim, dtype, 10 * i + 3));
          const outs = outDims.map((o) => k.allocF32(rows * o));
          k.matmulEach(outs, x, ws, rows, inDim, outDims);
          outDims.forEach((o, i) => {
            const wf = decodeMatrix(ws[i] as WeightTensor);
            const want = new Float32Array(rows * o);
            ref.matmul(want, x, wf, rows, inDim, o);
            assertQuantClose(outs[i] as Float32Array, want, x, wf, {
              rows,
              inDim,
              outDim: o,
              label: `${dtype} rows ${rows} segment ${i}`,
            });
          });
        }
        assert.equal(k.fallbackCalls, 0);
      });
    }

    if (backend === "native") {
      it("placeMatrix() puts each weight it copies on a cache line of the address, not only of the offset", () => {
        // The memory starts 16 bytes into a page: at a 64-byte-aligned offset every 64-byte load of
        // a weight row straddled two cache lines (bf16 decode read ~19% fewer bytes a second).
        const base = nativeAddon().pageOffset(new Uint8Array(k.buffer(), 0, 16));
        for (const dtype of ["f32", "bf16", "q8_0", "q4_0"] as const) {
          for (const outDim of [1, 3, 5]) {
            const t = encodeWeight(fill(new Float32Array(outDim * 32), outDim), [outDim, 32], dtype);
            const placed = k.placeMatrix(t);
            const at = placed instanceof Float32Array ? placed.byteOffset : placed.bytes.byteOffset;
            assert.equal((base + at) % 64, 0, `${dtype} [${outDim}, 32] at offset ${at}, base ${base}`);
          }
        }
      });
    }

    it("a block-quantised weight whose rows are not whole blocks runs on the reference kernel", () => {
      // encodeWeight refuses such a tensor; a hand-made one (as a file could hold) must not reach the kernel.
      const w: WeightTensor = {
        dtype: "q8_0",
        shape: [1, 16],
        bytes: (k.placeMatrix({ dtype: "q8_0", shape: [32], bytes: new Uint8Array(34) }) as WeightTensor)
          .bytes,
      };
      const before = k.fallbackCalls;
      assert.throws(
        () => k.matmul(k.allocF32(1), k.allocF32(16), w, 1, 16, 1),
        /whole number of 32-value blocks/,
      );
      assert.equal(k.fallbackCalls, before + 1);
    });
  });
}

describe("WasmKernels' two int8 tiles for batches on Q8_0/Q4_0 weights", () => {
  // qTileDot16 (relaxed int8 dot with accumulate, where the engine computes it exactly) and qTile16
  // (i16 dot products) form the same integer block sums and scale them in the same order.
  const major = Number(process.versions.node.split(".")[0]);
  let dot: WasmKernels;
  let i16: WasmKernels;
  before(async () => {
    dot = await WasmKernels.create({ threads: 2, parallelMinWork: 0, initialBytes: 1 << 20 });
    i16 = await WasmKernels.create({ threads: 2, parallelMinWork: 0, initialBytes: 1 << 20, dotAdd: false });
    await Promise.all([dot.ready(), i16.ready()]);
  });
  after(async () => {
    await Promise.all([dot.close(), i16.close()]);
  });

  it("the dot-with-accumulate tile runs where the engine gets the instruction right (not Node 20's V8)", () => {
    assert.equal(i16.dotAdd, false);
    if (major === 20) assert.equal(dot.dotAdd, false);
    if (major >= 24 && dot.fma) assert.equal(dot.dotAdd, true);
  });

  for (const dtype of ["q8_0", "q4_0"] as const) {
    it(`on ${dtype} weights both give bit-identical outputs (batch sizes 1–9, 16-row groups, row chunks)`, () => {
      for (const [rows, inDim, outDim] of QUANT_SHAPES) {
        const x = fill(dot.allocF32(rows * inDim), rows * 3 + inDim, 2);
        const xi = i16.allocF32(rows * inDim);
        xi.set(x);
        const seed = outDim * 7 + 1;
        const w = weight(dot, outDim, inDim, dtype, seed);
        const wi = weight(i16, outDim, inDim, dtype, seed);
        const got = dot.allocF32(rows * outDim);
        const want = i16.allocF32(rows * outDim);
        dot.matmul(got, x, w, rows, inDim, outDim);
        i16.matmul(want, xi, wi, rows, inDim, outDim);
        assert.deepEqual(got, want, `${dtype} ${rows}x${inDim}x${outDim}`);
      }
      assert.equal(dot.fallbackCalls + i16.fallbackCalls, 0);
    });
  }
});
