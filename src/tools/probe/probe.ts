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
 * Imports only src/lib and src/protocol, and talks only to the base URL it is given.
 */
import { KvfenceError } from "../../lib/errors.js";
import { NODES_INFO_PATH, nodesInfoSchema } from "../../protocol/admin-wire.js";
import {
  buildPrompt,
  CanaryFactory,
  CanaryIndex,
  type CanaryRecord,
  checkTemplates,
  DEFAULT_QUESTION_TEMPLATE,
  DEFAULT_RECORD_TEMPLATE,
  type PromptTemplates,
  Rng,
} from "./canary.js";
import { type ChatOutcome, type ClientOptions, postChat, postRaw } from "./chat-client.js";
import {
  type Finding,
  type FindingKind,
  type PhaseSummary,
  PROBE_PHASES,
  type ProbePhase,
  type ProbeReport,
} from "./probe-report.js";

export interface ProbeOptions {
  /** Server base URL, with or without a trailing `/v1`. */
  readonly baseUrl: string;
  /** Tenant A's API key (plants the canaries). */
  readonly apiKeyA?: string;
  /** Tenant B's API key (probes); defaults to A's. */
  readonly apiKeyB?: string;
  /** Model id; defaults to the first from /v1/models. */
  readonly model?: string;
  /** Context length; found from /v1/models or SGLang's server info when not given. */
  readonly maxModelLen?: number;
  /** KV pool tokens; found from /kvfence/nodes or SGLang's server info when not given. */
  readonly poolTokens?: number;
  /** The bearer token for a kvfence router's /kvfence/nodes (its operator key); default tenant A's key. */
  readonly operatorKey?: string;
  /** Ordinary load requests in the probe phase (default 24). */
  readonly requests?: number;
  /** Requests in flight at once (default 4). */
  readonly concurrency?: number;
  /** Per-request timeout (default 120 s). */
  readonly timeoutMs?: number;
  /** Budget for the whole run (default 15 min); requests still pending are abandoned. */
  readonly overallTimeoutMs?: number;
  readonly seed?: number;
  readonly recordTemplate?: string;
  readonly questionTemplate?: string;
  /** max_tokens of every request (default 48: kvfence-tiny restates the whole record, 44 bytes). */
  readonly maxTokens?: number;
  /** Number of plant prompts from A (default 8). */
  readonly plants?: number;
  /** Largest plant prompt in characters (default min(2048, limit ÷ 2)). */
  readonly plantChars?: number;
  /** Cap on any prompt's size in characters (default 8 Mi). */
  readonly maxPromptChars?: number;
  /** Progress lines (the CLI writes them to stderr). */
  readonly onProgress?: (line: string) => void;
}

interface ProbeCase {
  readonly name: string;
  readonly send: () => Promise<ChatOutcome>;
  /** ok: a 200 is expected; reject: a 4xx is required; any: only the output is checked. */
  readonly expect: "ok" | "reject" | "any";
  readonly malformed: boolean;
  /** B's own record the question asks about: a 200 must answer with its code. */
  readonly askOwn: CanaryRecord | null;
  /** The question asks about an account absent from the prompt: a code-shaped answer is suspicious. */
  readonly askAbsent?: boolean;
  /** Estimated prompt tokens (for the usage check), or null. */
  readonly estTokens: number | null;
}

interface Ctx {
  readonly client: ClientOptions;
  readonly keyA: string | undefined;
  readonly keyB: string | undefined;
  readonly operatorKey: string | undefined;
  model: string;
  readonly maxTokens: number;
  readonly concurrency: number;
  readonly templates: PromptTemplates;
  readonly rng: Rng;
  readonly canaries: CanaryFactory;
  readonly aCodes: CanaryIndex;
  readonly findings: Finding[];
  readonly warnings: string[];
  readonly phases: Map<ProbePhase, PhaseSummary>;
  readonly progress: (line: string) => void;
  sent: number;
  reliable: boolean;
}

const TEMPLATE_TOKENS_GUESS = 10;
/** An access-code-shaped string (the default record format). */
const CODE_SHAPE = /\b[A-Z0-9]{3}-[A-Z0-9]{3}\b/;
const DEFAULT_MAX_PROMPT_CHARS = 8 * 1024 * 1024;

/** Run the probe. Never throws for server behaviour: failures to run become `outcome: "error"`. */
export async function runProbe(options: ProbeOptions): Promise<ProbeReport> {
  const started = Date.now();
  const startedAt = new Date(started).toISOString();
  const seed = options.seed ?? Math.floor(Math.random() * 2 ** 31);
  const baseUrl = normalizeBaseUrl(options.baseUrl);
  const overall = new AbortController();
  const overallMs = options.overallTimeoutMs ?? 15 * 60_000;
  const timer = setTimeout(() => overall.abort(new Error("overall timeout")), overallMs);
  const phases = new Map<ProbePhase, PhaseSummary>(
    PROBE_PHASES.map((p) => [p, { phase: p, checks: 0, findings: 0, warnings: 0, skipped: null }]),
  );
  const rng = new Rng(seed);
  const ctx: Ctx = {
    client: { baseUrl, timeoutMs: options.timeoutMs ?? 120_000, signal: overall.signal },
    keyA: options.apiKeyA,
    keyB: options.apiKeyB ?? options.apiKeyA,
    operatorKey: options.operatorKey ?? options.apiKeyA,
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
  const base = {
    version: 1 as const,
    baseUrl,
    seed,
    settings: {
      requests: options.requests ?? 24,
      concurrency: ctx.concurrency,
      maxTokens: ctx.maxTokens,
      timeoutMs: ctx.client.timeoutMs,
      overallTimeoutMs: overallMs,
    },
    startedAt,
  };
  let discovered: Discovery | null = null;
  let planted = { codes: 0, asked: 0, repeated: 0 };
  let tokensPerChar = 1;
  try {
    discovered = await discover(ctx, options);
    ctx.model = discovered.model;
    const run = ctx;
    const effective = effectiveLimit(discovered.maxModelLen, discovered.poolTokens);
    const plantChars =
      options.plantChars ?? Math.max(200, Math.min(2048, Math.floor((effective ?? 4096) / 2)));
    const plant = await plantPhase(run, options.plants ?? 8, plantChars);
    planted = plant.planted;
    if (plant.responded === 0) {
      throw new KvfenceError(
        "node_unavailable",
        `No plant request got an answer, check the server: ${baseUrl}`,
      );
    }
    const fit = plant.fit;
    tokensPerChar = fit.perChar;
    await probePhase(run, {
      maxModelLen: discovered.maxModelLen,
      poolTokens: discovered.poolTokens,
      requests: options.requests ?? 24,
      fit,
      maxPromptChars: options.maxPromptChars ?? DEFAULT_MAX_PROMPT_CHARS,
    });
    await determinismPhase(run, plantChars);
    if (overall.signal.aborted) {
      ctx.warnings.push(`The overall timeout of ${overallMs} ms ran out; some requests were abandoned`);
    }
    return finish("ok", null);
  } catch (err) {
    const e = err instanceof KvfenceError ? err : new KvfenceError("internal", String(err));
    return finish("error", { code: e.code, message: e.message });
  } finally {
    clearTimeout(timer);
  }

  function finish(kind: "ok" | "error", error: { code: string; message: string } | null): ProbeReport {
    const limit = discovered === null ? null : effectiveLimit(discovered.maxModelLen, discovered.poolTokens);
    return {
      ...base,
      model: discovered?.model ?? null,
      maxModelLen: discovered?.maxModelLen ?? null,
      maxModelLenSource: discovered?.maxModelLenSource ?? "unknown",
      poolTokens: discovered?.poolTokens ?? null,
      poolTokensSource: discovered?.poolTokensSource ?? "unknown",
      effectiveLimit: limit,
      tokensPerChar,
      durationMs: Date.now() - started,
      outcome: kind === "error" ? "error" : ctx.findings.length > 0 ? "findings" : "clean",
      error,
      requestsSent: ctx.sent,
      planted,
      phases: [...phases.values()],
      findings: ctx.findings,
      warnings: ctx.warnings,
    };
  }
}

interface Discovery {
  model: string;
  maxModelLen: number | null;
  maxModelLenSource: string;
  poolTokens: number | null;
  poolTokensSource: string;
}

async function discover(ctx: Ctx, options: ProbeOptions): Promise<Discovery> {
  const modelsA = await getJson(ctx, "/v1/models", ctx.keyA);
  if (modelsA.status === 0) {
    throw new KvfenceError(
      "node_unavailable",
      `Cannot reach the server (${modelsA.error}): ${ctx.client.baseUrl}`,
    );
  }
  checkAuth(modelsA.status, "A (--api-key)");
  if (ctx.keyB !== ctx.keyA) {
    const modelsB = await getJson(ctx, "/v1/models", ctx.keyB);
    checkAuth(modelsB.status, "B (--api-key-b)");
  }
  const data = arrayField(modelsA.json, "data").filter(isObject);
  if (options.model === undefined && data.length === 0) {
    throw new KvfenceError(
      "model_not_found",
      `The server lists no models on /v1/models, pass --model: HTTP ${modelsA.status}`,
    );
  }
  const model = options.model ?? String(data[0]?.id);
  const card = data.find((m) => m.id === model) ?? data[0];
  let maxModelLen: number | null = options.maxModelLen ?? null;
  let maxModelLenSource = maxModelLen === null ? "unknown" : "--max-model-len";
  const fromCard = num(card?.max_model_len);
  if (maxModelLen === null && fromCard !== null) {
    maxModelLen = fromCard;
    maxModelLenSource = "/v1/models max_model_len";
  }
  let poolTokens: number | null = options.poolTokens ?? null;
  let poolTokensSource = poolTokens === null ? "unknown" : "--pool-tokens";
  if (poolTokens === null) {
    const nodes = await getJson(ctx, NODES_INFO_PATH, ctx.operatorKey);
    const parsed = nodes.status === 200 ? nodesInfoSchema.safeParse(nodes.json) : null;
    if (parsed?.success === true && parsed.data.nodes.length > 0) {
      poolTokens = Math.min(...parsed.data.nodes.map((n) => n.pool_tokens));
      poolTokensSource = `${NODES_INFO_PATH} (smallest node pool)`;
    }
  }
  if (maxModelLen === null || poolTokens === null) {
    for (const path of ["/server_info", "/get_server_info"]) {
      const info = await getJson(ctx, path, ctx.keyA);
      if (info.status !== 200 || !isObject(info.json)) continue;
      const ctxLen = num(info.json.context_length);
      if (maxModelLen === null && ctxLen !== null) {
        maxModelLen = ctxLen;
        maxModelLenSource = `${path} context_length`;
      }
      const pool = num(info.json.max_total_num_tokens);
      if (poolTokens === null && pool !== null) {
        poolTokens = pool;
        poolTokensSource = `${path} max_total_num_tokens`;
      }
      break;
    }
  }
  ctx.progress(
    `probe: model ${model}, max_model_len ${maxModelLen ?? "unknown"} (${maxModelLenSource}), ` +
      `pool ${poolTokens ?? "unknown"} (${poolTokensSource})`,
  );
  return { model, maxModelLen, maxModelLenSource, poolTokens, poolTokensSource };
}

function checkAuth(status: number, who: string): void {
  if (status === 401 || status === 403) {
    throw new KvfenceError(
      "invalid_api_key",
      `The server refused tenant ${who}'s key on /v1/models: HTTP ${status}`,
    );
  }
}

/** Linear fit tokens ≈ perChar × chars + overhead, from the plant phase's usage reports. */
interface TokenFit {
  readonly perChar: number;
  readonly overhead: number;
  readonly calibrated: boolean;
}

function charsForTokens(fit: TokenFit, tokens: number): number {
  return Math.max(1, Math.ceil((tokens - fit.overhead) / fit.perChar));
}

async function plantPhase(
  ctx: Ctx,
  count: number,
  plantChars: number,
): Promise<{
  planted: { codes: number; asked: number; repeated: number };
  fit: TokenFit;
  responded: number;
}> {
  const summary = ctx.phases.get("plant")!;
  ctx.progress(`plant: tenant A plants ${count} prompts of up to ${plantChars} characters`);
  const jobs = Array.from({ length: count }, (_, i) => {
    // Lengths from a quarter of plantChars up to plantChars: varied sizes calibrate the token count.
    const chars = Math.round(plantChars * (0.25 + (0.75 * i) / Math.max(1, count - 1)));
    const records = ctx.canaries.records(Math.max(2, Math.min(32, Math.floor(chars / 160))));
    for (const r of records) ctx.aCodes.add(r);
    const ask = ctx.rng.pick(records);
    const content = buildPrompt({
      records,
      askAccount: ask.account,
      targetChars: chars,
      templates: ctx.templates,
      rng: ctx.rng,
    });
    return { chars: content.length, ask, content, stream: i % 2 === 1 };
  });
  let repeated = 0;
  let responded = 0;
  const samples: Array<[number, number]> = [];
  let done = 0;
  await runPool(jobs, ctx.concurrency, async (job, i) => {
    const out = await send(ctx, ctx.keyA, job.content, job.stream);
    done++;
    if (done % 4 === 0 || done === jobs.length) ctx.progress(`plant: ${done}/${jobs.length}`);
    summary.checks++;
    if (out.status === 0) {
      warn(ctx, "plant", `plant#${i}: no response (${out.error})`);
      return;
    }
    responded++;
    if (out.status !== 200) {
      warn(ctx, "plant", `plant#${i}: HTTP ${out.status} (${out.error})`);
      return;
    }
    if (out.text.includes(job.ask.code)) repeated++;
    if (out.promptTokens !== null) samples.push([job.chars, out.promptTokens]);
  });
  const asked = jobs.length;
  ctx.reliable = asked > 0 && repeated * 2 >= asked;
  if (!ctx.reliable) {
    warn(
      ctx,
      "plant",
      `Only ${repeated} of ${asked} planted codes came back: this model does not repeat its context, so leaks ` +
        "may not be visible in its output (answer checks are reported as warnings)",
    );
  }
  return { planted: { codes: ctx.aCodes.size, asked, repeated }, fit: fitTokens(samples), responded };
}

function fitTokens(samples: Array<[number, number]>): TokenFit {
  const xs = new Set(samples.map((s) => s[0]));
  if (samples.length < 2 || xs.size < 2) {
    const s = samples[0];
    if (s === undefined) return { perChar: 1, overhead: TEMPLATE_TOKENS_GUESS, calibrated: false };
    return {
      perChar: Math.max(0.05, (s[1] - TEMPLATE_TOKENS_GUESS) / s[0]),
      overhead: TEMPLATE_TOKENS_GUESS,
      calibrated: true,
    };
  }
  const n = samples.length;
  const mx = samples.reduce((a, s) => a + s[0], 0) / n;
  const my = samples.reduce((a, s) => a + s[1], 0) / n;
  let sxy = 0;
  let sxx = 0;
  for (const [x, y] of samples) {
    sxy += (x - mx) * (y - my);
    sxx += (x - mx) ** 2;
  }
  const perChar = Math.max(0.05, sxy / sxx);
  return { perChar, overhead: Math.max(0, Math.round(my - perChar * mx)), calibrated: true };
}

function effectiveLimit(maxModelLen: number | null, poolTokens: number | null): number | null {
  if (maxModelLen === null) return poolTokens;
  return poolTokens === null ? maxModelLen : Math.min(maxModelLen, poolTokens);
}

async function probePhase(
  ctx: Ctx,
  input: {
    maxModelLen: number | null;
    poolTokens: number | null;
    requests: number;
    fit: TokenFit;
    maxPromptChars: number;
  },
): Promise<void> {
  const cases: ProbeCase[] = [];
  const { maxModelLen: L, poolTokens: P, fit } = input;
  const E = effectiveLimit(L, P);
  const M = ctx.maxTokens;
  const sized = (name: string, tokens: number, expect: "ok" | "reject", modes: Array<"plain" | "stream">) => {
    const chars = Math.min(input.maxPromptChars, charsForTokens(fit, tokens));
    const records = ctx.canaries.records(Math.max(2, Math.min(64, Math.floor(chars / 4096))));
    const own = ctx.rng.pick(records);
    const content = buildPrompt({
      records,
      askAccount: own.account,
      targetChars: chars,
      templates: ctx.templates,
      rng: ctx.rng,
    });
    const est = Math.round(content.length * fit.perChar + fit.overhead);
    // A prompt the size cap kept under the limit proves nothing about rejection.
    const exp = expect === "reject" && E !== null && est < E ? "any" : expect;
    for (const mode of modes) {
      cases.push({
        name: `${name}/${mode}`,
        send: () => send(ctx, ctx.keyB, content, mode === "stream"),
        expect: exp,
        malformed: false,
        askOwn: own,
        estTokens: est,
      });
    }
  };
  const both: Array<"plain" | "stream"> = ["plain", "stream"];
  const status = ctx.phases.get("status")!;
  if (L === null || E === null) {
    status.skipped = "max_model_len unknown (pass --max-model-len); only malformed requests checked";
    ctx.warnings.push("Context length unknown: limit prompts were not sent; pass --max-model-len");
  } else {
    if (E - M - 16 > 32) sized("under-limit", E - M - 16, "ok", both);
    // Exactly at the limit leaves no room for one output token; without a calibrated token count, step
    // a few tokens over so a guessed template overhead cannot land the prompt under the limit.
    sized("at-limit", fit.calibrated ? E : E + 8, "reject", both);
    sized("over-limit", E + 16, "reject", both);
    if (P !== null && P < L) {
      // The incident's shape: over the pool but under the context window.
      if (P + 64 < L) sized("over-pool-under-context", P + 64, "reject", both);
      sized("over-context", L + 16, "reject", ["plain"]);
    } else if (P !== null) {
      sized("over-pool", P + 16, "reject", ["plain"]);
    }
    const big = Math.max(L, P ?? 0);
    sized("very-long", Math.max(E + 1024, Math.min(2 * big, big + 4_194_304)), "reject", ["plain"]);
  }
  const model = ctx.model;
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
  for (const [name, raw] of malformed) {
    cases.push({
      name,
      send: () => {
        ctx.sent++;
        return postRaw(ctx.client, ctx.keyB, raw, false);
      },
      expect: "reject",
      malformed: true,
      askOwn: null,
      estTokens: null,
    });
  }
  cases.push({
    name: "empty-content",
    send: () => send(ctx, ctx.keyB, "", false),
    expect: "any",
    malformed: false,
    askOwn: null,
    estTokens: null,
  });
  const aRecords = ctx.aCodes;
  const aAccounts = plantedAccounts(aRecords);
  for (let i = 0; i < input.requests; i++) {
    cases.push(loadCase(ctx, `load#${i}`, aAccounts, i % 2 === 1));
  }
  shuffle(cases, ctx.rng);
  ctx.progress(`probe: tenant B sends ${cases.length} requests at concurrency ${ctx.concurrency}`);
  let done = 0;
  await runPool(cases, ctx.concurrency, async (c) => {
    const out = await c.send();
    judge(ctx, c, out, "probe");
    done++;
    if (done % 10 === 0 || done === cases.length) ctx.progress(`probe: ${done}/${cases.length}`);
  });
}

/** B asks for one of A's accounts with only B's own records in its context. */
function loadCase(ctx: Ctx, name: string, aAccounts: string[], stream: boolean): ProbeCase {
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
    send: () => send(ctx, ctx.keyB, content, stream),
    expect: "ok",
    malformed: false,
    askOwn: null,
    askAbsent: true,
    estTokens: null,
  };
}

function plantedAccounts(index: CanaryIndex): string[] {
  return index.records().map((r) => r.account);
}

function judge(ctx: Ctx, c: ProbeCase, out: ChatOutcome, scanPhase: ProbePhase): void {
  const probe = ctx.phases.get(scanPhase)!;
  const status = ctx.phases.get("status")!;
  if (out.status === 0) {
    warn(ctx, scanPhase, `${c.name}: no response (${out.error})`);
    return;
  }
  probe.checks++;
  const scanned = [out.text, out.error ?? "", out.rawExcerpt].join("\n");
  const hits = ctx.aCodes.scan(scanned);
  if (hits.length > 0) {
    const list = hits.map((h) => `${h.code} (account ${h.account}, ${h.match})`).join(", ");
    find(ctx, scanPhase, "leak", c.name, `tenant B's output holds tenant A's code: ${list}`, out);
  }
  if (c.expect === "reject") {
    status.checks++;
    if (out.status === 200) {
      const kind: FindingKind = c.malformed ? "malformed-accepted" : "over-limit-accepted";
      const what = c.malformed ? "a malformed request" : `an over-limit prompt (~${c.estTokens} tokens)`;
      const inBand = out.inBandError ? " (error sent in-band in the stream)" : "";
      find(ctx, "status", kind, c.name, `HTTP 200 to ${what}${inBand}; a 4xx is required`, out);
    } else if (out.status < 400 || out.status >= 500) {
      find(ctx, "status", "not-4xx", c.name, `HTTP ${out.status} (${out.error}); a 4xx is required`, out);
    }
    return;
  }
  if (out.status !== 200) {
    if (c.expect === "ok") {
      const size = c.estTokens === null ? "" : ` (~${c.estTokens} tokens, under the limit)`;
      warn(ctx, scanPhase, `${c.name}: HTTP ${out.status}${size}: ${out.error ?? ""}`);
    } else if (out.status >= 500) {
      warn(ctx, scanPhase, `${c.name}: HTTP ${out.status}: ${out.error ?? ""}`);
    }
    return;
  }
  if (out.inBandError) warn(ctx, scanPhase, `${c.name}: stream carried an error: ${out.error}`);
  if (c.askOwn !== null) {
    probe.checks++;
    if (!out.text.includes(c.askOwn.code)) {
      const msg = `HTTP 200 but the answer is not ${c.askOwn.code} from its own context: ${JSON.stringify(out.text.slice(0, 60))}`;
      if (ctx.reliable) find(ctx, scanPhase, "wrong-answer", c.name, msg, out);
      else warn(ctx, scanPhase, `${c.name}: ${msg}`);
    }
  }
  if (c.askAbsent === true && hits.length === 0 && CODE_SHAPE.test(out.text)) {
    warn(
      ctx,
      scanPhase,
      `${c.name}: answered a code for an account that is not in its context: ${JSON.stringify(out.text.slice(0, 60))}`,
    );
  }
  if (c.estTokens !== null && out.promptTokens !== null && c.estTokens >= 256) {
    probe.checks++;
    if (out.promptTokens < c.estTokens / 2) {
      find(
        ctx,
        scanPhase,
        "usage-mismatch",
        c.name,
        `usage.prompt_tokens is ${out.promptTokens} for a prompt of ~${c.estTokens} tokens (a placeholder prompt?)`,
        out,
      );
    }
  }
}

async function determinismPhase(ctx: Ctx, plantChars: number): Promise<void> {
  const summary = ctx.phases.get("determinism")!;
  const prompts = Array.from({ length: 4 }, (_, i) => {
    const records = ctx.canaries.records(3 + i);
    return buildPrompt({
      records,
      askAccount: ctx.rng.pick(records).account,
      targetChars: Math.round(plantChars * (0.3 + 0.2 * i)),
      templates: ctx.templates,
      rng: ctx.rng,
    });
  });
  ctx.progress(`determinism: ${prompts.length} prompts alone, then twice under load`);
  const baseline: Array<ChatOutcome | null> = [];
  for (const [i, p] of prompts.entries()) {
    const out = await send(ctx, ctx.keyB, p, false);
    judge(ctx, fixedCase(`determinism#${i}/alone`), out, "determinism");
    baseline.push(out.status === 200 ? out : null);
  }
  if (baseline.every((b) => b === null)) {
    summary.skipped = "no baseline answer (every isolated request failed)";
    return;
  }
  const aAccounts = plantedAccounts(ctx.aCodes);
  for (let round = 0; round < 2; round++) {
    const jobs: Array<{ index: number | null; c: ProbeCase }> = [];
    const load = Math.max(ctx.concurrency, 2);
    for (let i = 0; i < prompts.length; i++) {
      const p = prompts[i]!;
      jobs.push({
        index: i,
        c: { ...fixedCase(`determinism#${i}/load${round}`), send: () => send(ctx, ctx.keyB, p, false) },
      });
      for (let j = 0; j < Math.ceil(load / prompts.length); j++) {
        jobs.push({
          index: null,
          c: loadCase(ctx, `determinism-load${round}.${i}.${j}`, aAccounts, (i + j + round) % 2 === 0),
        });
      }
    }
    await runPool(jobs, Math.max(2, ctx.concurrency), async (job) => {
      const out = await job.c.send();
      judge(ctx, job.c, out, "determinism");
      if (job.index === null) return;
      const base = baseline[job.index];
      if (base === null || base === undefined || out.status !== 200) return;
      summary.checks++;
      if (out.text !== base.text) {
        find(
          ctx,
          "determinism",
          "nondeterminism",
          job.c.name,
          `greedy output under load differs from the isolated run: ${JSON.stringify(base.text.slice(0, 40))} → ${JSON.stringify(out.text.slice(0, 40))}`,
          out,
        );
      }
    });
  }
}

function fixedCase(name: string): ProbeCase {
  return {
    name,
    send: () => Promise.reject(new Error("unused")),
    expect: "ok",
    malformed: false,
    askOwn: null,
    estTokens: null,
  };
}

function send(ctx: Ctx, key: string | undefined, content: string, stream: boolean): Promise<ChatOutcome> {
  ctx.sent++;
  return postChat(ctx.client, key, {
    model: ctx.model,
    messages: [{ role: "user", content }],
    temperature: 0,
    max_tokens: ctx.maxTokens,
    stream,
  });
}

function find(
  ctx: Ctx,
  phase: ProbePhase,
  kind: FindingKind,
  name: string,
  message: string,
  out: ChatOutcome,
): void {
  ctx.phases.get(phase)!.findings++;
  ctx.findings.push({
    phase,
    kind,
    case: name,
    message,
    status: out.status,
    excerpt: (out.text || out.rawExcerpt).slice(0, 200),
  });
}

function warn(ctx: Ctx, phase: ProbePhase, message: string): void {
  ctx.phases.get(phase)!.warnings++;
  ctx.warnings.push(message);
}

async function getJson(
  ctx: Ctx,
  path: string,
  key: string | undefined,
): Promise<{ status: number; json: unknown; error: string | null }> {
  ctx.sent++;
  const headers: Record<string, string> = { accept: "application/json" };
  if (key !== undefined) headers.authorization = `Bearer ${key}`;
  try {
    const timeout = AbortSignal.timeout(Math.min(ctx.client.timeoutMs, 30_000));
    const signal = ctx.client.signal === undefined ? timeout : AbortSignal.any([timeout, ctx.client.signal]);
    const res = await fetch(`${ctx.client.baseUrl}${path}`, { headers, signal });
    const text = await res.text();
    let json: unknown = null;
    try {
      json = JSON.parse(text);
    } catch {
      // Leave json null.
    }
    return { status: res.status, json, error: null };
  } catch (err) {
    return { status: 0, json: null, error: (err as Error).message };
  }
}

/** Run `fn` over `items` with at most `limit` in flight; results in input order. */
export async function runPool<T, R>(
  items: readonly T[],
  limit: number,
  fn: (item: T, index: number) => Promise<R>,
): Promise<R[]> {
  const results = new Array<R>(items.length);
  let next = 0;
  const worker = async () => {
    while (next < items.length) {
      const i = next++;
      results[i] = await fn(items[i]!, i);
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  return results;
}

function shuffle<T>(items: T[], rng: Rng): void {
  for (let i = items.length - 1; i > 0; i--) {
    const j = rng.int(i + 1);
    [items[i], items[j]] = [items[j]!, items[i]!];
  }
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

function num(v: unknown): number | null {
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function arrayField(v: unknown, key: string): unknown[] {
  const a = isObject(v) ? v[key] : undefined;
  return Array.isArray(a) ? a : [];
}
