/**
 * `kvfence probe --timing` against real kvfence servers: the prefix cache fenced per tenant passes
 * (no leak; the power check sees A's own hits) in the threaded topology and in the `key` scope,
 * and a server whose prefix keys ignore the tenant (`shared-prefix` with the `tenant-salt` and
 * `page-tags` guards off) is caught as a leak. The grammar-cache audit (`--timing-case grammar`)
 * finds no leak on kvfence's per-tenant cache of compiled schemas, while A's own repeat is faster.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { modelDir, startTestServer } from "../../../testing/start-server.js";
import { startIncidentServer } from "../incident/incident.js";
import { renderGrammarTimingReport, runGrammarTimingProbe } from "./grammar-timing.js";
import { renderTimingReport, runTimingProbe, type TimingReport } from "./timing.js";

const TRIALS = 10;

/**
 * No leak; and A's own repeat is faster (the median: on a loaded machine its test may miss the
 * 1% level, which makes the verdict "inconclusive", never "leak").
 */
function assertNoLeak(
  report: Omit<TimingReport, "prefixChars">,
  text = renderTimingReport(report as TimingReport),
): void {
  assert.notEqual(report.verdict, "leak", text);
  assert.ok(report.crossTenant.test.p >= report.alpha, text);
  assert.ok(report.sameTenant.medianPlantedMs < report.sameTenant.medianFreshMs, text);
}

test("the timing probe finds no leak on kvfence (threaded, tenant scope); A's own repeat is faster", {
  timeout: 240_000,
}, async () => {
  const server = await startIncidentServer({ faults: [], disabledGuards: [], undersizedPrefill: false });
  try {
    const report = await runTimingProbe({
      baseUrl: server.url,
      apiKeyA: server.keyA,
      apiKeyB: server.keyB,
      trials: TRIALS,
      prefixChars: 900,
    });
    assertNoLeak(report);
    assert.equal(report.failures, 0);
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
