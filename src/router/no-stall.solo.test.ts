/**
 * Acceptance (issue #22 item 1): one tenant's abusive bodies never make another tenant wait. While
 * tenant "mallory" sends the bodies of the issue — a 15 MiB prompt (as a chat message and as a
 * completion prompt), 300,000 messages, 10 MB of nested JSON — and, under the body limit, the
 * largest body that breaks each other limit (prompt bytes, message count, nesting depth) and an
 * over-long prompt, tenant "victor"'s small requests keep their latency: p99 no more than 100 ms
 * above victor's own, measured alone in the same test, in turns with the attack. Each abusive body
 * gets its 4xx naming the limit it broke (the over-long one `context_length_exceeded` with both
 * numbers).
 *
 * Real server on 127.0.0.1; victor uses the official `openai` client on a fixed schedule (open
 * loop, so that a stall counts against every request it delays); mallory's client runs in a thread
 * of its own at the lowest priority (testing/flood-worker.ts), standing in for another machine
 * (the measurement: testing/latency-under-attack.ts).
 * Before the fix the router tokenized on its event loop: the 15 MiB prompt alone held every other
 * request for seconds.
 */
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import OpenAI from "openai";
import type { FloodAnswer } from "../../testing/flood-worker.js";
import { compareLatency, startFlood } from "../../testing/latency-under-attack.js";
import { modelDir, startTestServer, type TestServer } from "../../testing/start-server.js";
import { requestLimits } from "./request-limits.js";

const MODEL = "kvfence-tiny";
const CHAT = "/v1/chat/completions";
const COMPLETIONS = "/v1/completions";
const MALLORY = "sk-mallory-000001";
const VICTOR = "sk-victor-0000001";

/**
 * The test server's limits: the prompt limit of a bigger-context deployment (512 KiB, that of a 16k
 * context), whose largest prompts take the tokenizer long enough to show on an event loop.
 */
const MAX_PROMPT_BYTES = 512 * 1024;
const LIMITS = requestLimits(2048, { maxPromptBytes: MAX_PROMPT_BYTES });

let server: TestServer;
before(async () => {
  server = await startTestServer({
    model: modelDir(MODEL),
    apiKeys: { [MALLORY]: "mallory", [VICTOR]: "victor" },
    // One kernel thread: a second one spins between matrices and would take the router's core.
    kernelThreads: 1,
    maxPromptBytes: MAX_PROMPT_BYTES,
  });
});
after(() => server?.close());

interface Attack {
  readonly name: string;
  readonly path: string;
  readonly body: Buffer;
  readonly code: string;
  readonly status: number;
  readonly message?: RegExp;
}

const chat = (messages: unknown[]) => Buffer.from(JSON.stringify({ model: MODEL, messages }));
const nested = (depth: number) =>
  Buffer.from(
    `{"model":"${MODEL}","messages":[{"role":"user","content":"hi"}],"x":${"[".repeat(depth)}${"]".repeat(depth)}}`,
  );

function attacks(): Attack[] {
  const huge = "a".repeat(15 * 1024 * 1024);
  const underBody = LIMITS.maxBodyBytes - 1024;
  const tooLarge = { code: "payload_too_large", status: 413 } as const;
  return [
    { name: "a 15 MiB chat message", path: CHAT, body: chat([{ role: "user", content: huge }]), ...tooLarge },
    {
      name: "a 15 MiB completion prompt",
      path: COMPLETIONS,
      body: Buffer.from(JSON.stringify({ model: MODEL, prompt: huge })),
      ...tooLarge,
    },
    {
      name: "300,000 messages",
      path: CHAT,
      body: chat(Array.from({ length: 300_000 }, () => ({ role: "user", content: "a" }))),
      ...tooLarge,
    },
    { name: "10 MB of nested JSON", path: CHAT, body: nested(5_000_000), ...tooLarge },
    {
      name: "a prompt just under the body limit",
      path: COMPLETIONS,
      body: Buffer.from(JSON.stringify({ model: MODEL, prompt: "a".repeat(underBody - 100) })),
      code: "string_above_max_length",
      status: 400,
    },
    {
      name: "as many messages as fit under the body limit",
      path: CHAT,
      body: chat(Array.from({ length: Math.floor(underBody / 30) }, () => ({ role: "user", content: "a" }))),
      code: "array_above_max_length",
      status: 400,
    },
    {
      name: "nested JSON just under the body limit",
      path: CHAT,
      body: nested(underBody / 2 - 100),
      code: "json_too_deep",
      status: 400,
    },
    {
      // Tokenized (in a preparation worker: a third of a second's work), then refused with both numbers.
      name: "an over-long prompt at the prompt limit",
      path: COMPLETIONS,
      body: Buffer.from(
        JSON.stringify({ model: MODEL, prompt: "b".repeat(MAX_PROMPT_BYTES), max_tokens: 1 }),
      ),
      code: "context_length_exceeded",
      status: 400,
      message:
        /^This model's maximum context length is 2048 tokens, but the request needs \d{6} tokens \(\d{6} in the prompt \+ 1 for max_tokens\)/,
    },
  ];
}

const ROUNDS = 6;

test("a tenant's 15 MiB prompt, 300,000 messages and 10 MB of nested JSON leave another tenant's p99 within 100 ms of its baseline", {
  timeout: 240_000,
}, async (t) => {
  const list = attacks();
  const expected = new Map(list.map((a) => [a.name, a]));
  const mallory = await startFlood(
    server.url,
    MALLORY,
    list.map(({ name, path, body }) => ({ name, path, body })),
  );
  t.after(() => mallory.close());
  const victor = new OpenAI({ baseURL: server.baseURL, apiKey: VICTOR, maxRetries: 0, timeout: 120_000 });
  const answered: FloodAnswer[] = [];
  const { passed, reports } = await compareLatency({
    ask: async () => {
      const res = await victor.chat.completions.create({
        model: MODEL,
        messages: [{ role: "user", content: "What is the access code of account 4242?" }],
        max_tokens: 1,
        temperature: 0,
      });
      assert.equal(res.choices.length, 1);
    },
    attack: async () => {
      answered.push(...(await mallory.round()));
    },
    rounds: ROUNDS,
    attempts: 3,
    boundMs: 100,
    report: (line) => t.diagnostic(line),
  });
  assert.ok(passed, `over 100 ms above the baseline in every attempt:\n${reports.join("\n")}`);
  // Each abusive body got its 4xx, naming the limit it broke.
  assert.equal(answered.length % (ROUNDS * list.length), 0);
  for (const { name, status, text } of answered) {
    const attack = expected.get(name)!;
    assert.equal(status, attack.status, `${name}: ${text}`);
    const { error } = JSON.parse(text) as { error: { code: string; message: string } };
    assert.equal(error.code, attack.code, `${name}: ${error.message}`);
    if (attack.message !== undefined) assert.match(error.message, attack.message, name);
  }
  // The server is healthy.
  assert.equal((await fetch(`${server.url}/health`)).status, 200);
});
