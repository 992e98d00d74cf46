import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { assertAllClose } from "./assert-all-close.js";
import {
  add,
  addBias,
  matmul,
  pagedAttention,
  rmsnorm,
  rope,
  ropeTables,
  softmax,
  swiglu,
} from "./reference.js";

/** Deterministic pseudo-random floats in [-1, 1) (kernels import nothing, so no shared PRNG here). */
function randomArray(n: number, seed: number): Float32Array {
  const a = new Float32Array(n);
  let s = seed >>> 0 || 1;
  for (let i = 0; i < n; i++) {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    a[i] = ((s >>> 0) / 0x1_0000_0000) * 2 - 1;
  }
  return a;
}

function naiveMatmul(
  x: Float32Array,
  w: Float32Array,
  rows: number,
  inDim: number,
  outDim: number,
): Float64Array {
  const out = new Float64Array(rows * outDim);
  for (let r = 0; r < rows; r++)
    for (let j = 0; j < outDim; j++) {
      let s = 0;
      for (let k = 0; k < inDim; k++) s += x[r * inDim + k] * w[j * inDim + k];
      out[r * outDim + j] = s;
    }
  return out;
}

describe("assertAllClose", () => {
  it("assertAllClose() throws when one element is out of tolerance", () => {
    assert.throws(() => assertAllClose([1, 2, 3], [1, 2, 3.1], { atol: 1e-3, rtol: 0 }), /index 2/);
    assertAllClose([1, 2, 3], [1, 2, 3.0005], { atol: 1e-3, rtol: 0 });
    assert.throws(() => assertAllClose([Number.NaN], [0]), /index 0/);
  });
});

describe("matmul", () => {
  it("matmul() equals the naive triple loop for every remainder of the 4x4 tile and 8-row matvec", () => {
    for (const [rows, inDim, outDim] of [
      [1, 1, 1],
      [1, 13, 17],
      [3, 5, 9],
      [4, 16, 8],
      [7, 33, 21],
      [9, 64, 40],
    ] as const) {
      const x = randomArray(rows * inDim, rows * 7 + inDim);
      const w = randomArray(outDim * inDim, outDim * 3 + 1);
      const out = new Float32Array(rows * outDim).fill(Number.NaN);
      matmul(out, x, w, rows, inDim, outDim);
      assertAllClose(out, naiveMatmul(x, w, rows, inDim, outDim), {
        rtol: 1e-6,
        atol: 1e-6,
        message: `${rows}x${inDim}x${outDim}`,
      });
    }
  });
});

describe("elementwise kernels", () => {
  it("addBias() adds the bias to every row and add() sums element-wise", () => {
    const out = Float32Array.from([1, 2, 3, 4, 5, 6]);
    addBias(out, Float32Array.from([10, 20, 30]), 2, 3);
    assert.deepEqual([...out], [11, 22, 33, 14, 25, 36]);
    add(out, out, Float32Array.from([1, 1, 1, 1, 1, 1]), 6);
    assert.deepEqual([...out], [12, 23, 34, 15, 26, 37]);
  });

  it("rmsnorm() scales each row by 1/rms times the weight", () => {
    const x = Float32Array.from([1, 2, 3, 4, -1, 0, 0, 1]);
    const w = Float32Array.from([1, 0.5, 2, 1]);
    const out = new Float32Array(8);
    rmsnorm(out, x, w, 4, 1e-6, 2);
    const r0 = 1 / Math.sqrt((1 + 4 + 9 + 16) / 4 + 1e-6);
    const r1 = 1 / Math.sqrt(2 / 4 + 1e-6);
    assertAllClose(out, [r0, 2 * r0 * 0.5, 3 * r0 * 2, 4 * r0, -r1, 0, 0, r1], { rtol: 1e-6 });
  });

  it("swiglu() computes silu(gate)·up", () => {
    const out = new Float32Array(3);
    swiglu(out, Float32Array.from([0, 1, -2]), Float32Array.from([5, 2, 3]), 3);
    assertAllClose(out, [0, (2 * 1) / (1 + Math.exp(-1)), (3 * -2) / (1 + Math.exp(2))], { rtol: 1e-6 });
  });

  it("softmax() normalises a slice in place and is shift-invariant", () => {
    const x = Float32Array.from([9, 1, 2, 3, 9]);
    softmax(x, 1, 3);
    const z = Math.exp(1) + Math.exp(2) + Math.exp(3);
    assertAllClose(x, [9, Math.exp(1) / z, Math.exp(2) / z, Math.exp(3) / z, 9], { rtol: 1e-6 });
    const big = Float64Array.from([1000, 1001]);
    softmax(big, 0, 2);
    assertAllClose(big, [1 / (1 + Math.E), Math.E / (1 + Math.E)], { rtol: 1e-12 });
  });
});

describe("rope", () => {
  it("rope() rotates each (i, i+half) pair by position·theta^(-2i/d), matching complex multiplication", () => {
    const headDim = 8;
    const half = 4;
    const cos = new Float64Array(50 * half);
    const sin = new Float64Array(50 * half);
    ropeTables(cos, sin, 50, headDim, 10000);
    const x = randomArray(2 * 3 * headDim, 5);
    const orig = Float32Array.from(x);
    const positions = Int32Array.from([0, 37]);
    rope(x, positions, cos, sin, 2, 3, headDim);
    const expected = new Float64Array(x.length);
    for (let r = 0; r < 2; r++)
      for (let h = 0; h < 3; h++)
        for (let i = 0; i < half; i++) {
          const base = (r * 3 + h) * headDim;
          const ang = positions[r] * 10000 ** (-(2 * i) / headDim);
          // (a + ib)·e^{iθ}
          const a = orig[base + i];
          const b = orig[base + half + i];
          expected[base + i] = a * Math.cos(ang) - b * Math.sin(ang);
          expected[base + half + i] = a * Math.sin(ang) + b * Math.cos(ang);
        }
    assertAllClose(x, expected, { rtol: 1e-6, atol: 1e-6 });
    assertAllClose(x.subarray(0, 3 * headDim), orig.subarray(0, 3 * headDim), { rtol: 0, atol: 0 });
  });
});

describe("pagedAttention", () => {
  it("pagedAttention() through a shuffled block table equals dense causal GQA attention", () => {
    const numLayers = 2;
    const numHeads = 4;
    const numKvHeads = 2;
    const headDim = 8;
    const pageSize = 4;
    const ctx = 11; // 3 pages
    const layer = 1;
    const kvDim = numKvHeads * headDim;
    const pageFloats = numLayers * 2 * pageSize * kvDim;
    const numPages = 7;
    const pool = randomArray(numPages * pageFloats, 99); // garbage everywhere else
    const blockTable = Int32Array.from([5, 0, 3]);
    const k = randomArray(ctx * kvDim, 1);
    const v = randomArray(ctx * kvDim, 2);
    for (let t = 0; t < ctx; t++) {
      const page = blockTable[Math.floor(t / pageSize)];
      const base = page * pageFloats + (t % pageSize) * kvDim;
      for (let j = 0; j < kvDim; j++) {
        pool[base + (layer * 2 + 0) * pageSize * kvDim + j] = k[t * kvDim + j];
        pool[base + (layer * 2 + 1) * pageSize * kvDim + j] = v[t * kvDim + j];
      }
    }
    // The last 3 positions are queried, as a prefill chunk starting at 8; rows 2..4 of q.
    const rows = 3;
    const startPos = 8;
    const rowStart = 2;
    const q = randomArray((rowStart + rows) * numHeads * headDim, 3);
    const out = new Float32Array(q.length);
    pagedAttention(
      out,
      q,
      pool,
      blockTable,
      new Float64Array(headDim + ctx),
      rowStart,
      rows,
      startPos,
      layer,
      numLayers,
      numHeads,
      numKvHeads,
      headDim,
      pageSize,
    );
    const expected = new Float64Array(q.length);
    for (let i = 0; i < rows; i++) {
      const pos = startPos + i;
      for (let h = 0; h < numHeads; h++) {
        const kvh = Math.floor(h / 2);
        const qo = (rowStart + i) * numHeads * headDim + h * headDim;
        const sc: number[] = [];
        for (let t = 0; t <= pos; t++) {
          let s = 0;
          for (let d = 0; d < headDim; d++) s += q[qo + d] * k[t * kvDim + kvh * headDim + d];
          sc.push(s / Math.sqrt(headDim));
        }
        const m = Math.max(...sc);
        const z = sc.reduce((a, s) => a + Math.exp(s - m), 0);
        for (let t = 0; t <= pos; t++)
          for (let d = 0; d < headDim; d++)
            expected[qo + d] += (Math.exp(sc[t] - m) / z) * v[t * kvDim + kvh * headDim + d];
      }
    }
    assertAllClose(out, expected, { rtol: 1e-5, atol: 1e-6 });
  });
});
