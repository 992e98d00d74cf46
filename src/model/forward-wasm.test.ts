/**
 * The fast path of the forward pass: ForwardPass with the WebAssembly SIMD kernels (two threads,
 * every matmul and attention call through the worker job protocol) against the naive float64
 * forward and against ForwardPass on the reference kernels.
 */
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { blockTable, layoutFor, logitsAtEveryPosition, makePool } from "../../testing/forward-driver.js";
import { allocationPerRound, leastAllocation } from "../../testing/heap-growth.js";
import { naiveForward, randomModel } from "../../testing/random-model.js";
import { maxAbsDiff } from "../kernels/assert-all-close.js";
import { WasmKernels } from "../kernels/wasm-kernels.js";
import { Prng } from "../lib/prng.js";
import { ForwardPass, type StepSequence } from "./forward.js";

function randomTokens(n: number, vocab: number, seed: number): Int32Array {
  const rng = new Prng(seed);
  return Int32Array.from({ length: n }, () => rng.nextInt(vocab));
}

describe("ForwardPass on WasmKernels", () => {
  let k: WasmKernels;
  before(async () => {
    k = await WasmKernels.create({ threads: 2, parallelMinWork: 0, initialBytes: 1 << 22 });
    await k.ready();
  });
  after(async () => {
    await k.close();
  });

  const shapes = [
    { architecture: "llama", numHeads: 6, numKvHeads: 2, headDim: 8, hiddenSize: 48 }, // group 3
    { architecture: "qwen2", numHeads: 4, numKvHeads: 4, headDim: 6, hiddenSize: 45 }, // group 1, odd sizes
    { architecture: "llama", numHeads: 8, numKvHeads: 2, headDim: 10, hiddenSize: 37 }, // group 4
  ] as const;
  for (const shape of shapes) {
    it(`ForwardPass.step() with WasmKernels matches a naive float64 forward at every position (${shape.architecture}, heads ${shape.numHeads}/${shape.numKvHeads}, headDim ${shape.headDim})`, () => {
      const { config, weights } = randomModel({ ...shape, intermediateSize: 77, seed: 11 });
      const layout = layoutFor(config, 4);
      const fast = new ForwardPass(config, k.placeWeights(weights), layout, {
        maxBatchTokens: 32,
        maxSequences: 4,
        kernels: k,
      });
      const slow = new ForwardPass(config, weights, layout, { maxBatchTokens: 32, maxSequences: 4 });
      const tokens = randomTokens(23, config.vocabSize, 5);
      const expected = naiveForward(config, weights, tokens);
      for (const chunks of [[23], [5, 3, 7], [1]]) {
        const pool = k.placeF32(makePool(layout, 12));
        const table = blockTable(6, 12, true);
        const got = logitsAtEveryPosition(fast, pool, table, tokens, chunks);
        const ref = logitsAtEveryPosition(slow, makePool(layout, 12), table, tokens, chunks);
        for (let i = 0; i < tokens.length; i++) {
          const g = got[i] as Float32Array;
          const dNaive = maxAbsDiff(g, expected[i] as Float64Array);
          const dRef = maxAbsDiff(g, ref[i] as Float32Array);
          assert.ok(dNaive <= 1e-4, `chunks=${chunks} position ${i}: max |Δlogit| vs naive ${dNaive}`);
          assert.ok(
            dRef <= 1e-4,
            `chunks=${chunks} position ${i}: max |Δlogit| vs reference kernels ${dRef}`,
          );
        }
      }
      assert.equal(k.fallbackCalls, 0, "every kernel call ran in WebAssembly");
    });
  }

  it("ForwardPass.step() with WasmKernels allocates nothing per decode step (~0 bytes over 2000 steps)", async () => {
    const { config, weights } = randomModel({ seed: 3, maxPositionEmbeddings: 4096 });
    const layout = layoutFor(config, 16);
    const fp = new ForwardPass(config, k.placeWeights(weights), layout, {
      maxBatchTokens: 8,
      maxSequences: 2,
      kernels: k,
    });
    const pool = k.placeF32(makePool(layout, 2 * 140));
    const t1 = blockTable(140, 280, true).slice(0, 140);
    const t2 = blockTable(280, 280, true, 4).slice(140);
    const s1: StepSequence = {
      tokens: new Int32Array(1),
      startPos: 0,
      blockTable: t1,
      logits: new Float32Array(config.vocabSize),
    };
    const s2: StepSequence = {
      tokens: new Int32Array(1),
      startPos: 0,
      blockTable: t2,
      logits: new Float32Array(config.vocabSize),
    };
    const batch = [s1, s2];
    // Positions 100..139 and 1000..1039: short attention and attention split across the threads.
    const least = leastAllocation(
      await allocationPerRound(
        (i) => {
          s1.startPos = 100 + (i % 40);
          s2.startPos = 1000 + (i % 40);
          fp.step(pool, batch);
        },
        { warmup: 3000, steps: 2000, rounds: 5, below: 4096 },
      ),
    );
    assert.ok(least.bytes < 4096, `${least.bytes} bytes allocated over 2000 decode steps: ${least.sites}`);
    assert.equal(k.fallbackCalls, 0);
  });
});
