import assert from "node:assert/strict";
import { describe, it } from "node:test";
import {
  blockTable,
  greedyContinuation,
  layoutFor,
  logitsAtEveryPosition,
  makePool,
} from "../../testing/forward-driver.js";
import { allocationPerRound, leastAllocation } from "../../testing/heap-growth.js";
import { naiveForward, randomModel } from "../../testing/random-model.js";
import { maxAbsDiff } from "../kernels/assert-all-close.js";
import { type Kernels, referenceKernels } from "../kernels/kernels.js";
import { Prng } from "../lib/prng.js";
import { ForwardPass, type StepSequence } from "./forward.js";

function randomTokens(n: number, vocab: number, seed: number): Int32Array {
  const rng = new Prng(seed);
  return Int32Array.from({ length: n }, () => rng.nextInt(vocab));
}

function worstDiff(actual: Float32Array[], expected: Float64Array[]): number {
  assert.equal(actual.length, expected.length);
  let worst = 0;
  for (let i = 0; i < actual.length; i++)
    worst = Math.max(worst, maxAbsDiff(actual[i] as Float32Array, expected[i] as Float64Array));
  return worst;
}

describe("ForwardPass", () => {
  for (const architecture of ["llama", "qwen2"] as const) {
    it(`ForwardPass.step() matches a naive dense float64 forward at every position (${architecture}, GQA, shuffled pages, chunks)`, () => {
      const { config, weights } = randomModel({ architecture, seed: 11 });
      const layout = layoutFor(config, 4);
      const fp = new ForwardPass(config, weights, layout, { maxBatchTokens: 32, maxSequences: 4 });
      const tokens = randomTokens(23, config.vocabSize, 5);
      const expected = naiveForward(config, weights, tokens);
      for (const [shuffled, chunks] of [
        [false, [23]],
        [true, [23]],
        [true, [5, 3, 7]],
        [true, [1]],
      ] as const) {
        const pool = makePool(layout, 12);
        const table = blockTable(6, 12, shuffled);
        const got = logitsAtEveryPosition(fp, pool, table, tokens, chunks);
        const diff = worstDiff(got, expected);
        assert.ok(diff <= 1e-4, `shuffled=${shuffled} chunks=${chunks}: max |Δlogit| ${diff}`);
      }
    });
  }

  it("ForwardPass.step() gives each sequence of a mixed batch the logits it gets alone", () => {
    const { config, weights } = randomModel({ seed: 2 });
    const layout = layoutFor(config, 4);
    const fp = new ForwardPass(config, weights, layout, { maxBatchTokens: 40, maxSequences: 4 });
    const pool = makePool(layout, 24);
    const table = blockTable(24, 24, true);
    const tA = table.slice(0, 8);
    const tB = table.slice(8, 16);
    const tC = table.slice(16, 24);
    const a = randomTokens(13, config.vocabSize, 1);
    const b = randomTokens(9, config.vocabSize, 2);
    const c = randomTokens(20, config.vocabSize, 3);
    const v = config.vocabSize;
    // Prefill A (whole) and B (first 8) as one batch; C not yet.
    fp.step(pool, [
      { tokens: a, startPos: 0, blockTable: tA, logits: null },
      { tokens: b.slice(0, 8), startPos: 0, blockTable: tB, logits: null },
    ]);
    // Mixed step: decode A, last token of B's prefill, C's first chunk of 17 tokens.
    const la = new Float32Array(v);
    const lb = new Float32Array(v);
    const lc = new Float32Array(v);
    const extra = Int32Array.from([4]);
    fp.step(pool, [
      { tokens: extra, startPos: 13, blockTable: tA, logits: la },
      { tokens: b.slice(8), startPos: 8, blockTable: tB, logits: lb },
      { tokens: c.slice(0, 17), startPos: 0, blockTable: tC, logits: lc },
    ]);
    const expectA = naiveForward(config, weights, [...a, 4]).at(-1) as Float64Array;
    const expectB = naiveForward(config, weights, b).at(-1) as Float64Array;
    const expectC = naiveForward(config, weights, c.slice(0, 17)).at(-1) as Float64Array;
    assert.ok(maxAbsDiff(la, expectA) <= 1e-4, `A ${maxAbsDiff(la, expectA)}`);
    assert.ok(maxAbsDiff(lb, expectB) <= 1e-4, `B ${maxAbsDiff(lb, expectB)}`);
    assert.ok(maxAbsDiff(lc, expectC) <= 1e-4, `C ${maxAbsDiff(lc, expectC)}`);
  });

  it("ForwardPass.step() greedy continuation is the same with in-order and shuffled pages", () => {
    const { config, weights } = randomModel({ seed: 9, architecture: "qwen2" });
    const layout = layoutFor(config, 4);
    const fp = new ForwardPass(config, weights, layout, { maxBatchTokens: 16, maxSequences: 1 });
    const prompt = randomTokens(7, config.vocabSize, 4);
    const inOrder = greedyContinuation(fp, makePool(layout, 12), blockTable(10, 12, false), prompt, 30);
    const shuffled = greedyContinuation(fp, makePool(layout, 12), blockTable(10, 12, true), prompt, 30);
    assert.deepEqual(shuffled, inOrder);
    const all = [...prompt, ...inOrder];
    const expected = naiveForward(config, weights, all.slice(0, -1));
    for (let i = 0; i < inOrder.length; i++) {
      const row = expected[prompt.length - 1 + i] as Float64Array;
      let best = 0;
      for (let j = 1; j < row.length; j++) if ((row[j] as number) > (row[best] as number)) best = j;
      assert.equal(inOrder[i], best, `token ${i}`);
    }
  });

  it("ForwardPass.step() allocates nothing per decode step (~0 bytes over 2000 steps)", async () => {
    const { config, weights } = randomModel({ seed: 3, maxPositionEmbeddings: 4096 });
    const layout = layoutFor(config, 16);
    const fp = new ForwardPass(config, weights, layout, { maxBatchTokens: 8, maxSequences: 2 });
    const pool = makePool(layout, 2 * 140);
    const t1 = blockTable(140, 280, true).slice(0, 140);
    const t2 = blockTable(280, 280, true, 4).slice(140);
    const logits1 = new Float32Array(config.vocabSize);
    const logits2 = new Float32Array(config.vocabSize);
    const s1: StepSequence = { tokens: new Int32Array(1), startPos: 0, blockTable: t1, logits: logits1 };
    const s2: StepSequence = { tokens: new Int32Array(1), startPos: 0, blockTable: t2, logits: logits2 };
    const batch = [s1, s2];
    // Decode at positions 100..139 over and over (rewriting the same KV slots). One 12-byte
    // HeapNumber per step would show as 24 KB per round of 2000; the noise floor is a few KB.
    const least = leastAllocation(
      await allocationPerRound(
        (i) => {
          s1.startPos = 100 + (i % 40);
          s2.startPos = 100 + (i % 40);
          fp.step(pool, batch);
        },
        { warmup: 3000, steps: 2000, rounds: 5, below: 4096 },
      ),
    );
    assert.ok(least.bytes < 4096, `${least.bytes} bytes allocated over 2000 decode steps: ${least.sites}`);
  });

  it("ForwardPass.step() rejects a block table that does not cover the tokens, and pages outside the pool", () => {
    const { config, weights } = randomModel({ seed: 1 });
    const layout = layoutFor(config, 4);
    const fp = new ForwardPass(config, weights, layout, { maxBatchTokens: 16, maxSequences: 2 });
    const pool = makePool(layout, 4);
    const tokens = randomTokens(9, config.vocabSize, 1);
    assert.throws(
      () => fp.step(pool, [{ tokens, startPos: 0, blockTable: Int32Array.from([0, 1]), logits: null }]),
      {
        name: "KvfenceError",
        message: /Block table of sequence 0 is too short: 2 pages for 9 tokens/,
      },
    );
    assert.throws(
      () => fp.step(pool, [{ tokens, startPos: 0, blockTable: Int32Array.from([0, 1, 4]), logits: null }]),
      {
        message: /outside the pool: 4/,
      },
    );
    assert.throws(
      () =>
        fp.step(pool, [
          {
            tokens: randomTokens(17, 8, 1),
            startPos: 0,
            blockTable: Int32Array.from([0, 1, 2, 3, 0]),
            logits: null,
          },
        ]),
      {
        message: /maxBatchTokens: 17 > 16/,
      },
    );
    assert.throws(
      () =>
        fp.step(pool, [
          {
            tokens: Int32Array.from([config.vocabSize]),
            startPos: 0,
            blockTable: Int32Array.from([0]),
            logits: null,
          },
        ]),
      {
        code: "invalid_request",
      },
    );
    assert.throws(
      () =>
        fp.step(pool, [
          {
            tokens: Int32Array.from([1]),
            startPos: config.maxPositionEmbeddings,
            blockTable: new Int32Array(100),
            logits: null,
          },
        ]),
      {
        code: "context_length_exceeded",
      },
    );
  });

  it("ForwardPass constructor rejects a KV layout that does not match the model", () => {
    const { config, weights } = randomModel({ seed: 1 });
    assert.throws(
      () =>
        new ForwardPass(
          config,
          weights,
          { ...layoutFor(config), numKvHeads: 3 },
          { maxBatchTokens: 4, maxSequences: 1 },
        ),
      {
        code: "layout_mismatch",
      },
    );
  });
});

describe("ForwardPass.bufferBytes()", () => {
  it("ForwardPass fills its RoPE tables as far as its steps reach, and matches a naive forward past the first fill", () => {
    const { config, weights } = randomModel({ seed: 7, maxPositionEmbeddings: 4096 });
    const layout = layoutFor(config, 16);
    const fp = new ForwardPass(config, weights, layout, { maxBatchTokens: 512, maxSequences: 1 });
    // Not the whole window at start-up (each engine thread's start paid for it).
    assert.equal(fp.ropePositions, 1024);
    const tokens = randomTokens(1100, config.vocabSize, 9);
    const expected = naiveForward(config, weights, tokens);
    const pool = makePool(layout, 69);
    const table = blockTable(69, 69, true);
    const last = new Float32Array(config.vocabSize);
    for (let pos = 0; pos < tokens.length; pos += 512)
      fp.step(pool, [
        { tokens: tokens.slice(pos, pos + 512), startPos: pos, blockTable: table, logits: last },
      ]);
    assert.equal(fp.ropePositions, 2048);
    const diff = maxAbsDiff(last, expected[tokens.length - 1] as Float64Array);
    assert.ok(diff <= 1e-4, `max |Δlogit| at position 1099: ${diff}`);
  });

  it("ForwardPass.bufferBytes() equals the 64-byte-aligned bytes the constructor allocates", () => {
    const { config, weights } = randomModel({
      architecture: "qwen2",
      hiddenSize: 45,
      intermediateSize: 77,
      seed: 3,
    });
    let bytes = 0;
    const take = (n: number): number => {
      bytes += Math.ceil(n / 64) * 64;
      return n;
    };
    const counting: Kernels = {
      ...referenceKernels,
      allocF32: (n) => new Float32Array(take(n * 4) / 4),
      allocF64: (n) => new Float64Array(take(n * 8) / 8),
      allocI32: (n) => new Int32Array(take(n * 4) / 4),
    };
    const options = { maxBatchTokens: 37, maxSequences: 5 };
    const layout = {
      numLayers: config.numLayers,
      numKvHeads: config.numKvHeads,
      headDim: config.headDim,
      pageSize: 4,
    };
    new ForwardPass(config, weights, layout, { ...options, kernels: counting });
    assert.ok(bytes > 0);
    assert.equal(ForwardPass.bufferBytes(config, options), bytes);
  });
});
