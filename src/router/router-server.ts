/**
 * The OpenAI-compatible HTTP front door (docs/design.md §2, "router"), on node:http so that a client
 * disconnect is seen at once (`res` "close") and turned into `engine.abort`, which frees the
 * request's KV pages.
 *
 * Per request: route → method → API key (tenant) → body (Content-Type, size limit, strict UTF-8,
 * JSON) → zod validation → model → chat template + tokenize → admission (the context length, then
 * the answer's worst case in bytes: response-size.ts) → engine. Every failure on
 * that path is a KvfenceError rendered once, by `#sendError`, through `toOpenAiError`. A request
 * refused at admission never reaches the engine, so nothing is allocated for it.
 *
 * Streaming responses write their headers on the first engine event, not before: an error the
 * engine raises before the first token (its own admission door, a page-tag mismatch) still reaches
 * the client as a real 4xx/5xx status rather than an error inside a 200 stream. Answers, whole or
 * streamed, are serialised and written a chunk at a time (json-writer.ts), never in one call that
 * would hold the event loop.
 */
import { createHash, createHmac, randomBytes, randomUUID, timingSafeEqual } from "node:crypto";
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import { createServer as createHttpsServer } from "node:https";
import type { AddressInfo } from "node:net";
import { performance } from "node:perf_hooks";
import type { NodesInfo } from "../admin-api/admin-wire.js";
import { KvfenceError, publicError, toOpenAiError } from "../lib/errors.js";
import type { Logger } from "../lib/logger.js";
import { epochOf, type RequestSpan, tracing } from "../lib/tracing.js";
import type { EngineHandle, GenerationRequest } from "../protocol/engine-api.js";
import { admit, effectiveContextLength } from "./admission.js";
import { ANONYMOUS_TENANT, type Tenant, type TenantDirectory } from "./api-keys.js";
import { type ChoiceLogprobs, choicesLogprobs } from "./choice-logprobs.js";
import { answerClientError } from "./client-error.js";
import {
  DASHBOARD_HEADERS,
  type DashboardState,
  dashboardAsset,
  dashboardState,
  STATE_REUSE_MS,
  tenantColour,
} from "./dashboard.js";
import {
  type FinishReason,
  Generation,
  type GenerationSink,
  type StopReason,
  type TextStreamDecoder,
  type Usage,
} from "./generation.js";
import { sendJson } from "./json-writer.js";
import type { TokenPiece } from "./logprobs-wire.js";
import {
  CHAT_RESPONSES,
  completionId,
  RESPONSES_API,
  type ResponseMeta,
  type ResponseStrategy,
  TEXT_RESPONSES,
  usageWire,
} from "./openai-responses.js";
import type { ResponsesEcho, SamplingRequest } from "./openai-schemas.js";
import { checkOperatorHost } from "./operator-host.js";
import { inThreadPreparer, type RequestPreparer } from "./prepare-pool.js";
import {
  checkModel,
  type GenerateEndpointName,
  PROMPT_KINDS,
  type PromptTokenizer,
  type UtilityEndpointName,
} from "./prepare-request.js";
import { boundUnreadBody, checkJsonContentType, readBody } from "./read-body.js";
import { type RequestLimits, requestLimits } from "./request-limits.js";
import { laterSampleSampling, samplingParams } from "./request-sampling.js";
import { responseSizeRefusal, type TokenBounds } from "./response-size.js";
import { type Endpoint, RouterMetrics } from "./router-metrics.js";
import { SseWriter } from "./sse.js";

/** What the router needs from the tokenizer: no model weights, ever. */
export interface RouterTokenizer extends PromptTokenizer {
  /** One token's own text and bytes (log-probabilities name tokens by them). */
  tokenPiece(id: number): TokenPiece;
  /** A fresh UTF-8-safe streaming detokenizer, one per response (special tokens skipped by default). */
  createDecoder(options?: { readonly skipSpecialTokens?: boolean }): TextStreamDecoder;
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
const OPERATOR_LISTENER_PATHS = new Set([
  "/metrics",
  "/kvfence/nodes",
  "/health",
  "/kvfence/state",
  "/kvfence/ui",
  "/kvfence/ui/dashboard.js",
  "/kvfence/ui/dashboard.css",
]);

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

/** What differs between the generation endpoints; the router never branches on the endpoint. */
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

/** OpenAI's Responses API: a chat (its template), answered as a `response` object or its events. */
const RESPONSES: GenerateEndpoint = {
  endpoint: "responses",
  param: PROMPT_KINDS.responses.param,
  responses: RESPONSES_API,
};

const U32_MAX = 0xffff_ffff;

export class RouterServer {
  readonly #engine: EngineHandle;
  readonly #tokenizer: RouterTokenizer;
  readonly #model: ServedModel;
  readonly #tenants: TenantDirectory;
  readonly #log: Logger;
  readonly #maxBodyBytes: number;
  readonly #maxResponseBytes: number;
  /** The vocabulary's longest tokens, for the worst case of an answer (response-size.ts). */
  readonly #tokenBounds: TokenBounds;
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
  readonly #allowedOrigins: ReadonlySet<string>;
  #nextRid = 1;
  /** The last /kvfence/state snapshot (`#state`). */
  #lastState: { readonly at: number; readonly state: Promise<DashboardState> } | null = null;
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
    this.#maxResponseBytes = limits.maxResponseBytes;
    // Once, at startup: the first request's admission must not walk the vocabulary.
    this.#tokenBounds = options.tokenizer.tokenBounds;
    this.#preparer =
      options.preparer ??
      inThreadPreparer({
        modelId: [options.model.id, ...(options.model.aliases ?? [])],
        tokenizer: options.tokenizer,
        limits,
      });
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
    if (this.#unsafe !== null) this.metrics.showUnsafe(this.#unsafe);
    this.#routes = new Map<string, Route>([
      [
        "/v1/chat/completions",
        { endpoint: "chat", methods: ["POST"], handler: (c) => this.#generate(c, CHAT) },
      ],
      [
        "/v1/completions",
        { endpoint: "completions", methods: ["POST"], handler: (c) => this.#generate(c, COMPLETIONS) },
      ],
      [
        "/v1/responses",
        { endpoint: "responses", methods: ["POST"], handler: (c) => this.#generate(c, RESPONSES) },
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
        { endpoint: "nodes", methods: ["GET"], handler: (c) => this.#nodes(c), operator: true },
      ],
      [
        "/kvfence/state",
        { endpoint: "state", methods: ["GET"], handler: (c) => this.#state(c), operator: true },
      ],
      ...["", "/dashboard.js", "/dashboard.css"].map((file): [string, Route] => [
        `/kvfence/ui${file}`,
        { endpoint: "ui", methods: ["GET"], handler: (c) => this.#ui(c, file.slice(1)), operator: true },
      ]),
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
   * HTTP (the server config keeps it on loopback unless an operator key guards it; without a key it
   * answers loopback `Host` names only, operator-host.ts). Resolves to its base URL.
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
      // Keyless, the operator listener answers loopback Host names only (DNS rebinding).
      if (listener === "operator" && this.#operatorKey === null) checkOperatorHost(req.headers.host);
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
      if (route.operator === true) this.#authorizeOperator(req, listener);
      else if (ctx.url.pathname.startsWith("/v1/") || route.endpoint === "tokenize") {
        const found = this.#authenticate(req);
        ctx.tenant = found.tenant;
        ctx.keyIndex = found.keyIndex;
      }
      await route.handler(ctx);
    } catch (err) {
      this.#sendError(res, err);
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

  /**
   * `/kvfence/state`: the dashboard's JSON (src/router/dashboard.ts). Polls within
   * `STATE_REUSE_MS` of the last one share its snapshot: one poll of the nodes however many
   * dashboards are open.
   */
  async #state(ctx: RequestContext): Promise<void> {
    const now = performance.now();
    let last = this.#lastState;
    if (last === null || now - last.at >= STATE_REUSE_MS) {
      // One HMAC per tenant, not per page.
      const colours = new Map<number, number>();
      const colour = (tenant: number) => {
        const known = colours.get(tenant);
        if (known !== undefined) return known;
        const c = tenantColour(this.#tenantLabel(`tenant#${tenant}`));
        colours.set(tenant, c);
        return c;
      };
      const taken = { at: now, state: dashboardState(this.#engine, colour, this.#active.size) };
      taken.state.catch(() => {
        if (this.#lastState === taken) this.#lastState = null;
      });
      this.#lastState = last = taken;
    }
    this.#sendJson(ctx.res, 200, await last.state, { "Cache-Control": "no-store" });
  }

  /** `/kvfence/ui` and its files, as built into dist/ui/. */
  #ui(ctx: RequestContext, name: string): void {
    const asset = dashboardAsset(name);
    if (asset === null)
      throw new KvfenceError(
        "not_found",
        "The dashboard was not built: run npm run build (it bundles ui/ into dist/ui/)",
      );
    ctx.res.writeHead(200, {
      ...DASHBOARD_HEADERS,
      "Content-Type": asset.type,
      "Content-Length": String(asset.body.length),
    });
    ctx.res.end(asset.body);
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
    // A large answer goes out a chunk at a time, yielding to the event loop (json-writer.ts).
    sendJson(res, status, body, headers, this.#serialiseFailed(res.getHeader("x-request-id")));
  }

  /** Logs an answer that could not be serialised (a bug; its response is cut). */
  #serialiseFailed(requestId: unknown): (err: unknown) => void {
    return (err) => this.#log.error({ err, requestId }, "an answer could not be serialised");
  }

  /** The one place a thrown value becomes an HTTP response. */
  #sendError(res: ServerResponse, err: unknown): void {
    const { status, body } = toOpenAiError(err);
    if (!(err instanceof KvfenceError))
      this.#log.error(
        { err, requestId: res.getHeader("x-request-id") },
        "internal error while serving a request",
      );
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
    const { parsed, prompts } = await this.#preparer.prepare(kind.endpoint, body, ctx.tenant?.index);
    const admitted = prompts.map((tokens) => {
      const admission = admit(tokens.length, parsed.maxTokens, this.contextLength, kind.param);
      if (!admission.ok) {
        this.metrics.admissionRejections.inc({ reason: admission.reason });
        throw admission.error;
      }
      return { tokens, maxTokens: admission.maxTokens };
    });
    const plan = {
      endpoint: kind.endpoint,
      parsed,
      prompts: admitted.map((a) => ({ tokens: a.tokens.length, maxTokens: a.maxTokens })),
      bodyBytes: body.length,
      modelId: this.#model.id,
    };
    const tooLarge = responseSizeRefusal(plan, this.#tokenBounds, this.#maxResponseBytes);
    if (tooLarge !== null) {
      this.metrics.admissionRejections.inc({ reason: "response_too_large" });
      throw tooLarge;
    }
    if (ctx.res.destroyed) {
      // The client left while its body was read: nothing to serve, nothing to allocate.
      this.metrics.clientDisconnects.inc({ endpoint: kind.endpoint });
      return;
    }
    const requestId = ctx.requestId;
    const span = tracing()?.startRequest(
      "request",
      { "kvfence.request_id": requestId, "kvfence.endpoint": kind.endpoint },
      epochOf(ctx.receivedAt),
    );
    const base: Omit<GenerationRequest, "rid" | "promptTokens" | "maxTokens"> = {
      tenant: ctx.tenant!.index,
      sampling: samplingParams(parsed, this.#model),
      trace: span === undefined ? { requestId } : { requestId, traceparent: span.traceparent },
      cacheSalt: parsed.cacheSalt,
      cacheScope: this.#prefixCacheScope === "key" && ctx.keyIndex >= 0 ? `key:${ctx.keyIndex}` : "",
      // Several generations are admitted as one, or refused whole (src/fair-share/fair-share.ts).
      ...(admitted.length * parsed.n > 1
        ? { group: { first: this.#nextRid, size: admitted.length * parsed.n } }
        : {}),
    };
    // Per prompt, n samples (choice p·n + j): sample 0 computes the prompt, the others fork its KV
    // (one engine) — each its own request id and, with a seed, seed + j (as vLLM).
    const planned: PlannedChoice[] = [];
    // The disaggregated topologies run the samples as one group (one prefill, forked on decode),
    // unless log-probabilities are asked (each sample then computes its own prompt).
    const grouped =
      parsed.n > 1 && base.sampling.logprobs === undefined && base.sampling.promptLogprobs === undefined;
    admitted.forEach(({ tokens, maxTokens }, p) => {
      const first = this.#nextRid;
      const rids = Array.from({ length: parsed.n }, () => {
        const rid = this.#nextRid;
        this.#nextRid = rid >= U32_MAX ? 1 : rid + 1;
        return rid;
      });
      for (let j = 0; j < parsed.n; j++) {
        const rid = rids[j]!;
        const own = { ...base, rid, promptTokens: tokens, maxTokens };
        planned.push({
          request:
            j === 0
              ? grouped
                ? { ...own, samples: rids.slice(1) }
                : own
              : { ...own, sampling: laterSampleSampling(base.sampling, j), sample: { of: first, index: j } },
          echo: parsed.echoPrompts?.[p] ?? null,
          firstOfPrompt: j === 0,
        });
      }
    });
    this.#serve(ctx, kind, parsed, planned, span);
  }

  /**
   * Runs an admitted request's generations — one per choice (`n`), sample 0 first — and answers
   * them, streamed (each chunk names its choice's index) or whole (every choice, usage summed over
   * them). One choice failing fails the response and stops the others. With echo, a streamed
   * choice opens with the prompt (and its log-probabilities when asked).
   */
  #serve(
    ctx: RequestContext,
    kind: GenerateEndpoint,
    parsed: SamplingRequest,
    planned: readonly PlannedChoice[],
    span?: RequestSpan,
  ): void {
    const { res } = ctx;
    const { endpoint, responses } = kind;
    const labels = { endpoint };
    const meta = this.#responseMeta(responses, parsed, planned[0]!.request);
    const includeUsage = parsed.includeUsage;
    const piece = (id: number) => this.#tokenizer.tokenPiece(id);
    let lastTokenAt = 0;
    let sse: SseWriter | null = null;
    let ended = false;
    // Each prompt's log-probabilities are rendered once, for all its choices (choice-logprobs.ts).
    const logprobs = choicesLogprobs(planned, { parsed, piece, responses });
    const choices = planned.map(({ request, echo, firstOfPrompt }, index) => ({
      request,
      echo,
      firstOfPrompt,
      index,
      text: "",
      opened: false,
      ...logprobs[index]!,
      result: null as { reason: FinishReason; usage: Usage; stopReason: StopReason } | null,
    }));
    type Choice = (typeof choices)[number];
    const generations: Generation[] = [];

    const stream = (choice: Choice): SseWriter => {
      sse ??= new SseWriter(res, 200, responses.framing, this.#serialiseFailed(ctx.requestId));
      if (!choice.opened) {
        choice.opened = true;
        for (const opening of responses.opening(meta, includeUsage))
          sse.send(withIndex(opening, choice.index));
        if (choice.echo !== null) {
          const delta = responses.delta(meta, choice.echo, includeUsage, choice.logprobs.echoed());
          sse.send(withIndex(delta, choice.index));
        }
      }
      return sse;
    };
    const end = (status: number, usage: Usage | null) => {
      if (ended) return;
      ended = true;
      for (const generation of generations) this.#active.delete(generation);
      this.metrics.inFlight.set(this.#active.size);
      this.metrics.requestDuration.observe(labels, (performance.now() - ctx.receivedAt) / 1000);
      span?.end({
        "http.response.status_code": status,
        "kvfence.prompt_tokens": planned[0]!.request.promptTokens.length,
        ...(usage === null ? {} : { "kvfence.completion_tokens": usage.completionTokens }),
      });
      this.#logDone(ctx, planned[0]!.request, endpoint, status, usage);
    };
    const finished = () => {
      const usage = totalUsage(choices);
      end(200, usage);
      const whole = () => wholeAnswer(responses, meta, choices, usage);
      if (!parsed.stream) {
        this.#sendJson(res, 200, whole());
        return;
      }
      for (const closing of responses.closing(meta, includeUsage, usage, whole)) sse!.send(closing);
      sse!.done();
    };

    // vLLM's continuous_usage_stats: every chunk with the usage so far.
    const promptTokens = planned.reduce(
      (n, p) => n + (p.firstOfPrompt ? p.request.promptTokens.length : 0),
      0,
    );
    let generated = 0;
    const send = (choice: Choice, chunk: Record<string, unknown>) => {
      if (parsed.continuousUsage) chunk.usage = usageWire({ promptTokens, completionTokens: generated });
      stream(choice).send(withIndex(chunk, choice.index));
    };
    const sinkOf = (choice: Choice): GenerationSink => ({
      tokens: (count) => {
        generated += count;
        lastTokenAt = this.#observeTokens(ctx, labels, count, lastTokenAt);
        if (parsed.stream) stream(choice);
      },
      logprobs: (entry) => choice.logprobs.push(entry),
      // Sample 0 of a prompt computes its log-probabilities; every choice of that prompt shows them.
      promptLogprobs: (entries) => choice.prompt.set(entries),
      text: (delta) => {
        choice.text += delta;
        if (parsed.stream) send(choice, responses.delta(meta, delta, includeUsage, choice.logprobs.take()));
      },
      finish: (reason: FinishReason, usage: Usage, stopReason: StopReason) => {
        if (ended) return;
        choice.result = { reason, usage, stopReason };
        if (parsed.stream) {
          const logprobs = choice.logprobs.take();
          for (const chunk of responses.finish(meta, reason, includeUsage, stopReason, logprobs, choice.text))
            send(choice, chunk);
        }
        if (choices.every((c) => c.result !== null)) finished();
      },
      fail: (internal) => {
        if (ended) return;
        for (const generation of generations) generation.abort();
        const error = this.#publicEngineError(ctx.requestId, choice.request.rid, internal);
        const { status, body } = toOpenAiError(error);
        end(status, null);
        if (error.code === "context_length_exceeded")
          this.metrics.admissionRejections.inc({ reason: "engine_door" });
        if (sse === null) {
          this.#sendError(res, error);
          return;
        }
        // Headers are out: report the error in the stream, as OpenAI does, then end it.
        (sse as SseWriter).send(responses.streamError(body));
        (sse as SseWriter).done();
      },
    });
    for (const choice of choices) generations.push(this.#generation(choice.request, parsed, sinkOf(choice)));
    for (const generation of generations) this.#active.add(generation);
    this.metrics.inFlight.set(this.#active.size);
    res.on("close", () => {
      if (ended) return;
      for (const generation of generations) generation.abort();
      this.metrics.clientDisconnects.inc(labels);
      end(499, null);
    });
    for (const generation of generations) generation.start();
  }

  /** What every payload of one response repeats: its id, time, model, the settings in effect. */
  #responseMeta(
    responses: ResponseStrategy,
    parsed: SamplingRequest,
    first: GenerationRequest,
  ): ResponseMeta {
    const echo = (parsed as { responses?: ResponsesEcho }).responses;
    return {
      id: completionId(responses.idKind),
      created: Math.floor(Date.now() / 1000),
      model: this.#model.id,
      sampling: { temperature: first.sampling.temperature, topP: first.sampling.topP },
      ...(echo === undefined ? {} : { responses: echo }),
    };
  }

  /** Time to first token, or between tokens, of `count` new ones; returns now. */
  #observeTokens(
    ctx: RequestContext,
    labels: { endpoint: Endpoint },
    count: number,
    lastTokenAt: number,
  ): number {
    const now = performance.now();
    if (lastTokenAt === 0) {
      this.metrics.timeToFirstToken.observe(labels, (now - ctx.receivedAt) / 1000);
    } else {
      this.metrics.interTokenLatency.observeMany(labels, (now - lastTokenAt) / 1000 / count, count);
    }
    return now;
  }

  #generation(request: GenerationRequest, parsed: SamplingRequest, sink: GenerationSink): Generation {
    return new Generation(
      this.#engine,
      request,
      {
        logprobs: parsed.logprobs !== null,
        decoder: this.#tokenizer.createDecoder({ skipSpecialTokens: parsed.skipSpecialTokens }),
        stop: parsed.stop,
        stopTokenIds: parsed.stopTokenIds,
        minTokens: parsed.minTokens,
        includeStopStr: parsed.includeStopStr,
      },
      sink,
    );
  }

  /**
   * What the engine and the nodes say names request ids, pages and nodes: the log gets it, the
   * client the table's public message.
   */
  #publicEngineError(requestId: string, rid: number, internal: KvfenceError): KvfenceError {
    const error = publicError(internal);
    if (error !== internal) {
      this.#log.warn(
        { requestId, rid, code: internal.code, message: internal.message },
        "request failed in the engine",
      );
    }
    return error;
  }

  #logDone(
    ctx: RequestContext,
    request: GenerationRequest,
    endpoint: Endpoint,
    status: number,
    usage: Usage | null,
  ): void {
    const tenant = ctx.tenant!;
    if (usage !== null) {
      const label = this.#tenantLabel(tenant.name);
      this.metrics.promptTokens.inc({ tenant: label, endpoint }, usage.promptTokens);
      this.metrics.completionTokens.inc({ tenant: label, endpoint }, usage.completionTokens);
    }
    this.#log.info(
      {
        requestId: ctx.requestId,
        rid: request.rid,
        tenant: tenant.name,
        endpoint,
        status,
        promptTokens: request.promptTokens.length,
        completionTokens: usage?.completionTokens,
      },
      "request done",
    );
  }

  /** /tokenize and /detokenize, prepared by the same workers as a generation request. */
  async #utility(ctx: RequestContext, endpoint: UtilityEndpointName): Promise<void> {
    checkJsonContentType(ctx.req.headers["content-type"]);
    const body = await readBody(ctx.req, this.#maxBodyBytes);
    const answer = await this.#preparer.answer(endpoint, body, ctx.tenant?.index);
    this.#sendJson(
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
    this.#sendJson(ctx.res, 200, { object: "list", data: names.map((id) => this.#modelObject(id)) });
  }

  #model_(ctx: RequestContext, id: string): void {
    const name = decodePathSegment(id);
    checkModel(name, [this.#model.id, ...(this.#model.aliases ?? [])]);
    this.#sendJson(ctx.res, 200, this.#modelObject(name));
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
    const text = await this.metrics.registry.metrics();
    ctx.res.writeHead(200, {
      "Content-Type": this.metrics.registry.contentType,
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

/** One choice to generate: its request, echo's text of its prompt, and whether it is its prompt's sample 0. */
interface PlannedChoice {
  readonly request: GenerationRequest;
  readonly echo: string | null;
  readonly firstOfPrompt: boolean;
}

/** A finished choice, as the whole answer needs it. */
interface DoneChoice {
  readonly echo: string | null;
  readonly text: string;
  readonly firstOfPrompt: boolean;
  readonly logprobs: ChoiceLogprobs;
  readonly result: { reason: FinishReason; usage: Usage; stopReason: StopReason } | null;
}

/** Usage over the choices: each prompt once, every choice's completion tokens. */
function totalUsage(choices: readonly DoneChoice[]): Usage {
  let promptTokens = 0;
  let completionTokens = 0;
  let cachedTokens: number | undefined;
  for (const c of choices) {
    const usage = c.result!.usage;
    if (c.firstOfPrompt) {
      promptTokens += usage.promptTokens;
      // The prompt's tokens served from the prefix cache (its first sample's; absent with the cache off).
      if (usage.cachedTokens !== undefined) cachedTokens = (cachedTokens ?? 0) + usage.cachedTokens;
    }
    completionTokens += usage.completionTokens;
  }
  return cachedTokens === undefined
    ? { promptTokens, completionTokens }
    : { promptTokens, completionTokens, cachedTokens };
}

/** The whole (non-streamed) answer of every choice. */
function wholeAnswer(
  responses: ResponseStrategy,
  meta: ResponseMeta,
  choices: readonly DoneChoice[],
  usage: Usage,
): object {
  return mergeChoices(
    choices.map((c) =>
      responses.completion(
        meta,
        (c.echo ?? "") + c.text,
        c.result!.reason,
        usage,
        c.result!.stopReason,
        c.logprobs.all(),
      ),
    ),
  );
}

/** A chunk of one choice: the strategies build choice 0's; `n` > 1 names each. */
function withIndex(chunk: Record<string, unknown>, index: number): Record<string, unknown> {
  if (index !== 0) (chunk.choices as { index: number }[])[0]!.index = index;
  return chunk;
}

/** The whole answer of several choices: the first one's object with every choice, each its index. */
function mergeChoices(answers: readonly object[]): object {
  const first = answers[0] as { choices: { index: number }[] };
  if (answers.length === 1) return first;
  const choices = answers.map((a, index) => ({ ...(a as typeof first).choices[0]!, index }));
  return { ...first, choices };
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
