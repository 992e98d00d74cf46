/**
 * Structured output's grammar engine: an `OutputConstraint` compiled by xgrammar against a model's
 * vocabulary, and a matcher per sequence that masks each draw.
 *
 * - `GrammarEngine` (one per thread and vocabulary, `GrammarEngine.create`): compiles a constraint
 *   — `json_object` as the schema `{"type": "object"}`, `json_schema` with xgrammar's strict mode
 *   when `strict` (no properties or items beyond the schema's), `grammar` as GBNF / EBNF (start
 *   rule `root`), `regex` and `choice` through `regexToEbnf` / `choiceToEbnf` (regex-to-ebnf.ts) —
 *   into its tenant's cache (`TenantGrammarCache`), and makes matchers.
 *   Compilation is synchronous wasm: who calls it decides which thread waits (docs/structured-output.md).
 * - `ConstraintMatcher`: `mask(logits)` sets every token the grammar forbids next to −∞ (the stop
 *   tokens are the only ones left once the grammar is complete); `accept(token)` advances it.
 *   Synchronous and allocation-free in JS: the mask is read in place from wasm memory.
 * - `compileCheck(constraint, vocab)`: the router's check, in its preparation workers: compiles
 *   (nothing cached) and refuses what xgrammar cannot compile with `invalid_request`, naming the
 *   field and the construct.
 */
import { KvfenceError, type WireError } from "../lib/errors.js";
import type { OutputConstraint } from "../protocol/output-constraint.js";
import { TenantGrammarCache } from "./grammar-cache.js";
import type { GrammarVocab } from "./grammar-vocab.js";
import { jsonSchemaEbnf } from "./json-schema-ebnf.js";
import { choiceToEbnf, regexToEbnf } from "./regex-to-ebnf.js";
import { loadXgrammar, takeXgrammarError, type XgrammarBinding } from "./xgrammar-binding.js";

// biome-ignore lint/suspicious/noExplicitAny: embind objects are untyped.
type Handle = any;

/** A compiled grammar (an xgrammar handle) as the cache holds it. */
class Compiled {
  readonly handle: Handle;
  constructor(handle: Handle) {
    this.handle = handle;
  }
  dispose(): void {
    this.handle.delete();
  }
}

/** The request field a constraint's refusal names (the router's vendors all fold into these). */
export const CONSTRAINT_PARAM: Readonly<Record<OutputConstraint["kind"], string>> = {
  json_object: "response_format",
  json_schema: "response_format.json_schema.schema",
  regex: "regex",
  grammar: "grammar",
  choice: "choice",
};

/** What a refusal calls a constraint of each kind. */
export const CONSTRAINT_NAME: Readonly<Record<OutputConstraint["kind"], string>> = {
  json_object: "The JSON grammar",
  json_schema: "The JSON schema",
  regex: "The regex",
  grammar: "The grammar",
  choice: "The choice list",
};

/** A sequence's place in its grammar, as the sampling step uses it (this thread's or a grammar thread's). */
export interface SequenceGrammar {
  /** Sets every logit the grammar forbids next to −∞ (in place; `logits` spans the vocabulary). */
  mask(logits: Float32Array): void;
  /** Advances past the token just drawn. */
  accept(token: number): void;
  /** Frees it (its sequence ended). */
  dispose(): void;
}

/** Where an engine's sequences get their grammars: a `GrammarEngine` in its thread, or a `GrammarThreads`. */
export interface GrammarSource {
  /**
   * A matcher of `constraint` for a sequence of `tenant`, ending on one of `stopTokenIds`, that
   * has accepted `accepted` (a decode node's first token). Rejects with `invalid_request` when the
   * constraint does not compile.
   */
  bind(
    tenant: number,
    constraint: OutputConstraint,
    stopTokenIds: readonly number[],
    accepted: readonly number[],
  ): Promise<SequenceGrammar>;
  /** Frees what it holds (its engine is done). */
  close(): void;
}

export class GrammarEngine implements GrammarSource {
  readonly vocabSize: number;
  readonly #binding: XgrammarBinding;
  readonly #compiler: Handle;
  readonly #cache = new TenantGrammarCache<Compiled>();

  private constructor(binding: XgrammarBinding, compiler: Handle, vocabSize: number) {
    this.#binding = binding;
    this.#compiler = compiler;
    this.vocabSize = vocabSize;
  }

  /**
   * Loads xgrammar in this thread (once) and prepares `vocab` for logits of `vocabSize` (the
   * model's, which may exceed the tokenizer's ids: the rest are never allowed).
   */
  static async create(vocab: GrammarVocab, vocabSize: number): Promise<GrammarEngine> {
    const { api, binding } = await loadXgrammar();
    const info = await api.TokenizerInfo.createTokenizerInfo(
      vocab.tokens.slice(0, vocabSize),
      vocab.vocabType,
      vocab.prependSpace,
      vocabSize,
      // No stop tokens of its own: each matcher gets its request's. Left to guess them, xgrammar
      // takes `<|endoftext|>` for one, and a matcher whose request stops elsewhere then allows it
      // anywhere (an empty-text token that is neither a stop nor special) but refuses to accept it.
      [],
    );
    // xgrammar's own compile cache is keyed by the grammar alone (shared by tenants): off.
    const compiler = new binding.GrammarCompiler(info.handle, 1, false);
    info.dispose();
    return new GrammarEngine(binding, compiler, vocabSize);
  }

  /**
   * `constraint` compiled for `tenant`: from its cache, else compiled now (synchronously) and
   * kept. Throws `invalid_request` naming the field and what xgrammar refused.
   */
  compile(tenant: number, constraint: OutputConstraint): Handle {
    const key = TenantGrammarCache.key(constraint);
    const hit = this.#cache.get(tenant, key);
    if (hit !== undefined) return hit.handle;
    const compiled = new Compiled(this.compileUncached(constraint));
    this.#cache.set(tenant, key, compiled);
    return compiled.handle;
  }

  /** `constraint` compiled, not cached (the caller deletes the handle). */
  compileUncached(constraint: OutputConstraint): Handle {
    const compiler = this.#compiler;
    try {
      switch (constraint.kind) {
        case "json_object":
          // Any JSON object (xgrammar's builtin JSON grammar allows arrays too).
          return compiler.CompileJSONSchema(
            '{"type":"object"}',
            false,
            undefined,
            undefined,
            false,
            undefined,
          );
        case "json_schema":
          // One line, ", " and ": " between items: no free whitespace (a model left free to emit
          // whitespace may emit nothing else until max_tokens); strict: no extra properties. Through
          // EBNF, so that bounded and patterned strings stay valid JSON (json-schema-ebnf.ts).
          return this.#compileEbnf(
            jsonSchemaEbnf(this.#binding, constraint.schema, constraint.strict, CONSTRAINT_PARAM.json_schema),
          );
        case "grammar":
          return this.#compileEbnf(constraint.ebnf);
        case "regex":
          return this.#compileEbnf(regexToEbnf(constraint.pattern));
        case "choice":
          return this.#compileEbnf(choiceToEbnf(constraint.choices));
      }
    } catch (err) {
      if (err instanceof KvfenceError) throw err;
      const said = takeXgrammarError();
      // A misuse of the binding (its BindingError) is ours, not the request's.
      if (said === "") throw err;
      throw new KvfenceError(
        "invalid_request",
        `${CONSTRAINT_NAME[constraint.kind]} cannot be compiled: ${said}`,
        {
          param: CONSTRAINT_PARAM[constraint.kind],
          cause: err,
        },
      );
    }
  }

  #compileEbnf(ebnf: string): Handle {
    const grammar = new this.#binding.Grammar.FromEBNF(ebnf, "root");
    try {
      return this.#compiler.CompileGrammar(grammar);
    } finally {
      grammar.delete();
    }
  }

  /**
   * A matcher of `constraint` for a sequence of `tenant` (compiled or from the cache) ending on one
   * of `stopTokenIds` (the request's; none: the vocabulary's own end tokens).
   */
  matcher(tenant: number, constraint: OutputConstraint, stopTokenIds: readonly number[]): ConstraintMatcher {
    const compiled = this.compile(tenant, constraint);
    const binding = this.#binding;
    const stops = stopTokenIds.length === 0 ? undefined : binding.vecIntFromJSArray([...stopTokenIds]);
    const handle = new binding.GrammarMatcher(compiled, stops, false, -1);
    stops?.delete();
    const matcher = new ConstraintMatcher(handle, binding, this.vocabSize);
    // Its sequence's end disposes it; one that is dropped without is freed when collected.
    released.register(matcher, handle, matcher);
    return matcher;
  }

  /** `matcher`, with `accepted` accepted, compiled in this thread (the caller's wait is the compile's). */
  async bind(
    tenant: number,
    constraint: OutputConstraint,
    stopTokenIds: readonly number[],
    accepted: readonly number[],
  ): Promise<ConstraintMatcher> {
    const matcher = this.matcher(tenant, constraint, stopTokenIds);
    for (const token of accepted) matcher.accept(token);
    return matcher;
  }

  /** Nothing to free: its grammars live as long as its thread. */
  close(): void {}

  /** Compiled grammars held for `tenant` (tests). */
  cached(tenant: number): number {
    return this.#cache.size(tenant);
  }
}

/** One sequence's place in its grammar: masks its next draw, accepts what it drew. */
export class ConstraintMatcher implements SequenceGrammar {
  readonly #handle: Handle;
  readonly #binding: XgrammarBinding;
  readonly #vocabSize: number;

  constructor(handle: Handle, binding: XgrammarBinding, vocabSize: number) {
    this.#handle = handle;
    this.#binding = binding;
    this.#vocabSize = vocabSize;
  }

  /** Sets every logit the grammar forbids next to −∞ (in place; `logits` spans the vocabulary). */
  mask(logits: Float32Array): void {
    const vector = this.#handle.GetNextTokenBitmask(this.#vocabSize);
    try {
      // A view of wasm memory: read before the vector is deleted.
      maskLogits(logits, this.#binding.vecIntToView(vector), this.#vocabSize);
    } finally {
      vector.delete();
    }
  }

  /** Writes the grammar's next bitmask (32 ids a word, 1: allowed) into `target` (a grammar thread's shared slot). */
  writeMask(target: Int32Array): void {
    const vector = this.#handle.GetNextTokenBitmask(this.#vocabSize);
    try {
      target.set(this.#binding.vecIntToView(vector).subarray(0, target.length));
    } finally {
      vector.delete();
    }
  }

  /** Advances past `token`; false when the grammar does not allow it (the matcher is unchanged). */
  accept(token: number): boolean {
    return this.#handle.AcceptToken(token, false) as boolean;
  }

  /** Frees its wasm object (once; the matcher is unusable after). */
  dispose(): void {
    if (released.unregister(this)) this.#handle.delete();
  }

  /** True once a stop token was accepted. */
  get terminated(): boolean {
    return this.#handle.IsTerminated() as boolean;
  }
}

/** Sets the logits whose bit in `bitmask` (32 ids a word, 1: allowed) is 0 to −∞. */
export function maskLogits(logits: Float32Array, bitmask: Int32Array, vocabSize: number): void {
  const words = Math.ceil(vocabSize / 32);
  for (let w = 0; w < words; w++) {
    const bits = bitmask[w] as number;
    if (bits === -1) continue;
    const base = w * 32;
    const end = Math.min(32, vocabSize - base);
    for (let b = 0; b < end; b++) if ((bits & (1 << b)) === 0) logits[base + b] = Number.NEGATIVE_INFINITY;
  }
}

/** A structured-output failure as the wire carries it (a KvfenceError's own; anything else internal). */
export function wireOf(err: unknown): WireError {
  if (err instanceof KvfenceError) return err.toWire();
  return { code: "internal", message: `Structured output failed: ${(err as Error)?.message ?? String(err)}` };
}

const released = new FinalizationRegistry<Handle>((handle) => handle.delete());

const checkers = new WeakMap<GrammarVocab, Promise<GrammarEngine>>();

/**
 * The router's check of a request's constraint (in a preparation worker, off the event loop):
 * compiles it against `vocab` (not cached) and throws `invalid_request` naming the field and the
 * construct xgrammar refused.
 */
export async function compileCheck(constraint: OutputConstraint, vocab: GrammarVocab): Promise<void> {
  (await checkerFor(vocab)).compileUncached(constraint).delete();
}

/** The grammar engine `compileCheck` uses for `vocab` in this thread (made once: xgrammar loaded, the vocabulary prepared). */
export function checkerFor(vocab: GrammarVocab): Promise<GrammarEngine> {
  let engine = checkers.get(vocab);
  if (engine === undefined) {
    engine = GrammarEngine.create(vocab, vocab.tokens.length);
    checkers.set(vocab, engine);
  }
  return engine;
}
