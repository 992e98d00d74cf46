/**
 * A decode-side pool and ownership table over SharedArrayBuffers for transfer tests, plus a source
 * of distinct page contents on the prefill side.
 */
import { OwnershipTable } from "../src/kvcache/ownership-table.js";
import type { TransferLease } from "../src/transfer/transport.js";

export interface TransferFixture {
  readonly pool: Uint8Array;
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
