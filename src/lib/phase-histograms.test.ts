import assert from "node:assert/strict";
import { test } from "node:test";
import { Registry } from "prom-client";
import { parsePrometheusText } from "../tools/incident/prometheus-text.js";
import { MetricsScrape } from "./metrics-scrape.js";
import {
  addSnapshots,
  PHASE,
  PHASE_BUCKETS,
  PhaseMetrics,
  PhaseRecorder,
  type PhaseSource,
  phasePercentiles,
  renderPhaseMetrics,
  TRANSFER_BYTES_BUCKETS,
} from "./phase-histograms.js";

test("a recorder's observations render through prom-client with node and role labels, summed per node", async () => {
  const a = new PhaseRecorder();
  const b = new PhaseRecorder();
  a.observe(PHASE.inter_token, 0.001);
  a.observe(PHASE.inter_token, 0.003);
  b.observe(PHASE.inter_token, 100); // above the last bucket: +Inf only
  a.observeBytes(65536);
  const text = await renderPhaseMetrics([
    { node: "decode-0", role: "decode", snapshot: a.snapshot() },
    { node: "decode-1", role: "decode", snapshot: b.snapshot() },
  ]);
  assert.match(text, /# TYPE kvfence_phase_seconds histogram/);
  const m = parsePrometheusText(text);
  const labels = 'phase="inter_token",node="decode-0",role="decode"';
  assert.equal(m.get(`kvfence_phase_seconds_count{${labels}}`), 2);
  assert.ok(Math.abs(m.get(`kvfence_phase_seconds_sum{${labels}}`)! - 0.004) < 1e-12);
  // A bucket's `le` comes first, as in prom-client's own histograms (the place labels are shared).
  assert.equal(m.get(`kvfence_phase_seconds_bucket{le="0.0008",${labels}}`), 0);
  assert.equal(m.get(`kvfence_phase_seconds_bucket{le="0.0016",${labels}}`), 1);
  assert.equal(m.get(`kvfence_phase_seconds_bucket{le="+Inf",${labels}}`), 2);
  const other = 'phase="inter_token",node="decode-1",role="decode"';
  assert.equal(m.get(`kvfence_phase_seconds_bucket{le="${PHASE_BUCKETS.at(-1)}",${other}}`), 0);
  assert.equal(m.get(`kvfence_phase_seconds_bucket{le="+Inf",${other}}`), 1);
  assert.equal(m.get('kvfence_phase_transfer_bytes_count{node="decode-0",role="decode"}'), 1);
  // Phases with no observation have no series.
  assert.ok(![...m.keys()].some((k) => k.includes('phase="prefill"')));
  // Two snapshots of one node and role are summed (prom-client's aggregator).
  const twice = parsePrometheusText(
    await renderPhaseMetrics([
      { node: "decode-0", role: "decode", snapshot: a.snapshot() },
      { node: "decode-0", role: "decode", snapshot: a.snapshot() },
    ]),
  );
  assert.equal(twice.get(`kvfence_phase_seconds_count{${labels}}`), 4);
  assert.equal(twice.get(`kvfence_phase_seconds_bucket{${labels},le="0.0016"}`), 2);
  assert.equal(twice.get('kvfence_phase_transfer_bytes_count{node="decode-0",role="decode"}'), 2);
});

test("a disabled recorder records nothing; bytes and negative or NaN values are refused quietly", () => {
  const off = new PhaseRecorder(false);
  off.observe(PHASE.prefill, 0.1);
  off.observeBytes(10);
  assert.equal(phasePercentiles(off.snapshot(), "prefill").count, 0);
  const on = new PhaseRecorder();
  on.observe(PHASE.prefill, Number.NaN);
  on.observe(PHASE.prefill, -1);
  assert.equal(phasePercentiles(on.snapshot(), "prefill").count, 0);
});

test("percentiles from the buckets fall in the bucket of the true value; snapshots add", () => {
  const r = new PhaseRecorder();
  for (let i = 1; i <= 100; i++) r.observe(PHASE.first_token, i / 1000); // 1..100 ms
  const { count, mean, quantiles } = phasePercentiles(r.snapshot(), "first_token", [0.5, 0.99]);
  assert.equal(count, 100);
  assert.ok(Math.abs(mean - 0.0505) < 1e-9);
  assert.ok(quantiles[0]! > 0.0256 && quantiles[0]! <= 0.0512, String(quantiles[0]));
  assert.ok(quantiles[1]! > 0.0512 && quantiles[1]! <= 0.1024, String(quantiles[1]));
  const sum = addSnapshots([r.snapshot(), r.snapshot()]);
  assert.equal(phasePercentiles(sum, "first_token").count, 200);
});

test("PhaseMetrics renders every place's snapshots as read by the scrape, with no series before any", async () => {
  const scrape = new MetricsScrape(new Registry());
  const phases = new PhaseMetrics(scrape.registry, scrape);
  const engine = new PhaseRecorder();
  const router = new PhaseRecorder();
  let read: PhaseSource[] = [];
  scrape.add(async () => {
    await new Promise((resolve) => setTimeout(resolve, 10));
    read = [{ node: "engine", role: "engine", snapshot: engine.snapshot() }];
  });
  phases.add(() => read);
  phases.add(() => [{ node: "router", role: "router", snapshot: router.snapshot() }]);
  const idle = await scrape.registry.metrics();
  assert.equal(parsePrometheusText(idle).size, 0);
  assert.match(
    idle,
    /# TYPE kvfence_phase_seconds histogram\n[\s\S]*# TYPE kvfence_phase_transfer_bytes histogram/,
  );
  engine.observe(PHASE.prefill, 0.01);
  router.observeBytes(2_000_000);
  const m = parsePrometheusText(await scrape.registry.metrics());
  assert.equal(m.get('kvfence_phase_seconds_count{phase="prefill",node="engine",role="engine"}'), 1);
  assert.equal(m.get('kvfence_phase_transfer_bytes_count{node="router",role="router"}'), 1);
  // The byte buckets' bounds keep their 6 significant digits (4 MiB reads 4194300).
  assert.equal(TRANSFER_BYTES_BUCKETS[5], 4194300);
  assert.equal(m.get('kvfence_phase_transfer_bytes_bucket{le="4194300",node="router",role="router"}'), 1);
});
