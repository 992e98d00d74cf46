/**
 * Request validation for the OpenAI-compatible endpoints. Bodies are parsed with zod; every
 * problem is reported with its JSON path as an `invalid_request` KvfenceError whose `param` is the
 * path, so a client sees exactly which field is wrong. Fields we know but do not implement
 * (logprobs, tools, penalties, logit_bias, JSON response formats, suffix) are refused rather than
 * silently ignored when they would change the output, and so are the sampling extensions of vLLM
 * and SGLang that clients of those servers send (`EXTENSIONS`). Other unknown fields are ignored, as
 * vLLM and SGLang do (OpenAI refuses them), so that clients adding new harmless fields keep working.
 */
import { z } from "zod";
import { KvfenceError } from "../lib/errors.js";

const textPart = z.object({ type: z.literal("text"), text: z.string() });

const messageContent = z.union([z.string(), z.array(textPart)], {
  error:
    'expected a string or a list of text parts ({"type": "text", "text": "…"}); image, audio and file parts are not supported',
});

const chatMessage = z.object({
  role: z.enum(["system", "developer", "user", "assistant", "tool"]),
  content: messageContent.nullable().optional(),
  name: z.string().optional(),
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

const maxTokens = z.number().int().positive().nullable().optional();

const streamOptions = z.object({ include_usage: z.boolean().optional() }).nullable().optional();

const samplingFields = {
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
  n: z.number().int().nullable().optional(),
  user: z.string().optional(),
  frequency_penalty: z.number().nullable().optional(),
  presence_penalty: z.number().nullable().optional(),
  logit_bias: z.record(z.string(), z.number()).nullable().optional(),
  response_format: z.object({ type: z.string() }).nullable().optional(),
};

export const chatCompletionRequestSchema = z.object({
  ...samplingFields,
  messages: z.array(chatMessage).min(1),
  max_completion_tokens: maxTokens,
  logprobs: z.boolean().nullable().optional(),
  top_logprobs: z.number().int().nullable().optional(),
  tools: z.array(z.unknown()).nullable().optional(),
  tool_choice: z.unknown().optional(),
  functions: z.array(z.unknown()).nullable().optional(),
  function_call: z.unknown().optional(),
});

export const completionRequestSchema = z.object({
  ...samplingFields,
  prompt: z.union([z.string(), z.array(z.string()).length(1)], {
    error:
      "expected a string or a list of one string; lists of several prompts and token-id prompts are not supported (send one request per prompt, as text)",
  }),
  suffix: z.string().nullable().optional(),
  logprobs: z.number().int().nullable().optional(),
  echo: z.boolean().nullable().optional(),
  best_of: z.number().int().nullable().optional(),
});

export type ChatCompletionRequest = z.infer<typeof chatCompletionRequestSchema>;
export type CompletionRequest = z.infer<typeof completionRequestSchema>;

/** One chat message as the chat template sees it. */
export interface ChatMessage {
  readonly role: string;
  readonly content: string;
}

/** What the router needs from either endpoint once it is validated. */
export interface SamplingRequest {
  readonly model: string;
  readonly stream: boolean;
  readonly includeUsage: boolean;
  /** null = as many as fit in the context. */
  readonly maxTokens: number | null;
  readonly temperature: number | null;
  readonly topP: number | null;
  readonly topK: number | null;
  readonly seed: number | null;
  readonly stop: readonly string[];
  /** The client's `cache_salt`, or null. */
  readonly cacheSalt: string | null;
}

export interface ParsedChatRequest extends SamplingRequest {
  readonly messages: readonly ChatMessage[];
}

export interface ParsedCompletionRequest extends SamplingRequest {
  readonly prompt: string;
}

function pathOf(path: readonly PropertyKey[]): string {
  let out = "";
  for (const part of path) {
    if (typeof part === "number") out += `[${part}]`;
    else out += out === "" ? String(part) : `.${String(part)}`;
  }
  return out === "" ? "body" : out;
}

/** A refusal names this many problems of a body at most. */
const MAX_ISSUES_SHOWN = 5;

function parseWith<T>(schema: z.ZodType<T>, body: unknown): T {
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
function preview(value: unknown): string {
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

function refuse(param: string, message: string): never {
  throw new KvfenceError("invalid_request", message, { param });
}

const unset = (v: unknown): boolean => v == null;
const equals =
  (neutral: unknown) =>
  (v: unknown): boolean =>
    v == null || v === neutral;
const empty = (v: unknown): boolean => v == null || (Array.isArray(v) && v.length === 0);

/**
 * Request fields of vLLM and SGLang that change the answer, with the values that do not: a request
 * with any other value is refused, where it would otherwise be served as if the field were absent.
 */
export const EXTENSIONS: Readonly<Record<string, (v: unknown) => boolean>> = {
  repetition_penalty: equals(1),
  length_penalty: equals(1),
  min_p: equals(0),
  min_tokens: equals(0),
  ignore_eos: equals(false),
  use_beam_search: equals(false),
  include_stop_str_in_output: equals(false),
  skip_special_tokens: equals(true),
  stop_token_ids: empty,
  bad_words: empty,
  guided_json: unset,
  guided_regex: unset,
  guided_choice: unset,
  guided_grammar: unset,
  structured_outputs: unset,
  regex: unset,
  json_schema: unset,
  ebnf: unset,
  truncate_prompt_tokens: unset,
  prompt_logprobs: unset,
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
  if (req.n !== undefined && req.n !== null && req.n !== 1) {
    refuse("n", `Only n=1 is supported: got n=${req.n}; send separate requests instead`);
  }
  if (req.frequency_penalty) refuse("frequency_penalty", "frequency_penalty is not supported: leave it at 0");
  if (req.presence_penalty) refuse("presence_penalty", "presence_penalty is not supported: leave it at 0");
  if (req.logit_bias != null && Object.keys(req.logit_bias).length > 0) {
    refuse("logit_bias", "logit_bias is not supported: leave it unset or empty");
  }
  if (req.response_format != null && req.response_format.type !== "text") {
    refuse(
      "response_format",
      `response_format ${preview(req.response_format.type)} is not supported (this server has no constrained decoding): leave it unset or {"type": "text"}`,
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

function sampling(req: ChatCompletionRequest | CompletionRequest, maxTokens: number | null): SamplingRequest {
  return {
    model: req.model,
    stream: req.stream === true,
    includeUsage: req.stream_options?.include_usage === true,
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
  if (req.logprobs === true) refuse("logprobs", "logprobs is not supported: leave it unset or false");
  if (req.top_logprobs != null && req.top_logprobs !== 0)
    refuse("top_logprobs", "top_logprobs is not supported: leave it unset or 0");
  // The chat templates here do not render tool definitions and nothing parses a tool call out of
  // the answer, so tools would be dropped without a word: refused, even with tool_choice "none".
  if ((req.tools?.length ?? 0) > 0 || (req.functions?.length ?? 0) > 0) {
    refuse(
      req.tools?.length ? "tools" : "functions",
      "tools (function calling) are not supported: leave tools and functions unset",
    );
  }
  if (req.tool_choice != null && req.tool_choice !== "none") {
    refuse("tool_choice", 'tool_choice is not supported: leave it unset or "none"');
  }
  if (req.function_call != null && req.function_call !== "none") {
    refuse("function_call", 'function_call is not supported: leave it unset or "none"');
  }
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
  const messages = req.messages.map((m) => ({
    role: m.role === "developer" ? "system" : m.role,
    content:
      m.content == null
        ? ""
        : typeof m.content === "string"
          ? m.content
          : m.content.map((p) => p.text).join(""),
  }));
  return { ...sampling(req, req.max_completion_tokens ?? req.max_tokens ?? null), messages };
}

/** Validate a `/v1/completions` body; throws `invalid_request` naming the offending field. */
export function parseCompletionRequest(body: unknown): ParsedCompletionRequest {
  const req = parseWith(completionRequestSchema, body);
  commonChecks(req, body as object);
  if (req.logprobs != null) refuse("logprobs", "logprobs is not supported: leave it unset");
  if (req.echo === true) refuse("echo", "echo is not supported: leave it unset or false");
  if (req.best_of != null && req.best_of !== 1)
    refuse("best_of", `Only best_of=1 is supported: got ${req.best_of}`);
  if (req.suffix) refuse("suffix", "suffix (insertion) is not supported: leave it unset or empty");
  const prompt = typeof req.prompt === "string" ? req.prompt : req.prompt[0]!;
  return { ...sampling(req, req.max_tokens ?? null), prompt };
}
