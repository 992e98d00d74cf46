/**
 * The native glue's checks (native/src/addon.c): the WebAssembly sandbox kept a kernel inside its
 * memory for free, native code must check what it is handed. Each case hands the addon one bad
 * argument — an offset past the memory, a write outside the engine's region, a negative or huge
 * length, a block-table page past the pool, a segment record pointing outside — and expects a
 * RangeError naming it, with the memory (outputs included) untouched: nothing was computed.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { nativeAddon } from "./kernel-backend.js";

const MEMORY = 1 << 20;
const REGION = { start: 256 << 10, end: 768 << 10 };
const IN = REGION.start; // a good place in the region

type Call = (h: object, ...args: number[]) => void;

function setup() {
  const a = nativeAddon();
  const buffer = new SharedArrayBuffer(MEMORY);
  const bytes = new Uint8Array(buffer);
  for (let i = 0; i < MEMORY; i++) bytes[i] = (i * 131 + 7) & 0xff;
  const h = a.bind(new Uint8Array(buffer, 0, 16), MEMORY, REGION.start, REGION.end);
  const k = (name: string): Call => a[name] as Call;
  /** Asserts the call throws a RangeError matching `message` and changed no byte of the memory. */
  const refused = (name: string, args: number[], message: RegExp): void => {
    const before = bytes.slice();
    assert.throws(
      () => k(name)(h, ...args),
      (err: unknown) => err instanceof RangeError && message.test(err.message),
      `${name}(${args.join(", ")}) was not refused with ${message}`,
    );
    assert.ok(Buffer.from(bytes).equals(Buffer.from(before)), `${name}: the memory changed`);
  };
  return { buffer, h, k, refused };
}

describe("native kernel glue checks", () => {
  it("add() refuses reads past the memory, writes outside the region, negative, huge and fractional lengths", () => {
    const { refused, k, h, buffer } = setup();
    refused(
      "add",
      [IN, MEMORY - 16, IN, 8],
      /^Native add: a \[1048560, 1048560 \+ 32\) is outside the memory \[0, 1048576\)/,
    );
    refused("add", [IN, IN, 2 ** 40, 8], /^Native add: b \[1099511627776, .*outside the memory/);
    refused(
      "add",
      [REGION.start - 4, IN, IN, 8],
      /^Native add: out \[262140, .*outside the engine's region \[262144, 786432\)/,
    );
    refused("add", [REGION.end - 16, IN, IN, 8], /^Native add: out \[786416, .*outside the engine's region/);
    refused("add", [IN, IN, IN, -1], /^Native add: n must be an integer in \[0, 2147483647\]: -1/);
    refused(
      "add",
      [IN, IN, IN, 2 ** 40],
      /^Native add: n must be an integer in \[0, 2147483647\]: 1099511627776/,
    );
    refused("add", [IN, IN, IN, 1.5], /^Native add: n must be an integer.*: 1.5/);
    refused("add", [-64, IN, IN, 1], /^Native add: out must be an integer in \[0, /);
    refused("add", [IN + 2, IN, IN, 1], /^Native add: out at 262146 is not 4-byte aligned/);
    // The same call in range computes.
    const f = new Float32Array(buffer, IN, 2);
    k("add")(h, IN, IN, IN, 2);
    assert.ok(f.every((v) => Number.isFinite(v)));
  });

  it("the element-wise kernels refuse out-of-range outputs, inputs and RoPE positions", () => {
    const { refused, buffer } = setup();
    refused(
      "rmsnorm",
      [IN, IN, MEMORY - 8, 4, 1e-5, 1],
      /^Native rmsnorm: weight \[1048568, .*outside the memory/,
    );
    refused(
      "addBias",
      [IN, IN, 2 ** 20, 2 ** 20],
      /^Native addBias: out \[262144, 262144 \+ 4398046511104\) is outside/,
    );
    refused("swiglu", [0, IN, IN, 4], /^Native swiglu: out \[0, .*engine's region/);
    refused(
      "swigluPar",
      [IN, IN, IN, 4, REGION.end, 16],
      /^Native swigluPar: counter \[786432, .*engine's region/,
    );
    refused(
      "kvStore",
      [REGION.end - 4, IN, 4, 1],
      /^Native kvStore: dst \[786428, 786428 \+ 8\) is outside the engine's region/,
    );
    refused("kvStore", [IN, IN, 4, 3], /^Native kvStore: kvDtype must be an integer in \[0, 2\]: 3/);
    // rope: positions[1] = 40 is past tables of 32 positions (headDim 8: 4 doubles a position).
    new Int32Array(buffer, IN + 4096, 2).set([3, 40]);
    refused(
      "rope",
      [IN, IN + 4096, IN + 8192, IN + 16384, 2, 2, 8, 32 * 4 * 8],
      /^Native rope: positions\[1\] is outside the tables \(1024 bytes\): 40/,
    );
  });

  it("matmulPar() refuses a segment record pointing outside the region or the memory, or inconsistent", () => {
    const { refused, buffer, k, h } = setup();
    const [x, segs, out, w, counter] = [IN, IN + 4096, IN + 8192, 16, IN + 12288];
    const rec = new Float64Array(buffer, segs, 8);
    const call = (): number[] => [x, 0, 2, 32, segs, 2, counter, 8, 2, 0, 0];
    rec.set([out, w, 8, 0, out + 64, w, 8, 1]);
    k("matmulPar")(h, ...call()); // in range: computes
    rec.set([out, w, 8, 0, REGION.end - 16, w, 8, 1]);
    refused(
      "matmulPar",
      call(),
      /^Native matmulPar: segment 1 out \[786416, 786416 \+ 64\) is outside the engine's region/,
    );
    rec.set([out, w, 8, 0, out + 64, MEMORY - 64, 8, 1]);
    refused(
      "matmulPar",
      call(),
      /^Native matmulPar: segment 1 weight \[1048512, 1048512 \+ 1024\) is outside the memory/,
    );
    rec.set([out, w, 8, 0, out + 64, w, 8, 5]);
    refused("matmulPar", call(), /^Native matmulPar: segment 1's firstChunk must be 1: 5/);
    rec.set([out, w, 8, 0, out + 64, w, -8, 1]);
    refused("matmulPar", call(), /^Native matmulPar: segment outDim must be an integer in \[1, /);
    refused(
      "matmulPar",
      [x, 0, 2, 32, MEMORY - 8, 2, counter, 8, 2, 0, 0],
      /^Native matmulPar: segs \[1048568, .*outside the memory/,
    );
    refused(
      "matmulPar",
      [x, 0, 2, 33, segs, 2, counter, 8, 2, 0, 3],
      /^Native matmulPar: inDim must be a multiple of 32 for dtype 3: 33/,
    );
    // The k-quants (dtypes 5–7) take whole 256-weight blocks; no dtype past Q6_K.
    refused(
      "matmulPar",
      [x, 0, 2, 32, segs, 2, counter, 8, 2, 0, 5],
      /^Native matmulPar: inDim must be a multiple of 256 for dtype 5: 32/,
    );
    refused(
      "matmulPar",
      [x, 0, 2, 256, segs, 2, counter, 8, 2, 0, 8],
      /^Native matmulPar: dtype must be an integer in \[0, 7\]/,
    );
  });

  it("attentionPar() refuses a block-table page past the pool, an output outside the region and a small scratch", () => {
    const { refused, buffer } = setup();
    // 1 layer, 2 KV heads of 4 dims, pages of 4 tokens, f32: 256 bytes a page; a pool of 4 pages.
    const [numLayers, numHeads, numKvHeads, headDim, pageSize] = [1, 2, 2, 4, 4];
    const [out, q, pool, seqs, table, scratch, counter] = [
      IN,
      IN + 4096,
      IN + 8192,
      IN + 12288,
      IN + 16384,
      IN + 20480,
      IN + 24576,
    ];
    const poolBytes = 4 * 256;
    new Int32Array(buffer, table, 2).set([1, 3]);
    const rec = new Float64Array(buffer, seqs, 5);
    rec.set([0, 2, 5, table, 0]); // rows at positions 5 and 6: pages 0 and 1 of the table
    const args = (o = out, sb = 4096, pb = poolBytes): number[] => [
      o,
      q,
      pool,
      seqs,
      1,
      scratch,
      0,
      numLayers,
      numHeads,
      numKvHeads,
      headDim,
      pageSize,
      counter,
      1,
      0,
      0,
      1,
      0,
      pb,
      sb,
      0,
    ];
    new Int32Array(buffer, table, 2).set([1, 4]);
    refused(
      "attentionPar",
      args(),
      /^Native attentionPar: sequence 0's block table entry 1 is outside the pool's 4 pages: 4/,
    );
    new Int32Array(buffer, table, 2).set([-1, 3]);
    refused(
      "attentionPar",
      args(),
      /^Native attentionPar: sequence 0's block table entry 0 is outside the pool's 4 pages: -1/,
    );
    new Int32Array(buffer, table, 2).set([1, 3]);
    refused("attentionPar", args(out, 4096, 2 * 256), /entry 1 is outside the pool's 2 pages: 3/);
    refused(
      "attentionPar",
      args(REGION.end - 32),
      /^Native attentionPar: out \[786400, 786400 \+ 64\) is outside the engine's region/,
    );
    refused(
      "attentionPar",
      args(out, 16),
      /^Native attentionPar: scratch of 16 bytes is smaller than the 88 the longest context \(7\) needs/,
    );
    refused(
      "attentionPar",
      [...args().slice(0, 2), 0, ...args().slice(3)],
      /^Native attentionPar: pool \[0, .*engine's region/,
    );
    rec.set([0, 2, 5, MEMORY - 4, 0]);
    refused(
      "attentionPar",
      args(),
      /^Native attentionPar: sequence 0's block table \[1048572, 1048572 \+ 8\) is outside the memory/,
    );
  });

  it("bind() refuses a region outside the memory and kernels refuse a non-handle", () => {
    const a = nativeAddon();
    const buffer = new SharedArrayBuffer(MEMORY);
    const view = new Uint8Array(buffer, 0, 16);
    assert.throws(
      () => a.bind(view, MEMORY, 0, MEMORY + 64),
      /^RangeError: Native bind: regionEnd must be an integer in \[0, 1048576\]/,
    );
    assert.throws(
      () => a.bind(new Uint8Array(buffer, 16, 16), MEMORY, 0, 64),
      /view must be a Uint8Array at offset 0/,
    );
    assert.throws(
      () => a.bind(view, MEMORY, 0, 64, "avx9000"),
      /level is not one this build and CPU run: avx9000/,
    );
    assert.throws(
      () => (a.add as Call)({}, IN, IN, IN, 1),
      /the first argument is not a handle from bind\(\)/,
    );
  });
});
