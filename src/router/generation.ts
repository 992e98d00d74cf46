/**
 * One request's generation, as the router drives it: submits to the engine, turns token ids into
 * text with a UTF-8-safe streaming decoder, matches stop strings (aborting the engine request on a
 * match), and reports to a sink exactly once at the end (`finish` or `fail`). `abort()` (client
 * gone) ends it silently; the engine frees the request's pages and sends nothing more.
 */

import { KvfenceError, type WireError } from "../lib/errors.js";
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
}

export type FinishReason = "stop" | "length";

export interface GenerationSink {
  /** Tokens arrived (even if they produced no text yet); `count` new ones. */
  tokens?(count: number): void;
  /** Non-empty text for the client. */
  text(delta: string): void;
  finish(reason: FinishReason, usage: Usage): void;
  fail(error: KvfenceError): void;
}

export interface GenerationOptions {
  readonly decoder: TextStreamDecoder;
  readonly stop: readonly string[];
}

export class Generation {
  readonly #engine: EngineHandle;
  readonly #request: GenerationRequest;
  readonly #decoder: TextStreamDecoder;
  readonly #stop: StopMatcher;
  readonly #sink: GenerationSink;
  readonly #skip: ReadonlySet<number>;
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
    this.#stop = new StopMatcher(options.stop);
    this.#sink = sink;
    this.#skip = new Set(request.stopTokenIds);
  }

  get rid(): number {
    return this.#request.rid;
  }

  /** True once finished, failed or aborted. */
  get done(): boolean {
    return this.#done;
  }

  start(): void {
    this.#engine.submit(this.#request, {
      onTokens: (ids) => this.#onTokens(ids),
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

  #onTokens(ids: readonly number[]): void {
    if (this.#done) return;
    this.#completionTokens += ids.length;
    this.#sink.tokens?.(ids.length);
    const visible = ids.some((id) => this.#skip.has(id)) ? ids.filter((id) => !this.#skip.has(id)) : ids;
    const text = visible.length === 0 ? "" : this.#decoder.push(visible);
    if (text === "") return;
    const step = this.#stop.push(text);
    if (step.text !== "") this.#sink.text(step.text);
    if (step.stopped) {
      this.#done = true;
      this.#engine.abort(this.#request.rid);
      this.#sink.finish("stop", {
        promptTokens: this.#request.promptTokens.length,
        completionTokens: this.#completionTokens,
      });
    }
  }

  #onFinish(reason: FinishReason, usage: Usage): void {
    if (this.#done) return;
    const step = this.#stop.push(this.#decoder.flush());
    const tail = step.stopped ? step.text : step.text + this.#stop.flush();
    this.#done = true;
    if (tail !== "") this.#sink.text(tail);
    this.#sink.finish(step.stopped ? "stop" : reason, {
      promptTokens: usage.promptTokens,
      completionTokens: Math.max(usage.completionTokens, this.#completionTokens),
      ...(usage.cachedTokens === undefined ? {} : { cachedTokens: usage.cachedTokens }),
    });
  }

  #onError(error: WireError): void {
    if (this.#done) return;
    this.#done = true;
    this.#sink.fail(KvfenceError.fromWire(error));
  }
}
