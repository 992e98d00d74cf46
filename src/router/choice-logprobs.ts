/**
 * A response's log-probabilities as they arrive, rendered in the endpoint's shape: the prompt's once
 * per prompt (`PromptLogprobs`: echo's entries and vLLM's `prompt_logprobs`, shared by every choice
 * of that prompt, as vLLM shares one request's prompt_logprobs between its outputs) and each
 * choice's own output tokens (`ChoiceLogprobs`), whole (a non-streamed answer) or chunk by chunk (a
 * stream: `take` returns those not sent yet), `text_offset` running on from the prompt's.
 *
 * The prompt's lists are `SharedArray`s (src/lib/json-chunks.ts): with `n: 64` the answer repeats
 * them in 64 choices, as OpenAI's echo and vLLM's completions do, but they are built once, and
 * serialised once, and their text is written 64 times. A choice's echo is joined to its own tokens
 * by an `ArrayConcat`, never copied.
 */
import { ArrayConcat, LazyArray, SharedArray } from "../lib/json-chunks.js";
import type { TokenLogprobs } from "../lib/token-logprobs.js";
import { type LogprobItem, type TokenPiece, vllmPromptLogprobs } from "./logprobs-wire.js";
import type { ChoiceExtras, ResponseStrategy } from "./openai-responses.js";
import type { SamplingRequest } from "./openai-schemas.js";

/** Echo's part of a choice's logprobs: each list of the endpoint's shape, and the text offset after the prompt. */
interface Echoed {
  readonly wire: Readonly<Record<string, unknown>>;
  readonly offset: number;
}

/** What both kinds need to render entries. */
export interface Rendering {
  readonly parsed: SamplingRequest;
  readonly piece: (id: number) => TokenPiece;
  readonly responses: ResponseStrategy;
}

function isList(value: unknown): value is readonly unknown[] | LazyArray {
  return Array.isArray(value) || value instanceof LazyArray;
}

/** One prompt's log-probabilities (computed by its first sample), rendered once for all its choices. */
export class PromptLogprobs {
  readonly #tokens: Int32Array;
  readonly #rendering: Rendering;
  #entries: readonly (TokenLogprobs | null)[] | null = null;
  #echoed: Echoed | null = null;
  #vllm: SharedArray | null = null;

  constructor(tokens: Int32Array, rendering: Rendering) {
    this.#tokens = tokens;
    this.#rendering = rendering;
  }

  /** The prompt's entries, as its first sample computed them. */
  set(entries: readonly (TokenLogprobs | null)[]): void {
    this.#entries = entries;
  }

  /**
   * Echo's prompt tokens with their log-probabilities (top lists cut to `logprobs`), each list
   * shared. Kept once the entries are in (a stream may open a choice before they are: its echo then
   * shows null entries, rendered for it alone).
   */
  echoed(k: number): Echoed {
    if (this.#echoed !== null) return this.#echoed;
    const entries = this.#entries;
    const items = Array.from(this.#tokens, (token, i): LogprobItem => {
      const e = entries?.[i] ?? null;
      return { token, entry: e === null ? null : { ...e, top: e.top.slice(0, k) } };
    });
    const { piece, responses } = this.#rendering;
    const offset = { value: 0 };
    const wire = responses.logprobs(items, piece, offset) as Record<string, unknown>;
    const echoed: Echoed = {
      wire: Object.fromEntries(
        Object.entries(wire).map(([key, list]) => [key, isList(list) ? SharedArray.of(list) : list]),
      ),
      offset: offset.value,
    };
    if (entries !== null) this.#echoed = echoed;
    return echoed;
  }

  /** vLLM's `prompt_logprobs` (top lists cut to `k`), shared; null before the entries are in. */
  vllm(k: number): SharedArray | null {
    const entries = this.#entries;
    if (entries === null) return null;
    this.#vllm ??= SharedArray.of(vllmPromptLogprobs(entries, k, this.#rendering.piece));
    return this.#vllm;
  }
}

/** One choice's log-probabilities: its prompt's (shared) and its own output tokens'. */
export class ChoiceLogprobs {
  readonly #prompt: PromptLogprobs;
  readonly #rendering: Rendering;
  readonly #echo: boolean;
  /** The choice text's length before the next output token (`text_offset`). */
  readonly #offset = { value: 0 };
  #echoCounted = false;
  readonly #items: LogprobItem[] = [];
  #sent = 0;

  constructor(prompt: PromptLogprobs, rendering: Rendering, echo: boolean) {
    this.#prompt = prompt;
    this.#rendering = rendering;
    this.#echo = echo;
  }

  push(entry: TokenLogprobs): void {
    this.#items.push({ token: entry.token, entry });
  }

  /** Echo's prompt tokens with their log-probabilities, or null (no echo, or no logprobs asked). */
  echoed(): Readonly<Record<string, unknown>> | null {
    const k = this.#rendering.parsed.logprobs;
    if (k === null || !this.#echo) return null;
    const echoed = this.#prompt.echoed(k);
    if (!this.#echoCounted) {
      this.#echoCounted = true;
      this.#offset.value += echoed.offset;
    }
    return echoed.wire;
  }

  /** Output tokens' log-probabilities are waiting to be sent (`take`). */
  get pending(): boolean {
    return this.#items.length > this.#sent;
  }

  /** The output tokens' log-probabilities not sent yet (a stream), or null when none were asked. */
  take(): object | null {
    const { parsed, responses, piece } = this.#rendering;
    if (parsed.logprobs === null) return null;
    const items = this.#items.slice(this.#sent);
    this.#sent = this.#items.length;
    return responses.logprobs(items, piece, this.#offset);
  }

  /** A whole answer's: echo's and the output's in one object (echo's lists shared), and vLLM's prompt_logprobs. */
  all(): ChoiceExtras {
    const { parsed } = this.#rendering;
    let logprobs: object | null = null;
    if (parsed.logprobs !== null) {
      const echoed = this.echoed();
      const out = this.take() as Record<string, readonly unknown[] | LazyArray>;
      logprobs =
        echoed === null || !("tokens" in out)
          ? out
          : Object.fromEntries(
              Object.keys(out).map((key) => [key, new ArrayConcat([echoed[key] as SharedArray, out[key]!])]),
            );
    }
    const k = parsed.vllmPromptLogprobs;
    const shared = k === null ? null : this.#prompt.vllm(k);
    return { logprobs, ...(shared === null ? {} : { promptLogprobs: shared }) };
  }
}

/**
 * The log-probabilities of a response's choices, given each one's request and echo (null: none):
 * the choices of one prompt (the same `promptTokens`) share one `PromptLogprobs`.
 */
export function choicesLogprobs(
  choices: readonly {
    readonly request: { readonly promptTokens: Int32Array };
    readonly echo: string | null;
  }[],
  rendering: Rendering,
): { readonly prompt: PromptLogprobs; readonly logprobs: ChoiceLogprobs }[] {
  const prompts = new Map<Int32Array, PromptLogprobs>();
  return choices.map(({ request, echo }) => {
    const tokens = request.promptTokens;
    let prompt = prompts.get(tokens);
    if (prompt === undefined) {
      prompt = new PromptLogprobs(tokens, rendering);
      prompts.set(tokens, prompt);
    }
    return { prompt, logprobs: new ChoiceLogprobs(prompt, rendering, echo !== null) };
  });
}
