import assert from "node:assert/strict";
import { test } from "node:test";
import { MessageChannel, Worker } from "node:worker_threads";
import {
  reserveLease,
  sourcePage,
  type TransferFixture,
  transferFixture,
  transferFixturePast4GiB,
} from "../../testing/transfer-fixture.js";
import { NO_WRITER } from "../kvcache/ownership-table.js";
import { checksumLeasePages, PageChecksums, pageChecksumHex } from "./page-checksum.js";
import { createShmChannel, ShmTransferReceiver, ShmTransferWriter } from "./shm-transport.js";
import type { Manifest, TransferHandlers } from "./transport.js";
import { verifyManifest } from "./verify-manifest.js";

const PAGE_BYTES = 1024;

function setup(
  options: {
    numPages?: number;
    signalBytes?: number;
    checkLease?: boolean;
    ringCapacity?: number;
    fixture?: TransferFixture;
  } = {},
) {
  const fx = options.fixture ?? transferFixture(options.numPages ?? 16, PAGE_BYTES);
  const channel = createShmChannel({
    pool: fx.pool,
    table: fx.table,
    pageBytes: fx.pageBytes,
    layoutSignature: "sig",
    ringCapacity: options.ringCapacity ?? 1024,
  });
  const { port1, port2 } = new MessageChannel();
  const events: string[] = [];
  let onLeaseLanded = (): void => {};
  let onControl = (): void => {};
  const handlers: TransferHandlers = {
    pagesLanded: (rid, epoch, from, to) => events.push(`landed ${rid}/${epoch} [${from},${to})`),
    leaseLanded: (rid, epoch, n) => {
      events.push(`lease ${rid}/${epoch} ${n}`);
      onLeaseLanded();
    },
    control: (m) => {
      events.push(`control ${String(m.type)}`);
      onControl();
    },
  };
  const writer = new ShmTransferWriter(channel, {
    port: port1,
    layoutSignature: "sig",
    signalBytes: options.signalBytes ?? 2 * PAGE_BYTES,
    checkLease: options.checkLease ?? false,
  });
  const receiver = new ShmTransferReceiver(channel, { port: port2, handlers });
  const controlArrived = new Promise<void>((resolve) => {
    onControl = resolve;
  });
  const leaseArrived = new Promise<void>((resolve) => {
    onLeaseLanded = resolve;
  });
  return { fx, writer, receiver, events, controlArrived, leaseArrived };
}

test("ShmTransferWriter.writePages() lands pages with their writer stamp and signals batched ranges", async () => {
  const { fx, writer, receiver, events, controlArrived } = setup();
  const lease = reserveLease(fx, 7, 2, 6);
  const writes = lease.pages.map((_, i) => ({
    index: i,
    bytes: sourcePage(PAGE_BYTES, 7, i),
    filledTokens: 16,
  }));
  await writer.writePages(lease, writes);
  await writer.endLease(lease, 6);
  await writer.sendControl({
    type: "manifest",
    rid: 7,
    epoch: 2,
    tokenStart: 0,
    tokenEnd: 96,
    firstToken: 1,
    checksums: ["0123456789abcdef"],
  });
  await controlArrived;
  assert.deepEqual(events, [
    "landed 7/2 [0,2)",
    "landed 7/2 [2,4)",
    "landed 7/2 [4,6)",
    "lease 7/2 6",
    "control manifest",
  ]);
  for (const [i, { page }] of lease.pages.entries()) {
    assert.deepEqual(fx.pool.subarray(page * PAGE_BYTES, (page + 1) * PAGE_BYTES), writes[i]!.bytes);
    assert.equal(fx.table.writerRid(page), 7);
    assert.equal(fx.table.writerEpoch(page), 2);
    assert.equal(fx.table.filledTokens(page), 16);
  }
  assert.equal(writer.metrics.bytesTransferred, 6 * PAGE_BYTES);
  assert.equal(receiver.metrics.pagesTransferred, 6);
  assert.equal(receiver.metrics.transfers, 1);
  receiver.close();
});

test("ShmTransferWriter.writePages() writes into a pool past 4 GiB, where the page checksums read it", async () => {
  // More than one Uint8Array holds on Node 20: the writer, PageChecksums and checksumLeasePages
  // make a view per page (a whole-pool view threw RangeError: Invalid typed array length).
  const { fx, writer, receiver, leaseArrived } = setup({ fixture: transferFixturePast4GiB(1 << 20) });
  const lease = reserveLease(fx, 7, 2, 2);
  const writes = [0, 1].map((i) => ({ index: i, bytes: sourcePage(fx.pageBytes, 7, i), filledTokens: 16 }));
  await writer.writePages(lease, writes);
  await writer.endLease(lease, 2);
  await leaseArrived;
  const sums = new PageChecksums(fx.pool, fx.pageBytes, fx.table);
  const local: string[] = [];
  checksumLeasePages(local, fx.pool, fx.pageBytes, lease, 0, 2);
  for (const [i, { page }] of lease.pages.entries()) {
    assert.ok(page * fx.pageBytes >= 2 ** 32, "the page lies past 4 GiB");
    const landed = new Uint8Array(fx.pool.buffer, page * fx.pageBytes, fx.pageBytes);
    assert.equal(Buffer.compare(landed, writes[i]!.bytes), 0, `page ${i} landed`);
    const want = pageChecksumHex(writes[i]!.bytes, 7, 2, i);
    assert.equal(sums.get(page, 7, 2, i), want);
    assert.equal(local[i], want);
  }
  receiver.close();
});

test("ShmTransferWriter with checkLease skips a page that is no longer RESERVED for its lease and counts it", async () => {
  const { fx, writer, receiver, events, leaseArrived } = setup({ checkLease: true });
  const lease = reserveLease(fx, 3, 1, 2);
  const freed = lease.pages[1]!;
  assert.ok(fx.table.free(freed.page, freed.generation, 3, 1));
  const before = fx.pool.slice(freed.page * PAGE_BYTES, (freed.page + 1) * PAGE_BYTES);
  await writer.writePages(
    lease,
    [0, 1].map((i) => ({ index: i, bytes: sourcePage(PAGE_BYTES, 3, i), filledTokens: 16 })),
  );
  await writer.endLease(lease, 2);
  await leaseArrived;
  assert.equal(writer.metrics.droppedStaleWrites, 1);
  assert.deepEqual(fx.pool.slice(freed.page * PAGE_BYTES, (freed.page + 1) * PAGE_BYTES), before);
  assert.equal(fx.table.writerRid(freed.page), NO_WRITER);
  assert.deepEqual(events, ["landed 3/1 [0,1)", "lease 3/1 2"]);
  receiver.close();
});

test("ShmTransferWriter by default writes one-sided into a freed page, as RDMA does", async () => {
  const { fx, writer, receiver, leaseArrived } = setup();
  const lease = reserveLease(fx, 3, 1, 1);
  const { page, generation } = lease.pages[0]!;
  assert.ok(fx.table.free(page, generation, 3, 1));
  await writer.writePages(lease, [{ index: 0, bytes: sourcePage(PAGE_BYTES, 3, 0), filledTokens: 16 }]);
  await writer.endLease(lease, 1);
  await leaseArrived;
  assert.equal(writer.metrics.droppedStaleWrites, 0);
  assert.equal(fx.table.writerRid(page), 3);
  receiver.close();
});

test("ShmTransferWriter drops a page outside the pool as misaddressed", async () => {
  const { fx, writer, receiver, leaseArrived } = setup({ numPages: 4 });
  const lease = { ...reserveLease(fx, 5, 1, 1), pages: [{ page: 4, generation: 1 }] };
  await writer.writePages(lease, [{ index: 0, bytes: sourcePage(PAGE_BYTES, 5, 0), filledTokens: 16 }]);
  await writer.endLease(lease, 1);
  await leaseArrived;
  assert.equal(writer.metrics.droppedMisaddressedWrites, 1);
  receiver.close();
});

test("ShmTransferWriter waits for the receiver when the signal ring is full and loses no signal", async () => {
  const { fx, writer, receiver, events, leaseArrived } = setup({ ringCapacity: 2, signalBytes: PAGE_BYTES });
  const lease = reserveLease(fx, 9, 1, 12);
  for (let i = 0; i < 12; i++) {
    await writer.writePages(lease, [{ index: i, bytes: sourcePage(PAGE_BYTES, 9, i), filledTokens: 16 }]);
  }
  await writer.endLease(lease, 12);
  await leaseArrived;
  assert.deepEqual(events, [
    ...Array.from({ length: 12 }, (_, i) => `landed 9/1 [${i},${i + 1})`),
    "lease 9/1 12",
  ]);
  receiver.close();
});

test("ShmTransferWriter refuses a channel with another layout signature", () => {
  const fx = transferFixture(2, PAGE_BYTES);
  const channel = createShmChannel({
    pool: fx.pool,
    table: fx.table,
    pageBytes: PAGE_BYTES,
    layoutSignature: "a",
  });
  const { port1 } = new MessageChannel();
  assert.throws(() => new ShmTransferWriter(channel, { port: port1, layoutSignature: "b" }), {
    code: "layout_mismatch",
    message: /same model, dtype and page size: "a"$/,
  });
  port1.close();
});

test("ShmTransferReceiver.sendControl() reaches the writer's control handler", async () => {
  const fx = transferFixture(2, PAGE_BYTES);
  const channel = createShmChannel({
    pool: fx.pool,
    table: fx.table,
    pageBytes: PAGE_BYTES,
    layoutSignature: "a",
  });
  const { port1, port2 } = new MessageChannel();
  const got = new Promise<unknown>((resolve) => {
    new ShmTransferWriter(channel, { port: port1, layoutSignature: "a", handlers: { control: resolve } });
  });
  const receiver = new ShmTransferReceiver(channel, { port: port2, handlers: {} });
  receiver.sendControl({ type: "abort", rid: 1, epoch: 1 });
  assert.deepEqual(await got, { type: "abort", rid: 1, epoch: 1 });
  receiver.close();
});

test("ShmTransferWriter in a worker thread lands a lease that decode verifies against the manifest", async () => {
  const fx = transferFixture(64, 96 * 1024);
  const channel = createShmChannel({
    pool: fx.pool,
    table: fx.table,
    pageBytes: fx.pageBytes,
    layoutSignature: "w",
  });
  const lease = reserveLease(fx, 21, 3, 40, "w");
  const { port1, port2 } = new MessageChannel();
  const local: string[] = new Array<string>(40);
  const ranges: Array<[number, number]> = [];
  const manifest = new Promise<Manifest>((resolve) => {
    new ShmTransferReceiver(channel, {
      port: port2,
      handlers: {
        pagesLanded: (_rid, _epoch, from, to) => {
          ranges.push([from, to]);
          checksumLeasePages(local, fx.pool, fx.pageBytes, lease, from, to);
        },
        control: (m) => resolve(m as Manifest),
      },
    });
  });
  const worker = new Worker(new URL("../../testing/shm-writer-worker.js", import.meta.url), {
    workerData: { channel, port: port1, lease },
    transferList: [port1],
  });
  const m = await manifest;
  await new Promise((resolve) => worker.once("exit", resolve));
  const reservation = { rid: 21, epoch: 3, tokenStart: 0, tokenEnd: 40 * 16, numPages: 40 };
  assert.deepEqual(verifyManifest(reservation, m, local), { code: "ok" });
  // Contiguous ranges covering [0, 40), each but the last at least the 1 MiB signal batch.
  assert.equal(ranges[0]![0], 0);
  assert.equal(ranges.at(-1)![1], 40);
  for (let i = 0; i < ranges.length; i++) {
    if (i > 0) assert.equal(ranges[i]![0], ranges[i - 1]![1]);
    if (i < ranges.length - 1) assert.ok((ranges[i]![1] - ranges[i]![0]) * fx.pageBytes >= 1 << 20);
  }
  assert.ok(ranges.length < 40);
  for (const { page } of lease.pages) assert.equal(fx.table.writerRid(page), 21);
});
