/**
 * Acceptance (issue #35 item 3): routing by where the KV lives, with real processes.
 *
 * - A TCP cluster (1 router, 2 prefill, 1 decode; the official `openai` client over real HTTP):
 *   three conversations' first turns go round-robin over the prefill nodes; each second turn goes
 *   back to the prefill node that cached its first (all its full pages reused, `cached_tokens`),
 *   although round-robin — and prefix affinity, whose key covers the first four pages — would send
 *   each to the other one. Another tenant's identical conversation is never routed by them.
 * - Two routers (router slots 0 and 1, in this process) over the same node processes: a prompt
 *   cached through one router is routed to its prefill node by the other, from the same events.
 * - The threaded topology: the events ride the worker's MessagePort into the same index.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import OpenAI from "openai";
import { assertPoolIdle, modelDir, operatorGet, scrape } from "../../testing/start-server.js";
import { startCluster, startInProcess, type TopologyServer } from "../../testing/topology-servers.js";
import type { NodesInfo } from "../admin-api/admin-wire.js";
import { connectCluster } from "../cluster/cluster-router.js";
import type { DisaggregatedEngine } from "../cluster/disaggregated-engine.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { GREEDY_SAMPLING } from "../protocol/sampling-params.js";
import { type NodeProcesses, startNodeProcesses } from "./local-cluster.js";

const MODEL = "kvfence-tiny";
const KEYS = { "sk-route-alpha-0001": "alpha", "sk-route-beta-00002": "beta" } as const;
const PAGE = 16;
/** First turns of at most 4 pages (affinity's key covers fewer pages than the second turn's). */
const FIRST = ["the fox ran over the hill", "a cold wind blew at noon", "ships sail to the east"];

type UsageWithDetails = OpenAI.CompletionUsage & { prompt_tokens_details?: { cached_tokens?: number } };
const cachedTokens = (u: OpenAI.CompletionUsage | undefined) =>
  (u as UsageWithDetails | undefined)?.prompt_tokens_details?.cached_tokens ?? 0;

describe("routing by where the KV lives, TCP cluster (2 prefill + 1 decode)", { timeout: 180_000 }, () => {
  let server: TopologyServer;
  before(async () => {
    server = await startCluster(2, 1, { model: modelDir(MODEL), kvPages: 128, apiKeys: KEYS });
  });
  after(() => server.close());

  const chat = (key: string, messages: OpenAI.ChatCompletionMessageParam[]) =>
    new OpenAI({ baseURL: server.baseURL, apiKey: key, maxRetries: 0 }).chat.completions.create({
      model: MODEL,
      messages,
      max_tokens: 8,
      temperature: 0,
    });
  /** The keys the router's index holds per prefill node (`/kvfence/nodes`). */
  const indexed = async () => {
    const info = (await (await operatorGet(server.url, "/kvfence/nodes")).json()) as NodesInfo;
    return info.nodes.filter((n) => n.role === "prefill").map((n) => n.indexed_keys ?? 0);
  };
  const decisions = async () => {
    const m = await scrape(server.url);
    const of = (reason: string) => m.get(`kvfence_routing_decisions_total{reason="${reason}"}`) ?? 0;
    return { cache_hit: of("cache_hit"), load: of("load"), fallback: of("fallback") };
  };

  test("a conversation's second turn goes to the prefill node holding its first, where round-robin would not", async () => {
    const alpha = "sk-route-alpha-0001";
    const first: { text: string; answer: string; pages: number }[] = [];
    for (const text of FIRST) {
      const r = await chat(alpha, [{ role: "user", content: text }]);
      const prompt = r.usage!.prompt_tokens;
      assert.ok(
        prompt > 2 * PAGE && prompt <= 4 * PAGE,
        `a first turn of 2 to 4 full pages: ${prompt} tokens`,
      );
      first.push({ text, answer: r.choices[0]!.message.content!, pages: Math.floor(prompt / PAGE) });
    }
    // The nodes' events reach the router within one interval (50 ms): wait until it knows them all.
    const expected = first.reduce((n, f) => n + f.pages, 0);
    const deadline = Date.now() + 10_000;
    let keys = await indexed();
    while (keys.reduce((a, b) => a + b, 0) < expected && Date.now() < deadline) {
      await sleep(20);
      keys = await indexed();
    }
    assert.ok(
      keys.every((k) => k > 0),
      `both prefill nodes hold first turns (round-robin): ${keys}`,
    );
    const before = await decisions();
    const second = (f: { text: string; answer: string }): OpenAI.ChatCompletionMessageParam[] => [
      { role: "user", content: f.text },
      { role: "assistant", content: f.answer },
      { role: "user", content: "and what happened after that, in a few more words?" },
    ];
    // In the first turns' order: round-robin would now send each to the other prefill node.
    for (const f of first) {
      const r = await chat(alpha, second(f));
      assert.ok(
        cachedTokens(r.usage) >= f.pages * PAGE,
        `"${f.text}": every full page of its first turn reused (${f.pages * PAGE} tokens): ${JSON.stringify(r.usage)}`,
      );
    }
    const after = await decisions();
    assert.equal(after.cache_hit - before.cache_hit, FIRST.length, "each by a cache hit");
    // Tenant beta's identical conversation: nothing of alpha's routes it (its own namespace is empty).
    const beta = await chat("sk-route-beta-00002", second(first[0]!));
    assert.equal(cachedTokens(beta.usage), 0);
    const last = await decisions();
    assert.deepEqual(
      [last.cache_hit - after.cache_hit, last.fallback - after.fallback],
      [0, 1],
      "beta's prompt falls back: no cache hit from alpha's keys",
    );
    await assertPoolIdle(server.url);
  });
});

describe("routing by where the KV lives, two routers over the same nodes", { timeout: 180_000 }, () => {
  let nodes: NodeProcesses;
  const routers: DisaggregatedEngine[] = [];
  before(async () => {
    nodes = await startNodeProcesses({
      prefill: 2,
      decode: 1,
      model: modelDir(MODEL),
      nodeArgs: ["--kv-pages", "128", "--max-model-len", "512"],
    });
    for (const routerSlot of [0, 1]) {
      routers.push(
        await connectCluster({
          prefill: nodes.prefill.map((p) => p.url),
          decode: nodes.decode.map((d) => d.url),
          secret: nodes.secret,
          maxModelLen: 512,
          routerSlot,
        }),
      );
    }
  });
  after(async () => {
    for (const r of routers) await r.close();
    await nodes?.close();
  });

  let rid = 1;
  /** Runs `prompt` for tenant 0 through `router`: its cached tokens. */
  const run = (router: DisaggregatedEngine, prompt: Int32Array) =>
    new Promise<number>((resolve, reject) => {
      const request: GenerationRequest = {
        rid: rid++,
        tenant: 0,
        promptTokens: prompt,
        maxTokens: 2,
        sampling: GREEDY_SAMPLING,
      };
      router.submit(request, {
        onTokens() {},
        onFinish: (_reason, usage) => resolve(usage.cachedTokens ?? 0),
        onError: (e) => reject(new Error(e.message)),
      });
    });

  test("each router keeps the index from the same events: a prefix cached through one is routed to by the other", async () => {
    const [r0, r1] = routers as [DisaggregatedEngine, DisaggregatedEngine];
    const conversation = Int32Array.from({ length: 120 }, (_, i) => 10 + ((i * 37) % 240));
    // Router 0 sends the first turn (3 full pages) to a prefill node; a second prompt moves its
    // round-robin on, so the next pick by round-robin would be the other node for both routers.
    assert.equal(await run(r0, conversation.subarray(0, 50)), 0);
    const indexedOn = (r: DisaggregatedEngine) =>
      r
        .nodes()
        .filter((n) => n.role === "prefill")
        .map((n) => n.indexed_keys ?? 0);
    const deadline = Date.now() + 10_000;
    while (indexedOn(r1).every((k) => k === 0) && Date.now() < deadline) await sleep(20);
    assert.deepEqual(indexedOn(r1), indexedOn(r0), "both routers hold the same keys per node");
    const holder = indexedOn(r1).findIndex((k) => k > 0);
    // Router 1 has never routed this conversation; round-robin would send it to prefill-0 first.
    // Make its first pick the non-holder by round-robin when the holder is prefill-0.
    if (holder === 0)
      assert.equal(
        await run(
          r1,
          Int32Array.from({ length: 20 }, (_, i) => 200 + i),
        ),
        0,
      );
    const cached = await run(r1, conversation);
    assert.equal(cached, 3 * PAGE, "router 1 sent turn 2 to the node holding turn 1's three pages");
    assert.equal(r1.routing()?.decisions.cache_hit, 1);
  });
});

describe("routing by where the KV lives, threaded topology", { timeout: 120_000 }, () => {
  test("the prefill worker's cache events reach the router's index over its MessagePort", async () => {
    const server = await startInProcess("threads", { model: modelDir(MODEL), kvPages: 128, apiKeys: KEYS });
    try {
      const client = new OpenAI({ baseURL: server.baseURL, apiKey: "sk-route-alpha-0001", maxRetries: 0 });
      const r = await client.chat.completions.create({
        model: MODEL,
        messages: [{ role: "user", content: FIRST[0]! }],
        max_tokens: 4,
        temperature: 0,
      });
      const pages = Math.floor(r.usage!.prompt_tokens / PAGE);
      const deadline = Date.now() + 10_000;
      let keys = 0;
      while (keys < pages && Date.now() < deadline) {
        const info = (await (await operatorGet(server.url, "/kvfence/nodes")).json()) as NodesInfo;
        keys = info.nodes.find((n) => n.role === "prefill")?.indexed_keys ?? 0;
        if (keys < pages) await sleep(20);
      }
      assert.equal(keys, pages, "every full page of the prompt is in the router's index");
      // The decode node caches the turn too (prompt and answer, decode-side reuse) and says so.
      const total = (await scrape(server.url)).get("kvfence_kv_index_keys") ?? 0;
      assert.ok(
        total >= pages,
        `the index holds the prefill node's ${pages} keys and the decode node's: ${total}`,
      );
    } finally {
      await server.close();
    }
  });
});
