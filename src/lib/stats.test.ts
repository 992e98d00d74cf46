import assert from "node:assert/strict";
import { describe, it, test } from "node:test";
import {
  bootstrapInterval,
  mannWhitneyLess,
  mean,
  median,
  normalCdf,
  pairedRatio,
  populationStddev,
  quantile,
  quantiles,
  stddev,
  summarize,
  t975,
  tCritical95,
  tInterval95,
} from "./stats.js";

describe("stats", () => {
  it("quantile() interpolates between order statistics of unsorted input; median() is q=0.5", () => {
    assert.equal(quantile([3, 1, 2, 4], 0.5), 2.5);
    assert.equal(quantile([5, 1, 3], 0), 1);
    assert.equal(quantile([5, 1, 3], 1), 5);
    assert.ok(Number.isNaN(quantile([], 0.5)));
    assert.equal(median([10, 30, 20]), 20);
    assert.deepEqual(quantiles([3, 1, 2, 4], [0, 0.5, 1]), [1, 2.5, 4]);
  });

  it("summarize() reports count, median, extremes and quartiles", () => {
    assert.deepEqual(summarize([1, 2, 3, 4, 5]), { n: 5, median: 3, min: 1, max: 5, p25: 2, p75: 4 });
  });

  it("mean() and stddev() use the n − 1 sample deviation", () => {
    assert.equal(mean([1, 2, 3, 4]), 2.5);
    assert.ok(Math.abs(stddev([2, 4, 4, 4, 5, 5, 7, 9]) - 2.138089935299395) < 1e-12);
    assert.ok(Number.isNaN(stddev([1])));
  });

  it("populationStddev() divides by n, as numpy's std does", () => {
    assert.equal(populationStddev([2, 4, 4, 4, 5, 5, 7, 9]), 2);
    assert.equal(populationStddev([3]), 0);
    assert.ok(Number.isNaN(populationStddev([])));
  });

  it("tInterval95() uses Student's t critical values", () => {
    assert.equal(t975(3), 3.182);
    assert.equal(t975(100), 1.96);
    assert.ok(Math.abs(tCritical95(60) - 2.0003) < 1e-3);
    assert.ok(Math.abs(tCritical95(120) - 1.9799) < 1e-3);
    const ci = tInterval95([1, 2, 3]);
    // mean 2, sd 1, t(2) = 4.303: half-width 4.303/√3.
    assert.ok(Math.abs(ci.low - (2 - 4.303 / Math.sqrt(3))) < 1e-12);
    assert.ok(Math.abs(ci.high - (2 + 4.303 / Math.sqrt(3))) < 1e-12);
  });

  it("pairedRatio() gives the exact ratio with a zero-width interval for constant ratios and brackets noisy ones", () => {
    const r = pairedRatio([2, 4, 6], [1, 2, 3]);
    assert.equal(r.n, 3);
    assert.ok(Math.abs(r.ratio - 2) < 1e-12 && Math.abs(r.low - 2) < 1e-12 && Math.abs(r.high - 2) < 1e-12);
    const q = pairedRatio([1.1, 1.3, 1.2, 1.0], [1, 1, 1, 1]);
    assert.ok(q.low < q.ratio && q.ratio < q.high && q.low > 0.9 && q.high < 1.45);
  });

  it("bootstrapInterval() is reproducible from its seed and brackets the median", () => {
    const values = [5, 7, 6, 9, 4, 6, 7, 8, 5, 6, 30];
    const a = bootstrapInterval(values, { seed: 1 });
    const b = bootstrapInterval(values, { seed: 1 });
    assert.deepEqual(a, b);
    assert.ok(a.low <= median(values) && median(values) <= a.high);
    assert.ok(a.high < 30);
  });
});

test("mannWhitneyLess() is small when a is below b, near 1/2 when they mix, 1 when a is above", () => {
  const low = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
  const high = low.map((x) => x + 100);
  assert.ok(mannWhitneyLess(low, high).p < 1e-3);
  assert.ok(mannWhitneyLess(high, low).p > 0.999);
  const mixed = mannWhitneyLess([1, 4, 5, 8, 9], [2, 3, 6, 7, 10]);
  assert.ok(mixed.p > 0.2 && mixed.p < 0.8, `p ${mixed.p}`);
  assert.equal(mannWhitneyLess([5, 5, 5], [5, 5, 5]).p, 1, "all tied: no evidence");
  assert.ok(Math.abs(normalCdf(1.959964) - 0.975) < 1e-6);
});
