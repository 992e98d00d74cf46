/**
 * The rig of `kvfence bench transfer` (transfer.ts): the decode pool and its ownership table, the
 * prefill and decode workers (transfer-worker.ts), and the main thread's three receivers — the TCP
 * transport's decode end (verifying manifests inline or through the decode worker), the TLS one,
 * and a raw socket that only counts bytes. `run(path)` moves one lease over one path and returns
 * its nanoseconds, from prefill's first write to decode having processed the manifest.
 */
import net from "node:net";
import { MessageChannel, Worker } from "node:worker_threads";
import { type KvLayout, layoutSignature, pageBytes as pageBytesOf } from "../../kvcache/kv-layout.js";
import { OwnershipTable } from "../../kvcache/ownership-table.js";
import { PageChecksums } from "../../transfer/page-checksum.js";
import { createShmChannel } from "../../transfer/shm-transport.js";
import { SignalKind, SignalRing } from "../../transfer/signal-ring.js";
import { connectTcpReceiver, type TcpTransferReceiver } from "../../transfer/tcp-transport.js";
import { loadLinkTls, type TlsFiles } from "../../transfer/tls-config.js";
import type { ControlMessage, Manifest, TransferLease } from "../../transfer/transport.js";
import { verifyManifest } from "../../transfer/verify-manifest.js";
import type { HashMode, WorkerInit } from "./transfer-worker.js";

const SECRET = "bench-cluster-secret-not-for-production";

export const now = (): bigint => process.hrtime.bigint();

export interface RigOptions {
  readonly layout: KvLayout;
  readonly numPages: number;
  readonly signalBytes: number;
  readonly chunkPages: number;
  readonly directReads: boolean;
  /** The tcp+tls path's certificates, when that path runs. */
  readonly tlsFiles: TlsFiles | undefined;
}

/** Messages from a worker, awaited by `type` and run id. */
class Mailbox {
  readonly #waiting = new Map<
    string,
    { resolve: (msg: Record<string, unknown>) => void; reject: (e: Error) => void }
  >();
  readonly #early = new Map<string, Record<string, unknown>>();
  #dead: Error | null = null;

  constructor(worker: Worker, name: string) {
    worker.on("message", (msg: Record<string, unknown>) => {
      const key = `${String(msg.type)}:${String(msg.id ?? "")}`;
      const waiter = this.#waiting.get(key);
      if (waiter === undefined) this.#early.set(key, msg);
      else {
        this.#waiting.delete(key);
        waiter.resolve(msg);
      }
    });
    const die = (error: Error): void => {
      this.#dead ??= error;
      for (const waiter of this.#waiting.values()) waiter.reject(error);
      this.#waiting.clear();
    };
    worker.on("error", (e) => die(new Error(`The ${name} worker failed: ${e.message}`, { cause: e })));
    worker.on("exit", (code) => die(new Error(`The ${name} worker exited: code ${code}`)));
  }

  next(type: string, id: number | "" = ""): Promise<Record<string, unknown>> {
    const key = `${type}:${id}`;
    const early = this.#early.get(key);
    if (early !== undefined) {
      this.#early.delete(key);
      return Promise.resolve(early);
    }
    if (this.#dead !== null) return Promise.reject(this.#dead);
    return new Promise((resolve, reject) => this.#waiting.set(key, { resolve, reject }));
  }
}

/** The end of one transfer: when decode had processed the manifest, and its verdict. */
interface TransferEnd {
  readonly t1: bigint;
  readonly verdict: string;
}

/** A transfer under way: its end, once decode processed the manifest. */
interface Started {
  readonly end: Promise<TransferEnd>;
}

/** The TCP transfer in flight, as the main thread's receiver sees it. */
interface TcpRun {
  readonly lease: TransferLease;
  readonly hash: HashMode;
  /** Verify on the decode worker (landed ranges go through `verifyRing`) instead of inline. */
  readonly onWorker: (() => Promise<string[]>) | null;
  local: string[];
  readonly done: (t1: bigint, verdict: string) => void;
}

function hashOf(path: string): HashMode {
  return path.endsWith("+ondemand") ? "ondemand" : path.includes("+verify") ? "production" : "none";
}

export class TransferRig {
  readonly pageBytes: number;
  readonly bytes: number;
  /** Transfers that did not verify, and production hashes taken at commit instead of as pages landed. */
  readonly failures: string[] = [];
  /** The decode pool (pre-faulted), the memcpy source (pre-faulted, private). */
  readonly pool: Uint8Array;
  readonly #memcpySource: Uint8Array;
  readonly #options: RigOptions;
  readonly #signature: string;
  readonly #table: OwnershipTable;
  readonly #sums: PageChecksums;
  readonly #verifyRing: SignalRing;
  readonly #prefill: Worker;
  readonly #decode: Worker;
  readonly #exited: Promise<unknown>;
  readonly #pre: Mailbox;
  readonly #dec: Mailbox;
  #tcpReceiver: TcpTransferReceiver | null = null;
  #tlsReceiver: TcpTransferReceiver | null = null;
  #rawSocket: net.Socket | null = null;
  #tcpRun: TcpRun | null = null;
  #tlsRun: { done: (t1: bigint, verdict: string) => void } | null = null;
  #rawRun: { remaining: number; done: (t1: bigint) => void } | null = null;
  #rid = 1;
  #id = 0;

  /** The workers and the three receivers, connected. */
  static async start(options: RigOptions): Promise<TransferRig> {
    const rig = new TransferRig(options);
    await rig.#dec.next("decode-ready");
    const tcpPort = (await rig.#pre.next("tcp-port")).port as number;
    const rawPort = (await rig.#pre.next("raw-port")).port as number;
    rig.#tcpReceiver = await rig.#connectTcp(tcpPort);
    if (options.tlsFiles !== undefined) {
      const tlsPort = (await rig.#pre.next("tls-port")).port as number;
      rig.#tlsReceiver = await rig.#connectTls(tlsPort, options.tlsFiles);
    }
    const rawConnected = rig.#pre.next("raw-connected");
    rig.#rawSocket = rig.#connectRaw(rawPort);
    await rawConnected;
    return rig;
  }

  private constructor(options: RigOptions) {
    const { layout, numPages } = options;
    this.#options = options;
    this.pageBytes = pageBytesOf(layout);
    this.bytes = numPages * this.pageBytes;
    this.#signature = layoutSignature(layout, "SmolLM2-135M");
    this.#table = new OwnershipTable(numPages, {
      buffer: new SharedArrayBuffer(OwnershipTable.bytesFor(numPages)),
    });
    this.pool = new Uint8Array(new SharedArrayBuffer(this.bytes));
    this.pool.fill(1);
    this.#memcpySource = new Uint8Array(this.bytes);
    this.#memcpySource.fill(2);
    const channel = createShmChannel({
      pool: this.pool,
      table: this.#table,
      pageBytes: this.pageBytes,
      layoutSignature: this.#signature,
    });
    const { port1, port2 } = new MessageChannel();
    const workerUrl = new URL("./transfer-worker.js", import.meta.url);
    const verifyRingBuffer = SignalRing.createBuffer(Math.max(1024, 2 ** Math.ceil(Math.log2(numPages + 2))));
    this.#verifyRing = new SignalRing(verifyRingBuffer);
    this.#sums = new PageChecksums(this.pool, this.pageBytes, this.#table);
    const common = {
      channel,
      ...(options.tlsFiles === undefined ? {} : { tlsFiles: options.tlsFiles }),
      sourcePages: numPages,
      secret: SECRET,
      signalBytes: options.signalBytes,
      chunkPages: options.chunkPages,
      verifyRing: verifyRingBuffer,
    };
    this.#prefill = new Worker(workerUrl, {
      workerData: { ...common, role: "prefill", port: port1 } satisfies WorkerInit,
      transferList: [port1],
    });
    this.#decode = new Worker(workerUrl, {
      workerData: { ...common, role: "decode", port: port2 } satisfies WorkerInit,
      transferList: [port2],
    });
    this.#exited = Promise.all(
      [this.#prefill, this.#decode].map((w) => new Promise((r) => w.once("exit", r))),
    );
    this.#pre = new Mailbox(this.#prefill, "prefill");
    this.#dec = new Mailbox(this.#decode, "decode");
  }

  /** Moves one lease over `path`; its nanoseconds. */
  async run(path: string): Promise<number> {
    const runId = ++this.#id;
    if (path === "memcpy") {
      const t0 = now();
      this.pool.set(this.#memcpySource);
      return Number(now() - t0);
    }
    if (path === "raw-tcp") return this.#runRaw(runId);
    const lease = this.#lease();
    const hash = hashOf(path);
    let started: Started;
    if (path === "tcp+tls") started = this.#startTls(runId, lease, hash);
    else if (path.startsWith("shm")) started = await this.#startShm(runId, lease, hash);
    else started = await this.#startTcp(path, runId, { lease, hash });
    const t0 = (await this.#pre.next("t0", runId)).t0 as bigint;
    const end = await started.end;
    this.#release(lease);
    if (end.verdict !== "ok") this.failures.push(`${path}: manifest verdict ${end.verdict}`);
    return Number(end.t1 - t0);
  }

  async close(): Promise<void> {
    this.#prefill.postMessage({ cmd: "close" });
    this.#decode.postMessage({ cmd: "close" });
    await this.#tcpReceiver?.close();
    await this.#tlsReceiver?.close();
    this.#rawSocket?.destroy();
    await this.#exited;
  }

  async #runRaw(runId: number): Promise<number> {
    const t1 = new Promise<bigint>((done) => {
      this.#rawRun = { remaining: this.bytes, done };
    });
    this.#prefill.postMessage({ cmd: "raw", id: runId, bytes: this.bytes });
    const t0 = (await this.#pre.next("t0", runId)).t0 as bigint;
    return Number((await t1) - t0);
  }

  #startTls(runId: number, lease: TransferLease, hash: HashMode): Started {
    const end = new Promise<TransferEnd>((resolve) => {
      this.#tlsRun = { done: (t, verdict) => resolve({ t1: t, verdict }) };
    });
    this.#prefill.postMessage({ cmd: "tls", id: runId, lease, hash });
    return { end };
  }

  async #startShm(runId: number, lease: TransferLease, hash: HashMode): Promise<Started> {
    this.#decode.postMessage({ cmd: "expect", id: runId, lease, hash });
    await this.#dec.next("expecting", runId);
    const end = this.#dec
      .next("t1", runId)
      .then((m) => ({ t1: m.t1 as bigint, verdict: m.verdict as string }));
    this.#prefill.postMessage({ cmd: "shm", id: runId, lease, hash });
    return { end };
  }

  async #startTcp(
    path: string,
    runId: number,
    { lease, hash }: { lease: TransferLease; hash: HashMode },
  ): Promise<Started> {
    let onWorker: (() => Promise<string[]>) | null = null;
    if (path === "tcp+verify-worker") {
      this.#decode.postMessage({ cmd: "expect-tcp", id: runId, lease });
      await this.#dec.next("expecting", runId);
      onWorker = () => this.#dec.next("verified", runId).then((m) => m.local as string[]);
    }
    const end = new Promise<TransferEnd>((resolve) => {
      this.#tcpRun = {
        lease,
        onWorker,
        hash,
        local: new Array<string>(this.#options.numPages),
        done: (t, verdict) => resolve({ t1: t, verdict }),
      };
    });
    this.#prefill.postMessage({ cmd: "tcp", id: runId, lease, hash });
    return { end };
  }

  #lease(): TransferLease {
    const { numPages, layout } = this.#options;
    const pages = new Int32Array(numPages);
    const generations = new Uint32Array(numPages);
    if (!this.#table.allocate(numPages, this.#rid, 1, 0, pages, generations))
      throw new Error("Bench pool is not free");
    return {
      type: "lease",
      rid: this.#rid++,
      epoch: 1,
      incarnation: 0,
      pages: Array.from(pages, (page, i) => ({ page, generation: generations[i]! })),
      pageSize: layout.pageSize,
      layoutSignature: this.#signature,
    };
  }

  #release(lease: TransferLease): void {
    for (const p of lease.pages) this.#table.free(p.page, p.generation, lease.rid, lease.epoch);
  }

  #receiverOptions() {
    return {
      secret: SECRET,
      layoutSignature: this.#signature,
      pool: this.pool,
      table: this.#table,
      pageBytes: this.pageBytes,
      directReadMinBytes: this.#options.directReads ? 64 * 1024 : Number.POSITIVE_INFINITY,
    };
  }

  /** Main thread: decode end of the TCP transport. */
  #connectTcp(port: number): Promise<TcpTransferReceiver> {
    return connectTcpReceiver({
      port,
      ...this.#receiverOptions(),
      handlers: {
        pagesLanded: (rid, epoch, from, to) => {
          const run = this.#tcpRun;
          if (run?.onWorker) this.#verifyRing.tryPush(SignalKind.LANDED, rid, epoch, from, to);
          else if (run?.hash === "production") this.#sums.recordLease(run.lease, from, to);
        },
        control: (message) => this.#tcpControl(message),
        closed: (error) => {
          const run = this.#tcpRun;
          this.#tcpRun = null;
          run?.done(now(), `connection closed: ${error?.message ?? "closed"}`);
        },
      },
    });
  }

  /** The TCP run's manifest: verified as its hash mode says, and the run ends. */
  async #tcpControl(message: ControlMessage): Promise<void> {
    const run = this.#tcpRun;
    if (run === null || message.type !== "manifest") return;
    const lease = run.lease;
    if (run.onWorker !== null) {
      this.#verifyRing.tryPush(SignalKind.LEASE_END, lease.rid, lease.epoch, lease.pages.length, 0);
      run.local = await run.onWorker();
    } else if (run.hash !== "none") {
      // The commit check reads `KvPool.pageChecksum`, i.e. `PageChecksums.get`, per page.
      const sums = this.#sums;
      const misses = sums.misses;
      run.local = lease.pages.map(({ page }, i) => sums.get(page, lease.rid, lease.epoch, i));
      if (run.hash === "production" && sums.misses !== misses) {
        this.failures.push(`tcp+verify: ${sums.misses - misses} pages hashed at commit, not as they landed`);
      }
    }
    const verdict = run.hash !== "none" ? verdictOf(lease, message, run.local) : "ok";
    this.#tcpRun = null;
    run.done(now(), verdict);
  }

  /** Main thread: the decode end of the TLS transfer connection (only the tcp+tls path). */
  #connectTls(port: number, tlsFiles: TlsFiles): Promise<TcpTransferReceiver> {
    return connectTcpReceiver({
      port,
      ...this.#receiverOptions(),
      tls: loadLinkTls(tlsFiles),
      handlers: {
        control: (message) => {
          const run = this.#tlsRun;
          if (run === null || message.type !== "manifest") return;
          this.#tlsRun = null;
          run.done(now(), "ok");
        },
        closed: (error) => {
          const run = this.#tlsRun;
          this.#tlsRun = null;
          run?.done(now(), `connection closed: ${error?.message ?? "closed"}`);
        },
      },
    });
  }

  /** Main thread: the raw loopback receiver, counting bytes into one reused 1 MiB buffer. */
  #connectRaw(port: number): net.Socket {
    return net.connect({
      port,
      host: "127.0.0.1",
      noDelay: true,
      onread: {
        buffer: Buffer.allocUnsafe(1 << 20),
        callback: (n: number) => {
          const run = this.#rawRun;
          if (run === null) return true;
          run.remaining -= n;
          if (run.remaining <= 0) {
            this.#rawRun = null;
            run.done(now());
          }
          return true;
        },
      },
    });
  }
}

function verdictOf(lease: TransferLease, manifest: Manifest, local: readonly string[]): string {
  const expected = {
    rid: lease.rid,
    epoch: lease.epoch,
    tokenStart: 0,
    tokenEnd: lease.pages.length * lease.pageSize,
    numPages: lease.pages.length,
  };
  return verifyManifest(expected, manifest, local).code;
}
