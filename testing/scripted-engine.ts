/**
 * A scripted `EngineHandle` for unit tests of the HTTP layer only (the end-to-end tests use the
 * real engine): it answers each request with the tokens a script returns, one token per tick,
 * keeps page accounting like a real pool (pages held while a request runs, all FREE when idle),
 * and records what it was asked. The byte tokenizer beside it makes ids equal UTF-8 bytes.
 */

import type { WireError } from "../src/lib/errors.js";
import type {
  EngineCapacity,
  EngineHandle,
  EngineStats,
  GenerationEvents,
  GenerationRequest,
} from "../src/protocol/engine-api.js";
import type { TextStreamDecoder } from "../src/router/generation.js";
import type { ChatMessage } from "../src/router/openai-schemas.js";
import { tokenBounds } from "../src/router/response-size.js";
import type { RouterTokenizer } from "../src/router/router-server.js";

export const BYTE_EOS = 258; // <|im_end|>
const IM_START = 257;

export interface ScriptedEngineOptions {
  readonly numPages?: number;
  readonly pageSize?: number;
  readonly maxModelLen?: number;
  /** Tokens to generate for a prompt (before max_tokens truncation); default: "Hello, world!" then EOS. */
  readonly script?: (request: GenerationRequest) => readonly number[];
  /** Milliseconds between tokens (0 = one per event-loop turn). */
  readonly tokenDelayMs?: number;
  /** Fail every request with this error before its first token. */
  readonly failWith?: WireError;
  /** With `failWith`: the tokens sent before the failure (default 0, before the first). */
  readonly failAfter?: number;
}

interface Running {
  readonly request: GenerationRequest;
  readonly events: GenerationEvents;
  readonly tokens: readonly number[];
  pages: number;
  sent: number;
  timer: NodeJS.Timeout | null;
}

export class ScriptedEngine implements EngineHandle {
  readonly capacity: EngineCapacity;
  readonly submitted: GenerationRequest[] = [];
  readonly aborted: number[] = [];
  readonly #options: ScriptedEngineOptions;
  readonly #running = new Map<number, Running>();
  #usedPages = 0;
  #aborts = 0;
  #promptTokens = 0;
  #completionTokens = 0;

  constructor(options: ScriptedEngineOptions = {}) {
    const pageSize = options.pageSize ?? 16;
    const numPages = options.numPages ?? 64;
    this.capacity = {
      poolTokens: numPages * pageSize,
      pageSize,
      maxModelLen: options.maxModelLen ?? numPages * pageSize,
    };
    this.#options = options;
  }

  submit(request: GenerationRequest, events: GenerationEvents): void {
    this.submitted.push(request);
    const need = request.promptTokens.length + request.maxTokens;
    if (need > this.capacity.maxModelLen) {
      setImmediate(() =>
        events.onError({
          code: "context_length_exceeded",
          message: `Engine door: ${need} > ${this.capacity.maxModelLen}`,
        }),
      );
      return;
    }
    const script = this.#options.script ?? (() => [...Buffer.from("Hello, world!"), BYTE_EOS]);
    const run: Running = {
      request,
      events,
      tokens: script(request).slice(0, request.maxTokens),
      pages: Math.ceil(request.promptTokens.length / this.capacity.pageSize),
      sent: 0,
      timer: null,
    };
    this.#usedPages += run.pages;
    this.#running.set(request.rid, run);
    this.#schedule(run);
  }

  abort(rid: number): void {
    const run = this.#running.get(rid);
    if (run === undefined) return;
    this.aborted.push(rid);
    this.#aborts++;
    this.#release(run);
  }

  async stats(): Promise<EngineStats> {
    const total = Math.floor(this.capacity.poolTokens / this.capacity.pageSize);
    return {
      pages: { free: total - this.#usedPages, reserved: 0, ready: this.#usedPages, quarantined: 0, total },
      queue: { waiting: 0, running: this.#running.size, preempted: 0 },
      counters: {
        tagCheckFailures: 0,
        preemptions: 0,
        aborts: this.#aborts,
        promptTokens: this.#promptTokens,
        completionTokens: this.#completionTokens,
      },
    };
  }

  async close(): Promise<void> {
    for (const run of [...this.#running.values()]) this.#release(run);
  }

  #schedule(run: Running): void {
    const delay = this.#options.tokenDelayMs ?? 0;
    const tick = () => this.#step(run);
    run.timer = delay > 0 ? setTimeout(tick, delay) : (setImmediate(tick) as unknown as NodeJS.Timeout);
  }

  #release(run: Running): void {
    if (run.timer !== null) {
      clearTimeout(run.timer);
      clearImmediate(run.timer as unknown as NodeJS.Immediate);
    }
    this.#usedPages -= run.pages;
    this.#running.delete(run.request.rid);
  }

  #step(run: Running): void {
    if (!this.#running.has(run.request.rid)) return;
    if (this.#options.failWith !== undefined && run.sent >= (this.#options.failAfter ?? 0)) {
      this.#release(run);
      run.events.onError(this.#options.failWith);
      return;
    }
    const token = run.tokens[run.sent];
    if (token === undefined) {
      this.#finish(run, "length");
      return;
    }
    run.sent++;
    const length = run.request.promptTokens.length + run.sent;
    const pages = Math.ceil(length / this.capacity.pageSize);
    this.#usedPages += pages - run.pages;
    run.pages = pages;
    run.events.onTokens([token]);
    if (!this.#running.has(run.request.rid)) return; // aborted from inside onTokens
    if (run.request.sampling.stopTokenIds.includes(token)) this.#finish(run, "stop");
    else if (run.sent >= run.request.maxTokens) this.#finish(run, "length");
    else this.#schedule(run);
  }

  #finish(run: Running, reason: "stop" | "length"): void {
    this.#release(run);
    this.#promptTokens += run.request.promptTokens.length;
    this.#completionTokens += run.sent;
    run.events.onFinish(reason, {
      promptTokens: run.request.promptTokens.length,
      completionTokens: run.sent,
    });
  }
}

/** ChatML over UTF-8 bytes: ids 0-255 are bytes, 257 `<|im_start|>`, 258 `<|im_end|>`. */
export const byteTokenizer: RouterTokenizer = {
  vocabSize: 259,
  get tokenBounds() {
    return tokenBounds(259, (id) => byteTokenizer.tokenPiece(id));
  },
  decode: (ids) => Buffer.from(Array.from(ids).filter((id) => id < 256)).toString("utf8"),
  tokenPiece(id: number) {
    const bytes = id < 256 ? [id] : [...Buffer.from(id === IM_START ? "<|im_start|>" : "<|im_end|>")];
    return { text: Buffer.from(bytes).toString("utf8"), bytes };
  },
  encodeChat(messages: readonly ChatMessage[]): Int32Array {
    const ids: number[] = [];
    for (const m of messages) {
      ids.push(IM_START, ...Buffer.from(`${m.role}\n${m.content}`), BYTE_EOS, 10);
    }
    ids.push(IM_START, ...Buffer.from("assistant\n"));
    return Int32Array.from(ids);
  },
  encodePrompt(text: string): Int32Array {
    return Int32Array.from(Buffer.from(text));
  },
  createDecoder(): TextStreamDecoder {
    const decoder = new TextDecoder("utf-8", { fatal: false });
    return {
      push: (ids) => decoder.decode(Uint8Array.from(ids.filter((id) => id < 256)), { stream: true }),
      flush: () => decoder.decode(),
    };
  },
};
