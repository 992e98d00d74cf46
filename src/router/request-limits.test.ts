import assert from "node:assert/strict";
import { test } from "node:test";
import { KvfenceError } from "../lib/errors.js";
import {
  checkJsonDepth,
  checkMessageCount,
  checkPromptBytes,
  defaultMaxBodyBytes,
  defaultMaxPromptBytes,
  requestLimits,
} from "./request-limits.js";

const bytes = (text: string) => Buffer.from(text);

function code(fn: () => void): string | null {
  try {
    fn();
    return null;
  } catch (err) {
    assert.ok(err instanceof KvfenceError);
    return err.code;
  }
}

test("checkJsonDepth() counts objects and arrays, not brackets inside strings or after escapes", () => {
  assert.equal(
    code(() => checkJsonDepth(bytes('{"a":[[1]]}'), 3)),
    null,
  );
  assert.equal(
    code(() => checkJsonDepth(bytes('{"a":[[[1]]]}'), 3)),
    "json_too_deep",
  );
  assert.equal(
    code(() => checkJsonDepth(bytes('{"a":"[[[[[[{{{{"}'), 1)),
    null,
  );
  assert.equal(
    code(() => checkJsonDepth(bytes('{"a":"\\"[[[[[[","b":"\\\\"}'), 1)),
    null,
  );
  assert.equal(
    code(() => checkJsonDepth(bytes('{"a":"\\\\",  "b":[[[1]]]}'), 3)),
    "json_too_deep",
  );
  // Siblings do not add up: depth is nesting, not count.
  assert.equal(
    code(() => checkJsonDepth(bytes(`[${"[],".repeat(1000)}[]]`), 2)),
    null,
  );
  // Multi-byte UTF-8 never looks like a bracket.
  assert.equal(
    code(() => checkJsonDepth(bytes('{"a":"ſ[ê{"}'), 1)),
    null,
  );
  const deep = bytes(`${"[".repeat(100_000)}${"]".repeat(100_000)}`);
  assert.equal(
    code(() => checkJsonDepth(deep, 64)),
    "json_too_deep",
  );
});

test("checkMessageCount() and checkPromptBytes() refuse with the OpenAI codes, naming the limit's flag", () => {
  const messages = Array.from({ length: 3 }, () => ({ role: "user", content: "a" }));
  assert.equal(
    code(() => checkMessageCount({ messages }, 3)),
    null,
  );
  assert.equal(
    code(() => checkMessageCount({ messages: [...messages, ...messages] }, 3)),
    "array_above_max_length",
  );
  assert.equal(
    code(() => checkMessageCount({ messages: "not a list" }, 3)),
    null,
  );
  assert.equal(
    code(() => checkMessageCount(null, 3)),
    null,
  );
  try {
    checkPromptBytes(2000, 1000, "prompt");
    assert.fail("refused");
  } catch (err) {
    assert.ok(err instanceof KvfenceError);
    assert.equal(err.code, "string_above_max_length");
    assert.equal(err.param, "prompt");
    assert.match(err.message, /2000 bytes, over this server's limit of 1000 bytes.*--max-prompt-bytes/);
  }
  assert.equal(
    code(() => checkPromptBytes(1000, 1000, "messages")),
    null,
  );
});

test("requestLimits() derives the prompt and answer limits from the context and the body limit from the prompt limit", () => {
  assert.equal(defaultMaxPromptBytes(2048), 64 * 1024);
  assert.equal(defaultMaxPromptBytes(131_072), 32 * 131_072);
  assert.equal(defaultMaxBodyBytes(64 * 1024), 2 * 64 * 1024 + 1024 * 1024);
  assert.deepEqual(requestLimits(2048), {
    maxBodyBytes: defaultMaxBodyBytes(64 * 1024),
    maxJsonDepth: 64,
    maxMessages: 2048,
    maxPromptBytes: 64 * 1024,
    maxResponseBytes: 64 * 1024 * 1024,
  });
  assert.equal(requestLimits(131_072).maxResponseBytes, 128 * 1024 * 1024);
  assert.equal(requestLimits(2048, { maxPromptBytes: 1000 }).maxBodyBytes, defaultMaxBodyBytes(1000));
  assert.equal(requestLimits(2048, { maxBodyBytes: 5 }).maxBodyBytes, 5);
});
