import assert from "node:assert/strict";
import { test } from "node:test";
import { startFakeOpenAiServer } from "../../../testing/fake-openai-server.js";
import { Prng } from "../../lib/prng.js";
import { randomSchema, renderGrammarTimingReport, runGrammarTimingProbe } from "./grammar-timing.js";

const KEYS = { apiKeyA: "sk-grammar-a", apiKeyB: "sk-grammar-b" };

test("runGrammarTimingProbe() reports a leak on a grammar cache shared across keys", async () => {
  const server = await startFakeOpenAiServer({ grammarCache: "shared", apiKeys: Object.values(KEYS) });
  try {
    const report = await runGrammarTimingProbe({ baseUrl: server.url, ...KEYS, trials: 10 });
    const text = renderGrammarTimingReport(report);
    assert.equal(report.verdict, "leak", text);
    assert.match(text, /^LEAK: tenant B's constrained request is faster/m);
    assert.equal(report.failures, 0);
  } finally {
    await server.close();
  }
});

test("runGrammarTimingProbe() finds no leak on a cache per key, and sees the key's own hits", async () => {
  const server = await startFakeOpenAiServer({ grammarCache: "per-key", apiKeys: Object.values(KEYS) });
  try {
    const report = await runGrammarTimingProbe({ baseUrl: server.url, ...KEYS, trials: 10 });
    const text = renderGrammarTimingReport(report);
    assert.equal(report.verdict, "no-leak", text);
    assert.ok(report.sameTenant.medianPlantedMs < report.sameTenant.medianFreshMs, text);
  } finally {
    await server.close();
  }
});

test("runGrammarTimingProbe() is inconclusive on a server that caches no grammar", async () => {
  const server = await startFakeOpenAiServer({ apiKeys: Object.values(KEYS) });
  try {
    const report = await runGrammarTimingProbe({ baseUrl: server.url, ...KEYS, trials: 10 });
    assert.notEqual(report.verdict, "leak", renderGrammarTimingReport(report));
  } finally {
    await server.close();
  }
});

test("randomSchema() draws schemas of the given size, each unlike the others", () => {
  const rng = new Prng(7);
  const a = randomSchema(rng, 24);
  const b = randomSchema(rng, 24);
  assert.equal(Object.keys(a.properties as object).length, 24);
  assert.deepEqual(a.required, Object.keys(a.properties as object));
  assert.notDeepEqual(Object.keys(a.properties as object), Object.keys(b.properties as object));
});
