/**
 * The chaos campaign's workload: the canary workload of two tenants — each plants records (unique
 * access codes, src/tools/probe/canary.ts) in prompts that ask one back — and plain prompts both
 * send, all greedy. `reference` runs every (tenant, prompt) once on a server with no fault (one
 * engine apart from the cluster): those answers are what every 200 of the cluster must equal. `drive` sends requests from a seeded generator (tenant,
 * prompt, router, streamed or not) at a fixed concurrency until its deadline, and judges each:
 * completed (a 200 whose answer is the reference), wrong (a 200 with another answer, or a stream
 * ended by an error event whose text is not a prefix of the reference), failed (any other
 * outcome), and a leak whenever an output of one tenant holds a code the other planted.
 */
import { buildPrompt, CanaryFactory, CanaryIndex, checkTemplates, Rng } from "../probe/canary.js";
import { type ChatOutcome, postChat } from "../probe/chat-client.js";
import { runPool } from "../probe/probe-run.js";

const PLAIN = [
  "Tell me about item number {n} please.",
  "Write one sentence about the number {n}.",
  "What comes after {n}?",
  "Describe a quiet harbour town, version {n}.",
];

export interface Prompt {
  readonly id: string;
  readonly tenant: number;
  readonly content: string;
  /** The planted code a canary prompt asks back. */
  readonly ask?: string;
  /** A long request: this many tokens with `ignore_eos` (a stream long enough for a fault to cut). */
  readonly longTokens?: number;
}

export interface RequestRecord {
  readonly atMs: number;
  readonly prompt: string;
  readonly tenant: number;
  readonly router: number;
  readonly stream: boolean;
  readonly status: number;
  readonly outcome: "completed" | "wrong" | "failed";
  readonly elapsedMs: number;
  readonly error: string | null;
  /** Codes of the other tenant found in this output. */
  readonly leaked: string[];
  /** The output, when it was wrong or leaked. */
  readonly text?: string;
}

export interface Workload {
  readonly keys: readonly string[];
  readonly prompts: readonly Prompt[];
  /** Codes each tenant planted. */
  readonly planted: readonly CanaryIndex[];
  readonly maxTokens: number;
  readonly model: string;
  /** Prompt id → its fault-free greedy answer. */
  readonly reference: Map<string, string>;
}

/**
 * Two tenants' keys, `canaries` canary prompts each (3 records in about 400 characters), `plain`
 * plain prompts each and `long` long ones (plain prompts run to `longTokens` with `ignore_eos`).
 */
export function buildWorkload(input: {
  seed: number;
  keys: readonly [string, string];
  canaries: number;
  plain: number;
  long: number;
  longTokens: number;
  maxTokens: number;
  model: string;
}): Workload {
  const rng = new Rng(input.seed ^ 0x5eed);
  const factory = new CanaryFactory(rng);
  const templates = checkTemplates(
    "the access code of account {account} is {code}.",
    "What is the access code of account {account}?",
  );
  const planted = [new CanaryIndex(), new CanaryIndex()];
  const prompts: Prompt[] = [];
  for (const tenant of [0, 1]) {
    for (let i = 0; i < input.canaries; i++) {
      const records = factory.records(3);
      for (const r of records) planted[tenant]!.add(r);
      const ask = rng.pick(records);
      const content = buildPrompt({ records, askAccount: ask.account, targetChars: 400, templates, rng });
      prompts.push({ id: `canary-${tenant}-${i}`, tenant, content, ask: ask.code });
    }
    for (let i = 0; i < input.plain; i++) {
      const content = PLAIN[i % PLAIN.length]!.replace("{n}", String(7 * i + 3));
      prompts.push({ id: `plain-${tenant}-${i}`, tenant, content });
    }
    for (let i = 0; i < input.long; i++) {
      const content = `Write a long story about item ${11 * i + 5}.`;
      prompts.push({ id: `long-${tenant}-${i}`, tenant, content, longTokens: input.longTokens });
    }
  }
  return { ...input, prompts, planted, reference: new Map() };
}

function send(w: Workload, url: string, p: Prompt, stream: boolean, timeoutMs: number): Promise<ChatOutcome> {
  return postChat({ baseUrl: url, timeoutMs }, w.keys[p.tenant], {
    model: w.model,
    messages: [{ role: "user", content: p.content }],
    temperature: 0,
    max_tokens: p.longTokens ?? w.maxTokens,
    ...(p.longTokens === undefined ? {} : { ignore_eos: true }),
    stream,
  });
}

/** The codes of the tenant other than `tenant` in `out`'s text or error body. */
function leaks(w: Workload, tenant: number, out: ChatOutcome): string[] {
  const other = w.planted[1 - tenant]!;
  return other.scan(`${out.text}\n${out.rawExcerpt}\n${out.error ?? ""}`).map((h) => h.code);
}

/** Every prompt once, on the fault-free server at `url`: fills `w.reference`; throws on a failure or leak. */
export async function reference(w: Workload, url: string, concurrency: number): Promise<void> {
  await runPool(w.prompts, concurrency, async (p) => {
    const out = await send(w, url, p, false, 120_000);
    if (out.status !== 200)
      throw new Error(`The fault-free reference of ${p.id} failed: ${out.status} ${out.error}`);
    const leaked = leaks(w, p.tenant, out);
    if (leaked.length > 0)
      throw new Error(`The fault-free reference of ${p.id} leaked: ${leaked.join(", ")}`);
    w.reference.set(p.id, out.text);
  });
}

/**
 * A request against its fault-free answer `want`: completed (a 200 with exactly it), wrong (a 200
 * with another answer, or a stream cut by an error event after text that is not a prefix of it) or
 * failed (a non-200, no response, or a cut stream whose text so far is right).
 */
export function classify(out: ChatOutcome, want: string): RequestRecord["outcome"] {
  if (out.status !== 200) return "failed";
  if (!out.inBandError) return out.text === want ? "completed" : "wrong";
  return want.startsWith(out.text) ? "failed" : "wrong";
}

/**
 * Canary prompts whose fault-free answer restates the code they ask for, of all canary prompts:
 * a model that repeats its context shows a leaked code in its output, so the leak check can see.
 */
export function canariesRepeated(w: Workload): { repeated: number; canaries: number } {
  const canaries = w.prompts.filter((p) => p.ask !== undefined);
  const repeated = canaries.filter((p) => w.reference.get(p.id)?.includes(p.ask!)).length;
  return { repeated, canaries: canaries.length };
}

/** Requests from `seed` at `concurrency` in flight until `until()` is true; each judged and recorded. */
export async function drive(
  w: Workload,
  input: {
    readonly urls: readonly string[];
    readonly seed: number;
    readonly concurrency: number;
    readonly timeoutMs: number;
    readonly until: () => boolean;
    readonly startMs: number;
  },
): Promise<RequestRecord[]> {
  const rng = new Rng(input.seed ^ 0x10ad);
  const records: RequestRecord[] = [];
  const worker = async () => {
    while (!input.until()) {
      const p = rng.pick(w.prompts);
      const router = rng.int(input.urls.length);
      const stream = rng.next() < 0.5;
      const atMs = Date.now() - input.startMs;
      const out = await send(w, input.urls[router]!, p, stream, input.timeoutMs);
      const outcome = classify(out, w.reference.get(p.id)!);
      const leaked = leaks(w, p.tenant, out);
      records.push({
        atMs,
        prompt: p.id,
        tenant: p.tenant,
        router,
        stream,
        status: out.status,
        outcome,
        elapsedMs: Math.round(out.elapsedMs),
        error: out.error,
        leaked,
        ...(outcome === "wrong" || leaked.length > 0 ? { text: out.text } : {}),
      });
    }
  };
  await Promise.all(Array.from({ length: input.concurrency }, worker));
  return records;
}
