/**
 * How one request's tokens are drawn and reported: the one shape the router's parser fills in
 * (src/router/request-sampling.ts) and every later stage carries whole, as vLLM's
 * `EngineCoreRequest` carries its `sampling_params` — on `GenerationRequest.sampling` into the
 * engine (and through the one-engine worker's messages), on the `sampling` of the cluster's node
 * messages to the prefill and decode nodes, and from their engine requests to the sampling step
 * (src/engine/sampling-step.ts), the only part of an engine that reads it. Plain data: it crosses
 * threads by structured clone and processes as JSON.
 */
import type { LogitControls } from "../lib/logit-controls.js";
import type { OutputConstraint } from "./output-constraint.js";

export interface SamplingParams {
  /** 0 = greedy. */
  readonly temperature: number;
  readonly topP: number;
  /** 0 = off. */
  readonly topK: number;
  /** The generator's seed; null: one the engine draws. */
  readonly seed: number | null;
  /** EOS ids; stop *strings* are matched by the router, which then aborts. */
  readonly stopTokenIds: readonly number[];
  /** Logit bias, min_tokens, penalties, min-p (absent: none); applied where the token is sampled. */
  readonly controls?: LogitControls | undefined;
  /** Report each sampled token's log-probability and this many top ones (0 to 20); absent: none. */
  readonly logprobs?: number | undefined;
  /** Report the prompt's log-probabilities (each token given the ones before) and this many top ones. */
  readonly promptLogprobs?: number | undefined;
  /**
   * n > 1 run as one group on a prefill and a decode node (the first sample's `samples`, set by
   * the cluster at each dispatch): each later sample's seed, in the same order (null: a random
   * one). The prefill-only request draws their first tokens from the first sample's logits, each
   * with its own generator, reported after the first's in `onTokens`; decode runs each sample
   * with its own seed.
   */
  readonly sampleSeeds?: readonly (number | null)[] | undefined;
  /** What the output must match (structured output, tool_choice required or named); absent: anything. */
  readonly constraint?: OutputConstraint | undefined;
  /**
   * A request migrated mid-stream (src/cluster/migration.ts): the last this many of its prompt's
   * tokens are output the client already has. They count as generated — for the penalties and
   * `minTokens`, the grammar's state (its matcher accepts them first) and the seeded generator's
   * position (one draw each is skipped) — so the new attempt samples as the lost one would have.
   * Absent: 0.
   */
  readonly resumedTokens?: number | undefined;
}

/** The sampling of a request that names none (a node's attempt the router sent none for). */
export const GREEDY_SAMPLING: SamplingParams = Object.freeze({
  temperature: 0,
  topP: 1,
  topK: 0,
  seed: null,
  stopTokenIds: Object.freeze([]),
});
