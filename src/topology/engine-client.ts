/**
 * The main-thread side of the engine worker: an `EngineHandle` that proxies `submit`, `abort`,
 * `stats` and `close` to `engine-worker.ts` over its port and turns the worker's per-step event
 * messages back into each request's `GenerationEvents`.
 *
 * `abort(rid)` silences the request here at once (no event for it is delivered afterwards, even one
 * already in flight) and tells the worker, which frees the pages before its next step. Every
 * request gets exactly one terminal event (`onFinish` or `onError`) unless it was aborted; if the
 * worker dies or is closed, the requests still open end with `node_unavailable`.
 */
import { Worker } from "node:worker_threads";
import type { EngineBuildOptions } from "../engine/build-engine.js";
import { KvfenceError, type WireError } from "../lib/errors.js";
import type {
  EngineCapacity,
  EngineHandle,
  EngineStats,
  GenerationEvents,
  GenerationRequest,
} from "../protocol/engine-api.js";
import {
  ENGINE_WORKER_TAG,
  type EngineEventsMessage,
  FINISH_REASONS,
  type FromEngineWorker,
  type ToEngineWorker,
} from "./engine-messages.js";

const WORKER_URL = new URL("./engine-worker.js", import.meta.url);

export class EngineClient implements EngineHandle {
  readonly capacity: EngineCapacity;
  readonly #worker: Worker;
  readonly #open = new Map<number, GenerationEvents>();
  readonly #statsWaiters = new Map<
    number,
    { resolve: (s: EngineStats) => void; reject: (e: Error) => void }
  >();
  #nextStatsId = 1;
  #down: WireError | null = null;
  #closing: Promise<void> | null = null;

  private constructor(worker: Worker, capacity: EngineCapacity) {
    this.#worker = worker;
    this.capacity = capacity;
    worker.on("message", (message: FromEngineWorker) => this.#onMessage(message));
    worker.on("error", (err) => this.#goDown(`Engine worker failed: ${err.message}`));
    worker.on("exit", (code) => this.#goDown(`Engine worker exited with code: ${code}`));
  }

  /** Starts an engine worker and resolves once its model and pool are ready. */
  static start(options: EngineBuildOptions): Promise<EngineClient> {
    const worker = new Worker(WORKER_URL, { workerData: { tag: ENGINE_WORKER_TAG, options } });
    return new Promise((resolve, reject) => {
      const onMessage = (message: FromEngineWorker): void => {
        cleanup();
        if (message.type === "ready") {
          resolve(new EngineClient(worker, message.capacity));
        } else {
          void worker.terminate();
          reject(
            message.type === "failed"
              ? KvfenceError.fromWire(message.error)
              : new KvfenceError(
                  "internal",
                  `Engine worker sent an unexpected first message: ${message.type}`,
                ),
          );
        }
      };
      const onError = (err: Error): void => {
        cleanup();
        void worker.terminate();
        reject(
          new KvfenceError("node_unavailable", `Engine worker failed to start: ${err.message}`, {
            cause: err,
          }),
        );
      };
      const onExit = (code: number): void => {
        cleanup();
        reject(
          new KvfenceError("node_unavailable", `Engine worker exited before it was ready with code: ${code}`),
        );
      };
      const cleanup = (): void => {
        worker.off("message", onMessage);
        worker.off("error", onError);
        worker.off("exit", onExit);
      };
      worker.on("message", onMessage);
      worker.on("error", onError);
      worker.on("exit", onExit);
    });
  }

  submit(request: GenerationRequest, events: GenerationEvents): void {
    const refusal: WireError | null =
      this.#down ??
      (this.#open.has(request.rid)
        ? {
            code: "invalid_request",
            message: `Request id is already in use: ${request.rid}; assign a fresh rid`,
          }
        : null);
    if (refusal !== null) {
      queueMicrotask(() => events.onError(refusal));
      return;
    }
    this.#open.set(request.rid, events);
    this.#post({ type: "submit", request });
  }

  abort(rid: number): void {
    if (!this.#open.delete(rid)) return;
    this.#post({ type: "abort", rid });
  }

  stats(): Promise<EngineStats> {
    if (this.#down !== null) return Promise.reject(KvfenceError.fromWire(this.#down));
    const id = this.#nextStatsId++;
    return new Promise((resolve, reject) => {
      this.#statsWaiters.set(id, { resolve, reject });
      this.#post({ type: "stats", id });
    });
  }

  close(): Promise<void> {
    this.#closing ??= (async () => {
      if (this.#down === null) {
        const closed = new Promise<void>((resolve) => {
          const onMessage = (m: FromEngineWorker): void => {
            if (m.type === "closed") done();
          };
          const done = (): void => {
            this.#worker.off("message", onMessage);
            this.#worker.off("exit", done);
            resolve();
          };
          this.#worker.on("message", onMessage);
          this.#worker.on("exit", done);
        });
        this.#post({ type: "close" });
        await closed;
      }
      this.#goDown("Engine is closed: request not finished; retry");
      await this.#worker.terminate();
    })();
    return this.#closing;
  }

  #post(message: ToEngineWorker): void {
    this.#worker.postMessage(message);
  }

  #onMessage(message: FromEngineWorker): void {
    switch (message.type) {
      case "events":
        this.#deliver(message);
        break;
      case "stats": {
        const waiter = this.#statsWaiters.get(message.id);
        this.#statsWaiters.delete(message.id);
        waiter?.resolve(message.stats);
        break;
      }
      default:
        break;
    }
  }

  /** Hands one step's events to their requests; a callback that throws does not starve the others. */
  #deliver(message: EngineEventsMessage): void {
    let firstError: unknown;
    let failed = false;
    const call = (fn: () => void): void => {
      try {
        fn();
      } catch (err) {
        if (!failed) firstError = err;
        failed = true;
      }
    };
    const { tokens, finishes, errors } = message;
    for (let i = 0; i < tokens.length; ) {
      const rid = tokens[i]!;
      const count = tokens[i + 1]!;
      const ids = tokens.slice(i + 2, i + 2 + count);
      i += 2 + count;
      const events = this.#open.get(rid);
      if (events !== undefined) call(() => events.onTokens(ids));
    }
    for (let i = 0; i < finishes.length; i += 4) {
      const rid = finishes[i]!;
      const events = this.#open.get(rid);
      if (events === undefined) continue;
      this.#open.delete(rid);
      const reason = FINISH_REASONS[finishes[i + 1]!]!;
      const usage = { promptTokens: finishes[i + 2]!, completionTokens: finishes[i + 3]! };
      call(() => events.onFinish(reason, usage));
    }
    for (const { rid, error } of errors) {
      const events = this.#open.get(rid);
      if (events === undefined) continue;
      this.#open.delete(rid);
      call(() => events.onError(error));
    }
    if (failed) throw firstError;
  }

  /** The worker is gone: every open request and stats call ends with `node_unavailable`. */
  #goDown(message: string): void {
    if (this.#down !== null) return;
    const error: WireError = { code: "node_unavailable", message };
    this.#down = error;
    const open = [...this.#open.values()];
    this.#open.clear();
    for (const events of open) events.onError(error);
    for (const waiter of this.#statsWaiters.values()) waiter.reject(KvfenceError.fromWire(error));
    this.#statsWaiters.clear();
  }
}
