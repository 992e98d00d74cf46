/**
 * The process form of a prefill or decode node (`kvfence serve --role prefill|decode`): the same
 * node glue as the worker thread, with the TCP transport. The node listens for the router's
 * authenticated control link on `--port`; a prefill node also runs the TCP transfer server (on
 * `transferPort`, announced in its hello), and a decode node connects its transfer receiver to each
 * prefill node the router names (`connect_prefill`). A transfer connection that closes is the
 * peer's fence: decode releases that peer's quarantined pages only then, prefill frees that peer's
 * source pages.
 */

import { type ControlLink, listenControlLinks } from "../cluster/control-link.js";
import type { FromNode, ToNode } from "../cluster/node-messages.js";
import type { EngineBuildOptions } from "../engine/build-engine.js";
import { KvfenceError } from "../lib/errors.js";
import { connectTcpReceiver, TcpTransferServer } from "../transfer/tcp-transport.js";
import type { LinkTls } from "../transfer/tls-config.js";
import { buildNode } from "./node-host.js";
import { pageByteLength } from "./node-pool.js";

export interface NodeServerOptions {
  readonly role: "prefill" | "decode";
  readonly host: string;
  readonly port: number;
  readonly secret: string;
  /** Mutual TLS on the control port and the transfer connections (docs/tls.md); plain TCP without. */
  readonly tls?: LinkTls;
  readonly engine: EngineBuildOptions;
  /** Prefill: the transfer server's port (default 0, any free port). */
  readonly transferPort?: number;
  readonly faults?: readonly string[];
  readonly log?: (message: string) => void;
}

export interface NodeServer {
  readonly role: "prefill" | "decode";
  readonly port: number;
  readonly transferPort: number | undefined;
  close(): Promise<void>;
}

export async function startNodeServer(options: NodeServerOptions): Promise<NodeServer> {
  let router: ControlLink<FromNode, ToNode> | null = null;
  const toRouter = (message: FromNode): void => {
    if (router === null || router.closed) return;
    try {
      router.send(message);
    } catch {
      // The router went away; it fails its requests itself.
    }
  };
  const built = await buildNode(
    { role: options.role, engine: options.engine, faults: options.faults ?? [] },
    toRouter,
  );
  const log = options.log ?? (() => {});

  let transfer: TcpTransferServer | null = null;
  if (built.role === "prefill") {
    const node = built.node;
    transfer = await TcpTransferServer.listen({
      host: options.host,
      port: options.transferPort ?? 0,
      secret: options.secret,
      ...(options.tls === undefined ? {} : { tls: options.tls }),
      layoutSignature: built.layoutSignature,
      onWriter: (writer) => {
        const incarnation = writer.peerIncarnation ?? 0;
        const onControl = node.attachDecode(writer, incarnation, writer.metrics);
        writer.handlers = {
          control: onControl,
          closed: () => node.decodeLost(incarnation, writer),
        };
        log(`decode node ${incarnation} connected`);
      },
      onError: (error) => log(`transfer connection refused: ${error.message}`),
    });
  }
  const hello = transfer === null ? built.hello : { ...built.hello, transferPort: transfer.port };

  const onRouterMessage = async (message: ToNode): Promise<void> => {
    if (message.kind === "stats") {
      toRouter({ kind: "stats", id: message.id, stats: built.node.stats() });
      return;
    }
    if (built.role === "prefill") {
      built.node.onRouter(message);
      return;
    }
    const node = built.node;
    if (message.kind !== "connect_prefill") {
      node.onRouter(message);
      return;
    }
    const pool = built.engine.pool;
    let onControl: Parameters<typeof connectTcpReceiver>[0]["handlers"]["control"] = () => {};
    try {
      const receiver = await connectTcpReceiver({
        host: message.host,
        port: message.port,
        secret: options.secret,
        ...(options.tls === undefined ? {} : { tls: options.tls }),
        layoutSignature: built.layoutSignature,
        pool: pool.data,
        table: pool.table,
        pageBytes: pageByteLength(pool),
        incarnation: node.incarnation,
        // The receiver's lease check is the `lease-check` guard (`--unsafe-disable-guard lease-check`).
        leaseCheck: !(options.engine.disabledGuards ?? []).includes("lease-check"),
        leasedPage: (rid, epoch, index) => node.leasedPage(message.prefill, rid, epoch, index),
        handlers: {
          control: (m) => onControl?.(m),
          pagesLanded: (rid, epoch, from, to) => node.pagesLanded(message.prefill, rid, epoch, from, to),
          leaseLanded: () => node.recordTransferGbps(receiver.metrics.lastTransferGbps),
          writeDropped: (rid, epoch, page) => node.writeDropped(message.prefill, rid, epoch, page),
          closed: () => {
            node.prefillLost(message.prefill);
            toRouter({ kind: "prefill_down", prefill: message.prefill });
          },
        },
      });
      onControl = node.attachPrefill(
        message.prefill,
        {
          sendControl: (m) => receiver.sendControl(m),
          close: () => receiver.close(),
          metrics: receiver.metrics,
        },
        message.incarnation,
      );
      toRouter({ kind: "prefill_up", prefill: message.prefill });
      log(`transfer channel to ${message.prefill} up`);
    } catch (err) {
      log(
        `cannot connect to ${message.prefill} at ${message.host}:${message.port}: ${(err as Error).message}`,
      );
      toRouter({ kind: "prefill_down", prefill: message.prefill });
    }
  };

  const control = await listenControlLinks<FromNode, ToNode>({
    host: options.host,
    port: options.port,
    secret: options.secret,
    ...(options.tls === undefined ? {} : { tls: options.tls }),
    onRefused: (error) => log(`control connection refused: ${error.message}`),
    onLink: (link) => {
      router = link;
      link.onMessage((m) => {
        void onRouterMessage(m);
      });
      link.onClose(() => {
        if (router === link) router = null;
      });
      link.send(hello);
    },
  }).catch((err: Error) => {
    throw new KvfenceError(
      "config_invalid",
      `Cannot listen on ${options.host}:${options.port}: ${err.message}`,
    );
  });

  return {
    role: built.role,
    port: control.port,
    transferPort: transfer?.port,
    async close() {
      built.node.close();
      await control.close();
      await transfer?.close();
    },
  };
}
