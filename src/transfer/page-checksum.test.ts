import assert from "node:assert/strict";
import { test } from "node:test";
import { OwnershipTable } from "../kvcache/ownership-table.js";
import { PageChecksums, pageChecksumHex } from "./page-checksum.js";

const PAGE_BYTES = 256;
const NUM_PAGES = 4;

/** A pool whose pages are all leased to request 42, epoch 3, and written (stamped) by it. */
function fixture() {
  const pool = new Uint8Array(NUM_PAGES * PAGE_BYTES);
  for (let i = 0; i < pool.length; i++) pool[i] = (i * 31 + 7) & 0xff;
  const table = new OwnershipTable(NUM_PAGES);
  const pages = new Int32Array(NUM_PAGES);
  const generations = new Uint32Array(NUM_PAGES);
  assert.ok(table.allocate(NUM_PAGES, 42, 3, 0, pages, generations));
  for (const page of pages) table.stampWriter(page, 42, 3, 16);
  const sums = new PageChecksums(pool, PAGE_BYTES, table);
  const now = (page: number, index: number, epoch = 3): string =>
    pageChecksumHex(pool.subarray(page * PAGE_BYTES, (page + 1) * PAGE_BYTES), 42, epoch, index);
  return { pool, table, pages, generations, sums, now };
}

test("PageChecksums.get() serves the checksum recorded at production without hashing again", () => {
  const { pool, sums, now } = fixture();
  sums.recordLease({ rid: 42, epoch: 3, pages: [{ page: 2 }, { page: 0 }] }, 0, 2);
  assert.equal(sums.recorded, 2);
  const recorded = sums.get(0, 42, 3, 1);
  assert.equal(recorded, now(0, 1));
  assert.equal(sums.hits, 1);
  // The limit of any cache: bytes changed without a new writer stamp go unseen.
  pool[0]! ^= 1;
  assert.equal(sums.get(0, 42, 3, 1), recorded);
  assert.equal(sums.misses, 0);
});

test("PageChecksums.get() hashes again for another key", () => {
  const { sums, now } = fixture();
  sums.record(1, 42, 3, 0);
  assert.equal(sums.get(1, 42, 3, 1), now(1, 1));
  assert.equal(sums.get(1, 42, 4, 0), now(1, 0, 4));
  assert.equal(sums.misses, 2);
  assert.equal(sums.hits, 0);
});

test("PageChecksums.get() hashes again after another attempt wrote the page", () => {
  const { pool, table, sums, now } = fixture();
  sums.record(1, 42, 3, 0);
  pool[PAGE_BYTES]! ^= 0xff; // a late or misaddressed write of request 7 lands after the hash
  table.stampWriter(1, 7, 1, 16);
  assert.equal(sums.get(1, 42, 3, 0), now(1, 0));
  assert.equal(sums.misses, 1);
});

test("PageChecksums.get() hashes again after more tokens were written into the page", () => {
  const { pool, table, sums, now } = fixture();
  table.stampWriter(3, 42, 3, 5);
  sums.record(3, 42, 3, 0);
  pool[3 * PAGE_BYTES + 100]! ^= 0xff; // the next chunk fills the rest of the partial page
  table.stampWriter(3, 42, 3, 16);
  assert.equal(sums.get(3, 42, 3, 0), now(3, 0));
  assert.equal(sums.misses, 1);
});

test("PageChecksums.get() never serves an entry across a free and a new allocation of the page", () => {
  const { pool, table, pages, generations, sums, now } = fixture();
  const i = pages.indexOf(2);
  sums.record(2, 42, 3, 0);
  assert.ok(table.free(2, generations[i]!, 42, 3));
  // Reallocated to the same (rid, epoch) and rewritten with other bytes, stamped alike.
  const again = new Int32Array(1);
  assert.ok(table.allocate(1, 42, 3, 0, again, new Uint32Array(1)));
  assert.equal(again[0], 2);
  pool[2 * PAGE_BYTES]! ^= 0xff;
  table.stampWriter(2, 42, 3, 16);
  assert.equal(sums.get(2, 42, 3, 0), now(2, 0));
  assert.equal(sums.hits, 0);
});

test("PageChecksums.record() skips a page its attempt has not written", () => {
  const { table, sums, now } = fixture();
  table.stampWriter(0, 9, 9, 16);
  sums.record(0, 42, 3, 0);
  assert.equal(sums.recorded, 0);
  assert.equal(sums.get(0, 42, 3, 0), now(0, 0));
  assert.equal(sums.misses, 1);
});
