/**
 * The shared-memory transport (worker threads). Prefill writes each page straight into the decode
 * pool's SharedArrayBuffer — a one-sided write, as RDMA does — and stamps the writer stamp in the
 * shared ownership table right after the bytes, in the same step. Completion travels separately
 * through a `SignalRing`, batched: one LANDED record per ≥ `signalBytes` (1 MiB by default, so
 * about every second 720 KiB page; docs/benchmarks.md §3.4: signalling per 8 KiB page costs ~40% of the
 * bandwidth, 64 KiB is the floor) or per lease end, and a pending range is flushed before any
 * control message. A write call's pages stay pending until the batch fills, so call `endLease`.
 * Control messages (manifest, abort, ABORT_ACK) ride a `MessagePort`; the receiver drains the ring
 * before delivering each one, so a message never overtakes the writes sent before it.
 *
 * The writer never writes outside the pool (bounds are always checked). Like RDMA, and like the
 * protocol's model of it (`src/protocol/page-write.ts`), nothing else can refuse the write: the
 * guards are decode's quarantine, the manifest checksums and the page tags. `checkLease: true`
 * adds a writer-side look at decode's table that skips a page no longer RESERVED for the lease — a
 * courtesy with a race (decode may change the page right after the look), not a guard.
 * Pages of an aborted request stay QUARANTINED on decode until ABORT_ACK, which prefill sends only
 * after `writePages` returned, so no write can land in a page that was handed to someone else.
 */
import type { MessagePort } from "node:worker_threads";
import { OwnershipTable } from "../kvcache/ownership-table.js";
import { type ByteRange, byteView } from "../lib/byte-range.js";
import { KvfenceError } from "../lib/errors.js";
import { SignalKind, SignalRing } from "./signal-ring.js";
import { TransferClock, TransferMetrics } from "./transfer-metrics.js";
import type { ControlMessage, PageWrite, TransferHandlers, TransferWriter, WriteLease } from "./transport.js";

/** Everything both ends need; structured-cloneable, so it can be posted to a worker. */
export interface ShmChannel {
  readonly poolBuffer: SharedArrayBuffer;
  /** Byte offset of page 0 in `poolBuffer`. */
  readonly poolByteOffset: number;
  readonly numPages: number;
  readonly pageBytes: number;
  /** The decode pool's ownership table (`OwnershipTable` laid over this buffer at this offset). */
  readonly tableBuffer: SharedArrayBuffer;
  readonly tableByteOffset: number;
  readonly ringBuffer: SharedArrayBuffer;
  readonly layoutSignature: string;
}

export interface CreateShmChannelOptions {
  /** The decode pool's data, over a SharedArrayBuffer (e.g. the pool's Float32Array). */
  readonly pool: ArrayBufferView;
  readonly table: OwnershipTable;
  readonly pageBytes: number;
  readonly layoutSignature: string;
  /** Signal ring records (a power of two). Default 1024. */
  readonly ringCapacity?: number;
}

/** Decode builds the channel over its pool and table and hands it to the prefill thread. */
export function createShmChannel(options: CreateShmChannelOptions): ShmChannel {
  const { pool, table, pageBytes } = options;
  const poolBuffer = pool.buffer;
  const tableBuffer = table.bytes.buffer;
  if (!(poolBuffer instanceof SharedArrayBuffer) || !(tableBuffer instanceof SharedArrayBuffer)) {
    throw new KvfenceError(
      "config_invalid",
      "The shared-memory transport needs the pool and ownership table over a SharedArrayBuffer: got ArrayBuffer",
    );
  }
  if (pool.byteLength < table.numPages * pageBytes) {
    throw new KvfenceError(
      "config_invalid",
      `Pool of ${pool.byteLength} bytes is smaller than ${table.numPages} pages of ${pageBytes} bytes: ${pool.byteLength}`,
    );
  }
  return {
    poolBuffer,
    poolByteOffset: pool.byteOffset,
    numPages: table.numPages,
    pageBytes,
    tableBuffer,
    tableByteOffset: table.bytes.byteOffset,
    ringBuffer: SignalRing.createBuffer(options.ringCapacity ?? 1024),
    layoutSignature: options.layoutSignature,
  };
}

/** The pool as a range (it may pass 4 GiB, more than one Uint8Array holds): the writer makes a view per page. */
function poolRange(channel: ShmChannel): ByteRange {
  return {
    buffer: channel.poolBuffer,
    byteOffset: channel.poolByteOffset,
    byteLength: channel.numPages * channel.pageBytes,
  };
}

function attachTable(channel: ShmChannel): OwnershipTable {
  return new OwnershipTable(channel.numPages, {
    buffer: channel.tableBuffer,
    byteOffset: channel.tableByteOffset,
    attach: true,
  });
}

export interface ShmWriterOptions {
  /** Control messages to and from the receiver (the other end goes to `ShmTransferReceiver`). */
  readonly port: MessagePort;
  /** This node's layout signature; must equal the channel's. */
  readonly layoutSignature: string;
  /**
   * Also skip writes to pages not RESERVED for the writer's lease (see the module header). Default
   * false: a shared-memory write is one-sided, as in `src/protocol/page-write.ts`.
   */
  readonly checkLease?: boolean;
  /** Bytes written between two LANDED signals (≥ 64 KiB, docs/benchmarks.md §3.4). Default 1 MiB. */
  readonly signalBytes?: number;
  readonly metrics?: TransferMetrics;
  /** Control messages from decode (aborts); and `closed`. */
  readonly handlers?: Pick<TransferHandlers, "control" | "closed">;
}

/** The prefill end of a shared-memory channel. */
export class ShmTransferWriter implements TransferWriter {
  readonly kind = "shm";
  readonly metrics: TransferMetrics;
  readonly #pool: ByteRange;
  readonly #table: OwnershipTable;
  readonly #ring: SignalRing;
  readonly #port: MessagePort;
  readonly #pageBytes: number;
  readonly #checkLease: boolean;
  readonly #signalBytes: number;
  readonly #clock = new TransferClock();
  /** Landed range not yet signalled: `(rid, epoch)` pages `[from, to)` (from = -1: none). */
  #pendRid = 0;
  #pendEpoch = 0;
  #pendFrom = -1;
  #pendTo = -1;
  #ops: Promise<void> = Promise.resolve();
  #closed = false;

  constructor(channel: ShmChannel, options: ShmWriterOptions) {
    if (options.layoutSignature !== channel.layoutSignature) {
      throw layoutMismatch(options.layoutSignature, channel.layoutSignature);
    }
    this.#pool = poolRange(channel);
    this.#table = attachTable(channel);
    this.#ring = new SignalRing(channel.ringBuffer);
    this.#port = options.port;
    this.#pageBytes = channel.pageBytes;
    this.#checkLease = options.checkLease ?? false;
    this.#signalBytes = options.signalBytes ?? 1 << 20;
    this.metrics = options.metrics ?? new TransferMetrics();
    const handlers = options.handlers;
    this.#port.on("message", (message: ControlMessage) => handlers?.control?.(message));
    this.#port.on("close", () => handlers?.closed?.());
  }

  writePages(lease: WriteLease, writes: readonly PageWrite[]): Promise<void> {
    return this.#enqueue(() => this.#writePages(lease, writes));
  }

  endLease(lease: WriteLease, pageCount: number): Promise<void> {
    return this.#enqueue(async () => {
      await this.#flush();
      await this.#push(SignalKind.LEASE_END, lease.rid, lease.epoch, pageCount, 0);
      this.#clock.end(lease.rid, lease.epoch, this.metrics);
    });
  }

  sendControl(message: ControlMessage): Promise<void> {
    return this.#enqueue(async () => {
      await this.#flush();
      this.#port.postMessage(message);
    });
  }

  /** Closes the port and the ring; the receiver sees `closed`. */
  close(): Promise<void> {
    return this.#enqueue(async () => {
      if (this.#closed) return;
      await this.#flush();
      this.#closed = true;
      this.#ring.close();
      this.#port.close();
    });
  }

  #enqueue(op: () => Promise<void> | void): Promise<void> {
    const next = this.#ops.then(() => {
      if (this.#closed)
        throw new KvfenceError("transfer_failed", "Shared-memory transfer channel is closed: writer");
      return op();
    });
    this.#ops = next.catch(() => {});
    return next;
  }

  async #writePages(lease: WriteLease, writes: readonly PageWrite[]): Promise<void> {
    const pool = this.#pool;
    const table = this.#table;
    const pageBytes = this.#pageBytes;
    const { rid, epoch } = lease;
    for (const w of writes) {
      const dest = lease.pages[w.index];
      if (
        dest === undefined ||
        w.bytes.length !== pageBytes ||
        dest.page < 0 ||
        dest.page >= table.numPages
      ) {
        await this.#flush();
        this.metrics.droppedMisaddressedWrites++;
        continue;
      }
      if (this.#checkLease && !table.checkWrite(dest.page, dest.generation, rid, epoch)) {
        await this.#flush();
        this.metrics.droppedStaleWrites++;
        continue;
      }
      byteView(pool, dest.page * pageBytes, pageBytes).set(w.bytes);
      table.stampWriter(dest.page, rid, epoch, w.filledTokens);
      this.metrics.bytesTransferred += pageBytes;
      this.metrics.pagesTransferred++;
      this.#clock.add(rid, epoch, pageBytes);
      if (
        this.#pendFrom >= 0 &&
        (this.#pendRid !== rid || this.#pendEpoch !== epoch || this.#pendTo !== w.index)
      ) {
        await this.#flush();
      }
      if (this.#pendFrom < 0) {
        this.#pendRid = rid;
        this.#pendEpoch = epoch;
        this.#pendFrom = w.index;
      }
      this.#pendTo = w.index + 1;
      if ((this.#pendTo - this.#pendFrom) * pageBytes >= this.#signalBytes) await this.#flush();
    }
  }

  async #flush(): Promise<void> {
    if (this.#pendFrom < 0) return;
    const from = this.#pendFrom;
    this.#pendFrom = -1;
    await this.#push(SignalKind.LANDED, this.#pendRid, this.#pendEpoch, from, this.#pendTo);
  }

  async #push(kind: SignalKind, rid: number, epoch: number, a: number, b: number): Promise<void> {
    while (!this.#ring.tryPush(kind, rid, epoch, a, b)) {
      if (this.#ring.closed)
        throw new KvfenceError("transfer_failed", "Shared-memory transfer channel is closed: ring");
      await this.#ring.waitForSpace();
    }
  }
}

export interface ShmReceiverOptions {
  /** The other end of the writer's port. */
  readonly port: MessagePort;
  readonly handlers: TransferHandlers;
  readonly metrics?: TransferMetrics;
}

/** The decode end of a shared-memory channel: turns ring records and port messages into handlers. */
export class ShmTransferReceiver {
  readonly metrics: TransferMetrics;
  readonly #ring: SignalRing;
  readonly #port: MessagePort;
  readonly #handlers: TransferHandlers;
  readonly #pageBytes: number;
  readonly #clock = new TransferClock();
  readonly #onRecord = (kind: number, rid: number, epoch: number, a: number, b: number): void => {
    if (kind === SignalKind.LANDED) {
      const bytes = (b - a) * this.#pageBytes;
      this.metrics.bytesTransferred += bytes;
      this.metrics.pagesTransferred += b - a;
      this.#clock.add(rid, epoch, bytes);
      this.#handlers.pagesLanded?.(rid, epoch, a, b);
    } else if (kind === SignalKind.LEASE_END) {
      this.#clock.end(rid, epoch, this.metrics);
      this.#handlers.leaseLanded?.(rid, epoch, a);
    }
  };
  #closed = false;

  constructor(channel: ShmChannel, options: ShmReceiverOptions) {
    this.#ring = new SignalRing(channel.ringBuffer);
    this.#port = options.port;
    this.#handlers = options.handlers;
    this.#pageBytes = channel.pageBytes;
    this.metrics = options.metrics ?? new TransferMetrics();
    this.#port.on("message", (message: ControlMessage) => {
      this.poll();
      this.#handlers.control?.(message);
    });
    this.#port.on("close", () => this.#finish());
    void this.#loop();
  }

  /** Delivers every signal published so far; returns how many. The loop calls it on each wake. */
  poll(): number {
    return this.#ring.drain(this.#onRecord);
  }

  /** Sends a control message (e.g. an abort) to the writer. */
  sendControl(message: ControlMessage): void {
    this.#port.postMessage(message);
  }

  close(): void {
    this.#ring.close();
    this.#port.close();
    this.#finish();
  }

  #finish(): void {
    if (this.#closed) return;
    this.#closed = true;
    this.#ring.close();
    this.poll();
    this.#handlers.closed?.();
  }

  async #loop(): Promise<void> {
    while (!this.#closed && !this.#ring.closed) {
      this.poll();
      await this.#ring.waitForRecords();
    }
    this.poll();
  }
}

export function layoutMismatch(ours: string, theirs: string): KvfenceError {
  return new KvfenceError(
    "layout_mismatch",
    `KV layout of the peer differs from this node's ${JSON.stringify(ours)}; run both nodes with the same model, dtype and page size: ${JSON.stringify(theirs)}`,
  );
}
