import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { blockTable, greedyContinuation, layoutFor, makePool } from "../../testing/forward-driver.js";
import { randomModel } from "../../testing/random-model.js";
import { ForwardPass } from "../model/forward.js";
import { generateTokens } from "./generate.js";

describe("generateTokens", () => {
  const model = randomModel({ seed: 4, architecture: "qwen2" });
  const prompt = Int32Array.from([3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6, 26, 43, 3, 38]);
  const greedy = { temperature: 0, topK: 0, topP: 1, seed: 0 };

  it("generateTokens() at temperature 0 streams the greedy continuation of the forward pass", () => {
    const streamed: number[] = [];
    const result = generateTokens(
      model,
      prompt,
      { ...greedy, maxTokens: 24, stopTokenIds: new Set() },
      (id) => streamed.push(id),
    );
    const layout = layoutFor(model.config, 4);
    const fp = new ForwardPass(model.config, model.weights, layout, { maxBatchTokens: 32, maxSequences: 1 });
    const expected = greedyContinuation(fp, makePool(layout, 16), blockTable(16, 16, true), prompt, 24);
    assert.deepEqual(result.tokens, expected);
    assert.deepEqual(streamed, expected);
    assert.equal(result.finishReason, "length");
  });

  it("generateTokens() stops before a stop token and reports finish reason stop", () => {
    const all = generateTokens(
      model,
      prompt,
      { ...greedy, maxTokens: 10, stopTokenIds: new Set() },
      () => {},
    ).tokens;
    const stopAt = all[4] as number;
    const firstIndex = all.indexOf(stopAt);
    const result = generateTokens(
      model,
      prompt,
      { ...greedy, maxTokens: 10, stopTokenIds: new Set([stopAt]) },
      () => {},
    );
    assert.deepEqual(result.tokens, all.slice(0, firstIndex));
    assert.equal(result.finishReason, "stop");
  });

  it("generateTokens() with a seed is reproducible when sampling", () => {
    const opts = { temperature: 1, topK: 20, topP: 0.9, maxTokens: 16, stopTokenIds: new Set<number>() };
    const a = generateTokens(model, prompt, { ...opts, seed: 7 }, () => {}).tokens;
    const b = generateTokens(model, prompt, { ...opts, seed: 7 }, () => {}).tokens;
    const c = generateTokens(model, prompt, { ...opts, seed: 8 }, () => {}).tokens;
    assert.deepEqual(a, b);
    assert.notDeepEqual(a, c);
  });

  it("generateTokens() refuses prompt plus max tokens beyond the model window", () => {
    assert.throws(
      () =>
        generateTokens(
          model,
          prompt,
          { ...greedy, maxTokens: model.config.maxPositionEmbeddings, stopTokenIds: new Set() },
          () => {},
        ),
      { code: "context_length_exceeded", message: /20 \+ 256 > 256/ },
    );
  });
});
