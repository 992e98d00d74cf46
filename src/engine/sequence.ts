/**
 * One request inside the engine: its tokens (prompt, then generated), its block table, its seeded
 * generator, where it is (waiting, running, done) and what the current step does with it. The
 * engine (`engine.ts`), its scheduler (`scheduler.ts`) and its sampling step (`sampling-step.ts`)
 * share it; it holds state only.
 *
 * A decode step of a running request allocates nothing: the token it feeds the forward pass
 * (`decodeInput`), its step view (`step`) and the array `onTokens` receives (`sampled`) are its
 * own, reused.
 */
import type { SequenceGrammar } from "../grammar/grammar-engine.js";
import { BlockTable } from "../kvcache/block-table.js";
import { Prng } from "../lib/prng.js";
import type { TokenLogprobs } from "../lib/token-logprobs.js";
import type { StepSequence } from "../model/forward.js";
import type { TokenHistory } from "../model/sampler.js";
import type { GenerationEvents, GenerationRequest } from "../protocol/engine-api.js";
import type { TenantService } from "./tenant-shares.js";

/** Where a request is: queued for admission, in the running set, or ended (pages freed, silenced). */
export type SequenceState = "waiting" | "running" | "done";

/**
 * How a request's pages are owned (see `Engine.submitPrefill` / `Engine.submitDecode`):
 * - `local`: the engine leases, frees and preempts them (one engine serving a request end to end);
 * - `prefill-only`: a prefill node's, host-leased: compute the prompt into them, sample the first
 *   token, stop;
 * - `decode-external`: a decode node's, host-leased: the prompt's KV arrived by transfer; the host
 *   stamps the page each step writes (and, given `checkStep`, checks each step's pages).
 * The last two are never allocated, freed or preempted by the engine.
 */
export type PageOwnership = "local" | "prefill-only" | "decode-external";

export class Sequence {
  readonly request: GenerationRequest;
  readonly events: GenerationEvents;
  readonly rid: number;
  readonly tenant: number;
  /** Its tenant's account in the scheduler's fair share (set when queued). */
  service!: TenantService;
  readonly promptLength: number;
  /** Prompt, then generated tokens; `length` of them are valid. */
  readonly tokens: Int32Array;
  readonly blockTable: BlockTable;
  readonly rng: Prng;
  readonly step: StepSequence;
  /** Attempt number: bumped on preemption, so the old attempt's pages and stamps never match. */
  epoch = 0;
  length: number;
  /** Tokens whose K/V is in the pool. */
  computed = 0;
  generated = 0;
  state: SequenceState = "waiting";
  preempted = false;
  /** Tokens [stepStart, stepEnd) are in the current step. */
  stepStart = 0;
  stepEnd = 0;
  stepPrefill = false;
  inBatch = false;
  /** The step in which its prompt's chunk was held back (its tenant had its share). */
  heldAt = 0;
  /** Passed this step's page check (the forward pass computes it if it is still running). */
  checked = false;
  ownership: PageOwnership = "local";
  /** The host's check of each step (`ExternalPages.checkStep`), or null: the engine checks. */
  hostCheck: (() => boolean) | null = null;
  /** `performance.now()` when queued, and when first admitted (0: not yet). */
  queuedAt = performance.now();
  startedAt = 0;
  /** The one token of a decode step, fed to the forward pass (reused: no view per step). */
  readonly decodeInput = new Int32Array(1);
  /** The array `onTokens` receives a sampled token in (reused: listeners copy what they keep). */
  readonly sampled: number[] = [0];
  /** Log-probabilities asked for: the raw logits of the last step (the controls change the step's). */
  raw: Float32Array | null = null;
  readonly sampledLogprobs: TokenLogprobs[] = [];
  /** The prompt's log-probabilities asked for: filled as its chunks run, reported once. */
  promptEntries: (TokenLogprobs | null)[] | null = null;
  promptReported = false;
  /** A sample of n > 1 waiting to fork its first sample's prompt: that one's rid; else -1. */
  forkOf = -1;
  /** The forward pass's per-row callback that fills `promptEntries` (null: not asked). */
  rowLogits: ((index: number, logits: Float32Array, offset: number) => void) | null = null;
  /** The salt of its prefix-cache keys (null: the cache is off for it). */
  cacheSalt: string | null = null;
  /** The tenant's cache epoch (keys file `cache_epoch`): part of the salt and of each cached page. */
  cacheEpoch = 0;
  /** Prompt tokens this attempt reused from the prefix cache. */
  cachedTokens = 0;
  /** Its output constraint's place in the grammar (structured output), or null: unconstrained. */
  matcher: SequenceGrammar | null = null;
  /**
   * Its tokens as the sampler's controls and the grammar read them: itself, or for a request
   * migrated mid-stream (`SamplingParams.resumedTokens`) a view whose output starts that many
   * tokens inside its prompt (set once, by `SamplingStep.prepare`).
   */
  history: TokenHistory = this;
  #pagesView: Int32Array;

  constructor(request: GenerationRequest, events: GenerationEvents, pageSize: number, seed: number) {
    this.request = request;
    this.events = events;
    this.rid = request.rid;
    this.tenant = request.tenant;
    this.promptLength = request.promptTokens.length;
    const capacity = this.promptLength + request.maxTokens;
    this.tokens = new Int32Array(capacity);
    this.tokens.set(request.promptTokens);
    this.length = this.promptLength;
    this.blockTable = new BlockTable(Math.ceil(capacity / pageSize));
    this.rng = new Prng(seed);
    this.#pagesView = this.blockTable.pages.subarray(0, 0);
    this.step = {
      tokens: this.tokens.subarray(0, 0),
      startPos: 0,
      blockTable: this.#pagesView,
      logits: null,
    };
  }

  /** The leased pages as the forward pass wants them (a view, re-made only when pages were added). */
  pagesView(): Int32Array {
    if (this.#pagesView.length !== this.blockTable.length) {
      this.#pagesView = this.blockTable.pages.subarray(0, this.blockTable.length);
    }
    return this.#pagesView;
  }
}
