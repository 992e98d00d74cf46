/**
 * The worker-thread form of a prefill or decode node (the default `kvfence serve` topology). The
 * router (main thread) posts `ToNode` messages and thread-only setup messages on the parent port:
 *
 * - decode gets `shm_receiver {prefill, port}`: it lays a shared-memory channel over its own pool
 *   (`createShmChannel`), receives on `port`, and answers `shm_channel {prefill, channel}`;
 * - prefill gets `shm_writer {channel, port, incarnation}` (forwarded by the main thread) and
 *   writes one-sided into the decode pool through it.
 *
 * A worker's exit is its fence: the main thread tells the peers (`prefill_lost`), and the
 * transfer port closes with it.
 *
 * Its options come as `workerData`, or, for a worker started before they are known (the server's
 * first pair, started while the weights load: `prestartNodeWorkers` in
 * src/node/prestart-workers.ts), as the first message (`NodeWorkerOptions`): its modules load
 * meanwhile.
 */
import { isMainThread, type MessagePort, parentPort, workerData } from "node:worker_threads";
import type { SelfTestResult } from "../engine/kernels-choice.js";
import { faultInWeights } from "../engine/weight-pages.js";
import { KvfenceError } from "../lib/errors.js";
import type { ForwardedSpans } from "../lib/tracing.js";
import type { FromNode, ToNode } from "../links/node-messages.js";
import {
  createShmChannel,
  type ShmChannel,
  ShmTransferReceiver,
  ShmTransferWriter,
} from "../transfer/shm-transport.js";
import { buildNode, type NodeHostOptions, pong } from "./node-host.js";
import { pageByteLength } from "./node-pool.js";
import { NODE_WORKER_TAG } from "./prestart-workers.js";

/** Thread-only setup messages, main thread → node worker. */
export type NodeWorkerSetup =
  | {
      readonly kind: "shm_receiver";
      readonly prefill: string;
      readonly incarnation: number;
      readonly port: MessagePort;
    }
  | {
      readonly kind: "shm_writer";
      readonly channel: ShmChannel;
      readonly port: MessagePort;
      readonly incarnation: number;
    }
  | { readonly kind: "decode_lost"; readonly incarnation: number };

/** Thread-only replies, node worker → main thread. */
export type NodeWorkerReply =
  | { readonly kind: "shm_channel"; readonly prefill: string; readonly channel: ShmChannel }
  /** The node's finished spans, for the main thread's exporter (`WorkerLink` hands them on). */
  | ForwardedSpans
  | { readonly kind: "failed"; readonly error: { code: string; message: string } }
  /** A prestarted prefill thread's run of the native kernels' self-test (prestart-workers.ts). */
  | { readonly kind: "self_test"; readonly result: SelfTestResult };

async function main(port: MessagePort, options: NodeHostOptions): Promise<void> {
  const toRouter = (message: FromNode | NodeWorkerReply): void => port.postMessage(message);
  let built: Awaited<ReturnType<typeof buildNode>>;
  try {
    built = await buildNode(options, toRouter, toRouter);
  } catch (err) {
    const error =
      err instanceof KvfenceError
        ? err.toWire()
        : { code: "internal", message: `Node failed to start: ${String(err)}` };
    toRouter({ kind: "failed", error });
    return;
  }
  port.on("message", (message: ToNode | NodeWorkerSetup) => {
    if (message.kind === "ping") {
      toRouter(pong(message.id, built.engine));
      return;
    }
    if (message.kind === "stats") {
      toRouter({ kind: "stats", id: message.id, stats: built.node.stats() });
      return;
    }
    if (built.role === "decode") {
      const node = built.node;
      if (message.kind === "shm_receiver") {
        const pool = built.engine.pool;
        const channel = createShmChannel({
          pool: pool.data,
          table: pool.table,
          pageBytes: pageByteLength(pool),
          layoutSignature: built.layoutSignature,
        });
        const link = node.prefillLink(message.prefill);
        const receiver = new ShmTransferReceiver(channel, {
          port: message.port,
          handlers: {
            ...link.handlers,
            closed: () => {
              node.prefillLost(message.prefill);
              toRouter({ kind: "prefill_down", prefill: message.prefill });
            },
          },
        });
        link.attach(
          {
            sendControl: (m) => receiver.sendControl(m),
            close: () => receiver.close(),
            metrics: receiver.metrics,
          },
          message.incarnation,
        );
        toRouter({ kind: "shm_channel", prefill: message.prefill, channel });
        toRouter({ kind: "prefill_up", prefill: message.prefill });
        return;
      }
      if (message.kind === "shm_writer" || message.kind === "decode_lost") return;
      node.onRouter(message);
      return;
    }
    const node = built.node;
    if (message.kind === "shm_writer") {
      const link = node.decodeLink(message.incarnation);
      const writer = new ShmTransferWriter(message.channel, {
        port: message.port,
        layoutSignature: built.layoutSignature,
        handlers: link.handlers,
      });
      link.attach(writer);
      return;
    }
    if (message.kind === "decode_lost") {
      node.decodeLost(message.incarnation);
      return;
    }
    if (message.kind === "shm_receiver") return;
    node.onRouter(message);
  });
  toRouter(built.hello);
  // Idle until prefill's first transfer, the decode thread faults in the weights' pages meanwhile,
  // so that the first prefill step does not (src/engine/weight-pages.ts).
  const model = options.engine.model;
  if (built.role === "decode" && "weights" in model) void faultInWeights(model.weights);
}

/** The options of a worker started without them, its first message. */
export interface NodeWorkerOptions {
  readonly kind: "options";
  readonly options: NodeHostOptions;
}

const data = workerData as { tag?: unknown; options?: NodeHostOptions; selfTest?: boolean } | null;
if (!isMainThread && parentPort !== null && data?.tag === NODE_WORKER_TAG) {
  const port = parentPort;
  let options = data.options;
  if (options === undefined) {
    const given = new Promise<NodeHostOptions>((resolve) =>
      port.once("message", (m: NodeWorkerOptions) => resolve(m.options)),
    );
    // Asked to, it runs the process's kernel self-test while it waits, for the main thread.
    if (data.selfTest === true) {
      const { nativeSelfTest } = await import("../engine/kernels-choice.js");
      port.postMessage({ kind: "self_test", result: await nativeSelfTest() } satisfies NodeWorkerReply);
    }
    options = await given;
  }
  await main(port, options);
}
