/**
 * The most bytes a request's answer can take, known before any work, and the operator's cap on it
 * (`--max-response-bytes`, docs/api.md "Request limits"). An answer grows with what the request
 * asks for, not with its size: a 2 KB body asking for `n: 64` choices that each echo an
 * 1,800-token prompt with 20 log-probabilities per token and vLLM's `prompt_logprobs` is a 215 MB
 * answer (issue #31, finding 1). So once its prompts are tokenized and admitted, a request whose
 * worst-case answer is over the cap gets a 400 `response_too_large` that names the cap and what to
 * lower, before the engine sees it.
 *
 * The worst case is a bound, not a guess: each generated token is counted at the longest token text
 * of the vocabulary, each list of top log-probabilities at the longest texts of that many tokens
 * (`TokenBounds`, from the tokenizer once at startup), numbers at their longest JSON form, echo's
 * prompt text at its own length, and everything else at a generous constant. Streams count their
 * frames too (each token its own chunk, with its id, model and usage). An answer never exceeds it
 * (src/router/response-size.e2e.test.ts checks the bound against real answers).
 */
import { KvfenceError } from "../lib/errors.js";
import { MAX_TOP_LOGPROBS } from "../lib/token-logprobs.js";
import type { SamplingRequest } from "./openai-schemas.js";
import type { GenerateEndpointName } from "./prepare-request.js";

/** What the vocabulary's longest tokens take in an answer. */
export interface TokenBounds {
  /** `[0, the longest token text's JSON bytes (quotes included), the two longest summed, …]`, up to 21 tokens. */
  readonly textBytes: readonly number[];
  /** The same over the tokens' own bytes (chat's `bytes` lists). */
  readonly rawBytes: readonly number[];
}

/** Tokens a list of top log-probabilities can name: the top ones and the chosen one. */
const MAX_LISTED = MAX_TOP_LOGPROBS + 1;

/** Keeps the `MAX_LISTED` largest of `values` seen, largest first. */
function keepLargest(largest: number[], value: number): void {
  if (largest.length === MAX_LISTED && value <= largest[MAX_LISTED - 1]!) return;
  let i = largest.length;
  while (i > 0 && largest[i - 1]! < value) i--;
  largest.splice(i, 0, value);
  if (largest.length > MAX_LISTED) largest.pop();
}

function prefixSums(largest: readonly number[]): number[] {
  const sums = [0];
  for (let k = 1; k <= MAX_LISTED; k++) sums.push(sums[k - 1]! + (largest[k - 1] ?? 0));
  return sums;
}

/** The bounds of a vocabulary of `vocabSize` ids, from each token's piece (one pass, at startup). */
export function tokenBounds(
  vocabSize: number,
  piece: (id: number) => { readonly text: string; readonly bytes: ArrayLike<number> },
): TokenBounds {
  const text: number[] = [];
  const raw: number[] = [];
  for (let id = 0; id < vocabSize; id++) {
    const p = piece(id);
    keepLargest(text, Buffer.byteLength(JSON.stringify(p.text)));
    keepLargest(raw, p.bytes.length);
  }
  return { textBytes: prefixSums(text), rawBytes: prefixSums(raw) };
}

/** The longest JSON of a finite double (`-1.7976931348623157e+308`). */
const NUMBER = 24;
/** The longest JSON of a count, offset, rank or token id. */
const INT = 10;
/** Each of chat's `bytes` entries: up to `255,`. */
const BYTE_ENTRY = 4;
/** A whole answer without its choices: id, object, created, usage (with cached tokens), brackets. */
const ANSWER_BYTES = 512;
/** One choice without its text, log-probabilities and stop reasons. */
const CHOICE_BYTES = 256;
/** A logprobs object without its entries (completions' four lists, chat's content and refusal). */
const LOGPROBS_BYTES = 96;
/**
 * One stream frame without its text and log-probabilities: `data: ` or `event: TYPE`, id, object,
 * created, the choice's index, delta, finish and stop reasons, `usage: null`, the Responses API's
 * item id, indexes, obfuscation and sequence number.
 */
const FRAME_BYTES = 448;
/** A `usage` object in full (vLLM's continuous_usage_stats puts one in every frame). */
const USAGE_BYTES = 192;
/** A Responses `response` object without its text and the request fields it repeats. */
const RESPONSE_OBJECT_BYTES = 2048;
/**
 * The frames a reasoning parser adds to a stream: the token that ends the block also opens the
 * content (two frames), the held-back tail, and the Responses API's reasoning item events (added,
 * part added, text done, part done, item done; their repeated text is counted with the message's).
 */
const REASONING_FRAMES = 7;
/** A JSON text re-serialised is at most this many times its length (`1e20` is 21 digits). */
const REWRITE_FACTOR = 6;

/** One position of completions' logprobs: token, logprob, the top map (k + 1 entries), text offset. */
function textEntryBytes(k: number, b: TokenBounds): number {
  return b.textBytes[1]! + 1 + (NUMBER + 1) + (b.textBytes[k + 1]! + (k + 1) * (NUMBER + 2) + 3) + (INT + 1);
}

/** One entry of chat's `logprobs.content` with `k` top ones, each with its token, logprob and bytes. */
function chatEntryBytes(k: number, b: TokenBounds): number {
  const own = 51 + b.textBytes[1]! + NUMBER + BYTE_ENTRY * b.rawBytes[1]!;
  return own + k * (33 + NUMBER) + b.textBytes[k]! + BYTE_ENTRY * b.rawBytes[k]!;
}

/** One position of vLLM's `prompt_logprobs`: up to k + 1 `"id": {logprob, rank, decoded_token}`. */
function vllmEntryBytes(k: number, b: TokenBounds): number {
  return 3 + (k + 1) * (2 * INT + NUMBER + 41) + b.textBytes[k + 1]!;
}

function jsonBytes(text: string): number {
  return Buffer.byteLength(JSON.stringify(text));
}

/** What the worst case of a request's answer depends on. */
export interface ResponsePlan {
  readonly endpoint: GenerateEndpointName;
  readonly parsed: SamplingRequest;
  /** Each prompt's tokens and its completion budget, as admitted. */
  readonly prompts: readonly { readonly tokens: number; readonly maxTokens: number }[];
  /** The request body's bytes: the most the fields an answer repeats (stop strings, instructions, metadata) can take, rewritten. */
  readonly bodyBytes: number;
  readonly modelId: string;
  /** A reasoning parser splits the answer (`--reasoning-parser`): a stream's reasoning frames and events. */
  readonly reasoning?: boolean;
}

/** The most bytes the answer to `plan` can take (body only, not the HTTP headers). */
export function worstCaseResponseBytes(plan: ResponsePlan, bounds: TokenBounds): number {
  const { parsed, endpoint } = plan;
  const k = parsed.logprobs;
  const vllm = parsed.vllmPromptLogprobs;
  const entry =
    k === null
      ? 0
      : endpoint === "chat"
        ? chatEntryBytes(k, bounds)
        : endpoint === "completions"
          ? textEntryBytes(k, bounds)
          : 0;
  const stopBytes = Math.max(INT, ...parsed.stop.map(jsonBytes));
  const repeated = REWRITE_FACTOR * plan.bodyBytes;
  const frame = FRAME_BYTES + jsonBytes(plan.modelId) + (parsed.continuousUsage ? USAGE_BYTES : 0);
  let total = ANSWER_BYTES + jsonBytes(plan.modelId) + USAGE_BYTES;
  if (endpoint === "responses") total += (parsed.stream ? 4 : 1) * (RESPONSE_OBJECT_BYTES + repeated);
  plan.prompts.forEach(({ tokens, maxTokens }, p) => {
    const echo = parsed.echoPrompts?.[p] ?? null;
    const positions = (echo === null ? 0 : tokens) + maxTokens;
    const text = (echo === null ? 0 : jsonBytes(echo)) + maxTokens * (bounds.textBytes[1]! - 2);
    let choice = CHOICE_BYTES + 2 * stopBytes + text + (k === null ? 0 : LOGPROBS_BYTES + positions * entry);
    if (parsed.stream) {
      // A frame per token, and the opening, echo and finishing ones, each with its own logprobs object;
      // the Responses API repeats the text in its last four events.
      const frames = maxTokens + 4 + (plan.reasoning === true ? REASONING_FRAMES : 0);
      choice += frames * (frame + (k === null ? 0 : LOGPROBS_BYTES));
      if (endpoint === "responses") choice += 4 * text;
    } else if (vllm !== null && endpoint === "completions") {
      choice += 2 + tokens * vllmEntryBytes(vllm, bounds);
    }
    total += parsed.n * choice;
    // Chat's prompt_logprobs stand once, beside the choices.
    if (vllm !== null && endpoint === "chat" && !parsed.stream)
      total += 2 + tokens * vllmEntryBytes(vllm, bounds);
  });
  return total;
}

/**
 * The refusal of a request whose answer could be over `maxResponseBytes` (`response_too_large`,
 * naming the cap and the fields to lower), or null when it fits.
 */
export function responseSizeRefusal(
  plan: ResponsePlan,
  bounds: TokenBounds,
  maxResponseBytes: number,
): KvfenceError | null {
  const bytes = worstCaseResponseBytes(plan, bounds);
  if (bytes <= maxResponseBytes) return null;
  const { parsed } = plan;
  const maxTokens = Math.max(...plan.prompts.map((p) => p.maxTokens));
  const levers = [
    ...(parsed.n > 1 ? [`n (${parsed.n})`] : []),
    ...(plan.prompts.length > 1 ? [`the number of prompts (${plan.prompts.length})`] : []),
    `max_tokens (${maxTokens})`,
    ...(parsed.logprobs === null ? [] : [`logprobs (${parsed.logprobs})`]),
    ...(parsed.vllmPromptLogprobs === null ? [] : [`prompt_logprobs (${parsed.vllmPromptLogprobs})`]),
  ];
  const list = levers.length === 1 ? levers[0] : `${levers.slice(0, -1).join(", ")} or ${levers.at(-1)}`;
  return new KvfenceError(
    "response_too_large",
    `The answer to this request could take up to ${bytes} bytes, over this server's limit of ${maxResponseBytes} bytes: ` +
      `lower ${list}${parsed.echoPrompts === null ? "" : ", or drop echo"} (the operator sets the limit with --max-response-bytes)`,
  );
}
