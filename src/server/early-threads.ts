/**
 * The threads of `kvfence serve` started before the main thread loads its own modules (about half
 * a second of a start on this project's 2-core machines: zod, prom-client, the router): the default
 * topology's prefill and decode threads (src/node/prestart-workers.ts) and the router's first
 * preparation worker (src/router/prepare-worker-start.ts). Each loads its modules meanwhile and then
 * waits for its options; the preparation worker's are the model folder and the request limits.
 *
 * src/cli/main.ts starts them from the command line alone, where it can tell they will be used
 * (`kvfence serve` without --role or --help; the node threads also not with --no-disaggregation).
 * `startServer` takes them (`takeEarlyThreads`) and stops those its config does not use. Until then
 * they do not keep the process alive: a `serve` that fails on its flags exits as before.
 */
import {
  type EarlyWorker,
  earlyWorker,
  type PrestartedWorkers,
  prestartNodeWorkers,
} from "../node/prestart-workers.js";

const PREPARE_WORKER_URL = new URL("../router/prepare-worker-start.js", import.meta.url);

/** The early threads of this process: the node pair and the first preparation worker. */
export interface EarlyThreads {
  readonly nodes?: PrestartedWorkers;
  /** A preparation worker waiting for its `PrepareWorkerData` as its first message. */
  readonly preparer?: EarlyWorker;
}

let early: EarlyThreads = {};

/** Starts the threads `kvfence serve ARGS` will use; `args` are the words after `serve`. */
export function startEarlyThreads(args: readonly string[]): void {
  if (args.some((a) => a === "-h" || a === "--help" || a.startsWith("--role"))) return;
  const nodes = args.includes("--no-disaggregation") ? undefined : prestartNodeWorkers();
  // The small lane's worker: its nice value stays 0.
  const preparer = earlyWorker(PREPARE_WORKER_URL, { nice: 0 });
  for (const w of [nodes?.prefill, nodes?.decode, preparer]) w?.worker.unref();
  early = { ...(nodes === undefined ? {} : { nodes }), preparer };
}

/** The early threads, once (later calls get none), each keeping the process alive again. */
export function takeEarlyThreads(): EarlyThreads {
  const taken = early;
  early = {};
  for (const w of [taken.nodes?.prefill, taken.nodes?.decode, taken.preparer]) w?.worker.ref();
  return taken;
}
