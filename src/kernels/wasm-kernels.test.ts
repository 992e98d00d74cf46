import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { assertAllClose } from "./assert-all-close.js";
import * as ref from "./reference.js";
import { WasmKernels } from "./wasm-kernels.js";

/** Deterministic uniform values in [-scale, scale). */
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

function shuffledTable(n: number, numPages: number, seed: number): Int32Array {
  const ids = Array.from({ length: numPages }, (_, i) => i);
  let s = seed;
  for (let i = numPages - 1; i > 0; i--) {
    s = (s * 1103515245 + 12345) >>> 0;
    const j = s % (i + 1);
    [ids[i], ids[j]] = [ids[j], ids[i]];
  }
  return Int32Array.from(ids.slice(0, n));
}

const MATMUL_SHAPES: [number, number, number][] = [
  [1, 1, 1],
  [1, 37, 13],
  [2, 64, 9],
  [2, 37, 13], // two rows in one pass: a quad and a single after the 8-wide steps
  [2, 6, 3],
  [3, 5, 7], // three rows streamed: two in one pass, the third from L2
  [4, 33, 41],
  [7, 66, 19], // a packed group of 7 rows: both halves of the tile, the second padded
  [11, 37, 13], // a full group and one of 3 rows (padded to 4)
  [5, 37, 13], // 4 rows on the tile, the fifth a matvec from L2
  [9, 66, 7], // a full group, then one row as a matvec
  [8, 37, 13], // one packed group of 8 rows: a k tail of 1 and an odd last column
  [17, 66, 9], // two packed groups and a remainder row, a k tail of 2
  [16, 35, 8], // a k tail of 3, even columns
  [13, 576, 35],
  [1, 576, 193],
  [64, 120, 200],
  [131, 40, 101], // several row blocks of 64, a partial column chunk
];

for (const [threads, fma, backend] of [
  [1, true, "wasm"],
  [2, true, "wasm"],
  [2, false, "wasm"],
  [1, false, "native"],
  [2, false, "native"],
] as const) {
  const build = backend === "native" ? "native" : fma ? "fused multiply-add" : "multiply, then add";
  describe(`WasmKernels (${threads} thread${threads === 1 ? "" : "s"}, ${build})`, () => {
    let k: WasmKernels;
    before(async () => {
      // parallelMinWork 0: every matmul/attention goes through the two-thread job protocol. The
      // native memory does not grow: it is made big enough at once.
      const initialBytes = backend === "native" ? 64 << 20 : 1 << 20;
      k = await WasmKernels.create({ threads, parallelMinWork: 0, initialBytes, fma, backend });
      await k.ready();
      assert.equal(k.name, backend);
      // Node 20 takes the relaxed-SIMD build after turning on its flag; a build that silently fell
      // back would leave the fused kernels untested.
      if (backend === "wasm") assert.equal(k.fma, fma);
    });
    after(async () => {
      await k.close();
    });

    it("WasmKernels.matmul() matches reference matmul on odd shapes", () => {
      for (const [rows, inDim, outDim] of MATMUL_SHAPES) {
        const x = fill(k.allocF32(rows * inDim), rows * 7 + inDim);
        const w = fill(k.allocF32(outDim * inDim), outDim * 3 + 1);
        const got = k.allocF32(rows * outDim);
        const want = new Float32Array(rows * outDim);
        k.matmul(got, x, w, rows, inDim, outDim);
        ref.matmul(want, x, w, rows, inDim, outDim);
        assertAllClose(got, want, { rtol: 1e-4, atol: 1e-5, message: `${rows}x${inDim}x${outDim}` });
      }
      assert.equal(k.fallbackCalls, 0);
    });

    it("WasmKernels.matmulEach() equals a reference matmul per weight, as one job over uneven segments", () => {
      const inDim = 37;
      const outDims = [45, 7, 100];
      for (const rows of [1, 2, 5, 8, 17, 131]) {
        const x = fill(k.allocF32(rows * inDim), rows);
        const ws = outDims.map((o, i) => fill(k.allocF32(o * inDim), 10 * i + 3));
        const outs = outDims.map((o) => k.allocF32(rows * o));
        k.matmulEach(outs, x, ws, rows, inDim, outDims);
        outDims.forEach((o, i) => {
          const want = new Float32Array(rows * o);
          ref.matmul(want, x, ws[i] as Float32Array, rows, inDim, o);
          assertAllClose(outs[i] as Float32Array, want, {
            rtol: 1e-4,
            atol: 1e-5,
            message: `rows ${rows} segment ${i}`,
          });
        });
      }
      assert.equal(k.fallbackCalls, 0);
    });

    it("WasmKernels.rmsnorm() matches reference rmsnorm, in place and over rows", () => {
      for (const [n, rows] of [
        [1, 1],
        [7, 3],
        [576, 2],
        [45, 5],
      ] as const) {
        const x = fill(k.allocF32(n * rows), n + rows, 3);
        const weight = fill(k.allocF32(n), n);
        const want = new Float32Array(n * rows);
        ref.rmsnorm(want, x, weight, n, 1e-5, rows);
        k.rmsnorm(x, x, weight, n, 1e-5, rows);
        assertAllClose(x, want, { rtol: 1e-5, atol: 1e-6, message: `n=${n} rows=${rows}` });
      }
    });

    it("WasmKernels.rope() matches reference rope at scattered positions", () => {
      for (const [numHeads, headDim] of [
        [3, 6],
        [9, 64],
        [2, 10],
      ] as const) {
        const rows = 5;
        const maxPos = 300;
        const cos = k.allocF64(maxPos * (headDim >> 1));
        const sin = k.allocF64(maxPos * (headDim >> 1));
        ref.ropeTables(cos, sin, maxPos, headDim, 10000);
        const positions = k.allocI32(rows);
        positions.set([0, 1, 17, 299, 128]);
        const x = fill(k.allocF32(rows * numHeads * headDim), headDim);
        const want = Float32Array.from(x);
        ref.rope(want, positions, cos, sin, rows, numHeads, headDim);
        k.rope(x, positions, cos, sin, rows, numHeads, headDim);
        assertAllClose(x, want, { rtol: 1e-6, atol: 1e-7, message: `${numHeads}x${headDim}` });
      }
    });

    it("WasmKernels.swiglu(), add() and addBias() match the reference, including tails and large inputs", () => {
      for (const n of [1, 7, 1536, 20001]) {
        const gate = fill(k.allocF32(n), n, 12);
        const up = fill(k.allocF32(n), n + 1);
        const want = new Float32Array(n);
        ref.swiglu(want, gate, up, n);
        const got = k.allocF32(n);
        k.swiglu(got, gate, up, n);
        assertAllClose(got, want, { rtol: 1e-5, atol: 1e-6, message: `swiglu n=${n}` });
        ref.add(want, gate, up, n);
        k.add(got, gate, up, n);
        assertAllClose(got, want, { rtol: 0, atol: 0, message: `add n=${n}` });
      }
      const rows = 3;
      const n = 11;
      const out = fill(k.allocF32(rows * n), 5);
      const bias = fill(k.allocF32(n), 6);
      const want = Float32Array.from(out);
      ref.addBias(want, bias, rows, n);
      k.addBias(out, bias, rows, n);
      assertAllClose(out, want, { rtol: 0, atol: 0 });
    });

    it("WasmKernels.pagedAttentionBatch() of one sequence matches reference pagedAttention for GQA groups 1, 3, 4 over shuffled pages", () => {
      const cases = [
        // numHeads, numKvHeads, headDim, pageSize, rows, startPos
        [3, 3, 8, 4, 1, 0],
        [9, 3, 64, 16, 1, 37],
        [8, 2, 10, 3, 5, 6],
        [4, 1, 6, 5, 7, 0],
        [12, 3, 64, 16, 3, 200],
        // Eight rows or more: each item reads every KV head of a page.
        [9, 3, 64, 16, 9, 40],
        // Few items and a long context: on 2 threads the context is split and merged.
        [9, 3, 64, 16, 1, 1000],
        [6, 1, 10, 4, 2, 700],
        [8, 2, 12, 16, 1, 2047],
      ] as const;
      const numLayers = 3;
      for (const [numHeads, numKvHeads, headDim, pageSize, rows, startPos] of cases) {
        const ctx = startPos + rows;
        const pageFloats = numLayers * 2 * pageSize * numKvHeads * headDim;
        const numPages = Math.ceil(ctx / pageSize) + 3;
        const pool = fill(k.allocF32(numPages * pageFloats), ctx + headDim);
        const table = shuffledTable(Math.ceil(ctx / pageSize), numPages, ctx);
        const rowStart = 2;
        const qFloats = (rowStart + rows) * numHeads * headDim;
        const q = fill(k.allocF32(qFloats), numHeads, 2);
        const scratch = new Float64Array(headDim + ctx);
        for (let layer = 0; layer < numLayers; layer++) {
          const got = k.allocF32(qFloats);
          const want = new Float32Array(qFloats);
          const shape = [layer, numLayers, numHeads, numKvHeads, headDim, pageSize] as const;
          const one = [{ blockTable: table, rowStart, rows, startPos }];
          k.pagedAttentionBatch(got, q, pool, one, 1, scratch, ...shape);
          ref.pagedAttention(want, q, pool, table, scratch, rowStart, rows, startPos, ...shape);
          assertAllClose(got, want, {
            rtol: 1e-4,
            atol: 1e-5,
            message: `heads ${numHeads}/${numKvHeads} d=${headDim} page=${pageSize} rows=${rows} start=${startPos} layer=${layer}`,
          });
        }
      }
      assert.equal(k.fallbackCalls, 0);
    });

    it("WasmKernels.pagedAttentionBatch() matches the reference over sequences of mixed lengths sharing a pool", () => {
      const [numHeads, numKvHeads, headDim, pageSize, numLayers] = [9, 3, 64, 16, 2];
      const batches: [rows: number, startPos: number][][] = [
        // Eight decode rows at short contexts: one item per row, spread over both threads.
        Array.from({ length: 8 }, (_, i) => [1, 20 + 9 * i] as [number, number]),
        // Two decode rows: items cut by KV head.
        [
          [1, 5],
          [1, 40],
        ],
        // A prefill chunk between decode rows, an empty sequence, and a context past 512 tokens.
        [
          [1, 33],
          [12, 0],
          [0, 7],
          [1, 700],
        ],
      ];
      const pageFloats = numLayers * 2 * pageSize * numKvHeads * headDim;
      for (const batch of batches) {
        const pagesOf = batch.map(([rows, startPos]) => Math.ceil((rows + startPos) / pageSize));
        const numPages = pagesOf.reduce((a, b) => a + b, 0) + 2;
        const pool = fill(k.allocF32(numPages * pageFloats), numPages);
        // Every sequence gets its own pages, scattered over the pool.
        const order = shuffledTable(numPages, numPages, 7);
        let next = 0;
        let row = 1;
        const sequences = batch.map(([rows, startPos], i) => {
          const n = pagesOf[i] as number;
          const s = { blockTable: order.slice(next, next + n), rowStart: row, rows, startPos };
          next += n;
          row += rows;
          return s;
        });
        const qFloats = row * numHeads * headDim;
        const q = fill(k.allocF32(qFloats), row, 2);
        const maxCtx = Math.max(...batch.map(([rows, startPos]) => rows + startPos));
        const scratch = new Float64Array(headDim + maxCtx);
        for (let layer = 0; layer < numLayers; layer++) {
          const got = k.allocF32(qFloats);
          const want = new Float32Array(qFloats);
          const args = [scratch, layer, numLayers, numHeads, numKvHeads, headDim, pageSize] as const;
          k.pagedAttentionBatch(got, q, pool, sequences, sequences.length, ...args);
          ref.pagedAttentionBatch(want, q, pool, sequences, sequences.length, ...args);
          assertAllClose(got, want, {
            rtol: 1e-4,
            atol: 1e-5,
            message: `batch ${JSON.stringify(batch)} layer ${layer}`,
          });
        }
      }
      assert.equal(k.fallbackCalls, 0);
    });

    it("WasmKernels kernels fall back to the reference for buffers outside the memory", () => {
      const before = k.fallbackCalls;
      const x = fill(new Float32Array(2 * 9), 1);
      const w = fill(k.allocF32(5 * 9), 2);
      const got = new Float32Array(2 * 5);
      const want = new Float32Array(2 * 5);
      k.matmul(got, x, w, 2, 9, 5);
      ref.matmul(want, x, w, 2, 9, 5);
      assert.deepEqual(got, want);
      assert.equal(k.fallbackCalls, before + 1);
      assert.equal(k.owns(x), false);
      assert.equal(k.owns(w), true);
    });
  });
}

describe("WasmKernels memory", () => {
  it("WasmKernels runs views of its memory made after another WebAssembly memory grew, and refuses another memory's", async () => {
    // Growing any wasm memory in the thread gives every shared memory a new buffer object (V8 in
    // Node 20): views made afterwards must still count as this memory's, or every kernel on them
    // falls back to the reference (a process's second kernel set ran its matmuls 20x slower).
    const k = await WasmKernels.create({ threads: 1, initialBytes: 1 << 20 });
    const other = await WasmKernels.create({ threads: 1, initialBytes: 1 << 20 });
    try {
      const w = k.allocF32(5 * 37).fill(0.25);
      const out = k.allocF32(5);
      const at = k.allocBytes(4 * 37);
      const before = k.memory.buffer;
      other.allocF32(1 << 20); // grows the other memory
      assert.notEqual(k.memory.buffer, before, "V8 no longer refreshes the buffer: this test proves nothing");
      // A view made by hand, as a caller placing its own array (forward-setup's pools did).
      const x = new Float32Array(k.memory.buffer, at, 37).fill(0.5);
      k.matmul(out, x, w, 1, 37, 5);
      assert.equal(k.fallbackCalls, 0);
      assertAllClose(out, new Float32Array(5).fill(37 * 0.125), { rtol: 1e-6, atol: 0 });
      // A view of the other memory is not this one's, whatever its offsets.
      const foreign = other.allocF32(5);
      k.matmul(foreign, x, w, 1, 37, 5);
      assert.equal(k.fallbackCalls, 1);
      assert.ok(!k.owns(new Float32Array(new SharedArrayBuffer(1 << 17))));
    } finally {
      await k.close();
      await other.close();
    }
  });

  it("WasmKernels.allocF32() grows the memory and earlier views stay valid and owned", async () => {
    const k = await WasmKernels.create({ threads: 1, initialBytes: 1 << 17 });
    try {
      const a = k.allocF32(1000);
      a.fill(3);
      const big = k.allocF32(1 << 20); // past the initial size: grows
      big.fill(1);
      assert.equal(a[999], 3);
      assert.ok(k.owns(a) && k.owns(big));
      const x = k.allocF32(4);
      x.set([1, 2, 3, 4]);
      const out = k.allocF32(1);
      const w = k.placeF32(Float32Array.of(1, 1, 1, 1));
      k.matmul(out, x, w, 1, 4, 1);
      assert.equal(out[0], 10);
      assert.equal(k.fallbackCalls, 0);
      assert.equal(a.byteOffset % 64, 0);
      assert.equal(big.byteOffset % 64, 0);
    } finally {
      await k.close();
    }
  });

  it("WasmKernels.placeWeights() copies every tensor into the memory and keeps tied embeddings tied", async () => {
    const k = await WasmKernels.create({ threads: 1, initialBytes: 1 << 17 });
    try {
      const t = (n: number, seed: number) => fill(new Float32Array(n), seed);
      const embed = t(12, 1);
      const layer = {
        inputNorm: t(3, 2),
        q: t(9, 3),
        k: t(9, 4),
        v: t(9, 5),
        qBias: null,
        kBias: t(3, 6),
        vBias: null,
        o: t(9, 7),
        postNorm: t(3, 8),
        gate: t(6, 9),
        up: t(6, 10),
        down: t(6, 11),
      };
      const placed = k.placeWeights({ embed, layers: [layer], finalNorm: t(3, 12), lmHead: embed });
      assert.equal(placed.lmHead, placed.embed);
      assert.ok(k.owns(placed.embed) && k.owns(placed.layers[0].down) && k.owns(placed.layers[0].kBias!));
      assert.equal(placed.layers[0].qBias, null);
      assert.deepEqual(placed.layers[0].gate, layer.gate);
      assert.deepEqual(placed.embed, embed);
    } finally {
      await k.close();
    }
  });

  it("WasmKernels worker takes part in large jobs once ready", async () => {
    const k = await WasmKernels.create({ threads: 2 });
    try {
      await k.ready();
      const rows = 16;
      const inDim = 256;
      const outDim = 1024;
      const x = fill(k.allocF32(rows * inDim), 1);
      const w = fill(k.allocF32(outDim * inDim), 2);
      const out = k.allocF32(rows * outDim);
      const want = new Float32Array(rows * outDim);
      ref.matmul(want, x, w, rows, inDim, outDim);
      // (On a loaded machine the main thread can claim every chunk many calls in a row.)
      for (const until = Date.now() + 10_000; k.workerJobs === 0 && Date.now() < until; )
        k.matmul(out, x, w, rows, inDim, outDim);
      assert.ok(k.workerJobs > 0, "the worker never took a job");
      assertAllClose(out, want, { rtol: 1e-4, atol: 1e-5 });
    } finally {
      await k.close();
    }
  });
});

describe("WasmKernels on native past 4 GiB", () => {
  it("WasmKernels on native runs matmul, attention and the KV write on buffers past 4 GiB, on two threads", async () => {
    // The memory is 4 GiB + 64 MiB; only the pages used are touched (committed).
    const k = await WasmKernels.create({
      backend: "native",
      threads: 2,
      parallelMinWork: 0,
      initialBytes: 2 ** 32 + (64 << 20),
    });
    try {
      await k.ready();
      k.allocBytes(2 ** 32);
      const [rows, inDim, outDim] = [16, 256, 1024];
      const x = fill(k.allocF32(rows * inDim), 3);
      const w = fill(k.allocF32(outDim * inDim), 4);
      const got = k.allocF32(rows * outDim);
      assert.ok(x.byteOffset > 2 ** 32 && got.byteOffset > 2 ** 32);
      const want = new Float32Array(rows * outDim);
      ref.matmul(want, x, w, rows, inDim, outDim);
      // Until the worker took a job: its arguments (offsets past 2^32) come through the control block.
      // (On a loaded machine the main thread can claim every chunk many calls in a row.)
      for (const until = Date.now() + 10_000; k.workerJobs === 0 && Date.now() < until; )
        k.matmul(got, x, w, rows, inDim, outDim);
      assertAllClose(got, want, { rtol: 1e-4, atol: 1e-5, message: "matmul past 4 GiB" });
      const [numHeads, numKvHeads, headDim, pageSize] = [4, 2, 8, 4];
      const pool = new Uint16Array(
        k.buffer(),
        k.allocBytes(6 * 2 * pageSize * numKvHeads * headDim * 2),
        6 * 2 * pageSize * numKvHeads * headDim,
      );
      const seq = { blockTable: Int32Array.of(5, 1, 3), rowStart: 0, rows: 9, startPos: 0 };
      const kv = fill(k.allocF32(9 * numKvHeads * headDim), 5);
      k.storeKv(pool, kv, kv, [seq], 1, 0, 1, numKvHeads, headDim, pageSize, 1);
      const q = fill(k.allocF32(9 * numHeads * headDim), 6);
      const out = k.allocF32(q.length);
      const wantOut = new Float32Array(q.length);
      const scratch = new Float64Array(64);
      k.pagedAttentionBatch(
        out,
        q,
        pool,
        [seq],
        1,
        scratch,
        0,
        1,
        numHeads,
        numKvHeads,
        headDim,
        pageSize,
        1,
      );
      ref.pagedAttentionBatch(
        wantOut,
        q,
        pool,
        [seq],
        1,
        scratch,
        0,
        1,
        numHeads,
        numKvHeads,
        headDim,
        pageSize,
        1,
      );
      assertAllClose(out, wantOut, { rtol: 1e-4, atol: 1e-5, message: "attention past 4 GiB" });
      assert.equal(k.fallbackCalls, 0);
      assert.ok(k.workerJobs > 0, "the worker took part");
    } finally {
      await k.close();
    }
  });
});

describe("the relaxed-SIMD build on each Node version", () => {
  it("validates without any V8 flag from Node 22 on (Node 20 needs --experimental-wasm-relaxed-simd)", async () => {
    const { spawnSync } = await import("node:child_process");
    // A fresh process: this one may have set the flag already (wasmModule(true) does on Node 20).
    const script = `const b = require("node:fs").readFileSync(${JSON.stringify(new URL("./kernels-fma.wasm", import.meta.url).pathname)});
process.stdout.write(String(WebAssembly.validate(b)));`;
    const run = spawnSync(process.execPath, ["-e", script], { encoding: "utf8" });
    assert.equal(run.status, 0, run.stderr);
    const major = Number(process.versions.node.split(".")[0]);
    assert.equal(run.stdout, String(major >= 22), `Node ${process.version}`);
  });
});
