import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { type Misbehaviour, startFakeOpenAiServer } from "../../../testing/fake-openai-server.js";
import { type ProbeOptions, runProbe } from "./probe.js";
import { exitCodeOf, type FindingKind, type ProbeReport, renderProbeSummary } from "./probe-report.js";

const KEYS = ["key-a", "key-b"];

async function probeAgainst(
  misbehave: Misbehaviour[],
  server: {
    maxModelLen?: number;
    poolTokens?: number;
    modelsReportMaxLen?: boolean;
    sglangInfo?: boolean;
  } = {},
  probe: Partial<ProbeOptions> = {},
): Promise<ProbeReport> {
  const fake = await startFakeOpenAiServer({ maxModelLen: 2048, apiKeys: KEYS, misbehave, ...server });
  try {
    return await runProbe({
      baseUrl: `${fake.url}/v1`,
      apiKeyA: "key-a",
      apiKeyB: "key-b",
      requests: 12,
      concurrency: 4,
      seed: 7,
      timeoutMs: 10_000,
      ...probe,
    });
  } finally {
    await fake.close();
  }
}

function kinds(report: ProbeReport): Set<FindingKind> {
  return new Set(report.findings.map((f) => f.kind));
}

describe("runProbe() against the well-behaved fake", () => {
  let report: ProbeReport;
  before(async () => {
    report = await probeAgainst([]);
  });

  test("runProbe() reports clean and exit 0 when the server behaves", () => {
    assert.deepEqual(report.findings, [], renderProbeSummary(report));
    assert.deepEqual(report.warnings, []);
    assert.equal(report.outcome, "clean");
    assert.equal(exitCodeOf(report), 0);
  });

  test("runProbe() runs every phase with checks and finds max_model_len on /v1/models", () => {
    for (const p of report.phases) assert.ok(p.checks > 0, `${p.phase} made no checks`);
    assert.equal(report.maxModelLen, 2048);
    assert.match(report.maxModelLenSource, /v1\/models/);
    assert.equal(report.planted.repeated, report.planted.asked);
    assert.ok(report.planted.codes >= 16);
  });

  test("runProbe() calibrates one token per character against a byte-token server", () => {
    assert.ok(Math.abs(report.tokensPerChar - 1) < 0.01, String(report.tokensPerChar));
  });
});

describe("runProbe() detectors fire on the matching misbehaviour", () => {
  test("runProbe() finds a cross-tenant leak when the server answers with another tenant's code", async () => {
    const r = await probeAgainst(["leak"]);
    assert.ok(kinds(r).has("leak"), renderProbeSummary(r));
    assert.ok(r.findings.some((f) => f.kind === "leak" && f.case.startsWith("load#")));
    assert.ok(
      r.findings.some((f) => f.kind === "leak" && f.case.endsWith("/stream")),
      "no leak seen in a stream",
    );
    assert.ok(
      r.findings.some((f) => f.kind === "leak" && f.case.endsWith("/plain")),
      "no leak seen unstreamed",
    );
    assert.equal(exitCodeOf(r), 1);
  });

  test("runProbe() flags a 200 to an over-limit prompt even when its text is clean", async () => {
    const r = await probeAgainst(["accept-over-limit"]);
    assert.ok(kinds(r).has("over-limit-accepted"), renderProbeSummary(r));
    assert.ok(!kinds(r).has("leak"));
    assert.ok(
      r.findings.some((f) => f.case === "over-limit/stream"),
      "streamed over-limit case not flagged",
    );
    assert.equal(exitCodeOf(r), 1);
  });

  test("runProbe() catches the placeholder swap of a prompt over the pool but under the context", async () => {
    const r = await probeAgainst(["placeholder"], { poolTokens: 1024 }, { poolTokens: 1024 });
    const k = kinds(r);
    assert.ok(k.has("over-limit-accepted"), renderProbeSummary(r));
    assert.ok(r.findings.some((f) => f.case.startsWith("over-pool-under-context")));
    assert.equal(r.effectiveLimit, 1024);
  });

  test("runProbe() reports a usage mismatch and a wrong answer for the placeholder when the pool is unknown to it", async () => {
    // The probe is not told the pool, so it sends an under-limit prompt the fake swaps for a placeholder.
    const r = await probeAgainst(["placeholder"], { poolTokens: 1024 });
    const k = kinds(r);
    assert.ok(k.has("wrong-answer"), renderProbeSummary(r));
    assert.ok(k.has("usage-mismatch"), renderProbeSummary(r));
  });

  test("runProbe() flags a truncated answer as a wrong answer", async () => {
    const r = await probeAgainst(["truncated-answer"]);
    assert.ok(kinds(r).has("wrong-answer"), renderProbeSummary(r));
  });

  test("runProbe() finds greedy outputs that change under concurrent load", async () => {
    const r = await probeAgainst(["nondeterministic"]);
    assert.ok(kinds(r).has("nondeterminism"), renderProbeSummary(r));
  });

  test("runProbe() requires a 4xx, not a 5xx, for an over-limit prompt", async () => {
    const r = await probeAgainst(["server-error-over-limit"]);
    assert.ok(kinds(r).has("not-4xx"), renderProbeSummary(r));
    assert.ok(!kinds(r).has("over-limit-accepted"));
  });

  test("runProbe() flags a 200 to malformed requests", async () => {
    const r = await probeAgainst(["accept-malformed"]);
    const cases = new Set(r.findings.filter((f) => f.kind === "malformed-accepted").map((f) => f.case));
    for (const c of [
      "bad-json",
      "empty-messages",
      "messages-not-array",
      "max-tokens-string",
      "temperature-string",
    ]) {
      assert.ok(cases.has(c), `${c} not flagged: ${renderProbeSummary(r)}`);
    }
  });
});

describe("runProbe() discovery and failures", () => {
  test("runProbe() reads context_length from SGLang's /server_info when /v1/models lacks it", async () => {
    const r = await probeAgainst([], { modelsReportMaxLen: false, sglangInfo: true, poolTokens: 1500 });
    assert.equal(r.maxModelLen, 2048);
    assert.match(r.maxModelLenSource, /server_info/);
    assert.equal(r.poolTokens, 1500);
    assert.equal(r.outcome, "clean", renderProbeSummary(r));
  });

  test("runProbe() skips limit prompts and warns when the context length is unknown", async () => {
    const r = await probeAgainst([], { modelsReportMaxLen: false });
    assert.equal(r.maxModelLen, null);
    assert.match(r.phases.find((p) => p.phase === "status")?.skipped ?? "", /max_model_len unknown/);
    assert.equal(r.outcome, "clean");
  });

  test("runProbe() returns outcome error (exit 2) when tenant B's key is refused", async () => {
    const r = await probeAgainst([], {}, { apiKeyB: "wrong" });
    assert.equal(r.outcome, "error");
    assert.equal(r.error?.code, "invalid_api_key");
    assert.equal(exitCodeOf(r), 2);
  });

  test("runProbe() returns outcome error (exit 2) when the server is unreachable", async () => {
    const fake = await startFakeOpenAiServer();
    const url = fake.url;
    await fake.close();
    const r = await runProbe({ baseUrl: url, timeoutMs: 2000 });
    assert.equal(r.outcome, "error");
    assert.equal(r.error?.code, "node_unavailable");
    assert.equal(exitCodeOf(r), 2);
  });
});

describe("runProbe() bounds", () => {
  let fake: Awaited<ReturnType<typeof startFakeOpenAiServer>>;
  before(async () => {
    fake = await startFakeOpenAiServer({ maxModelLen: 2048 });
  });
  after(async () => {
    await fake.close();
  });

  test("runProbe() never has more requests in flight than --concurrency", async () => {
    const r = await runProbe({ baseUrl: fake.url, requests: 20, concurrency: 2, seed: 3 });
    assert.equal(r.outcome, "clean", renderProbeSummary(r));
    assert.ok(fake.maxInFlight <= 2, `max in flight ${fake.maxInFlight}`);
    assert.ok(fake.maxInFlight === 2, "the probe never ran requests concurrently");
  });
});
