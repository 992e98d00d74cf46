/**
 * Test worker: the prefill end of a shared-memory channel in its own thread. Writes every page of
 * the lease in `workerData` (contents from `sourcePage`), ends the lease and sends a manifest with
 * the page checksums.
 */
import { type MessagePort, workerData } from "node:worker_threads";
import { pageChecksumHex } from "../src/transfer/page-checksum.js";
import { type ShmChannel, ShmTransferWriter } from "../src/transfer/shm-transport.js";
import type { TransferLease } from "../src/transfer/transport.js";
import { sourcePage } from "./transfer-fixture.js";

const { channel, port, lease } = workerData as {
  channel: ShmChannel;
  port: MessagePort;
  lease: TransferLease;
};
const writer = new ShmTransferWriter(channel, { port, layoutSignature: channel.layoutSignature });
const checksums: string[] = [];
for (let i = 0; i < lease.pages.length; i++) {
  const bytes = sourcePage(channel.pageBytes, lease.rid, i);
  checksums.push(pageChecksumHex(bytes, lease.rid, lease.epoch, i));
  await writer.writePages(lease, [{ index: i, bytes, filledTokens: lease.pageSize }]);
}
await writer.endLease(lease, lease.pages.length);
const tokenEnd = lease.pages.length * lease.pageSize;
await writer.sendControl({
  type: "manifest",
  rid: lease.rid,
  epoch: lease.epoch,
  tokenStart: 0,
  tokenEnd,
  firstToken: 0,
  checksums,
});
await writer.close();
