/**
 * Response bodies and SSE chunks in exactly the shapes OpenAI sends: `chat.completion` /
 * `chat.completion.chunk` and `text_completion` objects, `usage` with prompt, completion and total
 * tokens, and the usage-only chunk (empty `choices`) that `stream_options.include_usage` asks for.
 * A choice that finished also says what stopped it as vLLM (`stop_reason`) and SGLang
 * (`matched_stop`) do: the stop string or stop token id; for EOS, vLLM's null and SGLang's EOS
 * token id; null for `length`.
 * Each endpoint's shapes are gathered in one `ResponseStrategy` (chat, text, or OpenAI's Responses
 * API: a `response` object, and a stream of named events each with its `sequence_number`), which is
 * all the router needs to know about the difference between them.
 */
import { randomBytes } from "node:crypto";
import type { FinishReason, StopReason, Usage } from "./generation.js";
import { chatLogprobs, type LogprobItem, type PieceOf, textLogprobs } from "./logprobs-wire.js";
import type { ResponsesEcho } from "./responses-request.js";
import type { SseFraming } from "./sse.js";
import type { ParsedToolCall, ToolCallDelta } from "./tool-call-parser.js";
import {
  chatToolCallDelta,
  chatToolCalls,
  functionCallEvents,
  functionCallItem,
  functionCallsDone,
} from "./tool-call-wire.js";

/** What a choice carries besides its text: log-probabilities in the endpoint's shape, vLLM's prompt_logprobs. */
export interface ChoiceExtras {
  readonly logprobs?: object | null;
  readonly promptLogprobs?: unknown;
  /** The tool calls parsed from the text (tool-call-parser.ts); absent: the request has no tool parsing. */
  readonly toolCalls?: readonly ParsedToolCall[];
  /** With a reasoning parser: the reasoning split out of the text (null: none). */
  readonly reasoning?: string | null;
}

/** An OpenAI error envelope (src/lib/errors.ts, `toOpenAiError`). */
export interface OpenAiErrorBody {
  readonly error: { message: string; type: string; param: string | null; code: string };
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

const ID_PREFIX = { chat: "chatcmpl-", text: "cmpl-", response: "resp_" } as const;

/** `count` random alphanumerics. */
function randomAlphanumerics(count: number): string {
  const alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  let out = "";
  for (const b of randomBytes(count)) out += alphabet[b % alphabet.length];
  return out;
}

/** `chatcmpl-…`, `cmpl-…` or `resp_…` followed by 24 random alphanumerics. */
export function completionId(kind: keyof typeof ID_PREFIX): string {
  return ID_PREFIX[kind] + randomAlphanumerics(24);
}

export interface ResponseMeta {
  readonly id: string;
  readonly created: number;
  readonly model: string;
  /** The sampling settings in effect (the Responses object repeats them). */
  readonly sampling?: { readonly temperature: number; readonly topP: number };
  /** A Responses request's fields its answer repeats. */
  readonly responses?: ResponsesEcho;
  /** The request used OpenAI's deprecated `functions`: calls answer as `function_call`. */
  readonly legacyFunctions?: boolean;
  /** With a reasoning parser, a stream's reasoning so far (the Responses API's items follow it). */
  readonly reasoning?: ReasoningTrack;
}

/** A streamed response's reasoning: its text so far (null: none yet), and where the message goes. */
export interface ReasoningTrack {
  text: string | null;
  messageIndex: number;
}

/** How an endpoint streams the reasoning a reasoning parser splits out (reasoning-parser.ts). */
export interface ReasoningShapes {
  /** The payloads of a piece of reasoning. */
  delta(
    meta: ResponseMeta,
    text: string,
    includeUsage: boolean,
    logprobs: object | null,
  ): Record<string, unknown>[];
  /** The payloads between the reasoning and the content: once, before the first content or the finish. */
  toContent(meta: ResponseMeta): Record<string, unknown>[];
}

/** vLLM's `stop_reason` and SGLang's `matched_stop` of a finished choice (they differ only for EOS). */
function stopFields(stopReason: StopReason) {
  if (stopReason !== null && typeof stopReason === "object")
    return { stop_reason: null, matched_stop: stopReason.eos };
  return { stop_reason: stopReason, matched_stop: stopReason };
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
        message: {
          ...chatMessage(content, extras.toolCalls, meta.legacyFunctions === true),
          ...(extras.reasoning === undefined ? {} : { reasoning_content: extras.reasoning }),
        },
        logprobs: extras.logprobs ?? null,
        finish_reason: finish,
        ...stopFields(stopReason),
      },
    ],
    usage: usageWire(usage),
  };
}

/** A chat answer's message: its calls, if any (content null when they are all it says). */
function chatMessage(content: string, calls: readonly ParsedToolCall[] | undefined, legacy: boolean) {
  if (calls === undefined || calls.length === 0)
    return { role: "assistant" as const, content, refusal: null };
  const call = calls[0]!;
  return {
    role: "assistant" as const,
    content: content === "" ? null : content,
    refusal: null,
    ...(legacy
      ? { function_call: { name: call.name, arguments: call.arguments } }
      : { tool_calls: chatToolCalls(calls) }),
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
        ...stopFields(stopReason),
        ...(extras.promptLogprobs === undefined ? {} : { prompt_logprobs: extras.promptLogprobs }),
      },
    ],
    usage: usageWire(usage),
  };
}

type ChatDelta = {
  role?: "assistant";
  content?: string;
  reasoning_content?: string;
  tool_calls?: Record<string, unknown>[];
  function_call?: { name?: string; arguments: string };
};

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
  if (stopReason !== undefined) Object.assign(choice, stopFields(stopReason));
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
  if (stopReason !== undefined) Object.assign(choice, stopFields(stopReason));
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
 * `CHAT_RESPONSES` for /v1/chat/completions, `TEXT_RESPONSES` for /v1/completions,
 * `RESPONSES_API` for /v1/responses.
 */
export interface ResponseStrategy {
  /** The id prefix (`chatcmpl-`, `cmpl-` or `resp_`). */
  readonly idKind: keyof typeof ID_PREFIX;
  /** How its stream is framed: `data:` chunks ending with `[DONE]`, or named events with sequence numbers. */
  readonly framing: SseFraming;
  /** The payloads a stream opens with before any text (chat's role chunk, the Responses lifecycle events). */
  opening(meta: ResponseMeta, includeUsage: boolean): Record<string, unknown>[];
  /** A payload carrying new text (and the log-probabilities of its tokens, when asked). */
  delta(
    meta: ResponseMeta,
    text: string,
    includeUsage: boolean,
    logprobs?: object | null,
  ): Record<string, unknown>;
  /** The payloads that end one choice: its finish reason (and the last tokens' log-probabilities); `text` is the choice's whole text. */
  finish(
    meta: ResponseMeta,
    reason: FinishReason,
    includeUsage: boolean,
    stopReason: StopReason,
    logprobs: object | null | undefined,
    text: string,
  ): Record<string, unknown>[];
  /** The payloads once every choice finished; `whole` builds the non-streamed answer. */
  closing(
    meta: ResponseMeta,
    includeUsage: boolean,
    usage: Usage,
    whole: () => object,
  ): Record<string, unknown>[];
  /** The payloads of one piece of a tool call (`calls`: every call so far); absent: no tools on this endpoint. */
  toolCall?(
    meta: ResponseMeta,
    delta: ToolCallDelta,
    calls: readonly ParsedToolCall[],
    includeUsage: boolean,
  ): Record<string, unknown>[];
  /** The payloads that close the calls, before the choice's finish payloads. */
  toolCallsDone?(calls: readonly ParsedToolCall[]): Record<string, unknown>[];
  /** The payload of an error after the stream's headers went out. */
  streamError(body: OpenAiErrorBody): Record<string, unknown>;
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
  /** How it streams reasoning (absent: the endpoint splits none out, as completions). */
  readonly reasoning?: ReasoningShapes;
}

/** A chat chunk's delta of one call's piece: `tool_calls`, or the deprecated `function_call`. */
function chatCallDelta(meta: ResponseMeta, delta: ToolCallDelta): ChatDelta {
  if (meta.legacyFunctions !== true) return { tool_calls: [chatToolCallDelta(delta)] };
  return {
    function_call:
      delta.name === undefined ? { arguments: delta.arguments } : { name: delta.name, arguments: "" },
  };
}

/** The usage-only chunk when `stream_options.include_usage` asks for it. */
function usageClosing(object: "chat.completion.chunk" | "text_completion") {
  return (meta: ResponseMeta, includeUsage: boolean, usage: Usage) =>
    includeUsage ? [usageChunk(meta, object, usage)] : [];
}

export const CHAT_RESPONSES: ResponseStrategy = {
  idKind: "chat",
  framing: "data",
  opening: (meta, includeUsage) => [chatChunk(meta, { role: "assistant", content: "" }, null, includeUsage)],
  delta: (meta, text, includeUsage, logprobs) =>
    chatChunk(meta, { content: text }, null, includeUsage, undefined, logprobs ?? null),
  finish: (meta, reason, includeUsage, stopReason, logprobs) => [
    chatChunk(meta, {}, reason, includeUsage, stopReason, logprobs ?? null),
  ],
  toolCall: (meta, delta, _calls, includeUsage) => [
    chatChunk(meta, chatCallDelta(meta, delta), null, includeUsage),
  ],
  closing: usageClosing("chat.completion.chunk"),
  streamError: (body) => ({ ...body }),
  completion: chatCompletion,
  logprobs: (items, piece) => chatLogprobs(items, piece),
  // vLLM's: reasoning deltas carry `reasoning_content`, then content deltas follow.
  reasoning: {
    delta: (meta, text, includeUsage, logprobs) => [
      chatChunk(meta, { reasoning_content: text }, null, includeUsage, undefined, logprobs),
    ],
    toContent: () => [],
  },
};

export const TEXT_RESPONSES: ResponseStrategy = {
  idKind: "text",
  framing: "data",
  opening: () => [],
  delta: (meta, text, includeUsage, logprobs) =>
    textChunk(meta, text, null, includeUsage, undefined, logprobs ?? null),
  finish: (meta, reason, includeUsage, stopReason, logprobs) => [
    textChunk(meta, "", reason, includeUsage, stopReason, logprobs ?? null),
  ],
  closing: usageClosing("text_completion"),
  streamError: (body) => ({ ...body }),
  completion: textCompletion,
  logprobs: textLogprobs,
};

/** The Responses API's usage: input, output and total tokens, with their details. */
export function responsesUsage(usage: Usage) {
  return {
    input_tokens: usage.promptTokens,
    input_tokens_details: { cached_tokens: usage.cachedTokens ?? 0 },
    output_tokens: usage.completionTokens,
    output_tokens_details: { reasoning_tokens: 0 },
    total_tokens: usage.promptTokens + usage.completionTokens,
  };
}

/** The one output message's id: `msg_` and the response id's random part. */
function messageId(meta: ResponseMeta): string {
  return `msg_${meta.id.slice(ID_PREFIX.response.length)}`;
}

/** The reasoning item's id: `rs_` and the response id's random part. */
function reasoningId(meta: ResponseMeta): string {
  return `rs_${meta.id.slice(ID_PREFIX.response.length)}`;
}

/** The reasoning item of a response (OpenAI's shape: its text as one `reasoning_text` part). */
function reasoningItem(meta: ResponseMeta, status: ResponseStatus, text: string | null) {
  return {
    id: reasoningId(meta),
    type: "reasoning" as const,
    status,
    summary: [],
    content: text === null ? [] : [reasoningText(text)],
  };
}

function reasoningText(text: string) {
  return { type: "reasoning_text" as const, text };
}

type ResponseStatus = "in_progress" | "completed" | "incomplete";

/** The assistant message item of a response. */
function messageItem(meta: ResponseMeta, status: ResponseStatus, text: string | null) {
  return {
    id: messageId(meta),
    type: "message" as const,
    status,
    role: "assistant" as const,
    content: text === null ? [] : [outputText(text)],
  };
}

function outputText(text: string) {
  return { type: "output_text" as const, text, annotations: [], logprobs: [] };
}

/**
 * A `response` object: its status, its output (the message once there is one), the request's
 * settings it repeats, and the usage once finished. A response cut by `max_output_tokens` (or the
 * context) is `incomplete`, with `incomplete_details.reason` `max_output_tokens`, as OpenAI's.
 */
function responseObject(meta: ResponseMeta, status: ResponseStatus, output: object[], usage: Usage | null) {
  const echo = meta.responses;
  return {
    id: meta.id,
    object: "response" as const,
    created_at: meta.created,
    status,
    ...(status === "in_progress" ? {} : { completed_at: Math.floor(Date.now() / 1000) }),
    background: false,
    error: null,
    incomplete_details: status === "incomplete" ? { reason: "max_output_tokens" as const } : null,
    instructions: echo?.instructions ?? null,
    max_output_tokens: echo?.maxOutputTokens ?? null,
    metadata: echo?.metadata ?? {},
    model: meta.model,
    output,
    parallel_tool_calls: echo?.tools?.parallel ?? false,
    previous_response_id: null,
    reasoning: { effort: echo?.reasoningEffort ?? null, summary: null },
    service_tier: "default" as const,
    store: false,
    temperature: meta.sampling?.temperature ?? null,
    text: { format: { type: "text" as const } },
    tool_choice: echo?.tools?.choice ?? "none",
    tools: echo?.tools?.tools ?? [],
    top_logprobs: 0,
    top_p: meta.sampling?.topP ?? null,
    truncation: "disabled" as const,
    usage: usage === null ? null : responsesUsage(usage),
    user: echo?.user ?? null,
  };
}

/** The status a finished response reports. */
function finishedStatus(reason: FinishReason): ResponseStatus {
  return reason === "length" ? "incomplete" : "completed";
}

/**
 * OpenAI's `obfuscation` field of a streamed delta: random characters so that a delta's size
 * tells an onlooker nothing about the token's length (on unless `stream_options.include_obfuscation` is false).
 */
function obfuscation(meta: ResponseMeta): { obfuscation?: string } {
  if (meta.responses?.obfuscate !== true) return {};
  return { obfuscation: randomAlphanumerics(1 + (randomBytes(1)[0]! % 16)) };
}

/** The place of the message's text in a response: output 0 (1 after a reasoning item), content part 0. */
function part(meta: ResponseMeta) {
  return { output_index: meta.reasoning?.messageIndex ?? 0, content_index: 0 };
}

/** The events that open the message item and its text part. */
function messageOpening(meta: ResponseMeta): Record<string, unknown>[] {
  return [
    {
      type: "response.output_item.added",
      output_index: part(meta).output_index,
      item: messageItem(meta, "in_progress", null),
    },
    { type: "response.content_part.added", item_id: messageId(meta), ...part(meta), part: outputText("") },
  ];
}

/** OpenAI's reasoning events: the reasoning item (output 0) and its `reasoning_text` deltas, then the message item. */
const RESPONSES_REASONING: ReasoningShapes = {
  delta: (meta, text) => {
    const track = meta.reasoning!;
    const item_id = reasoningId(meta);
    const at = { item_id, output_index: 0, content_index: 0 };
    const opening =
      track.text === null
        ? [
            {
              type: "response.output_item.added",
              output_index: 0,
              item: reasoningItem(meta, "in_progress", null),
            },
            { type: "response.content_part.added", ...at, part: reasoningText("") },
          ]
        : [];
    track.text = (track.text ?? "") + text;
    return [...opening, { type: "response.reasoning_text.delta", ...at, delta: text }];
  },
  toContent: (meta) => {
    const track = meta.reasoning!;
    const text = track.text;
    if (text === null) return messageOpening(meta);
    track.messageIndex = 1;
    const at = { item_id: reasoningId(meta), output_index: 0, content_index: 0 };
    return [
      { type: "response.reasoning_text.done", ...at, text },
      { type: "response.content_part.done", ...at, part: reasoningText(text) },
      { type: "response.output_item.done", output_index: 0, item: reasoningItem(meta, "completed", text) },
      ...messageOpening(meta),
    ];
  },
};

export const RESPONSES_API: ResponseStrategy = {
  idKind: "response",
  framing: "events",
  opening: (meta) => [
    { type: "response.created", response: responseObject(meta, "in_progress", [], null) },
    { type: "response.in_progress", response: responseObject(meta, "in_progress", [], null) },
    // With a reasoning parser, the message opens after the reasoning (RESPONSES_REASONING).
    ...(meta.reasoning === undefined ? messageOpening(meta) : []),
  ],
  delta: (meta, text) => ({
    type: "response.output_text.delta",
    item_id: messageId(meta),
    ...part(meta),
    delta: text,
    logprobs: [],
    ...obfuscation(meta),
  }),
  finish: (meta, reason, _includeUsage, _stopReason, _logprobs, text) => [
    { type: "response.output_text.done", item_id: messageId(meta), ...part(meta), text, logprobs: [] },
    { type: "response.content_part.done", item_id: messageId(meta), ...part(meta), part: outputText(text) },
    {
      type: "response.output_item.done",
      output_index: part(meta).output_index,
      item: messageItem(meta, finishedStatus(reason), text),
    },
  ],
  closing: (_meta, _includeUsage, _usage, whole) => {
    const response = whole() as { status: ResponseStatus };
    return [
      { type: response.status === "incomplete" ? "response.incomplete" : "response.completed", response },
    ];
  },
  toolCall: (_meta, delta, calls) => functionCallEvents(delta, calls),
  toolCallsDone: functionCallsDone,
  // OpenAI's error event of a stream.
  streamError: ({ error }) => ({
    type: "error",
    code: error.code,
    message: error.message,
    param: error.param,
  }),
  completion: (meta, text, reason, usage, _stopReason, extras) => {
    const status = finishedStatus(reason);
    const message = messageItem(meta, status, text);
    const reasoning = extras?.reasoning ?? null;
    const calls = (extras?.toolCalls ?? []).map((call) => functionCallItem(call, "completed"));
    const output = reasoning === null ? [message] : [reasoningItem(meta, "completed", reasoning), message];
    return responseObject(meta, status, [...output, ...calls], usage);
  },
  logprobs: () => ({}),
  reasoning: RESPONSES_REASONING,
};
