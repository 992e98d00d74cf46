/**
 * End-to-end: the prefix cache over real HTTP with the official `openai` client, on the real
 * server (one engine worker, the bundled model): a same-tenant repeat is a hit
 * (`usage.prompt_tokens_details.cached_tokens` > 0) with the output of a miss, another tenant's
 * identical prompt is a miss, a client `cache_salt` only narrows the namespace, streaming usage
 * carries the count, and /metrics counts the hits.
 */
import assert from "node:assert/strict";
import { after, afterEach, before, describe, test } from "node:test";
import OpenAI from "openai";
import {
  assertPoolIdle,
  modelDir,
  scrape,
  startTestServer,
  type TestServer,
} from "../../testing/start-server.js";

const KEYS = {
  "sk-alpha-tenant-1": "alpha",
  "sk-alpha-tenant-2": "alpha",
  "sk-beta-tenant-22": "beta",
} as const;
const FACTS =
  "the access code of account 4821 is QX7-PL2. the weather was mild. the meeting moved to friday. " +
  "the access code of account 7719 is ZT4-MN8. the train left at nine.";
const QUESTION = `${FACTS}\nWhat is the access code of account 4821?`;

type UsageWithDetails = OpenAI.CompletionUsage & { prompt_tokens_details?: { cached_tokens?: number } };
const cached = (usage: OpenAI.CompletionUsage | undefined | null) =>
  (usage as UsageWithDetails | undefined)?.prompt_tokens_details?.cached_tokens;

describe("prefix cache end to end (one engine, kvfence-tiny)", { timeout: 120_000 }, () => {
  let server: TestServer;
  const client = (key: string) => new OpenAI({ baseURL: server.baseURL, apiKey: key, maxRetries: 0 });
  const ask = (key: string, extra: Record<string, unknown> = {}) =>
    client(key).chat.completions.create({
      model: "kvfence-tiny",
      messages: [{ role: "user", content: QUESTION }],
      max_tokens: 12,
      temperature: 0,
      ...extra,
    } as OpenAI.ChatCompletionCreateParamsNonStreaming);

  before(async () => {
    server = await startTestServer({ model: modelDir("kvfence-tiny"), kvPages: 256, apiKeys: KEYS });
  });
  after(() => server.close());
  afterEach(() => assertPoolIdle(server.url));

  test("a same-tenant repeat hits with the output of the miss; another tenant's identical prompt misses", async () => {
    const miss = await ask("sk-alpha-tenant-1");
    assert.equal(cached(miss.usage), 0);
    const hit = await ask("sk-alpha-tenant-1");
    assert.ok((cached(hit.usage) ?? 0) > 0, `a hit: ${JSON.stringify(hit.usage)}`);
    assert.ok(cached(hit.usage)! < hit.usage!.prompt_tokens);
    assert.equal(hit.choices[0]!.message.content, miss.choices[0]!.message.content);
    const otherKeySameTenant = await ask("sk-alpha-tenant-2");
    assert.ok((cached(otherKeySameTenant.usage) ?? 0) > 0, "the tenant scope spans the tenant's keys");
    const beta = await ask("sk-beta-tenant-22");
    assert.equal(cached(beta.usage), 0, "another tenant's identical prompt is a miss");
    assert.equal(beta.choices[0]!.message.content, miss.choices[0]!.message.content);
    const salted = await ask("sk-alpha-tenant-1", { cache_salt: "project-x" });
    assert.equal(cached(salted.usage), 0, "a client cache_salt narrows the namespace");
    const forged = await ask("sk-beta-tenant-22", { cache_salt: "tenant:0" });
    assert.equal(cached(forged.usage), 0, "a client cache_salt never reaches another tenant");
    const m = await scrape(server.url);
    assert.ok(m.get('kvfence_prefix_cache_lookups_total{result="hit"}')! >= 2);
    assert.ok(m.get('kvfence_prefix_cache_lookups_total{result="miss"}')! >= 4);
    assert.ok(m.get("kvfence_prefix_cache_hit_tokens_total")! > 0);
    assert.ok(m.get('kvfence_kv_pool_pages{state="shared"}')! > 0);
  });

  test("streamed chat usage and completions carry cached_tokens", async () => {
    const stream = await client("sk-alpha-tenant-1").chat.completions.create({
      model: "kvfence-tiny",
      messages: [{ role: "user", content: QUESTION }],
      max_tokens: 8,
      temperature: 0,
      stream: true,
      stream_options: { include_usage: true },
    });
    let usage: OpenAI.CompletionUsage | null | undefined;
    for await (const chunk of stream) if (chunk.usage) usage = chunk.usage;
    assert.ok((cached(usage) ?? 0) > 0, `streamed usage: ${JSON.stringify(usage)}`);
    const text = client("sk-beta-tenant-22");
    const first = await text.completions.create({
      model: "kvfence-tiny",
      prompt: FACTS,
      max_tokens: 4,
      temperature: 0,
    });
    const again = await text.completions.create({
      model: "kvfence-tiny",
      prompt: FACTS,
      max_tokens: 4,
      temperature: 0,
    });
    assert.equal(cached(first.usage), 0);
    assert.ok((cached(again.usage) ?? 0) > 0);
    assert.equal(again.choices[0]!.text, first.choices[0]!.text);
  });

  test("a cache_salt that is not a string gets a 400 naming it", async () => {
    const res = await fetch(`${server.baseURL}/chat/completions`, {
      method: "POST",
      headers: { "content-type": "application/json", authorization: "Bearer sk-alpha-tenant-1" },
      body: JSON.stringify({
        model: "kvfence-tiny",
        messages: [{ role: "user", content: "hi" }],
        cache_salt: 7,
      }),
    });
    assert.equal(res.status, 400);
    const body = (await res.json()) as { error: { param: string; code: string } };
    assert.equal(body.error.param, "cache_salt");
  });
});

describe("prefix cache end to end, --prefix-cache-scope key", { timeout: 60_000 }, () => {
  let server: TestServer;
  before(async () => {
    server = await startTestServer({
      model: modelDir("kvfence-tiny"),
      kvPages: 128,
      apiKeys: KEYS,
      prefixCacheScope: "key",
    });
  });
  after(() => server.close());

  test("another key of the same tenant misses; the same key hits", async () => {
    const ask = (key: string) =>
      new OpenAI({ baseURL: server.baseURL, apiKey: key, maxRetries: 0 }).chat.completions.create({
        model: "kvfence-tiny",
        messages: [{ role: "user", content: QUESTION }],
        max_tokens: 4,
        temperature: 0,
      });
    await ask("sk-alpha-tenant-1");
    assert.ok((cached((await ask("sk-alpha-tenant-1")).usage) ?? 0) > 0);
    assert.equal(cached((await ask("sk-alpha-tenant-2")).usage), 0);
    await assertPoolIdle(server.url);
  });
});
