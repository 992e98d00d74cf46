/**
 * A generation request's body → its validated sampling fields and its prompt tokens, in one pure
 * function (`prepareRequest`) that runs in the router's preparation workers (prepare-pool.ts), so
 * that parsing, the chat template and tokenization never hold the router's event loop.
 *
 * The order is the cheapest check first, each before the work it bounds (request-limits.ts): the
 * nesting depth on the raw bytes, strict UTF-8, `JSON.parse`, the number of messages, validation
 * (openai-schemas.ts), the model, the prompt's bytes, then the chat template and the tokenizer.
 * Every refusal is a KvfenceError; the context-length check stays with admission at the router.
 *
 * `PROMPT_KINDS` holds what differs between the two endpoints (how a body becomes a prompt), so
 * nothing here or in the router branches on the endpoint.
 */

import { z } from "zod";
import { KvfenceError } from "../lib/errors.js";
import {
  type ChatMessage,
  type ChatTemplateOptions,
  parseChatRequest,
  parseCompletionRequest,
  type SamplingRequest,
} from "./openai-schemas.js";
import { parseJsonBody } from "./read-body.js";
import { checkJsonDepth, checkMessageCount, checkPromptBytes, type RequestLimits } from "./request-limits.js";
import {
  checkModel,
  type GenerateEndpointName,
  PROMPT_PARAM,
  type UtilityEndpointName,
} from "./request-names.js";
import { parseResponsesRequest } from "./responses-request.js";
import { resolveToolParsing, type TemplateToolSupport } from "./tool-request.js";

/** The tokenizer work a prompt needs: no model weights, ever. */
export interface PromptTokenizer {
  /** Prompt ids of a chat (template rendered with the generation prompt by default); throws `invalid_request`. */
  encodeChat(messages: readonly ChatMessage[], options?: ChatTemplateOptions): Int32Array;
  /** Prompt ids of a raw completion prompt (with the tokenizer's own special tokens, e.g. BOS, unless `addSpecialTokens` is false). */
  encodePrompt(text: string, addSpecialTokens?: boolean): Int32Array;
  /** One more than the largest token id: token ids a request names must be below it. */
  readonly vocabSize: number;
  /** The text of `ids` (special tokens skipped). */
  decode(ids: ArrayLike<number>): string;
  /** Whether the chat template renders tools, and the tool-call format to parse; absent: none. */
  readonly toolSupport?: TemplateToolSupport;
}

export type { GenerateEndpointName, UtilityEndpointName } from "./request-names.js";

/** A generation request ready for admission: its prompts (a chat has one), each its `n` choices. */
export interface PreparedRequest {
  readonly parsed: SamplingRequest;
  readonly prompts: readonly Int32Array[];
}

/** What the preparation of a body needs besides the body. */
export interface PrepareContext {
  /** The served model's name (or names): any other `model` is refused before tokenization. */
  readonly modelId: string | readonly string[];
  readonly tokenizer: PromptTokenizer;
  readonly limits: RequestLimits;
}

interface PromptKind {
  /** The request field a prompt error names. */
  readonly param: "messages" | "prompt" | "input";
  /** The error message for a prompt of no tokens. */
  readonly emptyPrompt: string;
  /** Checks on the parsed JSON before it is validated. */
  precheck(body: unknown, limits: RequestLimits): void;
  /** Validates a parsed body; `promptBytes` and `encode` measure and tokenize its prompt. */
  parse(body: unknown): {
    readonly parsed: SamplingRequest;
    promptBytes(): number;
    /** Each prompt's ids (a chat has one). */
    encode(tokenizer: PromptTokenizer): Int32Array[];
    /** Echo's text of each prompt (token ids: from the tokenizer); absent: no echo. */
    echoTexts?(tokenizer: PromptTokenizer, tokens: readonly Int32Array[]): string[];
  };
}

export const PROMPT_KINDS: Readonly<Record<GenerateEndpointName, PromptKind>> = {
  chat: {
    param: PROMPT_PARAM.chat,
    emptyPrompt: "The chat template rendered the messages as no tokens: send a message with content",
    precheck: (body, limits) => checkMessageCount(body, limits.maxMessages),
    parse(body) {
      const parsed = parseChatRequest(body);
      return {
        parsed,
        promptBytes: () => parsed.messages.reduce((sum, m) => sum + Buffer.byteLength(m.content), 0),
        encode: (tokenizer) => [tokenizer.encodeChat(parsed.messages, parsed.template)],
      };
    },
  },
  // The same chat template as chat: its input items (and instructions) are the messages.
  responses: {
    param: PROMPT_PARAM.responses,
    emptyPrompt: "The chat template rendered the input as no tokens: send an input with text",
    precheck: (body, limits) => {
      checkMessageCount(body, limits.maxMessages, "input");
    },
    parse(body) {
      const parsed = parseResponsesRequest(body);
      return {
        parsed,
        promptBytes: () => parsed.messages.reduce((sum, m) => sum + Buffer.byteLength(m.content), 0),
        encode: (tokenizer) => [tokenizer.encodeChat(parsed.messages, parsed.template)],
      };
    },
  },
  completions: {
    param: PROMPT_PARAM.completions,
    emptyPrompt: "The prompt is empty: send at least one character",
    precheck: () => {},
    parse(body) {
      const parsed = parseCompletionRequest(body);
      const { prompts } = parsed;
      return {
        parsed,
        promptBytes: () =>
          prompts.reduce((sum: number, q) => sum + (typeof q === "string" ? Buffer.byteLength(q) : 0), 0),
        encode: (tokenizer) =>
          prompts.map((q, i) =>
            typeof q === "string"
              ? tokenizer.encodePrompt(q, parsed.addSpecialTokens !== false)
              : checkedIds(q, i, prompts.length, tokenizer),
          ),
        echoTexts: (tokenizer, tokens) =>
          prompts.map((q, i) => (typeof q === "string" ? q : tokenizer.decode(tokens[i]!))),
      };
    },
  },
};

/** A token-id prompt, each id inside the vocabulary (else `invalid_request` naming its place). */
function checkedIds(
  ids: readonly number[],
  index: number,
  count: number,
  tokenizer: PromptTokenizer,
): Int32Array {
  const bad = ids.findIndex((id) => id >= tokenizer.vocabSize);
  if (bad >= 0) {
    const where = count === 1 ? `prompt[${bad}]` : `prompt[${index}][${bad}]`;
    throw new KvfenceError(
      "invalid_request",
      `${where} is token id ${ids[bad]}, outside this model's vocabulary of ${tokenizer.vocabSize} ids (0 to ${tokenizer.vocabSize - 1})`,
      { param: "prompt" },
    );
  }
  return Int32Array.from(ids);
}

/** Refuses token ids (logit_bias, stop_token_ids) outside the vocabulary, naming the field. */
function checkTokenIds(parsed: SamplingRequest, vocabSize: number): void {
  const outside = (ids: readonly number[], param: string) => {
    const bad = ids.find((id) => id >= vocabSize);
    if (bad !== undefined) {
      throw new KvfenceError(
        "invalid_request",
        `${param} names token id ${bad}, outside this model's vocabulary of ${vocabSize} ids (0 to ${vocabSize - 1})`,
        { param },
      );
    }
  };
  outside(parsed.controls?.logitBias?.map(([id]) => id) ?? [], "logit_bias");
  outside(parsed.stopTokenIds, "stop_token_ids");
}

/** A generation endpoint's raw body → its sampling fields and prompt tokens; throws KvfenceError. */
export function prepareRequest(
  endpoint: GenerateEndpointName,
  body: Uint8Array,
  context: PrepareContext,
): PreparedRequest {
  const kind = PROMPT_KINDS[endpoint];
  checkJsonDepth(body, context.limits.maxJsonDepth);
  const json = parseJsonBody(body);
  kind.precheck(json, context.limits);
  const { parsed: validated, promptBytes, encode, echoTexts } = kind.parse(json);
  checkModel(validated.model, context.modelId);
  const parsed = withToolParsing(validated, context.tokenizer);
  checkTokenIds(parsed, context.tokenizer.vocabSize);
  checkPromptBytes(promptBytes(), context.limits.maxPromptBytes, kind.param);
  const prompts = encode(context.tokenizer);
  if (prompts.some((tokens) => tokens.length === 0)) {
    throw new KvfenceError("invalid_request", kind.emptyPrompt, { param: kind.param });
  }
  if (parsed.echoPrompts !== null && echoTexts !== undefined) {
    return { parsed: { ...parsed, echoPrompts: echoTexts(context.tokenizer, prompts) }, prompts };
  }
  return { parsed, prompts };
}

/**
 * A request with tools, with how its answer is read under the served template (or a refusal).
 * Mistral's `[TOOL_CALLS]` is a special token: its output keeps special tokens, as vLLM's does.
 */
function withToolParsing(parsed: SamplingRequest, tokenizer: PromptTokenizer): SamplingRequest {
  if (parsed.tools == null) return parsed;
  const support = tokenizer.toolSupport ?? { usesTools: false, format: null };
  const tools = resolveToolParsing(parsed.tools, support);
  const keepSpecial = tools.parsing?.format === "mistral";
  return { ...parsed, tools, ...(keepSpecial ? { skipSpecialTokens: false } : {}) };
}

const tokenizeTextSchema = z.object({
  model: z.string().nullable().optional(),
  prompt: z.string(),
  add_special_tokens: z.boolean().nullable().optional(),
  return_token_strs: z.boolean().nullable().optional(),
});
const detokenizeSchema = z.object({
  model: z.string().nullable().optional(),
  tokens: z.array(z.number().int().min(0)),
});

/** What /tokenize and /detokenize answer besides the tokens: the context length (vLLM's `max_model_len`). */
export interface UtilityContext extends PrepareContext {
  readonly maxModelLen?: number;
}

/**
 * vLLM's /tokenize (`{prompt, add_special_tokens}` or a chat's `{messages, …}` →
 * `{count, max_model_len, tokens, token_strs}`) and /detokenize (`{tokens}` → `{prompt}`), under the
 * same limits and checks as a generation request; `model`, when given, must be the served one.
 */
export function answerUtility(
  endpoint: UtilityEndpointName,
  body: Uint8Array,
  context: UtilityContext,
): object {
  checkJsonDepth(body, context.limits.maxJsonDepth);
  const json = parseJsonBody(body);
  const model = (json as { model?: unknown } | null)?.model;
  const named = (m: unknown) => {
    if (typeof m === "string") checkModel(m, context.modelId);
  };
  const tokenizer = context.tokenizer;
  if (endpoint === "detokenize") {
    const { tokens } = parseUtility(detokenizeSchema, json);
    named(model);
    const bad = tokens.findIndex((id) => id >= tokenizer.vocabSize);
    if (bad >= 0) {
      throw new KvfenceError(
        "invalid_request",
        `tokens[${bad}] is token id ${tokens[bad]}, outside this model's vocabulary of ${tokenizer.vocabSize} ids`,
        { param: "tokens" },
      );
    }
    return { prompt: tokenizer.decode(tokens) };
  }
  let ids: Int32Array;
  let strs = false;
  if (typeof json === "object" && json !== null && "messages" in json) {
    // A chat: the same parse, checks and template as /v1/chat/completions.
    const kind = PROMPT_KINDS.chat;
    kind.precheck(json, context.limits);
    const parsed = kind.parse({ model: [context.modelId].flat()[0], ...(json as object) });
    checkPromptBytes(parsed.promptBytes(), context.limits.maxPromptBytes, kind.param);
    ids = parsed.encode(tokenizer)[0]!;
  } else {
    const req = parseUtility(tokenizeTextSchema, json);
    checkPromptBytes(Buffer.byteLength(req.prompt), context.limits.maxPromptBytes, "prompt");
    ids =
      req.add_special_tokens === false
        ? tokenizer.encodePrompt(req.prompt, false)
        : tokenizer.encodePrompt(req.prompt);
    strs = req.return_token_strs === true;
  }
  named(model);
  const tokens = Array.from(ids);
  return {
    count: tokens.length,
    max_model_len: context.maxModelLen ?? null,
    tokens,
    token_strs: strs ? tokens.map((id) => tokenizer.decode([id])) : null,
  };
}

function parseUtility<T>(schema: z.ZodType<T>, body: unknown): T {
  const result = schema.safeParse(body);
  if (result.success) return result.data;
  const issue = result.error.issues[0]!;
  const param = issue.path.map(String).join(".") || "body";
  throw new KvfenceError("invalid_request", `Invalid request: ${param}: ${issue.message}`, { param });
}
