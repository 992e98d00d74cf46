/**
 * One generation request's answer, as the handler of a generation endpoint returns it and the HTTP
 * layer pumps it (the model: llama.cpp's server, whose handlers return a response object whose
 * `next()` yields the stream's chunks). A `GenerationReply` runs one `Generation` per choice (`n`
 * per prompt, sample 0 of each prompt first) and keeps the choices' state: their text, their
 * log-probabilities (choice-logprobs.ts), how each finished. From the engine's events it makes the
 * endpoint's payloads (openai-responses.ts): a stream's chunks, each naming its choice's index (a
 * choice opens with the endpoint's opening payloads and, with echo, its prompt), then the closing
 * ones once every choice finished; or, not streamed, the whole answer of every choice with the
 * usage summed over them. One choice failing fails the reply and stops the others.
 *
 * With a reasoning parser (`--reasoning-parser`, reasoning-parser.ts), chat and the Responses API
 * split each choice's `<think>` block out of its text: streamed as the endpoint streams reasoning
 * (`ResponseStrategy.reasoning`), and in the whole answer as its `reasoning`.
 *
 * A choice's finish goes on the chunk of its last token when that chunk is still queued (as vLLM
 * and SGLang send it; the EOS token has a chunk of its own, without text), else on a chunk of its
 * own (OpenAI's way).
 *
 * It knows nothing of HTTP. The HTTP layer (answer-writer.ts) calls `start` with a wake-up; on each
 * wake-up it writes the stream's headers once they are due (`streaming`: the engine's first event,
 * so that an error before it is still a real 4xx/5xx), takes the payloads queued (`next`) and, once
 * there is one, the `outcome`. A wake-up follows the engine events that queued something, once per
 * call of the engine (a microtask later: a last token and its finish, reported in one call, go out
 * as one chunk), so nothing waits in the queue past that call; the writing itself
 * (json-writer.ts) has the backpressure. What the router records of the request goes to its
 * `ReplyHooks`.
 */

import { Deque } from "../lib/deque.js";
import { type KvfenceError, toOpenAiError } from "../lib/errors.js";
import type { EngineHandle, GenerationRequest } from "../protocol/engine-api.js";
import { type ChoiceLogprobs, choicesLogprobs, type PromptLogprobs } from "./choice-logprobs.js";
import {
  type FinishReason,
  Generation,
  type GenerationSink,
  type StopReason,
  type TextStreamDecoder,
  type Usage,
} from "./generation.js";
import type { TokenPiece } from "./logprobs-wire.js";
import { completionId, type ResponseMeta, type ResponseStrategy, usageWire } from "./openai-responses.js";
import type { ReasoningOutput, SamplingRequest } from "./openai-schemas.js";
import {
  type ReasoningParserName,
  type ReasoningPiece,
  ReasoningSplitter,
  splitReasoning,
} from "./reasoning-parser.js";
import type { ResponsesEcho } from "./responses-request.js";
import type { SseFraming } from "./sse.js";
import { ToolCallStream, type ToolStreamDelta } from "./tool-call-parser.js";

/** What a reply needs of the tokenizer. */
export interface ReplyTokenizer {
  /** One token's own text and bytes (log-probabilities name tokens by them). */
  tokenPiece(id: number): TokenPiece;
  /** A fresh UTF-8-safe streaming detokenizer, one per response (special tokens skipped by default). */
  createDecoder(options?: { readonly skipSpecialTokens?: boolean }): TextStreamDecoder;
}

/** One choice to generate: its request, echo's text of its prompt, and whether it is its prompt's sample 0. */
export interface PlannedChoice {
  readonly request: GenerationRequest;
  readonly echo: string | null;
  readonly firstOfPrompt: boolean;
}

/** What the router records of a reply (metrics, logs, spans); called in the engine's events. */
export interface ReplyHooks {
  /** `count` new tokens of one choice. */
  tokens(count: number): void;
  /** A choice failed in the engine: the error the client is shown (the log keeps `internal`). */
  failed(rid: number, internal: KvfenceError): KvfenceError;
  /** The client went away before the reply ended (`abort`). */
  clientGone(): void;
  /** The reply ended, once: 200 with the usage, an error's status, or 499 (the client went away). */
  ended(status: number, usage: Usage | null): void;
}

/** How a reply ended, for the HTTP layer. */
export type ReplyOutcome =
  /** The whole (non-streamed) answer. */
  | { readonly kind: "answer"; readonly body: object }
  /** The stream's last payload is queued: end it. */
  | { readonly kind: "end" }
  /** Failed before the stream's headers went out: an error response. */
  | { readonly kind: "error"; readonly error: KvfenceError };

const STREAM_END: ReplyOutcome = { kind: "end" };

interface ChoiceResult {
  readonly reason: FinishReason;
  readonly usage: Usage;
  readonly stopReason: StopReason;
}

/** A choice as the reply keeps it. */
interface Choice extends PlannedChoice {
  readonly index: number;
  readonly prompt: PromptLogprobs;
  readonly logprobs: ChoiceLogprobs;
  text: string;
  /** Reads tool calls out of its text (the request's tools are parsed); else null. */
  readonly tools: ToolCallStream | null;
  /** With a reasoning parser: its text's split so far, and whether its content began. */
  readonly splitter: ReasoningSplitter | null;
  contentBegan: boolean;
  /** Its last text chunk (its finish may go on it while it is still queued). */
  lastChunk: Record<string, unknown> | null;
  /** Its stream opened (its opening payloads are queued). */
  opened: boolean;
  result: ChoiceResult | null;
}

export interface ReplyParts {
  readonly engine: EngineHandle;
  readonly tokenizer: ReplyTokenizer;
  /** The `model` its answers name. */
  readonly modelId: string;
  readonly parsed: SamplingRequest;
  /** The endpoint's shapes. */
  readonly responses: ResponseStrategy;
  readonly planned: readonly PlannedChoice[];
  readonly hooks: ReplyHooks;
  /** `--reasoning-parser` (absent: none); endpoints without reasoning shapes ignore it. */
  readonly reasoningParser?: ReasoningParserName | null;
}

export class GenerationReply {
  readonly #parsed: SamplingRequest;
  readonly #responses: ResponseStrategy;
  /** The parser, when the endpoint streams reasoning. */
  readonly #parser: ReasoningParserName | null;
  /** vLLM's `include_reasoning`: false drops the reasoning the parser splits out. */
  readonly #includeReasoning: boolean;
  readonly #meta: ResponseMeta;
  readonly #hooks: ReplyHooks;
  readonly #choices: readonly Choice[];
  readonly #generations: readonly Generation[];
  /** Payloads not taken yet (`next`). */
  readonly #queue = new Deque<Record<string, unknown>>(4);
  /** The choices' last text chunks still in the queue. */
  readonly #queuedText = new Set<Record<string, unknown>>();
  /** vLLM's continuous_usage_stats: the prompts' tokens (each prompt once), and the tokens so far. */
  readonly #promptTokens: number;
  #generated = 0;
  #streaming = false;
  #ended = false;
  #outcome: ReplyOutcome | null = null;
  #wake: () => void = () => {};
  #wakeDue = false;

  constructor(parts: ReplyParts) {
    const { parsed, responses, planned, tokenizer } = parts;
    this.#parsed = parsed;
    this.#responses = responses;
    this.#hooks = parts.hooks;
    const output = (parsed as { reasoningOutput?: ReasoningOutput }).reasoningOutput;
    const parser =
      responses.reasoning === undefined || output?.separate === false
        ? null
        : (parts.reasoningParser ?? null);
    this.#parser = parser;
    this.#includeReasoning = output?.include !== false;
    this.#meta = responseMeta(responses, parsed, planned[0]!.request, parts.modelId, parser !== null);
    this.#promptTokens = planned.reduce(
      (n, p) => n + (p.firstOfPrompt ? p.request.promptTokens.length : 0),
      0,
    );
    // Each prompt's log-probabilities are rendered once, for all its choices (choice-logprobs.ts).
    const piece = (id: number) => tokenizer.tokenPiece(id);
    const logprobs = choicesLogprobs(planned, { parsed, piece, responses });
    const parsing = parsed.tools?.parsing ?? null;
    this.#choices = planned.map(({ request, echo, firstOfPrompt }, index) => ({
      request,
      echo,
      firstOfPrompt,
      index,
      text: "",
      tools: parsing === null ? null : new ToolCallStream(parsing.format, { maxCalls: parsing.maxCalls }),
      splitter: parser === null || !parsed.stream ? null : new ReasoningSplitter(parser),
      contentBegan: false,
      lastChunk: null,
      opened: false,
      ...logprobs[index]!,
      result: null,
    }));
    const options = {
      logprobs: parsed.logprobs !== null,
      stop: parsed.stop,
      stopTokenIds: parsed.stopTokenIds,
      minTokens: parsed.minTokens,
      includeStopStr: parsed.includeStopStr,
    };
    this.#generations = this.#choices.map((choice) => {
      const decoder = tokenizer.createDecoder({ skipSpecialTokens: parsed.skipSpecialTokens });
      return new Generation(parts.engine, choice.request, { ...options, decoder }, this.#sink(choice));
    });
  }

  /** One per choice, sample 0 of each prompt first. */
  get generations(): readonly Generation[] {
    return this.#generations;
  }

  /** How its stream is framed. */
  get framing(): SseFraming {
    return this.#responses.framing;
  }

  /** True once a streamed reply's headers are due (its first engine event came). */
  get streaming(): boolean {
    return this.#streaming;
  }

  /** How it ended, once it did (after the payloads still queued). */
  get outcome(): ReplyOutcome | null {
    return this.#outcome;
  }

  /** The next stream payload queued, or undefined. */
  next(): Record<string, unknown> | undefined {
    const payload = this.#queue.popFront();
    if (payload !== undefined) this.#queuedText.delete(payload);
    return payload;
  }

  /** Submits every choice to the engine; `wake` is called whenever there is something to write. */
  start(wake: () => void): void {
    this.#wake = wake;
    for (const generation of this.#generations) generation.start();
  }

  /** Wakes the writer once the engine's current call returns (see above). */
  #wakeSoon(): void {
    if (this.#wakeDue) return;
    this.#wakeDue = true;
    queueMicrotask(() => {
      this.#wakeDue = false;
      this.#wake();
    });
  }

  /** The client went away: every choice stops, no payload follows. */
  abort(): void {
    if (this.#ended) return;
    for (const generation of this.#generations) generation.abort();
    this.#hooks.clientGone();
    this.#end(499, null);
  }

  #sink(choice: Choice): GenerationSink {
    const stream = this.#parsed.stream;
    const meta = this.#meta;
    const includeUsage = this.#parsed.includeUsage;
    return {
      tokens: (count) => {
        this.#generated += count;
        this.#hooks.tokens(count);
        if (stream && !choice.opened) {
          this.#open(choice);
          this.#wakeSoon();
        }
      },
      logprobs: (entry) => choice.logprobs.push(entry),
      // Sample 0 of a prompt computes its log-probabilities; every choice of that prompt shows them.
      promptLogprobs: (entries) => choice.prompt.set(entries),
      text: (delta) => {
        if (choice.tools !== null) {
          this.#toolText(choice, choice.tools.push(delta));
          return;
        }
        choice.text += delta;
        if (!stream) return;
        if (choice.splitter === null) this.#sendText(choice, { reasoning: "", content: delta });
        else this.#sendText(choice, choice.splitter.push(delta));
        this.#wakeSoon();
      },
      finish: (engineReason, usage, stopReason) => {
        if (this.#ended) return;
        const reason = choice.tools === null ? engineReason : this.#endTools(choice, engineReason);
        choice.result = { reason, usage, stopReason };
        if (stream) {
          if (choice.splitter !== null) this.#sendText(choice, choice.splitter.flush(), true);
          const last = choice.lastChunk;
          const onLast = last !== null && this.#queuedText.has(last) && !choice.logprobs.pending;
          const logprobs = choice.logprobs.take();
          const chunks = this.#responses.finish(
            meta,
            reason,
            includeUsage,
            stopReason,
            logprobs,
            this.#parser === null ? choice.text : splitReasoning(this.#parser, choice.text).content,
          );
          if (onLast && this.framing === "data" && chunks.length === 1) this.#finishOn(last, chunks[0]!);
          else for (const chunk of chunks) this.#send(choice, chunk);
        }
        if (this.#choices.every((c) => c.result !== null)) this.#finished();
        this.#wakeSoon();
      },
      fail: (internal) => {
        if (this.#ended) return;
        for (const generation of this.#generations) generation.abort();
        const error = this.#hooks.failed(choice.request.rid, internal);
        const { status, body } = toOpenAiError(error);
        this.#end(status, null);
        if (this.#streaming) {
          // Headers are out: the error goes in the stream, as OpenAI does, and ends it.
          this.#queue.pushBack(this.#responses.streamError(body));
          this.#outcome = STREAM_END;
        } else {
          this.#outcome = { kind: "error", error };
        }
        this.#wakeSoon();
      },
    };
  }

  /** The content and tool-call pieces of a choice with tools: kept, and streamed when streaming. */
  #toolText(choice: Choice, delta: ToolStreamDelta): void {
    choice.text += delta.content;
    if (!this.#parsed.stream) return;
    const { meta, includeUsage } = { meta: this.#meta, includeUsage: this.#parsed.includeUsage };
    if (delta.content !== "")
      this.#send(choice, this.#responses.delta(meta, delta.content, includeUsage, choice.logprobs.take()));
    const calls = choice.tools!.calls;
    for (const piece of delta.calls)
      for (const chunk of this.#responses.toolCall?.(meta, piece, calls, includeUsage) ?? [])
        this.#send(choice, chunk);
    if (delta.content !== "" || delta.calls.length > 0) this.#wake();
  }

  /** A choice with tools ended: the text held back goes out; `tool_calls` when it stopped on calls. */
  #endTools(choice: Choice, reason: FinishReason): FinishReason {
    const tools = choice.tools!;
    this.#toolText(choice, tools.end());
    if (this.#parsed.stream && tools.calls.length > 0)
      for (const chunk of this.#responses.toolCallsDone?.(tools.calls) ?? []) this.#send(choice, chunk);
    if (reason !== "stop" || tools.calls.length === 0) return reason;
    return this.#parsed.tools?.legacy === true ? "function_call" : "tool_calls";
  }

  /** Makes the stream's headers due and queues, once per choice, its opening payloads (and echo's prompt). */
  #open(choice: Choice): void {
    this.#streaming = true;
    if (choice.opened) return;
    choice.opened = true;
    const meta = this.#meta;
    const includeUsage = this.#parsed.includeUsage;
    const openings = this.#responses.opening(meta, includeUsage);
    if (choice.echo !== null)
      openings.push(this.#responses.delta(meta, choice.echo, includeUsage, choice.logprobs.echoed()));
    for (const opening of openings) {
      // vLLM's continuous usage: the first chunk too, before any token is counted.
      if (this.#parsed.continuousUsage)
        opening.usage = usageWire({ promptTokens: this.#promptTokens, completionTokens: 0 });
      this.#queue.pushBack(withIndex(opening, choice.index));
    }
  }

  /** Queues one chunk of `choice` (its stream opened first), with the usage so far when asked. */
  #send(choice: Choice, chunk: Record<string, unknown>): void {
    if (this.#parsed.continuousUsage)
      chunk.usage = usageWire({ promptTokens: this.#promptTokens, completionTokens: this.#generated });
    this.#open(choice);
    this.#queue.pushBack(withIndex(chunk, choice.index));
  }

  /**
   * Queues a piece of `choice`'s text: its reasoning (with a parser), the payloads between the
   * reasoning and the content once the content begins (or the choice ends), its content.
   */
  #sendText(choice: Choice, piece: ReasoningPiece, ending = false): void {
    const meta = this.#meta;
    const includeUsage = this.#parsed.includeUsage;
    const shapes = this.#responses.reasoning;
    if (piece.reasoning !== "" && this.#includeReasoning)
      for (const chunk of shapes!.delta(meta, piece.reasoning, includeUsage, choice.logprobs.take()))
        this.#sendLast(choice, chunk);
    if (choice.splitter !== null && !choice.contentBegan && (ending || choice.splitter.inContent)) {
      choice.contentBegan = true;
      for (const chunk of shapes!.toContent(meta)) this.#send(choice, chunk);
    }
    if (piece.content !== "")
      this.#sendLast(
        choice,
        this.#responses.delta(meta, piece.content, includeUsage, choice.logprobs.take()),
      );
  }

  /** Queues a chunk of text of `choice`: its finish may go on it while it is still queued. */
  #sendLast(choice: Choice, chunk: Record<string, unknown>): void {
    this.#send(choice, chunk);
    choice.lastChunk = chunk;
    this.#queuedText.add(chunk);
  }

  /** Moves the finish fields of `finish` onto the queued chunk `last` (and the usage so far, when continuous). */
  #finishOn(last: Record<string, unknown>, finish: Record<string, unknown>): void {
    const into = (last.choices as Record<string, unknown>[])[0]!;
    const from = (finish.choices as Record<string, unknown>[])[0]!;
    for (const [key, value] of Object.entries(from))
      if (key !== "index" && key !== "delta" && key !== "text" && key !== "logprobs") into[key] = value;
    if (this.#parsed.continuousUsage)
      last.usage = usageWire({ promptTokens: this.#promptTokens, completionTokens: this.#generated });
  }

  /** Every choice finished: the whole answer, or the stream's closing payloads. */
  #finished(): void {
    const choices = this.#choices;
    const usage = totalUsage(choices);
    this.#end(200, usage);
    const whole = () =>
      wholeAnswer(this.#responses, this.#meta, choices, usage, this.#parser, this.#includeReasoning);
    if (!this.#parsed.stream) {
      this.#outcome = { kind: "answer", body: whole() };
      return;
    }
    for (const closing of this.#responses.closing(this.#meta, this.#parsed.includeUsage, usage, whole))
      this.#queue.pushBack(closing);
    this.#outcome = STREAM_END;
  }

  #end(status: number, usage: Usage | null): void {
    if (this.#ended) return;
    this.#ended = true;
    this.#hooks.ended(status, usage);
  }
}

/** What every payload of one response repeats: its id, time, model, the settings in effect. */
function responseMeta(
  responses: ResponseStrategy,
  parsed: SamplingRequest,
  first: GenerationRequest,
  model: string,
  reasoning: boolean,
): ResponseMeta {
  const echo = (parsed as { responses?: ResponsesEcho }).responses;
  return {
    id: completionId(responses.idKind),
    created: Math.floor(Date.now() / 1000),
    model,
    sampling: { temperature: first.sampling.temperature, topP: first.sampling.topP },
    ...(parsed.tools?.legacy === true ? { legacyFunctions: true } : {}),
    ...(echo === undefined ? {} : { responses: echo }),
    ...(reasoning ? { reasoning: { text: null, messageIndex: 0 } } : {}),
  };
}

/** Usage over the choices: each prompt once, every choice's completion tokens. */
function totalUsage(choices: readonly Choice[]): Usage {
  let promptTokens = 0;
  let completionTokens = 0;
  let cachedTokens: number | undefined;
  let migrations = 0;
  for (const c of choices) {
    const usage = c.result!.usage;
    migrations += usage.migrations ?? 0;
    if (c.firstOfPrompt) {
      promptTokens += usage.promptTokens;
      // The prompt's tokens served from the prefix cache (its first sample's; absent with the cache off).
      if (usage.cachedTokens !== undefined) cachedTokens = (cachedTokens ?? 0) + usage.cachedTokens;
    }
    completionTokens += usage.completionTokens;
  }
  return {
    promptTokens,
    completionTokens,
    ...(cachedTokens === undefined ? {} : { cachedTokens }),
    ...(migrations === 0 ? {} : { migrations }),
  };
}

/** The whole (non-streamed) answer of every choice. */
function wholeAnswer(
  responses: ResponseStrategy,
  meta: ResponseMeta,
  choices: readonly Choice[],
  usage: Usage,
  parser: ReasoningParserName | null,
  includeReasoning: boolean,
): object {
  return mergeChoices(
    choices.map((c) => {
      const text = (c.echo ?? "") + c.text;
      const split = parser === null ? null : splitReasoning(parser, text);
      const extras = c.tools === null ? c.logprobs.all() : { ...c.logprobs.all(), toolCalls: c.tools.calls };
      return responses.completion(
        meta,
        split === null ? text : split.content,
        c.result!.reason,
        usage,
        c.result!.stopReason,
        split === null ? extras : { ...extras, reasoning: includeReasoning ? split.reasoning : null },
      );
    }),
  );
}

/** A chunk of one choice: the strategies build choice 0's; `n` > 1 names each. */
function withIndex(chunk: Record<string, unknown>, index: number): Record<string, unknown> {
  if (index !== 0) (chunk.choices as { index: number }[])[0]!.index = index;
  return chunk;
}

/** The whole answer of several choices: the first one's object with every choice, each its index. */
function mergeChoices(answers: readonly object[]): object {
  const first = answers[0] as { choices: { index: number }[] };
  if (answers.length === 1) return first;
  const choices = answers.map((a, index) => ({ ...(a as typeof first).choices[0]!, index }));
  return { ...first, choices };
}
