/**
 * The preparation workers with the bundled model's real tokenizer and chat template: they give the
 * same prompt tokens as preparing in this thread, send refusals back as KvfenceErrors with their
 * code and param, keep a lane free for small bodies while large ones are prepared, and serve tenants
 * fairly.
 */
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { modelDir } from "../../testing/start-server.js";
import { KvfenceError } from "../lib/errors.js";
import { loadChatTemplate, ModelTokenizer } from "../tokenizer/tokenizer.js";
import { routerTokenizer } from "./model-tokenizer.js";
import { LARGE_BODY_BYTES, PreparePool } from "./prepare-pool.js";
import { prepareRequest } from "./prepare-request.js";
import { requestLimits } from "./request-limits.js";

const MODEL = "kvfence-tiny";
const dir = modelDir(MODEL);
const limits = requestLimits(2048);
const body = (value: unknown) => Buffer.from(JSON.stringify(value));

let pool: PreparePool;
before(async () => {
  pool = await PreparePool.start({ modelDir: dir, modelId: MODEL, limits, threads: 2 });
});
after(() => pool?.close());

test("PreparePool prepares a chat and a completion exactly as this thread would", async () => {
  const tokenizer = ModelTokenizer.fromFolder(dir);
  const here = {
    modelId: MODEL,
    tokenizer: routerTokenizer(tokenizer, loadChatTemplate(dir, tokenizer)),
    limits,
  };
  const chat = body({
    model: MODEL,
    messages: [{ role: "user", content: "What is the access code?" }],
    stop: "x",
  });
  const text = body({ model: MODEL, prompt: "The access code is", max_tokens: 4 });
  for (const [endpoint, raw] of [
    ["chat", chat],
    ["completions", text],
  ] as const) {
    const there = await pool.prepare(endpoint, Buffer.from(raw));
    const local = prepareRequest(endpoint, raw, here);
    assert.deepEqual([...there.prompts[0]!], [...local.prompts[0]!], endpoint);
    assert.deepEqual(there.parsed, local.parsed, endpoint);
  }
});

test("PreparePool sends a refusal back with its code and param", async () => {
  await assert.rejects(
    pool.prepare("chat", body({ model: MODEL, messages: [{ role: "user", content: 5 }] })),
    (err: unknown) =>
      err instanceof KvfenceError && err.code === "invalid_request" && err.param === "messages[0].content",
  );
  await assert.rejects(
    pool.prepare("completions", body({ model: "other", prompt: "a" })),
    (err: unknown) => err instanceof KvfenceError && err.code === "model_not_found",
  );
});

test("PreparePool serves a small body at once while large ones queue for the other worker", async () => {
  const large = body({ model: MODEL, prompt: "b".repeat(limits.maxPromptBytes - 100), max_tokens: 1 });
  assert.ok(large.byteLength > LARGE_BODY_BYTES);
  const order: string[] = [];
  const larges = Array.from({ length: 4 }, (_, i) =>
    pool.prepare("completions", Buffer.from(large)).then(() => order.push(`large ${i}`)),
  );
  const small = pool
    .prepare("completions", body({ model: MODEL, prompt: "hi" }))
    .then(() => order.push("small"));
  await Promise.all([...larges, small]);
  assert.equal(order[0], "small", order.join(", "));
});

test("PreparePool serves another tenant's body before a tenant's backlog of them", async () => {
  // One worker, so the order bodies finish in is the order they were served in (with two, a
  // worker descheduled on a busy machine finishes its body after the other worker's next ones).
  const one = await PreparePool.start({ modelDir: dir, modelId: MODEL, limits, threads: 1 });
  try {
    const chat = (i: number) =>
      body({ model: MODEL, messages: [{ role: "user", content: `${"x ".repeat(700)}${i}` }], max_tokens: 1 });
    const order: string[] = [];
    // Twenty small bodies of tenant 1 queue for the worker; then one of tenant 2.
    const backlog = Array.from({ length: 20 }, (_, i) =>
      one.prepare("chat", chat(i), 1).then(() => order.push("flood")),
    );
    const other = one.prepare("chat", chat(99), 2).then(() => order.push("other"));
    await Promise.all([...backlog, other]);
    assert.ok(
      order.indexOf("other") <= 2,
      `the other tenant's body went third at the latest: ${order.join(" ")}`,
    );
  } finally {
    await one.close();
  }
});
