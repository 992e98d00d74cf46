/**
 * Tool calling end to end (issue #34) with the official `openai` client against the real server and
 * the bundled tiny-qwen2, whose ChatML template renders tools in Qwen2.5's format: a multi-turn
 * tool conversation (tools, an assistant's tool_calls, the tool's result) reaches the model as the
 * template renders it (the prompt's token count is the local rendering's), streamed and not, on
 * chat and /v1/responses; a template without tools is refused for tool_choice auto. A random-weight
 * model does not write calls by itself: with `auto`, vLLM's `guided_regex` makes it write the
 * `<tool_call>` block its template teaches, which the router parses as it streams and the client's
 * stream helper assembles; the parsers are tested on the models' own text in tool-call-parser.test.ts.
 */
import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { modelDir, startTestServer, type TestServer } from "../../testing/start-server.js";
import { loadChatTemplate, ModelTokenizer } from "../tokenizer/tokenizer.js";

const MODEL = "tiny-qwen2";

const WEATHER = {
  type: "function" as const,
  function: {
    name: "get_weather",
    description: "The weather in a city",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
};

/** A conversation where the assistant called a tool and the tool answered. */
const CONVERSATION: OpenAI.Chat.ChatCompletionMessageParam[] = [
  { role: "system", content: "Be brief." },
  { role: "user", content: "Weather in Paris?" },
  {
    role: "assistant",
    content: null,
    tool_calls: [
      { id: "call_1", type: "function", function: { name: "get_weather", arguments: '{"city": "Paris"}' } },
    ],
  },
  { role: "tool", tool_call_id: "call_1", content: "18 C, sunny" },
];

describe("tool calling end to end (tiny-qwen2, real engine, openai client)", { timeout: 120_000 }, () => {
  let server: TestServer;
  let client: OpenAI;
  const tokenizer = ModelTokenizer.fromFolder(modelDir(MODEL));
  const template = loadChatTemplate(modelDir(MODEL), tokenizer)!;
  /** The prompt's tokens as the template renders the conversation with `tools`. */
  const renderedWith = (tools: readonly object[]) =>
    tokenizer.encode(
      template.render(
        [
          { role: "system", content: "Be brief." },
          { role: "user", content: "Weather in Paris?" },
          {
            role: "assistant",
            content: "",
            tool_calls: [
              {
                id: "call_1",
                type: "function",
                function: { name: "get_weather", arguments: { city: "Paris" } },
              },
            ],
          },
          { role: "tool", tool_call_id: "call_1", content: "18 C, sunny" },
        ],
        { tools },
      ),
      { addSpecialTokens: false },
    ).length;
  const rendered = renderedWith([WEATHER]);

  before(async () => {
    server = await startTestServer({ model: modelDir(MODEL) });
    client = new OpenAI({ baseURL: server.baseURL, apiKey: "none", maxRetries: 0 });
  });
  after(() => server.close());

  test("a multi-turn tool conversation reaches the model through the template's tools, and is answered", async () => {
    const answer = await client.chat.completions.create({
      model: MODEL,
      messages: CONVERSATION,
      tools: [WEATHER],
      tool_choice: "auto",
      max_tokens: 6,
      temperature: 0,
    });
    assert.equal(answer.usage!.prompt_tokens, rendered);
    const choice = answer.choices[0]!;
    assert.ok(["stop", "length", "tool_calls"].includes(choice.finish_reason), choice.finish_reason);
    assert.equal(choice.message.role, "assistant");
    // Without tools the prompt is shorter: the tools were rendered.
    const plain = await client.chat.completions.create({
      model: MODEL,
      messages: CONVERSATION,
      max_tokens: 1,
    });
    assert.ok(plain.usage!.prompt_tokens < rendered, `${plain.usage!.prompt_tokens} < ${rendered}`);
  });

  test("a streamed answer with tools is assembled by the client's stream helper", async () => {
    const stream = client.chat.completions.stream({
      model: MODEL,
      messages: CONVERSATION,
      tools: [WEATHER],
      max_tokens: 6,
      temperature: 0,
      stream_options: { include_usage: true },
    });
    const final = await stream.finalChatCompletion();
    const whole = await client.chat.completions.create({
      model: MODEL,
      messages: CONVERSATION,
      tools: [WEATHER],
      max_tokens: 6,
      temperature: 0,
    });
    assert.equal(final.usage!.prompt_tokens, rendered);
    assert.equal(final.choices[0]!.message.content ?? "", whole.choices[0]!.message.content ?? "");
    assert.deepEqual(final.choices[0]!.message.tool_calls ?? [], whole.choices[0]!.message.tool_calls ?? []);
  });

  test("tool_choice auto: a streamed <tool_call> block is parsed and assembled by the client, then answered in a second turn", async () => {
    // A random-weight model writes no call by itself: vLLM's guided_regex makes it write the
    // Hermes block its template teaches, which the auto parser reads as it streams.
    const regex =
      '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Lyon|Oslo)"\\}\\}\\n</tool_call>';
    const first = await client.chat.completions
      .stream({
        model: MODEL,
        messages: [{ role: "user", content: "Weather in Paris?" }],
        tools: [WEATHER],
        max_tokens: 120,
        temperature: 1,
        stream_options: { include_usage: true },
        guided_regex: regex,
      } as Parameters<typeof client.chat.completions.stream>[0])
      .finalChatCompletion();
    const choice = first.choices[0]!;
    assert.equal(choice.finish_reason, "tool_calls");
    assert.equal(choice.message.content, null);
    const call = choice.message.tool_calls![0] as OpenAI.Chat.ChatCompletionMessageFunctionToolCall;
    assert.equal(call.function.name, "get_weather");
    assert.match((JSON.parse(call.function.arguments) as { city: string }).city, /^(Paris|Lyon|Oslo)$/);
    // The second turn: the call and its result go back; the model answers.
    const second = await client.chat.completions.create({
      model: MODEL,
      messages: [
        { role: "user", content: "Weather in Paris?" },
        choice.message as OpenAI.Chat.ChatCompletionMessageParam,
        { role: "tool", tool_call_id: call.id, content: "18 C, sunny" },
      ],
      tools: [WEATHER],
      max_tokens: 4,
    });
    assert.ok(second.choices[0]!.message.role === "assistant");
    assert.ok(
      second.usage!.prompt_tokens > first.usage!.prompt_tokens,
      "the call and its result are in the prompt",
    );
  });

  test("/v1/responses takes function tools and function_call / function_call_output items", async () => {
    const response = await client.responses.create({
      model: MODEL,
      instructions: "Be brief.",
      input: [
        { role: "user", content: "Weather in Paris?" },
        { type: "function_call", call_id: "call_1", name: "get_weather", arguments: '{"city": "Paris"}' },
        { type: "function_call_output", call_id: "call_1", output: "18 C, sunny" },
      ],
      tools: [{ type: "function", strict: false, ...WEATHER.function }],
      max_output_tokens: 6,
      temperature: 0,
    });
    // The function tool as chat's, with its `strict`.
    const asChat = { type: "function", function: { ...WEATHER.function, strict: false } };
    assert.equal(response.usage!.input_tokens, renderedWith([asChat]));
    assert.equal(response.output[0]!.type, "message");
  });

  test("tool_choice naming a function not in tools is refused with 400 naming it", async () => {
    await assert.rejects(
      client.chat.completions.create({
        model: MODEL,
        messages: CONVERSATION,
        tools: [WEATHER],
        tool_choice: { type: "function", function: { name: "get_time" } },
        max_tokens: 2,
      }),
      (err: InstanceType<typeof OpenAI.APIError>) =>
        err.status === 400 && err.param === "tool_choice.function.name" && /get_time/.test(err.message),
    );
  });
});

describe("tool calling with a chat template that renders no tools", { timeout: 120_000 }, () => {
  let server: TestServer;
  let dir: string;
  before(async () => {
    dir = mkdtempSync(join(tmpdir(), "kvfence-template-"));
    const file = join(dir, "chatml.jinja");
    writeFileSync(
      file,
      "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    );
    server = await startTestServer({ model: modelDir(MODEL), chatTemplate: file });
  });
  after(async () => {
    await server.close();
    rmSync(dir, { recursive: true, force: true });
  });

  test("tool_choice auto is refused with 400 saying the template has no tool support", async () => {
    const client = new OpenAI({ baseURL: server.baseURL, apiKey: "none", maxRetries: 0 });
    await assert.rejects(
      client.chat.completions.create({
        model: MODEL,
        messages: [{ role: "user", content: "hi" }],
        tools: [WEATHER],
        max_tokens: 2,
      }),
      (err: InstanceType<typeof OpenAI.APIError>) =>
        err.status === 400 &&
        err.param === "tools" &&
        /no tool support/.test(err.message) &&
        /--chat-template/.test(err.message),
    );
  });
});
