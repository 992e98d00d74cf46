/**
 * Tool calls through the router's HTTP layer, with the official `openai` client assembling them:
 * the scripted engine (testing/scripted-engine.ts) writes the text a tool-calling model writes —
 * Qwen2.5's `<tool_call>` blocks for `auto`, the constrained JSON array for `required` — byte by
 * byte, and the router parses, streams and answers it. (A random-weight model does not write calls
 * by itself; the real engine's path is tools.e2e.test.ts.)
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { BYTE_EOS, byteTokenizer, ScriptedEngine } from "../../testing/scripted-engine.js";
import { createLogger } from "../lib/logger.js";
import { TenantDirectory } from "./api-keys.js";
import { RouterServer } from "./router-server.js";

const MODEL = "tiny-test";

const QWEN_OUTPUT =
  "Let me check.\n" +
  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' +
  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>';
const REQUIRED_OUTPUT = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]';

const WEATHER = {
  type: "function" as const,
  function: {
    name: "get_weather",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
};
const MESSAGES = [{ role: "user" as const, content: "Weather in Paris and Lyon?" }];

/** A router over `engine` with the byte tokenizer and a template that renders tools in Qwen2.5's (hermes) format. */
async function startRouter(engine: ScriptedEngine): Promise<{ server: RouterServer; client: OpenAI }> {
  const server = new RouterServer({
    engine,
    tokenizer: { ...byteTokenizer, toolSupport: { usesTools: true, format: "hermes" } },
    model: {
      id: MODEL,
      maxPositionEmbeddings: 2048,
      eosTokenIds: [BYTE_EOS],
      defaults: { temperature: 0 },
    },
    tenants: TenantDirectory.anonymous(),
    logger: createLogger({ level: "silent" }),
  });
  const url = await server.listen(0, "127.0.0.1");
  return { server, client: new OpenAI({ baseURL: `${url}/v1`, apiKey: "none", maxRetries: 0 }) };
}

describe("tool calls through the router (scripted engine, openai client)", () => {
  let server: RouterServer;
  let client: OpenAI;
  const engine = new ScriptedEngine({
    script: (request) => [
      ...Buffer.from(request.sampling.constraint === undefined ? QWEN_OUTPUT : REQUIRED_OUTPUT),
      BYTE_EOS,
    ],
  });
  before(async () => {
    ({ server, client } = await startRouter(engine));
  });
  after(() => server.close());

  const expected = [
    { name: "get_weather", arguments: { city: "Paris" } },
    { name: "get_weather", arguments: { city: "Lyon" } },
  ];
  const calls = (message: OpenAI.Chat.ChatCompletionMessage) =>
    (message.tool_calls ?? []).map((c) => {
      assert.equal(c.type, "function");
      assert.match(c.id, /^call_[A-Za-z0-9]{24}$/);
      const fn = (c as OpenAI.Chat.ChatCompletionMessageFunctionToolCall).function;
      return { name: fn.name, arguments: JSON.parse(fn.arguments) as unknown };
    });

  test("a streamed tool call is assembled by the client: content before it, the calls, finish_reason tool_calls", async () => {
    const stream = client.chat.completions.stream({ model: MODEL, messages: MESSAGES, tools: [WEATHER] });
    const pieces: string[] = [];
    stream.on("chunk", (chunk) => {
      for (const call of chunk.choices[0]?.delta.tool_calls ?? [])
        pieces.push(call.function?.name !== undefined ? `name${call.index}` : `args${call.index}`);
    });
    const final = await stream.finalChatCompletion();
    const choice = final.choices[0]!;
    assert.equal(choice.finish_reason, "tool_calls");
    assert.equal(choice.message.content, "Let me check.\n");
    assert.deepEqual(calls(choice.message), expected);
    // The name first, then the arguments in fragments (one per byte token), call after call.
    assert.equal(pieces[0], "name0");
    assert.ok(pieces.indexOf("name1") > pieces.lastIndexOf("args0"), pieces.join(" "));
    assert.ok(pieces.filter((p) => p === "args0").length > 1, "arguments in fragments");
  });

  test("the same answer not streamed, each of n=2 choices: message.tool_calls, content, finish_reason tool_calls", async () => {
    const answer = await client.chat.completions.create({
      model: MODEL,
      messages: MESSAGES,
      tools: [WEATHER],
      n: 2,
    });
    assert.equal(answer.choices.length, 2);
    for (const choice of answer.choices) {
      assert.equal(choice.finish_reason, "tool_calls");
      assert.equal(choice.message.content, "Let me check.\n");
      assert.deepEqual(calls(choice.message), expected);
    }
    const ids = answer.choices.flatMap((c) => (c.message.tool_calls ?? []).map((t) => t.id));
    assert.equal(new Set(ids).size, 4, "every call its own id");
  });

  test('tool_choice "required" sends the calls\' schema as the constraint and parses the array it makes', async () => {
    const answer = await client.chat.completions.create({
      model: MODEL,
      messages: MESSAGES,
      tools: [WEATHER],
      tool_choice: "required",
      parallel_tool_calls: false,
    });
    const constraint = engine.submitted.at(-1)!.sampling.constraint;
    assert.equal(constraint?.kind, "json_schema");
    assert.equal(JSON.parse((constraint as { schema: string }).schema).maxItems, 1);
    assert.equal(answer.choices[0]!.finish_reason, "tool_calls");
    assert.equal(answer.choices[0]!.message.content, null);
    assert.deepEqual(calls(answer.choices[0]!.message), [
      { name: "get_weather", arguments: { city: "Oslo" } },
    ]);
  });

  test("/v1/responses streams function_call items the client assembles", async () => {
    const stream = client.responses.stream({
      model: MODEL,
      input: "Weather in Paris and Lyon?",
      tools: [{ type: "function", strict: false, ...WEATHER.function }],
    });
    const response = await stream.finalResponse();
    const items = response.output.filter((item) => item.type === "function_call");
    assert.deepEqual(
      items.map((item) => ({ name: item.name, arguments: JSON.parse(item.arguments) as unknown })),
      expected,
    );
    for (const item of items) assert.match(item.call_id, /^call_/);
    const whole = await client.responses.create({
      model: MODEL,
      input: "Weather in Paris and Lyon?",
      tools: [{ type: "function", strict: false, ...WEATHER.function }],
    });
    assert.deepEqual(
      whole.output.filter((item) => item.type === "function_call").map((item) => item.name),
      ["get_weather", "get_weather"],
    );
    // The response repeats the tools in effect, as OpenAI's does.
    assert.deepEqual([whole.tool_choice, whole.parallel_tool_calls, whole.tools.length], ["auto", true, 1]);
  });
});

describe("OpenAI's deprecated functions through the router (scripted engine, openai client)", () => {
  let server: RouterServer;
  let client: OpenAI;
  before(async () => {
    ({ server, client } = await startRouter(
      new ScriptedEngine({ script: () => [...Buffer.from(QWEN_OUTPUT), BYTE_EOS] }),
    ));
  });
  after(() => server.close());

  test("functions are answered with message.function_call (the first call) and finish_reason function_call", async () => {
    const body = {
      model: MODEL,
      messages: MESSAGES,
      functions: [WEATHER.function],
      function_call: "auto" as const,
    };
    const answer = await client.chat.completions.create(body);
    const choice = answer.choices[0]!;
    assert.equal(choice.finish_reason, "function_call");
    assert.equal(choice.message.tool_calls, undefined);
    assert.equal(choice.message.function_call?.name, "get_weather");
    assert.deepEqual(JSON.parse(choice.message.function_call!.arguments), { city: "Paris" });
    const streamed = await client.chat.completions.stream(body).finalChatCompletion();
    assert.equal(streamed.choices[0]!.finish_reason, "function_call");
    assert.deepEqual(streamed.choices[0]!.message.function_call, choice.message.function_call);
  });
});
