/**
 * Request validation for the OpenAI-compatible endpoints. Bodies are parsed with zod; every
 * problem is reported with its JSON path as an `invalid_request` KvfenceError whose `param` is the
 * path, so a client sees exactly which field is wrong. The sampling controls of OpenAI, vLLM and
 * SGLang (penalties, logit_bias, min_p, min_tokens, ignore_eos, stop_token_ids, ...) become the
 * request's `LogitControls` and router-side options; the structured-output fields of every vendor
 * its `OutputConstraint` (output-constraint-fields.ts). Fields we know but do not implement (tools,
 * suffix, ...) are refused rather than silently ignored when they would
 * change the output, and so are the extensions of vLLM and SGLang that clients of those servers
 * send (`EXTENSIONS`). Other unknown fields are ignored, as
 * vLLM and SGLang do (OpenAI refuses them), so that clients adding new harmless fields keep working.
 */
import { z } from "zod";
import { KvfenceError } from "../lib/errors.js";
import type { LogitControls } from "../lib/logit-controls.js";
import { MAX_TOP_LOGPROBS } from "../lib/token-logprobs.js";
import type { OutputConstraint } from "../protocol/output-constraint.js";
import { requestConstraint } from "./output-constraint-fields.js";
import {
  chatTool,
  chatToolChoice,
  legacyFunctionCall,
  legacyFunctions,
  legacyMessage,
  legacyMessageCall,
  legacyToolRequest,
  messageToolCall,
  type ToolRequest,
  templateToolCalls,
  toolRequest,
  withToolConstraint,
} from "./tool-request.js";

const textPart = z.object({ type: z.literal("text"), text: z.string() });

const messageContent = z.union([z.string(), z.array(textPart)], {
  error:
    'expected a string or a list of text parts ({"type": "text", "text": "…"}); image, audio and file parts are not supported',
});

const chatMessage = z.object({
  role: z.enum(["system", "developer", "user", "assistant", "tool", "function"]),
  content: messageContent.nullable().optional(),
  name: z.string().optional(),
  /** An assistant's calls (tool-request.ts); its content may then be null. */
  tool_calls: z.array(messageToolCall).nullable().optional(),
  /** A tool message's answer to this call. */
  tool_call_id: z.string().optional(),
  /** An assistant's call in OpenAI's deprecated shape. */
  function_call: legacyMessageCall.nullable().optional(),
});

/**
 * Stop strings are matched on the router's event loop at every token, at a cost that grows with the
 * square of their length (the text that could still become one is held back): they are bounded.
 */
export const MAX_STOP_CHARS = 256;
const stopString = z
  .string()
  .max(MAX_STOP_CHARS, { error: `a stop string has at most ${MAX_STOP_CHARS} characters` });
const stop = z
  .union([stopString, z.array(stopString).max(4)])
  .nullable()
  .optional();

export const maxTokens = z.number().int().positive().nullable().optional();

const streamOptions = z
  .object({
    include_usage: z.boolean().nullable().optional(),
    /** vLLM's: every chunk carries the usage so far. */
    continuous_usage_stats: z.boolean().nullable().optional(),
  })
  .nullable()
  .optional();

/** `max_tokens` of a /v1/completions request that sends none (OpenAI's legacy default). */
export const COMPLETIONS_DEFAULT_MAX_TOKENS = 16;

/** The most choices (`n`) one request may ask for. */
export const MAX_N = 64;

export const samplingFields = {
  model: z.string().min(1),
  stream: z.boolean().nullable().optional(),
  stream_options: streamOptions,
  max_tokens: maxTokens,
  temperature: z.number().min(0).max(2).nullable().optional(),
  top_p: z.number().gt(0).max(1).nullable().optional(),
  /** Not in OpenAI's API; vLLM and SGLang accept it. 0 or -1 = off. */
  top_k: z.number().int().min(-1).nullable().optional(),
  seed: z.number().int().nullable().optional(),
  /** vLLM's field: narrows the prefix-cache namespace within the tenant (never widens it). */
  cache_salt: z.string().min(1).max(256).nullable().optional(),
  stop,
  n: z.number().int().min(1).max(MAX_N).nullable().optional(),
  user: z.string().optional(),
  frequency_penalty: z.number().min(-2).max(2).nullable().optional(),
  presence_penalty: z.number().min(-2).max(2).nullable().optional(),
  logit_bias: z
    .record(
      z.string().regex(/^\d{1,9}$/, { error: "a logit_bias key is a token id, as a decimal string" }),
      z.number().min(-100).max(100),
    )
    .nullable()
    .optional(),
  response_format: z.object({ type: z.string() }).nullable().optional(),
  // vLLM's and SGLang's sampling extensions.
  repetition_penalty: z.number().gt(0).max(1e6).nullable().optional(),
  min_p: z.number().min(0).max(1).nullable().optional(),
  min_tokens: z.number().int().min(0).nullable().optional(),
  ignore_eos: z.boolean().nullable().optional(),
  stop_token_ids: z.array(z.number().int().min(0)).max(64).nullable().optional(),
  skip_special_tokens: z.boolean().nullable().optional(),
  include_stop_str_in_output: z.boolean().nullable().optional(),
  /** SGLang's name for include_stop_str_in_output. */
  no_stop_trim: z.boolean().nullable().optional(),
  /** vLLM's: add the tokenizer's special tokens (BOS) to the prompt (completions: default true; chat: false). */
  add_special_tokens: z.boolean().nullable().optional(),
  /** vLLM's: the prompt's log-probabilities with this many top ones. */
  prompt_logprobs: z.number().int().min(0).max(MAX_TOP_LOGPROBS).nullable().optional(),
};

/** OpenAI's reasoning efforts. */
export const reasoningEffort = z
  .enum(["none", "minimal", "low", "medium", "high", "xhigh"])
  .nullable()
  .optional();

export const chatCompletionRequestSchema = z.object({
  ...samplingFields,
  messages: z.array(chatMessage).min(1),
  max_completion_tokens: maxTokens,
  logprobs: z.boolean().nullable().optional(),
  top_logprobs: z.number().int().min(0).max(MAX_TOP_LOGPROBS).nullable().optional(),
  tools: z.array(chatTool).nullable().optional(),
  tool_choice: chatToolChoice.nullable().optional(),
  parallel_tool_calls: z.boolean().nullable().optional(),
  functions: legacyFunctions.nullable().optional(),
  function_call: legacyFunctionCall.nullable().optional(),
  // vLLM's chat template controls.
  add_generation_prompt: z.boolean().nullable().optional(),
  continue_final_message: z.boolean().nullable().optional(),
  chat_template_kwargs: z.record(z.string(), z.unknown()).nullable().optional(),
  // OpenAI's: passed to the chat template (as vLLM does), refused when the template never reads it.
  reasoning_effort: reasoningEffort,
  // With --reasoning-parser (reasoning-parser.ts): vLLM's and SGLang's switches.
  include_reasoning: z.boolean().nullable().optional(),
  separate_reasoning: z.boolean().nullable().optional(),
  stream_reasoning: z.boolean().nullable().optional(),
});

/** A prompt given as token ids (checked against the vocabulary once the tokenizer is at hand). */
const tokenIds = z.array(z.number().int().min(0)).min(1);

export const completionRequestSchema = z.object({
  ...samplingFields,
  prompt: z.union(
    [z.string(), z.array(z.string()).min(1).max(MAX_N), tokenIds, z.array(tokenIds).min(1).max(MAX_N)],
    {
      error: `expected a string, a list of token ids, or a list of up to ${MAX_N} of either (one choice per prompt)`,
    },
  ),
  suffix: z.string().nullable().optional(),
  /** OpenAI allows 0 to 5; vLLM, as here, up to 20. */
  logprobs: z.number().int().min(0).max(MAX_TOP_LOGPROBS).nullable().optional(),
  echo: z.boolean().nullable().optional(),
  best_of: z.number().int().nullable().optional(),
});

export type ChatCompletionRequest = z.infer<typeof chatCompletionRequestSchema>;
export type CompletionRequest = z.infer<typeof completionRequestSchema>;

/** One chat message as the chat template sees it. */
export interface ChatMessage {
  readonly role: string;
  readonly content: string;
  /** An assistant's calls, their arguments a mapping when JSON (tool-request.ts `templateToolCalls`). */
  readonly tool_calls?: readonly object[];
  readonly tool_call_id?: string;
  readonly name?: string;
}

/** What the router needs from either endpoint once it is validated. */
export interface SamplingRequest {
  readonly model: string;
  readonly stream: boolean;
  readonly includeUsage: boolean;
  /** vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): every chunk carries the usage so far. */
  readonly continuousUsage: boolean;
  /** null = as many as fit in the context. */
  readonly maxTokens: number | null;
  readonly temperature: number | null;
  readonly topP: number | null;
  readonly topK: number | null;
  readonly seed: number | null;
  readonly stop: readonly string[];
  /** Choices to generate (`n`). */
  readonly n: number;
  /** Applied where the token is sampled; absent when every control is neutral. */
  readonly controls?: LogitControls | undefined;
  /** EOS does not end the request (`ignore_eos`). */
  readonly ignoreEos: boolean;
  /** The client's `stop_token_ids`: the router ends the request on one (after `min_tokens`). */
  readonly stopTokenIds: readonly number[];
  readonly minTokens: number;
  readonly skipSpecialTokens: boolean;
  /** The matched stop string (or stop token's text) stays in the output. */
  readonly includeStopStr: boolean;
  /** vLLM's `add_special_tokens`; null: the endpoint's default (completions yes, chat no). */
  readonly addSpecialTokens: boolean | null;
  /** Each output token's log-probability with this many top ones; null: none asked. */
  readonly logprobs: number | null;
  /** The prompt's log-probabilities with this many top ones (vLLM's `prompt_logprobs`, or echo's); null: none. */
  readonly promptLogprobs: number | null;
  /** vLLM's `prompt_logprobs` (rendered as vLLM does, beside echo's), or null. */
  readonly vllmPromptLogprobs: number | null;
  /**
   * Completions' `echo`: each prompt's text, which goes before its choices' completions (and their
   * logprobs); else null.
   */
  readonly echoPrompts: readonly string[] | null;
  /** The client's `cache_salt`, or null. */
  readonly cacheSalt: string | null;
  /** Chat's tools (tool-request.ts); absent or null: none. */
  readonly tools?: ToolRequest | null;
  /** What the output must match (structured output), absent when nothing constrains it. */
  readonly constraint?: OutputConstraint | undefined;
  /** The request field `constraint` came from (what a refusal to compile it names). */
  readonly constraintParam?: string | undefined;
}

export interface ParsedChatRequest extends SamplingRequest {
  readonly messages: readonly ChatMessage[];
  readonly template: ChatTemplateOptions;
  /** With a reasoning parser: vLLM's `include_reasoning` and SGLang's `separate_reasoning` (absent: both true). */
  readonly reasoningOutput?: ReasoningOutput;
}

/** What a request wants of the reasoning a parser splits out. */
export interface ReasoningOutput {
  /** SGLang's `separate_reasoning`: false leaves the reasoning in the content. */
  readonly separate: boolean;
  /** vLLM's `include_reasoning`: false drops the reasoning from the answer. */
  readonly include: boolean;
}

/** How the chat template renders a request's messages (vLLM's controls). */
export interface ChatTemplateOptions {
  readonly addGenerationPrompt: boolean;
  readonly continueFinalMessage: boolean;
  readonly kwargs: Readonly<Record<string, unknown>>;
  /** Add the tokenizer's special tokens (BOS) on top of the template's (vLLM's, default false). */
  readonly addSpecialTokens: boolean;
  /** The template's `tools` variable (OpenAI's chat tool objects); absent: none. */
  readonly tools?: readonly object[];
  /** Template variables the template must read, each with the request field that set it (else 400). */
  readonly mustRead?: Readonly<Record<string, string>>;
}

export interface ParsedCompletionRequest extends SamplingRequest {
  /** Each prompt's text, or its token ids (one or more prompts, each its `n` choices). */
  readonly prompts: readonly (string | readonly number[])[];
}

export function pathOf(path: readonly PropertyKey[]): string {
  let out = "";
  for (const part of path) {
    if (typeof part === "number") out += `[${part}]`;
    else out += out === "" ? String(part) : `.${String(part)}`;
  }
  return out === "" ? "body" : out;
}

/** A refusal names this many problems of a body at most. */
const MAX_ISSUES_SHOWN = 5;

export function parseWith<T>(schema: z.ZodType<T>, body: unknown): T {
  if (typeof body !== "object" || body === null || Array.isArray(body)) {
    throw new KvfenceError("invalid_request", `Request body must be a JSON object: got ${describe(body)}`);
  }
  const result = schema.safeParse(body);
  if (result.success) return result.data;
  const issues = result.error.issues;
  const first = issues[0]!;
  const shown = issues.slice(0, MAX_ISSUES_SHOWN).map((issue) => `${pathOf(issue.path)}: ${issue.message}`);
  if (issues.length > MAX_ISSUES_SHOWN) shown.push(`and ${issues.length - MAX_ISSUES_SHOWN} more`);
  const details = shown.join("; ");
  throw new KvfenceError("invalid_request", `Invalid request: ${details}`, { param: pathOf(first.path) });
}

/**
 * A short picture of a client's value for an error message: a primitive as JSON (cut to 40
 * characters), a container by its kind. Never serializes a container, whose nesting a client chooses.
 */
export function preview(value: unknown): string {
  if (value === null || typeof value !== "object") {
    const text = JSON.stringify(value) ?? String(value);
    return text.length > 40 ? `${text.slice(0, 40)}…` : text;
  }
  return describe(value);
}

function describe(value: unknown): string {
  if (value === null) return "null";
  if (Array.isArray(value)) return "an array";
  return typeof value === "object" ? "an object" : `a ${typeof value}`;
}

export function refuse(param: string, message: string): never {
  throw new KvfenceError("invalid_request", message, { param });
}

export const unset = (v: unknown): boolean => v == null;
export const equals =
  (neutral: unknown) =>
  (v: unknown): boolean =>
    v == null || v === neutral;
export const empty = (v: unknown): boolean => v == null || (Array.isArray(v) && v.length === 0);
export const emptyObject = (v: unknown): boolean =>
  v == null || (typeof v === "object" && !Array.isArray(v) && Object.keys(v).length === 0);

/**
 * Request fields of vLLM and SGLang that change the answer, with the values that do not: a request
 * with any other value is refused, where it would otherwise be served as if the field were absent.
 */
export const EXTENSIONS: Readonly<Record<string, (v: unknown) => boolean>> = {
  length_penalty: equals(1),
  use_beam_search: equals(false),
  bad_words: empty,
  truncate_prompt_tokens: unset,
  /** A per-request template: not taken from clients here (the operator's --chat-template is). */
  chat_template: unset,
  // vLLM's others.
  best_of: (v) => v == null || v === 1,
  allowed_token_ids: empty,
  spaces_between_special_tokens: equals(true),
  documents: empty,
  mm_processor_kwargs: emptyObject,
  structural_tag: unset,
  /** Every constraint is compiled by xgrammar here: other backends (and their options) are not served. */
  guided_decoding_backend: (v) => v == null || v === "" || v === "auto" || v === "xgrammar",
  /** xgrammar's JSON grammars take any whitespace between tokens: no pattern of the client's. */
  guided_whitespace_pattern: unset,
  logits_processors: empty,
  return_tokens_as_token_ids: equals(false),
  vllm_xargs: emptyObject,
  kv_transfer_params: emptyObject,
  prompt_embeds: unset,
  // SGLang's others.
  return_hidden_states: equals(false),
  return_routed_experts: equals(false),
  routed_experts_start_len: equals(0),
  return_cached_tokens_details: equals(false),
  return_prompt_token_ids: equals(false),
  return_token_ids: equals(false),
  return_meta_info: equals(false),
  task: unset,
  reasoning: unset,
  stop_regex: (v) => v == null || v === "" || (Array.isArray(v) && v.length === 0),
  lora_path: unset,
  session_id: unset,
  session_params: unset,
  max_dynamic_patch: unset,
  min_dynamic_patch: unset,
  use_audio_in_video: equals(false),
  images_config: unset,
  custom_logit_processor: unset,
  custom_params: unset,
  input_ids: unset,
  // OpenAI's newer fields that change the answer (no audio, predicted outputs, web search, reasoning).
  audio: unset,
  modalities: (v) => v == null || (Array.isArray(v) && v.length === 1 && v[0] === "text"),
  prediction: unset,
  web_search_options: unset,
  verbosity: unset,
};

/**
 * Fields that never change the answer, accepted and not used: bookkeeping (`user`, `metadata`,
 * `store`, request ids), routing and scheduling hints of other servers. Listed so that the field walk (request-fields.test.ts) and
 * docs/api.md know every field a client may send.
 */
export const NEUTRAL: Readonly<Record<string, string>> = {
  user: "an end-user id for the caller's own records",
  metadata: "the caller's tags, stored nowhere",
  store: "OpenAI's storage of completions: nothing is stored",
  service_tier: "OpenAI's billing tier",
  safety_identifier: "OpenAI's abuse-monitoring id",
  prompt_cache_key: "OpenAI's cache routing hint",
  priority: "a scheduling hint (fair sharing between tenants decides the order here)",
  request_id: "a request id (x-request-id is this server's)",
  rid: "a request id (x-request-id is this server's)",
  extra_key: "a caller's request class",
  cache_salt: "a prefix-cache salt: the cache here is fenced per tenant; the answer is the same",
  ngram_corpus_id: "a speculative-decoding corpus (none here)",
  bootstrap_host: "SGLang's disaggregation routing",
  bootstrap_port: "SGLang's disaggregation routing",
  bootstrap_room: "SGLang's disaggregation routing",
  routed_dp_rank: "SGLang's data-parallel routing",
  disagg_prefill_dp_rank: "SGLang's data-parallel routing",
  data_parallel_rank: "SGLang's data-parallel routing",
  custom_labels: "SGLang's metric labels",
};

function commonChecks(req: ChatCompletionRequest | CompletionRequest, body: object): void {
  for (const [name, neutral] of Object.entries(EXTENSIONS)) {
    const value = (body as Record<string, unknown>)[name];
    if (!neutral(value)) {
      refuse(
        name,
        `${name} (a vLLM/SGLang extension) is not supported: leave it unset; got ${preview(value)}`,
      );
    }
  }
  const maxTokens =
    "max_completion_tokens" in req ? (req.max_completion_tokens ?? req.max_tokens) : req.max_tokens;
  if (req.min_tokens != null && maxTokens != null && req.min_tokens > maxTokens) {
    refuse(
      "min_tokens",
      `min_tokens (${req.min_tokens}) is above max_tokens (${maxTokens}): lower min_tokens or raise max_tokens`,
    );
  }
  if (req.prompt_logprobs != null && req.stream === true) {
    refuse(
      "prompt_logprobs",
      "prompt_logprobs is not available when stream is true (as in vLLM): send stream false",
    );
  }
  if (req.stream_options != null && req.stream !== true) {
    refuse("stream_options", "stream_options is only allowed when stream is true: set stream to true");
  }
}

function stopList(stop: string | string[] | null | undefined): string[] {
  const list = stop == null ? [] : typeof stop === "string" ? [stop] : stop;
  return list.filter((s) => s !== "");
}

/** The request's logit controls, or undefined when every one is neutral. */
function logitControls(req: ChatCompletionRequest | CompletionRequest): LogitControls | undefined {
  const bias = Object.entries(req.logit_bias ?? {})
    .map(([id, b]) => [Number(id), b] as const)
    .filter(([, b]) => b !== 0);
  const controls: LogitControls = {
    ...(bias.length > 0 ? { logitBias: bias } : {}),
    ...(req.min_tokens ? { minTokens: req.min_tokens, stopTokenIds: req.stop_token_ids ?? [] } : {}),
    ...(req.repetition_penalty != null && req.repetition_penalty !== 1
      ? { repetitionPenalty: req.repetition_penalty }
      : {}),
    ...(req.frequency_penalty ? { frequencyPenalty: req.frequency_penalty } : {}),
    ...(req.presence_penalty ? { presencePenalty: req.presence_penalty } : {}),
    ...(req.min_p ? { minP: req.min_p } : {}),
  };
  return Object.keys(controls).length === 0 ? undefined : controls;
}

function sampling(req: ChatCompletionRequest | CompletionRequest, maxTokens: number | null): SamplingRequest {
  const controls = logitControls(req);
  return {
    ...(controls === undefined ? {} : { controls }),
    n: req.n ?? 1,
    ignoreEos: req.ignore_eos === true,
    stopTokenIds: req.stop_token_ids ?? [],
    minTokens: req.min_tokens ?? 0,
    skipSpecialTokens: req.skip_special_tokens !== false,
    includeStopStr: req.include_stop_str_in_output === true || req.no_stop_trim === true,
    addSpecialTokens: req.add_special_tokens ?? null,
    logprobs: null,
    promptLogprobs: req.prompt_logprobs ?? null,
    vllmPromptLogprobs: req.prompt_logprobs ?? null,
    echoPrompts: null,
    model: req.model,
    stream: req.stream === true,
    includeUsage: req.stream_options?.include_usage === true,
    // vLLM: only with include_usage.
    continuousUsage:
      req.stream_options?.include_usage === true && req.stream_options.continuous_usage_stats === true,
    maxTokens,
    temperature: req.temperature ?? null,
    topP: req.top_p ?? null,
    topK: req.top_k ?? null,
    seed: req.seed ?? null,
    stop: stopList(req.stop),
    cacheSalt: req.cache_salt ?? null,
  };
}

/** Validate a `/v1/chat/completions` body; throws `invalid_request` naming the offending field. */
export function parseChatRequest(body: unknown): ParsedChatRequest {
  const req = parseWith(chatCompletionRequestSchema, body);
  commonChecks(req, body as object);
  if (req.top_logprobs != null && req.top_logprobs > 0 && req.logprobs !== true)
    refuse("top_logprobs", "top_logprobs needs logprobs: set logprobs to true, or leave top_logprobs unset");
  const tools =
    legacyToolRequest(req.functions, req.function_call, (req.tools?.length ?? 0) > 0) ??
    toolRequest(req.tools, req.tool_choice, req.parallel_tool_calls);
  if (
    req.max_tokens != null &&
    req.max_completion_tokens != null &&
    req.max_tokens !== req.max_completion_tokens
  ) {
    refuse(
      "max_completion_tokens",
      `max_tokens and max_completion_tokens disagree: ${req.max_tokens} vs ${req.max_completion_tokens}; send only one`,
    );
  }
  const messages = req.messages.map(legacyMessage).map(
    (m): ChatMessage => ({
      role: m.role === "developer" ? "system" : m.role,
      content:
        m.content == null
          ? ""
          : typeof m.content === "string"
            ? m.content
            : m.content.map((p) => p.text).join(""),
      ...(m.tool_calls == null ? {} : { tool_calls: templateToolCalls(m.tool_calls) }),
      ...(m.tool_call_id === undefined ? {} : { tool_call_id: m.tool_call_id }),
      ...(m.name === undefined ? {} : { name: m.name }),
    }),
  );
  // vLLM's chat echo (the reply prefixed with the last message of its role) is not served.
  const echo = (body as { echo?: unknown }).echo;
  if (echo != null && echo !== false)
    refuse("echo", "echo on chat (vLLM's) is not supported: leave it unset or false");
  const continueFinalMessage = req.continue_final_message === true;
  if (continueFinalMessage && req.add_generation_prompt === true) {
    refuse(
      "continue_final_message",
      "continue_final_message and add_generation_prompt cannot both be true (as in vLLM): set add_generation_prompt to false",
    );
  }
  // tool_choice required or a named function: the calls' JSON array (tool-request.ts).
  const constrained = withToolConstraint(requestConstraint(body as Record<string, unknown>), tools);
  return {
    ...sampling(req, req.max_completion_tokens ?? req.max_tokens ?? null),
    ...constrained,
    logprobs: req.logprobs === true ? (req.top_logprobs ?? 0) : null,
    messages,
    tools,
    ...reasoningOutput(req),
    template: {
      addGenerationPrompt: req.add_generation_prompt !== false,
      continueFinalMessage,
      addSpecialTokens: req.add_special_tokens === true,
      ...(tools === null ? {} : { tools: tools.tools }),
      ...templateKwargs(req),
    },
  };
}

/** The template's variables: `chat_template_kwargs` over `reasoning_effort`, which the template must read. */
function templateKwargs(req: ChatCompletionRequest): Pick<ChatTemplateOptions, "kwargs" | "mustRead"> {
  const kwargs = req.chat_template_kwargs ?? {};
  if (req.reasoning_effort == null) return { kwargs };
  return {
    kwargs: { reasoning_effort: req.reasoning_effort, ...kwargs },
    mustRead: { reasoning_effort: "reasoning_effort" },
  };
}

/** What a chat request wants of the reasoning (--reasoning-parser); `stream_reasoning: false` is refused. */
function reasoningOutput(req: ChatCompletionRequest): { reasoningOutput?: ReasoningOutput } {
  if (req.stream_reasoning === false)
    refuse(
      "stream_reasoning",
      "stream_reasoning false is not supported: reasoning streams as it is generated; leave it unset or true",
    );
  const separate = req.separate_reasoning !== false;
  const include = req.include_reasoning !== false;
  return separate && include ? {} : { reasoningOutput: { separate, include } };
}

/** Validate a `/v1/completions` body; throws `invalid_request` naming the offending field. */
export function parseCompletionRequest(body: unknown): ParsedCompletionRequest {
  const req = parseWith(completionRequestSchema, body);
  commonChecks(req, body as object);

  if (req.best_of != null && req.best_of !== 1)
    refuse("best_of", `Only best_of=1 is supported: got ${req.best_of}`);
  if (req.suffix) refuse("suffix", "suffix (insertion) is not supported: leave it unset or empty");
  const p = req.prompt;
  const prompts: (string | readonly number[])[] =
    typeof p === "string" || typeof p[0] === "number"
      ? [p as string | number[]]
      : (p as (string | number[])[]);
  if (prompts.length * (req.n ?? 1) > MAX_N) {
    refuse(
      "n",
      `${prompts.length} prompts × n=${req.n ?? 1} choices is over ${MAX_N}: send fewer prompts or a smaller n`,
    );
  }
  // As OpenAI's legacy endpoint: 16 tokens unless max_tokens says otherwise.
  const base = sampling(req, req.max_tokens ?? COMPLETIONS_DEFAULT_MAX_TOKENS);
  const echo = req.echo === true;
  const logprobs = req.logprobs ?? null;
  return {
    ...base,
    ...requestConstraint(body as Record<string, unknown>),
    logprobs,
    // Token-id prompts: their text comes from the tokenizer (prepare-request.ts).
    echoPrompts: echo ? prompts.map((q) => (typeof q === "string" ? q : "")) : null,
    // Echo with logprobs reports the prompt's tokens too; vLLM's prompt_logprobs asks for its own k.
    promptLogprobs:
      echo && logprobs !== null ? Math.max(logprobs, base.promptLogprobs ?? 0) : base.promptLogprobs,
    prompts,
  };
}
