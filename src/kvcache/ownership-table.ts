/**
 * The page ownership table of docs/design.md §3: one entry per physical KV page, in typed arrays laid
 * over one caller-supplied buffer (a `SharedArrayBuffer` so worker threads and a one-sided writer
 * share it, or a plain `ArrayBuffer`; the model checker snapshots a table by copying its bytes).
 *
 * Per page: `generation` (bumped on every allocate and every free, so a stale `(page, generation)`
 * never matches again), the lease `owner`/`ownerEpoch`/`tenant`, `state`, `filledTokens`, and the
 * **writer stamp** `(writerRid, writerEpoch)`: whose data the page holds. The stamp is written by
 * whoever writes the page's bytes, in the same step, and is deliberately *not* reset on allocate or
 * free — pages are not zeroed, and a page that was reserved but never written still carries the
 * stamp of the earlier request whose data it holds, so `checkRead` catches a read of stale KV even
 * when every other guard is off.
 *
 * **Shared pages** (the prefix cache, `src/protocol/prefix-cache.ts`): a full READY page can be handed
 * to a cache entry (`share`): state SHARED, `owner` = the entry's id, `tenant` kept, generation
 * unchanged, and a **reference count** (`refcount`) of the requests reading it. A request that
 * hits takes a reference (`ref`) and records it in its block table; `unref` drops it; only a
 * SHARED page with no reference leaves, through `evict` (→ FREE, generation bumped). A SHARED page
 * is never writable (`checkWrite` wants RESERVED), never freed or quarantined by a lease holder
 * (`free`/`quarantine` want RESERVED or READY), and never handed out (it is not on the free stack).
 * `checkShared` is the read guard's rule for it: SHARED at the generation, a cache entry's (owner
 * epoch `NO_WRITER`), of the reader's tenant, referenced.
 *
 * **Sibling pages** (`n` > 1 on a decode node, `src/protocol/decode-machine.ts`): the full prompt
 * pages one transfer brought are shared by the request's samples, and by nobody else. `shareSiblings`
 * turns a full READY page of `(rid, epoch)` — the request's first sample, whose attempt the transfer
 * was — SHARED with owner `(rid, epoch)` kept and a reference per sample; `checkSibling` is the read
 * guard's rule for it: SHARED at the generation, owned by and holding the data of exactly the
 * reader's group `(rid, epoch)`, referenced. A prefix-cache reader's `checkShared` never accepts a
 * sibling page (its owner epoch is a real epoch), and a sibling read never accepts a cache page, nor
 * another request's sibling page. `dropSibling` drops a sample's reference; the last one frees the
 * page (→ FREE, generation bumped).
 *
 * Free pages sit on a stack inside the same buffer, so `allocate` is O(count), and the counters of
 * each state sit in a small header, so `countsInto` is O(1). Every operation is integer compares
 * and stores; nothing allocates.
 *
 * Buffer layout (all 32-bit words, little-endian host order):
 *   header[5]: freeTop, reserved, ready, quarantined, shared
 *   generation[n], owner[n], ownerEpoch[n], tenant[n], state[n], filledTokens[n],
 *   writerRid[n], writerEpoch[n], refcount[n], freeStack[n]
 *
 * Positional integer parameters (page, generation, rid, epoch) on purpose: these are per-page,
 * per-step calls that must not allocate an options object.
 *
 * Threads: one thread owns the table's lease operations (allocate, markReady, free, quarantine);
 * writers in other threads only call `stampWriter`, which publishes the stamp with `Atomics.store`
 * after the data. Generations are u32 and wrap after 2^31 allocate/free pairs of one page.
 */
import { KvfenceError } from "../lib/errors.js";
import { checkBufferRange } from "./buffer-range.js";

export const PageState = {
  FREE: 0,
  RESERVED: 1,
  READY: 2,
  QUARANTINED: 3,
  /** A full page owned by a prefix-cache entry, read-only, reference-counted. */
  SHARED: 4,
} as const;
export type PageState = (typeof PageState)[keyof typeof PageState];

/** Names of the page states, indexed by state, for logs and traces. */
export const PAGE_STATE_NAMES = ["FREE", "RESERVED", "READY", "QUARANTINED", "SHARED"] as const;

/** Page counts per state, for metrics and idle-pool checks. */
export interface PageCounts {
  free: number;
  reserved: number;
  ready: number;
  quarantined: number;
  total: number;
}

/** Writer stamp value of a page never written since the table was created. */
export const NO_WRITER = 0xffffffff;

const HEADER_WORDS = 5;
const H_FREE_TOP = 0;
const H_RESERVED = 1;
const H_READY = 2;
const H_QUARANTINED = 3;
const H_SHARED = 4;
const PAGE_ARRAYS = 10;

export interface OwnershipTableOptions {
  /** Buffer to lay the table over; a fresh `ArrayBuffer` when omitted. */
  readonly buffer?: ArrayBuffer | SharedArrayBuffer;
  /** Byte offset of the table in `buffer`; a multiple of 4. Default 0. */
  readonly byteOffset?: number;
  /**
   * Attach to a table another thread already initialised in `buffer` instead of initialising it
   * (all pages FREE). Default false.
   */
  readonly attach?: boolean;
}

export class OwnershipTable {
  readonly numPages: number;
  readonly #header: Int32Array;
  readonly #generation: Uint32Array;
  readonly #owner: Uint32Array;
  readonly #ownerEpoch: Uint32Array;
  readonly #tenant: Uint32Array;
  readonly #state: Uint32Array;
  readonly #filledTokens: Uint32Array;
  readonly #writerRid: Uint32Array;
  readonly #writerEpoch: Uint32Array;
  readonly #refcount: Uint32Array;
  readonly #freeStack: Int32Array;
  readonly #bytes: Uint8Array;

  /** Bytes a table of `numPages` pages occupies in a buffer. */
  static bytesFor(numPages: number): number {
    return (HEADER_WORDS + PAGE_ARRAYS * numPages) * 4;
  }

  constructor(numPages: number, options: OwnershipTableOptions = {}) {
    if (!Number.isInteger(numPages) || numPages < 1 || numPages > 0x7fffffff) {
      throw new KvfenceError(
        "config_invalid",
        `Ownership table size must be a positive integer number of pages: ${numPages}`,
      );
    }
    const byteOffset = options.byteOffset ?? 0;
    const bytes = OwnershipTable.bytesFor(numPages);
    const buffer = options.buffer ?? new ArrayBuffer(bytes);
    checkBufferRange("Ownership table", {
      numPages,
      bytes,
      byteOffset,
      buffer,
      sizedBy: "OwnershipTable.bytesFor",
    });
    this.numPages = numPages;
    this.#bytes = new Uint8Array(buffer, byteOffset, bytes);
    this.#header = new Int32Array(buffer, byteOffset, HEADER_WORDS);
    let at = byteOffset + HEADER_WORDS * 4;
    const u32 = (): Uint32Array => {
      const a = new Uint32Array(buffer, at, numPages);
      at += numPages * 4;
      return a;
    };
    this.#generation = u32();
    this.#owner = u32();
    this.#ownerEpoch = u32();
    this.#tenant = u32();
    this.#state = u32();
    this.#filledTokens = u32();
    this.#writerRid = u32();
    this.#writerEpoch = u32();
    this.#refcount = u32();
    this.#freeStack = new Int32Array(buffer, at, numPages);
    if (options.attach !== true) this.reset();
  }

  /** Every page FREE, generations 0, no writer; the free stack pops page 0 first. */
  reset(): void {
    this.#bytes.fill(0);
    const n = this.numPages;
    this.#writerRid.fill(NO_WRITER);
    this.#writerEpoch.fill(NO_WRITER);
    for (let i = 0; i < n; i++) this.#freeStack[i] = n - 1 - i;
    this.#header[H_FREE_TOP] = n;
  }

  /** The table's bytes (a view, not a copy): copy them to snapshot, `set` them back to restore. */
  get bytes(): Uint8Array {
    return this.#bytes;
  }

  /**
   * Leases `count` free pages to `(owner, epoch)` of `tenant`, all or nothing: FREE → RESERVED,
   * generation bumped. Writes the pages and their new generations to the first `count` slots of
   * the out arrays. Returns false (and changes nothing) when fewer than `count` pages are free.
   */
  allocate(
    count: number,
    owner: number,
    epoch: number,
    tenant: number,
    outPages: Int32Array,
    outGenerations: Uint32Array,
  ): boolean {
    const header = this.#header;
    const top = header[H_FREE_TOP]!;
    if (count < 0 || count > top || outPages.length < count || outGenerations.length < count) return false;
    for (let i = 0; i < count; i++) {
      const page = this.#freeStack[top - 1 - i]!;
      const generation = (this.#generation[page]! + 1) >>> 0;
      this.#generation[page] = generation;
      this.#owner[page] = owner;
      this.#ownerEpoch[page] = epoch;
      this.#tenant[page] = tenant;
      this.#state[page] = PageState.RESERVED;
      this.#filledTokens[page] = 0;
      outPages[i] = page;
      outGenerations[i] = generation;
    }
    header[H_FREE_TOP] = top - count;
    header[H_RESERVED] = header[H_RESERVED]! + count;
    return true;
  }

  /**
   * Records that `(rid, epoch)`'s data now fills the first `filledTokens` tokens of `page`. Called
   * by whoever writes the page's bytes, right after writing them — unconditionally, because a
   * one-sided writer cannot be stopped; the readers' checks decide what the stamp means.
   */
  stampWriter(page: number, rid: number, epoch: number, filledTokens: number): void {
    this.#filledTokens[page] = filledTokens;
    this.#writerEpoch[page] = epoch;
    Atomics.store(this.#writerRid, page, rid);
  }

  /** True when `page` is RESERVED for `(rid, epoch)` at `generation`: a receiver may apply a write. */
  checkWrite(page: number, generation: number, rid: number, epoch: number): boolean {
    return (
      page >= 0 &&
      page < this.numPages &&
      this.#generation[page] === generation &&
      this.#state[page] === PageState.RESERVED &&
      this.#owner[page] === rid &&
      this.#ownerEpoch[page] === epoch
    );
  }

  /** RESERVED → READY, only for the lease holder at that generation. */
  markReady(page: number, generation: number, rid: number, epoch: number): boolean {
    if (!this.checkWrite(page, generation, rid, epoch)) return false;
    this.#state[page] = PageState.READY;
    this.#header[H_RESERVED] = this.#header[H_RESERVED]! - 1;
    this.#header[H_READY] = this.#header[H_READY]! + 1;
    return true;
  }

  /**
   * RESERVED or READY → FREE for the lease holder at that generation; the generation is bumped, so
   * a second free of the same lease returns false (pages are freed exactly once). A QUARANTINED
   * page leaves only through `releaseQuarantine`.
   */
  free(page: number, generation: number, rid: number, epoch: number): boolean {
    if (!this.#leaveLease(page, generation, rid, epoch)) return false;
    this.#pushFree(page);
    return true;
  }

  /**
   * RESERVED or READY → QUARANTINED for the lease holder: the request ended while a write to the
   * page may still land. The page keeps its generation and owner and is never handed out until
   * `releaseQuarantine`.
   */
  quarantine(page: number, generation: number, rid: number, epoch: number): boolean {
    if (!this.#leaveLease(page, generation, rid, epoch)) return false;
    this.#state[page] = PageState.QUARANTINED;
    this.#header[H_QUARANTINED] = this.#header[H_QUARANTINED]! + 1;
    return true;
  }

  /**
   * The first half of `free` and `quarantine`: for the lease holder of a RESERVED or READY page,
   * takes the page out of its state's count and returns true (the caller sets the next state);
   * false, changing nothing, for anyone else or any other state.
   */
  #leaveLease(page: number, generation: number, rid: number, epoch: number): boolean {
    if (!this.#holds(page, generation, rid, epoch)) return false;
    const state = this.#state[page]!;
    if (state === PageState.RESERVED) this.#header[H_RESERVED] = this.#header[H_RESERVED]! - 1;
    else if (state === PageState.READY) this.#header[H_READY] = this.#header[H_READY]! - 1;
    else return false;
    return true;
  }

  /**
   * QUARANTINED → FREE (generation bumped), once the writer acknowledged that its writes drained or
   * was fenced. False when the page is not quarantined at that generation.
   */
  releaseQuarantine(page: number, generation: number): boolean {
    if (page < 0 || page >= this.numPages) return false;
    if (this.#generation[page] !== generation || this.#state[page] !== PageState.QUARANTINED) return false;
    this.#header[H_QUARANTINED] = this.#header[H_QUARANTINED]! - 1;
    this.#pushFree(page);
    return true;
  }

  /**
   * The per-step read guard: `page` is READY at `generation`, leased to `(rid, epoch)`, and holds
   * `(rid, epoch)`'s own data (writer stamp). Integer compares only.
   */
  checkRead(page: number, generation: number, rid: number, epoch: number): boolean {
    return this.#ownWritten(page, generation, PageState.READY, rid, epoch);
  }

  /**
   * The page-tag check of one step of `(rid, epoch)` that computes tokens `[start, end)` over the
   * `count` pages `pages`/`generations` (logical order, `pageSize` tokens each): -1 when every page
   * passes, else the first failing logical page (`count` when the pages cannot hold `end` tokens).
   * The one rule set of every read guard — the engine's `PagePool.checkStep` and the decode state
   * machine's per-token check both call it (the rule is spelled out in `page-pool.ts`):
   *
   * - a page holding earlier tokens (`j·P < start`) passes `checkRead` and its stamped filled tokens
   *   cover every slot of it the step reads but does not write; a page the block table marks as a
   *   shared reference (`shared[j] === 1`) passes `checkShared` for `tenant` instead, and one of the
   *   first `siblings` pages (a sample of `n` > 1 on a decode node) passes `checkSibling` for the
   *   request's group `(groupRid, epoch)` instead;
   * - a page the step writes first (`start ≤ j·P < end`) passes `checkWrite` (RESERVED at the leased
   *   generation for `(rid, epoch)`);
   * - a page past `end` is leased to `(rid, epoch)` at its generation, RESERVED or READY.
   *
   * Integer compares only; allocates nothing.
   */
  checkStep(
    pageSize: number,
    pages: ArrayLike<number>,
    generations: ArrayLike<number>,
    count: number,
    rid: number,
    epoch: number,
    start: number,
    end: number,
    shared?: Uint8Array,
    tenant?: number,
    siblings = 0,
    groupRid = -1,
  ): number {
    const P = pageSize;
    if (count * P < end) return count; // the step would write past the leased pages
    for (let j = 0; j < count; j++) {
      const page = pages[j]!;
      const generation = generations[j]!;
      if (page < 0 || page >= this.numPages) return j;
      const first = j * P;
      if (j < siblings) {
        // A full prompt page shared by the request's samples: read-only, never written by a step.
        if (!this.#fullSibling(page, generation, groupRid, epoch, P, first < start)) return j;
      } else if (first < start) {
        if (!this.#readable(page, generation, rid, epoch, shared, j, tenant)) return j;
        if (this.#filledTokens[page]! < Math.min(start - first, P)) return j;
      } else if (first < end) {
        if (!this.checkWrite(page, generation, rid, epoch)) return j;
      } else if (!this.#leasedAhead(page, generation, rid, epoch)) return j;
    }
    return -1;
  }

  /**
   * READY → SHARED: a full page of `(rid, epoch)` (its own data, `fullTokens` filled) is handed to
   * the prefix-cache entry `entry`; the holder keeps one reference (refcount 1) and must record it
   * in its block table. Generation, tenant and writer stamp unchanged. False (nothing changed) when
   * the page is not that attempt's full READY page.
   */
  share(
    page: number,
    generation: number,
    rid: number,
    epoch: number,
    entry: number,
    fullTokens: number,
  ): boolean {
    if (!this.checkRead(page, generation, rid, epoch) || this.#filledTokens[page] !== fullTokens)
      return false;
    this.#state[page] = PageState.SHARED;
    this.#owner[page] = entry;
    this.#ownerEpoch[page] = NO_WRITER;
    this.#refcount[page] = 1;
    this.#header[H_READY] = this.#header[H_READY]! - 1;
    this.#header[H_SHARED] = this.#header[H_SHARED]! + 1;
    return true;
  }

  /**
   * One more reference to SHARED `page` at `generation` (a prefix-cache hit). The tenant is not
   * checked here: the read guard (`checkShared`) checks it before every read.
   */
  ref(page: number, generation: number): boolean {
    if (!this.#isCachePage(page, generation)) return false;
    this.#refcount[page] = this.#refcount[page]! + 1;
    return true;
  }

  /** Drops one reference to SHARED `page` at `generation`; false when it holds none. */
  unref(page: number, generation: number): boolean {
    if (!this.#isCachePage(page, generation) || this.#refcount[page] === 0) return false;
    this.#refcount[page] = this.#refcount[page]! - 1;
    return true;
  }

  /** SHARED with no reference → FREE (generation bumped): the prefix cache evicts it. */
  evict(page: number, generation: number): boolean {
    if (!this.#isCachePage(page, generation) || this.#refcount[page] !== 0) return false;
    this.#header[H_SHARED] = this.#header[H_SHARED]! - 1;
    this.#pushFree(page);
    return true;
  }

  /**
   * The read guard's rule for a shared page: SHARED at `generation`, of `tenant`, and referenced
   * (the reader's own reference is in its block table). Integer compares only.
   */
  checkShared(page: number, generation: number, tenant: number): boolean {
    return (
      this.#generation[page] === generation &&
      this.#state[page] === PageState.SHARED &&
      this.#ownerEpoch[page] === NO_WRITER &&
      this.#tenant[page] === tenant &&
      this.#refcount[page]! > 0
    );
  }

  /**
   * READY → SHARED between the `samples` samples of request `(rid, epoch)`: a full page of its own
   * data (`fullTokens` filled), owner `(rid, epoch)` kept, one reference per sample. False (nothing
   * changed) when the page is not that attempt's full READY page, or `samples` < 1.
   */
  shareSiblings(
    page: number,
    generation: number,
    rid: number,
    epoch: number,
    samples: number,
    fullTokens: number,
  ): boolean {
    if (samples < 1 || epoch === NO_WRITER) return false;
    if (!this.checkRead(page, generation, rid, epoch) || this.#filledTokens[page] !== fullTokens)
      return false;
    this.#state[page] = PageState.SHARED;
    this.#refcount[page] = samples;
    this.#header[H_READY] = this.#header[H_READY]! - 1;
    this.#header[H_SHARED] = this.#header[H_SHARED]! + 1;
    return true;
  }

  /**
   * The read guard's rule for a sibling page: SHARED at `generation` between the samples of exactly
   * `(groupRid, groupEpoch)` — owned by it and holding its data (writer stamp) — and referenced.
   * Integer compares only.
   */
  checkSibling(page: number, generation: number, groupRid: number, groupEpoch: number): boolean {
    return (
      this.#ownWritten(page, generation, PageState.SHARED, groupRid, groupEpoch) && this.#refcount[page]! > 0
    );
  }

  /**
   * One sample of `(groupRid, groupEpoch)` is done with its sibling page: drops its reference, and
   * the last one frees the page (→ FREE, generation bumped). False when the page is not that
   * group's sibling page at `generation`, or holds no reference.
   */
  dropSibling(page: number, generation: number, groupRid: number, groupEpoch: number): boolean {
    if (
      !this.#isShared(page, generation) ||
      this.#owner[page] !== groupRid ||
      this.#ownerEpoch[page] !== groupEpoch ||
      groupEpoch === NO_WRITER ||
      this.#refcount[page] === 0
    )
      return false;
    const left = this.#refcount[page]! - 1;
    this.#refcount[page] = left;
    if (left === 0) {
      this.#header[H_SHARED] = this.#header[H_SHARED]! - 1;
      this.#pushFree(page);
    }
    return true;
  }

  /** References held on `page` (0 unless SHARED). */
  refcount(page: number): number {
    return this.#refcount[page]!;
  }

  /** SHARED pages right now (O(1)). */
  sharedPages(): number {
    return this.#header[H_SHARED]!;
  }

  /** `checkShared` for a page the reader's block table marks as a shared reference (`shared[j]`), else `checkRead`. */
  #readable(
    page: number,
    generation: number,
    rid: number,
    epoch: number,
    shared: Uint8Array | undefined,
    j: number,
    tenant: number | undefined,
  ): boolean {
    return shared?.[j] === 1
      ? this.checkShared(page, generation, tenant ?? -1)
      : this.checkRead(page, generation, rid, epoch);
  }

  /** A page past a step's end: leased to `(rid, epoch)` at `generation`, RESERVED or READY. */
  #leasedAhead(page: number, generation: number, rid: number, epoch: number): boolean {
    const state = this.#state[page];
    return (
      this.#holds(page, generation, rid, epoch) && (state === PageState.RESERVED || state === PageState.READY)
    );
  }

  /** A sibling page a step reads (`before` its start): `checkSibling`, all its `pageSize` tokens filled. */
  #fullSibling(
    page: number,
    generation: number,
    groupRid: number,
    epoch: number,
    pageSize: number,
    before: boolean,
  ): boolean {
    return (
      before && this.checkSibling(page, generation, groupRid, epoch) && this.#filledTokens[page]! >= pageSize
    );
  }

  /** SHARED at `generation` and a prefix-cache entry's (never a request's sibling page). */
  #isCachePage(page: number, generation: number): boolean {
    return this.#isShared(page, generation) && this.#ownerEpoch[page] === NO_WRITER;
  }

  #isShared(page: number, generation: number): boolean {
    return (
      page >= 0 &&
      page < this.numPages &&
      this.#generation[page] === generation &&
      this.#state[page] === PageState.SHARED
    );
  }

  /** What the table says of `page`, for the error of a failed check (allocates: not for hot paths). */
  describe(page: number): string {
    if (page < 0 || page >= this.numPages)
      return `page ${page} is outside the pool of ${this.numPages} pages`;
    return `physical page ${page} has generation ${this.generation(page)}, owner ${this.owner(page)}/${this.ownerEpoch(page)}, state ${PAGE_STATE_NAMES[this.state(page)]}, writer ${this.writerRid(page)}/${this.writerEpoch(page)} filling ${this.filledTokens(page)} tokens${this.state(page) === PageState.SHARED ? `, tenant ${this.tenant(page)}, ${this.refcount(page)} references` : ""}`;
  }

  /** Writes the page count of each state into `out` (no allocation). */
  countsInto(out: PageCounts): PageCounts {
    const header = this.#header;
    out.free = header[H_FREE_TOP]!;
    out.reserved = header[H_RESERVED]!;
    out.ready = header[H_READY]!;
    out.quarantined = header[H_QUARANTINED]!;
    out.total = this.numPages;
    return out;
  }

  /** Page counts per state (allocates the result; use `countsInto` on hot paths). */
  counts(): PageCounts {
    return this.countsInto({ free: 0, reserved: 0, ready: 0, quarantined: 0, total: 0 });
  }

  state(page: number): PageState {
    return this.#state[page] as PageState;
  }
  generation(page: number): number {
    return this.#generation[page]!;
  }
  owner(page: number): number {
    return this.#owner[page]!;
  }
  ownerEpoch(page: number): number {
    return this.#ownerEpoch[page]!;
  }
  tenant(page: number): number {
    return this.#tenant[page]!;
  }
  filledTokens(page: number): number {
    return this.#filledTokens[page]!;
  }
  writerRid(page: number): number {
    return Atomics.load(this.#writerRid, page);
  }
  writerEpoch(page: number): number {
    return this.#writerEpoch[page]!;
  }

  /** `page` is in `state` at `generation`, leased to `(rid, epoch)` and holding its data (writer stamp). */
  #ownWritten(page: number, generation: number, state: PageState, rid: number, epoch: number): boolean {
    return (
      this.#generation[page] === generation &&
      this.#state[page] === state &&
      this.#owner[page] === rid &&
      this.#ownerEpoch[page] === epoch &&
      this.#writerRid[page] === rid &&
      this.#writerEpoch[page] === epoch
    );
  }

  #holds(page: number, generation: number, rid: number, epoch: number): boolean {
    return (
      page >= 0 &&
      page < this.numPages &&
      this.#generation[page] === generation &&
      this.#owner[page] === rid &&
      this.#ownerEpoch[page] === epoch
    );
  }

  #pushFree(page: number): void {
    this.#generation[page] = (this.#generation[page]! + 1) >>> 0;
    this.#state[page] = PageState.FREE;
    const top = this.#header[H_FREE_TOP]!;
    this.#freeStack[top] = page;
    this.#header[H_FREE_TOP] = top + 1;
  }
}
