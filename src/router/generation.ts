/**
 * One request's generation, as the router drives it: submits to the engine, turns token ids into
 * text with a UTF-8-safe streaming decoder, matches stop strings and the client's stop token ids
 * (aborting the engine request on a match; stop strings only once `minTokens` were generated, as
 * vLLM does — the engine holds stop tokens back until then), and reports to a sink exactly once at
 * the end (`finish` or `fail`, with vLLM's `stop_reason`: the stop string or token id that matched,
 * or the EOS token that ended it). `abort()` (client gone) ends it silently; the engine frees the
 * request's pages and sends nothing more.
 */

import { KvfenceError, type WireError } from "../lib/errors.js";
import type { TokenLogprobs } from "../lib/token-logprobs.js";
import type { EngineHandle, GenerationRequest } from "../protocol/engine-api.js";
import { StopMatcher } from "./stop-matcher.js";

/** Turns token ids into text incrementally, never splitting a UTF-8 character. */
export interface TextStreamDecoder {
  push(tokenIds: readonly number[]): string;
  flush(): string;
}

export interface Usage {
  readonly promptTokens: number;
  readonly completionTokens: number;
  /** Prompt tokens served from the prefix cache (absent: the cache is off). */
  readonly cachedTokens?: number;
  /** Times it migrated mid-stream to another prefill/decode pair (absent: none; the access log's). */
  readonly migrations?: number;
}

/**
 * `tool_calls` (`function_call` for the deprecated `functions`): a `stop` whose output held tool
 * calls (set by the reply, never by the engine).
 */
export type FinishReason = "stop" | "length" | "tool_calls" | "function_call";

/**
 * What ended a `stop` finish: the stop string or the client's stop token id (vLLM's `stop_reason`
 * and SGLang's `matched_stop`), or the EOS token (SGLang's `matched_stop` only: vLLM says null);
 * null for `length`, or an EOS the router cannot name (several EOS ids, none reported).
 */
export type StopReason = string | number | EosStop | null;

/** Generation ended on the model's EOS token `eos`. */
export interface EosStop {
  readonly eos: number;
}

export interface GenerationSink {
  /** Tokens arrived (even if they produced no text yet); `count` new ones. */
  tokens?(count: number): void;
  /** The log-probabilities of an output token, before the text it completes (when asked). */
  logprobs?(entry: TokenLogprobs): void;
  /** The prompt's log-probabilities (when asked), before any token. */
  promptLogprobs?(entries: readonly (TokenLogprobs | null)[]): void;
  /** Non-empty text for the client. */
  text(delta: string): void;
  finish(reason: FinishReason, usage: Usage, stopReason: StopReason): void;
  fail(error: KvfenceError): void;
}

export interface GenerationOptions {
  readonly decoder: TextStreamDecoder;
  readonly stop: readonly string[];
  /** The client's `stop_token_ids` (EOS is the engine's). */
  readonly stopTokenIds?: readonly number[];
  /** Stop strings match only from this many generated tokens on. */
  readonly minTokens?: number;
  /** Keep the matched stop string or stop token's text in the output. */
  readonly includeStopStr?: boolean;
  /** The request asked for log-probabilities: they go to the sink token by token. */
  readonly logprobs?: boolean;
}

export class Generation {
  readonly #engine: EngineHandle;
  readonly #request: GenerationRequest;
  readonly #decoder: TextStreamDecoder;
  readonly #stop: StopMatcher;
  readonly #sink: GenerationSink;
  readonly #skip: ReadonlySet<number>;
  readonly #stopIds: ReadonlySet<number>;
  readonly #minTokens: number;
  readonly #includeStop: boolean;
  /** Token by token (the client's stop ids, min_tokens), or whole batches. */
  readonly #perToken: boolean;
  /** An EOS seen among the tokens, else the model's only EOS id (the engine's finish may name it instead). */
  #eos: number | null;
  #completionTokens = 0;
  #done = false;

  constructor(
    engine: EngineHandle,
    request: GenerationRequest,
    options: GenerationOptions,
    sink: GenerationSink,
  ) {
    this.#engine = engine;
    this.#request = request;
    this.#decoder = options.decoder;
    this.#includeStop = options.includeStopStr === true;
    this.#stop = new StopMatcher(options.stop, this.#includeStop);
    this.#sink = sink;
    this.#skip = new Set(request.sampling.stopTokenIds);
    this.#stopIds = new Set(options.stopTokenIds ?? []);
    this.#minTokens = options.minTokens ?? 0;
    this.#perToken = this.#stopIds.size > 0 || this.#minTokens > 0 || options.logprobs === true;
    const eos = request.sampling.stopTokenIds;
    this.#eos = eos.length === 1 ? eos[0]! : null;
  }

  get rid(): number {
    return this.#request.rid;
  }

  /** True once finished, failed or aborted. */
  get done(): boolean {
    return this.#done;
  }

  start(): void {
    // Another choice of its response failed while they were being submitted: this one never runs.
    if (this.#done) return;
    this.#engine.submit(this.#request, {
      onTokens: (ids, logprobs) => this.#onTokens(ids, logprobs),
      onPromptLogprobs: (entries) => {
        if (!this.#done) this.#sink.promptLogprobs?.(entries);
      },
      onFinish: (reason, usage) => this.#onFinish(reason, usage),
      onError: (error) => this.#onError(error),
    });
  }

  /** The client went away: stop the engine request; no sink call follows. Idempotent. */
  abort(): void {
    if (this.#done) return;
    this.#done = true;
    this.#engine.abort(this.#request.rid);
  }

  #onTokens(ids: readonly number[], logprobs: readonly TokenLogprobs[] | undefined): void {
    if (this.#done) return;
    this.#sink.tokens?.(ids.length);
    if (this.#perToken) {
      for (let i = 0; i < ids.length && !this.#done; i++) this.#onToken(ids[i]!, logprobs?.[i]);
      return;
    }
    this.#completionTokens += ids.length;
    const eos = ids.find((id) => this.#skip.has(id));
    if (eos !== undefined) this.#eos = eos;
    const visible = eos === undefined ? ids : ids.filter((id) => !this.#skip.has(id));
    this.#emit(visible.length === 0 ? "" : this.#decoder.push(visible), true);
  }

  /** One token, when the client's stop ids or min_tokens need them one by one. */
  #onToken(id: number, logprobs: TokenLogprobs | undefined): void {
    this.#completionTokens++;
    if (this.#skip.has(id)) {
      this.#eos = id;
      return;
    }
    if (logprobs !== undefined && (this.#includeStop || !this.#stopIds.has(id)))
      this.#sink.logprobs?.(logprobs);
    if (this.#stopIds.has(id)) {
      // The engine holds the client's stop ids back until min_tokens: this one ends the request.
      const own = this.#includeStop ? this.#decoder.push([id]) : "";
      const step = this.#stop.push(own + this.#decoder.flush(), false);
      const tail = step.text + this.#stop.flush();
      if (tail !== "") this.#sink.text(tail);
      this.#stopHere(id);
      return;
    }
    this.#emit(this.#decoder.push([id]), this.#completionTokens >= this.#minTokens);
  }

  #emit(text: string, armed: boolean): void {
    if (text === "") return;
    const step = this.#stop.push(text, armed);
    if (step.text !== "") this.#sink.text(step.text);
    if (step.stopped) this.#stopHere(step.matched ?? null);
  }

  #stopHere(stopReason: StopReason): void {
    this.#done = true;
    this.#engine.abort(this.#request.rid);
    this.#sink.finish(
      "stop",
      { promptTokens: this.#request.promptTokens.length, completionTokens: this.#completionTokens },
      stopReason,
    );
  }

  #onFinish(reason: FinishReason, usage: Usage & { readonly stopTokenId?: number }): void {
    if (this.#done) return;
    const step = this.#stop.push(this.#decoder.flush(), this.#completionTokens >= this.#minTokens);
    const tail = step.stopped ? step.text : step.text + this.#stop.flush();
    this.#done = true;
    const eosId = usage.stopTokenId ?? this.#eos;
    const eos = reason === "stop" && eosId !== null ? { eos: eosId } : null;
    if (tail !== "") this.#sink.text(tail);
    this.#sink.finish(
      step.stopped ? "stop" : reason,
      {
        promptTokens: usage.promptTokens,
        completionTokens: Math.max(usage.completionTokens, this.#completionTokens),
        ...(usage.cachedTokens === undefined ? {} : { cachedTokens: usage.cachedTokens }),
        ...(usage.migrations === undefined ? {} : { migrations: usage.migrations }),
      },
      step.stopped ? (step.matched ?? null) : eos,
    );
  }

  #onError(error: WireError): void {
    if (this.#done) return;
    this.#done = true;
    this.#sink.fail(KvfenceError.fromWire(error));
  }
}
