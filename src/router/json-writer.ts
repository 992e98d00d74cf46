/**
 * Writes JSON to an HTTP response without holding the event loop, however large: each value is
 * serialised a chunk at a time (src/lib/json-chunks.ts), each chunk written as soon as it is made,
 * with backpressure — when the socket's buffer is full the writer waits for `drain` (or the
 * client's going away) before making the next chunk — and after every `TURN_CHARS` written it lets
 * the event loop run. So a 200 MB answer costs the router its socket's buffer and a chunk beyond
 * the answer's own objects, even for a client that does not read, and other requests (another
 * tenant's, `/health`) are served between its chunks (src/router/response-size-attack.solo.test.ts).
 * Values are written in the order they were given; a small one, with nothing queued before it, is
 * written at once, in the same call.
 *
 * `sendJson` answers a whole JSON body: with `Content-Length` when it fits one chunk, else chunked.
 */
import type { ServerResponse } from "node:http";
import { JSON_CHUNK_CHARS, jsonChunks } from "../lib/json-chunks.js";

/** Characters written between two turns of the event loop. */
const TURN_CHARS = JSON_CHUNK_CHARS;

const JSON_CONTENT_TYPE = "application/json; charset=utf-8";

/** Resolves once `res` can take more (`drain`) or never will (`close`). */
function drained(res: ServerResponse): Promise<void> {
  return new Promise((resolve) => {
    const done = () => {
      res.off("drain", done);
      res.off("close", done);
      resolve();
    };
    res.on("drain", done);
    res.on("close", done);
  });
}

const nextTurn = () => new Promise<void>((resolve) => setImmediate(resolve));

/** `prefix`, then `value`'s JSON, then `suffix`, joined to its first and last chunks. */
function* framed(value: unknown, prefix: string, suffix: string): Generator<string, void, undefined> {
  let held: string | null = null;
  for (const chunk of jsonChunks(value)) {
    if (held !== null) yield held;
    held = held === null ? prefix + chunk : chunk;
  }
  yield (held ?? prefix) + suffix;
}

function* resumed(head: readonly string[], rest: Iterator<string>): Generator<string, void, undefined> {
  yield* head;
  for (let next = rest.next(); next.done !== true; next = rest.next()) yield next.value;
}

/** A response body made of JSON values written one after another (SSE frames, or one whole answer). */
export class JsonWriter {
  readonly #res: ServerResponse;
  readonly #onError: (err: unknown) => void;
  readonly #queue: Iterator<string>[] = [];
  /** What `end` was called with, once it was. */
  #ending: { readonly text: string | undefined } | null = null;
  #pumping = false;

  /** `onError`: a value could not be serialised (a bug); the response is then destroyed. */
  constructor(res: ServerResponse, onError: (err: unknown) => void) {
    this.#res = res;
    this.#onError = onError;
  }

  /** Writes `prefix`, `value`'s JSON and `suffix` after everything written before. */
  write(value: unknown, prefix = "", suffix = ""): void {
    this.#enqueue(framed(value, prefix, suffix));
  }

  /** Ends the response, after everything written before, with `text` last. */
  end(text?: string): void {
    if (this.#ending !== null) return;
    this.#ending = { text };
    this.#kick();
  }

  /** Writes chunks of JSON text already made, then the rest of their generator (`sendJson`). */
  writeChunks(head: readonly string[], rest: Iterator<string>): void {
    this.#enqueue(resumed(head, rest));
  }

  #enqueue(chunks: Iterator<string>): void {
    if (this.#ending !== null) return;
    this.#queue.push(chunks);
    this.#kick();
  }

  #kick(): void {
    if (this.#pumping) return;
    this.#pump().catch((err: unknown) => {
      this.#queue.length = 0;
      this.#res.destroy();
      this.#onError(err);
    });
  }

  /** Writes queued chunks until none is left; runs in the caller's call until it has to wait. */
  async #pump(): Promise<void> {
    this.#pumping = true;
    try {
      const res = this.#res;
      let written = 0;
      for (;;) {
        if (res.destroyed || res.writableEnded) {
          this.#queue.length = 0;
          return;
        }
        const chunks = this.#queue[0];
        if (chunks === undefined) break;
        const next = chunks.next();
        if (next.done === true) {
          this.#queue.shift();
          continue;
        }
        written += next.value.length;
        // A full buffer waits for `drain`, which a socket that took the bytes at once emits on the
        // next tick, before any timer or I/O: the turn is yielded as well.
        if (!res.write(next.value)) await drained(res);
        if (written >= TURN_CHARS) {
          await nextTurn();
          written = 0;
        }
      }
      if (this.#ending !== null) res.end(this.#ending.text);
    } finally {
      this.#pumping = false;
    }
  }
}

/**
 * A whole JSON answer: written at once with `Content-Length` when it is one chunk, else chunk by
 * chunk (`Transfer-Encoding: chunked`) by a `JsonWriter`.
 */
export function sendJson(
  res: ServerResponse,
  status: number,
  value: unknown,
  headers: Record<string, string>,
  onError: (err: unknown) => void,
): void {
  const chunks = jsonChunks(value);
  const first = chunks.next();
  const second = first.done === true ? first : chunks.next();
  if (second.done === true) {
    const text = first.done === true ? "" : first.value;
    res.writeHead(status, {
      ...headers,
      "Content-Type": JSON_CONTENT_TYPE,
      "Content-Length": String(Buffer.byteLength(text)),
    });
    res.end(text);
    return;
  }
  res.writeHead(status, { ...headers, "Content-Type": JSON_CONTENT_TYPE });
  const writer = new JsonWriter(res, onError);
  writer.writeChunks([first.value as string, second.value], chunks);
  writer.end();
}
