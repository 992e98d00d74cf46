/**
 * A node's KV pool in the model checker: the node's real `OwnershipTable` (the machines lease,
 * stamp and free through it exactly as on a server) beside the pages' ghost contents.
 *
 * Page contents are abstracted exactly as far as the invariants need: each page holds the
 * `(rid, epoch, logical index, corrupt)` of the data last written into it (the "ghost" content),
 * beside the ownership table's writer stamp — 4 numbers per page, rid -1 for never written. The
 * checksum of a page is the pair of its content and the key it is computed under, exactly the
 * equality a keyed xxhash64 gives.
 *
 * One `GhostPool` per role serves every world: `load` puts a world's table words and contents in
 * it before a machine steps, `save` copies the words back after.
 */
import { OwnershipTable } from "../../kvcache/ownership-table.js";
import type { KvPool, ReadingAttempt } from "../../protocol/effects.js";

/** Numbers of ghost content per page: rid, epoch, logical index, corrupt. */
export const GHOST_WORDS = 4;

export class GhostPool implements KvPool {
  readonly table: OwnershipTable;
  readonly pageSize: number;
  /** The table's 32-bit words, over its own bytes. */
  readonly words: Uint32Array;
  /** The loaded world's ghost contents of this pool (the world's array itself, not a copy). */
  content: number[] = [];
  /** Called on each read check of the decode engine's step (decode's pool only). */
  onRead: ((attempt: ReadingAttempt, count: number, fresh: number) => void) | null = null;

  constructor(numPages: number, pageSize: number) {
    this.table = new OwnershipTable(numPages);
    this.pageSize = pageSize;
    const bytes = this.table.bytes;
    this.words = new Uint32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
  }

  observeRead(attempt: ReadingAttempt, count: number, fresh: number): void {
    this.onRead?.(attempt, count, fresh);
  }

  pageChecksum(page: number, rid: number, epoch: number, index: number): string {
    const c = this.content;
    const at = page * GHOST_WORDS;
    return `${c[at]},${c[at + 1]},${c[at + 2]},${c[at + 3]}@${rid},${epoch},${index}`;
  }

  /** Makes a world's table words and ghost contents this pool's. */
  load(words: readonly number[], content: number[]): void {
    this.words.set(words);
    this.content = content;
  }

  /** Copies the table's words back into a world's. */
  save(words: number[]): void {
    const from = this.words;
    for (let i = 0; i < from.length; i++) words[i] = from[i]!;
  }

  /** The page counts of a world's table, read by the real table (its layout is its own). */
  countsOf(words: readonly number[]) {
    this.words.set(words);
    return this.table.counts();
  }
}

/** Records that `page` now holds page `index` of attempt `(rid, epoch)`'s own, uncorrupted KV. */
export function writeGhost(content: number[], page: number, rid: number, epoch: number, index: number): void {
  const at = page * GHOST_WORDS;
  content[at] = rid;
  content[at + 1] = epoch;
  content[at + 2] = index;
  content[at + 3] = 0;
}

/** Copies the ghost content of page `fromPage` of `from` to page `toPage` of `to`. */
export function copyGhost(to: number[], toPage: number, from: readonly number[], fromPage: number): void {
  const dst = toPage * GHOST_WORDS;
  const src = fromPage * GHOST_WORDS;
  for (let k = 0; k < GHOST_WORDS; k++) to[dst + k] = from[src + k]!;
}
