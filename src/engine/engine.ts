/**
 * The continuous-batching engine: one KV page pool, one forward pass, a scheduler that turns
 * submitted requests into batched steps, and a sampling step that turns each step's logits into
 * tokens. It is synchronous and single-threaded — `step()` runs one forward pass — so the worker
 * glue (`src/topology/engine-worker.ts`) drives it between messages, and tests drive it directly.
 *
 * ## One step
 *
 * 1. **Schedule** (`scheduler.ts`): the running requests' decode tokens, admission of waiting
 *    requests, and the running prompts' next chunks (chunked prefill), fairly between tenants
 *    (each step's compute shared by deficit round robin, `tenant-shares.ts`), pages leased as the
 *    step needs them and the newest running request preempted when the pool runs out.
 * 2. **The read guard.** Every page of every block table in the batch is checked against the
 *    ownership table (`PagePool.checkStep`: generation, owner rid/epoch, state, writer stamp, filled
 *    tokens). A request that fails is ended with `page_tag_mismatch` and counted; the rest of the
 *    batch goes on. Integer compares only. A decode node's request is checked by its host instead
 *    (`ExternalPages.checkStep`: the decode state machine, with the same rule), so each token is
 *    checked exactly once.
 * 3. **Forward**, then `PagePool.recordStep` stamps the written pages and marks fresh ones READY.
 * 4. **Sampling** (`sampling-step.ts`) for every request whose step reached its last token; the
 *    engine reports each token: a stop token id ends the request with `stop` (the stop token is
 *    counted in usage but not reported in `onTokens`), `maxTokens` with `length`. A sample of n > 1
 *    waiting for its first sample's prompt forks it here (a copy of its KV, the same logits).
 *
 * `step()` runs these as `scheduler.schedule()`, `#checkBatch`, `#forward`, `#sample`. A decode
 * step of a running request allocates nothing: the token it feeds the forward pass and the array
 * `onTokens` receives are the request's own, reused (listeners copy what they keep).
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

import type { GrammarSource } from "../grammar/grammar-engine.js";
import type { BlockTable } from "../kvcache/block-table.js";
import type { KvTiers } from "../kvcache/kv-tiers.js";
import { type OwnershipTable, PAGE_STATE_NAMES, PageState } from "../kvcache/ownership-table.js";
import type { PagePool } from "../kvcache/page-pool.js";
import type { WireError } from "../lib/errors.js";
import { KvfenceError } from "../lib/errors.js";
import { PHASE, PhaseRecorder } from "../lib/phase-recorder.js";
import type { StepSequence } from "../model/forward.js";
import type { ModelConfig } from "../model/model-config.js";
import type {
  EngineCapacity,
  EngineStats,
  GenerationEvents,
  GenerationRequest,
  PageMap,
} from "../protocol/engine-api.js";
import { PrefixCache, type PrefixCacheCounters } from "../protocol/prefix-cache.js";
import { prefixCacheSalt } from "../protocol/prefix-key.js";
import { faultOn, guardOn, SAFE, type Safety } from "../protocol/safety.js";
import { type DoorLimits, doorCheck } from "./door-check.js";
import { promptRows, SamplingStep } from "./sampling-step.js";
import { Scheduler } from "./scheduler.js";
import { type PageOwnership, Sequence } from "./sequence.js";
import { StepCost } from "./step-cost.js";
import { poolPageView, TierPrefetch } from "./tier-prefetch.js";

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
  /**
   * The KV tiers below the pool (docs/design.md §3b), with the prefix cache on: its evicted pages
   * spill there, and a request whose prompt continues below the pool waits outside the scheduler
   * while they load back (`TierPrefetch`).
   */
  readonly tiers?: KvTiers;
  /**
   * Where structured output's matchers come from — the engine's grammar thread
   * (src/grammar/grammar-thread.ts) — made on the first request with a constraint; absent: such
   * requests are refused.
   */
  readonly grammar?: () => Promise<GrammarSource>;
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

export class Engine {
  readonly capacity: EngineCapacity;
  readonly pool: PagePool;
  /** The model's config (the forward pass's). */
  readonly modelConfig: ModelConfig;
  /** This engine's per-phase histograms (queue wait, prefill, first token, inter-token); a node adds its own phases. */
  readonly phases: PhaseRecorder;
  readonly #model: StepModel;
  readonly #contextTokens: number;
  readonly #door: DoorLimits;
  readonly #tagCheck: boolean;
  readonly #safety: Safety;
  /** The prefix cache of this engine's pool (local requests only), or null when off. */
  readonly #cache: PrefixCache | null;
  /** Loads from the KV tiers (null without tiers), and the requests waiting for theirs, by rid. */
  readonly #prefetch: TierPrefetch | null;
  readonly #loading = new Map<number, Sequence>();
  /** What runs in each step: the requests, their pages and each step's batch. */
  readonly #scheduler: Scheduler;
  /** Each step's logits into tokens. */
  readonly #sampling: SamplingStep;
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
    this.pool = pool;
    this.#contextTokens = Math.min(maxModelLen, pool.capacityTokens);
    this.#door = Object.freeze({ contextTokens: this.#contextTokens, vocabSize: config.vocabSize });
    this.phases = new PhaseRecorder(options.phaseMetrics ?? true);
    this.#safety = options.safety ?? SAFE;
    this.#tagCheck = guardOn(this.#safety, "page-tags");
    const tiers = options.tiers;
    this.#cache =
      options.prefixCache !== true
        ? null
        : new PrefixCache(
            pool.table,
            pool.pageSize,
            this.#safety,
            tiers === undefined
              ? undefined
              : {
                  stored: () => {},
                  evicting: (page) =>
                    faultOn(this.#safety, "spill-race")
                      ? tiers.spillLater(page, () => poolPageView(pool, page.page))
                      : tiers.spill(page, poolPageView(pool, page.page)),
                },
          );
    this.#prefetch =
      this.#cache === null || tiers === undefined
        ? null
        : new TierPrefetch(this.#cache, tiers, pool, this.#safety);
    this.#scheduler = new Scheduler(pool, {
      maxBatchTokens: model.maxBatchTokens,
      maxPrefillTokens,
      maxSequences: model.maxSequences,
      cost: new StepCost(config),
      cache: this.#cache,
      counters: this.#counters,
      phases: this.phases,
    });
    this.#sampling = new SamplingStep(
      config.vocabSize,
      options.seed ?? Math.floor(Math.random() * 0x1_0000_0000),
      options.grammar ?? null,
      config.eosTokenIds,
    );
    this.capacity = Object.freeze({
      poolTokens: pool.capacityTokens,
      pageSize: pool.pageSize,
      maxModelLen,
      maxSequences: model.maxSequences,
    });
    for (let i = 0; i < model.maxSequences; i++) this.#logits.push(new Float32Array(config.vocabSize));
    for (let k = 0; k <= model.maxSequences; k++)
      this.#stepViews.push(Array.from({ length: k }, () => this.#idleStep));
  }

  /** Tokens one request may span (prompt + max_tokens): the lesser of the context length and the pool. */
  get contextTokens(): number {
    return this.#contextTokens;
  }

  /** True while any request is waiting for its grammar, waiting or running. */
  get busy(): boolean {
    return this.#scheduler.requests.size > 0 || this.#sampling.constraining > 0 || this.#loading.size > 0;
  }

  /**
   * Queues a request. A request that cannot be served (over the context, bad token ids, a rid in
   * use) gets `onError` before this returns, and nothing is allocated for it. A sample of n > 1
   * whose first sample runs here waits for its prompt, then forks it.
   */
  submit(request: GenerationRequest, events: GenerationEvents): void {
    const seq = this.#admit(request, events);
    if (seq === null) return;
    this.#sampling.prepare(seq);
    this.#sampling.constrain(seq, () => this.#afterLoads(seq));
  }

  /**
   * Queues `seq` once the pages of its prompt that the KV tiers hold are back in the pool (at once
   * when there are none): it waits outside the scheduler, so no step waits on a tier.
   */
  #afterLoads(seq: Sequence): void {
    const enqueue = () => {
      if (!this.#scheduler.awaitFork(seq)) this.#scheduler.enqueue(seq);
    };
    const P = this.pool.pageSize;
    const loads =
      this.#prefetch === null || seq.cacheSalt === null || seq.promptEntries !== null
        ? null
        : this.#prefetch.prefetch({
            salt: seq.cacheSalt,
            tokens: seq.tokens.subarray(0, seq.promptLength),
            maxPages: Math.floor((seq.promptLength - 1) / P),
            tenant: seq.tenant,
            cacheEpoch: seq.cacheEpoch,
          });
    if (loads === null) {
      enqueue();
      return;
    }
    this.#loading.set(seq.rid, seq);
    void loads.then(() => {
      if (this.#loading.get(seq.rid) !== seq) return; // aborted or failed meanwhile
      this.#loading.delete(seq.rid);
      enqueue();
    });
  }

  /** The KV tiers' loader, or null without tiers. */
  get tierPrefetch(): TierPrefetch | null {
    return this.#prefetch;
  }

  /** The door check, then the request's sequence (its seed drawn if it has none); null when refused. */
  #admit(request: GenerationRequest, events: GenerationEvents): Sequence | null {
    const refusal = doorCheck(request, this.#scheduler.requests.has(request.rid), this.#door);
    if (refusal !== null) {
      events.onError(refusal);
      return null;
    }
    const seq = new Sequence(request, events, this.pool.pageSize, this.#sampling.seedOf(request));
    seq.cacheEpoch = request.cacheEpoch ?? 0;
    if (this.#cache !== null)
      seq.cacheSalt = prefixCacheSalt(
        this.#safety,
        request.tenant,
        request.cacheSalt ?? null,
        request.cacheScope ?? "",
        seq.cacheEpoch,
      );
    return seq;
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
    this.#sampling.prepare(seq);
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
      this.#sampling.skipFirstDraw(seq);
    }
    this.#sampling.constrain(seq, () => this.#scheduler.enqueue(seq));
  }

  /** Ends a request wherever it is, freeing its pages exactly once; unknown or finished rids are ignored. */
  abort(rid: number): void {
    const seq = this.#scheduler.requests.get(rid);
    if (seq === undefined) {
      if (this.#sampling.dropConstraining(rid) || this.#loading.delete(rid)) this.#counters.aborts++;
      return;
    }
    this.#counters.aborts++;
    this.#scheduler.end(seq);
  }

  /** Frees what outlives its requests: the grammar thread, terminated (the engine is done). */
  close(): void {
    this.#sampling.close();
  }

  /** Ends every request with `error` (shutdown). */
  failAll(error: WireError): void {
    this.#sampling.failConstraining(error);
    for (const seq of this.#loading.values()) seq.events.onError(error);
    this.#loading.clear();
    for (const seq of [...this.#scheduler.requests.values()]) {
      this.#scheduler.end(seq);
      seq.events.onError(error);
    }
  }

  stats(): EngineStats {
    const { waiting, preempted } = this.#scheduler.queued();
    const stats: EngineStats = {
      pages: this.pool.counts(),
      queue: { waiting, running: this.#scheduler.running.length, preempted },
      counters: { ...this.#counters },
      phases: this.phases.snapshot(),
      pageMap: pageMapOf(this.pool.table),
    };
    if (this.#cache !== null) stats.prefixCache = this.prefixCacheStats()!;
    if (this.#prefetch !== null) stats.tiers = this.#prefetch.stats();
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
    return this.#scheduler.running.map((s) => ({
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
    const scheduler = this.#scheduler;
    // Waiting only for grammars or tier loads: the loop keeps turning until they are done.
    if (scheduler.requests.size === 0) return this.busy;
    scheduler.schedule();
    this.#stepDecodeTokens = 0;
    if (this.#checkBatch() > 0) {
      this.#forward();
      this.#sample();
    }
    this.#endStep();
    if (this.#stepDecodeTokens > 0) this.#counters.decodeSteps++;
    this.#timeDecodeStep();
    return this.busy;
  }

  /**
   * The read guard of every request in the batch (the host's check for a decode node's request,
   * else `PagePool.checkStep`), and the forward pass's view of those that pass. Returns how many
   * sequences the forward pass runs.
   */
  #checkBatch(): number {
    const scheduler = this.#scheduler;
    const batch = scheduler.batch;
    let logitsUsed = 0;
    for (let b = 0; b < scheduler.batchLength; b++) {
      const seq = batch[b]!;
      if (seq.hostCheck !== null) {
        // The host reported a failure itself (and may have aborted the request already).
        if (!seq.hostCheck()) {
          scheduler.end(seq);
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
          scheduler.fail(seq, this.#tagError(seq, bad));
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
    for (let b = 0; b < scheduler.batchLength; b++) if (this.#runs(batch[b]!)) count++;
    const view = this.#stepViews[count]!;
    let k = 0;
    for (let b = 0; b < scheduler.batchLength; b++) {
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

  /** The forward pass, then stamp what it wrote (a decode node's host stamps its own). */
  #forward(): void {
    this.#model.step(this.pool.data, this.#stepViews[this.#stepCount]!);
    const scheduler = this.#scheduler;
    const batch = scheduler.batch;
    for (let b = 0; b < scheduler.batchLength; b++) {
      const seq = batch[b]!;
      if (!this.#runs(seq)) continue;
      if (seq.ownership !== "decode-external")
        this.pool.recordStep(seq.blockTable, seq.rid, seq.epoch, seq.stepStart, seq.stepEnd);
      if (seq.stepStart < seq.promptLength)
        this.#counters.prefillTokens += Math.min(seq.stepEnd, seq.promptLength) - seq.stepStart;
      seq.computed = seq.stepEnd;
      if (seq.cacheSalt !== null && seq.stepStart < seq.promptLength && seq.stepEnd >= seq.promptLength)
        scheduler.insertPrefix(seq, seq.promptLength);
    }
  }

  /** Sample where a step reached the last token; report. Events may re-enter (abort). */
  #sample(): void {
    const scheduler = this.#scheduler;
    const batch = scheduler.batch;
    for (let b = 0; b < scheduler.batchLength; b++) {
      const seq = batch[b]!;
      const logits = seq.step.logits;
      if (!this.#runs(seq) || logits === null || seq.computed !== seq.length) continue;
      if (seq.generated === 0) this.#fork(seq, logits);
      this.#sampleOne(seq, logits);
    }
  }

  /**
   * The first sample of n > 1 computed its prompt: each sample waiting for it forks it
   * (`Scheduler.fork`: pages of its own, a copy of the prompt's KV read under the first sample's
   * tag check) and draws its first token from a copy of the same logits with its own generator.
   */
  #fork(first: Sequence, logits: Float32Array): void {
    const samples = this.#scheduler.takeForks(first);
    if (samples === undefined) return;
    const readable =
      !this.#tagCheck ||
      this.pool.checkStep(first.blockTable, first.rid, first.epoch, first.promptLength, first.promptLength) <
        0;
    for (const seq of samples) {
      if (this.#scheduler.fork(first, seq, readable)) this.#sampleOne(seq, this.#sampling.copyOf(logits));
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
      if (this.#itlSteps < ITL_WINDOW && this.#scheduler.requests.size > 0) return;
    } else if (!this.#itlOpen) return;
    if (this.#itlSteps > 0) {
      const now = performance.now();
      this.phases.observeMany(PHASE.inter_token, (now - start[0]!) / 1000 / this.#itlSteps, this.#itlTokens);
      this.#itlOpen = this.#stepDecodeTokens > 0 && this.#scheduler.requests.size > 0;
      start[0] = now;
    } else this.#itlOpen = false;
    this.#itlSteps = 0;
    this.#itlTokens = 0;
  }

  /** Draws `seq`'s next token from `logits` (its step's, changed in place by its controls); reports. */
  #sampleOne(seq: Sequence, logits: Float32Array): void {
    const sampling = this.#sampling;
    // A prefill node's group of n > 1: the later samples draw their first tokens from these logits too.
    const siblings = sampling.siblings(seq, logits);
    const token = sampling.sample(seq, logits);
    seq.tokens[seq.length++] = token;
    seq.generated++;
    this.#counters.completionTokens++;
    seq.sampled[0] = token;
    this.#timeToken(seq);
    const lp = sampling.logprobs(seq, token);
    if (seq.promptEntries !== null && !seq.promptReported) {
      seq.promptReported = true;
      seq.events.onPromptLogprobs?.(seq.promptEntries);
    }
    if (seq.ownership === "prefill-only") {
      this.#scheduler.end(seq);
      seq.events.onTokens(siblings === null ? seq.sampled : [token, ...siblings], lp);
      seq.events.onFinish("length", { promptTokens: seq.promptLength, completionTokens: 1 });
      return;
    }
    if (sampling.stops(seq, token)) {
      this.#finish(seq, "stop", token);
      return;
    }
    const done = seq.generated >= seq.request.maxTokens;
    if (done) this.#scheduler.end(seq, true);
    seq.events.onTokens(seq.sampled, lp);
    if (done) seq.events.onFinish("length", this.#usage(seq));
  }

  /** After the step: nobody is in the batch any more, and the step views hold nothing. */
  #endStep(): void {
    const scheduler = this.#scheduler;
    const batch = scheduler.batch;
    for (let b = 0; b < scheduler.batchLength; b++) {
      const seq = batch[b]!;
      seq.step.logits = null;
      seq.step.rowLogits = null;
      seq.checked = false;
    }
    scheduler.endStep();
    const view = this.#stepViews[this.#stepCount]!;
    for (let k = 0; k < view.length; k++) view[k] = this.#idleStep;
    this.#stepCount = 0;
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

  #finish(seq: Sequence, reason: "stop" | "length", stopTokenId?: number): void {
    this.#scheduler.end(seq, true);
    const usage = this.#usage(seq);
    seq.events.onFinish(reason, stopTokenId === undefined ? usage : { ...usage, stopTokenId });
  }

  #usage(seq: Sequence): { promptTokens: number; completionTokens: number; cachedTokens?: number } {
    const usage = { promptTokens: seq.promptLength, completionTokens: seq.generated };
    return this.#cache === null ? usage : { ...usage, cachedTokens: seq.cachedTokens };
  }
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
