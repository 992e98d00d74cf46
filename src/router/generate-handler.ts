/**
 * The generation endpoints (chat, completions, the Responses API) from a request to its reply: the
 * body read and prepared (parsed, templated, tokenized: prepare-pool.ts), each prompt admitted
 * (the context length, then the answer's worst case in bytes: response-size.ts), its choices
 * planned (generation-plan.ts), and the `GenerationReply` that runs them, which the HTTP layer
 * pumps (answer-writer.ts). What the router records of each request lives here too: time to first
 * token and between tokens, its duration and span, the generations in flight, the engine's errors
 * (logged whole, shown in their public form) and the "request done" log line.
 */
import type { IncomingMessage, ServerResponse } from "node:http";
import { performance } from "node:perf_hooks";
import { type KvfenceError, publicError } from "../lib/errors.js";
import type { Logger } from "../lib/logger.js";
import { epochOf, type RequestSpan, tracing } from "../lib/tracing.js";
import type { EngineHandle, GenerationRequest } from "../protocol/engine-api.js";
import { admit } from "./admission.js";
import type { Tenant } from "./api-keys.js";
import type { Generation, Usage } from "./generation.js";
import { type AdmittedPrompt, planChoices, RequestIds } from "./generation-plan.js";
import { GenerationReply, type PlannedChoice, type ReplyTokenizer } from "./generation-reply.js";
import { CHAT_RESPONSES, RESPONSES_API, type ResponseStrategy, TEXT_RESPONSES } from "./openai-responses.js";
import type { SamplingRequest } from "./openai-schemas.js";
import type { RequestPreparer } from "./prepare-pool.js";
import { checkJsonContentType, readBody } from "./read-body.js";
import type { ReasoningParserName } from "./reasoning-parser.js";
import { type GenerateEndpointName, PROMPT_PARAM } from "./request-names.js";
import { type SamplingModel, samplingParams } from "./request-sampling.js";
import { responseSizeRefusal, type TokenBounds } from "./response-size.js";
import type { Endpoint, RouterMetrics } from "./router-metrics.js";

/** What differs between the generation endpoints; the router never branches on the endpoint. */
export interface GenerateEndpoint {
  readonly endpoint: GenerateEndpointName;
  /** The request field a prompt-length error names. */
  readonly param: string;
  /** The shapes of its answers. */
  readonly responses: ResponseStrategy;
}

export const CHAT: GenerateEndpoint = {
  endpoint: "chat",
  param: PROMPT_PARAM.chat,
  responses: CHAT_RESPONSES,
};
export const COMPLETIONS: GenerateEndpoint = {
  endpoint: "completions",
  param: PROMPT_PARAM.completions,
  responses: TEXT_RESPONSES,
};

/** OpenAI's Responses API: a chat (its template), answered as a `response` object or its events. */
export const RESPONSES: GenerateEndpoint = {
  endpoint: "responses",
  param: PROMPT_PARAM.responses,
  responses: RESPONSES_API,
};

/** What a generation request needs of the request being served (the router's request context). */
export interface GenerateContext {
  readonly req: IncomingMessage;
  readonly res: ServerResponse;
  /** When it came in (`performance.now()`). */
  readonly receivedAt: number;
  readonly requestId: string;
  readonly tenant: Tenant | null;
  /** The API key's index in the key file (-1: anonymous), for `--prefix-cache-scope key`. */
  readonly keyIndex: number;
}

export interface GenerateHandlerOptions {
  readonly engine: EngineHandle;
  readonly tokenizer: ReplyTokenizer;
  /** The vocabulary's longest tokens, for the worst case of an answer (response-size.ts). */
  readonly tokenBounds: TokenBounds;
  /** The served model: the id its answers name, its sampling defaults, its reasoning parser. */
  readonly model: SamplingModel & { readonly id: string; readonly reasoningParser?: ReasoningParserName };
  readonly preparer: RequestPreparer;
  readonly maxBodyBytes: number;
  readonly maxResponseBytes: number;
  /** The longest request (prompt + max_tokens) admitted. */
  readonly contextLength: number;
  readonly prefixCacheScope: "tenant" | "key";
  readonly metrics: RouterMetrics;
  readonly logger: Logger;
  /** Tenant name → its label in metrics. */
  readonly tenantLabel: (name: string) => string;
  /** The generations in flight, the router's (a reply's are in it until it ends). */
  readonly active: Set<Generation>;
}

export class GenerateHandler {
  readonly #engine: EngineHandle;
  readonly #tokenizer: ReplyTokenizer;
  readonly #tokenBounds: TokenBounds;
  readonly #model: SamplingModel & { readonly id: string; readonly reasoningParser?: ReasoningParserName };
  readonly #preparer: RequestPreparer;
  readonly #maxBodyBytes: number;
  readonly #maxResponseBytes: number;
  readonly #contextLength: number;
  readonly #prefixCacheScope: "tenant" | "key";
  readonly #log: Logger;
  readonly #tenantLabel: (name: string) => string;
  readonly #active: Set<Generation>;
  readonly #rids = new RequestIds();
  /** The router's metrics (`RouterServer.metrics`). */
  readonly metrics: RouterMetrics;

  constructor(options: GenerateHandlerOptions) {
    this.#engine = options.engine;
    this.#tokenizer = options.tokenizer;
    this.#tokenBounds = options.tokenBounds;
    this.#model = options.model;
    this.#preparer = options.preparer;
    this.#maxBodyBytes = options.maxBodyBytes;
    this.#maxResponseBytes = options.maxResponseBytes;
    this.#contextLength = options.contextLength;
    this.#prefixCacheScope = options.prefixCacheScope;
    this.metrics = options.metrics;
    this.#log = options.logger;
    this.#tenantLabel = options.tenantLabel;
    this.#active = options.active;
  }

  /**
   * A generation endpoint's request: body → prompt → admission → its choices, answered in `kind`'s
   * shapes by the reply returned; undefined when the client already left.
   */
  async reply(ctx: GenerateContext, kind: GenerateEndpoint): Promise<GenerationReply | undefined> {
    checkJsonContentType(ctx.req.headers["content-type"]);
    const body = await readBody(ctx.req, this.#maxBodyBytes);
    const { parsed, prompts } = await this.#preparer.prepare(kind.endpoint, body, ctx.tenant?.index);
    const admitted = this.#admit(kind, parsed, prompts, body.length);
    if (ctx.res.destroyed) {
      // The client left while its body was read: nothing to serve, nothing to allocate.
      this.metrics.clientDisconnects.inc({ endpoint: kind.endpoint });
      return undefined;
    }
    const requestId = ctx.requestId;
    const span = tracing()?.startRequest(
      "request",
      { "kvfence.request_id": requestId, "kvfence.endpoint": kind.endpoint },
      epochOf(ctx.receivedAt),
    );
    const base = {
      tenant: ctx.tenant!.index,
      sampling: samplingParams(parsed, this.#model),
      trace: span === undefined ? { requestId } : { requestId, traceparent: span.traceparent },
      cacheSalt: parsed.cacheSalt,
      cacheScope: this.#prefixCacheScope === "key" && ctx.keyIndex >= 0 ? `key:${ctx.keyIndex}` : "",
      ...(ctx.tenant!.cacheEpoch === undefined ? {} : { cacheEpoch: ctx.tenant!.cacheEpoch }),
    };
    return this.#reply(ctx, kind, parsed, planChoices(base, admitted, parsed, this.#rids), span);
  }

  /** Each prompt with its completion budget, once the context and the answer's size admit them. */
  #admit(
    kind: GenerateEndpoint,
    parsed: SamplingRequest,
    prompts: readonly Int32Array[],
    bodyBytes: number,
  ): AdmittedPrompt[] {
    const admitted = prompts.map((tokens) => {
      const admission = admit(tokens.length, parsed.maxTokens, this.#contextLength, kind.param);
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
      bodyBytes,
      modelId: this.#model.id,
      reasoning: this.#model.reasoningParser !== undefined,
    };
    const tooLarge = responseSizeRefusal(plan, this.#tokenBounds, this.#maxResponseBytes);
    if (tooLarge !== null) {
      this.metrics.admissionRejections.inc({ reason: "response_too_large" });
      throw tooLarge;
    }
    return admitted;
  }

  /**
   * The reply of an admitted request's choices, its generations counted in flight; its hooks record
   * the request: token timings, an engine error (logged, shown in its public form), the end.
   */
  #reply(
    ctx: GenerateContext,
    kind: GenerateEndpoint,
    parsed: SamplingRequest,
    planned: readonly PlannedChoice[],
    span?: RequestSpan,
  ): GenerationReply {
    const { endpoint } = kind;
    const labels = { endpoint };
    const first = planned[0]!.request;
    let lastTokenAt = 0;
    const reply: GenerationReply = new GenerationReply({
      engine: this.#engine,
      tokenizer: this.#tokenizer,
      modelId: this.#model.id,
      parsed,
      responses: kind.responses,
      planned,
      reasoningParser: this.#model.reasoningParser ?? null,
      hooks: {
        tokens: (count) => {
          lastTokenAt = this.#observeTokens(ctx, labels, count, lastTokenAt);
        },
        failed: (rid, internal) => {
          const error = this.#publicEngineError(ctx.requestId, rid, internal);
          if (error.code === "context_length_exceeded")
            this.metrics.admissionRejections.inc({ reason: "engine_door" });
          return error;
        },
        clientGone: () => this.metrics.clientDisconnects.inc(labels),
        ended: (status, usage) => {
          for (const generation of reply.generations) this.#active.delete(generation);
          this.metrics.inFlight.set(this.#active.size);
          this.metrics.requestDuration.observe(labels, (performance.now() - ctx.receivedAt) / 1000);
          span?.end({
            "http.response.status_code": status,
            "kvfence.prompt_tokens": first.promptTokens.length,
            ...(usage === null ? {} : { "kvfence.completion_tokens": usage.completionTokens }),
            ...(usage?.migrations === undefined ? {} : { "kvfence.migrations": usage.migrations }),
          });
          this.#logDone(ctx, first, endpoint, status, usage);
        },
      },
    });
    for (const generation of reply.generations) this.#active.add(generation);
    this.metrics.inFlight.set(this.#active.size);
    return reply;
  }

  /** Time to first token, or between tokens, of `count` new ones; returns now. */
  #observeTokens(
    ctx: GenerateContext,
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
    ctx: GenerateContext,
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
        ...(usage?.migrations === undefined ? {} : { migrations: usage.migrations }),
      },
      "request done",
    );
  }
}
