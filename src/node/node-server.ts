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
import type { DecodeNode } from "./decode-node.js";
import { buildNode } from "./node-host.js";
import { pageByteLength } from "./node-pool.js";

/** Decode's reconnect to a live prefill node: every RECONNECT_MS, for RECONNECT_WINDOW_MS. */
const RECONNECT_MS = 500;
const RECONNECT_WINDOW_MS = 60_000;

type ConnectPrefill = Extract<ToNode, { kind: "connect_prefill" }>;

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
  /** Refused connections on the node's ports (default: `log`). */
  readonly warn?: (message: string) => void;
}

export interface NodeServer {
  readonly role: "prefill" | "decode";
  readonly port: number;
  readonly transferPort: number | undefined;
  close(): Promise<void>;
}

export async function startNodeServer(options: NodeServerOptions): Promise<NodeServer> {
  let router: ControlLink<FromNode, ToNode> | null = null;
  /** The connected router's incarnation (its start time, from its hello). */
  let routerIncarnation: number | undefined;
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
  const warn = options.warn ?? log;

  let transfer: TcpTransferServer | null = null;
  if (built.role === "prefill") {
    const node = built.node;
    transfer = await TcpTransferServer.listen({
      host: options.host,
      port: options.transferPort ?? 0,
      secret: options.secret,
      ...(options.tls === undefined ? {} : { tls: options.tls }),
      layoutSignature: built.layoutSignature,
      incarnation: node.incarnation,
      onRefused: (reason, detail) => warn(`transfer port: refused a connection (${reason}): ${detail}`),
      onWriter: (writer) => {
        const incarnation = writer.peerIncarnation ?? 0;
        const onControl = node.attachDecode(writer, incarnation, writer.metrics);
        writer.handlers = {
          control: onControl,
          closed: () => node.decodeLost(incarnation, writer),
        };
        log(`decode node ${incarnation} connected`);
      },
    });
  }
  const hello = transfer === null ? built.hello : { ...built.hello, transferPort: transfer.port };

  const onRouterMessage = async (message: ToNode): Promise<void> => {
    if (message.kind === "ping") {
      toRouter({ kind: "pong", id: message.id });
      return;
    }
    if (message.kind === "stats") {
      const linkAuthFailures = {
        control: { ...control.failures },
        ...(transfer === null ? {} : { transfer: { ...transfer.failures } }),
      };
      toRouter({ kind: "stats", id: message.id, stats: { ...built.node.stats(), linkAuthFailures } });
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
    connectPrefill(node, message);
  };

  /** The newest `connect_prefill` per prefill id: a reconnect loop of an older one stops. */
  const prefillTargets = new Map<string, ConnectPrefill>();
  let closing = false;

  /**
   * Connects decode's transfer receiver to the prefill node `target` names. When a connection that
   * was up drops while that prefill node lives on (same incarnation), decode fences it (its pages
   * are released as the protocol says), tells the router, and reconnects by itself: every
   * `RECONNECT_MS` for `RECONNECT_WINDOW_MS`, to the same incarnation only (the receiver refuses
   * another one: a restarted prefill node is the router's to announce).
   */
  const connectPrefill = (node: DecodeNode, target: ConnectPrefill, since?: number): void => {
    prefillTargets.set(target.prefill, target);
    const pool = (built as Extract<typeof built, { role: "decode" }>).engine.pool;
    let onControl: Parameters<typeof connectTcpReceiver>[0]["handlers"]["control"] = () => {};
    let receiver: Awaited<ReturnType<typeof connectTcpReceiver>> | undefined;
    /** True while the channel is up and not closed by this node (a local close is no drop). */
    let up = false;
    const retry = (why: string): void => {
      const start = since ?? Date.now();
      if (closing || prefillTargets.get(target.prefill) !== target) return;
      if (Date.now() - start > RECONNECT_WINDOW_MS) {
        log(`gave up reconnecting to ${target.prefill} after ${RECONNECT_WINDOW_MS} ms: ${why}`);
        return;
      }
      setTimeout(() => connectPrefill(node, target, start), RECONNECT_MS).unref();
    };
    connectTcpReceiver({
      host: target.host,
      port: target.port,
      secret: options.secret,
      ...(options.tls === undefined ? {} : { tls: options.tls }),
      layoutSignature: built.layoutSignature,
      pool: pool.data,
      table: pool.table,
      pageBytes: pageByteLength(pool),
      incarnation: node.incarnation,
      peerIncarnation: target.incarnation,
      // The receiver's lease check is the `lease-check` guard (`--unsafe-disable-guard lease-check`).
      leaseCheck: !(options.engine.disabledGuards ?? []).includes("lease-check"),
      leasedPage: (rid, epoch, index) => node.leasedPage(target.prefill, rid, epoch, index),
      handlers: {
        control: (m) => onControl?.(m),
        pagesLanded: (rid, epoch, from, to) => node.pagesLanded(target.prefill, rid, epoch, from, to),
        leaseLanded: () => node.recordTransferGbps(receiver?.metrics.lastTransferGbps ?? 0),
        writeDropped: (rid, epoch, page) => node.writeDropped(target.prefill, rid, epoch, page),
        closed: (error) => {
          if (!up) return;
          up = false;
          node.prefillLost(target.prefill);
          toRouter({ kind: "prefill_down", prefill: target.prefill });
          log(`transfer channel to ${target.prefill} down: ${error?.message ?? "closed"}; reconnecting`);
          retry(error?.message ?? "closed");
        },
      },
    }).then(
      (r) => {
        receiver = r;
        if (closing || prefillTargets.get(target.prefill) !== target) {
          void r.close();
          return;
        }
        up = true;
        onControl = node.attachPrefill(
          target.prefill,
          {
            sendControl: (m) => r.sendControl(m),
            close: () => {
              up = false;
              return r.close();
            },
            metrics: r.metrics,
          },
          target.incarnation,
        );
        toRouter({ kind: "prefill_up", prefill: target.prefill });
        log(`transfer channel to ${target.prefill} up${since === undefined ? "" : " again"}`);
      },
      (err: Error) => {
        log(`cannot connect to ${target.prefill} at ${target.host}:${target.port}: ${err.message}`);
        if (since === undefined) toRouter({ kind: "prefill_down", prefill: target.prefill });
        // A restarted prefill node (another incarnation) is the router's to announce.
        else if (!/another incarnation/.test(err.message)) retry(err.message);
      },
    );
  };

  const control = await listenControlLinks<FromNode, ToNode>({
    host: options.host,
    port: options.port,
    secret: options.secret,
    ...(options.tls === undefined ? {} : { tls: options.tls }),
    // One router at a time: another one (even with the secret) is refused while it is connected,
    // unless it is a newer incarnation (a restarted router whose old link the node has not seen
    // close yet, e.g. its host vanished): then the old link is closed, loudly.
    admit: (incarnation) => {
      if (router === null || router.closed) return true;
      if (incarnation === undefined || routerIncarnation === undefined || incarnation <= routerIncarnation)
        return false;
      warn(
        `control port: a newer router (incarnation ${incarnation}) replaces the connected one (${routerIncarnation})`,
      );
      router.close();
      router = null;
      return true;
    },
    onRefused: (reason, detail) => warn(`control port: refused a connection (${reason}): ${detail}`),
    onLink: (link, incarnation) => {
      router = link;
      routerIncarnation = incarnation;
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
      closing = true;
      built.node.close();
      await control.close();
      await transfer?.close();
    },
  };
}
