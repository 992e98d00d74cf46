/**
 * TLS on both cluster links (docs/tls.md): the control link (router ↔ node) and the TCP transfer
 * connection (decode → prefill) work over mutual TLS; a peer presenting no certificate or one from
 * another CA is refused on each link, in both directions; a plaintext client against a TLS port
 * fails cleanly; and the bytes on the wire carry neither a known prompt string nor a page body.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { startTcpTap, type TcpTap } from "../../testing/tcp-tap.js";
import { clusterTls, noCertTls, otherCaTls } from "../../testing/tls-fixtures.js";
import { reserveLease, sourcePage, transferFixture } from "../../testing/transfer-fixture.js";
import type { KvfenceError } from "../lib/errors.js";
import { isLoopback } from "../lib/loopback.js";
import { connectControlLink, listenControlLinks } from "../links/control-link.js";
import { connectTcpReceiver, TcpTransferServer, type TcpTransferWriter } from "./tcp-transport.js";
import { type LinkTls, linksExposure } from "./tls-config.js";

const SECRET = "a-cluster-secret-of-some-length";
const PAGE_BYTES = 4096;
type Msg = { text: string };

/** A node's control port; `advertise`: the address routers dial it at, when not its own (a tap). */
async function controlServer(tls: LinkTls | undefined, refused: string[] = [], advertise?: { port: number }) {
  return listenControlLinks<Msg, Msg>({
    host: "127.0.0.1",
    port: 0,
    ...(advertise === undefined ? {} : { advertise }),
    secret: SECRET,
    ...(tls === undefined ? {} : { tls }),
    onRefused: (reason, detail) => refused.push(`${reason}: ${detail}`),
    onLink: (l) => l.onMessage((m) => l.send({ text: `echo ${m.text}` })),
  });
}

async function controlRoundTrip(port: number, tls: LinkTls | undefined, text = "hello"): Promise<string> {
  const link = await connectControlLink<Msg, Msg>({
    host: "127.0.0.1",
    port,
    secret: SECRET,
    ...(tls === undefined ? {} : { tls }),
  });
  try {
    const reply = new Promise<string>((resolve) => link.onMessage((m) => resolve(m.text)));
    link.send({ text });
    return await reply;
  } finally {
    link.close();
  }
}

test("control link over mutual TLS: a round trip with the cluster's certificates", async (t) => {
  const server = await controlServer(clusterTls());
  t.after(() => server.close());
  assert.equal(await controlRoundTrip(server.port, clusterTls()), "echo hello");
});

test("control link: the node refuses a router with no certificate or one from another CA", async (t) => {
  const refused: string[] = [];
  const server = await controlServer(clusterTls(), refused);
  t.after(() => server.close());
  for (const [name, tls] of [
    ["no certificate", noCertTls()],
    ["another CA", otherCaTls()],
  ] as const) {
    await assert.rejects(controlRoundTrip(server.port, tls), /handshake|certificate|alert|closed/i, name);
  }
  // The refusals happened in the TLS handshake, on the node's side.
  for (let i = 0; i < 50 && refused.length < 2; i++) await new Promise((r) => setTimeout(r, 20));
  assert.equal(refused.length, 2, refused.join("; "));
  for (const e of refused) assert.match(e, /^tls_handshake: TLS handshake .* --tls-ca/);
  assert.equal(server.failures.tls_handshake, 2);
  // The node still serves its own cluster.
  assert.equal(await controlRoundTrip(server.port, clusterTls()), "echo hello");
});

test("control link: the router refuses a node whose certificate another CA issued", async (t) => {
  const server = await controlServer(otherCaTls());
  t.after(() => server.close());
  await assert.rejects(controlRoundTrip(server.port, clusterTls()), (err: Error) => {
    assert.match(err.message, /Cannot reach the node .* issued by --tls-ca/);
    return true;
  });
});

test("control link: a plaintext router against a TLS node fails cleanly", async (t) => {
  const refused: string[] = [];
  const server = await controlServer(clusterTls(), refused);
  t.after(() => server.close());
  await assert.rejects(
    controlRoundTrip(server.port, undefined),
    /closed the control link during the handshake; .* --tls-\* setting/,
  );
  assert.equal(await controlRoundTrip(server.port, clusterTls()), "echo hello");
});

/**
 * A transfer server (advertising `advertise` when decode dials it elsewhere: a tap), and a receiver
 * connecting with `receiverTls`, optionally through another port.
 */
async function transfer(serverTls: LinkTls | undefined, advertise?: { port: number }) {
  const errors: KvfenceError[] = [];
  const refused: string[] = [];
  let resolveWriter: (w: TcpTransferWriter) => void = () => {};
  const writer = new Promise<TcpTransferWriter>((resolve) => {
    resolveWriter = resolve;
  });
  const server = await TcpTransferServer.listen({
    secret: SECRET,
    layoutSignature: "sig",
    onWriter: resolveWriter,
    onError: (e) => errors.push(e),
    onRefused: (reason, detail) => refused.push(`${reason}: ${detail}`),
    ...(serverTls === undefined ? {} : { tls: serverTls }),
    ...(advertise === undefined ? {} : { advertise }),
  });
  const fx = transferFixture(8, PAGE_BYTES);
  const controls: string[] = [];
  let landed: () => void = () => {};
  const lease = reserveLease(fx, 7, 1, 2);
  const allLanded = new Promise<void>((resolve) => {
    landed = resolve;
  });
  const connect = (receiverTls: LinkTls | undefined, port = server.port) =>
    connectTcpReceiver({
      port,
      secret: SECRET,
      layoutSignature: "sig",
      pool: fx.pool,
      table: fx.table,
      pageBytes: PAGE_BYTES,
      // Page bodies are read from the TLS socket straight into their pool pages, as with 64 KiB pages.
      directReadMinBytes: PAGE_BYTES,
      ...(receiverTls === undefined ? {} : { tls: receiverTls }),
      handlers: {
        pagesLanded: (_rid, _epoch, _from, to) => {
          if (to === 2) landed();
        },
        control: (m) => controls.push(JSON.stringify(m)),
      },
    });
  return { server, errors, refused, writer, fx, lease, allLanded, controls, connect };
}

test("transfer over mutual TLS: pages land intact (direct reads into the pool through TLS)", async (t) => {
  const x = await transfer(clusterTls());
  t.after(() => x.server.close());
  const receiver = await x.connect(clusterTls());
  t.after(() => receiver.close());
  const writer = await x.writer;
  const pages = [sourcePage(PAGE_BYTES, 7, 0), sourcePage(PAGE_BYTES, 7, 1)];
  await writer.writePages(
    x.lease,
    pages.map((bytes, index) => ({ index, bytes, filledTokens: 16 })),
  );
  await x.allLanded;
  for (let i = 0; i < 2; i++) {
    const page = x.lease.pages[i]!.page;
    assert.deepEqual(x.fx.pool.subarray(page * PAGE_BYTES, (page + 1) * PAGE_BYTES), pages[i]);
  }
});

test("transfer: prefill refuses a decode node with no certificate or one from another CA", async (t) => {
  const x = await transfer(clusterTls());
  t.after(() => x.server.close());
  await assert.rejects(x.connect(noCertTls()), /alert|certificate|closed|handshake|reset/i);
  await assert.rejects(x.connect(otherCaTls()), /alert|certificate|closed|handshake|reset/i);
  for (let i = 0; i < 50 && x.refused.length < 2; i++) await new Promise((r) => setTimeout(r, 20));
  assert.equal(x.refused.length, 2, x.refused.join("; "));
  for (const e of x.refused) assert.match(e, /^tls_handshake: TLS handshake .* --tls-ca/);
  assert.equal(x.server.failures.tls_handshake, 2);
});

test("transfer: decode refuses a prefill node whose certificate another CA issued", async (t) => {
  const x = await transfer(otherCaTls());
  t.after(() => x.server.close());
  await assert.rejects(x.connect(clusterTls()), /certificate|verify|signature/i);
});

test("transfer: a plaintext decode node against a TLS prefill port fails cleanly", async (t) => {
  const x = await transfer(clusterTls());
  t.after(() => x.server.close());
  await assert.rejects(x.connect(undefined), /closed the transfer connection during the handshake/);
  for (let i = 0; i < 50 && x.refused.length < 1; i++) await new Promise((r) => setTimeout(r, 20));
  assert.deepEqual(x.server.failures, { tls_handshake: 1 });
});

const PROMPT = "The secret launch code is";

for (const encrypted of [true, false]) {
  const name = encrypted
    ? "with TLS the wire carries neither a known prompt string nor a page body"
    : "plaintext (the control case): the same bytes show the prompt string, so the check can fail";
  test(name, async (t) => {
    const tls = encrypted ? clusterTls() : undefined;
    // Control link through a recording tap (the node advertises the tap's address): a prompt
    // string in a message each way.
    let controlPort = 0;
    const controlTap = await startTcpTap(() => controlPort);
    t.after(() => controlTap.close());
    const control = await controlServer(tls, [], { port: controlTap.port });
    t.after(() => control.close());
    controlPort = control.port;
    assert.equal(await controlRoundTrip(controlTap.port, tls, PROMPT), `echo ${PROMPT}`);
    // Transfer through a tap: a page body and a manifest-like control message.
    let transferPort = 0;
    const transferTap = await startTcpTap(() => transferPort);
    t.after(() => transferTap.close());
    const x = await transfer(tls, { port: transferTap.port });
    t.after(() => x.server.close());
    transferPort = x.server.port;
    const receiver = await x.connect(tls, transferTap.port);
    t.after(() => receiver.close());
    const page = Buffer.alloc(PAGE_BYTES);
    page.write(`${PROMPT} `.repeat(100));
    const writer = await x.writer;
    await writer.writePages(x.lease, [
      { index: 0, bytes: page, filledTokens: 16 },
      { index: 1, bytes: page, filledTokens: 16 },
    ]);
    await x.allLanded;
    const both = (tap: TcpTap) => [tap.sent(0), tap.received(0)];
    const wire = Buffer.concat([...both(controlTap), ...both(transferTap)]);
    assert.ok(wire.length > 2 * PAGE_BYTES, `the taps saw the traffic: ${wire.length} bytes`);
    assert.equal(wire.includes(PROMPT), !encrypted);
  });
}

test("isLoopback and linksExposure: who must have TLS", () => {
  for (const h of ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"])
    assert.equal(isLoopback(h), true, h);
  for (const h of ["0.0.0.0", "::", "10.0.0.5", "node-1.internal", "::ffff:10.0.0.1"])
    assert.equal(isLoopback(h), false, h);
  const base = { nodeHosts: [], tls: false, insecurePlaintextLinks: false };
  assert.match(
    linksExposure({ ...base, role: "decode", host: "0.0.0.0" }) ?? "",
    /^The decode node would listen on 0\.0\.0\.0 .*plaintext.*--insecure-plaintext-links$/,
  );
  assert.equal(linksExposure({ ...base, role: "decode", host: "0.0.0.0", tls: true }), null);
  assert.equal(
    linksExposure({ ...base, role: "prefill", host: "0.0.0.0", insecurePlaintextLinks: true }),
    null,
  );
  assert.equal(linksExposure({ ...base, role: "prefill", host: "127.0.0.1" }), null);
  assert.match(
    linksExposure({ ...base, role: "router", host: "127.0.0.1", nodeHosts: ["127.0.0.1", "10.0.0.7"] }) ?? "",
    /router would reach the node at 10\.0\.0\.7/,
  );
  // The one-process topologies have no cluster links; the front door is docs/tls.md's business.
  assert.equal(linksExposure({ ...base, role: "all", host: "0.0.0.0" }), null);
});
