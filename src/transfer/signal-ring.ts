/**
 * A single-producer single-consumer ring of fixed 5-word records in a SharedArrayBuffer: the
 * completion signals of the shared-memory transport. The producer writes a record and publishes it
 * with one `Atomics.store` of the tail (release), then `Atomics.notify`; the consumer reads the
 * tail with `Atomics.load` (acquire), so every page byte and writer stamp stored before a record is
 * visible once the record is. The consumer sleeps in `Atomics.waitAsync`, so neither side blocks
 * its event loop; a full ring makes the producer wait (asynchronously) for the consumer.
 *
 * Buffer: Int32 words [head, tail, closed, 0] then `capacity` records of
 * [kind, rid, epoch, a, b]. Head and tail count records and wrap as int32.
 */
import { KvfenceError } from "../lib/errors.js";

const HEAD = 0;
const TAIL = 1;
const CLOSED = 2;
const HEADER_WORDS = 4;
export const RECORD_WORDS = 5;

/** `Atomics.waitAsync` (ES2024; in Node 20, missing from the ES2023 lib typings). */
const waitAsync = (
  Atomics as unknown as {
    waitAsync(
      array: Int32Array,
      index: number,
      value: number,
    ): { async: false; value: string } | { async: true; value: Promise<string> };
  }
).waitAsync;

export const SignalKind = {
  /** Pages `[a, b)` of `(rid, epoch)` landed. */
  LANDED: 1,
  /** The lease `(rid, epoch)` ended after `a` pages. */
  LEASE_END: 2,
} as const;
export type SignalKind = (typeof SignalKind)[keyof typeof SignalKind];

export class SignalRing {
  readonly #words: Int32Array;
  readonly #mask: number;
  readonly capacity: number;

  /** Bytes of a ring buffer for `capacity` records (a power of two). */
  static bytesFor(capacity: number): number {
    return (HEADER_WORDS + capacity * RECORD_WORDS) * 4;
  }

  /** A fresh shared buffer for a ring of `capacity` records (a power of two, default 1024). */
  static createBuffer(capacity = 1024): SharedArrayBuffer {
    if (!Number.isInteger(capacity) || capacity < 2 || (capacity & (capacity - 1)) !== 0) {
      throw new KvfenceError(
        "config_invalid",
        `Signal ring capacity must be a power of two ≥ 2: ${capacity}`,
      );
    }
    return new SharedArrayBuffer(SignalRing.bytesFor(capacity));
  }

  constructor(buffer: SharedArrayBuffer) {
    this.#words = new Int32Array(buffer);
    this.capacity = (this.#words.length - HEADER_WORDS) / RECORD_WORDS;
    this.#mask = this.capacity - 1;
  }

  get closed(): boolean {
    return Atomics.load(this.#words, CLOSED) !== 0;
  }

  /** Marks the ring closed and wakes both sides. */
  close(): void {
    Atomics.store(this.#words, CLOSED, 1);
    Atomics.notify(this.#words, TAIL);
    Atomics.notify(this.#words, HEAD);
  }

  /** Producer: appends a record; false when the ring is full (wait with `waitForSpace`). */
  tryPush(kind: SignalKind, rid: number, epoch: number, a: number, b: number): boolean {
    const w = this.#words;
    const tail = w[TAIL]!;
    if (((tail - Atomics.load(w, HEAD)) | 0) >= this.capacity) return false;
    const at = HEADER_WORDS + (tail & this.#mask) * RECORD_WORDS;
    w[at] = kind;
    w[at + 1] = rid | 0;
    w[at + 2] = epoch | 0;
    w[at + 3] = a;
    w[at + 4] = b;
    Atomics.store(w, TAIL, (tail + 1) | 0);
    Atomics.notify(w, TAIL);
    return true;
  }

  /** Producer: resolves when the consumer has made room (or the ring closed). */
  async waitForSpace(): Promise<void> {
    const w = this.#words;
    for (;;) {
      const head = Atomics.load(w, HEAD);
      if (((w[TAIL]! - head) | 0) < this.capacity || this.closed) return;
      const r = waitAsync(w, HEAD, head);
      if (r.async) await r.value;
    }
  }

  /**
   * Consumer: calls `onRecord` for every published record, in order, and frees their slots.
   * Returns the number of records read. rid and epoch come back as u32.
   */
  drain(onRecord: (kind: number, rid: number, epoch: number, a: number, b: number) => void): number {
    const w = this.#words;
    let head = w[HEAD]!;
    const tail = Atomics.load(w, TAIL);
    let n = 0;
    while (head !== tail) {
      const at = HEADER_WORDS + (head & this.#mask) * RECORD_WORDS;
      onRecord(w[at]!, w[at + 1]! >>> 0, w[at + 2]! >>> 0, w[at + 3]!, w[at + 4]!);
      head = (head + 1) | 0;
      n++;
    }
    if (n > 0) {
      Atomics.store(w, HEAD, head);
      Atomics.notify(w, HEAD);
    }
    return n;
  }

  /** Consumer: resolves when a record may be available after `drain` found none (or on close). */
  async waitForRecords(): Promise<void> {
    const w = this.#words;
    const tail = Atomics.load(w, TAIL);
    if (tail !== w[HEAD]! || this.closed) return;
    const r = waitAsync(w, TAIL, tail);
    if (r.async) await r.value;
  }
}
