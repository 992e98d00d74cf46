/**
 * The main-thread side of the engine worker: an `EngineHandle` that proxies `submit`, `abort`,
 * `stats` and `close` to `engine-worker.ts` over its port and turns the worker's per-step event
 * messages back into each request's `GenerationEvents`.
 *
 * Requests wait here, fairly, not in the engine: a `FairShare` (src/fair-share/fair-share.ts) holds each
 * tenant's queue, caps what each tenant may hold and bounds the queue, and posts a request to the
 * worker only while fewer than `ENGINE_WINDOW` times the engine's sequence slots are there. So the
 * engine's own first-come queue (which preemption needs) stays short and in fair order.
 *
 * `abort(rid)` silences the request here at once (no event for it is delivered afterwards, even one
 * already in flight) and tells the worker, which frees the pages before its next step; a waiting
 * request just leaves the queue. Every request gets exactly one terminal event (`onFinish` or
 * `onError`) unless it was aborted; if the worker dies or is closed, the requests still open end
 * with `node_unavailable`. Readiness (`health()`): the worker answers a ping between two steps,
 * every `PING_INTERVAL_MS`; one unanswered past the deadline makes the engine not ready.
 */
import { Worker } from "node:worker_threads";
import type { EngineBuildOptions } from "../engine/build-engine.js";
import { portableOptions } from "../engine/portable-weights.js";
import { FairShare, type FairShareConfig, resolveFairShare } from "../fair-share/fair-share.js";
import { KvfenceError, type WireError } from "../lib/errors.js";
import type {
  EngineCapacity,
  EngineHandle,
  EngineHealth,
  EngineStats,
  GenerationEvents,
  GenerationRequest,
} from "../protocol/engine-api.js";
import { readEngineEvents } from "./engine-events.js";
import {
  ENGINE_WORKER_TAG,
  type EngineEventsMessage,
  type FromEngineWorker,
  type ToEngineWorker,
} from "./engine-messages.js";

const WORKER_URL = new URL("./engine-worker.js", import.meta.url);

/** The worker holds at most this many times its sequence slots of requests; the rest wait here. */
export const ENGINE_WINDOW = 2;
const PING_INTERVAL_MS = 200;
const DEFAULT_PING_TIMEOUT_MS = 500;

export interface EngineClientOptions {
  /** Per-tenant caps, queue bounds and timeout. Default: one tenant. */
  readonly fairShare?: FairShareConfig;
  /** A worker whose pong takes longer is not ready. Default 500 ms. */
  readonly pingTimeoutMs?: number;
}

interface Open {
  readonly request: GenerationRequest;
  readonly events: GenerationEvents;
  /** The KV pages it may hold: its prompt and max_tokens. */
  readonly pages: number;
}

export class EngineClient implements EngineHandle {
  readonly capacity: EngineCapacity;
  readonly #worker: Worker;
  readonly #open = new Map<number, Open>();
  readonly #share: FairShare<Open>;
  readonly #statsWaiters = new Map<
    number,
    { resolve: (s: EngineStats) => void; reject: (e: Error) => void }
  >();
  #nextStatsId = 1;
  #down: WireError | null = null;
  #closing: Promise<void> | null = null;
  readonly #pingTimeoutMs: number;
  readonly #pingTimer: NodeJS.Timeout;
  #ping: { readonly id: number; readonly timer: NodeJS.Timeout } | null = null;
  /** Submits of this turn, not posted yet (`#submit`). */
  #submits: GenerationRequest[] = [];
  #nextPingId = 1;
  #answering = true;

  private constructor(worker: Worker, capacity: EngineCapacity, options: EngineClientOptions) {
    this.#worker = worker;
    this.capacity = capacity;
    const slots = capacity.maxSequences ?? 16;
    this.#share = new FairShare<Open>(
      resolveFairShare(options.fairShare ?? { tenants: 1 }, {
        pages: Math.floor(capacity.poolTokens / capacity.pageSize),
        slots,
      }),
      {
        tenant: (o) => o.request.tenant,
        pages: (o) => o.pages,
        group: (o) => o.request.group,
        dispatch: (o) => {
          this.#submit(o.request);
          return true;
        },
        expire: (o, error) => {
          this.#open.delete(o.request.rid);
          o.events.onError(error);
        },
      },
      { window: ENGINE_WINDOW * slots },
    );
    this.#pingTimeoutMs = options.pingTimeoutMs ?? DEFAULT_PING_TIMEOUT_MS;
    this.#pingTimer = setInterval(() => this.#sendPing(), PING_INTERVAL_MS);
    this.#pingTimer.unref();
    worker.on("message", (message: FromEngineWorker) => this.#onMessage(message));
    worker.on("error", (err) => this.#goDown(`Engine worker failed: ${err.message}`));
    worker.on("exit", (code) => this.#goDown(`Engine worker exited with code: ${code}`));
  }

  /** The fair share in front of the worker (its queue and per-tenant counts). */
  get fairShare(): FairShare<Open> {
    return this.#share;
  }

  /** Starts an engine worker and resolves once its model and pool are ready. */
  static start(options: EngineBuildOptions, client: EngineClientOptions = {}): Promise<EngineClient> {
    // Weights as numbers: a view past 4 GiB of the shared memory does not survive the structured clone.
    const worker = new Worker(WORKER_URL, {
      workerData: { tag: ENGINE_WORKER_TAG, options: portableOptions(options) },
    });
    return new Promise((resolve, reject) => {
      const onMessage = (message: FromEngineWorker): void => {
        cleanup();
        if (message.type === "ready") {
          resolve(new EngineClient(worker, message.capacity, client));
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
    const open: Open = {
      request,
      events,
      pages: Math.ceil((request.promptTokens.length + request.maxTokens) / this.capacity.pageSize),
    };
    this.#open.set(request.rid, open);
    const full = this.#share.offer(open);
    if (full !== null) {
      this.#open.delete(request.rid);
      queueMicrotask(() => events.onError(full));
    }
  }

  abort(rid: number): void {
    const open = this.#open.get(rid);
    if (open === undefined) return;
    this.#open.delete(rid);
    if (this.#share.cancel(open)) return;
    this.#post({ type: "abort", rid });
    this.#share.finished(open);
  }

  health(): EngineHealth {
    const live = this.#down === null;
    const ready = live && this.#answering && this.#closing === null;
    return {
      live,
      ready,
      reason: !live
        ? "the engine worker is gone"
        : this.#closing !== null
          ? "the server is shutting down"
          : ready
            ? null
            : "the engine does not answer (a step is taking longer than the readiness deadline)",
    };
  }

  /** The worker's stats; `queue.waiting` includes the requests waiting here, in the fair share. */
  stats(): Promise<EngineStats> {
    if (this.#down !== null) return Promise.reject(KvfenceError.fromWire(this.#down));
    const id = this.#nextStatsId++;
    return new Promise<EngineStats>((resolve, reject) => {
      this.#statsWaiters.set(id, { resolve, reject });
      this.#post({ type: "stats", id });
    }).then((s) => ({ ...s, queue: { ...s.queue, waiting: s.queue.waiting + this.#share.waiting } }));
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

  /** Submits go out together at the end of this turn (one message), before anything posted after them. */
  #submit(request: GenerationRequest): void {
    if (this.#submits.length === 0) queueMicrotask(() => this.#flushSubmits());
    this.#submits.push(request);
  }

  #flushSubmits(): void {
    if (this.#submits.length === 0) return;
    const requests = this.#submits;
    this.#submits = [];
    this.#worker.postMessage({ type: "submit", requests } satisfies ToEngineWorker);
  }

  #post(message: ToEngineWorker): void {
    this.#flushSubmits();
    this.#worker.postMessage(message);
  }

  #sendPing(): void {
    if (this.#down !== null || this.#ping !== null) return;
    const id = this.#nextPingId++;
    const timer = setTimeout(() => {
      // Read pongs that arrived while this thread was busy first (the poll phase runs after timers).
      setImmediate(() => {
        if (this.#ping?.id === id) this.#answering = false;
      });
    }, this.#pingTimeoutMs);
    timer.unref();
    this.#ping = { id, timer };
    this.#post({ type: "ping", id });
  }

  #onMessage(message: FromEngineWorker): void {
    switch (message.type) {
      case "events":
        this.#deliver(message);
        break;
      case "pong":
        if (this.#ping?.id === message.id) {
          clearTimeout(this.#ping.timer);
          this.#ping = null;
          this.#answering = true;
        }
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
    readEngineEvents(message, {
      promptLogprobs: (rid, entries) => {
        const open = this.#open.get(rid);
        if (open !== undefined) call(() => open.events.onPromptLogprobs?.(entries));
      },
      tokens: (rid, ids, lp) => {
        const open = this.#open.get(rid);
        if (open !== undefined) call(() => open.events.onTokens(ids, lp));
      },
      finish: (rid, reason, usage) => {
        const open = this.#end(rid);
        if (open !== undefined) call(() => open.events.onFinish(reason, usage));
      },
      error: (rid, error) => {
        const open = this.#end(rid);
        if (open !== undefined) call(() => open.events.onError(error));
      },
    });
    if (failed) throw firstError;
  }

  /** Request `rid` ended in the worker: out of the open ones and the fair share (undefined: not open). */
  #end(rid: number): Open | undefined {
    const open = this.#open.get(rid);
    if (open === undefined) return undefined;
    this.#open.delete(rid);
    this.#share.finished(open);
    return open;
  }

  /** The worker is gone: every open request and stats call ends with `node_unavailable`. */
  #goDown(message: string): void {
    if (this.#down !== null) return;
    const error: WireError = { code: "node_unavailable", message };
    this.#down = error;
    clearInterval(this.#pingTimer);
    if (this.#ping !== null) clearTimeout(this.#ping.timer);
    this.#share.close(error);
    const open = [...this.#open.values()];
    this.#open.clear();
    for (const o of open) o.events.onError(error);
    for (const waiter of this.#statsWaiters.values()) waiter.reject(KvfenceError.fromWire(error));
    this.#statsWaiters.clear();
  }
}
