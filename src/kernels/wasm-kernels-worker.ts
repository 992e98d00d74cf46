/**
 * The second thread of `WasmKernels`: instantiates the same kernels.wasm over the same shared
 * memory and runs jobs the main thread publishes in the control block (see wasm-kernels.ts). It
 * spins on `Atomics.load` for `spinMs` after each job, then sleeps in `Atomics.wait` until the main
 * thread notifies it, so it costs no CPU between requests but no futex wake within a token.
 */
import { parentPort, workerData } from "node:worker_threads";
import {
  CTL_ARGS,
  CTL_DONE,
  CTL_MAIN_SLEEPING,
  CTL_OP,
  CTL_QUIT,
  CTL_SEQ,
  CTL_TICKET,
  CTL_WORKER_JOBS,
  CTL_WORKER_SLEEPING,
  instantiate,
  OP_ATTENTION,
  OP_MATMUL,
  OP_SWIGLU,
} from "./wasm-kernels.js";

interface WorkerInit {
  module: Parameters<typeof instantiate>[0];
  memory: Parameters<typeof instantiate>[1];
  ctlByteOffset: number;
  spinMs: number;
}

const init = workerData as WorkerInit;
const x = instantiate(init.module, init.memory);
const ctl = new Int32Array(init.memory.buffer, init.ctlByteOffset, 128);
const a = new Uint32Array(init.memory.buffer, init.ctlByteOffset + CTL_ARGS * 4, 32);
parentPort?.postMessage("ready");

let last = Atomics.load(ctl, CTL_SEQ);
for (;;) {
  let s = Atomics.load(ctl, CTL_SEQ);
  if (s === last) {
    const until = performance.now() + init.spinMs;
    let spins = 0;
    while (s === last) {
      if ((++spins & 1023) === 0 && performance.now() > until) {
        Atomics.store(ctl, CTL_WORKER_SLEEPING, 1);
        if (Atomics.load(ctl, CTL_SEQ) === last) Atomics.wait(ctl, CTL_SEQ, last);
        Atomics.store(ctl, CTL_WORKER_SLEEPING, 0);
      }
      s = Atomics.load(ctl, CTL_SEQ);
    }
  }
  last = s;
  if (Atomics.load(ctl, CTL_QUIT) !== 0) break;
  if (Atomics.compareExchange(ctl, CTL_TICKET, 2 * s, 2 * s + 1) !== 2 * s) continue; // cancelled
  const op = ctl[CTL_OP];
  if (op === OP_MATMUL) {
    x.matmulPar(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], 1, a[9]);
  } else if (op === OP_ATTENTION) {
    x.attentionPar(
      a[0],
      a[1],
      a[2],
      a[3],
      a[4],
      a[5],
      a[6],
      a[7],
      a[8],
      a[9],
      a[10],
      a[11],
      a[12],
      a[13],
      a[14],
      a[15],
      a[16],
      a[17],
    );
  } else if (op === OP_SWIGLU) {
    x.swigluPar(a[0], a[1], a[2], a[3], a[4], a[5]);
  }
  Atomics.add(ctl, CTL_WORKER_JOBS, 1);
  Atomics.store(ctl, CTL_DONE, s);
  if (Atomics.load(ctl, CTL_MAIN_SLEEPING) !== 0) Atomics.notify(ctl, CTL_DONE);
}
