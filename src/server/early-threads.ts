/**
 * The threads of `kvfence serve` started before the main thread loads its own modules (about half
 * a second of a start on this project's 2-core machines: zod, prom-client, the router): the default
 * topology's prefill and decode threads (src/node/prestart-workers.ts) and the router's first
 * preparation worker (src/router/prepare-worker-start.ts). Each loads its modules meanwhile and then
 * waits for its options; the preparation worker's are the model folder and the request limits,
 * and it reads the tokenizer of the model the command line names meanwhile (`modelNamed`).
 *
 * src/cli/main.ts starts them from the command line alone, where it can tell they will be used
 * (`kvfence serve` without --role or --help; the node threads also not with --no-disaggregation).
 * `startServer` takes them (`takeEarlyThreads`) and stops those its config does not use. Until then
 * they do not keep the process alive: a `serve` that fails on its flags exits as before.
 */
import { resolve } from "node:path";
import {
  type EarlyWorker,
  earlyWorker,
  type PrestartedWorkers,
  prestartNodeWorkers,
} from "../node/prestart-workers.js";
import type { EarlyPrepareWorkerData } from "../router/prepare-pool.js";

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
  const nodes = args.includes("--no-disaggregation")
    ? undefined
    : prestartNodeWorkers({ selfTest: !/^(wasm|ts)$/.test(flagValue(args, "--kernels") ?? "auto") });
  // The small lane's worker (nice 0), which reads the named model's tokenizer meanwhile.
  const guess = modelNamed(args);
  const data: EarlyPrepareWorkerData = {
    nice: 0,
    early: true,
    ...(guess === undefined ? {} : { modelGuess: guess }),
  };
  const preparer = earlyWorker(PREPARE_WORKER_URL, data);
  for (const w of [nodes?.prefill, nodes?.decode, preparer]) w?.worker.unref();
  early = { ...(nodes === undefined ? {} : { nodes }), preparer };
}

/**
 * The model `kvfence serve ARGS` names as its first word or with `--model`, as an absolute path;
 * undefined for the bundled model or anything less plain (the worker then waits for its data).
 */
export function modelNamed(args: readonly string[]): string | undefined {
  const named = args[0] !== undefined && !args[0].startsWith("-") ? args[0] : flagValue(args, "--model");
  return named === undefined || named === "" ? undefined : resolve(named);
}

/** The value of `--flag VALUE` or `--flag=VALUE` in `args`, if given. */
function flagValue(args: readonly string[], flag: string): string | undefined {
  const at = args.indexOf(flag);
  return at >= 0 ? args[at + 1] : args.find((a) => a.startsWith(`${flag}=`))?.slice(flag.length + 1);
}

/** The early threads, once (later calls get none), each keeping the process alive again. */
export function takeEarlyThreads(): EarlyThreads {
  const taken = early;
  early = {};
  for (const w of [taken.nodes?.prefill, taken.nodes?.decode, taken.preparer]) w?.worker.ref();
  return taken;
}
