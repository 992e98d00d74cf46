import assert from "node:assert/strict";
import { test } from "node:test";
import { exponentialBuckets, MetricsRegistry, parsePrometheusText } from "./metrics.js";

test("MetricsRegistry.render() writes counters with labels, HELP and TYPE", async () => {
  const registry = new MetricsRegistry();
  const requests = registry.counter("kv_requests_total", "Requests", ["tenant", "status"]);
  requests.inc({ tenant: "a", status: 200 });
  requests.inc({ tenant: "a", status: 200 }, 2);
  requests.inc({ tenant: 'we"ird\n', status: 400 });
  const text = await registry.render();
  assert.match(text, /^# HELP kv_requests_total Requests\n# TYPE kv_requests_total counter\n/);
  assert.match(text, /kv_requests_total\{tenant="a",status="200"\} 3\n/);
  assert.match(text, /kv_requests_total\{tenant="we\\"ird\\n",status="400"\} 1\n/);
});

test("Counter.inc() refuses a negative amount and setTotal() refuses going down", () => {
  const registry = new MetricsRegistry();
  const c = registry.counter("c_total", "c");
  assert.throws(() => c.inc(undefined, -1), /only increase/);
  c.setTotal(5);
  assert.throws(() => c.setTotal(4), /cannot go down/);
  assert.equal(c.get(), 5);
});

test("Histogram.render() writes cumulative buckets, +Inf, sum and count", async () => {
  const registry = new MetricsRegistry();
  const h = registry.histogram("lat_seconds", "latency", { labelNames: ["endpoint"], buckets: [0.1, 1] });
  for (const v of [0.05, 0.5, 0.5, 3]) h.observe(v, { endpoint: "chat" });
  const parsed = parsePrometheusText(await registry.render());
  assert.equal(parsed.get('lat_seconds_bucket{endpoint="chat",le="0.1"}'), 1);
  assert.equal(parsed.get('lat_seconds_bucket{endpoint="chat",le="1"}'), 3);
  assert.equal(parsed.get('lat_seconds_bucket{endpoint="chat",le="+Inf"}'), 4);
  assert.equal(parsed.get('lat_seconds_sum{endpoint="chat"}'), 4.05);
  assert.equal(parsed.get('lat_seconds_count{endpoint="chat"}'), 4);
});

test("MetricsRegistry.onCollect() runs before each render", async () => {
  const registry = new MetricsRegistry();
  const g = registry.gauge("pages", "pages", ["state"]);
  let free = 3;
  registry.onCollect(async () => g.set(free, { state: "free" }));
  assert.equal(parsePrometheusText(await registry.render()).get('pages{state="free"}'), 3);
  free = 7;
  assert.equal(parsePrometheusText(await registry.render()).get('pages{state="free"}'), 7);
});

test("MetricsRegistry refuses duplicate names, missing labels and bad names", () => {
  const registry = new MetricsRegistry();
  const c = registry.counter("x_total", "x", ["a"]);
  assert.throws(() => registry.counter("x_total", "again"), /already registered/);
  assert.throws(() => c.inc({}), /missing label: a/);
  assert.throws(() => registry.gauge("bad-name", "b"), /Invalid metric name/);
  assert.throws(() => registry.histogram("h", "h", { buckets: [2, 1] }), /must increase/);
});

test("exponentialBuckets() grows by the factor", () => {
  assert.deepEqual(exponentialBuckets(0.001, 2, 4), [0.001, 0.002, 0.004, 0.008]);
});
