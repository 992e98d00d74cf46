/**
 * A byte range of a buffer, as numbers: what one typed array cannot always be. A typed array holds
 * at most 2^32 elements on Node 20 (a Uint8Array at most 4 GiB), and V8's structured clone keeps
 * only the low 32 bits of a view's `byteOffset` (Node 20 and 24), so code over memory that may pass
 * 4 GiB — the native kernels' SharedArrayBuffer holding a 3B model's weights, a KV pool past 4 GiB —
 * keeps ranges and makes a view of the part it reads or writes (`byteView`). A Uint8Array is a
 * `ByteRange`.
 */

export interface ByteRange {
  readonly buffer: ArrayBufferLike;
  readonly byteOffset: number;
  readonly byteLength: number;
}

/** Bytes [offset, offset + length) of `range` as a Uint8Array (the caller keeps it inside the range). */
export function byteView(range: ByteRange, offset: number, length: number): Uint8Array {
  return new Uint8Array(range.buffer, range.byteOffset + offset, length);
}
