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
  assert.equal(refusal(() => parseChatRequest({ ...chat, n: 65 })).param, "n");
  assert.equal(refusal(() => parseChatRequest({ ...chat, n: 0 })).param, "n");
  assert.equal(parseChatRequest({ ...chat, n: 64 }).n, 64);
  assert.equal(refusal(() => parseChatRequest({ ...chat, max_tokens: -1 })).param, "max_tokens");
  assert.equal(refusal(() => parseChatRequest({ ...chat, max_tokens: 1.5 })).param, "max_tokens");
  assert.equal(refusal(() => parseChatRequest({ ...chat, temperature: "hot" })).param, "temperature");
  assert.match(refusal(() => parseChatRequest([1])).message, /must be a JSON object: got an array/);
  assert.equal(refusal(() => parseChatRequest({ model: "m" })).param, "messages");
  assert.equal(refusal(() => parseChatRequest({ ...chat, stop: ["a", "b", "c", "d", "e"] })).param, "stop");
});

test("parseCompletionRequest() takes prompt lists and echo; prompts × n is bounded", () => {
  assert.deepEqual(parseCompletionRequest({ model: "m", prompt: ["x"] }).prompts, ["x"]);
  assert.deepEqual(parseCompletionRequest({ model: "m", prompt: ["x", "y"], echo: true }).echoPrompts, [
    "x",
    "y",
  ]);
  assert.equal(refusal(() => parseCompletionRequest({ model: "m", prompt: ["x", "y"], n: 33 })).param, "n");
  assert.equal(refusal(() => parseCompletionRequest({ model: "m", prompt: [] })).param, "prompt");
});

test("fields that would change the answer and are not implemented are refused, naming the field", () => {
  const tool = { type: "function", function: { name: "f", parameters: {} } };
  const cases: [object, string, RegExp][] = [
    // Tools and OpenAI's deprecated functions are served (tool-request.test.ts), not both at once.
    [{ tools: [tool], functions: [{ name: "f" }] }, "functions", /not both/],
    [{ tool_choice: "required" }, "tool_choice", /tool_choice needs tools/],
    [
      { tools: [tool], tool_choice: { type: "function", function: { name: "g" } } },
      "tool_choice.function.name",
      /not in tools: g/,
    ],
    [{ function_call: { name: "f" } }, "function_call", /there are no functions/],
    [
      { tools: [tool], tool_choice: "required", response_format: { type: "json_object" } },
      "tool_choice",
      /cannot be combined with a structured output format/,
    ],
    [
      { response_format: { type: "structural_tag" } },
      "response_format.type",
      /"structural_tag" is not supported/,
    ],
    [{ response_format: { type: "json_schema" } }, "response_format.json_schema", /must be an object/],
    [{ logprobs: false, top_logprobs: 2 }, "top_logprobs", /needs logprobs/],
  ];
  for (const [extra, param, message] of cases) {
    const err = refusal(() => parseChatRequest({ ...chat, ...extra }));
    assert.equal(err.param, param, JSON.stringify(extra));
    assert.match(err.message, message);
  }
  // Their harmless forms are accepted.
  const harmless = {
    tools: [],
    tool_choice: "none",
    logit_bias: {},
    response_format: { type: "text" },
    top_logprobs: 0,
  };
  assert.deepEqual(parseChatRequest({ ...chat, ...harmless }).messages, [{ role: "user", content: "hi" }]);
  const suffix = refusal(() => parseCompletionRequest({ model: "m", prompt: "x", suffix: "y" }));
  assert.equal(suffix.param, "suffix");
  assert.equal(parseCompletionRequest({ model: "m", prompt: "x", suffix: "" }).prompts[0], "x");
});

test("the sampling controls become the request's logit controls and router options", () => {
  const parsed = parseCompletionRequest({
    model: "m",
    prompt: "x",
    max_tokens: 8,
    logit_bias: { "5": 100, "7": 0, "9": -1.5 },
    frequency_penalty: 0.5,
    presence_penalty: -0.25,
    repetition_penalty: 1.2,
    min_p: 0.05,
    min_tokens: 3,
    stop_token_ids: [4],
    ignore_eos: true,
    skip_special_tokens: false,
    include_stop_str_in_output: true,
  });
  assert.deepEqual(parsed.controls, {
    logitBias: [
      [5, 100],
      [9, -1.5],
    ],
    minTokens: 3,
    stopTokenIds: [4],
    repetitionPenalty: 1.2,
    frequencyPenalty: 0.5,
    presencePenalty: -0.25,
    minP: 0.05,
  });
  assert.deepEqual(
    [
      parsed.ignoreEos,
      parsed.stopTokenIds,
      parsed.minTokens,
      parsed.skipSpecialTokens,
      parsed.includeStopStr,
    ],
    [true, [4], 3, false, true],
  );
  // Neutral values make no controls.
  const neutral = parseChatRequest({
    ...chat,
    logit_bias: { "5": 0 },
    frequency_penalty: 0,
    repetition_penalty: 1,
    min_p: 0,
    min_tokens: 0,
  });
  assert.equal(neutral.controls, undefined);
  for (const [extra, param] of [
    [{ logit_bias: { five: 1 } }, "logit_bias.five"],
    [{ logit_bias: { "5": -101 } }, "logit_bias.5"],
    [{ presence_penalty: -3 }, "presence_penalty"],
    [{ repetition_penalty: -1 }, "repetition_penalty"],
    [{ min_p: 1.01 }, "min_p"],
    [{ min_tokens: 1.5 }, "min_tokens"],
    [{ stop_token_ids: [-1] }, "stop_token_ids[0]"],
    [{ min_tokens: 9, max_tokens: 8 }, "min_tokens"],
    [{ min_tokens: 9, max_completion_tokens: 8 }, "min_tokens"],
  ] as const) {
    assert.equal(refusal(() => parseChatRequest({ ...chat, ...extra })).param, param, JSON.stringify(extra));
  }
});

test("prompt and content forms we do not serve are named in the error", () => {
  assert.deepEqual(parseCompletionRequest({ model: "m", prompt: [1, 2, 3] }).prompts[0], [1, 2, 3]);
  assert.deepEqual(parseCompletionRequest({ model: "m", prompt: [[1, 2], [3]] }).prompts, [[1, 2], [3]]);
  for (const prompt of [[[1], "x"], [[]], [1, "x"], [-1], [1.5]]) {
    const err = refusal(() => parseCompletionRequest({ model: "m", prompt }));
    assert.equal(err.param?.split("[")[0], "prompt", JSON.stringify(prompt));
  }
  const image = [{ type: "image_url", image_url: { url: "http://127.0.0.1/a.png" } }];
  const err = refusal(() => parseChatRequest({ ...chat, messages: [{ role: "user", content: image }] }));
  assert.equal(err.param, "messages[0].content");
  assert.match(err.message, /image, audio and file parts are not supported/);
});

test("other extensions of vLLM and SGLang are refused unless neutral; unknown fields are ignored", () => {
  for (const [extra, param] of [
    [{ use_beam_search: true }, "use_beam_search"],
    [{ bad_words: ["x"] }, "bad_words"],
    [{ structural_tag: "{}" }, "structural_tag"],
    [{ guided_decoding_backend: "outlines" }, "guided_decoding_backend"],
    [{ guided_whitespace_pattern: " " }, "guided_whitespace_pattern"],
  ] as const) {
    const err = refusal(() => parseChatRequest({ ...chat, ...extra }));
    assert.equal(err.param, param);
    assert.match(err.message, /a vLLM\/SGLang extension\) is not supported/);
    assert.equal(refusal(() => parseCompletionRequest({ model: "m", prompt: "x", ...extra })).param, param);
  }
  const neutral = {
    repetition_penalty: 1,
    min_p: 0,
    ignore_eos: false,
    stop_token_ids: [],
    skip_special_tokens: true,
  };
  assert.equal(parseCompletionRequest({ model: "m", prompt: "x", ...neutral }).prompts[0], "x");
  assert.equal(
    parseCompletionRequest({ model: "m", prompt: "x", store: false, metadata: { a: "b" } }).prompts[0],
    "x",
  );
});

test("parseChatRequest() refuses a 100,000-deep guided_json with a short message, not a stack overflow", () => {
  let deep: unknown = {};
  for (let i = 0; i < 100_000; i++) deep = { a: deep };
  const err = refusal(() => parseChatRequest({ ...chat, guided_json: deep }));
  assert.equal(err.code, "invalid_request");
  assert.equal(err.param, "guided_json");
  assert.match(err.message, /^guided_json nests too deep to be a JSON Schema: got an object$/);
  const long = refusal(() => parseChatRequest({ ...chat, guided_regex: "x".repeat(100_000) }));
  assert.ok(long.message.length < 200, long.message);
});

test("parseChatRequest() bounds stop strings and names at most five problems of a body", () => {
  const stop = refusal(() => parseChatRequest({ ...chat, stop: ["x".repeat(257)] }));
  assert.equal(stop.param, "stop[0]");
  assert.match(stop.message, /at most 256 characters/);
  assert.deepEqual(parseChatRequest({ ...chat, stop: "x".repeat(256) }).stop, ["x".repeat(256)]);
  const many = refusal(() =>
    parseChatRequest({ ...chat, messages: Array.from({ length: 50 }, () => ({ role: "nobody" })) }),
  );
  assert.equal(many.param, "messages[0].role");
  assert.match(many.message, /; and 45 more$/);
});
