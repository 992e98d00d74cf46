import assert from "node:assert/strict";
import { test } from "node:test";
import {
  detectToolCallFormat,
  type ToolCallFormat,
  ToolCallStream,
  type ToolStreamDelta,
  templateUsesTools,
} from "./tool-call-parser.js";

interface Assembled {
  content: string;
  calls: { id: string; name: string; arguments: string }[];
  /** Each call's pieces in order: "name" first, then "args". */
  order: string[][];
}

/** Feeds `pieces` and assembles the deltas as an OpenAI client does. */
function assemble(format: ToolCallFormat, pieces: readonly string[], maxCalls?: number): Assembled {
  const stream = new ToolCallStream(format, maxCalls === undefined ? {} : { maxCalls });
  const out: Assembled = { content: "", calls: [], order: [] };
  const take = (d: ToolStreamDelta) => {
    out.content += d.content;
    for (const c of d.calls) {
      if (c.name !== undefined) {
        assert.equal(out.calls.length, c.index, "calls open in index order");
        assert.match(c.id!, /^call_[A-Za-z0-9]{24}$/);
        out.calls.push({ id: c.id!, name: c.name, arguments: c.arguments });
        out.order.push(["name"]);
      } else {
        out.calls[c.index]!.arguments += c.arguments;
        out.order[c.index]!.push("args");
      }
    }
  };
  for (const piece of pieces) take(stream.push(piece));
  take(stream.end());
  // The stream's own record agrees with what it showed.
  assert.deepEqual(
    stream.calls.map((c) => ({ ...c })),
    out.calls,
  );
  return out;
}

/** Whole, one character at a time, and in seeded random splits: the same content and calls. */
function parseEveryWay(format: ToolCallFormat, text: string, maxCalls?: number): Assembled {
  const whole = assemble(format, [text], maxCalls);
  const strip = (a: Assembled) => ({
    content: a.content,
    calls: a.calls.map(({ name, arguments: x }) => ({ name, x })),
  });
  const chars = assemble(format, [...text], maxCalls);
  assert.deepEqual(strip(chars), strip(whole), "fed one character at a time");
  for (const order of chars.order) assert.equal(order[0], "name", "the name comes first");
  let seed = 12345;
  for (let trial = 0; trial < 20; trial++) {
    const pieces: string[] = [];
    for (let i = 0; i < text.length; ) {
      seed = (seed * 1103515245 + 12345) >>> 0;
      const n = 1 + (seed % 7);
      pieces.push(text.slice(i, i + n));
      i += n;
    }
    assert.deepEqual(strip(assemble(format, pieces, maxCalls)), strip(whole), `split ${pieces.join("|")}`);
  }
  return whole;
}

const calls = (a: Assembled) => a.calls.map((c) => ({ name: c.name, arguments: JSON.parse(c.arguments) }));

// Qwen2.5-7B-Instruct's output for "What's the temperature in San Francisco now and tomorrow?"
// with Qwen's function-calling example tools (two calls, one block each).
const QWEN_TWO_CALLS =
  '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n</tool_call>\n' +
  '<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>';

test("ToolCallStream (hermes) parses Qwen2.5's <tool_call> blocks into calls, however the text is split", () => {
  const got = parseEveryWay("hermes", QWEN_TWO_CALLS);
  assert.equal(got.content, "");
  assert.deepEqual(calls(got), [
    { name: "get_current_temperature", arguments: { location: "San Francisco, CA, USA" } },
    { name: "get_temperature_date", arguments: { location: "San Francisco, CA, USA", date: "2024-10-01" } },
  ]);
  assert.notEqual(got.calls[0]!.id, got.calls[1]!.id);
});

test("ToolCallStream (hermes) keeps the text before a call as content", () => {
  const text =
    'I\'ll look that up for you.\n<tool_call>\n{"name": "search", "arguments": {"query": "6 Metropolitan cities in Korea", "limit": 3}}\n</tool_call>';
  const got = parseEveryWay("hermes", text);
  assert.equal(got.content, "I'll look that up for you.\n");
  assert.deepEqual(calls(got), [
    { name: "search", arguments: { query: "6 Metropolitan cities in Korea", limit: 3 } },
  ]);
});

test("ToolCallStream (hermes) leaves text without a call, and a marker without an object, as content", () => {
  const plain = "The weather is <b>fine</b>; no <tool_ call needed. a<tool_c";
  assert.deepEqual(parseEveryWay("hermes", plain), { content: plain, calls: [], order: [] });
  const broken = "see <tool_call> not json";
  assert.equal(parseEveryWay("hermes", broken).content, broken);
  const nameless = '<tool_call>\n{"arguments": {}}\n</tool_call>';
  assert.equal(parseEveryWay("hermes", nameless).calls.length, 0);
});

test("ToolCallStream (hermes) streams arguments that come before the name once the name is known", () => {
  const text =
    '<tool_call>\n{"arguments": {"city": "Oslo", "days": [1, 2]}, "name": "forecast"}\n</tool_call>';
  const got = parseEveryWay("hermes", text);
  assert.deepEqual(calls(got), [{ name: "forecast", arguments: { city: "Oslo", days: [1, 2] } }]);
});

test("ToolCallStream (hermes) keeps a string argument's braces, quotes and escapes as the model wrote them", () => {
  const text =
    '<tool_call>\n{"name": "run", "arguments": {"code": "if (a) { print(\\"}\\") }\\n"}}\n</tool_call>';
  const got = parseEveryWay("hermes", text);
  assert.deepEqual(calls(got), [{ name: "run", arguments: { code: 'if (a) { print("}") }\n' } }]);
});

test("ToolCallStream (hermes) shows a call cut by max_tokens with the arguments read so far", () => {
  const got = parseEveryWay("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "b');
  assert.deepEqual(
    got.calls.map((c) => [c.name, c.arguments]),
    [["f", '{"a": "b']],
  );
});

test("ToolCallStream with maxCalls 1 (parallel_tool_calls false) shows only the first call", () => {
  const got = parseEveryWay("hermes", QWEN_TWO_CALLS, 1);
  assert.deepEqual(
    calls(got).map((c) => c.name),
    ["get_current_temperature"],
  );
});

test("ToolCallStream (llama3_json) parses Llama 3.2's JSON call, bare or after <|python_tag|>", () => {
  // Llama-3.2-3B-Instruct with vLLM's tool_chat_template_llama3.2_json.
  const bare =
    '{"name": "get_current_weather", "parameters": {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}}';
  const got = parseEveryWay("llama3_json", bare);
  assert.equal(got.content, "");
  assert.deepEqual(calls(got), [
    { name: "get_current_weather", arguments: { city: "Dallas", state: "TX", unit: "fahrenheit" } },
  ]);
  // Llama 3.1 (with special tokens kept) opens its call with <|python_tag|>; several are separated by ";".
  const tagged =
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"tz": "CET"}}';
  assert.deepEqual(calls(parseEveryWay("llama3_json", tagged)), [
    { name: "get_weather", arguments: { city: "Paris" } },
    { name: "get_time", arguments: { tz: "CET" } },
  ]);
  const prose = "Dallas is sunny today. {not a call}";
  assert.equal(parseEveryWay("llama3_json", prose).content, prose);
});

test("ToolCallStream (mistral) parses [TOOL_CALLS] and its array of calls", () => {
  // Mistral-7B-Instruct-v0.3's output.
  const text =
    'Checking. [TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}, {"name": "get_current_weather", "arguments": {"location": "Lyon, France", "format": "celsius"}}]';
  const got = parseEveryWay("mistral", text);
  assert.equal(got.content, "Checking. ");
  assert.deepEqual(calls(got), [
    { name: "get_current_weather", arguments: { location: "Paris, France", format: "celsius" } },
    { name: "get_current_weather", arguments: { location: "Lyon, France", format: "celsius" } },
  ]);
});

test("ToolCallStream (json_array) parses the array tool_choice required makes the model write", () => {
  const text = '[{"name": "add", "parameters": {"a": 1.5, "b": -2}}, {"name": "noop", "parameters": {}}]';
  const got = parseEveryWay("json_array", text);
  assert.equal(got.content, "");
  assert.deepEqual(calls(got), [
    { name: "add", arguments: { a: 1.5, b: -2 } },
    { name: "noop", arguments: {} },
  ]);
});

test("detectToolCallFormat() and templateUsesTools() read a chat template's text", () => {
  assert.equal(detectToolCallFormat("{{ '<tool_call>\\n' }}{% for tool in tools %}"), "hermes");
  assert.equal(detectToolCallFormat("[TOOL_CALLS]"), "mistral");
  assert.equal(
    detectToolCallFormat(
      '<|start_header_id|>system<|end_header_id|> {"name": function name, "parameters": …}',
    ),
    "llama3_json",
  );
  assert.equal(detectToolCallFormat("{% for message in messages %}{{ message.content }}{% endfor %}"), null);
  assert.equal(templateUsesTools("{% if tools %}x{% endif %}"), true);
  assert.equal(templateUsesTools("{% for message in messages %}{% endfor %}"), false);
});
