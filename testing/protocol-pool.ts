/**
 * A `KvPool` for protocol unit tests: a real `OwnershipTable` plus an abstract page content per
 * page (whose data it holds), with checksums that are equal exactly when content and key are.
 */
import { OwnershipTable } from "../src/kvcache/ownership-table.js";
import type { KvPool } from "../src/protocol/effects.js";

export class TestPool implements KvPool {
  readonly table: OwnershipTable;
  readonly pageSize: number;
  /** Content of each page: `"rid:epoch:index"` of the data it holds, or "" when never written. */
  readonly content: string[];

  constructor(numPages: number, pageSize = 1) {
    this.table = new OwnershipTable(numPages);
    this.pageSize = pageSize;
    this.content = new Array<string>(numPages).fill("");
  }

  pageChecksum(page: number, rid: number, epoch: number, index: number): string {
    return `${this.content[page]}@${rid}:${epoch}:${index}`;
  }

  /** Writes `(rid, epoch)`'s page `index` into `page` and stamps it, as a writer does. */
  write(page: number, rid: number, epoch: number, index: number, filledTokens = 1): void {
    this.content[page] = `${rid}:${epoch}:${index}`;
    this.table.stampWriter(page, rid, epoch, filledTokens);
  }

  /** The checksum prefill would put in its manifest for page `index` of `(rid, epoch)`. */
  static expectedChecksum(rid: number, epoch: number, index: number): string {
    return `${rid}:${epoch}:${index}@${rid}:${epoch}:${index}`;
  }
}
