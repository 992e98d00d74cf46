/**
 * `kvfence probe` as a library: a canary leak test for any OpenAI-compatible endpoint.
 *
 * Tenant A plants unique access codes in prompts of the bundled model's record format and asks for
 * them back (which also shows whether this model can repeat what is in its context). Tenant B then
 * sends prompts at and around every known limit (just under, at and over the context length, over
 * the KV pool, very long, empty, malformed JSON, wrong types) mixed with ordinary load that asks
 * for A's accounts with none of A's records in B's context, all at the given concurrency, streamed
 * and not. Every B output is scanned for A's codes; over-limit and malformed requests must get a
 * 4xx (a 200 is a finding even when the text looks clean); a 200 to B must answer from B's own
 * context; and greedy outputs of a fixed prompt set must be identical alone and under load.
 *
 * Imports only src/lib and src/protocol, and talks only to the base URL it is given. This module
 * runs the phases in order and builds the report; each phase is its own module (discover.ts,
 * plant-phase.ts, probe-phase.ts, determinism-phase.ts), answers are judged in judge.ts, and the
 * run's shared state and its doors are probe-run.ts.
 */
import { KvfenceError } from "../../lib/errors.js";
import {
  CanaryFactory,
  CanaryIndex,
  checkTemplates,
  DEFAULT_QUESTION_TEMPLATE,
  DEFAULT_RECORD_TEMPLATE,
  Rng,
} from "./canary.js";
import { determinismPhase } from "./determinism-phase.js";
import { type Discovery, discover, effectiveLimit } from "./discover.js";
import { plantPhase } from "./plant-phase.js";
import { probePhase } from "./probe-phase.js";
import type { PhaseSummary, ProbePhase, ProbeReport } from "./probe-report.js";
import { PROBE_PHASES } from "./probe-report.js";
import type { ProbeOptions, ProbeRun } from "./probe-run.js";

export type { ProbeOptions } from "./probe-run.js";

const DEFAULT_MAX_PROMPT_CHARS = 8 * 1024 * 1024;

/** What the report says however the run ends. */
interface RunRecord {
  readonly started: number;
  readonly base: Pick<ProbeReport, "version" | "baseUrl" | "seed" | "settings" | "startedAt">;
  discovered: Discovery | null;
  planted: ProbeReport["planted"];
  tokensPerChar: number;
}

/** Run the probe. Never throws for server behaviour: failures to run become `outcome: "error"`. */
export async function runProbe(options: ProbeOptions): Promise<ProbeReport> {
  const started = Date.now();
  const seed = options.seed ?? Math.floor(Math.random() * 2 ** 31);
  const baseUrl = normalizeBaseUrl(options.baseUrl);
  const overall = new AbortController();
  const overallMs = options.overallTimeoutMs ?? 15 * 60_000;
  const timer = setTimeout(() => overall.abort(new Error("overall timeout")), overallMs);
  const ctx = newRun(options, { baseUrl, seed, signal: overall.signal });
  const record: RunRecord = {
    started,
    base: {
      version: 1,
      baseUrl,
      seed,
      settings: {
        requests: options.requests ?? 24,
        concurrency: ctx.concurrency,
        maxTokens: ctx.maxTokens,
        timeoutMs: ctx.client.timeoutMs,
        overallTimeoutMs: overallMs,
      },
      startedAt: new Date(started).toISOString(),
    },
    discovered: null,
    planted: { codes: 0, asked: 0, repeated: 0 },
    tokensPerChar: 1,
  };
  try {
    await runPhases(ctx, options, record);
    if (overall.signal.aborted) {
      ctx.warnings.push(`The overall timeout of ${overallMs} ms ran out; some requests were abandoned`);
    }
    return report(ctx, record, null);
  } catch (err) {
    const e = err instanceof KvfenceError ? err : new KvfenceError("internal", String(err));
    return report(ctx, record, { code: e.code, message: e.message });
  } finally {
    clearTimeout(timer);
  }
}

/** A run's state from its options, its normalized base URL, its seed and its overall deadline's signal. */
function newRun(
  options: ProbeOptions,
  { baseUrl, seed, signal }: { baseUrl: string; seed: number; signal: AbortSignal },
): ProbeRun {
  const phases = new Map<ProbePhase, PhaseSummary>(
    PROBE_PHASES.map((p) => [p, { phase: p, checks: 0, findings: 0, warnings: 0, skipped: null }]),
  );
  const rng = new Rng(seed);
  return {
    client: { baseUrl, timeoutMs: options.timeoutMs ?? 120_000, signal },
    keyA: options.apiKeyA,
    keyB: options.apiKeyB ?? options.apiKeyA,
    operatorKey: options.operatorKey ?? options.apiKeyA,
    operatorUrl: options.operatorUrl === undefined ? baseUrl : normalizeBaseUrl(options.operatorUrl),
    model: "",
    maxTokens: options.maxTokens ?? 48,
    concurrency: Math.max(1, options.concurrency ?? 4),
    templates: checkTemplates(
      options.recordTemplate ?? DEFAULT_RECORD_TEMPLATE,
      options.questionTemplate ?? DEFAULT_QUESTION_TEMPLATE,
    ),
    rng,
    canaries: new CanaryFactory(rng),
    aCodes: new CanaryIndex(),
    findings: [],
    warnings: [],
    phases,
    progress: options.onProgress ?? (() => {}),
    sent: 0,
    reliable: true,
  };
}

/** Discovery, then the four phases in order; what the report needs goes into `record` as it is learnt. */
async function runPhases(ctx: ProbeRun, options: ProbeOptions, record: RunRecord): Promise<void> {
  const discovered = await discover(ctx, options);
  record.discovered = discovered;
  ctx.model = discovered.model;
  const effective = effectiveLimit(discovered.maxModelLen, discovered.poolTokens);
  const plantChars = options.plantChars ?? Math.max(200, Math.min(2048, Math.floor((effective ?? 4096) / 2)));
  const plant = await plantPhase(ctx, options.plants ?? 8, plantChars);
  record.planted = plant.planted;
  if (plant.responded === 0) {
    throw new KvfenceError(
      "node_unavailable",
      `No plant request got an answer, check the server: ${ctx.client.baseUrl}`,
    );
  }
  record.tokensPerChar = plant.fit.perChar;
  await probePhase(ctx, {
    maxModelLen: discovered.maxModelLen,
    poolTokens: discovered.poolTokens,
    requests: options.requests ?? 24,
    fit: plant.fit,
    maxPromptChars: options.maxPromptChars ?? DEFAULT_MAX_PROMPT_CHARS,
  });
  await determinismPhase(ctx, plantChars);
}

function report(
  ctx: ProbeRun,
  record: RunRecord,
  error: { code: string; message: string } | null,
): ProbeReport {
  const { discovered } = record;
  const limit = discovered === null ? null : effectiveLimit(discovered.maxModelLen, discovered.poolTokens);
  return {
    ...record.base,
    model: discovered?.model ?? null,
    maxModelLen: discovered?.maxModelLen ?? null,
    maxModelLenSource: discovered?.maxModelLenSource ?? "unknown",
    poolTokens: discovered?.poolTokens ?? null,
    poolTokensSource: discovered?.poolTokensSource ?? "unknown",
    effectiveLimit: limit,
    tokensPerChar: record.tokensPerChar,
    durationMs: Date.now() - record.started,
    outcome: error !== null ? "error" : ctx.findings.length > 0 ? "findings" : "clean",
    error,
    requestsSent: ctx.sent,
    planted: record.planted,
    phases: [...ctx.phases.values()],
    findings: ctx.findings,
    warnings: ctx.warnings,
  };
}

/** Strip trailing slashes and a trailing `/v1`, so both forms of a base URL work. */
export function normalizeBaseUrl(url: string): string {
  let u = url.trim().replace(/\/+$/, "");
  if (u.endsWith("/v1")) u = u.slice(0, -3);
  if (!/^https?:\/\//.test(u)) {
    throw new KvfenceError("invalid_request", `The base URL must start with http:// or https://: ${url}`, {
      param: "baseUrl",
    });
  }
  return u;
}
