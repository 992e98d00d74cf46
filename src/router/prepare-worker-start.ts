/**
 * The entry of a preparation worker thread (prepare-pool.ts): sets the thread's nice value before
 * anything else loads, so that a large-lane worker yields the CPU from its first millisecond (its
 * modules and its tokenizer take a few hundred, beside a server's start-up or its requests), then
 * runs prepare-worker.ts.
 */
import { workerData } from "node:worker_threads";
import { lowerThreadPriority } from "../lib/thread-priority.js";

const { nice } = workerData as { readonly nice: number };
if (nice !== 0) lowerThreadPriority(nice);
await import("./prepare-worker.js");
