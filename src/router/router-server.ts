/**
 * The OpenAI-compatible HTTP front door (docs/design.md §2, "router"), on node:http so that a client
 * disconnect is seen at once (`res` "close") and turned into `engine.abort`, which frees the
 * request's KV pages.
 *
 * Per request: route → method → API key (tenant) → body (Content-Type, size limit, strict UTF-8,
 * JSON) → zod validation → model → chat template + tokenize → admission → engine. Every failure on
 * that path is a KvfenceError rendered once, by `#sendError`, through `toOpenAiError`. A request
 * refused at admission never reaches the engine, so nothing is allocated for it.
 *
 * Streaming responses write their headers on the first engine event, not before: an error the
 * engine raises before the first token (its own admission door, a page-tag mismatch) still reaches
 * the client as a real 4xx/5xx status rather than an error inside a 200 stream.
 */
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import { createServer as createHttpsServer } from "node:https";
import type { AddressInfo } from "node:net";
import { performance } from "node:perf_hooks";
import { KvfenceError, toOpenAiError } from "../lib/errors.js";
import type { Logger } from "../lib/logger.js";
import { PROMETHEUS_CONTENT_TYPE } from "../lib/metrics.js";
import type { NodesInfo } from "../protocol/admin-wire.js";
import type { EngineHandle, GenerationRequest } from "../protocol/engine-api.js";
import { admit, effectiveContextLength } from "./admission.js";
import type { Tenant, TenantDirectory } from "./api-keys.js";
import { answerClientError } from "./client-error.js";
import { type FinishReason, Generation, type TextStreamDecoder, type Usage } from "./generation.js";
import {
  chatChunk,
  chatCompletion,
  completionId,
  type ResponseMeta,
  textChunk,
  textCompletion,
  usageChunk,
} from "./openai-responses.js";
import {
  type ChatMessage,
  parseChatRequest,
  parseCompletionRequest,
  type SamplingRequest,
} from "./openai-schemas.js";
import { checkJsonContentType, parseJsonBody, readBody } from "./read-body.js";
import { type Endpoint, RouterMetrics } from "./router-metrics.js";
import { SseWriter, sseFrame } from "./sse.js";

/** What the router needs from the tokenizer: no model weights, ever. */
export interface RouterTokenizer {
  /** Prompt ids of a chat (template rendered with the generation prompt); throws `invalid_request`. */
  encodeChat(messages: readonly ChatMessage[]): Int32Array;
  /** Prompt ids of a raw completion prompt (with the tokenizer's own special tokens, e.g. BOS). */
  encodePrompt(text: string): Int32Array;
  /** A fresh UTF-8-safe streaming detokenizer, one per response. */
  createDecoder(): TextStreamDecoder;
}

export interface ServedModel {
  /** The `model` name clients send. */
  readonly id: string;
  readonly maxPositionEmbeddings: number;
  readonly eosTokenIds: readonly number[];
  /** From generation_config.json; used when a request leaves a field out. */
  readonly defaults?: { readonly temperature?: number; readonly topP?: number; readonly topK?: number };
}

export interface RouterServerOptions {
  readonly engine: EngineHandle;
  readonly tokenizer: RouterTokenizer;
  readonly model: ServedModel;
  readonly tenants: TenantDirectory;
  readonly logger: Logger;
  /** `--max-model-len`. */
  readonly maxModelLen?: number | undefined;
  /** Request bodies over this are refused with 413 (default 16 MiB). */
  readonly maxBodyBytes?: number;
  /** `--unsafe-fault` / `--unsafe-disable-guard` names, shown in /health and /metrics. */
  readonly unsafe?: { readonly faults: readonly string[]; readonly disabledGuards: readonly string[] };
  /** Serve HTTPS with this certificate and key (`--https-cert/--https-key`, docs/tls.md). */
  readonly https?: { readonly cert: Buffer; readonly key: Buffer };
}

type Handler = (ctx: RequestContext) => Promise<void> | void;

interface Route {
  readonly endpoint: Endpoint;
  readonly methods: readonly string[];
  readonly handler: Handler;
}

interface RequestContext {
  readonly req: IncomingMessage;
  readonly res: ServerResponse;
  readonly url: URL;
  readonly receivedAt: number;
  tenant: Tenant | null;
}

export const DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024;
const U32_MAX = 0xffff_ffff;

export class RouterServer {
  readonly #engine: EngineHandle;
  readonly #tokenizer: RouterTokenizer;
  readonly #model: ServedModel;
  readonly #tenants: TenantDirectory;
  readonly #log: Logger;
  readonly #maxBodyBytes: number;
  readonly #routes: Map<string, Route>;
  readonly #server: Server;
  readonly #scheme: "http" | "https";
  readonly #active = new Set<Generation>();
  readonly #created = Math.floor(Date.now() / 1000);
  readonly #unsafe: { readonly faults: readonly string[]; readonly disabledGuards: readonly string[] } | null;
  #nextRid = 1;
  #url: string | null = null;
  /** The longest request (prompt + max_tokens) admitted. */
  readonly contextLength: number;
  readonly metrics: RouterMetrics;

  constructor(options: RouterServerOptions) {
    this.#engine = options.engine;
    this.#tokenizer = options.tokenizer;
    this.#model = options.model;
    this.#tenants = options.tenants;
    this.#log = options.logger;
    this.#maxBodyBytes = options.maxBodyBytes ?? DEFAULT_MAX_BODY_BYTES;
    this.contextLength = Math.min(
      effectiveContextLength({
        maxPositionEmbeddings: options.model.maxPositionEmbeddings,
        maxModelLen: options.maxModelLen,
        poolTokens: options.engine.capacity.poolTokens,
      }),
      options.engine.capacity.maxModelLen,
    );
    this.metrics = new RouterMetrics(options.engine);
    const unsafe = options.unsafe;
    this.#unsafe =
      unsafe !== undefined && (unsafe.faults.length > 0 || unsafe.disabledGuards.length > 0) ? unsafe : null;
    if (this.#unsafe !== null) {
      const fault = this.metrics.registry.gauge(
        "kvfence_unsafe_fault",
        "1 for each fault injected with --unsafe-fault (tests and demos only)",
        ["name"],
      );
      for (const name of this.#unsafe.faults) fault.set(1, { name });
      const guard = this.metrics.registry.gauge(
        "kvfence_guard_disabled",
        "1 for each guard switched off with --unsafe-disable-guard (tests and demos only)",
        ["name"],
      );
      for (const name of this.#unsafe.disabledGuards) guard.set(1, { name });
    }
    this.#routes = new Map<string, Route>([
      ["/v1/chat/completions", { endpoint: "chat", methods: ["POST"], handler: (c) => this.#chat(c) }],
      [
        "/v1/completions",
        { endpoint: "completions", methods: ["POST"], handler: (c) => this.#completions(c) },
      ],
      ["/v1/models", { endpoint: "models", methods: ["GET"], handler: (c) => this.#models(c) }],
      ["/health", { endpoint: "health", methods: ["GET"], handler: (c) => this.#health(c) }],
      ["/metrics", { endpoint: "metrics", methods: ["GET"], handler: (c) => this.#metrics(c) }],
      ["/kvfence/nodes", { endpoint: "nodes", methods: ["GET"], handler: (c) => this.#nodes(c) }],
    ]);
    const handle = (req: IncomingMessage, res: ServerResponse): void => {
      // #handle answers every error itself; this only keeps a bug from becoming a crash.
      this.#handle(req, res).catch((err: unknown) => this.#sendError(res, err));
    };
    this.#scheme = options.https === undefined ? "http" : "https";
    this.#server =
      options.https === undefined
        ? createServer({ noDelay: true, keepAliveTimeout: 5000 }, handle)
        : createHttpsServer({ ...options.https, noDelay: true, keepAliveTimeout: 5000 }, handle);
    this.#server.on("clientError", answerClientError);
  }

  /** Listen on `host:port` (port 0 = any free port); resolves to the base URL. */
  listen(port: number, host: string): Promise<string> {
    return new Promise((resolve, reject) => {
      const onError = (err: Error) => reject(err);
      this.#server.once("error", onError);
      this.#server.listen(port, host, () => {
        this.#server.off("error", onError);
        const address = this.#server.address() as AddressInfo;
        const shownHost = address.family === "IPv6" ? `[${address.address}]` : address.address;
        this.#url = `${this.#scheme}://${shownHost}:${address.port}`;
        resolve(this.#url);
      });
    });
  }

  /** The base URL once listening. */
  get url(): string {
    if (this.#url === null) throw new Error("RouterServer is not listening");
    return this.#url;
  }

  /** Generations in flight (for shutdown). */
  get activeRequests(): number {
    return this.#active.size;
  }

  /**
   * Stop accepting connections; wait up to `graceMs` for requests in flight, then close every
   * connection (which aborts their engine requests). Does not close the engine.
   */
  async close(graceMs = 0): Promise<void> {
    const closed = new Promise<void>((resolve) => this.#server.close(() => resolve()));
    this.#server.closeIdleConnections();
    const deadline = Date.now() + graceMs;
    while (this.#active.size > 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    for (const generation of this.#active) generation.abort();
    this.#active.clear();
    this.#server.closeAllConnections();
    await closed;
  }

  async #handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    // `new URL` throws on some targets (`//`, `http://[::1`): they get a 400, not an unhandled throw.
    const target = req.url ?? "/";
    const valid = URL.canParse(target, "http://localhost");
    const ctx: RequestContext = {
      req,
      res,
      url: new URL(valid ? target : "/", "http://localhost"),
      receivedAt: performance.now(),
      tenant: null,
    };
    const route = valid ? this.#route(ctx.url.pathname) : undefined;
    const endpoint: Endpoint = route?.endpoint ?? "other";
    res.on("close", () => {
      const status = res.writableFinished ? res.statusCode : 499;
      this.metrics.requests.inc({ tenant: ctx.tenant?.name ?? "-", endpoint, status });
    });
    try {
      if (!valid) {
        throw new KvfenceError(
          "invalid_request",
          `The request target is not a valid path: ${target.slice(0, 100)}; send a path such as /v1/models`,
        );
      }
      if (route === undefined) {
        throw new KvfenceError(
          "not_found",
          `Unknown route: ${req.method} ${ctx.url.pathname}; see docs/api.md`,
        );
      }
      // HEAD is GET without the body (Node's response drops it), as HTTP requires of every server.
      const method = req.method === "HEAD" && route.methods.includes("GET") ? "GET" : (req.method ?? "");
      if (!route.methods.includes(method)) {
        res.setHeader(
          "Allow",
          (route.methods.includes("GET") ? [...route.methods, "HEAD"] : route.methods).join(", "),
        );
        throw new KvfenceError(
          "method_not_allowed",
          `Method not allowed on ${ctx.url.pathname}: ${req.method}; use ${route.methods.join(" or ")}`,
        );
      }
      if (ctx.url.pathname.startsWith("/v1/")) ctx.tenant = this.#authenticate(req);
      await route.handler(ctx);
    } catch (err) {
      this.#sendError(res, err);
    }
  }

  #route(pathname: string): Route | undefined {
    const path = pathname.length > 1 && pathname.endsWith("/") ? pathname.slice(0, -1) : pathname;
    const exact = this.#routes.get(path);
    if (exact !== undefined) return exact;
    if (path.startsWith("/v1/models/")) {
      return {
        endpoint: "models",
        methods: ["GET"],
        handler: (c) => this.#model_(c, path.slice("/v1/models/".length)),
      };
    }
    return undefined;
  }

  #authenticate(req: IncomingMessage): Tenant {
    const header = req.headers.authorization;
    const tenant = this.#tenants.authenticate(header);
    if (tenant !== null) return tenant;
    if (header === undefined || header.trim() === "") {
      throw new KvfenceError(
        "invalid_api_key",
        "Missing API key: send it in the Authorization header as: Bearer YOUR_KEY",
      );
    }
    const given = header.replace(/^Bearer\s+/i, "");
    const shown = given.length > 8 ? `${given.slice(0, 3)}…${given.slice(-2)}` : "***";
    throw new KvfenceError(
      "invalid_api_key",
      `Incorrect API key provided: ${shown}; check the key your operator gave you`,
    );
  }

  #sendJson(res: ServerResponse, status: number, body: unknown, headers: Record<string, string> = {}): void {
    if (res.headersSent) {
      if (!res.writableEnded) res.end();
      return;
    }
    const text = JSON.stringify(body);
    res.writeHead(status, {
      ...headers,
      "Content-Type": "application/json; charset=utf-8",
      "Content-Length": String(Buffer.byteLength(text)),
    });
    res.end(text);
  }

  /** The one place a thrown value becomes an HTTP response. */
  #sendError(res: ServerResponse, err: unknown): void {
    const { status, body } = toOpenAiError(err);
    if (!(err instanceof KvfenceError)) this.#log.error({ err }, "internal error while serving a request");
    const headers: Record<string, string> = {};
    if (status === 401) headers["WWW-Authenticate"] = "Bearer";
    if (status === 413) headers.Connection = "close";
    this.#sendJson(res, status, body, headers);
  }

  #checkModel(model: string): void {
    if (model !== this.#model.id) {
      throw new KvfenceError(
        "model_not_found",
        `The model does not exist: ${model}; this server serves: ${this.#model.id}`,
        { param: "model" },
      );
    }
  }

  async #readJson(ctx: RequestContext): Promise<unknown> {
    checkJsonContentType(ctx.req.headers["content-type"]);
    return parseJsonBody(await readBody(ctx.req, this.#maxBodyBytes));
  }

  async #chat(ctx: RequestContext): Promise<void> {
    const parsed = parseChatRequest(await this.#readJson(ctx));
    this.#checkModel(parsed.model);
    this.#generate(ctx, "chat", parsed, this.#tokenizer.encodeChat(parsed.messages), "messages");
  }

  async #completions(ctx: RequestContext): Promise<void> {
    const parsed = parseCompletionRequest(await this.#readJson(ctx));
    this.#checkModel(parsed.model);
    const prompt = this.#tokenizer.encodePrompt(parsed.prompt);
    if (prompt.length === 0) {
      throw new KvfenceError("invalid_request", "The prompt is empty: send at least one character", {
        param: "prompt",
      });
    }
    this.#generate(ctx, "completions", parsed, prompt, "prompt");
  }

  #generate(
    ctx: RequestContext,
    endpoint: "chat" | "completions",
    parsed: SamplingRequest,
    promptTokens: Int32Array,
    param: string,
  ): void {
    const admission = admit(promptTokens.length, parsed.maxTokens, this.contextLength, param);
    if (!admission.ok) {
      this.metrics.admissionRejections.inc({ reason: admission.reason });
      throw admission.error;
    }
    const tenant = ctx.tenant!;
    const defaults = this.#model.defaults ?? {};
    const rid = this.#nextRid;
    this.#nextRid = rid >= U32_MAX ? 1 : rid + 1;
    const request: GenerationRequest = {
      rid,
      tenant: tenant.index,
      promptTokens,
      maxTokens: admission.maxTokens,
      temperature: parsed.temperature ?? defaults.temperature ?? 1,
      topP: parsed.topP ?? defaults.topP ?? 1,
      topK: parsed.topK === null ? (defaults.topK ?? 0) : Math.max(0, parsed.topK),
      seed: parsed.seed,
      stopTokenIds: this.#model.eosTokenIds,
    };
    const meta: ResponseMeta = {
      id: completionId(endpoint === "chat" ? "chat" : "text"),
      created: Math.floor(Date.now() / 1000),
      model: this.#model.id,
    };
    const { res } = ctx;
    const labels = { endpoint };
    let lastTokenAt = 0;
    let sse: SseWriter | null = null;
    let text = "";

    const startStream = (): SseWriter => {
      if (sse !== null) return sse;
      sse = new SseWriter(res);
      if (endpoint === "chat")
        sse.send(chatChunk(meta, { role: "assistant", content: "" }, null, parsed.includeUsage));
      return sse;
    };
    const end = (status: number, usage: Usage | null) => {
      this.#active.delete(generation);
      this.metrics.inFlight.set(this.#active.size);
      this.metrics.requestDuration.observe((performance.now() - ctx.receivedAt) / 1000, labels);
      if (usage !== null) {
        this.metrics.promptTokens.inc({ tenant: tenant.name, endpoint }, usage.promptTokens);
        this.metrics.completionTokens.inc({ tenant: tenant.name, endpoint }, usage.completionTokens);
      }
      this.#log.info(
        {
          rid,
          tenant: tenant.name,
          endpoint,
          status,
          promptTokens: promptTokens.length,
          completionTokens: usage?.completionTokens,
        },
        "request done",
      );
    };

    const generation = new Generation(
      this.#engine,
      request,
      { decoder: this.#tokenizer.createDecoder(), stop: parsed.stop },
      {
        tokens: (count) => {
          const now = performance.now();
          if (lastTokenAt === 0) {
            this.metrics.timeToFirstToken.observe((now - ctx.receivedAt) / 1000, labels);
          } else {
            const perToken = (now - lastTokenAt) / 1000 / count;
            for (let i = 0; i < count; i++) this.metrics.interTokenLatency.observe(perToken, labels);
          }
          lastTokenAt = now;
          if (parsed.stream) startStream();
        },
        text: (delta) => {
          if (!parsed.stream) {
            text += delta;
            return;
          }
          const writer = startStream();
          writer.send(
            endpoint === "chat"
              ? chatChunk(meta, { content: delta }, null, parsed.includeUsage)
              : textChunk(meta, delta, null, parsed.includeUsage),
          );
        },
        finish: (reason: FinishReason, usage: Usage) => {
          end(200, usage);
          if (!parsed.stream) {
            this.#sendJson(
              res,
              200,
              endpoint === "chat"
                ? chatCompletion(meta, text, reason, usage)
                : textCompletion(meta, text, reason, usage),
            );
            return;
          }
          const writer = startStream();
          writer.send(
            endpoint === "chat"
              ? chatChunk(meta, {}, reason, parsed.includeUsage)
              : textChunk(meta, "", reason, parsed.includeUsage),
          );
          if (parsed.includeUsage) {
            writer.send(
              usageChunk(meta, endpoint === "chat" ? "chat.completion.chunk" : "text_completion", usage),
            );
          }
          writer.done();
        },
        fail: (error) => {
          const { status, body } = toOpenAiError(error);
          end(status, null);
          if (error.code === "context_length_exceeded")
            this.metrics.admissionRejections.inc({ reason: "engine_door" });
          if (sse === null) {
            this.#sendError(res, error);
            return;
          }
          // Headers are out: report the error in the stream, as OpenAI does, then end it.
          if (!res.writableEnded) res.write(sseFrame(body));
          sse.done();
        },
      },
    );
    if (res.destroyed) {
      // The client left while its body was read: nothing to serve, nothing to allocate.
      this.metrics.clientDisconnects.inc(labels);
      return;
    }
    this.#active.add(generation);
    this.metrics.inFlight.set(this.#active.size);
    res.on("close", () => {
      if (generation.done) return;
      generation.abort();
      this.metrics.clientDisconnects.inc(labels);
      end(499, null);
    });
    generation.start();
  }

  #modelObject() {
    return {
      id: this.#model.id,
      object: "model" as const,
      created: this.#created,
      owned_by: "kvfence",
      max_model_len: this.contextLength,
    };
  }

  #models(ctx: RequestContext): void {
    this.#sendJson(ctx.res, 200, { object: "list", data: [this.#modelObject()] });
  }

  #model_(ctx: RequestContext, id: string): void {
    let decoded: string;
    try {
      decoded = decodeURIComponent(id);
    } catch {
      throw new KvfenceError(
        "invalid_request",
        `The model id in the path is not valid percent-encoding: ${id.slice(0, 100)}; encode it as UTF-8, e.g. with encodeURIComponent`,
      );
    }
    this.#checkModel(decoded);
    this.#sendJson(ctx.res, 200, this.#modelObject());
  }

  async #health(ctx: RequestContext): Promise<void> {
    try {
      await this.#engine.stats();
    } catch (err) {
      throw new KvfenceError("node_unavailable", `The engine does not answer: ${(err as Error).message}`);
    }
    this.#sendJson(
      ctx.res,
      200,
      this.#unsafe === null
        ? { status: "ok" }
        : {
            status: "ok",
            unsafe: { faults: this.#unsafe.faults, disabled_guards: this.#unsafe.disabledGuards },
          },
    );
  }

  async #metrics(ctx: RequestContext): Promise<void> {
    const text = await this.metrics.registry.render();
    ctx.res.writeHead(200, {
      "Content-Type": PROMETHEUS_CONTENT_TYPE,
      "Content-Length": String(Buffer.byteLength(text)),
    });
    ctx.res.end(text);
  }

  #nodes(ctx: RequestContext): void {
    const capacity = this.#engine.capacity;
    const body: NodesInfo = {
      max_model_len: this.contextLength,
      nodes: this.#engine.nodes?.() ?? [
        {
          id: "engine-0",
          role: "engine",
          url: this.#url ?? "",
          pool_tokens: capacity.poolTokens,
          page_size: capacity.pageSize,
          max_model_len: capacity.maxModelLen,
          up: true,
        },
      ],
    };
    this.#sendJson(ctx.res, 200, body);
  }
}
