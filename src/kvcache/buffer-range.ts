/**
 * The check both structures laid over a caller's buffer make before they take their bytes of it:
 * the ownership table (ownership-table.ts) and the pool's KV data (page-pool.ts). A wrong offset or
 * a buffer too small is a configuration error that names the structure and the function that sizes it.
 */
import { KvfenceError } from "../lib/errors.js";

/** Where a structure of `numPages` pages wants its `bytes` in a buffer, and what sizes it. */
export interface BufferRange {
  readonly numPages: number;
  readonly bytes: number;
  readonly byteOffset: number;
  readonly buffer: ArrayBuffer | SharedArrayBuffer;
  /** The static method that gives `bytes`, named in the error (e.g. `PagePool.dataBytesFor`). */
  readonly sizedBy: string;
}

/** Throws `config_invalid` unless the offset is a non-negative multiple of 4 and the bytes fit; `what` names the structure. */
export function checkBufferRange(what: string, range: BufferRange): void {
  const { numPages, bytes, byteOffset, buffer } = range;
  if (!Number.isInteger(byteOffset) || byteOffset < 0 || byteOffset % 4 !== 0) {
    throw new KvfenceError(
      "config_invalid",
      `${what} byte offset must be a non-negative multiple of 4: ${byteOffset}`,
    );
  }
  if (byteOffset + bytes > buffer.byteLength) {
    throw new KvfenceError(
      "config_invalid",
      `${what} of ${numPages} pages needs ${bytes} bytes at offset ${byteOffset}, buffer has: ${buffer.byteLength}; size it with ${range.sizedBy}()`,
    );
  }
}
