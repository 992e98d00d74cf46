/**
 * Per-page checksums of the transfer manifest: xxhash64 of the page bytes, seeded by a key derived
 * from `(rid, epoch, logical page index)`, so a page of another request, another attempt or another
 * position never matches even when its bytes are identical (a page holding an earlier request's KV,
 * a page written at the wrong index).
 *
 * `@node-rs/xxhash`'s native `xxh64` (≈22 GB/s here, MEASUREMENTS §4) is used; it reads
 * SharedArrayBuffer-backed views in place. `bench/transfer.ts` measures it against `xxhash-wasm`.
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

/**
 * Checksums of logical pages `[from, to)` of a lease, read from `poolBytes` (the whole pool, page p
 * at `p * pageBytes`), into `out[from..to)`. Decode calls this over its own copy as pages land.
 */
export function checksumLeasePages(
  out: bigint[],
  poolBytes: Uint8Array,
  pageBytes: number,
  lease: {
    readonly rid: number;
    readonly epoch: number;
    readonly pages: readonly { readonly page: number }[];
  },
  from: number,
  to: number,
): void {
  for (let i = from; i < to; i++) {
    const start = lease.pages[i]!.page * pageBytes;
    out[i] = pageChecksum(poolBytes.subarray(start, start + pageBytes), lease.rid, lease.epoch, i);
  }
}
