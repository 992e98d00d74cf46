/**
 * `kvfence bench serve` against real kvfence servers (the bundled kvfence-tiny, worker threads,
 * shared memory): the default server serves a small run with every nonce where it belongs; the
 * incident's server with every guard off (docs/incident.md) answers requests with other requests'
 * nonces, and the contamination count says so — as the probe's incident tests catch the leak.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { assertFiguresMatch } from "../../../testing/serve-bench-check.js";
import { assertPoolIdle } from "../../../testing/start-server.js";
import { INCIDENT_FAULTS, INCIDENT_GUARDS, metricSum, startIncidentServer } from "../incident/incident.js";
import { runServeBench } from "./serve.js";
import { formatRun } from "./serve-report.js";

test("bench serve against a default kvfence server: every request completes, no response holds another's nonce, figures match the record and /metrics", {
  timeout: 120_000,
}, async () => {
  const server = await startIncidentServer({ faults: [], disabledGuards: [], defaults: true });
  try {
    const before = await server.metrics();
    const slo = { ttft: 5000, tpot: 500 };
    const { runs } = await runServeBench({
      baseUrl: server.url,
      apiKey: server.keyA,
      numPrompts: 12,
      inputLen: 300,
      rangeRatio: 0.5,
      outputLen: 100,
      maxConcurrency: 4,
      // No warm-up request: /metrics then counts exactly the run's tokens.
      warmup: false,
      requestRates: [Number.POSITIVE_INFINITY],
      slo,
      seed: 7,
      progress: null,
    });
    const run = runs[0]!;
    assert.equal(run.completed, 12, JSON.stringify(run.errors));
    assert.equal(run.model_id, "kvfence-tiny");
    assert.equal(run.contamination.nonce_style, "ask");
    assert.equal(run.contamination.contaminated_responses, 0, JSON.stringify(run.contamination.examples));
    // kvfence-tiny repeats its own record: the detector would see a copy of someone else's.
    assert.equal(run.contamination.own_nonce_repeated, 12);
    assertFiguresMatch(run, slo);
    // The token counts are the server's own: /metrics counted the same.
    const after = await server.metrics();
    assert.equal(
      metricSum(after, "kvfence_prompt_tokens_total") - metricSum(before, "kvfence_prompt_tokens_total"),
      run.total_input_tokens,
    );
    assert.equal(
      metricSum(after, "kvfence_completion_tokens_total") -
        metricSum(before, "kvfence_completion_tokens_total"),
      run.total_output_tokens,
    );
    // Raw completions: kvfence-tiny, outside its chat template, ends at once. Those answers count
    // as completed (one token, the finish chunk as the first), and the report says the detector
    // cannot see a copy.
    const raw = (
      await runServeBench({
        baseUrl: server.url,
        apiKey: server.keyA,
        endpoint: "/v1/completions",
        numPrompts: 3,
        inputLen: 100,
        progress: null,
      })
    ).runs[0]!;
    assert.equal(raw.completed, 3, JSON.stringify(raw.errors));
    assert.deepEqual(raw.output_lens, [1, 1, 1]);
    assert.deepEqual(raw.generated_texts, ["", "", ""]);
    assert.ok(raw.ttfts.every((t) => t > 0));
    assert.equal(raw.contamination.own_nonce_repeated, 0);
    assert.match(formatRun(raw), /only 0 of 3 responses repeated their own nonce/);
    await assertPoolIdle(server.url, { key: server.operatorKey });
  } finally {
    await server.close();
  }
});

/** The incident's run: one request at a time, prompts on both sides of the prefill pool (256 tokens). */
function incidentRun(url: string, key: string) {
  return runServeBench({
    baseUrl: url,
    apiKey: key,
    numPrompts: 24,
    inputLen: 180,
    rangeRatio: 0.3,
    outputLen: 64,
    maxConcurrency: 1,
    seed: 2,
    progress: null,
  });
}

test("bench serve against the incident with every guard off reports contamination: responses hold other requests' nonces", {
  timeout: 120_000,
}, async () => {
  const server = await startIncidentServer({ faults: INCIDENT_FAULTS, disabledGuards: [...INCIDENT_GUARDS] });
  try {
    const run = (await incidentRun(server.url, server.keyA)).runs[0]!;
    // Every answer was HTTP 200 and fast: status and latency alone show nothing wrong.
    assert.equal(run.failed, 0, JSON.stringify(run.errors));
    const c = run.contamination;
    assert.ok(c.contaminated_responses > 0, JSON.stringify(c));
    for (const e of c.examples) {
      assert.notEqual(e.planted_by, e.request);
      assert.ok(e.planted_by >= 0, "the nonce is one this run planted");
      assert.ok(
        run.generated_texts[e.request]!.toUpperCase()
          .replace(/[^A-Z0-9]/g, "")
          .includes(e.code.replace("-", "")),
      );
    }
  } finally {
    await server.close();
  }
});

test("bench serve against the incident's faults with every guard on: no contamination, the over-pool prompts get 400", {
  timeout: 120_000,
}, async () => {
  const server = await startIncidentServer({ faults: INCIDENT_FAULTS, disabledGuards: [] });
  try {
    const run = (await incidentRun(server.url, server.keyA)).runs[0]!;
    assert.equal(run.contamination.contaminated_responses, 0, JSON.stringify(run.contamination.examples));
    assert.ok(run.failed > 0 && run.completed > 0, `${run.completed} / ${run.failed}`);
    for (const e of run.errors.filter((x) => x !== ""))
      assert.match(e, /^HTTP 400: .*maximum context length/);
    assert.equal(run.contamination.own_nonce_repeated, run.completed);
  } finally {
    await server.close();
  }
});
