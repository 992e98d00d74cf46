/**
 * Values owned elsewhere — an engine thread's pool pages and counters, the nodes' stats — read into
 * a prom-client registry once per scrape instead of being pushed on every change.
 *
 * prom-client renders a registry by calling every metric's `collect()` at once (`Registry.metrics()`
 * starts them all, then awaits them together). The metrics one read fills (a dozen gauges and
 * counters from one `engine.stats()`) each take `collect: () => scrape.read()`: the first of them
 * in a scrape starts the scrape's reads, the others await the same ones (`onePerScrape`), and the
 * next scrape reads again. The reads run one after another, in the order added: the cluster's node
 * poll comes after the engine's, so the transfer observations both polls brought are drained into
 * the same scrape.
 */
import { Counter, Gauge, type LabelValues, type Registry } from "prom-client";

/**
 * `read` shared by the calls made while it runs: the first call starts it, the calls until it ends
 * get the same promise, the first call after starts it again.
 */
export function onePerScrape<T>(read: () => Promise<T>): () => Promise<T> {
  let pending: Promise<T> | undefined;
  return () => {
    pending ??= read().finally(() => {
      pending = undefined;
    });
    return pending;
  };
}

/** What a metric filled at scrape time is made with: its registry, and the scrape's reads as its `collect()`. */
export interface ScrapedMetricOptions {
  readonly registers: Registry[];
  readonly collect: () => Promise<void>;
}

/** A counter without labels whose total is counted elsewhere, and the key of that total. */
export interface TotalCounter<K extends string> {
  readonly name: string;
  readonly help: string;
  readonly total: K;
}

/**
 * The reads of one registry's scrape, in order, shared by the `collect()` of the metrics they fill
 * (made here, or with `options` spread into a prom-client metric's configuration).
 */
export class MetricsScrape {
  readonly registry: Registry;
  /** Registered in `registry`, filled by this scrape's reads. */
  readonly options: ScrapedMetricOptions;
  readonly #reads: Array<() => void | Promise<void>> = [];

  constructor(registry: Registry) {
    this.registry = registry;
    this.options = { registers: [registry], collect: () => this.read() };
  }

  /** Runs `read` at each scrape, after the reads added before it. */
  add(read: () => void | Promise<void>): void {
    this.#reads.push(read);
  }

  /** This scrape's reads (started by the first call of a scrape, shared by the others). */
  readonly read = onePerScrape(async () => {
    for (const read of this.#reads) await read();
  });

  /** A gauge the reads set. */
  gauge<L extends string>(name: string, help: string, labelNames: readonly L[] = []): Gauge<L> {
    return new Gauge({ name, help, labelNames, ...this.options });
  }

  /** A counter the reads set (`setCounter`) to a total counted elsewhere. */
  counter<L extends string>(name: string, help: string, labelNames: readonly L[] = []): Counter<L> {
    return new Counter({ name, help, labelNames, ...this.options });
  }

  /**
   * One counter per row; the function returned sets each from a record of totals (a missing one
   * reads 0). A counter has no series until it is first set.
   */
  totalCounters<K extends string>(
    rows: readonly TotalCounter<K>[],
  ): (totals: Readonly<Partial<Record<K, number>>>) => void {
    const counters = rows.map(({ name, help, total }) => {
      const counter = this.counter(name, help);
      counter.remove();
      return { counter, total };
    });
    return (totals) => {
      for (const { counter, total } of counters) setCounter(counter, totals[total] ?? 0);
    };
  }
}

/**
 * Sets `counter`'s series `labels` to `total`, a count kept elsewhere (prom-client's `Counter` only
 * adds). The source keeps its totals from going down (`NodeTotals` for the nodes').
 */
export function setCounter<T extends string>(
  counter: Counter<T>,
  total: number,
  labels?: LabelValues<T>,
): void {
  if (labels === undefined) {
    counter.remove();
    counter.inc(total);
  } else {
    counter.remove(labels);
    counter.inc(labels, total);
  }
}
