/**
 * `kvfence bench serve --plot out.html`: one self-contained HTML page of a run or a sweep — the
 * latency distributions (TTFT, TPOT, ITL, end-to-end, each as its percentile curve, one line per
 * offered rate) and, for a sweep, throughput and TTFT (p50, p99) against the offered rate, with
 * the summary table. The chart library is uPlot from npm, its script and stylesheet inlined into
 * the page, so the page opens offline (no CDN) and can be mailed as one file. Only numbers and
 * labels go into the page, never a generated text.
 */
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { quantiles } from "../../lib/stats.js";
import {
  LATENCY_METRICS,
  type LatencyMetric,
  type ServeRunResult,
  SWEEP_COLUMNS,
  sweepRow,
  tpotOf,
} from "./serve-report.js";

const require = createRequire(import.meta.url);

/** Percentiles drawn for each distribution: 0, 1, …, 100 and the tail 99.5, 99.9. */
const CURVE = [...Array.from({ length: 100 }, (_, i) => i), 99.5, 99.9, 100];

interface PlotData {
  readonly title: string;
  readonly pcts: readonly number[];
  readonly runs: ReadonlyArray<{
    readonly label: string;
    readonly curves: Record<LatencyMetric, Array<number | null>>;
  }>;
  readonly sweep: {
    readonly labels: readonly string[];
    readonly requestThroughput: readonly number[];
    readonly outputThroughput: readonly number[];
    readonly p50Ttft: readonly number[];
    readonly p99Ttft: readonly number[];
  };
  readonly table: ReadonlyArray<readonly string[]>;
}

/** The values of one latency metric of a run, in ms, over its successful requests. */
export function latencySamples(run: ServeRunResult, metric: LatencyMetric): number[] {
  const ok = run.errors.map((e, i) => (e === "" ? i : -1)).filter((i) => i >= 0);
  switch (metric) {
    case "ttft":
      return ok.map((i) => run.ttfts[i]! * 1000);
    case "e2el":
      return ok.map((i) => run.latencies[i]! * 1000);
    case "itl":
      return ok.flatMap((i) => run.itls[i]!.map((v) => v * 1000));
    case "tpot":
      return ok
        .filter((i) => run.output_lens[i]! > 1)
        .map(
          (i) =>
            tpotOf({ latency: run.latencies[i]!, ttft: run.ttfts[i]!, outputLen: run.output_lens[i]! }) *
            1000,
        );
  }
}

function curve(values: readonly number[]): Array<number | null> {
  if (values.length === 0) return CURVE.map(() => null);
  return quantiles(
    values,
    CURVE.map((p) => p / 100),
  );
}

function rateLabel(r: ServeRunResult): string {
  return r.request_rate === "inf" ? "inf" : String(r.request_rate);
}

/** The page for the runs of one `bench serve` (one run, or a sweep in the order run). */
export function renderServePlot(runs: readonly ServeRunResult[]): string {
  const data = plotData(runs);
  const js = readFileSync(require.resolve("uplot/dist/uPlot.iife.min.js"), "utf8");
  const css = readFileSync(require.resolve("uplot/dist/uPlot.min.css"), "utf8");
  // Nothing in the inlined text may close its element early.
  const safe = (s: string) => s.replace(/<\/(script|style)/gi, "<\\/$1");
  const json = JSON.stringify(data).replace(/</g, "\\u003c");
  return `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>${escapeHtml(data.title)}</title>
<style>${safe(css)}</style>
<style>
${PAGE_STYLE}</style>
</head>
<body>
<h1 id="title"></h1>
<table id="summary"></table>
<h2>Latency distributions (percentile curves, one line per offered rate)</h2>
<div class="grid" id="latency"></div>
<div id="sweep-section"><h2>Against the offered rate</h2><div class="grid" id="sweep"></div></div>
<script>${safe(js)}</script>
<script type="application/json" id="data">${json}</script>
<script>
${PAGE_SCRIPT}</script>
</body>
</html>
`;
}

/** The numbers and labels the page draws: its title, each run's curves, the sweep, the table. */
function plotData(runs: readonly ServeRunResult[]): PlotData {
  const first = runs[0];
  const title =
    first === undefined
      ? "kvfence bench serve"
      : `kvfence bench serve — ${first.model_id} at ${first.base_url}${first.endpoint}, ${first.dataset_name}, ${first.num_prompts} requests per rate${first.max_concurrency === null ? "" : `, max concurrency ${first.max_concurrency}`}, ${first.date}`;
  const rateOf = (r: ServeRunResult) =>
    r.request_rate === "inf" ? Number.POSITIVE_INFINITY : r.request_rate;
  const byRate = [...runs].sort((a, b) => rateOf(a) - rateOf(b));
  return {
    title,
    pcts: CURVE,
    runs: runs.map((r) => ({
      label: rateLabel(r),
      curves: Object.fromEntries(LATENCY_METRICS.map((m) => [m, curve(latencySamples(r, m))])) as Record<
        LatencyMetric,
        Array<number | null>
      >,
    })),
    sweep: {
      labels: byRate.map(rateLabel),
      requestThroughput: byRate.map((r) => r.request_throughput),
      outputThroughput: byRate.map((r) => r.output_throughput),
      p50Ttft: byRate.map((r) => r.median_ttft_ms),
      p99Ttft: byRate.map((r) => r.p99_ttft_ms),
    },
    table: [SWEEP_COLUMNS, ...runs.map(sweepRow)],
  };
}

/** The page's own stylesheet. */
const PAGE_STYLE = `body { font: 14px system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 16px; font-weight: 600; }
h2 { font-size: 14px; font-weight: 600; margin: 20px 0 4px; }
.grid { display: flex; flex-wrap: wrap; gap: 12px; }
table { border-collapse: collapse; margin-top: 8px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f4f4f4; }
.bad { color: #b00; font-weight: 600; }
`;

/** The page's script: fills the table and draws the charts from the inlined data (no generated text). */
const PAGE_SCRIPT = `const D = JSON.parse(document.getElementById("data").textContent);
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
document.getElementById("title").textContent = D.title;
const table = document.getElementById("summary");
D.table.forEach((row, i) => {
  const tr = table.insertRow();
  row.forEach((cell, j) => {
    const c = document.createElement(i === 0 ? "th" : "td");
    c.textContent = cell;
    if (i > 0 && j === row.length - 1 && !cell.startsWith("0 ")) c.className = "bad";
    tr.appendChild(c);
  });
});
const NAMES = { ttft: "Time to first token (ms)", tpot: "Time per output token (ms)", itl: "Inter-token latency (ms)", e2el: "End-to-end latency (ms)" };
for (const m of ["ttft", "tpot", "itl", "e2el"]) {
  const el = document.createElement("div");
  document.getElementById("latency").appendChild(el);
  new uPlot({
    title: NAMES[m], width: 560, height: 300,
    scales: { x: { time: false } },
    series: [{ label: "percentile" }].concat(D.runs.map((r, i) => ({
      label: "rate " + r.label, stroke: COLORS[i % COLORS.length], width: 2, points: { show: false },
    }))),
    axes: [{ label: "percentile" }, { label: "ms" }],
  }, [D.pcts].concat(D.runs.map((r) => r.curves[m])), el);
}
if (D.sweep.labels.length < 2) {
  document.getElementById("sweep-section").style.display = "none";
} else {
  const xs = D.sweep.labels.map((_, i) => i);
  const xAxis = {
    label: "offered rate (req/s)",
    splits: () => xs,
    values: (u, splits) => splits.map((s) => D.sweep.labels[s] ?? ""),
  };
  const xScale = { time: false, range: (u, lo, hi) => [lo - 0.3, hi + 0.3] };
  const point = { show: true, size: 7 };
  const el1 = document.createElement("div");
  const el2 = document.createElement("div");
  document.getElementById("sweep").append(el1, el2);
  new uPlot({
    title: "Throughput", width: 560, height: 300,
    scales: { x: xScale, rps: { auto: true }, tps: { auto: true } },
    series: [
      { label: "offered rate" },
      { label: "requests/s", scale: "rps", stroke: COLORS[0], width: 2, points: point },
      { label: "output tokens/s", scale: "tps", stroke: COLORS[2], width: 2, points: point },
    ],
    axes: [xAxis, { scale: "rps", label: "requests/s" }, { scale: "tps", label: "output tokens/s", side: 1, grid: { show: false } }],
  }, [xs, D.sweep.requestThroughput, D.sweep.outputThroughput], el1);
  new uPlot({
    title: "Time to first token", width: 560, height: 300,
    scales: { x: xScale },
    series: [
      { label: "offered rate" },
      { label: "p50 TTFT (ms)", stroke: COLORS[0], width: 2, points: point },
      { label: "p99 TTFT (ms)", stroke: COLORS[1], width: 2, points: point },
    ],
    axes: [xAxis, { label: "ms" }],
  }, [xs, D.sweep.p50Ttft, D.sweep.p99Ttft], el2);
}
`;

function escapeHtml(s: string): string {
  return s.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}
