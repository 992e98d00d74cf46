import assert from "node:assert/strict";
import { test } from "node:test";
import { allocationPerRound, leastAllocation } from "../../testing/heap-growth.js";
import { ScriptedEngine } from "../../testing/scripted-engine.js";
import type { EngineStats } from "../protocol/engine-api.js";
import { parsePrometheusText } from "../tools/incident/prometheus-text.js";
import { RouterMetrics } from "./router-metrics.js";

/** A scripted engine whose stats are counted, and carry a prefix cache once `cache` is set. */
function countedEngine() {
  const engine = new ScriptedEngine();
  const own = engine.stats.bind(engine);
  const seen = { calls: 0, cache: undefined as EngineStats["prefixCache"] };
  engine.stats = async () => {
    seen.calls++;
    const stats = await own();
    return seen.cache === undefined ? stats : { ...stats, prefixCache: seen.cache };
  };
  return { engine, seen };
}

test("RouterMetrics.registry renders HELP, TYPE and label values escaped (backslash, quote, newline)", async () => {
  const metrics = new RouterMetrics(new ScriptedEngine());
  metrics.requests.inc({ tenant: "a", endpoint: "chat", status: 200 });
  metrics.requests.inc({ tenant: "a", endpoint: "chat", status: 200 }, 2);
  metrics.requests.inc({ tenant: 'we"ird\\\n', endpoint: "chat", status: 400 });
  const text = await metrics.registry.metrics();
  assert.match(
    text,
    /^# HELP kvfence_requests_total HTTP requests by tenant, endpoint and status code\n# TYPE kvfence_requests_total counter\n/,
  );
  assert.match(text, /\nkvfence_requests_total\{tenant="a",endpoint="chat",status="200"\} 3\n/);
  assert.match(text, /\nkvfence_requests_total\{tenant="we\\"ird\\\\\\n",endpoint="chat",status="400"\} 1\n/);
  assert.equal(metrics.registry.contentType, "text/plain; version=0.0.4; charset=utf-8");
});

test("RouterMetrics reads the engine's stats once a scrape, the prefix cache's series once it is on", async () => {
  const { engine, seen } = countedEngine();
  const metrics = new RouterMetrics(engine);
  let m = parsePrometheusText(await metrics.registry.metrics());
  assert.equal(seen.calls, 1);
  assert.equal(m.get('kvfence_kv_pool_pages{state="free"}'), 64);
  assert.equal(m.get("kvfence_kv_pool_pages_total"), 64);
  assert.equal(m.get("kvfence_engine_aborts_total"), 0);
  assert.equal(m.get("kvfence_prefill_tokens_total"), 0);
  assert.ok(![...m.keys()].some((k) => k.startsWith("kvfence_prefix_cache")), "no cache, no series");
  seen.cache = {
    hits: 2,
    misses: 5,
    hitTokens: 32,
    evictions: 1,
    collisions: 0,
    sharedPages: 4,
    evictablePages: 3,
  };
  m = parsePrometheusText(await metrics.registry.metrics());
  assert.equal(seen.calls, 2);
  assert.equal(m.get('kvfence_prefix_cache_lookups_total{result="hit"}'), 2);
  assert.equal(m.get('kvfence_prefix_cache_lookups_total{result="miss"}'), 5);
  assert.equal(m.get("kvfence_prefix_cache_hit_tokens_total"), 32);
  assert.equal(m.get("kvfence_prefix_cache_evictions_total"), 1);
  assert.equal(m.get("kvfence_prefix_cache_collisions_total"), 0);
  assert.equal(m.get('kvfence_prefix_cache_pages{state="referenced"}'), 1);
  assert.equal(m.get('kvfence_prefix_cache_pages{state="unreferenced"}'), 3);
  assert.equal(m.get('kvfence_kv_pool_pages{state="shared"}'), 4);
});

test("RouterMetrics.interTokenLatency allocates nothing per token (~0 bytes over 2000 observations)", async () => {
  const metrics = new RouterMetrics(new ScriptedEngine());
  const chat = { endpoint: "chat" } as const;
  const completions = { endpoint: "completions" } as const;
  const least = leastAllocation(
    await allocationPerRound(
      (i) => {
        metrics.interTokenLatency.observe(i % 2 === 0 ? chat : completions, 0.0001 * (i % 300));
        metrics.interTokenLatency.observeMany(chat, 0.002, 1 + (i % 3));
      },
      { warmup: 3000, steps: 2000, rounds: 5, below: 4096 },
    ),
  );
  assert.ok(least.bytes < 4096, `${least.bytes} bytes allocated over 2000 observations: ${least.sites}`);
  const m = parsePrometheusText(await metrics.registry.metrics());
  assert.ok(m.get('kvfence_inter_token_latency_seconds_count{endpoint="chat"}')! > 2000);
});
