/**
 * The default `kvfence serve` topology: the router on the main thread, one prefill node and one
 * decode node in worker threads, KV moved by the shared-memory transport (one-sided writes into the
 * decode pool's SharedArrayBuffer). The model's weights are shared with both workers (no copy).
 *
 * Setup: start both workers and wait for their hellos; ask decode for a shared-memory channel over
 * its pool (it receives on one end of a fresh MessageChannel) and hand the channel and the other
 * end to prefill, which writes through it. A worker's exit fails its in-flight requests with 503
 * and fences it at its peer.
 */
import { MessageChannel, Worker } from "node:worker_threads";
import { DisaggregatedEngine, type RouterNode } from "../cluster/disaggregated-engine.js";
import type { FromNode, NodeHello } from "../cluster/node-messages.js";
import { WorkerLink } from "../cluster/worker-link.js";
import type { EngineBuildOptions } from "../engine/build-engine.js";
import { KvfenceError, type WireError } from "../lib/errors.js";
import type { FairShareConfig } from "../lib/fair-share.js";
import type { NodeHostOptions } from "../node/node-host.js";
import { NODE_WORKER_TAG, type NodeWorkerReply, type NodeWorkerSetup } from "../node/node-worker.js";
import { SAFE, type Safety } from "../protocol/safety.js";
import type { ShmChannel } from "../transfer/shm-transport.js";

const WORKER_URL = new URL("../node/node-worker.js", import.meta.url);

export interface ThreadedTopologyOptions {
  /** Engine options of each node (pool size, page size, model shared in memory). */
  readonly prefill: EngineBuildOptions;
  readonly decode: EngineBuildOptions;
  /** The model's window (and `--max-model-len`). */
  readonly maxModelLen: number;
  readonly safety?: Safety;
  /** `--unsafe-fault` names, passed to both nodes. */
  readonly faults?: readonly string[];
  /** Per-tenant caps, queue bounds and timeout at the router. */
  readonly fairShare?: FairShareConfig;
  /** A node whose readiness ping takes longer is not ready. */
  readonly pingTimeoutMs?: number;
  /** The router's per-phase histograms (default on; `--no-phase-metrics`). */
  readonly phaseMetrics?: boolean;
}

export interface ThreadedTopology {
  readonly engine: DisaggregatedEngine;
  readonly prefillWorker: Worker;
  readonly decodeWorker: Worker;
  close(): Promise<void>;
}

function startWorker(
  options: NodeHostOptions,
): Promise<{ worker: Worker; link: WorkerLink; hello: NodeHello }> {
  const worker = new Worker(WORKER_URL, { workerData: { tag: NODE_WORKER_TAG, options } });
  const link = new WorkerLink(worker);
  return new Promise((resolve, reject) => {
    const onMessage = (m: FromNode | NodeWorkerReply): void => {
      if (m.kind === "hello") {
        cleanup();
        resolve({ worker, link, hello: m });
      } else if (m.kind === "failed") {
        cleanup();
        void worker.terminate();
        reject(KvfenceError.fromWire(m.error as WireError));
      }
    };
    const onExit = (code: number): void => {
      cleanup();
      reject(
        new KvfenceError(
          "node_unavailable",
          `The ${options.role} node worker exited during startup: code ${code}`,
        ),
      );
    };
    const cleanup = (): void => {
      worker.off("message", onMessage);
      worker.off("exit", onExit);
    };
    worker.on("message", onMessage);
    worker.on("exit", onExit);
  });
}

export async function startThreadedTopology(options: ThreadedTopologyOptions): Promise<ThreadedTopology> {
  const faults = options.faults ?? [];
  const started = await Promise.allSettled([
    startWorker({ role: "prefill", engine: options.prefill, faults }),
    startWorker({ role: "decode", engine: options.decode, faults }),
  ]);
  const [p, d] = started;
  if (p.status === "rejected" || d.status === "rejected") {
    for (const s of started) if (s.status === "fulfilled") await s.value.worker.terminate();
    throw p.status === "rejected" ? p.reason : (d as PromiseRejectedResult).reason;
  }
  const prefill: RouterNode = {
    id: "prefill-0",
    url: "thread:prefill-0",
    hello: p.value.hello,
    link: p.value.link,
  };
  const decode: RouterNode = {
    id: "decode-0",
    url: "thread:decode-0",
    hello: d.value.hello,
    link: d.value.link,
  };
  const engine = new DisaggregatedEngine({
    prefill: [prefill],
    decode: [decode],
    maxModelLen: options.maxModelLen,
    safety: options.safety ?? SAFE,
    ...(options.fairShare === undefined ? {} : { fairShare: options.fairShare }),
    ...(options.pingTimeoutMs === undefined ? {} : { pingTimeoutMs: options.pingTimeoutMs }),
    ...(options.phaseMetrics === undefined ? {} : { phaseMetrics: options.phaseMetrics }),
  });
  const prefillWorker = p.value.worker;
  const decodeWorker = d.value.worker;
  // The decode worker's exit fences it at prefill (its transfer port closes too).
  decodeWorker.on("exit", () => {
    if (!p.value.link.closed) {
      prefillWorker.postMessage({
        kind: "decode_lost",
        incarnation: d.value.hello.incarnation,
      } satisfies NodeWorkerSetup);
    }
  });

  const { port1, port2 } = new MessageChannel();
  const channel = await new Promise<ShmChannel>((resolve, reject) => {
    let shm: ShmChannel | null = null;
    let up = false;
    const onMessage = (m: FromNode | NodeWorkerReply): void => {
      if (m.kind === "shm_channel") shm = m.channel;
      else if (m.kind === "prefill_up") up = true;
      if (shm !== null && up) {
        decodeWorker.off("message", onMessage);
        resolve(shm);
      }
    };
    decodeWorker.on("message", onMessage);
    decodeWorker.once("exit", () =>
      reject(new KvfenceError("node_unavailable", "The decode node worker exited during setup: exit")),
    );
    decodeWorker.postMessage(
      {
        kind: "shm_receiver",
        prefill: prefill.id,
        incarnation: p.value.hello.incarnation,
        port: port2,
      } satisfies NodeWorkerSetup,
      [port2],
    );
  });
  prefillWorker.postMessage(
    {
      kind: "shm_writer",
      channel,
      port: port1,
      incarnation: d.value.hello.incarnation,
    } satisfies NodeWorkerSetup,
    [port1],
  );
  return {
    engine,
    prefillWorker,
    decodeWorker,
    async close() {
      await engine.close();
      await Promise.all([prefillWorker.terminate(), decodeWorker.terminate()]);
    },
  };
}
