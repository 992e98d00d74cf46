/**
 * `--reasoning-parser` and `reasoning_effort` on the real server (real engine, the bundled
 * random-weight model kvfence-tiny, 127.0.0.1, the official `openai` client). A random-weight model
 * writes no think tags of its own, so this checks the wiring with whatever it writes (the tags
 * themselves, cut across tokens, are covered by reasoning-parser.test.ts on fixtures and by
 * reasoning-reply.test.ts through the router): with deepseek_r1 the answer starts inside the block,
 * so the reasoning and content of a greedy answer are the split of the raw text the same request
 * gets with `separate_reasoning: false`, whole and streamed, on chat and /v1/responses.
 * `reasoning_effort` reaches a template that reads it (the prompt grows by its text) and is refused
 * by name by one that does not.
 */
import assert from "node:assert/strict";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { modelDir, startTestServer, type TestServer } from "../../testing/start-server.js";
import { splitReasoning } from "./reasoning-parser.js";

const MODEL_DIR = modelDir("kvfence-tiny");
const ask = {
  model: "kvfence-tiny",
  messages: [{ role: "user" as const, content: "Think, then answer: what is 2 + 3?" }],
  temperature: 0,
  max_tokens: 24,
};

describe("reasoning on the real server (kvfence-tiny, deepseek_r1)", () => {
  let server: TestServer;
  let client: OpenAI;

  before(async () => {
    server = await startTestServer({ model: MODEL_DIR, kvPages: 128, reasoningParser: "deepseek_r1" });
    client = new OpenAI({ baseURL: server.baseURL, apiKey: "unused", maxRetries: 0 });
  });
  after(() => server.close());

  test("chat: reasoning_content and content are the split of the raw answer, whole and streamed", async () => {
    const raw = await client.chat.completions.create({ ...ask, separate_reasoning: false } as never);
    const text = (raw as OpenAI.ChatCompletion).choices[0]!.message.content!;
    assert.ok(text.length > 0);
    const want = splitReasoning("deepseek_r1", text);
    const whole = await client.chat.completions.create(ask);
    const message = whole.choices[0]!.message as { content: string; reasoning_content?: string | null };
    assert.deepEqual({ reasoning: message.reasoning_content, content: message.content }, want);

    let reasoning = "";
    let content = "";
    for await (const chunk of await client.chat.completions.create({ ...ask, stream: true })) {
      const delta = chunk.choices[0]?.delta as { content?: string; reasoning_content?: string } | undefined;
      reasoning += delta?.reasoning_content ?? "";
      content += delta?.content ?? "";
    }
    assert.deepEqual({ reasoning: reasoning === "" ? null : reasoning, content }, want);
  });

  test("/v1/responses: the reasoning item holds the split's reasoning, whole and streamed", async () => {
    const raw = await client.chat.completions.create({ ...ask, separate_reasoning: false } as never);
    const want = splitReasoning("deepseek_r1", (raw as OpenAI.ChatCompletion).choices[0]!.message.content!);
    const request = {
      model: ask.model,
      input: ask.messages[0]!.content,
      temperature: 0,
      max_output_tokens: 24,
    };
    for (const response of [
      await client.responses.create(request),
      await client.responses.stream(request).finalResponse(),
    ]) {
      const reasoning = response.output.find((o) => o.type === "reasoning") as
        | { content: { text: string }[] }
        | undefined;
      assert.equal(reasoning?.content[0]?.text ?? null, want.reasoning);
      assert.equal(response.output_text, want.content);
    }
  });

  test("reasoning_effort and reasoning.effort are refused by name when the template never reads them", async () => {
    const chat = await client.chat.completions.create({ ...ask, reasoning_effort: "high" }).catch((e) => e);
    assert.ok(chat instanceof OpenAI.BadRequestError);
    assert.equal(chat.param, "reasoning_effort");
    assert.match(
      chat.message,
      /reasoning_effort is not supported by this model: its chat template never reads/,
    );
    const responses = await client.responses
      .create({ model: ask.model, input: "hi", reasoning: { effort: "low" } })
      .catch((e) => e);
    assert.ok(responses instanceof OpenAI.BadRequestError);
    assert.equal(responses.param, "reasoning.effort");
    // The server goes on serving.
    assert.equal((await client.chat.completions.create({ ...ask, max_tokens: 2 })).choices.length, 1);
  });
});

describe("reasoning_effort reaches a chat template that reads it", () => {
  let dir: string;
  let server: TestServer;
  let client: OpenAI;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), "kvfence-effort-"));
    const own = JSON.parse(readFileSync(join(MODEL_DIR, "tokenizer_config.json"), "utf8"))
      .chat_template as string;
    const template = join(dir, "effort.jinja");
    writeFileSync(template, `{% if reasoning_effort %}Reasoning: {{ reasoning_effort }}\n{% endif %}${own}`);
    server = await startTestServer({ model: MODEL_DIR, kvPages: 128, chatTemplate: template });
    client = new OpenAI({ baseURL: server.baseURL, apiKey: "unused", maxRetries: 0 });
  });
  after(async () => {
    await server.close();
    rmSync(dir, { recursive: true, force: true });
  });

  test("reasoning_effort and reasoning.effort render into the prompt; chat_template_kwargs wins", async () => {
    const prompt = async (extra: object) =>
      (await client.chat.completions.create({ ...ask, max_tokens: 1, ...extra })).usage!.prompt_tokens;
    const none = await prompt({});
    const minimal = await prompt({ reasoning_effort: "minimal" });
    assert.equal(minimal, none + Buffer.byteLength("Reasoning: minimal\n"));
    assert.equal(
      await prompt({ reasoning_effort: "minimal", chat_template_kwargs: { reasoning_effort: "low" } }),
      none + Buffer.byteLength("Reasoning: low\n"),
    );
    const response = await client.responses.create({
      model: ask.model,
      input: ask.messages[0]!.content,
      max_output_tokens: 1,
      reasoning: { effort: "minimal" },
    });
    assert.equal(response.usage!.input_tokens, minimal);
    assert.equal(response.reasoning?.effort, "minimal");
  });
});
