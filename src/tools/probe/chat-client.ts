/**
 * The probe's HTTP client for any OpenAI-compatible server, on Node's global `fetch` (no SDK at run
 * time): chat completions non-streamed and streamed (SSE), and raw bodies for malformed-request
 * cases. It never throws for an HTTP status; every outcome is data the probe judges. Network
 * failures and timeouts come back as `status: 0` with the error text.
 */

/** What one request produced. */
export interface ChatOutcome {
  /** HTTP status, or 0 when no response arrived (network error or timeout). */
  readonly status: number;
  /** Assistant text (non-streamed: choices[0].message.content; streamed: joined deltas). */
  readonly text: string;
  readonly streamed: boolean;
  /** `usage.prompt_tokens` when the server reported it. */
  readonly promptTokens: number | null;
  /** Error message from a non-2xx body, an in-band SSE error event, or the network. */
  readonly error: string | null;
  /** True when a 200 stream carried an error event. */
  readonly inBandError: boolean;
  /** The raw body (truncated) for non-2xx answers, for the report. */
  readonly rawExcerpt: string;
  readonly elapsedMs: number;
}

export interface ClientOptions {
  /** Base URL without `/v1`. */
  readonly baseUrl: string;
  readonly timeoutMs: number;
  /** Aborts every request when the overall budget runs out. */
  readonly signal?: AbortSignal;
}

/** POST a chat completion with a JSON body built from `body`; `stream` decides SSE or not. */
export async function postChat(
  client: ClientOptions,
  apiKey: string | undefined,
  body: Record<string, unknown>,
): Promise<ChatOutcome> {
  return postRaw(client, apiKey, JSON.stringify(body), body.stream === true);
}

/** POST an arbitrary (possibly malformed) body to /v1/chat/completions. */
export async function postRaw(
  client: ClientOptions,
  apiKey: string | undefined,
  rawBody: string,
  stream: boolean,
): Promise<ChatOutcome> {
  const started = performance.now();
  const headers: Record<string, string> = { "content-type": "application/json" };
  if (apiKey !== undefined) headers.authorization = `Bearer ${apiKey}`;
  const timeout = AbortSignal.timeout(client.timeoutMs);
  const signal = client.signal === undefined ? timeout : AbortSignal.any([timeout, client.signal]);
  const done = (o: Omit<ChatOutcome, "elapsedMs" | "streamed">): ChatOutcome => ({
    ...o,
    streamed: stream,
    elapsedMs: performance.now() - started,
  });
  try {
    const res = await fetch(`${client.baseUrl}/v1/chat/completions`, {
      method: "POST",
      headers,
      body: rawBody,
      signal,
    });
    const contentType = res.headers.get("content-type") ?? "";
    if (res.status === 200 && contentType.includes("text/event-stream")) {
      const sse = await readSse(res);
      return done({
        status: 200,
        text: sse.text,
        promptTokens: sse.promptTokens,
        error: sse.error,
        inBandError: sse.error !== null,
        rawExcerpt: "",
      });
    }
    const raw = await res.text();
    let json: unknown = null;
    try {
      json = JSON.parse(raw);
    } catch {
      // Not JSON: reported through rawExcerpt.
    }
    if (res.ok) {
      return done({
        status: res.status,
        text: messageText(json) ?? raw,
        promptTokens: promptTokensOf(json),
        error: null,
        inBandError: false,
        rawExcerpt: "",
      });
    }
    return done({
      status: res.status,
      text: messageText(json) ?? "",
      promptTokens: null,
      error: errorMessage(json) ?? `HTTP ${res.status}`,
      inBandError: false,
      rawExcerpt: raw.slice(0, 300),
    });
  } catch (err) {
    const e = err as Error;
    return done({
      status: 0,
      text: "",
      promptTokens: null,
      error: e.name === "TimeoutError" ? `timed out after ${client.timeoutMs} ms` : `${e.name}: ${e.message}`,
      inBandError: false,
      rawExcerpt: "",
    });
  }
}

async function readSse(
  res: Response,
): Promise<{ text: string; promptTokens: number | null; error: string | null }> {
  let text = "";
  let promptTokens: number | null = null;
  let error: string | null = null;
  let buffer = "";
  const decoder = new TextDecoder();
  const handle = (event: string): boolean => {
    for (const line of event.split("\n")) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return true;
      let json: unknown;
      try {
        json = JSON.parse(data);
      } catch {
        error ??= `unparseable SSE data: ${data.slice(0, 80)}`;
        continue;
      }
      const msg = errorMessage(json);
      if (msg !== null) error ??= msg;
      const delta = deltaText(json);
      if (delta !== null) text += delta;
      promptTokens = promptTokensOf(json) ?? promptTokens;
    }
    return false;
  };
  if (res.body === null) return { text, promptTokens, error };
  for await (const chunk of res.body) {
    buffer += decoder.decode(chunk as Uint8Array, { stream: true });
    buffer = buffer.replaceAll("\r\n", "\n");
    let cut = buffer.indexOf("\n\n");
    while (cut >= 0) {
      if (handle(buffer.slice(0, cut))) return { text, promptTokens, error };
      buffer = buffer.slice(cut + 2);
      cut = buffer.indexOf("\n\n");
    }
  }
  if (buffer.trim() !== "") handle(buffer);
  return { text, promptTokens, error };
}

function field(v: unknown, key: string): unknown {
  return typeof v === "object" && v !== null ? (v as Record<string, unknown>)[key] : undefined;
}

function firstChoice(json: unknown): unknown {
  const choices = field(json, "choices");
  return Array.isArray(choices) ? choices[0] : undefined;
}

function messageText(json: unknown): string | null {
  const content = field(field(firstChoice(json), "message"), "content");
  return typeof content === "string" ? content : null;
}

function deltaText(json: unknown): string | null {
  const content = field(field(firstChoice(json), "delta"), "content");
  return typeof content === "string" ? content : null;
}

function promptTokensOf(json: unknown): number | null {
  const n = field(field(json, "usage"), "prompt_tokens");
  return typeof n === "number" ? n : null;
}

/** The message of an error body or event (OpenAI's `{"error":{"message"}}`, a bare string, vLLM's older shape). */
export function errorMessage(json: unknown): string | null {
  const e = field(json, "error");
  if (typeof e === "string") return e;
  const m = field(e, "message");
  if (typeof m === "string") return m;
  // vLLM's older error shape: {"object": "error", "message": ...}
  if (field(json, "object") === "error") {
    const msg = field(json, "message");
    return typeof msg === "string" ? msg : "error";
  }
  return null;
}
