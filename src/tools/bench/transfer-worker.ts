/**
 * Worker threads of `src/tools/bench/transfer.ts`. Role "prefill": owns the source pages (a private,
 * pre-faulted buffer) and every sender (shared-memory writer, TCP transfer server, raw socket
 * server). Role "decode": the shared-memory receiver, verifying checksums as pages land.
 * Checksums use the serving path's own code (`PageChecksums`, as `src/node/prefill-node.ts` and
 * `decode-node.ts` do): prefill records each page when it is "produced" (stamped, as the engine's
 * step stamps it) and reads the records when it builds the manifest; decode records each page in
 * `pagesLanded` and reads the records at the commit check.
 * Every timestamp is `process.hrtime.bigint()`, one monotonic clock for all threads of the process.
 */
import net from "node:net";
import { type MessagePort, parentPort, workerData } from "node:worker_threads";
import { OwnershipTable } from "../../kvcache/ownership-table.js";
import { checksumLeasePages, PageChecksums, pageChecksumHex } from "../../transfer/page-checksum.js";
import { type ShmChannel, ShmTransferReceiver, ShmTransferWriter } from "../../transfer/shm-transport.js";
import { SignalKind, SignalRing } from "../../transfer/signal-ring.js";
import { TcpTransferServer, type TcpTransferWriter } from "../../transfer/tcp-transport.js";
import { loadLinkTls, type TlsFiles } from "../../transfer/tls-config.js";
import type { Manifest, PageWrite, TransferLease, TransferWriter } from "../../transfer/transport.js";
import { type TransferReservation, verifyManifest } from "../../transfer/verify-manifest.js";

/**
 * "none": no checksums; "production": the serving path — prefill hashes at production (before the
 * transfer) and reads the records into the manifest, decode hashes as pages land and reads the
 * records at commit; "ondemand": the same calls with nothing recorded, so both ends hash every page
 * in series with the transfer (the serving path before checksums moved off it).
 */
export type HashMode = "none" | "production" | "ondemand";

export interface WorkerInit {
  readonly role: "prefill" | "decode";
  readonly channel: ShmChannel;
  readonly port: MessagePort;
  readonly sourcePages: number;
  readonly secret: string;
  readonly signalBytes: number;
  /** Pages per `writePages` call (one prefill chunk). */
  readonly chunkPages: number;
  /** Landed ranges of the TCP receiver (main thread) that the decode worker verifies. */
  readonly verifyRing: SharedArrayBuffer;
  /** With the tcp+tls path: the certificates of its TLS transfer server. */
  readonly tlsFiles?: TlsFiles;
}

const init = workerData as WorkerInit;
const parent = parentPort!;
const pageBytes = init.channel.pageBytes;
const now = (): bigint => process.hrtime.bigint();

/** The manifest prefill sends; `checksums` empty when the run skips them. */
export function manifestFor(lease: TransferLease, checksums: readonly string[]): Manifest {
  return {
    type: "manifest",
    rid: lease.rid,
    epoch: lease.epoch,
    tokenStart: 0,
    tokenEnd: lease.pages.length * lease.pageSize,
    firstToken: 0,
    checksums,
  };
}

function fillPseudoRandom(bytes: Uint8Array, seed: number): void {
  const words = new Uint32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength >>> 2);
  let x = seed >>> 0 || 1;
  for (let i = 0; i < words.length; i++) {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    words[i] = x;
  }
}

if (init.role === "prefill") {
  const source = new Uint8Array(init.sourcePages * pageBytes);
  fillPseudoRandom(source, 12345);
  const page = (i: number): Uint8Array => source.subarray(i * pageBytes, (i + 1) * pageBytes);
  // The prefill pool's ownership table: source page i holds logical page i of the lease.
  const sourceTable = new OwnershipTable(init.sourcePages);
  const sourceSums = new PageChecksums(source, pageBytes, sourceTable);
  const shm = new ShmTransferWriter(init.channel, {
    port: init.port,
    layoutSignature: init.channel.layoutSignature,
    signalBytes: init.signalBytes,
  });
  let tcp: TcpTransferWriter | null = null;
  const tcpReady = new Promise<void>((resolve) => {
    void TcpTransferServer.listen({
      secret: init.secret,
      layoutSignature: init.channel.layoutSignature,
      onWriter: (w) => {
        tcp = w;
        resolve();
      },
    }).then((server) => parent.postMessage({ type: "tcp-port", port: server.port }));
  });
  // The same transport over mutual TLS (the tcp+tls path).
  let tls: TcpTransferWriter | null = null;
  const tlsReady = new Promise<void>((resolve) => {
    if (init.tlsFiles === undefined) return;
    void TcpTransferServer.listen({
      secret: init.secret,
      layoutSignature: init.channel.layoutSignature,
      tls: loadLinkTls(init.tlsFiles),
      onWriter: (w) => {
        tls = w;
        resolve();
      },
    }).then((server) => parent.postMessage({ type: "tls-port", port: server.port }));
  });
  let raw: net.Socket | null = null;
  const rawServer = net.createServer({ noDelay: true }, (socket) => {
    raw = socket;
    parent.postMessage({ type: "raw-connected" });
  });
  rawServer.listen(0, "127.0.0.1", () =>
    parent.postMessage({ type: "raw-port", port: (rawServer.address() as net.AddressInfo).port }),
  );

  const send = async (writer: TransferWriter, lease: TransferLease, hash: HashMode): Promise<bigint> => {
    const n = lease.pages.length;
    // Production: the engine's step writes and stamps each source page; the prefill node then
    // records its checksum (`PrefillNode`'s after-step hook), all before the transfer starts.
    for (let i = 0; i < n; i++) sourceTable.stampWriter(i, lease.rid, lease.epoch, lease.pageSize);
    if (hash === "production") for (let i = 0; i < n; i++) sourceSums.record(i, lease.rid, lease.epoch, i);
    const t0 = now();
    // The manifest's checksums, read as the prefill machine reads them at `computed` (before the
    // writes): recorded values, or hashed now when nothing was recorded.
    const checksums: string[] = new Array<string>(hash === "none" ? 0 : n);
    const misses = sourceSums.misses;
    if (hash !== "none")
      for (let i = 0; i < n; i++) checksums[i] = sourceSums.get(i, lease.rid, lease.epoch, i);
    if (hash === "production" && sourceSums.misses !== misses)
      throw new Error(
        `Prefill hashed ${sourceSums.misses - misses} pages again instead of reading the records`,
      );
    // Pages go out one `writePages` per prefill chunk.
    for (let from = 0; from < n; from += init.chunkPages) {
      const writes: PageWrite[] = [];
      for (let i = from; i < Math.min(n, from + init.chunkPages); i++) {
        writes.push({ index: i, bytes: page(i), filledTokens: lease.pageSize });
      }
      await writer.writePages(lease, writes);
    }
    await writer.endLease(lease, n);
    await writer.sendControl(manifestFor(lease, checksums));
    return t0;
  };

  const sendRaw = async (bytes: number): Promise<bigint> => {
    const socket = raw!;
    const chunk = 1 << 20;
    const t0 = now();
    for (let off = 0; off < bytes; off += chunk) {
      const end = Math.min(bytes, off + chunk);
      if (!socket.write(source.subarray(off, end))) await new Promise((r) => socket.once("drain", r));
    }
    return t0;
  };

  parent.on(
    "message",
    async (msg: { cmd: string; id: number; lease: TransferLease; hash: HashMode; bytes: number }) => {
      if (msg.cmd === "shm")
        parent.postMessage({ type: "t0", id: msg.id, t0: await send(shm, msg.lease, msg.hash) });
      else if (msg.cmd === "tcp") {
        await tcpReady;
        parent.postMessage({ type: "t0", id: msg.id, t0: await send(tcp!, msg.lease, msg.hash) });
      } else if (msg.cmd === "tls") {
        await tlsReady;
        parent.postMessage({ type: "t0", id: msg.id, t0: await send(tls!, msg.lease, msg.hash) });
      } else if (msg.cmd === "raw")
        parent.postMessage({ type: "t0", id: msg.id, t0: await sendRaw(msg.bytes) });
      else if (msg.cmd === "hash") {
        // Checksum throughput of the sender's own pages (what "pre" moves out of the transfer).
        const t0 = now();
        for (let i = 0; i < msg.bytes; i++) pageChecksumHex(page(i), 1, 1, i);
        parent.postMessage({ type: "hash", id: msg.id, ns: Number(now() - t0) });
      } else if (msg.cmd === "close") {
        await shm.close();
        await (tcp as TcpTransferWriter | null)?.close();
        await (tls as TcpTransferWriter | null)?.close();
        (raw as net.Socket | null)?.destroy();
        rawServer.close();
        process.exit(0);
      }
    },
  );
} else {
  const pool = new Uint8Array(
    init.channel.poolBuffer,
    init.channel.poolByteOffset,
    init.channel.numPages * pageBytes,
  );
  let current: { id: number; lease: TransferLease; hash: HashMode } | null = null;
  const table = new OwnershipTable(init.channel.numPages, {
    buffer: init.channel.tableBuffer,
    byteOffset: init.channel.tableByteOffset,
    attach: true,
  });
  const sums = new PageChecksums(pool, pageBytes, table);
  const receiver = new ShmTransferReceiver(init.channel, {
    port: init.port,
    handlers: {
      pagesLanded: (_rid, _epoch, from, to) => {
        if (current?.hash === "production") sums.recordLease(current.lease, from, to);
      },
      control: (message) => {
        const run = current;
        if (run === null || message.type !== "manifest") return;
        const manifest = message as Manifest;
        let verdict = "ok";
        if (run.hash !== "none") {
          const lease = run.lease;
          const reservation: TransferReservation = {
            rid: lease.rid,
            epoch: lease.epoch,
            tokenStart: 0,
            tokenEnd: lease.pages.length * lease.pageSize,
            numPages: lease.pages.length,
          };
          // The commit check reads `KvPool.pageChecksum`, i.e. `PageChecksums.get`, per page.
          const misses = sums.misses;
          const local = lease.pages.map(({ page }, i) => sums.get(page, lease.rid, lease.epoch, i));
          verdict = verifyManifest(reservation, manifest, local).code;
          if (run.hash === "production" && sums.misses !== misses)
            verdict = `${sums.misses - misses} pages hashed at commit, not as they landed`;
        }
        const t1 = now();
        current = null;
        parent.postMessage({ type: "t1", id: run.id, t1, verdict });
      },
    },
  });
  // TCP verify on this thread: the main-thread receiver pushes each landed range into a ring.
  const verifyRing = new SignalRing(init.verifyRing);
  let tcpVerify: { id: number; lease: TransferLease; local: string[] } | null = null;
  const onVerifyRecord = (kind: number, _rid: number, _epoch: number, a: number, b: number): void => {
    const run = tcpVerify;
    if (run === null) return;
    if (kind === SignalKind.LANDED) checksumLeasePages(run.local, pool, pageBytes, run.lease, a, b);
    else if (kind === SignalKind.LEASE_END) {
      tcpVerify = null;
      parent.postMessage({ type: "verified", id: run.id, local: run.local });
    }
  };
  void (async () => {
    while (!verifyRing.closed) {
      verifyRing.drain(onVerifyRecord);
      await verifyRing.waitForRecords();
    }
  })();
  parent.on("message", (msg: { cmd: string; id: number; lease: TransferLease; hash: HashMode }) => {
    if (msg.cmd === "expect-tcp") {
      tcpVerify = { id: msg.id, lease: msg.lease, local: new Array<string>(msg.lease.pages.length) };
      parent.postMessage({ type: "expecting", id: msg.id });
    } else if (msg.cmd === "expect") {
      current = { id: msg.id, lease: msg.lease, hash: msg.hash };
      parent.postMessage({ type: "expecting", id: msg.id });
    } else if (msg.cmd === "close") {
      receiver.close();
      verifyRing.close();
      process.exit(0);
    }
  });
  parent.postMessage({ type: "decode-ready" });
}
