import assert from "node:assert/strict";
import { test } from "node:test";
import { Ajv } from "ajv";
import type { KvfenceError } from "../lib/errors.js";
import { CHATML_TEMPLATE } from "../model/gen-model.js";
import { ChatTemplate } from "../tokenizer/tokenizer.js";
import { parseChatRequest } from "./openai-schemas.js";
import { detectToolCallFormat, ToolCallStream } from "./tool-call-parser.js";
import { resolveToolParsing, type ToolRequest, toolConstraint } from "./tool-request.js";

const ADD = {
  type: "function" as const,
  function: {
    name: "add",
    parameters: {
      type: "object",
      properties: { a: { type: "number" }, b: { type: "number", minimum: 0 } },
      required: ["a", "b"],
    },
  },
};
const NOOP = {
  type: "function" as const,
  function: { name: "noop", parameters: { type: "object", properties: {} } },
};

function tools(extra: Record<string, unknown>): ToolRequest {
  const parsed = parseChatRequest({
    model: "m",
    messages: [{ role: "user", content: "hi" }],
    tools: [ADD, NOOP],
    ...extra,
  });
  return parsed.tools!;
}

function validator(request: ToolRequest) {
  const constraint = toolConstraint(request);
  assert.ok(constraint !== null && constraint.kind === "json_schema");
  return new Ajv({ strict: false }).compile(JSON.parse(constraint.schema) as object);
}

test("toolConstraint() of tool_choice \"required\" is vLLM's array of {name, parameters}, each tool's schema its parameters", () => {
  const valid = validator(tools({ tool_choice: "required" }));
  assert.equal(
    valid([
      { name: "add", parameters: { a: 1, b: 2 } },
      { name: "noop", parameters: {} },
    ]),
    true,
  );
  assert.equal(valid([]), false, "at least one call");
  assert.equal(valid([{ name: "add", parameters: { a: 1, b: -2 } }]), false, "the tool's own schema");
  assert.equal(valid([{ name: "other", parameters: {} }]), false, "only the tools' names");
  // parallel_tool_calls false: one call at most.
  const one = validator(tools({ tool_choice: "required", parallel_tool_calls: false }));
  assert.equal(
    one([
      { name: "noop", parameters: {} },
      { name: "noop", parameters: {} },
    ]),
    false,
  );
});

test("toolConstraint() of a named function allows exactly one call of it", () => {
  const valid = validator(tools({ tool_choice: { type: "function", function: { name: "add" } } }));
  assert.equal(valid([{ name: "add", parameters: { a: 1, b: 2 } }]), true);
  assert.equal(valid([{ name: "noop", parameters: {} }]), false);
  assert.equal(
    valid([
      { name: "add", parameters: { a: 1, b: 2 } },
      { name: "add", parameters: { a: 1, b: 2 } },
    ]),
    false,
  );
});

test("toolConstraint() is null for none and auto; the constrained array parses into tool calls", () => {
  assert.equal(toolConstraint(tools({ tool_choice: "auto" })), null);
  assert.equal(toolConstraint(tools({ tool_choice: "none" })), null);
  const request = resolveToolParsing(tools({ tool_choice: "required" }), { usesTools: false, format: null });
  assert.deepEqual(request.parsing, { format: "json_array", maxCalls: Number.MAX_SAFE_INTEGER });
  const stream = new ToolCallStream(request.parsing!.format);
  stream.push('[{"name": "add", "parameters": {"a": 1, "b": 2}}]');
  stream.end();
  assert.deepEqual(
    stream.calls.map((c) => [c.name, JSON.parse(c.arguments)]),
    [["add", { a: 1, b: 2 }]],
  );
});

test("resolveToolParsing() refuses auto without a template that renders tools or a known format", () => {
  const auto = tools({});
  for (const [support, pattern] of [
    [{ usesTools: false, format: "hermes" }, /no tool support.*--chat-template/],
    [{ usesTools: true, format: null }, /--tool-call-parser/],
  ] as const) {
    assert.throws(
      () => resolveToolParsing(auto, support),
      (err: KvfenceError) => err.param === "tools" && pattern.test(err.message),
    );
  }
  assert.deepEqual(resolveToolParsing(auto, { usesTools: true, format: "hermes" }).parsing, {
    format: "hermes",
    maxCalls: Number.MAX_SAFE_INTEGER,
  });
  assert.equal(
    resolveToolParsing(tools({ parallel_tool_calls: false }), { usesTools: true, format: "mistral" }).parsing
      ?.maxCalls,
    1,
  );
});

test("parseChatRequest() validates tools and tool messages, naming the field", () => {
  const chat = { model: "m", messages: [{ role: "user", content: "hi" }] };
  const param = (body: object) => {
    try {
      parseChatRequest({ ...chat, ...body });
      return null;
    } catch (err) {
      return (err as KvfenceError).param;
    }
  };
  assert.equal(param({ tools: [{ type: "retrieval" }] }), "tools[0].type");
  assert.equal(
    param({ tools: [{ type: "function", function: { name: "bad name" } }] }),
    "tools[0].function.name",
  );
  assert.equal(param({ tools: [ADD, ADD] }), "tools[1].function.name");
  assert.equal(param({ tools: [ADD], tool_choice: "sometimes" }), "tool_choice");
  const call = {
    role: "assistant",
    content: null,
    tool_calls: [{ id: "c1", type: "function", function: { name: "add" } }],
  };
  assert.equal(param({ messages: [call] }), "messages[0].tool_calls[0].function.arguments");
  const parsed = parseChatRequest({
    ...chat,
    messages: [
      {
        role: "assistant",
        content: null,
        tool_calls: [{ id: "c1", type: "function", function: { name: "add", arguments: '{"a": 1}' } }],
      },
      { role: "tool", tool_call_id: "c1", content: "3" },
    ],
  });
  assert.deepEqual(parsed.messages, [
    {
      role: "assistant",
      content: "",
      tool_calls: [{ id: "c1", type: "function", function: { name: "add", arguments: { a: 1 } } }],
    },
    { role: "tool", content: "3", tool_call_id: "c1" },
  ]);
});

test("parseChatRequest() takes the deprecated functions, function_call and function messages as tools", () => {
  const parsed = parseChatRequest({
    model: "m",
    functions: [ADD.function],
    function_call: { name: "add" },
    messages: [
      { role: "user", content: "1 + 2?" },
      { role: "assistant", content: null, function_call: { name: "add", arguments: '{"a": 1, "b": 2}' } },
      { role: "function", name: "add", content: "3" },
    ],
  });
  assert.equal(parsed.tools?.legacy, true);
  assert.deepEqual(parsed.tools?.choice, { name: "add" });
  assert.equal(parsed.tools?.parallel, false);
  assert.deepEqual(parsed.messages.slice(1), [
    {
      role: "assistant",
      content: "",
      tool_calls: [
        { id: "call_legacy_1", type: "function", function: { name: "add", arguments: { a: 1, b: 2 } } },
      ],
    },
    { role: "tool", content: "3", tool_call_id: "call_legacy_1", name: "add" },
  ]);
  assert.throws(
    () =>
      parseChatRequest({
        model: "m",
        messages: [{ role: "user", content: "x" }],
        functions: [ADD.function],
        function_call: { name: "sub" },
      }),
    (err: KvfenceError) => err.param === "function_call.name",
  );
});

test("CHATML_TEMPLATE renders tools, earlier calls and their results in Qwen2.5's format, plain ChatML without them", () => {
  const template = new ChatTemplate(CHATML_TEMPLATE, {
    bosToken: null,
    eosToken: "<|im_end|>",
    label: "chatml",
  });
  const parsed = parseChatRequest({
    model: "m",
    tools: [ADD],
    messages: [
      { role: "user", content: "1 + 2?" },
      {
        role: "assistant",
        content: null,
        tool_calls: [
          { id: "c1", type: "function", function: { name: "add", arguments: '{"a": 1, "b": 2}' } },
        ],
      },
      { role: "tool", tool_call_id: "c1", content: "3" },
    ],
  });
  const text = template.render(parsed.messages, { tools: parsed.template.tools! });
  assert.ok(text.startsWith("<|im_start|>system\n# Tools\n"), text);
  assert.ok(
    text.includes(`<tools>\n${JSON.stringify(ADD).replaceAll(",", ", ").replaceAll(":", ": ")}\n</tools>`),
    text,
  );
  assert.ok(
    text.endsWith(
      '<|im_start|>user\n1 + 2?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n' +
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ),
    text,
  );
  assert.equal(detectToolCallFormat(CHATML_TEMPLATE), "hermes");
  assert.equal(
    template.render([{ role: "user", content: "hi" }]),
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
  );
});
