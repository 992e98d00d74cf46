import assert from "node:assert/strict";
import net from "node:net";
import { test } from "node:test";
import { type ControlLink, connectControlLink, listenControlLinks } from "./control-link.js";

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
