/**
 * One probe run's shared state and the doors every phase goes through: the options of a run, the
 * run itself (its client, the two tenants' keys, the model, the seeded generator, tenant A's
 * planted codes, the findings and warnings per phase), the case a phase sends and judges, sending a
 * chat or a GET (each counted), recording a finding or a warning against its phase, and running
 * jobs at a bounded concurrency.
 */
import {
  buildPrompt,
  type CanaryFactory,
  type CanaryIndex,
  type CanaryRecord,
  type PromptTemplates,
  type Rng,
} from "./canary.js";
import { type ChatOutcome, type ClientOptions, postChat } from "./chat-client.js";
import type { Finding, PhaseSummary, ProbePhase } from "./probe-report.js";

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
  /**
   * Where a kvfence router's /kvfence/nodes is, when not on `baseUrl`: its operator listener
   * (`--operator-port`, loopback by default), e.g. http://127.0.0.1:8001.
   */
  readonly operatorUrl?: string;
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

export interface ProbeCase {
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

export interface ProbeRun {
  readonly client: ClientOptions;
  readonly keyA: string | undefined;
  readonly keyB: string | undefined;
  readonly operatorKey: string | undefined;
  /** The base URL of /kvfence/nodes: the operator listener's, or the server's. */
  readonly operatorUrl: string;
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

/** One chat request of the run: greedy, the run's model and max_tokens. */
export interface ChatSend {
  readonly key: string | undefined;
  readonly content: string;
  readonly stream: boolean;
}

export function send(ctx: ProbeRun, { key, content, stream }: ChatSend): Promise<ChatOutcome> {
  ctx.sent++;
  return postChat(ctx.client, key, {
    model: ctx.model,
    messages: [{ role: "user", content }],
    temperature: 0,
    max_tokens: ctx.maxTokens,
    stream,
  });
}

/** `count` fresh records and a prompt of `chars` characters around them asking for one: the one asked. */
export function askingPrompt(
  ctx: ProbeRun,
  count: number,
  chars: number,
): { records: CanaryRecord[]; ask: CanaryRecord; content: string } {
  const records = ctx.canaries.records(count);
  const ask = ctx.rng.pick(records);
  const content = buildPrompt({
    records,
    askAccount: ask.account,
    targetChars: chars,
    templates: ctx.templates,
    rng: ctx.rng,
  });
  return { records, ask, content };
}

/** Records `finding` (its status and output excerpt from `out`) against its phase. */
export function find(ctx: ProbeRun, finding: Omit<Finding, "status" | "excerpt">, out: ChatOutcome): void {
  ctx.phases.get(finding.phase)!.findings++;
  ctx.findings.push({
    ...finding,
    status: out.status,
    excerpt: (out.text || out.rawExcerpt).slice(0, 200),
  });
}

export function warn(ctx: ProbeRun, phase: ProbePhase, message: string): void {
  ctx.phases.get(phase)!.warnings++;
  ctx.warnings.push(message);
}

export async function getJson(
  ctx: ProbeRun,
  path: string,
  key: string | undefined,
  baseUrl = ctx.client.baseUrl,
): Promise<{ status: number; json: unknown; error: string | null }> {
  ctx.sent++;
  const headers: Record<string, string> = { accept: "application/json" };
  if (key !== undefined) headers.authorization = `Bearer ${key}`;
  try {
    const timeout = AbortSignal.timeout(Math.min(ctx.client.timeoutMs, 30_000));
    const signal = ctx.client.signal === undefined ? timeout : AbortSignal.any([timeout, ctx.client.signal]);
    const res = await fetch(`${baseUrl}${path}`, { headers, signal });
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

/**
 * Run `fn` over `items` with at most `limit` in flight; results in input order. Also the bench's and
 * chaos's work lists. Hand-written (eight lines) because the probe imports no npm package
 * (src/import-rules.test.ts), so that it runs against any server from a bare checkout.
 */
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

export function shuffle<T>(items: T[], rng: Rng): void {
  for (let i = items.length - 1; i > 0; i--) {
    const j = rng.int(i + 1);
    [items[i], items[j]] = [items[j]!, items[i]!];
  }
}
