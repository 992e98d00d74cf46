/**
 * The router's pool of (prefill, decode) node pairs: who is in it, what each node holds by the
 * router's ledger, and which pair takes the next request. As undici's `PoolBase` owns membership
 * and dispatch while its pools override only the policy that picks, `PairPool` owns the nodes,
 * their pairs and the ledger, and a `PairPolicy` picks among the pairs that can take a request
 * (src/cluster/kv-routing-policy.ts is the default).
 *
 * Membership: every node has a slot, and each slot is paired with every slot of the other role;
 * each pair runs its own router state machine (`state`), so a node's loss reaches only the
 * requests that use it. A node joins (`add`), is lost and comes back as a new incarnation
 * (`back`), leaves and rejoins the registry's membership (`setMember`), or goes for good once lost
 * when it came back in another role (`remove`, a role switch); a joining node must
 * fit what the router admits (its KV layout, page size, pool and context: `admits`).
 *
 * The ledger: the KV pages the router's dispatched requests reserve on each node (decode: prompt
 * + max_tokens; prefill: the prompt, until the commit) against its pool, and at most
 * `DECODE_WINDOW` times decode's sequence slots of requests. A node that refused a request for
 * want of pages the ledger cannot see (quarantined after an abort) is `full`: it takes nothing
 * more until it reports freed pages.
 *
 * Choice (`take`): the pairs usable now (up, both nodes there, answering their readiness pings
 * and members) with room by the ledger, in round-robin order from the pair after the last one
 * taken, go to the policy; the pair it picks has the request's pages booked. The default policy
 * routes by where the KV lives (kv-routing-policy.ts): the pool hands it the nodes' cache events.
 */

import type { NodeInfo } from "../admin-api/admin-wire.js";
import type { CacheEventsMessage, FromNode, Link, NodeHello, ToNode } from "../links/node-messages.js";
import type { EngineCapacity, EngineHealth, GenerationRequest } from "../protocol/engine-api.js";
import { initialRouterState, type RouterState } from "../protocol/router-machine.js";

/** One node as the router holds it. */
export interface RouterNode {
  readonly id: string;
  readonly url: string;
  readonly hello: NodeHello;
  readonly link: Link<ToNode, FromNode>;
}

/** A node's place in the router: the node of its current incarnation, and what the router knows of it. */
export interface NodeSlot {
  readonly id: string;
  readonly role: "prefill" | "decode";
  node: RouterNode;
  /** The link closed and the node has not come back. */
  lost: boolean;
  /** False while a readiness ping is unanswered past the deadline (src/cluster/node-pings.ts). */
  answering: boolean;
  /** KV pages the router's dispatched requests reserve on this node. */
  usedPages: number;
  /** Requests dispatched to this decode node. */
  running: number;
  /** It refused a request for want of pages: nothing more until it reports `pages_freed`. */
  full: boolean;
  /**
   * In the cluster's membership: always with static lists; with a registry, while its entry is
   * there and not draining. A node out of it takes no new request; its requests in flight go on
   * and nothing of it is freed (only the fence, its link's close, does that).
   */
  member: boolean;
  /** Pages its prefix cache held at its last pong (null: no cache). */
  cachedPages: number | null;
}

/** A prefill node and a decode node, with the router state machine of their requests. */
export interface NodePair {
  readonly key: string;
  readonly prefill: NodeSlot;
  readonly decode: NodeSlot;
  readonly state: RouterState;
  /** Decode's transfer channel to the prefill node is up. */
  up: boolean;
}

/** What one dispatch reserves on a pair's nodes by the ledger, and what the policy may prefer it by. */
export interface PairDemand {
  /** On decode: prompt + max_tokens (a group of samples: every sample's, the prompt's full pages once). */
  readonly decodePages: number;
  /** On prefill: the prompt, until the commit. */
  readonly prefillPages: number;
  /** The policy's key for it (`PairPolicy.affinityKey`), or null. */
  readonly affinityKey: string | null;
  /** Its prompt's chain keys, for a policy that routes by the nodes' caches (`PairPolicy.chainOf`). */
  readonly chain?: PromptChain | null;
  /**
   * The pair its last attempt lost a node on or failed on (src/cluster/migration.ts): a pair
   * sharing neither node is offered first. The router may not know yet which node is gone: a
   * decode node can report a prefill node's loss before the prefill link closes.
   */
  readonly avoid?: NodePair | null;
}

/**
 * A prompt's prefix-cache chain keys as its prefill node computes them (`prefixBlockKey` under the
 * request's salt), computed on the first call (src/cluster/kv-routing-policy.ts).
 */
export interface PromptChain {
  readonly tenant: number;
  keys(): readonly string[];
}

/** Why a policy that routes by the nodes' caches picked a pair (`kvfence_routing_decisions_total`). */
export type RoutingReason = "cache_hit" | "load" | "fallback";

/** What such a policy reports for metrics and `/kvfence/nodes`. */
export interface RoutingReport {
  /** Keys its KV index holds, over every node. */
  readonly indexKeys: number;
  readonly decisions: Readonly<Record<RoutingReason, number>>;
}

/** Which pair takes a request, among those that can (undici's pools differ only in this). */
export interface PairPolicy {
  /**
   * The pair for `demand` among `candidates` — the pairs usable now with room for it, in
   * round-robin order from the pair after the last one taken (never empty) — or null to leave it
   * waiting. Called once per dispatch: a policy that remembers its picks remembers this one.
   */
  pick(candidates: readonly NodePair[], demand: PairDemand): NodePair | null;
  /** The key of `request` that `pick` sees as `demand.affinityKey`, computed once at submit. */
  affinityKey?(request: GenerationRequest, pageSize: number): string | null;
  /** The chain of `request` that `pick` sees as `demand.chain` (made at submit, its keys computed when used). */
  chainOf?(request: GenerationRequest, pageSize: number): PromptChain | null;
  /** Node `node`'s cache events (src/node/cache-events.ts). */
  cacheEvents?(node: string, message: CacheEventsMessage): void;
  /** Node `node` is lost: what it cached is gone. */
  nodeLost?(node: string): void;
  /** Keys known for `node` (`/kvfence/nodes`), and the totals (metrics). */
  indexedKeys?(node: string): number;
  routing?(): RoutingReport;
}

/** Decode sequence slots of a node that does not say (an older hello). */
const DEFAULT_SLOTS = 16;
/**
 * A decode node is sent at most this many times its sequence slots of requests at once: enough
 * that the ones in prefill keep its batch full, few enough that the rest wait at the router, in
 * fair order, rather than in the node's own first-come queue.
 */
export const DECODE_WINDOW = 2;

/** A decode node's sequence slots, by its hello. */
export const sequenceSlots = (hello: NodeHello): number => hello.maxSequences ?? DEFAULT_SLOTS;

/** A node's KV pool in pages. */
export const poolPages = (slot: NodeSlot): number =>
  Math.floor(slot.node.hello.poolTokens / slot.node.hello.pageSize);

export interface PairPoolOptions {
  readonly prefill: readonly RouterNode[];
  readonly decode: readonly RouterNode[];
  /** What the router admits: a node joining or coming back must hold at least this pool and context. */
  readonly admitted: Pick<EngineCapacity, "poolTokens" | "maxModelLen">;
  readonly policy: PairPolicy;
}

export class PairPool {
  readonly #slots: NodeSlot[] = [];
  readonly #pairs: NodePair[] = [];
  readonly #admitted: Pick<EngineCapacity, "poolTokens" | "maxModelLen">;
  readonly #policy: PairPolicy;
  /** Where the next round-robin pass starts. */
  #next = 0;

  constructor(options: PairPoolOptions) {
    this.#admitted = options.admitted;
    this.#policy = options.policy;
    const prefill = options.prefill.map(newSlot);
    const decode = options.decode.map(newSlot);
    this.#slots.push(...prefill, ...decode);
    for (const p of prefill) for (const d of decode) this.#pair(p, d);
  }

  /** Every node's slot: the prefill nodes', the decode nodes', then those that joined. */
  get slots(): readonly NodeSlot[] {
    return this.#slots;
  }

  get pairs(): readonly NodePair[] {
    return this.#pairs;
  }

  /** The pages of every decode pool (the fair share's capacity). */
  get decodePages(): number {
    return this.#slots.filter((s) => s.role === "decode").reduce((sum, d) => sum + poolPages(d), 0);
  }

  /** The smallest decode pool in pages: a group of samples larger than it never runs at once. */
  get smallestDecodePages(): number {
    return Math.min(...this.#slots.filter((s) => s.role === "decode").map(poolPages));
  }

  /** The policy's key of `request` (null: the policy has none). */
  affinityKey(request: GenerationRequest, pageSize: number): string | null {
    return this.#policy.affinityKey?.(request, pageSize) ?? null;
  }

  /** The policy's chain of `request` (null: the policy routes by no cache). */
  chainOf(request: GenerationRequest, pageSize: number): PromptChain | null {
    return this.#policy.chainOf?.(request, pageSize) ?? null;
  }

  /** Node `slot`'s cache events, to the policy. */
  cacheEvents(slot: NodeSlot, message: CacheEventsMessage): void {
    this.#policy.cacheEvents?.(slot.id, message);
  }

  /** Node `slot` is lost: the policy forgets what it cached. */
  cacheLost(slot: NodeSlot): void {
    this.#policy.nodeLost?.(slot.id);
  }

  /** The policy's routing report (null: it routes by no cache). */
  routing(): RoutingReport | null {
    return this.#policy.routing?.() ?? null;
  }

  /**
   * A node joins the running cluster: it is paired with every node of the other role (its pairs
   * come up with decode's transfer channel). Returns its slot, or why it cannot join (an id
   * already here, or `admits`'s refusal).
   */
  add(node: RouterNode): NodeSlot | string {
    if (this.#slots.some((s) => s.id === node.id)) return `a node ${node.id} is already in this cluster`;
    const refused = this.admits(node.hello);
    if (refused !== null) return refused;
    const slot = newSlot(node);
    this.#slots.push(slot);
    for (const other of this.#slots) {
      if (other.role === slot.role) continue;
      if (slot.role === "prefill") this.#pair(slot, other);
      else this.#pair(other, slot);
    }
    return slot;
  }

  /**
   * A lost node answered again (possibly a new incarnation after a restart): it takes its place
   * back, answering and with room. Returns its slot, or why it cannot (no such node, not lost,
   * another role, layout or page size, a smaller pool or context than the router admits).
   */
  back(node: RouterNode): NodeSlot | string {
    const slot = this.#slots.find((s) => s.id === node.id);
    if (slot === undefined) return `no node ${node.id} in this cluster`;
    const was = slot.node.hello;
    const now = node.hello;
    const { poolTokens, maxModelLen } = this.#admitted;
    if (!slot.lost) return `node ${node.id} is not lost`;
    if (now.role !== was.role) return `it is a ${now.role} node now, not ${was.role}`;
    if (now.layoutSignature !== was.layoutSignature || now.pageSize !== was.pageSize)
      return "its KV layout or page size changed";
    if (now.poolTokens < poolTokens || now.maxModelLen < maxModelLen)
      return `its pool (${now.poolTokens} tokens) or context (${now.maxModelLen}) is below what the router admits (${poolTokens}, ${maxModelLen})`;
    slot.node = node;
    slot.lost = false;
    slot.answering = true;
    slot.full = false;
    return slot;
  }

  /**
   * Node `id` leaves the cluster for good (it came back in another role, under another id): its
   * slot and its pairs go (its pings and stats were forgotten when it was lost). Only a lost node
   * none of whose pairs has a request in flight; returns why it cannot go, else null.
   */
  remove(id: string): string | null {
    const slot = this.#slots.find((s) => s.id === id);
    if (slot === undefined) return `no node ${id} in this cluster`;
    if (!slot.lost) return `node ${id} is not lost`;
    const mine = (p: NodePair) => p.prefill === slot || p.decode === slot;
    if (this.#pairs.some((p) => mine(p) && Object.keys(p.state.requests).length > 0))
      return `node ${id} still has requests in flight`;
    this.#slots.splice(this.#slots.indexOf(slot), 1);
    for (let i = this.#pairs.length - 1; i >= 0; i--) if (mine(this.#pairs[i]!)) this.#pairs.splice(i, 1);
    this.#next = 0;
    return null;
  }

  /** Whether a node with `hello` fits what this router admits (null), or why not. */
  admits(hello: NodeHello): string | null {
    const like = this.#slots[0]!.node.hello;
    const { poolTokens, maxModelLen } = this.#admitted;
    if (hello.layoutSignature !== like.layoutSignature || hello.pageSize !== like.pageSize)
      return `its KV layout (${hello.layoutSignature}, page ${hello.pageSize}) differs from the cluster's (${like.layoutSignature}, page ${like.pageSize})`;
    if (hello.poolTokens < poolTokens || hello.maxModelLen < maxModelLen)
      return `its pool (${hello.poolTokens} tokens) or context (${hello.maxModelLen}) is below what the router admits (${poolTokens}, ${maxModelLen})`;
    return null;
  }

  /** Node `id` is in the membership or not; true when it just came in (it may take requests again). */
  setMember(id: string, member: boolean): boolean {
    const slot = this.#slots.find((s) => s.id === id);
    if (slot === undefined || slot.member === member) return false;
    slot.member = member;
    return member;
  }

  /** Whether some pair is up with both its nodes there (answering or not, members or not). */
  anyPairUp(): boolean {
    return this.#pairs.some((p) => p.up && !p.prefill.lost && !p.decode.lost);
  }

  /** A pair that can take a request now: up, both nodes there, answering and members. */
  usable(pair: NodePair): boolean {
    const { prefill, decode } = pair;
    return (
      pair.up &&
      !prefill.lost &&
      !decode.lost &&
      prefill.answering &&
      decode.answering &&
      prefill.member &&
      decode.member
    );
  }

  /**
   * The pair the policy picks for `demand` among the usable ones with room, its pages booked in
   * the ledger; null when none can take it now.
   */
  take(demand: PairDemand): NodePair | null {
    const n = this.#pairs.length;
    const candidates: NodePair[] = [];
    for (let i = 0; i < n; i++) {
      const pair = this.#pairs[(this.#next + i) % n]!;
      if (this.usable(pair) && this.#fits(pair, demand)) candidates.push(pair);
    }
    const avoid = demand.avoid;
    const apart =
      avoid == null
        ? candidates
        : candidates.filter((p) => p.prefill !== avoid.prefill && p.decode !== avoid.decode);
    const offered = apart.length > 0 ? apart : candidates;
    const pair = offered.length === 0 ? null : this.#policy.pick(offered, demand);
    if (pair === null) return null;
    this.#next = (this.#pairs.indexOf(pair) + 1) % n;
    pair.decode.usedPages += demand.decodePages;
    pair.decode.running++;
    pair.prefill.usedPages += demand.prefillPages;
    return pair;
  }

  /** The attempt of `demand` on `pair` ended: its decode reservation leaves the ledger. */
  releaseDecode(pair: NodePair, demand: PairDemand): void {
    pair.decode.usedPages -= demand.decodePages;
    pair.decode.running--;
  }

  /** Its prefill pages leave the ledger (at the commit, or when the attempt ends before it). */
  releasePrefill(pair: NodePair, demand: PairDemand): void {
    pair.prefill.usedPages -= demand.prefillPages;
  }

  /**
   * `slot` refused a request needing `pages` for want of pages: it takes nothing more until it
   * reports freed pages. False (nothing marked) when the request is larger than that whole pool:
   * it would wait forever.
   */
  refusedForPages(slot: NodeSlot, pages: number): boolean {
    if (pages > poolPages(slot)) return false;
    slot.full = true;
    return true;
  }

  /** Readiness: a pair is usable (and the router is not closing), with each role's answering nodes. */
  health(closed: boolean): EngineHealth {
    const count = (role: "prefill" | "decode") => {
      const of = this.#slots.filter((s) => s.role === role);
      return { ready: of.filter((s) => !s.lost && s.answering).length, total: of.length };
    };
    const prefill = count("prefill");
    const decode = count("decode");
    const ready = !closed && this.#pairs.some((p) => this.usable(p));
    let reason: string | null = null;
    if (closed) reason = "the server is shutting down";
    else if (prefill.ready === 0) reason = `no prefill node answers (0 of ${prefill.total})`;
    else if (decode.ready === 0) reason = `no decode node answers (0 of ${decode.total})`;
    else if (!ready)
      reason = "no decode node that answers has its transfer channel to a prefill node that answers";
    return { live: true, ready, reason, prefill, decode };
  }

  /** The nodes for `/kvfence/nodes`. */
  nodes(): NodeInfo[] {
    return this.#slots.map((s) => ({
      id: s.id,
      role: s.role,
      url: s.node.url,
      pool_tokens: s.node.hello.poolTokens,
      page_size: s.node.hello.pageSize,
      max_model_len: s.node.hello.maxModelLen,
      up: !s.lost,
      member: s.member,
      ...(s.cachedPages === null ? {} : { cached_pages: s.cachedPages }),
      ...(this.#policy.indexedKeys === undefined ? {} : { indexed_keys: this.#policy.indexedKeys(s.id) }),
    }));
  }

  /** Whether `pair`'s nodes have room for `demand` by the ledger. */
  #fits(pair: NodePair, demand: PairDemand): boolean {
    const { prefill, decode } = pair;
    if (prefill.full || decode.full) return false;
    if (decode.running >= DECODE_WINDOW * sequenceSlots(decode.node.hello)) return false;
    // An empty node always takes one (a request larger than its pool is refused at its door).
    const room = (slot: NodeSlot, pages: number) =>
      slot.usedPages === 0 || slot.usedPages + pages <= poolPages(slot);
    return room(decode, demand.decodePages) && room(prefill, demand.prefillPages);
  }

  #pair(prefill: NodeSlot, decode: NodeSlot): void {
    this.#pairs.push({
      key: `${prefill.id}|${decode.id}`,
      prefill,
      decode,
      state: initialRouterState(),
      up: false,
    });
  }
}

/** A node's slot as it joins: up, answering, nothing booked on it, in the membership. */
function newSlot(node: RouterNode): NodeSlot {
  return {
    id: node.id,
    role: node.hello.role,
    node,
    lost: false,
    answering: true,
    usedPages: 0,
    running: 0,
    full: false,
    member: true,
    cachedPages: null,
  };
}
