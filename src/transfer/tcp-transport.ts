/**
 * The TCP transport (processes, hosts). Prefill listens (`TcpTransferServer`, like SGLang's
 * bootstrap server on prefill); each decode node connects (`connectTcpReceiver`) and reads into one
 * reused buffer (`onread`, docs/benchmarks.md §3.4: the default `'data'` receiver allocates per chunk).
 *
 * Handshake (control-auth.ts, docs/protocol.md §3a): decode sends HELLO `{v, layoutSignature, nonce,
 * incarnation, dialled}` MACed with the cluster secret; prefill answers the challenge, a HELLO
 * `{layoutSignature, nonce, peerNonce, incarnation, advertised}` MACed with its session key over
 * both, or REFUSE `{code, message}` and closes; decode answers PROOF, MACed with its session key over
 * both, and only then does prefill create the writer. A replayed handshake fails at the PROOF; a
 * second connection for a connected decode incarnation is refused after it (no takeover). Either
 * side refuses a different layout signature (docs/prior-art.md H8), and a dialled address that is
 * not the advertised one (link-address.ts: a relay; prefill closes after its challenge, decode
 * refuses it). Until the PROOF a connection is held to the
 * pre-handshake limits (link-guard.ts): a deadline, a cap on pending connections, 4 KiB frames.
 * After it, control frames (CONTROL, LEASE_END) carry an HMAC-SHA256 under per-direction session
 * keys and a sequence number; page bodies do not (the manifest checksums cover them).
 *
 * Writer: page frames go out corked, flushed as one writev of ≥ `batchBytes` (1 MiB) or when the
 * event loop turns, with backpressure on the socket's queued bytes. Concurrent transfers interleave
 * frame by frame on the one connection (a call waits for the socket mid-lease), so every frame
 * carries its own lease's `(rid, epoch)`. Page bodies are sent from the
 * caller's memory without a copy, so the source pages must stay pinned until the lease concludes
 * (docs/prior-art.md H3), as the protocol does anyway.
 *
 * Receiver: a page body lands in the pool — read from the socket straight into its page (pages of
 * ≥ 64 KiB, through an `onread` buffer function) or copied from the reused receive buffer — only
 * if the page is in bounds, the body is exactly one page, and the page is RESERVED for the frame's
 * `(rid, epoch)` at its generation (`OwnershipTable.checkWrite`); otherwise it drops the body and
 * counts it (docs/prior-art.md H2/H7). The check is repeated when the body is complete, then the writer
 * stamp is set. Frames are applied in stream order, so a control message (manifest,
 * ABORT_ACK) is delivered after every page written before it.
 */
import { randomBytes } from "node:crypto";
import type net from "node:net";
import type { OwnershipTable } from "../kvcache/ownership-table.js";
import { type ByteRange, byteView } from "../lib/byte-range.js";
import { KvfenceError } from "../lib/errors.js";
import {
  clusterSecretBytes,
  HANDSHAKE_VERSION,
  handshakeVersionMismatch,
  MAC_BYTES,
  NONCE_BYTES,
  sessionKeys,
  transcript,
} from "./control-auth.js";
import { decodeControl, decodeJsonObject, encodeControl } from "./control-codec.js";
import {
  DROP_BODY,
  FRAME_HEADER_BYTES,
  FrameDecoder,
  type FrameHeader,
  type FrameSink,
  FrameType,
  frameHeaderBytes,
} from "./frame-codec.js";
import { advertisedMismatch, dialledMismatch, linkAddress } from "./link-address.js";
import { type LinkAuthFailures, type LinkAuthReason, MAX_PREAUTH_BYTES, PreAuthGuard } from "./link-guard.js";
import { MacChannel } from "./mac-channel.js";
import { layoutMismatch } from "./shm-transport.js";
import { connectLink, createLinkServer, type LinkTls } from "./tls-config.js";
import { TransferClock, TransferMetrics } from "./transfer-metrics.js";
import type { ControlMessage, PageWrite, TransferHandlers, TransferWriter, WriteLease } from "./transport.js";

const HELLO_CONTEXT = Buffer.from("kvfence hello");
const CHALLENGE = "kvfence transfer challenge";
const PROOF = "kvfence transfer proof";
const MAX_CONTROL_BYTES = 1 << 20;

interface HelloPayload {
  readonly layoutSignature: string;
  readonly nonce: string;
  readonly peerNonce?: string;
  /** Decode's incarnation (boot count), so prefill knows which leases it may write. */
  readonly incarnation?: number;
  /** Decode's HELLO: the handshake version and the address it dialled (checked by prefill). */
  readonly v?: unknown;
  readonly dialled?: unknown;
  /** Prefill's challenge: the address it advertises (checked by decode). */
  readonly advertised?: unknown;
}

function parseHello(payload: Uint8Array): HelloPayload | null {
  try {
    const v = decodeJsonObject(payload) as Partial<HelloPayload>;
    if (typeof v.layoutSignature !== "string" || typeof v.nonce !== "string") return null;
    if (!/^[0-9a-f]{32}$/.test(v.nonce)) return null;
    if (v.incarnation !== undefined && !Number.isSafeInteger(v.incarnation)) return null;
    return v as HelloPayload;
  } catch {
    return null;
  }
}

/** A REFUSE frame `{code, message}` of `error` (MACed with `prefix` before the session keys exist). */
function refuseFrame(mac: MacChannel, error: KvfenceError, prefix?: Buffer): Buffer {
  return mac.frame(
    FrameType.REFUSE,
    0,
    0,
    0,
    encodeControl({ code: error.code, message: error.message }),
    prefix,
  );
}

function authError(side: string): KvfenceError {
  return new KvfenceError(
    "transfer_failed",
    `Transfer peer failed authentication; give both nodes the same --cluster-secret: ${side}`,
  );
}

export interface TcpServerOptions {
  /** Default 127.0.0.1. */
  readonly host?: string;
  /** Default 0 (an ephemeral port). */
  readonly port?: number;
  readonly secret: string | Uint8Array;
  readonly layoutSignature: string;
  /** A decode node connected and passed the handshake. */
  readonly onWriter: (writer: TcpTransferWriter) => void;
  /** A connection failed before or during the handshake (bad MAC, layout mismatch, bad frames). */
  readonly onError?: (error: KvfenceError) => void;
  /** Bytes per socket write batch. Default 1 MiB. */
  readonly batchBytes?: number;
  /** This prefill node's incarnation, sent in the challenge (decode checks it on a reconnect). */
  readonly incarnation?: number;
  /**
   * The address decode dials this server at, each part defaulting to `host` and the port listened
   * on (a node's is its `--advertise` host): decode's HELLO must name it (link-address.ts).
   */
  readonly advertise?: { readonly host?: string; readonly port?: number };
  /** Pre-handshake limits (link-guard.ts). */
  readonly handshakeTimeoutMs?: number;
  readonly maxPending?: number;
  /** A connection was refused before admission (counted in `failures`). */
  readonly onRefused?: (reason: LinkAuthReason, detail: string) => void;
  /** Mutual TLS (docs/tls.md); plain TCP without. A failed TLS handshake counts as `tls_handshake`. */
  readonly tls?: LinkTls;
}

/** The prefill side: accepts decode connections and hands out one `TcpTransferWriter` each. */
export class TcpTransferServer {
  readonly #server: net.Server;
  readonly #writers = new Set<TcpTransferWriter>();
  readonly #sockets = new Set<net.Socket>();
  readonly #guard: PreAuthGuard;
  /** Set once listening (the port may be the one the system chose). */
  #advertised = "";

  private constructor(server: net.Server, guard: PreAuthGuard) {
    this.#server = server;
    this.#guard = guard;
  }

  /** Connections refused before admission, by reason (`kvfence_link_auth_failures_total`). */
  get failures(): LinkAuthFailures {
    return this.#guard.failures;
  }

  /** Connections in their handshake now. */
  get pending(): number {
    return this.#guard.pending;
  }

  static async listen(options: TcpServerOptions): Promise<TcpTransferServer> {
    const secret = clusterSecretBytes(options.secret);
    const guard = new PreAuthGuard({
      ...(options.handshakeTimeoutMs === undefined ? {} : { handshakeTimeoutMs: options.handshakeTimeoutMs }),
      ...(options.maxPending === undefined ? {} : { maxPending: options.maxPending }),
      ...(options.onRefused === undefined ? {} : { onRefused: options.onRefused }),
    });
    const onTlsRefused = (error: KvfenceError, socket: net.Socket): void => {
      guard.count(socket, "tls_handshake", error.message);
    };
    const server = createLinkServer({ tls: options.tls, onRefused: onTlsRefused }, (socket) =>
      self.#accept(socket, secret, options),
    );
    const self = new TcpTransferServer(server, guard);
    await new Promise<void>((resolve, reject) => {
      server.once("error", reject);
      server.listen(options.port ?? 0, options.host ?? "127.0.0.1", () => {
        server.off("error", reject);
        resolve();
      });
    });
    self.#advertised = linkAddress(
      options.advertise?.host ?? options.host ?? "127.0.0.1",
      options.advertise?.port ?? self.port,
    );
    return self;
  }

  get port(): number {
    return (this.#server.address() as net.AddressInfo).port;
  }

  /** The address decode must have dialled (`linkAddress` form). */
  get advertised(): string {
    return this.#advertised;
  }

  /** Stops listening and closes every connection. */
  async close(): Promise<void> {
    this.#guard.close();
    for (const socket of this.#sockets) socket.destroy();
    await new Promise<void>((resolve) => this.#server.close(() => resolve()));
  }

  /** The refusal of a connection for a decode incarnation that is connected already, or null. */
  #duplicateRefusal(incarnation: number | undefined): KvfenceError | null {
    for (const w of this.#writers) {
      if (w.peerIncarnation === incarnation && !w.closed) {
        return new KvfenceError(
          "transfer_failed",
          `Prefill refused the transfer connection: decode incarnation ${incarnation} is connected already`,
        );
      }
    }
    return null;
  }

  #accept(socket: net.Socket, secret: Buffer, options: TcpServerOptions): void {
    this.#sockets.add(socket);
    socket.on("close", () => this.#sockets.delete(socket));
    const remote = `${socket.remoteAddress}:${socket.remotePort}`;
    this.#guard.accepted(socket, remote);
    const mac = new MacChannel(secret);
    let writer: TcpTransferWriter | null = null;
    /** The hello's payload and body once it verified, and the challenge sent back. */
    let hello: { payload: Buffer; body: HelloPayload; challenge: Buffer } | null = null;
    const refuse = (reason: LinkAuthReason, error: KvfenceError, frame?: Buffer): undefined => {
      if (this.#guard.refuse(socket, reason, `${error.message} from ${remote}`, frame))
        options.onError?.(error);
    };
    /** A REFUSE frame before the session keys exist: MACed with the secret. */
    const refusal = (error: KvfenceError): Buffer => refuseFrame(mac, error, HELLO_CONTEXT);
    const onHello = (header: FrameHeader, body: Uint8Array): undefined => {
      if (header.type !== FrameType.HELLO) {
        return refuse("malformed", authError(`expected HELLO first, got frame type ${header.type}`));
      }
      const payload = mac.open(header, body, HELLO_CONTEXT);
      if (payload === null) {
        const error = authError("bad HELLO from decode");
        return refuse("bad_hello", error, refusal(error));
      }
      const parsed = parseHello(payload);
      if (parsed === null) return refuse("malformed", authError("malformed HELLO from decode"));
      const refused = helloRefusal(parsed, options.layoutSignature);
      if (refused !== null) return refuse(refused.reason, refused.error, refusal(refused.error));
      const nonce = randomBytes(NONCE_BYTES);
      const keys = sessionKeys(secret, Buffer.from(parsed.nonce, "hex"), nonce);
      mac.sendKey = keys.serverToClient;
      mac.recvKey = keys.clientToServer;
      const helloPayload = Buffer.from(payload);
      const challenge = encodeControl({
        layoutSignature: options.layoutSignature,
        nonce: nonce.toString("hex"),
        peerNonce: parsed.nonce,
        ...(options.incarnation === undefined ? {} : { incarnation: options.incarnation }),
        advertised: this.#advertised,
      });
      const answer = mac.frame(FrameType.HELLO, 0, 0, 0, challenge, transcript(CHALLENGE, helloPayload));
      // A decode node that dialled another address reached prefill through a relay: the challenge
      // tells it so (under the MAC), and prefill closes.
      const mismatch = dialledMismatch(parsed.dialled, this.#advertised);
      if (mismatch !== null) return refuse("address_mismatch", authError(mismatch), answer);
      socket.write(answer);
      hello = { payload: helloPayload, body: parsed, challenge };
    };
    const onProof = (header: FrameHeader, body: Uint8Array): undefined => {
      const h = hello!;
      const proof =
        header.type === FrameType.PROOF
          ? mac.open(header, body, transcript(PROOF, h.payload, h.challenge))
          : null;
      if (proof === null || proof.length !== 0) {
        return refuse(
          "bad_proof",
          authError("the PROOF does not answer this connection's challenge (a replay?)"),
        );
      }
      const incarnation = h.body.incarnation;
      const duplicate = this.#duplicateRefusal(incarnation);
      if (duplicate !== null) return refuse("peer_connected", duplicate, refuseFrame(mac, duplicate));
      this.#guard.admitted(socket);
      decoder.setMaxControlBytes(MAX_CONTROL_BYTES);
      const w = new TcpTransferWriter(socket, mac, options.batchBytes ?? 1 << 20, incarnation);
      writer = w;
      this.#writers.add(w);
      socket.on("close", () => this.#writers.delete(w));
      options.onWriter(w);
    };
    const sink: FrameSink = {
      onHeader: () => undefined,
      onFrame: (header, body) => {
        if (writer !== null) return writer.onFrame(header, body);
        if (socket.destroyed) return;
        return hello === null ? onHello(header, body) : onProof(header, body);
      },
      onError: (error) => {
        if (writer !== null) return writer.fail(error);
        refuse(/longer than the limit/.test(error.message) ? "oversized" : "malformed", error);
      },
    };
    // Before the handshake a frame may declare at most MAX_PREAUTH_BYTES (link-guard.ts).
    const decoder = new FrameDecoder(sink, { maxPageBytes: 0, maxControlBytes: MAX_PREAUTH_BYTES });
    socket.on("data", (chunk: Buffer) => {
      try {
        decoder.push(chunk);
      } catch (error) {
        if (writer !== null) writer.fail(error as Error);
        else socket.destroy();
      }
    });
    socket.on("error", (error) => writer?.fail(error));
  }
}

/** Why prefill refuses a verified HELLO before its challenge (another version or layout), or null. */
function helloRefusal(
  hello: HelloPayload,
  layoutSignature: string,
): { reason: LinkAuthReason; error: KvfenceError } | null {
  const version = handshakeVersionMismatch(hello.v);
  if (version !== null) return { reason: "malformed", error: new KvfenceError("transfer_failed", version) };
  if (hello.layoutSignature !== layoutSignature) {
    return { reason: "layout_mismatch", error: layoutMismatch(layoutSignature, hello.layoutSignature) };
  }
  return null;
}

/** The prefill end of one TCP connection (created by `TcpTransferServer`). */
export class TcpTransferWriter implements TransferWriter {
  readonly kind = "tcp";
  readonly metrics = new TransferMetrics();
  /** The connected decode node's incarnation from its HELLO (the protocol's `peer_up`). */
  readonly peerIncarnation: number | undefined;
  /** Control messages from decode (aborts) and `closed`; set by the node glue. */
  handlers: Pick<TransferHandlers, "control" | "closed"> = {};
  readonly #socket: net.Socket;
  readonly #mac: MacChannel;
  readonly #batchBytes: number;
  readonly #clock = new TransferClock();
  #corked = 0;
  #flushScheduled = false;
  #closedError: Error | null = null;
  #closed = false;

  /** True once the connection closed. */
  get closed(): boolean {
    return this.#closed || this.#socket.destroyed;
  }

  /** @internal */
  constructor(socket: net.Socket, mac: MacChannel, batchBytes: number, peerIncarnation: number | undefined) {
    this.peerIncarnation = peerIncarnation;
    this.#socket = socket;
    this.#mac = mac;
    this.#batchBytes = batchBytes;
    socket.on("close", () => {
      this.#closed = true;
      this.handlers.closed?.(this.#closedError ?? undefined);
    });
  }

  /** @internal A frame from decode after the handshake. */
  onFrame(header: FrameHeader, body: Uint8Array): undefined {
    const payload = header.type === FrameType.CONTROL ? this.#mac.open(header, body) : null;
    if (payload === null) return this.fail(authError("bad control frame from decode"));
    let message: ControlMessage;
    try {
      message = decodeControl(payload);
    } catch (error) {
      return this.fail(error as Error);
    }
    this.handlers.control?.(message);
  }

  /** @internal Closes the connection because of `error`. */
  fail(error: Error): undefined {
    this.#closedError ??= error;
    this.#socket.destroy();
  }

  async writePages(lease: WriteLease, writes: readonly PageWrite[]): Promise<void> {
    this.#assertOpen();
    const socket = this.#socket;
    // This call's own header: it waits for the socket below, and meanwhile other transfers write
    // through the same writer (a shared header once sent their (rid, epoch) on this call's pages).
    const h: FrameHeader = {
      type: FrameType.PAGE,
      rid: lease.rid,
      epoch: lease.epoch,
      page: 0,
      generation: 0,
      index: 0,
      tokens: 0,
      length: 0,
    };
    for (const w of writes) {
      const dest = lease.pages[w.index];
      if (dest === undefined) {
        throw new KvfenceError(
          "internal",
          `Page index outside the lease of ${lease.pages.length} pages: ${w.index}`,
        );
      }
      h.page = dest.page;
      h.generation = dest.generation;
      h.index = w.index;
      h.tokens = w.filledTokens;
      h.length = w.bytes.length;
      this.#cork();
      socket.write(frameHeaderBytes(h));
      socket.write(w.bytes);
      this.#corked += FRAME_HEADER_BYTES + w.bytes.length;
      this.metrics.bytesTransferred += w.bytes.length;
      this.metrics.pagesTransferred++;
      this.#clock.add(lease.rid, lease.epoch, w.bytes.length);
      if (this.#corked >= this.#batchBytes) await this.#flush();
    }
    this.#scheduleFlush();
  }

  async endLease(lease: WriteLease, pageCount: number): Promise<void> {
    this.#assertOpen();
    this.#cork();
    this.#socket.write(
      this.#mac.frame(FrameType.LEASE_END, lease.rid, lease.epoch, pageCount, new Uint8Array(0)),
    );
    await this.#flush();
    this.#clock.end(lease.rid, lease.epoch, this.metrics);
  }

  async sendControl(message: ControlMessage): Promise<void> {
    this.#assertOpen();
    this.#cork();
    this.#socket.write(this.#mac.frame(FrameType.CONTROL, 0, 0, 0, encodeControl(message)));
    await this.#flush();
  }

  /** Flushes what is queued, ends the connection and resolves when the socket closed. */
  async close(): Promise<void> {
    if (this.#closed || this.#socket.destroyed) return;
    if (this.#corked > 0) {
      this.#corked = 0;
      this.#socket.uncork();
    }
    await new Promise<void>((resolve) => {
      this.#socket.once("close", () => resolve());
      this.#socket.end();
    });
  }

  #assertOpen(): void {
    if (this.#closed || this.#socket.destroyed) {
      throw new KvfenceError(
        "transfer_failed",
        `TCP transfer connection to decode is closed: ${this.#closedError?.message ?? "closed"}`,
      );
    }
  }

  #cork(): void {
    if (this.#corked === 0) this.#socket.cork();
    if (this.#corked === 0) this.#corked = 1;
  }

  #scheduleFlush(): void {
    if (this.#flushScheduled || this.#corked === 0) return;
    this.#flushScheduled = true;
    setImmediate(() => {
      this.#flushScheduled = false;
      void this.#flush().catch(() => {});
    });
  }

  /** Sends everything corked as one writev; waits while more than 4 batches are queued. */
  async #flush(): Promise<void> {
    const socket = this.#socket;
    if (this.#corked > 0) {
      this.#corked = 0;
      socket.uncork();
    }
    while (socket.writableLength > 4 * this.#batchBytes && !socket.destroyed) {
      await new Promise<void>((resolve) => {
        const done = (): void => {
          socket.off("drain", done);
          socket.off("close", done);
          resolve();
        };
        socket.once("drain", done);
        socket.once("close", done);
      });
    }
    this.#assertOpen();
  }
}

export interface TcpReceiverOptions {
  readonly host?: string;
  readonly port: number;
  readonly secret: string | Uint8Array;
  readonly layoutSignature: string;
  /** Mutual TLS (docs/tls.md); plain TCP without. */
  readonly tls?: LinkTls;
  /** The decode pool's data (page p at byte `p * pageBytes`). */
  readonly pool: ArrayBufferView;
  readonly table: OwnershipTable;
  readonly pageBytes: number;
  readonly handlers: TransferHandlers;
  readonly metrics?: TransferMetrics;
  /** This decode node's incarnation, sent in the HELLO (`TcpTransferWriter.peerIncarnation`). */
  readonly incarnation?: number;
  /** Refuse a prefill node of another incarnation than this one (a reconnect to the same node). */
  readonly peerIncarnation?: number;
  /**
   * Apply a page write only if its page is RESERVED for its `(rid, epoch)` at its generation (the
   * `lease-check` guard). Default true; false keeps only the bounds check (fault demonstrations).
   */
  readonly leaseCheck?: boolean;
  /**
   * With the lease check: decode's page for logical page `index` of `(rid, epoch)`, or -1
   * (`leasedPage` of the decode machine). A write to any other page is dropped as misaddressed, even
   * one RESERVED for the same request (its tail pages for generated tokens are).
   */
  readonly leasedPage?: (rid: number, epoch: number, index: number) => number;
  /** Size of the reused receive buffer. Default 1 MiB. */
  readonly receiveBufferBytes?: number;
  /**
   * Pages of at least this many bytes are read from the socket straight into the pool (no copy
   * through the receive buffer). Default 64 KiB; `Infinity` turns direct reads off.
   */
  readonly directReadMinBytes?: number;
}

/** Connects decode to a prefill `TcpTransferServer`; resolves once the handshake succeeded. */
export function connectTcpReceiver(options: TcpReceiverOptions): Promise<TcpTransferReceiver> {
  const secret = clusterSecretBytes(options.secret);
  return new Promise((resolve, reject) => {
    const receiver = new TcpTransferReceiver(options, secret, resolve, reject);
    void receiver;
  });
}

/** The decode end of a TCP connection: applies page writes into the pool after the lease check. */
export class TcpTransferReceiver {
  readonly metrics: TransferMetrics;
  readonly #socket: net.Socket;
  readonly #mac: MacChannel;
  readonly #decoder: FrameDecoder;
  /** The pool as a range (it may pass 4 GiB, more than one Uint8Array holds): a view per page. */
  readonly #pool: ByteRange;
  readonly #table: OwnershipTable;
  readonly #leaseCheck: boolean;
  readonly #leasedPage: ((rid: number, epoch: number, index: number) => number) | undefined;
  readonly #pageBytes: number;
  readonly #handlers: TransferHandlers;
  readonly #clock = new TransferClock();
  readonly #nonce = randomBytes(NONCE_BYTES);
  readonly #secret: Buffer;
  readonly #layoutSignature: string;
  readonly #peerIncarnation: number | undefined;
  /** The address dialled, as `linkAddress` writes it: prefill's challenge must name it. */
  readonly #dialled: string;
  /** The HELLO payload sent (the handshake transcript's first message). */
  #hello: Buffer = Buffer.alloc(0);
  #ready = false;
  #error: Error | null = null;
  #resolve: ((r: TcpTransferReceiver) => void) | null;
  #reject: ((e: Error) => void) | null;

  /** @internal Use `connectTcpReceiver`. */
  constructor(
    options: TcpReceiverOptions,
    secret: Buffer,
    resolve: (r: TcpTransferReceiver) => void,
    reject: (e: Error) => void,
  ) {
    this.#resolve = resolve;
    this.#reject = reject;
    this.#secret = secret;
    this.#layoutSignature = options.layoutSignature;
    this.#peerIncarnation = options.peerIncarnation;
    this.#dialled = linkAddress(options.host ?? "127.0.0.1", options.port);
    this.#pool = options.pool;
    this.#table = options.table;
    this.#leaseCheck = options.leaseCheck ?? true;
    this.#leasedPage = options.leasedPage;
    this.#pageBytes = options.pageBytes;
    this.#handlers = options.handlers;
    this.metrics = options.metrics ?? new TransferMetrics();
    this.#mac = new MacChannel(secret);
    const maxPageBytes = Math.max(options.pageBytes, 0);
    this.#decoder = new FrameDecoder(this.#sink, { maxPageBytes, maxControlBytes: MAX_CONTROL_BYTES });
    const staging = Buffer.allocUnsafe(options.receiveBufferBytes ?? 1 << 20);
    const exactReads = options.pageBytes >= (options.directReadMinBytes ?? 64 * 1024);
    let direct = false;
    const { socket, ready } = connectLink(options.tls, {
      host: options.host ?? "127.0.0.1",
      port: options.port,
      noDelay: true,
      onread: {
        // Called before every read: a page body in progress is read straight into its pool page;
        // with large pages, headers and control bodies are read exactly, so no read spills into
        // the next page body and every page byte crosses user space once, from the kernel.
        buffer: () => {
          const target = exactReads ? this.#decoder.directTarget() : null;
          direct = target !== null;
          if (target !== null) return target;
          return exactReads
            ? staging.subarray(0, Math.min(this.#decoder.pending(), staging.length))
            : staging;
        },
        callback: (n: number, buf: Uint8Array) => {
          try {
            if (direct) this.#decoder.advanceDirect(n);
            else this.#decoder.push(buf.subarray(0, n));
          } catch (error) {
            // A throwing handler leaves the stream position unknown: close the connection.
            this.#fail(error as Error);
          }
          return true;
        },
      },
    });
    this.#socket = socket;
    this.#socket.on(ready, () => {
      this.#hello = encodeControl({
        v: HANDSHAKE_VERSION,
        layoutSignature: options.layoutSignature,
        nonce: this.#nonce.toString("hex"),
        ...(options.incarnation === undefined ? {} : { incarnation: options.incarnation }),
        dialled: this.#dialled,
      });
      this.#socket.write(this.#mac.frame(FrameType.HELLO, 0, 0, 0, this.#hello, HELLO_CONTEXT));
    });
    this.#socket.on("error", (error) => this.#fail(error));
    this.#socket.on("close", () => {
      if (!this.#ready) {
        this.#reject?.(
          this.#error ??
            new KvfenceError(
              "transfer_failed",
              "Prefill closed the transfer connection during the handshake: closed",
            ),
        );
        this.#resolve = this.#reject = null;
      } else this.#handlers.closed?.(this.#error ?? undefined);
    });
  }

  /** Sends a control message (e.g. an abort) to prefill. */
  sendControl(message: ControlMessage): void {
    if (!this.#ready || this.#socket.destroyed) {
      throw new KvfenceError("transfer_failed", "TCP transfer connection to prefill is closed: closed");
    }
    this.#socket.write(this.#mac.frame(FrameType.CONTROL, 0, 0, 0, encodeControl(message)));
  }

  /** Closes the connection; resolves when the socket closed. */
  close(): Promise<void> {
    return new Promise((resolve) => {
      if (this.#socket.destroyed) return resolve();
      this.#socket.once("close", () => resolve());
      this.#socket.destroy();
    });
  }

  #fail(error: Error): undefined {
    this.#error ??= error;
    this.#socket.destroy();
  }

  #drop(header: FrameHeader, reason: "stale" | "misaddressed"): Uint8Array {
    if (reason === "stale") this.metrics.droppedStaleWrites++;
    else this.metrics.droppedMisaddressedWrites++;
    this.#handlers.writeDropped?.(header.rid, header.epoch, header.page, reason);
    return DROP_BODY;
  }

  readonly #sink: FrameSink = {
    onHeader: (h) => {
      if (h.type !== FrameType.PAGE) return undefined;
      if (!this.#ready) {
        this.#fail(new KvfenceError("transfer_failed", "Prefill sent a page before the handshake: PAGE"));
        return DROP_BODY;
      }
      if (h.page >= this.#table.numPages || h.length !== this.#pageBytes)
        return this.#drop(h, "misaddressed");
      if (this.#leaseCheck && !this.#table.checkWrite(h.page, h.generation, h.rid, h.epoch)) {
        return this.#drop(h, "stale");
      }
      if (
        this.#leaseCheck &&
        this.#leasedPage !== undefined &&
        this.#leasedPage(h.rid, h.epoch, h.index) !== h.page
      )
        return this.#drop(h, "misaddressed");
      return byteView(this.#pool, h.page * this.#pageBytes, this.#pageBytes);
    },
    onFrame: (h, body) => {
      if (h.type === FrameType.PAGE) {
        if (body === DROP_BODY) return;
        // The page may have left RESERVED while its body streamed in (an abort in between).
        if (this.#leaseCheck && !this.#table.checkWrite(h.page, h.generation, h.rid, h.epoch)) {
          this.#drop(h, "stale");
          return;
        }
        this.#table.stampWriter(h.page, h.rid, h.epoch, h.tokens);
        this.metrics.bytesTransferred += h.length;
        this.metrics.pagesTransferred++;
        this.#clock.add(h.rid, h.epoch, h.length);
        this.#handlers.pagesLanded?.(h.rid, h.epoch, h.index, h.index + 1);
        return;
      }
      if (!this.#ready) return this.#onHandshake(h, body);
      const payload =
        h.type === FrameType.CONTROL || h.type === FrameType.LEASE_END || h.type === FrameType.REFUSE
          ? this.#mac.open(h, body)
          : null;
      if (payload === null) return this.#fail(authError("bad control frame from prefill"));
      if (h.type === FrameType.REFUSE) return this.#refused(payload);
      if (h.type === FrameType.LEASE_END) {
        this.#clock.end(h.rid, h.epoch, this.metrics);
        this.#handlers.leaseLanded?.(h.rid, h.epoch, h.tokens);
        return;
      }
      let message: ControlMessage;
      try {
        message = decodeControl(payload);
      } catch (error) {
        return this.#fail(error as Error);
      }
      this.#handlers.control?.(message);
    },
    onError: (error) => this.#fail(error),
  };

  #onHandshake(h: FrameHeader, body: Uint8Array): undefined {
    if (h.type === FrameType.REFUSE) {
      const payload = this.#mac.open(h, body, HELLO_CONTEXT);
      if (payload === null) return this.#fail(authError("bad handshake from prefill"));
      return this.#refused(payload);
    }
    if (h.type !== FrameType.HELLO || body.length < MAC_BYTES) {
      return this.#fail(authError("bad handshake from prefill"));
    }
    // The challenge is MACed under the session keys, which depend on its nonce: read it first.
    const hello = parseHello(body.subarray(0, body.length - MAC_BYTES));
    if (hello === null || hello.peerNonce !== this.#nonce.toString("hex")) {
      return this.#fail(authError("bad challenge from prefill"));
    }
    const keys = sessionKeys(this.#secret, this.#nonce, Buffer.from(hello.nonce, "hex"));
    this.#mac.sendKey = keys.clientToServer;
    this.#mac.recvKey = keys.serverToClient;
    const challenge = this.#mac.open(h, body, transcript(CHALLENGE, this.#hello));
    if (challenge === null) return this.#fail(authError("bad challenge MAC from prefill"));
    const mismatch = advertisedMismatch(hello.advertised, this.#dialled);
    if (mismatch !== null) return this.#fail(authError(mismatch));
    if (hello.layoutSignature !== this.#layoutSignature) {
      return this.#fail(layoutMismatch(this.#layoutSignature, hello.layoutSignature));
    }
    if (this.#peerIncarnation !== undefined && hello.incarnation !== this.#peerIncarnation) {
      return this.#fail(
        new KvfenceError(
          "node_unavailable",
          `The prefill node at this address is another incarnation than the one to reconnect to: ${hello.incarnation} instead of ${this.#peerIncarnation}`,
        ),
      );
    }
    const proof = transcript(PROOF, this.#hello, Buffer.from(challenge));
    this.#socket.write(this.#mac.frame(FrameType.PROOF, 0, 0, 0, new Uint8Array(0), proof));
    this.#ready = true;
    this.#resolve?.(this);
    this.#resolve = this.#reject = null;
  }

  /** Prefill refused the connection (REFUSE): fail with its reason. */
  #refused(payload: Uint8Array): undefined {
    let refusal: Record<string, unknown> = {};
    try {
      refusal = decodeJsonObject(payload);
    } catch {}
    const code = refusal.code === "layout_mismatch" ? "layout_mismatch" : "transfer_failed";
    return this.#fail(
      new KvfenceError(code, `Prefill refused the transfer connection: ${String(refusal.message)}`),
    );
  }
}
