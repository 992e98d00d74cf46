/**
 * Log-probabilities from logits: the log-softmax of the raw logits (the model's distribution, as
 * vLLM reports by default: before temperature, penalties or any other sampling control), computed
 * in float64 with the max subtracted, at one token and for the k most likely tokens.
 */
import type { TokenLogprobs } from "../lib/token-logprobs.js";

/** log Σ exp(logits): the normaliser of the log-softmax. */
export function logSumExp(logits: Float32Array, offset = 0, length = logits.length - offset): number {
  let max = Number.NEGATIVE_INFINITY;
  for (let i = 0; i < length; i++) {
    const v = logits[offset + i] as number;
    if (v > max) max = v;
  }
  let sum = 0;
  for (let i = 0; i < length; i++) sum += Math.exp((logits[offset + i] as number) - max);
  return max + Math.log(sum);
}

/**
 * The log-probability of `token` and of the `k` most likely tokens, from the row of `vocab` logits
 * at `offset` (default: the whole array).
 */
export function tokenLogprobs(
  logits: Float32Array,
  token: number,
  k: number,
  offset = 0,
  vocab = logits.length - offset,
): TokenLogprobs {
  const lse = logSumExp(logits, offset, vocab);
  const top: [number, number][] = [];
  if (k > 0) {
    // The k largest by insertion into a short sorted list (k ≤ 20): descending, lower id first on ties.
    const ids: number[] = [];
    for (let t = 0; t < vocab; t++) {
      const v = logits[offset + t] as number;
      if (ids.length === k && v <= (logits[offset + ids[k - 1]!] as number)) continue;
      let i = ids.length === k ? k - 1 : ids.length;
      if (ids.length < k) ids.push(t);
      while (i > 0 && (logits[offset + ids[i - 1]!] as number) < v) {
        ids[i] = ids[i - 1]!;
        i--;
      }
      ids[i] = t;
    }
    for (const id of ids) top.push([id, (logits[offset + id] as number) - lse]);
  }
  const own = logits[offset + token] as number;
  let rank = 1;
  for (let t = 0; t < vocab; t++) if ((logits[offset + t] as number) > own) rank++;
  return { token, logprob: own - lse, rank, top };
}
