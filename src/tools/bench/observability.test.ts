/**
 * The pure parts of `kvfence bench observability` (src/tools/bench/observability.ts): the arms'
 * order rotates so each arm takes each place equally often, `--what` parses, and the verdict
 * reads a confidence interval against a bound.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { armOrder, FEATURES, parseWhat, verdict } from "./observability.js";

test("every arm takes every place once in as many rounds as there are arms", () => {
  const arms = ["off", ...FEATURES];
  const places = arms.map(() => new Set<string>());
  for (let r = 0; r < arms.length; r++) {
    const order = armOrder(FEATURES, r);
    assert.deepEqual([...order].sort(), [...arms].sort(), `round ${r}: each arm once`);
    for (const [i, arm] of order.entries()) places[i]!.add(arm);
  }
  for (const p of places) assert.equal(p.size, arms.length);
  assert.deepEqual(armOrder(FEATURES, -1), armOrder(FEATURES, arms.length - 1), "warm-up rounds rotate too");
});

test("--what: a list of features in a fixed order, each for all of them, a clear error otherwise", () => {
  assert.deepEqual(parseWhat("all,histograms"), ["histograms", "all"]);
  assert.deepEqual(parseWhat("each"), [...FEATURES]);
  assert.deepEqual(parseWhat("traces, traces"), ["traces"]);
  assert.throws(() => parseWhat("histogram"), /"histogram" is not a feature; give a comma-separated list/);
});

test("the verdict: within the bound, beyond it, undecided, too few rounds", () => {
  assert.match(verdict({ ratio: 1, low: 0.992, high: 1.01, n: 10, logs: [] }, 0.99), /costs at most 1\.0%/);
  assert.match(
    verdict({ ratio: 0.95, low: 0.93, high: 0.97, n: 10, logs: [] }, 0.99),
    /costs MORE than 1\.0%/,
  );
  assert.match(verdict({ ratio: 0.99, low: 0.97, high: 1.01, n: 10, logs: [] }, 0.99), /undecided/);
  assert.match(
    verdict({ ratio: 1, low: Number.NaN, high: Number.NaN, n: 1, logs: [] }, 0.99),
    /too few rounds/,
  );
});
