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
import { KvfenceError } from "../lib/errors.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { EngineEventsBatch } from "./engine-events.js";
import { ENGINE_WORKER_TAG, type FromEngineWorker, type ToEngineWorker } from "./engine-messages.js";

/** Serves `engine` over `port` until a `close` message. */
export function serveEngine(engine: Engine, port: MessagePort): void {
  const batch = new EngineEventsBatch();
  let scheduled = false;
  let closed = false;

  const flush = (): void => {
    const message = batch.take();
    if (message !== null) port.postMessage(message);
  };

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
      case "submit":
        submitAll(engine, message.requests, batch);
        kick();
        break;
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
        engine.close();
        flush();
        port.postMessage({ type: "closed" } satisfies FromEngineWorker);
        port.close();
        return;
    }
    flush();
  });
}

/** Queues each request in the engine, its events packed into `batch`; one it refuses ends with an error. */
function submitAll(engine: Engine, requests: readonly GenerationRequest[], batch: EngineEventsBatch): void {
  for (const request of requests) {
    const events = batch.eventsFor(request.rid);
    try {
      engine.submit(request, events);
    } catch (err) {
      events.onError({
        code: "invalid_request",
        message: `Request could not be queued: ${err instanceof Error ? err.message : String(err)}`,
      });
    }
  }
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
