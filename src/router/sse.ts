/**
 * Server-sent events as OpenAI frames them. Chat and completions (`data` framing): each event is
 * one `data: {json}` line followed by a blank line, and the stream ends with `data: [DONE]`; no
 * `event:` or `id:` fields. The Responses API (`events` framing): each event is an `event: TYPE`
 * line (the payload's `type`) and its `data:` line, each payload stamped with its
 * `sequence_number` (0, 1, …), and the stream ends after its last event, without `[DONE]`.
 *
 * Frames are written by a `JsonWriter` (json-writer.ts): a large one (echo's prompt with its
 * log-probabilities) a chunk at a time, the next ones after it.
 */
import type { ServerResponse } from "node:http";
import { JsonWriter } from "./json-writer.js";

export const SSE_HEADERS = {
  "Content-Type": "text/event-stream; charset=utf-8",
  "Cache-Control": "no-cache",
  Connection: "keep-alive",
  "X-Accel-Buffering": "no",
} as const;

export const SSE_DONE = "data: [DONE]\n\n";

/** How a stream is framed (see above). */
export type SseFraming = "data" | "events";

/** Writes frames to a response once the headers are out; silently stops once the client is gone. */
export class SseWriter {
  readonly #res: ServerResponse;
  readonly #framing: SseFraming;
  readonly #body: JsonWriter;
  #sequence = 0;
  #done = false;

  /** `onError`: a payload could not be serialised (a bug); the stream is then cut. */
  constructor(
    res: ServerResponse,
    status = 200,
    framing: SseFraming = "data",
    onError: (err: unknown) => void = () => {},
  ) {
    this.#res = res;
    this.#framing = framing;
    this.#body = new JsonWriter(res, onError);
    res.writeHead(status, SSE_HEADERS);
    res.flushHeaders();
  }

  get closed(): boolean {
    return this.#done || this.#res.destroyed || this.#res.writableEnded;
  }

  send(payload: Record<string, unknown>): void {
    if (this.closed) return;
    if (this.#framing === "data") {
      this.#body.write(payload, "data: ", "\n\n");
      return;
    }
    payload.sequence_number = this.#sequence++;
    this.#body.write(payload, `event: ${String(payload.type)}\ndata: `, "\n\n");
  }

  /** End the response (after `data: [DONE]` in the `data` framing), once every frame is written. */
  done(): void {
    if (this.closed) return;
    this.#done = true;
    this.#body.end(this.#framing === "data" ? SSE_DONE : undefined);
  }
}
