/**
 * `kvfence bench prefix-cache` end to end on the bundled model: real server processes per arm,
 * real multi-turn traffic turn by turn; the cached arm computes fewer prompt tokens than `off`,
 * its answers are the off arm's, and the report names the working set against the pools.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { formatPrefixCacheReport, runPrefixCacheBench } from "./prefix-cache.js";

test("runPrefixCacheBench() compares the arms turn by turn: the cache computes fewer prompt tokens, same answers", async () => {
  const result = await runPrefixCacheBench({
    topology: "cluster",
    prefillNodes: 2,
    decodeNodes: 1,
    arms: ["off", "on"],
    sessions: 3,
    concurrency: 2,
    turns: 3,
    rounds: 1,
    documentLen: 48,
    inputLen: 12,
    outputLen: 6,
    kvPages: 64,
    maxModelLen: 512,
  });
  assert.deepEqual(result.failures, []);
  const [off, on] = [result.arms.find((a) => a.name === "off")!, result.arms.find((a) => a.name === "on")!];
  assert.equal(on.promptTokens, off.promptTokens, "the same conversations in both arms");
  assert.ok(on.computedTokens < off.computedTokens, `cached ${on.computedTokens} < ${off.computedTokens}`);
  assert.equal(off.computedTokens, off.promptTokens, "the off arm computes every prompt token");
  assert.equal(off.ttftRatio, null);
  assert.ok(on.ttftRatio !== null && on.ttftRatio.ratio > 0);
  assert.equal(result.prefillPoolTokens, 2 * 64 * 16);
  // Decode-side reuse: later turns hold their conversation's pages on decode with the cache on.
  assert.ok(off.pagesSent !== null && off.pagesSent > 0, "the off arm's transfers counted");
  assert.equal(off.pagesReused, 0, "nothing held on decode with the cache off");
  assert.ok(on.pagesReused !== null && on.pagesReused > 0, `held on decode: ${on.pagesReused}`);
  assert.ok(on.pagesSent! < off.pagesSent!, `fewer pages sent: ${on.pagesSent} < ${off.pagesSent}`);
  assert.ok(
    result.workingSetTokens > off.promptTokens / 9,
    "the working set is the conversations' last turns",
  );
  const report = formatPrefixCacheReport(result);
  assert.match(report, /2 prefill \+ 1 decode nodes/);
  assert.match(report, /working set \d+ tokens: [\d.]+× the prefill pools \(2048 tokens\)/);
  assert.match(report, /pool only \/ cache off: [\d.]+/);
});
