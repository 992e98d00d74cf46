/**
 * The router side of the disaggregated topology: an `EngineHandle` (so the HTTP layer is the same
 * as with one engine) that runs the protocol's router state machine (`routerStep`) and talks to the
 * prefill and decode nodes over `Link`s — MessagePorts of worker threads or authenticated TCP links
 * of processes. This file is the wiring; each part has its own module:
 *
 * - `PairPool` (pair-pool.ts): the nodes, their (prefill, decode) pairs and the router's page
 *   ledger; a `PairPolicy` picks the pair (kv-routing-policy.ts by default: by where the KV lives,
 *   from the nodes' cache events).
 * - `FairShare` (src/fair-share/fair-share.ts): where requests wait, fairly between tenants.
 * - `SampleGroups` (sample-group.ts): n > 1 as one group riding on its first sample's attempt.
 * - `NodePings` (node-pings.ts) readiness, `NodeStatsPoller` (node-stats.ts) statistics,
 *   `AttemptRids` (attempt-rids.ts) the rids attempts go out under.
 *
 * One router state machine per pair, so a node's loss (`peer_lost`) reaches only the requests that
 * use it. The effective context length is the least of the model's window and every node's pool
 * and context length; each node re-checks at its own door and its rejection reaches the client
 * unchanged. Effects become link messages (the prompt's token ids and the sampling parameters ride
 * along), `GenerationEvents` calls, and, on `respond`, the end of the request. A link's close is
 * the node's loss: every in-flight attempt on it ends with `node_unavailable` (its request runs
 * again elsewhere, or fails with 503: migration.ts); decode nodes
 * hear of a lost prefill node and fence it. A lost node that comes back (`nodeBack`, the cluster
 * router re-dials it) is paired again once decode's transfer channel to it is up.
 *
 * Requests wait in one place, fairly: a `FairShare` holds each tenant's queue, caps what each
 * tenant may hold (requests, KV pages) and bounds the queue (429 for a tenant over its share, 503
 * when the server is full, a queue timeout). A request is dispatched to a pair with room by the
 * ledger when its turn comes. A node may still refuse for want of pages (`pool_exhausted`: pages
 * quarantined after an abort, that the ledger cannot see): the request goes back to the front of
 * its tenant's queue, to be submitted again as a fresh attempt under a new internal request id
 * (the refused one is tombstoned), and that node takes nothing more until it reports freed pages
 * (`pages_freed`). No timer frees or waits for pages. A request whose pair lost a node before its
 * first token runs again on another pair, once; after it, it migrates (migration.ts).
 *
 * Readiness (`health()`, `/ready`): a node whose readiness pong is late is not answering and gets
 * no new requests until it answers again; ready means a pair is up with both its nodes answering.
 */

import type { NodeInfo } from "../admin-api/admin-wire.js";
import { FairShare, type FairShareConfig, resolveFairShare } from "../fair-share/fair-share.js";
import type { WireError } from "../lib/errors.js";
import { PHASE, PhaseRecorder } from "../lib/phase-histograms.js";
import { epochOf, traceSpan, tracing } from "../lib/tracing.js";
import type { FromNode, NodeHello, NodeStats, ToNode } from "../links/node-messages.js";
import type { Effects, RespondEffect, TokensEffect } from "../protocol/effects.js";
import type {
  EngineCapacity,
  EngineHandle,
  EngineHealth,
  EngineStats,
  GenerationEvents,
  GenerationRequest,
  NodeViews,
} from "../protocol/engine-api.js";
import {
  type RouterConfig,
  type RouterContext,
  type RouterEvent,
  routerStep,
} from "../protocol/router-machine.js";
import { faultOn, guardOn, type Safety } from "../protocol/safety.js";
import type { ControlMessage } from "../protocol/wire.js";
import type { LinkAuthFailures } from "../transfer/link-guard.js";
import { AttemptRids } from "./attempt-rids.js";
import { KvRoutingPolicy } from "./kv-routing-policy.js";
import { Migrations, resumedTokens } from "./migration.js";
import { NodePings } from "./node-pings.js";
import { NodeStatsPoller, nodeView } from "./node-stats.js";
import {
  type NodePair,
  type NodeSlot,
  type PairPolicy,
  PairPool,
  type RouterNode,
  type RoutingReport,
  sequenceSlots,
} from "./pair-pool.js";
import { type PendingRequest, pendingRequest, usageOf } from "./pending-request.js";
import { isRider, SampleGroups, withRiders } from "./sample-group.js";

export type { RouterNode } from "./pair-pool.js";

export interface DisaggregatedEngineOptions {
  readonly prefill: readonly RouterNode[];
  readonly decode: readonly RouterNode[];
  /** The model's window (and `--max-model-len`). */
  readonly maxModelLen: number;
  readonly safety: Safety;
  /** Attempts per request (1 = no retry). Default 1. */
  readonly maxAttempts?: number;
  /** Per-tenant caps, queue bounds and timeout (`maxQueue` 0: a full pool answers 503). Default: one tenant. */
  readonly fairShare?: FairShareConfig;
  /** A node whose pong takes longer is not answering (not ready). Default 500 ms. */
  readonly pingTimeoutMs?: number;
  /** Record the router's per-phase histograms (src/lib/phase-histograms.ts). Default true. */
  readonly phaseMetrics?: boolean;
  /**
   * This router's slot (`--router-slot`, 0 to `ROUTER_SLOTS - 1`, default 0): its attempts go out
   * under rids of that slot only, so several routers over the same nodes never share a rid
   * (docs/protocol.md §3, item 13).
   */
  readonly routerSlot?: number;
  /** The router's own refusals of nodes it dialled, by reason (cluster-router.ts); kept, not copied. */
  readonly dialRefusals?: LinkAuthFailures;
  /** Which pair takes a request among those that can. Default: `KvRoutingPolicy`. */
  readonly pairPolicy?: PairPolicy;
  /** `--max-migrations`: times a request may migrate mid-stream (migration.ts). Default 2. */
  readonly maxMigrations?: number;
}

export class DisaggregatedEngine implements EngineHandle {
  readonly capacity: EngineCapacity;
  readonly #config: RouterConfig;
  readonly #pool: PairPool;
  /** Every dispatched attempt by its rid (a group's riders each under their own). */
  readonly #requests = new Map<number, PendingRequest>();
  /** The node message being handled (its log-probabilities go with the tokens it yields), or null. */
  #incoming: (FromNode & { kind: "protocol" }) | null = null;
  /** Every open request by the client's rid: waiting or dispatched. */
  readonly #open = new Map<number, PendingRequest>();
  readonly #groups = new SampleGroups<PendingRequest>();
  readonly #stats = new NodeStatsPoller();
  readonly #out: Effects = [];
  readonly #routerContext: RouterContext;
  readonly #share: FairShare<PendingRequest>;
  readonly #observers: ((node: RouterNode, msg: ControlMessage) => void)[] = [];
  readonly #pings: NodePings;
  #closed = false;
  /** Requests aborted by the router (`abort` of a live or waiting request). */
  #aborts = 0;
  /** The router's phases: queue wait (submit to dispatch), reservation (reserve to lease), first token. */
  readonly phases: PhaseRecorder;
  /** The rids its attempts go out under (of `DisaggregatedEngineOptions.routerSlot`). */
  readonly #rids: AttemptRids;
  /** See `DisaggregatedEngineOptions.dialRefusals` (`kvfence_router_link_refusals_total`). */
  readonly dialRefusals: LinkAuthFailures;
  /** Requests moved to another pair after a node's loss or failure (`kvfence_migrations_total`). */
  readonly migrations: Migrations;

  constructor(options: DisaggregatedEngineOptions) {
    if (options.prefill.length === 0 || options.decode.length === 0) {
      throw new Error("A disaggregated engine needs at least one prefill node and one decode node");
    }
    this.#rids = new AttemptRids(options.routerSlot ?? 0);
    this.dialRefusals = options.dialRefusals ?? {};
    this.migrations = new Migrations(options.maxMigrations);
    this.phases = new PhaseRecorder(options.phaseMetrics ?? true);
    const nodes = [...options.prefill, ...options.decode];
    const min = (f: (n: RouterNode) => number, list: readonly RouterNode[]) => Math.min(...list.map(f));
    const pageSize = options.decode[0]!.hello.pageSize;
    const nodeLimit = min((n) => Math.min(n.hello.maxModelLen, n.hello.poolTokens), nodes);
    this.#config = {
      maxModelLen: Math.min(
        options.maxModelLen,
        min((n) => n.hello.maxModelLen, nodes),
      ),
      prefillPoolTokens: min((n) => n.hello.poolTokens, options.prefill),
      decodePoolTokens: min((n) => n.hello.poolTokens, options.decode),
      maxAttempts: options.maxAttempts ?? 1,
    };
    this.#routerContext = { config: this.#config, safety: options.safety, out: this.#out };
    // The undersized-pool fault with the admission doors off: the HTTP door trusts the model's
    // window alone (no min over the pools), as in the incident.
    const trustWindow =
      faultOn(options.safety, "undersized-pool") && !guardOn(options.safety, "admission-doors");
    const slots = options.decode.reduce((s, n) => s + sequenceSlots(n.hello), 0);
    this.capacity = Object.freeze({
      poolTokens: trustWindow
        ? Math.max(...nodes.map((n) => n.hello.poolTokens), this.#config.maxModelLen)
        : min((n) => n.hello.poolTokens, nodes),
      pageSize,
      maxModelLen: trustWindow ? this.#config.maxModelLen : Math.min(options.maxModelLen, nodeLimit),
      maxSequences: slots,
    });
    this.#pool = new PairPool({
      prefill: options.prefill,
      decode: options.decode,
      admitted: this.capacity,
      policy: options.pairPolicy ?? new KvRoutingPolicy({ safety: options.safety }),
    });
    this.#share = new FairShare<PendingRequest>(
      resolveFairShare(options.fairShare ?? { tenants: 1 }, { pages: this.#pool.decodePages, slots }),
      {
        tenant: (p) => p.request.tenant,
        pages: (p) => p.decodePages,
        // A group forked on decode runs each of its samples: they count against the tenant's cap.
        size: (p) => withRiders(p).length,
        group: (p) => p.request.group,
        dispatch: (p) => this.#dispatch(p),
        expire: (p, error) => {
          for (const x of withRiders(p)) {
            this.#open.delete(x.request.rid);
            if (!x.silenced) x.events.onError(error);
          }
        },
      },
    );
    for (const s of this.#pool.slots) {
      this.#listen(s, s.node);
      this.#rids.raiseFloor(s.node.hello);
    }
    this.#pings = new NodePings({
      slots: () => this.#pool.slots,
      ...(options.pingTimeoutMs === undefined ? {} : { timeoutMs: options.pingTimeoutMs }),
      onAnswering: () => this.#share.pump(),
    });
  }

  /** Marks the transfer channel of a (prefill, decode) pair up (the decode node connected to the prefill node). */
  pairUp(prefillId: string, decodeId: string, up = true): void {
    for (const pair of this.#pool.pairs) {
      if (pair.prefill.id !== prefillId || pair.decode.id !== decodeId) continue;
      pair.up = up;
      if (!up) continue;
      // Both ends may be new incarnations: they hear the pair's watermark (their tombstones of
      // older rids can go).
      this.#step(pair, { type: "peer_up", role: "decode" });
      this.#step(pair, { type: "peer_up", role: "prefill" });
    }
    if (up) this.#share.pump();
  }

  /** True once `close()` was called. */
  get closed(): boolean {
    return this.#closed;
  }

  /** True when every pair's transfer channel is up. */
  get allPairsUp(): boolean {
    return this.#pool.pairs.every((p) => p.up);
  }

  /** Requests submitted and not yet ended (waiting ones included). */
  get inFlight(): number {
    return this.#open.size;
  }

  /** Requests waiting for their turn or for room now. */
  get waiting(): number {
    return this.#share.waiting;
  }

  /** The fair share in front of the nodes (its queue and per-tenant counts). */
  get fairShare(): FairShare<PendingRequest> {
    return this.#share;
  }

  /**
   * Calls `listener` after the router state machine handled each protocol message from a node
   * (diagnostics, and tests that act at an exact protocol state).
   */
  observe(listener: (node: RouterNode, msg: ControlMessage) => void): void {
    this.#observers.push(listener);
  }

  /** The pair policy's KV index size and decisions by reason (null: it routes by no cache). */
  routing(): RoutingReport | null {
    return this.#pool.routing();
  }

  /** The nodes for `/kvfence/nodes`. */
  nodes(): NodeInfo[] {
    return this.#pool.nodes();
  }

  /** The node in each place now (a node that came back is its new incarnation). */
  get currentNodes(): readonly RouterNode[] {
    return this.#pool.slots.map((s) => s.node);
  }

  health(): EngineHealth {
    return this.#pool.health(this.#closed);
  }

  /**
   * A lost node answered again (re-dialled; maybe a new incarnation): it takes its place back, its
   * pairs up with decode's transfer channel to the prefill node (`prefill_up`). Returns why it
   * cannot: it no longer fits what the router admits (role, layout, page size, pool, context).
   */
  nodeBack(node: RouterNode): string | null {
    const slot = this.#pool.back(node);
    if (typeof slot === "string") return slot;
    this.#pings.forget(slot);
    this.#rids.raiseFloor(node.hello);
    this.#listen(slot, node);
    return null;
  }

  /**
   * A node joins the running cluster (a registry entry that proved the cluster secret), paired
   * with every node of the other role, its pairs up with decode's transfer channel (`prefill_up`).
   * Returns why it cannot (an id here already; layout, page size, pool or context not admitted).
   */
  addNode(node: RouterNode): string | null {
    const slot = this.#pool.add(node);
    if (typeof slot === "string") return slot;
    this.#rids.raiseFloor(node.hello);
    this.#listen(slot, node);
    return null;
  }

  /** Lost node `id` serves in another role now (a role switch): it goes (`PairPool.remove`), or why not. */
  removeNode(id: string): string | null {
    return this.#pool.remove(id);
  }

  /**
   * Node `id` is in the membership (a registry entry, not draining) or not: out of it, it takes no
   * new request; nothing in flight is touched.
   */
  setMember(id: string, member: boolean): void {
    if (this.#pool.setMember(id, member)) this.#share.pump();
  }

  /** The pre-flight a node that wants to join runs against (null: it would be admitted). */
  admissionRefusal(hello: NodeHello): string | null {
    return this.#pool.admits(hello);
  }

  submit(request: GenerationRequest, events: GenerationEvents): void {
    if (!this.#pool.anyPairUp()) {
      events.onError({
        code: "node_unavailable",
        message: "No prefill/decode node pair is available: every pair has a node down; retry later",
        retryAfter: 1,
      });
      return;
    }
    if (this.#open.has(request.rid)) {
      events.onError({
        code: "invalid_request",
        message: `Request id is already in use: ${request.rid}; assign a fresh rid`,
      });
      return;
    }
    const pageSize = this.capacity.pageSize;
    const affinityKey = this.#pool.affinityKey(request, pageSize);
    const chain = this.#pool.chainOf(request, pageSize);
    const pending = pendingRequest(request, events, { pageSize, affinityKey, chain });
    this.#open.set(request.rid, pending);
    // A later sample of a group being assembled rides on its first sample's attempt.
    const ready = this.#groups.add(pending);
    if (ready !== null) this.#offer(ready);
  }

  /** Into the fair share (a group with its riders, its reservation every sample's); refused: every one learns why. */
  #offer(pending: PendingRequest): void {
    const group = pending.group;
    if (group !== null) {
      const pages = group.decodePages(this.capacity.pageSize);
      if (pages > this.#pool.smallestDecodePages) {
        // The group would not fit a decode pool at once: its samples go alone (each its own prefill).
        const riders = group.split();
        this.#offer(pending);
        for (const r of riders) if (!r.silenced) this.#offer(r);
        return;
      }
      pending.decodePages = pages;
    }
    const refusal = this.#share.offer(pending);
    if (refusal === null) return;
    for (const x of withRiders(pending)) {
      this.#open.delete(x.request.rid);
      x.events.onError(refusal);
    }
  }

  abort(rid: number): void {
    const pending = this.#open.get(rid);
    if (pending === undefined) return;
    if (isRider(pending) && pending.pair === null) {
      // A rider while its group waits: it leaves the group (it holds nothing anywhere).
      pending.silenced = true;
      this.#open.delete(rid);
      this.#aborts++;
      return;
    }
    if (this.#share.cancel(pending)) {
      // Waiting: it holds nothing anywhere, so it just leaves the queue, and its riders with it.
      for (const x of withRiders(pending)) {
        x.silenced = true;
        this.#open.delete(x.request.rid);
      }
      this.#aborts++;
      return;
    }
    if (pending.pair === null) return;
    if (!pending.silenced) this.#aborts++;
    pending.silenced = true;
    this.#step(pending.pair, { type: "client_abort", rid: pending.rid });
  }

  /** Every node's stats (null for a node that did not answer, is lost or is not answering pings). */
  nodeStats(): Promise<{ node: RouterNode; stats: NodeStats | null }[]> {
    return this.#stats.poll(this.#pool.slots);
  }

  /** Each node's stats and guard counters, and the router's phases, for the dashboard. */
  async nodeViews(): Promise<NodeViews> {
    const all = await this.nodeStats();
    return { nodes: all.map(nodeView), routerPhases: this.phases.snapshot(), waiting: this.#share.waiting };
  }

  /** The per-transfer GB/s and ABORT_ACK latencies (seconds) observed since the last call. */
  takeObservations(): { gbps: number[]; abortAckSeconds: number[] } {
    return this.#stats.takeObservations();
  }

  async stats(): Promise<EngineStats> {
    const all = await this.nodeStats();
    return this.#stats.sum(all, { waiting: this.#share.waiting, aborts: this.#aborts });
  }

  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    this.#pings.close();
    const error: WireError = {
      code: "node_unavailable",
      message: "The server is shutting down: request not finished; retry",
    };
    this.#share.close(error);
    for (const [rid, pending] of this.#requests) {
      this.#requests.delete(rid);
      this.#open.delete(pending.request.rid);
      if (!pending.silenced) pending.events.onError(error);
    }
    for (const s of this.#pool.slots) s.node.link.close();
  }

  #listen(slot: NodeSlot, node: RouterNode): void {
    node.link.onMessage((m) => {
      if (slot.node === node) this.#onNodeMessage(slot, m);
    });
    node.link.onClose(() => {
      if (slot.node === node) this.#nodeLost(slot);
    });
  }

  /** The FairShare's dispatch: start `p` on the pair the pool takes for it; false when none can. */
  #dispatch(p: PendingRequest): boolean {
    const pair = this.#pool.take(p);
    if (pair === null) return false;
    if (!p.dispatched) {
      this.phases.since(PHASE.queue_wait, p.submittedAt);
      traceSince(p, "queue_wait", p.submittedAt);
    }
    // Attempts go out under rids of this router's slot in serial order: the client's rid when it
    // is of the slot and the newest yet, else the next one; a group's riders take the ones after.
    p.rid = this.#rids.take(p.dispatched ? 0 : p.request.rid);
    p.dispatched = true;
    p.pair = pair;
    const group = p.group;
    for (const r of group?.board() ?? []) {
      r.rid = this.#rids.take();
      r.pair = pair;
      r.dispatched = true;
      this.#requests.set(r.rid, r);
    }
    if (group !== null && group.riders.length > 0) p.sampling = group.sampling(p.request.sampling);
    p.prefillHeld = true;
    this.#requests.set(p.rid, p);
    this.#step(pair, {
      type: "submit",
      rid: p.rid,
      tenant: p.request.tenant,
      promptLen: p.prompt.length,
      maxTokens: p.maxTokens,
      ...(group === null || group.riders.length === 0 ? {} : { samples: group.rids() }),
    });
    return true;
  }

  /** The attempt of `p` ended: its reservations leave the ledger. */
  #release(p: PendingRequest): void {
    // A rider's pages are in its group's reservation.
    if (p.pair === null || isRider(p)) return;
    this.#pool.releaseDecode(p.pair, p);
    this.#releasePrefill(p);
  }

  #releasePrefill(p: PendingRequest): void {
    if (!p.prefillHeld || p.pair === null) return;
    p.prefillHeld = false;
    this.#pool.releasePrefill(p.pair, p);
  }

  #onNodeMessage(slot: NodeSlot, message: FromNode): void {
    switch (message.kind) {
      case "protocol":
        this.#incoming = message;
        try {
          this.#onProtocol(slot, message.msg);
        } finally {
          this.#incoming = null;
        }
        return;
      case "pong":
        if (message.cachedPages !== undefined) slot.cachedPages = message.cachedPages;
        this.#pings.pong(slot, message.id);
        return;
      case "stats":
        this.#stats.answer(message.id, message.stats);
        return;
      case "prefill_up":
        this.pairUp(message.prefill, slot.id, true);
        return;
      case "prefill_down":
        this.#prefillDown(slot, message.prefill);
        return;
      case "pages_freed":
        slot.full = false;
        this.#share.pump();
        return;
      case "cache_events":
      case "cache_snapshot":
        this.#pool.cacheEvents(slot, message);
        return;
      case "prefix_cached": {
        const pending = this.#requests.get(message.rid);
        // A migrated request's prompt is its first attempt's.
        if (pending?.rid === message.rid && pending.migrations === 0)
          pending.cachedTokens = message.cachedTokens;
        return;
      }
      default:
        return;
    }
  }

  /** A protocol message from a node of the request's pair (from any other node, dropped). */
  #onProtocol(slot: NodeSlot, msg: ControlMessage): void {
    const pending = this.#requests.get(msg.rid);
    if (pending === undefined || pending.pair === null) return;
    const pair = pending.pair;
    if (slot !== pair.prefill && slot !== pair.decode) return;
    if (msg.type === "finished") {
      pending.completionTokens = resumedTokens(pending) + msg.completionTokens;
      if (msg.stopTokenId !== undefined) pending.stopTokenId = msg.stopTokenId;
    }
    if (msg.type === "lease" && pending.reserveSentAt > 0) {
      this.phases.since(PHASE.reservation, pending.reserveSentAt);
      traceSince(pending, "reservation", pending.reserveSentAt);
      pending.reserveSentAt = 0;
    }
    if (msg.type === "rejected") pending.refusedForPages = msg.error.code === "pool_exhausted" ? slot : null;
    this.#step(pair, { type: "message", msg });
    // Prefill frees its source pages at decode's release, right after the commit.
    if (pending.prefillHeld && pair.state.requests[msg.rid]?.phase === "decoding") {
      this.#releasePrefill(pending);
      this.#share.pump();
    }
    for (const listener of this.#observers) listener(slot.node, msg);
  }

  /**
   * Decode node `decode` lost its transfer channel to `prefill` (it fenced that prefill node): the
   * pair's requests that still need a transfer fail with 503; the pair takes no new ones.
   */
  #prefillDown(decode: NodeSlot, prefill: string): void {
    for (const pair of this.#pool.pairs) {
      if (pair.prefill.id !== prefill || pair.decode !== decode) continue;
      pair.up = false;
      this.#step(pair, { type: "peer_lost", role: "prefill" });
    }
    this.#failWaitingIfNoPair();
  }

  /** With no pair left up, the waiting requests cannot be served: they end with 503 now. */
  #failWaitingIfNoPair(): void {
    if (this.#pool.anyPairUp()) return;
    this.#share.failWaiting({
      code: "node_unavailable",
      message: "Every prefill/decode node pair went down while the request waited; retry later",
      retryAfter: 1,
    });
  }

  #nodeLost(slot: NodeSlot): void {
    if (slot.lost) return;
    slot.lost = true;
    this.#pool.cacheLost(slot);
    this.#pings.forget(slot);
    this.#stats.nodeLost(slot.id);
    const role = slot.role;
    if (role === "prefill") {
      // Decode nodes fence the lost prefill node (close its channel) before releasing its pages.
      for (const pair of this.#pool.pairs) {
        if (pair.prefill !== slot || pair.decode.lost) continue;
        try {
          pair.decode.node.link.send({ kind: "prefill_lost", prefill: slot.id });
        } catch {
          // That decode node is going too.
        }
      }
    }
    for (const pair of this.#pool.pairs) {
      if (pair.prefill === slot || pair.decode === slot) {
        pair.up = false;
        this.#step(pair, { type: "peer_lost", role });
      }
    }
    this.#failWaitingIfNoPair();
  }

  #step(pair: NodePair, event: RouterEvent): void {
    const out = this.#out;
    const start = out.length;
    routerStep(pair.state, event, this.#routerContext);
    const effects = out.splice(start);
    for (const effect of effects) {
      switch (effect.kind) {
        case "send":
          this.#send(pair, effect.to === "prefill" ? pair.prefill : pair.decode, effect.msg);
          break;
        case "tokens":
          this.#tokens(effect);
          break;
        case "respond":
          this.#respond(pair, effect);
          break;
        default:
          break;
      }
    }
  }

  /** Tokens for the client, up to a stop token (only prefill's first token can be one). */
  #tokens(effect: TokensEffect): void {
    const pending = this.#requests.get(effect.rid);
    if (pending === undefined || pending.silenced || pending.stopped) return;
    // The node message these tokens came in carries their log-probabilities, when asked.
    const incoming = this.#incoming;
    if (incoming?.promptLogprobs !== undefined) pending.events.onPromptLogprobs?.(incoming.promptLogprobs);
    const lp = incoming?.logprobs;
    // A stop token ends the stream; decode reports the finish.
    let n = 0;
    while (n < effect.tokens.length && !pending.sampling.stopTokenIds.includes(effect.tokens[n]!)) n++;
    if (n < effect.tokens.length) {
      pending.stopped = true;
      pending.stopTokenId = effect.tokens[n]!;
    }
    if (n > 0) {
      for (let i = 0; i < n; i++) pending.output.push(effect.tokens[i]!);
      this.#timeTokens(pending, n);
      const all = n === effect.tokens.length;
      pending.events.onTokens(
        all ? effect.tokens : effect.tokens.slice(0, n),
        lp === undefined || lp.length < n ? undefined : all ? lp : lp.slice(0, n),
      );
    }
  }

  /** `n` tokens reach the client now: the first token's time, or each token's share of the gap. */
  #timeTokens(pending: PendingRequest, n: number): void {
    const now = performance.now();
    if (!pending.firstToken) {
      pending.firstToken = true;
      this.phases.since(PHASE.first_token, pending.submittedAt);
      traceSince(pending, "first_token", pending.submittedAt);
    } else this.phases.observeMany(PHASE.inter_token, (now - pending.lastTokenAt) / 1000 / n, n);
    pending.lastTokenAt = now;
  }

  /**
   * The machine is done with an attempt: its reservations leave the ledger, and it waits again
   * (refused by a full pool that can hold it), or its client learns the finish or the error.
   */
  #respond(pair: NodePair, effect: RespondEffect): void {
    const pending = this.#requests.get(effect.rid);
    delete pair.state.requests[effect.rid];
    if (pending === undefined) return;
    this.#requests.delete(effect.rid);
    const group = isRider(pending) ? pending.group : null;
    if (
      group !== null &&
      (pending.rid !== effect.rid || (group.first.pair === null && this.#open.has(group.first.request.rid)))
    ) {
      // Its group went back to wait (for pages, or for another pair; it may already be out again,
      // the rider with it under a new rid): the rider goes on with it.
      if (pending.rid === effect.rid) pending.pair = null;
      return;
    }
    this.#release(pending);
    const mayWait =
      !pending.silenced && effect.error?.code === "pool_exhausted" && pending.refusedForPages !== null;
    if (mayWait && this.#waitForPages(pending)) return;
    const error =
      effect.error === null || this.#closed ? effect.error : this.#relocate(pending, effect.error);
    if (error === "requeued") return;
    this.#open.delete(pending.request.rid);
    if (group === null) this.#share.finished(pending);
    if (pending.silenced) return;
    if (error === null) {
      // A stop token ends it with `stop` even as its last allowed token (max_tokens 1: decode
      // finished the request at commit, by its length).
      pending.events.onFinish(pending.stopped ? "stop" : (effect.finishReason ?? "length"), usageOf(pending));
    } else pending.events.onError(error);
  }

  /**
   * A node of its pair refused `pending` for want of pages: it goes back to the front of its
   * tenant's queue and that node takes nothing more until it frees pages. False when it cannot
   * wait (the queue takes none, the pair is down, or the request is larger than that whole pool:
   * it would wait forever); the refusal then reaches the client.
   */
  #waitForPages(pending: PendingRequest): boolean {
    const slot = pending.refusedForPages!;
    pending.refusedForPages = null;
    // Decode reserves the prompt and max_tokens, prefill the prompt's pages.
    const needed = slot.role === "decode" ? pending.decodePages : pending.prefillPages;
    if (this.#closed || pending.pair === null || !pending.pair.up) return false;
    if (!this.#pool.refusedForPages(slot, needed)) return false;
    pending.pair = null;
    if (!this.#share.returned(pending)) return false;
    this.#share.pump();
    return true;
  }

  /**
   * A node's loss or failure ended the attempt of `pending` (migration.ts): it goes back to the
   * front of its tenant's queue, to run as a fresh attempt on a pair that is up ("requeued"), or it
   * ends — with the error returned, or finished (null: nothing was left to generate).
   */
  #relocate(pending: PendingRequest, error: WireError): WireError | null | "requeued" {
    const from = pending.pair;
    const other = this.#pool.pairs.some((p) => p !== from && this.#pool.usable(p));
    const next = this.migrations.after(pending, error, other, this.capacity.pageSize);
    if (next !== "requeue") return next === "finished" ? null : next;
    pending.pair = null;
    if (!this.#share.returned(pending)) return error;
    this.#share.pump();
    return "requeued";
  }

  #send(pair: NodePair, slot: NodeSlot, msg: ControlMessage): void {
    if (slot.lost) return;
    const pending = this.#requests.get(msg.rid);
    let message: ToNode;
    const trace = pending?.request.trace;
    if (msg.type === "prefill") {
      message = {
        kind: "protocol",
        prefill: pair.prefill.id,
        msg:
          pending === undefined
            ? msg
            : {
                ...msg,
                promptTokens: pending.prompt,
                cacheSalt: pending.request.cacheSalt ?? null,
                cacheScope: pending.request.cacheScope ?? "",
                ...(pending.request.cacheEpoch === undefined
                  ? {}
                  : { cacheEpoch: pending.request.cacheEpoch }),
              },
        ...(pending === undefined ? {} : { sampling: pending.sampling }),
        ...(trace === undefined ? {} : { trace }),
      };
    } else if (msg.type === "reserve" && pending !== undefined) {
      const sampling = pending.sampling;
      pending.reserveSentAt = performance.now();
      // Decode looks the prompt up in its prefix cache (decode-side reuse) under the same salt
      // inputs as prefill; its sampling reads the ids for a repetition penalty, or to resume (the
      // attempt's prompt: after a migration, the request's followed by the output so far).
      const { cacheSalt, cacheScope } = pending.request;
      message = {
        kind: "protocol",
        prefill: pair.prefill.id,
        msg: {
          ...msg,
          promptTokens: pending.prompt,
          cacheSalt: cacheSalt ?? null,
          cacheScope: cacheScope ?? "",
        },
        sampling,
        ...(trace === undefined ? {} : { trace }),
      };
    } else if (msg.type === "watermark" && slot === pair.prefill) {
      // Prefill runs one machine per decode incarnation: the pair's is named.
      message = {
        kind: "protocol",
        prefill: pair.prefill.id,
        msg,
        decode: pair.decode.node.hello.incarnation,
      };
    } else message = { kind: "protocol", prefill: pair.prefill.id, msg };
    try {
      slot.node.link.send(message);
    } catch {
      // The link is closing; its close event fails the request.
    }
  }
}

/** A router phase of `p` that began at `startMs` (`performance.now()`) and ends now, as a span (tracing on). */
function traceSince(p: PendingRequest, name: string, startMs: number): void {
  if (tracing() !== null) traceSpan(p.request.trace, name, epochOf(startMs));
}
