/**
 * The engine's scheduler: what runs in each step. It holds the requests (waiting, preempted,
 * running, and the samples of n > 1 waiting to fork), leases their pages, and builds each step's
 * batch (`schedule`), which the engine then checks, runs and samples (`engine.ts`).
 *
 * 1. **Decode tokens**, running requests tenant by tenant (the tenant served least lately first),
 *    each tenant's oldest first: each adds its one pending token. Pages are leased lazily, as the
 *    step needs them. When the pool runs out, the most recently admitted running request is
 *    **preempted**: its pages are freed, its epoch bumped, and it goes back to the front of the
 *    queue to be recomputed later from its prompt plus the tokens it already generated (never from
 *    its old pages).
 * 2. **Admission, and prompts, fairly between tenants.** First the waiting requests of tenants with
 *    no prompt in progress that have been served no more lately than those that have one (a
 *    tenant that was not computing goes ahead of one that was); then the running prompts' next
 *    chunks, the tenant served least lately first, within `maxPrefillTokens` per step (chunked
 *    prefill) and `maxBatchTokens` in all; then the other waiting requests: preempted ones first,
 *    then the rest by weighted fair queuing over the tokens each still has to compute
 *    (`src/lib/fair-queue.ts`). Admission needs a sequence slot, token budget and free pages for
 *    the first chunk, and stops in a step that had to preempt, to avoid thrashing.
 *
 * **Each step's compute is shared by deficit round robin between tenants** (`tenant-shares.ts`):
 * a tenant served more lately than another tenant with work in the step adds to it, decodes and
 * prompt chunks alike, no more compute than that tenant has in it, plus what it was owed and could
 * not use before. On this CPU engine a step's time grows with its work, so a flood's 128-token
 * chunk at a long context made another tenant's decode step a hundred times slower; now each of
 * that tenant's steps costs at most about twice its own, and the flood gets the rest (every step
 * it has alone, and its share of the others). With one tenant none of this binds: it is
 * first-come, oldest prompt first, full chunks.
 *
 * The prefix cache (`PrefixCache`, local requests only): a request about to compute its prompt
 * reuses the cached full pages its prompt starts with; a finished prefill, and a finished request,
 * caches its full pages; when the pool is short, unreferenced cached pages are evicted before
 * anyone is preempted.
 *
 * Preempted requests wait in a ring-buffer deque (admission pops its front, a preempted request
 * goes back to its front, both O(1)), the others in the fair queue. `end` frees a request's pages
 * (a host-leased request's are the host's: only forgotten), exactly once, wherever it is. The batch
 * and the per-step lists are reused arrays; scheduling a step of running decodes allocates nothing.
 */
import type { PagePool } from "../kvcache/page-pool.js";
import { Deque } from "../lib/deque.js";
import type { WireError } from "../lib/errors.js";
import { FairQueue } from "../lib/fair-queue.js";
import { PHASE, type PhaseRecorder } from "../lib/phase-recorder.js";
import type { PrefixCache } from "../protocol/prefix-cache.js";
import type { Sequence } from "./sequence.js";
import type { StepCost } from "./step-cost.js";
import { type TenantService, TenantShares } from "./tenant-shares.js";

/** What `#schedule` did with a running request. */
type ScheduleOutcome =
  /** In this step's batch. */
  | "scheduled"
  /** It was the newest running request and went back to the queue to free pages. */
  | "preempted"
  /** Alone and still short of pages (held outside this engine): ended with `pool_exhausted`. */
  | "failed";

/** The engine's counters the scheduler adds to. */
export interface SchedulerCounters {
  preemptions: number;
  promptTokens: number;
  forkedSamples: number;
}

export interface SchedulerOptions {
  /** Tokens per step over all requests. */
  readonly maxBatchTokens: number;
  /** Prefill tokens per step over all requests (chunked prefill). */
  readonly maxPrefillTokens: number;
  /** Requests running at once. */
  readonly maxSequences: number;
  /** The estimated compute of a step's tokens, to share each step between tenants. */
  readonly cost: StepCost;
  /** The prefix cache of the pool (local requests only), or null when off. */
  readonly cache: PrefixCache | null;
  readonly counters: SchedulerCounters;
  /** Where admission observes each request's queue wait. */
  readonly phases: PhaseRecorder;
}

export class Scheduler {
  /** Every request waiting or running (or waiting to fork), by rid. */
  readonly requests = new Map<number, Sequence>();
  /** The running requests, oldest admitted first. */
  readonly running: Sequence[] = [];
  /**
   * This step's batch: its first `batchLength` entries. Neither array here is ever truncated to
   * length 0 — V8 drops an array's backing store then, and the next push allocates a new one: that
   * was two allocations per step.
   */
  readonly batch: (Sequence | null)[] = [];
  /** How many entries of `batch` this step runs (read-only outside: a plain field, no getter on the hot path). */
  batchLength = 0;
  readonly #pool: PagePool;
  readonly #cache: PrefixCache | null;
  readonly #shares: TenantShares;
  readonly #counters: SchedulerCounters;
  readonly #phases: PhaseRecorder;
  readonly #maxBatchTokens: number;
  readonly #maxPrefillTokens: number;
  readonly #maxSequences: number;
  /** Waiting requests, fair between tenants (costed by the tokens each still has to compute). */
  readonly #waiting = new FairQueue<Sequence>({
    flow: (seq) => seq.tenant,
    cost: (seq) => seq.length - seq.computed,
  });
  /** Preempted requests: admitted before any other, oldest preemption last. */
  readonly #preempted = new Deque<Sequence>();
  /** Samples of n > 1 waiting for their first sample's prompt (by its rid), to fork it. */
  readonly #forks = new Map<number, Sequence[]>();
  #tokenBudget = 0;
  #prefillBudget = 0;
  #preemptedThisStep = false;
  /** This step's tenants with a prompt in progress (`#markPrefillTenants`). */
  readonly #prefillTenants: Uint32Array;
  #prefillTenantCount = 0;
  /** The least recent service among them (Infinity: none). */
  #leastRecentPrefill = Number.POSITIVE_INFINITY;
  /** The tenants with running requests, served least lately first (`#scheduleDecodes`). */
  readonly #tenantOrder: TenantService[] = [];
  /** May a waiting request of `tenant` start before the running prompts' chunks (made once). */
  readonly #fresh = (tenant: number, front: Sequence): boolean =>
    !this.#isPrefillTenant(tenant) &&
    this.#shares.recent(front.service) <= this.#leastRecentPrefill &&
    this.#mayCompute(front);
  /** May a waiting request start in this step: its tenant has not had its share of it (made once). */
  readonly #mayCompute = (front: Sequence): boolean => this.#chunk(front, 1) > 0;
  readonly #mayComputeFlow = (_tenant: number, front: Sequence): boolean => this.#mayCompute(front);

  constructor(pool: PagePool, options: SchedulerOptions) {
    this.#pool = pool;
    this.#cache = options.cache;
    this.#shares = new TenantShares(options.cost);
    this.#counters = options.counters;
    this.#phases = options.phases;
    this.#maxBatchTokens = options.maxBatchTokens;
    this.#maxPrefillTokens = options.maxPrefillTokens;
    this.#maxSequences = options.maxSequences;
    this.#prefillTenants = new Uint32Array(options.maxSequences);
  }

  /** Requests waiting for admission (preempted ones included) and those of them preempted. */
  queued(): { waiting: number; preempted: number } {
    const preempted = this.#preempted.length;
    return { waiting: this.#waiting.length + preempted, preempted };
  }

  /** Queues `seq` for admission. */
  enqueue(seq: Sequence): void {
    seq.service = this.#shares.serviceOf(seq.tenant);
    this.requests.set(seq.rid, seq);
    this.#waiting.push(seq);
    this.#counters.promptTokens += seq.promptLength;
  }

  /**
   * A sample of n > 1 whose first sample is here, local and not yet past its prompt: it waits for
   * that prompt, then forks it (`fork`); true. Else false (queue it with `enqueue`).
   */
  awaitFork(seq: Sequence): boolean {
    const sample = seq.request.sample;
    const first = sample === undefined ? undefined : this.requests.get(sample.of);
    if (first === undefined || first.ownership !== "local" || first.generated !== 0 || first.forkOf >= 0)
      return false;
    seq.forkOf = first.rid;
    seq.service = this.#shares.serviceOf(seq.tenant);
    this.requests.set(seq.rid, seq);
    this.#counters.promptTokens += seq.promptLength;
    const list = this.#forks.get(first.rid);
    if (list === undefined) this.#forks.set(first.rid, [seq]);
    else list.push(seq);
    return true;
  }

  /** The samples waiting to fork `first`'s prompt (no longer waiting once returned), if any. */
  takeForks(first: Sequence): Sequence[] | undefined {
    const samples = this.#forks.get(first.rid);
    if (samples !== undefined) this.#forks.delete(first.rid);
    return samples;
  }

  /**
   * The first sample of n > 1 computed its prompt: `seq`, one of its samples, gets pages of its
   * own, a copy of the prompt's KV (`readable`: it passed the first sample's tag check), stamped as
   * its own, and runs; true (it draws its first token from the first sample's logits). A sample that
   * cannot fork (no pages or sequence slot now, unreadable pages) waits as an ordinary request;
   * false, as for one that ended.
   */
  fork(first: Sequence, seq: Sequence, readable: boolean): boolean {
    seq.forkOf = -1;
    if (seq.state === "done") return false;
    const pool = this.#pool;
    const pages = Math.ceil(first.promptLength / pool.pageSize);
    if (
      !readable ||
      this.running.length >= this.#maxSequences ||
      !pool.allocate(pages, seq.rid, seq.epoch, seq.tenant, seq.blockTable)
    ) {
      this.#waiting.push(seq);
      return false;
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
    this.running.push(seq);
    this.#counters.forkedSamples++;
    return true;
  }

  /** Phases 1 and 2 of a step: builds its batch (`batch`, the first `batchLength` entries). */
  schedule(): void {
    this.#tokenBudget = this.#maxBatchTokens;
    this.#prefillBudget = this.#maxPrefillTokens;
    this.#shares.beginStep();
    this.#preemptedThisStep = false;
    this.#scheduleDecodes();
    this.#markPrefillTenants();
    this.#admitWaiting(true);
    this.#schedulePrefills();
    this.#admitWaiting(false);
  }

  /** After the step: nobody is in the batch any more; each tenant keeps what it was owed. */
  endStep(): void {
    const batch = this.batch;
    for (let b = 0; b < this.batchLength; b++) {
      batch[b]!.inBatch = false;
      batch[b] = null;
    }
    this.batchLength = 0;
    this.#shares.endStep();
  }

  /**
   * Phase 1: the running requests' decode tokens, tenant by tenant, the one served least lately
   * first, each tenant's oldest first, within its share of the step (`#chunk`). With one tenant:
   * oldest first.
   */
  #scheduleDecodes(): void {
    const running = this.running;
    const order = this.#tenantOrder;
    const step = this.#shares.step;
    let tenants = 0;
    for (let i = 0; i < running.length; i++) {
      const service = running[i]!.service;
      if (service.orderStep === step) continue;
      service.orderStep = step;
      // Insertion by recent service: a handful of tenants. The sort key is kept in a field, not in a
      // local: V8 13's Maglev tier boxed the double `recent` returned, 16 bytes a step (Node 24).
      service.orderRecent = this.#shares.recent(service);
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
   * Phase 2, between the two rounds of admission: the next chunk of the running prompts, the
   * tenant served least lately first (ties: oldest first), each taking what the step has left and
   * what its tenant's share allows (`#chunk`); a prompt whose tenant had its share waits for a
   * later step.
   */
  #schedulePrefills(): void {
    const running = this.running;
    for (;;) {
      let best: Sequence | null = null;
      // (Not Infinity: V8 13's Maglev tier boxed that constant on every call, 16 bytes a step.)
      let bestRecent = 0;
      for (let i = 0; i < running.length; i++) {
        const seq = running[i]!;
        if (seq.inBatch || seq.length - seq.computed <= 1 || seq.heldAt === this.#shares.step) continue;
        const recent = this.#shares.recent(seq.service);
        if (best === null || recent < bestRecent) {
          best = seq;
          bestRecent = recent;
        }
      }
      if (best === null) return;
      const n = Math.min(best.length - best.computed, this.#prefillBudget, this.#tokenBudget);
      if (n <= 0) return;
      const fair = this.#chunk(best, n);
      if (fair <= 0) best.heldAt = this.#shares.step;
      else this.#schedule(best, fair, true);
    }
  }

  /** How many of `n` tokens of `seq` its tenant may add to this step (`TenantShares.chunk`). */
  #chunk(seq: Sequence, n: number): number {
    return this.#shares.chunk(seq.service, seq.computed, n);
  }

  /**
   * Records the tenants with a prompt in progress (`#prefillTenants`) and the least recent
   * service among them. Allocates nothing.
   */
  #markPrefillTenants(): void {
    this.#prefillTenantCount = 0;
    this.#leastRecentPrefill = Number.POSITIVE_INFINITY;
    const running = this.running;
    for (let i = 0; i < running.length; i++) {
      const seq = running[i]!;
      if (seq.length - seq.computed > 1) this.#markPrefillTenant(seq);
    }
  }

  #markPrefillTenant(seq: Sequence): void {
    if (this.#isPrefillTenant(seq.tenant)) return;
    this.#prefillTenants[this.#prefillTenantCount++] = seq.tenant;
    this.#leastRecentPrefill = Math.min(this.#leastRecentPrefill, this.#shares.recent(seq.service));
  }

  #isPrefillTenant(tenant: number): boolean {
    const tenants = this.#prefillTenants;
    for (let j = 0; j < this.#prefillTenantCount; j++) if (tenants[j] === tenant) return true;
    return false;
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
    const running = this.running;
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
        this.#phases.observe(PHASE.queue_wait, (seq.startedAt - seq.queuedAt) / 1000);
      }
      seq.state = "running";
      seq.preempted = false;
      running.push(seq);
      this.#addToBatch(seq, n, prefill);
      if (prefill) this.#markPrefillTenant(seq);
    }
  }

  /**
   * Leases the pages `n` more tokens of running `seq` need and adds it to the batch, preempting the
   * newest running requests while the pool is short.
   */
  #schedule(seq: Sequence, n: number, prefill: boolean): ScheduleOutcome {
    const running = this.running;
    const pagesNeeded =
      seq.ownership === "local"
        ? Math.ceil((seq.computed + n) / this.#pool.pageSize) - seq.blockTable.length
        : 0;
    while (!this.#allocatePages(pagesNeeded, seq)) {
      const victim = running[running.length - 1]!;
      if ((victim === seq && running.length === 1) || victim.ownership !== "local") {
        this.fail(seq, {
          code: "pool_exhausted",
          message: `KV pool has no free page for request ${seq.rid}: ${this.#pool.counts().free} free of ${this.#pool.numPages}; retry later`,
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
    return this.#allocatePages(Math.ceil(tokens / this.#pool.pageSize) - seq.blockTable.length, seq);
  }

  /**
   * Leases `count` more pages to `seq`; when the pool is short, first evicts cached pages no
   * request references (least recently used), before the caller preempts anyone.
   */
  #allocatePages(count: number, seq: Sequence): boolean {
    const pool = this.#pool;
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
    const P = this.#pool.pageSize;
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
    this.#pool.free(seq.blockTable, seq.rid, seq.epoch);
    seq.computed = 0;
    seq.cachedTokens = 0;
  }

  /** Caches `seq`'s full pages of its first `tokens` computed tokens (its cache salt set). */
  insertPrefix(seq: Sequence, tokens: number): void {
    this.#cache!.insert(
      seq.cacheSalt!,
      seq.tokens,
      Math.floor(tokens / this.#pool.pageSize),
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
    this.#shares.served(seq.service, seq.stepStart, n);
    this.batch[this.batchLength++] = seq;
  }

  #removeFromBatch(seq: Sequence): void {
    if (!seq.inBatch) return;
    seq.inBatch = false;
    const n = seq.stepEnd - seq.stepStart;
    this.#tokenBudget += n;
    if (seq.stepPrefill) this.#prefillBudget += n;
    this.#shares.served(seq.service, seq.stepStart, -n);
    const batch = this.batch;
    let i = 0;
    while (i < this.batchLength && batch[i] !== seq) i++;
    if (i === this.batchLength) return;
    for (; i < this.batchLength - 1; i++) batch[i] = batch[i + 1]!;
    batch[--this.batchLength] = null;
  }

  #preempt(seq: Sequence): void {
    this.#removeFromBatch(seq);
    this.#preemptedThisStep = true;
    this.#pool.free(seq.blockTable, seq.rid, seq.epoch);
    this.#removeRunning(seq);
    seq.epoch = (seq.epoch + 1) >>> 0;
    seq.computed = 0;
    seq.state = "waiting";
    seq.preempted = true;
    this.#preempted.pushFront(seq);
    this.#counters.preemptions++;
  }

  /** Ends `seq` (`end`) and reports `error` to it. */
  fail(seq: Sequence, error: WireError): void {
    this.end(seq);
    seq.events.onError(error);
  }

  /**
   * Frees the request's pages and forgets it; later calls for the same request do nothing. A
   * request that `finished` first caches its full pages (prompt and generated tokens: the next
   * turn of a chat starts with them).
   */
  end(seq: Sequence, finished = false): void {
    if (seq.state === "done") return;
    if (finished && seq.cacheSalt !== null && seq.ownership === "local") this.insertPrefix(seq, seq.computed);
    if (seq.ownership === "local") this.#pool.free(seq.blockTable, seq.rid, seq.epoch);
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
    // Its grammar matcher (structured output) lives in xgrammar's wasm memory: freed now.
    seq.matcher?.dispose();
    seq.matcher = null;
    this.requests.delete(seq.rid);
  }

  #removeRunning(seq: Sequence): void {
    const i = this.running.indexOf(seq);
    if (i >= 0) this.running.splice(i, 1);
  }
}
