/**
 * The second thread of `WasmKernels`: makes the same backend over the same shared memory (the
 * WebAssembly kernels instantiated over the same `WebAssembly.Memory`, or the native addon bound
 * to the same SharedArrayBuffer and region at the same ISA level) and runs jobs the main thread
 * publishes in the control block (see wasm-kernels.ts). It spins on `Atomics.load` for `spinMs`
 * after each job, then sleeps in `Atomics.wait` until the main thread notifies it, so it costs no
 * CPU between requests but no futex wake within a token.
 */
import { parentPort, workerData } from "node:worker_threads";
import {
  type BackendSpec,
  backendOf,
  CTL_ARGS,
  CTL_DONE,
  CTL_MAIN_SLEEPING,
  CTL_OP,
  CTL_QUIT,
  CTL_SEQ,
  CTL_TICKET,
  CTL_WORKER_JOBS,
  CTL_WORKER_SLEEPING,
  OP_ATTENTION,
  OP_MATMUL,
  OP_SWIGLU,
} from "./wasm-kernels.js";

interface WorkerInit {
  spec: BackendSpec;
  ctlByteOffset: number;
  spinMs: number;
  matvecChunk: number;
}

const init = workerData as WorkerInit;
const x = backendOf(init.spec, init.matvecChunk);
const buffer = init.spec.kind === "wasm" ? init.spec.memory.buffer : init.spec.buffer;
const ctl = new Int32Array(buffer, init.ctlByteOffset, 256);
const a = new Float64Array(buffer, init.ctlByteOffset + CTL_ARGS * 4, 24);
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
  try {
    if (op === OP_MATMUL) {
      x.matmulPar(a[0]!, a[1]!, a[2]!, a[3]!, a[4]!, a[5]!, a[6]!, a[7]!, a[8]!, 1, a[9]!);
    } else if (op === OP_ATTENTION) {
      x.attentionPar(
        a[0]!,
        a[1]!,
        a[2]!,
        a[3]!,
        a[4]!,
        a[5]!,
        a[6]!,
        a[7]!,
        a[8]!,
        a[9]!,
        a[10]!,
        a[11]!,
        a[12]!,
        a[13]!,
        a[14]!,
        a[15]!,
        a[16]!,
        a[17]!,
        a[18]!,
        a[19]!,
        1,
      );
    } else if (op === OP_SWIGLU) {
      x.swigluPar(a[0]!, a[1]!, a[2]!, a[3]!, a[4]!, a[5]!);
    }
  } catch {
    // The native glue refused the job (a RangeError): the main thread, calling the same kernel on
    // the same arguments, throws it to the caller; here the job just ends.
  } finally {
    Atomics.add(ctl, CTL_WORKER_JOBS, 1);
    Atomics.store(ctl, CTL_DONE, s);
    if (Atomics.load(ctl, CTL_MAIN_SLEEPING) !== 0) Atomics.notify(ctl, CTL_DONE);
  }
}
