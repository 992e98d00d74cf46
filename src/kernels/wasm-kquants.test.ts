/**
 * The fast matmul on llama.cpp's k-quant weights (Q4_K, Q5_K, Q6_K), on both kernel sets: the
 * WebAssembly kernels (`matmulColsK`, activations in 32-value int8 blocks) and the native ones
 * (native/src/kquants.c, activations as ggml's 256-value q8_K), each against an independent
 * emulation of what it computes: the activations quantised as documented (q8-activations.ts)
 * times the weights dequantised by k-quants.ts (which equals ggml's bit for bit), summed in
 * doubles. The kernels form the same sum from integer block dots, so the two agree to f32 rounding
 * (1e-5 of Σ|w·x|).
 *
 * Weights: ggml's own blocks (testing/fixtures/kquant-blocks.json) and, for every shape, random
 * block bytes with sane f16 scales (any bytes are a valid block). Shapes: batch sizes 1–9, the
 * kernels' groups of 4 rows and their last partial group, the 64-row chunks, rows of 1–3 blocks.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, before, describe, it } from "node:test";
import { K_BLOCK_BYTES, type KQuantDType, QK_K } from "./k-quants.js";
import { q8Activations, q8KActivations } from "./q8-activations.js";
import { WasmKernels } from "./wasm-kernels.js";
import { decodeMatrix, f32ToF16Bits, type WeightTensor } from "./weight-format.js";

const DTYPES: readonly KQuantDType[] = ["q4_K", "q5_K", "q6_K"];

/** Deterministic values in [-scale, scale) (xorshift32). */
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

/** Random k-quant blocks for [outDim][inDim]: random bytes, then d (and dmin) set to small f16s. */
function randomKQuant(dtype: KQuantDType, outDim: number, inDim: number, seed: number): WeightTensor {
  const size = K_BLOCK_BYTES[dtype];
  const blocks = (outDim * inDim) / QK_K;
  const noise = fill(new Float32Array(blocks * size), seed);
  const bytes = Uint8Array.from(noise, (v) => Math.floor((v + 1) * 128) & 255);
  const scales = fill(new Float32Array(2 * blocks), seed + 1);
  const setHalf = (o: number, v: number): void => {
    const h = f32ToF16Bits(v);
    bytes[o] = h & 255;
    bytes[o + 1] = h >> 8;
  };
  for (let b = 0; b < blocks; b++) {
    const o = b * size;
    const d = 0.002 + Math.abs(scales[2 * b] as number) * 0.01;
    if (dtype === "q6_K") setHalf(o + 208, d);
    else {
      setHalf(o, d);
      setHalf(o + 2, 0.5 * d + Math.abs(scales[2 * b + 1] as number) * 0.01);
    }
  }
  return { dtype, shape: [outDim, inDim], bytes };
}

/**
 * Σ_k w[j][k]·(q_x·d_x)[r][k] in doubles, and Σ |w·x| (the scale of f32 rounding); x quantised in
 * 32-value blocks (the WebAssembly kernels) or as ggml's q8_K (the native ones).
 */
function emulate(
  x: Float32Array,
  w: WeightTensor,
  rows: number,
  inDim: number,
  outDim: number,
  q8K: boolean,
) {
  const wf = decodeMatrix(w);
  const { q, d } = (q8K ? q8KActivations : q8Activations)(x, rows, inDim);
  const shift = q8K ? 8 : 5;
  const out = new Float64Array(rows * outDim);
  const mag = new Float64Array(rows * outDim);
  for (let r = 0; r < rows; r++) {
    for (let j = 0; j < outDim; j++) {
      let s = 0;
      let m = 0;
      for (let k = 0; k < inDim; k++) {
        const t =
          (wf[j * inDim + k] as number) *
          (q[r * inDim + k] as number) *
          (d[(r * inDim + k) >> shift] as number);
        s += t;
        m += Math.abs(t);
      }
      out[r * outDim + j] = s;
      mag[r * outDim + j] = m;
    }
  }
  return { out, mag };
}

function assertEmulated(
  k: WasmKernels,
  got: Float32Array,
  x: Float32Array,
  w: WeightTensor,
  rows: number,
  label: string,
): void {
  const [outDim, inDim] = w.shape as [number, number];
  const { out, mag } = emulate(x, w, rows, inDim, outDim, k.name === "native");
  for (let i = 0; i < rows * outDim; i++) {
    const diff = Math.abs((got[i] as number) - (out[i] as number));
    if (!(diff <= 1e-5 * (mag[i] as number) + 1e-6))
      assert.fail(`${label} [${i}]: got ${got[i]}, emulated ${out[i]}, |diff| ${diff}`);
  }
}

const SHAPES: [number, number, number][] = [
  [1, 256, 5],
  [1, 768, 37],
  [2, 256, 9],
  [3, 512, 7],
  [4, 256, 41],
  [5, 512, 13],
  [6, 256, 8],
  [7, 256, 3],
  [8, 512, 35],
  [9, 256, 19],
  [17, 256, 11],
  [64, 256, 50],
  [70, 512, 21],
];

const fixture = JSON.parse(
  readFileSync(new URL("../../../testing/fixtures/kquant-blocks.json", import.meta.url), "utf8"),
) as { cases: { dtype: KQuantDType; rows: number; cols: number; blocks: string }[] };

for (const [threads, fma, backend] of [
  [1, true, "wasm"],
  [2, true, "wasm"],
  [2, false, "wasm"],
  [1, false, "native"],
  [2, false, "native"],
] as const) {
  const build = backend === "native" ? "native" : fma ? "relaxed SIMD" : "plain SIMD";
  describe(`WasmKernels on Q4_K/Q5_K/Q6_K weights (${threads} thread${threads === 1 ? "" : "s"}, ${build})`, () => {
    let k: WasmKernels;
    before(async () => {
      // The native memory does not grow: it is made big enough at once.
      const initialBytes = backend === "native" ? 64 << 20 : 1 << 22;
      k = await WasmKernels.create({ threads, parallelMinWork: 0, initialBytes, fma, backend });
      await k.ready();
      assert.equal(k.name, backend);
      if (backend === "wasm") assert.equal(k.fma, fma);
    });
    after(async () => {
      await k.close();
    });

    for (const dtype of DTYPES) {
      it(`matmul() on ${dtype} weights computes the int8 algorithm on the dequantised weights (to f32 rounding)`, () => {
        for (const [rows, inDim, outDim] of SHAPES) {
          const x = fill(k.allocF32(rows * inDim), rows * 13 + inDim, 3);
          x[0] = 40; // an outlier: its block's other values quantise coarsely, as real activations' do
          const w = k.placeMatrix(randomKQuant(dtype, outDim, inDim, outDim * 17 + rows)) as WeightTensor;
          const got = k.allocF32(rows * outDim);
          k.matmul(got, x, w, rows, inDim, outDim);
          assertEmulated(k, got, x, w, rows, `${dtype} ${rows}x${inDim}x${outDim}`);
        }
        assert.equal(k.fallbackCalls, 0);
      });

      it(`matmul() on ggml's own ${dtype} blocks computes the same`, () => {
        const c = fixture.cases.find((f) => f.dtype === dtype);
        assert.ok(c !== undefined);
        const bytes = new Uint8Array(Buffer.from(c.blocks, "base64"));
        const w = k.placeMatrix({ dtype, shape: [c.rows, c.cols], bytes }) as WeightTensor;
        for (const rows of [1, 3, 4, 9]) {
          const x = fill(k.allocF32(rows * c.cols), rows + 5, 2);
          const got = k.allocF32(rows * c.rows);
          k.matmul(got, x, w, rows, c.cols, c.rows);
          assertEmulated(k, got, x, w, rows, `ggml ${dtype} rows ${rows}`);
        }
        assert.equal(k.fallbackCalls, 0);
      });
    }

    it("matmulEach() on k-quant weights runs the segments as one job", () => {
      const inDim = 512;
      const outDims = [45, 7, 100];
      for (const dtype of DTYPES) {
        for (const rows of [1, 2, 5, 8, 17]) {
          const x = fill(k.allocF32(rows * inDim), rows);
          const ws = outDims.map(
            (o, i) => k.placeMatrix(randomKQuant(dtype, o, inDim, 10 * i + 3)) as WeightTensor,
          );
          const outs = outDims.map((o) => k.allocF32(rows * o));
          k.matmulEach(outs, x, ws, rows, inDim, outDims);
          ws.forEach((w, i) => {
            assertEmulated(k, outs[i] as Float32Array, x, w, rows, `${dtype} rows ${rows} segment ${i}`);
          });
        }
      }
      assert.equal(k.fallbackCalls, 0);
    });

    it("matmulEach() over segments in different formats (Q4_K_M's Q4_K q, k and Q6_K v) runs in WebAssembly", () => {
      const inDim = 256;
      const outDims = [64, 16, 16];
      const dtypes: KQuantDType[] = ["q4_K", "q4_K", "q6_K"];
      for (const rows of [1, 5]) {
        const x = fill(k.allocF32(rows * inDim), rows + 40);
        const ws = outDims.map(
          (o, i) =>
            k.placeMatrix(randomKQuant(dtypes[i] as KQuantDType, o, inDim, 7 * i + 1)) as WeightTensor,
        );
        const outs = outDims.map((o) => k.allocF32(rows * o));
        const before = k.fallbackCalls;
        k.matmulEach(outs, x, ws, rows, inDim, outDims);
        assert.equal(k.fallbackCalls, before, "no segment fell back to the reference");
        ws.forEach((w, i) => {
          assertEmulated(k, outs[i] as Float32Array, x, w, rows, `mixed rows ${rows} segment ${i}`);
        });
      }
    });

    it("a k-quant weight whose rows are not whole 256-weight blocks runs on the reference kernel", () => {
      // The GGUF loader refuses such a tensor; a hand-made one must still not reach the kernel.
      const w: WeightTensor = {
        dtype: "q4_K",
        shape: [1, 128],
        bytes: (k.placeMatrix(randomKQuant("q4_K", 1, 256, 1)) as WeightTensor).bytes,
      };
      const before = k.fallbackCalls;
      assert.throws(
        () => k.matmul(k.allocF32(1), k.allocF32(128), w, 1, 128, 1),
        /whole number of 256-value blocks/,
      );
      assert.equal(k.fallbackCalls, before + 1);
    });
  });
}
