/**
 * The engine's door check: what is wrong with a submitted request, as the `WireError` its
 * `onError` gets, before anything is allocated for it — a rid in use, an empty prompt, a bad
 * `max_tokens`, a prompt plus `max_tokens` over the context, bad sampling parameters
 * (`samplingRefusal`), a prompt token outside the vocabulary. The first problem found is reported.
 */
import type { WireError } from "../lib/errors.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { samplingRefusal } from "./sampling-step.js";

/** What the engine serves. */
export interface DoorLimits {
  /** Tokens one request may span (prompt + max_tokens). */
  readonly contextTokens: number;
  readonly vocabSize: number;
}

/** What is wrong with `r` (`ridInUse`: its rid is taken by a request in the engine), or null: it may be queued. */
export function doorCheck(r: GenerationRequest, ridInUse: boolean, limits: DoorLimits): WireError | null {
  if (ridInUse) {
    return {
      code: "invalid_request",
      message: `Request id is already in use: ${r.rid}; assign a fresh rid`,
    };
  }
  const promptLength = r.promptTokens.length;
  if (promptLength < 1) {
    return {
      code: "invalid_request",
      message: "Prompt is empty: 0 tokens; send at least one token",
      param: "messages",
    };
  }
  if (!Number.isInteger(r.maxTokens) || r.maxTokens < 1) {
    return {
      code: "invalid_request",
      message: `max_tokens must be a positive integer: ${r.maxTokens}`,
      param: "max_tokens",
    };
  }
  const total = promptLength + r.maxTokens;
  if (total > limits.contextTokens) {
    return {
      code: "context_length_exceeded",
      message: `This model's maximum context length is ${limits.contextTokens} tokens, but the request needs ${promptLength} prompt tokens plus ${r.maxTokens} max_tokens: ${total}; shorten the prompt or lower max_tokens`,
      param: "messages",
    };
  }
  const sampling = samplingRefusal(r.sampling, limits.vocabSize);
  if (sampling !== null) return sampling;
  const vocab = limits.vocabSize;
  for (let i = 0; i < promptLength; i++) {
    const t = r.promptTokens[i]!;
    if (!(t >= 0 && t < vocab)) {
      return {
        code: "invalid_request",
        message: `Prompt token id is outside the vocabulary of ${vocab}: ${t}`,
        param: "messages",
      };
    }
  }
  return null;
}
