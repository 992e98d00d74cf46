import assert from "node:assert/strict";
import { test } from "node:test";
import { Counter, Gauge, Registry } from "prom-client";
import { parsePrometheusText } from "../tools/incident/prometheus-text.js";
import { MetricsScrape, setCounter } from "./metrics-scrape.js";

test("MetricsScrape.read() runs the reads once a scrape, in order, before any of its metrics renders", async () => {
  const scrape = new MetricsScrape(new Registry());
  const pages = new Gauge({
    name: "pages",
    help: "pages",
    labelNames: ["state"] as const,
    ...scrape.options,
  });
  const total = new Gauge({ name: "pages_total", help: "pages", ...scrape.options });
  const order: string[] = [];
  let free = 3;
  scrape.add(async () => {
    await new Promise((resolve) => setTimeout(resolve, 20));
    order.push("engine");
    pages.set({ state: "free" }, free);
  });
  scrape.add(() => {
    order.push("nodes");
    total.set(free + 1);
  });
  let m = parsePrometheusText(await scrape.registry.metrics());
  assert.equal(m.get('pages{state="free"}'), 3);
  assert.equal(m.get("pages_total"), 4);
  assert.deepEqual(order, ["engine", "nodes"]);
  free = 7;
  m = parsePrometheusText(await scrape.registry.metrics());
  assert.equal(m.get('pages{state="free"}'), 7);
  assert.equal(m.get("pages_total"), 8);
  assert.deepEqual(order, ["engine", "nodes", "engine", "nodes"]);
});

test("setCounter() sets one series to a total counted elsewhere and leaves the others", async () => {
  const registry = new Registry();
  const c = new Counter({ name: "x_total", help: "x", labelNames: ["a"] as const, registers: [registry] });
  setCounter(c, 5, { a: "one" });
  setCounter(c, 2, { a: "two" });
  setCounter(c, 9, { a: "one" });
  const m = parsePrometheusText(await registry.metrics());
  assert.equal(m.get('x_total{a="one"}'), 9);
  assert.equal(m.get('x_total{a="two"}'), 2);
});

test("MetricsScrape.totalCounters() have no series until set, then read their totals (a missing one 0)", async () => {
  const scrape = new MetricsScrape(new Registry());
  const update = scrape.totalCounters([
    { name: "hits_total", help: "hits", total: "hits" },
    { name: "misses_total", help: "misses", total: "misses" },
  ]);
  let totals: { hits?: number; misses?: number } | undefined;
  scrape.add(() => {
    if (totals !== undefined) update(totals);
  });
  const text = await scrape.registry.metrics();
  assert.equal(parsePrometheusText(text).size, 0);
  assert.match(text, /# TYPE hits_total counter/);
  totals = { hits: 4 };
  const m = parsePrometheusText(await scrape.registry.metrics());
  assert.equal(m.get("hits_total"), 4);
  assert.equal(m.get("misses_total"), 0);
});
