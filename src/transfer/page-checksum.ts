/**
 * Per-page checksums of the transfer manifest: xxhash64 of the page bytes, seeded by a key derived
 * from `(rid, epoch, logical page index)`, so a page of another request, another attempt or another
 * position never matches even when its bytes are identical (a page holding an earlier request's KV,
 * a page written at the wrong index). On the wire a checksum is 16 lowercase hex digits
 * (`Manifest.checksums`, JSON has no bigint).
 *
 * `@node-rs/xxhash`'s native `xxh64` reads SharedArrayBuffer-backed views in place; it measured
 * ≈22 GB/s here against ≈10 GB/s for `xxhash-wasm` (MEASUREMENTS §4; `kvfence bench transfer`
 * re-measures both per page).
 *
 * `LandedChecksums` lets decode hash each page as it lands — on its own thread, in parallel with the
 * writes still arriving — so the commit check at manifest time only compares strings.
 */
import { xxh64 } from "@node-rs/xxhash";

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
 * page p at `p * pageBytes`), into `out[from..to)`. Decode calls this over its own copy.
 */
export function checksumLeasePages(
  out: string[],
  poolBytes: Uint8Array,
  pageBytes: number,
  lease: ChecksumLease,
  from: number,
  to: number,
): void {
  for (let i = from; i < to; i++) {
    const start = lease.pages[i]!.page * pageBytes;
    out[i] = pageChecksumHex(poolBytes.subarray(start, start + pageBytes), lease.rid, lease.epoch, i);
  }
}

/**
 * Checksums decode computed as pages landed, per physical page with the key they were computed
 * under. `get` returns the recorded value only for the same `(rid, epoch, index)` and when the
 * page's writer stamp still names that attempt; anything else is hashed again on the spot. Pass
 * it as the node pool's `pageChecksum`, so the protocol's commit check costs string compares.
 */
export class LandedChecksums {
  readonly #poolBytes: Uint8Array;
  readonly #pageBytes: number;
  readonly #hex: string[];
  readonly #rid: Uint32Array;
  readonly #epoch: Uint32Array;
  readonly #index: Int32Array;
  /** Cache hits and misses of `get`, for the metrics. */
  hits = 0;
  misses = 0;

  constructor(poolBytes: Uint8Array, pageBytes: number) {
    const numPages = Math.floor(poolBytes.length / pageBytes);
    this.#poolBytes = poolBytes;
    this.#pageBytes = pageBytes;
    this.#hex = new Array<string>(numPages).fill("");
    this.#rid = new Uint32Array(numPages);
    this.#epoch = new Uint32Array(numPages);
    this.#index = new Int32Array(numPages).fill(-1);
  }

  /** Hashes pages `[from, to)` of `lease` now (call it from `pagesLanded`). */
  record(lease: ChecksumLease, from: number, to: number): void {
    for (let i = from; i < to; i++) {
      const page = lease.pages[i]!.page;
      this.#hex[page] = this.#hash(page, lease.rid, lease.epoch, i);
      this.#rid[page] = lease.rid;
      this.#epoch[page] = lease.epoch;
      this.#index[page] = i;
    }
  }

  /** Forgets `page` (call it when the page is freed or rewritten). */
  invalidate(page: number): void {
    this.#index[page] = -1;
  }

  /**
   * The hex checksum of `page` as page `index` of `(rid, epoch)`: recorded when it landed if the
   * key matches and `writerMatches` (the page's writer stamp is still `(rid, epoch)`), else now.
   */
  get(page: number, rid: number, epoch: number, index: number, writerMatches = true): string {
    if (
      writerMatches &&
      this.#index[page] === index &&
      this.#rid[page] === rid &&
      this.#epoch[page] === epoch
    ) {
      this.hits++;
      return this.#hex[page]!;
    }
    this.misses++;
    return this.#hash(page, rid, epoch, index);
  }

  #hash(page: number, rid: number, epoch: number, index: number): string {
    const start = page * this.#pageBytes;
    return pageChecksumHex(this.#poolBytes.subarray(start, start + this.#pageBytes), rid, epoch, index);
  }
}
