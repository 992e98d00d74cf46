/**
 * `prepareRequest` with a tokenizer that counts its calls: every limit is checked before the work
 * it bounds (depth before parsing, message count before validation, model and prompt bytes before
 * tokenization), and a request that passes is tokenized once.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { KvfenceError } from "../lib/errors.js";
import type { ChatMessage } from "./openai-schemas.js";
import { type PrepareContext, type PromptTokenizer, prepareRequest } from "./prepare-request.js";
import { requestLimits } from "./request-limits.js";

function counting(): PromptTokenizer & { calls: number } {
  return {
    calls: 0,
    vocabSize: 256,
    decode: (ids) => Buffer.from(Array.from(ids)).toString("utf8"),
    encodeChat(messages: readonly ChatMessage[]) {
      this.calls++;
      return Int32Array.from(Buffer.from(messages.map((m) => m.content).join("")));
    },
    encodePrompt(text: string) {
      this.calls++;
      return Int32Array.from(Buffer.from(text));
    },
  };
}

const limits = requestLimits(2048, { maxPromptBytes: 100, maxMessages: 4, maxJsonDepth: 8 });
const body = (value: unknown) => Buffer.from(typeof value === "string" ? value : JSON.stringify(value));

function refused(endpoint: "chat" | "completions", value: unknown, context: PrepareContext): KvfenceError {
  try {
    prepareRequest(endpoint, body(value), context);
  } catch (err) {
    assert.ok(err instanceof KvfenceError, String(err));
    return err;
  }
  assert.fail("expected a refusal");
}

test("prepareRequest() tokenizes a valid chat and completion once", () => {
  const tokenizer = counting();
  const context = { modelId: "m", tokenizer, limits };
  const chat = prepareRequest(
    "chat",
    body({ model: "m", messages: [{ role: "user", content: "hi" }] }),
    context,
  );
  assert.deepEqual([...chat.prompts[0]!], [...Buffer.from("hi")]);
  const text = prepareRequest("completions", body({ model: "m", prompt: "abc", max_tokens: 3 }), context);
  assert.deepEqual([...text.prompts[0]!], [...Buffer.from("abc")]);
  assert.equal(text.parsed.maxTokens, 3);
  assert.equal(tokenizer.calls, 2);
});

test("prepareRequest() refuses before the work each limit bounds, and never tokenizes what it refuses", () => {
  const tokenizer = counting();
  const context = { modelId: "m", tokenizer, limits };
  // Too deep and not even JSON: the depth scan runs before the parser.
  assert.equal(refused("chat", `{"model":"m","x":${"[".repeat(9)}`, context).code, "json_too_deep");
  assert.equal(refused("chat", '{"model":', context).code, "invalid_json");
  // Too many messages, and each of them invalid: counted before validation.
  const bad = Array.from({ length: 5 }, () => ({ role: "nobody" }));
  const many = refused("chat", { model: "m", messages: bad }, context);
  assert.equal(many.code, "array_above_max_length");
  assert.equal(many.param, "messages");
  assert.equal(
    refused("chat", { model: "other", messages: [{ role: "user", content: "x" }] }, context).code,
    "model_not_found",
  );
  const long = refused("completions", { model: "m", prompt: "é".repeat(51) }, context);
  assert.equal(long.code, "string_above_max_length");
  assert.match(long.message, /102 bytes/);
  const content = Array.from({ length: 2 }, () => ({ role: "user", content: "x".repeat(51) }));
  assert.equal(refused("chat", { model: "m", messages: content }, context).param, "messages");
  assert.equal(refused("completions", { model: "m", prompt: "" }, { ...context }).code, "invalid_request");
  assert.equal(tokenizer.calls, 1, "only the empty prompt reached the tokenizer");
});

test("prepareRequest() names a long unknown model in at most 64 characters", () => {
  const err = refused(
    "completions",
    { model: "x".repeat(10_000), prompt: "a" },
    { modelId: "m", tokenizer: counting(), limits },
  );
  assert.ok(err.message.length < 150, err.message);
});
