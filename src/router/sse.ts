/**
 * Server-sent events as OpenAI frames them: each event is one `data: {json}` line followed by a
 * blank line, and the stream ends with `data: [DONE]`. No `event:` or `id:` fields.
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

/** Writes frames to a response once the headers are out; silently stops once the client is gone. */
export class SseWriter {
  readonly #res: ServerResponse;

  constructor(res: ServerResponse, status = 200) {
    this.#res = res;
    res.writeHead(status, SSE_HEADERS);
    res.flushHeaders();
  }

  get closed(): boolean {
    return this.#res.destroyed || this.#res.writableEnded;
  }

  send(payload: unknown): void {
    if (!this.closed) this.#res.write(sseFrame(payload));
  }

  /** Write `data: [DONE]` and end the response. */
  done(): void {
    if (!this.closed) this.#res.end(SSE_DONE);
  }
}
