/**
 * Attacks on prefill's transfer port by someone who reaches it without the cluster secret (issue
 * #21): a recorded handshake replayed byte for byte, a recorded control frame, garbage, a half
 * frame, a huge declared length, page frames for a live lease, a flood of half-open connections,
 * a relay at another address (on plaintext and TLS links). Each is refused and counted by reason, and the real decode connection keeps carrying its lease
 * with every page as prefill wrote it. The same attacks against whole clusters are in
 * src/node/link-attacks.e2e.test.ts.
 */
import assert from "node:assert/strict";
import type net from "node:net";
import { test } from "node:test";
import { replay, startTcpTap } from "../../testing/tcp-tap.js";
import { clusterTls } from "../../testing/tls-fixtures.js";
import { reserveLease, sourcePage, transferFixture } from "../../testing/transfer-fixture.js";
import { halfOpenHello } from "../tools/bench/link-flood.js";
import { FrameType, frameHeaderBytes } from "./frame-codec.js";
import {
  connectTcpReceiver,
  type TcpServerOptions,
  TcpTransferServer,
  type TcpTransferWriter,
} from "./tcp-transport.js";

const PAGE_BYTES = 4096;
const SECRET = "test-cluster-secret-0123456789";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function until(what: string, condition: () => boolean, timeoutMs = 60_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!condition()) {
    if (Date.now() > deadline) assert.fail(`timed out waiting for ${what}`);
    await sleep(10);
  }
}

/**
 * A prefill transfer server reached through a recording tap (the address it advertises), and one
 * real decode connected through it.
 */
async function setup(
  t: { after(fn: () => Promise<void>): void },
  serverOptions: Partial<TcpServerOptions> = {},
) {
  const fx = transferFixture(16, PAGE_BYTES);
  const writers: TcpTransferWriter[] = [];
  const refused: string[] = [];
  let serverPort = 0;
  const tap = await startTcpTap(() => serverPort);
  const server = await TcpTransferServer.listen({
    secret: SECRET,
    layoutSignature: "sig",
    advertise: { port: tap.port },
    onWriter: (w) => writers.push(w),
    onRefused: (reason, detail) => refused.push(`${reason}: ${detail}`),
    ...serverOptions,
  });
  serverPort = server.port;
  const events: string[] = [];
  const receiver = await connectTcpReceiver({
    port: tap.port,
    secret: SECRET,
    layoutSignature: "sig",
    pool: fx.pool,
    table: fx.table,
    pageBytes: PAGE_BYTES,
    incarnation: 7,
    handlers: {
      leaseLanded: (rid, epoch, n) => events.push(`lease ${rid}/${epoch} ${n}`),
      writeDropped: (rid, epoch, page, reason) => events.push(`dropped ${rid}/${epoch} ${page} ${reason}`),
      closed: (e) => events.push(`closed ${e?.message ?? ""}`),
    },
  });
  await until("the real writer", () => writers.length === 1);
  const controls: unknown[] = [];
  writers[0]!.handlers = { control: (m) => controls.push(m) };
  // A control frame on the wire, for the capture.
  receiver.sendControl({ type: "abort", rid: 9, epoch: 1 });
  await until("the control message", () => controls.length === 1);
  t.after(async () => {
    await receiver.close();
    await tap.close();
    await server.close();
  });
  /** One lease over the real connection; resolves with whether every page landed as written. */
  const transfer = async (rid: number): Promise<boolean> => {
    const lease = reserveLease(fx, rid, 1, 3);
    const writes = lease.pages.map((_, i) => ({
      index: i,
      bytes: sourcePage(PAGE_BYTES, rid, i),
      filledTokens: 16,
    }));
    await writers[0]!.writePages(lease, writes);
    await writers[0]!.endLease(lease, 3);
    await until(`lease ${rid}`, () => events.includes(`lease ${rid}/1 3`));
    return lease.pages.every(({ page }, i) =>
      Buffer.from(fx.pool.subarray(page * PAGE_BYTES, (page + 1) * PAGE_BYTES)).equals(writes[i]!.bytes),
    );
  };
  return { fx, server, tap, writers, refused, events, receiver, transfer };
}

test("TcpTransferServer refuses decode's recorded handshake replayed byte for byte: no second writer, the real one keeps its leases", async (t) => {
  const s = await setup(t);
  // What a passive eavesdropper captured: decode's HELLO, PROOF and a control frame.
  const captured = s.tap.sent(0);
  const result = await replay(s.server.port, captured, 3000);
  assert.equal(result.open, false, "prefill closed the replayed connection");
  assert.equal(s.writers.length, 1, "the replay got no writer (no lease can be written to it)");
  assert.equal(s.writers[0]!.closed, false, "the real decode connection was not fenced");
  assert.equal(s.server.failures.bad_proof, 1);
  assert.match(s.refused.join("\n"), /^bad_proof: .*replay/m);
  assert.ok(await s.transfer(31), "the real decode still receives its pages");
});

test("TcpTransferServer refuses a second decode of the same incarnation while the first is connected", async (t) => {
  const s = await setup(t);
  const fx = transferFixture(4, PAGE_BYTES);
  const second = await connectTcpReceiver({
    port: s.tap.port,
    secret: SECRET,
    layoutSignature: "sig",
    pool: fx.pool,
    table: fx.table,
    pageBytes: PAGE_BYTES,
    incarnation: 7,
    handlers: {},
  });
  await until("the refusal", () => s.server.failures.peer_connected === 1);
  assert.equal(s.writers.length, 1);
  assert.equal(s.writers[0]!.closed, false);
  assert.match(s.refused.join("\n"), /^peer_connected: .*incarnation 7 is connected already/m);
  assert.ok(await s.transfer(32));
  await second.close();
});

test("TcpTransferServer refuses garbage, a half frame, a huge length, a replayed control frame and page frames for a live lease", async (t) => {
  const s = await setup(t, { handshakeTimeoutMs: 500 });
  const lease = reserveLease(s.fx, 40, 1, 2);
  const before = Buffer.from(s.fx.pool);
  const header = (type: FrameType, length: number, page = 0, generation = 0) =>
    frameHeaderBytes({ type, rid: 40, epoch: 1, page, generation, index: 0, tokens: 16, length });
  const captured = s.tap.sent(0);
  // The control frame decode sent after its handshake (HELLO, PROOF, CONTROL).
  let at = 0;
  while (captured[at + 3] !== FrameType.CONTROL) at += 32 + captured.readUInt32LE(at + 28);
  const control = captured.subarray(at, at + 32 + captured.readUInt32LE(at + 28));
  const attacks: Array<[string, Buffer, string]> = [
    ["garbage", Buffer.from("GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n"), "malformed"],
    ["half a frame", header(FrameType.HELLO, 200).subarray(0, 20), "timeout"],
    ["a huge declared length", header(FrameType.HELLO, 0xfff0_0000), "oversized"],
    ["a replayed control frame", Buffer.from(control), "malformed"],
    [
      "page frames for a live lease",
      Buffer.concat(
        lease.pages.map(({ page, generation }) =>
          Buffer.concat([
            header(FrameType.PAGE, PAGE_BYTES, page, generation),
            Buffer.alloc(PAGE_BYTES, 0xee),
          ]),
        ),
      ),
      "oversized",
    ],
  ];
  for (const [name, bytes, reason] of attacks) {
    const was = s.server.failures[reason as keyof typeof s.server.failures] ?? 0;
    const result = await replay(s.server.port, bytes, 20_000);
    assert.equal(result.open, false, `${name}: closed`);
    assert.equal(
      s.server.failures[reason as keyof typeof s.server.failures],
      was + 1,
      `${name}: counted as ${reason}`,
    );
  }
  assert.equal(s.writers.length, 1);
  assert.ok(Buffer.from(s.fx.pool).equals(before), "no page of the pool changed");
  assert.ok(await s.transfer(33), "the real decode still receives its pages");
});

test("TcpTransferServer under 400 half-open connections with half-sent big frames: bounded buffers, all closed, the real link serves", async (t) => {
  const s = await setup(t, { handshakeTimeoutMs: 2000, maxPending: 64 });
  (globalThis as { gc?: () => void }).gc?.();
  // One body buffer for every client write (a write does not copy it): this process's ArrayBuffer
  // memory is then the server's, not the 400 clients'.
  const halfBody = Buffer.alloc(1 << 19, 0x41);
  const base = process.memoryUsage();
  const sockets: net.Socket[] = [];
  let maxPending = 0;
  const closed: Promise<void>[] = [];
  for (let i = 0; i < 400; i++) {
    // Half connections declare the largest body allowed before the handshake and send half of
    // it; half declare 1 MiB (the post-handshake control limit) and send 512 KiB.
    const socket = halfOpenHello(s.server.port, i % 2 === 1, halfBody);
    closed.push(new Promise((resolve) => socket.once("close", () => resolve())));
    sockets.push(socket);
    if (i % 20 === 0) await sleep(5);
    maxPending = Math.max(maxPending, s.server.pending);
  }
  const during = process.memoryUsage();
  await Promise.all(closed);
  const after = process.memoryUsage();
  const mib = (n: number) => (n / (1 << 20)).toFixed(1);
  t.diagnostic(
    `400 half-open connections: pending at most ${maxPending}; arrayBuffers +${mib(during.arrayBuffers - base.arrayBuffers)} MiB while open; rss ${mib(base.rss)} → ${mib(during.rss)} → ${mib(after.rss)} MiB; refused ${JSON.stringify(s.server.failures)}`,
  );
  assert.ok(maxPending <= 64, `pending connections capped: ${maxPending}`);
  const f = s.server.failures;
  assert.equal(
    (f.oversized ?? 0) + (f.too_many_pending ?? 0) + (f.timeout ?? 0),
    400,
    "every connection refused and counted",
  );
  assert.equal(f.oversized, 200, "every 1 MiB declaration refused at its header");
  // Before the fix each connection staged a 1 MiB buffer: 400 MiB. Now at most 64 × 4 KiB are held.
  assert.ok(during.arrayBuffers - base.arrayBuffers < 32 << 20, "buffers stay bounded");
  assert.equal(s.writers[0]!.closed, false);
  assert.ok(await s.transfer(34));
});

for (const tls of [undefined, clusterTls()]) {
  const links = tls === undefined ? "plaintext" : "TLS";
  test(`TcpTransferServer and connectTcpReceiver refuse a transfer connection relayed from another address, on ${links} links`, async (t) => {
    const writers: TcpTransferWriter[] = [];
    const refused: string[] = [];
    const server = await TcpTransferServer.listen({
      secret: SECRET,
      layoutSignature: "sig",
      ...(tls === undefined ? {} : { tls }),
      onWriter: (w) => writers.push(w),
      onRefused: (reason, detail) => refused.push(`${reason}: ${detail}`),
    });
    t.after(() => server.close());
    // A relay without the secret in front of the transfer port (decode told to dial it): it
    // forwards every byte both ways, unchanged, and would carry the KV pages.
    const relay = await startTcpTap(server.port);
    t.after(() => relay.close());
    const fx = transferFixture(4, PAGE_BYTES);
    const receiver = (port: number) =>
      connectTcpReceiver({
        port,
        secret: SECRET,
        layoutSignature: "sig",
        ...(tls === undefined ? {} : { tls }),
        pool: fx.pool,
        table: fx.table,
        pageBytes: PAGE_BYTES,
        incarnation: 3,
        handlers: {},
      });
    await assert.rejects(
      receiver(relay.port),
      new RegExp(`dialled at 127\\.0\\.0\\.1:${relay.port} answers to 127\\.0\\.0\\.1:${server.port}`),
    );
    await until("the refusal", () => server.failures.address_mismatch === 1);
    assert.deepEqual(server.failures, { address_mismatch: 1 });
    assert.match(
      refused.join("\n"),
      new RegExp(`^address_mismatch: .*the peer dialled 127\\.0\\.0\\.1:${relay.port}`),
    );
    assert.equal(writers.length, 0, "prefill made no writer: no page can go through the relay");
    // Decode sent its HELLO and nothing after it: no PROOF.
    if (tls === undefined) {
      const sent = relay.sent(0);
      assert.equal(sent[3], FrameType.HELLO);
      assert.equal(sent.length, 32 + sent.readUInt32LE(28), "one frame, the HELLO");
    }
    // The transfer port's own address still works.
    const direct = await receiver(server.port);
    await until("the writer", () => writers.length === 1);
    await direct.close();
  });
}
