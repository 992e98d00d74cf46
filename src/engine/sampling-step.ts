/**
 * The sampling step of the engine: turning a step's logits into tokens. For every request whose
 * step reached its last token, its logit controls (`Sampler.process`) apply, then its per-request
 * seeded generator draws the next token (`Sampler.sample`). A request that asked for
 * log-probabilities gets them with each token (from the raw logits, before the controls), and the
 * prompt's once, before its first token (computed row by row as its prompt's chunks run, through
 * the forward pass's `StepSequence.rowLogits`).
 *
 * n > 1: a prefill node's first sample of a group also draws each later sample's first token from
 * the same logits (`siblings`, each with a generator of its own seed), and a sample forked on one
 * engine draws from a copy of its first sample's logits (`copyOf`).
 *
 * Structured output (`SamplingParams.constraint`): a request waits outside the scheduler until its
 * grammar is compiled (`constrain`, per tenant, on the engine's grammar threads: src/grammar/); then before each draw its matcher
 * masks the logits the grammar forbids — after the logit controls, while its log-probabilities stay
 * the raw logits' — and the drawn token advances it. A decode node's matcher first accepts the
 * tokens prefill sampled; a prefill node's siblings draw under the same first mask. A request
 * migrated mid-stream (`resumedTokens`) resumes the lost attempt's sampler: its output so far
 * counts as output for the controls and the grammar, and its generator skips their draws.
 *
 * This is the one place in the engine that reads a request's sampling parameters (temperature, top
 * p and k, seed, stop token ids, logit controls, log-probabilities, the group's seeds); the engine
 * reports what it returns (`Engine`'s step: counters, timing, events, the end of a request).
 * Nothing here allocates per token: a token's log-probabilities go in the request's own reused
 * array, its raw logits in a buffer made on its first token.
 */
import { type GrammarSource, wireOf } from "../grammar/grammar-engine.js";
import type { WireError } from "../lib/errors.js";
import { KvfenceError } from "../lib/errors.js";
import { Prng } from "../lib/prng.js";
import { MAX_TOP_LOGPROBS, type TokenLogprobs } from "../lib/token-logprobs.js";
import { tokenLogprobs } from "../model/logprobs.js";
import { Sampler } from "../model/sampler.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import type { SamplingParams } from "../protocol/sampling-params.js";
import type { Sequence } from "./sequence.js";

/** The forward pass's per-row callback for a step of a sequence (see `StepSequence.rowLogits`). */
type RowLogits = (index: number, logits: Float32Array, offset: number) => void;

export class SamplingStep {
  readonly #sampler: Sampler;
  readonly #vocabSize: number;
  /** Seeds for requests that bring none. */
  readonly #seeds: Prng;
  /** A copy of a step's logits: a sibling's or a forked sample's to draw from. */
  readonly #copy: Float32Array;
  /** Where sequences get their grammars, made on first use (null: structured output refused). */
  readonly #grammar: (() => Promise<GrammarSource>) | null;
  #grammarSource: Promise<GrammarSource> | null = null;
  /** Sequences waiting for their grammar, by rid. */
  readonly #waiting = new Map<number, Sequence>();
  /** The model's EOS ids: a grammar's end when the request has no stop ids of its own (`ignore_eos`). */
  readonly #eosTokenIds: readonly number[];

  constructor(
    vocabSize: number,
    seed: number,
    grammar: (() => Promise<GrammarSource>) | null = null,
    eosTokenIds: readonly number[] = [],
  ) {
    this.#vocabSize = vocabSize;
    this.#grammar = grammar;
    this.#eosTokenIds = eosTokenIds;
    this.#sampler = new Sampler(vocabSize);
    this.#seeds = new Prng(seed);
    this.#copy = new Float32Array(vocabSize);
  }

  /** The seed of a request's generator: its own, else one drawn from this engine's seeds. */
  seedOf(request: GenerationRequest): number {
    return request.sampling.seed ?? this.#seeds.nextUint32();
  }

  /**
   * Readies a new sequence (its ownership set): when its request asked for the prompt's
   * log-probabilities and it computes its prompt (a decode node's does not: prefill reported them),
   * the entries to fill and the forward pass's per-row callback that fills them (made once per request).
   */
  prepare(seq: Sequence): void {
    this.#resume(seq);
    const k = seq.request.sampling.promptLogprobs;
    if (k === undefined || seq.ownership === "decode-external") return;
    const entries: (TokenLogprobs | null)[] = new Array(seq.promptLength).fill(null);
    const vocab = this.#vocabSize;
    seq.promptEntries = entries;
    // Row `index` of a step at position p predicts the prompt's token p + 1.
    seq.rowLogits = (index, logits, offset) => {
      const next = seq.stepStart + index + 1;
      if (next < seq.promptLength) entries[next] = tokenLogprobs(logits, seq.tokens[next]!, k, offset, vocab);
    };
  }

  /**
   * A request migrated mid-stream (`SamplingParams.resumedTokens` = r): the last r prompt tokens
   * are its output so far — the controls and the grammar read them as such (`seq.history`), and
   * its generator skips the r draws they took — so it samples on as the lost attempt would have.
   */
  #resume(seq: Sequence): void {
    const r = seq.request.sampling.resumedTokens ?? 0;
    if (r <= 0) return;
    seq.history = {
      tokens: seq.tokens,
      promptLength: seq.promptLength - r,
      get length() {
        return seq.length;
      },
      get generated() {
        return seq.generated + r;
      },
    };
    if (Sampler.draws(seq.request.sampling)) for (let i = 0; i < r; i++) seq.rng.next();
  }

  /** Sequences waiting for their grammar. */
  get constraining(): number {
    return this.#waiting.size;
  }

  /**
   * Runs `then` now for an unconstrained sequence; a constrained one waits (outside the scheduler)
   * for its matcher — its tenant's compiled grammar, then the tokens it already has (a decode
   * node's first token) accepted — and runs `then` unless it was dropped meanwhile; a constraint
   * that does not compile, or an engine without a grammar engine, ends it with `onError`.
   */
  constrain(seq: Sequence, then: () => void): void {
    const constraint = seq.request.sampling.constraint;
    if (constraint === undefined) {
      then();
      return;
    }
    this.#waiting.set(seq.rid, seq);
    const grammar = this.#grammar;
    if (grammar === null) {
      this.#fail(seq, {
        code: "invalid_request",
        message: "Structured output needs the model's tokenizer, which this engine was built without",
        param: "response_format",
      });
      return;
    }
    this.#grammarSource ??= grammar();
    this.#grammarSource
      .then((source) =>
        source.bind(
          seq.tenant,
          constraint,
          this.#grammarStops(seq),
          Array.from(seq.tokens.subarray(seq.history.promptLength, seq.length)),
        ),
      )
      .then(
        (matcher) => {
          if (this.#waiting.get(seq.rid) !== seq) {
            matcher.dispose();
            return;
          }
          seq.matcher = matcher;
          this.#waiting.delete(seq.rid);
          then();
        },
        (err: unknown) => this.#fail(seq, wireOf(err)),
      );
  }

  /** Frees the grammar source's resources (a grammar thread: terminated); the engine is done. */
  close(): void {
    this.#grammarSource?.then(
      (source) => source.close(),
      () => {},
    );
  }

  /** Drops a sequence waiting for its grammar (aborted); true when one was. */
  dropConstraining(rid: number): boolean {
    return this.#waiting.delete(rid);
  }

  /** Ends every sequence waiting for its grammar with `error`. */
  failConstraining(error: WireError): void {
    for (const seq of [...this.#waiting.values()]) this.#fail(seq, error);
  }

  #fail(seq: Sequence, error: WireError): void {
    if (this.#waiting.get(seq.rid) !== seq) return;
    this.#waiting.delete(seq.rid);
    seq.state = "done";
    seq.events.onError(error);
  }

  /**
   * A decode node's sequence whose first token prefill sampled from the same seeded generator:
   * skips that draw, so a seeded request samples the same tokens as on one engine (the sampler
   * draws once per token).
   */
  skipFirstDraw(seq: Sequence): void {
    if (Sampler.draws(seq.request.sampling)) seq.rng.next();
  }

  /**
   * The first tokens of a prefill-only request's later samples (n > 1 as one group), else null:
   * each from a copy of `logits` as they are before any sample's controls, under the same controls
   * and sampling parameters, with a generator of its own seed (null: one from this engine's seeds)
   * — as each sample would draw its first token alone. Call before `sample`. Runs once per group,
   * not per token.
   */
  siblings(seq: Sequence, logits: Float32Array): number[] | null {
    const r = seq.request.sampling;
    const seeds = r.sampleSeeds;
    if (seq.ownership !== "prefill-only" || seeds === undefined) return null;
    const tokens: number[] = [];
    for (const seed of seeds) {
      const copy = this.#copy;
      copy.set(logits);
      if (r.controls !== undefined) this.#sampler.process(copy, r.controls, seq.history, r.stopTokenIds);
      // Every sample starts at the grammar's start: the first sample's matcher has accepted nothing yet.
      seq.matcher?.mask(copy);
      tokens.push(this.#sampler.sample(copy, r, new Prng(seed ?? this.#seeds.nextUint32())));
    }
    return tokens;
  }

  /**
   * Draws `seq`'s next token from `logits` (its step's, changed in place by its controls and its
   * grammar's mask), keeping the raw logits first when it asked for log-probabilities; the token
   * advances its matcher.
   */
  sample(seq: Sequence, logits: Float32Array): number {
    const r = seq.request.sampling;
    if (r.logprobs !== undefined) keepRaw(seq, logits);
    if (r.controls !== undefined) this.#sampler.process(logits, r.controls, seq.history, r.stopTokenIds);
    const matcher = seq.matcher;
    if (matcher === null) return this.#sampler.sample(logits, r, seq.rng);
    matcher.mask(logits);
    const token = this.#sampler.sample(logits, r, seq.rng);
    matcher.accept(token);
    return token;
  }

  /** `logits` copied into this step's reused buffer: a forked sample draws from the copy. */
  copyOf(logits: Float32Array): Float32Array {
    this.#copy.set(logits);
    return this.#copy;
  }

  /** The sampled token's log-probabilities when the request asked (one entry, reused array), else undefined. */
  logprobs(seq: Sequence, token: number): TokenLogprobs[] | undefined {
    const k = seq.request.sampling.logprobs;
    if (k === undefined || seq.raw === null) return undefined;
    seq.sampledLogprobs[0] = tokenLogprobs(seq.raw, token, k);
    return seq.sampledLogprobs;
  }

  /**
   * True when `token` ends the request with `stop`: one of its stop tokens, or, for a constrained
   * request, one of its grammar's end tokens (a grammar ends on EOS even under `ignore_eos`: past
   * its end it allows no token, and a draw from nothing would be filler).
   */
  stops(seq: Sequence, token: number): boolean {
    if (seq.request.sampling.stopTokenIds.includes(token)) return true;
    return seq.matcher !== null && this.#grammarStops(seq).includes(token);
  }

  /** The tokens a sequence's grammar ends on: its request's stop ids, else the model's EOS ids. */
  #grammarStops(seq: Sequence): readonly number[] {
    const own = seq.request.sampling.stopTokenIds;
    return own.length > 0 ? own : this.#eosTokenIds;
  }
}

/**
 * What is wrong with a request's sampling parameters for a vocabulary of `vocabSize` (as a
 * `WireError`), or null: the sampler's own rules, then the log-probability counts.
 */
export function samplingRefusal(r: SamplingParams, vocabSize: number): WireError | null {
  try {
    Sampler.validate(r, vocabSize);
  } catch (err) {
    if (err instanceof KvfenceError) return err.toWire();
    throw err;
  }
  for (const [param, k] of [
    ["logprobs", r.logprobs],
    ["prompt_logprobs", r.promptLogprobs],
  ] as const) {
    if (k !== undefined && !(Number.isInteger(k) && k >= 0 && k <= MAX_TOP_LOGPROBS)) {
      return {
        code: "invalid_request",
        message: `${param} must be an integer from 0 to ${MAX_TOP_LOGPROBS}: ${k}`,
        param,
      };
    }
  }
  return null;
}

/** The forward pass's per-row callback for `seq`'s step when it asked for the prompt's log-probabilities and the step holds prompt rows, else null. */
export function promptRows(seq: Sequence): RowLogits | null {
  return seq.rowLogits !== null && seq.stepStart < seq.promptLength - 1 ? seq.rowLogits : null;
}

/** Keeps the step's raw logits of `seq` (the controls change them in place) for its log-probabilities. */
function keepRaw(seq: Sequence, logits: Float32Array): void {
  if (seq.raw === null) seq.raw = new Float32Array(logits.length);
  seq.raw.set(logits);
}
