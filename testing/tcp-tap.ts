/**
 * A recording TCP relay on 127.0.0.1 for the replay tests: clients connect to `port`, every byte is
 * relayed to `target` and back unchanged, and the bytes each client sent are kept in order
 * (`sent(i)`, connection `i`). What an eavesdropper on the wire would capture, without the secret.
 *
 * The links bind the address dialled (src/transfer/link-address.ts), so a server reached through a
 * tap must advertise the tap's address (`advertise: { port: tap.port }`, a node's `--advertise`),
 * as behind any port-forward; `target` may be a function for that, read at each connection, so the
 * tap can start before the server it forwards to. The tap listens on `listen` (default
 * 127.0.0.1, any free port) and forwards to 127.0.0.1.
 */
import net from "node:net";

export interface TcpTap {
  readonly port: number;
  /** Bytes the `index`-th client sent towards the target so far. */
  sent(index: number): Buffer;
  /** Bytes the target sent back to the `index`-th client so far. */
  received(index: number): Buffer;
  close(): Promise<void>;
}

export async function startTcpTap(
  target: number | (() => number),
  listen: { readonly host?: string; readonly port?: number } = {},
): Promise<TcpTap> {
  const recorded: Buffer[][] = [];
  const answered: Buffer[][] = [];
  const sockets = new Set<net.Socket>();
  const server = net.createServer((client) => {
    const chunks: Buffer[] = [];
    const back: Buffer[] = [];
    recorded.push(chunks);
    answered.push(back);
    const upstream = net.connect({ host: "127.0.0.1", port: typeof target === "number" ? target : target() });
    for (const s of [client, upstream]) {
      sockets.add(s);
      s.on("close", () => sockets.delete(s));
      s.on("error", () => {});
    }
    client.on("data", (chunk: Buffer) => {
      chunks.push(Buffer.from(chunk));
      upstream.write(chunk);
    });
    upstream.on("data", (chunk: Buffer) => {
      back.push(Buffer.from(chunk));
      client.write(chunk);
    });
    client.on("close", () => upstream.destroy());
    upstream.on("close", () => client.destroy());
  });
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen(listen.port ?? 0, listen.host ?? "127.0.0.1", resolve);
  });
  return {
    port: (server.address() as net.AddressInfo).port,
    sent: (index) => Buffer.concat(recorded[index] ?? []),
    received: (index) => Buffer.concat(answered[index] ?? []),
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy();
        server.close(() => resolve());
      }),
  };
}

/**
 * Sends `bytes` on a fresh connection to `port` and resolves when the server closes it, with
 * everything the server sent back (or after `waitMs`, with the connection still open: `open`).
 */
export function replay(
  port: number,
  bytes: Uint8Array,
  waitMs = 10_000,
): Promise<{ received: Buffer; open: boolean }> {
  return new Promise((resolve) => {
    const socket = net.connect({ host: "127.0.0.1", port });
    const received: Buffer[] = [];
    socket.on("error", () => {});
    socket.on("data", (c: Buffer) => received.push(c));
    const timer = setTimeout(() => {
      socket.destroy();
      resolve({ received: Buffer.concat(received), open: true });
    }, waitMs);
    socket.on("close", () => {
      clearTimeout(timer);
      resolve({ received: Buffer.concat(received), open: false });
    });
    socket.on("connect", () => socket.write(bytes));
  });
}
