/**
 * The engine's worker thread: builds the model, the KV page pool and the `Engine` from its
 * `workerData`, then serves the messages of `engine-client.ts` over its parent port.
 *
 * The step loop runs one `engine.step()` per `setImmediate` turn, so between two forward steps the
 * event loop polls the port: an abort posted by the router (a client disconnect) is applied before
 * the next step, never after the request finishes. Everything the engine reports during one step
 * (every request's new token, finishes, errors) goes out as **one** message after the step.
 */
import { isMainThread, type MessagePort, parentPort, workerData } from "node:worker_threads";
import { buildEngine, type EngineBuildOptions } from "../engine/build-engine.js";
import type { Engine } from "../engine/engine.js";
import { KvfenceError, type WireError } from "../lib/errors.js";
import type { TokenLogprobs } from "../lib/token-logprobs.js";
import type { GenerationEvents } from "../protocol/engine-api.js";
import {
  ENGINE_WORKER_TAG,
  type EngineEventsMessage,
  FINISH_REASONS,
  type FromEngineWorker,
  type ToEngineWorker,
} from "./engine-messages.js";

/** Serves `engine` over `port` until a `close` message. */
export function serveEngine(engine: Engine, port: MessagePort): void {
  let tokens: number[] = [];
  let runs = 0;
  /** Per run of `tokens`, its log-probabilities; null until some request asked for them. */
  let logprobs: (TokenLogprobs[] | null)[] | null = null;
  let prompts: { rid: number; entries: readonly (TokenLogprobs | null)[] }[] | null = null;
  let finishes: number[] = [];
  let errors: { rid: number; error: WireError }[] = [];
  let scheduled = false;
  let closed = false;

  const flush = (): void => {
    if (tokens.length === 0 && finishes.length === 0 && errors.length === 0) return;
    const message: EngineEventsMessage = {
      type: "events",
      tokens,
      finishes,
      errors,
      ...(logprobs === null ? {} : { logprobs }),
      ...(prompts === null ? {} : { prompts }),
    };
    port.postMessage(message);
    tokens = [];
    runs = 0;
    logprobs = null;
    prompts = null;
    finishes = [];
    errors = [];
  };

  const eventsFor = (rid: number): GenerationEvents => ({
    onTokens(ids, lp) {
      tokens.push(rid, ids.length);
      for (const id of ids) tokens.push(id);
      if (lp !== undefined) {
        logprobs ??= new Array<TokenLogprobs[] | null>(runs).fill(null);
        logprobs.length = runs;
        logprobs.push([...lp]);
      } else if (logprobs !== null) logprobs.push(null);
      runs++;
    },
    onPromptLogprobs(entries) {
      prompts ??= [];
      prompts.push({ rid, entries });
    },
    onFinish(reason, usage) {
      finishes.push(
        rid,
        FINISH_REASONS.indexOf(reason),
        usage.promptTokens,
        usage.completionTokens,
        usage.cachedTokens ?? -1,
      );
    },
    onError(error) {
      errors.push({ rid, error });
    },
  });

  const tick = (): void => {
    scheduled = false;
    if (closed) return;
    let more = false;
    try {
      more = engine.step();
    } catch (err) {
      // A bug in a step: end every request with an internal error rather than leave them hanging.
      const message = err instanceof Error ? err.message : String(err);
      engine.failAll({ code: "internal", message: `Engine step failed: ${message}` });
    }
    flush();
    if (more) kick();
  };

  const kick = (): void => {
    if (scheduled || closed) return;
    scheduled = true;
    setImmediate(tick);
  };

  port.on("message", (message: ToEngineWorker) => {
    if (closed) return;
    switch (message.type) {
      case "submit": {
        for (const request of message.requests) {
          const events = eventsFor(request.rid);
          try {
            engine.submit(request, events);
          } catch (err) {
            events.onError({
              code: "invalid_request",
              message: `Request could not be queued: ${err instanceof Error ? err.message : String(err)}`,
            });
          }
        }
        kick();
        break;
      }
      case "abort":
        engine.abort(message.rid);
        break;
      case "stats":
        port.postMessage({ type: "stats", id: message.id, stats: engine.stats() } satisfies FromEngineWorker);
        break;
      case "ping":
        port.postMessage({ type: "pong", id: message.id } satisfies FromEngineWorker);
        return;
      case "close":
        closed = true;
        engine.failAll({
          code: "node_unavailable",
          message: "Engine is shutting down: request not finished; retry",
        });
        flush();
        port.postMessage({ type: "closed" } satisfies FromEngineWorker);
        port.close();
        return;
    }
    flush();
  });
}

async function main(port: MessagePort, options: EngineBuildOptions): Promise<void> {
  let engine: Engine;
  try {
    engine = await buildEngine(options);
  } catch (err) {
    const error =
      err instanceof KvfenceError
        ? err.toWire()
        : {
            code: "internal" as const,
            message: `Engine failed to start: ${err instanceof Error ? err.message : String(err)}`,
          };
    port.postMessage({ type: "failed", error } satisfies FromEngineWorker);
    port.close();
    return;
  }
  serveEngine(engine, port);
  port.postMessage({ type: "ready", capacity: engine.capacity } satisfies FromEngineWorker);
}

const data = workerData as { tag?: unknown; options?: EngineBuildOptions } | null;
if (!isMainThread && parentPort !== null && data?.tag === ENGINE_WORKER_TAG && data.options !== undefined) {
  await main(parentPort, data.options);
}
