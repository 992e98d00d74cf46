import assert from "node:assert/strict";
import { test } from "node:test";
import { Registry } from "prom-client";
import { parsePrometheusText } from "../tools/incident/prometheus-text.js";
import { HistogramRecorder } from "./histogram-recorder.js";

function recorder(registry = new Registry()) {
  const h = new HistogramRecorder({
    name: "lat_seconds",
    help: "latency",
    labelName: "endpoint",
    buckets: [0.1, 1],
    registers: [registry],
  });
  return { h, registry };
}

test("HistogramRecorder renders cumulative buckets, +Inf, sum and count through prom-client", async () => {
  const { h, registry } = recorder();
  for (const v of [0.05, 0.5, 0.5, 3]) h.observe({ endpoint: "chat" }, v);
  const text = await registry.metrics();
  assert.match(text, /^# HELP lat_seconds latency\n# TYPE lat_seconds histogram\n/);
  const parsed = parsePrometheusText(text);
  // A bucket's `le` first, as in prom-client's own histograms.
  assert.equal(parsed.get('lat_seconds_bucket{le="0.1",endpoint="chat"}'), 1);
  assert.equal(parsed.get('lat_seconds_bucket{le="1",endpoint="chat"}'), 3);
  assert.equal(parsed.get('lat_seconds_bucket{le="+Inf",endpoint="chat"}'), 4);
  assert.equal(parsed.get('lat_seconds_sum{endpoint="chat"}'), 4.05);
  assert.equal(parsed.get('lat_seconds_count{endpoint="chat"}'), 4);
});

test("HistogramRecorder.observeMany() counts each observation; unobserved labels have no series", async () => {
  const { h, registry } = recorder();
  h.observeMany({ endpoint: "completions" }, 0.25, 3);
  h.observeMany({ endpoint: "completions" }, Number.NaN, 2);
  h.observeMany({ endpoint: "completions" }, 0.25, 0);
  const parsed = parsePrometheusText(await registry.metrics());
  assert.equal(parsed.get('lat_seconds_bucket{le="0.1",endpoint="completions"}'), 0);
  assert.equal(parsed.get('lat_seconds_bucket{le="1",endpoint="completions"}'), 3);
  assert.equal(parsed.get('lat_seconds_sum{endpoint="completions"}'), 0.75);
  assert.equal(parsed.get('lat_seconds_count{endpoint="completions"}'), 3);
  assert.ok(![...parsed.keys()].some((k) => k.includes('endpoint="chat"')));
  registry.resetMetrics();
  assert.equal(parsePrometheusText(await registry.metrics()).size, 0);
});

test("HistogramRecorder refuses a name its registry already holds", () => {
  const { registry } = recorder();
  assert.throws(() => recorder(registry), /already been registered/);
});
