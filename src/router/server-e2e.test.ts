/**
 * End-to-end: the real server (`startServer` of `kvfence serve`), the real engine worker and a
 * real model, driven by the official `openai` client and raw HTTP. After every test, once idle,
 * every page of the pool must be FREE (checked through /metrics).
 */
import assert from "node:assert/strict";
import { copyFileSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { request as httpRequest } from "node:http";
import { tmpdir } from "node:os";
import { basename, join } from "node:path";
import { after, afterEach, before, describe, test } from "node:test";
import OpenAI from "openai";
import {
  assertPoolIdle,
  modelDir,
  operatorGet,
  scrape,
  startTestServer,
  type TestServer,
} from "../../testing/start-server.js";
import { nodesInfoSchema } from "../admin-api/admin-wire.js";
import { loadChatTemplate, ModelTokenizer } from "../tokenizer/tokenizer.js";

const MODEL = "tiny-qwen2";
const KEYS = { "sk-alpha-tenant-1": "alpha", "sk-beta-tenant-22": "beta" } as const;

async function post(url: string, body: string | Uint8Array | object, headers: Record<string, string> = {}) {
  const res = await fetch(url, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: "Bearer sk-alpha-tenant-1", ...headers },
    body: typeof body === "string" || body instanceof Uint8Array ? body : JSON.stringify(body),
  });
  const text = await res.text();
  return { status: res.status, text, json: () => JSON.parse(text) as { error: Record<string, unknown> } };
}

describe("kvfence serve end to end (tiny-qwen2, real engine)", { timeout: 120_000 }, () => {
  let server: TestServer;
  let alpha: OpenAI;
  let beta: OpenAI;
  const tokenizer = ModelTokenizer.fromFolder(modelDir(MODEL));
  const template = loadChatTemplate(modelDir(MODEL), tokenizer)!;

  before(async () => {
    server = await startTestServer({
      model: modelDir(MODEL),
      kvPages: 256,
      maxModelLen: 1024,
      apiKeys: KEYS,
      // These tests count requests per tenant by name (opaque ids are the default: operator-endpoints.e2e.test).
      metricsTenantNames: true,
    });
    alpha = new OpenAI({ baseURL: server.baseURL, apiKey: "sk-alpha-tenant-1", maxRetries: 0 });
    beta = new OpenAI({ baseURL: server.baseURL, apiKey: "sk-beta-tenant-22", maxRetries: 0 });
  });
  after(() => server.close());
  afterEach(() => assertPoolIdle(server.url));

  const chat = (content: string) => [{ role: "user" as const, content }];

  test("chat completion: OpenAI shape, usage counts the templated prompt", async () => {
    const res = await alpha.chat.completions.create({
      model: MODEL,
      messages: chat("hello"),
      max_tokens: 32,
      temperature: 0,
    });
    assert.match(res.id, /^chatcmpl-/);
    assert.equal(res.object, "chat.completion");
    assert.equal(res.model, MODEL);
    assert.equal(res.choices[0]?.message.role, "assistant");
    assert.ok(["stop", "length"].includes(res.choices[0]!.finish_reason));
    const promptTokens = tokenizer.encode(template.render(chat("hello")), { addSpecialTokens: false }).length;
    assert.equal(res.usage?.prompt_tokens, promptTokens);
    assert.ok(res.usage!.completion_tokens >= 1 && res.usage!.completion_tokens <= 32);
    assert.equal(res.usage?.total_tokens, promptTokens + res.usage!.completion_tokens);
  });

  test("streaming chat equals the non-streamed greedy answer, with include_usage", async () => {
    const messages = chat("The quick brown fox");
    const whole = await alpha.chat.completions.create({
      model: MODEL,
      messages,
      max_tokens: 40,
      temperature: 0,
    });
    const stream = await alpha.chat.completions.create({
      model: MODEL,
      messages,
      max_tokens: 40,
      temperature: 0,
      stream: true,
      stream_options: { include_usage: true },
    });
    let content = "";
    let role: string | undefined;
    let finish: string | null = null;
    let usage: OpenAI.CompletionUsage | null | undefined;
    let chunks = 0;
    for await (const chunk of stream) {
      chunks++;
      assert.equal(chunk.object, "chat.completion.chunk");
      role ??= chunk.choices[0]?.delta.role;
      content += chunk.choices[0]?.delta.content ?? "";
      finish = chunk.choices[0]?.finish_reason ?? finish;
      if (chunk.usage) {
        assert.deepEqual(chunk.choices, []);
        usage = chunk.usage;
      }
    }
    assert.ok(chunks >= 3);
    assert.equal(role, "assistant");
    assert.equal(content, whole.choices[0]?.message.content);
    assert.equal(finish, whole.choices[0]?.finish_reason);
    // The same prompt again: the streamed request reuses the first one's cached pages.
    const { prompt_tokens_details: streamedCache, ...streamed } = usage as OpenAI.CompletionUsage;
    const { prompt_tokens_details: wholeCache, ...counted } = whole.usage!;
    assert.deepEqual(streamed, counted);
    assert.equal(wholeCache?.cached_tokens, 0);
    assert.ok((streamedCache?.cached_tokens ?? 0) > 0);
  });

  test("completions, streamed and not, agree; max_tokens truncates with finish_reason length", async () => {
    const whole = await alpha.completions.create({
      model: MODEL,
      prompt: "hello world",
      max_tokens: 48,
      temperature: 0,
    });
    assert.equal(whole.object, "text_completion");
    assert.match(whole.id, /^cmpl-/);
    const stream = await alpha.completions.create({
      model: MODEL,
      prompt: "hello world",
      max_tokens: 48,
      temperature: 0,
      stream: true,
    });
    let text = "";
    for await (const chunk of stream) text += chunk.choices[0]?.text ?? "";
    assert.equal(text, whole.choices[0]?.text);
    const generated = whole.usage!.completion_tokens;
    assert.ok(generated > 3, "the baseline generates more than 3 tokens");
    const short = await alpha.completions.create({
      model: MODEL,
      prompt: "hello world",
      max_tokens: 3,
      temperature: 0,
    });
    assert.equal(short.usage?.completion_tokens, 3);
    assert.equal(short.choices[0]?.finish_reason, "length");
    const full = whole.choices[0]!.text;
    assert.ok(
      full.startsWith(short.choices[0]!.text.replace(/\uFFFD+$/, "")),
      "a truncated answer is a prefix",
    );
  });

  test("a stop string ends the answer before it, with finish_reason stop, and frees the pages", async () => {
    const whole = await alpha.completions.create({
      model: MODEL,
      prompt: "hello world",
      max_tokens: 48,
      temperature: 0,
    });
    const full = whole.choices[0]!.text;
    const stop = [...full].slice(6, 8).join("");
    assert.ok(stop.length > 0);
    const expected = full.slice(0, full.indexOf(stop));
    for (const stream of [false, true]) {
      if (stream) {
        const s = await alpha.completions.create({
          model: MODEL,
          prompt: "hello world",
          max_tokens: 48,
          temperature: 0,
          stop,
          stream,
        });
        let text = "";
        let finish: string | null = null;
        for await (const chunk of s) {
          text += chunk.choices[0]?.text ?? "";
          finish = chunk.choices[0]?.finish_reason ?? finish;
        }
        assert.equal(text, expected);
        assert.equal(finish, "stop");
      } else {
        const r = await alpha.completions.create({
          model: MODEL,
          prompt: "hello world",
          max_tokens: 48,
          temperature: 0,
          stop: [stop],
        });
        assert.equal(r.choices[0]?.text, expected);
        assert.equal(r.choices[0]?.finish_reason, "stop");
      }
    }
  });

  test("an over-long request gets 400 context_length_exceeded with both numbers, and nothing is allocated", async () => {
    const before = await scrape(server.url);
    const content = "x".repeat(1000);
    const prompt = tokenizer.encode(template.render(chat(content)), { addSpecialTokens: false }).length;
    const res = await post(`${server.baseURL}/chat/completions`, {
      model: MODEL,
      messages: chat(content),
      max_tokens: 100,
    });
    assert.equal(res.status, 400);
    assert.deepEqual(res.json(), {
      error: {
        message:
          `This model's maximum context length is 1024 tokens, but the request needs ${prompt + 100} tokens ` +
          `(${prompt} in the prompt + 100 for max_tokens): shorten the prompt or lower max_tokens`,
        type: "invalid_request_error",
        param: "messages",
        code: "context_length_exceeded",
      },
    });
    const alone = await post(`${server.baseURL}/chat/completions`, {
      model: MODEL,
      messages: chat("y".repeat(1100)),
    });
    assert.equal(alone.status, 400);
    assert.equal(alone.json().error.code, "context_length_exceeded");
    const afterwards = await scrape(server.url);
    assert.equal(
      afterwards.get('kvfence_admission_rejections_total{reason="context_length_exceeded"}')! -
        (before.get('kvfence_admission_rejections_total{reason="context_length_exceeded"}') ?? 0),
      2,
    );
    assert.equal(
      afterwards.get('kvfence_kv_pool_pages{state="free"}')! +
        afterwards.get('kvfence_prefix_cache_pages{state="unreferenced"}')!,
      afterwards.get("kvfence_kv_pool_pages_total"),
    );
    assert.equal(afterwards.get("kvfence_engine_aborts_total"), before.get("kvfence_engine_aborts_total"));
    // A request that fits exactly is served.
    const fits = await alpha.chat.completions.create({
      model: MODEL,
      messages: chat(content),
      max_tokens: 1024 - prompt,
      temperature: 0,
    });
    assert.equal(fits.usage?.prompt_tokens, prompt);
  });

  const invalid: Array<[string, string | Uint8Array | object, number, string, string | null]> = [
    ["malformed JSON", "{not json", 400, "invalid_json", null],
    [
      "a wrong type",
      { model: MODEL, messages: [{ role: "user", content: 42 }] },
      400,
      "invalid_request",
      "messages[0].content",
    ],
    ["n above 64", { model: MODEL, messages: chat("a"), n: 65 }, 400, "invalid_request", "n"],
    [
      "negative max_tokens",
      { model: MODEL, messages: chat("a"), max_tokens: -1 },
      400,
      "invalid_request",
      "max_tokens",
    ],
    [
      "non-integer max_tokens",
      { model: MODEL, messages: chat("a"), max_tokens: 3.5 },
      400,
      "invalid_request",
      "max_tokens",
    ],
    [
      "invalid UTF-8",
      Buffer.concat([Buffer.from('{"model":"'), Buffer.from([0xc3, 0x28]), Buffer.from('"}')]),
      400,
      "invalid_request",
      null,
    ],
    ["an unknown model", { model: "gpt-4o", messages: chat("a") }, 404, "model_not_found", "model"],
  ];
  for (const [what, body, status, code, param] of invalid) {
    test(`${what} gets ${status} ${code} and the server keeps serving`, async () => {
      const res = await post(`${server.baseURL}/chat/completions`, body);
      assert.equal(res.status, status, res.text);
      const { error } = res.json();
      assert.equal(error.code, code);
      assert.equal(error.param, param);
      assert.ok(typeof error.message === "string" && error.message.length > 10);
      const ok = await beta.chat.completions.create({
        model: MODEL,
        messages: chat("still here?"),
        max_tokens: 4,
      });
      assert.equal(ok.object, "chat.completion");
    });
  }

  test("a body over the size limit gets 413, an unknown route 404, a wrong method 405", async () => {
    const huge = await post(`${server.baseURL}/completions`, {
      model: MODEL,
      prompt: "z".repeat(17 * 1024 * 1024),
    });
    assert.equal(huge.status, 413);
    assert.equal(huge.json().error.code, "payload_too_large");
    const route = await fetch(`${server.baseURL}/embeddings`, { method: "POST" });
    assert.equal(route.status, 404);
    const method = await fetch(`${server.baseURL}/completions`, { method: "PUT" });
    assert.equal(method.status, 405);
    assert.equal(method.headers.get("allow"), "POST");
  });

  test("a wrong or missing API key gets 401 in the OpenAI envelope", async () => {
    const missing = await post(
      `${server.baseURL}/chat/completions`,
      { model: MODEL, messages: chat("a") },
      { authorization: "" },
    );
    assert.equal(missing.status, 401);
    assert.equal(missing.json().error.type, "authentication_error");
    assert.equal(missing.json().error.code, "invalid_api_key");
    const wrong = new OpenAI({ baseURL: server.baseURL, apiKey: "sk-not-a-real-key", maxRetries: 0 });
    await assert.rejects(wrong.models.list(), (err: unknown) => err instanceof OpenAI.AuthenticationError);
  });

  test("/v1/models reports the effective max_model_len; /kvfence/nodes the pool", async () => {
    const models = await alpha.models.list();
    assert.equal(models.data.length, 1);
    assert.equal(models.data[0]?.id, MODEL);
    assert.equal((models.data[0] as unknown as { max_model_len: number }).max_model_len, 1024);
    const nodes = nodesInfoSchema.parse(await (await operatorGet(server.url, "/kvfence/nodes")).json());
    assert.equal(nodes.max_model_len, 1024);
    assert.deepEqual(
      nodes.nodes.map((n) => [n.role, n.pool_tokens, n.page_size]),
      [["engine", 256 * 16, 16]],
    );
  });

  test("a seeded sampled request repeats exactly; top_p and top_k reach the engine", async () => {
    const sample = (seed: number) =>
      alpha.chat.completions
        .create({
          model: MODEL,
          messages: chat("sample me"),
          max_tokens: 24,
          temperature: 1,
          top_p: 0.9,
          seed,
        })
        .then((r) => r.choices[0]!.message.content);
    const first = await sample(42);
    assert.equal(await sample(42), first);
    const others = await Promise.all([sample(1), sample(2), sample(3)]);
    assert.ok(
      others.some((o) => o !== first),
      "different seeds give different samples",
    );
  });

  test("concurrent greedy requests from two tenants equal the same prompts run alone", async () => {
    const prompts = ["alpha one", "beta two", "a longer prompt about the weather today", "zz", "tenant"];
    const run = (client: OpenAI, content: string) =>
      client.chat.completions
        .create({ model: MODEL, messages: chat(content), max_tokens: 40, temperature: 0 })
        .then((r) => r.choices[0]!.message.content);
    const alone: string[] = [];
    for (const p of prompts) alone.push((await run(alpha, p))!);
    const together = await Promise.all(prompts.flatMap((p) => [run(alpha, p), run(beta, p)]));
    assert.deepEqual(
      together,
      alone.flatMap((a) => [a, a]),
    );
    const m = await scrape(server.url);
    assert.ok(m.get('kvfence_requests_total{tenant="beta",endpoint="chat",status="200"}')! >= prompts.length);
    assert.ok(m.get('kvfence_time_to_first_token_seconds_count{endpoint="chat"}')! >= prompts.length * 3);
  });
});

const ENDLESS_WINDOW = 32768;

describe("kvfence serve end to end: client disconnect", { timeout: 60_000 }, () => {
  let dir: string;
  let server: TestServer;
  before(async () => {
    // tiny-qwen2 with no end-of-sequence id, so a greedy answer runs to max_tokens, and a window of
    // 32,768 tokens (RoPE has no learned positions), so that answer takes seconds. (It used to set
    // the id to 263, which the greedy answer to "abc" reaches after ~140 tokens: the answer was
    // over in a few ms, and whenever the client took longer than that to read its first chunks,
    // as on a loaded machine, the server had finished with 200 and the test failed: 9 of 120
    // runs under two CPU hogs.)
    dir = mkdtempSync(join(tmpdir(), "kvfence-endless-"));
    for (const f of readdirSync(modelDir(MODEL))) copyFileSync(join(modelDir(MODEL), f), join(dir, f));
    for (const f of ["config.json", "generation_config.json"]) {
      const json = JSON.parse(readFileSync(join(dir, f), "utf8"));
      json.eos_token_id = [];
      if (f === "config.json") json.max_position_embeddings = ENDLESS_WINDOW;
      writeFileSync(join(dir, f), JSON.stringify(json));
    }
    server = await startTestServer({
      model: dir,
      kvPages: ENDLESS_WINDOW / 16 + 16,
      metricsTenantNames: true,
    });
  });
  after(async () => {
    await server.close();
    rmSync(dir, { recursive: true, force: true });
  });

  test("a client that disconnects mid-stream has its engine request aborted and its pages freed", async () => {
    const before = await scrape(server.url);
    await new Promise<void>((resolve, reject) => {
      const req = httpRequest(`${server.baseURL}/completions`, {
        method: "POST",
        headers: { "content-type": "application/json" },
      });
      req.on("response", (res) => {
        if (res.statusCode !== 200) reject(new Error(`Expected a 200 stream: got ${res.statusCode}`));
        let chunks = 0;
        res.on("data", (data: Buffer) => {
          chunks += data.toString().split("data: ").length - 1;
          if (chunks >= 3) {
            req.destroy();
            resolve();
          }
        });
      });
      req.on("error", (err: NodeJS.ErrnoException) => {
        if (err.code !== "ECONNRESET") reject(err);
      });
      req.end(
        JSON.stringify({
          model: basename(dir),
          prompt: "abc",
          stream: true,
          max_tokens: ENDLESS_WINDOW - 16,
          temperature: 0,
        }),
      );
    });
    const m = await assertPoolIdle(server.url);
    assert.equal(
      m.get('kvfence_client_disconnects_total{endpoint="completions"}'),
      1,
      "the stream was cut mid-way",
    );
    assert.equal(m.get("kvfence_engine_aborts_total")! - (before.get("kvfence_engine_aborts_total") ?? 0), 1);
    assert.equal(m.get('kvfence_requests_total{tenant="anonymous",endpoint="completions",status="499"}'), 1);
  });
});

test("startServer refuses a pool that cannot hold one full-context request, naming both fixes", {
  timeout: 30_000,
}, async () => {
  await assert.rejects(startTestServer({ model: modelDir(MODEL), kvPages: 8 }), (err: Error) => {
    assert.match(err.message, /pool holds 128 tokens/);
    assert.match(err.message, /context length is 2048 tokens/);
    assert.match(err.message, /--kv-pages 128 or --kv-memory/);
    assert.match(err.message, /--max-model-len 128/);
    return true;
  });
});
