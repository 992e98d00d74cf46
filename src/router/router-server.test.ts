/**
 * The HTTP layer on its own, against a scripted engine (testing/scripted-engine.ts): validation,
 * SSE framing, errors, auth, admission and metrics. The end-to-end tests in
 * testing/e2e-server.test.ts run the same API against the real engine and model.
 */
import assert from "node:assert/strict";
import { request as httpRequest } from "node:http";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import {
  BYTE_EOS,
  byteTokenizer,
  ScriptedEngine,
  type ScriptedEngineOptions,
} from "../../testing/scripted-engine.js";
import { operatorGet, operatorHeaders, TEST_OPERATOR_KEY } from "../../testing/start-server.js";
import { nodesInfoSchema } from "../admin-api/admin-wire.js";
import { ERROR_TABLE } from "../lib/errors.js";
import { createLogger } from "../lib/logger.js";
import { parsePrometheusText } from "../tools/incident/prometheus-text.js";
import { TenantDirectory } from "./api-keys.js";
import { RouterServer } from "./router-server.js";

const MODEL = "tiny-test";

async function startRouter(
  engineOptions: ScriptedEngineOptions = {},
  extra: { keys?: string; maxBodyBytes?: number; tenantNames?: boolean } = {},
) {
  const engine = new ScriptedEngine(engineOptions);
  const server = new RouterServer({
    engine,
    tokenizer: byteTokenizer,
    model: { id: MODEL, maxPositionEmbeddings: 2048, eosTokenIds: [BYTE_EOS], defaults: { temperature: 0 } },
    tenants:
      extra.keys === undefined ? TenantDirectory.anonymous() : TenantDirectory.parse(extra.keys, "test keys"),
    logger: createLogger({ level: "silent" }),
    ...(extra.maxBodyBytes === undefined ? {} : { limits: { maxBodyBytes: extra.maxBodyBytes } }),
    operatorKey: TEST_OPERATOR_KEY,
    metricsTenantNames: extra.tenantNames ?? true,
  });
  const url = await server.listen(0, "127.0.0.1");
  return { engine, server, url };
}

async function post(url: string, body: unknown, headers: Record<string, string> = {}) {
  const res = await fetch(url, {
    method: "POST",
    headers: { "content-type": "application/json", ...headers },
    body: typeof body === "string" || body instanceof Uint8Array ? body : JSON.stringify(body),
  });
  return { status: res.status, text: await res.text(), headers: res.headers };
}

async function pagesInUse(url: string): Promise<number> {
  const metrics = parsePrometheusText(await (await operatorGet(url, "/metrics")).text());
  return metrics.get("kvfence_kv_pool_pages_total")! - metrics.get('kvfence_kv_pool_pages{state="free"}')!;
}

function sseEvents(text: string): string[] {
  assert.ok(text.endsWith("\n\n"), "every SSE frame ends with a blank line");
  return text
    .slice(0, -2)
    .split("\n\n")
    .map((frame) => {
      assert.match(frame, /^data: /);
      return frame.slice("data: ".length);
    });
}

describe("RouterServer with a scripted engine", () => {
  let ctx: Awaited<ReturnType<typeof startRouter>>;
  let client: OpenAI;
  before(async () => {
    ctx = await startRouter({}, { maxBodyBytes: 64 * 1024 });
    client = new OpenAI({ baseURL: `${ctx.url}/v1`, apiKey: "none", maxRetries: 0 });
  });
  after(() => ctx.server.close());

  test("RouterServer answers a chat completion in OpenAI's shape", async () => {
    const res = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "hi" }],
    });
    assert.match(res.id, /^chatcmpl-[A-Za-z0-9]{24}$/);
    assert.equal(res.object, "chat.completion");
    assert.equal(res.model, MODEL);
    assert.equal(typeof res.created, "number");
    assert.equal(res.choices.length, 1);
    assert.deepEqual(res.choices[0]?.message, { role: "assistant", content: "Hello, world!", refusal: null });
    assert.equal(res.choices[0]?.finish_reason, "stop");
    const promptTokens = byteTokenizer.encodeChat([{ role: "user", content: "hi" }]).length;
    assert.deepEqual(res.usage, {
      prompt_tokens: promptTokens,
      completion_tokens: 14,
      total_tokens: promptTokens + 14,
    });
    assert.equal(ctx.engine.submitted.at(-1)?.sampling.temperature, 0, "generation_config default applies");
  });

  test("RouterServer streams chat chunks framed exactly as OpenAI does, with include_usage", async () => {
    const { status, text, headers } = await post(`${ctx.url}/v1/chat/completions`, {
      model: MODEL,
      messages: [{ role: "user", content: "hi" }],
      stream: true,
      stream_options: { include_usage: true },
    });
    assert.equal(status, 200);
    assert.match(headers.get("content-type") ?? "", /^text\/event-stream/);
    const events = sseEvents(text);
    assert.equal(events.at(-1), "[DONE]");
    const chunks = events.slice(0, -1).map((e) => JSON.parse(e));
    for (const c of chunks) {
      assert.equal(c.object, "chat.completion.chunk");
      assert.equal(c.id, chunks[0].id);
      assert.equal(c.created, chunks[0].created);
      assert.equal(c.model, MODEL);
      assert.ok("usage" in c);
    }
    assert.deepEqual(chunks[0].choices, [
      { index: 0, delta: { role: "assistant", content: "" }, logprobs: null, finish_reason: null },
    ]);
    const content = chunks
      .slice(1, -2)
      .map((c) => c.choices[0].delta.content)
      .join("");
    assert.equal(content, "Hello, world!");
    // The EOS token's chunk, plus what stopped it as vLLM (stop_reason: null for EOS) and SGLang
    // (matched_stop: the EOS id) say.
    assert.deepEqual(chunks.at(-2).choices, [
      { index: 0, delta: {}, logprobs: null, finish_reason: "stop", stop_reason: null, matched_stop: 258 },
    ]);
    assert.equal(chunks.at(-2).usage, null);
    assert.deepEqual(chunks.at(-1).choices, []);
    assert.equal(chunks.at(-1).usage.completion_tokens, 14);
  });

  test("RouterServer streams through the openai client and omits usage unless asked", async () => {
    const stream = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "hi" }],
      stream: true,
    });
    let content = "";
    let finish: string | null = null;
    for await (const chunk of stream) {
      assert.equal("usage" in chunk, false);
      content += chunk.choices[0]?.delta.content ?? "";
      finish = chunk.choices[0]?.finish_reason ?? finish;
    }
    assert.equal(content, "Hello, world!");
    assert.equal(finish, "stop");
  });

  test("RouterServer answers /v1/completions streaming and not", async () => {
    const res = await client.completions.create({ model: MODEL, prompt: "abc", max_tokens: 5 });
    assert.match(res.id, /^cmpl-/);
    assert.equal(res.object, "text_completion");
    assert.equal(res.choices[0]?.text, "Hello");
    assert.equal(res.choices[0]?.finish_reason, "length");
    assert.deepEqual(res.usage, { prompt_tokens: 3, completion_tokens: 5, total_tokens: 8 });
    const stream = await client.completions.create({
      model: MODEL,
      prompt: "abc",
      stream: true,
      stream_options: { include_usage: true },
    });
    let text = "";
    let usage = null;
    for await (const chunk of stream) {
      assert.equal(chunk.object, "text_completion");
      text += chunk.choices[0]?.text ?? "";
      if (chunk.usage) usage = chunk.usage;
    }
    assert.equal(text, "Hello, world!");
    assert.deepEqual(usage, { prompt_tokens: 3, completion_tokens: 14, total_tokens: 17 });
  });

  test("RouterServer trims a stop string, reports finish_reason stop and aborts the engine request", async () => {
    const res = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "hi" }],
      stop: [", w", "zzz"],
    });
    assert.equal(res.choices[0]?.message.content, "Hello");
    assert.equal(res.choices[0]?.finish_reason, "stop");
    assert.ok(ctx.engine.aborted.includes(ctx.engine.submitted.at(-1)!.rid));
    assert.equal(await pagesInUse(ctx.url), 0);
  });

  test("RouterServer refuses an over-long request with context_length_exceeded and allocates nothing", async () => {
    const before = ctx.engine.submitted.length;
    const { status, text } = await post(`${ctx.url}/v1/chat/completions`, {
      model: MODEL,
      messages: [{ role: "user", content: "x".repeat(1000) }],
      max_tokens: 100,
    });
    assert.equal(status, 400);
    const { error } = JSON.parse(text);
    assert.equal(error.type, "invalid_request_error");
    assert.equal(error.param, "messages");
    assert.equal(error.code, "context_length_exceeded");
    const prompt = byteTokenizer.encodeChat([{ role: "user", content: "x".repeat(1000) }]).length;
    assert.equal(
      error.message,
      `This model's maximum context length is 1024 tokens, but the request needs ${prompt + 100} tokens ` +
        `(${prompt} in the prompt + 100 for max_tokens): shorten the prompt or lower max_tokens`,
    );
    assert.equal(ctx.engine.submitted.length, before, "a refused request never reaches the engine");
    const metrics = parsePrometheusText(await (await operatorGet(ctx.url, "/metrics")).text());
    assert.ok(metrics.get('kvfence_admission_rejections_total{reason="context_length_exceeded"}')! >= 1);
    assert.equal(await pagesInUse(ctx.url), 0);
  });

  test("RouterServer defaults a chat's max_tokens to what fits in the context", async () => {
    await client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "abcd" }] });
    const prompt = byteTokenizer.encodeChat([{ role: "user", content: "abcd" }]).length;
    assert.equal(ctx.engine.submitted.at(-1)?.maxTokens, 1024 - prompt);
  });

  const badRequests: Array<[string, string | Uint8Array | object, number, string, string | null]> = [
    ["malformed JSON", '{"model": ', 400, "invalid_json", null],
    ["an empty body", "", 400, "invalid_json", null],
    ["a wrong type", { model: MODEL, messages: "hi" }, 400, "invalid_request", "messages"],
    [
      "n above 64",
      { model: MODEL, messages: [{ role: "user", content: "hi" }], n: 65 },
      400,
      "invalid_request",
      "n",
    ],
    [
      "negative max_tokens",
      { model: MODEL, messages: [{ role: "user", content: "a" }], max_tokens: -5 },
      400,
      "invalid_request",
      "max_tokens",
    ],
    [
      "fractional max_tokens",
      { model: MODEL, messages: [{ role: "user", content: "a" }], max_tokens: 2.5 },
      400,
      "invalid_request",
      "max_tokens",
    ],
    [
      "invalid UTF-8",
      Uint8Array.from([123, 34, 109, 34, 58, 34, 0xff, 0xfe, 34, 125]),
      400,
      "invalid_request",
      null,
    ],
    [
      "an unknown model",
      { model: "gpt-4", messages: [{ role: "user", content: "a" }] },
      404,
      "model_not_found",
      "model",
    ],
    [
      "a body over the size limit",
      { model: MODEL, messages: [{ role: "user", content: "x".repeat(70_000) }] },
      413,
      "payload_too_large",
      null,
    ],
  ];
  for (const [what, body, status, code, param] of badRequests) {
    test(`RouterServer answers ${what} with ${status} ${code} and keeps serving`, async () => {
      const res = await post(`${ctx.url}/v1/chat/completions`, body);
      assert.equal(res.status, status, res.text);
      const { error } = JSON.parse(res.text);
      assert.equal(error.code, code);
      assert.equal(error.param, param);
      assert.equal(typeof error.message, "string");
      assert.equal(typeof error.type, "string");
      const ok = await client.chat.completions.create({
        model: MODEL,
        messages: [{ role: "user", content: "hi" }],
      });
      assert.equal(ok.choices[0]?.message.content, "Hello, world!");
    });
  }

  test("RouterServer answers an unknown route with 404 and a wrong method with 405 and Allow", async () => {
    const missing = await fetch(`${ctx.url}/v1/nope`);
    assert.equal(missing.status, 404);
    assert.equal(((await missing.json()) as { error: { code: string } }).error.code, "not_found");
    const wrong = await fetch(`${ctx.url}/v1/chat/completions`);
    assert.equal(wrong.status, 405);
    assert.equal(wrong.headers.get("allow"), "POST");
    assert.equal(((await wrong.json()) as { error: { code: string } }).error.code, "method_not_allowed");
    const put = await fetch(`${ctx.url}/health`, { method: "PUT" });
    assert.equal(put.status, 405);
    assert.equal(put.headers.get("allow"), "GET, HEAD");
  });

  test("RouterServer answers HEAD where it answers GET, without a body", async () => {
    for (const path of ["/health", "/v1/models", "/metrics"]) {
      const get = await fetch(`${ctx.url}${path}`, { headers: operatorHeaders() });
      const head = await fetch(`${ctx.url}${path}`, { method: "HEAD", headers: operatorHeaders() });
      assert.equal(head.status, 200, path);
      assert.equal(head.headers.get("content-type"), get.headers.get("content-type"), path);
      assert.equal(await head.text(), "", path);
    }
    assert.equal((await fetch(`${ctx.url}/v1/chat/completions`, { method: "HEAD" })).status, 405);
  });

  test("RouterServer lists the model with its effective max_model_len", async () => {
    const models = await client.models.list();
    assert.deepEqual(
      models.data.map((m) => ({
        id: m.id,
        object: m.object,
        owned_by: m.owned_by,
        len: (m as unknown as { max_model_len: number }).max_model_len,
      })),
      [{ id: MODEL, object: "model", owned_by: "kvfence", len: 1024 }],
    );
    const one = await client.models.retrieve(MODEL);
    assert.equal(one.id, MODEL);
    await assert.rejects(
      client.models.retrieve("other"),
      (err: unknown) => err instanceof OpenAI.NotFoundError,
    );
  });

  test("RouterServer serves /health, /kvfence/nodes and /metrics", async () => {
    assert.deepEqual(await (await fetch(`${ctx.url}/health`)).json(), { status: "ok" });
    const nodes = nodesInfoSchema.parse(await (await operatorGet(ctx.url, "/kvfence/nodes")).json());
    assert.deepEqual(nodes, {
      max_model_len: 1024,
      nodes: [
        {
          id: "engine-0",
          role: "engine",
          url: ctx.url,
          pool_tokens: 1024,
          page_size: 16,
          max_model_len: 1024,
          up: true,
        },
      ],
    });
    const res = await operatorGet(ctx.url, "/metrics");
    assert.match(res.headers.get("content-type") ?? "", /^text\/plain; version=0\.0\.4/);
    const text = await res.text();
    for (const family of [
      "kvfence_requests_total",
      "kvfence_prompt_tokens_total",
      "kvfence_completion_tokens_total",
      "kvfence_kv_pool_pages",
      "kvfence_engine_requests",
      "kvfence_tag_check_failures_total",
      "kvfence_admission_rejections_total",
      "kvfence_time_to_first_token_seconds",
      "kvfence_inter_token_latency_seconds",
    ]) {
      assert.match(text, new RegExp(`# TYPE ${family} `));
    }
    const parsed = parsePrometheusText(text);
    assert.ok(parsed.get('kvfence_requests_total{tenant="anonymous",endpoint="chat",status="200"}')! >= 1);
    assert.ok(parsed.get('kvfence_completion_tokens_total{tenant="anonymous",endpoint="chat"}')! >= 14);
    assert.ok(parsed.get('kvfence_time_to_first_token_seconds_count{endpoint="chat"}')! >= 1);
  });
});

test("RouterServer aborts the engine request when a streaming client disconnects", async () => {
  const ctx = await startRouter({ tokenDelayMs: 10, script: () => new Array(500).fill(65) });
  try {
    const rid = await new Promise<number>((resolve, reject) => {
      const req = httpRequest(`${ctx.url}/v1/chat/completions`, {
        method: "POST",
        headers: { "content-type": "application/json" },
      });
      req.on("response", (res) => {
        let seen = "";
        res.on("data", (chunk: Buffer) => {
          seen += chunk.toString();
          if (seen.split('"content":"A"').length > 3) {
            const rid = ctx.engine.submitted.at(-1)!.rid;
            req.destroy();
            resolve(rid);
          }
        });
      });
      req.on("error", (err) => {
        if (!(err as NodeJS.ErrnoException).code?.startsWith("ECONNRESET")) reject(err);
      });
      req.end(JSON.stringify({ model: MODEL, messages: [{ role: "user", content: "go" }], stream: true }));
    });
    for (let i = 0; i < 200 && !ctx.engine.aborted.includes(rid); i++)
      await new Promise((r) => setTimeout(r, 10));
    assert.ok(ctx.engine.aborted.includes(rid), "the engine request was aborted");
    assert.equal(await pagesInUse(ctx.url), 0);
    const metrics = parsePrometheusText(await (await operatorGet(ctx.url, "/metrics")).text());
    assert.equal(metrics.get('kvfence_client_disconnects_total{endpoint="chat"}'), 1);
  } finally {
    await ctx.server.close();
  }
});

test("RouterServer maps API keys to tenants and answers a wrong or missing key with 401", async () => {
  const ctx = await startRouter({}, { keys: '{"sk-tenant-a-1": "alpha", "sk-tenant-b-2": "beta"}' });
  try {
    const body = { model: MODEL, messages: [{ role: "user" as const, content: "hi" }] };
    const missing = await post(`${ctx.url}/v1/chat/completions`, body);
    assert.equal(missing.status, 401);
    assert.deepEqual(Object.keys(JSON.parse(missing.text).error), ["message", "type", "param", "code"]);
    assert.equal(JSON.parse(missing.text).error.type, "authentication_error");
    const wrong = new OpenAI({ baseURL: `${ctx.url}/v1`, apiKey: "sk-wrong-key-000", maxRetries: 0 });
    await assert.rejects(
      wrong.chat.completions.create(body),
      (err: unknown) => err instanceof OpenAI.AuthenticationError,
    );
    const beta = new OpenAI({ baseURL: `${ctx.url}/v1`, apiKey: "sk-tenant-b-2", maxRetries: 0 });
    await beta.chat.completions.create(body);
    assert.equal(ctx.engine.submitted.at(-1)?.tenant, 1);
    const metrics = parsePrometheusText(await (await operatorGet(ctx.url, "/metrics")).text());
    assert.equal(metrics.get('kvfence_requests_total{tenant="beta",endpoint="chat",status="200"}'), 1);
    assert.equal(metrics.get('kvfence_requests_total{tenant="-",endpoint="chat",status="401"}'), 2);
  } finally {
    await ctx.server.close();
  }
});

test("RouterServer returns an engine error raised before the first token as a real HTTP status", async () => {
  const ctx = await startRouter({
    failWith: { code: "page_tag_mismatch", message: "Page tag mismatch: page 3" },
  });
  try {
    const res = await post(`${ctx.url}/v1/chat/completions`, {
      model: MODEL,
      messages: [{ role: "user", content: "hi" }],
      stream: true,
    });
    assert.equal(res.status, 500);
    assert.equal(JSON.parse(res.text).error.code, "page_tag_mismatch");
  } finally {
    await ctx.server.close();
  }
});

test("RouterServer sends the error table's public message for a failure inside the engine, never its ids", async () => {
  const internal = "KV page 3 of request 4242 epoch 2, incarnation 7717, written by 4241/1 on 10.0.0.7:9100";
  for (const code of [
    "page_tag_mismatch",
    "node_unavailable",
    "checksum_mismatch",
    "pool_exhausted",
  ] as const) {
    for (const failAfter of [0, 3]) {
      const ctx = await startRouter({ failWith: { code, message: internal }, failAfter });
      try {
        const res = await post(`${ctx.url}/v1/chat/completions`, {
          model: MODEL,
          messages: [{ role: "user", content: "hi" }],
          stream: failAfter > 0,
        });
        // Before the first token: an HTTP error; after it: an error event inside the stream.
        const text = failAfter === 0 ? res.text : sseEvents(res.text).at(-2)!;
        const { error } = JSON.parse(text) as { error: { code: string; message: string } };
        assert.equal(error.code, code);
        assert.equal(error.message, ERROR_TABLE[code].publicMessage, `${code} after ${failAfter} tokens`);
        // In the error itself: the response's own ids and timestamps are random digits.
        for (const id of ["4242", "4241", "7717", "10.0.0.7", "9100"]) assert.ok(!text.includes(id), id);
      } finally {
        await ctx.server.close();
      }
    }
  }
});

test("RouterServer labels tenants in /metrics by opaque ids unless asked for names", async () => {
  const keys = '{"sk-tenant-a-1": "alpha-corp", "sk-tenant-b-2": "beta-corp"}';
  const body = { model: MODEL, messages: [{ role: "user" as const, content: "hi" }] };
  const labels: string[][] = [];
  for (const tenantNames of [false, false, true]) {
    const ctx = await startRouter({}, { keys, tenantNames });
    try {
      for (const key of ["sk-tenant-a-1", "sk-tenant-b-2"]) {
        const client = new OpenAI({ baseURL: `${ctx.url}/v1`, apiKey: key, maxRetries: 0 });
        await client.chat.completions.create(body);
      }
      const text = await (await operatorGet(ctx.url, "/metrics")).text();
      const seen = [...text.matchAll(/kvfence_completion_tokens_total\{tenant="([^"]+)"/g)].map((m) => m[1]!);
      labels.push(seen.sort());
      if (!tenantNames) {
        assert.doesNotMatch(text, /alpha-corp|beta-corp/);
        for (const label of seen) assert.match(label, /^t-[0-9a-f]{12}$/);
      }
    } finally {
      await ctx.server.close();
    }
  }
  assert.equal(new Set(labels[0]).size, 2, "one label per tenant");
  assert.deepEqual(labels[1], labels[0], "the same labels after a restart with the same operator key");
  assert.deepEqual(labels[2], ["alpha-corp", "beta-corp"]);
});
