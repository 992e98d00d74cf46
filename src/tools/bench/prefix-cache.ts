/**
 * `kvfence bench prefix-cache`: what the tenant-fenced prefix cache and its tiers buy multi-turn
 * chat (issues #16 and #35). Starts one server per arm, all of the same topology (`--topology
 * single`, `threads` — the default `kvfence serve` — or `cluster`, with `--prefill-nodes` and
 * `--decode-nodes` node processes), each with an API keys file of `--tenants` tenants:
 * - `off`: `--prefix-cache off`;
 * - `on` (also named `pool`): the cache in the KV pool only;
 * - `tiers`: the cache with its host-memory and disk tiers (`--tier-args`, by default
 *   `--cache-ram 64MiB --cache-disk <a temporary directory> --cache-disk-size 1GiB`).
 * Each round builds `bench serve`'s multi-turn dataset (src/tools/bench/serve-datasets.ts:
 * sessions of `--turns` turns, the first starting with a document of the session's own, each turn
 * resending the whole history with the answers the server gave) and runs it through each arm, the
 * arms' order rotating every round (interleaved). Turn by turn: every session's turn t, at most
 * `--concurrency` at once, before any session's turn t + 1 — so with more sessions than the pools
 * hold, a conversation's pages are evicted between its turns (the working set, printed against the
 * prefill pools, is what the tiers are for). Session s is tenant s mod T.
 *
 * Reported per arm: the mean time to first token of turns 2..N (and of turn 1), with its spread
 * over rounds, the prompt tokens it computed (`usage.prompt_tokens` minus
 * `usage.prompt_tokens_details.cached_tokens`) and, where the server exports them, the KV pages
 * its transfers sent to decode and those decode already held (`kvfence_transfer_pages_total`,
 * `kvfence_transfer_pages_reused_total`);
 * and each cached arm against `off`: the TTFT ratio as the geometric mean of the per-round ratios
 * with a 95% confidence interval. Greedy answers must be the same in every arm (a hit computes what
 * a miss does).
 */
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import os from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { Command } from "commander";
import { mean, pairedRatio, type RatioInterval, type Summary, summarize } from "../../lib/stats.js";
import { runPool } from "../probe/probe-run.js";
import { serveArgsOf } from "./arm-load.js";
import { positiveInt } from "./bench-cli.js";
import {
  type ArmNodes,
  type FairBenchTopology,
  orderOf,
  type Server,
  startArm,
  topologyOption,
} from "./fair-share.js";
import { describeLoad, loadAverage, type MachineLoad, machineLoad } from "./machine-load.js";
import { type RunContext, sendTurn } from "./serve.js";
import type { StreamOutcome } from "./serve-client.js";
import { buildDataset, type Dataset } from "./serve-datasets.js";

/** An arm: the cache off, in the pool only, or with its tiers. */
export type PrefixArmName = "off" | "on" | "tiers";

export interface PrefixBenchOptions {
  readonly topology?: FairBenchTopology;
  readonly model?: string;
  readonly kvPages?: number;
  /** Longest request the servers take (`--max-model-len`; default: the model's context). */
  readonly maxModelLen?: number;
  /** The decode nodes' KV pool in pages (`cluster` only; default: `kvPages`). */
  readonly decodeKvPages?: number;
  /** Node processes of each role (`cluster` only). */
  readonly prefillNodes?: number;
  readonly decodeNodes?: number;
  readonly arms?: readonly PrefixArmName[];
  /** The `tiers` arm's flags (a temporary `--cache-disk` directory by default). */
  readonly tierArgs?: readonly string[];
  readonly tenants?: number;
  /** Sessions per round. */
  readonly sessions?: number;
  /** Turns running at once (default: every session). */
  readonly concurrency?: number;
  readonly turns?: number;
  readonly rounds?: number;
  /** Tokens of the document each session's first turn starts with. */
  readonly documentLen?: number;
  /** Tokens of each new user turn, and each answer's max_tokens. */
  readonly inputLen?: number;
  readonly outputLen?: number;
  readonly seed?: number;
  readonly log?: (line: string) => void;
}

export interface PrefixArm {
  readonly name: PrefixArmName;
  readonly label: string;
  /** Mean TTFT (s) of turns 2..N over every round, and its spread over the rounds' means. */
  readonly laterTtft: number;
  readonly laterTtftRounds: Summary;
  /** Mean TTFT (s) of turn 1 over every round. */
  readonly firstTtft: number;
  /** Prompt tokens sent and computed (sent minus served from the cache), over every round. */
  readonly promptTokens: number;
  readonly computedTokens: number;
  /** KV pages the transfers sent to decode, and those decode already held (null: not exported). */
  readonly pagesSent: number | null;
  readonly pagesReused: number | null;
  /** Mean TTFT of turns 2..N against the `off` arm's, paired by round (null for `off` itself). */
  readonly ttftRatio: RatioInterval | null;
  /**
   * The `tiers` arm against the pool-only arm (`on`), paired by round, when both ran: mean TTFT of
   * turn 1 (no conversation to hit: what the tiers cost while they spill) and of turns 2..N.
   */
  readonly vsPool: { readonly first: RatioInterval; readonly later: RatioInterval } | null;
}

export interface PrefixBenchResult {
  readonly topology: FairBenchTopology;
  readonly prefillNodes: number;
  readonly decodeNodes: number;
  readonly tenants: number;
  readonly sessions: number;
  readonly concurrency: number;
  readonly turns: number;
  readonly rounds: number;
  /** Tokens of every session's whole conversation (last prompt and answer), and the prefill pools'. */
  readonly workingSetTokens: number;
  readonly prefillPoolTokens: number;
  readonly arms: readonly PrefixArm[];
  /** The first five failures (refused turns, answers that differ between arms) … */
  readonly failures: readonly string[];
  /** … and how many there were in all. */
  readonly failureCount: number;
  readonly load: MachineLoad;
}

const THIS_MAIN = fileURLToPath(new URL("../../cli/main.js", import.meta.url));
const PAGE_SIZE = 16;
const keyOf = (t: number): string => `sk-bench-prefix-tenant-${t}`;
const OPERATOR_KEY = "sk-bench-prefix-operator";

/**
 * The flags of an arm's node `index` of `role` (in the one-process topologies, the server's): the
 * cache on or off, and the tiers arm's tier flags on prefill nodes (each disk tier in a directory
 * of its own, `DIR/prefill-i`, as `kvfence cluster` does).
 */
function armArgs(
  arm: PrefixArmName,
  tierArgs: readonly string[],
  role: "prefill" | "decode",
  index: number,
): string[] {
  if (arm === "off") return ["--prefix-cache", "off"];
  if (arm === "on" || role === "decode") return ["--prefix-cache", "on"];
  const own = tierArgs.map((a, i) => (tierArgs[i - 1] === "--cache-disk" ? join(a, `prefill-${index}`) : a));
  return ["--prefix-cache", "on", ...own];
}

/** One arm's round: turn by turn, every session's turn t (at most `concurrency` at once) before any t + 1. */
async function runRound(
  url: string,
  model: string,
  dataset: Dataset,
  tenants: number,
  concurrency: number,
): Promise<StreamOutcome[][]> {
  const replies = dataset.sessions.map((s) => s.turns.map(() => ""));
  const outcomes = dataset.sessions.map(() => [] as StreamOutcome[]);
  const turns = Math.max(...dataset.sessions.map((s) => s.turns.length));
  const ctx = (s: number): RunContext => ({
    baseUrl: url,
    endpoint: "/v1/chat/completions",
    apiKey: keyOf(s % tenants),
    model,
    dataset,
    maxTokens: undefined,
    temperature: 0,
    ignoreEos: false,
    timeoutMs: 600_000,
    charsPerToken: 1,
  });
  for (let t = 0; t < turns; t++) {
    const jobs = dataset.sessions.flatMap((session, s) =>
      t < session.turns.length
        ? [
            async () => {
              const { outcome } = await sendTurn(ctx(s), s, t, replies);
              replies[s]![t] = outcome.text;
              outcomes[s]!.push(outcome);
            },
          ]
        : [],
    );
    await runPool(jobs, concurrency, (job) => job());
  }
  return outcomes;
}

/** The pages decode received and held (`kvfence_transfer_pages_total`, `…_reused_total`) in a Prometheus exposition (null: absent). */
export function transferPages(exposition: string): { sent: number; reused: number } | null {
  const total = (name: string): number | null => {
    const m = new RegExp(`^${name}(?:\\{[^}]*\\})?\\s+(\\S+)$`, "m").exec(exposition);
    return m === null ? null : Number(m[1]);
  };
  const sent = total("kvfence_transfer_pages_total");
  return sent === null ? null : { sent, reused: total("kvfence_transfer_pages_reused_total") ?? 0 };
}

async function scrapeTransferPages(url: string): Promise<{ sent: number; reused: number } | null> {
  try {
    const res = await fetch(`${url}/metrics`, { headers: { authorization: `Bearer ${OPERATOR_KEY}` } });
    return res.ok ? transferPages(await res.text()) : null;
  } catch {
    return null;
  }
}

/** What the measured rounds found, per arm. */
class Tally {
  readonly failures: string[] = [];
  failureCount = 0;
  readonly later = new Map<PrefixArmName, number[]>();
  readonly first = new Map<PrefixArmName, number[]>();
  readonly prompt = new Map<PrefixArmName, number>();
  readonly computed = new Map<PrefixArmName, number>();
  workingSet = 0;

  add(
    arm: PrefixArmName,
    r: number,
    outcomes: StreamOutcome[][],
    reference: StreamOutcome[][] | undefined,
  ): void {
    const later: number[] = [];
    const first: number[] = [];
    let workingSet = 0;
    for (const [s, turns] of outcomes.entries()) {
      for (const [t, o] of turns.entries()) {
        if (!o.ok) {
          // A refusal answers at once: its time is no time to a first token.
          this.#fail(`${arm} round ${r + 1} session ${s + 1} turn ${t + 1}: ${o.error}`);
          continue;
        }
        const ttft = ((o.tokenTimes[0] ?? o.firstChoiceAt ?? o.endAt) - o.sentAt) / 1000;
        (t === 0 ? first : later).push(ttft);
        this.prompt.set(arm, (this.prompt.get(arm) ?? 0) + (o.promptTokens ?? 0));
        this.computed.set(arm, (this.computed.get(arm) ?? 0) + (o.promptTokens ?? 0) - (o.cachedTokens ?? 0));
        const twin = reference?.[s]?.[t];
        if (twin?.ok && o.ok && twin.text !== o.text)
          this.#fail(
            `round ${r + 1} session ${s + 1} turn ${t + 1}: the answers of ${arm} and the first arm differ`,
          );
      }
      // The session's KV at its last answered turn (a refused turn holds none).
      const last = turns.findLast((o) => o.ok);
      workingSet += (last?.promptTokens ?? 0) + (last?.completionTokens ?? 0);
    }
    this.workingSet = Math.max(this.workingSet, workingSet);
    this.later.set(arm, [...(this.later.get(arm) ?? []), mean(later)]);
    this.first.set(arm, [...(this.first.get(arm) ?? []), mean(first)]);
  }

  #fail(line: string): void {
    this.failureCount++;
    if (this.failures.length < 5) this.failures.push(line);
  }
}

function settingsOf(options: PrefixBenchOptions) {
  const topology = options.topology ?? "threads";
  const sessions = options.sessions ?? 6;
  const arms: PrefixArmName[] = [...new Set<PrefixArmName>(options.arms ?? ["on", "off"])];
  if (arms.length < 2 || !arms.includes("off"))
    throw new Error(`--arms: name "off" and at least one of on, pool, tiers (got ${arms.join(",")})`);
  return {
    topology,
    prefillNodes: topology === "cluster" ? (options.prefillNodes ?? 1) : 1,
    decodeNodes: topology === "cluster" ? (options.decodeNodes ?? 1) : 1,
    arms,
    tierArgs: options.tierArgs,
    tenants: options.tenants ?? 3,
    sessions,
    concurrency: Math.min(sessions, options.concurrency ?? sessions),
    turns: options.turns ?? 8,
    rounds: options.rounds ?? 3,
    documentLen: options.documentLen ?? 512,
    inputLen: options.inputLen ?? 64,
    outputLen: options.outputLen ?? 32,
    seed: options.seed ?? 1,
    kvPages: options.kvPages ?? 1024,
    decodeKvPages: topology === "cluster" ? options.decodeKvPages : undefined,
    common: [
      ...serveArgsOf(options, 1024),
      ...(options.maxModelLen === undefined ? [] : ["--max-model-len", String(options.maxModelLen)]),
      "--page-size",
      String(PAGE_SIZE),
      "--operator-key",
      OPERATOR_KEY,
    ],
    log: options.log ?? (() => {}),
  };
}

type Settings = ReturnType<typeof settingsOf>;

async function startArms(st: Settings, keys: string, dir: string): Promise<Map<PrefixArmName, Server>> {
  const servers = new Map<PrefixArmName, Server>();
  const tierArgs = st.tierArgs ?? [
    "--cache-ram",
    "64MiB",
    "--cache-disk",
    join(dir, "tier-disk"),
    "--cache-disk-size",
    "1GiB",
    "--cache-disk-key",
    join(dir, "tier-disk.key"),
  ];
  for (const arm of st.arms) {
    const decodePool = st.decodeKvPages === undefined ? [] : ["--kv-pages", String(st.decodeKvPages)];
    const nodes: ArmNodes = {
      prefill: st.prefillNodes,
      decode: st.decodeNodes,
      nodeArgs: (role, i) => [...armArgs(arm, tierArgs, role, i), ...(role === "decode" ? decodePool : [])],
    };
    st.log(`starting the ${arm} arm (${st.topology}): ${armArgs(arm, tierArgs, "prefill", 0).join(" ")}`);
    const routerArgs = [
      "--api-keys",
      keys,
      ...(st.topology === "cluster" ? armArgs(arm, [], "decode", 0) : []),
    ];
    try {
      servers.set(arm, await startArm(THIS_MAIN, st.topology, st.common, routerArgs, nodes));
    } catch (err) {
      // The arms started already stop with it (the caller never gets them to close).
      await Promise.all([...servers.values()].map((s) => s.close()));
      throw err;
    }
  }
  return servers;
}

export async function runPrefixCacheBench(options: PrefixBenchOptions = {}): Promise<PrefixBenchResult> {
  const st = settingsOf(options);
  const loadStart = loadAverage();
  const dir = mkdtempSync(join(os.tmpdir(), "kvfence-bench-prefix-"));
  const keys = join(dir, "keys.json");
  writeFileSync(
    keys,
    JSON.stringify(
      Object.fromEntries(Array.from({ length: st.tenants }, (_, t) => [keyOf(t), `tenant-${t}`])),
    ),
  );
  let servers = new Map<PrefixArmName, Server>();
  const tally = new Tally();
  const pages = new Map<PrefixArmName, { sent: number; reused: number } | null>();
  try {
    servers = await startArms(st, keys, dir);
    const any = servers.values().next().value!;
    const models = (await (
      await fetch(`${any.url}/v1/models`, { headers: { authorization: `Bearer ${keyOf(0)}` } })
    ).json()) as { data: { id: string }[] };
    const model = models.data[0]!.id;
    for (let r = 0; r < st.rounds; r++) {
      const dataset = buildDataset({
        name: "multi-turn",
        numPrompts: st.sessions * st.turns,
        seed: st.seed + r,
        nonce: "ask",
        charsPerToken: 1,
        inputLen: st.inputLen,
        outputLen: st.outputLen,
        rangeRatio: 0,
        prefixGroups: 1,
        prefixLen: 0,
        turns: st.turns,
        sessionPrefixLen: st.documentLen,
      });
      let reference: StreamOutcome[][] | undefined;
      for (const arm of orderOf(st.arms, r)) {
        const outcomes = await runRound(servers.get(arm)!.url, model, dataset, st.tenants, st.concurrency);
        tally.add(arm, r, outcomes, reference);
        reference ??= outcomes;
      }
      st.log(
        `round ${r + 1}/${st.rounds}: mean TTFT of ${st.turns < 2 ? "turn 1" : `turns 2-${st.turns}`}: ${st.arms.map((a) => `${a} ${((st.turns < 2 ? tally.first : tally.later).get(a)!.at(-1)! * 1000).toFixed(1)} ms`).join(", ")}`,
      );
    }
    for (const [arm, server] of servers) pages.set(arm, await scrapeTransferPages(server.url));
  } finally {
    await Promise.all([...servers.values()].map((s) => s.close()));
    rmSync(dir, { recursive: true, force: true });
  }
  const off = tally.later.get("off")!;
  const arms = st.arms.map(
    (name): PrefixArm => ({
      name,
      label: name === "off" ? "cache off" : name === "on" ? "pool only" : "pool + tiers",
      laterTtft: mean(tally.later.get(name)!),
      laterTtftRounds: summarize(tally.later.get(name)!),
      firstTtft: mean(tally.first.get(name)!),
      promptTokens: tally.prompt.get(name) ?? 0,
      computedTokens: tally.computed.get(name) ?? 0,
      pagesSent: pages.get(name)?.sent ?? null,
      pagesReused: pages.get(name)?.reused ?? null,
      ttftRatio: name === "off" ? null : pairedRatio(tally.later.get(name)!, off),
      vsPool:
        name === "tiers" && tally.first.has("on")
          ? {
              first: pairedRatio(tally.first.get("tiers")!, tally.first.get("on")!),
              later: pairedRatio(tally.later.get("tiers")!, tally.later.get("on")!),
            }
          : null,
    }),
  );
  return {
    topology: st.topology,
    prefillNodes: st.prefillNodes,
    decodeNodes: st.decodeNodes,
    tenants: st.tenants,
    sessions: st.sessions,
    concurrency: st.concurrency,
    turns: st.turns,
    rounds: st.rounds,
    workingSetTokens: tally.workingSet,
    prefillPoolTokens: st.kvPages * PAGE_SIZE * st.prefillNodes,
    arms,
    failures: tally.failures,
    failureCount: tally.failureCount,
    load: machineLoad(loadStart),
  };
}

/**
 * The acceptance bars on an arm's TTFT ratio to the cache off: the pool cache's (#16) 1/3; with the
 * tiers and a working set past the pools (#35), 0.35.
 */
export const TTFT_RATIO_TARGET: Readonly<Record<Exclude<PrefixArmName, "off">, number>> = {
  on: 1 / 3,
  tiers: 0.35,
};

/** A ratio against its bar: its CI's high end, else its point estimate. */
function ttftVerdict(t: RatioInterval, bar: number): string {
  const b = bar.toFixed(3).replace(/0+$/, "");
  if (t.high <= bar) return `≤ ${b}: pass (the CI's high end too)`;
  if (t.ratio <= bar)
    return `≤ ${b}: pass by the point estimate; the CI reaches past it (more rounds, a quieter machine)`;
  return `> ${b}: FAIL`;
}

/** The human-readable report of a run. */
export function formatPrefixCacheReport(r: PrefixBenchResult): string {
  const ms = (s: number): string => `${(s * 1000).toFixed(1)} ms`;
  const nodes =
    r.topology === "cluster" ? ` (${r.prefillNodes} prefill + ${r.decodeNodes} decode nodes)` : "";
  const line = (a: PrefixArm): string => {
    const moved =
      a.pagesSent === null ? "" : `; pages to decode: sent ${a.pagesSent}, already held ${a.pagesReused}`;
    const later =
      r.turns < 2
        ? ""
        : `TTFT turns 2-${r.turns}: mean ${ms(a.laterTtft)} (rounds ${ms(a.laterTtftRounds.min)}–${ms(a.laterTtftRounds.max)}), `;
    return `${a.label.padEnd(13)} ${later}turn 1: ${ms(a.firstTtft)}; prompt tokens ${a.promptTokens}, computed ${a.computedTokens}${moved}`;
  };
  const ci = (t: RatioInterval): string =>
    Number.isNaN(t.low) ? "-" : `${t.low.toFixed(3)}–${t.high.toFixed(3)}`;
  const ratios = r.arms.flatMap((a) => {
    const t = a.ttftRatio;
    if (t === null || r.turns < 2) return [];
    const bar = TTFT_RATIO_TARGET[a.name as Exclude<PrefixArmName, "off">];
    return [
      `mean TTFT of turns 2-${r.turns}, ${a.label} / cache off: ${t.ratio.toFixed(3)} [95% CI ${ci(t)}] ${ttftVerdict(t, bar)}`,
    ];
  });
  const tiers = r.arms.find((a) => a.vsPool !== null)?.vsPool;
  if (tiers !== undefined && tiers !== null)
    ratios.push(
      `pool + tiers / pool only, mean TTFT: turn 1 ${tiers.first.ratio.toFixed(3)} [95% CI ${ci(tiers.first)}]${r.turns < 2 ? "" : `, turns 2-${r.turns} ${tiers.later.ratio.toFixed(3)} [95% CI ${ci(tiers.later)}]`}`,
    );
  return [
    `kvfence ${r.topology}${nodes}, prefix cache arms ${r.arms.map((a) => a.name).join(", ")}: ${r.rounds} interleaved rounds of ${r.sessions} ${r.turns}-turn chat sessions (${r.concurrency} at once, turn by turn) over ${r.tenants} tenants (bench serve's multi-turn dataset, greedy)`,
    `working set ${r.workingSetTokens} tokens: ${(r.workingSetTokens / r.prefillPoolTokens).toFixed(2)}× the prefill pools (${r.prefillPoolTokens} tokens)`,
    describeLoad(r.load),
    ...r.arms.map(line),
    ...ratios,
    ...(r.failures.length > 0
      ? [`FAILURES (${r.failureCount}; the first ${r.failures.length}): ${r.failures.join("; ")}`]
      : []),
  ].join("\n");
}

interface PrefixCliOptions {
  topology: FairBenchTopology;
  model?: string;
  kvPages: number;
  decodeKvPages?: number;
  maxModelLen?: number;
  prefillNodes: number;
  decodeNodes: number;
  arms: PrefixArmName[];
  tierArgs?: string;
  tenants: number;
  sessions: number;
  concurrency?: number;
  turns: number;
  rounds: number;
  documentLen: number;
  inputLen: number;
  outputLen: number;
  seed: number;
  json?: boolean;
}

function nonNegativeInt(value: string): number {
  return value.trim() === "0" ? 0 : positiveInt("--document-len")(value);
}

function armList(value: string): PrefixArmName[] {
  return value.split(",").map((raw) => {
    const name = raw.trim() === "pool" ? "on" : raw.trim();
    if (name !== "off" && name !== "on" && name !== "tiers")
      throw new Error(`--arms: unknown arm: ${raw}; use off, on (or pool) and tiers`);
    return name;
  });
}

/** `kvfence bench prefix-cache`. */
export function prefixCacheCommand(): Command {
  return new Command("prefix-cache")
    .description(
      "Multi-turn chat TTFT and prompt tokens computed with the prefix cache off, in the pool, and with its tiers: one server per arm, interleaved rounds, 95% CI of each TTFT ratio",
    )
    .addOption(topologyOption())
    .option("--model <dir>", "model folder (default: the bundled kvfence-tiny)")
    .option("--kv-pages <n>", "KV pool of each engine or node in pages", positiveInt("--kv-pages"), 1024)
    .option("--max-model-len <tokens>", "longest request the servers take", positiveInt("--max-model-len"))
    .option(
      "--decode-kv-pages <n>",
      "cluster: the decode nodes' KV pool in pages (default: --kv-pages)",
      positiveInt("--decode-kv-pages"),
    )
    .option("--prefill-nodes <n>", "cluster: prefill node processes", positiveInt("--prefill-nodes"), 1)
    .option("--decode-nodes <n>", "cluster: decode node processes", positiveInt("--decode-nodes"), 1)
    .option("--arms <list>", "arms to compare: off, on (or pool), tiers", armList, [
      "on",
      "off",
    ] as PrefixArmName[])
    .option(
      "--tier-args <flags>",
      'the tiers arm\'s flags (default "--cache-ram 64MiB --cache-disk <temporary> --cache-disk-size 1GiB")',
    )
    .option(
      "--tenants <n>",
      "tenants the sessions belong to (session s is tenant s mod n)",
      positiveInt("--tenants"),
      3,
    )
    .option("--sessions <n>", "chat sessions per round", positiveInt("--sessions"), 6)
    .option(
      "--concurrency <n>",
      "turns running at once (default: every session)",
      positiveInt("--concurrency"),
    )
    .option("--turns <n>", "turns per session", positiveInt("--turns"), 8)
    .option("--rounds <n>", "interleaved rounds (each runs every arm)", positiveInt("--rounds"), 3)
    .option(
      "--document-len <tokens>",
      "tokens of the document each session's first turn starts with (0: none)",
      nonNegativeInt,
      512,
    )
    .option("--input-len <tokens>", "tokens of each new user turn", positiveInt("--input-len"), 64)
    .option("--output-len <tokens>", "max_tokens of each answer", positiveInt("--output-len"), 32)
    .option("--seed <n>", "dataset seed (round r uses seed + r)", positiveInt("--seed"), 1)
    .option("--json", "print the result as JSON")
    .action(async ({ tierArgs, ...o }: PrefixCliOptions) => {
      const result = await runPrefixCacheBench({
        ...o,
        ...(o.model === undefined ? {} : { model: o.model }),
        ...(tierArgs === undefined ? {} : { tierArgs: tierArgs.split(/\s+/).filter((a) => a !== "") }),
        log: (line) => process.stderr.write(`${line}\n`),
      });
      process.stdout.write(
        `${o.json === true ? JSON.stringify(result, null, 2) : formatPrefixCacheReport(result)}\n`,
      );
      if (result.failures.length > 0) process.exitCode = 1;
    });
}
