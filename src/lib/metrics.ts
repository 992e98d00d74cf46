/**
 * A small Prometheus registry: counters, gauges and histograms with labels, rendered in the text
 * exposition format (version 0.0.4). No dependency (prom-client is large and global-stateful).
 *
 * Each metric keeps one series per distinct label set, keyed by the label values joined with a
 * separator that cannot appear in a value after escaping. Collectors registered with `onCollect`
 * run before each exposition, so values owned by another thread (pool pages, queue depths) are
 * read once per scrape instead of being pushed on every change.
 */

export type Labels = Readonly<Record<string, string | number>>;

const KEY_SEP = "\u0000";

function escapeLabelValue(value: string): string {
  return value.replace(/\\/g, "\\\\").replace(/\n/g, "\\n").replace(/"/g, '\\"');
}

function escapeHelp(text: string): string {
  return text.replace(/\\/g, "\\\\").replace(/\n/g, "\\n");
}

function formatNumber(value: number): string {
  if (Number.isNaN(value)) return "NaN";
  if (value === Number.POSITIVE_INFINITY) return "+Inf";
  if (value === Number.NEGATIVE_INFINITY) return "-Inf";
  return String(value);
}

const NAME_RE = /^[a-zA-Z_:][a-zA-Z0-9_:]*$/;
const LABEL_RE = /^[a-zA-Z_][a-zA-Z0-9_]*$/;

abstract class Metric {
  readonly name: string;
  readonly help: string;
  readonly labelNames: readonly string[];
  abstract readonly type: "counter" | "gauge" | "histogram";

  constructor(name: string, help: string, labelNames: readonly string[]) {
    if (!NAME_RE.test(name)) throw new Error(`Invalid metric name: ${name}`);
    for (const label of labelNames) {
      if (!LABEL_RE.test(label) || label === "le") throw new Error(`Invalid label name on ${name}: ${label}`);
    }
    this.name = name;
    this.help = help;
    this.labelNames = labelNames;
  }

  protected key(labels: Labels | undefined): string {
    if (this.labelNames.length === 0) return "";
    if (labels === undefined)
      throw new Error(`Metric ${this.name} needs labels: ${this.labelNames.join(", ")}`);
    let key = "";
    for (let i = 0; i < this.labelNames.length; i++) {
      const value = labels[this.labelNames[i]!];
      if (value === undefined) throw new Error(`Metric ${this.name} is missing label: ${this.labelNames[i]}`);
      key += (i === 0 ? "" : KEY_SEP) + String(value);
    }
    return key;
  }

  protected renderLabels(key: string, extra?: string): string {
    const parts: string[] = [];
    if (this.labelNames.length > 0) {
      const values = key.split(KEY_SEP);
      for (let i = 0; i < this.labelNames.length; i++) {
        parts.push(`${this.labelNames[i]}="${escapeLabelValue(values[i] ?? "")}"`);
      }
    }
    if (extra !== undefined) parts.push(extra);
    return parts.length === 0 ? "" : `{${parts.join(",")}}`;
  }

  protected header(): string {
    return `# HELP ${this.name} ${escapeHelp(this.help)}\n# TYPE ${this.name} ${this.type}\n`;
  }

  abstract render(): string;
}

/** A metric with one number per label set: a counter or a gauge. */
abstract class ValueMetric extends Metric {
  protected readonly values = new Map<string, number>();

  get(labels?: Labels): number {
    return this.values.get(this.key(labels)) ?? 0;
  }

  render(): string {
    let out = this.header();
    if (this.labelNames.length === 0 && this.values.size === 0) out += `${this.name} 0\n`;
    for (const [key, value] of this.values)
      out += `${this.name}${this.renderLabels(key)} ${formatNumber(value)}\n`;
    return out;
  }
}

/** A monotonically increasing count. */
export class Counter extends ValueMetric {
  readonly type = "counter" as const;

  inc(labels?: Labels, amount = 1): void {
    if (!(amount >= 0)) throw new Error(`Counter ${this.name} can only increase: ${amount}`);
    const key = this.key(labels);
    this.values.set(key, (this.values.get(key) ?? 0) + amount);
  }

  /**
   * Mirror a total counted elsewhere (e.g. in the engine thread). The value must not go down.
   */
  setTotal(value: number, labels?: Labels): void {
    const key = this.key(labels);
    const previous = this.values.get(key) ?? 0;
    if (value < previous) throw new Error(`Counter ${this.name} cannot go down: ${previous} -> ${value}`);
    this.values.set(key, value);
  }
}

/** A value that goes up and down. */
export class Gauge extends ValueMetric {
  readonly type = "gauge" as const;

  set(value: number, labels?: Labels): void {
    this.values.set(this.key(labels), value);
  }

  inc(labels?: Labels, amount = 1): void {
    const key = this.key(labels);
    this.values.set(key, (this.values.get(key) ?? 0) + amount);
  }

  dec(labels?: Labels, amount = 1): void {
    this.inc(labels, -amount);
  }
}

interface HistogramSeries {
  readonly counts: Float64Array; // one per bucket, non-cumulative; the last is +Inf
  sum: number;
  count: number;
}

/** Observations counted into fixed cumulative buckets (`le`), plus their sum and count. */
export class Histogram extends Metric {
  readonly type = "histogram" as const;
  readonly buckets: readonly number[];
  #series = new Map<string, HistogramSeries>();

  constructor(name: string, help: string, labelNames: readonly string[], buckets: readonly number[]) {
    super(name, help, labelNames);
    for (let i = 1; i < buckets.length; i++) {
      if (!(buckets[i]! > buckets[i - 1]!)) throw new Error(`Histogram ${name} buckets must increase`);
    }
    this.buckets = buckets.filter((b) => b !== Number.POSITIVE_INFINITY);
  }

  observe(value: number, labels?: Labels): void {
    const key = this.key(labels);
    let series = this.#series.get(key);
    if (series === undefined) {
      series = { counts: new Float64Array(this.buckets.length + 1), sum: 0, count: 0 };
      this.#series.set(key, series);
    }
    let i = 0;
    while (i < this.buckets.length && value > this.buckets[i]!) i++;
    series.counts[i]! += 1;
    series.sum += value;
    series.count += 1;
  }

  /** Number of observations for one label set (for tests and summaries). */
  count(labels?: Labels): number {
    return this.#series.get(this.key(labels))?.count ?? 0;
  }

  render(): string {
    let out = this.header();
    for (const [key, series] of this.#series) {
      let cumulative = 0;
      for (let i = 0; i <= this.buckets.length; i++) {
        cumulative += series.counts[i]!;
        const le = i < this.buckets.length ? formatNumber(this.buckets[i]!) : "+Inf";
        out += `${this.name}_bucket${this.renderLabels(key, `le="${le}"`)} ${cumulative}\n`;
      }
      out += `${this.name}_sum${this.renderLabels(key)} ${formatNumber(series.sum)}\n`;
      out += `${this.name}_count${this.renderLabels(key)} ${series.count}\n`;
    }
    return out;
  }
}

/** Buckets growing by `factor` from `start`: `count` bounds. */
export function exponentialBuckets(start: number, factor: number, count: number): number[] {
  const out: number[] = [];
  let v = start;
  for (let i = 0; i < count; i++) {
    out.push(Number(v.toPrecision(6)));
    v *= factor;
  }
  return out;
}

/** A set of metrics rendered together; names are unique within a registry. */
export class MetricsRegistry {
  #metrics = new Map<string, Metric>();
  #collectors: Array<() => void | Promise<void>> = [];
  #expositions: Array<() => string | Promise<string>> = [];

  counter(name: string, help: string, labelNames: readonly string[] = []): Counter {
    return this.#add(new Counter(name, help, labelNames));
  }

  gauge(name: string, help: string, labelNames: readonly string[] = []): Gauge {
    return this.#add(new Gauge(name, help, labelNames));
  }

  histogram(
    name: string,
    help: string,
    options: { labelNames?: readonly string[]; buckets: readonly number[] },
  ): Histogram {
    return this.#add(new Histogram(name, help, options.labelNames ?? [], options.buckets));
  }

  /** Run `collect` before every exposition (to copy values owned elsewhere into gauges/counters). */
  onCollect(collect: () => void | Promise<void>): void {
    this.#collectors.push(collect);
  }

  /**
   * Append `expose`'s text exposition after this registry's own metrics (metrics rendered by
   * another library: the per-phase histograms, src/lib/phase-histograms.ts), after the collectors.
   */
  onExpose(expose: () => string | Promise<string>): void {
    this.#expositions.push(expose);
  }

  /** The text exposition of every metric, after running the collectors. */
  async render(): Promise<string> {
    for (const collect of this.#collectors) await collect();
    let out = "";
    for (const metric of this.#metrics.values()) out += metric.render();
    for (const expose of this.#expositions) out += await expose();
    return out;
  }

  #add<M extends Metric>(metric: M): M {
    if (this.#metrics.has(metric.name)) throw new Error(`Metric already registered: ${metric.name}`);
    this.#metrics.set(metric.name, metric);
    return metric;
  }
}

/** The content type of the text exposition format. */
export const PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8";

/**
 * Parse a text exposition into `name{labels}` → value (for tests and tools; no HELP/TYPE kept).
 * Label order is as rendered.
 */
export function parsePrometheusText(text: string): Map<string, number> {
  const out = new Map<string, number>();
  for (const line of text.split("\n")) {
    if (line === "" || line.startsWith("#")) continue;
    const space = line.lastIndexOf(" ");
    const value = line.slice(space + 1);
    out.set(line.slice(0, space), value === "+Inf" ? Number.POSITIVE_INFINITY : Number(value));
  }
  return out;
}
