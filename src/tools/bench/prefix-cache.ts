/**
 * `kvfence bench prefix-cache`: what the tenant-fenced prefix cache buys multi-turn chat (issue
 * #16's acceptance). Starts two servers of the same topology (`--topology single`, `threads` — the
 * default `kvfence serve` — or `cluster`), one with `--prefix-cache on` and one with `off`, each
 * with an API keys file of `--tenants` tenants. Each round builds `bench serve`'s multi-turn
 * dataset (src/tools/bench/serve-datasets.ts: sessions of `--turns` turns, the first starting with
 * a document of the session's own, each turn resending the whole history with the answers the
 * server gave) and runs its sessions concurrently, session s as
 * tenant s mod T, through each server, the two arms in alternating order (interleaved A/B).
 *
 * Reported per arm: the mean time to first token of turns 2..N (and of turn 1), with its spread
 * over rounds, and the prompt tokens each arm computed (`usage.prompt_tokens` minus
 * `usage.prompt_tokens_details.cached_tokens`); and the on/off ratios — the TTFT ratio as the
 * geometric mean of the per-round ratios with a 95% confidence interval — against the acceptance
 * (both ≤ 1/3). Greedy answers must be the same in both arms (a hit computes what a miss does).
 */
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import os from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { Command } from "commander";
import { mean, pairedRatio, type RatioInterval, type Summary, summarize } from "../../lib/stats.js";
import { serveArgsOf } from "./arm-load.js";
import { positiveInt } from "./bench-cli.js";
import { type FairBenchTopology, type Server, startArm, topologyOption } from "./fair-share.js";
import { describeLoad, loadAverage, type MachineLoad, machineLoad } from "./machine-load.js";
import { type RunContext, sendTurn } from "./serve.js";
import type { StreamOutcome } from "./serve-client.js";
import { buildDataset, type Dataset } from "./serve-datasets.js";

export interface PrefixBenchOptions {
  readonly topology?: FairBenchTopology;
  readonly model?: string;
  readonly kvPages?: number;
  readonly tenants?: number;
  /** Concurrent sessions per round. */
  readonly sessions?: number;
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
  readonly label: string;
  /** Mean TTFT (s) of turns 2..N over every round, and its spread over the rounds' means. */
  readonly laterTtft: number;
  readonly laterTtftRounds: Summary;
  /** Mean TTFT (s) of turn 1 over every round. */
  readonly firstTtft: number;
  /** Prompt tokens sent and computed (sent minus served from the cache), over every round. */
  readonly promptTokens: number;
  readonly computedTokens: number;
}

export interface PrefixBenchResult {
  readonly topology: FairBenchTopology;
  readonly tenants: number;
  readonly sessions: number;
  readonly turns: number;
  readonly rounds: number;
  readonly on: PrefixArm;
  readonly off: PrefixArm;
  /** Mean TTFT of turns 2..N, on / off, paired by round. */
  readonly ttftRatio: RatioInterval;
  /** Prompt tokens computed, on / off. */
  readonly computedRatio: number;
  readonly failures: readonly string[];
  readonly load: MachineLoad;
}

const THIS_MAIN = fileURLToPath(new URL("../../cli/main.js", import.meta.url));
const keyOf = (t: number): string => `sk-bench-prefix-tenant-${t}`;

type ArmName = "on" | "off";

/** One arm's round: every session's turns, the sessions concurrently. */
interface RoundResult {
  readonly outcomes: StreamOutcome[][];
}

async function runRound(url: string, model: string, dataset: Dataset, tenants: number): Promise<RoundResult> {
  const replies = dataset.sessions.map((s) => s.turns.map(() => ""));
  const outcomes = dataset.sessions.map(() => [] as StreamOutcome[]);
  await Promise.all(
    dataset.sessions.map(async (session, s) => {
      const ctx: RunContext = {
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
      };
      for (let t = 0; t < session.turns.length; t++) {
        const { outcome } = await sendTurn(ctx, s, t, replies);
        replies[s]![t] = outcome.text;
        outcomes[s]!.push(outcome);
      }
    }),
  );
  return { outcomes };
}

/** What the measured rounds found, per arm. */
class Tally {
  readonly failures: string[] = [];
  readonly later = { on: [] as number[], off: [] as number[] };
  readonly first = { on: [] as number[], off: [] as number[] };
  readonly prompt = { on: 0, off: 0 };
  readonly computed = { on: 0, off: 0 };

  add(arm: ArmName, r: number, result: RoundResult, other: RoundResult | undefined): void {
    const later: number[] = [];
    const first: number[] = [];
    for (const [s, turns] of result.outcomes.entries()) {
      for (const [t, o] of turns.entries()) {
        if (!o.ok) this.#fail(`${arm} round ${r + 1} session ${s + 1} turn ${t + 1}: ${o.error}`);
        const ttft = ((o.tokenTimes[0] ?? o.firstChoiceAt ?? o.endAt) - o.sentAt) / 1000;
        (t === 0 ? first : later).push(ttft);
        this.prompt[arm] += o.promptTokens ?? 0;
        this.computed[arm] += (o.promptTokens ?? 0) - (o.cachedTokens ?? 0);
        const twin = other?.outcomes[s]?.[t];
        if (twin?.ok && o.ok && twin.text !== o.text)
          this.#fail(
            `round ${r + 1} session ${s + 1} turn ${t + 1}: the answers with and without the cache differ`,
          );
      }
    }
    this.later[arm].push(mean(later));
    this.first[arm].push(mean(first));
  }

  #fail(line: string): void {
    if (this.failures.length < 5) this.failures.push(line);
  }
}

function settingsOf(options: PrefixBenchOptions) {
  return {
    topology: options.topology ?? "threads",
    tenants: options.tenants ?? 3,
    sessions: options.sessions ?? 6,
    turns: options.turns ?? 8,
    rounds: options.rounds ?? 3,
    documentLen: options.documentLen ?? 512,
    inputLen: options.inputLen ?? 64,
    outputLen: options.outputLen ?? 32,
    seed: options.seed ?? 1,
    common: serveArgsOf(options, 1024),
    log: options.log ?? (() => {}),
  };
}

export async function runPrefixCacheBench(options: PrefixBenchOptions = {}): Promise<PrefixBenchResult> {
  const st = settingsOf(options);
  const loadStart = loadAverage();
  const dir = mkdtempSync(join(os.tmpdir(), "kvfence-bench-keys-"));
  const keys = join(dir, "keys.json");
  writeFileSync(
    keys,
    JSON.stringify(
      Object.fromEntries(Array.from({ length: st.tenants }, (_, t) => [keyOf(t), `tenant-${t}`])),
    ),
  );
  const servers: Partial<Record<ArmName, Server>> = {};
  const tally = new Tally();
  try {
    st.log(`starting two ${st.topology} servers: --prefix-cache on and off`);
    servers.on = await startArm(THIS_MAIN, st.topology, st.common, [
      "--api-keys",
      keys,
      "--prefix-cache",
      "on",
    ]);
    servers.off = await startArm(THIS_MAIN, st.topology, st.common, [
      "--api-keys",
      keys,
      "--prefix-cache",
      "off",
    ]);
    const models = (await (
      await fetch(`${servers.on.url}/v1/models`, { headers: { authorization: `Bearer ${keyOf(0)}` } })
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
      const order: ArmName[] = r % 2 === 0 ? ["on", "off"] : ["off", "on"];
      const results: Partial<Record<ArmName, RoundResult>> = {};
      for (const arm of order) {
        results[arm] = await runRound(servers[arm]!.url, model, dataset, st.tenants);
        tally.add(arm, r, results[arm]!, results[arm === "on" ? "off" : "on"]);
      }
      st.log(
        `round ${r + 1}/${st.rounds}: mean TTFT of turns 2-${st.turns}: on ${(tally.later.on.at(-1)! * 1000).toFixed(1)} ms, off ${(tally.later.off.at(-1)! * 1000).toFixed(1)} ms`,
      );
    }
  } finally {
    await Promise.all([servers.on?.close(), servers.off?.close()]);
    rmSync(dir, { recursive: true, force: true });
  }
  const arm = (name: ArmName): PrefixArm => ({
    label: `--prefix-cache ${name}`,
    laterTtft: mean(tally.later[name]),
    laterTtftRounds: summarize(tally.later[name]),
    firstTtft: mean(tally.first[name]),
    promptTokens: tally.prompt[name],
    computedTokens: tally.computed[name],
  });
  return {
    topology: st.topology,
    tenants: st.tenants,
    sessions: st.sessions,
    turns: st.turns,
    rounds: st.rounds,
    on: arm("on"),
    off: arm("off"),
    ttftRatio: pairedRatio(tally.later.on, tally.later.off),
    computedRatio: tally.computed.on / Math.max(1, tally.computed.off),
    failures: tally.failures,
    load: machineLoad(loadStart),
  };
}

/** The human-readable report of a run. */
export function formatPrefixCacheReport(r: PrefixBenchResult): string {
  const ms = (s: number): string => `${(s * 1000).toFixed(1)} ms`;
  const arm = (a: PrefixArm): string =>
    `${a.label.padEnd(18)} TTFT turns 2-${r.turns}: mean ${ms(a.laterTtft)} (rounds ${ms(a.laterTtftRounds.min)}–${ms(a.laterTtftRounds.max)}), turn 1: ${ms(a.firstTtft)}; prompt tokens ${a.promptTokens}, computed ${a.computedTokens}`;
  const t = r.ttftRatio;
  const pass = (x: number): string => (x <= 1 / 3 ? "≤ 1/3: pass" : "> 1/3: FAIL");
  return [
    `kvfence ${r.topology}, prefix cache on vs off: ${r.rounds} interleaved rounds of ${r.sessions} concurrent ${r.turns}-turn chat sessions over ${r.tenants} tenants (bench serve's multi-turn dataset, greedy)`,
    describeLoad(r.load),
    arm(r.on),
    arm(r.off),
    `mean TTFT of turns 2-${r.turns}, on / off: ${t.ratio.toFixed(3)} [95% CI ${Number.isNaN(t.low) ? "-" : `${t.low.toFixed(3)}–${t.high.toFixed(3)}`}] ${ttftVerdict(t)}`,
    `prompt tokens computed, on / off: ${r.computedRatio.toFixed(3)} ${pass(r.computedRatio)}`,
    ...(r.failures.length > 0 ? [`FAILURES: ${r.failures.join("; ")}`] : []),
  ].join("\n");
}

/** The acceptance on the TTFT ratio: its CI, else its point estimate, against 1/3. */
function ttftVerdict(t: RatioInterval): string {
  if (t.high <= 1 / 3) return "≤ 1/3: pass (the CI's high end too)";
  if (t.ratio <= 1 / 3)
    return "≤ 1/3: pass by the point estimate; the CI reaches past 1/3 (more rounds, a quieter machine)";
  return "> 1/3: FAIL";
}

interface PrefixCliOptions {
  topology: FairBenchTopology;
  model?: string;
  kvPages: number;
  tenants: number;
  sessions: number;
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

/** `kvfence bench prefix-cache`. */
export function prefixCacheCommand(): Command {
  return new Command("prefix-cache")
    .description(
      "Multi-turn chat TTFT and prompt tokens computed with the prefix cache on vs off: two servers, interleaved rounds, 95% CI of the TTFT ratio",
    )
    .addOption(topologyOption())
    .option("--model <dir>", "model folder (default: the bundled kvfence-tiny)")
    .option("--kv-pages <n>", "KV pool of each engine or node in pages", positiveInt("--kv-pages"), 1024)
    .option(
      "--tenants <n>",
      "tenants the sessions belong to (session s is tenant s mod n)",
      positiveInt("--tenants"),
      3,
    )
    .option("--sessions <n>", "concurrent chat sessions per round", positiveInt("--sessions"), 6)
    .option("--turns <n>", "turns per session", positiveInt("--turns"), 8)
    .option("--rounds <n>", "interleaved rounds (each runs both arms)", positiveInt("--rounds"), 3)
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
    .action(async (o: PrefixCliOptions) => {
      const result = await runPrefixCacheBench({
        ...o,
        ...(o.model === undefined ? {} : { model: o.model }),
        log: (line) => process.stderr.write(`${line}\n`),
      });
      process.stdout.write(
        `${o.json === true ? JSON.stringify(result, null, 2) : formatPrefixCacheReport(result)}\n`,
      );
      if (result.failures.length > 0) process.exitCode = 1;
    });
}
