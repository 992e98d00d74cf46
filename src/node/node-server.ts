/**
 * The process form of a prefill or decode node (`kvfence serve --role prefill|decode`): the same
 * node glue as the worker thread, with the TCP transport. The node listens for the router's
 * authenticated control link on `--port`; a prefill node also runs the TCP transfer server (on
 * `transferPort`, announced in its hello), and a decode node connects its transfer receiver to each
 * prefill node the router names (`connect_prefill`). A transfer connection that closes is the
 * peer's fence: decode releases that peer's quarantined pages only then, prefill frees that peer's
 * source pages. Both ports are bound to the node's advertised address (`advertise`, default
 * `host:port`; the transfer port at its host): a router or decode node that dialled another
 * address — a relay — is refused in the handshake (src/transfer/link-address.ts).
 */

import type { EngineBuildOptions } from "../engine/build-engine.js";
import type { Engine } from "../engine/engine.js";
import { KvfenceError } from "../lib/errors.js";
import { tracing } from "../lib/tracing.js";
import { type ControlLink, listenControlLinks } from "../links/control-link.js";
import type { FromNode, NodeHello, ToNode } from "../links/node-messages.js";
import { routerSlotOf } from "../protocol/wire.js";
import { parseLinkAddress } from "../transfer/link-address.js";
import { connectTcpReceiver, TcpTransferServer } from "../transfer/tcp-transport.js";
import type { LinkTls } from "../transfer/tls-config.js";
import { DecodeNode } from "./decode-node.js";
import { type BuiltNode, buildNode, pong, roleNode } from "./node-host.js";
import { pageByteLength } from "./node-pool.js";
import { type ScrubReport, scrubPool, waitUntil } from "./role-switch.js";

/** Decode's reconnect to a live prefill node: every RECONNECT_MS, for RECONNECT_WINDOW_MS. */
const RECONNECT_MS = 500;
const RECONNECT_WINDOW_MS = 60_000;

type ConnectPrefill = Extract<ToNode, { kind: "connect_prefill" }>;

export interface NodeServerOptions {
  readonly role: "prefill" | "decode";
  readonly host: string;
  readonly port: number;
  /**
   * `--advertise`: the host:port routers dial this node at, when it is not `host:port` (NAT, a pod
   * IP, a proxy). The handshakes of both ports bind it (the transfer port at its host).
   */
  readonly advertise?: string;
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
  /** Tests: called at a role switch once the pool is scrubbed, before the new role takes any work. */
  readonly onScrubbed?: (engine: Engine) => void;
}

export interface NodeServer {
  /** Its role now (a role switch changes it). */
  readonly role: "prefill" | "decode";
  readonly port: number;
  /** The address routers must dial (`--advertise`, or `host:port`), as the handshake compares it. */
  readonly advertised: string;
  readonly transferPort: number | undefined;
  /** What the node registers (`--registry`), its address aside: its hello's incarnation, layout and capacity. */
  readonly registration: Pick<
    NodeHello,
    "role" | "incarnation" | "layoutSignature" | "poolTokens" | "pageSize" | "maxModelLen"
  >;
  /** Its engine (for a test that reads the pool after a role switch). */
  readonly engine: Engine;
  /** Nothing in flight: every page of the pool FREE (a drained node may leave). */
  idle(): boolean;
  /** Protocol attempts in flight on this node (a draining node switches role at 0). */
  inFlight(): number;
  /**
   * Changes role (src/node/role-switch.ts): closes every router link and transfer connection (the
   * fence: what is still in flight there migrates, docs/topologies.md), waits for the pages to be
   * released, scrubs the pool and serves as a new incarnation of `role` on the same ports (the
   * transfer port anew). Routers are refused meanwhile. Null when it has that role already.
   */
  switchRole(role: "prefill" | "decode"): Promise<ScrubReport | null>;
  close(): Promise<void>;
}

/**
 * The node's router links, one per router slot (docs/protocol.md §3, item 13): several routers
 * share the node, each in its own slot (`--router-slot`, in its hello), so their rids never meet.
 * A second router in a slot that is connected is refused (even with the secret), unless it is a
 * newer incarnation (a restarted router whose old link the node has not seen close yet, e.g. its
 * host vanished): then the old link is closed, loudly. A router's link that closes, or is
 * replaced, is that router's fence: `onLost(slot)` aborts its attempts, nobody else's.
 */
class RouterLinks {
  readonly #links = new Map<
    number,
    { link: ControlLink<FromNode, ToNode>; incarnation: number | undefined }
  >();
  readonly #warn: (message: string) => void;
  /** Set once the node is built: the fence of the router of `slot`. */
  onLost: (slot: number) => void = () => {};
  /** False during a role switch: no router is admitted. */
  admitting = true;

  constructor(warn: (message: string) => void) {
    this.#warn = warn;
  }

  /**
   * Sends to the router the message is for: a protocol message (or `prefix_cached`) to the router
   * of its rid's slot, anything else (pages freed, a transfer channel up or down, cache events) to every router.
   * Nothing when that router is gone (it fails its requests itself).
   */
  readonly send = (message: FromNode): void => {
    const rid =
      message.kind === "protocol" ? message.msg.rid : message.kind === "prefix_cached" ? message.rid : 0;
    if (rid !== 0) {
      const to = this.#links.get(routerSlotOf(rid));
      if (to !== undefined) sendOn(to.link, message);
      return;
    }
    for (const to of this.#links.values()) sendOn(to.link, message);
  };

  /** Whether a router that proved itself with `incarnation` in `slot` may have that slot's link. */
  readonly admit = (incarnation: number | undefined, slot = 0): boolean => {
    if (!this.admitting) return false;
    const current = this.#links.get(slot);
    if (current === undefined || current.link.closed) return true;
    const known = current.incarnation;
    if (incarnation === undefined || known === undefined || incarnation <= known) return false;
    this.#warn(
      `control port: a newer router (incarnation ${incarnation}) replaces the connected one (${known}) in router slot ${slot}`,
    );
    this.#links.delete(slot);
    current.link.close();
    this.onLost(slot);
    return true;
  };

  /** Closes every router's link (a role switch): each router fences this node's attempts. */
  closeAll(): void {
    const links = [...this.#links.entries()];
    this.#links.clear();
    for (const [slot, { link }] of links) {
      link.close();
      this.onLost(slot);
    }
  }

  /** An admitted router's link: it gets the node's hello, its messages go to `onMessage`. */
  attach(
    link: ControlLink<FromNode, ToNode>,
    incarnation: number | undefined,
    slot: number,
    onMessage: (message: ToNode, reply: (message: FromNode) => void) => void,
    hello: FromNode,
    after: () => readonly FromNode[],
  ): void {
    this.#links.set(slot, { link, incarnation });
    const reply = (message: FromNode): void => sendOn(link, message);
    link.onMessage((message) => onMessage(message, reply));
    link.onClose(() => {
      if (this.#links.get(slot)?.link !== link) return;
      this.#links.delete(slot);
      this.onLost(slot);
    });
    link.send(hello);
    // Then what this router must know from the start (the cache events' snapshot).
    for (const message of after()) sendOn(link, message);
  }
}

function sendOn(link: ControlLink<FromNode, ToNode>, message: FromNode): void {
  if (link.closed) return;
  try {
    link.send(message);
  } catch {
    // The router went away; it fails its requests itself.
  }
}

type BuiltDecode = Extract<BuiltNode, { role: "decode" }>;

/** A role's node object and its transport: prefill's transfer server, or decode's connector. */
interface RoleServing {
  readonly built: BuiltNode;
  readonly transfer: TcpTransferServer | null;
  readonly prefill: PrefillConnector | null;
  readonly hello: NodeHello;
}

/** Prefill's transfer server: each decode node that proves itself gets a writer wired to its link. */
function listenForDecode(
  options: NodeServerOptions & { readonly advertisedHost: string | undefined },
  built: Extract<BuiltNode, { role: "prefill" }>,
  log: (message: string) => void,
  warn: (message: string) => void,
): Promise<TcpTransferServer> {
  const node = built.node;
  return TcpTransferServer.listen({
    host: options.host,
    port: options.transferPort ?? 0,
    ...(options.advertisedHost === undefined ? {} : { advertise: { host: options.advertisedHost } }),
    secret: options.secret,
    ...(options.tls === undefined ? {} : { tls: options.tls }),
    layoutSignature: built.layoutSignature,
    incarnation: node.incarnation,
    onRefused: (reason, detail) => warn(`transfer port: refused a connection (${reason}): ${detail}`),
    onWriter: (writer) => {
      const incarnation = writer.peerIncarnation ?? 0;
      const link = node.decodeLink(incarnation);
      writer.handlers = link.handlers;
      link.attach(writer);
      log(`decode node ${incarnation} connected`);
    },
  });
}

/**
 * Decode's transfer receivers, one per prefill node the router names (`connect_prefill`). When a
 * connection that was up drops while that prefill node lives on (same incarnation), decode fences
 * it (its pages are released as the protocol says), tells the router, and reconnects by itself:
 * every `RECONNECT_MS` for `RECONNECT_WINDOW_MS`, to the same incarnation only (the receiver refuses
 * another one: a restarted prefill node is the router's to announce).
 */
class PrefillConnector {
  /** The newest `connect_prefill` per prefill id: a reconnect loop of an older one stops. */
  readonly #targets = new Map<string, ConnectPrefill>();
  /** Prefill ids whose channel is up now. */
  readonly #up = new Set<string>();
  /** Prefill ids whose first connect (not a reconnect) is under way. */
  readonly #connecting = new Set<string>();
  #closing = false;

  constructor(
    private readonly options: NodeServerOptions,
    private readonly built: BuiltDecode,
    private readonly toRouter: (message: FromNode) => void,
    private readonly log: (message: string) => void,
  ) {}

  close(): void {
    this.#closing = true;
  }

  connect(target: ConnectPrefill, since?: number): void {
    // A router that (re)connected names a prefill node whose channel is already up (the same
    // incarnation): the channel stays, the router hears it is up.
    // Another router names one that is being connected: every router hears its `prefill_up`.
    const current = this.#targets.get(target.prefill);
    if (since === undefined && current !== undefined && current.incarnation === target.incarnation) {
      if (this.#up.has(target.prefill)) {
        this.toRouter({ kind: "prefill_up", prefill: target.prefill });
        return;
      }
      if (this.#connecting.has(target.prefill)) return;
    }
    this.#targets.set(target.prefill, target);
    const { node, engine, layoutSignature } = this.built;
    const pool = engine.pool;
    const link = node.prefillLink(target.prefill);
    /** True while the channel is up and not closed by this node (a local close is no drop). */
    let up = false;
    if (since === undefined) this.#connecting.add(target.prefill);
    const settled = (): void => {
      if (since === undefined && this.#targets.get(target.prefill) === target)
        this.#connecting.delete(target.prefill);
    };
    connectTcpReceiver({
      host: target.host,
      port: target.port,
      secret: this.options.secret,
      ...(this.options.tls === undefined ? {} : { tls: this.options.tls }),
      layoutSignature,
      pool: pool.data,
      table: pool.table,
      pageBytes: pageByteLength(pool),
      incarnation: node.incarnation,
      peerIncarnation: target.incarnation,
      // The receiver's lease check is the `lease-check` guard (`--unsafe-disable-guard lease-check`).
      leaseCheck: !(this.options.engine.disabledGuards ?? []).includes("lease-check"),
      leasedPage: link.leasedPage,
      handlers: {
        ...link.handlers,
        closed: (error) => {
          if (!up) return;
          up = false;
          if (this.#targets.get(target.prefill) === target) this.#up.delete(target.prefill);
          node.prefillLost(target.prefill);
          this.toRouter({ kind: "prefill_down", prefill: target.prefill });
          const why = error?.message ?? "closed";
          this.log(`transfer channel to ${target.prefill} down: ${why}; reconnecting`);
          this.#retry(target, since ?? Date.now(), why);
        },
      },
    }).then(
      (r) => {
        settled();
        if (!this.#current(target)) {
          void r.close();
          return;
        }
        up = true;
        this.#up.add(target.prefill);
        const channel = {
          sendControl: (m: Parameters<typeof r.sendControl>[0]) => r.sendControl(m),
          close: () => {
            up = false;
            if (this.#targets.get(target.prefill) === target) this.#up.delete(target.prefill);
            return r.close();
          },
          metrics: r.metrics,
        };
        link.attach(channel, target.incarnation);
        this.toRouter({ kind: "prefill_up", prefill: target.prefill });
        this.log(`transfer channel to ${target.prefill} up${since === undefined ? "" : " again"}`);
      },
      (err: Error) => {
        settled();
        this.log(`cannot connect to ${target.prefill} at ${target.host}:${target.port}: ${err.message}`);
        if (since === undefined) this.toRouter({ kind: "prefill_down", prefill: target.prefill });
        // A restarted prefill node (another incarnation) is the router's to announce.
        else if (!/another incarnation/.test(err.message)) this.#retry(target, since, err.message);
      },
    );
  }

  /** Whether `target` is still the one to connect to (not closing, not replaced). */
  #current(target: ConnectPrefill): boolean {
    return !this.#closing && this.#targets.get(target.prefill) === target;
  }

  #retry(target: ConnectPrefill, start: number, why: string): void {
    if (!this.#current(target)) return;
    if (Date.now() - start > RECONNECT_WINDOW_MS) {
      this.log(`gave up reconnecting to ${target.prefill} after ${RECONNECT_WINDOW_MS} ms: ${why}`);
      return;
    }
    setTimeout(() => this.connect(target, start), RECONNECT_MS).unref();
  }
}

export async function startNodeServer(options: NodeServerOptions): Promise<NodeServer> {
  const log = options.log ?? (() => {});
  const warn = options.warn ?? log;
  const advertise = options.advertise === undefined ? undefined : parseLinkAddress(options.advertise);
  if (advertise === null)
    throw new KvfenceError(
      "config_invalid",
      `--advertise must be host:port, e.g. 10.0.0.11:9001: ${JSON.stringify(options.advertise)}`,
    );
  const router = new RouterLinks(warn);
  const withHost = { ...options, advertisedHost: advertise?.host };
  /** The node of its current role with that role's transport (a role switch replaces it). */
  const serve = async (built: BuiltNode): Promise<RoleServing> => {
    const transfer = built.role === "prefill" ? await listenForDecode(withHost, built, log, warn) : null;
    const prefill = built.role === "decode" ? new PrefillConnector(options, built, router.send, log) : null;
    const hello = transfer === null ? built.hello : { ...built.hello, transferPort: transfer.port };
    const node = built.node;
    router.onLost = node instanceof DecodeNode ? (slot) => node.routerLost(slot) : () => {};
    return { built, transfer, prefill, hello };
  };
  let now = await serve(
    await buildNode(
      { role: options.role, engine: options.engine, faults: options.faults ?? [] },
      router.send,
    ),
  );

  const onRouterMessage = (message: ToNode, reply: (message: FromNode) => void): void => {
    const { built, transfer, prefill } = now;
    if (message.kind === "ping") reply(pong(message.id, built.engine));
    else if (message.kind === "stats") {
      const linkAuthFailures = {
        control: { ...control.failures },
        ...(transfer === null ? {} : { transfer: { ...transfer.failures } }),
      };
      reply({ kind: "stats", id: message.id, stats: { ...built.node.stats(), linkAuthFailures } });
    } else if (built.role === "prefill") built.node.onRouter(message);
    else if (message.kind === "connect_prefill") prefill!.connect(message);
    else built.node.onRouter(message);
  };

  const control = await listenControlLinks<FromNode, ToNode>({
    host: options.host,
    port: options.port,
    ...(advertise === undefined ? {} : { advertise }),
    secret: options.secret,
    ...(options.tls === undefined ? {} : { tls: options.tls }),
    admit: router.admit,
    onRefused: (reason, detail) => warn(`control port: refused a connection (${reason}): ${detail}`),
    // The hello names the rid floor of the router's slot now: its rids go after every earlier
    // router's of that slot.
    onLink: (link, incarnation, slot = 0) =>
      router.attach(
        link,
        incarnation,
        slot,
        onRouterMessage,
        { ...now.hello, ridFloor: now.built.node.ridFloor(slot) },
        () => now.built.cacheEvents?.snapshot() ?? [],
      ),
  }).catch((err: Error) => {
    throw new KvfenceError(
      "config_invalid",
      `Cannot listen on ${options.host}:${options.port}: ${err.message}`,
    );
  });

  return {
    get role() {
      return now.built.role;
    },
    port: control.port,
    advertised: control.advertised,
    get transferPort() {
      return now.transfer?.port;
    },
    get registration() {
      const hello = now.hello;
      return {
        role: hello.role,
        incarnation: hello.incarnation,
        layoutSignature: hello.layoutSignature,
        poolTokens: hello.poolTokens,
        pageSize: hello.pageSize,
        maxModelLen: hello.maxModelLen,
      };
    },
    get engine() {
      return now.built.engine;
    },
    idle() {
      const pages = now.built.engine.pool.table.counts();
      return pages.free === pages.total;
    },
    inFlight() {
      return now.built.node.inFlight();
    },
    async switchRole(role) {
      if (role === now.built.role) return null;
      router.admitting = false;
      try {
        const next = await changeRole(now, role, { router, serve, log, onScrubbed: options.onScrubbed });
        now = next.serving;
        return next.scrub;
      } finally {
        router.admitting = true;
      }
    },
    async close() {
      now.prefill?.close();
      now.built.cacheEvents?.close();
      now.built.node.close();
      await control.close();
      await now.transfer?.close();
      // The spans still buffered (src/lib/tracing.ts) leave before the process does.
      await tracing()?.shutdown();
    },
  };
}

/**
 * The role switch of `from` (see `NodeServer.switchRole`), with the routers refused meanwhile:
 * every router link and transfer connection closed (the fence), the old node object stopped with
 * its engine kept, the pool scrubbed once its pages are released, the new role served.
 */
async function changeRole(
  from: RoleServing,
  role: "prefill" | "decode",
  how: {
    readonly router: RouterLinks;
    readonly serve: (built: BuiltNode) => Promise<RoleServing>;
    readonly log: (message: string) => void;
    readonly onScrubbed: ((engine: Engine) => void) | undefined;
  },
): Promise<{ serving: RoleServing; scrub: ScrubReport }> {
  const { built, transfer, prefill } = from;
  how.router.closeAll();
  prefill?.close();
  await transfer?.close();
  // Stops the old node; a decode node fences its prefill peers (their channels closed first).
  built.node.close(true);
  // The fences release what the old role's attempts held (at once for a drained node).
  await waitUntil(() => built.node.inFlight() === 0 && freeButCached(built.engine), 10_000);
  const scrub = scrubPool(built.engine);
  how.onScrubbed?.(built.engine);
  const serving = await how.serve(roleNode(role, built, how.router.send));
  how.log(
    `role switch: ${built.role} → ${role} (incarnation ${serving.hello.incarnation}): ${scrub.cachedPages} cached pages evicted, ${scrub.pages} pages zeroed`,
  );
  return { serving, scrub };
}

/** Every page FREE but those the prefix cache holds with no reference (a scrub evicts them). */
function freeButCached(engine: Engine): boolean {
  const counts = engine.pool.table.counts();
  const cached = engine.prefixCache?.evictable() ?? 0;
  return counts.free + cached === counts.total;
}
