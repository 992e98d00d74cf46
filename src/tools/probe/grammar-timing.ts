/**
 * `kvfence probe URL --timing --timing-case grammar`: a timing side-channel audit of a server's
 * compiled-grammar cache (structured output), as an outside tenant. A server that caches compiled
 * JSON schemas across tenants answers tenant B's constrained request faster when tenant A already
 * sent the same schema — so B learns, by timing, which schemas A uses. kvfence keeps the cache per
 * tenant (docs/api.md, "Structured output").
 *
 * The design of the prefix-cache audit (timing.ts): each trial draws a fresh random schema S
 * (`schemaProperties` properties of random names and kinds, never sent before), tenant A sends a
 * request constrained by S (the plant); then tenant B sends, in a random order, a request with S
 * and one with a fresh schema of the same shape; and tenant A does the same (the power check: a
 * cache of A's own shows there). Every request is the same short chat, one greedy token, not
 * streamed, constrained by `response_format: {"type": "json_schema"}`: its time is the schema's
 * compilation (unless cached) plus the first token. A one-sided Mann–Whitney U test on each pair
 * of samples; the verdict is the prefix audit's (`verdictOf`).
 */
import { Prng } from "../../lib/prng.js";
import type { ClientOptions } from "./chat-client.js";
import {
  compare,
  comparisonLine,
  firstModel,
  Timer,
  type TimingComparison,
  type TimingOptions,
  verdictOf,
} from "./timing.js";

export interface GrammarTimingOptions extends Omit<TimingOptions, "prefixChars"> {
  /** Properties of each schema (default 24): more make each compilation longer, and easier to see. */
  readonly schemaProperties?: number;
}

export interface GrammarTimingReport {
  readonly trials: number;
  readonly schemaProperties: number;
  readonly alpha: number;
  /** Tenant B after tenant A sent the schema: the leak under test. */
  readonly crossTenant: TimingComparison;
  /** Tenant A after its own: the power check. */
  readonly sameTenant: TimingComparison;
  readonly failures: number;
  readonly verdict: "leak" | "no-leak" | "inconclusive";
}

const QUESTION = "Fill in the form.";

/** A JSON Schema of `properties` properties, their names and bounds random (unlike any other). */
export function randomSchema(rng: Prng, properties: number): Record<string, unknown> {
  const props: Record<string, unknown> = {};
  const tag = rng.nextUint32().toString(36);
  for (let i = 0; i < properties; i++) {
    const name = `${tag}_${i}_${rng.nextUint32().toString(36)}`;
    switch (rng.nextInt(4)) {
      case 0:
        props[name] = { type: "string", minLength: 1, maxLength: 4 + rng.nextInt(60) };
        break;
      case 1:
        props[name] = { type: "integer", minimum: -rng.nextInt(1000), maximum: rng.nextInt(100_000) };
        break;
      case 2:
        props[name] = {
          enum: Array.from({ length: 3 + rng.nextInt(5) }, () => rng.nextUint32().toString(36)),
        };
        break;
      default:
        props[name] = { type: "array", items: { type: "number" }, maxItems: 1 + rng.nextInt(8) };
    }
  }
  return { type: "object", properties: props, required: Object.keys(props), additionalProperties: false };
}

function constrainedBy(schema: Record<string, unknown>): Record<string, unknown> {
  return { response_format: { type: "json_schema", json_schema: { name: "form", schema, strict: true } } };
}

export async function runGrammarTimingProbe(options: GrammarTimingOptions): Promise<GrammarTimingReport> {
  const trials = options.trials ?? 40;
  const properties = options.schemaProperties ?? 24;
  const alpha = options.alpha ?? 0.01;
  const rng = new Prng(options.seed ?? 1);
  const client: ClientOptions = { baseUrl: options.baseUrl, timeoutMs: options.timeoutMs ?? 120_000 };
  const model = options.model ?? (await firstModel(options.baseUrl, options.apiKeyA));
  const timer = new Timer(client, model);
  const time = (key: string | undefined, schema: Record<string, unknown>) => () =>
    timer.time(key, QUESTION, constrainedBy(schema));
  const cross = { planted: [] as number[], fresh: [] as number[] };
  const same = { planted: [] as number[], fresh: [] as number[] };
  // One request of each tenant before the trials, outside the figures (first-use costs).
  await time(options.apiKeyA, randomSchema(rng, properties))();
  await time(options.apiKeyB, randomSchema(rng, properties))();
  for (let i = 0; i < trials; i++) {
    const planted = randomSchema(rng, properties);
    await time(options.apiKeyA, planted)();
    await timer.pairOf(
      time(options.apiKeyB, planted),
      time(options.apiKeyB, randomSchema(rng, properties)),
      rng,
      cross,
    );
    await timer.pairOf(
      time(options.apiKeyA, planted),
      time(options.apiKeyA, randomSchema(rng, properties)),
      rng,
      same,
    );
    if ((i + 1) % 10 === 0) options.onProgress?.(`grammar timing: ${i + 1}/${trials} trials`);
  }
  const crossTenant = compare(cross);
  const sameTenant = compare(same);
  return {
    trials,
    schemaProperties: properties,
    alpha,
    crossTenant,
    sameTenant,
    failures: timer.failures,
    verdict: verdictOf(crossTenant, sameTenant, alpha),
  };
}

/** The human-readable report. */
export function renderGrammarTimingReport(r: GrammarTimingReport): string {
  const verdict = {
    leak: `LEAK: tenant B's constrained request is faster after tenant A sent the same schema (p < ${r.alpha}): B can tell which schemas A uses (a grammar cache shared across tenants)`,
    "no-leak": `no timing leak: tenant B is not measurably faster after A sent the schema, while A's own repeat is (the grammar cache works and is fenced per tenant)`,
    inconclusive: `inconclusive: neither tenant is measurably faster with a schema sent before (no grammar cache, or too few trials or too small a schema to see one)`,
  }[r.verdict];
  return [
    `kvfence probe --timing (grammar cache): ${r.trials} paired trials, schemas of ${r.schemaProperties} properties, one-token requests one at a time${r.failures > 0 ? `, ${r.failures} failed requests` : ""}`,
    comparisonLine("tenant B after tenant A's schema (the leak)", r.crossTenant),
    comparisonLine("tenant A after its own schema (power check)", r.sameTenant),
    verdict,
  ].join("\n");
}
