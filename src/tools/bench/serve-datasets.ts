/**
 * The workloads of `kvfence bench serve` (docs/benchmarks.md §6): what each request asks, built
 * from a seed so that a run can be repeated.
 *
 * - `random`: one user message per request, its length drawn uniformly from
 *   [len·(1−r), len·(1+r)] tokens (as vLLM's random dataset draws it), and the same for the output.
 * - `shared-prefix`: requests in `groups` groups; every request of a group starts with the same
 *   long prefix and ends with its own suffix (the shape a prefix cache serves).
 * - `multi-turn`: sessions of `turns` turns; each turn resends the whole history (earlier user
 *   turns and the answers the server actually gave) plus a new user turn; optionally the first turn
 *   starts with a document of the session's own (`sessionPrefixLen`).
 * - `sharegpt`: the first human turn of each conversation of a ShareGPT file (JSON array or JSON
 *   lines of `{"conversations":[{"from":"human","value":…},{"from":"gpt","value":…}]}`), the gpt
 *   turn's length as the output length.
 *
 * Every request carries a nonce: a record in the bundled model's format (`the access code of
 * account 4821 is QX7-PL2.`, from the probe's canary helpers, src/tools/probe/canary.ts) whose code
 * is unique in the run. With the `ask` style the prompt ends with the question about that account,
 * so kvfence-tiny (docs/kvfence-tiny.md) answers by repeating the record; with `plant` the record
 * sits in the text without a question (for other models). Lengths are in tokens, turned into
 * characters by `charsPerToken` (1 for kvfence-tiny's byte tokens); the token counts the report
 * uses come from the server's `usage`.
 */
import { readFileSync } from "node:fs";
import { KvfenceError } from "../../lib/errors.js";
import {
  buildPrompt,
  CanaryFactory,
  type CanaryRecord,
  DEFAULT_QUESTION_TEMPLATE,
  DEFAULT_RECORD_TEMPLATE,
  type PromptTemplates,
  Rng,
} from "../probe/canary.js";

export const DATASET_NAMES = ["random", "shared-prefix", "multi-turn", "sharegpt"] as const;
export type DatasetName = (typeof DATASET_NAMES)[number];

export type NonceStyle = "ask" | "plant";

export interface DatasetOptions {
  readonly name: DatasetName;
  /** Requests in the run (for multi-turn: turns over all sessions). */
  readonly numPrompts: number;
  readonly seed: number;
  readonly nonce: NonceStyle;
  /** Characters per token of the served model's tokenizer, to size prompts. */
  readonly charsPerToken: number;
  /** random, shared-prefix (the suffix), multi-turn (each new turn): input and output tokens. */
  readonly inputLen: number;
  readonly outputLen: number;
  readonly rangeRatio: number;
  /** shared-prefix: groups and the prefix's tokens. */
  readonly prefixGroups: number;
  readonly prefixLen: number;
  /** multi-turn: turns per session. */
  readonly turns: number;
  /**
   * multi-turn: tokens of a document of its own each session's first turn starts with (a system
   * prompt or a pasted file the later turns keep resending); default 0, none.
   */
  readonly sessionPrefixLen?: number;
  /** sharegpt: the file, and a fixed output length (default: each gpt turn's length). */
  readonly datasetPath?: string;
  readonly sharegptOutputLen?: number;
}

/** One user turn of a session: the text it adds, its nonce, and the tokens it may generate. */
export interface DatasetTurn {
  /** Text the request's prompt starts with, shared by its group (shared-prefix), else "". */
  readonly prefix: string;
  /** The user turn's own text (it holds the nonce). */
  readonly content: string;
  readonly nonce: CanaryRecord;
  readonly outputLen: number;
}

/** A session: one turn for every dataset but multi-turn. Its turns run one after the other. */
export interface DatasetSession {
  readonly turns: readonly DatasetTurn[];
}

export interface Dataset {
  readonly name: DatasetName;
  readonly sessions: readonly DatasetSession[];
  /** Requests in dispatch order: turn t of every session before turn t + 1 of any. */
  readonly order: ReadonlyArray<{ readonly session: number; readonly turn: number }>;
  /** Notes for the operator (a ShareGPT file reused, entries skipped). */
  readonly notes: readonly string[];
}

/** The most requests one run can carry: nonces use 4-digit accounts, unique in the run. */
export const MAX_REQUESTS_PER_RUN = 8999;

const ASK: PromptTemplates = { record: DEFAULT_RECORD_TEMPLATE, question: DEFAULT_QUESTION_TEMPLATE };
const PLANT: PromptTemplates = { record: DEFAULT_RECORD_TEMPLATE, question: "" };

export function buildDataset(options: DatasetOptions): Dataset {
  if (options.numPrompts > MAX_REQUESTS_PER_RUN) {
    throw new KvfenceError(
      "invalid_request",
      `At most ${MAX_REQUESTS_PER_RUN} requests per run (each carries a nonce with its own 4-digit account): --num-prompts ${options.numPrompts}`,
      { param: "numPrompts" },
    );
  }
  const rng = new Rng(options.seed);
  const nonces = new CanaryFactory(rng);
  const notes: string[] = [];
  let sessions: DatasetSession[];
  switch (options.name) {
    case "random":
      sessions = Array.from({ length: options.numPrompts }, () => ({
        turns: [randomTurn(options, rng, nonces, "")],
      }));
      break;
    case "shared-prefix": {
      const prefixes = Array.from({ length: options.prefixGroups }, () =>
        filler(Math.round(options.prefixLen * options.charsPerToken), rng),
      );
      sessions = Array.from({ length: options.numPrompts }, (_, i) => ({
        turns: [randomTurn(options, rng, nonces, prefixes[i % prefixes.length]!)],
      }));
      break;
    }
    case "multi-turn": {
      const count = Math.ceil(options.numPrompts / options.turns);
      sessions = Array.from({ length: count }, (_, s) => ({
        turns: Array.from(
          { length: Math.min(options.turns, options.numPrompts - s * options.turns) },
          (_, t) =>
            randomTurn(
              options,
              rng,
              nonces,
              t === 0 && (options.sessionPrefixLen ?? 0) > 0
                ? filler(Math.round(options.sessionPrefixLen! * options.charsPerToken), rng)
                : "",
            ),
        ),
      }));
      break;
    }
    case "sharegpt":
      sessions = sharegptSessions(options, rng, nonces, notes);
      break;
  }
  const order: Array<{ session: number; turn: number }> = [];
  const longest = Math.max(0, ...sessions.map((s) => s.turns.length));
  for (let t = 0; t < longest; t++) {
    sessions.forEach((s, i) => {
      if (t < s.turns.length) order.push({ session: i, turn: t });
    });
  }
  return { name: options.name, sessions, order, notes };
}

/** The integer lengths vLLM's random dataset draws: uniform on [floor(n(1−r)), ceil(n(1+r))]. */
export function drawLength(n: number, ratio: number, rng: Rng, min: number): number {
  const lo = Math.max(min, Math.floor(n * (1 - ratio)));
  const hi = Math.max(lo, Math.ceil(n * (1 + ratio)));
  return lo + rng.int(hi - lo + 1);
}

function randomTurn(options: DatasetOptions, rng: Rng, nonces: CanaryFactory, prefix: string): DatasetTurn {
  const inputTokens = drawLength(options.inputLen, options.rangeRatio, rng, 1);
  const outputLen = drawLength(options.outputLen, options.rangeRatio, rng, 1);
  const nonce = nonces.record();
  const content = buildPrompt({
    records: [nonce],
    askAccount: nonce.account,
    targetChars: Math.round(inputTokens * options.charsPerToken),
    templates: options.nonce === "ask" ? ASK : PLANT,
    rng,
  });
  return { prefix: prefix === "" ? "" : `${prefix}\n\n`, content, nonce, outputLen };
}

/** The nonce alone: its record, and with the `ask` style the question about it. */
export function nonceTag(nonce: CanaryRecord, style: NonceStyle): string {
  return buildPrompt({
    records: [nonce],
    askAccount: nonce.account,
    targetChars: 0,
    templates: style === "ask" ? ASK : PLANT,
    rng: new Rng(0),
  }).trim();
}

/** Neutral filler of `chars` characters (the probe's sentences, no record, no question). */
function filler(chars: number, rng: Rng): string {
  return buildPrompt({ records: [], askAccount: "", targetChars: chars, templates: PLANT, rng }).trimEnd();
}

interface ShareGptPair {
  readonly prompt: string;
  readonly completion: string;
}

const HUMAN = new Set(["human", "user"]);
const MODEL = new Set(["gpt", "assistant", "chatgpt", "model", "bard", "bing"]);

/** The (first human turn, the answer after it) pairs of a ShareGPT file. */
export function readShareGpt(path: string): { pairs: ShareGptPair[]; skipped: number } {
  let text: string;
  try {
    text = readFileSync(path, "utf8");
  } catch (err) {
    throw new KvfenceError(
      "invalid_request",
      `Cannot read the ShareGPT file (${(err as Error).message}): ${path}`,
      { param: "datasetPath" },
    );
  }
  let entries: unknown[];
  const trimmed = text.trimStart();
  try {
    entries = trimmed.startsWith("[")
      ? (JSON.parse(trimmed) as unknown[])
      : trimmed
          .split("\n")
          .filter((l) => l.trim() !== "")
          .map((l) => JSON.parse(l) as unknown);
  } catch (err) {
    throw new KvfenceError(
      "invalid_request",
      `The ShareGPT file is neither a JSON array nor JSON lines (${(err as Error).message}): ${path}`,
      { param: "datasetPath" },
    );
  }
  const pairs: ShareGptPair[] = [];
  let skipped = 0;
  for (const entry of Array.isArray(entries) ? entries : []) {
    const turns = (entry as { conversations?: unknown } | null)?.conversations;
    const pair = Array.isArray(turns) ? firstPair(turns) : null;
    if (pair === null) skipped++;
    else pairs.push(pair);
  }
  if (pairs.length === 0) {
    throw new KvfenceError(
      "invalid_request",
      `The ShareGPT file holds no conversation with a human turn followed by a gpt turn (each line or array element needs {"conversations":[{"from":"human","value":...},{"from":"gpt","value":...}]}): ${path}`,
      { param: "datasetPath" },
    );
  }
  return { pairs, skipped };
}

function firstPair(turns: unknown[]): ShareGptPair | null {
  for (let i = 0; i + 1 < turns.length; i++) {
    const a = turns[i] as { from?: unknown; value?: unknown } | null;
    const b = turns[i + 1] as { from?: unknown; value?: unknown } | null;
    if (
      typeof a?.from === "string" &&
      HUMAN.has(a.from) &&
      typeof a.value === "string" &&
      a.value.trim().length >= 4 &&
      typeof b?.from === "string" &&
      MODEL.has(b.from) &&
      typeof b.value === "string" &&
      b.value.trim().length >= 4
    ) {
      return { prompt: a.value, completion: b.value };
    }
  }
  return null;
}

function sharegptSessions(
  options: DatasetOptions,
  rng: Rng,
  nonces: CanaryFactory,
  notes: string[],
): DatasetSession[] {
  if (options.datasetPath === undefined) {
    throw new KvfenceError("invalid_request", "The sharegpt dataset needs --dataset-path FILE", {
      param: "datasetPath",
    });
  }
  const { pairs, skipped } = readShareGpt(options.datasetPath);
  if (skipped > 0)
    notes.push(`${skipped} entries of the ShareGPT file have no human→gpt turn pair (skipped)`);
  // A seeded shuffle, then as many as asked; a file with fewer conversations is gone through again.
  const order = pairs.map((_, i) => i);
  for (let i = order.length - 1; i > 0; i--) {
    const j = rng.int(i + 1);
    [order[i], order[j]] = [order[j]!, order[i]!];
  }
  if (pairs.length < options.numPrompts) {
    notes.push(
      `The ShareGPT file has ${pairs.length} usable conversations for ${options.numPrompts} requests: each is sent more than once (with its own nonce)`,
    );
  }
  return Array.from({ length: options.numPrompts }, (_, i) => {
    const pair = pairs[order[i % order.length]!]!;
    const nonce = nonces.record();
    const tag = nonceTag(nonce, options.nonce);
    const outputLen =
      options.sharegptOutputLen ?? Math.max(1, Math.round(pair.completion.length / options.charsPerToken));
    return { turns: [{ prefix: "", content: `${pair.prompt}\n\n${tag}`, nonce, outputLen }] };
  });
}
