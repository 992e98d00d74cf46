/**
 * The size limits of a request, each checked before the work it bounds: the body in bytes (while
 * it is read, read-body.ts), the JSON nesting depth (a byte scan before `JSON.parse`), the number of
 * chat messages (before validation and the chat template) and the prompt in bytes (before
 * tokenization). Together they bound the time and memory one request can cost the router, so that
 * no request, however built, keeps other tenants waiting (docs/api.md, "Request limits"). The answer
 * is bounded too: its worst case is checked against `maxResponseBytes` once the prompt is
 * tokenized, before the engine sees it (response-size.ts).
 *
 * Each refusal is a 4xx that names the limit, the request's size and the `kvfence serve` flag that
 * raises it.
 */
import { KvfenceError } from "../lib/errors.js";

export interface RequestLimits {
  /** `--max-body-bytes`: the request body (413 past it, before it is read). */
  readonly maxBodyBytes: number;
  /** `--max-json-depth`: nesting of objects and arrays in the body. */
  readonly maxJsonDepth: number;
  /** `--max-messages`: entries of a chat request's `messages`. */
  readonly maxMessages: number;
  /** `--max-prompt-bytes`: UTF-8 bytes of the prompt (a chat's message contents, summed). */
  readonly maxPromptBytes: number;
  /** `--max-response-bytes`: the worst case of a request's answer (400 past it, before any work). */
  readonly maxResponseBytes: number;
}

export const DEFAULT_MAX_JSON_DEPTH = 64;
/** OpenAI's own limit on `messages`. */
export const DEFAULT_MAX_MESSAGES = 2048;
/** The floor of the default prompt limit. */
const MIN_DEFAULT_PROMPT_BYTES = 64 * 1024;
/** Bytes per token of the context the default prompt limit allows (English averages about 4). */
const DEFAULT_PROMPT_BYTES_PER_TOKEN = 32;

/**
 * The default `--max-prompt-bytes` for a context of `contextLength` tokens: 32 bytes per token, at
 * least 64 KiB, far above what any prompt that fits the context needs.
 */
export function defaultMaxPromptBytes(contextLength: number): number {
  return Math.max(MIN_DEFAULT_PROMPT_BYTES, DEFAULT_PROMPT_BYTES_PER_TOKEN * contextLength);
}

/**
 * The default `--max-body-bytes` for a prompt limit of `maxPromptBytes`: twice the prompt (room for
 * JSON escapes of non-ASCII text) plus 1 MiB for the rest of the body. A body over it is refused from
 * its declared length, before it is read.
 */
export function defaultMaxBodyBytes(maxPromptBytes: number): number {
  return 2 * maxPromptBytes + 1024 * 1024;
}

/** The floor of the default answer limit. */
const MIN_DEFAULT_RESPONSE_BYTES = 64 * 1024 * 1024;
/** Bytes per token of the context the default answer limit allows. */
const DEFAULT_RESPONSE_BYTES_PER_TOKEN = 1024;

/**
 * The default `--max-response-bytes` for a context of `contextLength` tokens: 1 KiB per token, at
 * least 64 MiB — room for any answer of one choice without log-probabilities, streamed or not.
 */
export function defaultMaxResponseBytes(contextLength: number): number {
  return Math.max(MIN_DEFAULT_RESPONSE_BYTES, DEFAULT_RESPONSE_BYTES_PER_TOKEN * contextLength);
}

/** The limits for a context of `contextLength` tokens: each one given, else its default. */
export function requestLimits(contextLength: number, given: Partial<RequestLimits> = {}): RequestLimits {
  const maxPromptBytes = given.maxPromptBytes ?? defaultMaxPromptBytes(contextLength);
  return {
    maxBodyBytes: given.maxBodyBytes ?? defaultMaxBodyBytes(maxPromptBytes),
    maxJsonDepth: given.maxJsonDepth ?? DEFAULT_MAX_JSON_DEPTH,
    maxMessages: given.maxMessages ?? DEFAULT_MAX_MESSAGES,
    maxPromptBytes,
    maxResponseBytes: given.maxResponseBytes ?? defaultMaxResponseBytes(contextLength),
  };
}

const QUOTE = 0x22;
const BACKSLASH = 0x5c;
const OPEN_BRACE = 0x7b;
const OPEN_BRACKET = 0x5b;
const CLOSE_BRACE = 0x7d;
const CLOSE_BRACKET = 0x5d;

/**
 * Refuses a body whose objects and arrays nest deeper than `maxDepth`, scanning its bytes once
 * (strings skipped, escapes honoured) before anything parses it. UTF-8 continuation bytes are never
 * ASCII, so the scan is exact on the raw bytes. A body that is not JSON at all is left for the
 * parser to refuse.
 */
export function checkJsonDepth(body: Uint8Array, maxDepth: number): void {
  let depth = 0;
  let inString = false;
  for (let i = 0; i < body.length; i++) {
    const byte = body[i]!;
    if (inString) {
      if (byte === BACKSLASH) i++;
      else if (byte === QUOTE) inString = false;
    } else if (byte === QUOTE) {
      inString = true;
    } else if (byte === OPEN_BRACE || byte === OPEN_BRACKET) {
      if (++depth > maxDepth) {
        throw new KvfenceError(
          "json_too_deep",
          `Request body nests objects and arrays deeper than this server's limit of ${maxDepth} levels: ` +
            "flatten it (the operator sets the limit with --max-json-depth)",
        );
      }
    } else if (byte === CLOSE_BRACE || byte === CLOSE_BRACKET) {
      depth--;
    }
  }
}

/** Refuses a chat body with more than `maxMessages` messages, before it is validated. */
export function checkMessageCount(
  body: unknown,
  maxMessages: number,
  field: "messages" | "input" = "messages",
): void {
  if (typeof body !== "object" || body === null) return;
  const messages = (body as Record<string, unknown>)[field];
  if (Array.isArray(messages) && messages.length > maxMessages) {
    throw new KvfenceError(
      "array_above_max_length",
      `Too many messages: ${messages.length}, over this server's limit of ${maxMessages}; ` +
        "send fewer (the operator sets the limit with --max-messages)",
      { param: field },
    );
  }
}

/** Refuses a prompt of more than `maxPromptBytes` UTF-8 bytes, before it is tokenized. */
export function checkPromptBytes(bytes: number, maxPromptBytes: number, param: string): void {
  if (bytes > maxPromptBytes) {
    throw new KvfenceError(
      "string_above_max_length",
      `The ${param === "prompt" ? "prompt" : param === "input" ? "input's text" : "messages' content"} is ${bytes} bytes, over this server's limit of ` +
        `${maxPromptBytes} bytes: shorten it (the operator sets the limit with --max-prompt-bytes)`,
      { param },
    );
  }
}
