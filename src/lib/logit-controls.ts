/**
 * A request's logit controls (logit bias, min_tokens, the repetition, frequency and presence
 * penalties, min-p): the one definition shared by the router that fills them in, the messages that
 * carry them to the node that samples, and the sampler that applies them (src/model/sampler.ts).
 * Plain JSON-able data.
 */

/**
 * Per-request controls of the logits before a draw, as vLLM and OpenAI define them. Plain data
 * (they travel to the node that samples).
 */
export interface LogitControls {
  /** `[token id, bias]` pairs added to the logits (OpenAI's `logit_bias`, −100 to 100). */
  readonly logitBias?: readonly (readonly [number, number])[] | undefined;
  /** Until this many tokens are generated, the stop tokens (below and the request's own) cannot be drawn. */
  readonly minTokens?: number | undefined;
  /** The client's `stop_token_ids`: held back under `minTokens` (the router stops on them). */
  readonly stopTokenIds?: readonly number[] | undefined;
  /** vLLM's: a token already in the prompt or the output has a positive logit divided by it, a negative one multiplied. */
  readonly repetitionPenalty?: number | undefined;
  /** OpenAI's: minus this times the token's count in the output so far. */
  readonly frequencyPenalty?: number | undefined;
  /** OpenAI's: minus this for a token present in the output so far. */
  readonly presencePenalty?: number | undefined;
  /** Drop tokens whose probability (at the temperature) is under min_p times the top token's. */
  readonly minP?: number | undefined;
}
