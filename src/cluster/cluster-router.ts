/**
 * The router of the multi-process topology (`kvfence serve --role router --prefill URL… --decode
 * URL…`): connects an authenticated control link to every node, reads each node's hello (pool,
 * page size, context length, layout), tells every decode node to connect its transfer channel to
 * every prefill node, waits until every pair is up, and returns the `DisaggregatedEngine` the HTTP
 * server drives.
 *
 * A node whose control link closes (its process died, was restarted, or the link dropped) is
 * re-dialled at its address with backoff (`REDIAL_MS` doubling to `REDIAL_MAX_MS`) for as long as
 * the router runs. When it answers — the same process or a new incarnation — it takes its place
 * again (`DisaggregatedEngine.nodeBack`) and the transfer channels are re-made: a prefill node
 * that is back is announced to every decode node (`connect_prefill` with its new transfer port and
 * incarnation), a decode node that is back is told to connect to every prefill node. No router
 * restart.
 *
 * Every dial binds the address dialled (src/transfer/link-address.ts): a node that answers to
 * another address — reached through a relay, e.g. at a registry entry copied to the relay's
 * address — is refused and counted (`DisaggregatedEngine.dialRefusals`,
 * `kvfence_router_link_refusals_total`).
 */

import type { FairShareConfig } from "../fair-share/fair-share.js";
import { KvfenceError } from "../lib/errors.js";
import type { Logger } from "../lib/logger.js";
import { type ControlLink, connectControlLink, HandshakeError } from "../links/control-link.js";
import type { FromNode, NodeHello, ToNode } from "../links/node-messages.js";
import { SAFE, type Safety } from "../protocol/safety.js";
import { ROUTER_SLOTS } from "../protocol/wire.js";
import type { LinkAuthFailures } from "../transfer/link-guard.js";
import type { LinkTls } from "../transfer/tls-config.js";
import { DisaggregatedEngine, type RouterNode } from "./disaggregated-engine.js";
import { claimRouterSlot, type Registration, type RegistryOptions, watchRegistry } from "./registry.js";

/**
 * This router process's incarnation, sent in its control-link hello: a node admits a newer router
 * in place of an older one it still believes connected, never an equal or older one.
 */
const ROUTER_INCARNATION = Date.now();

export interface ClusterRouterOptions {
  readonly prefill: readonly string[];
  readonly decode: readonly string[];
  readonly secret: string;
  /** Mutual TLS on every control link (docs/tls.md); plain TCP without. */
  readonly tls?: LinkTls;
  readonly maxModelLen: number;
  readonly safety?: Safety;
  /** How long to wait for the nodes and their transfer channels. Default 30 s. */
  readonly connectTimeoutMs?: number;
  /** Per-tenant caps, queue bounds and timeout at the router. */
  readonly fairShare?: FairShareConfig;
  /** A node whose readiness ping takes longer is not ready. */
  readonly pingTimeoutMs?: number;
  /** The router's per-phase histograms (default on; `--no-phase-metrics`). */
  readonly phaseMetrics?: boolean;
  /** This router's slot (`--router-slot`, default 0): each router over the same nodes needs its own. */
  readonly routerSlot?: number;
  /** `--max-migrations`: times a request may migrate mid-stream to another pair (default 2). */
  readonly maxMigrations?: number;
  /** Lost nodes, re-dials and refusals. */
  readonly log?: Logger;
}

/** Re-dial a lost node after this, doubling up to `REDIAL_MAX_MS`. */
export const REDIAL_MS = 100;
export const REDIAL_MAX_MS = 2000;
/** A registered node that admitted no router yet (its slot busy) is dialled this many times, this far apart. */
const JOIN_TRIES = 10;
const JOIN_RETRY_MS = 200;

/** "http://host:port", "tcp://host:port" or "host:port" → host and port. */
export function parseNodeUrl(url: string): { host: string; port: number } {
  const match = /^(?:[a-z]+:\/\/)?(\[[^\]]+\]|[^:/]+):(\d+)\/?$/i.exec(url.trim());
  const port = match === null ? Number.NaN : Number(match[2]);
  if (match === null || !Number.isInteger(port) || port < 1 || port > 65535) {
    throw new KvfenceError(
      "config_invalid",
      `Node address must look like http://127.0.0.1:9001: ${JSON.stringify(url)}`,
    );
  }
  return { host: match[1]!.replace(/^\[|\]$/g, ""), port };
}

/** What dialling a node needs: the secret, TLS, the router slot, and where its refusals are counted. */
type DialOptions = Pick<ClusterRouterOptions, "secret" | "tls" | "routerSlot"> & {
  readonly refusals: LinkAuthFailures;
};

/**
 * Connects the router's control link to one node (`--prefill` or `--decode` `url`) and awaits its
 * hello; a handshake the router refuses (the node answers to another address) is counted in
 * `refusals` by reason.
 */
async function connectNode(
  node: { readonly id: string; readonly url: string; readonly role: "prefill" | "decode" },
  { secret, tls, routerSlot, refusals }: DialOptions,
): Promise<RouterNode> {
  const { id, url, role } = node;
  const { host, port } = parseNodeUrl(url);
  const link = await connectControlLink<ToNode, FromNode>({
    host,
    port,
    secret,
    ...(tls === undefined ? {} : { tls }),
    incarnation: ROUTER_INCARNATION,
    ...(routerSlot === undefined ? {} : { routerSlot }),
  }).catch((err: Error) => {
    if (err instanceof HandshakeError) refusals[err.reason] = (refusals[err.reason] ?? 0) + 1;
    throw err;
  });
  const hello = await new Promise<NodeHello>((resolve, reject) => {
    link.onMessage((m) => {
      if (m.kind === "hello") resolve(m);
    });
    link.onClose(() =>
      reject(
        new KvfenceError(
          "node_unavailable",
          `The node at ${url} closed the link before its hello; it admits one router at a time (its log says why): closed`,
        ),
      ),
    );
  });
  if (hello.role !== role) {
    link.close();
    throw new KvfenceError(
      "config_invalid",
      `The node at ${url} is a ${hello.role} node, listed as --${role}: ${url}`,
    );
  }
  return { id, url, hello, link: link as ControlLink<ToNode, FromNode> };
}

/** Tells `decode` to connect its transfer channel to `prefill`. */
function connectPrefill(decode: RouterNode, prefill: RouterNode): void {
  if (prefill.hello.transferPort === undefined) return;
  try {
    decode.link.send({
      kind: "connect_prefill",
      prefill: prefill.id,
      host: parseNodeUrl(prefill.url).host,
      port: prefill.hello.transferPort,
      incarnation: prefill.hello.incarnation,
    });
  } catch {
    // That decode node's link is closing: it is re-dialled and told again.
  }
}

/**
 * Re-dials every node whose link closes, and pairs it again when it answers, until `retired` says
 * it serves in another role now. Returns `watch`, for a node that joins later (the registry's).
 */
function superviseNodes(
  engine: DisaggregatedEngine,
  options: Pick<ClusterRouterOptions, "secret" | "tls" | "log" | "routerSlot">,
  retired: (node: RouterNode) => boolean = () => false,
): (node: RouterNode) => void {
  const log = options.log;
  const watch = (node: RouterNode): void => {
    node.link.onClose(() => {
      if (engine.closed) return;
      log?.warn({ node: node.id, url: node.url }, "lost the node's control link; re-dialling it");
      redial(node, REDIAL_MS);
    });
  };
  const redial = (lost: RouterNode, delayMs: number): void => {
    const timer = setTimeout(() => {
      // A node that serves in another role now is another node (a role switch): not re-dialled.
      if (engine.closed || retired(lost)) return;
      connectNode(
        { id: lost.id, url: lost.url, role: lost.hello.role },
        { ...options, refusals: engine.dialRefusals },
      ).then(
        (node) => {
          if (!takeBack(engine, node, log)) {
            if (!engine.closed) redial(lost, REDIAL_MAX_MS);
            return;
          }
          watch(node);
          remakeChannels(engine, node, log);
        },
        () => redial(lost, Math.min(REDIAL_MAX_MS, delayMs * 2)),
      );
    }, delayMs);
    timer.unref();
  };
  for (const node of engine.currentNodes) watch(node);
  return watch;
}

/**
 * A lost node answered the re-dial as `node`: true when it takes its place in `engine`; else its
 * link is closed (the engine closed, or refused it).
 */
function takeBack(engine: DisaggregatedEngine, node: RouterNode, log: Logger | undefined): boolean {
  if (engine.closed) {
    node.link.close();
    return false;
  }
  const refused = engine.nodeBack(node);
  if (refused === null) return true;
  log?.error(
    { node: node.id, url: node.url, why: refused },
    "a lost node answered but cannot take its place",
  );
  node.link.close();
  return false;
}

/** A node that is back gets its transfer channels to (or from) every node that is up. */
function remakeChannels(engine: DisaggregatedEngine, node: RouterNode, log: Logger | undefined): void {
  log?.warn(
    { node: node.id, url: node.url, incarnation: node.hello.incarnation },
    "the lost node answers again; re-making its transfer channels",
  );
  const up = engine.nodes().filter((n) => n.up);
  const current = engine.currentNodes.filter((n) => up.some((u) => u.id === n.id));
  if (node.hello.role === "prefill")
    for (const d of current) if (d.hello.role === "decode") connectPrefill(d, node);
  if (node.hello.role === "decode")
    for (const p of current) if (p.hello.role === "prefill") connectPrefill(node, p);
}

/**
 * Why the nodes cannot share KV pages, or null when they all have one KV layout (model shape, page
 * size, KV cache dtype: the handshake's layout signature, src/kvcache/kv-layout.ts): a prefill
 * node's f16 page read as a decode node's f32 one would be garbage, so the router refuses to start.
 */
export function layoutDisagreement(nodes: readonly RouterNode[]): string | null {
  const first = nodes[0];
  if (first === undefined) return null;
  const other = nodes.find((n) => n.hello.layoutSignature !== first.hello.layoutSignature);
  if (other === undefined) return null;
  return `The nodes disagree on the KV layout: ${first.id} at ${first.url} has ${first.hello.layoutSignature}, ${other.id} at ${other.url} has ${other.hello.layoutSignature}; start every node with the same --model, --page-size and --kv-cache-dtype`;
}

export async function connectCluster(options: ClusterRouterOptions): Promise<DisaggregatedEngine> {
  const dial = { ...options, refusals: {} };
  const prefill = await Promise.all(
    options.prefill.map((url, i) => connectNode({ id: `prefill-${i}`, url, role: "prefill" }, dial)),
  );
  const decode = await Promise.all(
    options.decode.map((url, i) => connectNode({ id: `decode-${i}`, url, role: "decode" }, dial)),
  );
  const disagreement = layoutDisagreement([...prefill, ...decode]);
  if (disagreement !== null) {
    for (const n of [...prefill, ...decode]) n.link.close();
    throw new KvfenceError("layout_mismatch", disagreement);
  }
  const engine = new DisaggregatedEngine({
    prefill,
    decode,
    maxModelLen: options.maxModelLen,
    safety: options.safety ?? SAFE,
    ...(options.fairShare === undefined ? {} : { fairShare: options.fairShare }),
    ...(options.pingTimeoutMs === undefined ? {} : { pingTimeoutMs: options.pingTimeoutMs }),
    ...(options.phaseMetrics === undefined ? {} : { phaseMetrics: options.phaseMetrics }),
    ...(options.routerSlot === undefined ? {} : { routerSlot: options.routerSlot }),
    ...(options.maxMigrations === undefined ? {} : { maxMigrations: options.maxMigrations }),
    dialRefusals: dial.refusals,
  });
  superviseNodes(engine, options);
  for (const d of decode) for (const p of prefill) connectPrefill(d, p);
  const deadline = Date.now() + (options.connectTimeoutMs ?? 30_000);
  while (!engine.allPairsUp) {
    if (Date.now() > deadline) {
      await engine.close();
      throw new KvfenceError(
        "node_unavailable",
        "The decode nodes could not connect their transfer channels to every prefill node; check the nodes' logs and --cluster-secret: timeout",
      );
    }
    await new Promise((r) => setTimeout(r, 20));
  }
  return engine;
}

export interface RegistryRouterOptions extends Omit<ClusterRouterOptions, "prefill" | "decode"> {
  readonly registry: RegistryOptions;
  /** Dial registered nodes beyond loopback without TLS (`--insecure-plaintext-links`). */
  readonly plaintextBeyondLoopback?: boolean;
}

const isLoopback = (host: string): boolean => /^(127\.\d+\.\d+\.\d+|::1|localhost)$/.test(host);

/** A registry entry's node id: its role and control address (stable across its restarts). */
export const registryNodeId = (reg: Pick<Registration, "role" | "address">): string =>
  `${reg.role}@${reg.address}`;

/** Why a node's hello does not say what its registry entry says (null: it does). */
function helloMismatch(reg: Registration, hello: NodeHello): string | null {
  const fields = ["role", "incarnation", "layoutSignature", "poolTokens", "pageSize", "maxModelLen"] as const;
  for (const f of fields) {
    if (reg[f] !== hello[f])
      return `its registry entry says ${f} ${String(reg[f])}, its hello ${String(hello[f])}`;
  }
  return null;
}

/**
 * The router over a registry (`--registry etcd://…`): watches the cluster's entries, dials each
 * node an entry names and believes the entry only when the node proves the cluster secret on its
 * own control link, at the entry's very address, and its hello matches the entry (a forged entry
 * pointing elsewhere fails the handshake, a relay to the real node included; one that misstates
 * the node is refused). The engine starts with the first prefill
 * and decode node that pass; each later one joins through `DisaggregatedEngine.addNode` (the
 * pre-flight of every join: layout, page size, pool and context against what the router admits).
 * An entry that goes or drains takes its node out of the membership (no new requests; nothing is
 * freed); one that comes back (a restarted node, a new incarnation) is paired again by the
 * re-dial of its address. Resolves once a pair is up.
 */
export async function connectClusterFromRegistry(given: RegistryRouterOptions): Promise<DisaggregatedEngine> {
  // Its router slot first: `--router-slot`, or the lowest one no router of the cluster holds.
  const claim = await claimRouterSlot(
    given.registry,
    given.routerSlot,
    ROUTER_SLOTS,
    ROUTER_INCARNATION,
    (m) => given.log?.warn(m),
  );
  const options = { ...given, routerSlot: claim.slot };
  options.log?.info({ routerSlot: claim.slot }, "router slot claimed in the registry");
  const membership = new RegistryMembership(options);
  let watch: { close(): void };
  let e: DisaggregatedEngine;
  try {
    watch = await watchRegistry(
      options.registry,
      (entries) => membership.reconcile(entries),
      (m) => options.log?.warn(m),
    );
  } catch (err) {
    await claim.close();
    throw err;
  }
  try {
    e = await membership.started(options.connectTimeoutMs ?? 30_000);
  } catch (err) {
    watch.close();
    await claim.close();
    throw err;
  }
  const close = e.close.bind(e);
  e.close = async () => {
    watch.close();
    await close();
    await claim.close();
  };
  const until = Date.now() + (options.connectTimeoutMs ?? 30_000);
  while (!e.allPairsUp && Date.now() < until) await new Promise((r) => setTimeout(r, 20));
  return e;
}

/** The registry's entries turned into the engine's nodes (see `connectClusterFromRegistry`). */
class RegistryMembership {
  #engine: DisaggregatedEngine | null = null;
  #watchNode: ((node: RouterNode) => void) | null = null;
  /** Nodes admitted before the engine exists (it starts with a prefill and a decode node). */
  readonly #first: RouterNode[] = [];
  /** Ids being dialled, and the incarnation a refusal was logged for (not dialled again). */
  readonly #dialling = new Set<string>();
  readonly #refused = new Map<string, number>();
  /** The router's own handshake refusals (before and after the engine starts). */
  readonly #refusals: LinkAuthFailures = {};
  #latest: ReadonlyMap<string, Registration> = new Map();
  #ready: (e: DisaggregatedEngine) => void = () => {};
  readonly #start: Promise<DisaggregatedEngine>;

  constructor(private readonly options: RegistryRouterOptions) {
    this.#start = new Promise((resolve) => {
      this.#ready = resolve;
    });
  }

  /** The engine, once a prefill and a decode node joined; rejects after `timeoutMs`. */
  started(timeoutMs: number): Promise<DisaggregatedEngine> {
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(
        () =>
          reject(
            new KvfenceError(
              "node_unavailable",
              "No prefill and decode node of the registry joined; check the nodes' --registry, their logs and --cluster-secret: timeout",
            ),
          ),
        timeoutMs,
      );
    });
    return Promise.race([this.#start, timeout]).finally(() => clearTimeout(timer));
  }

  /** The entries now: dial the new ones, set every known node's membership. */
  reconcile(entries: ReadonlyMap<string, Registration>): void {
    this.#latest = new Map(entries);
    for (const n of this.#engine?.nodes() ?? []) if (!n.up) this.#retired(n.id);
    const members = new Set<string>();
    for (const reg of entries.values()) {
      const id = registryNodeId(reg);
      if (!reg.draining) members.add(id);
      if (this.#known(id) || this.#dialling.has(id) || this.#refused.get(id) === reg.incarnation) continue;
      this.#join(reg);
    }
    const engine = this.#engine;
    if (engine !== null) for (const n of engine.nodes()) engine.setMember(n.id, members.has(n.id));
  }

  /**
   * Whether node `id` is lost and its address is registered in the other role now (a role switch,
   * `kvfence role`): then it leaves the engine for good (`removeNode`) and is not re-dialled; the
   * new role's entry joins as another node.
   */
  readonly #retired = (id: string): boolean => {
    const engine = this.#engine;
    const node = engine?.nodes().find((n) => n.id === id);
    if (engine === null || node === undefined) return true;
    if (node.up) return false;
    const other = node.role === "prefill" ? "decode" : "prefill";
    const address = id.slice(id.indexOf("@") + 1);
    if (![...this.#latest.values()].some((r) => r.role === other && r.address === address)) return false;
    const why = engine.removeNode(id);
    if (why !== null) return false;
    this.options.log?.warn(
      { node: id, now: `${other}@${address}` },
      "the node changed role; its old place goes",
    );
    return true;
  };

  #known(id: string): boolean {
    return this.#engine?.nodes().some((n) => n.id === id) ?? this.#first.some((n) => n.id === id);
  }

  #refuse(id: string, reg: Registration, why: string): void {
    if (this.#refused.get(id) !== reg.incarnation)
      this.options.log?.error(
        { node: id, url: reg.address, why },
        "a registered node cannot join the cluster",
      );
    this.#refused.set(id, reg.incarnation);
  }

  /** Why the router will not dial `reg`'s address at all (null: it dials). */
  #undialable(reg: Registration): string | null {
    let host: string;
    try {
      host = parseNodeUrl(reg.address).host;
    } catch {
      return "its address is not host:port";
    }
    if (this.options.tls === undefined && this.options.plaintextBeyondLoopback !== true && !isLoopback(host))
      return "it is beyond loopback and the links have no TLS (give --tls-cert/--tls-key/--tls-ca, or --insecure-plaintext-links)";
    return null;
  }

  /** Dials `reg`'s node; `tries`: a node that admitted no router in its slot yet is dialled again. */
  #join(reg: Registration, tries = JOIN_TRIES): void {
    const id = registryNodeId(reg);
    const undialable = this.#undialable(reg);
    if (undialable !== null) {
      this.#refuse(id, reg, undialable);
      return;
    }
    this.#dialling.add(id);
    connectNode({ id, url: reg.address, role: reg.role }, { ...this.options, refusals: this.#refusals }).then(
      (node) => {
        this.#dialling.delete(id);
        this.#admit(reg, node);
      },
      (err: Error) => {
        // The node closed the link before its hello: its router slot was busy (this router's
        // last dial of its old role, during a role switch). Dialled again, a few times.
        const still = [...this.#latest.values()].some(
          (r) => registryNodeId(r) === id && r.incarnation === reg.incarnation,
        );
        if (tries > 1 && still && /before its hello/.test(err.message)) {
          setTimeout(() => {
            this.#dialling.delete(id);
            if (!(this.#engine?.closed ?? false)) this.#join(reg, tries - 1);
          }, JOIN_RETRY_MS).unref();
          return;
        }
        this.#dialling.delete(id);
        // Not the node the entry says (no secret), or not there: never believed.
        this.#refuse(id, reg, `its control link failed: ${err.message}`);
      },
    );
  }

  /** `node` proved the secret at `reg`'s address: it joins, if its hello is the entry's and it fits. */
  #admit(reg: Registration, node: RouterNode): void {
    const engine = this.#engine;
    const why = helloMismatch(reg, node.hello) ?? (engine === null ? null : engine.addNode(node));
    if (why !== null || (engine?.closed ?? false)) {
      node.link.close();
      if (why !== null) this.#refuse(node.id, reg, why);
      return;
    }
    if (engine === null) {
      this.#first.push(node);
      this.#startEngine();
      return;
    }
    this.#watchNode!(node);
    remakeChannels(engine, node, this.options.log);
    this.reconcile(this.#latest);
  }

  #startEngine(): void {
    const prefill = this.#first.filter((n) => n.hello.role === "prefill");
    const decode = this.#first.filter((n) => n.hello.role === "decode");
    if (prefill.length === 0 || decode.length === 0) return;
    const o = this.options;
    const engine = new DisaggregatedEngine({
      prefill,
      decode,
      maxModelLen: o.maxModelLen,
      safety: o.safety ?? SAFE,
      ...(o.fairShare === undefined ? {} : { fairShare: o.fairShare }),
      ...(o.pingTimeoutMs === undefined ? {} : { pingTimeoutMs: o.pingTimeoutMs }),
      ...(o.phaseMetrics === undefined ? {} : { phaseMetrics: o.phaseMetrics }),
      ...(o.routerSlot === undefined ? {} : { routerSlot: o.routerSlot }),
      ...(o.maxMigrations === undefined ? {} : { maxMigrations: o.maxMigrations }),
      dialRefusals: this.#refusals,
    });
    this.#engine = engine;
    this.#watchNode = superviseNodes(engine, o, (node) => this.#retired(node.id));
    for (const d of decode) for (const p of prefill) connectPrefill(d, p);
    this.#ready(engine);
    this.reconcile(this.#latest);
  }
}
