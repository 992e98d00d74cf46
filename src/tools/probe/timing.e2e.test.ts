/**
 * `kvfence probe --timing` against real kvfence servers: the prefix cache fenced per tenant passes
 * (no leak; the power check sees A's own hits) in the threaded topology, through the KV tiers (each
 * plant pushed out of the pool into host memory first) and in the `key` scope,
 * and a server whose prefix keys ignore the tenant (`shared-prefix` with the `tenant-salt` and
 * `page-tags` guards off) is caught as a leak. The grammar-cache audit (`--timing-case grammar`)
 * finds no leak on kvfence's per-tenant cache of compiled schemas, while A's own repeat is faster.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { modelDir, scrape, startTestServer } from "../../../testing/start-server.js";
import { startIncidentServer } from "../incident/incident.js";
import { renderGrammarTimingReport, runGrammarTimingProbe } from "./grammar-timing.js";
import { renderTimingReport, runTimingProbe, type TimingReport } from "./timing.js";

const TRIALS = 10;

/**
 * No leak; and A's own repeat is faster (the median: on a loaded machine its test may miss the
 * 1% level, which makes the verdict "inconclusive", never "leak").
 */
function assertNoLeak(
  report: Omit<TimingReport, "prefixChars" | "evictRequests">,
  text = renderTimingReport(report as TimingReport),
): void {
  assert.notEqual(report.verdict, "leak", text);
  assert.ok(report.crossTenant.test.p >= report.alpha, text);
  assert.ok(report.sameTenant.medianPlantedMs < report.sameTenant.medianFreshMs, text);
}

const TENANTS = { "sk-timing-alpha-01": "alpha", "sk-timing-beta-002": "beta" };

test("the timing probe finds no leak on kvfence (threaded, tenant scope); A's own repeat is faster", {
  timeout: 240_000,
}, async () => {
  const server = await startTestServer({
    model: modelDir("kvfence-tiny"),
    kvPages: 256,
    apiKeys: TENANTS,
    disaggregation: true,
  });
  try {
    const report = await runTimingProbe({
      baseUrl: server.url,
      apiKeyA: "sk-timing-alpha-01",
      apiKeyB: "sk-timing-beta-002",
      trials: TRIALS,
      prefixChars: 900,
    });
    assertNoLeak(report);
    assert.equal(report.failures, 0);
  } finally {
    await server.close();
  }
});

test("the timing probe finds no leak through the KV tiers (--timing-case tiers): A's own repeat, loaded back from host memory, is faster", {
  timeout: 240_000,
}, async () => {
  // 80 pages of 16 tokens: three fresh prompts of ~720 tokens (this tokenizer: about a token a
  // character) push each plant out of the pool into --cache-ram.
  const server = await startTestServer({
    model: modelDir("kvfence-tiny"),
    kvPages: 80,
    maxModelLen: 1024,
    apiKeys: TENANTS,
    disaggregation: true,
    cacheRam: "64MiB",
  });
  try {
    const report = await runTimingProbe({
      baseUrl: server.url,
      apiKeyA: "sk-timing-alpha-01",
      apiKeyB: "sk-timing-beta-002",
      trials: TRIALS,
      prefixChars: 700,
      evictRequests: 3,
    });
    assertNoLeak(report);
    assert.equal(report.failures, 0);
    assert.match(renderTimingReport(report), /pushed out of the KV pool by 3 fresh prompts/);
    const m = await scrape(server.url);
    // A's repeats were hits from the tier: the plants really left the pool.
    const ramLoads = m.get('kvfence_kv_tier_loads_total{tier="ram"}') ?? 0;
    assert.ok(ramLoads >= TRIALS, `pages loaded back from RAM: ${ramLoads}`);
  } finally {
    await server.close();
  }
});

test("the timing probe finds no leak between two keys of one tenant in the key scope", {
  timeout: 240_000,
}, async () => {
  const server = await startTestServer({
    model: modelDir("kvfence-tiny"),
    kvPages: 256,
    apiKeys: { "sk-timing-key-one-1": "acme", "sk-timing-key-two-2": "acme" },
    prefixCacheScope: "key",
  });
  try {
    const report = await runTimingProbe({
      baseUrl: server.url,
      apiKeyA: "sk-timing-key-one-1",
      apiKeyB: "sk-timing-key-two-2",
      trials: TRIALS,
      prefixChars: 900,
    });
    assertNoLeak(report);
  } finally {
    await server.close();
  }
});

test("the timing probe catches a prefix cache shared across tenants (shared-prefix, guards off)", {
  timeout: 240_000,
}, async () => {
  const server = await startIncidentServer({
    faults: ["shared-prefix"],
    disabledGuards: ["tenant-salt", "page-tags"],
    undersizedPrefill: false,
    topology: "single",
  });
  try {
    const report = await runTimingProbe({
      baseUrl: server.url,
      apiKeyA: server.keyA,
      apiKeyB: server.keyB,
      trials: TRIALS,
      prefixChars: 900,
    });
    assert.equal(report.verdict, "leak", renderTimingReport(report));
    assert.match(renderTimingReport(report), /LEAK/);
  } finally {
    await server.close();
  }
});

test("the grammar timing probe finds no leak on kvfence's per-tenant grammar cache; A's own repeat is faster", {
  timeout: 240_000,
}, async () => {
  const server = await startTestServer({
    model: modelDir("kvfence-tiny"),
    kvPages: 256,
    apiKeys: { "sk-grammar-timing-a": "alpha", "sk-grammar-timing-b": "beta" },
  });
  try {
    const report = await runGrammarTimingProbe({
      baseUrl: server.url,
      apiKeyA: "sk-grammar-timing-a",
      apiKeyB: "sk-grammar-timing-b",
      trials: TRIALS,
    });
    assertNoLeak(report, renderGrammarTimingReport(report));
  } finally {
    await server.close();
  }
});
