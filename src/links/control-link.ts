/**
 * The router ↔ node control link of the multi-process topology: one TCP connection per node,
 * newline-delimited JSON, every line authenticated with the cluster secret.
 *
 * Handshake (control-auth.ts, docs/protocol.md): the router sends `{v, nonce, dialled}` MACed with
 * the secret; the node answers the challenge `{nonce, peerNonce, advertised}` MACed with its session
 * key over both lines; the router answers the proof `{}` MACed with its session key over both lines,
 * and only then does the node admit the link (and send anything on it). A recorded handshake
 * replayed to the node fails at the proof: the node's nonce is new. The address the router dialled
 * and the one the node advertises must be the same (link-address.ts): through a relay elsewhere
 * the node answers its challenge and closes, and the router refuses that challenge
 * (`address_mismatch` on both sides). Until admitted, a connection is held to the pre-handshake
 * limits (link-guard.ts: a deadline, a cap on pending connections, 4 KiB per line), and the node
 * decides whether a proven router may have the link (`admit`: not while another one holds it,
 * unless it is a newer incarnation, i.e. a restarted router). After it, every line carries an
 * HMAC-SHA256 over its sequence number and payload, so a line cannot be forged, replayed or
 * reordered. Any bad line closes the connection; a closed connection is the peer's loss (the fence).
 * The router's lines may hold a prompt's ids as an `Int32Array`, written in base64 and read back
 * as one (src/transfer/control-codec.ts); the node's, one per token, are plain JSON.
 */
import { randomBytes } from "node:crypto";
import type net from "node:net";
import { KvfenceError } from "../lib/errors.js";
import { ROUTER_SLOTS } from "../protocol/wire.js";
import {
  clusterSecretBytes,
  HANDSHAKE_VERSION,
  handshakeVersionMismatch,
  hmac,
  NONCE_BYTES,
  sessionKeys,
  transcript,
  verifyHmac,
} from "../transfer/control-auth.js";
import { parseWithInt32Arrays, stringifyWithInt32Arrays } from "../transfer/control-codec.js";
import { advertisedMismatch, dialledMismatch, linkAddress } from "../transfer/link-address.js";
import {
  type LinkAuthFailures,
  type LinkAuthReason,
  MAX_PREAUTH_BYTES,
  PreAuthGuard,
} from "../transfer/link-guard.js";
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
  readonly #encode: (message: Out) => string;
  #sendSeq = 0;
  #recvSeq = 0;
  readonly #handlers: ((m: In) => void)[] = [];
  readonly #closeHandlers: ((error?: Error) => void)[] = [];
  readonly #backlog: In[] = [];
  #closed = false;
  #error: Error | undefined;

  /**
   * @internal Use `connectControlLink` or `listenControlLinks`. `encode` writes a message's line
   * (the router's: with its `Int32Array`s; the node's: plain JSON).
   */
  constructor(
    socket: net.Socket,
    sendKey: Buffer,
    recvKey: Buffer,
    rest: Buffer,
    encode: (message: Out) => string,
  ) {
    this.#socket = socket;
    this.#encode = encode;
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
    const payload = Buffer.from(this.#encode(message));
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
      message = parseWithInt32Arrays(payload.toString()) as In;
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

const CHALLENGE = "kvfence link challenge";
const PROOF = "kvfence link proof";
const PROOF_PAYLOAD = Buffer.from("{}");

/** `payload \t hex(mac)\n`. */
function line(payload: Buffer, mac: Buffer): Buffer {
  return Buffer.concat([payload, Buffer.from(`\t${mac.toString("hex")}\n`)]);
}

/**
 * A link refused during its handshake, with the reason it is counted under; the node sends `last`
 * (if any) before closing.
 */
export class HandshakeError extends KvfenceError {
  constructor(
    readonly reason: LinkAuthReason,
    message: string,
    readonly last?: Buffer,
  ) {
    super("transfer_failed", message);
  }
}

/** Reads one `payload \t mac` line of at most `MAX_PREAUTH_BYTES`; resolves with it and the bytes after it. */
function readLine(socket: net.Socket, rest: Buffer): Promise<{ payload: Buffer; mac: Buffer; rest: Buffer }> {
  return new Promise((resolve, reject) => {
    let buffered = rest;
    const cleanup = (): void => {
      socket.off("data", onData);
      socket.off("close", onClose);
    };
    const onClose = (): void => {
      cleanup();
      reject(new KvfenceError("node_unavailable", "Control link closed during the handshake: closed"));
    };
    const onData = (chunk: Buffer): void => {
      buffered = buffered.length === 0 ? chunk : Buffer.concat([buffered, chunk]);
      const nl = buffered.indexOf(10);
      if (nl < 0) {
        if (buffered.length > MAX_PREAUTH_BYTES) {
          cleanup();
          reject(new HandshakeError("oversized", `Handshake line longer than ${MAX_PREAUTH_BYTES} bytes`));
        }
        return;
      }
      cleanup();
      const text = buffered.subarray(0, nl);
      const tab = text.lastIndexOf(9);
      const hex = text.subarray(tab + 1).toString();
      if (tab < 0 || !/^[0-9a-f]{64}$/.test(hex)) {
        reject(new HandshakeError("malformed", "Handshake line is not `payload<TAB>mac`"));
        return;
      }
      resolve({
        payload: text.subarray(0, tab),
        mac: Buffer.from(hex, "hex"),
        rest: buffered.subarray(nl + 1),
      });
    };
    socket.on("data", onData);
    socket.on("close", onClose);
    if (buffered.length > 0) queueMicrotask(() => onData(Buffer.alloc(0)));
  });
}

function parseJson(payload: Buffer): Record<string, unknown> | null {
  try {
    const v: unknown = JSON.parse(payload.toString());
    return v !== null && typeof v === "object" && !Array.isArray(v) ? (v as Record<string, unknown>) : null;
  } catch {
    return null;
  }
}

const NONCE_HEX = /^[0-9a-f]{32}$/;

/** Connects to a node's control port (the router side); resolves once the node proved itself. */
export async function connectControlLink<Out, In>(options: {
  readonly host: string;
  readonly port: number;
  readonly secret: string | Uint8Array;
  /** This router's incarnation (its start time), sent in the hello: a newer one may replace an older. */
  readonly incarnation?: number;
  /** This router's slot (`--router-slot`), sent in the hello: the node keeps one router per slot. */
  readonly routerSlot?: number;
  /** Mutual TLS (docs/tls.md); plain TCP without. */
  readonly tls?: LinkTls;
}): Promise<ControlLink<Out, In>> {
  const secret = clusterSecretBytes(options.secret);
  const { socket, ready } = connectLink(options.tls, {
    host: options.host,
    port: options.port,
    noDelay: true,
  });
  // From here on a reset or a TLS alert mid-handshake is a refusal, never an unhandled error.
  let failure: Error | undefined;
  socket.on("error", (err) => {
    failure ??= err;
  });
  await new Promise<void>((resolve, reject) => {
    const onClose = (): void => reject(failure ?? new Error("closed"));
    socket.once(ready, () => {
      socket.off("close", onClose);
      resolve();
    });
    socket.once("close", onClose);
  }).catch((err: Error) => {
    throw new KvfenceError(
      "node_unavailable",
      `Cannot reach the node at ${options.host}:${options.port}; check that it runs${options.tls === undefined ? "" : " and that its certificate is issued by --tls-ca for that address"}: ${tlsReason(err)}`,
    );
  });
  const nonce = randomBytes(NONCE_BYTES);
  // The address as this router knows it (the registry entry's, the --prefill/--decode URL's).
  const dialled = linkAddress(options.host, options.port);
  const hello = Buffer.from(
    JSON.stringify({
      v: HANDSHAKE_VERSION,
      nonce: nonce.toString("hex"),
      dialled,
      ...(options.incarnation === undefined ? {} : { incarnation: options.incarnation }),
      ...(options.routerSlot === undefined ? {} : { routerSlot: options.routerSlot }),
    }),
  );
  socket.write(line(hello, hmac(secret, HELLO, hello)));
  const challenge = await readLine(socket, Buffer.alloc(0)).catch((err: Error) => {
    socket.destroy();
    throw err instanceof HandshakeError
      ? new KvfenceError("transfer_failed", `Control link peer sent a bad challenge: ${err.message}`)
      : new KvfenceError(
          "node_unavailable",
          options.tls === undefined
            ? `The node at ${options.host}:${options.port} closed the control link during the handshake; check that it has the same --cluster-secret and the same --tls-* setting (its log says why it refused): closed`
            : // The TLS server checks our certificate after our handshake ends (TLS 1.3): its refusal lands here.
              `The node at ${options.host}:${options.port} closed the control link during the handshake; check that it has the same --cluster-secret and that --tls-cert is issued by its --tls-ca: ${failure === undefined ? "closed" : tlsReason(failure)}`,
        );
  });
  const body = parseJson(challenge.payload);
  const fail = (why: string): never => {
    socket.destroy();
    throw new KvfenceError(
      "transfer_failed",
      `Control link peer failed authentication; give every node the same --cluster-secret: ${why}`,
    );
  };
  if (body === null || typeof body.nonce !== "string" || !NONCE_HEX.test(body.nonce)) fail("bad challenge");
  if (body!.peerNonce !== nonce.toString("hex")) fail("the challenge does not answer our nonce");
  const keys = sessionKeys(secret, nonce, Buffer.from(body!.nonce as string, "hex"));
  if (!verifyHmac(keys.serverToClient, challenge.mac, transcript(CHALLENGE, hello, challenge.payload))) {
    fail("bad challenge MAC");
  }
  const mismatch = advertisedMismatch(body!.advertised, dialled);
  if (mismatch !== null) {
    socket.destroy();
    throw new HandshakeError("address_mismatch", `Refused the node's control link: ${mismatch}`);
  }
  socket.write(line(PROOF_PAYLOAD, hmac(keys.clientToServer, transcript(PROOF, hello, challenge.payload))));
  return new ControlLink<Out, In>(
    socket,
    keys.clientToServer,
    keys.serverToClient,
    challenge.rest,
    stringifyWithInt32Arrays,
  );
}

export interface ControlListenOptions<Out, In> {
  readonly host: string;
  readonly port: number;
  readonly secret: string | Uint8Array;
  readonly onLink: (link: ControlLink<Out, In>, incarnation: number | undefined, routerSlot?: number) => void;
  /**
   * Called for a peer that proved itself, with the incarnation from its hello (a router's start
   * time): false refuses it (`peer_connected`) — while an admitted peer holds the link, a new one
   * must not silently replace it — true admits it. `routerSlot` is the router's slot from its
   * hello (0 when it names none). Default: admit.
   */
  readonly admit?: (incarnation: number | undefined, routerSlot: number) => boolean;
  readonly handshakeTimeoutMs?: number;
  readonly maxPending?: number;
  readonly reportWindowMs?: number;
  /**
   * The address routers dial this node at (`--advertise`), each part defaulting to `host` and the
   * port listened on: a router's hello must name it (link-address.ts).
   */
  readonly advertise?: { readonly host?: string; readonly port?: number };
  /** A connection was refused (counted in `failures`). */
  readonly onRefused?: (reason: LinkAuthReason, detail: string) => void;
  /** Mutual TLS (docs/tls.md); plain TCP without. A failed TLS handshake counts as `tls_handshake`. */
  readonly tls?: LinkTls;
}

export interface ControlListener {
  readonly port: number;
  /** The address routers must have dialled (`linkAddress` form). */
  readonly advertised: string;
  /** Refused connections by reason. */
  readonly failures: LinkAuthFailures;
  close(): Promise<void>;
}

/**
 * The router slot a proven hello names (absent: 0), or the refusal: out of range, or the node's
 * `admit` says a router holds that slot already.
 */
function admittedRouterSlot(
  slot: unknown,
  incarnation: number | undefined,
  admit: ((incarnation: number | undefined, routerSlot: number) => boolean) | undefined,
): number {
  const routerSlot = slot ?? 0;
  if (
    typeof routerSlot !== "number" ||
    !Number.isInteger(routerSlot) ||
    routerSlot < 0 ||
    routerSlot >= ROUTER_SLOTS
  ) {
    throw new HandshakeError(
      "malformed",
      `router slot out of range 0-${ROUTER_SLOTS - 1}: ${String(routerSlot)}`,
    );
  }
  if (admit?.(incarnation, routerSlot) === false) {
    throw new HandshakeError(
      "peer_connected",
      `a router is connected in router slot ${routerSlot} already; give each router its own --router-slot`,
    );
  }
  return routerSlot;
}

/** Listens for router links (the node side); `onLink` gets each authenticated link. */
export async function listenControlLinks<Out, In>(
  options: ControlListenOptions<Out, In>,
): Promise<ControlListener> {
  const secret = clusterSecretBytes(options.secret);
  const sockets = new Set<net.Socket>();
  const guard = new PreAuthGuard({
    ...(options.handshakeTimeoutMs === undefined ? {} : { handshakeTimeoutMs: options.handshakeTimeoutMs }),
    ...(options.maxPending === undefined ? {} : { maxPending: options.maxPending }),
    ...(options.reportWindowMs === undefined ? {} : { reportWindowMs: options.reportWindowMs }),
    ...(options.onRefused === undefined ? {} : { onRefused: options.onRefused }),
  });
  /** Set once listening (the port may be the one the system chose). */
  let advertised = "";
  const accept = async (socket: net.Socket): Promise<void> => {
    const hello = await readLine(socket, Buffer.alloc(0));
    if (!verifyHmac(secret, hello.mac, HELLO, hello.payload)) {
      throw new HandshakeError("bad_hello", "hello MAC does not verify (another --cluster-secret?)");
    }
    const body = parseJson(hello.payload);
    if (body === null || typeof body.nonce !== "string" || !NONCE_HEX.test(body.nonce)) {
      throw new HandshakeError("malformed", "hello without a nonce");
    }
    const version = handshakeVersionMismatch(body.v);
    if (version !== null) throw new HandshakeError("malformed", version);
    const nonce = randomBytes(NONCE_BYTES);
    const keys = sessionKeys(secret, Buffer.from(body.nonce, "hex"), nonce);
    const challenge = Buffer.from(
      JSON.stringify({ nonce: nonce.toString("hex"), peerNonce: body.nonce, advertised }),
    );
    const answer = line(
      challenge,
      hmac(keys.serverToClient, transcript(CHALLENGE, hello.payload, challenge)),
    );
    // A router that dialled another address reached this node through a relay: the challenge tells
    // it so (under the MAC, so the relay cannot hide it), and the node closes.
    const mismatch = dialledMismatch(body.dialled, advertised);
    if (mismatch !== null) throw new HandshakeError("address_mismatch", mismatch, answer);
    socket.write(answer);
    const proof = await readLine(socket, hello.rest);
    if (!verifyHmac(keys.clientToServer, proof.mac, transcript(PROOF, hello.payload, challenge))) {
      throw new HandshakeError(
        "bad_proof",
        "the proof does not answer this connection's challenge (a replay?)",
      );
    }
    const incarnation = Number.isSafeInteger(body.incarnation) ? (body.incarnation as number) : undefined;
    const routerSlot = admittedRouterSlot(body.routerSlot, incarnation, options.admit);
    guard.admitted(socket);
    const link = new ControlLink<Out, In>(
      socket,
      keys.serverToClient,
      keys.clientToServer,
      proof.rest,
      JSON.stringify,
    );
    options.onLink(link, incarnation, routerSlot);
  };
  const onTlsRefused = (error: KvfenceError, socket: net.Socket): void => {
    guard.count(socket, "tls_handshake", error.message);
  };
  const server = createLinkServer({ tls: options.tls, onRefused: onTlsRefused }, (socket) => {
    sockets.add(socket);
    socket.on("close", () => sockets.delete(socket));
    socket.on("error", () => {});
    const remote = `${socket.remoteAddress}:${socket.remotePort}`;
    guard.accepted(socket, remote);
    accept(socket).catch((err: Error) => {
      if (err instanceof HandshakeError)
        guard.refuse(socket, err.reason, `${err.message} from ${remote}`, err.last);
      else socket.destroy();
    });
  });
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen(options.port, options.host, () => {
      server.off("error", reject);
      resolve();
    });
  });
  const port = (server.address() as net.AddressInfo).port;
  advertised = linkAddress(options.advertise?.host ?? options.host, options.advertise?.port ?? port);
  return {
    port,
    advertised,
    failures: guard.failures,
    close: () =>
      new Promise<void>((resolve) => {
        guard.close();
        for (const s of sockets) s.destroy();
        server.close(() => resolve());
      }),
  };
}
