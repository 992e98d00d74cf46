/**
 * Response bodies and SSE chunks in exactly the shapes OpenAI sends: `chat.completion` /
 * `chat.completion.chunk` and `text_completion` objects, `usage` with prompt, completion and total
 * tokens, and the usage-only chunk (empty `choices`) that `stream_options.include_usage` asks for.
 * Each endpoint's shapes are gathered in one `ResponseStrategy` (chat or text), which is all the
 * router needs to know about the difference between the two.
 */
import { randomBytes } from "node:crypto";
import type { FinishReason, Usage } from "./generation.js";

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

export function chatCompletion(meta: ResponseMeta, content: string, finish: FinishReason, usage: Usage) {
  return {
    id: meta.id,
    object: "chat.completion" as const,
    created: meta.created,
    model: meta.model,
    choices: [
      {
        index: 0,
        message: { role: "assistant" as const, content, refusal: null },
        logprobs: null,
        finish_reason: finish,
      },
    ],
    usage: usageWire(usage),
  };
}

export function textCompletion(meta: ResponseMeta, text: string, finish: FinishReason, usage: Usage) {
  return {
    id: meta.id,
    object: "text_completion" as const,
    created: meta.created,
    model: meta.model,
    choices: [{ index: 0, text, logprobs: null, finish_reason: finish }],
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
) {
  const chunk: Record<string, unknown> = {
    id: meta.id,
    object: "chat.completion.chunk",
    created: meta.created,
    model: meta.model,
    choices: [{ index: 0, delta, logprobs: null, finish_reason: finish }],
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
) {
  const chunk: Record<string, unknown> = {
    id: meta.id,
    object: "text_completion",
    created: meta.created,
    model: meta.model,
    choices: [{ index: 0, text, logprobs: null, finish_reason: finish }],
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
  /** A chunk carrying new text. */
  delta(meta: ResponseMeta, text: string, includeUsage: boolean): Record<string, unknown>;
  /** The chunk with the finish reason and no new text. */
  finish(meta: ResponseMeta, reason: FinishReason, includeUsage: boolean): Record<string, unknown>;
  /** The whole non-streamed answer. */
  completion(meta: ResponseMeta, text: string, reason: FinishReason, usage: Usage): object;
}

export const CHAT_RESPONSES: ResponseStrategy = {
  idKind: "chat",
  chunkObject: "chat.completion.chunk",
  opening: (meta, includeUsage) => chatChunk(meta, { role: "assistant", content: "" }, null, includeUsage),
  delta: (meta, text, includeUsage) => chatChunk(meta, { content: text }, null, includeUsage),
  finish: (meta, reason, includeUsage) => chatChunk(meta, {}, reason, includeUsage),
  completion: chatCompletion,
};

export const TEXT_RESPONSES: ResponseStrategy = {
  idKind: "text",
  chunkObject: "text_completion",
  opening: () => null,
  delta: (meta, text, includeUsage) => textChunk(meta, text, null, includeUsage),
  finish: (meta, reason, includeUsage) => textChunk(meta, "", reason, includeUsage),
  completion: textCompletion,
};
