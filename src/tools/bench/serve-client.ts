/**
 * One streamed request of `kvfence bench serve`, timed as the client sees it: the time it was
 * sent, the arrival time of every chunk that carries generated text, and the end of the response.
 * Talks to any OpenAI-compatible server with Node's global `fetch`; the server-sent events are
 * parsed by `eventsource-parser`. Each network read is stamped with `performance.now()` when it
 * arrives, before it is parsed, so every event in it carries that read's time.
 *
 * A request fails (and says why) on a non-200 status, an error event inside the stream, a stream
 * that ends without `data: [DONE]` or without any choice, a network error or the timeout. It never
 * throws. A stream whose only choice is the finish (the model ended at once) succeeds with no text;
 * its first token is then that chunk, as vLLM counts it.
 */
import { createParser } from "eventsource-parser";
import { errorMessage } from "../probe/chat-client.js";

export type ServeEndpoint = "/v1/chat/completions" | "/v1/completions";

export interface StreamOutcome {
  readonly ok: boolean;
  /** HTTP status, 0 when no response arrived. */
  readonly status: number;
  readonly error: string | null;
  /** `performance.now()` just before the request was sent. */
  readonly sentAt: number;
  /** `performance.now()` at the arrival of each chunk that carried generated text. */
  readonly tokenTimes: readonly number[];
  /** `performance.now()` at the arrival of the first chunk with a choice (text or not), or null. */
  readonly firstChoiceAt: number | null;
  /** `performance.now()` when the response ended (or failed). */
  readonly endAt: number;
  readonly text: string;
  /** `usage` of the final chunk, when the server sent one. */
  readonly promptTokens: number | null;
  readonly completionTokens: number | null;
  /** `usage.prompt_tokens_details.cached_tokens` (prompt tokens from a prefix cache), when sent. */
  readonly cachedTokens: number | null;
}

export interface StreamRequest {
  /** Base URL without `/v1`. */
  readonly baseUrl: string;
  readonly endpoint: ServeEndpoint;
  readonly apiKey: string | undefined;
  /** The JSON body; `stream` and `stream_options.include_usage` are set here. */
  readonly body: Record<string, unknown>;
  readonly timeoutMs: number;
}

export async function streamRequest(request: StreamRequest): Promise<StreamOutcome> {
  const headers: Record<string, string> = { "content-type": "application/json", accept: "text/event-stream" };
  if (request.apiKey !== undefined) headers.authorization = `Bearer ${request.apiKey}`;
  const body = JSON.stringify({ ...request.body, stream: true, stream_options: { include_usage: true } });
  const tokenTimes: number[] = [];
  let text = "";
  let promptTokens: number | null = null;
  let completionTokens: number | null = null;
  let cachedTokens: number | null = null;
  let inBandError: string | null = null;
  let done = false;
  let status = 0;
  let firstChoiceAt: number | null = null;
  const sentAt = performance.now();
  const finish = (error: string | null): StreamOutcome => ({
    ok: error === null,
    status,
    error,
    sentAt,
    tokenTimes,
    firstChoiceAt,
    endAt: performance.now(),
    text,
    promptTokens,
    completionTokens,
    cachedTokens,
  });
  try {
    const res = await fetch(`${request.baseUrl}${request.endpoint}`, {
      method: "POST",
      headers,
      body,
      signal: AbortSignal.timeout(request.timeoutMs),
    });
    status = res.status;
    if (status !== 200 || res.body === null) {
      const raw = await res.text();
      return finish(`HTTP ${status}: ${errorMessage(parseJson(raw)) ?? raw.slice(0, 200)}`);
    }
    let at = 0;
    const parser = createParser({
      onEvent(event) {
        if (event.data === "[DONE]") {
          done = true;
          return;
        }
        const json = parseJson(event.data);
        const err = errorMessage(json);
        if (err !== null) {
          inBandError ??= err;
          return;
        }
        const choices = field(json, "choices");
        if (firstChoiceAt === null && Array.isArray(choices) && choices.length > 0) firstChoiceAt = at;
        const piece = chunkText(json, request.endpoint);
        if (piece !== null && piece !== "") {
          tokenTimes.push(at);
          text += piece;
        }
        const usage = field(json, "usage");
        const p = field(usage, "prompt_tokens");
        const c = field(usage, "completion_tokens");
        if (typeof p === "number") promptTokens = p;
        if (typeof c === "number") completionTokens = c;
        const cached = field(field(usage, "prompt_tokens_details"), "cached_tokens");
        if (typeof cached === "number") cachedTokens = cached;
      },
    });
    const decoder = new TextDecoder();
    for await (const chunk of res.body) {
      at = performance.now();
      parser.feed(decoder.decode(chunk as Uint8Array, { stream: true }));
    }
    parser.feed(decoder.decode());
    if (inBandError !== null) return finish(`error in the stream: ${inBandError}`);
    if (!done) return finish("the stream ended without data: [DONE]");
    if (firstChoiceAt === null) return finish("the stream carried no choice");
    return finish(null);
  } catch (err) {
    const e = err as Error;
    return finish(
      e.name === "TimeoutError" ? `timed out after ${request.timeoutMs} ms` : `${e.name}: ${e.message}`,
    );
  }
}

function parseJson(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return null;
  }
}

function field(v: unknown, key: string): unknown {
  return typeof v === "object" && v !== null ? (v as Record<string, unknown>)[key] : undefined;
}

/** The text a chunk adds: `choices[0].delta.content` (chat) or `choices[0].text` (completions). */
function chunkText(json: unknown, endpoint: ServeEndpoint): string | null {
  const choices = field(json, "choices");
  const first = Array.isArray(choices) ? choices[0] : undefined;
  const v = endpoint === "/v1/completions" ? field(first, "text") : field(field(first, "delta"), "content");
  return typeof v === "string" ? v : null;
}
