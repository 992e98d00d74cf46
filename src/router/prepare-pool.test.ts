/**
 * The preparation workers with the bundled model's real tokenizer and chat template: they give the
 * same prompt tokens as preparing in this thread, send refusals back as KvfenceErrors with their
 * code and param, keep a lane free for small bodies while large ones are prepared, and serve tenants
 * fairly.
 */
import assert from "node:assert/strict";
import { copyFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { modelDir } from "../../testing/start-server.js";
import { KvfenceError } from "../lib/errors.js";
import { earlyWorker } from "../node/prestart-workers.js";
import { loadChatTemplate, ModelTokenizer } from "../tokenizer/tokenizer.js";
import { routerTokenizer } from "./model-tokenizer.js";
import { type EarlyPrepareWorkerData, LARGE_BODY_BYTES, PreparePool } from "./prepare-pool.js";
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

test("PreparePool.tokenBounds is the vocabulary's bounds as this thread walks them", () => {
  const here = routerTokenizer(ModelTokenizer.fromFolder(dir), null).tokenBounds;
  assert.ok(here.textBytes.length > 1 && (here.textBytes[1] ?? 0) > 0);
  assert.deepEqual(pool.tokenBounds, here);
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

test("PreparePool starts its other workers only once a body would wait for the first", async () => {
  const fresh = await PreparePool.start({ modelDir: dir, modelId: MODEL, limits, threads: 2 });
  try {
    assert.equal(fresh.startedWorkers, 1);
    await fresh.prepare("completions", body({ model: MODEL, prompt: "hi" }));
    assert.equal(fresh.startedWorkers, 1, "a small body the first worker took at once starts none");
    const large = body({ model: MODEL, prompt: "b".repeat(limits.maxPromptBytes - 100), max_tokens: 1 });
    const prepared = fresh.prepare("completions", large);
    assert.equal(fresh.startedWorkers, 2, "a large body starts the large lane's worker");
    await prepared;
  } finally {
    await fresh.close();
  }
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

/** Settles `promises` and returns the labels in the order they settled. */
async function settleOrder(promises: Record<string, Promise<unknown>>): Promise<string[]> {
  const order: string[] = [];
  await Promise.all(
    Object.entries(promises).map(([label, p]) =>
      p.then(
        () => order.push(label),
        () => order.push(label),
      ),
    ),
  );
  return order;
}

/** A chat body asking for a JSON schema of `n` optional string properties (compiling grows with n). */
function schemaBody(n: number): Buffer {
  const properties = Object.fromEntries(
    Array.from({ length: n }, (_, i) => [`field_${i}`, { type: "string" }]),
  );
  return body({
    model: MODEL,
    messages: [{ role: "user", content: "fill the form" }],
    response_format: {
      type: "json_schema",
      json_schema: { name: "form", schema: { type: "object", properties } },
    },
  });
}

test("PreparePool refuses a schema still compiling after GRAMMAR_COMPILE_MS and replaces its worker", async () => {
  // 3,000 optional properties: xgrammar takes seconds (a 1 MB schema: minutes).
  const heavy = pool.prepare("chat", schemaBody(3000), 1);
  const small = pool.prepare("completions", body({ model: MODEL, prompt: "hi", max_tokens: 2 }), 2);
  const order = await settleOrder({ heavy, small });
  assert.deepEqual(order, ["small", "heavy"], "the small body is not held behind the compilation");
  await assert.rejects(heavy, (err: unknown) => {
    assert.ok(err instanceof KvfenceError);
    assert.equal(err.code, "invalid_request");
    assert.equal(err.param, "response_format.json_schema.schema");
    assert.match(err.message, /^The JSON schema takes over \d+ ms to compile: send a simpler one/);
    return true;
  });
  // The replaced worker serves again.
  const again = await pool.prepare(
    "chat",
    body({ model: MODEL, messages: [{ role: "user", content: "x" }] }),
    1,
  );
  assert.ok(again.prompts[0]!.length > 0);
});

test("PreparePool answers a small body with a schema once its constraint compiled (as a job of the large lane)", async () => {
  const small = schemaBody(20);
  assert.ok(small.byteLength < LARGE_BODY_BYTES);
  const prepared = await pool.prepare("chat", small, 1);
  assert.equal(prepared.parsed.constraint?.kind, "json_schema");
  assert.ok(prepared.prompts[0]!.length > 0);
});

test("PreparePool refuses a grammar xgrammar cannot compile, naming the construct", async () => {
  await assert.rejects(
    pool.prepare("completions", body({ model: MODEL, prompt: "a", guided_grammar: "root ::= missing" })),
    (err: unknown) =>
      err instanceof KvfenceError &&
      err.code === "invalid_request" &&
      /^The grammar cannot be compiled: .*Rule "missing" is not defined/.test(err.message),
  );
});

/** A copy of the bundled model's tokenizer files whose byte tokens have other ids (b → 255 - b). */
function otherTokenizerFolder(): string {
  const other = mkdtempSync(join(tmpdir(), "kvfence-other-tokenizer-"));
  const json = JSON.parse(readFileSync(join(dir, "tokenizer.json"), "utf8")) as {
    model: { vocab: Record<string, number> };
  };
  for (const [token, id] of Object.entries(json.model.vocab))
    if (id < 256) json.model.vocab[token] = 255 - id;
  writeFileSync(join(other, "tokenizer.json"), JSON.stringify(json));
  copyFileSync(join(dir, "tokenizer_config.json"), join(other, "tokenizer_config.json"));
  return other;
}

test("PreparePool's early first worker serves its modelDir's tokenizer, not the one its command line named", async () => {
  const other = otherTokenizerFolder();
  const tokenize = async (p: PreparePool) =>
    (await p.answer("tokenize", body({ model: MODEL, prompt: "Ab" }))) as { tokens: number[] };
  const want = [...ModelTokenizer.fromFolder(dir).encode("Ab")];
  assert.notDeepEqual([...ModelTokenizer.fromFolder(other).encode("Ab")], want, "the folders must differ");
  try {
    for (const guess of [other, dir, undefined]) {
      const data: EarlyPrepareWorkerData = {
        nice: 0,
        early: true,
        ...(guess === undefined ? {} : { modelGuess: guess }),
      };
      const first = earlyWorker(new URL("./prepare-worker-start.js", import.meta.url), data);
      const early = await PreparePool.start({ first, modelDir: dir, modelId: MODEL, limits, threads: 1 });
      try {
        assert.deepEqual((await tokenize(early)).tokens, want, `named ${guess ?? "none"}`);
      } finally {
        await early.close();
      }
    }
  } finally {
    rmSync(other, { recursive: true, force: true });
  }
});
