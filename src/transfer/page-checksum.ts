/**
 * Per-page checksums of the transfer manifest: xxhash64 of the page bytes, seeded by a key derived
 * from `(rid, epoch, logical page index)`, so a page of another request, another attempt or another
 * position never matches even when its bytes are identical (a page holding an earlier request's KV,
 * a page written at the wrong index). On the wire a checksum is 16 lowercase hex digits
 * (`Manifest.checksums`, JSON has no bigint).
 *
 * `@node-rs/xxhash`'s native `xxh64` reads SharedArrayBuffer-backed views in place; it measured
 * ≈22 GB/s here against ≈10 GB/s for `xxhash-wasm` (docs/benchmarks.md §3.3; `kvfence bench transfer`
 * re-measures both per page).
 *
 * `PageChecksums` moves the hashing off the transfer's critical path: prefill hashes each page when
 * the engine has produced it, decode as it lands (on its own thread, in parallel with the writes
 * still arriving), so the manifest and the commit check only read recorded strings.
 */
import { xxh64 } from "@node-rs/xxhash";
import { type ByteRange, byteView } from "../lib/byte-range.js";

const keyBytes = new Uint8Array(12);
const keyView = new DataView(keyBytes.buffer);

/** The xxhash64 seed for page `index` of `(rid, epoch)`. */
export function pageChecksumSeed(rid: number, epoch: number, index: number): bigint {
  keyView.setUint32(0, rid, true);
  keyView.setUint32(4, epoch, true);
  keyView.setUint32(8, index, true);
  return xxh64(keyBytes, 0x6b7666656e6365n);
}

/** The checksum of one page's bytes as page `index` of `(rid, epoch)`. */
export function pageChecksum(bytes: Uint8Array, rid: number, epoch: number, index: number): bigint {
  return xxh64(bytes, pageChecksumSeed(rid, epoch, index));
}

/** A checksum as it travels in a manifest: 16 lowercase hex digits. */
export function checksumHex(checksum: bigint): string {
  return checksum.toString(16).padStart(16, "0");
}

/** `checksumHex(pageChecksum(...))`. */
export function pageChecksumHex(bytes: Uint8Array, rid: number, epoch: number, index: number): string {
  return checksumHex(pageChecksum(bytes, rid, epoch, index));
}

/** The lease fields a checksum pass needs. */
export interface ChecksumLease {
  readonly rid: number;
  readonly epoch: number;
  readonly pages: readonly { readonly page: number }[];
}

/**
 * Hex checksums of logical pages `[from, to)` of a lease, read from `poolBytes` (the whole pool,
 * page p at `p * pageBytes`; a range, as a pool may pass 4 GiB), into `out[from..to)`. Decode calls
 * this over its own copy.
 */
export function checksumLeasePages(
  out: string[],
  poolBytes: ByteRange,
  pageBytes: number,
  lease: ChecksumLease,
  from: number,
  to: number,
): void {
  for (let i = from; i < to; i++) {
    const page = byteView(poolBytes, lease.pages[i]!.page * pageBytes, pageBytes);
    out[i] = pageChecksumHex(page, lease.rid, lease.epoch, i);
  }
}

/** What a checksum cache reads of the ownership table (`OwnershipTable` has it). */
export interface PageStamps {
  generation(page: number): number;
  writerRid(page: number): number;
  writerEpoch(page: number): number;
  filledTokens(page: number): number;
}

/**
 * Page checksums computed when the page's bytes were produced — prefill: after the engine step
 * that filled the page; decode: as the transport reports the page landed (`pagesLanded`) — and
 * served later at the protocol's checksum points (`KvPool.pageChecksum`, `PageChecksums.get`), so
 * neither side hashes in series with the transfer.
 *
 * A recorded value is served only while the page provably still holds the bytes that were hashed:
 * the same key `(rid, epoch, index)`, the same `generation` (bumped by every free and every
 * allocation, so freeing or reallocating a page invalidates its entry), a writer stamp naming that
 * attempt, and the same filled-token count. Every writer of page bytes (the engine's step, the
 * shared-memory writer, the TCP receiver) stamps the page right after writing it, so a write by
 * anyone else after the hash changes the stamp and the value is hashed again on the spot. What a
 * cache cannot see is a write that does not stamp, or that stamps the same attempt without being
 * reported (see docs/protocol.md, "Checksums off the critical path").
 */
export class PageChecksums {
  readonly #poolBytes: ByteRange;
  readonly #pageBytes: number;
  readonly #stamps: PageStamps;
  readonly #hex: string[];
  readonly #rid: Uint32Array;
  readonly #epoch: Uint32Array;
  readonly #index: Int32Array;
  readonly #generation: Uint32Array;
  readonly #filled: Uint32Array;
  /** `get` served from the cache / hashed on the spot; `record` calls that hashed. */
  hits = 0;
  misses = 0;
  recorded = 0;

  /**
   * `poolBytes`: the whole pool, page p at `p * pageBytes` (a range: a pool may pass 4 GiB, more
   * than one Uint8Array holds); `stamps`: its ownership table.
   */
  constructor(poolBytes: ByteRange, pageBytes: number, stamps: PageStamps) {
    const numPages = Math.floor(poolBytes.byteLength / pageBytes);
    this.#poolBytes = poolBytes;
    this.#pageBytes = pageBytes;
    this.#stamps = stamps;
    this.#hex = new Array<string>(numPages).fill("");
    this.#rid = new Uint32Array(numPages);
    this.#epoch = new Uint32Array(numPages);
    this.#index = new Int32Array(numPages).fill(-1);
    this.#generation = new Uint32Array(numPages);
    this.#filled = new Uint32Array(numPages);
  }

  /**
   * Hashes `page` now as page `index` of `(rid, epoch)` and remembers it, if the page's writer
   * stamp names that attempt (else there is nothing of it to hash; `get` will hash what is there).
   */
  record(page: number, rid: number, epoch: number, index: number): void {
    const stamps = this.#stamps;
    // Read the stamp before the bytes: a writer stamps after writing, so a write racing this hash
    // leaves a stamp that differs from the one recorded here.
    if (stamps.writerRid(page) !== rid || stamps.writerEpoch(page) !== epoch) {
      this.#index[page] = -1;
      return;
    }
    const generation = stamps.generation(page);
    const filled = stamps.filledTokens(page);
    this.#hex[page] = this.#hash(page, rid, epoch, index);
    this.#rid[page] = rid;
    this.#epoch[page] = epoch;
    this.#index[page] = index;
    this.#generation[page] = generation;
    this.#filled[page] = filled;
    this.recorded++;
  }

  /** `record` for logical pages `[from, to)` of `lease` (decode's `pagesLanded`). */
  recordLease(lease: ChecksumLease, from: number, to: number): void {
    for (let i = from; i < to; i++) this.record(lease.pages[i]!.page, lease.rid, lease.epoch, i);
  }

  /** The counters, for a node's stats. */
  counts(): { recorded: number; hits: number; misses: number } {
    return { recorded: this.recorded, hits: this.hits, misses: this.misses };
  }

  /** The hex checksum of the bytes `page` holds as page `index` of `(rid, epoch)`. */
  get(page: number, rid: number, epoch: number, index: number): string {
    const stamps = this.#stamps;
    if (
      this.#index[page] === index &&
      this.#rid[page] === rid &&
      this.#epoch[page] === epoch &&
      stamps.generation(page) === this.#generation[page] &&
      stamps.writerRid(page) === rid &&
      stamps.writerEpoch(page) === epoch &&
      stamps.filledTokens(page) === this.#filled[page]
    ) {
      this.hits++;
      return this.#hex[page]!;
    }
    this.misses++;
    return this.#hash(page, rid, epoch, index);
  }

  #hash(page: number, rid: number, epoch: number, index: number): string {
    const bytes = byteView(this.#poolBytes, page * this.#pageBytes, this.#pageBytes);
    return pageChecksumHex(bytes, rid, epoch, index);
  }
}
