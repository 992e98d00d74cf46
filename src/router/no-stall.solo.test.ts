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
 * of its own at the lowest priority (testing/flood-worker.ts), standing in for another machine.
 * Before the fix the router tokenized on its event loop: the 15 MiB prompt alone held every other
 * request for seconds.
 */
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { Worker } from "node:worker_threads";
import OpenAI from "openai";
import type { FloodAnswer, FloodOptions } from "../../testing/flood-worker.js";
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

function p99(samples: number[]): number {
  const sorted = [...samples].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.ceil(0.99 * sorted.length) - 1)]!;
}

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

/** Mallory's client in a thread of its own: `round()` sends every attack at once. */
async function startFlood(list: readonly Attack[]) {
  const options: FloodOptions = {
    url: server.url,
    apiKey: MALLORY,
    requests: list.map(({ name, path, body }) => ({ name, path, body })),
  };
  const worker = new Worker(new URL("../../testing/flood-worker.js", import.meta.url), {
    workerData: options,
    transferList: list.map((a) => a.body.buffer as ArrayBuffer),
  });
  await new Promise((resolve) => worker.once("online", resolve));
  return {
    round: () =>
      new Promise<FloodAnswer[]>((resolve, reject) => {
        worker.once("message", resolve);
        worker.once("error", reject);
        worker.postMessage("go");
      }),
    close: () => worker.terminate(),
  };
}

const ROUNDS = 6;
const ATTEMPTS = 3;
const INTERVAL_MS = 40;
const MAX_IN_FLIGHT = 100;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

test("a tenant's 15 MiB prompt, 300,000 messages and 10 MB of nested JSON leave another tenant's p99 within 100 ms of its baseline", {
  timeout: 240_000,
}, async (t) => {
  const list = attacks();
  const expected = new Map(list.map((a) => [a.name, a]));
  const mallory = await startFlood(list);
  t.after(() => mallory.close());
  const victor = new OpenAI({ baseURL: server.baseURL, apiKey: VICTOR, maxRetries: 0, timeout: 120_000 });
  const ask = async (): Promise<void> => {
    const res = await victor.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "What is the access code of account 4242?" }],
      max_tokens: 1,
      temperature: 0,
    });
    assert.equal(res.choices.length, 1);
  };
  /**
   * Victor's load: one request every INTERVAL_MS on a fixed schedule that does not wait for the
   * answers (so a stall counts against every request it delays, not just one), each latency
   * counted from the request's scheduled time, until `more()` is false and at least `min` were sent.
   */
  const measure = async (more: () => boolean, min: number): Promise<number[]> => {
    const latencies: number[] = [];
    const pending: Promise<void>[] = [];
    let inFlight = 0;
    const start = performance.now();
    for (let i = 0; more() || i < min; i++) {
      const due = start + i * INTERVAL_MS;
      const wait = due - performance.now();
      if (wait > 0) await sleep(wait);
      if (inFlight >= MAX_IN_FLIGHT) {
        // Too far behind to send: the slot counts with the time it has waited already.
        latencies.push(performance.now() - due);
        continue;
      }
      inFlight++;
      pending.push(
        ask().then(
          () => {
            inFlight--;
            latencies.push(performance.now() - due);
          },
          (err: Error) => {
            // A failed request counts as infinitely slow (and is named in the report).
            inFlight--;
            failures.push(err.message);
            latencies.push(Number.POSITIVE_INFINITY);
          },
        ),
      );
    }
    await Promise.all(pending);
    return latencies;
  };
  const failures: string[] = [];
  await measure(() => false, 10); // warm-up

  const answered: FloodAnswer[] = [];
  /** Alone and under attack, in turns, so that a change in the machine's load hits both alike. */
  const attempt = async () => {
    const alone: number[] = [];
    const underAttack: number[] = [];
    for (let round = 0; round < ROUNDS; round++) {
      alone.push(...(await measure(() => false, 20)));
      let attacking = true;
      const answers = mallory.round().finally(() => {
        attacking = false;
      });
      underAttack.push(...(await measure(() => attacking, 20)));
      answered.push(...(await answers));
    }
    const slowest = (xs: number[]) =>
      [...xs]
        .sort((a, b) => b - a)
        .slice(0, 5)
        .map((x) => x.toFixed(0))
        .join(", ");
    const report =
      `victor's p99 ${p99(underAttack).toFixed(1)} ms under attack (${underAttack.length} requests; slowest ${slowest(underAttack)}), ` +
      `${p99(alone).toFixed(1)} ms alone (${alone.length}; slowest ${slowest(alone)})` +
      (failures.length === 0 ? "" : `; ${failures.length} failed: ${[...new Set(failures)].join("; ")}`);
    t.diagnostic(report);
    return { ok: p99(underAttack) <= p99(alone) + 100, report };
  };
  // A machine shared with other work can stall this process for its own reasons: the measurement
  // gets up to three attempts, and must pass one (a router that stalls fails every one).
  const reports: string[] = [];
  let passed = false;
  for (let i = 0; i < ATTEMPTS && !passed; i++) {
    const { ok, report } = await attempt();
    reports.push(report);
    passed = ok;
  }
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
