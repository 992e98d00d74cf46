/**
 * The reply object on its own, without HTTP: a request prepared and planned as the router does
 * (prepare-request.ts, generation-plan.ts), run by a scripted engine (testing/scripted-engine.ts),
 * its payloads taken with `next()` on each wake-up as the HTTP layer (answer-writer.ts) takes them.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import {
  BYTE_EOS,
  byteTokenizer,
  ScriptedEngine,
  type ScriptedEngineOptions,
} from "../../testing/scripted-engine.js";
import { KvfenceError } from "../lib/errors.js";
import type { Usage } from "./generation.js";
import { planChoices, RequestIds } from "./generation-plan.js";
import { GenerationReply } from "./generation-reply.js";
import { CHAT_RESPONSES } from "./openai-responses.js";
import { prepareRequest } from "./prepare-request.js";
import { requestLimits } from "./request-limits.js";
import { samplingParams } from "./request-sampling.js";

const MODEL = { id: "tiny-test", eosTokenIds: [BYTE_EOS] };

/** A chat request's reply, started; resolves once it has an outcome (or `until` says so). */
function run(body: object, engineOptions: ScriptedEngineOptions = {}) {
  const engine = new ScriptedEngine(engineOptions);
  const bytes = Buffer.from(JSON.stringify({ model: MODEL.id, ...body }));
  const { parsed, prompts } = prepareRequest("chat", bytes, {
    modelId: MODEL.id,
    tokenizer: byteTokenizer,
    limits: requestLimits(1024),
  });
  const base = { tenant: 0, sampling: samplingParams(parsed, MODEL), cacheSalt: null };
  const planned = planChoices(
    base,
    prompts.map((tokens) => ({ tokens, maxTokens: parsed.maxTokens ?? 64 })),
    parsed,
    new RequestIds(),
  );
  const events: string[] = [];
  const ended: { status: number; usage: Usage | null }[] = [];
  const reply = new GenerationReply({
    engine,
    tokenizer: byteTokenizer,
    modelId: MODEL.id,
    parsed,
    responses: CHAT_RESPONSES,
    planned,
    hooks: {
      tokens: () => {},
      failed: (_rid, internal) => internal,
      clientGone: () => events.push("client gone"),
      ended: (status, usage) => ended.push({ status, usage }),
    },
  });
  const payloads: Record<string, unknown>[] = [];
  const done = new Promise<void>((resolve) =>
    reply.start(() => {
      if (reply.streaming && !events.includes("headers")) events.push("headers");
      for (let p = reply.next(); p !== undefined; p = reply.next()) payloads.push(p);
      if (reply.outcome !== null) resolve();
    }),
  );
  return { engine, reply, payloads, events, ended, done };
}

type Chunk = { choices: { index: number; delta: { content?: string }; finish_reason: string | null }[] };

test("GenerationReply.next() yields each choice's chunks with its index, then the usage, and its outcome ends the stream", async () => {
  const { reply, payloads, events, ended, done } = run({
    messages: [{ role: "user", content: "hi" }],
    n: 2,
    stream: true,
    stream_options: { include_usage: true },
  });
  await done;
  assert.deepEqual(reply.outcome, { kind: "end" });
  assert.deepEqual(events, ["headers"]);
  const chunks = payloads as Chunk[];
  for (const index of [0, 1]) {
    const own = chunks.filter((c) => c.choices[0]?.index === index);
    assert.equal(own.map((c) => c.choices[0]!.delta.content ?? "").join(""), "Hello, world!");
    assert.equal(own.at(-1)!.choices[0]!.finish_reason, "stop");
  }
  const last = payloads.at(-1) as { choices: unknown[]; usage: { completion_tokens: number } };
  assert.deepEqual(last.choices, []);
  assert.equal(last.usage.completion_tokens, 2 * 14);
  assert.equal(ended.length, 1);
  assert.equal(ended[0]!.status, 200);
  assert.equal(ended[0]!.usage!.completionTokens, 2 * 14);
});

test("GenerationReply.outcome is the whole answer of every choice when not streamed", async () => {
  const { reply, payloads, events, done } = run({ messages: [{ role: "user", content: "hi" }], n: 2 });
  await done;
  assert.deepEqual(payloads, []);
  assert.deepEqual(events, []);
  const outcome = reply.outcome as {
    kind: string;
    body: { choices: { index: number; message: { content: string } }[] };
  };
  assert.equal(outcome.kind, "answer");
  assert.deepEqual(
    outcome.body.choices.map((c) => [c.index, c.message.content]),
    [
      [0, "Hello, world!"],
      [1, "Hello, world!"],
    ],
  );
});

test("GenerationReply fails as an error outcome before its first token, as a stream error payload after it", async () => {
  const failWith = { code: "internal" as const, message: "Decode node lost page 7" };
  const early = run({ messages: [{ role: "user", content: "hi" }], stream: true }, { failWith });
  await early.done;
  assert.equal(early.reply.outcome?.kind, "error");
  assert.ok((early.reply.outcome as { error: unknown }).error instanceof KvfenceError);
  assert.deepEqual(early.payloads, []);
  assert.deepEqual(early.events, []);
  assert.equal(early.ended[0]!.status, 500);

  const late = run({ messages: [{ role: "user", content: "hi" }], stream: true }, { failWith, failAfter: 3 });
  await late.done;
  assert.deepEqual(late.reply.outcome, { kind: "end" });
  assert.deepEqual(late.events, ["headers"]);
  assert.equal((late.payloads.at(-1) as { error: { code: string } }).error.code, "internal");
  assert.equal(late.ended[0]!.status, 500);
});

test("GenerationReply.abort() stops every choice in the engine, once, and ends with 499", async () => {
  const { engine, reply, events, ended } = run(
    { messages: [{ role: "user", content: "hi" }], n: 3, stream: true },
    { tokenDelayMs: 5 },
  );
  await new Promise((r) => setTimeout(r, 20));
  reply.abort();
  reply.abort();
  assert.deepEqual(engine.aborted.sort(), engine.submitted.map((r) => r.rid).sort());
  assert.deepEqual(events, ["headers", "client gone"]);
  assert.deepEqual(ended, [{ status: 499, usage: null }]);
  assert.equal(reply.outcome, null);
});
