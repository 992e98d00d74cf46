/**
 * `kvfence bench observability`: what the per-phase histograms, the traces and the dashboard cost
 * (issue #18: histograms ≤ 0.5% of decode throughput; histograms, traces and dashboard together
 * ≤ 1% at the highest rate measured). Starts one server per arm, all of the same topology from
 * this build, and measures each feature alone and all together against `off`:
 *
 * - `off`: `--no-phase-metrics`, no exporter, nobody polling the dashboard's JSON;
 * - `histograms`: the default flags (the per-phase histograms recorded, and rendered at each scrape);
 * - `traces`: `--no-phase-metrics --otlp-endpoint` to an OTLP/HTTP receiver inside this command
 *   (it counts the spans it is sent and drops them);
 * - `dashboard`: `--no-phase-metrics`, and `/kvfence/state` polled every `--poll-ms` (the page's
 *   default, 1 s) while the arm runs;
 * - `all`: histograms, traces and the dashboard's polling together.
 *
 * Every arm's `/metrics` is scraped every `--scrape-ms` while it runs, as Prometheus would (the
 * counters and gauges are there in every arm; what the histograms add to a scrape is theirs).
 *
 * Each round drives the same batch of greedy chat requests (`--concurrency` in flight: the server
 * saturated, the highest rate it serves) through each arm in turn, the order rotated every round
 * so each arm takes each place equally often. An arm's round is its requests and then a settle
 * time (`--settle-ms`; by default the span exporter's 5 s batch delay plus the 1 s spans wait to
 * be built, src/lib/tracing.ts), so the spans a round made are exported inside its own window and
 * not during the next arm's round. Measured per arm and round: output tokens per second of the
 * requests' wall time, and the server processes' CPU time (every thread, from /proc) over the
 * whole window per output token. Reported: each feature arm over `off` as the geometric mean of
 * the per-round paired ratios with a 95% confidence interval, for throughput and for CPU per
 * token; every arm must give the same answers.
 */
import { randomBytes } from "node:crypto";
import { createServer, type Server as HttpServer } from "node:http";
import os from "node:os";
import { fileURLToPath } from "node:url";
import { Command, InvalidArgumentError, Option } from "commander";
import { bundledModelDir } from "../../lib/package-root.js";
import { pairedRatio, type RatioInterval, type Summary, summarize } from "../../lib/stats.js";
import { prompt, round } from "./cluster.js";
import {
  armLoadOptions,
  type FairBenchTopology,
  type Server,
  startArm,
  topologyOption,
} from "./fair-share.js";
import { cpuSeconds } from "./process-cpu.js";
import { positiveInt, runBenchCli } from "./transfer.js";

/** A feature arm (each is compared with `off`). */
export type ObservabilityFeature = "histograms" | "traces" | "dashboard" | "all";
export const FEATURES: readonly ObservabilityFeature[] = ["histograms", "traces", "dashboard", "all"];
type Arm = "off" | ObservabilityFeature;

/** What each arm switches on. */
const ARM: Readonly<Record<Arm, { histograms: boolean; traces: boolean; dashboard: boolean }>> = {
  off: { histograms: false, traces: false, dashboard: false },
  histograms: { histograms: true, traces: false, dashboard: false },
  traces: { histograms: false, traces: true, dashboard: false },
  dashboard: { histograms: false, traces: false, dashboard: true },
  all: { histograms: true, traces: true, dashboard: true },
};

/** The issue's bounds: histograms ≤ 0.5%, everything together ≤ 1% (the others are reported only). */
export const BOUND: Readonly<Partial<Record<ObservabilityFeature, number>>> = {
  histograms: 0.995,
  all: 0.99,
};

/**
 * The settle time of a traced arm: the span exporter's batch delay (the SDK's 5 s, or
 * OTEL_BSP_SCHEDULE_DELAY from this command's environment, which the servers inherit) plus the
 * 1 s before spans are built (src/lib/tracing.ts) and a margin. A server's idle CPU over it is
 * counted in every arm alike (~2 ms a second on this VM, against seconds of CPU a round).
 */
function tracedSettleMs(): number {
  const delay = Number(process.env.OTEL_BSP_SCHEDULE_DELAY);
  return (Number.isFinite(delay) && delay > 0 ? delay : 5000) + 1500;
}
const UNTRACED_SETTLE_MS = 500;

export interface ObservabilityBenchOptions {
  readonly topology?: FairBenchTopology;
  /** The feature arms to measure against `off` (default: each alone and all together). */
  readonly what?: readonly ObservabilityFeature[];
  readonly model?: string;
  readonly kvPages?: number;
  readonly rounds?: number;
  readonly warmup?: number;
  readonly requests?: number;
  readonly concurrency?: number;
  readonly maxTokens?: number;
  readonly promptChars?: number;
  /** How often the dashboard poller reads /kvfence/state (ms). */
  readonly pollMs?: number;
  /** How often every arm's /metrics is scraped (ms). */
  readonly scrapeMs?: number;
  /** The wait after an arm's requests that still counts to its CPU (ms). */
  readonly settleMs?: number;
  readonly log?: (line: string) => void;
}

export interface ArmResult {
  readonly tokensPerSecond: Summary;
  readonly outputTokens: number;
  /** Server CPU milliseconds per output token, per round. */
  readonly cpuMsPerToken: Summary | null;
  /** What the arm's observers saw (proof they ran). */
  readonly observed: { readonly spans: number; readonly statePolls: number; readonly scrapes: number };
}

export interface FeatureRatio {
  /** Throughput of the feature arm over off, paired by round. */
  readonly throughput: RatioInterval;
  /** Server CPU time per output token, feature arm over off, paired by round (null without /proc). */
  readonly cpuPerToken: RatioInterval | null;
}

export interface ObservabilityBenchResult {
  readonly topology: FairBenchTopology;
  readonly what: readonly ObservabilityFeature[];
  readonly rounds: number;
  readonly requests: number;
  readonly concurrency: number;
  readonly maxTokens: number;
  readonly pollMs: number;
  readonly scrapeMs: number;
  readonly settleMs: number;
  readonly arms: Readonly<Partial<Record<Arm, ArmResult>>>;
  readonly ratios: Readonly<Partial<Record<ObservabilityFeature, FeatureRatio>>>;
  readonly failures: readonly string[];
  readonly load: { readonly start: number; readonly end: number; readonly cpus: number };
}

const THIS_MAIN = fileURLToPath(new URL("../../cli/main.js", import.meta.url));

/** An OTLP/HTTP receiver that counts the spans posted to it (JSON) and keeps nothing. */
async function spanSink(): Promise<{ url: string; spans: () => number; close(): Promise<void> }> {
  let spans = 0;
  const server: HttpServer = createServer((req, res) => {
    let body = "";
    req.setEncoding("utf8");
    req.on("data", (c: string) => {
      body += c;
    });
    req.on("end", () => {
      spans += body.split('"spanId"').length - 1;
      res.writeHead(200, { "content-type": "application/json" });
      res.end("{}");
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const address = server.address();
  const port = typeof address === "object" && address !== null ? address.port : 0;
  return {
    url: `http://127.0.0.1:${port}`,
    spans: () => spans,
    close: () => new Promise<void>((resolve) => server.close(() => resolve())),
  };
}

/** Scrapes /metrics (and polls /kvfence/state when `dashboard`) while one arm runs; counts what it read. */
function observe(
  url: string,
  key: string,
  dashboard: boolean,
  s: { pollMs: number; scrapeMs: number },
  counts: { statePolls: number; scrapes: number },
) {
  const headers = { authorization: `Bearer ${key}` };
  const get = async (path: string, field: keyof typeof counts) => {
    try {
      const res = await fetch(`${url}${path}`, { headers });
      await res.arrayBuffer();
      if (res.ok) counts[field]++;
    } catch {
      // The server is starting or stopping.
    }
  };
  const timers = [setInterval(() => void get("/metrics", "scrapes"), s.scrapeMs)];
  if (dashboard) timers.push(setInterval(() => void get("/kvfence/state", "statePolls"), s.pollMs));
  return () => {
    for (const t of timers) clearInterval(t);
  };
}

/** The arms in round `r`'s order: off and the features, rotated by one place a round. */
export function armOrder(features: readonly ObservabilityFeature[], r: number): Arm[] {
  const arms: Arm[] = ["off", ...features];
  const k = ((r % arms.length) + arms.length) % arms.length;
  return [...arms.slice(k), ...arms.slice(0, k)];
}

/** `--what`: a comma-separated list of features (`each`: every feature alone and all together). */
export function parseWhat(value: string): ObservabilityFeature[] {
  const out: ObservabilityFeature[] = [];
  for (const part of value.split(",").map((p) => p.trim())) {
    if (part === "each") out.push(...FEATURES);
    else if ((FEATURES as readonly string[]).includes(part)) out.push(part as ObservabilityFeature);
    else
      throw new Error(
        `--what: "${part}" is not a feature; give a comma-separated list of ${FEATURES.join(", ")}, or each`,
      );
  }
  return FEATURES.filter((f) => out.includes(f));
}

function settingsOf(options: ObservabilityBenchOptions) {
  const what = options.what ?? FEATURES;
  const traced = what.some((f) => ARM[f].traces);
  return {
    topology: options.topology ?? "threads",
    what,
    rounds: options.rounds ?? 10,
    warmup: options.warmup ?? 1,
    requests: options.requests ?? 64,
    concurrency: options.concurrency ?? 16,
    maxTokens: options.maxTokens ?? 64,
    promptChars: options.promptChars ?? 200,
    pollMs: options.pollMs ?? 1000,
    scrapeMs: options.scrapeMs ?? 1000,
    settleMs: options.settleMs ?? (traced ? tracedSettleMs() : UNTRACED_SETTLE_MS),
    common: ["--model", options.model ?? bundledModelDir(), "--kv-pages", String(options.kvPages ?? 600)],
    log: options.log ?? (() => {}),
  };
}

type Settings = ReturnType<typeof settingsOf>;

interface Running {
  readonly arm: Arm;
  readonly server: Server;
  readonly sink: Awaited<ReturnType<typeof spanSink>> | null;
  readonly counts: { statePolls: number; scrapes: number };
  readonly ns: number[];
  readonly tps: number[];
  readonly cpuPerToken: number[];
  outputTokens: number;
}

export async function runObservabilityBench(
  options: ObservabilityBenchOptions = {},
): Promise<ObservabilityBenchResult> {
  const s = settingsOf(options);
  const loadStart = os.loadavg()[0]!;
  const key = randomBytes(24).toString("hex");
  const arms: Arm[] = ["off", ...s.what];
  const running: Running[] = [];
  const failures: string[] = [];
  try {
    s.log(`starting ${arms.length} ${s.topology} servers: ${arms.join(", ")}`);
    // Started together, so none is systematically the first (its threads placed first).
    const started = await Promise.allSettled(arms.map((arm) => startOne(s, arm, key)));
    for (const r of started) if (r.status === "fulfilled") running.push(r.value);
    const failed = started.find((r) => r.status === "rejected");
    if (failed !== undefined) throw failed.reason;
    const model = await modelOf(running[0]!.server.url);
    await runRounds(s, running, model, key, failures);
  } finally {
    await Promise.all(running.map(async (a) => Promise.all([a.server.close(), a.sink?.close()])));
  }
  const byArm = new Map(running.map((a) => [a.arm, a]));
  const off = byArm.get("off")!;
  const armResults: Partial<Record<Arm, ArmResult>> = {};
  for (const a of running)
    armResults[a.arm] = {
      tokensPerSecond: summarize(a.tps),
      outputTokens: a.outputTokens,
      cpuMsPerToken: a.cpuPerToken.length === s.rounds ? summarize(a.cpuPerToken.map((c) => c * 1000)) : null,
      observed: { spans: a.sink?.spans() ?? 0, ...a.counts },
    };
  const ratios: Partial<Record<ObservabilityFeature, FeatureRatio>> = {};
  for (const f of s.what) {
    const a = byArm.get(f)!;
    ratios[f] = {
      // Throughput ratio = time ratio off / arm (the same tokens in every arm).
      throughput: pairedRatio(off.ns, a.ns),
      cpuPerToken:
        a.cpuPerToken.length === s.rounds && off.cpuPerToken.length === s.rounds
          ? pairedRatio(a.cpuPerToken, off.cpuPerToken)
          : null,
    };
  }
  return {
    topology: s.topology,
    what: s.what,
    rounds: s.rounds,
    requests: s.requests,
    concurrency: s.concurrency,
    maxTokens: s.maxTokens,
    pollMs: s.pollMs,
    scrapeMs: s.scrapeMs,
    settleMs: s.settleMs,
    arms: armResults,
    ratios,
    failures,
    load: { start: loadStart, end: os.loadavg()[0]!, cpus: os.cpus().length },
  };
}

async function startOne(s: Settings, arm: Arm, key: string): Promise<Running> {
  const on = ARM[arm];
  const sink = on.traces ? await spanSink() : null;
  const args = [...s.common];
  if (!on.histograms) args.push("--no-phase-metrics");
  if (sink !== null) args.push("--otlp-endpoint", sink.url);
  try {
    const server = await startArm(THIS_MAIN, s.topology, args, ["--operator-key", key]);
    return {
      arm,
      server,
      sink,
      counts: { statePolls: 0, scrapes: 0 },
      ns: [],
      tps: [],
      cpuPerToken: [],
      outputTokens: 0,
    };
  } catch (err) {
    await sink?.close();
    throw err;
  }
}

/** The warm-up and measured rounds, the arms' order rotated each round. */
async function runRounds(
  s: Settings,
  running: readonly Running[],
  model: string,
  key: string,
  failures: string[],
): Promise<void> {
  const prompts = Array.from({ length: s.requests }, (_, i) => prompt(i, s.promptChars));
  const byArm = new Map(running.map((a) => [a.arm, a]));
  let reference: string[] | null = null;
  for (let r = -s.warmup; r < s.rounds; r++) {
    for (const arm of armOrder(s.what, r)) {
      const a = byArm.get(arm)!;
      const cpu0 = cpuSeconds(a.server.pids);
      const stop = observe(a.server.url, key, ARM[arm].dashboard, s, a.counts);
      let result: Awaited<ReturnType<typeof round>>;
      try {
        result = await round({ url: a.server.url, model, maxTokens: s.maxTokens }, prompts, s.concurrency);
      } finally {
        stop();
      }
      // The spans this round made are built and exported now, inside its window.
      await new Promise((resolve) => setTimeout(resolve, s.settleMs));
      const cpu = cpuSeconds(a.server.pids) - cpu0;
      const ref: string[] = reference ?? result.texts;
      reference = ref;
      if (result.texts.some((t, i) => t !== ref[i]) && failures.length < 5)
        failures.push(`${arm} round ${r + 1}: answers differ from the first round's (greedy decoding)`);
      if (r < 0) continue;
      a.ns.push(result.ns);
      a.tps.push(result.tokens / (result.ns / 1e9));
      a.outputTokens += result.tokens;
      if (!Number.isNaN(cpu)) a.cpuPerToken.push(cpu / result.tokens);
    }
    if (r >= 0)
      s.log(
        `round ${r + 1}/${s.rounds}: ${running.map((a) => `${a.arm} ${a.tps.at(-1)!.toFixed(0)}`).join(", ")} tok/s`,
      );
  }
}

async function modelOf(url: string): Promise<string> {
  const models = (await (await fetch(`${url}/v1/models`)).json()) as { data: { id: string }[] };
  return models.data[0]!.id;
}

const pct = (x: number): string => `${(x * 100).toFixed(1)}%`;

/** What a throughput interval says against a bound (the least fraction of off's throughput allowed). */
export function verdict(t: RatioInterval, bound: number): string {
  if (Number.isNaN(t.low)) return "too few rounds for a CI";
  if (t.low >= bound) return `costs at most ${pct(1 - bound)} (CI low end ≥ ${pct(bound)})`;
  if (t.high < bound) return `costs MORE than ${pct(1 - bound)} (CI high end < ${pct(bound)})`;
  return `undecided against ${pct(1 - bound)}: the CI straddles ${pct(bound)} (more rounds, a quieter machine)`;
}

const LABEL: Readonly<Record<Arm, string>> = {
  off: "off (--no-phase-metrics)",
  histograms: "histograms (the default)",
  traces: "traces (--otlp-endpoint)",
  dashboard: "dashboard (/kvfence/state polled)",
  all: "all (histograms + traces + dashboard)",
};

/** The human-readable report of a run. */
export function formatObservabilityReport(r: ObservabilityBenchResult): string {
  const lines = [
    `kvfence ${r.topology}, observability features vs off: ${r.rounds} rounds of ${r.requests} chat requests per arm, arms interleaved (${r.concurrency} in flight: saturated; max_tokens ${r.maxTokens}, greedy)`,
    `every arm's /metrics scraped every ${r.scrapeMs} ms; /kvfence/state polled every ${r.pollMs} ms in dashboard and all; ${r.settleMs} ms after each arm's requests counted to its CPU`,
    `machine: ${r.load.cpus} CPUs, 1-min load average ${r.load.start.toFixed(1)} at start, ${r.load.end.toFixed(1)} at end`,
  ];
  for (const [arm, a] of Object.entries(r.arms) as [Arm, ArmResult][]) {
    const x = a.tokensPerSecond;
    const cpu = a.cpuMsPerToken === null ? "" : `  CPU ${a.cpuMsPerToken.median.toFixed(2)} ms/token`;
    const seen = ARM[arm].traces || ARM[arm].dashboard ? `  (${observed(a.observed)})` : "";
    lines.push(
      `${LABEL[arm].padEnd(40)} ${x.median.toFixed(0).padStart(6)} tok/s  quartiles ${x.p25.toFixed(0)}–${x.p75.toFixed(0)}  range ${x.min.toFixed(0)}–${x.max.toFixed(0)}${cpu}${seen}`,
    );
  }
  for (const f of r.what) {
    const ratio = r.ratios[f];
    if (ratio === undefined) continue;
    const t = ratio.throughput;
    const bound = BOUND[f];
    lines.push(
      `${f} / off: throughput ${pct(t.ratio)} [95% CI ${pct(t.low)}–${pct(t.high)}]${bound === undefined ? "" : `: ${verdict(t, bound)}`}`,
    );
    if (ratio.cpuPerToken !== null) {
      const c = ratio.cpuPerToken;
      lines.push(
        `${" ".repeat(f.length + 7)}CPU per token ${pct(c.ratio)} [95% CI ${pct(c.low)}–${pct(c.high)}]`,
      );
    }
  }
  if (r.failures.length > 0) lines.push(`FAILURES: ${r.failures.join("; ")}`);
  return lines.join("\n");
}

function observed(o: ArmResult["observed"]): string {
  return `${o.spans} spans exported, ${o.statePolls} dashboard polls, ${o.scrapes} scrapes`;
}

interface CliOptions {
  topology: FairBenchTopology;
  what: ObservabilityFeature[];
  model?: string;
  kvPages: number;
  rounds: number;
  warmup: number;
  requests: number;
  concurrency: number;
  maxTokens: number;
  promptChars: number;
  pollMs: number;
  scrapeMs: number;
  settleMs?: number;
  json?: boolean;
}

/** `kvfence bench observability`. */
export function observabilityCommand(): Command {
  const cmd = new Command("observability")
    .description(
      "Chat throughput and CPU per token with the per-phase histograms, the traces and the dashboard's polling each on, and all together, vs all off: interleaved rounds, 95% CIs of the ratios",
    )
    .addOption(topologyOption())
    .addOption(
      new Option(
        "--what <features>",
        "the arms measured against off, comma-separated: histograms, traces, dashboard, all (together), or each (every one)",
      )
        .argParser((v: string) => {
          try {
            return parseWhat(v);
          } catch (err) {
            throw new InvalidArgumentError((err as Error).message);
          }
        })
        .default([...FEATURES], "each"),
    )
    .option(
      "--poll-ms <n>",
      "the dashboard poller's interval (the page's default)",
      positiveInt("--poll-ms"),
      1000,
    )
    .option("--scrape-ms <n>", "every arm's /metrics scrape interval", positiveInt("--scrape-ms"), 1000)
    .option(
      "--settle-ms <n>",
      `wait after each arm's requests, counted to its CPU (default with a traced arm: the spans' export delay, 5 s or OTEL_BSP_SCHEDULE_DELAY, + 1.5 s; else ${UNTRACED_SETTLE_MS})`,
      (v) => (v === "0" ? 0 : positiveInt("--settle-ms")(v)),
    );
  return armLoadOptions(cmd, { rounds: 10, warmup: 1, requests: 64, promptChars: 200 }).action(
    (o: CliOptions) =>
      runBenchCli(
        "observability",
        o.json,
        (log) => runObservabilityBench({ ...o, log }),
        formatObservabilityReport,
      ),
  );
}
