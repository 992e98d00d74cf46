/**
 * Length-prefixed framing for the TCP transport.
 *
 * Every frame is a fixed 32-byte little-endian header followed by `length` body bytes:
 *
 *   0 u16 magic 0x4b56 ("KV")   2 u8 version   3 u8 type
 *   4 u32 rid    8 u32 epoch    12 u32 page    16 u32 generation
 *   20 u32 index (logical page index of a PAGE frame; the sequence number of a control frame)
 *   24 u32 tokens (filled tokens of a PAGE frame; page count of a LEASE_END frame)
 *   28 u32 length (body bytes)
 *
 * `FrameDecoder` turns any split of the byte stream into the same frames. It never allocates per
 * frame: a PAGE body is copied straight from the socket's receive buffer into the destination the
 * sink names when it sees the header (the KV pool page), or skipped when the sink drops it; other
 * bodies are staged in one reused buffer bounded by `maxControlBytes`. A bad magic, version, type
 * or an oversized length fails the stream once, cleanly: the decoder reports a `KvfenceError` and
 * ignores everything after it (the caller closes the connection).
 */
import { KvfenceError } from "../lib/errors.js";

export const FRAME_HEADER_BYTES = 32;
export const FRAME_MAGIC = 0x4b56;
export const FRAME_VERSION = 1;

export const FrameType = {
  /** Handshake: decode's hello, or prefill's challenge: JSON `{layoutSignature, nonce, …}` + HMAC. */
  HELLO: 1,
  /** Handshake refused: JSON `{code, message}` + HMAC; the sender closes after it. */
  REFUSE: 2,
  /** One KV page; the body is the page bytes (covered by the manifest checksums, not an HMAC). */
  PAGE: 3,
  /** Every page of `(rid, epoch)` was written; `tokens` holds the page count. Body: HMAC only. */
  LEASE_END: 4,
  /** A control message: JSON + HMAC. */
  CONTROL: 5,
  /** Handshake, decode's last message: empty body + HMAC under its session key (control-auth.ts). */
  PROOF: 6,
} as const;
export type FrameType = (typeof FrameType)[keyof typeof FrameType];

const MAX_TYPE = 6;

/** The decoded header fields. Decoders reuse one instance: copy what you keep. */
export interface FrameHeader {
  type: FrameType;
  rid: number;
  epoch: number;
  page: number;
  generation: number;
  index: number;
  tokens: number;
  length: number;
}

export function emptyFrameHeader(): FrameHeader {
  return { type: FrameType.PAGE, rid: 0, epoch: 0, page: 0, generation: 0, index: 0, tokens: 0, length: 0 };
}

/** Writes `header` as 32 bytes at `offset` of `out`. */
export function encodeFrameHeader(out: Uint8Array, offset: number, header: FrameHeader): void {
  const view = new DataView(out.buffer, out.byteOffset + offset, FRAME_HEADER_BYTES);
  view.setUint16(0, FRAME_MAGIC, true);
  view.setUint8(2, FRAME_VERSION);
  view.setUint8(3, header.type);
  view.setUint32(4, header.rid, true);
  view.setUint32(8, header.epoch, true);
  view.setUint32(12, header.page, true);
  view.setUint32(16, header.generation, true);
  view.setUint32(20, header.index, true);
  view.setUint32(24, header.tokens, true);
  view.setUint32(28, header.length, true);
}

/** A fresh 32-byte buffer holding `header`. */
export function frameHeaderBytes(header: FrameHeader): Buffer {
  const out = Buffer.allocUnsafe(FRAME_HEADER_BYTES);
  encodeFrameHeader(out, 0, header);
  return out;
}

/** Returned by `FrameSink.onHeader` to skip a body without copying it anywhere. */
export const DROP_BODY: Uint8Array = new Uint8Array(0);

export interface FrameSink {
  /**
   * A header arrived. For a PAGE frame return the destination of exactly `header.length` bytes
   * (the body is copied there as it arrives) or `DROP_BODY`. For other frames return `undefined`:
   * the body is staged and handed to `onFrame`.
   */
  onHeader(header: FrameHeader): Uint8Array | undefined;
  /** The whole body arrived: the destination from `onHeader`, or a staged view valid only now. */
  onFrame(header: FrameHeader, body: Uint8Array): void;
  /** The stream is malformed; called once, after which the decoder ignores all input. */
  onError(error: KvfenceError): void;
}

export interface FrameDecoderOptions {
  /** Largest PAGE body accepted. */
  readonly maxPageBytes: number;
  /**
   * Largest body of any other frame. Default 1 MiB. The staging buffer grows to it only as larger
   * bodies arrive; raise it with `setMaxControlBytes` (after a handshake).
   */
  readonly maxControlBytes?: number;
}

export class FrameDecoder {
  readonly #sink: FrameSink;
  readonly #maxPageBytes: number;
  #maxControlBytes: number;
  #staging: Uint8Array;
  readonly #headerBytes = new Uint8Array(FRAME_HEADER_BYTES);
  readonly #headerView = new DataView(this.#headerBytes.buffer);
  readonly #header: FrameHeader = emptyFrameHeader();
  #headerFill = 0;
  /** Body in progress: destination (null while reading a header), bytes received so far. */
  #body: Uint8Array | null = null;
  #bodyFill = 0;
  #skipping = false;
  #failed = false;

  constructor(sink: FrameSink, options: FrameDecoderOptions) {
    this.#sink = sink;
    this.#maxPageBytes = options.maxPageBytes;
    this.#maxControlBytes = options.maxControlBytes ?? 1 << 20;
    this.#staging = new Uint8Array(Math.min(this.#maxControlBytes, 4096));
  }

  /** Changes the largest non-PAGE body accepted from the next header on. */
  setMaxControlBytes(bytes: number): void {
    this.#maxControlBytes = bytes;
  }

  /** Bytes this decoder holds for staging (grows with the largest control body seen). */
  get stagingBytes(): number {
    return this.#staging.length;
  }

  get failed(): boolean {
    return this.#failed;
  }

  /** True between frames (no partial header or body buffered). */
  get idle(): boolean {
    return this.#headerFill === 0 && this.#body === null && !this.#skipping;
  }

  /**
   * While a PAGE body is streaming into its destination: the rest of that destination, so a
   * receiver can read from the socket straight into it (then `advanceDirect`). Otherwise null.
   */
  directTarget(): Uint8Array | null {
    return this.#body === null || this.#header.type !== FrameType.PAGE || this.#failed
      ? null
      : this.#body.subarray(this.#bodyFill);
  }

  /** Bytes still needed to finish the current header or body (≥ 1). */
  pending(): number {
    if (this.#body === null && !this.#skipping) return FRAME_HEADER_BYTES - this.#headerFill;
    return this.#header.length - this.#bodyFill;
  }

  /** `n` bytes of the current PAGE body were written straight into `directTarget()`. */
  advanceDirect(n: number): void {
    if (this.#body === null || n > this.#header.length - this.#bodyFill) {
      throw new KvfenceError("internal", `Direct read beyond the current page body: ${n} bytes`);
    }
    this.#bodyFill += n;
    if (this.#bodyFill === this.#header.length) this.#finishBody();
  }

  /** Feeds the next chunk of the stream; the chunk may be reused by the caller afterwards. */
  push(chunk: Uint8Array): void {
    let at = 0;
    const end = chunk.length;
    while (at < end && !this.#failed) {
      if (this.#body === null && !this.#skipping) {
        const take = Math.min(FRAME_HEADER_BYTES - this.#headerFill, end - at);
        this.#headerBytes.set(chunk.subarray(at, at + take), this.#headerFill);
        this.#headerFill += take;
        at += take;
        if (this.#headerFill === FRAME_HEADER_BYTES) {
          this.#headerFill = 0;
          this.#startBody();
        }
        continue;
      }
      const header = this.#header;
      const take = Math.min(header.length - this.#bodyFill, end - at);
      if (!this.#skipping) this.#body!.set(chunk.subarray(at, at + take), this.#bodyFill);
      this.#bodyFill += take;
      at += take;
      if (this.#bodyFill === header.length) this.#finishBody();
    }
  }

  #startBody(): undefined {
    const v = this.#headerView;
    const h = this.#header;
    const magic = v.getUint16(0, true);
    const version = v.getUint8(2);
    const type = v.getUint8(3);
    h.rid = v.getUint32(4, true);
    h.epoch = v.getUint32(8, true);
    h.page = v.getUint32(12, true);
    h.generation = v.getUint32(16, true);
    h.index = v.getUint32(20, true);
    h.tokens = v.getUint32(24, true);
    h.length = v.getUint32(28, true);
    if (magic !== FRAME_MAGIC) return this.#fail(`Bad frame magic: 0x${magic.toString(16)}`);
    if (version !== FRAME_VERSION) {
      return this.#fail(`Unsupported frame version: ${version}; run the same kvfence version on both nodes`);
    }
    if (type < 1 || type > MAX_TYPE) return this.#fail(`Unknown frame type: ${type}`);
    h.type = type as FrameType;
    const max = type === FrameType.PAGE ? this.#maxPageBytes : this.#maxControlBytes;
    if (h.length > max) return this.#fail(`Frame body longer than the limit of ${max} bytes: ${h.length}`);
    this.#bodyFill = 0;
    if (type === FrameType.PAGE) {
      const dest = this.#sink.onHeader(h);
      if (dest === undefined || dest === DROP_BODY) this.#skipping = true;
      else if (dest.length !== h.length) {
        return this.#fail(`Page destination of ${dest.length} bytes for a body of: ${h.length}`);
      } else this.#body = dest;
    } else {
      this.#sink.onHeader(h);
      if (h.length > this.#staging.length) {
        let size = Math.max(this.#staging.length * 2, 4096);
        while (size < h.length) size *= 2;
        this.#staging = new Uint8Array(Math.min(size, this.#maxControlBytes));
      }
      this.#body = this.#staging.subarray(0, h.length);
    }
    if (h.length === 0) this.#finishBody();
  }

  #finishBody(): void {
    const body = this.#skipping ? DROP_BODY : this.#body!;
    this.#body = null;
    this.#skipping = false;
    this.#bodyFill = 0;
    this.#sink.onFrame(this.#header, body);
  }

  #fail(message: string): undefined {
    this.#failed = true;
    this.#body = null;
    this.#skipping = false;
    this.#sink.onError(new KvfenceError("transfer_failed", message));
  }
}
