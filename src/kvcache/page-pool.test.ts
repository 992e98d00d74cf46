import assert from "node:assert/strict";
import { test } from "node:test";
import fc from "fast-check";
import { KvfenceError } from "../lib/errors.js";
import { BlockTable } from "./block-table.js";
import type { KvLayout } from "./kv-layout.js";
import { PageState } from "./ownership-table.js";
import { PagePool } from "./page-pool.js";

const LAYOUT: KvLayout = { numLayers: 2, numKvHeads: 2, headDim: 4, pageSize: 4 };

function pageSum(pool: PagePool, page: number): number {
  let s = 0;
  for (let i = page * pool.pageFloats; i < (page + 1) * pool.pageFloats; i++) s += Math.abs(pool.data[i]!);
  return s;
}

test("PagePool keeps its data in a SharedArrayBuffer cut into page-major pages", () => {
  const pool = new PagePool(LAYOUT, 5);
  assert.ok(pool.data.buffer instanceof SharedArrayBuffer);
  assert.equal(pool.data.length, 5 * pool.pageFloats);
  assert.equal(pool.pageFloats, 2 * 2 * 4 * 2 * 4);
  assert.equal(pool.capacityTokens, 20);
  assert.deepEqual(pool.counts(), { free: 5, reserved: 0, ready: 0, quarantined: 0, total: 5 });
});

test("PagePool refuses more pages than one typed array holds (2^32 elements), before allocating", () => {
  // 2^31 f16 elements a page: two pages are 2^32 elements, three are past what a typed array holds on Node 20.
  const huge: KvLayout = { numLayers: 1, numKvHeads: 1, headDim: 2 ** 20, pageSize: 1024, dtype: "f16" };
  assert.equal(PagePool.maxPages(huge), 2);
  assert.throws(
    () => new PagePool(huge, 3),
    (err: unknown) =>
      err instanceof KvfenceError &&
      err.code === "config_invalid" &&
      /A KV pool holds at most 2\^32 elements \(2 pages of this layout\) but 3 pages were asked for/.test(
        err.message,
      ),
  );
});

test("PagePool lays its data over a caller-supplied buffer at an offset", () => {
  const bytes = PagePool.dataBytesFor(LAYOUT, 3);
  const buffer = new SharedArrayBuffer(64 + bytes);
  new Float32Array(buffer).fill(7);
  const pool = new PagePool(LAYOUT, 3, { dataBuffer: buffer, dataByteOffset: 64 });
  assert.equal(pool.data.byteOffset, 64);
  assert.equal(pool.data.buffer, buffer);
  assert.equal(new Float32Array(buffer, 0, 16)[0], 7, "bytes before the offset are untouched");
  assert.throws(() => new PagePool(LAYOUT, 4, { dataBuffer: buffer, dataByteOffset: 64 }), /needs \d+ bytes/);
});

test("PagePool zeroes a caller's buffer unless the caller vouches it is fresh (zeroed)", () => {
  const bytes = PagePool.dataBytesFor(LAYOUT, 3);
  const used = new SharedArrayBuffer(bytes);
  new Float32Array(used).fill(7);
  assert.ok(
    new PagePool(LAYOUT, 3, { dataBuffer: used }).data.every((v) => v === 0),
    "zeroed by the pool",
  );
  const fresh = new SharedArrayBuffer(bytes);
  new Float32Array(fresh).fill(7); // a lie, to see that the pool writes nothing when told `zeroed`
  const untouched = new PagePool(LAYOUT, 3, { dataBuffer: fresh, zeroed: true });
  assert.ok(
    untouched.data.every((v) => v === 7),
    "a range the caller vouches for is not written",
  );
  assert.ok(
    new PagePool(LAYOUT, 3).data.every((v) => v === 0),
    "a pool's own buffer starts zero",
  );
});

test("PagePool.allocate() is all-or-nothing and appends to the block table", () => {
  const pool = new PagePool(LAYOUT, 3);
  const bt = new BlockTable(4);
  assert.equal(pool.allocate(2, 1, 0, 0, bt), true);
  assert.equal(bt.length, 2);
  assert.equal(pool.allocate(2, 1, 0, 0, bt), false);
  assert.equal(bt.length, 2);
  assert.equal(pool.allocate(1, 1, 0, 0, bt), true);
  assert.deepEqual([...bt.pages.subarray(0, 3)].sort(), [0, 1, 2]);
  assert.equal(pool.counts().free, 0);
});

test("PagePool.free() frees a request's pages exactly once and leaves pages it no longer holds", () => {
  const pool = new PagePool(LAYOUT, 3);
  const bt = new BlockTable(3);
  pool.allocate(3, 1, 0, 0, bt);
  const stolen = bt.pages[1]!;
  // Someone else frees page 1 and re-leases it: rid 1 must not free it again.
  pool.table.free(stolen, bt.generations[1]!, 1, 0);
  const other = new BlockTable(1);
  pool.allocate(1, 2, 0, 0, other);
  assert.equal(other.pages[0], stolen);
  const copy = new BlockTable(3);
  for (let i = 0; i < 3; i++) copy.push(bt.pages[i]!, bt.generations[i]!);
  assert.equal(pool.free(bt, 1, 0), 2);
  assert.equal(bt.length, 0);
  assert.equal(pool.free(copy, 1, 0), 0, "a second free of the same lease frees nothing");
  assert.equal(pool.table.state(stolen), PageState.RESERVED);
  assert.equal(pool.table.owner(stolen), 2);
});

test("PagePool does not zero freed pages unless scrubOnFree is set", () => {
  for (const scrubOnFree of [false, true]) {
    const pool = new PagePool(LAYOUT, 1, { scrubOnFree });
    const bt = new BlockTable(1);
    pool.allocate(1, 1, 0, 0, bt);
    pool.data.fill(3);
    pool.free(bt, 1, 0);
    assert.equal(pageSum(pool, 0) === 0, scrubOnFree, `scrubOnFree=${scrubOnFree}`);
  }
});

test("PagePool.checkStep() passes a request's own pages through prefill and decode", () => {
  const pool = new PagePool(LAYOUT, 4); // pageSize 4
  const bt = new BlockTable(4);
  const rid = 9;
  const epoch = 2;
  // Prefill 6 tokens: two fresh pages.
  pool.allocate(2, rid, epoch, 0, bt);
  assert.equal(pool.checkStep(bt, rid, epoch, 0, 6), -1);
  pool.recordStep(bt, rid, epoch, 0, 6);
  assert.equal(pool.table.state(bt.pages[0]!), PageState.READY);
  assert.equal(
    pool.table.state(bt.pages[1]!),
    PageState.READY,
    "a partly filled page is READY once its tokens are computed",
  );
  assert.equal(pool.table.filledTokens(bt.pages[1]!), 2);
  // Decode into the partly filled page, then across the boundary.
  for (let pos = 6; pos < 12; pos++) {
    if (pos % 4 === 0) pool.allocate(1, rid, epoch, 0, bt);
    assert.equal(pool.checkStep(bt, rid, epoch, pos, pos + 1), -1, `pos ${pos}`);
    pool.recordStep(bt, rid, epoch, pos, pos + 1);
  }
  assert.equal(pool.table.filledTokens(bt.pages[2]!), 4);
  assert.equal(pool.counts().ready, 3);
});

test("PagePool.checkStep() fails a stale generation, a foreign owner or stamp, and a short fill", () => {
  const setup = () => {
    const pool = new PagePool(LAYOUT, 6);
    const bt = new BlockTable(4);
    pool.allocate(2, 1, 0, 0, bt);
    pool.recordStep(bt, 1, 0, 0, 6);
    return { pool, bt };
  };
  {
    const { pool, bt } = setup();
    assert.equal(pool.checkStep(bt, 1, 0, 6, 7), -1);
    assert.equal(pool.checkStep(bt, 1, 1, 6, 7), 0, "another epoch of the same rid");
    assert.equal(pool.checkStep(bt, 2, 0, 6, 7), 0, "another rid");
  }
  {
    const { pool, bt } = setup();
    pool.table.stampWriter(bt.pages[0]!, 2, 0, 4);
    assert.equal(pool.checkStep(bt, 1, 0, 6, 7), 0, "a stamp from another request");
  }
  {
    const { pool, bt } = setup();
    pool.table.free(bt.pages[1]!, bt.generations[1]!, 1, 0);
    const thief = new BlockTable(6);
    pool.allocate(pool.counts().free, 5, 0, 0, thief); // re-leases the freed page (and the rest)
    assert.equal(pool.checkStep(bt, 1, 0, 6, 7), 1, "a stale generation");
  }
  {
    const { pool, bt } = setup();
    pool.table.stampWriter(bt.pages[1]!, 1, 0, 1);
    assert.equal(pool.checkStep(bt, 1, 0, 6, 7), 1, "a partly filled page missing tokens the step reads");
  }
  {
    const { pool, bt } = setup();
    assert.equal(pool.checkStep(bt, 1, 0, 6, 9), 2, "a step past the leased pages");
  }
});

test("PagePool.checkStep() fails a reserved page that was never written, whatever its old stamp", () => {
  const pool = new PagePool(LAYOUT, 1);
  const first = new BlockTable(1);
  pool.allocate(1, 1, 0, 0, first);
  pool.recordStep(first, 1, 0, 0, 4); // request 1 fills page 0
  pool.free(first, 1, 0);
  const second = new BlockTable(1);
  pool.allocate(1, 2, 0, 0, second); // same physical page, still holding request 1's KV
  assert.equal(second.pages[0], 0);
  assert.equal(pool.checkStep(second, 2, 0, 0, 4), -1, "writing it fresh is fine");
  assert.equal(pool.checkStep(second, 2, 0, 4, 4), 0, "reading it unwritten is not");
  // Even a forged READY state does not pass without the owner's stamp.
  pool.table.markReady(0, second.generations[0]!, 2, 0);
  assert.equal(pool.checkStep(second, 2, 0, 4, 4), 0);
});

/** A random program of pool operations against a model of who holds what. */
type Op =
  | { kind: "allocate"; who: number; count: number }
  | { kind: "step"; who: number; tokens: number }
  | { kind: "free"; who: number }
  | { kind: "quarantine"; who: number }
  | { kind: "release"; who: number };

const opArb: fc.Arbitrary<Op> = fc.oneof(
  fc.record({
    kind: fc.constant("allocate" as const),
    who: fc.nat(4),
    count: fc.integer({ min: 1, max: 4 }),
  }),
  fc.record({ kind: fc.constant("step" as const), who: fc.nat(4), tokens: fc.integer({ min: 1, max: 6 }) }),
  fc.record({ kind: fc.constant("free" as const), who: fc.nat(4) }),
  fc.record({ kind: fc.constant("quarantine" as const), who: fc.nat(4) }),
  fc.record({ kind: fc.constant("release" as const), who: fc.nat(4) }),
);

/** One owner of the model: its request, block table, computed tokens and quarantined pages. */
interface Owner {
  readonly rid: number;
  epoch: number;
  readonly bt: BlockTable;
  computed: number;
  quarantined: { page: number; generation: number }[];
}

/** Applies `op` to `pool` for its owner, checking what the op itself promises. */
function applyOp(pool: PagePool, owners: readonly Owner[], op: Op): void {
  const o = owners[op.who]!;
  const t = pool.table;
  switch (op.kind) {
    case "allocate": {
      const quarantinedBefore = new Set(owners.flatMap((x) => x.quarantined.map((q) => q.page)));
      const before = o.bt.length;
      const ok = pool.allocate(op.count, o.rid, o.epoch, 0, o.bt);
      for (let i = before; i < o.bt.length; i++) {
        assert.ok(!quarantinedBefore.has(o.bt.pages[i]!), "a quarantined page was handed out");
      }
      assert.equal(o.bt.length, ok ? before + op.count : before);
      break;
    }
    case "step": {
      const end = Math.min(o.computed + op.tokens, o.bt.length * LAYOUT.pageSize);
      if (end <= o.computed) break;
      assert.equal(pool.checkStep(o.bt, o.rid, o.epoch, o.computed, end), -1);
      pool.recordStep(o.bt, o.rid, o.epoch, o.computed, end);
      o.computed = end;
      break;
    }
    case "free":
      pool.free(o.bt, o.rid, o.epoch);
      o.computed = 0;
      o.epoch++;
      break;
    case "quarantine":
      for (let i = 0; i < o.bt.length; i++) {
        if (t.quarantine(o.bt.pages[i]!, o.bt.generations[i]!, o.rid, o.epoch)) {
          o.quarantined.push({ page: o.bt.pages[i]!, generation: o.bt.generations[i]! });
        }
      }
      o.bt.clear();
      o.computed = 0;
      o.epoch++;
      break;
    case "release":
      for (const q of o.quarantined) assert.equal(t.releaseQuarantine(q.page, q.generation), true);
      o.quarantined = [];
      break;
  }
}

/** A page is never held twice, and the table agrees with every block table. */
function checkHeld(pool: PagePool, owners: readonly Owner[]): void {
  const t = pool.table;
  const held = new Set<number>();
  for (const x of owners) {
    for (let i = 0; i < x.bt.length; i++) {
      const page = x.bt.pages[i]!;
      assert.ok(!held.has(page), `page ${page} held twice`);
      held.add(page);
      assert.equal(t.owner(page), x.rid);
      assert.equal(t.generation(page), x.bt.generations[i]);
    }
    for (const q of x.quarantined) {
      assert.ok(!held.has(q.page), `quarantined page ${q.page} also held`);
      held.add(q.page);
      assert.equal(t.state(q.page), PageState.QUARANTINED);
    }
  }
  const c = pool.counts();
  assert.equal(c.free + c.reserved + c.ready + c.quarantined, c.total);
  assert.equal(c.total - c.free, held.size);
}

test("PagePool invariants hold under any sequence of operations (fast-check)", () => {
  fc.assert(
    fc.property(fc.array(opArb, { maxLength: 60 }), fc.boolean(), (ops, scrubOnFree) => {
      const numPages = 8;
      const pool = new PagePool(LAYOUT, numPages, { scrubOnFree });
      const owners: Owner[] = [0, 1, 2, 3, 4].map((i) => ({
        rid: 100 + i,
        epoch: 0,
        bt: new BlockTable(numPages),
        computed: 0,
        quarantined: [],
      }));
      const lastGeneration = new Uint32Array(numPages);
      for (const op of ops) {
        applyOp(pool, owners, op);
        checkHeld(pool, owners);
        for (let p = 0; p < numPages; p++) {
          assert.ok(pool.table.generation(p) >= lastGeneration[p]!, "generations only grow");
          lastGeneration[p] = pool.table.generation(p);
        }
      }
    }),
    { numRuns: 300 },
  );
});
