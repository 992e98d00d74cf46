/**
 * The protocol's view of a node's KV pool (`KvPool` of `src/protocol/effects.ts`) over a real
 * `PagePool`: the ownership table itself, and page checksums computed with the transfer's xxhash64
 * (`src/transfer/page-checksum.ts`) over the page's bytes in place.
 */
import type { PagePool } from "../kvcache/page-pool.js";
import type { KvPool } from "../protocol/effects.js";
import { pageChecksumHex } from "../transfer/page-checksum.js";

/** Bytes of one page in `pool.data`. */
export function pageByteLength(pool: PagePool): number {
  return pool.pageFloats * 4;
}

/** The bytes of `page` (a view, no copy). */
export function pageBytesOf(pool: PagePool, page: number): Uint8Array {
  const n = pageByteLength(pool);
  return new Uint8Array(pool.data.buffer, pool.data.byteOffset + page * n, n);
}

export function protocolPool(pool: PagePool): KvPool {
  return {
    table: pool.table,
    pageSize: pool.pageSize,
    pageChecksum: (page, rid, epoch, index) => pageChecksumHex(pageBytesOf(pool, page), rid, epoch, index),
  };
}
