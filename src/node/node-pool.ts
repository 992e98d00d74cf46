/**
 * The protocol's view of a node's KV pool (`KvPool` of `src/protocol/effects.ts`) over a real
 * `PagePool`: the ownership table itself, and page checksums with the transfer's xxhash64
 * (`src/transfer/page-checksum.ts`) served by the node's `PageChecksums` — recorded when a page was
 * produced (prefill) or landed (decode), hashed on the spot only when no valid record exists.
 */
import type { PagePool } from "../kvcache/page-pool.js";
import type { KvPool } from "../protocol/effects.js";
import { PageChecksums } from "../transfer/page-checksum.js";

/** Bytes of one page in `pool.data`. */
export function pageByteLength(pool: PagePool): number {
  return pool.pageBytes;
}

/** The bytes of `page` (a view, no copy). */
export function pageBytesOf(pool: PagePool, page: number): Uint8Array {
  const n = pageByteLength(pool);
  return new Uint8Array(pool.data.buffer, pool.data.byteOffset + page * n, n);
}

/** A checksum cache over the whole of `pool` (its data as a byte range) and its ownership table. */
export function pageChecksumsOf(pool: PagePool): PageChecksums {
  return new PageChecksums(pool.data, pageByteLength(pool), pool.table);
}

/** The protocol pool of `pool`; `checksums` (default: a fresh cache) serves `pageChecksum`. */
export function protocolPool(pool: PagePool, checksums: PageChecksums = pageChecksumsOf(pool)): KvPool {
  return {
    table: pool.table,
    pageSize: pool.pageSize,
    pageChecksum: (page, rid, epoch, index) => checksums.get(page, rid, epoch, index),
  };
}
