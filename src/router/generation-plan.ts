/**
 * The choices of an admitted generation request, each its own `GenerationRequest`: per prompt, `n`
 * samples (choice p·n + j), each with its own request id; sample 0 computes the prompt and the
 * others fork its KV (one engine), each with, given a seed, seed + j (as vLLM). The disaggregated
 * topologies run a prompt's samples as one group (one prefill, forked on decode: sample 0 names
 * the others), unless log-probabilities are asked (each sample then computes its own prompt).
 * Several generations of one HTTP request are admitted as one, or refused whole
 * (src/fair-share/fair-share.ts): each then names the group's first rid and its size.
 */
import type { GenerationRequest } from "../protocol/engine-api.js";
import type { PlannedChoice } from "./generation-reply.js";
import type { SamplingRequest } from "./openai-schemas.js";
import { laterSampleSampling } from "./request-sampling.js";

const U32_MAX = 0xffff_ffff;

/** The router's request ids: 1, 2, … up to 2³² − 1, then 1 again. */
export class RequestIds {
  #next = 1;

  /** The id `take` returns next. */
  get next(): number {
    return this.#next;
  }

  take(): number {
    const rid = this.#next;
    this.#next = rid >= U32_MAX ? 1 : rid + 1;
    return rid;
  }
}

/** A prompt admitted, with the completion budget admission gave it. */
export interface AdmittedPrompt {
  readonly tokens: Int32Array;
  readonly maxTokens: number;
}

/** What every choice of a request shares. */
export type ChoiceBase = Omit<GenerationRequest, "rid" | "promptTokens" | "maxTokens" | "group">;

/** The choices of `prompts`, `parsed.n` each, their ids taken from `rids`. */
export function planChoices(
  base: ChoiceBase,
  prompts: readonly AdmittedPrompt[],
  parsed: Pick<SamplingRequest, "n" | "echoPrompts">,
  rids: RequestIds,
): PlannedChoice[] {
  const n = parsed.n;
  const shared: Omit<GenerationRequest, "rid" | "promptTokens" | "maxTokens"> =
    prompts.length * n > 1 ? { ...base, group: { first: rids.next, size: prompts.length * n } } : base;
  const grouped = n > 1 && base.sampling.logprobs === undefined && base.sampling.promptLogprobs === undefined;
  const planned: PlannedChoice[] = [];
  prompts.forEach(({ tokens, maxTokens }, p) => {
    const first = rids.next;
    const ids = Array.from({ length: n }, () => rids.take());
    for (let j = 0; j < n; j++) {
      const own = { ...shared, rid: ids[j]!, promptTokens: tokens, maxTokens };
      planned.push({
        request:
          j === 0
            ? grouped
              ? { ...own, samples: ids.slice(1) }
              : own
            : { ...own, sampling: laterSampleSampling(base.sampling, j), sample: { of: first, index: j } },
        echo: parsed.echoPrompts?.[p] ?? null,
        firstOfPrompt: j === 0,
      });
    }
  });
  return planned;
}
