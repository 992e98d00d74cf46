/**
 * Histograms recorded without allocating and rendered by prom-client, for observations made on a
 * hot path: one per generated token (the router's inter-token latency, each engine's and node's
 * phases: phase-histograms.ts). prom-client's own `Histogram.observe` allocates an object and a
 * label-hash string on every call (measured on this VM: ≈ 450–660 ns and a scavenge every ~6,000
 * observations, against ≈ 4 ns here), so the hot path is not prom-client's: a recorder keeps fixed
 * buckets in a `Float64Array`, and an observation is a bucket search and three additions. At each
 * scrape the counts become prom-client's metric JSON (`histogramRows`), which prom-client renders
 * like its own histograms (a bucket's `le` first, then the series' labels).
 */
import type { Metric, Registry } from "prom-client";

/** The index of the bucket `value` falls in: the first bound it does not exceed (`bounds.length`: +Inf). */
export function bucketOf(bounds: readonly number[], value: number): number {
  let i = 0;
  while (i < bounds.length && value > bounds[i]!) i++;
  return i;
}

/**
 * One row of prom-client's metric JSON (`Registry.getMetricsAsJSON`). A bucket row's `le` is in
 * `labels` and its series' labels in `sharedLabels`, one object for all of a histogram's buckets,
 * as prom-client's own `Histogram` gives them: the registry formats a shared object once a render.
 */
export interface MetricRow {
  readonly metricName: string;
  readonly labels: Record<string, string | number>;
  readonly sharedLabels?: Record<string, string>;
  readonly value: number;
}

/** One histogram of prom-client's metric JSON, as `Registry` renders it and `AggregatorRegistry.aggregate` takes it. */
export interface MetricJson {
  readonly name: string;
  readonly help: string;
  readonly type: "histogram";
  readonly values: MetricRow[];
  readonly aggregator: "sum";
}

/**
 * One series' rows in prom-client's metric JSON: cumulative buckets (`counts` from `offset` holds
 * `bounds.length + 1` non-cumulative counts, +Inf last), sum and count.
 */
export function histogramRows(
  name: string,
  labels: Record<string, string>,
  bounds: readonly number[],
  counts: ArrayLike<number>,
  offset: number,
  sum: number,
): MetricRow[] {
  const out: MetricRow[] = [];
  let cumulative = 0;
  for (let i = 0; i <= bounds.length; i++) {
    cumulative += counts[offset + i]!;
    out.push({
      metricName: `${name}_bucket`,
      labels: { le: i < bounds.length ? bounds[i]! : "+Inf" },
      sharedLabels: labels,
      value: cumulative,
    });
  }
  out.push({ metricName: `${name}_sum`, labels, value: sum });
  out.push({ metricName: `${name}_count`, labels, value: cumulative });
  return out;
}

interface Series {
  readonly labels: Record<string, string>;
  /** Non-cumulative, one per bucket, +Inf last. */
  readonly counts: Float64Array;
  sum: number;
}

/**
 * A histogram with one label, recorded allocation-free and registered in prom-client `registers`
 * as a metric of its own (prom-client calls `get()` at each scrape). A series is found by its label
 * value (a `Map` look-up with the string the caller holds: nothing allocated); it is created, once,
 * by its first observation, so a label value never observed has no series.
 */
export class HistogramRecorder<L extends string> {
  readonly name: string;
  readonly help: string;
  readonly type = "histogram" as const;
  readonly aggregator = "sum" as const;
  readonly #labelName: L;
  readonly #bounds: readonly number[];
  readonly #series = new Map<string, Series>();

  constructor(config: {
    readonly name: string;
    readonly help: string;
    readonly labelName: L;
    readonly buckets: readonly number[];
    readonly registers: readonly Registry[];
  }) {
    this.name = config.name;
    this.help = config.help;
    this.#labelName = config.labelName;
    this.#bounds = config.buckets;
    for (const registry of config.registers) registry.registerMetric(this as unknown as Metric);
  }

  /** One observation of `value` in the series `labels`; a value that is not finite is dropped. */
  observe(labels: Readonly<Record<L, string>>, value: number): void {
    this.observeMany(labels, value, 1);
  }

  /** `count` observations, each `value` (a gap shared by the `count` tokens it brought). */
  observeMany(labels: Readonly<Record<L, string>>, value: number, count: number): void {
    if (!Number.isFinite(value) || !(count > 0)) return;
    const key = labels[this.#labelName];
    let series = this.#series.get(key);
    if (series === undefined) {
      series = {
        labels: { [this.#labelName]: key },
        counts: new Float64Array(this.#bounds.length + 1),
        sum: 0,
      };
      this.#series.set(key, series);
    }
    series.counts[bucketOf(this.#bounds, value)]! += count;
    series.sum += value * count;
  }

  /** The counts as prom-client's metric JSON (what a scrape renders). */
  async get(): Promise<MetricJson> {
    const values: MetricRow[] = [];
    for (const s of this.#series.values())
      values.push(...histogramRows(this.name, s.labels, this.#bounds, s.counts, 0, s.sum));
    return { name: this.name, help: this.help, type: this.type, values, aggregator: this.aggregator };
  }

  /** Forgets every series (prom-client's `Registry.resetMetrics`). */
  reset(): void {
    this.#series.clear();
  }
}
