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
import { createHash, createHmac, randomBytes, timingSafeEqual } from "node:crypto";
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import { createServer as createHttpsServer } from "node:https";
import type { AddressInfo } from "node:net";
import { performance } from "node:perf_hooks";
import { KvfenceError, publicError, toOpenAiError } from "../lib/errors.js";
import type { Logger } from "../lib/logger.js";
import { PROMETHEUS_CONTENT_TYPE } from "../lib/metrics.js";
import type { NodesInfo } from "../protocol/admin-wire.js";
import type { EngineHandle, GenerationRequest } from "../protocol/engine-api.js";
import { admit, effectiveContextLength } from "./admission.js";
import { ANONYMOUS_TENANT, type Tenant, type TenantDirectory } from "./api-keys.js";
import { answerClientError } from "./client-error.js";
import {
  type FinishReason,
  Generation,
  type GenerationSink,
  type TextStreamDecoder,
  type Usage,
} from "./generation.js";
import {
  CHAT_RESPONSES,
  completionId,
  type ResponseMeta,
  type ResponseStrategy,
  TEXT_RESPONSES,
  usageChunk,
} from "./openai-responses.js";
import type { SamplingRequest } from "./openai-schemas.js";
import { inThreadPreparer, type RequestPreparer } from "./prepare-pool.js";
import {
  checkModel,
  type GenerateEndpointName,
  PROMPT_KINDS,
  type PromptTokenizer,
} from "./prepare-request.js";
import { boundUnreadBody, checkJsonContentType, readBody } from "./read-body.js";
import { type RequestLimits, requestLimits } from "./request-limits.js";
import { type Endpoint, RouterMetrics } from "./router-metrics.js";
import { SseWriter, sseFrame } from "./sse.js";

/** What the router needs from the tokenizer: no model weights, ever. */
export interface RouterTokenizer extends PromptTokenizer {
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
  /** Request size limits (request-limits.ts); each one absent takes its default. */
  readonly limits?: Partial<RequestLimits>;
  /**
   * Prepares generation bodies (parse, validate, template, tokenize): the worker pool of
   * prepare-pool.ts in a real server. Absent: in this thread with `tokenizer` (tests).
   */
  readonly preparer?: RequestPreparer;
  /** `--unsafe-fault` / `--unsafe-disable-guard` names, shown in /health and /metrics. */
  readonly unsafe?: { readonly faults: readonly string[]; readonly disabledGuards: readonly string[] };
  /** Serve HTTPS with this certificate and key (`--https-cert/--https-key`, docs/tls.md). */
  readonly https?: { readonly cert: Buffer; readonly key: Buffer };
  /**
   * `--operator-key`: the operator endpoints (/metrics, /kvfence/nodes) need it as a Bearer token on
   * every listener. Absent: they are served only on the operator listener (`listenOperator`), which
   * the server config binds to loopback.
   */
  readonly operatorKey?: string | undefined;
  /** `--metrics-tenant-names`: label metrics with tenant names, not opaque ids. */
  readonly metricsTenantNames?: boolean;
  /** `--prefix-cache-scope`: the prefix cache's namespace, per tenant (default) or per API key. */
  readonly prefixCacheScope?: "tenant" | "key";
}

type Handler = (ctx: RequestContext) => Promise<void> | void;

interface Route {
  readonly endpoint: Endpoint;
  readonly methods: readonly string[];
  readonly handler: Handler;
  /** For the operator only: the operator key, or the operator listener (docs/api.md). */
  readonly operator?: true;
}

/** Which listener a request came in on: the front door, or the operator listener. */
type Listener = "front" | "operator";

/** The routes of the operator listener: the operator endpoints and /health. */
const OPERATOR_LISTENER_PATHS = new Set(["/metrics", "/kvfence/nodes", "/health"]);

interface RequestContext {
  readonly req: IncomingMessage;
  readonly res: ServerResponse;
  readonly url: URL;
  readonly receivedAt: number;
  tenant: Tenant | null;
  /** The API key's index in the key file (-1: anonymous), for `--prefix-cache-scope key`. */
  keyIndex: number;
}

/** What differs between the two generation endpoints; the router never branches on the endpoint. */
interface GenerateEndpoint {
  readonly endpoint: GenerateEndpointName;
  /** The request field a prompt-length error names. */
  readonly param: string;
  /** The shapes of its answers. */
  readonly responses: ResponseStrategy;
}

const CHAT: GenerateEndpoint = {
  endpoint: "chat",
  param: PROMPT_KINDS.chat.param,
  responses: CHAT_RESPONSES,
};
const COMPLETIONS: GenerateEndpoint = {
  endpoint: "completions",
  param: PROMPT_KINDS.completions.param,
  responses: TEXT_RESPONSES,
};

const U32_MAX = 0xffff_ffff;

export class RouterServer {
  readonly #engine: EngineHandle;
  readonly #tokenizer: RouterTokenizer;
  readonly #model: ServedModel;
  readonly #tenants: TenantDirectory;
  readonly #log: Logger;
  readonly #maxBodyBytes: number;
  readonly #preparer: RequestPreparer;
  readonly #routes: Map<string, Route>;
  readonly #server: Server;
  readonly #scheme: "http" | "https";
  readonly #active = new Set<Generation>();
  readonly #created = Math.floor(Date.now() / 1000);
  readonly #unsafe: { readonly faults: readonly string[]; readonly disabledGuards: readonly string[] } | null;
  /** SHA-256 of the operator key, or null. */
  readonly #operatorKey: Buffer | null;
  /** Tenant name → its label in metrics. */
  readonly #tenantLabel: (name: string) => string;
  readonly #prefixCacheScope: "tenant" | "key";
  #operatorServer: Server | null = null;
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
    this.#prefixCacheScope = options.prefixCacheScope ?? "tenant";
    this.#log = options.logger;
    this.contextLength = Math.min(
      effectiveContextLength({
        maxPositionEmbeddings: options.model.maxPositionEmbeddings,
        maxModelLen: options.maxModelLen,
        poolTokens: options.engine.capacity.poolTokens,
      }),
      options.engine.capacity.maxModelLen,
    );
    const limits = requestLimits(this.contextLength, options.limits);
    this.#maxBodyBytes = limits.maxBodyBytes;
    this.#preparer =
      options.preparer ??
      inThreadPreparer({ modelId: options.model.id, tokenizer: options.tokenizer, limits });
    this.metrics = new RouterMetrics(options.engine);
    this.#operatorKey = options.operatorKey === undefined ? null : sha256(options.operatorKey);
    this.#tenantLabel =
      options.metricsTenantNames === true
        ? (name) => name
        : opaqueTenantLabels(options.operatorKey ?? randomBytes(32).toString("hex"));
    if (options.metricsTenantNames !== true) {
      const names = options.tenants.anonymous
        ? [ANONYMOUS_TENANT.name]
        : options.tenants.tenants.map((t) => t.name);
      this.#log.info(
        { labels: Object.fromEntries(names.map((name) => [name, this.#tenantLabel(name)])) },
        "tenants are labelled in /metrics by these opaque ids (--metrics-tenant-names shows names)",
      );
    }
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
      [
        "/v1/chat/completions",
        { endpoint: "chat", methods: ["POST"], handler: (c) => this.#generate(c, CHAT) },
      ],
      [
        "/v1/completions",
        { endpoint: "completions", methods: ["POST"], handler: (c) => this.#generate(c, COMPLETIONS) },
      ],
      ["/v1/models", { endpoint: "models", methods: ["GET"], handler: (c) => this.#models(c) }],
      ["/health", { endpoint: "health", methods: ["GET"], handler: (c) => this.#health(c) }],
      ["/ready", { endpoint: "ready", methods: ["GET"], handler: (c) => this.#ready(c) }],
      [
        "/metrics",
        { endpoint: "metrics", methods: ["GET"], handler: (c) => this.#metrics(c), operator: true },
      ],
      [
        "/kvfence/nodes",
        { endpoint: "nodes", methods: ["GET"], handler: (c) => this.#nodes(c), operator: true },
      ],
    ]);
    const handle = (req: IncomingMessage, res: ServerResponse): void => {
      // #handle answers every error itself; this only keeps a bug from becoming a crash.
      this.#handle(req, res, "front").catch((err: unknown) => this.#sendError(res, err));
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

  /**
   * Open the operator listener on `host:port`: /metrics, /kvfence/nodes and /health only, plain
   * HTTP (the server config keeps it on loopback unless an operator key guards it). Resolves to its
   * base URL.
   */
  listenOperator(port: number, host: string): Promise<string> {
    const server = createServer({ noDelay: true, keepAliveTimeout: 5000 }, (req, res) => {
      this.#handle(req, res, "operator").catch((err: unknown) => this.#sendError(res, err));
    });
    server.on("clientError", answerClientError);
    this.#operatorServer = server;
    return new Promise((resolve, reject) => {
      const onError = (err: Error) => reject(err);
      server.once("error", onError);
      server.listen(port, host, () => {
        server.off("error", onError);
        const address = server.address() as AddressInfo;
        const shownHost = address.family === "IPv6" ? `[${address.address}]` : address.address;
        resolve(`http://${shownHost}:${address.port}`);
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
    const operator = this.#operatorServer;
    if (operator !== null) {
      operator.close();
      operator.closeAllConnections();
    }
    const closed = new Promise<void>((resolve) => this.#server.close(() => resolve()));
    this.#server.closeIdleConnections();
    const deadline = Date.now() + graceMs;
    while (this.#active.size > 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    for (const generation of this.#active) generation.abort();
    this.#active.clear();
    this.#server.closeAllConnections();
    await closed;
  }

  async #handle(req: IncomingMessage, res: ServerResponse, listener: Listener): Promise<void> {
    // `new URL` throws on some targets (`//`, `http://[::1`): they get a 400, not an unhandled throw.
    const target = req.url ?? "/";
    const valid = URL.canParse(target, "http://localhost");
    const ctx: RequestContext = {
      req,
      res,
      url: new URL(valid ? target : "/", "http://localhost"),
      receivedAt: performance.now(),
      tenant: null,
      keyIndex: -1,
    };
    const route = valid ? this.#route(ctx.url.pathname, listener) : undefined;
    const endpoint: Endpoint = route?.endpoint ?? "other";
    res.on("close", () => {
      const status = res.writableFinished ? res.statusCode : 499;
      const tenant = ctx.tenant === null ? "-" : this.#tenantLabel(ctx.tenant.name);
      this.metrics.requests.inc({ tenant, endpoint, status });
    });
    try {
      if (!valid) {
        throw new KvfenceError(
          "invalid_request",
          `The request target is not a valid path: ${target.slice(0, 100)}; send a path such as /v1/models`,
        );
      }
      if (route === undefined) {
        const shown = ctx.url.pathname.length > 100 ? `${ctx.url.pathname.slice(0, 100)}…` : ctx.url.pathname;
        throw new KvfenceError(
          "not_found",
          listener === "operator"
            ? `Unknown route on the operator listener: ${req.method} ${shown}; it serves /metrics, /kvfence/nodes and /health`
            : `Unknown route: ${req.method} ${shown}; see docs/api.md`,
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
      if (route.operator === true) this.#authorizeOperator(req, listener);
      else if (ctx.url.pathname.startsWith("/v1/")) {
        const found = this.#authenticate(req);
        ctx.tenant = found.tenant;
        ctx.keyIndex = found.keyIndex;
      }
      await route.handler(ctx);
    } catch (err) {
      this.#sendError(res, err);
    }
  }

  #route(pathname: string, listener: Listener): Route | undefined {
    const path = pathname.length > 1 && pathname.endsWith("/") ? pathname.slice(0, -1) : pathname;
    if (listener === "operator")
      return OPERATOR_LISTENER_PATHS.has(path) ? this.#routes.get(path) : undefined;
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

  /**
   * The operator endpoints: with an operator key configured, the request must carry it (on either
   * listener); without one, only the operator listener serves them.
   */
  #authorizeOperator(req: IncomingMessage, listener: Listener): void {
    if (this.#operatorKey === null) {
      if (listener === "operator") return;
      throw new KvfenceError(
        "invalid_api_key",
        "This endpoint is for the server's operator: without --operator-key it is served only on the operator listener (--metrics-host, --metrics-port; docs/api.md)",
      );
    }
    const match = /^Bearer\s+(\S+)\s*$/i.exec(req.headers.authorization ?? "");
    if (match !== null && timingSafeEqual(sha256(match[1]!), this.#operatorKey)) return;
    throw new KvfenceError(
      "invalid_api_key",
      match === null
        ? "This endpoint needs the operator key: send it in the Authorization header as: Bearer OPERATOR_KEY"
        : "Incorrect operator key: send the server's --operator-key (or KVFENCE_OPERATOR_KEY) as: Bearer OPERATOR_KEY",
    );
  }

  #authenticate(req: IncomingMessage): { tenant: Tenant; keyIndex: number } {
    const header = req.headers.authorization;
    const found = this.#tenants.authenticateKey(header);
    if (found !== null) return found;
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
    if (err instanceof KvfenceError && err.retryAfter !== undefined)
      headers["Retry-After"] = String(err.retryAfter);
    boundUnreadBody(res.req, res);
    this.#sendJson(res, status, body, headers);
  }

  /** A generation endpoint: body → prompt → admission → engine, answered in `kind`'s shapes. */
  async #generate(ctx: RequestContext, kind: GenerateEndpoint): Promise<void> {
    checkJsonContentType(ctx.req.headers["content-type"]);
    const body = await readBody(ctx.req, this.#maxBodyBytes);
    const { parsed, promptTokens } = await this.#preparer.prepare(kind.endpoint, body);
    const admission = admit(promptTokens.length, parsed.maxTokens, this.contextLength, kind.param);
    if (!admission.ok) {
      this.metrics.admissionRejections.inc({ reason: admission.reason });
      throw admission.error;
    }
    if (ctx.res.destroyed) {
      // The client left while its body was read: nothing to serve, nothing to allocate.
      this.metrics.clientDisconnects.inc({ endpoint: kind.endpoint });
      return;
    }
    const rid = this.#nextRid;
    this.#nextRid = rid >= U32_MAX ? 1 : rid + 1;
    const defaults = this.#model.defaults ?? {};
    const request: GenerationRequest = {
      rid,
      tenant: ctx.tenant!.index,
      promptTokens,
      maxTokens: admission.maxTokens,
      temperature: parsed.temperature ?? defaults.temperature ?? 1,
      topP: parsed.topP ?? defaults.topP ?? 1,
      topK: parsed.topK === null ? (defaults.topK ?? 0) : Math.max(0, parsed.topK),
      seed: parsed.seed,
      stopTokenIds: this.#model.eosTokenIds,
      cacheSalt: parsed.cacheSalt,
      cacheScope: this.#prefixCacheScope === "key" && ctx.keyIndex >= 0 ? `key:${ctx.keyIndex}` : "",
    };
    this.#serve(ctx, kind, parsed, request);
  }

  /** Runs an admitted request's generation and answers it, streamed or whole. */
  #serve(
    ctx: RequestContext,
    kind: GenerateEndpoint,
    parsed: SamplingRequest,
    request: GenerationRequest,
  ): void {
    const { res } = ctx;
    const { endpoint, responses } = kind;
    const tenant = ctx.tenant!;
    const labels = { endpoint };
    const meta: ResponseMeta = {
      id: completionId(responses.idKind),
      created: Math.floor(Date.now() / 1000),
      model: this.#model.id,
    };
    const includeUsage = parsed.includeUsage;
    let lastTokenAt = 0;
    let sse: SseWriter | null = null;
    let text = "";

    const startStream = (): SseWriter => {
      if (sse !== null) return sse;
      sse = new SseWriter(res);
      const opening = responses.opening(meta, includeUsage);
      if (opening !== null) sse.send(opening);
      return sse;
    };
    const end = (status: number, usage: Usage | null) => {
      this.#active.delete(generation);
      this.metrics.inFlight.set(this.#active.size);
      this.metrics.requestDuration.observe((performance.now() - ctx.receivedAt) / 1000, labels);
      if (usage !== null) {
        const label = this.#tenantLabel(tenant.name);
        this.metrics.promptTokens.inc({ tenant: label, endpoint }, usage.promptTokens);
        this.metrics.completionTokens.inc({ tenant: label, endpoint }, usage.completionTokens);
      }
      this.#log.info(
        {
          rid: request.rid,
          tenant: tenant.name,
          endpoint,
          status,
          promptTokens: request.promptTokens.length,
          completionTokens: usage?.completionTokens,
        },
        "request done",
      );
    };

    const sink: GenerationSink = {
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
        if (parsed.stream) startStream().send(responses.delta(meta, delta, includeUsage));
        else text += delta;
      },
      finish: (reason: FinishReason, usage: Usage) => {
        end(200, usage);
        if (!parsed.stream) {
          this.#sendJson(res, 200, responses.completion(meta, text, reason, usage));
          return;
        }
        const writer = startStream();
        writer.send(responses.finish(meta, reason, includeUsage));
        if (includeUsage) writer.send(usageChunk(meta, responses.chunkObject, usage));
        writer.done();
      },
      fail: (internal) => {
        // What the engine and the nodes say names request ids, pages and nodes: the log gets it,
        // the client the table's public message.
        const error = publicError(internal);
        if (error !== internal) {
          this.#log.warn(
            { rid: request.rid, code: internal.code, message: internal.message },
            "request failed in the engine",
          );
        }
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
    };
    const generation = new Generation(
      this.#engine,
      request,
      { decoder: this.#tokenizer.createDecoder(), stop: parsed.stop },
      sink,
    );
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
    checkModel(decodePathSegment(id), this.#model.id);
    this.#sendJson(ctx.res, 200, this.#modelObject());
  }

  /** Liveness: this process answers (and its engine can still serve); never waits on a node. */
  #health(ctx: RequestContext): void {
    const health = this.#engine.health?.();
    if (health !== undefined && !health.live) {
      throw new KvfenceError(
        "node_unavailable",
        `The server can no longer serve: ${health.reason}; restart it`,
      );
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

  /**
   * Readiness, for a load balancer: 200 while a request sent now can be served, else 503
   * `not_ready`. Answered from the state the engine keeps up to date in the background (pings
   * with a deadline), so it never waits on a frozen node.
   */
  #ready(ctx: RequestContext): void {
    const health = this.#engine.health?.();
    if (health !== undefined && !health.ready) {
      throw new KvfenceError("not_ready", `Not ready: ${health.reason ?? "unknown"}; retry later`, {
        retryAfter: 1,
      });
    }
    this.#sendJson(ctx.res, 200, {
      status: "ready",
      ...(health?.prefill === undefined ? {} : { prefill: health.prefill }),
      ...(health?.decode === undefined ? {} : { decode: health.decode }),
    });
  }

  async #metrics(ctx: RequestContext): Promise<void> {
    const text = await this.metrics.registry.render();
    ctx.res.writeHead(200, {
      "Content-Type": PROMETHEUS_CONTENT_TYPE,
      "Content-Length": String(Buffer.byteLength(text)),
    });
    ctx.res.end(text);
  }

  async #nodes(ctx: RequestContext): Promise<void> {
    const capacity = this.#engine.capacity;
    const cachedPages =
      this.#engine.nodes === undefined ? (await this.#engine.stats()).prefixCache?.sharedPages : undefined;
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
          ...(cachedPages === undefined ? {} : { cached_pages: cachedPages }),
        },
      ],
    };
    this.#sendJson(ctx.res, 200, body);
  }
}

/** A percent-encoded path segment, or `invalid_request` when it is not valid percent-encoding. */
function decodePathSegment(segment: string): string {
  try {
    return decodeURIComponent(segment);
  } catch {
    throw new KvfenceError(
      "invalid_request",
      "The path is not valid percent-encoded UTF-8: encode the model id with encodeURIComponent",
    );
  }
}

function sha256(text: string): Buffer {
  return createHash("sha256").update(text, "utf8").digest();
}

/**
 * Tenant names → opaque metric labels: `t-` and 12 hex digits of an HMAC-SHA256 of the name keyed
 * with `key` (the operator key when there is one, so that labels stay the same across restarts).
 */
function opaqueTenantLabels(key: string): (name: string) => string {
  const labels = new Map<string, string>();
  return (name) => {
    let label = labels.get(name);
    if (label === undefined) {
      label = `t-${createHmac("sha256", key).update(`kvfence tenant label\0${name}`).digest("hex").slice(0, 12)}`;
      labels.set(name, label);
    }
    return label;
  };
}
