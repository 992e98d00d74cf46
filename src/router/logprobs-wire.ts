/**
 * Log-probabilities in the shapes clients expect: OpenAI's chat `logprobs.content` (token, logprob,
 * UTF-8 bytes, `top_logprobs`), OpenAI's legacy completions `logprobs` (`tokens`,
 * `token_logprobs`, `top_logprobs` as a token → logprob map including the chosen token, and
 * `text_offset`, the offset of each token's text in the choice's text), and vLLM's
 * `prompt_logprobs` (per prompt position a map of token id → `{logprob, rank, decoded_token}`,
 * null for the first). A token's text is its own bytes decoded alone (a token that holds part of a
 * UTF-8 character shows U+FFFD; `bytes` are exact).
 *
 * The lists whose entries are objects (chat's `content`, completions' `top_logprobs`, vLLM's
 * positions) are `LazyArray`s (src/lib/json-chunks.ts): each entry is made as the answer is
 * serialised, a chunk at a time, so that a long list is never built whole on the event loop.
 */
import { LazyArray } from "../lib/json-chunks.js";
import type { TokenLogprobs } from "../lib/token-logprobs.js";

/** One token's text and bytes, as the tokenizer has them. */
export interface TokenPiece {
  readonly text: string;
  readonly bytes: readonly number[];
}

export type PieceOf = (id: number) => TokenPiece;

/** A position to report: its token and its log-probabilities (null: the prompt's first token). */
export interface LogprobItem {
  readonly token: number;
  readonly entry: TokenLogprobs | null;
}

/** One entry of OpenAI's chat `logprobs.content`. */
function chatEntry(token: number, entry: TokenLogprobs, piece: PieceOf) {
  const own = piece(token);
  return {
    token: own.text,
    logprob: entry.logprob,
    bytes: [...own.bytes],
    top_logprobs: entry.top.map(([id, logprob]) => {
      const p = piece(id);
      return { token: p.text, logprob, bytes: [...p.bytes] };
    }),
  };
}

/** OpenAI's chat `choices[].logprobs` for `items` (null entries are skipped). */
export function chatLogprobs(items: readonly LogprobItem[], piece: PieceOf) {
  const kept = items.filter((item): item is { token: number; entry: TokenLogprobs } => item.entry !== null);
  const content = new LazyArray(kept.length, (i) => chatEntry(kept[i]!.token, kept[i]!.entry, piece));
  return { content, refusal: null };
}

/** One position's `top_logprobs` map of the legacy completions shape. */
function textTop(text: string, entry: TokenLogprobs, piece: PieceOf): Record<string, number> {
  const top: Record<string, number> = {};
  for (const [id, logprob] of entry.top) {
    const key = piece(id).text;
    if (!(key in top)) top[key] = logprob;
  }
  // As OpenAI: the chosen token is always there, so a map has up to logprobs + 1 entries.
  if (!(text in top)) top[text] = entry.logprob;
  return top;
}

/**
 * OpenAI's legacy completions `choices[].logprobs` for `items`; `offset.value` is the choice text's
 * length before them (streams carry it from chunk to chunk) and is advanced.
 */
export function textLogprobs(items: readonly LogprobItem[], piece: PieceOf, offset: { value: number }) {
  const tokens = items.map(({ token }) => piece(token).text);
  const textOffset = tokens.map((text) => {
    const at = offset.value;
    offset.value += text.length;
    return at;
  });
  return {
    tokens,
    token_logprobs: items.map(({ entry }) => (entry === null ? null : entry.logprob)),
    top_logprobs: new LazyArray(items.length, (i) => {
      const entry = items[i]!.entry;
      return entry === null ? null : textTop(tokens[i]!, entry, piece);
    }),
    text_offset: textOffset,
  };
}

/** One prompt position of vLLM's `prompt_logprobs` (null for the first). */
function vllmPosition(entry: TokenLogprobs | null, piece: PieceOf) {
  if (entry === null) return null;
  const out: Record<string, { logprob: number; rank: number; decoded_token: string }> = {};
  entry.top.forEach(([id, logprob], i) => {
    out[String(id)] = { logprob, rank: i + 1, decoded_token: piece(id).text };
  });
  out[String(entry.token)] ??= {
    logprob: entry.logprob,
    rank: entry.rank,
    decoded_token: piece(entry.token).text,
  };
  return out;
}

/**
 * vLLM's `prompt_logprobs`: per prompt position, token id → `{logprob, rank, decoded_token}` for
 * the top `k` and the prompt's own token.
 */
export function vllmPromptLogprobs(entries: readonly (TokenLogprobs | null)[], k: number, piece: PieceOf) {
  return new LazyArray(entries.length, (i) => {
    const e = entries[i] ?? null;
    return vllmPosition(e === null ? null : { ...e, top: e.top.slice(0, k) }, piece);
  });
}
