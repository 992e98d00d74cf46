/**
 * What the fault matrix's cells send and what each finds (src/tools/incident/fault-matrix.ts and its
 * KV tier rows, tier-cells.ts): tenant A's planted access codes, tenant B's prompt, the chat request
 * every cell makes (greedy, 8 tokens), and a cell's outcome.
 */
import type { FaultName, GuardName } from "../../protocol/safety.js";

export interface CellOutcome {
  readonly fault: FaultName;
  readonly faults: readonly FaultName[];
  readonly topology: "threads" | "tcp" | "single";
  /** The guard switched on alone, or null for the all-off row. */
  readonly guardOn: GuardName | null;
  readonly disabledGuards: readonly GuardName[];
  readonly expect: "bug shows" | "caught";
  readonly status: number;
  /** The error code of a non-200 answer. */
  readonly errorCode: string | null;
  /** Tokens B's prompt had (as the server counted them for A's same-size prompt) and usage said. */
  readonly promptTokensReported: number | null;
  readonly leakedCode: boolean;
  /** The start of B's answer (200 only). */
  readonly answer: string;
  /** The guard counters of /metrics after B's request minus before. */
  readonly guardCounterDelta: number;
  /** B's greedy answer differs from the same prompt on a safe server (null: no baseline). */
  readonly differsFromBaseline: boolean | null;
  /** What shows the bug (or the catch), in words. */
  readonly symptom: string;
  /** The guard caught the fault by serving a correct miss (HTTP 200, nothing reused), not an error. */
  readonly caughtAsMiss: boolean;
  /** The guard caught it by serving the right KV (a hit whose answer is the fresh one: `tier-spill-copy`). */
  readonly caughtAsCorrectHit?: boolean;
  readonly ok: boolean;
}

export const A_CODES = ["QX7-PL2", "ZK4-M9T", "RB2-W8N", "HJ5-T3V"];
export const A_ACCOUNTS = [4821, 7730, 1906, 5544];

export function recordText(account: number, code: string): string {
  return `the access code of account ${account} is ${code}.`;
}

/** A's planted prompt: its records, then the question about the first one (~`chars` characters). */
export function plantPrompt(i: number, chars: number): string {
  const records: string[] = [];
  let text = "";
  for (let k = 0; text.length < chars - 80; k++) {
    const j = (i + k) % A_CODES.length;
    records.push(recordText(A_ACCOUNTS[j]!, A_CODES[j]!));
    text = records.join(" ");
  }
  return `${text} what is the access code of account ${A_ACCOUNTS[i % A_ACCOUNTS.length]}?`;
}

/** B's prompt: B's own filler records and a question about one of A's accounts. */
export function victimPrompt(chars: number): string {
  const records: string[] = [];
  let text = "";
  for (let k = 0; text.length < chars - 80; k++) {
    records.push(recordText(3000 + k, `B${(k % 10).toString()}B-${(k * 7) % 10}BB`));
    text = records.join(" ");
  }
  // A first page of its own, unlike A's prompts (so a stale first page differs from B's own).
  return `tenant b keeps these records: ${text} what is the access code of account ${A_ACCOUNTS[0]}?`;
}

export interface ChatResult {
  status: number;
  content: string;
  promptTokens: number | null;
  /** `usage.prompt_tokens_details.cached_tokens` (null: absent). */
  cachedTokens: number | null;
  errorCode: string | null;
}

/** Every chat of the matrix: greedy, 8 tokens. */
const MAX_TOKENS = 8;

export async function chat(url: string, key: string, content: string): Promise<ChatResult> {
  const res = await fetch(`${url}/v1/chat/completions`, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${key}` },
    body: JSON.stringify({
      model: "kvfence-tiny",
      messages: [{ role: "user", content }],
      max_tokens: MAX_TOKENS,
      temperature: 0,
    }),
  });
  const body = (await res.json()) as {
    choices?: { message?: { content?: string } }[];
    usage?: { prompt_tokens?: number; prompt_tokens_details?: { cached_tokens?: number } };
    error?: { code?: string };
  };
  return {
    status: res.status,
    content: body.choices?.[0]?.message?.content ?? "",
    promptTokens: body.usage?.prompt_tokens ?? null,
    cachedTokens: body.usage?.prompt_tokens_details?.cached_tokens ?? null,
    errorCode: body.error?.code ?? null,
  };
}
