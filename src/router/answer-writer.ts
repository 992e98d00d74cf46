/**
 * The router's HTTP layer for answers: the one place a response body is written. A JSON answer goes
 * out a chunk at a time, with backpressure, yielding to the event loop (json-writer.ts); a thrown
 * value becomes an error response once, here, through `toOpenAiError` (`WWW-Authenticate` on a
 * 401, `Retry-After` when the error names one, anything but a `KvfenceError` logged as a bug); and a
 * generation's reply (generation-reply.ts) is pumped: on each of its wake-ups the stream's headers
 * once they are due, then its payloads as server-sent events (sse.ts), then its end — the whole
 * answer, the stream's end, or an error response. The client's going away aborts the reply.
 */
import type { ServerResponse } from "node:http";
import { KvfenceError, toOpenAiError } from "../lib/errors.js";
import type { Logger } from "../lib/logger.js";
import type { GenerationReply } from "./generation-reply.js";
import { sendJson } from "./json-writer.js";
import { boundUnreadBody } from "./read-body.js";
import { SseWriter } from "./sse.js";

export class AnswerWriter {
  readonly #log: Logger;

  constructor(log: Logger) {
    this.#log = log;
  }

  /** A JSON answer; after headers already sent (a bug, or a stream cut), only ends the response. */
  json(res: ServerResponse, status: number, body: unknown, headers: Record<string, string> = {}): void {
    if (res.headersSent) {
      if (!res.writableEnded) res.end();
      return;
    }
    // A large answer goes out a chunk at a time, yielding to the event loop (json-writer.ts).
    sendJson(res, status, body, headers, this.#serialiseFailed(res.getHeader("x-request-id")));
  }

  /** The one place a thrown value becomes an HTTP response. */
  error(res: ServerResponse, err: unknown): void {
    const { status, body } = toOpenAiError(err);
    if (!(err instanceof KvfenceError))
      this.#log.error(
        { err, requestId: res.getHeader("x-request-id") },
        "internal error while serving a request",
      );
    const headers: Record<string, string> = {};
    if (status === 401) headers["WWW-Authenticate"] = "Bearer";
    if (err instanceof KvfenceError && err.retryAfter !== undefined)
      headers["Retry-After"] = String(err.retryAfter);
    boundUnreadBody(res.req, res);
    this.json(res, status, body, headers);
  }

  /** Pumps `reply` into `res` until it ends; the client's going away aborts it. */
  reply(res: ServerResponse, reply: GenerationReply): void {
    let sse: SseWriter | null = null;
    let ended = false;
    res.on("close", () => reply.abort());
    reply.start(() => {
      if (ended) return;
      if (sse === null && reply.streaming)
        sse = new SseWriter(res, 200, reply.framing, this.#serialiseFailed(res.getHeader("x-request-id")));
      for (let payload = reply.next(); payload !== undefined; payload = reply.next()) sse!.send(payload);
      const outcome = reply.outcome;
      if (outcome === null) return;
      ended = true;
      if (outcome.kind === "answer") this.json(res, 200, outcome.body);
      else if (outcome.kind === "error") this.error(res, outcome.error);
      else sse!.done();
    });
  }

  /** Logs an answer that could not be serialised (a bug; its response is cut). */
  #serialiseFailed(requestId: unknown): (err: unknown) => void {
    return (err) => this.#log.error({ err, requestId }, "an answer could not be serialised");
  }
}
