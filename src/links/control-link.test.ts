import assert from "node:assert/strict";
import net from "node:net";
import { test } from "node:test";
import { replay, startTcpTap } from "../../testing/tcp-tap.js";
import { clusterTls } from "../../testing/tls-fixtures.js";
import { hmac } from "../transfer/control-auth.js";
import { type ControlLink, connectControlLink, HandshakeError, listenControlLinks } from "./control-link.js";

const SECRET = "a-cluster-secret-of-some-length";

async function pair(clientSecret = SECRET) {
  const links: ControlLink<{ n: number }, { n: number }>[] = [];
  const server = await listenControlLinks<{ n: number }, { n: number }>({
    host: "127.0.0.1",
    port: 0,
    secret: SECRET,
    onLink: (l) => links.push(l),
  });
  const client = connectControlLink<{ n: number }, { n: number }>({
    host: "127.0.0.1",
    port: server.port,
    secret: clientSecret,
  });
  return { server, client, links };
}

test("ControlLink round trip: node echoes the router's messages", async (t) => {
  const server = await listenControlLinks<{ n: number }, { n: number }>({
    host: "127.0.0.1",
    port: 0,
    secret: SECRET,
    onLink: (l) => l.onMessage((m) => l.send({ n: m.n * 10 })),
  });
  t.after(() => server.close());
  const link = await connectControlLink<{ n: number }, { n: number }>({
    host: "127.0.0.1",
    port: server.port,
    secret: SECRET,
  });
  const got: number[] = [];
  const done = new Promise<void>((resolve) =>
    link.onMessage((m) => {
      got.push(m.n);
      if (got.length === 3) resolve();
    }),
  );
  for (const n of [1, 2, 3]) link.send({ n });
  await done;
  assert.deepEqual(got, [10, 20, 30]);
  const closed = new Promise<void>((resolve) => link.onClose(() => resolve()));
  link.close();
  await closed;
});

test("ControlLink.send() carries the router's Int32Array to the node as an Int32Array", async (t) => {
  type Prompt = { prompt: Int32Array };
  const received: Prompt[] = [];
  let arrived = (): void => {};
  const done = new Promise<void>((resolve) => {
    arrived = resolve;
  });
  const server = await listenControlLinks<never, Prompt>({
    host: "127.0.0.1",
    port: 0,
    secret: SECRET,
    onLink: (l) =>
      l.onMessage((m) => {
        received.push(m);
        arrived();
      }),
  });
  t.after(() => server.close());
  const link = await connectControlLink<Prompt, never>({
    host: "127.0.0.1",
    port: server.port,
    secret: SECRET,
  });
  t.after(() => link.close());
  // A view into a larger buffer: only its own ids travel.
  link.send({ prompt: Int32Array.from([9, -1, 2 ** 31 - 1, 151_643, 0]).subarray(1, 4) });
  await done;
  assert.deepEqual(received, [{ prompt: Int32Array.from([-1, 2 ** 31 - 1, 151_643]) }]);
});

test("connectControlLink() refuses a node with another cluster secret", async (t) => {
  const { server, client, links } = await pair("another-secret-entirely-1234");
  t.after(() => server.close());
  await assert.rejects(client, (err: Error) => /closed|authentication/.test(err.message));
  assert.equal(links.length, 0, "the node accepted no link");
});

test("ControlLink closes on a line whose MAC does not verify", async (t) => {
  let accepted: ControlLink<{ n: number }, { n: number }> | null = null;
  const server = await listenControlLinks<{ n: number }, { n: number }>({
    host: "127.0.0.1",
    port: 0,
    secret: SECRET,
    onLink: (l) => {
      accepted = l;
    },
  });
  t.after(() => server.close());
  // A raw client that completes no handshake and sends a forged line: the node never accepts it.
  const socket = net.connect({ host: "127.0.0.1", port: server.port });
  await new Promise((r) => socket.once("connect", r));
  const closed = new Promise((r) => socket.once("close", r));
  socket.write(`{"nonce":"${"0".repeat(32)}"}\t${"ab".repeat(32)}\n`);
  await closed;
  assert.equal(accepted, null);
});

test("listenControlLinks() refuses a recorded router handshake replayed byte for byte, counts and logs it", async (t) => {
  const links: ControlLink<{ n: number }, { n: number }>[] = [];
  const refused: string[] = [];
  // The router reaches the node through a recording tap, the address the node advertises.
  let serverPort = 0;
  const tap = await startTcpTap(() => serverPort);
  t.after(() => tap.close());
  const server = await listenControlLinks<{ n: number }, { n: number }>({
    host: "127.0.0.1",
    port: 0,
    advertise: { port: tap.port },
    secret: SECRET,
    onLink: (l) => {
      links.push(l);
      l.onMessage((m) => l.send({ n: m.n * 10 }));
    },
    admit: () => !links.some((l) => !l.closed),
    onRefused: (reason, detail) => refused.push(`${reason}: ${detail}`),
  });
  t.after(() => server.close());
  serverPort = server.port;
  const router = await connectControlLink<{ n: number }, { n: number }>({
    host: "127.0.0.1",
    port: tap.port,
    secret: SECRET,
  });
  const replies: number[] = [];
  router.onMessage((m) => replies.push(m.n));
  router.send({ n: 1 });
  while (replies.length < 1) await new Promise((r) => setTimeout(r, 10));
  // What a passive eavesdropper captured: the router's hello, proof and first control line.
  const captured = tap.sent(0);
  const result = await replay(server.port, captured, 3000);
  assert.equal(result.open, false, "the node closed the replayed connection");
  assert.equal(links.length, 1, "the replay was not admitted as a link");
  assert.equal(server.failures.bad_proof, 1);
  assert.match(refused.join("\n"), /^bad_proof: .*replay/m);
  // The real router's link is untouched.
  router.send({ n: 2 });
  while (replies.length < 2) await new Promise((r) => setTimeout(r, 10));
  assert.deepEqual(replies, [10, 20]);
  router.close();
});

test("listenControlLinks() refuses a second router while one is connected, and admits one after it left", async (t) => {
  const links: ControlLink<{ n: number }, { n: number }>[] = [];
  const server = await listenControlLinks<{ n: number }, { n: number }>({
    host: "127.0.0.1",
    port: 0,
    secret: SECRET,
    onLink: (l) => links.push(l),
    admit: () => !links.some((l) => !l.closed),
  });
  t.after(() => server.close());
  const options = { host: "127.0.0.1", port: server.port, secret: SECRET };
  const first = await connectControlLink<{ n: number }, { n: number }>(options);
  // The second one proves itself, but the first still holds the node: it is refused, not swapped in.
  const second = await connectControlLink<{ n: number }, { n: number }>(options);
  await new Promise<void>((resolve) => second.onClose(() => resolve()));
  assert.equal(links.length, 1);
  assert.equal(server.failures.peer_connected, 1);
  assert.equal(first.closed, false);
  first.close();
  await new Promise<void>((resolve) => links[0]!.onClose(() => resolve()));
  const third = await connectControlLink<{ n: number }, { n: number }>(options);
  while (links.length < 2) await new Promise((r) => setTimeout(r, 10));
  assert.equal(third.closed, false);
  third.close();
});

test("listenControlLinks() holds unauthenticated connections to a deadline, a line limit and a cap", async (t) => {
  const links: ControlLink<{ n: number }, { n: number }>[] = [];
  const reported: string[] = [];
  const server = await listenControlLinks<{ n: number }, { n: number }>({
    host: "127.0.0.1",
    port: 0,
    secret: SECRET,
    onLink: (l) => links.push(l),
    handshakeTimeoutMs: 300,
    maxPending: 4,
    reportWindowMs: 600_000,
    onRefused: (reason) => reported.push(reason),
  });
  t.after(() => server.close());
  // Silent: closed by the deadline.
  assert.equal((await replay(server.port, Buffer.alloc(0), 20_000)).open, false);
  assert.equal(server.failures.timeout, 1);
  // A line that never ends: closed at 4 KiB, nothing more buffered.
  assert.equal((await replay(server.port, Buffer.alloc(64 * 1024, 0x41), 20_000)).open, false);
  assert.equal(server.failures.oversized, 1);
  // Garbage with a newline.
  assert.equal((await replay(server.port, Buffer.from("GET / HTTP/1.1\r\n\r\n"), 20_000)).open, false);
  assert.equal(server.failures.malformed, 1);
  // A flood of 12 silent connections with a cap of 4: 8 are closed at once to make room.
  const flood = Array.from({ length: 12 }, () => replay(server.port, Buffer.alloc(0), 20_000));
  await Promise.all(flood);
  assert.equal(server.failures.too_many_pending, 8);
  assert.equal(server.failures.timeout, 5);
  // Counted all; logged at most 20 per window (a flood does not flood the log).
  assert.equal(reported.length, 15);
  await Promise.all(Array.from({ length: 12 }, () => replay(server.port, Buffer.alloc(0), 20_000)));
  assert.equal(server.failures.too_many_pending! + server.failures.timeout!, 25);
  assert.equal(reported.length, 20);
  // The real router still gets in.
  const link = await connectControlLink<{ n: number }, { n: number }>({
    host: "127.0.0.1",
    port: server.port,
    secret: SECRET,
  });
  while (links.length < 1) await new Promise((r) => setTimeout(r, 10));
  link.close();
});

for (const tls of [undefined, clusterTls()]) {
  const links = tls === undefined ? "plaintext" : "TLS";
  test(`listenControlLinks() and connectControlLink() refuse a link relayed from another address, on ${links} links`, async (t) => {
    const admitted: ControlLink<{ n: number }, { n: number }>[] = [];
    const refused: string[] = [];
    const server = await listenControlLinks<{ n: number }, { n: number }>({
      host: "127.0.0.1",
      port: 0,
      secret: SECRET,
      ...(tls === undefined ? {} : { tls }),
      onLink: (l) => admitted.push(l),
      onRefused: (reason, detail) => refused.push(`${reason}: ${detail}`),
    });
    t.after(() => server.close());
    // A relay without the secret (a registry entry copied to its address sends the router there):
    // it forwards every byte both ways, unchanged. With TLS the node's certificate names 127.0.0.1
    // and so passes for the relay's address too: only the address binding tells them apart.
    const relay = await startTcpTap(server.port);
    t.after(() => relay.close());
    await assert.rejects(
      connectControlLink<{ n: number }, { n: number }>({
        host: "127.0.0.1",
        port: relay.port,
        secret: SECRET,
        ...(tls === undefined ? {} : { tls }),
      }),
      (err: Error) => {
        assert.ok(err instanceof HandshakeError, err.message);
        assert.equal(err.reason, "address_mismatch");
        assert.match(
          err.message,
          new RegExp(`dialled at 127\\.0\\.0\\.1:${relay.port} answers to 127\\.0\\.0\\.1:${server.port}`),
        );
        return true;
      },
    );
    for (let i = 0; i < 100 && server.failures.address_mismatch === undefined; i++)
      await new Promise((r) => setTimeout(r, 10));
    assert.deepEqual(server.failures, { address_mismatch: 1 });
    assert.match(
      refused.join("\n"),
      new RegExp(`^address_mismatch: the peer dialled 127\\.0\\.0\\.1:${relay.port}`),
    );
    assert.equal(admitted.length, 0, "the node admitted no link");
    // The router sent its hello and nothing after it: no proof, no control line.
    if (tls === undefined) assert.equal(relay.sent(0).toString().split("\n").filter(Boolean).length, 1);
    // The node's own address still works.
    const direct = await connectControlLink<{ n: number }, { n: number }>({
      host: "127.0.0.1",
      port: server.port,
      secret: SECRET,
      ...(tls === undefined ? {} : { tls }),
    });
    while (admitted.length < 1) await new Promise((r) => setTimeout(r, 10));
    direct.close();
  });
}

test("listenControlLinks() refuses a hello of an older handshake version, saying so", async (t) => {
  const refused: string[] = [];
  const server = await listenControlLinks<{ n: number }, { n: number }>({
    host: "127.0.0.1",
    port: 0,
    secret: SECRET,
    onLink: () => assert.fail("no link"),
    onRefused: (reason, detail) => refused.push(`${reason}: ${detail}`),
  });
  t.after(() => server.close());
  // A version-1 router's hello, with the secret: a nonce and no `v`, no dialled address.
  const hello = Buffer.from(JSON.stringify({ nonce: "00112233445566778899aabbccddeeff" }));
  const mac = hmac(Buffer.from(SECRET), Buffer.from("kvfence link hello"), hello);
  const result = await replay(server.port, Buffer.from(`${hello}\t${mac.toString("hex")}\n`), 3000);
  assert.equal(result.open, false);
  assert.deepEqual(server.failures, { malformed: 1 });
  assert.match(refused.join("\n"), /handshake version 1, this process 2; run the same kvfence version/);
});
