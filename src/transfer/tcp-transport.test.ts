import assert from "node:assert/strict";
import { test } from "node:test";
import {
  reserveLease,
  sourcePage,
  transferFixture,
  transferFixturePast4GiB,
} from "../../testing/transfer-fixture.js";
import { NO_WRITER } from "../kvcache/ownership-table.js";
import { FRAME_HEADER_BYTES, type FrameHeader, FrameType } from "./frame-codec.js";
import { MacChannel } from "./mac-channel.js";
import {
  connectTcpReceiver,
  type TcpReceiverOptions,
  TcpTransferServer,
  type TcpTransferWriter,
} from "./tcp-transport.js";
import type { ControlMessage, DropReason, TransferHandlers } from "./transport.js";

const PAGE_BYTES = 4096;
const SECRET = "test-cluster-secret-0123456789";

interface Harness {
  server: TcpTransferServer;
  writer: TcpTransferWriter;
  fx: ReturnType<typeof transferFixture>;
  events: string[];
  drops: Array<[number, DropReason]>;
  next(pattern: RegExp): Promise<void>;
  receiver: Awaited<ReturnType<typeof connectTcpReceiver>>;
  close(): Promise<void>;
}

async function harness(
  t: { after(fn: () => Promise<void>): void },
  numPages = 16,
  receiverOptions: Partial<TcpReceiverOptions> = {},
  batchBytes?: number,
): Promise<Harness> {
  const fx = transferFixture(numPages, PAGE_BYTES);
  const events: string[] = [];
  const drops: Array<[number, DropReason]> = [];
  const waiters: Array<{ pattern: RegExp; resolve: () => void }> = [];
  const push = (e: string): void => {
    events.push(e);
    for (const w of waiters.splice(0)) {
      if (w.pattern.test(e)) w.resolve();
      else waiters.push(w);
    }
  };
  let resolveWriter: (w: TcpTransferWriter) => void = () => {};
  const writerReady = new Promise<TcpTransferWriter>((resolve) => {
    resolveWriter = resolve;
  });
  const server = await TcpTransferServer.listen({
    secret: SECRET,
    layoutSignature: "sig",
    onWriter: resolveWriter,
    ...(batchBytes === undefined ? {} : { batchBytes }),
  });
  const handlers: TransferHandlers = {
    pagesLanded: (rid, epoch, from, to) => push(`landed ${rid}/${epoch} [${from},${to})`),
    leaseLanded: (rid, epoch, n) => push(`lease ${rid}/${epoch} ${n}`),
    writeDropped: (_rid, _epoch, page, reason) => drops.push([page, reason]),
    control: (m: ControlMessage) => push(`control ${JSON.stringify(m)}`),
    closed: (error) => push(`closed ${error?.message ?? ""}`),
  };
  const receiver = await connectTcpReceiver({
    port: server.port,
    secret: SECRET,
    layoutSignature: "sig",
    pool: fx.pool,
    table: fx.table,
    pageBytes: PAGE_BYTES,
    handlers,
    receiveBufferBytes: 10_000,
    ...receiverOptions,
  });
  const writer = await writerReady;
  const h: Harness = {
    server,
    writer,
    fx,
    events,
    drops,
    receiver,
    next: (pattern) =>
      events.some((e) => pattern.test(e))
        ? Promise.resolve()
        : new Promise((resolve) => waiters.push({ pattern, resolve })),
    close: async () => {
      await receiver.close();
      await server.close();
    },
  };
  t.after(h.close);
  return h;
}

test("TcpTransferWriter.writePages() lands pages in the pool with stamps, then the lease end and the control message", async (t) => {
  const h = await harness(t);
  const lease = reserveLease(h.fx, 11, 4, 5);
  const writes = lease.pages.map((_, i) => ({
    index: i,
    bytes: sourcePage(PAGE_BYTES, 11, i),
    filledTokens: 16,
  }));
  await h.writer.writePages(lease, writes);
  await h.writer.endLease(lease, 5);
  await h.writer.sendControl({ type: "release", rid: 11, epoch: 4 });
  await h.next(/^control/);
  assert.deepEqual(h.events, [
    ...writes.map((_, i) => `landed 11/4 [${i},${i + 1})`),
    "lease 11/4 5",
    'control {"type":"release","rid":11,"epoch":4}',
  ]);
  for (const [i, { page }] of lease.pages.entries()) {
    assert.deepEqual(h.fx.pool.subarray(page * PAGE_BYTES, (page + 1) * PAGE_BYTES), writes[i]!.bytes);
    assert.equal(h.fx.table.writerRid(page), 11);
    assert.equal(h.fx.table.writerEpoch(page), 4);
  }
  assert.equal(h.receiver.metrics.bytesTransferred, 5 * PAGE_BYTES);
  assert.equal(h.receiver.metrics.transfers, 1);
});

test("TcpTransferReceiver lands pages in a pool past 4 GiB (more than one Uint8Array holds)", async (t) => {
  const big = transferFixturePast4GiB(PAGE_BYTES);
  const h = await harness(t, 16, { pool: big.pool, table: big.table });
  const lease = reserveLease(big, 12, 1, 2);
  const writes = lease.pages.map((_, i) => ({
    index: i,
    bytes: sourcePage(PAGE_BYTES, 12, i),
    filledTokens: 16,
  }));
  await h.writer.writePages(lease, writes);
  await h.writer.endLease(lease, 2);
  await h.next(/^lease 12\/1/);
  assert.deepEqual(h.drops, []);
  for (const [i, { page }] of lease.pages.entries()) {
    assert.ok(page * PAGE_BYTES >= 2 ** 32, "the page lies past 4 GiB");
    assert.deepEqual(new Uint8Array(big.pool.buffer, page * PAGE_BYTES, PAGE_BYTES), writes[i]!.bytes);
    assert.equal(big.table.writerRid(page), 12);
  }
});

test("TcpTransferWriter.writePages() of two leases at once: every frame carries its own lease's (rid, epoch)", async (t) => {
  // A prefill node transfers several requests at once over one connection, and writePages waits
  // for the socket every batchBytes (here every 2 pages). The writer used to keep one frame header
  // for all calls and set its rid and epoch once per call: a call resuming after another had
  // started sent the rest of its pages under the other's (rid, epoch), which decode's lease check
  // dropped, and the commit then failed its checksums (a multi-process cluster failed 2 in 10
  // concurrent requests this way).
  const h = await harness(t, 16, {}, 2 * PAGE_BYTES);
  const leases = [reserveLease(h.fx, 21, 1, 6), reserveLease(h.fx, 22, 3, 6)];
  const writes = leases.map((lease) =>
    lease.pages.map((_, i) => ({ index: i, bytes: sourcePage(PAGE_BYTES, lease.rid, i), filledTokens: 16 })),
  );
  await Promise.all(leases.map((lease, k) => h.writer.writePages(lease, writes[k]!)));
  await Promise.all(leases.map((lease) => h.writer.endLease(lease, 6)));
  await h.next(/^lease 21\/1/);
  await h.next(/^lease 22\/3/);
  assert.deepEqual(h.drops, []);
  for (const [k, lease] of leases.entries()) {
    for (const [i, { page }] of lease.pages.entries()) {
      assert.deepEqual(h.fx.pool.subarray(page * PAGE_BYTES, (page + 1) * PAGE_BYTES), writes[k]![i]!.bytes);
      assert.equal(h.fx.table.writerRid(page), lease.rid);
      assert.equal(h.fx.table.writerEpoch(page), lease.epoch);
    }
  }
});

test("TcpTransferReceiver drops a write to a page not RESERVED for its (rid, epoch) and counts it", async (t) => {
  const h = await harness(t);
  const lease = reserveLease(h.fx, 1, 1, 3);
  const { page, generation } = lease.pages[1]!;
  assert.ok(h.fx.table.quarantine(page, generation, 1, 1)); // the request was aborted meanwhile
  const before = h.fx.pool.slice(page * PAGE_BYTES, (page + 1) * PAGE_BYTES);
  await h.writer.writePages(
    lease,
    [0, 1, 2].map((i) => ({ index: i, bytes: sourcePage(PAGE_BYTES, 1, i), filledTokens: 16 })),
  );
  await h.writer.endLease(lease, 3);
  await h.next(/^lease/);
  assert.deepEqual(h.drops, [[page, "stale"]]);
  assert.equal(h.receiver.metrics.droppedStaleWrites, 1);
  assert.deepEqual(h.fx.pool.slice(page * PAGE_BYTES, (page + 1) * PAGE_BYTES), before);
  assert.equal(h.fx.table.writerRid(page), NO_WRITER);
  assert.deepEqual(h.events, ["landed 1/1 [0,1)", "landed 1/1 [2,3)", "lease 1/1 3"]);
});

test("TcpTransferReceiver drops a write from an earlier epoch and a write at an old generation", async (t) => {
  const h = await harness(t);
  const lease = reserveLease(h.fx, 2, 5, 1);
  const bytes = sourcePage(PAGE_BYTES, 2, 0);
  await h.writer.writePages({ ...lease, epoch: 4 }, [{ index: 0, bytes, filledTokens: 16 }]);
  const stale = {
    ...lease,
    pages: [{ page: lease.pages[0]!.page, generation: lease.pages[0]!.generation - 1 }],
  };
  await h.writer.writePages(stale, [{ index: 0, bytes, filledTokens: 16 }]);
  await h.writer.endLease(lease, 1);
  await h.next(/^lease/);
  assert.equal(h.receiver.metrics.droppedStaleWrites, 2);
  assert.equal(h.receiver.metrics.pagesTransferred, 0);
});

test("TcpTransferReceiver drops a write outside the pool as misaddressed", async (t) => {
  const h = await harness(t, 4);
  const lease = { ...reserveLease(h.fx, 3, 1, 1), pages: [{ page: 4, generation: 1 }] };
  await h.writer.writePages(lease, [{ index: 0, bytes: sourcePage(PAGE_BYTES, 3, 0), filledTokens: 16 }]);
  const wrongSize = reserveLease(h.fx, 3, 2, 1);
  await h.writer.writePages(wrongSize, [
    { index: 0, bytes: new Uint8Array(PAGE_BYTES / 2), filledTokens: 8 },
  ]);
  await h.writer.endLease(lease, 1);
  await h.next(/^lease/);
  assert.equal(h.receiver.metrics.droppedMisaddressedWrites, 2);
  assert.deepEqual(h.drops, [
    [4, "misaddressed"],
    [wrongSize.pages[0]!.page, "misaddressed"],
  ]);
});

test("TcpTransferReceiver.sendControl() reaches the writer authenticated", async (t) => {
  const h = await harness(t);
  const got = new Promise<ControlMessage>((resolve) => {
    h.writer.handlers = { control: resolve };
  });
  h.receiver.sendControl({ type: "abort", rid: 9, epoch: 1 });
  assert.deepEqual(await got, { type: "abort", rid: 9, epoch: 1 });
});

async function refusal(
  t: { after(fn: () => Promise<void>): void },
  serverSig: string,
  client: Partial<TcpReceiverOptions>,
) {
  const fx = transferFixture(2, PAGE_BYTES);
  const serverErrors: Error[] = [];
  const server = await TcpTransferServer.listen({
    secret: SECRET,
    layoutSignature: serverSig,
    onWriter: () => assert.fail("no writer may be created"),
    onError: (e) => serverErrors.push(e),
  });
  t.after(() => server.close());
  const err = await connectTcpReceiver({
    port: server.port,
    secret: SECRET,
    layoutSignature: "sig",
    pool: fx.pool,
    table: fx.table,
    pageBytes: PAGE_BYTES,
    handlers: {},
    ...client,
  }).then(
    () => assert.fail("the handshake must fail"),
    (e: unknown) => e as Error & { code: string },
  );
  return { err, serverErrors };
}

test("connectTcpReceiver() refuses to pair on a layout signature mismatch, with a clear error on both sides", async (t) => {
  const { err, serverErrors } = await refusal(t, "SmolLM2|f32|page=16", {});
  assert.equal(err.code, "layout_mismatch");
  assert.match(err.message, /Prefill refused.*same model, dtype and page size: "sig"/);
  assert.equal(serverErrors.length, 1);
  assert.equal((serverErrors[0] as Error & { code: string }).code, "layout_mismatch");
});

test("connectTcpReceiver() fails authentication with another cluster secret", async (t) => {
  const { err, serverErrors } = await refusal(t, "sig", { secret: "another-secret-0123456789" });
  assert.equal(err.code, "transfer_failed");
  assert.match(err.message, /authentication/);
  assert.equal(serverErrors.length, 1);
});

test("TcpTransferReceiver reads page bodies straight into the pool and still drops stale writes", async (t) => {
  const h = await harness(t, 16, { directReadMinBytes: 1024 });
  const lease = reserveLease(h.fx, 6, 1, 8);
  const { page, generation } = lease.pages[3]!;
  assert.ok(h.fx.table.quarantine(page, generation, 6, 1));
  const before = h.fx.pool.slice(page * PAGE_BYTES, (page + 1) * PAGE_BYTES);
  const writes = lease.pages.map((_, i) => ({
    index: i,
    bytes: sourcePage(PAGE_BYTES, 6, i),
    filledTokens: 16,
  }));
  await h.writer.writePages(lease, writes.slice(0, 5));
  await h.writer.sendControl({ type: "abort", rid: 6, epoch: 1 });
  await h.writer.writePages(lease, writes.slice(5));
  await h.writer.endLease(lease, 8);
  await h.next(/^lease/);
  for (const [i, p] of lease.pages.entries()) {
    const got = h.fx.pool.subarray(p.page * PAGE_BYTES, (p.page + 1) * PAGE_BYTES);
    assert.deepEqual(got, i === 3 ? before : writes[i]!.bytes);
  }
  assert.deepEqual(h.drops, [[page, "stale"]]);
  assert.deepEqual(h.events, [
    "landed 6/1 [0,1)",
    "landed 6/1 [1,2)",
    "landed 6/1 [2,3)",
    "landed 6/1 [4,5)",
    'control {"type":"abort","rid":6,"epoch":1}',
    "landed 6/1 [5,6)",
    "landed 6/1 [6,7)",
    "landed 6/1 [7,8)",
    "lease 6/1 8",
  ]);
});

test("MacChannel.open() rejects a tampered header or payload, a replay and another key", () => {
  const key = Buffer.alloc(32, 7);
  const sender = new MacChannel(key);
  const receiver = new MacChannel(key);
  const frame = (payload: string): { header: FrameHeader; body: Uint8Array } => {
    const bytes = sender.frame(FrameType.CONTROL, 1, 2, 0, Buffer.from(payload));
    const h: FrameHeader = {
      type: FrameType.CONTROL,
      rid: 0,
      epoch: 0,
      page: 0,
      generation: 0,
      index: 0,
      tokens: 0,
      length: 0,
    };
    const v = new DataView(bytes.buffer, bytes.byteOffset);
    h.rid = v.getUint32(4, true);
    h.epoch = v.getUint32(8, true);
    h.index = v.getUint32(20, true);
    h.length = v.getUint32(28, true);
    return { header: h, body: bytes.subarray(FRAME_HEADER_BYTES) };
  };
  const first = frame('{"type":"abort"}');
  const tampered = Buffer.from(first.body);
  tampered[3]! ^= 1;
  assert.equal(receiver.open(first.header, tampered), null);
  assert.equal(receiver.open({ ...first.header, rid: 9 }, first.body), null);
  assert.equal(new MacChannel(Buffer.alloc(32, 8)).open(first.header, first.body), null);
  assert.equal(Buffer.from(receiver.open(first.header, first.body)!).toString(), '{"type":"abort"}');
  assert.equal(receiver.open(first.header, first.body), null, "a replayed frame is refused");
  const second = frame("{}");
  assert.equal(Buffer.from(receiver.open(second.header, second.body)!).toString(), "{}");
});

test("TcpTransferReceiver with leaseCheck off applies a write into a quarantined page (the guard is what drops it)", async (t) => {
  const h = await harness(t, 16, { leaseCheck: false });
  const lease = reserveLease(h.fx, 4, 1, 1);
  const { page, generation } = lease.pages[0]!;
  assert.ok(h.fx.table.quarantine(page, generation, 4, 1));
  const bytes = sourcePage(PAGE_BYTES, 4, 0);
  await h.writer.writePages(lease, [{ index: 0, bytes, filledTokens: 16 }]);
  await h.writer.endLease(lease, 1);
  await h.next(/^lease/);
  assert.deepEqual(h.drops, []);
  assert.deepEqual(h.fx.pool.subarray(page * PAGE_BYTES, (page + 1) * PAGE_BYTES), bytes);
  assert.equal(h.fx.table.writerRid(page), 4);
});

test("TcpTransferWriter.close() reaches decode as closed (the fence on peer loss), and the reverse", async (t) => {
  const h = await harness(t);
  const writerClosed = new Promise<void>((resolve) => {
    h.writer.handlers = { closed: () => resolve() };
  });
  await h.writer.close();
  await h.next(/^closed/);
  await writerClosed;
  await assert.rejects(
    h.writer.writePages(reserveLease(h.fx, 1, 1, 1), [
      { index: 0, bytes: new Uint8Array(PAGE_BYTES), filledTokens: 1 },
    ]),
    { code: "transfer_failed" },
  );
});
