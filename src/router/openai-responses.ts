/**
 * Response bodies and SSE chunks in exactly the shapes OpenAI sends: `chat.completion` /
 * `chat.completion.chunk` and `text_completion` objects, `usage` with prompt, completion and total
 * tokens, and the usage-only chunk (empty `choices`) that `stream_options.include_usage` asks for.
 * A choice that finished also says what stopped it as vLLM (`stop_reason`) and SGLang
 * (`matched_stop`) do: the stop string or stop token id, null for EOS and `length`.
 * Each endpoint's shapes are gathered in one `ResponseStrategy` (chat or text), which is all the
 * router needs to know about the difference between the two.
 */
import { randomBytes } from "node:crypto";
import type { FinishReason, StopReason, Usage } from "./generation.js";
import { chatLogprobs, type LogprobItem, type PieceOf, textLogprobs } from "./logprobs-wire.js";

/** What a choice carries besides its text: log-probabilities in the endpoint's shape, vLLM's prompt_logprobs. */
export interface ChoiceExtras {
  readonly logprobs?: object | null;
  readonly promptLogprobs?: unknown;
}

export interface UsageWire {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  /** OpenAI's field: prompt tokens served from the prefix cache (when the cache is on). */
  prompt_tokens_details?: { cached_tokens: number };
}

export function usageWire(usage: Usage): UsageWire {
  const wire: UsageWire = {
    prompt_tokens: usage.promptTokens,
    completion_tokens: usage.completionTokens,
    total_tokens: usage.promptTokens + usage.completionTokens,
  };
  if (usage.cachedTokens !== undefined) wire.prompt_tokens_details = { cached_tokens: usage.cachedTokens };
  return wire;
}

/** `chatcmpl-…` or `cmpl-…` followed by 24 random alphanumerics. */
export function completionId(kind: "chat" | "text"): string {
  const alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  const bytes = randomBytes(24);
  let out = kind === "chat" ? "chatcmpl-" : "cmpl-";
  for (const b of bytes) out += alphabet[b % alphabet.length];
  return out;
}

export interface ResponseMeta {
  readonly id: string;
  readonly created: number;
  readonly model: string;
}

export function chatCompletion(
  meta: ResponseMeta,
  content: string,
  finish: FinishReason,
  usage: Usage,
  stopReason: StopReason = null,
  extras: ChoiceExtras = {},
) {
  return {
    id: meta.id,
    object: "chat.completion" as const,
    created: meta.created,
    model: meta.model,
    ...(extras.promptLogprobs === undefined ? {} : { prompt_logprobs: extras.promptLogprobs }),
    choices: [
      {
        index: 0,
        message: { role: "assistant" as const, content, refusal: null },
        logprobs: extras.logprobs ?? null,
        finish_reason: finish,
        stop_reason: stopReason,
        matched_stop: stopReason,
      },
    ],
    usage: usageWire(usage),
  };
}

export function textCompletion(
  meta: ResponseMeta,
  text: string,
  finish: FinishReason,
  usage: Usage,
  stopReason: StopReason = null,
  extras: ChoiceExtras = {},
) {
  return {
    id: meta.id,
    object: "text_completion" as const,
    created: meta.created,
    model: meta.model,
    choices: [
      {
        index: 0,
        text,
        logprobs: extras.logprobs ?? null,
        finish_reason: finish,
        stop_reason: stopReason,
        matched_stop: stopReason,
        ...(extras.promptLogprobs === undefined ? {} : { prompt_logprobs: extras.promptLogprobs }),
      },
    ],
    usage: usageWire(usage),
  };
}

type ChatDelta = { role?: "assistant"; content?: string };

/** A `chat.completion.chunk`; `usage: null` is present on every chunk when usage was requested. */
export function chatChunk(
  meta: ResponseMeta,
  delta: ChatDelta,
  finish: FinishReason | null,
  includeUsage: boolean,
  stopReason?: StopReason,
  logprobs: object | null = null,
) {
  const choice: Record<string, unknown> = { index: 0, delta, logprobs, finish_reason: finish };
  if (stopReason !== undefined) Object.assign(choice, { stop_reason: stopReason, matched_stop: stopReason });
  const chunk: Record<string, unknown> = {
    id: meta.id,
    object: "chat.completion.chunk",
    created: meta.created,
    model: meta.model,
    choices: [choice],
  };
  if (includeUsage) chunk.usage = null;
  return chunk;
}

/** A streamed `text_completion` chunk. */
export function textChunk(
  meta: ResponseMeta,
  text: string,
  finish: FinishReason | null,
  includeUsage: boolean,
  stopReason?: StopReason,
  logprobs: object | null = null,
) {
  const choice: Record<string, unknown> = { index: 0, text, logprobs, finish_reason: finish };
  if (stopReason !== undefined) Object.assign(choice, { stop_reason: stopReason, matched_stop: stopReason });
  const chunk: Record<string, unknown> = {
    id: meta.id,
    object: "text_completion",
    created: meta.created,
    model: meta.model,
    choices: [choice],
  };
  if (includeUsage) chunk.usage = null;
  return chunk;
}

/** The last chunk before `[DONE]` when `stream_options.include_usage` is set: no choices, usage. */
export function usageChunk(
  meta: ResponseMeta,
  object: "chat.completion.chunk" | "text_completion",
  usage: Usage,
) {
  return {
    id: meta.id,
    object,
    created: meta.created,
    model: meta.model,
    choices: [],
    usage: usageWire(usage),
  };
}

/**
 * How one endpoint's answers look, so the router builds them without branching on the endpoint:
 * `CHAT_RESPONSES` for /v1/chat/completions, `TEXT_RESPONSES` for /v1/completions.
 */
export interface ResponseStrategy {
  /** The id prefix (`chatcmpl-` or `cmpl-`). */
  readonly idKind: "chat" | "text";
  /** The `object` of a streamed chunk (and of the usage-only chunk). */
  readonly chunkObject: "chat.completion.chunk" | "text_completion";
  /** The chunk a stream opens with before any text (chat's role chunk), or null. */
  opening(meta: ResponseMeta, includeUsage: boolean): Record<string, unknown> | null;
  /** A chunk carrying new text (and the log-probabilities of its tokens, when asked). */
  delta(
    meta: ResponseMeta,
    text: string,
    includeUsage: boolean,
    logprobs?: object | null,
  ): Record<string, unknown>;
  /** The chunk with the finish reason and no new text (and the last tokens' log-probabilities). */
  finish(
    meta: ResponseMeta,
    reason: FinishReason,
    includeUsage: boolean,
    stopReason: StopReason,
    logprobs?: object | null,
  ): Record<string, unknown>;
  /** The whole non-streamed answer. */
  completion(
    meta: ResponseMeta,
    text: string,
    reason: FinishReason,
    usage: Usage,
    stopReason: StopReason,
    extras?: ChoiceExtras,
  ): object;
  /** Log-probabilities of `items` in this endpoint's shape; `offset`: the text before them (completions). */
  logprobs(items: readonly LogprobItem[], piece: PieceOf, offset: { value: number }): object;
}

export const CHAT_RESPONSES: ResponseStrategy = {
  idKind: "chat",
  chunkObject: "chat.completion.chunk",
  opening: (meta, includeUsage) => chatChunk(meta, { role: "assistant", content: "" }, null, includeUsage),
  delta: (meta, text, includeUsage, logprobs) =>
    chatChunk(meta, { content: text }, null, includeUsage, undefined, logprobs ?? null),
  finish: (meta, reason, includeUsage, stopReason, logprobs) =>
    chatChunk(meta, {}, reason, includeUsage, stopReason, logprobs ?? null),
  completion: chatCompletion,
  logprobs: (items, piece) => chatLogprobs(items, piece),
};

export const TEXT_RESPONSES: ResponseStrategy = {
  idKind: "text",
  chunkObject: "text_completion",
  opening: () => null,
  delta: (meta, text, includeUsage, logprobs) =>
    textChunk(meta, text, null, includeUsage, undefined, logprobs ?? null),
  finish: (meta, reason, includeUsage, stopReason, logprobs) =>
    textChunk(meta, "", reason, includeUsage, stopReason, logprobs ?? null),
  completion: textCompletion,
  logprobs: textLogprobs,
};
