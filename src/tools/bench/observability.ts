/**
 * `kvfence bench observability`: what the per-phase histograms, the traces and the dashboard cost
 * (issue #18: histograms ≤ 0.5% of decode throughput; histograms, traces and dashboard together
 * ≤ 1% at the highest rate measured). Starts one server per arm, all of the same topology from
 * this build, up together for the whole run, and measures each feature alone and all together
 * against `off`:
 *
 * - `off`: `--no-phase-metrics`, no exporter, nobody polling the dashboard's JSON;
 * - `histograms`: the default flags (the per-phase histograms recorded, and rendered at each scrape);
 * - `traces`: `--no-phase-metrics --otlp-endpoint` to an OTLP/HTTP receiver inside this command
 *   (it counts the spans it is sent and drops them);
 * - `dashboard`: `--no-phase-metrics`, and `/kvfence/state` polled every `--poll-ms` (the page's
 *   default, 1 s);
 * - `all`: histograms, traces and the dashboard's polling together;
 * - `control` (only when asked for): a second server exactly as `off`, so control / off shows what
 *   the bench reads between two identical servers (an A/A check).
 *
 * Every arm's `/metrics` is scraped every `--scrape-ms`, as Prometheus would (the counters and
 * gauges are there in every arm; what the histograms add to a scrape is theirs). Scrapes and
 * polls run on the arm's own clock of loaded time (see `activeTimer`): a saturated server scraped
 * every second, however the load is shared out between the arms.
 *
 * The load comes in short bursts: one burst is the same half of `--requests` greedy chats (`--concurrency`
 * in flight: the server saturated, the highest rate it serves) sent to one arm. A round is each
 * arm's burst in a rotated order and then in the reverse order (ABBA for two arms), so a drift of
 * the machine within the round weighs on every arm alike; rounds follow each other with no pause.
 * At each round's edges every arm's server CPU (every thread, /proc/PID/stat) is read, so all of
 * an arm's CPU falls in some round, wherever it runs: the spans a burst made are built and
 * exported when a batch of 512 is full or 5 s later (src/lib/tracing.ts), during later bursts,
 * and still count to their own server. Measured per arm and round: output tokens per second of its bursts' wall time, and
 * its servers' CPU over the round per output token, the primary figure (throughput is also moved
 * by the other arms' deferred work running beside a burst; CPU per token is not). Reported: each
 * feature arm over `off` as the geometric mean of the per-round paired ratios with a 95%
 * confidence interval; every arm must give the same answers. `--json` keeps every round's raw
 * figures and each ratio's per-round logs, so `kvfence bench combine` pools the chunks of a long
 * measurement (src/tools/bench/combine.ts).
 */
import { randomBytes } from "node:crypto";
import { createServer, type Server as HttpServer } from "node:http";
import { fileURLToPath } from "node:url";
import { Command, InvalidArgumentError, Option } from "commander";
import { pairedRatio, type RatioInterval, type Summary, summarize } from "../../lib/stats.js";
import { type ArmLoadCliOptions, type ArmLoadOptions, armLoadOptions, serveArgsOf } from "./arm-load.js";
import { positiveInt, runBenchCli } from "./bench-cli.js";
import { prompt, round } from "./cluster.js";
import { type FairBenchTopology, type Server, startArm, topologyOption } from "./fair-share.js";
import { describeLoad, loadAverage, type MachineLoad, machineLoad } from "./machine-load.js";
import { cpuSeconds } from "./process-cpu.js";

/** A feature arm (each is compared with `off`). */
export type ObservabilityFeature = "control" | "histograms" | "traces" | "dashboard" | "all";
/** What `each` measures: every feature alone and all together. */
export const FEATURES: readonly ObservabilityFeature[] = ["histograms", "traces", "dashboard", "all"];
/** Every arm `--what` names, in the order they are reported: `control` is a second `off` (an A/A check). */
const WHAT: readonly ObservabilityFeature[] = ["control", ...FEATURES];
type Arm = "off" | ObservabilityFeature;

/** What each arm switches on. */
const ARM: Readonly<Record<Arm, { histograms: boolean; traces: boolean; dashboard: boolean }>> = {
  off: { histograms: false, traces: false, dashboard: false },
  control: { histograms: false, traces: false, dashboard: false },
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
 * A run: each round is every arm's burst, then again in the reverse order, so `requests` (per arm
 * per round) must be even: two bursts of half as many.
 */
export interface ObservabilityBenchOptions extends ArmLoadOptions {
  readonly topology?: FairBenchTopology;
  /** The feature arms to measure against `off` (default: each alone and all together). */
  readonly what?: readonly ObservabilityFeature[];
  /** How often the dashboard poller reads /kvfence/state (ms of the arm's loaded time). */
  readonly pollMs?: number;
  /** How often every arm's /metrics is scraped (ms of the arm's loaded time). */
  readonly scrapeMs?: number;
}

/** One arm's figures in one round: its bursts' wall time and output tokens, its servers' CPU over the round. */
export interface RoundSample {
  readonly ns: number;
  readonly tokens: number;
  /** CPU seconds of the arm's server processes over the whole round (NaN without /proc). */
  readonly cpuSeconds: number;
}

/** What an arm's observers saw (proof they ran). */
export interface Observed {
  readonly spans: number;
  readonly statePolls: number;
  readonly scrapes: number;
}

export interface ArmResult {
  readonly tokensPerSecond: Summary;
  readonly outputTokens: number;
  /** Server CPU milliseconds per output token, per round (null without /proc). */
  readonly cpuMsPerToken: Summary | null;
  readonly observed: Observed;
}

export interface FeatureRatio {
  /** Throughput of the feature arm over off, paired by round. */
  readonly throughput: RatioInterval;
  /** Server CPU time per output token, feature arm over off, paired by round (null without /proc). */
  readonly cpuPerToken: RatioInterval | null;
}

/** The settings a run's rounds share. */
export interface ObservabilitySetup {
  readonly topology: FairBenchTopology;
  readonly what: readonly ObservabilityFeature[];
  readonly requests: number;
  readonly concurrency: number;
  readonly maxTokens: number;
  readonly promptChars: number;
  readonly pollMs: number;
  readonly scrapeMs: number;
}

/** A run's raw figures: every arm's rounds (index-aligned), what it observed, its failures and load. */
export interface ObservabilityRun extends ObservabilitySetup {
  readonly rounds: Readonly<Partial<Record<Arm, readonly RoundSample[]>>>;
  readonly observed: Readonly<Partial<Record<Arm, Observed>>>;
  readonly failures: readonly string[];
  readonly load: MachineLoad;
}

export interface ObservabilityBenchResult extends ObservabilityRun {
  /** Rounds measured (per arm). */
  readonly n: number;
  readonly arms: Readonly<Partial<Record<Arm, ArmResult>>>;
  readonly ratios: Readonly<Partial<Record<ObservabilityFeature, FeatureRatio>>>;
}

const THIS_MAIN = fileURLToPath(new URL("../../cli/main.js", import.meta.url));

/** An OTLP/HTTP receiver that counts the spans posted to it (JSON) and keeps nothing. */
export async function spanSink(): Promise<{ url: string; spans: () => number; close(): Promise<void> }> {
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

/**
 * A timer that runs `fn` every `intervalMs` of the time it is resumed: paused, it keeps what was
 * left of the interval, so an arm loaded in bursts is scraped and polled as often per second of
 * load as a server loaded all the time.
 */
export function activeTimer(
  intervalMs: number,
  fn: () => void,
  clock: () => number = () => performance.now(),
): { resume(): void; pause(): void } {
  let left = intervalMs;
  let armedAt = 0;
  let timer: ReturnType<typeof setTimeout> | null = null;
  const arm = (): void => {
    armedAt = clock();
    timer = setTimeout(() => {
      left = intervalMs;
      fn();
      arm();
    }, left);
  };
  return {
    resume() {
      if (timer === null) arm();
    },
    pause() {
      if (timer === null) return;
      clearTimeout(timer);
      timer = null;
      left = Math.max(0, left - (clock() - armedAt));
    },
  };
}

/** The scrapes of /metrics (and polls of /kvfence/state when `dashboard`) of one arm, counting what they read. */
function observers(
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
      // The server is stopping.
    }
  };
  const timers = [activeTimer(s.scrapeMs, () => void get("/metrics", "scrapes"))];
  if (dashboard) timers.push(activeTimer(s.pollMs, () => void get("/kvfence/state", "statePolls")));
  return {
    resume: () => {
      for (const t of timers) t.resume();
    },
    pause: () => {
      for (const t of timers) t.pause();
    },
  };
}

/**
 * The bursts of round `r`: off and the features rotated by `r` places, then the same in reverse
 * (for two arms ABBA, then BAAB), so each arm takes each place equally often and a linear drift
 * within a round weighs on every arm alike.
 */
export function burstOrder(features: readonly ObservabilityFeature[], r: number): Arm[] {
  const arms: Arm[] = ["off", ...features];
  const k = ((r % arms.length) + arms.length) % arms.length;
  const once = [...arms.slice(k), ...arms.slice(0, k)];
  return [...once, ...once.reverse()];
}

/** `--what`: a comma-separated list of features (`each`: every feature alone and all together). */
export function parseWhat(value: string): ObservabilityFeature[] {
  const out: ObservabilityFeature[] = [];
  for (const part of value.split(",").map((p) => p.trim())) {
    if (part === "each") out.push(...FEATURES);
    else if ((WHAT as readonly string[]).includes(part)) out.push(part as ObservabilityFeature);
    else
      throw new Error(
        `--what: "${part}" is not a feature; give a comma-separated list of ${WHAT.join(", ")}, or each`,
      );
  }
  return WHAT.filter((f) => out.includes(f));
}

function evenRequests(n: number): number {
  if (n % 2 !== 0)
    throw new Error(`--requests must be even (two bursts of half as many per arm a round): ${n}`);
  return n;
}

function settingsOf(options: ObservabilityBenchOptions) {
  return {
    setup: {
      topology: options.topology ?? "threads",
      what: options.what ?? FEATURES,
      requests: evenRequests(options.requests ?? 64),
      concurrency: options.concurrency ?? 16,
      maxTokens: options.maxTokens ?? 64,
      promptChars: options.promptChars ?? 200,
      pollMs: options.pollMs ?? 1000,
      scrapeMs: options.scrapeMs ?? 1000,
    } satisfies ObservabilitySetup,
    rounds: options.rounds ?? 60,
    warmup: options.warmup ?? 2,
    common: serveArgsOf(options, 600),
    log: options.log ?? (() => {}),
  };
}

type Settings = ReturnType<typeof settingsOf>;

interface Running {
  readonly arm: Arm;
  readonly server: Server;
  readonly sink: Awaited<ReturnType<typeof spanSink>> | null;
  readonly counts: { statePolls: number; scrapes: number };
  readonly observers: ReturnType<typeof observers>;
  readonly rounds: RoundSample[];
}

export async function runObservabilityBench(
  options: ObservabilityBenchOptions = {},
): Promise<ObservabilityBenchResult> {
  const s = settingsOf(options);
  const loadStart = loadAverage();
  const key = randomBytes(24).toString("hex");
  const arms: Arm[] = ["off", ...s.setup.what];
  const running: Running[] = [];
  const failures: string[] = [];
  try {
    s.log(`starting ${arms.length} ${s.setup.topology} servers: ${arms.join(", ")}`);
    // Started together, so none is systematically the first (its threads placed first).
    const started = await Promise.allSettled(arms.map((arm) => startOne(s, arm, key)));
    for (const r of started) if (r.status === "fulfilled") running.push(r.value);
    const failed = started.find((r) => r.status === "rejected");
    if (failed !== undefined) throw failed.reason;
    const model = await modelOf(running[0]!.server.url);
    await runRounds(s, running, model, failures);
  } finally {
    for (const a of running) a.observers.pause();
    await Promise.all(running.map(async (a) => Promise.all([a.server.close(), a.sink?.close()])));
  }
  const rounds: Partial<Record<Arm, RoundSample[]>> = {};
  const observed: Partial<Record<Arm, Observed>> = {};
  for (const a of running) {
    rounds[a.arm] = a.rounds;
    observed[a.arm] = { spans: a.sink?.spans() ?? 0, ...a.counts };
  }
  return analyse({
    ...s.setup,
    rounds,
    observed,
    failures,
    load: machineLoad(loadStart),
  });
}

/** The summaries and paired ratios of a run's rounds. */
export function analyse(run: ObservabilityRun): ObservabilityBenchResult {
  const off = run.rounds.off ?? [];
  const perToken = (r: readonly RoundSample[]) => r.map((x) => x.cpuSeconds / x.tokens);
  const withCpu = (r: readonly RoundSample[]) =>
    r.length > 0 && r.every((x) => Number.isFinite(x.cpuSeconds));
  const arms: Partial<Record<Arm, ArmResult>> = {};
  for (const [arm, r] of Object.entries(run.rounds) as [Arm, RoundSample[]][])
    arms[arm] = {
      tokensPerSecond: summarize(r.map((x) => x.tokens / (x.ns / 1e9))),
      outputTokens: r.reduce((sum, x) => sum + x.tokens, 0),
      cpuMsPerToken: withCpu(r) ? summarize(perToken(r).map((c) => c * 1000)) : null,
      observed: run.observed[arm] ?? { spans: 0, statePolls: 0, scrapes: 0 },
    };
  const ratios: Partial<Record<ObservabilityFeature, FeatureRatio>> = {};
  for (const f of run.what) {
    const a = run.rounds[f] ?? [];
    const tps = (r: readonly RoundSample[]) => r.map((x) => x.tokens / x.ns);
    ratios[f] = {
      throughput: pairedRatio(tps(a), tps(off)),
      cpuPerToken: withCpu(a) && withCpu(off) ? pairedRatio(perToken(a), perToken(off)) : null,
    };
  }
  return { ...run, n: off.length, arms, ratios };
}

async function startOne(s: Settings, arm: Arm, key: string): Promise<Running> {
  const on = ARM[arm];
  const sink = on.traces ? await spanSink() : null;
  const args = [...s.common];
  if (!on.histograms) args.push("--no-phase-metrics");
  if (sink !== null) args.push("--otlp-endpoint", sink.url);
  try {
    const server = await startArm(THIS_MAIN, s.setup.topology, args, ["--operator-key", key]);
    const counts = { statePolls: 0, scrapes: 0 };
    return {
      arm,
      server,
      sink,
      counts,
      observers: observers(server.url, key, on.dashboard, s.setup, counts),
      rounds: [],
    };
  } catch (err) {
    await sink?.close();
    throw err;
  }
}

/** The warm-up and measured rounds, back to back, every server's CPU read at each round's edges. */
async function runRounds(
  s: Settings,
  running: readonly Running[],
  model: string,
  failures: string[],
): Promise<void> {
  const prompts = Array.from({ length: s.setup.requests / 2 }, (_, i) => prompt(i, s.setup.promptChars));
  const byArm = new Map(running.map((a) => [a.arm, a]));
  let reference: string[] | null = null;
  let cpu0 = running.map((a) => cpuSeconds(a.server.pids));
  for (let r = -s.warmup; r < s.rounds; r++) {
    const burst = new Map(running.map((a) => [a.arm, { ns: 0, tokens: 0 }]));
    for (const arm of burstOrder(s.setup.what, r)) {
      const a = byArm.get(arm)!;
      a.observers.resume();
      let result: Awaited<ReturnType<typeof round>>;
      try {
        result = await round(
          { url: a.server.url, model, maxTokens: s.setup.maxTokens },
          prompts,
          s.setup.concurrency,
        );
      } finally {
        a.observers.pause();
      }
      const ref: string[] = reference ?? result.texts;
      reference = ref;
      if (result.texts.some((t, i) => t !== ref[i]) && failures.length < 5)
        failures.push(`${arm} round ${r + 1}: answers differ from the first round's (greedy decoding)`);
      const b = burst.get(arm)!;
      b.ns += result.ns;
      b.tokens += result.tokens;
    }
    const cpu1 = running.map((a) => cpuSeconds(a.server.pids));
    if (r >= 0)
      for (const [i, a] of running.entries())
        a.rounds.push({ ...burst.get(a.arm)!, cpuSeconds: cpu1[i]! - cpu0[i]! });
    cpu0 = cpu1;
    if (r < 0 && (r + 1) % 10 === 0) s.log(`warm-up: ${s.warmup + r + 1} of ${s.warmup} rounds`);
    if (r >= 0 && ((r + 1) % 10 === 0 || r + 1 === s.rounds))
      s.log(
        `round ${r + 1}/${s.rounds}: ${running
          .map((a) => {
            const x = a.rounds.at(-1)!;
            return `${a.arm} ${(x.tokens / (x.ns / 1e9)).toFixed(0)} tok/s ${((1000 * x.cpuSeconds) / x.tokens).toFixed(2)} CPU ms/token`;
          })
          .join(", ")}`,
      );
  }
}

async function modelOf(url: string): Promise<string> {
  const models = (await (await fetch(`${url}/v1/models`)).json()) as { data: { id: string }[] };
  return models.data[0]!.id;
}

const pct = (x: number): string => `${(x * 100).toFixed(1)}%`;
const pct2 = (x: number): string => `${(x * 100).toFixed(2)}%`;

/**
 * What an interval of a feature / off ratio says against a bound (the least fraction of off's
 * throughput allowed): of throughput as given, of CPU per token (`cpu`) against its inverse, the
 * most CPU per token allowed (1 / 0.99 = 101.0% for a 1% bound).
 */
export function verdict(t: RatioInterval, bound: number, cpu = false): string {
  if (Number.isNaN(t.low)) return "too few rounds for a CI";
  const limit = cpu ? 1 / bound : bound;
  const [within, beyond] = cpu ? [t.high <= limit, t.low > limit] : [t.low >= limit, t.high < limit];
  const [near, far] = cpu ? ["high", "low"] : ["low", "high"];
  if (within) return `costs at most ${pct(1 - bound)} (CI ${near} end ${cpu ? "≤" : "≥"} ${pct(limit)})`;
  if (beyond) return `costs MORE than ${pct(1 - bound)} (CI ${far} end ${cpu ? ">" : "<"} ${pct(limit)})`;
  return `undecided against ${pct(1 - bound)}: the CI straddles ${pct(limit)} (more rounds, a quieter machine)`;
}

const LABEL: Readonly<Record<Arm, string>> = {
  off: "off (--no-phase-metrics)",
  control: "control (a second off server)",
  histograms: "histograms (the default)",
  traces: "traces (--otlp-endpoint)",
  dashboard: "dashboard (/kvfence/state polled)",
  all: "all (histograms + traces + dashboard)",
};

/** The human-readable report of a run. */
export function formatObservabilityReport(r: ObservabilityBenchResult): string {
  const lines = [
    `kvfence ${r.topology}, observability features vs off: ${r.n} rounds, each a burst of ${r.requests / 2} chat requests per arm and the same in reverse order, back to back (${r.concurrency} in flight: saturated; max_tokens ${r.maxTokens}, greedy)`,
    `every arm's /metrics scraped every ${r.scrapeMs} ms of its loaded time; /kvfence/state polled every ${r.pollMs} ms in dashboard and all; CPU per token: the servers' CPU over each whole round`,
    describeLoad(r.load),
  ];
  for (const [arm, a] of Object.entries(r.arms) as [Arm, ArmResult][]) {
    const x = a.tokensPerSecond;
    const cpu = a.cpuMsPerToken === null ? "" : `  CPU ${a.cpuMsPerToken.median.toFixed(3)} ms/token`;
    const seen = ARM[arm].traces || ARM[arm].dashboard ? `  (${observed(a.observed)})` : "";
    lines.push(
      `${LABEL[arm].padEnd(40)} ${x.median.toFixed(0).padStart(6)} tok/s  quartiles ${x.p25.toFixed(0)}–${x.p75.toFixed(0)}  range ${x.min.toFixed(0)}–${x.max.toFixed(0)}${cpu}${seen}`,
    );
  }
  for (const f of r.what) {
    const ratio = r.ratios[f];
    if (ratio === undefined) continue;
    const bound = BOUND[f];
    if (ratio.cpuPerToken !== null) {
      const c = ratio.cpuPerToken;
      lines.push(
        `${f} / off: CPU per token ${pct2(c.ratio)} [95% CI ${pct2(c.low)}–${pct2(c.high)}]${bound === undefined ? "" : `: ${verdict(c, bound, true)}`}`,
      );
    }
    const t = ratio.throughput;
    lines.push(
      `${f} / off: throughput ${pct2(t.ratio)} [95% CI ${pct2(t.low)}–${pct2(t.high)}]${bound === undefined ? "" : `: ${verdict(t, bound)}`}`,
    );
  }
  if (r.failures.length > 0) lines.push(`FAILURES: ${r.failures.join("; ")}`);
  return lines.join("\n");
}

function observed(o: Observed): string {
  return `${o.spans} spans exported, ${o.statePolls} dashboard polls, ${o.scrapes} scrapes`;
}

interface CliOptions extends ArmLoadCliOptions {
  topology: FairBenchTopology;
  what: ObservabilityFeature[];
  pollMs: number;
  scrapeMs: number;
  json?: boolean;
}

/** `kvfence bench observability`. */
export function observabilityCommand(): Command {
  const cmd = new Command("observability")
    .description(
      "Server CPU per token and chat throughput with the per-phase histograms, the traces and the dashboard's polling each on, and all together, vs all off: every arm's server up at once, the load in short bursts in ABBA order, 95% CIs of the per-round ratios",
    )
    .addOption(topologyOption())
    .addOption(
      new Option(
        "--what <features>",
        "the arms measured against off, comma-separated: histograms, traces, dashboard, all (together), each (those four), control (a second off server: an A/A check of the bench)",
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
    .option("--scrape-ms <n>", "every arm's /metrics scrape interval", positiveInt("--scrape-ms"), 1000);
  return armLoadOptions(cmd, {
    kvPages: 600,
    rounds: 60,
    warmup: 2,
    requests: 64,
    concurrency: 16,
    promptChars: 200,
  }).action((o: CliOptions) =>
    runBenchCli(
      "observability",
      o.json,
      (log) => runObservabilityBench({ ...o, log }),
      formatObservabilityReport,
    ),
  );
}
