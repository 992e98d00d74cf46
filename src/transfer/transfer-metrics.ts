/**
 * Counters of one transport endpoint, plain numbers the node glue exports (in its stats, which the
 * router reads at each scrape of /metrics: src/cluster/cluster-metrics.ts). Updating them is a
 * field increment; nothing allocates.
 */
export class TransferMetrics {
  /** Page bytes written (writer) or applied (receiver). */
  bytesTransferred = 0;
  pagesTransferred = 0;
  /** Leases ended (writer) or landed (receiver). */
  transfers = 0;
  /** Sum of per-transfer seconds, first page to lease end, for the mean. */
  transferSeconds = 0;
  /** GB/s (10^9 B/s) of the most recent transfer, first page to lease end. */
  lastTransferGbps = 0;
  checksumFailures = 0;
  coverageFailures = 0;
  /** Page writes dropped because the page was not RESERVED for that (rid, epoch, generation). */
  droppedStaleWrites = 0;
  /** Page writes dropped because the page was out of bounds or the body had the wrong size. */
  droppedMisaddressedWrites = 0;

  /** Records one finished transfer of `bytes` in `seconds`. */
  recordTransfer(bytes: number, seconds: number): void {
    this.transfers++;
    this.transferSeconds += seconds;
    this.lastTransferGbps = seconds > 0 ? bytes / seconds / 1e9 : 0;
  }

  /** Records the outcome of `verifyManifest` by its code. */
  recordVerdict(code: string): void {
    if (code === "checksum_mismatch") this.checksumFailures++;
    else if (code === "coverage_mismatch" || code === "stale_manifest") this.coverageFailures++;
  }

  snapshot(): Record<string, number> {
    return {
      bytesTransferred: this.bytesTransferred,
      pagesTransferred: this.pagesTransferred,
      transfers: this.transfers,
      transferSeconds: this.transferSeconds,
      lastTransferGbps: this.lastTransferGbps,
      checksumFailures: this.checksumFailures,
      coverageFailures: this.coverageFailures,
      droppedStaleWrites: this.droppedStaleWrites,
      droppedMisaddressedWrites: this.droppedMisaddressedWrites,
    };
  }
}

/** Per-lease timing and byte count of the transfer in flight for each rid, for `recordTransfer`. */
export class TransferClock {
  readonly #byRid = new Map<number, { epoch: number; startNs: bigint; bytes: number }>();

  /** Adds `bytes` to the transfer of `(rid, epoch)`, starting its clock on the first call. */
  add(rid: number, epoch: number, bytes: number): void {
    const entry = this.#byRid.get(rid);
    if (entry === undefined || entry.epoch !== epoch) {
      this.#byRid.set(rid, { epoch, startNs: process.hrtime.bigint(), bytes });
    } else entry.bytes += bytes;
  }

  /** Ends the transfer of `(rid, epoch)` into `metrics`; a no-op when nothing was added. */
  end(rid: number, epoch: number, metrics: TransferMetrics): void {
    const entry = this.#byRid.get(rid);
    if (entry === undefined || entry.epoch !== epoch) return;
    this.#byRid.delete(rid);
    metrics.recordTransfer(entry.bytes, Number(process.hrtime.bigint() - entry.startNs) / 1e9);
  }
}
