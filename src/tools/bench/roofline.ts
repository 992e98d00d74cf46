/**
 * The machine's read bandwidth, for the decode roofline of `kvfence bench model` and
 * src/tools/bench/kernels.ts: native `memchr` (`Buffer.indexOf` of a byte that is absent) over a buffer far
 * larger than the caches, touched before timing, on one thread or split in halves over this thread
 * and one worker (started once, woken per measurement, so no start-up cost is timed).
 *
 * Decode must read every distinct weight once per step, so at batch B the ceiling is
 * B · bandwidth / weight bytes tokens per second.
 */
import { Worker } from "node:worker_threads";

const MEMCHR_WORKER = `
const { workerData } = require("node:worker_threads");
const ctl = new Int32Array(workerData.ctl);
const buf = Buffer.from(workerData.sab, workerData.offset, workerData.length);
let seen = 0;
for (;;) {
  Atomics.wait(ctl, 0, seen);
  seen = Atomics.load(ctl, 0);
  if (seen < 0) break;
  ctl[2] = buf.indexOf(1);
  Atomics.store(ctl, 1, seen);
  Atomics.notify(ctl, 1);
}
`;

export class BandwidthProbe {
  readonly bytes: number;
  #all: Buffer;
  #half: Buffer;
  #ctl: Int32Array;
  #worker: Worker;
  #seq = 0;

  private constructor(bytes: number, sab: SharedArrayBuffer, ctl: SharedArrayBuffer, worker: Worker) {
    this.bytes = bytes;
    this.#all = Buffer.from(sab);
    this.#half = Buffer.from(sab, 0, bytes / 2);
    this.#ctl = new Int32Array(ctl);
    this.#worker = worker;
  }

  /** Allocates and touches `bytes` (rounded down to a multiple of 128) and starts the worker. */
  static async start(bytes: number): Promise<BandwidthProbe> {
    const size = Math.max(128, Math.floor(bytes / 128) * 128);
    const sab = new SharedArrayBuffer(size);
    Buffer.from(sab).fill(0); // touch every page
    const ctl = new SharedArrayBuffer(16);
    const worker = new Worker(MEMCHR_WORKER, {
      eval: true,
      workerData: { sab, ctl, offset: size / 2, length: size / 2 },
    });
    await new Promise<void>((resolve, reject) => {
      worker.once("online", resolve);
      worker.once("error", reject);
    });
    return new BandwidthProbe(size, sab, ctl, worker);
  }

  /** One timed read of the whole buffer on `threads` threads; GB/s. */
  measure(threads: 1 | 2): number {
    const t0 = process.hrtime.bigint();
    if (threads === 1) {
      if (this.#all.indexOf(1) !== -1) throw new Error("Bandwidth probe buffer is not zero");
    } else {
      const ctl = this.#ctl;
      const s = ++this.#seq;
      Atomics.store(ctl, 0, s);
      Atomics.notify(ctl, 0);
      this.#half.indexOf(1);
      while (Atomics.load(ctl, 1) !== s) Atomics.wait(ctl, 1, Atomics.load(ctl, 1), 1);
    }
    return this.bytes / Number(process.hrtime.bigint() - t0);
  }

  async close(): Promise<void> {
    Atomics.store(this.#ctl, 0, -1);
    Atomics.notify(this.#ctl, 0);
    await this.#worker.terminate();
  }
}
