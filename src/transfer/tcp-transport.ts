/**
 * The TCP transport (processes, hosts). Prefill listens (`TcpTransferServer`, like SGLang's
 * bootstrap server on prefill); each decode node connects (`connectTcpReceiver`) and reads into one
 * reused buffer (`onread`, docs/benchmarks.md §3.4: the default `'data'` receiver allocates per chunk).
 *
 * Handshake: decode sends HELLO `{layoutSignature, nonce}`, prefill answers HELLO
 * `{layoutSignature, nonce, peerNonce}` or REFUSE `{code, message}` and closes; both are MACed
 * with the cluster secret, and either side refuses a different layout signature (docs/prior-art.md H8).
 * After it, control frames (CONTROL, LEASE_END) carry an HMAC-SHA256 under per-direction session
 * keys and a sequence number (see control-auth.ts); page bodies do not (the manifest checksums
 * cover them).
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
import { KvfenceError } from "../lib/errors.js";
import { clusterSecretBytes, hmac, MAC_BYTES, sessionKeys, verifyHmac } from "./control-auth.js";
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
import { layoutMismatch } from "./shm-transport.js";
import { connectLink, createLinkServer, type LinkTls } from "./tls-config.js";
import { TransferClock, TransferMetrics } from "./transfer-metrics.js";
import type { ControlMessage, PageWrite, TransferHandlers, TransferWriter, WriteLease } from "./transport.js";

const HELLO_CONTEXT = Buffer.from("kvfence hello");
const NONCE_BYTES = 16;
const MAX_CONTROL_BYTES = 1 << 20;

interface HelloPayload {
  readonly layoutSignature: string;
  readonly nonce: string;
  readonly peerNonce?: string;
  /** Decode's incarnation (boot count), so prefill knows which leases it may write. */
  readonly incarnation?: number;
}

/** @internal MACs and sequence numbers of the control frames of one connection (exported for tests). */
export class MacChannel {
  sendKey: Buffer;
  recvKey: Buffer;
  #sendSeq = 0;
  #recvSeq = 0;

  constructor(key: Buffer) {
    this.sendKey = key;
    this.recvKey = key;
  }

  /** Header + payload + MAC of a control-type frame, as one buffer. */
  frame(
    type: FrameType,
    rid: number,
    epoch: number,
    tokens: number,
    payload: Uint8Array,
    prefix?: Buffer,
  ): Buffer {
    const header: FrameHeader = {
      type,
      rid,
      epoch,
      page: 0,
      generation: 0,
      index: this.#sendSeq++ >>> 0,
      tokens,
      length: payload.length + MAC_BYTES,
    };
    const headerBytes = frameHeaderBytes(header);
    const mac =
      prefix === undefined
        ? hmac(this.sendKey, headerBytes, payload)
        : hmac(this.sendKey, prefix, headerBytes, payload);
    return Buffer.concat([headerBytes, payload, mac]);
  }

  /** The payload of a MACed frame, or null when the MAC or the sequence number is wrong. */
  open(header: FrameHeader, body: Uint8Array, prefix?: Buffer): Uint8Array | null {
    if (body.length < MAC_BYTES || header.index !== this.#recvSeq >>> 0) return null;
    const headerBytes = frameHeaderBytes(header);
    const payload = body.subarray(0, body.length - MAC_BYTES);
    const mac = body.subarray(body.length - MAC_BYTES);
    const ok =
      prefix === undefined
        ? verifyHmac(this.recvKey, mac, headerBytes, payload)
        : verifyHmac(this.recvKey, mac, prefix, headerBytes, payload);
    if (!ok) return null;
    this.#recvSeq++;
    return payload;
  }
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
  /** Mutual TLS (docs/tls.md); plain TCP without. A failed TLS handshake goes to `onError`. */
  readonly tls?: LinkTls;
}

/** The prefill side: accepts decode connections and hands out one `TcpTransferWriter` each. */
export class TcpTransferServer {
  readonly #server: net.Server;
  readonly #writers = new Set<TcpTransferWriter>();
  readonly #sockets = new Set<net.Socket>();

  private constructor(server: net.Server) {
    this.#server = server;
  }

  static async listen(options: TcpServerOptions): Promise<TcpTransferServer> {
    const secret = clusterSecretBytes(options.secret);
    const server = createLinkServer({ tls: options.tls, onRefused: options.onError }, (socket) =>
      self.#accept(socket, secret, options),
    );
    const self = new TcpTransferServer(server);
    await new Promise<void>((resolve, reject) => {
      server.once("error", reject);
      server.listen(options.port ?? 0, options.host ?? "127.0.0.1", () => {
        server.off("error", reject);
        resolve();
      });
    });
    return self;
  }

  get port(): number {
    return (this.#server.address() as net.AddressInfo).port;
  }

  /** Stops listening and closes every connection. */
  async close(): Promise<void> {
    for (const socket of this.#sockets) socket.destroy();
    await new Promise<void>((resolve) => this.#server.close(() => resolve()));
  }

  #accept(socket: net.Socket, secret: Buffer, options: TcpServerOptions): void {
    this.#sockets.add(socket);
    socket.on("close", () => this.#sockets.delete(socket));
    const mac = new MacChannel(secret);
    let writer: TcpTransferWriter | null = null;
    let failed = false;
    const fail = (error: KvfenceError, refuse: boolean): void => {
      if (failed) return;
      failed = true;
      if (refuse && !socket.destroyed) {
        const payload = encodeControl({ code: error.code, message: error.message });
        socket.end(mac.frame(FrameType.REFUSE, 0, 0, 0, payload, HELLO_CONTEXT));
      } else socket.destroy();
      options.onError?.(error);
    };
    const sink: FrameSink = {
      onHeader: () => undefined,
      onFrame: (header, body) => {
        if (writer !== null) return writer.onFrame(header, body);
        if (failed) return;
        if (header.type !== FrameType.HELLO) return fail(authError("expected HELLO first"), true);
        const payload = mac.open(header, body, HELLO_CONTEXT);
        const hello = payload === null ? null : parseHello(payload);
        if (hello === null) return fail(authError("bad HELLO from decode"), true);
        if (hello.layoutSignature !== options.layoutSignature) {
          return fail(layoutMismatch(options.layoutSignature, hello.layoutSignature), true);
        }
        const nonce = randomBytes(NONCE_BYTES);
        const reply: HelloPayload = {
          layoutSignature: options.layoutSignature,
          nonce: nonce.toString("hex"),
          peerNonce: hello.nonce,
        };
        socket.write(mac.frame(FrameType.HELLO, 0, 0, 0, encodeControl({ ...reply }), HELLO_CONTEXT));
        const keys = sessionKeys(secret, Buffer.from(hello.nonce, "hex"), nonce);
        mac.sendKey = keys.serverToClient;
        mac.recvKey = keys.clientToServer;
        writer = new TcpTransferWriter(socket, mac, options.batchBytes ?? 1 << 20, hello.incarnation);
        this.#writers.add(writer);
        socket.on("close", () => writer !== null && this.#writers.delete(writer));
        options.onWriter(writer);
      },
      onError: (error) => (writer !== null ? writer.fail(error) : fail(error, false)),
    };
    const decoder = new FrameDecoder(sink, { maxPageBytes: 0, maxControlBytes: MAX_CONTROL_BYTES });
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
  readonly #pool: Uint8Array;
  readonly #table: OwnershipTable;
  readonly #leaseCheck: boolean;
  readonly #leasedPage: ((rid: number, epoch: number, index: number) => number) | undefined;
  readonly #pageBytes: number;
  readonly #handlers: TransferHandlers;
  readonly #clock = new TransferClock();
  readonly #nonce = randomBytes(NONCE_BYTES);
  readonly #secret: Buffer;
  readonly #layoutSignature: string;
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
    this.#pool = new Uint8Array(options.pool.buffer, options.pool.byteOffset, options.pool.byteLength);
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
      const hello = encodeControl({
        layoutSignature: options.layoutSignature,
        nonce: this.#nonce.toString("hex"),
        ...(options.incarnation === undefined ? {} : { incarnation: options.incarnation }),
      });
      this.#socket.write(this.#mac.frame(FrameType.HELLO, 0, 0, 0, hello, HELLO_CONTEXT));
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
      const start = h.page * this.#pageBytes;
      return this.#pool.subarray(start, start + this.#pageBytes);
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
        h.type === FrameType.CONTROL || h.type === FrameType.LEASE_END ? this.#mac.open(h, body) : null;
      if (payload === null) return this.#fail(authError("bad control frame from prefill"));
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
    const payload =
      h.type === FrameType.HELLO || h.type === FrameType.REFUSE
        ? this.#mac.open(h, body, HELLO_CONTEXT)
        : null;
    if (payload === null) return this.#fail(authError("bad handshake from prefill"));
    if (h.type === FrameType.REFUSE) {
      let refusal: Record<string, unknown> = {};
      try {
        refusal = decodeJsonObject(payload);
      } catch {}
      const code = refusal.code === "layout_mismatch" ? "layout_mismatch" : "transfer_failed";
      return this.#fail(
        new KvfenceError(code, `Prefill refused the transfer connection: ${String(refusal.message)}`),
      );
    }
    const hello = parseHello(payload);
    if (hello === null || hello.peerNonce !== this.#nonce.toString("hex")) {
      return this.#fail(authError("bad HELLO from prefill"));
    }
    if (hello.layoutSignature !== this.#layoutSignature) {
      return this.#fail(layoutMismatch(this.#layoutSignature, hello.layoutSignature));
    }
    const keys = sessionKeys(this.#secret, this.#nonce, Buffer.from(hello.nonce, "hex"));
    this.#mac.sendKey = keys.clientToServer;
    this.#mac.recvKey = keys.serverToClient;
    this.#ready = true;
    this.#resolve?.(this);
    this.#resolve = this.#reject = null;
  }
}
