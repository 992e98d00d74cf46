/**
 * Admission at the router: the first door (docs/design.md §4 step 1). A request is admitted only when
 * its prompt plus its completion budget fits the effective context length — the minimum of the
 * model's window, `--max-model-len` and the pool's capacity — so nothing is allocated and no engine
 * is contacted for a request that cannot be served whole. Expected outcomes are returned as a
 * discriminated result, never thrown.
 */
import { KvfenceError } from "../lib/errors.js";

export interface ContextLimits {
  readonly maxPositionEmbeddings: number;
  /** `--max-model-len`, when given. */
  readonly maxModelLen?: number | undefined;
  /** Tokens the KV pool holds (pages × page size). */
  readonly poolTokens: number;
}

/** min(model window, --max-model-len, pool capacity). */
export function effectiveContextLength(limits: ContextLimits): number {
  return Math.min(
    limits.maxPositionEmbeddings,
    limits.maxModelLen ?? Number.POSITIVE_INFINITY,
    limits.poolTokens,
  );
}

export type AdmissionResult =
  | { readonly ok: true; readonly maxTokens: number }
  | { readonly ok: false; readonly reason: "context_length_exceeded"; readonly error: KvfenceError };

/**
 * Admit `promptTokens` with a completion budget of `maxTokens` (null = whatever fits) into a
 * context of `contextLength` tokens.
 */
export function admit(
  promptTokens: number,
  maxTokens: number | null,
  contextLength: number,
  param = "messages",
): AdmissionResult {
  if (maxTokens === null) {
    if (promptTokens >= contextLength) {
      return {
        ok: false,
        reason: "context_length_exceeded",
        error: new KvfenceError(
          "context_length_exceeded",
          `This model's maximum context length is ${contextLength} tokens, but the prompt has ${promptTokens} tokens, ` +
            "which leaves no room for a completion: shorten the prompt",
          { param },
        ),
      };
    }
    return { ok: true, maxTokens: contextLength - promptTokens };
  }
  const needed = promptTokens + maxTokens;
  if (needed > contextLength) {
    return {
      ok: false,
      reason: "context_length_exceeded",
      error: new KvfenceError(
        "context_length_exceeded",
        `This model's maximum context length is ${contextLength} tokens, but the request needs ${needed} tokens ` +
          `(${promptTokens} in the prompt + ${maxTokens} for max_tokens): shorten the prompt or lower max_tokens`,
        { param },
      ),
    };
  }
  return { ok: true, maxTokens };
}
