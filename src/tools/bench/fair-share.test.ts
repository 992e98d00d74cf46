import assert from "node:assert/strict";
import { test } from "node:test";
import { combineFairShareResults, type FairBenchResult, orderOf } from "./fair-share.js";

test("orderOf: two arms alternate (ABBA); three rotate, each in each place, none twice in a row", () => {
  assert.deepEqual(
    [-2, -1, 0, 1, 2, 3].map((r) => orderOf(["a", "b"], r).join("")),
    ["ab", "ba", "ab", "ba", "ab", "ba"],
  );
  const rounds = [-1, 0, 1, 2, 3, 4, 5].map((r) => orderOf(["a", "b", "c"], r));
  assert.deepEqual(
    rounds.map((o) => o.join("")),
    ["cab", "abc", "bca", "cab", "abc", "bca", "cab"],
  );
  const run = rounds.flat();
  for (let i = 1; i < run.length; i++) assert.notEqual(run[i], run[i - 1], `no arm twice in a row at ${i}`);
});

/** A result of `rounds` measured rounds where fair takes `fairNs` and fcfs `fcfsNs` per round. */
function result(fairNs: number[], fcfsNs: number[]): FairBenchResult {
  const arm = (ns: number[]) => ({ ns, tokens: ns.map(() => 100), cpuSeconds: ns.map((n) => n / 2e9) });
  const base = combineFairShareResults([
    {
      topology: "threads",
      tenants: 1,
      rounds: fairNs.length,
      requests: 8,
      concurrency: 4,
      maxTokens: 16,
      arms: [
        { name: "fair", label: "fair" },
        { name: "policy", label: "fcfs" },
      ],
      comparisons: [],
      perRound: { fair: arm(fairNs), policy: arm(fcfsNs) },
      failures: [],
      load: { start: 1, end: 1, cpus: 2 },
      runs: 1,
    } as unknown as FairBenchResult,
  ]);
  return JSON.parse(JSON.stringify(base)) as FairBenchResult;
}

test("combineFairShareResults joins the runs' rounds and computes the ratios over all of them", () => {
  const a = result([1e9, 2e9], [1e9, 2e9]);
  const b = result([2e9, 2e9], [1e9, 1e9]);
  const both = combineFairShareResults([a, b]);
  assert.equal(both.rounds, 4);
  assert.equal(both.runs, 2);
  assert.deepEqual(both.perRound.fair?.ns, [1e9, 2e9, 2e9, 2e9]);
  const c = both.comparisons[0]!;
  assert.equal(c.against, "policy");
  // fair's throughput over fcfs's by round: 1, 1, 0.5, 0.5: geometric mean sqrt(0.5)
  assert.ok(Math.abs(c.throughput.ratio - Math.SQRT1_2) < 1e-9, String(c.throughput.ratio));
  assert.ok(Math.abs(c.cpu.ratio - Math.SQRT1_2) < 1e-9, String(c.cpu.ratio));
  assert.equal(both.arms[0]!.outputTokens, 400);
  assert.throws(() => combineFairShareResults([a, { ...b, topology: "cluster" }]), /the runs differ/);
});
