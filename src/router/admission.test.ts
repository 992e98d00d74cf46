import assert from "node:assert/strict";
import { test } from "node:test";
import { admit, effectiveContextLength } from "./admission.js";

test("effectiveContextLength() is the minimum of model window, --max-model-len and pool", () => {
  assert.equal(effectiveContextLength({ maxPositionEmbeddings: 2048, poolTokens: 4096 }), 2048);
  assert.equal(
    effectiveContextLength({ maxPositionEmbeddings: 2048, maxModelLen: 512, poolTokens: 4096 }),
    512,
  );
  assert.equal(
    effectiveContextLength({ maxPositionEmbeddings: 2048, maxModelLen: 4000, poolTokens: 1024 }),
    1024,
  );
});

test("admit() refuses prompt + max_tokens over the limit and states both numbers", () => {
  const result = admit(2041, 64, 2048);
  assert.equal(result.ok, false);
  if (result.ok) return;
  assert.equal(result.error.code, "context_length_exceeded");
  assert.equal(result.error.param, "messages");
  assert.equal(
    result.error.message,
    "This model's maximum context length is 2048 tokens, but the request needs 2105 tokens " +
      "(2041 in the prompt + 64 for max_tokens): shorten the prompt or lower max_tokens",
  );
});

test("admit() accepts a request that fits exactly", () => {
  assert.deepEqual(admit(2000, 48, 2048), { ok: true, maxTokens: 48 });
});

test("admit() defaults max_tokens to what fits and still refuses a prompt that fills the context", () => {
  assert.deepEqual(admit(2000, null, 2048), { ok: true, maxTokens: 48 });
  const full = admit(2048, null, 2048, "prompt");
  assert.equal(full.ok, false);
  if (!full.ok) {
    assert.equal(full.error.param, "prompt");
    assert.match(full.error.message, /maximum context length is 2048 tokens, but the prompt has 2048 tokens/);
  }
});
