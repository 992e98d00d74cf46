/**
 * Node worker threads started before their options are known: the default `kvfence serve`
 * topology's prefill and decode threads load their modules while the main thread loads its own and
 * the weights, then get their options as their first message (src/node/node-worker.ts). This
 * module loads nothing but `node:worker_threads`, so that `kvfence serve` can start them before it
 * loads anything else (src/server/early-threads.ts).
 */
import { Worker } from "node:worker_threads";

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
 */
export function prestartNodeWorkers(): PrestartedWorkers {
  const prefill = earlyWorker(WORKER_URL, { tag: NODE_WORKER_TAG });
  const decode = earlyWorker(WORKER_URL, { tag: NODE_WORKER_TAG });
  return {
    prefill,
    decode,
    terminate: async () => {
      await Promise.all([prefill.worker.terminate(), decode.worker.terminate()]);
    },
  };
}
