/**
 * Small statistics for benchmarks: median, mean, standard deviation, quantiles, a five-number
 * `summarize`, 95% confidence intervals by Student's t (for means) and by a seeded percentile
 * bootstrap (for any statistic, e.g. the median), and `pairedRatio` for interleaved A/B runs (the
 * geometric mean of per-pair ratios with a t interval on their logs), and a one-sided Mann–Whitney
 * rank test (`kvfence probe --timing`). Pure functions over plain number arrays.
 */
import { Prng } from "./prng.js";

export function mean(values: readonly number[]): number {
  if (values.length === 0) return Number.NaN;
  let s = 0;
  for (const v of values) s += v;
  return s / values.length;
}

/** Sample standard deviation (n − 1). NaN for fewer than two values. */
export function stddev(values: readonly number[]): number {
  if (values.length < 2) return Number.NaN;
  const m = mean(values);
  let s = 0;
  for (const v of values) s += (v - m) ** 2;
  return Math.sqrt(s / (values.length - 1));
}

/** Population standard deviation (n, numpy's default, as serving benchmarks report it). 0 for one value. */
export function populationStddev(values: readonly number[]): number {
  if (values.length === 0) return Number.NaN;
  const m = mean(values);
  let s = 0;
  for (const v of values) s += (v - m) ** 2;
  return Math.sqrt(s / values.length);
}

/** Quantile q in [0, 1] with linear interpolation between order statistics (numpy's default). */
export function quantile(values: readonly number[], q: number): number {
  return quantiles(values, [q])[0] as number;
}

/** `quantile` at each of `qs`, sorting the values once. */
export function quantiles(values: readonly number[], qs: readonly number[]): number[] {
  if (values.length === 0) return qs.map(() => Number.NaN);
  const sorted = [...values].sort((a, b) => a - b);
  return qs.map((q) => {
    const pos = (sorted.length - 1) * Math.min(1, Math.max(0, q));
    const lo = Math.floor(pos);
    const hi = Math.ceil(pos);
    return (sorted[lo] as number) + ((sorted[hi] as number) - (sorted[lo] as number)) * (pos - lo);
  });
}

export function median(values: readonly number[]): number {
  return quantile(values, 0.5);
}

export interface Summary {
  readonly n: number;
  readonly median: number;
  readonly min: number;
  readonly max: number;
  readonly p25: number;
  readonly p75: number;
}

/** Count, median, extremes and quartiles. */
export function summarize(values: readonly number[]): Summary {
  return {
    n: values.length,
    median: quantile(values, 0.5),
    min: quantile(values, 0),
    max: quantile(values, 1),
    p25: quantile(values, 0.25),
    p75: quantile(values, 0.75),
  };
}

export interface Interval {
  readonly low: number;
  readonly high: number;
}

// Two-sided 95% Student t critical values for df = 1..30.
const T95 = [
  12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.16, 2.145, 2.131,
  2.12, 2.11, 2.101, 2.093, 2.086, 2.08, 2.074, 2.069, 2.064, 2.06, 2.056, 2.052, 2.048, 2.045, 2.042,
];

/** The 97.5% quantile of Student's t (two-sided 95%) for `df` degrees of freedom; 1.96 beyond 30. */
export function t975(df: number): number {
  if (!(df >= 1)) return Number.NaN;
  return df <= 30 ? (T95[Math.floor(df) - 1] as number) : 1.96;
}

/** 95% two-sided Student t critical value for `df` degrees of freedom (series beyond 30: more exact than t975). */
export function tCritical95(df: number): number {
  if (df < 1) return Number.NaN;
  if (df <= 30) return T95[df - 1] as number;
  // Cornish–Fisher expansion of the t quantile around the normal one; within 0.001 for df > 30.
  const z = 1.959964;
  return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df * df);
}

export interface RatioInterval {
  /** Geometric mean of a[i] / b[i]. */
  readonly ratio: number;
  readonly low: number;
  readonly high: number;
  /** Number of pairs. */
  readonly n: number;
  /**
   * The pairs' log ratios, ln(a[i] / b[i]): a bench's JSON result carries them, so runs made in
   * chunks can be pooled into one interval (`ratioOfLogs`, `kvfence bench combine`).
   */
  readonly logs: readonly number[];
}

/**
 * Ratio of paired measurements a[i] / b[i] (interleaved A/B runs): the geometric mean with a 95%
 * Student t interval computed on the logs of the ratios.
 */
export function pairedRatio(a: readonly number[], b: readonly number[]): RatioInterval {
  const n = Math.min(a.length, b.length);
  const logs: number[] = [];
  for (let i = 0; i < n; i++) logs.push(Math.log((a[i] as number) / (b[i] as number)));
  return ratioOfLogs(logs);
}

/** `pairedRatio` from the pairs' log ratios (e.g. those of several runs pooled). */
export function ratioOfLogs(logs: readonly number[]): RatioInterval {
  const n = logs.length;
  const m = mean(logs);
  if (n < 2) return { ratio: Math.exp(m), low: Number.NaN, high: Number.NaN, n, logs };
  const half = (t975(n - 1) * stddev(logs)) / Math.sqrt(n);
  return { ratio: Math.exp(m), low: Math.exp(m - half), high: Math.exp(m + half), n, logs };
}

/** 95% confidence interval of the mean by Student's t. */
export function tInterval95(values: readonly number[]): Interval {
  const n = values.length;
  const m = mean(values);
  if (n < 2) return { low: Number.NaN, high: Number.NaN };
  const half = (tCritical95(n - 1) * stddev(values)) / Math.sqrt(n);
  return { low: m - half, high: m + half };
}

/**
 * Percentile bootstrap confidence interval of `statistic` (default: the median), seeded so a
 * report is reproducible.
 */
export function bootstrapInterval(
  values: readonly number[],
  options: {
    statistic?: (v: readonly number[]) => number;
    confidence?: number;
    iterations?: number;
    seed?: number;
  } = {},
): Interval {
  const n = values.length;
  if (n === 0) return { low: Number.NaN, high: Number.NaN };
  const statistic = options.statistic ?? median;
  const confidence = options.confidence ?? 0.95;
  const iterations = options.iterations ?? 2000;
  const rng = new Prng(options.seed ?? 12345);
  const stats: number[] = new Array(iterations);
  const resample: number[] = new Array(n);
  for (let i = 0; i < iterations; i++) {
    for (let j = 0; j < n; j++) resample[j] = values[rng.nextInt(n)] as number;
    stats[i] = statistic(resample);
  }
  const alpha = (1 - confidence) / 2;
  return { low: quantile(stats, alpha), high: quantile(stats, 1 - alpha) };
}

/** A one-sided rank test's result. */
export interface RankTest {
  /** Mann–Whitney U: pairs (a, b) with a < b, ties counting a half. */
  readonly u: number;
  /** Normal approximation's z (with continuity correction). */
  readonly z: number;
  /** One-sided p-value of "a tends to be smaller than b". */
  readonly p: number;
}

/**
 * One-sided Mann–Whitney U test that the values of `a` tend to be smaller than those of `b`, by the
 * normal approximation with continuity and tie corrections (good from about 8 values each).
 * Hand-written: 25 lines, and the probe that uses it imports no npm package (it runs anywhere).
 */
export function mannWhitneyLess(a: readonly number[], b: readonly number[]): RankTest {
  const n1 = a.length;
  const n2 = b.length;
  let u = 0;
  for (const x of a) for (const y of b) u += x < y ? 1 : x === y ? 0.5 : 0;
  // Tie correction of the variance, from the pooled ranks' tie groups.
  const pooled = [...a, ...b].sort((x, y) => x - y);
  let ties = 0;
  for (let i = 0; i < pooled.length; ) {
    let j = i + 1;
    while (j < pooled.length && pooled[j] === pooled[i]) j++;
    const t = j - i;
    ties += t ** 3 - t;
    i = j;
  }
  const n = n1 + n2;
  const variance = ((n1 * n2) / 12) * (n + 1 - ties / (n * (n - 1)));
  if (n1 === 0 || n2 === 0 || !(variance > 0)) return { u, z: 0, p: 1 };
  const z = (u - (n1 * n2) / 2 - 0.5) / Math.sqrt(variance);
  return { u, z, p: 1 - normalCdf(z) };
}

/** The standard normal distribution function (Abramowitz and Stegun 7.1.26, error below 1.5e-7). */
export function normalCdf(z: number): number {
  const x = Math.abs(z) / Math.SQRT2;
  const t = 1 / (1 + 0.3275911 * x);
  const poly =
    t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
  const erf = 1 - poly * Math.exp(-x * x);
  return z >= 0 ? (1 + erf) / 2 : (1 - erf) / 2;
}
