import assert from "node:assert/strict";
import { test } from "node:test";
import { KvfenceError } from "../lib/errors.js";
import { parseChatRequest, parseCompletionRequest } from "./openai-schemas.js";

function refusal(fn: () => unknown): KvfenceError {
  try {
    fn();
  } catch (err) {
    assert.ok(err instanceof KvfenceError);
    return err;
  }
  assert.fail("expected a KvfenceError");
}

const chat = { model: "m", messages: [{ role: "user", content: "hi" }] };

test("parseChatRequest() normalizes stop, max_completion_tokens, content parts and developer role", () => {
  const parsed = parseChatRequest({
    ...chat,
    messages: [
      { role: "developer", content: "be brief" },
      {
        role: "user",
        content: [
          { type: "text", text: "a" },
          { type: "text", text: "b" },
        ],
      },
    ],
    stop: "END",
    max_completion_tokens: 5,
    stream: true,
    stream_options: { include_usage: true },
  });
  assert.deepEqual(parsed.messages, [
    { role: "system", content: "be brief" },
    { role: "user", content: "ab" },
  ]);
  assert.deepEqual(parsed.stop, ["END"]);
  assert.equal(parsed.maxTokens, 5);
  assert.equal(parsed.includeUsage, true);
});

test("parseChatRequest() reports the path of a wrong type", () => {
  const err = refusal(() => parseChatRequest({ ...chat, messages: [{ role: "user", content: 5 }] }));
  assert.equal(err.code, "invalid_request");
  assert.equal(err.param, "messages[0].content");
  assert.match(err.message, /^Invalid request: messages\[0\]\.content: /);
});

test("parseChatRequest() refuses n > 1, negative or fractional max_tokens, and a non-object body", () => {
  assert.equal(refusal(() => parseChatRequest({ ...chat, n: 2 })).param, "n");
  assert.equal(refusal(() => parseChatRequest({ ...chat, max_tokens: -1 })).param, "max_tokens");
  assert.equal(refusal(() => parseChatRequest({ ...chat, max_tokens: 1.5 })).param, "max_tokens");
  assert.equal(refusal(() => parseChatRequest({ ...chat, temperature: "hot" })).param, "temperature");
  assert.match(refusal(() => parseChatRequest([1])).message, /must be a JSON object: got an array/);
  assert.equal(refusal(() => parseChatRequest({ model: "m" })).param, "messages");
  assert.equal(refusal(() => parseChatRequest({ ...chat, stop: ["a", "b", "c", "d", "e"] })).param, "stop");
});

test("parseCompletionRequest() accepts a one-element prompt list and refuses echo", () => {
  assert.equal(parseCompletionRequest({ model: "m", prompt: ["x"] }).prompt, "x");
  assert.equal(refusal(() => parseCompletionRequest({ model: "m", prompt: "x", echo: true })).param, "echo");
  assert.equal(refusal(() => parseCompletionRequest({ model: "m", prompt: ["x", "y"] })).param, "prompt");
});
