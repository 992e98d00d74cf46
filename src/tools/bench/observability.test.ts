/**
 * The pure parts of `kvfence bench observability` (src/tools/bench/observability.ts): the arms'
 * bursts of a round run in a palindromic order, rotated so each arm takes each place equally often; a paused timer keeps its time; the
 * per-round ratios pair the arms, `--what` parses, and the verdict
 * reads a confidence interval against a bound.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import {
  activeTimer,
  analyse,
  burstOrder,
  FEATURES,
  type ObservabilityRun,
  parseWhat,
  verdict,
} from "./observability.js";

test("a round is every arm's burst and then the same in reverse; each arm takes each place equally often", () => {
  assert.deepEqual(burstOrder(["all"], 0), ["off", "all", "all", "off"], "ABBA");
  assert.deepEqual(burstOrder(["all"], 1), ["all", "off", "off", "all"], "then BAAB");
  const arms = ["off", ...FEATURES];
  const places = arms.map(() => new Set<string>());
  for (let r = 0; r < arms.length; r++) {
    const order = burstOrder(FEATURES, r);
    assert.deepEqual(
      order.slice(0, arms.length),
      [...order.slice(arms.length)].reverse(),
      `round ${r}: a palindrome`,
    );
    assert.deepEqual([...order.slice(0, arms.length)].sort(), [...arms].sort(), `round ${r}: each arm once`);
    for (const [i, arm] of order.slice(0, arms.length).entries()) places[i]!.add(arm);
  }
  for (const p of places) assert.equal(p.size, arms.length);
  assert.deepEqual(
    burstOrder(FEATURES, -1),
    burstOrder(FEATURES, arms.length - 1),
    "warm-up rounds rotate too",
  );
});

test("an active timer fires once per interval of resumed time, keeping what was left across a pause", async () => {
  let t = 0;
  let fired = 0;
  const timer = activeTimer(
    30,
    () => fired++,
    () => t,
  );
  timer.resume();
  t = 20; // 20 of its 30 ms pass while resumed
  timer.pause();
  t = 1000; // paused: no time counts
  timer.resume();
  // 10 ms are left: it fires within ~10 ms of wall time, not 30.
  await new Promise((resolve) => setTimeout(resolve, 20));
  t = 1010;
  assert.equal(fired, 1);
  timer.pause();
  await new Promise((resolve) => setTimeout(resolve, 60));
  assert.equal(fired, 1, "paused, it does not fire");
});

/** A run of `rounds` rounds where the feature arm's CPU per token is `cpuFactor` of off's, with some noise. */
function fakeRun(rounds: number, cpuFactor: number, seed: number): ObservabilityRun {
  let x = seed;
  const noise = () => {
    x = (x * 1103515245 + 12345) % 2147483648;
    return 1 + (x / 2147483648 - 0.5) * 0.02;
  };
  const off = [];
  const all = [];
  for (let i = 0; i < rounds; i++) {
    const drift = 1 + 0.1 * Math.sin(i); // the machine's speed, shared by both arms of a round
    off.push({ ns: 2e9 * drift * noise(), tokens: 4096, cpuSeconds: 7 * drift * noise() });
    all.push({
      ns: 2e9 * drift * noise() * cpuFactor,
      tokens: 4096,
      cpuSeconds: 7 * drift * noise() * cpuFactor,
    });
  }
  return {
    topology: "threads",
    what: ["all"],
    requests: 64,
    concurrency: 16,
    maxTokens: 64,
    promptChars: 200,
    pollMs: 1000,
    scrapeMs: 1000,
    rounds: { off, all },
    observed: { all: { spans: 100, statePolls: 10, scrapes: 10 } },
    failures: [],
    load: { start: 1, end: 1, cpus: 2 },
  };
}

test("the ratios pair each round's arms, so a drift both arms share cancels", () => {
  const r = analyse(fakeRun(40, 1.02, 7));
  const c = r.ratios.all!.cpuPerToken!;
  assert.ok(c.low < 1.02 && 1.02 < c.high, `CPU per token ${c.low}–${c.high} holds the 2% it was given`);
  assert.ok(c.high - c.low < 0.01, `paired, the ±10% drift drops out: ${c.low}–${c.high}`);
  const t = r.ratios.all!.throughput;
  assert.ok(t.low < 1 / 1.02 && 1 / 1.02 < t.high);
  assert.equal(r.n, 40);
  assert.equal(r.arms.off!.outputTokens, 40 * 4096);
});

test("--what: a list of features in a fixed order, each for all of them, a clear error otherwise", () => {
  assert.deepEqual(parseWhat("all,histograms"), ["histograms", "all"]);
  assert.deepEqual(parseWhat("each"), [...FEATURES]);
  assert.deepEqual(parseWhat("traces, traces"), ["traces"]);
  assert.deepEqual(parseWhat("all,control"), ["control", "all"], "the A/A arm first, only when asked for");
  assert.ok(!parseWhat("each").includes("control"));
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
  // CPU per token is the inverse: 100.5% [100.2–100.9%] of off's CPU is within 1%, 101.5% [101.2–101.8%] beyond.
  assert.match(
    verdict({ ratio: 1.005, low: 1.002, high: 1.009, n: 10, logs: [] }, 0.99, true),
    /costs at most 1\.0% \(CI high end ≤ 101\.0%\)/,
  );
  assert.match(
    verdict({ ratio: 1.015, low: 1.012, high: 1.018, n: 10, logs: [] }, 0.99, true),
    /costs MORE than 1\.0% \(CI low end > 101\.0%\)/,
  );
  assert.match(
    verdict({ ratio: 1.01, low: 1.005, high: 1.015, n: 10, logs: [] }, 0.99, true),
    /undecided against 1\.0%: the CI straddles 101\.0%/,
  );
});
