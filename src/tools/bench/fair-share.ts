/**
 * `kvfence bench fair-share`: what fair sharing costs one tenant that runs alone (issue #22: within
 * 2% of first-come-first-served). Starts servers of one topology (`--topology single`, `threads` —
 * the default `kvfence serve` — or `cluster`: router, prefill and decode processes), each with an
 * API keys file of `--tenants` tenants (default 2: the per-tenant default caps are on, half the
 * server each; 1: no cap, what the fair queue itself costs). The arm `fair` is this build with its
 * defaults; `--compare` names the arms it is measured against:
 *
 * - `policy`: this build with `--scheduling-policy fcfs` (one queue in arrival order across
 *   tenants): fair queuing's own cost, every other line of code the same;
 * - `baseline`: the build at `--baseline DIR` (a checkout of an older kvfence, built: e.g. db989fb,
 *   the commit before fair sharing, whose queue was first-come);
 * - `caps`: this build with every per-tenant cap off (`--tenant-max-concurrency 0
 *   --tenant-max-pages 0 --tenant-max-queue 0`).
 *
 * Default: `baseline` with `--baseline`, else `caps`. `--fair-args` go to every arm of this build.
 *
 * Each round drives the same batch of chat requests (greedy, fixed prompts and `max_tokens`,
 * `--concurrency` in flight) from the one tenant through each server, the arms back to back, two
 * arms alternating (ABBA) and three rotating (ABC, BCA, CAB): a drift of the machine's load falls
 * on all alike, and measures two things per arm and round: output tokens per second of wall time,
 * and output tokens per CPU second of the arm's server processes (all their threads, from
 * /proc/PID/stat). The first is the throughput; the second is the work each token costs, which
 * another program's load on a shared machine disturbs far less (it takes our cores, not our
 * instructions) — a fair queue doing extra work per request or step shows there, and a cap leaving
 * the engine idle shows in the first. Reported: each arm's median with its quartiles and range, and
 * each fair/other ratio paired by round — the geometric mean with a 95% Student t interval on the
 * logs, and the median with a 95% bootstrap interval (robust to a round a burst of load hit). All
 * arms must give the same answers. The JSON result (`--json`) keeps every round's measurements, so
 * runs split into chunks (the bench lock's 10 minutes) combine into one: `--combine a.json b.json`.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import os from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { Command, Option } from "commander";
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
import {
  type ArmLoadCliOptions,
  type ArmLoadOptions,
  armLoadOf,
  armLoadOptions,
  serveArgsOf,
} from "./arm-load.js";
import { runBenchCli } from "./bench-cli.js";
import { prompt, round } from "./cluster.js";
import { describeLoad, loadAverage, type MachineLoad, machineLoad } from "./machine-load.js";
import { cpuSeconds } from "./process-cpu.js";

export type FairBenchTopology = "single" | "threads" | "cluster";

/** What the fair arm is measured against (see the module header). */
export type FairCompare = "policy" | "baseline" | "caps";
export const FAIR_COMPARES: readonly FairCompare[] = ["policy", "baseline", "caps"];

/** A run: each engine's or node's pool 600 pages by default. */
export interface FairBenchOptions extends ArmLoadOptions {
  readonly topology?: FairBenchTopology;
  /** The arms beside `fair` (default: baseline with `baseline`, else caps). */
  readonly compare?: readonly FairCompare[];
  /** A kvfence checkout (built) whose `kvfence serve` is the `baseline` arm. */
  readonly baseline?: string;
  /**
   * Extra `kvfence serve` flags of this build's arms (every role), e.g. `--kv-cache-dtype f32
   * --prefix-cache off` to switch off what a `baseline` build lacks, so the ratio is the queue's.
   */
  readonly fairArgs?: readonly string[];
  /** Tenants in the keys file (only the first sends): 2 puts the default caps on, 1 leaves them off. */
  readonly tenants?: 1 | 2;
}

/** An arm's name: `fair`, or what it is compared with. */
export type ArmName = "fair" | FairCompare;

/** One arm's measured rounds, in round order: what `--combine` joins. */
export interface ArmRounds {
  /** Wall time of each round, ns. */
  readonly ns: number[];
  /** Output tokens of each round. */
  readonly tokens: number[];
  /** CPU seconds of the arm's server processes in each round (NaN without /proc). */
  readonly cpuSeconds: number[];
}

export interface FairArm {
  readonly name: ArmName;
  readonly label: string;
  readonly tokensPerSecond: Summary;
  /** Output tokens per CPU second of the arm's server processes (NaN without /proc). */
  readonly tokensPerCpuSecond: Summary;
  readonly outputTokens: number;
}

/** A fair/other ratio paired by round: geometric mean with its t interval, median with its bootstrap interval. */
export interface PairedFigure extends RatioInterval {
  readonly median: number;
  readonly medianInterval: Interval;
}

/** The fair arm against one other. */
export interface FairComparison {
  readonly against: FairCompare;
  /** Throughput (wall time) of fair over the other arm, paired by round. */
  readonly throughput: PairedFigure;
  /** Tokens per CPU second of the servers, fair over the other arm, paired by round. */
  readonly cpu: PairedFigure;
}

export interface FairBenchResult {
  readonly topology: FairBenchTopology;
  readonly tenants: 1 | 2;
  /** Measured rounds (over every chunk, when combined). */
  readonly rounds: number;
  readonly requests: number;
  readonly concurrency: number;
  readonly maxTokens: number;
  /** `fair` first, then the compared arms. */
  readonly arms: readonly FairArm[];
  readonly comparisons: readonly FairComparison[];
  /** Every measured round of each arm (the arms' order of `arms`). */
  readonly perRound: Readonly<Partial<Record<ArmName, ArmRounds>>>;
  readonly failures: readonly string[];
  /** The 1-minute load average at the start and end of the run (combined: of the first and the last). */
  readonly load: MachineLoad;
  /** Runs combined into this result (1 for a run). */
  readonly runs: number;
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

/** The paired fair/other ratio of per-round measurements `fair[i] / other[i]`. */
function paired(fair: readonly number[], other: readonly number[]): PairedFigure {
  const ratios = fair.map((f, i) => f / other[i]!);
  return {
    ...pairedRatio(fair, other),
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

/** A cluster arm's nodes: how many of each role, and the arguments only the nodes take. */
export interface ArmNodes {
  readonly prefill: number;
  readonly decode: number;
  /** Node `index` of `role`'s own arguments (in the one-process topologies: prefill node 0's). */
  readonly nodeArgs: (role: "prefill" | "decode", index: number) => readonly string[];
}

/**
 * A server of `topology` from the build whose CLI is `main`, with `routerArgs` on its front door
 * (also bench observability's and bench prefix-cache's). A cluster has one prefill and one decode
 * node process unless `nodes` says otherwise; `nodes.nodeArgs` go to the node processes (in the
 * one-process topologies, to the server).
 */
export async function startArm(
  main: string,
  topology: FairBenchTopology,
  common: readonly string[],
  routerArgs: readonly string[],
  nodes: ArmNodes = { prefill: 1, decode: 1, nodeArgs: () => [] },
): Promise<Server> {
  const children: ChildProcess[] = [];
  try {
    if (topology !== "cluster") {
      const s = await serve(
        main,
        [
          ...common,
          ...(topology === "single" ? ["--no-disaggregation"] : []),
          ...nodes.nodeArgs("prefill", 0),
          ...routerArgs,
        ],
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
    const roles: ["prefill" | "decode", number][] = [
      ...Array.from({ length: nodes.prefill }, (_, i): ["prefill", number] => ["prefill", i]),
      ...Array.from({ length: nodes.decode }, (_, i): ["decode", number] => ["decode", i]),
    ];
    const settled = await Promise.allSettled(
      roles.map(([role, i]) => serve(main, ["--role", role, ...common, ...nodes.nodeArgs(role, i)], env)),
    );
    for (const s of settled) if (s.status === "fulfilled") children.push(s.value.child);
    const failed = settled.find((s) => s.status === "rejected");
    if (failed !== undefined) throw failed.reason;
    const urls = settled.map((s) => (s as PromiseFulfilledResult<{ url: string }>).value.url);
    const r = await serve(
      main,
      [
        "--role",
        "router",
        ...common,
        ...routerArgs,
        "--prefill",
        ...urls.slice(0, nodes.prefill),
        "--decode",
        ...urls.slice(nodes.prefill),
      ],
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
  const compare = options.compare ?? [options.baseline === undefined ? "caps" : "baseline"];
  if (compare.length === 0) throw new Error("--compare: name at least one arm (policy, baseline, caps)");
  if (compare.includes("baseline") && options.baseline === undefined)
    throw new Error("--compare baseline needs --baseline DIR (a built kvfence checkout)");
  return {
    topology: options.topology ?? "threads",
    compare: [...new Set(compare)],
    rounds: options.rounds ?? 20,
    warmup: options.warmup ?? 2,
    requests: options.requests ?? 64,
    concurrency: options.concurrency ?? 16,
    maxTokens: options.maxTokens ?? 64,
    // With two tenants the default per-tenant caps apply; only the first one sends.
    tenants: options.tenants ?? 2,
    common: serveArgsOf(options, 600),
    baseline: options.baseline ?? null,
    fairArgs: options.fairArgs ?? [],
    promptChars: options.promptChars ?? 400,
    log: options.log ?? (() => {}),
  };
}

type Settings = ReturnType<typeof settingsOf>;

/** An arm's build, its flags for every role and for the front door only, and its label. */
function armOf(
  settings: Settings,
  name: ArmName,
): { main: string; args: readonly string[]; routerArgs: readonly string[]; label: string } {
  const extra = settings.fairArgs.length === 0 ? "" : `, ${settings.fairArgs.join(" ")}`;
  const ours = (routerArgs: readonly string[], label: string) => ({
    main: THIS_MAIN,
    args: settings.fairArgs,
    routerArgs,
    label: `${label} (this build${extra})`,
  });
  switch (name) {
    case "fair":
      return ours([], "fair");
    case "policy":
      return ours(["--scheduling-policy", "fcfs"], "fcfs");
    case "caps":
      return ours(UNCAPPED, "caps off");
    case "baseline":
      return {
        main: join(settings.baseline!, "dist/src/cli/main.js"),
        args: [],
        routerArgs: [],
        label: `first-come (${settings.baseline})`,
      };
  }
}

/** `rounds[arm]`, made empty when absent. */
function roundsOf(rounds: Partial<Record<ArmName, ArmRounds>>, arm: ArmName): ArmRounds {
  const found = rounds[arm] ?? { ns: [], tokens: [], cpuSeconds: [] };
  rounds[arm] = found;
  return found;
}

/** What the measured rounds found, per arm. */
class Tally {
  readonly failures: string[] = [];
  readonly rounds: Partial<Record<ArmName, ArmRounds>> = {};
  #reference: string[] | null = null;

  /** One arm's round `r` (negative: a warm-up round, checked but not counted). */
  add(arm: ArmName, r: number, result: Awaited<ReturnType<typeof round>>, cpu: number): void {
    const reference = this.#reference;
    if (reference === null) this.#reference = result.texts;
    else if (result.texts.some((t, i) => t !== reference[i]) && this.failures.length < 5) {
      this.failures.push(`${arm} round ${r + 1}: answers differ from the first round's (greedy decoding)`);
    }
    if (r < 0) return;
    const rounds = roundsOf(this.rounds, arm);
    rounds.ns.push(result.ns);
    rounds.tokens.push(result.tokens);
    rounds.cpuSeconds.push(cpu);
  }
}

const tokensPerSecond = (r: ArmRounds): number[] => r.tokens.map((t, i) => t / (r.ns[i]! / 1e9));
const tokensPerCpuSecond = (r: ArmRounds): number[] => r.tokens.map((t, i) => t / r.cpuSeconds[i]!);

/**
 * The arms' order in round `r`: two arms alternate (ABBA); three or more rotate (ABC, BCA, CAB),
 * so each arm takes each place equally often and no arm runs twice in a row — with ABC/CBA the
 * middle arm would always run between two others, and the end arms twice in a row every other
 * round (a server idle between its rounds collects its garbage then, one run back to back does not).
 */
export function orderOf<T>(names: readonly T[], r: number): T[] {
  const k = names.length;
  const i = ((r % (k === 2 ? 2 : k)) + k) % k;
  if (k === 2) return i === 0 ? [...names] : [...names].reverse();
  return [...names.slice(i), ...names.slice(0, i)];
}

/** The warm-up and measured rounds, the arms' order changing every round (`orderOf`). */
async function runRounds(
  settings: Settings,
  servers: ReadonlyMap<ArmName, Server>,
  prompts: readonly string[],
): Promise<Tally> {
  const { rounds, warmup, maxTokens, concurrency, log } = settings;
  const names = [...servers.keys()];
  const models = (await (
    await fetch(`${servers.get("fair")!.url}/v1/models`, { headers: { authorization: `Bearer ${KEY}` } })
  ).json()) as {
    data: { id: string }[];
  };
  const modelId = models.data[0]!.id;
  const tally = new Tally();
  for (let r = -warmup; r < rounds; r++) {
    const order = orderOf(names, r);
    for (const arm of order) {
      const server = servers.get(arm)!;
      const target = { url: server.url, model: modelId, maxTokens, apiKey: KEY };
      const cpu0 = cpuSeconds(server.pids);
      const result = await round(target, prompts, concurrency);
      tally.add(arm, r, result, cpuSeconds(server.pids) - cpu0);
    }
    if (r >= 0) {
      const last = (xs: number[]): string => xs.at(-1)!.toFixed(0);
      const parts = names.map((n) => {
        const a = tally.rounds[n]!;
        return `${n} ${last(tokensPerSecond(a))} tok/s (${last(tokensPerCpuSecond(a))} per CPU s)`;
      });
      log(`round ${r + 1}/${rounds}: ${parts.join(", ")}`);
    }
  }
  return tally;
}

/** The result of measured rounds: each arm's summaries and the fair arm against each other arm. */
function resultOf(
  meta: Pick<
    FairBenchResult,
    "topology" | "tenants" | "requests" | "concurrency" | "maxTokens" | "load" | "runs"
  >,
  labels: ReadonlyMap<ArmName, string>,
  perRound: Partial<Record<ArmName, ArmRounds>>,
  failures: readonly string[],
): FairBenchResult {
  const names = [...labels.keys()];
  const fair = perRound.fair!;
  return {
    ...meta,
    rounds: fair.ns.length,
    arms: names.map((name) => {
      const r = perRound[name]!;
      return {
        name,
        label: labels.get(name)!,
        tokensPerSecond: summarize(tokensPerSecond(r)),
        tokensPerCpuSecond: summarize(tokensPerCpuSecond(r)),
        outputTokens: r.tokens.reduce((a, b) => a + b, 0),
      };
    }),
    comparisons: names
      .filter((n): n is FairCompare => n !== "fair")
      .map((against) => ({
        against,
        throughput: paired(tokensPerSecond(fair), tokensPerSecond(perRound[against]!)),
        cpu: paired(tokensPerCpuSecond(fair), tokensPerCpuSecond(perRound[against]!)),
      })),
    perRound,
    failures,
  };
}

export async function runFairShareBench(options: FairBenchOptions = {}): Promise<FairBenchResult> {
  const settings = settingsOf(options);
  const { topology, requests, concurrency, maxTokens, tenants, common } = settings;
  const loadStart = loadAverage();
  const dir = mkdtempSync(join(os.tmpdir(), "kvfence-bench-keys-"));
  const keys = join(dir, "keys.json");
  writeFileSync(
    keys,
    JSON.stringify(tenants === 2 ? { [KEY]: "alone", "sk-bench-tenant-idle-2": "idle" } : { [KEY]: "alone" }),
  );
  const prompts = Array.from({ length: requests }, (_, i) => prompt(i, settings.promptChars));
  const names: ArmName[] = ["fair", ...settings.compare];
  const arms = new Map(names.map((n) => [n, armOf(settings, n)] as const));
  const labels = new Map(names.map((n) => [n, arms.get(n)!.label] as const));
  const servers = new Map<ArmName, Server>();
  let tally: Tally;
  try {
    settings.log(`starting ${names.length} ${topology} servers: ${[...labels.values()].join("; ")}`);
    for (const [name, arm] of arms) {
      servers.set(
        name,
        await startArm(arm.main, topology, [...common, ...arm.args], ["--api-keys", keys, ...arm.routerArgs]),
      );
    }
    tally = await runRounds(settings, servers, prompts);
  } finally {
    await Promise.all([...servers.values()].map((s) => s.close()));
    rmSync(dir, { recursive: true, force: true });
  }
  return resultOf(
    {
      topology,
      tenants,
      requests,
      concurrency,
      maxTokens,
      load: machineLoad(loadStart),
      runs: 1,
    },
    labels,
    tally.rounds,
    tally.failures,
  );
}

/**
 * Several runs' JSON results (`--json`) as one: their rounds joined arm by arm and the figures
 * computed over all of them. The runs must have measured the same arms with the same load.
 */
export function combineFairShareResults(results: readonly FairBenchResult[]): FairBenchResult {
  const first = results[0];
  if (first === undefined) throw new Error("--combine: no results given");
  const key = (r: FairBenchResult): string =>
    JSON.stringify([
      r.topology,
      r.tenants,
      r.requests,
      r.concurrency,
      r.maxTokens,
      r.arms.map((a) => a.label),
    ]);
  const perRound: Partial<Record<ArmName, ArmRounds>> = {};
  for (const r of results) {
    if (key(r) !== key(first))
      throw new Error(
        `--combine: the runs differ (topology, tenants, load or arms): ${key(r)} against ${key(first)}`,
      );
    for (const arm of r.arms) {
      const from = r.perRound[arm.name];
      if (from === undefined)
        throw new Error(`--combine: a result without its per-round figures (${arm.name})`);
      const to = roundsOf(perRound, arm.name);
      to.ns.push(...from.ns);
      to.tokens.push(...from.tokens);
      // JSON writes NaN as null.
      to.cpuSeconds.push(...from.cpuSeconds.map((c) => c ?? Number.NaN));
    }
  }
  return resultOf(
    {
      topology: first.topology,
      tenants: first.tenants,
      requests: first.requests,
      concurrency: first.concurrency,
      maxTokens: first.maxTokens,
      // At the start of the first run and the end of the last.
      load: { start: first.load.start, end: results.at(-1)!.load.end, cpus: first.load.cpus },
      runs: results.reduce((n, r) => n + r.runs, 0),
    },
    new Map(first.arms.map((a) => [a.name, a.label] as const)),
    perRound,
    results.flatMap((r) => r.failures),
  );
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
  const labelOf = (name: ArmName): string => r.arms.find((a) => a.name === name)!.label;
  return [
    `kvfence ${r.topology}, one tenant sending of ${r.tenants} in the keys file${r.tenants === 2 ? " (default caps: half the server each)" : " (no cap)"}: ${r.rounds} rounds of ${r.requests} chat requests per arm${r.runs > 1 ? ` (${r.runs} runs combined)` : ""}, the arms back to back, their order changing every round (${r.concurrency} in flight, max_tokens ${r.maxTokens}, greedy)`,
    `${describeLoad(r.load)}${r.load.start > 0.5 * r.load.cpus ? " (others are running: trust the per-CPU-second figure more, or rerun on a quiet machine)" : ""}`,
    ...r.arms.map(arm),
    ...r.comparisons.flatMap((c) => [
      `fair / ${labelOf(c.against)}, paired by round (the goal: fair at 98% or more):`,
      ...figure("  throughput (tokens per wall second)", c.throughput),
      ...figure("  work per token (tokens per CPU second of the servers)", c.cpu),
    ]),
    ...(r.failures.length > 0 ? [`FAILURES: ${r.failures.join("; ")}`] : []),
  ].join("\n");
}

interface FairCliOptions extends ArmLoadCliOptions {
  topology: FairBenchTopology;
  tenants: "1" | "2";
  compare?: string;
  baseline?: string;
  fairArgs?: string;
  combine?: string[];
  json?: boolean;
}

/** `--compare a,b`: each a known arm. */
function compareOf(text: string): FairCompare[] {
  const names = text.split(",").map((s) => s.trim());
  for (const n of names)
    if (!(FAIR_COMPARES as readonly string[]).includes(n))
      throw new Error(`--compare: ${JSON.stringify(n)} is not one of ${FAIR_COMPARES.join(", ")}`);
  return names as FairCompare[];
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

/** `kvfence bench fair-share`. */
export function fairShareCommand(): Command {
  const cmd = new Command("fair-share")
    .description(
      "Chat throughput of one tenant alone with fair sharing vs first-come (this build's fcfs policy, an older build, or this one with the caps off): interleaved rounds, 95% CI of each ratio",
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
      "--compare <arms>",
      "the arms fair is measured against, comma-separated: policy (this build, --scheduling-policy fcfs), baseline (the --baseline build), caps (this build, caps off); default baseline with --baseline, else caps",
    )
    .option(
      "--baseline <dir>",
      "a built kvfence checkout whose serve is the baseline arm (e.g. the commit before fair sharing)",
    )
    .option(
      "--fair-args <flags>",
      'extra serve flags of this build\'s arms, e.g. "--kv-cache-dtype f32 --prefix-cache off" (what the baseline lacks)',
    )
    .option(
      "--combine <files...>",
      "run nothing: report the rounds of these --json results (runs of the same arms and load) as one",
    );
  return armLoadOptions(cmd, {
    kvPages: 600,
    rounds: 20,
    warmup: 2,
    requests: 64,
    concurrency: 16,
    promptChars: 400,
  }).action((o: FairCliOptions) =>
    runBenchCli(
      "fair-share",
      o.json,
      async (log) =>
        o.combine !== undefined
          ? combineFairShareResults(
              o.combine.map((f) => JSON.parse(readFileSync(f, "utf8")) as FairBenchResult),
            )
          : runFairShareBench({
              topology: o.topology,
              tenants: o.tenants === "1" ? 1 : 2,
              ...(o.compare === undefined ? {} : { compare: compareOf(o.compare) }),
              ...(o.baseline === undefined ? {} : { baseline: o.baseline }),
              ...(o.fairArgs === undefined
                ? {}
                : { fairArgs: o.fairArgs.split(/\s+/).filter((a) => a !== "") }),
              ...armLoadOf(o),
              log,
            }),
      formatFairShareReport,
    ),
  );
}
