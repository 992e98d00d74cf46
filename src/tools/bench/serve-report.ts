/**
 * The figures of a `kvfence bench serve` run (docs/benchmarks.md §6), from the per-request records
 * the load generator collected: completed / failed, throughput, TTFT, TPOT, ITL and end-to-end
 * latency (mean, median, std, p50, p90, p99), goodput under SLOs, and the contamination count.
 *
 * The result object uses the field names of vLLM's `vllm bench serve` result file (and its
 * definitions: TPOT = (e2el − ttft) / (output tokens − 1) over requests with more than one output
 * token; ITL = the gaps between chunks that carried text, over all requests; a request meets the
 * SLOs when each configured value is at most its bound, a one-token request counting TPOT 0;
 * std is numpy's population deviation; percentiles interpolate linearly), so tools that read
 * those files read these. Per-request arrays are in seconds, aggregates in milliseconds.
 * kvfence's own additions: `input_throughput` (SGLang's name), `slo`, and the `contamination`
 * block: responses holding another request's nonce.
 */
import { mean, populationStddev, quantile } from "../../lib/stats.js";
import type { CanaryIndex } from "../probe/canary.js";

/** Service-level objectives in milliseconds; a request meets them when each set one holds. */
export interface Slo {
  readonly ttft?: number;
  readonly tpot?: number;
  readonly e2el?: number;
}

/** What the load generator saw of one request. Times in seconds from the start of the run. */
export interface RequestRecord {
  readonly index: number;
  readonly session: number;
  readonly turn: number;
  /** When it was sent (after any wait for a concurrency slot or the previous turn). */
  readonly startTime: number;
  readonly success: boolean;
  /** "" when it succeeded. */
  readonly error: string;
  readonly ttft: number;
  readonly itl: readonly number[];
  readonly latency: number;
  /** `usage.prompt_tokens`, else the dataset's estimate. */
  readonly promptLen: number;
  /** `usage.completion_tokens`, else the number of chunks that carried text; 0 when it failed. */
  readonly outputLen: number;
  readonly usageReported: boolean;
  readonly generatedText: string;
  /** The text the request sent (every message, or the prompt). */
  readonly promptText: string;
  /** The code of the nonce this request planted. */
  readonly nonceCode: string;
}

export const PERCENTILES = [50, 90, 99] as const;
export const LATENCY_METRICS = ["ttft", "tpot", "itl", "e2el"] as const;
export type LatencyMetric = (typeof LATENCY_METRICS)[number];

export interface ContaminationExample {
  /** The request whose response held the nonce. */
  readonly request: number;
  /** The foreign nonce's code, and the request that planted it. */
  readonly code: string;
  readonly planted_by: number;
  readonly match: "exact" | "fragment";
  readonly excerpt: string;
}

export interface Contamination {
  readonly nonce_style: "ask" | "plant";
  /** Responses scanned (every request: the text of a failed one is its error). */
  readonly responses: number;
  /** Responses holding at least one nonce of another request that their own prompt did not hold. */
  readonly contaminated_responses: number;
  /** (response, foreign nonce) pairs. */
  readonly foreign_nonces: number;
  /** Successful responses that repeated their own nonce (shows the detector can see a copy). */
  readonly own_nonce_repeated: number;
  readonly examples: readonly ContaminationExample[];
}

type Percentile = (typeof PERCENTILES)[number];

/** `mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p50_ttft_ms`, `p90_ttft_ms`, `p99_ttft_ms`, … */
export type LatencyFields = {
  readonly [K in `${"mean" | "median" | "std" | `p${Percentile}`}_${LatencyMetric}_ms`]: number;
};

/** One run at one offered rate, in vLLM's result-file shape plus kvfence's fields. */
export interface ServeRunResult extends LatencyFields {
  readonly date: string;
  readonly endpoint_type: string;
  readonly backend: string;
  readonly label: null;
  readonly model_id: string;
  readonly tokenizer_id: null;
  readonly num_prompts: number;
  readonly request_rate: number | "inf";
  readonly burstiness: number;
  readonly max_concurrency: number | null;
  readonly base_url: string;
  readonly endpoint: string;
  readonly dataset_name: string;
  readonly seed: number;
  readonly slo: Slo | null;
  readonly duration: number;
  readonly completed: number;
  readonly failed: number;
  readonly total_input_tokens: number;
  readonly total_output_tokens: number;
  readonly request_throughput: number;
  readonly request_goodput: number | null;
  readonly input_throughput: number;
  readonly output_throughput: number;
  readonly total_token_throughput: number;
  readonly max_concurrent_requests: number;
  readonly input_lens: readonly number[];
  readonly output_lens: readonly number[];
  readonly ttfts: readonly number[];
  readonly itls: ReadonlyArray<readonly number[]>;
  readonly latencies: readonly number[];
  readonly start_times: readonly number[];
  readonly generated_texts: readonly string[];
  readonly errors: readonly string[];
  readonly contamination: Contamination;
}

export interface RunMeta {
  readonly date: Date;
  readonly endpoint: string;
  readonly modelId: string;
  readonly baseUrl: string;
  readonly requestRate: number;
  readonly maxConcurrency: number | null;
  readonly datasetName: string;
  readonly seed: number;
  readonly slo: Slo | null;
  readonly nonceStyle: "ask" | "plant";
}

/** TPOT of one successful request in seconds: 0 for a one-token answer (as vLLM's goodput counts it). */
export function tpotOf(r: Pick<RequestRecord, "latency" | "ttft" | "outputLen">): number {
  return r.outputLen > 1 ? (r.latency - r.ttft) / (r.outputLen - 1) : 0;
}

/** The run's figures from its records (in dispatch order) and the duration in seconds. */
export function summarizeRun(
  records: readonly RequestRecord[],
  durationS: number,
  meta: RunMeta,
  nonces: { readonly index: CanaryIndex; readonly plantedBy: ReadonlyMap<string, number> },
): ServeRunResult {
  const ok = records.filter((r) => r.success);
  const samples: Record<LatencyMetric, number[]> = {
    ttft: ok.map((r) => r.ttft),
    tpot: ok.filter((r) => r.outputLen > 1).map(tpotOf),
    itl: ok.flatMap((r) => r.itl),
    e2el: ok.map((r) => r.latency),
  };
  const totalInput = ok.reduce((n, r) => n + r.promptLen, 0);
  const totalOutput = ok.reduce((n, r) => n + r.outputLen, 0);
  const slo = meta.slo;
  const good =
    slo === null
      ? null
      : ok.filter(
          (r) =>
            (slo.ttft === undefined || r.ttft * 1000 <= slo.ttft) &&
            (slo.tpot === undefined || tpotOf(r) * 1000 <= slo.tpot) &&
            (slo.e2el === undefined || r.latency * 1000 <= slo.e2el),
        ).length;
  const latencyFields = {} as Record<keyof LatencyFields, number>;
  for (const m of LATENCY_METRICS) {
    const ms = samples[m].map((v) => v * 1000);
    latencyFields[`mean_${m}_ms`] = ms.length === 0 ? 0 : mean(ms);
    latencyFields[`median_${m}_ms`] = ms.length === 0 ? 0 : quantile(ms, 0.5);
    latencyFields[`std_${m}_ms`] = ms.length === 0 ? 0 : populationStddev(ms);
    for (const p of PERCENTILES) latencyFields[`p${p}_${m}_ms`] = ms.length === 0 ? 0 : quantile(ms, p / 100);
  }
  const chat = meta.endpoint === "/v1/chat/completions";
  return {
    date: vllmDate(meta.date),
    endpoint_type: chat ? "openai-chat" : "openai",
    backend: chat ? "openai-chat" : "openai",
    label: null,
    model_id: meta.modelId,
    tokenizer_id: null,
    num_prompts: records.length,
    request_rate: Number.isFinite(meta.requestRate) ? meta.requestRate : "inf",
    burstiness: 1,
    max_concurrency: meta.maxConcurrency,
    base_url: meta.baseUrl,
    endpoint: meta.endpoint,
    dataset_name: meta.datasetName,
    seed: meta.seed,
    slo,
    duration: durationS,
    completed: ok.length,
    failed: records.length - ok.length,
    total_input_tokens: totalInput,
    total_output_tokens: totalOutput,
    request_throughput: ok.length / durationS,
    request_goodput: good === null ? null : good / durationS,
    input_throughput: totalInput / durationS,
    output_throughput: totalOutput / durationS,
    total_token_throughput: (totalInput + totalOutput) / durationS,
    max_concurrent_requests: peakConcurrency(ok),
    ...latencyFields,
    input_lens: records.map((r) => r.promptLen),
    output_lens: records.map((r) => (r.success ? r.outputLen : 0)),
    ttfts: records.map((r) => (r.success ? r.ttft : 0)),
    itls: records.map((r) => (r.success ? r.itl : [])),
    latencies: records.map((r) => (r.success ? r.latency : 0)),
    start_times: records.map((r) => r.startTime),
    generated_texts: records.map((r) => r.generatedText),
    errors: records.map((r) => r.error),
    contamination: contamination(records, meta.nonceStyle, nonces.index, nonces.plantedBy),
  };
}

/**
 * Every response scanned for the run's nonces: a nonce counts as foreign when another request
 * planted it and this request's own prompt (its messages, including earlier answers in a
 * multi-turn session) did not hold it.
 */
export function contamination(
  records: readonly RequestRecord[],
  nonceStyle: "ask" | "plant",
  index: CanaryIndex,
  plantedBy: ReadonlyMap<string, number>,
): Contamination {
  let contaminated = 0;
  let foreign = 0;
  let repeated = 0;
  const examples: ContaminationExample[] = [];
  for (const r of records) {
    const output = r.success ? r.generatedText : `${r.generatedText}\n${r.error}`;
    const hits = index.scan(output);
    if (r.success && hits.some((h) => h.code === r.nonceCode)) repeated++;
    const own = new Set([r.nonceCode, ...index.scan(r.promptText).map((h) => h.code)]);
    const theirs = hits.filter((h) => !own.has(h.code));
    if (theirs.length === 0) continue;
    contaminated++;
    foreign += theirs.length;
    for (const h of theirs) {
      if (examples.length >= 5) break;
      examples.push({
        request: r.index,
        code: h.code,
        planted_by: plantedBy.get(h.code) ?? -1,
        match: h.match,
        excerpt: output.slice(0, 120),
      });
    }
  }
  return {
    nonce_style: nonceStyle,
    responses: records.length,
    contaminated_responses: contaminated,
    foreign_nonces: foreign,
    own_nonce_repeated: repeated,
    examples,
  };
}

/** The most requests in flight at once, over half-open [start, start + latency) intervals. */
function peakConcurrency(ok: readonly RequestRecord[]): number {
  const events = ok.flatMap((r) => [
    [r.startTime, 1],
    [r.startTime + r.latency, -1],
  ]) as Array<[number, number]>;
  events.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
  let now = 0;
  let peak = 0;
  for (const [, d] of events) {
    now += d;
    peak = Math.max(peak, now);
  }
  return peak;
}

function vllmDate(d: Date): string {
  const p = (n: number) => String(n).padStart(2, "0");
  return `${d.getFullYear()}${p(d.getMonth() + 1)}${p(d.getDate())}-${p(d.getHours())}${p(d.getMinutes())}${p(d.getSeconds())}`;
}

const HEADERS: Record<LatencyMetric, [string, string]> = {
  ttft: ["TTFT", "Time to First Token"],
  tpot: ["TPOT", "Time per Output Token (excl. 1st token)"],
  itl: ["ITL", "Inter-token Latency"],
  e2el: ["E2EL", "End-to-end Latency"],
};

/** The run as text, in the layout of vLLM's result block, with the contamination line beside goodput. */
export function formatRun(r: ServeRunResult): string {
  const lines: string[] = [];
  const row = (label: string, value: string | number) =>
    lines.push(`${label.padEnd(40)} ${typeof value === "number" ? fmt(value) : value}`);
  lines.push(center(" Serving Benchmark Result ", "="));
  row("Successful requests:", String(r.completed));
  row("Failed requests:", String(r.failed));
  if (r.max_concurrency !== null) row("Maximum request concurrency:", String(r.max_concurrency));
  row("Request rate configured (RPS):", r.request_rate === "inf" ? "inf" : fmt(r.request_rate));
  row("Benchmark duration (s):", r.duration);
  row("Total input tokens:", String(r.total_input_tokens));
  row("Total generated tokens:", String(r.total_output_tokens));
  row("Request throughput (req/s):", r.request_throughput);
  if (r.request_goodput !== null) row("Request goodput (req/s):", r.request_goodput);
  const c = r.contamination;
  row(
    "Contaminated responses:",
    `${c.contaminated_responses} of ${c.responses} (own nonce repeated in ${c.own_nonce_repeated})`,
  );
  row("Input token throughput (tok/s):", r.input_throughput);
  row("Output token throughput (tok/s):", r.output_throughput);
  row("Total token throughput (tok/s):", r.total_token_throughput);
  row("Peak concurrent requests:", String(r.max_concurrent_requests));
  for (const m of LATENCY_METRICS) {
    const [short, long] = HEADERS[m];
    lines.push(center(long, "-"));
    row(`Mean ${short} (ms):`, r[`mean_${m}_ms`]);
    row(`Median ${short} (ms):`, r[`median_${m}_ms`]);
    row(`Std ${short} (ms):`, r[`std_${m}_ms`]);
    for (const p of PERCENTILES) row(`P${p} ${short} (ms):`, r[`p${p}_${m}_ms`]);
  }
  lines.push("=".repeat(50));
  if (r.completed > 0 && c.own_nonce_repeated * 2 < r.completed) {
    lines.push(
      `note: only ${c.own_nonce_repeated} of ${r.completed} responses repeated their own nonce: this model does not copy its context, so a leak may not show up as text (kvfence-tiny answers through its chat template: use /v1/chat/completions)`,
    );
  }
  for (const e of c.examples) {
    lines.push(
      `contamination: request ${e.request}'s response holds ${e.code} (planted by request ${e.planted_by}, ${e.match}): ${JSON.stringify(e.excerpt)}`,
    );
  }
  const firstErrors = r.errors.filter((e) => e !== "").slice(0, 3);
  for (const e of firstErrors) lines.push(`error: ${e}`);
  return lines.join("\n");
}

/** The columns of the sweep's summary table (`formatSweep`, and the chart page's table). */
export const SWEEP_COLUMNS: readonly string[] = [
  "offered rate (req/s)",
  "completed / failed",
  "req/s",
  "output tok/s",
  "goodput (req/s)",
  "TTFT p50 / p99 (ms)",
  "TPOT mean (ms)",
  "ITL p99 (ms)",
  "E2EL p50 / p99 (ms)",
  "contaminated",
];

/** A run's row of the sweep's summary table, one cell per `SWEEP_COLUMNS`. */
export function sweepRow(r: ServeRunResult): string[] {
  return [
    String(r.request_rate),
    `${r.completed} / ${r.failed}`,
    fmt(r.request_throughput),
    fmt(r.output_throughput),
    r.request_goodput === null ? "–" : fmt(r.request_goodput),
    `${fmt(r.median_ttft_ms)} / ${fmt(r.p99_ttft_ms)}`,
    fmt(r.mean_tpot_ms),
    fmt(r.p99_itl_ms),
    `${fmt(r.median_e2el_ms)} / ${fmt(r.p99_e2el_ms)}`,
    `${r.contamination.contaminated_responses} of ${r.contamination.responses}`,
  ];
}

/** One Markdown row per rate: the sweep at a glance. */
export function formatSweep(runs: readonly ServeRunResult[]): string {
  const row = (cells: readonly string[]): string => `| ${cells.join(" | ")} |`;
  return [
    row(SWEEP_COLUMNS),
    `|${" --- |".repeat(SWEEP_COLUMNS.length)}`,
    ...runs.map((r) => row(sweepRow(r))),
  ].join("\n");
}

/** `text` centred in 50 columns of `fill`, as Python's `"{:fill^50}"`. */
function center(text: string, fill: string): string {
  const left = Math.max(0, Math.floor((50 - text.length) / 2));
  return `${fill.repeat(left)}${text}`.padEnd(50, fill);
}

function fmt(v: number): string {
  return v.toFixed(2);
}
