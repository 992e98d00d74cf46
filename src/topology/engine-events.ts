/**
 * The packing of `EngineEventsMessage` (engine-messages.ts), the one message the engine worker
 * posts per step, in one place for both ends: on the worker, `EngineEventsBatch` hands each
 * request a `GenerationEvents` that packs what the engine reports into the batch, and `take()`
 * turns the batch into the message; on the client, `readEngineEvents` unpacks a message into calls
 * of an `EngineEventsReader`, in the order the engine made them: prompt log-probabilities, tokens,
 * finishes, errors.
 */
import type { WireError } from "../lib/errors.js";
import type { TokenLogprobs } from "../lib/token-logprobs.js";
import type { GenerationEvents, GenerationUsage } from "../protocol/engine-api.js";
import { type EngineEventsMessage, FINISH_REASONS, FINISH_STRIDE } from "./engine-messages.js";

/** What the engine reported since the last `take()`, packed as `EngineEventsMessage` holds it. */
export class EngineEventsBatch {
  #tokens: number[] = [];
  #runs = 0;
  /** Per run of `tokens`, its log-probabilities; null until some request asked for them. */
  #logprobs: (TokenLogprobs[] | null)[] | null = null;
  #prompts: { rid: number; entries: readonly (TokenLogprobs | null)[] }[] | null = null;
  #finishes: number[] = [];
  #errors: { rid: number; error: WireError }[] = [];

  /** The events of request `rid`, packed into this batch. */
  eventsFor(rid: number): GenerationEvents {
    return {
      onTokens: (ids, lp) => {
        this.#tokens.push(rid, ids.length);
        for (const id of ids) this.#tokens.push(id);
        if (lp !== undefined) {
          this.#logprobs ??= new Array<TokenLogprobs[] | null>(this.#runs).fill(null);
          this.#logprobs.length = this.#runs;
          this.#logprobs.push([...lp]);
        } else if (this.#logprobs !== null) this.#logprobs.push(null);
        this.#runs++;
      },
      onPromptLogprobs: (entries) => {
        this.#prompts ??= [];
        this.#prompts.push({ rid, entries });
      },
      onFinish: (reason, usage) => {
        this.#finishes.push(
          rid,
          FINISH_REASONS.indexOf(reason),
          usage.promptTokens,
          usage.completionTokens,
          usage.cachedTokens ?? -1,
          usage.stopTokenId ?? -1,
        );
      },
      onError: (error) => {
        this.#errors.push({ rid, error });
      },
    };
  }

  /** The batch as one message, and an empty batch; null when nothing was reported. */
  take(): EngineEventsMessage | null {
    if (this.#tokens.length === 0 && this.#finishes.length === 0 && this.#errors.length === 0) return null;
    const message: EngineEventsMessage = {
      type: "events",
      tokens: this.#tokens,
      finishes: this.#finishes,
      errors: this.#errors,
      ...(this.#logprobs === null ? {} : { logprobs: this.#logprobs }),
      ...(this.#prompts === null ? {} : { prompts: this.#prompts }),
    };
    this.#tokens = [];
    this.#runs = 0;
    this.#logprobs = null;
    this.#prompts = null;
    this.#finishes = [];
    this.#errors = [];
    return message;
  }
}

/** The calls `readEngineEvents` makes, one per event of a message. */
export interface EngineEventsReader {
  promptLogprobs(rid: number, entries: readonly (TokenLogprobs | null)[]): void;
  tokens(rid: number, ids: number[], logprobs: TokenLogprobs[] | undefined): void;
  finish(rid: number, reason: (typeof FINISH_REASONS)[number], usage: GenerationUsage): void;
  error(rid: number, error: WireError): void;
}

/** Unpacks `message` into `reader`'s calls: prompt log-probabilities, tokens, finishes, errors. */
export function readEngineEvents(message: EngineEventsMessage, reader: EngineEventsReader): void {
  const { tokens, finishes, errors, logprobs, prompts } = message;
  for (const { rid, entries } of prompts ?? []) reader.promptLogprobs(rid, entries);
  for (let i = 0, run = 0; i < tokens.length; run++) {
    const rid = tokens[i]!;
    const count = tokens[i + 1]!;
    const ids = tokens.slice(i + 2, i + 2 + count);
    i += 2 + count;
    reader.tokens(rid, ids, logprobs?.[run] ?? undefined);
  }
  for (let i = 0; i < finishes.length; i += FINISH_STRIDE) {
    const cached = finishes[i + 4]!;
    const stop = finishes[i + 5]!;
    reader.finish(finishes[i]!, FINISH_REASONS[finishes[i + 1]!]!, {
      promptTokens: finishes[i + 2]!,
      completionTokens: finishes[i + 3]!,
      ...(cached < 0 ? {} : { cachedTokens: cached }),
      ...(stop < 0 ? {} : { stopTokenId: stop }),
    });
  }
  for (const { rid, error } of errors) reader.error(rid, error);
}
