/**
 * The default `kvfence serve` topology: the router on the main thread, one prefill node and one
 * decode node in worker threads, KV moved by the shared-memory transport (one-sided writes into the
 * decode pool's SharedArrayBuffer). The model's weights are shared with both workers (no copy).
 *
 * Setup: start both workers and wait for their hellos; ask decode for a shared-memory channel over
 * its pool (it receives on one end of a fresh MessageChannel) and hand the channel and the other
 * end to prefill, which writes through it (`pairShm`).
 *
 * A worker that exits or throws is a lost node, as a node process whose link closes is to the
 * cluster router (`src/cluster/cluster-router.ts`): its in-flight requests fail with 503
 * `node_unavailable`, it is fenced at its peer (decode hears `prefill_lost` from the router;
 * prefill hears `decode_lost` here), `/ready` says 503 — and a new worker of the same role is
 * started in its place, a new incarnation (with backoff, `RESTART_MS` doubling to
 * `RESTART_MAX_MS`, while it fails to start). Once it says hello it takes its place again
 * (`DisaggregatedEngine.nodeBack`), its shared-memory channel to the surviving peer is made anew,
 * and the pair comes up: `/ready` 200, requests served, no restart of the server.
 */
import { MessageChannel, Worker } from "node:worker_threads";
import { DisaggregatedEngine, type RouterNode } from "../cluster/disaggregated-engine.js";
import type { EngineBuildOptions } from "../engine/build-engine.js";
import { portableOptions } from "../engine/portable-weights.js";
import type { FairShareConfig } from "../fair-share/fair-share.js";
import { KvfenceError, type WireError } from "../lib/errors.js";
import type { Logger } from "../lib/logger.js";
import type { FromNode, NodeHello } from "../links/node-messages.js";
import { WorkerLink } from "../links/worker-link.js";
import type { NodeHostOptions } from "../node/node-host.js";
import type { NodeWorkerOptions, NodeWorkerReply, NodeWorkerSetup } from "../node/node-worker.js";
import { type EarlyWorker, NODE_WORKER_TAG, type PrestartedWorkers } from "../node/prestart-workers.js";
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
  /** Lost workers and their restarts. */
  readonly log?: Logger;
  /** The router's per-phase histograms (default on; `--no-phase-metrics`). */
  readonly phaseMetrics?: boolean;
  /** `--max-migrations` (one pair here: a request can migrate only to the restarted node's pair, which is not waited for). */
  readonly maxMigrations?: number;
  /** The first pair's threads, started earlier (src/node/prestart-workers.ts); restarts start their own. */
  readonly prestarted?: PrestartedWorkers;
}

export interface ThreadedTopology {
  readonly engine: DisaggregatedEngine;
  /** The current prefill node's worker (a new one after a restart). */
  readonly prefillWorker: Worker;
  /** The current decode node's worker. */
  readonly decodeWorker: Worker;
  /** Workers started in place of lost ones, so far. */
  readonly restarts: number;
  close(): Promise<void>;
}

/** Start a lost worker's successor after this, doubling up to `RESTART_MAX_MS` while it fails. */
export const RESTART_MS = 100;
export const RESTART_MAX_MS = 2000;

type Role = "prefill" | "decode";

interface NodeWorker {
  readonly worker: Worker;
  readonly link: WorkerLink;
  readonly hello: NodeHello;
}

const NODE_ID = { prefill: "prefill-0", decode: "decode-0" } as const;

function routerNode(role: Role, w: NodeWorker): RouterNode {
  return { id: NODE_ID[role], url: `thread:${NODE_ID[role]}`, hello: w.hello, link: w.link };
}

/** Starts a node worker (or gives a prestarted one its options) and waits for its hello. */
function startWorker(
  options: NodeHostOptions,
  early?: EarlyWorker,
): Promise<{ worker: Worker; link: WorkerLink; hello: NodeHello }> {
  // Weights as numbers: a view past 4 GiB of the shared memory does not survive the structured clone.
  const hostOptions = { ...options, engine: portableOptions(options.engine) };
  const worker =
    early?.worker ?? new Worker(WORKER_URL, { workerData: { tag: NODE_WORKER_TAG, options: hostOptions } });
  if (early !== undefined)
    worker.postMessage({ kind: "options", options: hostOptions } satisfies NodeWorkerOptions);
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
    if (early?.exitCode != null) onExit(early.exitCode);
  });
}

export async function startThreadedTopology(options: ThreadedTopologyOptions): Promise<ThreadedTopology> {
  const faults = options.faults ?? [];
  const hostOptions = (role: Role): NodeHostOptions => ({ role, engine: options[role], faults });
  const started = await Promise.allSettled([
    startWorker(hostOptions("prefill"), options.prestarted?.prefill),
    startWorker(hostOptions("decode"), options.prestarted?.decode),
  ]);
  const [p, d] = started;
  if (p.status === "rejected" || d.status === "rejected") {
    for (const s of started) if (s.status === "fulfilled") await s.value.worker.terminate();
    throw p.status === "rejected" ? p.reason : (d as PromiseRejectedResult).reason;
  }
  const engine = new DisaggregatedEngine({
    prefill: [routerNode("prefill", p.value)],
    decode: [routerNode("decode", d.value)],
    maxModelLen: options.maxModelLen,
    safety: options.safety ?? SAFE,
    ...(options.fairShare === undefined ? {} : { fairShare: options.fairShare }),
    ...(options.pingTimeoutMs === undefined ? {} : { pingTimeoutMs: options.pingTimeoutMs }),
    ...(options.phaseMetrics === undefined ? {} : { phaseMetrics: options.phaseMetrics }),
    ...(options.maxMigrations === undefined ? {} : { maxMigrations: options.maxMigrations }),
  });
  const current: Record<Role, NodeWorker> = { prefill: p.value, decode: d.value };
  let closing = false;
  let restarts = 0;
  const log = options.log;

  const watch = (role: Role, w: NodeWorker): void => {
    w.link.onClose((error) => {
      if (closing || engine.closed) return;
      log?.warn(
        { node: NODE_ID[role], error: error?.message },
        "a node worker thread exited; starting another in its place",
      );
      // The decode worker's exit fences it at prefill (its transfer port closes too).
      if (role === "decode" && !current.prefill.link.closed) {
        current.prefill.worker.postMessage({
          kind: "decode_lost",
          incarnation: w.hello.incarnation,
        } satisfies NodeWorkerSetup);
      }
      restart(role, RESTART_MS);
    });
  };
  const restart = (role: Role, delayMs: number): void => {
    const timer = setTimeout(() => {
      if (closing) return;
      startWorker(hostOptions(role)).then(
        (fresh) => void takeBack(role, fresh),
        (err: unknown) => {
          log?.error({ node: NODE_ID[role], error: String(err) }, "a node worker failed to start; retrying");
          restart(role, Math.min(RESTART_MAX_MS, delayMs * 2));
        },
      );
    }, delayMs);
    timer.unref();
  };
  const takeBack = async (role: Role, fresh: NodeWorker): Promise<void> => {
    const refused = closing ? "the server is closing" : engine.nodeBack(routerNode(role, fresh));
    if (refused !== null) {
      if (!closing)
        log?.error({ node: NODE_ID[role], why: refused }, "a new node worker cannot take its place");
      await fresh.worker.terminate();
      return;
    }
    current[role] = fresh;
    restarts++;
    watch(role, fresh);
    const { prefill, decode } = current;
    if (prefill.link.closed || decode.link.closed) return; // the peer's own restart pairs them
    try {
      await pairShm(prefill, decode);
      log?.warn({ node: NODE_ID[role], incarnation: fresh.hello.incarnation }, "the node worker is back");
    } catch {
      // A worker exited while pairing: its restart pairs them again.
    }
  };

  watch("prefill", p.value);
  watch("decode", d.value);
  await pairShm(p.value, d.value);
  return {
    engine,
    get prefillWorker() {
      return current.prefill.worker;
    },
    get decodeWorker() {
      return current.decode.worker;
    },
    get restarts() {
      return restarts;
    },
    async close() {
      closing = true;
      await engine.close();
      await Promise.all([current.prefill.worker.terminate(), current.decode.worker.terminate()]);
    },
  };
}

/**
 * Makes the shared-memory channel from `prefill` into `decode`'s pool: decode lays it over its pool
 * and receives on one end of a fresh MessageChannel; prefill gets the channel and the other end.
 * Decode's `prefill_up` (heard by the router too) brings the pair up.
 */
function pairShm(prefill: NodeWorker, decode: NodeWorker): Promise<void> {
  const { port1, port2 } = new MessageChannel();
  return new Promise<void>((resolve, reject) => {
    let shm: ShmChannel | null = null;
    const onMessage = (m: FromNode | NodeWorkerReply): void => {
      if (m.kind === "shm_channel" && m.prefill === NODE_ID.prefill) shm = m.channel;
      else if (m.kind === "prefill_up" && m.prefill === NODE_ID.prefill && shm !== null) {
        cleanup();
        prefill.worker.postMessage(
          {
            kind: "shm_writer",
            channel: shm,
            port: port1,
            incarnation: decode.hello.incarnation,
          } satisfies NodeWorkerSetup,
          [port1],
        );
        resolve();
      }
    };
    const onExit = (): void => {
      cleanup();
      reject(new KvfenceError("node_unavailable", "The decode node worker exited during setup: exit"));
    };
    const cleanup = (): void => {
      decode.worker.off("message", onMessage);
      decode.worker.off("exit", onExit);
    };
    decode.worker.on("message", onMessage);
    decode.worker.once("exit", onExit);
    decode.worker.postMessage(
      {
        kind: "shm_receiver",
        prefill: NODE_ID.prefill,
        incarnation: prefill.hello.incarnation,
        port: port2,
      } satisfies NodeWorkerSetup,
      [port2],
    );
  });
}
