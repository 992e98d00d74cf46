/**
 * `--reasoning-parser` through the router with answers that hold think tags for sure: a scripted
 * engine writes them a byte (a token) at a time — every tag cut across tokens — behind the real
 * router on 127.0.0.1, read with the official `openai` client. Chat (whole, streamed as vLLM
 * streams `reasoning_content`, `include_reasoning` / `separate_reasoning`), the Responses API (the
 * reasoning item, its events, the client's stream helper), completions untouched, and qwen3's
 * answer without a block.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { BYTE_EOS, byteTokenizer, ScriptedEngine } from "../../testing/scripted-engine.js";
import { TEST_OPERATOR_KEY } from "../../testing/start-server.js";
import { createLogger } from "../lib/logger.js";
import { TenantDirectory } from "./api-keys.js";
import { parseChatRequest } from "./openai-schemas.js";
import { worstCaseResponseBytes } from "./response-size.js";
import { parseResponsesRequest } from "./responses-request.js";
import { RouterServer } from "./router-server.js";

const MODEL = "tiny-test";
const KEY = "sk-reasoning-0001";
const THINKING = "<think>\nplan: greet 🙂 </th</think>\n\nHello!";
const REASONING = "\nplan: greet 🙂 </th";
const CONTENT = "\n\nHello!";

type Delta = { content?: string | null; reasoning_content?: string };

describe("reasoning parser through the router (qwen3)", () => {
  let server: RouterServer;
  let client: OpenAI;
  let url: string;

  before(async () => {
    // A prompt that says "plain" gets an answer without a think block.
    const script = (request: { promptTokens: Int32Array }) => {
      const plain = Buffer.from(request.promptTokens.filter((t) => t < 256)).includes("plain");
      return [...Buffer.from(plain ? "Just hi." : THINKING), BYTE_EOS];
    };
    server = new RouterServer({
      engine: new ScriptedEngine({ script }),
      tokenizer: byteTokenizer,
      model: {
        id: MODEL,
        maxPositionEmbeddings: 2048,
        eosTokenIds: [BYTE_EOS],
        defaults: { temperature: 0 },
        reasoningParser: "qwen3",
      },
      tenants: TenantDirectory.parse(`${KEY} alpha`, "test keys"),
      logger: createLogger({ level: "silent" }),
      operatorKey: TEST_OPERATOR_KEY,
    });
    url = await server.listen(0, "127.0.0.1");
    client = new OpenAI({ baseURL: `${url}/v1`, apiKey: KEY, maxRetries: 0 });
  });
  after(() => server.close());

  const ask = (content = "hi") => ({ model: MODEL, messages: [{ role: "user" as const, content }] });

  /** A streamed chat answer's deltas. */
  async function deltas(body: Record<string, unknown>): Promise<Delta[]> {
    const stream = await client.chat.completions.create({ ...ask(), ...body, stream: true });
    const out: Delta[] = [];
    for await (const chunk of stream)
      if (chunk.choices[0] !== undefined) out.push(chunk.choices[0].delta as Delta);
    return out;
  }

  test("GenerationReply splits the think block into reasoning_content, whole and streamed as vLLM", async () => {
    const whole = await client.chat.completions.create(ask());
    const message = whole.choices[0]!.message as { content: string; reasoning_content?: string | null };
    assert.deepEqual([message.reasoning_content, message.content], [REASONING, CONTENT]);

    const streamed = await deltas({});
    const reasoning = streamed.map((d) => d.reasoning_content ?? "").join("");
    const content = streamed.map((d) => d.content ?? "").join("");
    assert.deepEqual([reasoning, content], [REASONING, CONTENT]);
    // Reasoning deltas first, then content deltas; no delta carries both, none a tag.
    const kinds = streamed.slice(1).map((d) => (d.reasoning_content !== undefined ? "r" : "c"));
    assert.match(kinds.join(""), /^r+c+$/);
    for (const d of streamed) assert.ok(!(d.reasoning_content !== undefined && d.content !== undefined));
    // The openai client's stream helper still assembles the content.
    const final = await client.chat.completions.stream(ask()).finalChatCompletion();
    assert.equal(final.choices[0]!.message.content, CONTENT);
  });

  test("include_reasoning false drops the reasoning; separate_reasoning false leaves it in the content", async () => {
    const dropped = await client.chat.completions.create({ ...ask(), include_reasoning: false } as never);
    const message = (dropped as OpenAI.ChatCompletion).choices[0]!.message as { reasoning_content?: unknown };
    assert.deepEqual([message.reasoning_content, (message as { content: string }).content], [null, CONTENT]);
    const streamed = await deltas({ include_reasoning: false });
    assert.ok(streamed.every((d) => d.reasoning_content === undefined));
    assert.equal(streamed.map((d) => d.content ?? "").join(""), CONTENT);

    const together = await client.chat.completions.create({ ...ask(), separate_reasoning: false } as never);
    const raw = (together as OpenAI.ChatCompletion).choices[0]!.message;
    assert.equal(raw.content, THINKING);
    assert.equal("reasoning_content" in raw, false);
    assert.equal(
      (await deltas({ separate_reasoning: false })).map((d) => d.content ?? "").join(""),
      THINKING,
    );
  });

  test("qwen3: an answer without <think> is all content; completions keep the raw text", async () => {
    const plain = await client.chat.completions.create(ask("plain please"));
    const message = plain.choices[0]!.message as { content: string; reasoning_content?: string | null };
    assert.deepEqual([message.reasoning_content, message.content], [null, "Just hi."]);
    const text = await client.completions.create({ model: MODEL, prompt: "hi", max_tokens: 100 });
    assert.equal(text.choices[0]!.text, THINKING);
  });

  test("/v1/responses: a reasoning item before the message, whole and streamed with OpenAI's events", async () => {
    const request = { model: MODEL, input: "hi" };
    const whole = await client.responses.create(request);
    assert.deepEqual(
      whole.output.map((item) => item.type),
      ["reasoning", "message"],
    );
    const item = whole.output[0] as { id: string; content: { type: string; text: string }[] };
    assert.match(item.id, /^rs_/);
    assert.deepEqual(item.content, [{ type: "reasoning_text", text: REASONING }]);
    assert.equal(whole.output_text, CONTENT);

    const types: string[] = [];
    let reasoning = "";
    for await (const event of await client.responses.create({ ...request, stream: true })) {
      types.push(event.type);
      if (event.type === "response.reasoning_text.delta") reasoning += event.delta;
      if (event.type === "response.output_text.delta") assert.equal(event.output_index, 1);
    }
    assert.equal(reasoning, REASONING);
    const squeezed = types.filter((t, i) => t !== types[i - 1]);
    assert.deepEqual(squeezed, [
      "response.created",
      "response.in_progress",
      "response.output_item.added",
      "response.content_part.added",
      "response.reasoning_text.delta",
      "response.reasoning_text.done",
      "response.content_part.done",
      "response.output_item.done",
      "response.output_item.added",
      "response.content_part.added",
      "response.output_text.delta",
      "response.output_text.done",
      "response.content_part.done",
      "response.output_item.done",
      "response.completed",
    ]);
    const final = await client.responses.stream(request).finalResponse();
    assert.equal(final.output_text, CONTENT);
    assert.deepEqual(
      final.output.map((o) => o.type),
      ["reasoning", "message"],
    );
    // Without a block the message is output 0, as without a parser.
    const plain = await client.responses.create({ model: MODEL, input: "plain please" });
    assert.deepEqual(
      plain.output.map((o) => o.type),
      ["message"],
    );
  });

  test("worstCaseResponseBytes() bounds a streamed answer with reasoning, a token a frame", async () => {
    // Every token of the answer is a frame (the byte tokenizer); the tag's end splits one in two.
    const maxTokens = Buffer.byteLength(THINKING);
    const bodies = {
      chat: { ...ask(), max_tokens: maxTokens, stream: true },
      responses: { model: MODEL, input: "hi", max_output_tokens: maxTokens, stream: true },
    } as const;
    for (const endpoint of ["chat", "responses"] as const) {
      const body = bodies[endpoint];
      const path = endpoint === "chat" ? "/v1/chat/completions" : "/v1/responses";
      const res = await fetch(`${url}${path}`, {
        method: "POST",
        headers: { "content-type": "application/json", authorization: `Bearer ${KEY}` },
        body: JSON.stringify(body),
      });
      const bytes = Buffer.byteLength(await res.text());
      const parsed = endpoint === "chat" ? parseChatRequest(body) : parseResponsesRequest(body);
      const plan = {
        endpoint,
        parsed,
        prompts: [{ tokens: 16, maxTokens }],
        bodyBytes: JSON.stringify(body).length,
        modelId: MODEL,
      };
      const worst = worstCaseResponseBytes({ ...plan, reasoning: true }, byteTokenizer.tokenBounds);
      assert.ok(bytes <= worst, `${endpoint}: ${bytes} bytes, worst case ${worst}`);
      assert.ok(worstCaseResponseBytes(plan, byteTokenizer.tokenBounds) < worst);
    }
  });
});
