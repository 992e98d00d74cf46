import assert from "node:assert/strict";
import { test } from "node:test";
import { RSS_ALLOWANCE_BYTES, type StartupRun, summarizeStartup } from "./startup.js";

test("summarizeStartup() gives each build's medians and its RSS budget of weights + pools + 150 MB", () => {
  const run = (build: string, seconds: number, peakRssBytes: number): StartupRun => ({
    build,
    seconds,
    peakRssBytes,
    poolBytes: 500e6,
  });
  const runs = [
    run("this", 2, 700e6),
    run("baseline", 4, 950e6),
    run("this", 1, 690e6),
    run("baseline", 5, 940e6),
    run("this", 3, 710e6),
  ];
  const [mine, base] = summarizeStartup(143e6, runs);
  assert.deepEqual(mine, {
    build: "this",
    medianSeconds: 2,
    secondsRange: [1, 3],
    medianPeakRssBytes: 700e6,
    poolBytes: 500e6,
    rssBudgetBytes: 143e6 + 500e6 + RSS_ALLOWANCE_BYTES,
  });
  assert.equal(base?.medianSeconds, 4.5);
  assert.ok(base!.medianPeakRssBytes > base!.rssBudgetBytes, "the baseline is over its budget");
});
