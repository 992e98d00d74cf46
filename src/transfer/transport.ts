/**
 * The one transport interface of the transfer engine, implemented by the shared-memory transport
 * (worker threads, one-sided writes into the decode pool's SharedArrayBuffer) and the TCP transport
 * (processes, framed writes that the receiver applies after a lease check).
 *
 * Prefill holds a `TransferWriter`: it writes pages of a lease as their KV is produced, ends the
 * lease, and sends control messages (the manifest, ABORT_ACK) that arrive after every write sent
 * before them. Decode supplies `TransferHandlers`: it learns which pages landed (batched ranges,
 * in order), when a lease's writes all landed, which writes were dropped, and receives control
 * messages. Both sides are plain callbacks and promises, so the node glue wires them to the
 * protocol state machines without knowing which transport runs underneath.
 *
 * The lease and manifest types are local until `src/protocol/wire.ts` exists; they carry exactly the
 * fields of DESIGN.md §4 (lease: rid, epoch, (page, generation) pairs, pageSize, layout signature;
 * manifest: coverage, first token, one checksum per page).
 */

/** One destination page of a lease. */
export interface LeasePage {
  readonly page: number;
  readonly generation: number;
}

/** A transfer lease as decode grants it (DESIGN.md §4 step 2). */
export interface TransferLease {
  readonly rid: number;
  readonly epoch: number;
  /** Destination pages in logical order: entry i receives tokens [i*pageSize, (i+1)*pageSize). */
  readonly pages: readonly LeasePage[];
  readonly pageSize: number;
  readonly layoutSignature: string;
}

/** The completion manifest prefill sends after the last page (DESIGN.md §4 step 5). */
export interface TransferManifest {
  readonly rid: number;
  readonly epoch: number;
  /** Token coverage `[tokenStart, tokenEnd)` that the written pages hold. */
  readonly tokenStart: number;
  readonly tokenEnd: number;
  readonly firstToken: number;
  /** `pageChecksum` of each written page, by logical page index. */
  readonly checksums: readonly bigint[];
}

/** One page for `TransferWriter.writePages`: logical index in the lease, its bytes, tokens filled. */
export interface PageWrite {
  readonly index: number;
  readonly bytes: Uint8Array;
  readonly filledTokens: number;
}

/**
 * A control message: any JSON-like value (bigint allowed). The protocol's wire messages travel as
 * these; the TCP transport MACs them, the shared-memory transport posts them on a MessagePort.
 */
export type ControlMessage = { readonly [key: string]: unknown };

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
  writePages(lease: TransferLease, writes: readonly PageWrite[]): Promise<void>;
  /** Signals that `pageCount` pages of the lease were written (the decode side's `leaseLanded`). */
  endLease(lease: TransferLease, pageCount: number): Promise<void>;
  /** Sends a control message ordered after every write before it. */
  sendControl(message: ControlMessage): Promise<void>;
  close(): Promise<void>;
}
