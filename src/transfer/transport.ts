/**
 * The one transport interface of the transfer engine, implemented by the shared-memory transport
 * (worker threads, one-sided writes into the decode pool's SharedArrayBuffer) and the TCP transport
 * (processes, framed writes that the receiver applies after a lease check).
 *
 * Prefill holds a `TransferWriter`: it writes pages of a lease as their KV is produced, ends the
 * lease, and sends control messages (the manifest, ABORT_ACK) that arrive after every write sent
 * before them — so an ABORT_ACK sent once the last `writePages` resolved means every write of that
 * attempt has landed or been dropped on decode (over shared memory a resolved `writePages` has
 * already landed; over TCP decode applies frames in stream order). Decode supplies `TransferHandlers`: it learns which pages landed (batched ranges,
 * in order), when a lease's writes all landed, which writes were dropped, and receives control
 * messages. Both sides are plain callbacks and promises, so the node glue wires them to the
 * protocol state machines without knowing which transport runs underneath.
 *
 * Leases, manifests and control messages are the protocol's wire types (`src/protocol/wire.ts`); the
 * TCP transport MACs control messages, the shared-memory transport posts them on a MessagePort.
 *
 * Wiring (the node glue):
 * - shared memory: decode calls `createShmChannel({pool, table, pageBytes, layoutSignature})` and
 *   `new MessageChannel()`, keeps `new ShmTransferReceiver(channel, {port: port2, handlers})`, and
 *   posts `channel` + `port1` (transferList) to the prefill worker, which makes
 *   `new ShmTransferWriter(channel, {port: port1, layoutSignature})`;
 * - TCP: prefill runs `TcpTransferServer.listen({secret, layoutSignature, onWriter})`; decode runs
 *   `connectTcpReceiver({port, secret, layoutSignature, pool, table, pageBytes, handlers})`.
 * Decode feeds `pagesLanded` to `PageChecksums.record` (via `DecodeNode.pagesLanded`) and serves the
 * protocol's `KvPool.pageChecksum` from `PageChecksums.get`, so verification overlaps the transfer; a
 * closed channel (`closed`) is the fence of docs/design.md §3.
 */
import type { ControlMessage, TransferLease } from "../protocol/wire.js";

export type { ControlMessage, LeasePage, Manifest, TransferLease } from "../protocol/wire.js";

/** What a writer needs of a lease: its key and destination pages (in logical order). */
export type WriteLease = Pick<TransferLease, "rid" | "epoch" | "pages">;

/** One page for `TransferWriter.writePages`: logical index in the lease, its bytes, tokens filled. */
export interface PageWrite {
  readonly index: number;
  readonly bytes: Uint8Array;
  readonly filledTokens: number;
}

/** Why a receiver dropped a page write instead of applying it. */
export type DropReason = "stale" | "misaddressed";

/** What decode learns from a transport. Every callback runs on the receiver's event loop. */
export interface TransferHandlers {
  /** Pages with logical indices `[from, to)` of `(rid, epoch)` landed and carry their writer stamp. */
  pagesLanded?(rid: number, epoch: number, from: number, to: number): void;
  /** Prefill ended the lease after writing `pageCount` pages; every one of its writes has landed. */
  leaseLanded?(rid: number, epoch: number, pageCount: number): void;
  /** A write was dropped (page not RESERVED for that rid/epoch at that generation, or out of bounds). */
  writeDropped?(rid: number, epoch: number, page: number, reason: DropReason): void;
  /** A control message, delivered after every write sent before it. */
  control?(message: ControlMessage): void;
  /** The channel closed; `error` when it failed (peer gone, bad frame, bad MAC). */
  closed?(error?: Error): void;
}

/** The prefill side of a transport. */
export interface TransferWriter {
  readonly kind: "shm" | "tcp";
  /** Writes pages of `lease` into the decode pool; resolves when the transport accepted them. */
  writePages(lease: WriteLease, writes: readonly PageWrite[]): Promise<void>;
  /** Signals that `pageCount` pages of the lease were written (the decode side's `leaseLanded`). */
  endLease(lease: WriteLease, pageCount: number): Promise<void>;
  /** Sends a control message ordered after every write before it. */
  sendControl(message: ControlMessage): Promise<void>;
  close(): Promise<void>;
}
