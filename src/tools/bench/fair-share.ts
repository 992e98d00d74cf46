/**
 * `kvfence bench fair-share`: what fair sharing costs one tenant that runs alone (issue #22: within
 * 2% of first-come-first-served). Starts two servers of the same topology (`--topology single`,
 * `threads` — the default `kvfence serve` — or `cluster`: router, prefill and decode processes),
 * each with an API keys file of `--tenants` tenants (default 2: the per-tenant default caps are on,
 * half the server each; 1: no cap, what the fair queue itself costs):
 *
 * - `fair`: this build, default flags;
 * - `fifo`: the build at `--baseline DIR` (a checkout of an older kvfence, built: its first-come
 *   queue), or without it this build with every per-tenant cap off (`--tenant-max-concurrency 0
 *   --tenant-max-pages 0 --tenant-max-queue 0`), where one tenant's fair queue is first-come.
 *
 * Each round drives the same batch of chat requests (greedy, fixed prompts and `max_tokens`,
 * `--concurrency` in flight) from the one tenant through each server, the two arms back to back in
 * alternating order (ABBA: a drift of the machine's load falls on both alike), and measures two
 * things per arm and round: output tokens per second of wall time, and output tokens per CPU
 * second of the arm's server processes (all their threads, from /proc/PID/stat). The first is the
 * throughput; the second is the work each token costs, which another program's load on a shared
 * machine disturbs far less (it takes our cores, not our instructions) — a fair queue doing extra
 * work per request or step shows there, and a cap leaving the engine idle shows in the first.
 * Reported: each arm's median with its quartiles and range, and each fair/fifo ratio paired by
 * round — the geometric mean with a 95% Student t interval on the logs, and the median with a 95%
 * bootstrap interval (robust to a round a burst of load hit). Both arms must give the same answers.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import os from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { Command, Option } from "commander";
import { bundledModelDir } from "../../lib/package-root.js";
import {
  bootstrapInterval,
  type Interval,
  median,
  pairedRatio,
  type RatioInterval,
  type Summary,
  summarize,
} from "../../lib/stats.js";
import { stopProcess } from "../../topology/local-cluster.js";
import { prompt, round } from "./cluster.js";
import { cpuSeconds } from "./process-cpu.js";
import { positiveInt, runBenchCli } from "./transfer.js";

export type FairBenchTopology = "single" | "threads" | "cluster";

export interface FairBenchOptions {
  readonly topology?: FairBenchTopology;
  /** A kvfence checkout (built) whose `kvfence serve` is the fifo arm; absent: this build uncapped. */
  readonly baseline?: string;
  /**
   * Extra `kvfence serve` flags of the fair arm only (every role), e.g. `--kv-cache-dtype f32
   * --prefix-cache off` to switch off what a `baseline` build lacks, so the ratio is the queue's.
   */
  readonly fairArgs?: readonly string[];
  /** Tenants in the keys file (only the first sends): 2 puts the default caps on, 1 leaves them off. */
  readonly tenants?: 1 | 2;
  readonly model?: string;
  /** KV pool of each engine or node in pages (default 600). */
  readonly kvPages?: number;
  readonly rounds?: number;
  readonly warmup?: number;
  readonly requests?: number;
  readonly concurrency?: number;
  readonly maxTokens?: number;
  readonly promptChars?: number;
  readonly log?: (line: string) => void;
}

export interface FairArm {
  readonly label: string;
  readonly tokensPerSecond: Summary;
  /** Output tokens per CPU second of the arm's server processes (NaN without /proc). */
  readonly tokensPerCpuSecond: Summary;
  readonly outputTokens: number;
}

/** A fair/fifo ratio paired by round: geometric mean with its t interval, median with its bootstrap interval. */
export interface PairedFigure extends RatioInterval {
  readonly median: number;
  readonly medianInterval: Interval;
}

export interface FairBenchResult {
  readonly topology: FairBenchTopology;
  readonly tenants: 1 | 2;
  readonly rounds: number;
  readonly requests: number;
  readonly concurrency: number;
  readonly maxTokens: number;
  readonly fair: FairArm;
  readonly fifo: FairArm;
  /** Throughput (wall time) of fair over fifo, paired by round. */
  readonly fairOverFifo: PairedFigure;
  /** Tokens per CPU second of the servers, fair over fifo, paired by round (NaN without /proc). */
  readonly cpuFairOverFifo: PairedFigure;
  readonly failures: readonly string[];
  readonly load: { readonly start: number; readonly end: number; readonly cpus: number };
}

const THIS_MAIN = fileURLToPath(new URL("../../cli/main.js", import.meta.url));
const KEY = "sk-bench-tenant-alone-1";
const UNCAPPED = ["--tenant-max-concurrency", "0", "--tenant-max-pages", "0", "--tenant-max-queue", "0"];

export interface Server {
  readonly url: string;
  /** The server's processes (router and nodes), for their CPU time. */
  readonly pids: readonly number[];
  close(): Promise<void>;
}

/** The paired fair/fifo ratio of per-round measurements `fair[i] / fifo[i]`. */
function paired(fair: readonly number[], fifo: readonly number[]): PairedFigure {
  const ratios = fair.map((f, i) => f / fifo[i]!);
  return {
    ...pairedRatio(fair, fifo),
    median: median(ratios),
    medianInterval: ratios.length < 2 ? { low: Number.NaN, high: Number.NaN } : bootstrapInterval(ratios),
  };
}

/** One `kvfence serve` process of `main`; resolves with the address it printed. */
function serve(
  main: string,
  args: readonly string[],
  env: NodeJS.ProcessEnv,
): Promise<{ url: string; child: ChildProcess }> {
  const child = spawn(
    process.execPath,
    [main, "serve", "--host", "127.0.0.1", "--port", "0", "--log-level", "warn", ...args],
    {
      env: { ...process.env, ...env },
      stdio: ["ignore", "pipe", "pipe"],
    },
  );
  let err = "";
  child.stderr!.on("data", (d: Buffer) => {
    err = (err + d.toString()).slice(-2000);
  });
  return new Promise((resolve, reject) => {
    let out = "";
    const onData = (d: Buffer): void => {
      out += d.toString();
      const m = /(?:listening at| at) (https?:\/\/\S+)/.exec(out);
      if (m === null) return;
      child.stdout!.off("data", onData);
      child.stdout!.resume();
      child.off("exit", onExit);
      resolve({ url: m[1]!, child });
    };
    const onExit = (code: number | null): void =>
      reject(new Error(`kvfence serve ${args.join(" ")} exited with ${code}:\n${err}`));
    child.stdout!.on("data", onData);
    child.on("exit", onExit);
  });
}

/** A server of `topology` from the build whose CLI is `main`, with `routerArgs` on its front door (also bench observability's). */
export async function startArm(
  main: string,
  topology: FairBenchTopology,
  common: readonly string[],
  routerArgs: readonly string[],
): Promise<Server> {
  const children: ChildProcess[] = [];
  try {
    if (topology !== "cluster") {
      const s = await serve(
        main,
        [...common, ...(topology === "single" ? ["--no-disaggregation"] : []), ...routerArgs],
        {},
      );
      children.push(s.child);
      return {
        url: s.url,
        pids: pidsOf(children),
        close: async () => void (await Promise.all(children.map(stopProcess))),
      };
    }
    const env = { KVFENCE_CLUSTER_SECRET: randomBytes(24).toString("hex") };
    const [p, d] = await Promise.all([
      serve(main, ["--role", "prefill", ...common], env),
      serve(main, ["--role", "decode", ...common], env),
    ]);
    children.push(p.child, d.child);
    const r = await serve(
      main,
      ["--role", "router", ...common, ...routerArgs, "--prefill", p.url, "--decode", d.url],
      env,
    );
    children.push(r.child);
    return {
      url: r.url,
      pids: pidsOf(children),
      close: async () => void (await Promise.all(children.reverse().map(stopProcess))),
    };
  } catch (err) {
    await Promise.all(children.map(stopProcess));
    throw err;
  }
}

function pidsOf(children: readonly ChildProcess[]): number[] {
  return children.flatMap((c) => (c.pid === undefined ? [] : [c.pid]));
}

/** The options given, with defaults for the rest. */
function settingsOf(options: FairBenchOptions) {
  return {
    topology: options.topology ?? "threads",
    rounds: options.rounds ?? 20,
    warmup: options.warmup ?? 2,
    requests: options.requests ?? 64,
    concurrency: options.concurrency ?? 16,
    maxTokens: options.maxTokens ?? 64,
    // With two tenants the default per-tenant caps apply; only the first one sends.
    tenants: options.tenants ?? 2,
    common: ["--model", options.model ?? bundledModelDir(), "--kv-pages", String(options.kvPages ?? 600)],
    baselineMain: options.baseline === undefined ? null : join(options.baseline, "dist/src/cli/main.js"),
    fairArgs: options.fairArgs ?? [],
    promptChars: options.promptChars ?? 400,
    log: options.log ?? (() => {}),
  };
}

type Settings = ReturnType<typeof settingsOf>;
type ArmName = "fair" | "fifo";

/** What the measured rounds found, per arm. */
class Tally {
  readonly failures: string[] = [];
  readonly tps = { fair: [] as number[], fifo: [] as number[] };
  readonly cpuTps = { fair: [] as number[], fifo: [] as number[] };
  readonly ns = { fair: [] as number[], fifo: [] as number[] };
  readonly outputTokens = { fair: 0, fifo: 0 };
  #reference: string[] | null = null;

  /** One arm's round `r` (negative: a warm-up round, checked but not counted). */
  add(arm: ArmName, r: number, result: Awaited<ReturnType<typeof round>>, cpu: number): void {
    const reference = this.#reference;
    if (reference === null) this.#reference = result.texts;
    else if (result.texts.some((t, i) => t !== reference[i]) && this.failures.length < 5) {
      this.failures.push(`${arm} round ${r + 1}: answers differ from the first round's (greedy decoding)`);
    }
    if (r < 0) return;
    this.ns[arm].push(result.ns);
    this.tps[arm].push(result.tokens / (result.ns / 1e9));
    this.cpuTps[arm].push(result.tokens / cpu);
    this.outputTokens[arm] += result.tokens;
  }
}

/** The warm-up and measured rounds, the two arms in alternating order (ABBA). */
async function runRounds(
  settings: Settings,
  servers: Record<ArmName, Server>,
  prompts: readonly string[],
): Promise<Tally> {
  const { rounds, warmup, maxTokens, concurrency, log } = settings;
  const models = (await (
    await fetch(`${servers.fair.url}/v1/models`, { headers: { authorization: `Bearer ${KEY}` } })
  ).json()) as {
    data: { id: string }[];
  };
  const modelId = models.data[0]!.id;
  const tally = new Tally();
  for (let r = -warmup; r < rounds; r++) {
    const order = ((r % 2) + 2) % 2 === 0 ? (["fair", "fifo"] as const) : (["fifo", "fair"] as const);
    for (const arm of order) {
      const target = { url: servers[arm].url, model: modelId, maxTokens, apiKey: KEY };
      const cpu0 = cpuSeconds(servers[arm].pids);
      const result = await round(target, prompts, concurrency);
      tally.add(arm, r, result, cpuSeconds(servers[arm].pids) - cpu0);
    }
    if (r >= 0) {
      const last = (xs: number[]): string => xs.at(-1)!.toFixed(0);
      log(
        `round ${r + 1}/${rounds}: fair ${last(tally.tps.fair)} tok/s (${last(tally.cpuTps.fair)} per CPU s), fifo ${last(tally.tps.fifo)} tok/s (${last(tally.cpuTps.fifo)} per CPU s)`,
      );
    }
  }
  return tally;
}

export async function runFairShareBench(options: FairBenchOptions = {}): Promise<FairBenchResult> {
  const settings = settingsOf(options);
  const { topology, rounds, requests, concurrency, maxTokens, tenants, common, baselineMain } = settings;
  const loadStart = os.loadavg()[0]!;
  const dir = mkdtempSync(join(os.tmpdir(), "kvfence-bench-keys-"));
  const keys = join(dir, "keys.json");
  writeFileSync(
    keys,
    JSON.stringify(tenants === 2 ? { [KEY]: "alone", "sk-bench-tenant-idle-2": "idle" } : { [KEY]: "alone" }),
  );
  const prompts = Array.from({ length: requests }, (_, i) => prompt(i, settings.promptChars));
  const servers: { fair?: Server; fifo?: Server } = {};
  const labels = {
    fair:
      settings.fairArgs.length === 0
        ? "fair (this build)"
        : `fair (this build, ${settings.fairArgs.join(" ")})`,
    fifo: baselineMain === null ? "fifo (this build, caps off)" : `fifo (${options.baseline})`,
  };
  let tally: Tally;
  try {
    settings.log(`starting two ${topology} servers: ${labels.fair} and ${labels.fifo}`);
    const fair = await startArm(THIS_MAIN, topology, [...common, ...settings.fairArgs], ["--api-keys", keys]);
    servers.fair = fair;
    servers.fifo = await startArm(baselineMain ?? THIS_MAIN, topology, common, [
      "--api-keys",
      keys,
      ...(baselineMain === null ? UNCAPPED : []),
    ]);
    tally = await runRounds(settings, { fair, fifo: servers.fifo }, prompts);
  } finally {
    await Promise.all([servers.fair?.close(), servers.fifo?.close()]);
    rmSync(dir, { recursive: true, force: true });
  }
  const arm = (name: ArmName): FairArm => ({
    label: labels[name],
    tokensPerSecond: summarize(tally.tps[name]),
    tokensPerCpuSecond: summarize(tally.cpuTps[name]),
    outputTokens: tally.outputTokens[name],
  });
  return {
    topology,
    tenants,
    rounds,
    requests,
    concurrency,
    maxTokens,
    fair: arm("fair"),
    fifo: arm("fifo"),
    // Throughput ratio = time ratio fifo / fair (the same tokens in both arms).
    fairOverFifo: paired(tally.ns.fifo, tally.ns.fair),
    cpuFairOverFifo: paired(tally.cpuTps.fair, tally.cpuTps.fifo),
    failures: tally.failures,
    load: { start: loadStart, end: os.loadavg()[0]!, cpus: os.cpus().length },
  };
}

/** Whether a paired ratio shows "within 2%": its interval's low end at 98% or more. */
function verdict(low: number, high: number): string {
  if (Number.isNaN(low)) return "too few rounds for an interval";
  if (low >= 0.98) return "within 2% (low end ≥ 98%)";
  if (high < 0.98) return "NOT within 2% (high end < 98%)";
  return "undecided: the interval straddles 98% (more rounds, a quieter machine)";
}

/** The human-readable report of a run. */
export function formatFairShareReport(r: FairBenchResult): string {
  const pct = (x: number): string => `${(x * 100).toFixed(1)}%`;
  const arm = (a: FairArm): string => {
    const t = a.tokensPerSecond;
    const c = a.tokensPerCpuSecond;
    return `${a.label.padEnd(34)} ${t.median.toFixed(0).padStart(6)} tok/s  quartiles ${t.p25.toFixed(0)}–${t.p75.toFixed(0)}  range ${t.min.toFixed(0)}–${t.max.toFixed(0)} | ${c.median.toFixed(0).padStart(6)} tok per CPU s  quartiles ${c.p25.toFixed(0)}–${c.p75.toFixed(0)} | ${a.outputTokens} output tokens`;
  };
  const figure = (name: string, f: PairedFigure): string[] => [
    `${name}: geometric mean ${pct(f.ratio)} [95% t CI ${pct(f.low)}–${pct(f.high)}]: ${verdict(f.low, f.high)}`,
    `${" ".repeat(name.length)}  median ${pct(f.median)} [95% bootstrap CI ${pct(f.medianInterval.low)}–${pct(f.medianInterval.high)}]: ${verdict(f.medianInterval.low, f.medianInterval.high)}`,
  ];
  return [
    `kvfence ${r.topology}, one tenant sending of ${r.tenants} in the keys file${r.tenants === 2 ? " (default caps: half the server each)" : " (no cap)"}, fair sharing vs first-come: ${r.rounds} rounds of ${r.requests} chat requests per arm, the arms back to back in ABBA order (${r.concurrency} in flight, max_tokens ${r.maxTokens}, greedy)`,
    `machine: ${r.load.cpus} CPUs, 1-min load average ${r.load.start.toFixed(1)} at start, ${r.load.end.toFixed(1)} at end${r.load.start > 0.5 * r.load.cpus ? " (others are running: trust the per-CPU-second figure more, or rerun on a quiet machine)" : ""}`,
    arm(r.fair),
    arm(r.fifo),
    "fair / fifo, paired by round (the goal: fair at 98% or more):",
    ...figure("  throughput (tokens per wall second)", r.fairOverFifo),
    ...figure("  work per token (tokens per CPU second of the servers)", r.cpuFairOverFifo),
    ...(r.failures.length > 0 ? [`FAILURES: ${r.failures.join("; ")}`] : []),
  ].join("\n");
}

interface FairCliOptions {
  topology: FairBenchTopology;
  tenants: "1" | "2";
  baseline?: string;
  fairArgs?: string;
  model?: string;
  kvPages: number;
  rounds: number;
  warmup: number;
  requests: number;
  concurrency: number;
  maxTokens: number;
  promptChars: number;
  json?: boolean;
}

/** `--topology` of a bench whose arms are servers (`startArm`). */
export function topologyOption(): Option {
  return new Option(
    "--topology <kind>",
    "single (--no-disaggregation), threads (the default serve) or cluster",
  )
    .choices(["single", "threads", "cluster"])
    .default("threads");
}

/**
 * The options of a bench that loads two server arms with the same chats (fair-share,
 * observability): the model and pool, rounds and warm-up, and each round's requests; `--json`.
 */
export function armLoadOptions(
  cmd: Command,
  defaults: { rounds: number; warmup: number; requests: number; promptChars: number },
): Command {
  return cmd
    .option("--model <dir>", "Hugging Face model folder (default: bundled kvfence-tiny)")
    .option("--kv-pages <n>", "KV pool of each engine or node in pages", positiveInt("--kv-pages"), 600)
    .option("--rounds <n>", "measured rounds (each runs both arms)", positiveInt("--rounds"), defaults.rounds)
    .option(
      "--warmup <n>",
      "warm-up rounds",
      (v) => (v === "0" ? 0 : positiveInt("--warmup")(v)),
      defaults.warmup,
    )
    .option("--requests <n>", "chat requests per arm per round", positiveInt("--requests"), defaults.requests)
    .option("--concurrency <n>", "requests in flight", positiveInt("--concurrency"), 16)
    .option("--max-tokens <n>", "max_tokens of each request", positiveInt("--max-tokens"), 64)
    .option(
      "--prompt-chars <n>",
      "characters per prompt",
      positiveInt("--prompt-chars"),
      defaults.promptChars,
    )
    .option("--json", "print the result as JSON");
}

/** `kvfence bench fair-share`. */
export function fairShareCommand(): Command {
  const cmd = new Command("fair-share")
    .description(
      "Chat throughput of one tenant alone with fair sharing vs first-come (an older build, or this one with the caps off): interleaved rounds, 95% CI of the ratio",
    )
    .addOption(topologyOption())
    .addOption(
      new Option(
        "--tenants <n>",
        "tenants in the keys file, only the first sends: 2 (the default caps on) or 1",
      )
        .choices(["1", "2"])
        .default("2"),
    )
    .option(
      "--baseline <dir>",
      "a built kvfence checkout whose serve is the fifo arm (e.g. the commit before fair sharing)",
    )
    .option(
      "--fair-args <flags>",
      'extra serve flags of the fair arm only, e.g. "--kv-cache-dtype f32 --prefix-cache off" (what the baseline lacks)',
    );
  return armLoadOptions(cmd, { rounds: 20, warmup: 2, requests: 64, promptChars: 400 }).action(
    (o: FairCliOptions) =>
      runBenchCli(
        "fair-share",
        o.json,
        (log) =>
          runFairShareBench({
            topology: o.topology,
            tenants: o.tenants === "1" ? 1 : 2,
            ...(o.baseline === undefined ? {} : { baseline: o.baseline }),
            ...(o.fairArgs === undefined
              ? {}
              : { fairArgs: o.fairArgs.split(/\s+/).filter((a) => a !== "") }),
            ...(o.model === undefined ? {} : { model: o.model }),
            kvPages: o.kvPages,
            rounds: o.rounds,
            warmup: o.warmup,
            requests: o.requests,
            concurrency: o.concurrency,
            maxTokens: o.maxTokens,
            promptChars: o.promptChars,
            log,
          }),
        formatFairShareReport,
      ),
  );
}
