/**
 * `kvfence probe URL --timing`: a timing side-channel audit of a prefix cache, as an outside
 * tenant, for any OpenAI-compatible endpoint (the PromptPeek class of leaks, docs/probe.md). Does
 * a prefix planted by tenant A make tenant B's first token faster?
 *
 * Each trial draws a fresh random prefix P (never sent before) and has tenant A send P plus a
 * question (the plant). Then, in a random order, tenant B sends P plus its own question (planted)
 * and a fresh prefix F of the same length plus the same question (control); each request asks for
 * one token (`max_tokens` 1, greedy, not streamed), so its time is the time to the first token.
 * The same is done by tenant A itself (A sends P again, and a fresh prefix) as the power check:
 * a cache that reuses a tenant's own prefix shows there, and the audit says whether it could see a
 * leak at all. A one-sided Mann–Whitney U test (`mannWhitneyLess` in src/lib/stats.ts) asks
 * whether planted times tend to be smaller than control times; the verdict:
 *
 * - `leak`: B is faster after A's plant (p < `alpha`, default 0.01): A's prompt reaches B's
 *   timing, so B can recover A's prompts token by token;
 * - `no-leak`: B is not measurably faster, and A's own repeat is (the cache works and is fenced);
 * - `inconclusive`: neither is measurably faster — no prefix cache, or too few trials or too
 *   short a prefix to see one; the audit cannot tell.
 *
 * With `evictRequests` (the KV tiers' case, `--timing-case tiers`), A follows each plant with that
 * many fresh prompts of the same length, pushing the planted pages out of the server's KV pool into
 * whatever keeps them below it (host memory, disk): B's pair then asks whether a page loaded back
 * from a tier reaches another tenant, and A's pair (a hit from the tier) is the power check.
 *
 * Trials run one request at a time (no load of our own). It imports only lib helpers and its own
 * client, so it works against any server. The same design audits the grammar cache
 * (grammar-timing.ts), over this module's `timingRun`, `Timer`, `compare` and `verdictOf`.
 */
import { Prng } from "../../lib/prng.js";
import { mannWhitneyLess, median, type RankTest } from "../../lib/stats.js";
import { type ClientOptions, postChat } from "./chat-client.js";

export interface TimingOptions {
  /** Server base URL without `/v1`. */
  readonly baseUrl: string;
  readonly apiKeyA?: string;
  readonly apiKeyB?: string;
  /** Model id (default: the first of /v1/models). */
  readonly model?: string;
  /** Paired trials (default 40). */
  readonly trials?: number;
  /** Characters of each prefix (default 1500). */
  readonly prefixChars?: number;
  /** Fresh prompts A sends after each plant, to push it out of the KV pool (default 0). */
  readonly evictRequests?: number;
  /** Significance level of the one-sided test (default 0.01). */
  readonly alpha?: number;
  readonly seed?: number;
  readonly timeoutMs?: number;
  readonly onProgress?: (line: string) => void;
}

/** One comparison: the times (ms) after the plant and with a fresh prefix, and the test. */
export interface TimingComparison {
  readonly plantedMs: readonly number[];
  readonly freshMs: readonly number[];
  readonly medianPlantedMs: number;
  readonly medianFreshMs: number;
  readonly test: RankTest;
}

export interface TimingReport {
  readonly trials: number;
  readonly prefixChars: number;
  /** Fresh prompts after each plant (0: the plant stays in the pool). */
  readonly evictRequests: number;
  readonly alpha: number;
  /** Tenant B after tenant A's plant: the leak under test. */
  readonly crossTenant: TimingComparison;
  /** Tenant A after its own plant: the power check. */
  readonly sameTenant: TimingComparison;
  readonly failures: number;
  readonly verdict: "leak" | "no-leak" | "inconclusive";
}

const WORDS = [
  "amber",
  "basil",
  "cedar",
  "delta",
  "ember",
  "fjord",
  "garnet",
  "harbor",
  "iris",
  "juniper",
  "kelp",
  "lumen",
  "maple",
  "nectar",
  "onyx",
  "pebble",
  "quartz",
  "russet",
  "sable",
  "tundra",
];

/** A random prefix of about `chars` characters, unlike any other (a fresh number leads it). */
function randomPrefix(rng: Prng, chars: number): string {
  let text = `note ${rng.nextUint32().toString(36)}:`;
  while (text.length < chars) text += ` ${WORDS[rng.nextInt(WORDS.length)]}${rng.nextInt(100)}`;
  return text.slice(0, chars);
}

/** What every timing audit starts from: its trials, level, generator and timer (the model resolved). */
export async function timingRun(
  options: Omit<TimingOptions, "prefixChars">,
): Promise<{ trials: number; alpha: number; rng: Prng; timer: Timer }> {
  const client: ClientOptions = { baseUrl: options.baseUrl, timeoutMs: options.timeoutMs ?? 120_000 };
  const model = options.model ?? (await firstModel(options.baseUrl, options.apiKeyA));
  return {
    trials: options.trials ?? 40,
    alpha: options.alpha ?? 0.01,
    rng: new Prng(options.seed ?? 1),
    timer: new Timer(client, model),
  };
}

export async function runTimingProbe(options: TimingOptions): Promise<TimingReport> {
  const chars = options.prefixChars ?? 1500;
  const evict = options.evictRequests ?? 0;
  const { trials, alpha, rng, timer } = await timingRun(options);
  const cross = { planted: [] as number[], fresh: [] as number[] };
  const same = { planted: [] as number[], fresh: [] as number[] };
  // One request before the trials, outside the figures (first-use costs of the server).
  await timer.time(options.apiKeyB, randomPrefix(rng, chars));
  for (let i = 0; i < trials; i++) {
    const planted = randomPrefix(rng, chars);
    await timer.time(options.apiKeyA, `${planted}\nwhat comes first?`);
    for (let e = 0; e < evict; e++)
      await timer.time(options.apiKeyA, `${randomPrefix(rng, chars)}\nwhat comes first?`);
    await timer.pair(options.apiKeyB, planted, randomPrefix(rng, chars), "what comes next?", rng, cross);
    await timer.pair(options.apiKeyA, planted, randomPrefix(rng, chars), "what comes last?", rng, same);
    if ((i + 1) % 10 === 0) options.onProgress?.(`timing: ${i + 1}/${trials} trials`);
  }
  const crossTenant = compare(cross);
  const sameTenant = compare(same);
  const verdict = verdictOf(crossTenant, sameTenant, alpha);
  return {
    trials,
    prefixChars: chars,
    evictRequests: evict,
    alpha,
    crossTenant,
    sameTenant,
    failures: timer.failures,
    verdict,
  };
}

/** A leak when B is faster after A's plant; else no leak when A's own repeat is faster; else inconclusive. */
export function verdictOf(
  crossTenant: TimingComparison,
  sameTenant: TimingComparison,
  alpha: number,
): TimingReport["verdict"] {
  return crossTenant.test.p < alpha ? "leak" : sameTenant.test.p < alpha ? "no-leak" : "inconclusive";
}

export function compare(c: { planted: number[]; fresh: number[] }): TimingComparison {
  return {
    plantedMs: c.planted,
    freshMs: c.fresh,
    medianPlantedMs: median(c.planted),
    medianFreshMs: median(c.fresh),
    test: mannWhitneyLess(c.planted, c.fresh),
  };
}

/** One-token requests, timed; failures counted. */
export class Timer {
  readonly #client: ClientOptions;
  readonly #model: string;
  failures = 0;

  constructor(client: ClientOptions, model: string) {
    this.#client = client;
    this.#model = model;
  }

  /** The time (ms) of one greedy one-token chat (with `extra` fields), or null when it failed. */
  async time(
    key: string | undefined,
    content: string,
    extra: Record<string, unknown> = {},
  ): Promise<number | null> {
    const o = await postChat(this.#client, key, {
      model: this.#model,
      messages: [{ role: "user", content }],
      max_tokens: 1,
      temperature: 0,
      ...extra,
    });
    if (o.status !== 200) {
      this.failures++;
      return null;
    }
    return o.elapsedMs;
  }

  /** The planted prefix and a fresh one with the same question, in a random order, into `into`. */
  async pair(
    key: string | undefined,
    planted: string,
    fresh: string,
    question: string,
    rng: Prng,
    into: { planted: number[]; fresh: number[] },
  ): Promise<void> {
    await this.pairOf(
      () => this.time(key, `${planted}\n${question}`),
      () => this.time(key, `${fresh}\n${question}`),
      rng,
      into,
    );
  }

  /** Two timed requests, the planted one and the fresh one, in a random order, into `into`. */
  async pairOf(
    planted: () => Promise<number | null>,
    fresh: () => Promise<number | null>,
    rng: Prng,
    into: { planted: number[]; fresh: number[] },
  ): Promise<void> {
    const plantedFirst = rng.nextInt(2) === 0;
    const first = await (plantedFirst ? planted : fresh)();
    const second = await (plantedFirst ? fresh : planted)();
    const [p, f] = plantedFirst ? [first, second] : [second, first];
    if (p === null || f === null) return;
    into.planted.push(p);
    into.fresh.push(f);
  }
}

async function firstModel(baseUrl: string, key: string | undefined): Promise<string> {
  const res = await fetch(`${baseUrl}/v1/models`, {
    headers: key === undefined ? {} : { authorization: `Bearer ${key}` },
    signal: AbortSignal.timeout(30_000),
  });
  const body = (await res.json().catch(() => null)) as { data?: { id?: unknown }[] } | null;
  const id = body?.data?.[0]?.id;
  if (res.status !== 200 || typeof id !== "string")
    throw new Error(`GET ${baseUrl}/v1/models gave no model (HTTP ${res.status}); pass --model`);
  return id;
}

/** One comparison's line of a report. */
export function comparisonLine(label: string, c: TimingComparison): string {
  return `${label}: median ${c.medianPlantedMs.toFixed(1)} ms after the plant vs ${c.medianFreshMs.toFixed(1)} ms fresh (${c.plantedMs.length} pairs), Mann–Whitney one-sided p = ${c.test.p.toPrecision(3)}`;
}

/** The human-readable report. */
export function renderTimingReport(r: TimingReport): string {
  const line = comparisonLine;
  const verdict = {
    leak: `LEAK: tenant B's first token is faster after tenant A planted the prefix (p < ${r.alpha}): another tenant's prompts reach B's timing (a prefix cache shared across tenants)`,
    "no-leak": `no timing leak: tenant B is not measurably faster after A's plant, while A's own repeat is (the prefix cache works and is fenced per tenant)`,
    inconclusive: `inconclusive: neither tenant is measurably faster after the plant (no prefix cache, or too few trials or too short a prefix to see one)`,
  }[r.verdict];
  return [
    `kvfence probe --timing: ${r.trials} paired trials, prefixes of ${r.prefixChars} characters, one-token requests one at a time${r.evictRequests > 0 ? `, each plant pushed out of the KV pool by ${r.evictRequests} fresh prompts of A (the tiers' case)` : ""}${r.failures > 0 ? `, ${r.failures} failed requests` : ""}`,
    line("tenant B after tenant A's plant (the leak)", r.crossTenant),
    line("tenant A after its own plant (power check)", r.sameTenant),
    verdict,
  ].join("\n");
}
