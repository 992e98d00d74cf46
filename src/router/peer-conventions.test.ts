/**
 * Three conventions the API tests of vLLM and SGLang expect (issue #34 item 4), on the router alone
 * (a scripted engine answering "Hello, world!" then EOS, the byte tokenizer; real HTTP on
 * 127.0.0.1, the official `openai` client): `finish_reason` on the chunk of the last token (the EOS
 * token's chunk is its own, without text), the client's stream helper still assembling the answer;
 * SGLang's `matched_stop` naming the EOS token id (vLLM's `stop_reason` stays null); vLLM's
 * `stream_options.continuous_usage_stats`, which needs `include_usage` and covers the first chunk.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { BYTE_EOS, byteTokenizer, ScriptedEngine } from "../../testing/scripted-engine.js";
import { TEST_OPERATOR_KEY } from "../../testing/start-server.js";
import { createLogger } from "../lib/logger.js";
import { TenantDirectory } from "./api-keys.js";
import { RouterServer } from "./router-server.js";

const MODEL = "tiny-test";
const KEY = "sk-conventions-0001";

type Choice = {
  index: number;
  delta?: { content?: string };
  text?: string;
  finish_reason: string | null;
  stop_reason?: unknown;
  matched_stop?: unknown;
};
type Chunk = { choices: Choice[]; usage?: { completion_tokens: number } | null };

describe("peer conventions (issue #34 item 4)", () => {
  let server: RouterServer;
  let client: OpenAI;
  const messages = [{ role: "user" as const, content: "hi" }];

  before(async () => {
    server = new RouterServer({
      engine: new ScriptedEngine(),
      tokenizer: byteTokenizer,
      model: {
        id: MODEL,
        maxPositionEmbeddings: 2048,
        eosTokenIds: [BYTE_EOS],
        defaults: { temperature: 0 },
      },
      tenants: TenantDirectory.parse(`${KEY} alpha`, "test keys"),
      logger: createLogger({ level: "silent" }),
      operatorKey: TEST_OPERATOR_KEY,
    });
    const url = await server.listen(0, "127.0.0.1");
    client = new OpenAI({ baseURL: `${url}/v1`, apiKey: KEY, maxRetries: 0 });
  });
  after(() => server.close());

  /** Every chunk of a streamed chat request. */
  async function chatChunks(body: Record<string, unknown>): Promise<Chunk[]> {
    const stream = await client.chat.completions.create({
      model: MODEL,
      messages,
      ...body,
      stream: true,
    } as OpenAI.ChatCompletionCreateParamsStreaming);
    const chunks: Chunk[] = [];
    for await (const chunk of stream) chunks.push(chunk as unknown as Chunk);
    return chunks;
  }

  test("GenerationReply puts finish_reason on the last token's chunk, chat and completions", async () => {
    const long = await chatChunks({ max_tokens: 4 });
    assert.deepEqual(
      long.map((c) => [c.choices[0]!.delta!.content, c.choices[0]!.finish_reason]),
      [
        ["", null],
        ["H", null],
        ["e", null],
        ["l", null],
        ["l", "length"],
      ],
    );
    // The stop string's last token ("w") shows no text: its chunk carries only the finish.
    const stopped = await chatChunks({ stop: [", w"] });
    assert.equal(stopped.map((c) => c.choices[0]!.delta!.content ?? "").join(""), "Hello");
    const last = stopped.at(-1)!.choices[0]!;
    assert.deepEqual(
      [last.delta, last.finish_reason, last.stop_reason, last.matched_stop],
      [{}, "stop", ", w", ", w"],
    );
    const text = await client.completions.create({
      model: MODEL,
      prompt: "abc",
      max_tokens: 3,
      stream: true,
    });
    const pieces: [string, string | null][] = [];
    for await (const chunk of text) pieces.push([chunk.choices[0]!.text, chunk.choices[0]!.finish_reason]);
    assert.deepEqual(pieces, [
      ["H", null],
      ["e", null],
      ["l", "length"],
    ]);
  });

  test("GenerationReply ends on EOS with a chunk of its own whose matched_stop is the EOS id; the openai stream helper assembles the answer", async () => {
    const chunks = await chatChunks({});
    assert.deepEqual(chunks.at(-1)!.choices, [
      {
        index: 0,
        delta: {},
        logprobs: null,
        finish_reason: "stop",
        stop_reason: null,
        matched_stop: BYTE_EOS,
      },
    ]);
    const whole = await client.chat.completions.create({ model: MODEL, messages });
    const choice = whole.choices[0] as unknown as Choice;
    assert.deepEqual([choice.stop_reason, choice.matched_stop], [null, BYTE_EOS]);
    for (const limit of [{}, { max_tokens: 5 }]) {
      const final = await client.chat.completions
        .stream({ model: MODEL, messages, ...limit })
        .finalChatCompletion();
      const alone = await client.chat.completions.create({ model: MODEL, messages, ...limit });
      assert.deepEqual(
        [final.choices[0]!.message.content, final.choices[0]!.finish_reason],
        [alone.choices[0]!.message.content, alone.choices[0]!.finish_reason],
      );
    }
  });

  test("stream_options.continuous_usage_stats counts on every chunk, the first included, only with include_usage", async () => {
    const withUsage = await chatChunks({
      max_tokens: 3,
      stream_options: { include_usage: true, continuous_usage_stats: true },
    });
    assert.deepEqual(
      withUsage.map((c) => c.usage?.completion_tokens),
      [0, 1, 2, 3, 3],
    );
    const without = await chatChunks({ max_tokens: 3, stream_options: { continuous_usage_stats: true } });
    assert.equal(without.length, 4);
    for (const chunk of without) assert.equal("usage" in chunk, false);
  });
});
