/**
 * Per-phase latency histograms of a request's path (docs/api.md, "Per-phase metrics"): queue wait,
 * reservation, prefill, transfer (seconds and bytes), commit/verification, first token and
 * inter-token, recorded where each phase happens — the router, each prefill and decode node, the
 * one engine — and exposed at the router's /metrics, labelled by node and role only (never by
 * tenant or prompt).
 *
 * Recording is a `PhaseRecorder`: fixed buckets in one `Float64Array`, so an observation (one per
 * generated token for inter-token latency) is a bucket search and three additions, with nothing
 * allocated (histogram-recorder.ts says why the hot path is not prom-client's). A recorder's
 * cumulative `snapshot()` is plain data that crosses a MessagePort or a control line inside the
 * node's stats; at each scrape the router turns each snapshot into prom-client's metric JSON with
 * the node's labels (`PhaseMetrics`) and lets prom-client aggregate and render them
 * (`AggregatorRegistry.aggregate`, its cluster path), so the exposition format is prom-client's.
 */
import { AggregatorRegistry, type Metric, Registry } from "prom-client";
import { histogramRows, type MetricJson } from "./histogram-recorder.js";
import { type MetricsScrape, onePerScrape } from "./metrics-scrape.js";
import {
  NB,
  NBYTES,
  PHASE,
  PHASE_BUCKETS,
  PHASES,
  type Phase,
  type PhaseSnapshot,
  TRANSFER_BYTES_BUCKETS,
} from "./phase-recorder.js";

export {
  PHASE,
  PHASE_BUCKETS,
  PHASES,
  type Phase,
  PhaseRecorder,
  type PhaseSnapshot,
  TRANSFER_BYTES_BUCKETS,
} from "./phase-recorder.js";

/** Where a snapshot was recorded. */
export interface PhaseSource {
  readonly node: string;
  readonly role: "router" | "prefill" | "decode" | "engine";
  readonly snapshot: PhaseSnapshot;
}

export const PHASE_SECONDS_METRIC = "kvfence_phase_seconds";
export const TRANSFER_BYTES_METRIC = "kvfence_phase_transfer_bytes";
const HELP: { readonly [name: string]: string } = {
  [PHASE_SECONDS_METRIC]:
    "Time a request spent in each phase (queue_wait, reservation, prefill, transfer, commit, first_token, inter_token), by node and role",
  [TRANSFER_BYTES_METRIC]: "Bytes of each KV transfer, by node and role",
};

/** A family with no series (what a registry renders before any source has observations). */
function emptyFamily(name: string): MetricJson {
  return { name, help: HELP[name]!, type: "histogram", values: [], aggregator: "sum" };
}

/** One source's snapshot as prom-client metric JSON, labelled with its node and role. */
export function phaseMetricsJson(source: PhaseSource): MetricJson[] {
  const { node, role, snapshot } = source;
  const seconds = emptyFamily(PHASE_SECONDS_METRIC);
  PHASES.forEach((phase, p) => {
    const count = rowCount(snapshot.seconds, p * NB, NB);
    if (count === 0) return;
    seconds.values.push(
      ...histogramRows(
        PHASE_SECONDS_METRIC,
        { phase, node, role },
        PHASE_BUCKETS,
        snapshot.seconds,
        p * NB,
        snapshot.secondsSum[p]!,
      ),
    );
  });
  const out = [seconds];
  if (rowCount(snapshot.bytes, 0, NBYTES) > 0) {
    const bytes = emptyFamily(TRANSFER_BYTES_METRIC);
    bytes.values.push(
      ...histogramRows(
        TRANSFER_BYTES_METRIC,
        { node, role },
        TRANSFER_BYTES_BUCKETS,
        snapshot.bytes,
        0,
        snapshot.bytesSum,
      ),
    );
    out.push(bytes);
  }
  return out;
}

function rowCount(counts: readonly number[], offset: number, n: number): number {
  let c = 0;
  for (let i = 0; i < n; i++) c += counts[offset + i]!;
  return c;
}

/**
 * Every source's histograms as prom-client metric JSON, one entry per metric. Sources of distinct
 * node and role (always, from one router) have disjoint label sets, so their rows are joined per
 * metric as they are; prom-client's `AggregatorRegistry.aggregate`, which sums rows of equal labels
 * by hashing every row's labels, gives the same text and is used only when two sources share a
 * node and role. With the bucket rows' place labels shared (`MetricRow`), a render of three busy
 * sources (router, prefill, decode: 48 KB) took 0.5–0.7 ms of CPU on this VM, against 2.3–2.9 ms
 * through the aggregator with every row's labels whole (docs/benchmarks.md §8).
 */
async function phaseFamilies(sources: readonly PhaseSource[]): Promise<MetricJson[]> {
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
    return (await AggregatorRegistry.aggregate(whole).getMetricsAsJSON()) as unknown as MetricJson[];
  }
  const byName = new Map<string, MetricJson>();
  for (const metrics of json)
    for (const m of metrics) {
      const joined = byName.get(m.name);
      if (joined === undefined) byName.set(m.name, { ...m, values: [...m.values] });
      else joined.values.push(...m.values);
    }
  return [...byName.values()];
}

/** The text exposition of the sources' histograms alone, rendered by prom-client. */
export async function renderPhaseMetrics(sources: readonly PhaseSource[]): Promise<string> {
  const registry = new Registry();
  for (const m of await phaseFamilies(sources))
    registry.registerMetric({ ...m, get: () => m } as unknown as Metric);
  return registry.metrics();
}

/**
 * The per-phase families in a router's registry, from the snapshots each place gives at a scrape:
 * the one engine's (router-metrics.ts), or the router's and each node's (cluster-metrics.ts). Both
 * families are registered up front (prom-client renders the metrics registered when a scrape
 * starts) and have no series until a source has observations.
 */
export class PhaseMetrics {
  readonly #sources: Array<() => readonly PhaseSource[]> = [];

  constructor(registry: Registry, scrape: MetricsScrape) {
    // One conversion a scrape, after its reads, for both families.
    const families = onePerScrape(async () => {
      await scrape.read();
      return phaseFamilies(this.#sources.flatMap((sources) => sources()));
    });
    for (const name of [PHASE_SECONDS_METRIC, TRANSFER_BYTES_METRIC]) {
      const family = {
        ...emptyFamily(name),
        get: async () => (await families()).find((m) => m.name === name) ?? emptyFamily(name),
        reset: () => {},
      };
      registry.registerMetric(family as unknown as Metric);
    }
  }

  /** Adds the snapshots a place gives at each scrape, read after the scrape's reads. */
  add(sources: () => readonly PhaseSource[]): void {
    this.#sources.push(sources);
  }
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
