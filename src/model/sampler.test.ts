import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { allocationPerRound, leastAllocation } from "../../testing/heap-growth.js";
import { Prng } from "../lib/prng.js";
import { argmax, GREEDY, MIN_TEMPERATURE, Sampler, type SamplerSettings } from "./sampler.js";

function logitsOf(probs: number[]): Float32Array {
  return Float32Array.from(probs.map((p) => Math.log(p)));
}

function histogram(
  sampler: Sampler,
  logits: Float32Array,
  params: SamplerSettings,
  n: number,
  seed = 1,
): number[] {
  const counts = new Array<number>(logits.length).fill(0);
  const rng = new Prng(seed);
  for (let i = 0; i < n; i++) counts[sampler.sample(logits, params, rng)]! += 1;
  return counts.map((c) => c / n);
}

describe("Sampler", () => {
  it("argmax() returns the first index of the largest logit", () => {
    assert.equal(argmax(Float32Array.from([1, 5, 3, 5])), 1);
    assert.equal(argmax(Float32Array.from([-2])), 0);
  });

  it("Sampler.sample() is greedy at temperature 0 and with top_k 1, without drawing from the PRNG", () => {
    const s = new Sampler(4);
    const logits = Float32Array.from([0.1, 0.3, 2, -1]);
    const rng = new Prng(5);
    assert.equal(s.sample(logits, GREEDY, rng), 2);
    assert.equal(s.sample(logits, { temperature: 1, topK: 1, topP: 1 }, rng), 2);
    assert.equal(rng.nextUint32(), new Prng(5).nextUint32());
  });

  it("Sampler.sample() is greedy below MIN_TEMPERATURE, where 1/T overflows (it used to hang with top_p)", () => {
    const s = new Sampler(4);
    const logits = Float32Array.from([0.1, 0.3, 2, -1]);
    for (const temperature of [5e-324, 3.5e-323, 1e-310, 1e-6]) {
      for (const topP of [1, 0.5, 0.005]) {
        assert.equal(
          s.sample(logits, { temperature, topK: 0, topP }, new Prng(1)),
          2,
          `T=${temperature} p=${topP}`,
        );
      }
    }
    assert.ok(MIN_TEMPERATURE <= 1e-5);
  });

  it("Sampler.sample() draws in proportion to softmax(logits / T)", () => {
    const s = new Sampler(4);
    const probs = [0.5, 0.25, 0.15, 0.1];
    const freq = histogram(s, logitsOf(probs), { temperature: 1, topK: 0, topP: 1 }, 40000);
    for (let i = 0; i < 4; i++)
      assert.ok(Math.abs((freq[i] as number) - (probs[i] as number)) < 0.015, `token ${i}: ${freq[i]}`);
    // T = 0.5 squares the probabilities (then renormalises).
    const z = probs.reduce((a, p) => a + p * p, 0);
    const hot = histogram(s, logitsOf(probs), { temperature: 0.5, topK: 0, topP: 1 }, 40000);
    for (let i = 0; i < 4; i++)
      assert.ok(
        Math.abs((hot[i] as number) - (probs[i] as number) ** 2 / z) < 0.015,
        `T=0.5 token ${i}: ${hot[i]}`,
      );
  });

  it("Sampler.sample() with top_k keeps only the k most likely tokens, renormalised", () => {
    const s = new Sampler(6);
    const probs = [0.05, 0.3, 0.1, 0.25, 0.2, 0.1];
    const freq = histogram(s, logitsOf(probs), { temperature: 1, topK: 3, topP: 1 }, 30000);
    assert.equal(freq[0], 0);
    assert.equal(freq[2], 0);
    assert.equal(freq[5], 0);
    assert.ok(Math.abs((freq[1] as number) - 0.3 / 0.75) < 0.015);
    assert.ok(Math.abs((freq[3] as number) - 0.25 / 0.75) < 0.015);
  });

  it("Sampler.sample() with top_p keeps the smallest prefix of the sorted distribution reaching p", () => {
    const s = new Sampler(5);
    const probs = [0.1, 0.4, 0.05, 0.3, 0.15];
    // Sorted: 0.4 (1), 0.3 (3), 0.15 (4) ... ; cumulative 0.4, 0.7, 0.85: p = 0.75 keeps {1, 3, 4}.
    const freq = histogram(s, logitsOf(probs), { temperature: 1, topK: 0, topP: 0.75 }, 30000);
    assert.equal(freq[0], 0);
    assert.equal(freq[2], 0);
    assert.ok(Math.abs((freq[1] as number) - 0.4 / 0.85) < 0.015);
    assert.ok(Math.abs((freq[4] as number) - 0.15 / 0.85) < 0.015);
    // Combined with top_k 2: {1, 3} (cumulative 0.7/0.7 ≥ 0.75 within the top 2).
    const both = histogram(s, logitsOf(probs), { temperature: 1, topK: 2, topP: 0.75 }, 20000);
    assert.equal((both[1] as number) + (both[3] as number), 1);
  });

  it("Sampler.sample() top_p over a large flat vocabulary gathers below the first threshold", () => {
    const vocab = 50000;
    const s = new Sampler(vocab);
    const logits = new Float32Array(vocab); // uniform: every token has p = 2e-5 < 1e-3
    logits[123] = 3;
    const freq = histogram(s, logits, { temperature: 1, topK: 0, topP: 0.5 }, 2000);
    const distinct = freq.filter((f) => f > 0).length;
    // p(123) = e³/(e³+49999) ≈ 4e-4: the nucleus holds about half the vocabulary.
    assert.ok(distinct > 500, `only ${distinct} distinct tokens`);
  });

  it("Sampler.sample() is reproducible from the seed", () => {
    const s = new Sampler(64);
    const rng = new Prng(3);
    const logits = new Float32Array(64);
    for (let i = 0; i < 64; i++) logits[i] = rng.nextGaussian();
    const params = { temperature: 0.8, topK: 20, topP: 0.9 };
    const run = (seed: number): number[] => {
      const r = new Prng(seed);
      return Array.from({ length: 50 }, () => s.sample(logits, params, r));
    };
    assert.deepEqual(run(42), run(42));
    assert.notDeepEqual(run(42), run(43));
  });

  it("Sampler.validate() rejects out-of-range parameters", () => {
    assert.throws(() => Sampler.validate({ temperature: -1, topK: 0, topP: 1 }), {
      code: "invalid_request",
      message: /Temperature.*: -1/,
    });
    assert.throws(() => Sampler.validate({ temperature: 1, topK: 1.5, topP: 1 }), { message: /Top-k/ });
    assert.throws(() => Sampler.validate({ temperature: 1, topK: 0, topP: 0 }), {
      message: /Top-p must be in \(0, 1\]: 0/,
    });
    Sampler.validate({ temperature: 0.7, topK: 40, topP: 0.95 });
  });

  it("Sampler.sample() allocates nothing per token (~0 bytes over 2000 draws with top_k and top_p)", async () => {
    const vocab = 4096;
    const s = new Sampler(vocab);
    const rng = new Prng(1);
    const logits = new Float32Array(vocab);
    for (let i = 0; i < vocab; i++) logits[i] = rng.nextGaussian() * 3;
    const a = { temperature: 0.9, topK: 50, topP: 0.9 };
    const b = { temperature: 1.1, topK: 0, topP: 0.8 };
    let sink = 0;
    const least = leastAllocation(
      await allocationPerRound(
        (i) => {
          sink += s.sample(logits, i % 2 === 0 ? a : b, rng);
        },
        { warmup: 3000, steps: 2000, rounds: 5, below: 4096 },
      ),
    );
    assert.ok(sink > 0);
    assert.ok(least.bytes < 4096, `${least.bytes} bytes allocated over 2000 draws: ${least.sites}`);
  });

  describe("Sampler.process() (logit controls, in vLLM's order)", () => {
    const history = (tokens: number[], promptLength: number) => ({
      tokens: Int32Array.from(tokens),
      promptLength,
      length: tokens.length,
      generated: tokens.length - promptLength,
    });

    it("adds logit_bias and holds the stop tokens back until min_tokens", () => {
      const s = new Sampler(4);
      const logits = Float32Array.from([1, 2, 3, 4]);
      s.process(logits, { logitBias: [[0, 10]], minTokens: 2, stopTokenIds: [2] }, history([1, 1], 1), [3]);
      assert.deepEqual(Array.from(logits), [11, 2, -Infinity, -Infinity]);
      const later = Float32Array.from([1, 2, 3, 4]);
      s.process(later, { minTokens: 2, stopTokenIds: [2] }, history([1, 1, 1], 1), [3]);
      assert.deepEqual(Array.from(later), [1, 2, 3, 4]);
    });

    it("repetition_penalty divides positive and multiplies negative logits of prompt and output tokens, once each", () => {
      const s = new Sampler(4);
      const logits = Float32Array.from([2, -2, 3, 1]);
      s.process(logits, { repetitionPenalty: 2 }, history([0, 1, 1, 0], 2), []);
      assert.deepEqual(Array.from(logits), [1, -4, 3, 1]);
    });

    it("frequency and presence penalties count the output only", () => {
      const s = new Sampler(4);
      const logits = Float32Array.from([5, 5, 5, 5]);
      s.process(logits, { frequencyPenalty: 1, presencePenalty: 0.5 }, history([3, 1, 1, 2], 1), []);
      assert.deepEqual(Array.from(logits), [5, 2.5, 3.5, 5]);
      // The scratch counts were reset: the same call again gives the same logits.
      const again = Float32Array.from([5, 5, 5, 5]);
      s.process(again, { frequencyPenalty: 1, presencePenalty: 0.5 }, history([3, 1, 1, 2], 1), []);
      assert.deepEqual(Array.from(again), [5, 2.5, 3.5, 5]);
    });

    it("min_p keeps only tokens with at least min_p of the top token's probability, drawing once", () => {
      const s = new Sampler(4);
      const probs = [0.5, 0.3, 0.15, 0.05];
      const freq = histogram(
        s,
        logitsOf(probs),
        { temperature: 1, topK: 0, topP: 1, controls: { minP: 0.5 } },
        20000,
      );
      assert.equal(freq[2], 0);
      assert.equal(freq[3], 0);
      assert.ok(Math.abs(freq[0]! - 0.625) < 0.02, `token 0: ${freq[0]}`);
      const rng = new Prng(9);
      s.sample(logitsOf(probs), { temperature: 1, topK: 0, topP: 1, controls: { minP: 0.9 } }, rng);
      const ref = new Prng(9);
      ref.next();
      assert.equal(rng.nextUint32(), ref.nextUint32());
    });

    it("Sampler.validate() refuses controls out of range, naming the field", () => {
      const base = { temperature: 1, topK: 0, topP: 1 };
      const cases: [object, string][] = [
        [{ logitBias: [[9, 1]] }, "logit_bias"],
        [{ logitBias: [[1, 101]] }, "logit_bias"],
        [{ stopTokenIds: [4] }, "stop_token_ids"],
        [{ minTokens: -1 }, "min_tokens"],
        [{ repetitionPenalty: 0 }, "repetition_penalty"],
        [{ frequencyPenalty: 2.5 }, "frequency_penalty"],
        [{ presencePenalty: Number.NaN }, "presence_penalty"],
        [{ minP: 1.5 }, "min_p"],
      ];
      for (const [controls, param] of cases) {
        assert.throws(() => Sampler.validate({ ...base, controls }, 4), { code: "invalid_request", param });
      }
      Sampler.validate({ ...base, controls: { logitBias: [[3, -100]], minP: 1, repetitionPenalty: 1.2 } }, 4);
    });
  });
});
