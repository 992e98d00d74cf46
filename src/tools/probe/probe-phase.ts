/**
 * The probe's main phase: tenant B sends prompts at and around every known limit (just under, at
 * and over the effective limit, over the pool but under the context window — the incident's shape —
 * over the context, very long), malformed requests and empty content, mixed with ordinary load
 * that asks for A's accounts with none of A's records in B's context; all shuffled, at the run's
 * concurrency, each answer judged (judge.ts).
 */
import { buildPrompt, type CanaryIndex } from "./canary.js";
import { postRaw } from "./chat-client.js";
import { effectiveLimit } from "./discover.js";
import { judge } from "./judge.js";
import { charsForTokens, type TokenFit } from "./plant-phase.js";
import { askingPrompt, type ProbeCase, type ProbeRun, runPool, send, shuffle } from "./probe-run.js";

export interface ProbePhaseInput {
  readonly maxModelLen: number | null;
  readonly poolTokens: number | null;
  /** Ordinary load requests. */
  readonly requests: number;
  readonly fit: TokenFit;
  /** Cap on any prompt's size in characters. */
  readonly maxPromptChars: number;
}

type Mode = "plain" | "stream";
const BOTH: readonly Mode[] = ["plain", "stream"];

export async function probePhase(ctx: ProbeRun, input: ProbePhaseInput): Promise<void> {
  const cases: ProbeCase[] = [
    ...limitCases(ctx, input),
    ...malformedCases(ctx),
    {
      name: "empty-content",
      send: () => send(ctx, { key: ctx.keyB, content: "", stream: false }),
      expect: "any",
      malformed: false,
      askOwn: null,
      estTokens: null,
    },
  ];
  const aAccounts = plantedAccounts(ctx.aCodes);
  for (let i = 0; i < input.requests; i++) {
    cases.push(loadCase(ctx, { name: `load#${i}`, aAccounts, stream: i % 2 === 1 }));
  }
  shuffle(cases, ctx.rng);
  ctx.progress(`probe: tenant B sends ${cases.length} requests at concurrency ${ctx.concurrency}`);
  let done = 0;
  await runPool(cases, ctx.concurrency, async (c) => {
    const out = await c.send();
    judge({ ctx, phase: "probe", c, out });
    done++;
    if (done % 10 === 0 || done === cases.length) ctx.progress(`probe: ${done}/${cases.length}`);
  });
}

/** A prompt of about `tokens` tokens asking for one of B's own records, sent in each of `modes`. */
interface SizedCase {
  readonly name: string;
  readonly tokens: number;
  readonly expect: "ok" | "reject";
  readonly modes: readonly Mode[];
}

/** The prompts at and around every known limit (none when the context length is unknown). */
function limitCases(ctx: ProbeRun, input: ProbePhaseInput): ProbeCase[] {
  const { maxModelLen: L, poolTokens: P, fit } = input;
  const E = effectiveLimit(L, P);
  const status = ctx.phases.get("status")!;
  if (L === null || E === null) {
    status.skipped = "max_model_len unknown (pass --max-model-len); only malformed requests checked";
    ctx.warnings.push("Context length unknown: limit prompts were not sent; pass --max-model-len");
    return [];
  }
  const sizes: SizedCase[] = [];
  const M = ctx.maxTokens;
  if (E - M - 16 > 32) sizes.push({ name: "under-limit", tokens: E - M - 16, expect: "ok", modes: BOTH });
  // Exactly at the limit leaves no room for one output token; without a calibrated token count, step
  // a few tokens over so a guessed template overhead cannot land the prompt under the limit.
  sizes.push({ name: "at-limit", tokens: fit.calibrated ? E : E + 8, expect: "reject", modes: BOTH });
  sizes.push({ name: "over-limit", tokens: E + 16, expect: "reject", modes: BOTH });
  if (P !== null && P < L) {
    // The incident's shape: over the pool but under the context window.
    if (P + 64 < L)
      sizes.push({ name: "over-pool-under-context", tokens: P + 64, expect: "reject", modes: BOTH });
    sizes.push({ name: "over-context", tokens: L + 16, expect: "reject", modes: ["plain"] });
  } else if (P !== null) {
    sizes.push({ name: "over-pool", tokens: P + 16, expect: "reject", modes: ["plain"] });
  }
  const big = Math.max(L, P ?? 0);
  const veryLong = Math.max(E + 1024, Math.min(2 * big, big + 4_194_304));
  sizes.push({ name: "very-long", tokens: veryLong, expect: "reject", modes: ["plain"] });
  return sizes.flatMap((size) => sizedCases(ctx, input, { ...size, limit: E }));
}

/** A sized case's prompt, judged against the effective `limit`. */
function sizedCases(ctx: ProbeRun, input: ProbePhaseInput, size: SizedCase & { limit: number }): ProbeCase[] {
  const { limit } = size;
  const { fit } = input;
  const chars = Math.min(input.maxPromptChars, charsForTokens(fit, size.tokens));
  const { ask: own, content } = askingPrompt(ctx, Math.max(2, Math.min(64, Math.floor(chars / 4096))), chars);
  const est = Math.round(content.length * fit.perChar + fit.overhead);
  // A prompt the size cap kept under the limit proves nothing about rejection.
  const expect = size.expect === "reject" && est < limit ? "any" : size.expect;
  return size.modes.map((mode) => ({
    name: `${size.name}/${mode}`,
    send: () => send(ctx, { key: ctx.keyB, content, stream: mode === "stream" }),
    expect,
    malformed: false,
    askOwn: own,
    estTokens: est,
  }));
}

/** Requests every server must refuse with a 4xx: no messages, bad JSON, wrong types. */
function malformedCases(ctx: ProbeRun): ProbeCase[] {
  const model = ctx.model;
  const M = ctx.maxTokens;
  const malformed: Array<[string, string]> = [
    ["empty-messages", JSON.stringify({ model, messages: [], max_tokens: M, temperature: 0 })],
    ["bad-json", `{"model": ${JSON.stringify(model)}, "messages": [{"role": "user", "content": "hi"`],
    ["messages-not-array", JSON.stringify({ model, messages: "What is the access code?", max_tokens: M })],
    [
      "max-tokens-string",
      JSON.stringify({ model, messages: [{ role: "user", content: "hello" }], max_tokens: "sixteen" }),
    ],
    [
      "temperature-string",
      JSON.stringify({
        model,
        messages: [{ role: "user", content: "hello" }],
        max_tokens: M,
        temperature: "hot",
      }),
    ],
    ["content-number", JSON.stringify({ model, messages: [{ role: "user", content: 4821 }], max_tokens: M })],
  ];
  return malformed.map(([name, raw]) => ({
    name,
    send: () => {
      ctx.sent++;
      return postRaw(ctx.client, ctx.keyB, raw, false);
    },
    expect: "reject",
    malformed: true,
    askOwn: null,
    estTokens: null,
  }));
}

/** One ordinary load request: B asks for one of A's accounts with only B's own records in its context. */
export function loadCase(
  ctx: ProbeRun,
  { name, aAccounts, stream }: { name: string; aAccounts: readonly string[]; stream: boolean },
): ProbeCase {
  const records = ctx.canaries.records(2 + ctx.rng.int(3));
  const askA = aAccounts.length > 0 ? ctx.rng.pick(aAccounts) : ctx.canaries.record().account;
  const content = buildPrompt({
    records,
    askAccount: askA,
    targetChars: 200 + ctx.rng.int(600),
    templates: ctx.templates,
    rng: ctx.rng,
  });
  return {
    name: `${name}/${stream ? "stream" : "plain"}`,
    send: () => send(ctx, { key: ctx.keyB, content, stream }),
    expect: "ok",
    malformed: false,
    askOwn: null,
    askAbsent: true,
    estTokens: null,
  };
}

export function plantedAccounts(index: CanaryIndex): string[] {
  return index.records().map((r) => r.account);
}
