/**
 * Acceptance (issue #16): the prefix cache in the disaggregated topologies, with the official
 * `openai` client over real HTTP — the threaded default (worker threads, shared memory) and a TCP
 * cluster of processes (1 router, 2 prefill, 1 decode). The prefill node keeps the cache and
 * computes only the uncached suffix; decode receives every page as without a cache. A same-tenant
 * repeat is a hit (cached_tokens > 0) with the output of the miss (and of one engine); another
 * tenant's identical prompt is a miss; prefix affinity sends the repeat to the prefill node that
 * holds the prefix. Every pool is idle afterwards (FREE, or cached with no reference). And the
 * canary probe stays clean with the cache on, under load, with aborts alongside, on a pool small
 * enough that the cache must evict.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import OpenAI from "openai";
import {
  assertPoolIdle,
  modelDir,
  operatorGet,
  scrape,
  TEST_OPERATOR_KEY,
} from "../../testing/start-server.js";
import { startCluster, startInProcess, type TopologyServer } from "../../testing/topology-servers.js";
import type { NodesInfo } from "../admin-api/admin-wire.js";
import { PING_INTERVAL_MS } from "../cluster/node-pings.js";
import { runProbe } from "../tools/probe/probe.js";

const KEYS = { "sk-prefix-alpha-01": "alpha", "sk-prefix-beta-002": "beta" } as const;
const PROMPT =
  "the access code of account 4821 is QX7-PL2. the weather was mild. the meeting moved to friday. " +
  "the access code of account 7719 is ZT4-MN8. the train left at nine.\nWhat is the access code of account 4821?";

type UsageWithDetails = OpenAI.CompletionUsage & { prompt_tokens_details?: { cached_tokens?: number } };
const cached = (u: OpenAI.CompletionUsage | undefined) =>
  (u as UsageWithDetails | undefined)?.prompt_tokens_details?.cached_tokens;

async function ask(server: TopologyServer, key: string) {
  const client = new OpenAI({ baseURL: server.baseURL, apiKey: key, maxRetries: 0 });
  return client.chat.completions.create({
    model: "kvfence-tiny",
    messages: [{ role: "user", content: PROMPT }],
    max_tokens: 16,
    temperature: 0,
  });
}

let reference: string;

before(async () => {
  const single = await startInProcess("single", {
    model: modelDir("kvfence-tiny"),
    kvPages: 128,
    apiKeys: KEYS,
  });
  try {
    reference = (await ask(single, "sk-prefix-alpha-01")).choices[0]!.message.content!;
  } finally {
    await single.close();
  }
});

for (const topology of ["threads", "tcp"] as const) {
  describe(`prefix cache, ${topology === "tcp" ? "TCP cluster (2 prefill + 1 decode)" : "threaded"}`, {
    timeout: 120_000,
  }, () => {
    let server: TopologyServer;
    before(async () => {
      const options = { model: modelDir("kvfence-tiny"), kvPages: 128, apiKeys: KEYS };
      server =
        topology === "tcp" ? await startCluster(2, 1, options) : await startInProcess("threads", options);
    });
    after(() => server.close());

    test("a same-tenant repeat hits with the output of a miss; another tenant's identical prompt misses", async () => {
      const miss = await ask(server, "sk-prefix-alpha-01");
      assert.equal(cached(miss.usage), 0);
      assert.equal(miss.choices[0]!.message.content, reference, "a miss answers as one engine");
      for (let i = 0; i < 2; i++) {
        const hit = await ask(server, "sk-prefix-alpha-01");
        assert.ok((cached(hit.usage) ?? 0) > 0, `hit ${i}: ${JSON.stringify(hit.usage)}`);
        assert.equal(hit.choices[0]!.message.content, reference, "a hit answers as a miss");
      }
      const other = await ask(server, "sk-prefix-beta-002");
      assert.equal(cached(other.usage), 0, "another tenant's identical prompt is a miss");
      assert.equal(other.choices[0]!.message.content, reference);
      // `cached_pages` is as of each node's last readiness ping (docs/api.md), and the requests
      // above can all finish within one ping interval: read it until a ping has come since.
      const readPrefillCached = async () => {
        const nodes = (await (await operatorGet(server.url, "/kvfence/nodes")).json()) as NodesInfo;
        return nodes.nodes.filter((n) => n.role === "prefill").map((n) => n.cached_pages ?? 0);
      };
      const deadline = Date.now() + 10 * PING_INTERVAL_MS;
      let prefillCached = await readPrefillCached();
      while (!prefillCached.some((c) => c > 0) && Date.now() < deadline) {
        await sleep(PING_INTERVAL_MS / 4);
        prefillCached = await readPrefillCached();
      }
      assert.ok(
        prefillCached.some((c) => c > 0),
        `cached pages on a prefill node: ${JSON.stringify(prefillCached)}`,
      );
      await assertPoolIdle(server.url);
    });
  });
}

describe("canary probe with the prefix cache on: load, aborts, a pool that forces evictions", {
  timeout: 180_000,
}, () => {
  let server: TopologyServer;
  before(async () => {
    // 64 pages of 16 tokens on each node: the probe's plants and prompts overflow the cache.
    server = await startInProcess("threads", {
      model: modelDir("kvfence-tiny"),
      kvPages: 64,
      maxModelLen: 1024,
      apiKeys: KEYS,
    });
  });
  after(() => server.close());

  test("runProbe() reports clean while other requests are aborted mid-flight", async () => {
    let stop = false;
    const aborts = (async () => {
      for (let i = 0; !stop && i < 200; i++) {
        const controller = new AbortController();
        const sent = fetch(`${server.baseURL}/chat/completions`, {
          method: "POST",
          signal: controller.signal,
          headers: { "content-type": "application/json", authorization: "Bearer sk-prefix-alpha-01" },
          body: JSON.stringify({
            model: "kvfence-tiny",
            messages: [{ role: "user", content: `${PROMPT} ${i % 3}` }],
            max_tokens: 64,
            stream: true,
          }),
        }).catch(() => null);
        await new Promise((r) => setTimeout(r, 15 + (i % 4) * 10));
        controller.abort();
        await sent;
      }
    })();
    const report = await runProbe({
      baseUrl: server.baseURL,
      apiKeyA: "sk-prefix-alpha-01",
      apiKeyB: "sk-prefix-beta-002",
      operatorKey: TEST_OPERATOR_KEY,
      requests: 24,
      concurrency: 6,
      seed: 16,
    });
    stop = true;
    await aborts;
    assert.equal(report.outcome, "clean", JSON.stringify(report.findings.slice(0, 3)));
    const m = await scrape(server.url);
    assert.ok((m.get("kvfence_prefix_cache_evictions_total") ?? 0) > 0, "the small pool forced evictions");
    assert.ok((m.get('kvfence_prefix_cache_lookups_total{result="hit"}') ?? 0) > 0, "the cache served hits");
    await assertPoolIdle(server.url);
  });
});
