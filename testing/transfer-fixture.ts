/**
 * A decode-side pool and ownership table over SharedArrayBuffers for transfer tests, plus a source
 * of distinct page contents on the prefill side.
 */
import { OwnershipTable } from "../src/kvcache/ownership-table.js";
import type { TransferLease } from "../src/transfer/transport.js";

export interface TransferFixture {
  readonly pool: Uint8Array | Uint16Array;
  readonly table: OwnershipTable;
  readonly pageBytes: number;
  readonly numPages: number;
}

export function transferFixture(numPages: number, pageBytes: number): TransferFixture {
  const pool = new Uint8Array(new SharedArrayBuffer(numPages * pageBytes));
  const table = new OwnershipTable(numPages, {
    buffer: new SharedArrayBuffer(OwnershipTable.bytesFor(numPages)),
  });
  return { pool, table, pageBytes, numPages };
}

/**
 * A pool past 4 GiB — more than one Uint8Array holds on Node 20, so its data is a Uint16Array, as
 * an f16 PagePool's — whose pages below 4 GiB all belong to request 1 already: the next lease lies
 * past 2^32. The memory is only reserved; a test touches the pages it writes.
 */
export function transferFixturePast4GiB(pageBytes: number): TransferFixture {
  const below = 2 ** 32 / pageBytes;
  const numPages = below + 4;
  const pool = new Uint16Array(new SharedArrayBuffer(numPages * pageBytes));
  const table = new OwnershipTable(numPages, {
    buffer: new SharedArrayBuffer(OwnershipTable.bytesFor(numPages)),
  });
  if (!table.allocate(below, 1, 1, 0, new Int32Array(below), new Uint32Array(below)))
    throw new Error(`Pool full: ${below}`);
  return { pool, table, pageBytes, numPages };
}

/** Reserves `count` pages for `(rid, epoch)` and returns the lease decode would grant. */
export function reserveLease(
  fx: TransferFixture,
  rid: number,
  epoch: number,
  count: number,
  layoutSignature = "test",
): TransferLease {
  const pages = new Int32Array(count);
  const generations = new Uint32Array(count);
  if (!fx.table.allocate(count, rid, epoch, 0, pages, generations)) throw new Error(`Pool full: ${count}`);
  return {
    type: "lease",
    rid,
    epoch,
    incarnation: 0,
    pages: Array.from(pages, (page, i) => ({ page, generation: generations[i]! })),
    pageSize: 16,
    layoutSignature,
  };
}

/** Distinct, deterministic bytes for logical page `index` of request `rid`. */
export function sourcePage(pageBytes: number, rid: number, index: number): Uint8Array {
  const out = new Uint8Array(pageBytes);
  let x = (rid * 2654435761 + index * 40503 + 1) >>> 0;
  for (let i = 0; i < pageBytes; i++) {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    out[i] = x & 0xff;
  }
  return out;
}
