/**
 * The OpenAI-compatible HTTP front door (docs/design.md §2, "router"), on node:http so that a client
 * disconnect is seen at once (`res` "close") and turned into `engine.abort`, which frees the
 * request's KV pages.
 *
 * Per request: route → method → API key (tenant) → body (Content-Type, size limit, strict UTF-8,
 * JSON) → zod validation → model → chat template + tokenize → admission (the context length, then
 * the answer's worst case in bytes: response-size.ts) → engine. Every failure on
 * that path is a KvfenceError rendered once, by `AnswerWriter.error` (answer-writer.ts), through
 * `toOpenAiError`. A request refused at admission never reaches the engine, so nothing is
 * allocated for it.
 *
 * A generation endpoint's handler returns a `GenerationReply` (generation-reply.ts: its choices,
 * run in the engine and turned into the endpoint's payloads) and the HTTP layer pumps it
 * (`AnswerWriter.reply`). Streaming responses write their headers on the first engine event, not
 * before: an error the engine raises before the first token (its own admission door, a page-tag
 * mismatch) still reaches the client as a real 4xx/5xx status rather than an error inside a 200
 * stream. Answers, whole or streamed, are serialised and written a chunk at a time
 * (json-writer.ts), never in one call that would hold the event loop.
 */
import { randomUUID } from "node:crypto";
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import { createServer as createHttpsServer } from "node:https";
import type { AddressInfo } from "node:net";
import { performance } from "node:perf_hooks";
import { KvfenceError } from "../lib/errors.js";
import type { Logger } from "../lib/logger.js";
import type { EngineHandle } from "../protocol/engine-api.js";
import { effectiveContextLength } from "./admission.js";
import { AnswerWriter } from "./answer-writer.js";
import { ANONYMOUS_TENANT, type Tenant, type TenantDirectory } from "./api-keys.js";
import { answerClientError } from "./client-error.js";
import { CHAT, COMPLETIONS, GenerateHandler, RESPONSES } from "./generate-handler.js";
import type { Generation } from "./generation.js";
import type { GenerationReply, ReplyTokenizer } from "./generation-reply.js";
import { type Listener, OPERATOR_LISTENER_PATHS, OperatorEndpoints } from "./operator-endpoints.js";
import { inThreadPreparer, type RequestPreparer } from "./prepare-pool.js";
import type { PromptTokenizer } from "./prepare-request.js";
import { checkJsonContentType, readBody } from "./read-body.js";
import type { ReasoningParserName } from "./reasoning-parser.js";
import { type RequestLimits, requestLimits } from "./request-limits.js";
import { checkModel, type UtilityEndpointName } from "./request-names.js";
import type { TokenBounds } from "./response-size.js";
import { type Endpoint, RouterMetrics } from "./router-metrics.js";
import { tenantLabels } from "./tenant-labels.js";

/** What the router needs from the tokenizer: no model weights, ever. */
export interface RouterTokenizer extends PromptTokenizer, ReplyTokenizer {
  /** What the vocabulary's longest tokens take in an answer (response-size.ts), computed once. */
  readonly tokenBounds: TokenBounds;
}

export interface ServedModel {
  /** The `model` name clients send (and the one answers report). */
  readonly id: string;
  /** Other names clients may send (`--served-model-name`'s after the first). */
  readonly aliases?: readonly string[];
  readonly maxPositionEmbeddings: number;
  readonly eosTokenIds: readonly number[];
  /** From generation_config.json; used when a request leaves a field out. */
  readonly defaults?: { readonly temperature?: number; readonly topP?: number; readonly topK?: number };
  /** `--reasoning-parser`: chat and /v1/responses split the answer's `<think>` block out. */
  readonly reasoningParser?: ReasoningParserName;
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
  /**
   * `--allowed-origins`: the browser origins (`https://app.example`, or `*` for any) answered with
   * CORS headers, their preflights (OPTIONS) included. Absent or empty: no CORS headers.
   */
  readonly allowedOrigins?: readonly string[];
  /** `--prefix-cache-scope`: the prefix cache's namespace, per tenant (default) or per API key. */
  readonly prefixCacheScope?: "tenant" | "key";
}

/**
 * A route answers the request itself (`handler`), or, a generation endpoint, returns its reply
 * (`reply`; undefined: the client already left) for the HTTP layer to pump.
 */
type Route = {
  readonly endpoint: Endpoint;
  readonly methods: readonly string[];
  /** For the operator only: the operator key, or the operator listener (docs/api.md). */
  readonly operator?: true;
} & (
  | { readonly handler: (ctx: RequestContext) => Promise<void> | void }
  | { readonly reply: (ctx: RequestContext) => Promise<GenerationReply | undefined> }
);

interface RequestContext {
  readonly req: IncomingMessage;
  readonly res: ServerResponse;
  readonly url: URL;
  readonly receivedAt: number;
  /** The client's `x-request-id` (printable ASCII, at most 128 characters), else a fresh UUID. */
  readonly requestId: string;
  tenant: Tenant | null;
  /** The API key's index in the key file (-1: anonymous), for `--prefix-cache-scope key`. */
  keyIndex: number;
}

/** A client's `x-request-id` kept as it is: printable ASCII, 1 to 128 characters. */
const REQUEST_ID = /^[\x21-\x7e]{1,128}$/;

/** The request id a response echoes: the client's when it is usable, else a new one. */
function requestIdOf(req: IncomingMessage): string {
  const given = req.headers["x-request-id"];
  return typeof given === "string" && REQUEST_ID.test(given) ? given : randomUUID();
}

export class RouterServer {
  readonly #engine: EngineHandle;
  readonly #model: ServedModel;
  readonly #tenants: TenantDirectory;
  readonly #maxBodyBytes: number;
  readonly #preparer: RequestPreparer;
  readonly #routes: Map<string, Route>;
  readonly #server: Server;
  readonly #scheme: "http" | "https";
  readonly #active = new Set<Generation>();
  readonly #created = Math.floor(Date.now() / 1000);
  readonly #unsafe: { readonly faults: readonly string[]; readonly disabledGuards: readonly string[] } | null;
  /** Tenant name → its label in metrics. */
  readonly #tenantLabel: (name: string) => string;
  readonly #answers: AnswerWriter;
  readonly #operator: OperatorEndpoints;
  /** The generation endpoints: a request → its reply. */
  readonly #generate: GenerateHandler;
  #operatorServer: Server | null = null;
  readonly #allowedOrigins: ReadonlySet<string>;
  #url: string | null = null;
  /** The longest request (prompt + max_tokens) admitted. */
  readonly contextLength: number;
  readonly metrics: RouterMetrics;

  constructor(options: RouterServerOptions) {
    this.#engine = options.engine;
    this.#model = options.model;
    this.#tenants = options.tenants;
    this.#answers = new AnswerWriter(options.logger);
    this.#allowedOrigins = new Set(options.allowedOrigins ?? []);
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
      inThreadPreparer({
        modelId: [options.model.id, ...(options.model.aliases ?? [])],
        tokenizer: options.tokenizer,
        limits,
      });
    this.metrics = new RouterMetrics(options.engine);
    this.#tenantLabel = tenantLabels(
      {
        names: options.tenants.anonymous
          ? [ANONYMOUS_TENANT.name]
          : options.tenants.tenants.map((t) => t.name),
        byName: options.metricsTenantNames === true,
        operatorKey: options.operatorKey,
      },
      options.logger,
    );
    this.#operator = new OperatorEndpoints({
      engine: options.engine,
      answers: this.#answers,
      operatorKey: options.operatorKey,
      tenantLabel: this.#tenantLabel,
      contextLength: this.contextLength,
      activeRequests: () => this.#active.size,
      url: () => this.#url,
    });
    this.#generate = new GenerateHandler({
      engine: options.engine,
      tokenizer: options.tokenizer,
      // Once, at startup: the first request's admission must not walk the vocabulary.
      tokenBounds: options.tokenizer.tokenBounds,
      model: options.model,
      preparer: this.#preparer,
      maxBodyBytes: limits.maxBodyBytes,
      maxResponseBytes: limits.maxResponseBytes,
      contextLength: this.contextLength,
      prefixCacheScope: options.prefixCacheScope ?? "tenant",
      metrics: this.metrics,
      logger: options.logger,
      tenantLabel: this.#tenantLabel,
      active: this.#active,
    });
    const unsafe = options.unsafe;
    this.#unsafe =
      unsafe !== undefined && (unsafe.faults.length > 0 || unsafe.disabledGuards.length > 0) ? unsafe : null;
    if (this.#unsafe !== null) this.metrics.showUnsafe(this.#unsafe);
    this.#routes = this.#routeTable();
    const handle = (req: IncomingMessage, res: ServerResponse): void => {
      // #handle answers every error itself; this only keeps a bug from becoming a crash.
      this.#handle(req, res, "front").catch((err: unknown) => this.#answers.error(res, err));
    };
    this.#scheme = options.https === undefined ? "http" : "https";
    this.#server =
      options.https === undefined
        ? createServer({ noDelay: true, keepAliveTimeout: 5000 }, handle)
        : createHttpsServer({ ...options.https, noDelay: true, keepAliveTimeout: 5000 }, handle);
    this.#server.on("clientError", answerClientError);
  }

  /** Every route of the front door by path (`#route` adds /v1/models/{id}, and serves the operator listener's). */
  #routeTable(): Map<string, Route> {
    return new Map<string, Route>([
      [
        "/v1/chat/completions",
        { endpoint: "chat", methods: ["POST"], reply: (c) => this.#generate.reply(c, CHAT) },
      ],
      [
        "/v1/completions",
        { endpoint: "completions", methods: ["POST"], reply: (c) => this.#generate.reply(c, COMPLETIONS) },
      ],
      [
        "/v1/responses",
        { endpoint: "responses", methods: ["POST"], reply: (c) => this.#generate.reply(c, RESPONSES) },
      ],
      ["/v1/models", { endpoint: "models", methods: ["GET"], handler: (c) => this.#models(c) }],
      // vLLM's, outside /v1 as there (and behind the API key, as every tenant endpoint here).
      [
        "/tokenize",
        { endpoint: "tokenize", methods: ["POST"], handler: (c) => this.#utility(c, "tokenize") },
      ],
      [
        "/detokenize",
        { endpoint: "tokenize", methods: ["POST"], handler: (c) => this.#utility(c, "detokenize") },
      ],
      ["/health", { endpoint: "health", methods: ["GET"], handler: (c) => this.#health(c) }],
      ["/ready", { endpoint: "ready", methods: ["GET"], handler: (c) => this.#ready(c) }],
      [
        "/metrics",
        { endpoint: "metrics", methods: ["GET"], handler: (c) => this.#metrics(c), operator: true },
      ],
      [
        "/kvfence/nodes",
        { endpoint: "nodes", methods: ["GET"], handler: (c) => this.#operator.nodes(c.res), operator: true },
      ],
      [
        "/kvfence/state",
        { endpoint: "state", methods: ["GET"], handler: (c) => this.#operator.state(c.res), operator: true },
      ],
      ...["", "/dashboard.js", "/dashboard.css"].map((file): [string, Route] => [
        `/kvfence/ui${file}`,
        {
          endpoint: "ui",
          methods: ["GET"],
          handler: (c) => this.#operator.ui(c.res, file.slice(1)),
          operator: true,
        },
      ]),
    ]);
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
   * HTTP (the server config keeps it on loopback unless an operator key guards it; without a key it
   * answers loopback `Host` names only, operator-host.ts). Resolves to its base URL.
   */
  listenOperator(port: number, host: string): Promise<string> {
    const server = createServer({ noDelay: true, keepAliveTimeout: 5000 }, (req, res) => {
      this.#handle(req, res, "operator").catch((err: unknown) => this.#answers.error(res, err));
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
      requestId: requestIdOf(req),
      tenant: null,
      keyIndex: -1,
    };
    // On every response (errors and streams included): a client or proxy correlates it with the logs.
    res.setHeader("x-request-id", ctx.requestId);
    if (listener === "front") this.#cors(req, res);
    const route = valid ? this.#route(ctx.url.pathname, listener) : undefined;
    const endpoint: Endpoint = route?.endpoint ?? "other";
    res.on("close", () => {
      const status = res.writableFinished ? res.statusCode : 499;
      const tenant = ctx.tenant === null ? "-" : this.#tenantLabel(ctx.tenant.name);
      this.metrics.requests.inc({ tenant, endpoint, status });
    });
    try {
      this.#operator.checkListener(req, listener);
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
      if (req.method === "OPTIONS" && this.#preflight(req, res, route)) return;
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
      if (route.operator === true) this.#operator.authorize(req, listener);
      else if (ctx.url.pathname.startsWith("/v1/") || route.endpoint === "tokenize") {
        const found = this.#authenticate(req);
        ctx.tenant = found.tenant;
        ctx.keyIndex = found.keyIndex;
      }
      if ("handler" in route) {
        await route.handler(ctx);
        return;
      }
      const reply = await route.reply(ctx);
      if (reply !== undefined) this.#answers.reply(res, reply);
    } catch (err) {
      this.#answers.error(res, err);
    }
  }

  /** The CORS headers of a request from an allowed browser origin (`--allowed-origins`). */
  #cors(req: IncomingMessage, res: ServerResponse): void {
    const origin = req.headers.origin;
    if (origin === undefined || this.#allowedOrigins.size === 0) return;
    const any = this.#allowedOrigins.has("*");
    if (!any && !this.#allowedOrigins.has(origin)) return;
    res.setHeader("Access-Control-Allow-Origin", any ? "*" : origin);
    if (!any) res.setHeader("Vary", "Origin");
    res.setHeader("Access-Control-Expose-Headers", "x-request-id, retry-after");
  }

  /**
   * A CORS preflight from an allowed origin to a known route: 204 with the methods and headers it
   * may use (before any API key: browsers send none on a preflight). Else false (405 follows).
   */
  #preflight(req: IncomingMessage, res: ServerResponse, route: Route): boolean {
    if (
      !res.hasHeader("Access-Control-Allow-Origin") ||
      req.headers["access-control-request-method"] === undefined
    )
      return false;
    const methods = route.methods.includes("GET") ? [...route.methods, "HEAD"] : route.methods;
    res.writeHead(204, {
      "Access-Control-Allow-Methods": [...methods, "OPTIONS"].join(", "),
      "Access-Control-Allow-Headers": "authorization, content-type, x-request-id",
      "Access-Control-Max-Age": "600",
    });
    res.end();
    return true;
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

  /** /tokenize and /detokenize, prepared by the same workers as a generation request. */
  async #utility(ctx: RequestContext, endpoint: UtilityEndpointName): Promise<void> {
    checkJsonContentType(ctx.req.headers["content-type"]);
    const body = await readBody(ctx.req, this.#maxBodyBytes);
    const answer = await this.#preparer.answer(endpoint, body, ctx.tenant?.index);
    this.#answers.json(
      ctx.res,
      200,
      endpoint === "tokenize" ? { ...answer, max_model_len: this.contextLength } : answer,
    );
  }

  #modelObject(id = this.#model.id) {
    return {
      id,
      object: "model" as const,
      created: this.#created,
      owned_by: "kvfence",
      max_model_len: this.contextLength,
    };
  }

  #models(ctx: RequestContext): void {
    const names = [this.#model.id, ...(this.#model.aliases ?? [])];
    this.#answers.json(ctx.res, 200, { object: "list", data: names.map((id) => this.#modelObject(id)) });
  }

  #model_(ctx: RequestContext, id: string): void {
    const name = decodePathSegment(id);
    checkModel(name, [this.#model.id, ...(this.#model.aliases ?? [])]);
    this.#answers.json(ctx.res, 200, this.#modelObject(name));
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
    this.#answers.json(
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
    this.#answers.json(ctx.res, 200, {
      status: "ready",
      ...(health?.prefill === undefined ? {} : { prefill: health.prefill }),
      ...(health?.decode === undefined ? {} : { decode: health.decode }),
    });
  }

  async #metrics(ctx: RequestContext): Promise<void> {
    const text = await this.metrics.registry.metrics();
    ctx.res.writeHead(200, {
      "Content-Type": this.metrics.registry.contentType,
      "Content-Length": String(Buffer.byteLength(text)),
    });
    ctx.res.end(text);
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
