/**
 * Server-sent events as OpenAI frames them. Chat and completions (`data` framing): each event is
 * one `data: {json}` line followed by a blank line, and the stream ends with `data: [DONE]`; no
 * `event:` or `id:` fields. The Responses API (`events` framing): each event is an `event: TYPE`
 * line (the payload's `type`) and its `data:` line, each payload stamped with its
 * `sequence_number` (0, 1, …), and the stream ends after its last event, without `[DONE]`.
 */
import type { ServerResponse } from "node:http";

export const SSE_HEADERS = {
  "Content-Type": "text/event-stream; charset=utf-8",
  "Cache-Control": "no-cache",
  Connection: "keep-alive",
  "X-Accel-Buffering": "no",
} as const;

/** One SSE frame for a JSON payload. */
export function sseFrame(payload: unknown): string {
  return `data: ${JSON.stringify(payload)}\n\n`;
}

export const SSE_DONE = "data: [DONE]\n\n";

/** How a stream is framed (see above). */
export type SseFraming = "data" | "events";

/** Writes frames to a response once the headers are out; silently stops once the client is gone. */
export class SseWriter {
  readonly #res: ServerResponse;
  readonly #framing: SseFraming;
  #sequence = 0;

  constructor(res: ServerResponse, status = 200, framing: SseFraming = "data") {
    this.#res = res;
    this.#framing = framing;
    res.writeHead(status, SSE_HEADERS);
    res.flushHeaders();
  }

  get closed(): boolean {
    return this.#res.destroyed || this.#res.writableEnded;
  }

  send(payload: Record<string, unknown>): void {
    if (this.closed) return;
    if (this.#framing === "data") {
      this.#res.write(sseFrame(payload));
      return;
    }
    payload.sequence_number = this.#sequence++;
    this.#res.write(`event: ${String(payload.type)}\n${sseFrame(payload)}`);
  }

  /** End the response (after `data: [DONE]` in the `data` framing). */
  done(): void {
    if (!this.closed) this.#res.end(this.#framing === "data" ? SSE_DONE : undefined);
  }
}
