/**
 * `kvfence bench observability`: what the per-phase histograms, the traces and the dashboard cost
 * (issue #18: histograms ≤ 0.5% of decode throughput; histograms, traces and dashboard together
 * ≤ 1% at the highest rate measured). Starts two servers of the same topology from this build:
 *
 * - `on`: the default flags (per-phase histograms recorded), and with `--what all` (the default)
 *   also `--otlp-endpoint` to an OTLP/HTTP receiver inside this command (it counts the spans it
 *   is sent and drops them), while this command polls `/kvfence/state` as the dashboard page does
 *   (every `--poll-ms`) and scrapes `/metrics` every second as Prometheus would;
 * - `off`: `--no-phase-metrics`, no exporter, nobody polling.
 *
 * Each round drives the same batch of greedy chat requests (`--concurrency` in flight: the server
 * saturated, the highest rate it serves) through each server, the two arms in alternating order,
 * and measures output tokens per second of wall time, most of it decode. Reported: each arm's
 * median with its quartiles, and the on/off throughput ratio as the geometric mean of the
 * per-round paired ratios with a 95% confidence interval; both arms must give the same answers.
 */
import { randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { createServer, type Server as HttpServer } from "node:http";
import os from "node:os";
import { fileURLToPath } from "node:url";
import { Command, Option } from "commander";
import { bundledModelDir } from "../../lib/package-root.js";
import { pairedRatio, type RatioInterval, type Summary, summarize } from "../../lib/stats.js";
import { prompt, round } from "./cluster.js";
import { armLoadOptions, type FairBenchTopology, type Server, startArm } from "./fair-share.js";
import { positiveInt } from "./transfer.js";

export type ObservabilityWhat = "histograms" | "all";

export interface ObservabilityBenchOptions {
  readonly topology?: FairBenchTopology;
  /** `histograms`: the on arm records histograms only; `all`: also traces and a dashboard poller. */
  readonly what?: ObservabilityWhat;
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
  readonly log?: (line: string) => void;
}

export interface ObservabilityBenchResult {
  readonly topology: FairBenchTopology;
  readonly what: ObservabilityWhat;
  readonly rounds: number;
  readonly requests: number;
  readonly concurrency: number;
  readonly maxTokens: number;
  readonly on: { readonly tokensPerSecond: Summary; readonly outputTokens: number };
  readonly off: { readonly tokensPerSecond: Summary; readonly outputTokens: number };
  /** Throughput of on over off, paired by round. */
  readonly onOverOff: RatioInterval;
  /**
   * The servers' CPU time per output token, on over off, paired by round (Linux /proc; null
   * elsewhere): what the observability costs in work, less moved by other jobs than wall time.
   */
  readonly cpuOnOverOff: RatioInterval | null;
  /** What the on arm's observers saw (proof they ran): spans received, state polls, scrapes. */
  readonly observed: { readonly spans: number; readonly statePolls: number; readonly scrapes: number };
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

/** Polls the dashboard's JSON and /metrics while the rounds run; counts what it read. */
function observers(url: string, key: string, pollMs: number) {
  const counts = { statePolls: 0, scrapes: 0 };
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
  const state = setInterval(() => void get("/kvfence/state", "statePolls"), pollMs);
  const scrape = setInterval(() => void get("/metrics", "scrapes"), 1000);
  return {
    counts,
    stop() {
      clearInterval(state);
      clearInterval(scrape);
    },
  };
}

function settingsOf(options: ObservabilityBenchOptions) {
  return {
    topology: options.topology ?? "threads",
    what: options.what ?? "all",
    rounds: options.rounds ?? 10,
    warmup: options.warmup ?? 1,
    requests: options.requests ?? 32,
    concurrency: options.concurrency ?? 16,
    maxTokens: options.maxTokens ?? 64,
    promptChars: options.promptChars ?? 200,
    pollMs: options.pollMs ?? 500,
    common: ["--model", options.model ?? bundledModelDir(), "--kv-pages", String(options.kvPages ?? 600)],
    log: options.log ?? (() => {}),
  };
}

type Arm = "on" | "off";

export async function runObservabilityBench(
  options: ObservabilityBenchOptions = {},
): Promise<ObservabilityBenchResult> {
  const s = settingsOf(options);
  const loadStart = os.loadavg()[0]!;
  const key = randomBytes(24).toString("hex");
  const operator = ["--operator-key", key];
  const sink = s.what === "all" ? await spanSink() : null;
  const servers: Partial<Record<Arm, Server>> = {};
  let watch: ReturnType<typeof observers> | null = null;
  const tally = newTally();
  const { tps, ns, outputTokens, cpuPerToken, failures } = tally;
  try {
    s.log(`starting two ${s.topology} servers: on (${s.what}) and off (--no-phase-metrics)`);
    const onArgs = sink === null ? s.common : [...s.common, "--otlp-endpoint", sink.url];
    // Started together, so neither is systematically the first (its threads placed first).
    const [on, off] = await Promise.allSettled([
      startArm(THIS_MAIN, s.topology, onArgs, operator),
      startArm(THIS_MAIN, s.topology, [...s.common, "--no-phase-metrics"], operator),
    ]);
    if (on.status === "fulfilled") servers.on = on.value;
    if (off.status === "fulfilled") servers.off = off.value;
    if (on.status === "rejected") throw on.reason;
    if (off.status === "rejected") throw off.reason;
    if (servers.on === undefined || servers.off === undefined) throw new Error("a server did not start");
    if (s.what === "all") watch = observers(servers.on.url, key, s.pollMs);
    const model = await modelOf(servers.on.url);
    await runRounds(s, servers as Record<Arm, Server>, model, tally);
    // The last spans leave in the exporters' next batch (every 500 ms).
    if (sink !== null) await new Promise((r) => setTimeout(r, 1500));
  } finally {
    watch?.stop();
    await Promise.all([servers.on?.close(), servers.off?.close()]);
    await sink?.close();
  }
  return {
    topology: s.topology,
    what: s.what,
    rounds: s.rounds,
    requests: s.requests,
    concurrency: s.concurrency,
    maxTokens: s.maxTokens,
    on: { tokensPerSecond: summarize(tps.on), outputTokens: outputTokens.on },
    off: { tokensPerSecond: summarize(tps.off), outputTokens: outputTokens.off },
    // Throughput ratio = time ratio off / on (the same tokens in both arms).
    onOverOff: pairedRatio(ns.off, ns.on),
    cpuOnOverOff:
      cpuPerToken.on.length === s.rounds && cpuPerToken.off.length === s.rounds
        ? pairedRatio(cpuPerToken.on, cpuPerToken.off)
        : null,
    observed: {
      spans: sink?.spans() ?? 0,
      statePolls: watch?.counts.statePolls ?? 0,
      scrapes: watch?.counts.scrapes ?? 0,
    },
    failures,
    load: { start: loadStart, end: os.loadavg()[0]!, cpus: os.cpus().length },
  };
}

function newTally() {
  return {
    tps: { on: [], off: [] } as Record<Arm, number[]>,
    ns: { on: [], off: [] } as Record<Arm, number[]>,
    outputTokens: { on: 0, off: 0 } as Record<Arm, number>,
    cpuPerToken: { on: [], off: [] } as Record<Arm, number[]>,
    failures: [] as string[],
  };
}

/** The warm-up and measured rounds, the two arms in alternating order. */
async function runRounds(
  s: ReturnType<typeof settingsOf>,
  servers: Record<Arm, Server>,
  model: string,
  tally: ReturnType<typeof newTally>,
): Promise<void> {
  const { tps, ns, outputTokens, cpuPerToken, failures } = tally;
  const prompts = Array.from({ length: s.requests }, (_, i) => prompt(i, s.promptChars));
  let reference: string[] | null = null;
  for (let r = -s.warmup; r < s.rounds; r++) {
    const order: readonly Arm[] = ((r % 2) + 2) % 2 === 0 ? ["on", "off"] : ["off", "on"];
    for (const arm of order) {
      const cpu0 = cpuSeconds(servers[arm].pids);
      const result = await round(
        { url: servers[arm].url, model, maxTokens: s.maxTokens },
        prompts,
        s.concurrency,
      );
      const cpu = cpuSeconds(servers[arm].pids) - cpu0;
      const ref: string[] = reference ?? result.texts;
      reference = ref;
      if (result.texts.some((t, i) => t !== ref[i]) && failures.length < 5)
        failures.push(`${arm} round ${r + 1}: answers differ from the first round's (greedy decoding)`);
      if (r < 0) continue;
      ns[arm].push(result.ns);
      tps[arm].push(result.tokens / (result.ns / 1e9));
      outputTokens[arm] += result.tokens;
      if (!Number.isNaN(cpu)) cpuPerToken[arm].push(cpu / result.tokens);
    }
    if (r >= 0)
      s.log(
        `round ${r + 1}/${s.rounds}: on ${tps.on.at(-1)!.toFixed(0)} tok/s, off ${tps.off.at(-1)!.toFixed(0)} tok/s`,
      );
  }
}

/** CPU seconds (user + system) the processes used so far, from /proc; NaN where that cannot be read. */
function cpuSeconds(pids: readonly number[]): number {
  let ticks = 0;
  try {
    for (const pid of pids) {
      // Fields after the command name (which may hold spaces): utime and stime are the 12th and 13th.
      const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
      const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
      ticks += Number(fields[11]) + Number(fields[12]);
    }
  } catch {
    return Number.NaN;
  }
  return ticks / CLOCK_TICKS;
}

/** Linux's USER_HZ: /proc reports CPU time in these ticks per second. */
const CLOCK_TICKS = 100;

async function modelOf(url: string): Promise<string> {
  const models = (await (await fetch(`${url}/v1/models`)).json()) as { data: { id: string }[] };
  return models.data[0]!.id;
}

/** The human-readable report of a run. */
export function formatObservabilityReport(r: ObservabilityBenchResult): string {
  const pct = (x: number): string => `${(x * 100).toFixed(1)}%`;
  const bound = r.what === "all" ? 0.99 : 0.995;
  const t = r.onOverOff;
  const verdict = Number.isNaN(t.low)
    ? "too few rounds for a CI"
    : t.low >= bound
      ? `costs at most ${pct(1 - bound)} (CI low end ≥ ${pct(bound)})`
      : t.high < bound
        ? `costs MORE than ${pct(1 - bound)} (CI high end < ${pct(bound)})`
        : `undecided against ${pct(1 - bound)}: the CI straddles ${pct(bound)} (more rounds, a quieter machine)`;
  const arm = (name: string, a: ObservabilityBenchResult["on"]): string => {
    const x = a.tokensPerSecond;
    return `${name.padEnd(40)} ${x.median.toFixed(0).padStart(6)} tok/s  quartiles ${x.p25.toFixed(0)}–${x.p75.toFixed(0)}  range ${x.min.toFixed(0)}–${x.max.toFixed(0)}  ${a.outputTokens} output tokens`;
  };
  const on = r.what === "all" ? `on (histograms + traces + dashboard poll)` : "on (per-phase histograms)";
  return [
    `kvfence ${r.topology}, observability on vs off: ${r.rounds} interleaved rounds of ${r.requests} chat requests (${r.concurrency} in flight, max_tokens ${r.maxTokens}, greedy)`,
    `machine: ${r.load.cpus} CPUs, 1-min load average ${r.load.start.toFixed(1)} at start, ${r.load.end.toFixed(1)} at end`,
    arm(on, r.on),
    arm("off (--no-phase-metrics)", r.off),
    ...(r.what === "all"
      ? [
          `on arm observed: ${r.observed.spans} spans exported, ${r.observed.statePolls} dashboard polls, ${r.observed.scrapes} /metrics scrapes`,
        ]
      : []),
    `on throughput / off: ${pct(t.ratio)} [95% CI ${pct(t.low)}–${pct(t.high)}]: ${verdict}`,
    ...(r.cpuOnOverOff === null
      ? []
      : [
          `servers' CPU time per output token, on / off: ${pct(r.cpuOnOverOff.ratio)} [95% CI ${pct(r.cpuOnOverOff.low)}–${pct(r.cpuOnOverOff.high)}]`,
        ]),
    ...(r.failures.length > 0 ? [`FAILURES: ${r.failures.join("; ")}`] : []),
  ].join("\n");
}

interface CliOptions {
  topology: FairBenchTopology;
  what: ObservabilityWhat;
  model?: string;
  kvPages: number;
  rounds: number;
  warmup: number;
  requests: number;
  concurrency: number;
  maxTokens: number;
  promptChars: number;
  pollMs: number;
  json?: boolean;
}

/** `kvfence bench observability`. */
export function observabilityCommand(): Command {
  const cmd = new Command("observability")
    .description(
      "Chat throughput with the per-phase histograms (and traces and the dashboard's polling) on vs off: interleaved rounds, 95% CI of the ratio",
    )
    .addOption(
      new Option("--topology <kind>", "single (--no-disaggregation), threads (the default serve) or cluster")
        .choices(["single", "threads", "cluster"])
        .default("threads"),
    )
    .addOption(
      new Option(
        "--what <arm>",
        "histograms: the on arm records histograms only; all: also exports spans and is polled like the dashboard",
      )
        .choices(["histograms", "all"])
        .default("all"),
    )
    .option("--poll-ms <n>", "the dashboard poller's interval", positiveInt("--poll-ms"), 500);
  return armLoadOptions(cmd, { rounds: 10, warmup: 1, requests: 32, promptChars: 200 }).action(
    async (o: CliOptions) => {
      try {
        const result = await runObservabilityBench({
          ...o,
          log: o.json === true ? () => {} : (line) => process.stderr.write(`${line}\n`),
        });
        process.stdout.write(
          `${o.json === true ? JSON.stringify(result, null, 2) : formatObservabilityReport(result)}\n`,
        );
        if (result.failures.length > 0) process.exitCode = 1;
      } catch (err) {
        process.stderr.write(
          `kvfence bench observability: ${err instanceof Error ? err.message : String(err)}\n`,
        );
        process.exitCode = 1;
      }
    },
  );
}
