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
 * `--concurrency` in flight) from the one tenant through each server, the two arms in alternating
 * order, and measures output tokens per second of wall time. Reported: each arm's median with its
 * quartiles and range, and the fair/fifo throughput ratio as the geometric mean of the per-round
 * paired ratios with a 95% confidence interval. Both arms must give the same answers.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import os from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { Command, Option } from "commander";
import { bundledModelDir } from "../../lib/package-root.js";
import { pairedRatio, type RatioInterval, type Summary, summarize } from "../../lib/stats.js";
import { stopProcess } from "../../topology/local-cluster.js";
import { prompt, round } from "./cluster.js";
import { positiveInt } from "./transfer.js";

export type FairBenchTopology = "single" | "threads" | "cluster";

export interface FairBenchOptions {
  readonly topology?: FairBenchTopology;
  /** A kvfence checkout (built) whose `kvfence serve` is the fifo arm; absent: this build uncapped. */
  readonly baseline?: string;
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
  readonly outputTokens: number;
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
  /** Throughput of fair over fifo, paired by round. */
  readonly fairOverFifo: RatioInterval;
  readonly failures: readonly string[];
  readonly load: { readonly start: number; readonly end: number; readonly cpus: number };
}

const THIS_MAIN = fileURLToPath(new URL("../../cli/main.js", import.meta.url));
const KEY = "sk-bench-tenant-alone-1";
const UNCAPPED = ["--tenant-max-concurrency", "0", "--tenant-max-pages", "0", "--tenant-max-queue", "0"];

export interface Server {
  readonly url: string;
  close(): Promise<void>;
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

/** A server of `topology` from the build whose CLI is `main`, with `routerArgs` on its front door. */
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
      return { url: s.url, close: async () => void (await Promise.all(children.map(stopProcess))) };
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
    return { url: r.url, close: async () => void (await Promise.all(children.reverse().map(stopProcess))) };
  } catch (err) {
    await Promise.all(children.map(stopProcess));
    throw err;
  }
}

/** The options given, with defaults for the rest. */
function settingsOf(options: FairBenchOptions) {
  return {
    topology: options.topology ?? "threads",
    rounds: options.rounds ?? 10,
    warmup: options.warmup ?? 1,
    requests: options.requests ?? 32,
    concurrency: options.concurrency ?? 16,
    maxTokens: options.maxTokens ?? 64,
    // With two tenants the default per-tenant caps apply; only the first one sends.
    tenants: options.tenants ?? 2,
    common: ["--model", options.model ?? bundledModelDir(), "--kv-pages", String(options.kvPages ?? 600)],
    baselineMain: options.baseline === undefined ? null : join(options.baseline, "dist/src/cli/main.js"),
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
  readonly ns = { fair: [] as number[], fifo: [] as number[] };
  readonly outputTokens = { fair: 0, fifo: 0 };
  #reference: string[] | null = null;

  /** One arm's round `r` (negative: a warm-up round, checked but not counted). */
  add(arm: ArmName, r: number, result: Awaited<ReturnType<typeof round>>): void {
    const reference = this.#reference;
    if (reference === null) this.#reference = result.texts;
    else if (result.texts.some((t, i) => t !== reference[i]) && this.failures.length < 5) {
      this.failures.push(`${arm} round ${r + 1}: answers differ from the first round's (greedy decoding)`);
    }
    if (r < 0) return;
    this.ns[arm].push(result.ns);
    this.tps[arm].push(result.tokens / (result.ns / 1e9));
    this.outputTokens[arm] += result.tokens;
  }
}

/** The warm-up and measured rounds, the two arms in alternating order. */
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
      tally.add(arm, r, await round(target, prompts, concurrency));
    }
    if (r >= 0) {
      log(
        `round ${r + 1}/${rounds}: fair ${tally.tps.fair.at(-1)!.toFixed(0)} tok/s, fifo ${tally.tps.fifo.at(-1)!.toFixed(0)} tok/s`,
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
    fair: "fair (this build)",
    fifo: baselineMain === null ? "fifo (this build, caps off)" : `fifo (${options.baseline})`,
  };
  let tally: Tally;
  try {
    settings.log(`starting two ${topology} servers: ${labels.fair} and ${labels.fifo}`);
    const fair = await startArm(THIS_MAIN, topology, common, ["--api-keys", keys]);
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
    fairOverFifo: pairedRatio(tally.ns.fifo, tally.ns.fair),
    failures: tally.failures,
    load: { start: loadStart, end: os.loadavg()[0]!, cpus: os.cpus().length },
  };
}

/** The human-readable report of a run. */
export function formatFairShareReport(r: FairBenchResult): string {
  const pct = (x: number): string => `${(x * 100).toFixed(1)}%`;
  const arm = (a: FairArm): string => {
    const t = a.tokensPerSecond;
    return `${a.label.padEnd(34)} ${t.median.toFixed(0).padStart(6)} tok/s  quartiles ${t.p25.toFixed(0)}–${t.p75.toFixed(0)}  range ${t.min.toFixed(0)}–${t.max.toFixed(0)}  ${a.outputTokens} output tokens`;
  };
  const t = r.fairOverFifo;
  const verdict = Number.isNaN(t.low)
    ? "too few rounds for a CI"
    : t.low >= 0.98
      ? "within 2% (CI low end ≥ 98%)"
      : t.high < 0.98
        ? "NOT within 2% (CI high end < 98%)"
        : "undecided: the CI straddles 98% (more rounds, a quieter machine)";
  return [
    `kvfence ${r.topology}, one tenant sending of ${r.tenants} in the keys file${r.tenants === 2 ? " (default caps: half the server each)" : " (no cap)"}, fair sharing vs first-come: ${r.rounds} interleaved rounds of ${r.requests} chat requests (${r.concurrency} in flight, max_tokens ${r.maxTokens}, greedy)`,
    `machine: ${r.load.cpus} CPUs, 1-min load average ${r.load.start.toFixed(1)} at start, ${r.load.end.toFixed(1)} at end`,
    arm(r.fair),
    arm(r.fifo),
    `fair throughput / fifo: ${pct(t.ratio)} [95% CI ${pct(t.low)}–${pct(t.high)}]: ${verdict}`,
    ...(r.failures.length > 0 ? [`FAILURES: ${r.failures.join("; ")}`] : []),
  ].join("\n");
}

interface FairCliOptions {
  topology: FairBenchTopology;
  tenants: "1" | "2";
  baseline?: string;
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

/** `kvfence bench fair-share`. */
export function fairShareCommand(): Command {
  return new Command("fair-share")
    .description(
      "Chat throughput of one tenant alone with fair sharing vs first-come (an older build, or this one with the caps off): interleaved rounds, 95% CI of the ratio",
    )
    .addOption(
      new Option("--topology <kind>", "single (--no-disaggregation), threads (the default serve) or cluster")
        .choices(["single", "threads", "cluster"])
        .default("threads"),
    )
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
    .option("--model <dir>", "Hugging Face model folder (default: bundled kvfence-tiny)")
    .option("--kv-pages <n>", "KV pool of each engine or node in pages", positiveInt("--kv-pages"), 600)
    .option("--rounds <n>", "measured rounds (each runs both arms)", positiveInt("--rounds"), 10)
    .option("--warmup <n>", "warm-up rounds", (v) => (v === "0" ? 0 : positiveInt("--warmup")(v)), 1)
    .option("--requests <n>", "chat requests per arm per round", positiveInt("--requests"), 32)
    .option("--concurrency <n>", "requests in flight", positiveInt("--concurrency"), 16)
    .option("--max-tokens <n>", "max_tokens of each request", positiveInt("--max-tokens"), 64)
    .option("--prompt-chars <n>", "characters per prompt", positiveInt("--prompt-chars"), 400)
    .option("--json", "print the result as JSON")
    .action(async (o: FairCliOptions) => {
      try {
        const result = await runFairShareBench({
          topology: o.topology,
          tenants: o.tenants === "1" ? 1 : 2,
          ...(o.baseline === undefined ? {} : { baseline: o.baseline }),
          ...(o.model === undefined ? {} : { model: o.model }),
          kvPages: o.kvPages,
          rounds: o.rounds,
          warmup: o.warmup,
          requests: o.requests,
          concurrency: o.concurrency,
          maxTokens: o.maxTokens,
          promptChars: o.promptChars,
          log: o.json === true ? () => {} : (line) => process.stderr.write(`${line}\n`),
        });
        process.stdout.write(
          `${o.json === true ? JSON.stringify(result, null, 2) : formatFairShareReport(result)}\n`,
        );
        if (result.failures.length > 0) process.exitCode = 1;
      } catch (err) {
        process.stderr.write(
          `kvfence bench fair-share: ${err instanceof Error ? err.message : String(err)}\n`,
        );
        process.exitCode = 1;
      }
    });
}
