/**
 * Log-probabilities of one position, as OpenAI's `logprobs` report them: the chosen token's, and
 * the most likely tokens' at that position. The one definition shared by the engine that computes
 * them (src/model/logprobs.ts), the messages that carry them from the node that sampled to the
 * router, and the router that renders them. Plain JSON-able data.
 */
export interface TokenLogprobs {
  readonly token: number;
  /** log-softmax of the model's logits at this position, at the token (before any sampling control). */
  readonly logprob: number;
  /** 1 + how many tokens are more likely (vLLM's `rank`). */
  readonly rank: number;
  /** `[token id, logprob]` of the most likely tokens, most likely first (ties: the lower id first). */
  readonly top: readonly (readonly [number, number])[];
}

/** The most top log-probabilities a request may ask for (OpenAI's `top_logprobs` limit). */
export const MAX_TOP_LOGPROBS = 20;
