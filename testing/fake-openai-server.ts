/**
 * A small OpenAI-compatible server for testing `kvfence probe` (node:http, 127.0.0.1, port 0). Its
 * "model" is a regex: it reads the records `the access code of account NNNN is XXX-XXX.` out of its
 * own prompt and answers the last question `What is the access code of account NNNN?` with the code,
 * or `unknown`. Tokens are bytes, as in kvfence-tiny. `/v1/models` reports `max_model_len`;
 * chat completions and completions (`prompt`) work streamed (SSE, with a final usage chunk when
 * `stream_options.include_usage` is set) and not. Streams send `chunkChars` characters per chunk,
 * `tokenDelayMs` apart, and `streams` records when each request arrived and when each chunk was
 * written (`performance.now()`, the clock of a client in the same process), for the serving
 * benchmark's tests.
 *
 * Well behaved by default; each `misbehave` entry switches on one bug the probe must catch:
 * - `leak`: a question about an account not in the prompt is answered with the code another API
 *   key planted earlier (cross-tenant leak).
 * - `accept-over-limit`: an over-limit prompt gets 200, answered from the truncated prompt (clean
 *   text, wrong status).
 * - `placeholder`: a prompt over the pool but under the context is swapped for a one-token
 *   placeholder and answered 200 with `unknown` (the SGLang incident).
 * - `truncated-answer`: answers to prompts over half the context are cut to 3 characters.
 * - `nondeterministic`: when another request overlaps this one, answers change.
 * - `server-error-over-limit`: over-limit prompts get 500 instead of 400.
 * - `accept-malformed`: malformed requests get 200.
 * - `cross-request`: every other answer is the code of the previous request's first record,
 *   whoever sent it (a server that mixes requests' context).
 *
 * `grammarCache` gives it a cache of compiled JSON schemas (`response_format` json_schema), shared
 * by every key or one per key: a schema not in it costs `compileMs` more (`probe --timing
 * --timing-case grammar` tells the two apart).
 */
import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { setTimeout as sleep } from "node:timers/promises";

export type Misbehaviour =
  | "leak"
  | "accept-over-limit"
  | "placeholder"
  | "truncated-answer"
  | "nondeterministic"
  | "server-error-over-limit"
  | "accept-malformed"
  | "cross-request";

export interface FakeOpenAiServerOptions {
  readonly model?: string;
  /** Context length in tokens (bytes), reported on /v1/models (default 4096). */
  readonly maxModelLen?: number;
  /** KV pool in tokens; prompts at or over min(context, pool) are rejected (default: no pool limit). */
  readonly poolTokens?: number;
  /** Report max_model_len on /v1/models (default true); when false, only /server_info tells it. */
  readonly modelsReportMaxLen?: boolean;
  /** Serve SGLang-style `/server_info` with `context_length` and `max_total_num_tokens`. */
  readonly sglangInfo?: boolean;
  /** Accepted API keys; when set, any other bearer token gets 401. */
  readonly apiKeys?: readonly string[];
  readonly misbehave?: readonly Misbehaviour[];
  /** Delay before answering, so concurrent requests overlap (default 3 ms). */
  readonly latencyMs?: number;
  /** Streams: characters per content chunk (default 3). */
  readonly chunkChars?: number;
  /** Streams: delay between content chunks (default 0: written at once). */
  readonly tokenDelayMs?: number;
  /** Streams: honour `stream_options.include_usage` (default true). */
  readonly streamUsage?: boolean;
  /** A compiled-schema cache: one for all keys (`shared`, the leak) or one per key (`per-key`). */
  readonly grammarCache?: "shared" | "per-key";
  /** What compiling a schema not in the cache costs (default 40 ms). */
  readonly compileMs?: number;
}

/** When a streamed request arrived and when each of its content chunks was written. */
export interface StreamLog {
  readonly receivedAt: number;
  readonly writes: number[];
  /** The streamed text, by chunk. */
  readonly chunks: string[];
}

export interface FakeOpenAiServer {
  readonly url: string;
  /** Chat completion requests received. */
  readonly chatRequests: number;
  /** Largest number of chat requests in flight at once. */
  readonly maxInFlight: number;
  /** Every streamed answer, in arrival order. */
  readonly streams: readonly StreamLog[];
  close(): Promise<void>;
}

const RECORD_RE = /the access code of account (\d{4}) is ([A-Z0-9]{3}-[A-Z0-9]{3})\./g;
const QUESTION_RE = /What is the access code of account (\d{4})\?/g;
const MAX_BODY_BYTES = 64 * 1024 * 1024;

/** Tokens of a chat under a ChatML template with single-token specials (bytes + 4 per message + 3). */
export function fakePromptTokens(messages: ReadonlyArray<{ role: string; content: string }>): number {
  let n = 3;
  for (const m of messages) n += Buffer.byteLength(m.role) + Buffer.byteLength(m.content) + 4;
  return n;
}

/** The regex "model": the code for the last question's account in `text`, or "unknown". */
export function fakeAnswer(text: string): { answer: string; account: string | null } {
  const records = new Map<string, string>();
  for (const m of text.matchAll(RECORD_RE)) records.set(m[1]!, m[2]!);
  let account: string | null = null;
  for (const m of text.matchAll(QUESTION_RE)) account = m[1]!;
  if (account === null) return { answer: "unknown", account };
  return { answer: records.get(account) ?? "unknown", account };
}

export async function startFakeOpenAiServer(
  options: FakeOpenAiServerOptions = {},
): Promise<FakeOpenAiServer> {
  const fake = new FakeOpenAi(options);
  const server = createServer((req, res) => {
    fake.handle(req, res).catch((err: unknown) => {
      if (!res.headersSent) sendError(res, 500, "internal", String(err));
      else res.end();
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const port = (server.address() as AddressInfo).port;
  return {
    url: `http://127.0.0.1:${port}`,
    get chatRequests() {
      return fake.chatRequests;
    },
    get maxInFlight() {
      return fake.maxInFlight;
    },
    get streams() {
      return fake.streams;
    },
    close: () =>
      new Promise<void>((resolve, reject) => {
        server.closeAllConnections();
        server.close((err) => (err ? reject(err) : resolve()));
      }),
  };
}

/** Who sent a completion request, which endpoint it came to, and when. */
interface Arrival {
  readonly key: string;
  /** Its number among the completion requests, from 1. */
  readonly arrival: number;
  /** `/v1/completions` (a `prompt`) rather than `/v1/chat/completions`. */
  readonly completions: boolean;
  readonly receivedAt: number;
}

/** How an answer is sent: streamed or not, in which endpoint's shape, with a usage chunk or not. */
interface Delivery {
  readonly stream: boolean;
  readonly completions: boolean;
  readonly includeUsage: boolean;
  readonly receivedAt: number;
}

/** A prompt as the "model" sees it: its text and its length in tokens. */
interface Prompt {
  readonly tokens: number;
  readonly text: string;
}

type Usage = { prompt_tokens: number; completion_tokens: number; total_tokens: number };

/** The fake's routes and its "model", with what it remembers across requests. */
class FakeOpenAi {
  readonly #options: FakeOpenAiServerOptions;
  readonly #model: string;
  readonly #maxModelLen: number;
  readonly #limit: number;
  readonly #bad: ReadonlySet<Misbehaviour>;
  readonly #chunkChars: number;
  readonly #tokenDelayMs: number;
  /** account → { code, key } for every record any tenant ever sent (what a leaky KV cache holds). */
  readonly #seen = new Map<string, { code: string; key: string }>();
  /** The first record of the previous request (for `cross-request`). */
  #previousCode: string | null = null;
  /** The schemas compiled, each with its key unless the cache is shared. */
  readonly #grammars = new Set<string>();
  readonly streams: StreamLog[] = [];
  chatRequests = 0;
  inFlight = 0;
  maxInFlight = 0;

  constructor(options: FakeOpenAiServerOptions) {
    this.#options = options;
    this.#model = options.model ?? "kvfence-tiny";
    this.#maxModelLen = options.maxModelLen ?? 4096;
    this.#limit = Math.min(this.#maxModelLen, options.poolTokens ?? Number.POSITIVE_INFINITY);
    this.#bad = new Set(options.misbehave ?? []);
    this.#chunkChars = options.chunkChars ?? 3;
    this.#tokenDelayMs = options.tokenDelayMs ?? 0;
  }

  async handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const options = this.#options;
    const key = (req.headers.authorization ?? "").replace(/^Bearer\s+/i, "");
    if (options.apiKeys !== undefined && !options.apiKeys.includes(key)) {
      await drain(req);
      return sendError(res, 401, "invalid_api_key", "Incorrect API key provided");
    }
    const path = (req.url ?? "/").split("?")[0];
    if (req.method === "GET" && path === "/v1/models") return this.#models(res);
    if (req.method === "GET" && path === "/server_info" && options.sglangInfo === true) {
      return sendJson(res, 200, {
        context_length: this.#maxModelLen,
        page_size: 1,
        max_total_num_tokens: options.poolTokens ?? this.#maxModelLen * 4,
        status: "ready",
        internal_states: [],
      });
    }
    const completions = path === "/v1/completions";
    if (req.method !== "POST" || (path !== "/v1/chat/completions" && !completions)) {
      await drain(req);
      return sendError(res, 404, "not_found", `No route ${req.method} ${path}`);
    }
    const receivedAt = performance.now();
    this.chatRequests++;
    this.inFlight++;
    this.maxInFlight = Math.max(this.maxInFlight, this.inFlight);
    try {
      await this.#chat(req, res, { key, arrival: this.chatRequests, completions, receivedAt });
    } finally {
      this.inFlight--;
    }
  }

  #models(res: ServerResponse): void {
    const card: Record<string, unknown> = { id: this.#model, object: "model", created: 0, owned_by: "fake" };
    if (this.#options.modelsReportMaxLen !== false) card.max_model_len = this.#maxModelLen;
    sendJson(res, 200, { object: "list", data: [card] });
  }

  async #chat(req: IncomingMessage, res: ServerResponse, from: Arrival): Promise<void> {
    const raw = await readBody(req);
    if (raw === null) return sendError(res, 413, "payload_too_large", "Request body too large");
    const parsed = parseRequest(raw, from.completions);
    if ("error" in parsed) {
      if (this.#bad.has("accept-malformed")) return this.#sendCompletion(res, "unknown", 1);
      return sendError(res, 400, "invalid_request", parsed.error);
    }
    const { messages } = parsed;
    if (parsed.model !== undefined && parsed.model !== this.#model) {
      return sendError(res, 404, "model_not_found", `The model does not exist: ${parsed.model}`);
    }
    const prompt = this.#admit(
      res,
      parsed.prompt === undefined
        ? { tokens: fakePromptTokens(messages), text: messages.map((m) => m.content).join("\n") }
        : { tokens: Buffer.byteLength(parsed.prompt), text: parsed.prompt },
    );
    if (prompt === null) return;
    // Remember every record (what pages of a shared pool would hold).
    for (const m of prompt.text.matchAll(RECORD_RE))
      if (!this.#seen.has(m[1]!)) this.#seen.set(m[1]!, { code: m[2]!, key: from.key });
    await this.#compile(raw, from.key);
    await sleep(this.#options.latencyMs ?? 3);
    return this.#sendCompletion(res, this.#answer(prompt, from), prompt.tokens, {
      stream: parsed.stream,
      completions: from.completions,
      includeUsage: parsed.includeUsage && this.#options.streamUsage !== false,
      receivedAt: from.receivedAt,
    });
  }

  /** A constrained request's schema "compiled", unless the grammar cache (shared or the key's) holds it. */
  async #compile(raw: string, key: string): Promise<void> {
    const cache = this.#options.grammarCache;
    if (cache === undefined) return;
    const body = JSON.parse(raw) as { response_format?: { json_schema?: { schema?: unknown } } };
    const schema = body.response_format?.json_schema?.schema;
    if (schema === undefined) return;
    const id = `${cache === "per-key" ? key : ""}\n${JSON.stringify(schema)}`;
    if (this.#grammars.has(id)) return;
    this.#grammars.add(id);
    await sleep(this.#options.compileMs ?? 40);
  }

  /** The prompt as served: refused over the limit (null, answered), or what a misbehaviour makes of it. */
  #admit(res: ServerResponse, prompt: Prompt): Prompt | null {
    const { tokens } = prompt;
    if (tokens < this.#limit) return prompt;
    const bad = this.#bad;
    // The incident: the prompt is swapped for a one-token placeholder and still "succeeds".
    if (bad.has("placeholder") && tokens < this.#maxModelLen) return { text: "", tokens: 1 };
    if (bad.has("accept-over-limit"))
      return { ...prompt, text: prompt.text.slice(prompt.text.length - (this.#limit - 32)) };
    if (bad.has("server-error-over-limit")) sendError(res, 500, "internal", "Internal server error");
    else {
      sendError(
        res,
        400,
        "context_length_exceeded",
        `This model's maximum context length is ${this.#limit} tokens; the prompt has ${tokens}`,
      );
    }
    return null;
  }

  /** The regex model's answer, bent by the misbehaviours switched on. */
  #answer(prompt: Prompt, from: Arrival): string {
    const bad = this.#bad;
    let { answer, account } = fakeAnswer(prompt.text);
    if (answer === "unknown" && account !== null && bad.has("leak")) {
      const other = this.#seen.get(account);
      if (other !== undefined && other.key !== from.key) answer = other.code;
    }
    const firstRecord = RECORD_RE.exec(prompt.text);
    RECORD_RE.lastIndex = 0;
    if (bad.has("cross-request") && from.arrival % 2 === 0 && this.#previousCode !== null) {
      answer = this.#previousCode;
    }
    this.#previousCode = firstRecord?.[2] ?? this.#previousCode;
    if (bad.has("truncated-answer") && prompt.tokens > this.#maxModelLen / 2) answer = answer.slice(0, 3);
    // "Under load": another request is in flight now or arrived while this one was served.
    const underLoad = this.inFlight > 1 || this.chatRequests !== from.arrival;
    if (bad.has("nondeterministic") && underLoad) answer = answer === "unknown" ? "unknown." : `${answer}?`;
    return answer;
  }

  async #sendCompletion(
    res: ServerResponse,
    answer: string,
    promptTokens: number,
    how: Delivery = { stream: false, completions: false, includeUsage: false, receivedAt: 0 },
  ): Promise<void> {
    const id = how.completions ? `cmpl-fake${this.chatRequests}` : `chatcmpl-fake${this.chatRequests}`;
    const usage = {
      prompt_tokens: promptTokens,
      completion_tokens: answer.length,
      total_tokens: promptTokens + answer.length,
    };
    if (how.stream) return this.#sendStream(res, { id, answer, usage }, how);
    sendJson(res, 200, {
      id,
      object: how.completions ? "text_completion" : "chat.completion",
      created: 0,
      model: this.#model,
      choices: [
        how.completions
          ? { index: 0, text: answer, finish_reason: "stop" }
          : { index: 0, message: { role: "assistant", content: answer }, finish_reason: "stop" },
      ],
      usage,
    });
  }

  /**
   * An SSE answer: the role chunk (chat), content chunks of `chunkChars` characters `tokenDelayMs`
   * apart (each write logged in `streams`), the stop chunk, and the usage chunk when asked for.
   */
  async #sendStream(
    res: ServerResponse,
    completion: { readonly id: string; readonly answer: string; readonly usage: Usage },
    how: Delivery,
  ): Promise<void> {
    const { id, answer } = completion;
    const object = how.completions ? "text_completion" : "chat.completion.chunk";
    const frame = (choices: unknown[], usage?: Usage) =>
      `data: ${JSON.stringify({ id, object, created: 0, model: this.#model, choices, usage })}\n\n`;
    const chunk = (piece: string | null, finish: string | null) =>
      frame([
        how.completions
          ? { index: 0, text: piece ?? "", finish_reason: finish }
          : { index: 0, delta: piece === null ? {} : { content: piece }, finish_reason: finish },
      ]);
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" });
    const log: StreamLog = { receivedAt: how.receivedAt, writes: [], chunks: [] };
    this.streams.push(log);
    if (!how.completions) {
      res.write(frame([{ index: 0, delta: { role: "assistant", content: "" }, finish_reason: null }]));
    }
    for (let i = 0; i < answer.length; i += this.#chunkChars) {
      if (i > 0 && this.#tokenDelayMs > 0) await sleep(this.#tokenDelayMs);
      const piece = answer.slice(i, i + this.#chunkChars);
      log.writes.push(performance.now());
      log.chunks.push(piece);
      res.write(chunk(piece, null));
    }
    res.write(chunk(null, "stop"));
    if (how.includeUsage) res.write(frame([], completion.usage));
    res.end("data: [DONE]\n\n");
  }
}

type ParsedRequest =
  | {
      messages: Array<{ role: string; content: string }>;
      /** A completions request's prompt. */
      prompt?: string;
      stream: boolean;
      includeUsage: boolean;
      model: string | undefined;
    }
  | { error: string };

function parseRequest(raw: string, completions = false): ParsedRequest {
  let body: unknown;
  try {
    body = JSON.parse(raw);
  } catch {
    return { error: "Request body is not valid JSON" };
  }
  if (typeof body !== "object" || body === null) return { error: "Request body must be a JSON object" };
  const b = body as Record<string, unknown>;
  const includeUsage = (b.stream_options as { include_usage?: unknown } | undefined)?.include_usage === true;
  if (completions) {
    if (typeof b.prompt !== "string") return { error: "prompt must be a string" };
    if (b.model !== undefined && typeof b.model !== "string") return { error: "model must be a string" };
    return {
      messages: [],
      prompt: b.prompt,
      stream: b.stream === true,
      includeUsage,
      model: b.model as string | undefined,
    };
  }
  if (!Array.isArray(b.messages) || b.messages.length === 0)
    return { error: "messages must be a non-empty array" };
  const messages: Array<{ role: string; content: string }> = [];
  for (const m of b.messages) {
    const mm = m as Record<string, unknown> | null;
    if (typeof mm?.role !== "string" || typeof mm.content !== "string") {
      return { error: "each message needs a string role and string content" };
    }
    messages.push({ role: mm.role, content: mm.content });
  }
  if (b.max_tokens !== undefined && (!Number.isInteger(b.max_tokens) || (b.max_tokens as number) < 1)) {
    return { error: "max_tokens must be a positive integer" };
  }
  if (b.temperature !== undefined && typeof b.temperature !== "number")
    return { error: "temperature must be a number" };
  if (b.model !== undefined && typeof b.model !== "string") return { error: "model must be a string" };
  return { messages, stream: b.stream === true, includeUsage, model: b.model as string | undefined };
}

async function readBody(req: IncomingMessage): Promise<string | null> {
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const c of req) {
    size += (c as Buffer).length;
    if (size > MAX_BODY_BYTES) return null;
    chunks.push(c as Buffer);
  }
  return Buffer.concat(chunks).toString("utf8");
}

async function drain(req: IncomingMessage): Promise<void> {
  for await (const _ of req) {
    // Discard.
  }
}

function sendJson(res: ServerResponse, status: number, body: unknown): void {
  const text = JSON.stringify(body);
  res.writeHead(status, { "content-type": "application/json", "content-length": Buffer.byteLength(text) });
  res.end(text);
}

function sendError(res: ServerResponse, status: number, code: string, message: string): void {
  sendJson(res, status, {
    error: { message, type: status >= 500 ? "server_error" : "invalid_request_error", param: null, code },
  });
}

/** A route of a static test server: a JSON value, or raw text with a content type. */
export type StaticRoute =
  | { json: unknown; status?: number }
  | { text: string; contentType: string; status?: number };

/** Serve fixed GET routes on 127.0.0.1 port 0 (404 for anything else); for preflight's fakes. */
export async function startStaticServer(
  routes: Record<string, StaticRoute>,
): Promise<{ url: string; hits: string[]; close(): Promise<void> }> {
  const hits: string[] = [];
  const server = createServer((req, res) => {
    const path = (req.url ?? "/").split("?")[0] ?? "/";
    hits.push(path);
    const route = routes[path];
    if (req.method !== "GET" || route === undefined)
      return sendError(res, 404, "not_found", `No route ${path}`);
    if ("json" in route) return sendJson(res, route.status ?? 200, route.json);
    res.writeHead(route.status ?? 200, { "content-type": route.contentType });
    res.end(route.text);
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    hits,
    close: () =>
      new Promise<void>((resolve, reject) => {
        server.closeAllConnections();
        server.close((err) => (err ? reject(err) : resolve()));
      }),
  };
}
