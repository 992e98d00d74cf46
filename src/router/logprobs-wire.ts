/**
 * Log-probabilities in the shapes clients expect: OpenAI's chat `logprobs.content` (token, logprob,
 * UTF-8 bytes, `top_logprobs`), OpenAI's legacy completions `logprobs` (`tokens`,
 * `token_logprobs`, `top_logprobs` as a token → logprob map including the chosen token, and
 * `text_offset`, the offset of each token's text in the choice's text), and vLLM's
 * `prompt_logprobs` (per prompt position a map of token id → `{logprob, rank, decoded_token}`,
 * null for the first). A token's text is its own bytes decoded alone (a token that holds part of a
 * UTF-8 character shows U+FFFD; `bytes` are exact).
 */
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

/** OpenAI's chat `choices[].logprobs` for `items` (null entries are skipped). */
export function chatLogprobs(items: readonly LogprobItem[], piece: PieceOf) {
  const content = [];
  for (const { token, entry } of items) {
    if (entry === null) continue;
    const own = piece(token);
    content.push({
      token: own.text,
      logprob: entry.logprob,
      bytes: [...own.bytes],
      top_logprobs: entry.top.map(([id, logprob]) => {
        const p = piece(id);
        return { token: p.text, logprob, bytes: [...p.bytes] };
      }),
    });
  }
  return { content, refusal: null };
}

/**
 * OpenAI's legacy completions `choices[].logprobs` for `items`; `offset.value` is the choice text's
 * length before them (streams carry it from chunk to chunk) and is advanced.
 */
export function textLogprobs(items: readonly LogprobItem[], piece: PieceOf, offset: { value: number }) {
  const tokens: string[] = [];
  const tokenLogprobs: (number | null)[] = [];
  const topLogprobs: (Record<string, number> | null)[] = [];
  const textOffset: number[] = [];
  for (const { token, entry } of items) {
    const text = piece(token).text;
    tokens.push(text);
    textOffset.push(offset.value);
    offset.value += text.length;
    if (entry === null) {
      tokenLogprobs.push(null);
      topLogprobs.push(null);
      continue;
    }
    tokenLogprobs.push(entry.logprob);
    const top: Record<string, number> = {};
    for (const [id, logprob] of entry.top) {
      const key = piece(id).text;
      if (!(key in top)) top[key] = logprob;
    }
    // As OpenAI: the chosen token is always there, so a map has up to logprobs + 1 entries.
    if (!(text in top)) top[text] = entry.logprob;
    topLogprobs.push(top);
  }
  return { tokens, token_logprobs: tokenLogprobs, top_logprobs: topLogprobs, text_offset: textOffset };
}

/** vLLM's `prompt_logprobs`: per prompt position, token id → `{logprob, rank, decoded_token}`. */
export function vllmPromptLogprobs(entries: readonly (TokenLogprobs | null)[], piece: PieceOf) {
  return entries.map((entry) => {
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
  });
}
