/**
 * A validated request's `SamplingParams` (src/protocol/sampling-params.ts), built once here from
 * what the parser read (openai-schemas.ts) and the served model's defaults, and then carried whole
 * to the engine or the nodes that sample: a field the client left out takes the model's
 * generation_config value, else the OpenAI default; EOS ends the request unless `ignore_eos`.
 */
import type { SamplingParams } from "../protocol/sampling-params.js";
import type { SamplingRequest } from "./openai-schemas.js";

/** What the served model contributes: its EOS ids and its generation_config defaults. */
export interface SamplingModel {
  readonly eosTokenIds: readonly number[];
  readonly defaults?: { readonly temperature?: number; readonly topP?: number; readonly topK?: number };
}

/** The sampling of a request's first sample (of each prompt). */
export function samplingParams(parsed: SamplingRequest, model: SamplingModel): SamplingParams {
  const defaults = model.defaults ?? {};
  return {
    temperature: parsed.temperature ?? defaults.temperature ?? 1,
    topP: parsed.topP ?? defaults.topP ?? 1,
    topK: parsed.topK === null ? (defaults.topK ?? 0) : Math.max(0, parsed.topK),
    seed: parsed.seed,
    // ignore_eos: EOS ends nothing; the client's stop_token_ids are the router's to match.
    stopTokenIds: parsed.ignoreEos ? [] : model.eosTokenIds,
    ...(parsed.controls === undefined ? {} : { controls: parsed.controls }),
    ...(parsed.logprobs === null ? {} : { logprobs: parsed.logprobs }),
    ...(parsed.promptLogprobs === null ? {} : { promptLogprobs: parsed.promptLogprobs }),
    ...(parsed.constraint === undefined ? {} : { constraint: parsed.constraint }),
  };
}

/**
 * The sampling of sample `j` ≥ 1 of `n`: the first's, with a seed of its own (the first's + j, as
 * vLLM; none: random) and no prompt log-probabilities (the first sample computes them).
 */
export function laterSampleSampling(first: SamplingParams, j: number): SamplingParams {
  return { ...first, seed: first.seed === null ? null : first.seed + j, promptLogprobs: undefined };
}
