/**
 * The KV page pool of docs/design.md §3: the KV data of one node as one typed array (over a
 * `SharedArrayBuffer`, or a caller-supplied buffer and offset, e.g. inside a shared
 * `WebAssembly.Memory`) cut into pages of `pageSize` tokens in the page-major layout of
 * `kv-layout.ts`, plus the ownership table that says who holds each page and whose data it holds.
 * The array is a `Float32Array` for an f32 layout and a `Uint16Array` of raw half-float bits for
 * f16/bf16 (`KvData`); nothing here reads the values, so the pool is the same for every dtype.
 *
 * The data is allocated once and starts all zeros: a fresh buffer is (the operating system hands out
 * zeroed pages, faulted in only when first written, so an idle pool costs no resident memory and
 * no start-up time), and a caller's buffer is zeroed here unless the caller vouches it is fresh
 * (`zeroed`: a kernel arena's first use, src/kernels/wasm-kernels.ts `freshArena`). Pages are
 * **not zeroed** on free, as in real engines: stale KV stays in a freed page until it is
 * overwritten, which is exactly why every read is checked. `scrubOnFree` zeroes a page as it is
 * freed, at a measured cost.
 *
 * ## The per-step read check (`checkStep`) and the partially filled page
 *
 * A step computes tokens `[start, end)` of one request: it writes their K/V into the pool and its
 * attention reads slots `[0, end)`. For page `j` of the block table (slots `[j·P, (j+1)·P)`):
 *
 * - **Pages holding earlier tokens** (`j·P < start`): the step reads them. They must pass
 *   `OwnershipTable.checkRead` — READY at the leased generation, leased to `(rid, epoch)` and
 *   stamped with `(rid, epoch)` as the writer — and their stamped `filledTokens` must cover every
 *   slot read from them that the step does not write (`min(P, start − j·P)`). This includes the
 *   **partially filled last page** of a decoding request: it became READY when its first tokens
 *   were computed, and the step appends to it (the owner writing into its own READY page).
 * - **Pages first written by this step** (`start ≤ j·P < end`): they must be RESERVED at the
 *   leased generation for `(rid, epoch)` (`checkWrite`). Their writer stamp is *not* required to be
 *   the owner's, because every slot of them that the step reads is one it writes first (attention
 *   is causal, and the forward pass writes a layer's K/V before that layer's attention).
 * - **Pages past `end`** (reserved ahead, not touched this step): leased to `(rid, epoch)` at the
 *   leased generation, RESERVED or READY.
 *
 * After the forward pass, `recordStep` stamps every page the step wrote with `(rid, epoch)` and its
 * filled token count (the same step as the data, right after it), and marks the fresh ones READY:
 * a page is READY once any of its tokens are computed, and stays READY while its owner appends.
 * A page reserved but never written keeps an earlier request's stamp and never turns READY through
 * this path, so a read of it fails the check.
 *
 * **Shared pages** (a prefix-cache hit, `src/protocol/prefix-cache.ts`): pages the block table
 * marks as shared references must pass `OwnershipTable.checkShared` instead of `checkRead`: SHARED
 * at the generation, of the reader's tenant, referenced. They are always full and always before
 * `start` (a hit covers whole pages of the prompt and the step computes after them), so a step
 * never writes one.
 *
 * The rule is written once, in `OwnershipTable.checkStep`: this pool's `checkStep` (the engine's
 * guard for the requests whose pages it owns or computes) and the decode state machine's per-token
 * check (the decode node's committed requests, see `src/protocol/decode-machine.ts`) both call it,
 * and each token is checked by exactly one of them.
 */

import { KvfenceError } from "../lib/errors.js";
import type { BlockTable } from "./block-table.js";
import { checkBufferRange } from "./buffer-range.js";
import type { KvDtype, KvLayout } from "./kv-layout.js";
import { kvDtypeOf, kvElementBytes, pageBytes, pageFloats } from "./kv-layout.js";
import { OwnershipTable, type PageCounts, PageState } from "./ownership-table.js";

export interface PagePoolOptions {
  /** Zero each page's data as it is freed (default false: pages keep stale KV, as in real engines). */
  readonly scrubOnFree?: boolean;
  /** Buffer for the KV data; a fresh `SharedArrayBuffer` when omitted. */
  readonly dataBuffer?: SharedArrayBuffer | ArrayBuffer;
  /** Byte offset of the KV data in `dataBuffer`; a multiple of 4. Default 0. */
  readonly dataByteOffset?: number;
  /** Buffer for the ownership table; a fresh `SharedArrayBuffer` when omitted. */
  readonly tableBuffer?: SharedArrayBuffer | ArrayBuffer;
  /** Byte offset of the table in `tableBuffer`. Default 0. */
  readonly tableByteOffset?: number;
  /** Attach to a pool another thread already initialised in the given buffers (no reset, no touch). */
  readonly attach?: boolean;
  /**
   * The caller vouches that the data range of `dataBuffer` is all zeros and was never written (fresh
   * memory), so the pool neither zeroes nor touches it. Default false: a caller's range is zeroed
   * here. A pool's own fresh buffer (no `dataBuffer`) is never zeroed: it is zero.
   */
  readonly zeroed?: boolean;
}

/** A pool's KV data: f32 elements, or the raw bits of 2-byte f16/bf16 elements. */
export type KvData = Float32Array | Uint16Array;

/** Result of `PagePool.checkStep`: -1 when every page passes, else the first failing logical page. */
export type StepCheck = number;

export class PagePool {
  readonly layout: KvLayout;
  readonly numPages: number;
  readonly pageSize: number;
  /** Elements per page (all layers, K and V). */
  readonly pageFloats: number;
  /** Bytes per page at the layout's dtype. */
  readonly pageBytes: number;
  readonly dtype: KvDtype;
  /** The KV data, page-major: page p starts at element `p * pageFloats`. */
  readonly data: KvData;
  readonly table: OwnershipTable;
  readonly scrubOnFree: boolean;
  readonly #outPages: Int32Array;
  readonly #outGenerations: Uint32Array;

  /** Bytes of KV data a pool of `numPages` pages needs. */
  static dataBytesFor(layout: KvLayout, numPages: number): number {
    return pageBytes(layout) * numPages;
  }

  /**
   * The most pages a pool of `layout` holds: its data is one typed array, and a typed array holds
   * at most 2^32 elements on Node 20 (8 GiB of f16 or bf16, 16 GiB of f32).
   */
  static maxPages(layout: KvLayout): number {
    return Math.floor(2 ** 32 / pageFloats(layout));
  }

  constructor(layout: KvLayout, numPages: number, options: PagePoolOptions = {}) {
    if (!Number.isInteger(numPages) || numPages < 1) {
      throw new KvfenceError(
        "config_invalid",
        `KV pool size must be a positive integer number of pages: ${numPages}`,
      );
    }
    if (numPages > PagePool.maxPages(layout)) {
      throw new KvfenceError(
        "config_invalid",
        `A KV pool holds at most 2^32 elements (${PagePool.maxPages(layout)} pages of this layout) but ${numPages} pages were asked for; use a smaller --kv-memory or --kv-pages, or a smaller --max-model-len`,
      );
    }
    this.layout = layout;
    this.numPages = numPages;
    this.pageSize = layout.pageSize;
    this.pageFloats = pageFloats(layout);
    this.pageBytes = pageBytes(layout);
    this.dtype = kvDtypeOf(layout);
    this.scrubOnFree = options.scrubOnFree ?? false;
    const dataBytes = PagePool.dataBytesFor(layout, numPages);
    const dataOffset = options.dataByteOffset ?? 0;
    const dataBuffer = options.dataBuffer ?? new SharedArrayBuffer(dataBytes);
    checkBufferRange("KV pool", {
      numPages,
      bytes: dataBytes,
      byteOffset: dataOffset,
      buffer: dataBuffer,
      sizedBy: "PagePool.dataBytesFor",
    });
    this.data =
      kvElementBytes(this.dtype) === 4
        ? new Float32Array(dataBuffer, dataOffset, numPages * this.pageFloats)
        : new Uint16Array(dataBuffer, dataOffset, numPages * this.pageFloats);
    const attach = options.attach ?? false;
    this.table = new OwnershipTable(numPages, {
      buffer: options.tableBuffer ?? new SharedArrayBuffer(OwnershipTable.bytesFor(numPages)),
      byteOffset: options.tableByteOffset ?? 0,
      attach,
    });
    // A range not known fresh is zeroed; a fresh one is left untouched (a page is faulted in, as
    // zeros, by the first step that writes it: ~90 faults a 16-token page of a 135M model, µs).
    const fresh = options.dataBuffer === undefined || options.zeroed === true;
    if (!attach && !fresh) this.data.fill(0);
    this.#outPages = new Int32Array(numPages);
    this.#outGenerations = new Uint32Array(numPages);
  }

  /** Tokens the pool holds in all. */
  get capacityTokens(): number {
    return this.numPages * this.pageSize;
  }

  /** Free pages right now. */
  get freePages(): number {
    return this.table.counts().free;
  }

  /**
   * Leases `count` more pages to `(rid, epoch)` of `tenant` and appends them to `blockTable`, all
   * or nothing. Returns false (changing nothing) when the pool has fewer than `count` free pages.
   */
  allocate(count: number, rid: number, epoch: number, tenant: number, blockTable: BlockTable): boolean {
    if (count === 0) return true;
    if (blockTable.length + count > blockTable.capacity) {
      // An empty pool answers "no" first (all or nothing, nothing changed); a block table too small
      // for pages the pool could give is a scheduler bug.
      if (count > this.freePages) return false;
      throw new RangeError(
        `Block table of ${blockTable.capacity} pages cannot take ${count} more after: ${blockTable.length}`,
      );
    }
    const pages = this.#outPages;
    const generations = this.#outGenerations;
    if (!this.table.allocate(count, rid, epoch, tenant, pages, generations)) return false;
    for (let i = 0; i < count; i++) blockTable.push(pages[i]!, generations[i]!);
    return true;
  }

  /**
   * Frees every page of `blockTable` still leased to `(rid, epoch)` at its generation, drops the
   * table's references to shared prefix-cache pages (`unref`: they stay cached), and clears the
   * table. A page not held any more (freed already, re-leased to someone else) is left alone, so
   * calling this twice frees nothing the second time. Returns the number of pages freed.
   */
  free(blockTable: BlockTable, rid: number, epoch: number): number {
    const table = this.table;
    const pf = this.pageFloats;
    let freed = 0;
    for (let i = 0; i < blockTable.length; i++) {
      const page = blockTable.pages[i]!;
      if (blockTable.shared[i] === 1) {
        table.unref(page, blockTable.generations[i]!);
        blockTable.shared[i] = 0;
      } else if (table.free(page, blockTable.generations[i]!, rid, epoch)) {
        freed++;
        if (this.scrubOnFree) this.data.fill(0, page * pf, (page + 1) * pf);
      }
    }
    blockTable.clear();
    return freed;
  }

  /**
   * The read guard for one step of one request computing tokens `[start, end)`; see the module
   * header for the rule. Returns -1 when every page of `blockTable` passes, else the index of the
   * first page that fails. Integer compares only; allocates nothing.
   */
  checkStep(
    blockTable: BlockTable,
    rid: number,
    epoch: number,
    start: number,
    end: number,
    tenant = 0,
  ): StepCheck {
    return this.table.checkStep(
      this.pageSize,
      blockTable.pages,
      blockTable.generations,
      blockTable.length,
      rid,
      epoch,
      start,
      end,
      blockTable.shared,
      tenant,
    );
  }

  /**
   * After a step wrote tokens `[start, end)` of `(rid, epoch)`: stamps each written page with the
   * writer and its filled token count, and marks the pages first written by this step READY.
   */
  recordStep(blockTable: BlockTable, rid: number, epoch: number, start: number, end: number): void {
    if (end <= start) return;
    const table = this.table;
    const P = this.pageSize;
    const firstPage = Math.floor(start / P);
    const lastPage = Math.floor((end - 1) / P);
    for (let j = firstPage; j <= lastPage; j++) {
      const page = blockTable.pages[j]!;
      const filled = Math.min(end - j * P, P);
      table.stampWriter(page, rid, epoch, filled);
      if (table.state(page) === PageState.RESERVED)
        table.markReady(page, blockTable.generations[j]!, rid, epoch);
    }
  }

  /** Page counts per state. */
  counts(): PageCounts {
    return this.table.counts();
  }

  /** Writes the page counts per state into `out` (no allocation). */
  countsInto(out: PageCounts): PageCounts {
    return this.table.countsInto(out);
  }
}
