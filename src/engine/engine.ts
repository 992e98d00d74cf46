/**
 * The continuous-batching engine: one KV page pool, one forward pass, and a scheduler that turns
 * submitted requests into batched steps. It is synchronous and single-threaded — `step()` runs one
 * forward pass — so the worker glue (`src/topology/engine-worker.ts`) drives it between messages, and
 * tests drive it directly.
 *
 * ## One step
 *
 * 1. **Decode tokens**, running requests tenant by tenant (the tenant served least lately first),
 *    each tenant's oldest first: each adds its one pending token. Pages are
 *    leased lazily, as the step needs them. When the pool runs out, the most recently admitted
 *    running request is **preempted**: its pages are freed, its epoch bumped, and it goes back to
 *    the front of the queue to be recomputed later from its prompt plus the tokens it already
 *    generated (never from its old pages).
 * 2. **Admission, and prompts, fairly between tenants.** First the waiting requests of tenants with
 *    no prompt in progress that have been served no more lately than those that have one (a
 *    tenant that was not computing goes ahead of one that was); then the running prompts' next
 *    chunks, the tenant served least lately first, within `maxPrefillTokens` per step (chunked
 *    prefill) and `maxBatchTokens` in all; then the other waiting requests: preempted ones first,
 *    then the rest by weighted fair queuing over the tokens each still has to compute
 *    (`src/lib/fair-queue.ts`). Admission needs a sequence slot, token budget and free pages for
 *    the first chunk, and stops in a step that had to preempt, to avoid thrashing.
 *    **Each step's compute is shared by deficit round robin between tenants** (`#chunk`): a
 *    tenant's recent service is the estimated compute of its tokens (`src/engine/step-cost.ts`:
 *    the matrices plus attention over the context), decayed per step (`SERVICE_DECAY`). A tenant
 *    served more lately than another tenant with work in the step adds to it — decodes and prompt
 *    chunks alike — no more compute than that tenant has in it, plus what it was owed and could
 *    not use before. On this CPU engine a step's time grows with its work, so a flood's 128-token
 *    chunk at a long context made another tenant's decode step a hundred times slower; now each of
 *    that tenant's steps costs at most about twice its own, and the flood gets the rest (every
 *    step it has alone, and its share of the others). With one tenant none of this binds: it is
 *    first-come, oldest prompt first, full chunks, as before.
 * 3. **The read guard.** Every page of every block table in the batch is checked against the
 *    ownership table (`PagePool.checkStep`: generation, owner rid/epoch, state, writer stamp, filled
 *    tokens). A request that fails is ended with `page_tag_mismatch` and counted; the rest of the
 *    batch goes on. Integer compares only. A decode node's request is checked by its host instead
 *    (`ExternalPages.checkStep`: the decode state machine, with the same rule), so each token is
 *    checked exactly once.
 * 4. **Forward**, then `PagePool.recordStep` stamps the written pages and marks fresh ones READY.
 * 5. **Sampling** for every request whose step reached its last token: its logit controls
 *    (`Sampler.process`) apply, then its per-request seeded generator draws the next token; a stop
 *    token id ends it with `stop` (the stop token is counted in usage but not reported in
 *    `onTokens`), `maxTokens` with `length`. A request that asked for log-probabilities gets them
 *    with each token (from the raw logits, before the controls), and the prompt's once, before its
 *    first token (computed row by row as its prompt's chunks run, `StepSequence.rowLogits`).
 *
 * `step()` runs these as named phases (`#scheduleDecodes`, `#admitWaiting`, `#schedulePrefills`,
 * `#checkBatch`, `#forward`, `#sample`). A decode step of a running request allocates nothing: the token it feeds
 * the forward pass and the array `onTokens` receives are the request's own, reused (listeners copy
 * what they keep). Preempted requests wait in a ring-buffer deque (admission pops its front, a
 * preempted request goes back to its front, both O(1)), the others in the fair queue.
 *
 * Abort frees a request's pages at once (nothing writes them outside `step()`), exactly once, and
 * silences it.
 *
 * The disaggregated nodes use two more doors: `submitPrefill` (compute the prompt into pages the
 * prefill state machine leased, sample the first token, stop) and `submitDecode` (continue from a
 * prompt whose KV arrived by transfer into pages the decode state machine leased). Their pages
 * belong to the host: the engine never allocates, frees or preempts them. Greedy output does not depend on batching, chunking or preemption: every token's
 * computation is per row, and recompute reproduces the same positions.
 */

import { BlockTable } from "../kvcache/block-table.js";
import { type OwnershipTable, PAGE_STATE_NAMES, PageState } from "../kvcache/ownership-table.js";
import type { PagePool } from "../kvcache/page-pool.js";
import { Deque } from "../lib/deque.js";
import type { WireError } from "../lib/errors.js";
import { KvfenceError } from "../lib/errors.js";
import { FairQueue } from "../lib/fair-queue.js";
import { PHASE, PhaseRecorder } from "../lib/phase-histograms.js";
import { Prng } from "../lib/prng.js";
import { MAX_TOP_LOGPROBS, type TokenLogprobs } from "../lib/token-logprobs.js";
import type { StepSequence } from "../model/forward.js";
import { tokenLogprobs } from "../model/logprobs.js";
import type { ModelConfig } from "../model/model-config.js";
import { Sampler } from "../model/sampler.js";
import type {
  EngineCapacity,
  EngineStats,
  GenerationEvents,
  GenerationRequest,
  PageMap,
} from "../protocol/engine-api.js";
import { PrefixCache, type PrefixCacheCounters } from "../protocol/prefix-cache.js";
import { prefixCacheSalt } from "../protocol/prefix-key.js";
import { guardOn, SAFE, type Safety } from "../protocol/safety.js";
import { StepCost } from "./step-cost.js";

/** What the engine needs from the forward pass (`ForwardPass` implements it). */
export interface StepModel {
  readonly config: ModelConfig;
  readonly maxBatchTokens: number;
  readonly maxSequences: number;
  step(pool: Float32Array | Uint16Array, sequences: readonly StepSequence[]): void;
}

export interface EngineOptions {
  /** Prefill tokens per step over all requests (chunked prefill). Default: the model's `maxBatchTokens`. */
  readonly maxPrefillTokens?: number;
  /** Context length to serve, at most the model's window. Default: the model's window. */
  readonly maxModelLen?: number;
  /**
   * Guards and faults (`src/protocol/safety.ts`); default `SAFE`. The engine honours the
   * `page-tags` guard: with it disabled (tests showing what it catches, the overhead benchmark) the
   * per-step check is skipped and the engine reads whatever its block tables point at.
   */
  readonly safety?: Safety;
  /** Seed for requests that bring none. Default: from `Math.random`. */
  readonly seed?: number;
  /** Record the per-phase histograms (src/lib/phase-histograms.ts). Default true. */
  readonly phaseMetrics?: boolean;
  /**
   * Keep the full pages of finished prefills as a tenant-fenced prefix cache (`PrefixCache`) and
   * reuse them for requests whose prompt starts with them. Default false (the server's
   * `--prefix-cache` is on by default and sets it).
   */
  readonly prefixCache?: boolean;
}

/**
 * How much of a tenant's recent service one step forgets: its compute counts for about the last
 * 1 / (1 − SERVICE_DECAY) steps (a thousand: several requests' worth, so a light tenant stays
 * light across its own prompt's burst, and a tenant that went quiet is soon light again).
 */
const SERVICE_DECAY = 0.999;

/** A tenant's share of the engine's compute, for the scheduler (`Engine.#allowance`). */
interface TenantService {
  /** Its recent service: the estimated cost (`StepCost`) of its tokens, decayed per step, as of `step`. */
  value: number;
  step: number;
  /**
   * The cost of its work in step `costStep`; `costStep` is the current step when it has work in
   * it or was held back in it (then it is in the step's list of tenants).
   */
  stepCost: number;
  costStep: number;
  /** Compute it was owed at the end of step `creditStep` and did not use (deficit round robin). */
  credit: number;
  creditStep: number;
  /** It had more work than its share in step `heldStep`. */
  heldStep: number;
  /** `#scheduleDecodes` listed it in step `orderStep`, with recent service `orderRecent`. */
  orderStep: number;
  orderRecent: number;
}

/**
 * Decode steps timed together for the inter-token latency: the clock is read once per window, not
 * per token, because every clock read allocates (measured: 100–750 bytes a read inside a decode
 * step) and a decode token allocates nothing (src/node/decode-node.test.ts). Each token of the
 * window is observed at the window's mean step period — the time between two tokens of every
 * request decoding through it; a step without decode tokens, or the engine going idle, closes a
 * window early. The router observes each token's own gap as the client sees it.
 */
const ITL_WINDOW = 1024;

/** Where a request is: queued for admission, in the running set, or ended (pages freed, silenced). */
type SequenceState = "waiting" | "running" | "done";

/**
 * How a request's pages are owned (see `Engine.submitPrefill` / `Engine.submitDecode`):
 * - `local`: the engine leases, frees and preempts them (one engine serving a request end to end);
 * - `prefill-only`: a prefill node's, host-leased: compute the prompt into them, sample the first
 *   token, stop;
 * - `decode-external`: a decode node's, host-leased: the prompt's KV arrived by transfer; the host
 *   stamps the page each step writes (and, given `checkStep`, checks each step's pages).
 * The last two are never allocated, freed or preempted by the engine.
 */
type PageOwnership = "local" | "prefill-only" | "decode-external";

/** What `#schedule` did with a running request. */
type ScheduleOutcome =
  /** In this step's batch. */
  | "scheduled"
  /** It was the newest running request and went back to the queue to free pages. */
  | "preempted"
  /** Alone and still short of pages (held outside this engine): ended with `pool_exhausted`. */
  | "failed";

/** Pages a host (a protocol state machine) leased for a request, in logical order. */
export interface ExternalPages {
  /** The protocol attempt that holds the pages; the engine checks and stamps under it. */
  readonly epoch: number;
  readonly pages: readonly { readonly page: number; readonly generation: number }[];
  /**
   * Decode only: the host's page-tag check of the request's next step, run before its forward pass
   * in place of the engine's own `PagePool.checkStep` (the decode node's state machine owns the
   * check of its committed requests, with the same rule set, so a token is checked once). False:
   * the host failed the request and reported it; the engine drops it without an event. Without it
   * the engine checks the pages itself.
   */
  readonly checkStep?: () => boolean;
  /**
   * Prefill only: the first `cachedPages` pages are prefix-cache references (SHARED, computed
   * already, read-only); the engine computes from the first page after them. Default 0.
   */
  readonly cachedPages?: number;
}

/** One request inside the engine. */
class Sequence {
  readonly request: GenerationRequest;
  readonly events: GenerationEvents;
  readonly rid: number;
  readonly tenant: number;
  /** Its tenant's service (set when queued). */
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
  /** Prompt tokens this attempt reused from the prefix cache. */
  cachedTokens = 0;
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

export class Engine {
  readonly capacity: EngineCapacity;
  readonly pool: PagePool;
  /** The model's config (the forward pass's). */
  readonly modelConfig: ModelConfig;
  /** This engine's per-phase histograms (queue wait, prefill, first token, inter-token); a node adds its own phases. */
  readonly phases: PhaseRecorder;
  readonly #model: StepModel;
  readonly #cost: StepCost;
  readonly #maxPrefillTokens: number;
  readonly #maxBatchTokens: number;
  readonly #maxSequences: number;
  readonly #contextTokens: number;
  readonly #tagCheck: boolean;
  readonly #safety: Safety;
  /** The prefix cache of this engine's pool (local requests only), or null when off. */
  readonly #cache: PrefixCache | null;
  readonly #seeds: Prng;
  readonly #sampler: Sampler;
  readonly #byRid = new Map<number, Sequence>();
  /** Waiting requests, fair between tenants (costed by the tokens each still has to compute). */
  readonly #waiting = new FairQueue<Sequence>({
    flow: (seq) => seq.tenant,
    cost: (seq) => seq.length - seq.computed,
  });
  /** Preempted requests: admitted before any other, oldest preemption last. */
  readonly #preempted = new Deque<Sequence>();
  readonly #running: Sequence[] = [];
  /**
   * This step's batch: its first `#batchLength` entries. Neither array here is ever truncated to
   * length 0 — V8 drops an array's backing store then, and the next push allocates a new one: that
   * was two allocations per step.
   */
  readonly #batch: (Sequence | null)[] = [];
  #batchLength = 0;
  /** `#stepViews[k]`: an array of exactly k step sequences, refilled for a step that runs k. */
  readonly #stepViews: StepSequence[][] = [];
  #stepCount = 0;
  /** What a step view holds between steps (so it keeps no ended request alive). */
  readonly #idleStep: StepSequence = {
    tokens: new Int32Array(0),
    startPos: 0,
    blockTable: new Int32Array(0),
    logits: null,
  };
  readonly #logits: Float32Array[] = [];
  #tokenBudget = 0;
  #prefillBudget = 0;
  /** This step's tenants with a prompt in progress (`#markPrefillTenants`). */
  readonly #prefillTenants: Uint32Array;
  #prefillTenantCount = 0;
  /** The least recent service among them (Infinity: none). */
  #leastRecentPrefill = Number.POSITIVE_INFINITY;
  /** Each tenant's service. */
  readonly #services = new Map<number, TenantService>();
  /** The services of the tenants with work in this step, or held back in it: the first `#stepTenantCount`. */
  readonly #stepTenants: TenantService[] = [];
  #stepTenantCount = 0;
  /** The tenants with running requests, served least lately first (`#scheduleDecodes`). */
  readonly #tenantOrder: TenantService[] = [];
  #stepNumber = 0;
  /** May a waiting request of `tenant` start before the running prompts' chunks (made once). */
  readonly #fresh = (tenant: number, front: Sequence): boolean =>
    !this.#isPrefillTenant(tenant) &&
    this.#recent(front.service) <= this.#leastRecentPrefill &&
    this.#mayCompute(front);
  /** May a waiting request start in this step: its tenant has not had its share of it (made once). */
  readonly #mayCompute = (front: Sequence): boolean => this.#chunk(front, 1) > 0;
  readonly #mayComputeFlow = (_tenant: number, front: Sequence): boolean => this.#mayCompute(front);
  #preemptedThisStep = false;
  /**
   * The inter-token window: open or not, its start (`performance.now()`), its steps and decode
   * tokens. (Open is its own flag: comparing the start with 0 on every step boxed the double in
   * V8 13's Maglev tier, 10 bytes a step on Node 24.)
   */
  #itlOpen = false;
  readonly #itlStart = new Float64Array(1);
  #itlSteps = 0;
  #itlTokens = 0;
  /** Decode tokens (not a request's first) sampled this step. */
  #stepDecodeTokens = 0;
  readonly #counters = {
    tagCheckFailures: 0,
    preemptions: 0,
    aborts: 0,
    promptTokens: 0,
    completionTokens: 0,
    prefillTokens: 0,
    forkedSamples: 0,
    decodeSteps: 0,
  };
  /** Samples of n > 1 waiting for their first sample's prompt (by its rid), to fork it. */
  readonly #forks = new Map<number, Sequence[]>();
  /** A fork's copy of the first sample's raw logits, for each sample to draw from. */
  readonly #forkLogits: Float32Array;

  constructor(model: StepModel, pool: PagePool, options: EngineOptions = {}) {
    const config = model.config;
    this.modelConfig = config;
    if (
      pool.layout.numLayers !== config.numLayers ||
      pool.layout.numKvHeads !== config.numKvHeads ||
      pool.layout.headDim !== config.headDim
    ) {
      throw new KvfenceError(
        "layout_mismatch",
        `KV pool layout does not match the model: pool ${pool.layout.numLayers}/${pool.layout.numKvHeads}/${pool.layout.headDim}, model ${config.numLayers}/${config.numKvHeads}/${config.headDim} (layers/kvHeads/headDim)`,
      );
    }
    const maxModelLen = options.maxModelLen ?? config.maxPositionEmbeddings;
    if (!Number.isInteger(maxModelLen) || maxModelLen < 1 || maxModelLen > config.maxPositionEmbeddings) {
      throw new KvfenceError(
        "config_invalid",
        `maxModelLen must be an integer from 1 to the model's window of ${config.maxPositionEmbeddings}: ${maxModelLen}`,
      );
    }
    const maxPrefillTokens = options.maxPrefillTokens ?? model.maxBatchTokens;
    if (
      !Number.isInteger(maxPrefillTokens) ||
      maxPrefillTokens < 1 ||
      maxPrefillTokens > model.maxBatchTokens
    ) {
      throw new KvfenceError(
        "config_invalid",
        `maxPrefillTokens must be an integer from 1 to maxBatchTokens (${model.maxBatchTokens}): ${maxPrefillTokens}`,
      );
    }
    this.#model = model;
    this.#cost = new StepCost(config);
    this.pool = pool;
    this.#maxPrefillTokens = maxPrefillTokens;
    this.#maxBatchTokens = model.maxBatchTokens;
    this.#maxSequences = model.maxSequences;
    this.#contextTokens = Math.min(maxModelLen, pool.capacityTokens);
    this.#tagCheck = guardOn(options.safety ?? SAFE, "page-tags");
    this.phases = new PhaseRecorder(options.phaseMetrics ?? true);
    this.#safety = options.safety ?? SAFE;
    this.#tagCheck = guardOn(this.#safety, "page-tags");
    this.#cache =
      options.prefixCache === true ? new PrefixCache(pool.table, pool.pageSize, this.#safety) : null;
    this.#sampler = new Sampler(config.vocabSize);
    this.#seeds = new Prng(options.seed ?? Math.floor(Math.random() * 0x1_0000_0000));
    this.capacity = Object.freeze({
      poolTokens: pool.capacityTokens,
      pageSize: pool.pageSize,
      maxModelLen,
      maxSequences: model.maxSequences,
    });
    this.#prefillTenants = new Uint32Array(this.#maxSequences);
    this.#forkLogits = new Float32Array(config.vocabSize);
    for (let i = 0; i < this.#maxSequences; i++) this.#logits.push(new Float32Array(config.vocabSize));
    for (let k = 0; k <= this.#maxSequences; k++)
      this.#stepViews.push(Array.from({ length: k }, () => this.#idleStep));
  }

  /** Tokens one request may span (prompt + max_tokens): the lesser of the context length and the pool. */
  get contextTokens(): number {
    return this.#contextTokens;
  }

  /** True while any request is waiting or running. */
  get busy(): boolean {
    return this.#byRid.size > 0;
  }

  /**
   * Queues a request. A request that cannot be served (over the context, bad token ids, a rid in
   * use) gets `onError` before this returns, and nothing is allocated for it.
   */
  submit(request: GenerationRequest, events: GenerationEvents): void {
    const seq = this.#admit(request, events);
    if (seq === null) return;
    const first = request.sample === undefined ? undefined : this.#byRid.get(request.sample.of);
    if (first !== undefined && first.ownership === "local" && first.generated === 0 && first.forkOf < 0) {
      // A sample of n > 1: it waits for its first sample's prompt, then forks it (`#fork`).
      seq.forkOf = first.rid;
      seq.service = this.#serviceOf(seq.tenant);
      this.#byRid.set(seq.rid, seq);
      this.#counters.promptTokens += seq.promptLength;
      const list = this.#forks.get(first.rid);
      if (list === undefined) this.#forks.set(first.rid, [seq]);
      else list.push(seq);
      return;
    }
    this.#enqueue(seq);
  }

  /** The door check, then the request's sequence (its seed drawn if it has none); null when refused. */
  #admit(request: GenerationRequest, events: GenerationEvents): Sequence | null {
    const refusal = this.#doorCheck(request);
    if (refusal !== null) {
      events.onError(refusal);
      return null;
    }
    const seed = request.seed ?? this.#seeds.nextUint32();
    const seq = new Sequence(request, events, this.pool.pageSize, seed);
    const k = request.promptLogprobs;
    if (k !== undefined) {
      const entries: (TokenLogprobs | null)[] = new Array(seq.promptLength).fill(null);
      const vocab = this.#model.config.vocabSize;
      seq.promptEntries = entries;
      // Row `index` of a step at position p predicts the prompt's token p + 1.
      seq.rowLogits = (index, logits, offset) => {
        const next = seq.stepStart + index + 1;
        if (next < seq.promptLength)
          entries[next] = tokenLogprobs(logits, seq.tokens[next]!, k, offset, vocab);
      };
    }
    if (this.#cache !== null)
      seq.cacheSalt = prefixCacheSalt(
        this.#safety,
        request.tenant,
        request.cacheSalt ?? null,
        request.cacheScope ?? "",
      );
    return seq;
  }

  #enqueue(seq: Sequence): void {
    seq.service = this.#serviceOf(seq.tenant);
    this.#byRid.set(seq.rid, seq);
    this.#waiting.push(seq);
    this.#counters.promptTokens += seq.promptLength;
  }

  /** The tenant's fair-share account in this engine's scheduler (made on its first request). */
  #serviceOf(tenant: number): TenantService {
    let service = this.#services.get(tenant);
    if (service === undefined) {
      service = {
        value: 0,
        step: this.#stepNumber,
        stepCost: 0,
        costStep: -1,
        credit: 0,
        creditStep: -1,
        heldStep: -1,
        orderStep: -1,
        orderRecent: 0,
      };
      this.#services.set(tenant, service);
    }
    return service;
  }

  /**
   * Queues a prefill-only request (the prefill node): its prompt's KV is computed, in chunks, into
   * `pages`, which the host already leased to `(rid, pages.epoch)`; the engine stamps and marks them
   * READY as it writes them, samples the first token, reports it with `onTokens` then
   * `onFinish("length")`, and leaves the pages to the host (never frees or preempts them).
   */
  submitPrefill(request: GenerationRequest, pages: ExternalPages, events: GenerationEvents): void {
    this.#submitExternal(request, events, { pages, ownership: "prefill-only", firstToken: -1 });
  }

  /**
   * Queues a request whose prompt KV is already in `pages` (the decode node, after the transfer
   * committed): `request.promptTokens` only gives the prompt's length (the ids are not read),
   * `firstToken` was sampled by prefill. Before every step the page tags are checked — by the host
   * when `pages.checkStep` is given (the decode state machine's `check` event), else by the engine
   * — and each sampled token is reported; the host stamps the page each step writes (the decode
   * state machine's `step` event, fed from `onTokens`) and owns the pages (the engine never frees
   * them).
   */
  submitDecode(
    request: GenerationRequest,
    pages: ExternalPages,
    firstToken: number,
    events: GenerationEvents,
  ): void {
    this.#submitExternal(request, events, { pages, ownership: "decode-external", firstToken });
  }

  #submitExternal(
    request: GenerationRequest,
    events: GenerationEvents,
    external: {
      readonly pages: ExternalPages;
      readonly ownership: PageOwnership;
      readonly firstToken: number;
    },
  ): void {
    const { pages, ownership, firstToken } = external;
    const seq = this.#admit(request, events);
    if (seq === null) return;
    if (pages.pages.length > seq.blockTable.capacity) {
      events.onError({
        code: "internal",
        message: `Request ${request.rid} brings more pages than its prompt and max_tokens span: ${pages.pages.length}`,
      });
      return;
    }
    seq.ownership = ownership;
    seq.epoch = pages.epoch;
    // The host owns the pages and its cache: this engine's cache never takes them.
    seq.cacheSalt = null;
    const cached = ownership === "prefill-only" ? (pages.cachedPages ?? 0) : 0;
    pages.pages.forEach((p, i) => {
      seq.blockTable.push(p.page, p.generation, i < cached);
    });
    seq.computed = cached * this.pool.pageSize;
    seq.cachedTokens = seq.computed;
    if (ownership === "decode-external") {
      seq.hostCheck = pages.checkStep ?? null;
      seq.computed = seq.promptLength;
      seq.tokens[seq.length++] = firstToken;
      seq.generated = 1;
      // Prefill drew the first token from the same seeded generator: skip its draw, so a seeded
      // request samples the same tokens as on one engine (the sampler draws once per token).
      if (Sampler.draws(request)) seq.rng.next();
    }
    this.#enqueue(seq);
  }

  /** Ends a request wherever it is, freeing its pages exactly once; unknown or finished rids are ignored. */
  abort(rid: number): void {
    const seq = this.#byRid.get(rid);
    if (seq === undefined) return;
    this.#counters.aborts++;
    this.#end(seq);
  }

  /** Ends every request with `error` (shutdown). */
  failAll(error: WireError): void {
    for (const seq of [...this.#byRid.values()]) {
      this.#end(seq);
      seq.events.onError(error);
    }
  }

  stats(): EngineStats {
    const preempted = this.#preempted.length;
    const stats: EngineStats = {
      pages: this.pool.counts(),
      queue: { waiting: this.#waiting.length + preempted, running: this.#running.length, preempted },
      counters: { ...this.#counters },
      phases: this.phases.snapshot(),
      pageMap: pageMapOf(this.pool.table),
    };
    if (this.#cache !== null) stats.prefixCache = this.prefixCacheStats()!;
    return stats;
  }

  /** The prefix cache of this engine's pool (a prefill node's host drives it too), or null when off. */
  get prefixCache(): PrefixCache | null {
    return this.#cache;
  }

  /** The prefix cache's counters and pages, or null when it is off. */
  prefixCacheStats(): (PrefixCacheCounters & { sharedPages: number; evictablePages: number }) | null {
    const cache = this.#cache;
    if (cache === null) return null;
    return { ...cache.counters, sharedPages: cache.size, evictablePages: cache.evictable() };
  }

  /** The running requests' block tables (read-only use: diagnostics and the tag-check benchmark). */
  liveBlockTables(): { rid: number; epoch: number; computed: number; blockTable: BlockTable }[] {
    return this.#running.map((s) => ({
      rid: s.rid,
      epoch: s.epoch,
      computed: s.computed,
      blockTable: s.blockTable,
    }));
  }

  /**
   * Runs one scheduling step and its forward pass. Returns true while work remains (call again),
   * false when the engine is idle.
   */
  step(): boolean {
    if (this.#byRid.size === 0) return false;
    this.#tokenBudget = this.#maxBatchTokens;
    this.#prefillBudget = this.#maxPrefillTokens;
    this.#stepNumber++;
    this.#preemptedThisStep = false;
    this.#scheduleDecodes();
    this.#markPrefillTenants();
    this.#admitWaiting(true);
    this.#schedulePrefills();
    this.#admitWaiting(false);
    this.#stepDecodeTokens = 0;
    if (this.#checkBatch() > 0) {
      this.#forward();
      this.#sample();
    }
    this.#endStep();
    if (this.#stepDecodeTokens > 0) this.#counters.decodeSteps++;
    this.#timeDecodeStep();
    return this.#byRid.size > 0;
  }

  /**
   * Phase 1: the running requests' decode tokens, tenant by tenant, the one served least lately
   * first, each tenant's oldest first, within its share of the step (`#chunk`). With one tenant:
   * oldest first.
   */
  #scheduleDecodes(): void {
    const running = this.#running;
    const order = this.#tenantOrder;
    let tenants = 0;
    for (let i = 0; i < running.length; i++) {
      const service = running[i]!.service;
      if (service.orderStep === this.#stepNumber) continue;
      service.orderStep = this.#stepNumber;
      // Insertion by recent service: a handful of tenants. The sort key is kept in a field, not in a
      // local: V8 13's Maglev tier boxed the double `#recent` returned, 16 bytes a step (Node 24).
      service.orderRecent = this.#recent(service);
      let k = tenants++;
      for (; k > 0 && order[k - 1]!.orderRecent > service.orderRecent; k--) order[k] = order[k - 1]!;
      order[k] = service;
    }
    for (let k = 0; k < tenants; k++) {
      const tenant = order[k]!;
      for (let i = 0; i < running.length; i++) {
        const seq = running[i]!;
        if (
          seq.service !== tenant ||
          seq.inBatch ||
          seq.length - seq.computed !== 1 ||
          this.#tokenBudget <= 0 ||
          (tenants > 1 && this.#chunk(seq, 1) === 0)
        )
          continue;
        if (this.#schedule(seq, 1, false) === "failed") i--;
      }
    }
  }

  /**
   * Phase 3: the next chunk of the running prompts, the tenant served least lately first (ties:
   * oldest first), each taking what the step has left and what its tenant's share allows
   * (`#chunk`); a prompt whose tenant had its share waits for a later step.
   */
  #schedulePrefills(): void {
    const running = this.#running;
    for (;;) {
      let best: Sequence | null = null;
      // (Not Infinity: V8 13's Maglev tier boxed that constant on every call, 16 bytes a step.)
      let bestRecent = 0;
      for (let i = 0; i < running.length; i++) {
        const seq = running[i]!;
        if (seq.inBatch || seq.length - seq.computed <= 1 || seq.heldAt === this.#stepNumber) continue;
        const recent = this.#recent(seq.service);
        if (best === null || recent < bestRecent) {
          best = seq;
          bestRecent = recent;
        }
      }
      if (best === null) return;
      const n = Math.min(best.length - best.computed, this.#prefillBudget, this.#tokenBudget);
      if (n <= 0) return;
      const fair = this.#chunk(best, n);
      if (fair <= 0) best.heldAt = this.#stepNumber;
      else this.#schedule(best, fair, true);
    }
  }

  /**
   * How many of `n` tokens of `seq` its tenant may add to this step: deficit round robin over each
   * step's compute (`StepCost`). A tenant served more lately than another tenant with work in the
   * step may add no more compute than the most that tenant has in it, plus what it was owed and
   * did not use in the steps before (`credit`: a decode or a prompt token that costs more than
   * its share waits until its owed share covers it). So a flood's prompt chunks and long-context
   * decodes make another tenant's step cost at most about twice its own, and the flood gets every
   * step's rest. The tenant served least lately, and a tenant alone, are not held back. A tenant
   * held back is listed in the step (`#touch`) so that it keeps what it is owed.
   */
  #chunk(seq: Sequence, n: number): number {
    const allowance = this.#allowance(seq.service);
    if (allowance === Number.POSITIVE_INFINITY) return n;
    const fit = Math.min(n, this.#cost.tokensWithin(seq.computed, allowance));
    if (fit < n) {
      this.#touch(seq.service);
      seq.service.heldStep = this.#stepNumber;
    }
    return fit;
  }

  /** The compute `service`'s tenant may still add to this step (Infinity: no bound). See `#chunk`. */
  #allowance(service: TenantService): number {
    const lighter = this.#lighterCost(service);
    if (lighter < 0) return Number.POSITIVE_INFINITY;
    const credit = service.creditStep === this.#stepNumber - 1 ? service.credit : 0;
    const own = service.costStep === this.#stepNumber ? service.stepCost : 0;
    return credit + lighter - own;
  }

  /** The most work in this step of a tenant served less lately than `service`'s; -1: none. */
  #lighterCost(service: TenantService): number {
    const mine = this.#recent(service);
    let lighter = -1;
    for (let i = 0; i < this.#stepTenantCount; i++) {
      const t = this.#stepTenants[i]!;
      if (t !== service && t.stepCost > 0 && t.value < mine) lighter = Math.max(lighter, t.stepCost);
    }
    return lighter;
  }

  /**
   * Records the tenants with a prompt in progress (`#prefillTenants`) and the least recent
   * service among them. Allocates nothing.
   */
  #markPrefillTenants(): void {
    this.#prefillTenantCount = 0;
    this.#leastRecentPrefill = Number.POSITIVE_INFINITY;
    const running = this.#running;
    for (let i = 0; i < running.length; i++) {
      const seq = running[i]!;
      if (seq.length - seq.computed > 1) this.#markPrefillTenant(seq);
    }
  }

  #markPrefillTenant(seq: Sequence): void {
    if (this.#isPrefillTenant(seq.tenant)) return;
    this.#prefillTenants[this.#prefillTenantCount++] = seq.tenant;
    this.#leastRecentPrefill = Math.min(this.#leastRecentPrefill, this.#recent(seq.service));
  }

  #isPrefillTenant(tenant: number): boolean {
    const tenants = this.#prefillTenants;
    for (let j = 0; j < this.#prefillTenantCount; j++) if (tenants[j] === tenant) return true;
    return false;
  }

  /** A tenant's recent service as of this step (each step's worth decayed by `SERVICE_DECAY`). */
  #recent(service: TenantService): number {
    const age = this.#stepNumber - service.step;
    return age === 0 ? service.value : service.value * SERVICE_DECAY ** age;
  }

  /** `seq`'s tenant is served tokens [seq.computed, seq.computed + n) in this step (negative n: taken back). */
  #served(seq: Sequence, start: number, n: number): void {
    const service = seq.service;
    this.#touch(service);
    const cost = n > 0 ? this.#cost.of(start, n) : -this.#cost.of(start, -n);
    service.value += cost;
    service.stepCost += cost;
  }

  /** Lists `service`'s tenant in this step (its recent service brought up to date). */
  #touch(service: TenantService): void {
    if (service.costStep === this.#stepNumber) return;
    service.value = this.#recent(service);
    service.step = this.#stepNumber;
    service.costStep = this.#stepNumber;
    service.stepCost = 0;
    this.#stepTenants[this.#stepTenantCount++] = service;
  }

  /**
   * Phase 2: admission while sequence slots, budget and pages last (not after a preemption).
   * First (`newcomers`) the waiting requests of tenants with no prompt in progress and no more
   * recent service than those with one, one prompt per tenant, before the running prompts take
   * their chunks. Then (after the chunks) the rest: preempted requests first, then the waiting
   * ones fairly between tenants (`FairQueue`: a tenant's backlog of long prompts does not hold
   * another tenant's short one behind it all). A prompt's first chunk is bounded by its tenant's
   * share of the step (`#chunk`), as the running prompts' chunks are.
   */
  #admitWaiting(newcomers: boolean): void {
    const running = this.#running;
    if (newcomers && this.#preempted.length > 0) return;
    while (!this.#preemptedThisStep && running.length < this.#maxSequences) {
      const seq = newcomers
        ? this.#waiting.peek(this.#fresh)
        : (this.#preempted.peekFront() ?? this.#waiting.peek(this.#mayComputeFlow));
      if (seq === undefined) break;
      const n = this.#firstChunk(seq);
      if (n <= 0) break;
      const prefill = seq.length - seq.computed > 1;
      if (seq.preempted) this.#preempted.popFront();
      else this.#waiting.take();
      if (seq.startedAt === 0) {
        seq.startedAt = performance.now();
        this.phases.observe(PHASE.queue_wait, (seq.startedAt - seq.queuedAt) / 1000);
      }
      seq.state = "running";
      seq.preempted = false;
      running.push(seq);
      this.#addToBatch(seq, n, prefill);
      if (prefill) this.#markPrefillTenant(seq);
    }
  }

  /**
   * Phase 3: the read guard of every request in the batch (the host's check for a decode node's
   * request, else `PagePool.checkStep`), and the forward pass's view of those that pass. Returns
   * how many sequences the forward pass runs.
   */
  #checkBatch(): number {
    const batch = this.#batch;
    let logitsUsed = 0;
    for (let b = 0; b < this.#batchLength; b++) {
      const seq = batch[b]!;
      if (seq.hostCheck !== null) {
        // The host reported a failure itself (and may have aborted the request already).
        if (!seq.hostCheck()) {
          this.#end(seq);
          continue;
        }
        if (seq.state !== "running") continue;
      } else if (this.#tagCheck) {
        const bad = this.pool.checkStep(
          seq.blockTable,
          seq.rid,
          seq.epoch,
          seq.stepStart,
          seq.stepEnd,
          seq.tenant,
        );
        if (bad >= 0) {
          this.#counters.tagCheckFailures++;
          this.#fail(seq, this.#tagError(seq, bad));
          continue;
        }
      }
      const s = seq.step;
      if (seq.stepEnd - seq.stepStart === 1) {
        seq.decodeInput[0] = seq.tokens[seq.stepStart]!;
        s.tokens = seq.decodeInput;
      } else s.tokens = seq.tokens.subarray(seq.stepStart, seq.stepEnd);
      s.startPos = seq.stepStart;
      s.blockTable = seq.pagesView();
      s.logits = seq.stepEnd === seq.length ? this.#logits[logitsUsed++]! : null;
      s.rowLogits = promptRows(seq);
      seq.checked = true;
    }
    let count = 0;
    for (let b = 0; b < this.#batchLength; b++) if (this.#runs(batch[b]!)) count++;
    const view = this.#stepViews[count]!;
    let k = 0;
    for (let b = 0; b < this.#batchLength; b++) {
      const seq = batch[b]!;
      if (this.#runs(seq)) view[k++] = seq.step;
    }
    this.#stepCount = count;
    return count;
  }

  /** True when `seq` passed this step's check and is still running: the forward pass computes it. */
  #runs(seq: Sequence): boolean {
    return seq.checked && seq.state === "running";
  }

  /** Phase 4: the forward pass, then stamp what it wrote (a decode node's host stamps its own). */
  #forward(): void {
    this.#model.step(this.pool.data, this.#stepViews[this.#stepCount]!);
    const batch = this.#batch;
    for (let b = 0; b < this.#batchLength; b++) {
      const seq = batch[b]!;
      if (!this.#runs(seq)) continue;
      if (seq.ownership !== "decode-external")
        this.pool.recordStep(seq.blockTable, seq.rid, seq.epoch, seq.stepStart, seq.stepEnd);
      if (seq.stepStart < seq.promptLength)
        this.#counters.prefillTokens += Math.min(seq.stepEnd, seq.promptLength) - seq.stepStart;
      seq.computed = seq.stepEnd;
      if (seq.cacheSalt !== null && seq.stepStart < seq.promptLength && seq.stepEnd >= seq.promptLength)
        this.#insertPrefix(seq, seq.promptLength);
    }
  }

  /** Phase 5: sample where a step reached the last token; report. Events may re-enter (abort). */
  #sample(): void {
    const batch = this.#batch;
    for (let b = 0; b < this.#batchLength; b++) {
      const seq = batch[b]!;
      const logits = seq.step.logits;
      if (!this.#runs(seq) || logits === null || seq.computed !== seq.length) continue;
      if (seq.generated === 0 && this.#forks.has(seq.rid)) this.#fork(seq, logits);
      this.#sampleOne(seq, logits);
    }
  }

  /**
   * The first sample of n > 1 computed its prompt: each sample waiting for it gets pages of its own,
   * a copy of the prompt's KV (read under the first sample's tag check, stamped as the sample's own),
   * and draws its first token from the same logits with its own generator. A sample that cannot
   * fork (no pages or sequence slot now, a failed check) waits as an ordinary request instead.
   */
  #fork(first: Sequence, logits: Float32Array): void {
    const samples = this.#forks.get(first.rid)!;
    this.#forks.delete(first.rid);
    const pool = this.pool;
    const pages = Math.ceil(first.promptLength / pool.pageSize);
    const readable =
      !this.#tagCheck ||
      pool.checkStep(first.blockTable, first.rid, first.epoch, first.promptLength, first.promptLength) < 0;
    for (const seq of samples) {
      seq.forkOf = -1;
      if (seq.state === "done") continue;
      if (
        !readable ||
        this.#running.length >= this.#maxSequences ||
        !pool.allocate(pages, seq.rid, seq.epoch, seq.tenant, seq.blockTable)
      ) {
        this.#waiting.push(seq);
        continue;
      }
      const pf = pool.pageFloats;
      for (let j = 0; j < pages; j++) {
        const from = first.blockTable.pages[j]! * pf;
        pool.data.copyWithin(seq.blockTable.pages[j]! * pf, from, from + pf);
      }
      pool.recordStep(seq.blockTable, seq.rid, seq.epoch, 0, seq.promptLength);
      seq.computed = seq.promptLength;
      seq.state = "running";
      // Its prompt was computed with the first sample's: the same prefill phase.
      seq.startedAt = first.startedAt;
      this.#running.push(seq);
      this.#counters.forkedSamples++;
      this.#forkLogits.set(logits);
      this.#sampleOne(seq, this.#forkLogits);
    }
  }

  /** The phases a sampled token ends: prefill and first token (the first), or inter-token. */
  #timeToken(seq: Sequence): void {
    if (seq.ownership !== "decode-external" && seq.generated === 1) {
      const now = performance.now();
      this.phases.observe(PHASE.prefill, (now - seq.startedAt) / 1000);
      if (seq.ownership === "local") this.phases.observe(PHASE.first_token, (now - seq.queuedAt) / 1000);
    } else this.#stepDecodeTokens++;
  }

  /**
   * After a step: a window of `ITL_WINDOW` decode steps observes its tokens' inter-token latency; a
   * step without decode tokens, or the engine going idle, closes the window early.
   */
  #timeDecodeStep(): void {
    if (!this.phases.enabled) return;
    const start = this.#itlStart;
    if (this.#stepDecodeTokens > 0 && !this.#itlOpen) {
      // A window opens at the end of its first decode step (that step's tokens have no timed gap).
      this.#itlOpen = true;
      start[0] = performance.now();
      return;
    }
    if (this.#stepDecodeTokens > 0) {
      this.#itlSteps++;
      this.#itlTokens += this.#stepDecodeTokens;
      if (this.#itlSteps < ITL_WINDOW && this.#byRid.size > 0) return;
    } else if (!this.#itlOpen) return;
    if (this.#itlSteps > 0) {
      const now = performance.now();
      this.phases.observeMany(PHASE.inter_token, (now - start[0]!) / 1000 / this.#itlSteps, this.#itlTokens);
      this.#itlOpen = this.#stepDecodeTokens > 0 && this.#byRid.size > 0;
      start[0] = now;
    } else this.#itlOpen = false;
    this.#itlSteps = 0;
    this.#itlTokens = 0;
  }

  /** Draws `seq`'s next token from `logits` (its step's, changed in place by its controls); reports. */
  #sampleOne(seq: Sequence, logits: Float32Array): void {
    const r = seq.request;
    // A prefill node's group of n > 1: the later samples draw their first tokens from these logits too.
    const siblings =
      seq.ownership === "prefill-only" && r.sampleSeeds !== undefined
        ? this.#sampleSiblings(seq, logits, r.sampleSeeds)
        : null;
    if (r.logprobs !== undefined) keepRaw(seq, logits);
    if (r.controls !== undefined) this.#sampler.process(logits, r.controls, seq, r.stopTokenIds);
    const token = this.#sampler.sample(logits, r, seq.rng);
    seq.tokens[seq.length++] = token;
    seq.generated++;
    this.#counters.completionTokens++;
    seq.sampled[0] = token;
    this.#timeToken(seq);
    const lp = this.#logprobsOf(seq, token);
    if (seq.promptEntries !== null && !seq.promptReported) {
      seq.promptReported = true;
      seq.events.onPromptLogprobs?.(seq.promptEntries);
    }
    if (seq.ownership === "prefill-only") {
      this.#end(seq);
      seq.events.onTokens(siblings === null ? seq.sampled : [token, ...siblings], lp);
      seq.events.onFinish("length", { promptTokens: seq.promptLength, completionTokens: 1 });
      return;
    }
    if (r.stopTokenIds.includes(token)) {
      this.#finish(seq, "stop");
      return;
    }
    const done = seq.generated >= r.maxTokens;
    if (done) this.#end(seq, true);
    seq.events.onTokens(seq.sampled, lp);
    if (done) seq.events.onFinish("length", this.#usage(seq));
  }

  /**
   * The first tokens of a prefill-only request's later samples (n > 1 as one group): each from a
   * copy of `logits` as they are before any sample's controls, under the same controls and
   * sampling parameters, with a generator of its own seed (null: one from this engine's seeds) —
   * as each sample would draw its first token alone. Runs once per group, not per token.
   */
  #sampleSiblings(seq: Sequence, logits: Float32Array, seeds: readonly (number | null)[]): number[] {
    const r = seq.request;
    const tokens: number[] = [];
    for (const seed of seeds) {
      const copy = this.#forkLogits;
      copy.set(logits);
      if (r.controls !== undefined) this.#sampler.process(copy, r.controls, seq, r.stopTokenIds);
      tokens.push(this.#sampler.sample(copy, r, new Prng(seed ?? this.#seeds.nextUint32())));
    }
    return tokens;
  }

  /** The sampled token's log-probabilities when the request asked (one entry, reused array), else undefined. */
  #logprobsOf(seq: Sequence, token: number): TokenLogprobs[] | undefined {
    const k = seq.request.logprobs;
    if (k === undefined || seq.raw === null) return undefined;
    seq.sampledLogprobs[0] = tokenLogprobs(seq.raw, token, k);
    return seq.sampledLogprobs;
  }

  /** After the step: nobody is in the batch any more. */
  #endStep(): void {
    const batch = this.#batch;
    for (let b = 0; b < this.#batchLength; b++) {
      const seq = batch[b]!;
      seq.step.logits = null;
      seq.step.rowLogits = null;
      seq.inBatch = false;
      seq.checked = false;
      batch[b] = null;
    }
    this.#batchLength = 0;
    // What each tenant held back was owed and did not use, it keeps for the next step (deficit
    // round robin, `#chunk`); a tenant that did all it wanted keeps nothing.
    for (let i = 0; i < this.#stepTenantCount; i++) {
      const t = this.#stepTenants[i]!;
      if (t.heldStep !== this.#stepNumber) continue;
      t.credit = Math.max(0, this.#allowance(t));
      t.creditStep = this.#stepNumber;
    }
    this.#stepTenantCount = 0;
    const view = this.#stepViews[this.#stepCount]!;
    for (let k = 0; k < view.length; k++) view[k] = this.#idleStep;
    this.#stepCount = 0;
  }

  /**
   * Leases the pages `n` more tokens of running `seq` need and adds it to the batch, preempting the
   * newest running requests while the pool is short.
   */
  #schedule(seq: Sequence, n: number, prefill: boolean): ScheduleOutcome {
    const running = this.#running;
    const pagesNeeded =
      seq.ownership === "local"
        ? Math.ceil((seq.computed + n) / this.pool.pageSize) - seq.blockTable.length
        : 0;
    while (!this.#allocatePages(pagesNeeded, seq)) {
      const victim = running[running.length - 1]!;
      if ((victim === seq && running.length === 1) || victim.ownership !== "local") {
        this.#fail(seq, {
          code: "pool_exhausted",
          message: `KV pool has no free page for request ${seq.rid}: ${this.pool.counts().free} free of ${this.pool.numPages}; retry later`,
        });
        return "failed";
      }
      this.#preempt(victim);
      if (victim === seq) return "preempted";
    }
    this.#addToBatch(seq, n, prefill);
    return "scheduled";
  }

  /**
   * The tokens waiting `seq` computes in its first step if admitted now (after its prefix-cache
   * hit), its pages leased; 0 when the budget or the pool has no room for it (a local request then
   * gives its hit back, to look it up again when admitted).
   */
  #firstChunk(seq: Sequence): number {
    const local = seq.ownership === "local";
    if (seq.cacheSalt !== null && local) this.#lookupPrefix(seq);
    const remaining = seq.length - seq.computed;
    const prefill = remaining > 1;
    let n = Math.min(remaining, this.#tokenBudget, prefill ? this.#prefillBudget : remaining);
    // A prompt's first chunk is bounded by its tenant's share of the step, as running prompts' are.
    if (prefill && n > 0) n = this.#chunk(seq, n);
    if (n > 0 && (!local || this.#allocateFor(seq, seq.computed + n))) return n;
    if (seq.cachedTokens > 0 && local) this.#releasePrefix(seq);
    return 0;
  }

  /** Leases the pages `seq` needs to hold `tokens` tokens (evicting unreferenced cached pages if short). */
  #allocateFor(seq: Sequence, tokens: number): boolean {
    return this.#allocatePages(Math.ceil(tokens / this.pool.pageSize) - seq.blockTable.length, seq);
  }

  /**
   * Leases `count` more pages to `seq`; when the pool is short, first evicts cached pages no
   * request references (least recently used), before the caller preempts anyone.
   */
  #allocatePages(count: number, seq: Sequence): boolean {
    const pool = this.pool;
    if (pool.allocate(count, seq.rid, seq.epoch, seq.tenant, seq.blockTable)) return true;
    const cache = this.#cache;
    if (cache === null || cache.size === 0) return false;
    if (cache.evict(count - pool.table.counts().free) === 0) return false;
    return pool.allocate(count, seq.rid, seq.epoch, seq.tenant, seq.blockTable);
  }

  /**
   * A request about to start computing from its first token: reuse the cached full pages its
   * prompt starts with (never its last prompt token, whose logits the first sample needs).
   */
  #lookupPrefix(seq: Sequence): void {
    // A prompt whose log-probabilities were asked is computed whole (a hit would skip its rows).
    if (seq.computed !== 0 || seq.blockTable.length !== 0 || seq.promptEntries !== null) return;
    const P = this.pool.pageSize;
    const hit = this.#cache!.lookup(
      seq.cacheSalt!,
      seq.tokens,
      Math.floor((seq.promptLength - 1) / P),
      seq.blockTable,
    );
    seq.computed = hit * P;
    seq.cachedTokens = hit * P;
  }

  /** Gives back a hit that could not be admitted this step (the references; it looks up again later). */
  #releasePrefix(seq: Sequence): void {
    this.pool.free(seq.blockTable, seq.rid, seq.epoch);
    seq.computed = 0;
    seq.cachedTokens = 0;
  }

  /** Caches `seq`'s full pages of its first `tokens` computed tokens. */
  #insertPrefix(seq: Sequence, tokens: number): void {
    this.#cache!.insert(
      seq.cacheSalt!,
      seq.tokens,
      Math.floor(tokens / this.pool.pageSize),
      seq.blockTable,
      seq,
    );
  }

  #addToBatch(seq: Sequence, n: number, prefill: boolean): void {
    seq.stepStart = seq.computed;
    seq.stepEnd = seq.computed + n;
    seq.stepPrefill = prefill;
    seq.inBatch = true;
    this.#tokenBudget -= n;
    if (prefill) this.#prefillBudget -= n;
    this.#served(seq, seq.stepStart, n);
    this.#batch[this.#batchLength++] = seq;
  }

  #removeFromBatch(seq: Sequence): void {
    if (!seq.inBatch) return;
    seq.inBatch = false;
    const n = seq.stepEnd - seq.stepStart;
    this.#tokenBudget += n;
    if (seq.stepPrefill) this.#prefillBudget += n;
    this.#served(seq, seq.stepStart, -n);
    const batch = this.#batch;
    let i = 0;
    while (i < this.#batchLength && batch[i] !== seq) i++;
    if (i === this.#batchLength) return;
    for (; i < this.#batchLength - 1; i++) batch[i] = batch[i + 1]!;
    batch[--this.#batchLength] = null;
  }

  #doorCheck(r: GenerationRequest): WireError | null {
    if (this.#byRid.has(r.rid)) {
      return {
        code: "invalid_request",
        message: `Request id is already in use: ${r.rid}; assign a fresh rid`,
      };
    }
    const promptLength = r.promptTokens.length;
    if (promptLength < 1) {
      return {
        code: "invalid_request",
        message: "Prompt is empty: 0 tokens; send at least one token",
        param: "messages",
      };
    }
    if (!Number.isInteger(r.maxTokens) || r.maxTokens < 1) {
      return {
        code: "invalid_request",
        message: `max_tokens must be a positive integer: ${r.maxTokens}`,
        param: "max_tokens",
      };
    }
    const total = promptLength + r.maxTokens;
    if (total > this.#contextTokens) {
      return {
        code: "context_length_exceeded",
        message: `This model's maximum context length is ${this.#contextTokens} tokens, but the request needs ${promptLength} prompt tokens plus ${r.maxTokens} max_tokens: ${total}; shorten the prompt or lower max_tokens`,
        param: "messages",
      };
    }
    try {
      Sampler.validate(r, this.#model.config.vocabSize);
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
    const vocab = this.#model.config.vocabSize;
    for (let i = 0; i < promptLength; i++) {
      const t = r.promptTokens[i]!;
      if (!(t >= 0 && t < vocab)) {
        return {
          code: "invalid_request",
          message: `Prompt token id is outside the vocabulary of ${vocab}: ${t}`,
          param: "messages",
        };
      }
    }
    return null;
  }

  #tagError(seq: Sequence, logicalPage: number): WireError {
    const bt = seq.blockTable;
    const t = this.pool.table;
    if (logicalPage >= bt.length) {
      return {
        code: "page_tag_mismatch",
        message: `KV page check failed for request ${seq.rid}: block table has ${bt.length} pages for ${seq.stepEnd} tokens`,
      };
    }
    return {
      code: "page_tag_mismatch",
      message: `KV page check failed for request ${seq.rid} epoch ${seq.epoch} at logical page ${logicalPage} (leased at generation ${bt.generations[logicalPage]}): ${t.describe(bt.pages[logicalPage]!)}`,
    };
  }

  #preempt(seq: Sequence): void {
    this.#removeFromBatch(seq);
    this.#preemptedThisStep = true;
    this.pool.free(seq.blockTable, seq.rid, seq.epoch);
    this.#removeRunning(seq);
    seq.epoch = (seq.epoch + 1) >>> 0;
    seq.computed = 0;
    seq.state = "waiting";
    seq.preempted = true;
    this.#preempted.pushFront(seq);
    this.#counters.preemptions++;
  }

  #finish(seq: Sequence, reason: "stop" | "length"): void {
    this.#end(seq, true);
    seq.events.onFinish(reason, this.#usage(seq));
  }

  #usage(seq: Sequence): { promptTokens: number; completionTokens: number; cachedTokens?: number } {
    const usage = { promptTokens: seq.promptLength, completionTokens: seq.generated };
    return this.#cache === null ? usage : { ...usage, cachedTokens: seq.cachedTokens };
  }

  #fail(seq: Sequence, error: WireError): void {
    this.#end(seq);
    seq.events.onError(error);
  }

  /**
   * Frees the request's pages and forgets it; later calls for the same request do nothing. A
   * request that `finished` first caches its full pages (prompt and generated tokens: the next
   * turn of a chat starts with them).
   */
  #end(seq: Sequence, finished = false): void {
    if (seq.state === "done") return;
    if (finished && seq.cacheSalt !== null && seq.ownership === "local")
      this.#insertPrefix(seq, seq.computed);
    if (seq.ownership === "local") this.pool.free(seq.blockTable, seq.rid, seq.epoch);
    else seq.blockTable.clear();
    if (seq.forkOf >= 0) {
      const list = this.#forks.get(seq.forkOf);
      if (list !== undefined) list.splice(list.indexOf(seq), 1);
      seq.forkOf = -1;
    } else if (seq.state === "running") this.#removeRunning(seq);
    else if (!this.#preempted.remove(seq)) this.#waiting.remove(seq);
    // A first sample that ends before its prompt is computed: its samples compute their own.
    const samples = this.#forks.get(seq.rid);
    if (samples !== undefined) {
      this.#forks.delete(seq.rid);
      for (const s of samples) {
        s.forkOf = -1;
        this.#waiting.push(s);
      }
    }
    seq.state = "done";
    this.#byRid.delete(seq.rid);
  }

  #removeRunning(seq: Sequence): void {
    const i = this.#running.indexOf(seq);
    if (i >= 0) this.#running.splice(i, 1);
  }
}

/** The forward pass's per-row callback for `seq`'s step when it asked for the prompt's log-probabilities and the step holds prompt rows, else null. */
function promptRows(seq: Sequence): ((index: number, logits: Float32Array, offset: number) => void) | null {
  return seq.rowLogits !== null && seq.stepStart < seq.promptLength - 1 ? seq.rowLogits : null;
}

/** Keeps the step's raw logits of `seq` (the controls change them in place) for its log-probabilities. */
function keepRaw(seq: Sequence, logits: Float32Array): void {
  if (seq.raw === null) seq.raw = new Float32Array(logits.length);
  seq.raw.set(logits);
}

/**
 * Every page's state (one digit per page: the index in `PAGE_STATE_NAMES`) and its tenant (0 for
 * a free page), for the operator's dashboard (`/kvfence/state`).
 */
function pageMapOf(table: OwnershipTable): PageMap {
  let states = "";
  const tenants: number[] = new Array(table.numPages);
  for (let page = 0; page < table.numPages; page++) {
    const state = table.state(page);
    states += String(state);
    tenants[page] = state === PageState.FREE ? 0 : table.tenant(page);
  }
  return { states, stateNames: PAGE_STATE_NAMES, tenants };
}
