/**
 * OpenAI's Responses API (`/v1/responses`) request: its schema and its parser, which reads the
 * input items as chat messages and runs the chat parser (openai-schemas.ts), so the endpoint shares
 * chat's template, sampling and admission; what it does not serve is refused by name.
 */
import { z } from "zod";
import { KvfenceError } from "../lib/errors.js";
import { MAX_TOP_LOGPROBS } from "../lib/token-logprobs.js";
import {
  type ChatTemplateOptions,
  empty,
  equals,
  maxTokens,
  NEUTRAL,
  type ParsedChatRequest,
  parseChatRequest,
  parseWith,
  pathOf,
  preview,
  reasoningEffort,
  refuse,
  samplingFields,
  unset,
} from "./openai-schemas.js";
import { responsesConstraint } from "./output-constraint-fields.js";
import {
  functionCallItem,
  functionCallOutputItem,
  responsesTool,
  responsesToolChoice,
  responsesToolFields,
  withToolConstraint,
} from "./tool-request.js";

/** A text part of a Responses input message: the user's (`input_text`) or an earlier answer's (`output_text`). */
const responsesTextPart = z.object({
  type: z.enum(["input_text", "output_text"], {
    error:
      'expected a text part ({"type": "input_text", "text": "…"}); image, audio and file parts are not supported',
  }),
  text: z.string(),
});

/** A message item of a Responses `input` (`type: "message"` or no type, as OpenAI's easy input). */
const responsesMessage = z.object({
  type: z
    .literal("message", {
      error:
        'expected a message item ({"role": …, "content": …}), a function_call or a function_call_output: no reasoning items or item references',
    })
    .optional(),
  role: z.enum(["user", "assistant", "system", "developer"]),
  content: z.union([z.string(), z.array(responsesTextPart)], {
    error: 'expected a string or a list of text parts ({"type": "input_text", "text": "…"})',
  }),
});

/**
 * OpenAI's Responses API (`/v1/responses`) for text in and text out: the same sampling path as chat
 * (its template, its admission), one answer. Fields that would change the answer and are not
 * served — tools, stored state (`store`, `previous_response_id`, `conversation`, `background`),
 * reasoning, log-probabilities, truncation — are refused (`responsesRefusals`).
 */
export const responsesRequestSchema = z.object({
  model: z.string().min(1),
  // Items are checked one by one (`inputItems`), so that an error names the item's own field.
  input: z.union([z.string(), z.array(z.unknown()).min(1)], {
    error: "expected a string or a list of message items",
  }),
  instructions: z.string().nullable().optional(),
  max_output_tokens: maxTokens,
  temperature: samplingFields.temperature,
  top_p: samplingFields.top_p,
  stream: samplingFields.stream,
  stream_options: z.object({ include_obfuscation: z.boolean().nullable().optional() }).nullable().optional(),
  // `effort` goes to the chat template (as chat's reasoning_effort); summaries are not made.
  reasoning: z
    .object({
      effort: reasoningEffort,
      summary: z.null().optional(),
      generate_summary: z.null().optional(),
    })
    .nullable()
    .optional(),
  text: z
    .object({
      format: z.object({ type: z.string() }).nullable().optional(),
      verbosity: z.string().nullable().optional(),
    })
    .nullable()
    .optional(),
  tools: z.array(responsesTool).nullable().optional(),
  tool_choice: responsesToolChoice.nullable().optional(),
  parallel_tool_calls: z.boolean().nullable().optional(),
  top_logprobs: z.number().int().min(0).max(MAX_TOP_LOGPROBS).nullable().optional(),
});

export type ResponsesRequest = z.infer<typeof responsesRequestSchema>;

/** The fields of a Responses request the response object repeats (OpenAI's echo of the request). */
export interface ResponsesEcho {
  readonly instructions: string | null;
  readonly maxOutputTokens: number | null;
  readonly metadata: Readonly<Record<string, unknown>>;
  readonly user: string | null;
  /** Every streamed delta carries an `obfuscation` field (OpenAI's default; `stream_options.include_obfuscation: false` turns it off). */
  readonly obfuscate: boolean;
  /** The function tools, tool_choice and parallel_tool_calls in effect (absent: no tools). */
  readonly tools?: {
    readonly tools: readonly object[];
    readonly choice: unknown;
    readonly parallel: boolean;
  };
  /** `reasoning.effort`, repeated in the answer's `reasoning`. */
  readonly reasoningEffort?: string | null;
}

export interface ParsedResponsesRequest extends ParsedChatRequest {
  readonly responses: ResponsesEcho;
}

/**
 * Responses fields that never change the answer here, accepted and not used (the field walk of
 * request-fields.test.ts reads it). `store` is not one of them: OpenAI stores a response by default
 * and serves it later (`GET /v1/responses/{id}`, `previous_response_id`); nothing is stored here, so
 * `store: true` is refused rather than answered as if it were kept.
 */
export const RESPONSES_NEUTRAL: Readonly<Record<string, string>> = {
  user: NEUTRAL.user!,
  metadata: NEUTRAL.metadata!,
  service_tier: NEUTRAL.service_tier!,
  safety_identifier: NEUTRAL.safety_identifier!,
  prompt_cache_key: NEUTRAL.prompt_cache_key!,
  prompt_cache_retention: "OpenAI's cache lifetime hint",
  prompt_cache_options: "OpenAI's cache breakpoints and lifetime",
};

/**
 * Responses fields that change the answer and are not served, with the values that do not and
 * what to send instead: refused with a 400 naming the field.
 */
const RESPONSES_REFUSED: Readonly<Record<string, { neutral: (v: unknown) => boolean; fix: string }>> = {
  store: {
    neutral: equals(false),
    fix: "nothing is stored on this server (no GET /v1/responses/{id}): send store false or leave it unset",
  },
  previous_response_id: {
    neutral: unset,
    fix: "responses are not stored: send the whole conversation in input instead",
  },
  conversation: { neutral: unset, fix: "conversations are not stored: send the whole conversation in input" },
  background: {
    neutral: equals(false),
    fix: "background responses are not supported: leave it unset or false",
  },
  prompt: { neutral: unset, fix: "stored prompt templates are not supported: send the text in input" },
  include: { neutral: empty, fix: "no additional output data is served: leave it unset or []" },
  truncation: {
    neutral: equals("disabled"),
    fix: 'the input is never truncated (a too long one gets 400): leave it unset or "disabled"',
  },
  context_management: { neutral: empty, fix: "context compaction is not supported: leave it unset" },
  moderation: { neutral: unset, fix: "moderation is not run here: leave it unset" },
};

/** One item of a Responses `input`, validated with `schema`; an error names `input[i].…`. */
function inputItem<T>(schema: z.ZodType<T>, item: unknown, i: number): T {
  const result = schema.safeParse(item);
  if (result.success) return result.data;
  const issue = result.error.issues[0]!;
  const param = pathOf(["input", i, ...issue.path]);
  throw new KvfenceError("invalid_request", `Invalid request: ${param}: ${issue.message}`, { param });
}

/** The items of a Responses `input` as chat messages: function calls join the assistant's message, their outputs are tool messages. */
function inputMessages(items: readonly unknown[]): Record<string, unknown>[] {
  const messages: Record<string, unknown>[] = [];
  items.forEach((item, i) => {
    const type = (item as { type?: unknown } | null)?.type;
    if (type === "function_call") {
      const call = inputItem(functionCallItem, item, i);
      const wire = {
        id: call.call_id,
        type: "function",
        function: { name: call.name, arguments: call.arguments },
      };
      const last = messages.at(-1);
      if (last?.role === "assistant")
        last.tool_calls = [...((last.tool_calls as object[] | undefined) ?? []), wire];
      else messages.push({ role: "assistant", content: null, tool_calls: [wire] });
    } else if (type === "function_call_output") {
      const output = inputItem(functionCallOutputItem, item, i);
      messages.push({ role: "tool", tool_call_id: output.call_id, content: output.output });
    } else {
      const m = inputItem(responsesMessage, item, i);
      messages.push({
        role: m.role === "developer" ? "system" : m.role,
        content: typeof m.content === "string" ? m.content : m.content.map((p) => p.text).join(""),
      });
    }
  });
  return messages;
}

/** A Responses request's `reasoning.effort`, or null. */
function effortOf(req: ResponsesRequest): string | null {
  return req.reasoning?.effort ?? null;
}

/** A Responses request's template options: its `reasoning.effort` named as such in a refusal. */
function effortAsResponses(template: ChatTemplateOptions): ChatTemplateOptions {
  if (template.mustRead === undefined) return template;
  return { ...template, mustRead: { reasoning_effort: "reasoning.effort" } };
}

/** Validate a `/v1/responses` body into a chat request (the same template); throws `invalid_request` naming the field. */
export function parseResponsesRequest(body: unknown): ParsedResponsesRequest {
  const req = parseWith(responsesRequestSchema, body);
  const raw = body as Record<string, unknown>;
  for (const [name, { neutral, fix }] of Object.entries(RESPONSES_REFUSED)) {
    if (!neutral(raw[name]))
      refuse(name, `${name} is not supported on /v1/responses: ${fix}; got ${preview(raw[name])}`);
  }
  const format = responsesConstraint(raw);
  if (req.text?.verbosity != null)
    refuse("text.verbosity", "text.verbosity is not supported: leave it unset");
  if (req.top_logprobs != null && req.top_logprobs > 0)
    refuse(
      "top_logprobs",
      "top_logprobs is not served on /v1/responses (it is on /v1/chat/completions): leave it unset or 0",
    );
  if (req.stream_options != null && req.stream !== true)
    refuse("stream_options", "stream_options is only allowed when stream is true: set stream to true");
  const input =
    typeof req.input === "string" ? [{ role: "user", content: req.input }] : inputMessages(req.input);
  const instructions = req.instructions ?? null;
  const messages = instructions === null ? input : [{ role: "system", content: instructions }, ...input];
  const maxTokens = req.max_output_tokens ?? null;
  const effort = effortOf(req);
  const chat = parseChatRequest({
    model: req.model,
    messages,
    stream: req.stream ?? null,
    max_tokens: maxTokens,
    temperature: req.temperature ?? null,
    top_p: req.top_p ?? null,
    ...responsesToolFields(req),
    reasoning_effort: effort,
  });
  const constrained = withToolConstraint(format, chat.tools ?? null);
  return {
    ...chat,
    ...constrained,
    template: effortAsResponses(chat.template),
    responses: {
      instructions,
      maxOutputTokens: maxTokens,
      metadata:
        typeof raw.metadata === "object" && raw.metadata !== null
          ? (raw.metadata as Record<string, unknown>)
          : {},
      user: typeof raw.user === "string" ? raw.user : null,
      obfuscate: req.stream === true && req.stream_options?.include_obfuscation !== false,
      ...(chat.tools == null
        ? {}
        : {
            tools: {
              tools: req.tools ?? [],
              choice: req.tool_choice ?? "auto",
              parallel: chat.tools.parallel,
            },
          }),
      reasoningEffort: effort,
    },
  };
}
