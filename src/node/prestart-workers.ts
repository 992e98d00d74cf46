/**
 * Node worker threads started before their options are known: the default `kvfence serve`
 * topology's prefill and decode threads load their modules while the main thread loads its own and
 * the weights, then get their options as their first message (src/node/node-worker.ts). This
 * module loads nothing but `node:worker_threads`, so that `kvfence serve` can start them before it
 * loads anything else (src/server/early-threads.ts).
 */
import { Worker } from "node:worker_threads";
import type { SelfTestResult } from "../engine/kernels-choice.js";

/** In a node worker's `workerData`: the thread is a node (node-worker.ts runs only then). */
export const NODE_WORKER_TAG = "kvfence-node-worker";

const WORKER_URL = new URL("./node-worker.js", import.meta.url);

/** A worker thread started early, and its exit code once it exited. */
export interface EarlyWorker {
  readonly worker: Worker;
  exitCode: number | null;
}

/** A prefill and a decode worker thread started before their options are known. */
export interface PrestartedWorkers {
  readonly prefill: EarlyWorker;
  readonly decode: EarlyWorker;
  /**
   * The process's native kernel self-test, run by the prefill thread while it waits for its options
   * (when asked: `--kernels auto|native`); undefined when the thread exited before it reported.
   */
  readonly selfTest?: Promise<SelfTestResult | undefined>;
  /** Stops both (when the server fails to start before they are given their options). */
  terminate(): Promise<void>;
}

/** Starts `url` as a worker thread with `workerData`, noting its exit. */
export function earlyWorker(url: URL, workerData: unknown): EarlyWorker {
  const w: EarlyWorker = { worker: new Worker(url, { workerData }), exitCode: null };
  w.worker.once("exit", (code) => {
    w.exitCode = code;
  });
  return w;
}

/**
 * Starts the node worker threads of the default topology; `startThreadedTopology`
 * (src/topology/threaded-topology.ts) gives them their options once the weights are in memory.
 * With `selfTest`, the prefill thread first runs the native kernels' self-test (beside the main
 * thread, which would otherwise run it on its own start-up path) and reports it.
 */
export function prestartNodeWorkers(options?: { readonly selfTest?: boolean }): PrestartedWorkers {
  const asked = options?.selfTest === true;
  const prefill = earlyWorker(WORKER_URL, { tag: NODE_WORKER_TAG, ...(asked ? { selfTest: true } : {}) });
  const decode = earlyWorker(WORKER_URL, { tag: NODE_WORKER_TAG });
  return {
    prefill,
    decode,
    ...(asked ? { selfTest: selfTestOf(prefill.worker) } : {}),
    terminate: async () => {
      await Promise.all([prefill.worker.terminate(), decode.worker.terminate()]);
    },
  };
}

/** The `self_test` report of `worker` (node-worker.ts), or undefined if it exits first. */
function selfTestOf(worker: Worker): Promise<SelfTestResult | undefined> {
  return new Promise((resolve) => {
    const onMessage = (m: { readonly kind?: string; readonly result?: SelfTestResult }): void => {
      if (m.kind !== "self_test") return;
      done();
      resolve(m.result);
    };
    const onExit = (): void => {
      done();
      resolve(undefined);
    };
    const done = (): void => {
      worker.off("message", onMessage);
      worker.off("exit", onExit);
    };
    worker.on("message", onMessage);
    worker.once("exit", onExit);
  });
}
