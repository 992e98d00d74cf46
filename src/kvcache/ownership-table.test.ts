import assert from "node:assert/strict";
import { test } from "node:test";
import fc from "fast-check";
import { KvfenceError } from "../lib/errors.js";
import { NO_WRITER, OwnershipTable, PageState } from "./ownership-table.js";

function lease(table: OwnershipTable, count: number, rid: number, epoch = 1, tenant = 0) {
  const pages = new Int32Array(count);
  const generations = new Uint32Array(count);
  const ok = table.allocate(count, rid, epoch, tenant, pages, generations);
  return { ok, pages, generations };
}

test("OwnershipTable.allocate() leases distinct pages all-or-nothing and bumps generations", () => {
  const table = new OwnershipTable(4);
  const a = lease(table, 3, 7);
  assert.equal(a.ok, true);
  assert.equal(new Set(a.pages).size, 3);
  for (let i = 0; i < 3; i++) {
    const page = a.pages[i]!;
    assert.equal(table.state(page), PageState.RESERVED);
    assert.equal(table.generation(page), 1);
    assert.equal(table.owner(page), 7);
  }
  const b = lease(table, 2, 8);
  assert.equal(b.ok, false);
  assert.deepEqual(table.counts(), { free: 1, reserved: 3, ready: 0, quarantined: 0, total: 4 });
});

test("OwnershipTable.free() frees a lease exactly once", () => {
  const table = new OwnershipTable(2);
  const a = lease(table, 1, 1);
  const page = a.pages[0]!;
  const generation = a.generations[0]!;
  assert.equal(table.free(page, generation, 1, 1), true);
  assert.equal(table.state(page), PageState.FREE);
  assert.equal(table.generation(page), generation + 1);
  assert.equal(table.free(page, generation, 1, 1), false);
  assert.equal(table.counts().free, 2);
});

test("OwnershipTable.free() refuses another owner, epoch or generation", () => {
  const table = new OwnershipTable(2);
  const { pages, generations } = lease(table, 1, 1, 3);
  const page = pages[0]!;
  const generation = generations[0]!;
  assert.equal(table.free(page, generation, 2, 3), false);
  assert.equal(table.free(page, generation, 1, 4), false);
  assert.equal(table.free(page, generation + 1, 1, 3), false);
  assert.equal(table.state(page), PageState.RESERVED);
});

test("OwnershipTable.markReady() needs the lease holder at that generation", () => {
  const table = new OwnershipTable(2);
  const { pages, generations } = lease(table, 1, 5, 2);
  const page = pages[0]!;
  assert.equal(table.markReady(page, generations[0]!, 5, 1), false);
  assert.equal(table.markReady(page, generations[0]!, 5, 2), true);
  assert.equal(table.state(page), PageState.READY);
  assert.equal(table.markReady(page, generations[0]!, 5, 2), false);
});

test("OwnershipTable.checkRead() needs READY, the lease and the holder's own writer stamp", () => {
  const table = new OwnershipTable(2);
  const { pages, generations } = lease(table, 1, 5, 2);
  const page = pages[0]!;
  const generation = generations[0]!;
  assert.equal(table.writerRid(page), NO_WRITER);
  table.markReady(page, generation, 5, 2);
  // READY but never written: the stamp is not this request's.
  assert.equal(table.checkRead(page, generation, 5, 2), false);
  table.stampWriter(page, 5, 1, 1);
  assert.equal(table.checkRead(page, generation, 5, 2), false);
  table.stampWriter(page, 5, 2, 1);
  assert.equal(table.checkRead(page, generation, 5, 2), true);
  assert.equal(table.checkRead(page, generation, 6, 2), false);
  assert.equal(table.checkRead(page, generation + 2, 5, 2), false);
});

test("OwnershipTable keeps the writer stamp across free and reuse (pages are not zeroed)", () => {
  const table = new OwnershipTable(1);
  const a = lease(table, 1, 1);
  table.stampWriter(a.pages[0]!, 1, 1, 1);
  table.free(a.pages[0]!, a.generations[0]!, 1, 1);
  const b = lease(table, 1, 2);
  assert.equal(b.pages[0], a.pages[0]);
  assert.equal(table.writerRid(b.pages[0]!), 1);
  table.markReady(b.pages[0]!, b.generations[0]!, 2, 1);
  assert.equal(table.checkRead(b.pages[0]!, b.generations[0]!, 2, 1), false);
});

test("OwnershipTable.quarantine() holds a page until releaseQuarantine()", () => {
  const table = new OwnershipTable(1);
  const { pages, generations } = lease(table, 1, 1);
  const page = pages[0]!;
  const generation = generations[0]!;
  assert.equal(table.quarantine(page, generation, 1, 1), true);
  assert.equal(table.free(page, generation, 1, 1), false);
  assert.equal(lease(table, 1, 2).ok, false);
  assert.equal(table.releaseQuarantine(page, generation + 1), false);
  assert.equal(table.releaseQuarantine(page, generation), true);
  assert.equal(table.releaseQuarantine(page, generation), false);
  assert.equal(lease(table, 1, 2).ok, true);
});

test("OwnershipTable.checkWrite() accepts only a RESERVED page of the lease", () => {
  const table = new OwnershipTable(2);
  const { pages, generations } = lease(table, 1, 1);
  const page = pages[0]!;
  assert.equal(table.checkWrite(page, generations[0]!, 1, 1), true);
  assert.equal(table.checkWrite(page, generations[0]!, 2, 1), false);
  assert.equal(table.checkWrite(99, generations[0]!, 1, 1), false);
  table.markReady(page, generations[0]!, 1, 1);
  assert.equal(table.checkWrite(page, generations[0]!, 1, 1), false);
});

test("OwnershipTable attaches to a table shared through a SharedArrayBuffer at an offset", () => {
  const buffer = new SharedArrayBuffer(64 + OwnershipTable.bytesFor(3));
  const a = new OwnershipTable(3, { buffer, byteOffset: 64 });
  const leased = lease(a, 2, 9);
  const b = new OwnershipTable(3, { buffer, byteOffset: 64, attach: true });
  b.stampWriter(leased.pages[0]!, 9, 1, 1);
  assert.equal(a.writerRid(leased.pages[0]!), 9);
  assert.deepEqual(b.counts(), { free: 1, reserved: 2, ready: 0, quarantined: 0, total: 3 });
});

test("OwnershipTable constructor rejects a buffer that is too small", () => {
  assert.throws(
    () => new OwnershipTable(4, { buffer: new ArrayBuffer(8) }),
    (err: unknown) =>
      err instanceof KvfenceError && err.code === "config_invalid" && /bytesFor/.test(err.message),
  );
});

test("OwnershipTable snapshots and restores by copying bytes", () => {
  const table = new OwnershipTable(2);
  const snapshot = table.bytes.slice();
  lease(table, 2, 1);
  assert.equal(table.counts().free, 0);
  table.bytes.set(snapshot);
  assert.equal(table.counts().free, 2);
  assert.equal(lease(table, 2, 1).ok, true);
});

type Op =
  | { kind: "allocate"; count: number; rid: number }
  | { kind: "ready" | "free" | "quarantine" | "release" | "stamp" | "staleRead"; pick: number };

const opArb: fc.Arbitrary<Op> = fc.oneof(
  fc.record({
    kind: fc.constant("allocate" as const),
    count: fc.integer({ min: 0, max: 4 }),
    rid: fc.nat(5),
  }),
  fc.record({
    kind: fc.constantFrom("ready" as const, "free" as const, "quarantine" as const, "release" as const),
    pick: fc.nat(),
  }),
  fc.record({ kind: fc.constantFrom("stamp" as const, "staleRead" as const), pick: fc.nat() }),
);

type Held = { page: number; generation: number; rid: number; epoch: number };

/** The model of a table under test: the leases held now, the quarantined pages, every page handed out. */
class TableModel {
  readonly table: OwnershipTable;
  readonly held: Held[] = [];
  readonly quarantined: Array<{ page: number; generation: number }> = [];
  readonly handedOut: Held[] = [];
  readonly #lastGeneration: Uint32Array;
  #epoch = 0;

  constructor(readonly numPages: number) {
    this.table = new OwnershipTable(numPages);
    this.#lastGeneration = new Uint32Array(numPages);
  }

  apply(op: Op): void {
    if (op.kind === "allocate") this.#allocate(op.count, op.rid);
    else if (op.kind === "release") this.#release(op.pick);
    else if (op.kind === "staleRead") this.#staleRead(op.pick);
    else if (this.held.length > 0) this.#onHeld(op.kind, op.pick % this.held.length);
    this.#checkInvariants();
  }

  #allocate(count: number, rid: number): void {
    const epoch = ++this.#epoch;
    const r = lease(this.table, count, rid, epoch);
    const freeBefore = this.numPages - this.held.length - this.quarantined.length;
    assert.equal(r.ok, count <= freeBefore);
    if (!r.ok) return;
    for (let i = 0; i < count; i++) {
      const entry = { page: r.pages[i]!, generation: r.generations[i]!, rid, epoch };
      // Never owned twice, never a quarantined page.
      assert.ok(!this.held.some((h) => h.page === entry.page));
      assert.ok(!this.quarantined.some((q) => q.page === entry.page));
      this.held.push(entry);
      this.handedOut.push(entry);
    }
  }

  #release(pick: number): void {
    if (this.quarantined.length === 0) return;
    const q = this.quarantined.splice(pick % this.quarantined.length, 1)[0]!;
    assert.equal(this.table.releaseQuarantine(q.page, q.generation), true);
    assert.equal(this.table.releaseQuarantine(q.page, q.generation), false);
  }

  /** A (page, generation) no longer held can never pass checkRead, whoever asks. */
  #staleRead(pick: number): void {
    if (this.handedOut.length === 0) return;
    const h = this.handedOut[pick % this.handedOut.length]!;
    if (!this.held.includes(h))
      assert.equal(this.table.checkRead(h.page, h.generation, h.rid, h.epoch), false);
  }

  #onHeld(kind: "ready" | "free" | "quarantine" | "stamp", index: number): void {
    const table = this.table;
    const h = this.held[index]!;
    if (kind === "stamp") table.stampWriter(h.page, h.rid, h.epoch, 1);
    else if (kind === "ready") table.markReady(h.page, h.generation, h.rid, h.epoch);
    else if (kind === "free") {
      assert.equal(table.free(h.page, h.generation, h.rid, h.epoch), true);
      assert.equal(table.free(h.page, h.generation, h.rid, h.epoch), false);
      this.held.splice(index, 1);
    } else {
      assert.equal(table.quarantine(h.page, h.generation, h.rid, h.epoch), true);
      this.held.splice(index, 1);
      this.quarantined.push({ page: h.page, generation: h.generation });
    }
  }

  #checkInvariants(): void {
    const c = this.table.counts();
    assert.equal(c.free + c.reserved + c.ready + c.quarantined, this.numPages);
    assert.equal(c.quarantined, this.quarantined.length);
    assert.equal(c.reserved + c.ready, this.held.length);
    for (let p = 0; p < this.numPages; p++) {
      assert.ok(this.table.generation(p) >= this.#lastGeneration[p]!, "generations only grow");
      this.#lastGeneration[p] = this.table.generation(p);
    }
  }
}

test("OwnershipTable keeps its invariants over random operation sequences", () => {
  fc.assert(
    fc.property(fc.array(opArb, { maxLength: 80 }), (ops) => {
      const model = new TableModel(6);
      for (const op of ops) model.apply(op);
    }),
    { numRuns: 300 },
  );
});

test("OwnershipTable sibling pages: shared by one request's samples, read by them only, freed by the last", () => {
  const table = new OwnershipTable(4);
  const a = lease(table, 2, 7, 3);
  const [page, generation] = [a.pages[0]!, a.generations[0]!];
  assert.equal(table.shareSiblings(page, generation, 7, 3, 2, 4), false, "not READY yet");
  table.stampWriter(page, 7, 3, 4);
  table.markReady(page, generation, 7, 3);
  assert.equal(table.shareSiblings(page, generation, 7, 3, 2, 8), false, "not full");
  assert.equal(table.shareSiblings(page, generation, 8, 3, 2, 4), false, "another request's page");
  assert.equal(table.shareSiblings(page, generation, 7, 3, 2, 4), true);
  assert.equal(table.state(page), PageState.SHARED);
  assert.equal(table.refcount(page), 2);
  assert.ok(table.checkSibling(page, generation, 7, 3));
  assert.ok(!table.checkSibling(page, generation, 8, 3));
  assert.ok(!table.checkSibling(page, generation, 7, 4));
  assert.ok(!table.checkSibling(page, generation + 1, 7, 3));
  // Not a prefix-cache page: the cache's read rule and its operations refuse it.
  assert.ok(!table.checkShared(page, generation, 0));
  assert.equal(table.ref(page, generation), false);
  assert.equal(table.unref(page, generation), false);
  assert.equal(table.free(page, generation, 7, 3), false, "never freed as a lease");
  assert.equal(table.dropSibling(page, generation, 8, 3), false);
  assert.equal(table.dropSibling(page, generation, 7, 3), true);
  assert.equal(table.state(page), PageState.SHARED);
  assert.equal(table.dropSibling(page, generation, 7, 3), true);
  assert.equal(table.state(page), PageState.FREE);
  assert.equal(table.generation(page), generation + 1);
  assert.equal(table.dropSibling(page, generation, 7, 3), false);
  assert.equal(table.sharedPages(), 0);
  // A prefix-cache page is not a sibling page.
  const b = lease(table, 1, 9, 1);
  table.stampWriter(b.pages[0]!, 9, 1, 4);
  table.markReady(b.pages[0]!, b.generations[0]!, 9, 1);
  table.share(b.pages[0]!, b.generations[0]!, 9, 1, 5, 4);
  assert.ok(table.checkShared(b.pages[0]!, b.generations[0]!, 0));
  assert.ok(!table.checkSibling(b.pages[0]!, b.generations[0]!, 5, NO_WRITER));
  assert.equal(table.dropSibling(b.pages[0]!, b.generations[0]!, 5, NO_WRITER), false);
});
