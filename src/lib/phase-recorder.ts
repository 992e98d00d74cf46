/**
 * The recording half of the per-phase histograms (src/lib/phase-histograms.ts renders them): the
 * phases, their buckets, the snapshot that crosses threads and processes, and `PhaseRecorder`.
 * Apart from the rendering so the engine threads, which only record, do not load prom-client.
 */
import { bucketOf } from "./histogram-recorder.js";

/** `count` bounds from `start`, each `factor` times the last (prom-client's `exponentialBuckets`). */
function exponentialBuckets(start: number, factor: number, count: number): number[] {
  const bounds: number[] = [];
  for (let i = 0, b = start; i < count; i++, b *= factor) bounds.push(b);
  return bounds;
}

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
/**
 * Bytes of one transfer: 4 KiB to 4 GiB, ×4, each bound rounded to 6 significant digits (1048580,
 * …, 4294970000), as the series' `le` labels have always read.
 */
export const TRANSFER_BYTES_BUCKETS: readonly number[] = exponentialBuckets(4096, 4, 11).map((b) =>
  Number(b.toPrecision(6)),
);

/** Cumulative counts of one recorder (JSON-able): per phase, non-cumulative bucket counts (+Inf last). */
export interface PhaseSnapshot {
  /** `PHASES.length` rows of `PHASE_BUCKETS.length + 1` counts. */
  readonly seconds: readonly number[];
  readonly secondsSum: readonly number[];
  /** `TRANSFER_BYTES_BUCKETS.length + 1` counts, and their sum. */
  readonly bytes: readonly number[];
  readonly bytesSum: number;
}

/** Buckets a phase's row holds (+Inf last), and the transfer-bytes row. */
export const NB = PHASE_BUCKETS.length + 1;
export const NBYTES = TRANSFER_BYTES_BUCKETS.length + 1;

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
