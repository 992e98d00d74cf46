/**
 * Per-phase latency histograms of a request's path (docs/api.md, "Per-phase metrics"): queue wait,
 * reservation, prefill, transfer (seconds and bytes), commit/verification, first token and
 * inter-token, recorded where each phase happens — the router, each prefill and decode node, the
 * one engine — and exposed at the router's /metrics, labelled by node and role only (never by
 * tenant or prompt).
 *
 * Recording is a `PhaseRecorder`: fixed buckets in one `Float64Array`, so an observation (one per
 * generated token for inter-token latency) is a bucket search and three additions, with nothing
 * allocated. prom-client's own `Histogram.observe` allocates an object and a label-hash string on
 * every call (measured on this VM: ≈ 450–660 ns and a scavenge every ~6,000 observations, against
 * ≈ 4 ns here), which is why the hot path is not prom-client's. A recorder's cumulative
 * `snapshot()` is plain data that crosses a MessagePort or a control line inside the node's stats;
 * the router turns each snapshot into prom-client's metric JSON with the node's labels and lets
 * prom-client aggregate and render them (`AggregatorRegistry.aggregate`, its cluster path), so
 * the exposition format is prom-client's.
 */
import { AggregatorRegistry, type Metric, Registry } from "prom-client";
import { exponentialBuckets } from "./metrics.js";

/** The phases, in a request's order. */
export const PHASES = [
  "queue_wait",
  "reservation",
  "prefill",
  "transfer",
  "commit",
  "first_token",
  "inter_token",
] as const;
export type Phase = (typeof PHASES)[number];

/** Index of each phase in a recorder's arrays. */
export const PHASE: { readonly [P in Phase]: number } = Object.freeze(
  Object.fromEntries(PHASES.map((p, i) => [p, i])) as { [P in Phase]: number },
);

/** Seconds: 50 µs to ~26 s, doubling. */
export const PHASE_BUCKETS: readonly number[] = exponentialBuckets(0.00005, 2, 20);
/** Bytes of one transfer: 4 KiB to 4 GiB, ×4. */
export const TRANSFER_BYTES_BUCKETS: readonly number[] = exponentialBuckets(4096, 4, 11);

/** Cumulative counts of one recorder (JSON-able): per phase, non-cumulative bucket counts (+Inf last). */
export interface PhaseSnapshot {
  /** `PHASES.length` rows of `PHASE_BUCKETS.length + 1` counts. */
  readonly seconds: readonly number[];
  readonly secondsSum: readonly number[];
  /** `TRANSFER_BYTES_BUCKETS.length + 1` counts, and their sum. */
  readonly bytes: readonly number[];
  readonly bytesSum: number;
}

const NB = PHASE_BUCKETS.length + 1;
const NBYTES = TRANSFER_BYTES_BUCKETS.length + 1;

function bucketOf(bounds: readonly number[], value: number): number {
  let i = 0;
  while (i < bounds.length && value > bounds[i]!) i++;
  return i;
}

/** Allocation-free per-phase histograms of one place (a node, the router, the engine). */
export class PhaseRecorder {
  readonly #seconds = new Float64Array(PHASES.length * NB);
  readonly #sums = new Float64Array(PHASES.length);
  readonly #bytes = new Float64Array(NBYTES);
  #bytesSum = 0;
  /** False: observations are dropped (`--no-phase-metrics`, the overhead benchmark's baseline). */
  readonly enabled: boolean;

  constructor(enabled = true) {
    this.enabled = enabled;
  }

  /** One observation of `phase` (an index from `PHASE`), in seconds. */
  observe(phase: number, seconds: number): void {
    if (!this.enabled || !(seconds >= 0)) return;
    this.#seconds[phase * NB + bucketOf(PHASE_BUCKETS, seconds)]! += 1;
    this.#sums[phase]! += seconds;
  }

  /** `count` observations of `phase`, each `seconds` (a window's mean, one per token it covers). */
  observeMany(phase: number, seconds: number, count: number): void {
    if (!this.enabled || !(seconds >= 0) || !(count > 0)) return;
    this.#seconds[phase * NB + bucketOf(PHASE_BUCKETS, seconds)]! += count;
    this.#sums[phase]! += seconds * count;
  }

  /** Time since `startMs` (a `performance.now()` reading) as one observation of `phase`. */
  since(phase: number, startMs: number): void {
    this.observe(phase, (performance.now() - startMs) / 1000);
  }

  /** One transfer's size in bytes. */
  observeBytes(bytes: number): void {
    if (!this.enabled || !(bytes >= 0)) return;
    this.#bytes[bucketOf(TRANSFER_BYTES_BUCKETS, bytes)]! += 1;
    this.#bytesSum += bytes;
  }

  /** The counts so far (a copy). */
  snapshot(): PhaseSnapshot {
    return {
      seconds: Array.from(this.#seconds),
      secondsSum: Array.from(this.#sums),
      bytes: Array.from(this.#bytes),
      bytesSum: this.#bytesSum,
    };
  }
}

/** Where a snapshot was recorded. */
export interface PhaseSource {
  readonly node: string;
  readonly role: "router" | "prefill" | "decode" | "engine";
  readonly snapshot: PhaseSnapshot;
}

export const PHASE_SECONDS_METRIC = "kvfence_phase_seconds";
export const TRANSFER_BYTES_METRIC = "kvfence_phase_transfer_bytes";

/**
 * One row of prom-client's metric JSON (`Registry.getMetricsAsJSON`). A bucket row's `le` is in
 * `labels` and its place's labels in `sharedLabels`, one object for all of a histogram's buckets,
 * as prom-client's own `Histogram` gives them: the registry formats a shared object once a render.
 */
interface MetricRow {
  readonly metricName: string;
  readonly labels: Record<string, string | number>;
  readonly sharedLabels?: Record<string, string>;
  readonly value: number;
}

/** One metric of prom-client's metric JSON, as `AggregatorRegistry.aggregate` takes it. */
export interface MetricJson {
  readonly name: string;
  readonly help: string;
  readonly type: "histogram";
  readonly values: MetricRow[];
  readonly aggregator: "sum";
}

/** Histogram rows in prom-client's metric JSON (cumulative buckets, sum, count). */
function histogramValues(
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

/** One source's snapshot as prom-client metric JSON, labelled with its node and role. */
export function phaseMetricsJson(source: PhaseSource): MetricJson[] {
  const { node, role, snapshot } = source;
  const seconds: MetricRow[] = [];
  PHASES.forEach((phase, p) => {
    const count = rowCount(snapshot.seconds, p * NB, NB);
    if (count === 0) return;
    seconds.push(
      ...histogramValues(
        PHASE_SECONDS_METRIC,
        { phase, node, role },
        PHASE_BUCKETS,
        snapshot.seconds,
        p * NB,
        snapshot.secondsSum[p]!,
      ),
    );
  });
  const out: MetricJson[] = [
    {
      name: PHASE_SECONDS_METRIC,
      help: "Time a request spent in each phase (queue_wait, reservation, prefill, transfer, commit, first_token, inter_token), by node and role",
      type: "histogram",
      values: seconds,
      aggregator: "sum",
    },
  ];
  if (rowCount(snapshot.bytes, 0, NBYTES) > 0) {
    out.push({
      name: TRANSFER_BYTES_METRIC,
      help: "Bytes of each KV transfer, by node and role",
      type: "histogram",
      values: histogramValues(
        TRANSFER_BYTES_METRIC,
        { node, role },
        TRANSFER_BYTES_BUCKETS,
        snapshot.bytes,
        0,
        snapshot.bytesSum,
      ),
      aggregator: "sum",
    });
  }
  return out;
}

function rowCount(counts: readonly number[], offset: number, n: number): number {
  let c = 0;
  for (let i = 0; i < n; i++) c += counts[offset + i]!;
  return c;
}

/**
 * The text exposition of every source's histograms, rendered by prom-client. Sources of distinct
 * node and role (always, from one router) have disjoint label sets, so their rows are joined per
 * metric and rendered as they are; prom-client's `AggregatorRegistry.aggregate`, which sums rows of
 * equal labels by hashing every row's labels, gives the same text and is used only when two sources
 * share a node and role. With the bucket rows' place labels shared (`MetricRow`), a render of
 * three busy sources (router, prefill, decode: 48 KB) took 0.5–0.7 ms of CPU on this VM, against
 * 2.3–2.9 ms through the aggregator with every row's labels whole (docs/benchmarks.md §8).
 */
export async function renderPhaseMetrics(sources: readonly PhaseSource[]): Promise<string> {
  if (sources.length === 0) return "";
  const json = sources.map(phaseMetricsJson);
  const places = new Set(sources.map((s) => `${s.node}\u0000${s.role}`));
  if (places.size < sources.length) {
    // The aggregator hashes `labels` only: the shared ones go back in.
    const whole = json.map((metrics) =>
      metrics.map((m) => ({
        ...m,
        values: m.values.map(({ sharedLabels, ...row }) => ({
          ...row,
          labels: { ...sharedLabels, ...row.labels },
        })),
      })),
    );
    return AggregatorRegistry.aggregate(whole).metrics();
  }
  const byName = new Map<string, MetricJson>();
  for (const metrics of json)
    for (const m of metrics) {
      const joined = byName.get(m.name);
      if (joined === undefined) byName.set(m.name, { ...m, values: [...m.values] });
      else joined.values.push(...m.values);
    }
  const registry = new Registry();
  for (const m of byName.values()) registry.registerMetric({ ...m, get: () => m } as unknown as Metric);
  return registry.metrics();
}

/** Percentiles of one phase of a snapshot, estimated from its buckets (linear within a bucket). */
export function phasePercentiles(
  snapshot: PhaseSnapshot,
  phase: Phase,
  quantiles: readonly number[] = [0.5, 0.9, 0.99],
): { count: number; mean: number; quantiles: number[] } {
  const p = PHASE[phase];
  const count = rowCount(snapshot.seconds, p * NB, NB);
  const mean = count === 0 ? 0 : snapshot.secondsSum[p]! / count;
  const quantilesOut = quantiles.map((q) => {
    if (count === 0) return 0;
    const rank = q * count;
    let cumulative = 0;
    for (let i = 0; i < NB; i++) {
      const c = snapshot.seconds[p * NB + i]!;
      if (cumulative + c >= rank && c > 0) {
        const lo = i === 0 ? 0 : PHASE_BUCKETS[i - 1]!;
        const hi = i < PHASE_BUCKETS.length ? PHASE_BUCKETS[i]! : lo * 2;
        return lo + ((hi - lo) * (rank - cumulative)) / c;
      }
      cumulative += c;
    }
    return PHASE_BUCKETS[PHASE_BUCKETS.length - 1]!;
  });
  return { count, mean, quantiles: quantilesOut };
}

/** The sum of snapshots (the dashboard's view of one phase over several nodes). */
export function addSnapshots(snapshots: readonly PhaseSnapshot[]): PhaseSnapshot {
  const seconds = new Array<number>(PHASES.length * NB).fill(0);
  const secondsSum = new Array<number>(PHASES.length).fill(0);
  const bytes = new Array<number>(NBYTES).fill(0);
  let bytesSum = 0;
  for (const s of snapshots) {
    for (let i = 0; i < seconds.length; i++) seconds[i]! += s.seconds[i] ?? 0;
    for (let i = 0; i < secondsSum.length; i++) secondsSum[i]! += s.secondsSum[i] ?? 0;
    for (let i = 0; i < bytes.length; i++) bytes[i]! += s.bytes[i] ?? 0;
    bytesSum += s.bytesSum;
  }
  return { seconds, secondsSum, bytes, bytesSum };
}
