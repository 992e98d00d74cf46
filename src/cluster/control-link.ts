/**
 * The router ↔ node control link of the multi-process topology: one TCP connection per node,
 * newline-delimited JSON, every line authenticated with the cluster secret.
 *
 * Handshake: the router sends `{nonce}` MACed with the secret; the node checks it and answers
 * `{nonce, peerNonce}` MACed likewise. Both derive per-direction session keys from the two nonces
 * (`sessionKeys`), and every later line carries an HMAC-SHA256 over its sequence number and payload,
 * so a line cannot be forged, replayed or reordered. Any bad line closes the connection; a closed
 * connection is the peer's loss (the fence).
 */
import { randomBytes } from "node:crypto";
import type net from "node:net";
import { KvfenceError } from "../lib/errors.js";
import { clusterSecretBytes, hmac, sessionKeys, verifyHmac } from "../transfer/control-auth.js";
import { connectLink, createLinkServer, type LinkTls, tlsReason } from "../transfer/tls-config.js";
import type { Link } from "./node-messages.js";

const HELLO = Buffer.from("kvfence link hello");
const MAX_LINE_BYTES = 64 * 1024 * 1024;

function seqBytes(seq: number): Buffer {
  const b = Buffer.alloc(8);
  b.writeBigUInt64LE(BigInt(seq));
  return b;
}

/** One authenticated link over a connected socket. */
export class ControlLink<Out, In> implements Link<Out, In> {
  readonly #socket: net.Socket;
  readonly #sendKey: Buffer;
  readonly #recvKey: Buffer;
  #sendSeq = 0;
  #recvSeq = 0;
  readonly #handlers: ((m: In) => void)[] = [];
  readonly #closeHandlers: ((error?: Error) => void)[] = [];
  readonly #backlog: In[] = [];
  #closed = false;
  #error: Error | undefined;

  /** @internal Use `connectControlLink` or `listenControlLinks`. */
  constructor(socket: net.Socket, sendKey: Buffer, recvKey: Buffer, rest: Buffer) {
    this.#socket = socket;
    // A peer host that vanishes without closing the connection is detected by TCP keepalive.
    socket.setKeepAlive(true, 5000);
    this.#sendKey = sendKey;
    this.#recvKey = recvKey;
    let buffered = rest;
    const onData = (chunk: Buffer): void => {
      buffered = buffered.length === 0 ? chunk : Buffer.concat([buffered, chunk]);
      let nl = buffered.indexOf(10);
      while (nl >= 0) {
        const line = buffered.subarray(0, nl);
        buffered = buffered.subarray(nl + 1);
        if (!this.#onLine(line)) return;
        nl = buffered.indexOf(10);
      }
      if (buffered.length > MAX_LINE_BYTES) this.#fail(new Error("Control line too long"));
    };
    socket.on("data", onData);
    socket.on("error", (err) => {
      this.#error ??= err;
    });
    socket.on("close", () => {
      this.#closed = true;
      for (const h of this.#closeHandlers) h(this.#error);
    });
    if (rest.length > 0) queueMicrotask(() => onData(Buffer.alloc(0)));
  }

  get closed(): boolean {
    return this.#closed;
  }

  send(message: Out): void {
    if (this.#closed || this.#socket.destroyed) throw new Error("Control link is closed");
    const payload = Buffer.from(JSON.stringify(message));
    const mac = hmac(this.#sendKey, seqBytes(this.#sendSeq++), payload);
    this.#socket.write(Buffer.concat([payload, Buffer.from(`\t${mac.toString("hex")}\n`)]));
  }

  onMessage(handler: (message: In) => void): void {
    this.#handlers.push(handler);
    if (this.#handlers.length === 1 && this.#backlog.length > 0) {
      for (const m of this.#backlog.splice(0)) handler(m);
    }
  }

  onClose(handler: (error?: Error) => void): void {
    if (this.#closed) queueMicrotask(() => handler(this.#error));
    else this.#closeHandlers.push(handler);
  }

  close(): void {
    this.#socket.destroy();
  }

  #onLine(line: Buffer): boolean {
    const tab = line.lastIndexOf(9);
    if (tab < 0) return this.#fail(new Error("Control line without a MAC"));
    const payload = line.subarray(0, tab);
    const mac = Buffer.from(line.subarray(tab + 1).toString(), "hex");
    if (!verifyHmac(this.#recvKey, mac, seqBytes(this.#recvSeq), payload)) {
      return this.#fail(
        new KvfenceError(
          "transfer_failed",
          "Control link peer failed authentication; give every node the same --cluster-secret: bad MAC",
        ),
      );
    }
    this.#recvSeq++;
    let message: In;
    try {
      message = JSON.parse(payload.toString()) as In;
    } catch {
      return this.#fail(new Error("Control line is not JSON"));
    }
    if (this.#handlers.length === 0) this.#backlog.push(message);
    else for (const h of this.#handlers) h(message);
    return true;
  }

  #fail(error: Error): false {
    this.#error ??= error;
    this.#socket.destroy();
    return false;
  }
}

function helloLine(secret: Buffer, body: object): Buffer {
  const payload = Buffer.from(JSON.stringify(body));
  return Buffer.concat([payload, Buffer.from(`\t${hmac(secret, HELLO, payload).toString("hex")}\n`)]);
}

/** Reads one MACed hello line; resolves with its body and the bytes after it. */
function readHello(
  socket: net.Socket,
  secret: Buffer,
): Promise<{ body: Record<string, unknown>; rest: Buffer }> {
  return new Promise((resolve, reject) => {
    let buffered = Buffer.alloc(0);
    const cleanup = (): void => {
      socket.off("data", onData);
      socket.off("close", onClose);
    };
    const onClose = (): void => {
      cleanup();
      reject(new KvfenceError("node_unavailable", "Control link closed during the handshake: closed"));
    };
    const onData = (chunk: Buffer): void => {
      buffered = Buffer.concat([buffered, chunk]);
      const nl = buffered.indexOf(10);
      if (nl < 0) {
        if (buffered.length > 4096) onClose();
        return;
      }
      cleanup();
      const line = buffered.subarray(0, nl);
      const rest = buffered.subarray(nl + 1);
      const tab = line.lastIndexOf(9);
      const payload = line.subarray(0, Math.max(tab, 0));
      const mac = Buffer.from(line.subarray(tab + 1).toString(), "hex");
      if (tab < 0 || !verifyHmac(secret, mac, HELLO, payload)) {
        socket.destroy();
        reject(
          new KvfenceError(
            "transfer_failed",
            "Control link peer failed authentication; give every node the same --cluster-secret: bad hello",
          ),
        );
        return;
      }
      try {
        resolve({ body: JSON.parse(payload.toString()) as Record<string, unknown>, rest });
      } catch {
        socket.destroy();
        reject(new KvfenceError("transfer_failed", "Control link hello is not JSON: bad hello"));
      }
    };
    socket.on("data", onData);
    socket.on("close", onClose);
  });
}

/** Connects to a node's control port (the router side). */
export async function connectControlLink<Out, In>(options: {
  readonly host: string;
  readonly port: number;
  readonly secret: string | Uint8Array;
  /** Mutual TLS (docs/tls.md); plain TCP without. */
  readonly tls?: LinkTls;
}): Promise<ControlLink<Out, In>> {
  const secret = clusterSecretBytes(options.secret);
  const { socket, ready } = connectLink(options.tls, {
    host: options.host,
    port: options.port,
    noDelay: true,
  });
  // Until the link takes the socket over: a reset or a TLS alert mid-handshake is a refusal, not a crash.
  let failure: Error | undefined;
  const onEarlyError = (err: Error): void => {
    failure ??= err;
  };
  socket.on("error", onEarlyError);
  await new Promise<void>((resolve, reject) => {
    socket.once(ready, () => {
      socket.off("close", onClose);
      resolve();
    });
    const onClose = (): void => reject(failure ?? new Error("closed"));
    socket.once("close", onClose);
  }).catch((err: Error) => {
    throw new KvfenceError(
      "node_unavailable",
      `Cannot reach the node at ${options.host}:${options.port}; check that it runs${options.tls === undefined ? "" : " and that its certificate is issued by --tls-ca for that address"}: ${tlsReason(err)}`,
    );
  });
  const nonce = randomBytes(16);
  socket.write(helloLine(secret, { nonce: nonce.toString("hex") }));
  const { body, rest } = await readHello(socket, secret).catch((err: Error) => {
    // The TLS server checks our certificate after our handshake ends (TLS 1.3): its refusal lands here.
    if (options.tls === undefined) throw err;
    throw new KvfenceError(
      "transfer_failed",
      `The node at ${options.host}:${options.port} closed the TLS link during the handshake; check that --tls-cert is issued by the node's --tls-ca: ${failure === undefined ? "closed" : tlsReason(failure)}`,
    );
  });
  socket.off("error", onEarlyError);
  if (body.peerNonce !== nonce.toString("hex") || typeof body.nonce !== "string") {
    socket.destroy();
    throw new KvfenceError("transfer_failed", "Control link hello does not answer ours: bad nonce");
  }
  const keys = sessionKeys(secret, nonce, Buffer.from(body.nonce, "hex"));
  return new ControlLink<Out, In>(socket, keys.clientToServer, keys.serverToClient, rest);
}

/** Listens for router links (the node side); `onLink` gets each authenticated link. */
export async function listenControlLinks<Out, In>(options: {
  readonly host: string;
  readonly port: number;
  readonly secret: string | Uint8Array;
  readonly onLink: (link: ControlLink<Out, In>) => void;
  /** Mutual TLS (docs/tls.md); plain TCP without. */
  readonly tls?: LinkTls;
  /** A connection refused in the TLS handshake (no certificate, another CA, plaintext). */
  readonly onRefused?: (error: KvfenceError) => void;
}): Promise<{ readonly port: number; close(): Promise<void> }> {
  const secret = clusterSecretBytes(options.secret);
  const sockets = new Set<net.Socket>();
  const server = createLinkServer(options, (socket) => {
    sockets.add(socket);
    socket.on("close", () => sockets.delete(socket));
    socket.on("error", () => {});
    readHello(socket, secret).then(
      ({ body, rest }) => {
        if (typeof body.nonce !== "string" || !/^[0-9a-f]{32}$/.test(body.nonce)) {
          socket.destroy();
          return;
        }
        const nonce = randomBytes(16);
        socket.write(helloLine(secret, { nonce: nonce.toString("hex"), peerNonce: body.nonce }));
        const keys = sessionKeys(secret, Buffer.from(body.nonce, "hex"), nonce);
        options.onLink(new ControlLink<Out, In>(socket, keys.serverToClient, keys.clientToServer, rest));
      },
      () => socket.destroy(),
    );
  });
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen(options.port, options.host, () => {
      server.off("error", reject);
      resolve();
    });
  });
  return {
    port: (server.address() as net.AddressInfo).port,
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy();
        server.close(() => resolve());
      }),
  };
}
