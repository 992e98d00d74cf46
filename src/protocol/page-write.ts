/**
 * Where a page write lands (docs/design.md §4 step 4). Over shared memory the writer copies the page
 * straight into the decode pool — a one-sided write, like RDMA: nothing on the receiver can refuse
 * it, only the region bounds apply — and stamps the writer stamp in the same step. Over TCP the
 * receiver applies a framed write only if the destination page is the one decode leased for that
 * write's logical index, and is still RESERVED for that write's `(rid, epoch)` at that generation
 * (the `lease-check` guard); otherwise it drops it.
 *
 * Checking the ownership table alone is not enough: the pages decode reserved for its own
 * generated tokens are RESERVED for the same `(rid, epoch)` too, so a write misaddressed into one
 * of them would pass (`kvfence check --fault misaddressed-write --keep-guards --transport tcp`
 * found this). The receiver asks the decode machine for the leased page (`leasedPage`).
 */
import type { OwnershipTable } from "../kvcache/ownership-table.js";
import { guardOn, type Safety } from "./safety.js";
import type { PageWriteHeader } from "./wire.js";

export type TransportKind = "shm" | "tcp";

/** Where a write arrives: a decode incarnation's pool, over a transport, under a node's guards. */
export interface LandingSite {
  readonly incarnation: number;
  /** Decode's page for the write's `(rid, epoch, index)`, or -1 (see `leasedPage`). */
  readonly leasedPage: number;
  readonly transport: TransportKind;
  readonly safety: Safety;
}

/**
 * True when the write described by `header` lands in the pool of decode incarnation
 * `site.incarnation` (the host then copies and stamps). A write aimed at another incarnation's pool
 * never lands here: over TCP it travelled on that incarnation's (closed) connection, over shared
 * memory it went into that incarnation's buffer.
 */
export function writeLands(table: OwnershipTable, header: PageWriteHeader, site: LandingSite): boolean {
  const { leasedPage, transport, safety } = site;
  if (header.incarnation !== site.incarnation) return false;
  if (header.page < 0 || header.page >= table.numPages) return false;
  if (transport === "shm" || !guardOn(safety, "lease-check")) return true;
  return (
    leasedPage === header.page && table.checkWrite(header.page, header.generation, header.rid, header.epoch)
  );
}

/** Stamps the page a write just landed in: its data is now `(rid, epoch)`'s. */
export function stampLandedWrite(table: OwnershipTable, header: PageWriteHeader): void {
  table.stampWriter(header.page, header.rid, header.epoch, header.filledTokens);
}
