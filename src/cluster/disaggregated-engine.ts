/**
 * The router side of the disaggregated topology: an `EngineHandle` (so the HTTP layer is the same
 * as with one engine) that runs the protocol's router state machine (`routerStep`) and talks to the
 * prefill and decode nodes over `Link`s — MessagePorts of worker threads or authenticated TCP links
 * of processes.
 *
 * One router state machine per (prefill, decode) pair, so a node's loss (`peer_lost`) reaches only
 * the requests that use it. The effective context length is the least of the model's window and
 * every node's pool and context length; each node re-checks at its own door and its rejection
 * reaches the client unchanged. Effects become link messages (the prompt's token ids and the
 * sampling parameters ride along), `GenerationEvents` calls, and, on `respond`, the end of the
 * request. A link's close is the node's loss: every in-flight request on it fails with 503
 * `node_unavailable`; decode nodes hear of a lost prefill node and fence it. A lost node that comes
 * back (`nodeBack`, the cluster router re-dials it) is paired again once decode's transfer
 * channel to it is up.
 *
 * Requests wait in one place, fairly: a `FairShare` (src/lib/fair-share.ts) holds each tenant's
 * queue, caps what each tenant may hold (requests, KV pages) and bounds the queue (429 for a tenant
 * over its share, 503 when the server is full, a queue timeout). A request is dispatched to a pair
 * — round-robin over the pairs that are up, whose nodes answer their readiness pings, and that
 * have room — when its turn comes. Room is the router's own ledger of each node: the KV pages its
 * dispatched requests reserve there (decode: prompt + max_tokens; prefill: the prompt, until the
 * commit) against the pool, and at most `DECODE_WINDOW` times decode's sequence slots of requests. A node may still refuse for want of pages
 * (`pool_exhausted`: pages quarantined after an abort, that the ledger cannot see): the request
 * goes back to the front of its tenant's queue, to be submitted again as a fresh attempt under a
 * new internal request id (the refused one is tombstoned), and that node takes nothing more until
 * it reports freed pages (`pages_freed`). No timer frees or waits for pages.
 *
 * Readiness (`health()`, `/ready`): every node gets a ping every `PING_INTERVAL_MS`; a node whose
 * pong has not come within the ping timeout is marked not answering (a frozen process, a wedged
 * link) and gets no new requests until it answers again. A ping timeout only marks a node: it
 * never fails a request or frees a page (docs/protocol.md: pages are freed by an ABORT_ACK or the
 * fence). Ready means a pair is up with both its nodes answering.
 */

import { createHash } from "node:crypto";
import type { NodeInfo } from "../admin-api/admin-wire.js";
import { FairShare, type FairShareConfig, resolveFairShare } from "../fair-share/fair-share.js";
import type { WireError } from "../lib/errors.js";
import { PHASE, PhaseRecorder } from "../lib/phase-histograms.js";
import { epochOf, traceSpan, tracing } from "../lib/tracing.js";
import type { FromNode, Link, NodeHello, NodeStats, SamplingParams, ToNode } from "../links/node-messages.js";
import { decodeGroupPages, decodeReservationPages } from "../protocol/decode-machine.js";
import type { Effects, RespondEffect, TokensEffect } from "../protocol/effects.js";
import type {
  EngineCapacity,
  EngineHandle,
  EngineHealth,
  EngineStats,
  GenerationEvents,
  GenerationRequest,
  NodeView,
  NodeViews,
} from "../protocol/engine-api.js";
import {
  initialRouterState,
  type RouterConfig,
  type RouterContext,
  type RouterEvent,
  type RouterState,
  routerStep,
} from "../protocol/router-machine.js";
import { faultOn, guardOn, type Safety } from "../protocol/safety.js";
import { type ControlMessage, nextRidIn, ridBefore, routerSlotOf } from "../protocol/wire.js";
import type { LinkAuthFailures } from "../transfer/link-guard.js";
import { NodeTotals } from "./node-totals.js";

/** One node as the router holds it. */
export interface RouterNode {
  readonly id: string;
  readonly url: string;
  readonly hello: NodeHello;
  readonly link: Link<ToNode, FromNode>;
}

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
}

/** A node's place in the router: the node of its current incarnation, and what the router knows of it. */
interface Slot {
  readonly id: string;
  readonly role: "prefill" | "decode";
  node: RouterNode;
  /** The link closed and the node has not come back. */
  lost: boolean;
  /** False while a readiness ping is unanswered past the deadline. */
  answering: boolean;
  /** The unanswered ping, if any. */
  ping: { readonly id: number; readonly timer: NodeJS.Timeout } | null;
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

interface Pair {
  readonly key: string;
  readonly prefill: Slot;
  readonly decode: Slot;
  readonly state: RouterState;
  up: boolean;
}

interface Pending {
  /** The pair of the current attempt; null while it waits. */
  pair: Pair | null;
  /** The rid of the current attempt: `request.rid`, or an internal one after waiting for pages. */
  rid: number;
  /** Dispatched at least once (a later attempt needs a fresh rid). */
  dispatched: boolean;
  /** The node of its pair that refused the attempt for want of pages, if one did. */
  refusedForPages: Slot | null;
  readonly request: GenerationRequest;
  readonly events: GenerationEvents;
  /** Its sampling parameters (a group's: with its riders' seeds, set at each dispatch). */
  sampling: SamplingParams;
  readonly promptTokens: number[];
  /**
   * What the attempt reserves: on decode (prompt + max_tokens; a group: every sample's, the full
   * prompt pages once) and on prefill (the prompt).
   */
  decodePages: number;
  readonly prefillPages: number;
  /** The prefill node's pages still count in the ledger (until the commit). */
  prefillHeld: boolean;
  /** Prompt tokens the prefill node served from its prefix cache (null: it has none, or not told). */
  cachedTokens: number | null;
  /** The per-tenant key of its prompt's first full pages (prefix affinity), or null (none full). */
  readonly affinityKey: string | null;
  completionTokens: number;
  stopped: boolean;
  silenced: boolean;
  /** `performance.now()` at submit, at the last `reserve` sent (0: none), and whether a token reached the client (no retry on another pair after that). */
  readonly submittedAt: number;
  reserveSentAt: number;
  firstToken: boolean;
  /** `performance.now()` when tokens last reached the client (0: none yet). */
  lastTokenAt: number;
  /** Times it went back to the queue because its pair lost a node before its first token. */
  moved: number;
  /**
   * n > 1 as one group (the request names its `samples`): the later samples, which ride on this
   * one's attempt — one reserve, one prefill, one transfer; decode forks them at the commit
   * (docs/protocol.md §3, item 13). They wait, dispatch and retry with it, each its own rid and events.
   */
  riders: Pending[];
  /** A rider: its group's first sample; else null. */
  group: Pending | null;
  /** A group being assembled: riders not submitted yet (they follow their first sample at once). */
  awaiting: number;
}

const STATS_TIMEOUT_MS = 5000;
/** Adds one node's prefix-cache counters and pages to the sum of every node's. */
const NO_PREFIX_CACHE = {
  hits: 0,
  misses: 0,
  hitTokens: 0,
  evictions: 0,
  collisions: 0,
  sharedPages: 0,
  evictablePages: 0,
};

/** The node counters `stats()` sums over every node that ever answered (`NodeTotals`). */
const COUNTED = [
  "tagCheckFailures",
  "preemptions",
  "prefillTokens",
  "forkedSamples",
  "decodeSteps",
  "hits",
  "misses",
  "hitTokens",
  "evictions",
  "collisions",
] as const;

/** Prefix-affinity keys remembered (the oldest is forgotten first). */
const AFFINITY_ENTRIES = 10_000;
/** Full pages of a prompt its prefix-affinity key covers. */
const AFFINITY_PAGES = 4;

/**
 * The prefix-affinity key of `request`: its tenant, cache namespace and the token ids of its first
 * full pages (at most `AFFINITY_PAGES`, never the last prompt token, as a cache hit), hashed; null
 * when the prompt has no full page to reuse.
 */
function prefixAffinityKey(request: GenerationRequest, pageSize: number): string | null {
  const pages = Math.min(AFFINITY_PAGES, Math.floor((request.promptTokens.length - 1) / pageSize));
  if (pages <= 0) return null;
  const hash = createHash("sha256").update(
    `${request.tenant}\u0000${request.cacheScope ?? ""}\u0000${request.cacheSalt ?? ""}\u0000`,
  );
  hash.update(
    new Uint8Array(request.promptTokens.buffer, request.promptTokens.byteOffset, pages * pageSize * 4),
  );
  return hash.digest("base64");
}
/** Readiness pings: one per node in flight at most, every this often. */
export const PING_INTERVAL_MS = 200;
export const DEFAULT_PING_TIMEOUT_MS = 500;
/** Decode sequence slots of a node that does not say (an older hello). */
const DEFAULT_SLOTS = 16;
/**
 * A decode node is sent at most this many times its sequence slots of requests at once: enough
 * that the ones in prefill keep its batch full, few enough that the rest wait at the router, in
 * fair order, rather than in the node's own first-come queue.
 */
export const DECODE_WINDOW = 2;
/** A request whose pair lost a node before its first token runs again on another pair, once. */
const MAX_MOVES = 1;

const poolPages = (slot: Slot): number => Math.floor(slot.node.hello.poolTokens / slot.node.hello.pageSize);

export class DisaggregatedEngine implements EngineHandle {
  readonly capacity: EngineCapacity;
  readonly #config: RouterConfig;
  readonly #safety: Safety;
  readonly #pairs: Pair[] = [];
  readonly #slots: Slot[];
  readonly #requests = new Map<number, Pending>();
  /** The node message being handled (its log-probabilities go with the tokens it yields), or null. */
  #incoming: (FromNode & { kind: "protocol" }) | null = null;
  /** Every open request by the client's rid: waiting or dispatched. */
  readonly #open = new Map<number, Pending>();
  /** Groups of n > 1 whose first sample came and whose riders are still coming (by its rid). */
  readonly #assembling = new Map<number, Pending>();
  readonly #statsWaiters = new Map<number, { node: string; resolve: (s: NodeStats | null) => void }>();
  /** The nodes' counters for `stats()`, kept while a node misses a poll or restarts (never going down). */
  readonly #counted = new NodeTotals();
  readonly #out: Effects = [];
  readonly #routerContext: RouterContext;
  readonly #share: FairShare<Pending>;
  /** Per-transfer GB/s and ABORT_ACK latencies drained from the nodes, until `takeObservations`. */
  #gbps: number[] = [];
  #ackSeconds: number[] = [];
  readonly #observers: ((node: RouterNode, msg: ControlMessage) => void)[] = [];
  readonly #pingTimeoutMs: number;
  readonly #pingTimer: NodeJS.Timeout;
  #nextPair = 0;
  /** Prefix affinity: a prompt's first-pages key → the prefill node that last took it (oldest first). */
  readonly #affinity = new Map<string, string>();
  #nextStatsId = 1;
  #nextPingId = 1;
  #closed = false;
  /** Requests aborted by the router (`abort` of a live or waiting request). */
  #aborts = 0;
  /** The router's phases: queue wait (submit to dispatch), reservation (reserve to lease), first token. */
  readonly phases: PhaseRecorder;
  /** The newest rid an attempt went out under (0: none yet). */
  #lastRid = 0;
  /** See `DisaggregatedEngineOptions.routerSlot`. */
  readonly #routerSlot: number;
  /** See `DisaggregatedEngineOptions.dialRefusals` (`kvfence_router_link_refusals_total`). */
  readonly dialRefusals: LinkAuthFailures;

  constructor(options: DisaggregatedEngineOptions) {
    if (options.prefill.length === 0 || options.decode.length === 0) {
      throw new Error("A disaggregated engine needs at least one prefill node and one decode node");
    }
    this.#safety = options.safety;
    this.#routerSlot = options.routerSlot ?? 0;
    this.dialRefusals = options.dialRefusals ?? {};
    this.#pingTimeoutMs = options.pingTimeoutMs ?? DEFAULT_PING_TIMEOUT_MS;
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
    this.#routerContext = { config: this.#config, safety: this.#safety, out: this.#out };
    // The undersized-pool fault with the admission doors off: the HTTP door trusts the model's
    // window alone (no min over the pools), as in the incident.
    const trustWindow =
      faultOn(options.safety, "undersized-pool") && !guardOn(options.safety, "admission-doors");
    const slots = options.decode.reduce((s, n) => s + (n.hello.maxSequences ?? DEFAULT_SLOTS), 0);
    this.capacity = Object.freeze({
      poolTokens: trustWindow
        ? Math.max(...nodes.map((n) => n.hello.poolTokens), this.#config.maxModelLen)
        : min((n) => n.hello.poolTokens, nodes),
      pageSize,
      maxModelLen: trustWindow ? this.#config.maxModelLen : Math.min(options.maxModelLen, nodeLimit),
      maxSequences: slots,
    });
    const prefill = options.prefill.map(newSlot);
    const decode = options.decode.map(newSlot);
    this.#slots = [...prefill, ...decode];
    for (const p of prefill) {
      for (const d of decode) {
        this.#pairs.push({
          key: `${p.id}|${d.id}`,
          prefill: p,
          decode: d,
          state: initialRouterState(),
          up: false,
        });
      }
    }
    this.#share = new FairShare<Pending>(
      resolveFairShare(options.fairShare ?? { tenants: 1 }, {
        pages: decode.reduce((s, d) => s + poolPages(d), 0),
        slots,
      }),
      {
        tenant: (p) => p.request.tenant,
        pages: (p) => p.decodePages,
        // A group forked on decode runs each of its samples: they count against the tenant's cap.
        size: (p) => 1 + p.riders.length,
        group: (p) => p.request.group,
        dispatch: (p) => this.#dispatch(p),
        expire: (p, error) => {
          for (const x of [p, ...p.riders]) {
            this.#open.delete(x.request.rid);
            if (!x.silenced) x.events.onError(error);
          }
        },
      },
    );
    for (const s of this.#slots) {
      this.#listen(s, s.node);
      this.#raiseRidFloor(s.node.hello);
    }
    this.#pingTimer = setInterval(() => this.#pingAll(), PING_INTERVAL_MS);
    this.#pingTimer.unref();
  }

  /** Marks the transfer channel of a (prefill, decode) pair up (the decode node connected to the prefill node). */
  pairUp(prefillId: string, decodeId: string, up = true): void {
    for (const pair of this.#pairs) {
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
    return this.#pairs.every((p) => p.up);
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
  get fairShare(): FairShare<Pending> {
    return this.#share;
  }

  /**
   * Calls `listener` after the router state machine handled each protocol message from a node
   * (diagnostics, and tests that act at an exact protocol state).
   */
  observe(listener: (node: RouterNode, msg: ControlMessage) => void): void {
    this.#observers.push(listener);
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
    }));
  }

  /** The node in each place now (a node that came back is its new incarnation). */
  get currentNodes(): readonly RouterNode[] {
    return this.#slots.map((s) => s.node);
  }

  health(): EngineHealth {
    const count = (role: "prefill" | "decode") => {
      const of = this.#slots.filter((s) => s.role === role);
      return { ready: of.filter((s) => !s.lost && s.answering).length, total: of.length };
    };
    const prefill = count("prefill");
    const decode = count("decode");
    const ready = !this.#closed && this.#pairs.some((p) => this.#usable(p));
    let reason: string | null = null;
    if (this.#closed) reason = "the server is shutting down";
    else if (prefill.ready === 0) reason = `no prefill node answers (0 of ${prefill.total})`;
    else if (decode.ready === 0) reason = `no decode node answers (0 of ${decode.total})`;
    else if (!ready)
      reason = "no decode node that answers has its transfer channel to a prefill node that answers";
    return { live: true, ready, reason, prefill, decode };
  }

  /**
   * A lost node answered again (the cluster router re-dialled it; possibly a new incarnation after
   * a restart): it takes its place back. Its pairs come up when decode's transfer channel to the
   * prefill node is up (`prefill_up`). Returns why it cannot, when the node no longer fits what
   * the router admits (another role, layout or page size, a smaller pool or context).
   */
  nodeBack(node: RouterNode): string | null {
    const slot = this.#slots.find((s) => s.id === node.id);
    if (slot === undefined) return `no node ${node.id} in this cluster`;
    const was = slot.node.hello;
    const now = node.hello;
    if (!slot.lost) return `node ${node.id} is not lost`;
    if (now.role !== was.role) return `it is a ${now.role} node now, not ${was.role}`;
    if (now.layoutSignature !== was.layoutSignature || now.pageSize !== was.pageSize)
      return "its KV layout or page size changed";
    if (now.poolTokens < this.capacity.poolTokens || now.maxModelLen < this.capacity.maxModelLen)
      return `its pool (${now.poolTokens} tokens) or context (${now.maxModelLen}) is below what the router admits (${this.capacity.poolTokens}, ${this.capacity.maxModelLen})`;
    if (slot.ping !== null) clearTimeout(slot.ping.timer);
    slot.node = node;
    this.#raiseRidFloor(node.hello);
    slot.lost = false;
    slot.answering = true;
    slot.ping = null;
    slot.full = false;
    this.#listen(slot, node);
    return null;
  }

  /**
   * A node joins the running cluster (a registry entry whose node proved the cluster secret):
   * it is paired with every node of the other role; its pairs come up with decode's transfer
   * channel (`prefill_up`). The pre-flight of every join: returns why it cannot (an id already
   * here, another KV layout or page size, a pool or context below what the router admits).
   */
  addNode(node: RouterNode): string | null {
    if (this.#slots.some((s) => s.id === node.id)) return `a node ${node.id} is already in this cluster`;
    const refused = this.#admits(node.hello);
    if (refused !== null) return refused;
    const slot = newSlot(node);
    this.#slots.push(slot);
    this.#raiseRidFloor(node.hello);
    for (const other of this.#slots) {
      if (other.role === slot.role) continue;
      const [prefill, decode] = slot.role === "prefill" ? [slot, other] : [other, slot];
      this.#pairs.push({
        key: `${prefill.id}|${decode.id}`,
        prefill,
        decode,
        state: initialRouterState(),
        up: false,
      });
    }
    this.#listen(slot, node);
    return null;
  }

  /** Rids go out after every rid an earlier router of this slot sent this node (its hello's floor). */
  #raiseRidFloor(hello: NodeHello): void {
    const floor = hello.ridFloor ?? 0;
    if (floor === 0) return;
    const last = floor === 1 ? 0xffff_ffff : (floor - 1) >>> 0;
    if (this.#lastRid === 0 || ridBefore(this.#lastRid, last)) this.#lastRid = last;
  }

  /** Whether a node with `hello` fits what this router admits (null), or why not. */
  #admits(hello: NodeHello): string | null {
    const like = this.#slots[0]!.node.hello;
    if (hello.layoutSignature !== like.layoutSignature || hello.pageSize !== like.pageSize)
      return `its KV layout (${hello.layoutSignature}, page ${hello.pageSize}) differs from the cluster's (${like.layoutSignature}, page ${like.pageSize})`;
    if (hello.poolTokens < this.capacity.poolTokens || hello.maxModelLen < this.capacity.maxModelLen)
      return `its pool (${hello.poolTokens} tokens) or context (${hello.maxModelLen}) is below what the router admits (${this.capacity.poolTokens}, ${this.capacity.maxModelLen})`;
    return null;
  }

  /**
   * Node `id` is in the membership (a registry entry, not draining) or not: out of it, it takes no
   * new request; nothing in flight is touched.
   */
  setMember(id: string, member: boolean): void {
    const slot = this.#slots.find((s) => s.id === id);
    if (slot === undefined || slot.member === member) return;
    slot.member = member;
    if (member) this.#share.pump();
  }

  /** The pre-flight a node that wants to join runs against (null: it would be admitted). */
  admissionRefusal(hello: NodeHello): string | null {
    return this.#admits(hello);
  }

  submit(request: GenerationRequest, events: GenerationEvents): void {
    if (!this.#pairs.some((p) => p.up && !p.prefill.lost && !p.decode.lost)) {
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
    const group = request.sample === undefined ? undefined : this.#assembling.get(request.sample.of);
    const pending: Pending = {
      pair: null,
      rid: request.rid,
      dispatched: false,
      refusedForPages: null,
      request,
      events,
      sampling: {
        temperature: request.temperature,
        topP: request.topP,
        topK: request.topK,
        seed: request.seed,
        stopTokenIds: request.stopTokenIds,
        ...(request.controls === undefined ? {} : { controls: request.controls }),
        ...(request.logprobs === undefined ? {} : { logprobs: request.logprobs }),
        ...(request.promptLogprobs === undefined ? {} : { promptLogprobs: request.promptLogprobs }),
      },
      promptTokens: Array.from(request.promptTokens),
      decodePages: decodeReservationPages(request.promptTokens.length, request.maxTokens, pageSize),
      prefillPages: Math.ceil(request.promptTokens.length / pageSize),
      prefillHeld: false,
      cachedTokens: null,
      affinityKey: prefixAffinityKey(request, pageSize),
      completionTokens: 0,
      stopped: false,
      silenced: false,
      submittedAt: performance.now(),
      reserveSentAt: 0,
      firstToken: false,
      lastTokenAt: 0,
      moved: 0,
      riders: [],
      group: group ?? null,
      awaiting: request.samples?.length ?? 0,
    };
    this.#open.set(request.rid, pending);
    if (group !== undefined) {
      // A later sample of a group being assembled: it rides on its first sample's attempt.
      group.riders.push(pending);
      if (--group.awaiting > 0) return;
      this.#assembling.delete(group.request.rid);
      this.#offer(group);
      return;
    }
    if (pending.awaiting > 0) this.#assembling.set(request.rid, pending);
    else this.#offer(pending);
  }

  /** Into the fair share (a group with its riders, its reservation every sample's); refused: every one learns why. */
  #offer(pending: Pending): void {
    if (pending.riders.length > 0) {
      const { promptTokens, request } = pending;
      const samples = 1 + pending.riders.length;
      const pages = decodeGroupPages(promptTokens.length, request.maxTokens, this.capacity.pageSize, samples);
      const smallest = Math.min(...this.#slots.filter((s) => s.role === "decode").map(poolPages));
      if (pages > smallest) {
        // The group would not fit a decode pool at once: its samples go alone (each its own prefill).
        const riders = pending.riders;
        pending.riders = [];
        this.#offer(pending);
        for (const r of riders) {
          r.group = null;
          if (!r.silenced) this.#offer(r);
        }
        return;
      }
      pending.decodePages = pages;
    }
    const refusal = this.#share.offer(pending);
    if (refusal === null) return;
    for (const x of [pending, ...pending.riders]) {
      this.#open.delete(x.request.rid);
      x.events.onError(refusal);
    }
  }

  abort(rid: number): void {
    const pending = this.#open.get(rid);
    if (pending === undefined) return;
    if (pending.group !== null && pending.pair === null) {
      // A rider while its group waits: it leaves the group (it holds nothing anywhere).
      pending.silenced = true;
      this.#open.delete(rid);
      this.#aborts++;
      return;
    }
    if (this.#share.cancel(pending)) {
      // Waiting: it holds nothing anywhere, so it just leaves the queue, and its riders with it.
      for (const x of [pending, ...pending.riders]) {
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
  async nodeStats(): Promise<{ node: RouterNode; stats: NodeStats | null }[]> {
    const all = await Promise.all(
      this.#slots.map(async (s) => ({
        node: s.node,
        // A node that does not answer its pings would hold the scrape for the whole timeout.
        stats: s.lost || !s.answering ? null : await this.#poll(s.node),
      })),
    );
    for (const { stats } of all) {
      if (stats === null) continue;
      // One observation per transfer: the writer's (prefill's) view.
      if (stats.role === "prefill") this.#gbps.push(...stats.transferGbps);
      this.#ackSeconds.push(...stats.abortAckSeconds);
    }
    return all;
  }

  /** Each node's stats and guard counters, and the router's phases, for the dashboard. */
  async nodeViews(): Promise<NodeViews> {
    const all = await this.nodeStats();
    const nodes = all.map(({ node, stats }): NodeView => {
      const t = stats?.transfer;
      let linkAuth = 0;
      for (const reasons of Object.values(stats?.linkAuthFailures ?? {}))
        for (const n of Object.values(reasons ?? {})) linkAuth += n;
      return {
        id: node.id,
        role: node.hello.role,
        up: stats !== null,
        stats,
        transferBytes: t?.bytes ?? 0,
        guards: {
          tag_check_failures: stats?.counters.tagCheckFailures ?? 0,
          checksum_failures: t?.checksumFailures ?? 0,
          coverage_failures: t?.coverageFailures ?? 0,
          dropped_stale_writes: t?.droppedStaleWrites ?? 0,
          dropped_misaddressed_writes: t?.droppedMisaddressedWrites ?? 0,
          link_auth_failures: linkAuth,
        },
      };
    });
    return { nodes, routerPhases: this.phases.snapshot(), waiting: this.#share.waiting };
  }

  /** The per-transfer GB/s and ABORT_ACK latencies (seconds) observed since the last call. */
  takeObservations(): { gbps: number[]; abortAckSeconds: number[] } {
    const taken = { gbps: this.#gbps, abortAckSeconds: this.#ackSeconds };
    this.#gbps = [];
    this.#ackSeconds = [];
    return taken;
  }

  async stats(): Promise<EngineStats> {
    const all = await this.nodeStats();
    const sum: EngineStats = {
      pages: { free: 0, reserved: 0, ready: 0, quarantined: 0, total: 0 },
      queue: { waiting: this.#share.waiting, running: 0, preempted: 0 },
      counters: { tagCheckFailures: 0, preemptions: 0, aborts: 0, promptTokens: 0, completionTokens: 0 },
    };
    let answered = 0;
    let prefixCache = false;
    for (const { node, stats } of all) {
      if (stats === null) continue;
      answered++;
      for (const k of ["free", "reserved", "ready", "quarantined", "total"] as const)
        sum.pages[k] += stats.pages[k];
      for (const k of ["waiting", "running", "preempted"] as const) sum.queue[k] += stats.queue[k];
      const c = stats.prefixCache;
      this.#counted.see(node.id, node.hello.incarnation, {
        tagCheckFailures: stats.counters.tagCheckFailures,
        preemptions: stats.counters.preemptions,
        // Prompt tokens computed (the prefill nodes'), samples forked from one transfer (the decode nodes').
        prefillTokens: stats.counters.prefillTokens ?? 0,
        forkedSamples: stats.counters.forkedSamples ?? 0,
        decodeSteps: stats.role === "decode" ? (stats.counters.decodeSteps ?? 0) : 0,
        ...(c === undefined ? {} : { hits: c.hits, misses: c.misses, hitTokens: c.hitTokens }),
        ...(c === undefined ? {} : { evictions: c.evictions, collisions: c.collisions }),
      });
      if (c === undefined) continue;
      prefixCache = true;
      sum.prefixCache ??= { ...NO_PREFIX_CACHE };
      sum.prefixCache.sharedPages += c.sharedPages;
      sum.prefixCache.evictablePages += c.evictablePages;
    }
    if (answered === 0) throw new Error("No node answers");
    // Counters over every node that ever answered: one that misses this poll keeps its last counts.
    const counted = this.#counted.total(COUNTED);
    sum.counters.tagCheckFailures = counted.tagCheckFailures;
    sum.counters.preemptions = counted.preemptions;
    if (prefixCache && sum.prefixCache !== undefined) {
      for (const k of ["hits", "misses", "hitTokens", "evictions", "collisions"] as const)
        sum.prefixCache[k] = counted[k];
    }
    // Aborts are the router's (a client gone, a stop string matched), as on one engine; the nodes'
    // own counts would miss a request aborted before decode ran it and count some twice.
    sum.counters.aborts = this.#aborts;
    sum.counters.prefillTokens = counted.prefillTokens;
    sum.counters.forkedSamples = counted.forkedSamples;
    sum.counters.decodeSteps = counted.decodeSteps;
    return sum;
  }

  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    clearInterval(this.#pingTimer);
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
    for (const s of this.#slots) {
      if (s.ping !== null) clearTimeout(s.ping.timer);
      s.node.link.close();
    }
  }

  #listen(slot: Slot, node: RouterNode): void {
    node.link.onMessage((m) => {
      if (slot.node === node) this.#onNodeMessage(slot, m);
    });
    node.link.onClose(() => {
      if (slot.node === node) this.#nodeLost(slot);
    });
  }

  /** A pair that can take a request now: up, both nodes there, answering and members. */
  #usable(pair: Pair): boolean {
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

  /** Whether `pair`'s nodes have room for `p` by the router's ledger. */
  #fits(pair: Pair, p: Pending): boolean {
    const { prefill, decode } = pair;
    if (prefill.full || decode.full) return false;
    if (decode.running >= DECODE_WINDOW * (decode.node.hello.maxSequences ?? DEFAULT_SLOTS)) return false;
    // An empty node always takes one (a request larger than its pool is refused at its door).
    const room = (slot: Slot, pages: number) =>
      slot.usedPages === 0 || slot.usedPages + pages <= poolPages(slot);
    return room(decode, p.decodePages) && room(prefill, p.prefillPages);
  }

  /**
   * The pair for `p` among those with room: with prefix-caching prefill nodes, the one whose
   * prefill node last took a prompt with the same first pages of the same tenant (prefix
   * affinity), else the one whose prefill node holds the fewest pages by the ledger; without,
   * round-robin. Null when none has room.
   */
  #choosePair(p: Pending): Pair | null {
    const n = this.#pairs.length;
    const preferred = p.affinityKey === null ? undefined : this.#affinity.get(p.affinityKey);
    let pair: Pair | null = null;
    let at = -1;
    for (let i = 0; i < n; i++) {
      const candidate = this.#pairs[(this.#nextPair + i) % n]!;
      if (!this.#usable(candidate) || !this.#fits(candidate, p)) continue;
      const caching = candidate.prefill.node.hello.prefixCache === true;
      if (pair === null || (caching && candidate.prefill.usedPages < pair.prefill.usedPages)) {
        pair = candidate;
        at = i;
      }
      if (!caching || candidate.prefill.id === preferred) {
        pair = candidate;
        at = i;
        break;
      }
    }
    if (pair === null) return null;
    this.#nextPair = (this.#nextPair + at + 1) % n;
    if (p.affinityKey !== null && pair.prefill.node.hello.prefixCache === true) {
      this.#affinity.delete(p.affinityKey);
      this.#affinity.set(p.affinityKey, pair.prefill.id);
      if (this.#affinity.size > AFFINITY_ENTRIES) this.#affinity.delete(this.#affinity.keys().next().value!);
    }
    return pair;
  }

  /** The FairShare's dispatch: start `p` on a pair with room (`#choosePair`); false when none has. */
  #dispatch(p: Pending): boolean {
    const pair = this.#choosePair(p);
    if (pair === null) return false;
    // Attempts go out under rids of this router's slot in serial order (the pairs' watermarks rely
    // on it): the client's rid when it is of the slot and the newest yet, else the next one.
    let rid = p.request.rid;
    if (!p.dispatched) {
      this.phases.since(PHASE.queue_wait, p.submittedAt);
      traceSince(p, "queue_wait", p.submittedAt);
    }
    if (
      p.dispatched ||
      rid === 0 ||
      routerSlotOf(rid) !== this.#routerSlot ||
      (this.#lastRid !== 0 && !ridBefore(this.#lastRid, rid))
    )
      rid = nextRidIn(this.#lastRid, this.#routerSlot);
    p.dispatched = true;
    p.pair = pair;
    p.rid = rid;
    // A group's riders (those not aborted while it waited) take the rids after its own.
    p.riders = p.riders.filter((r) => !r.silenced);
    for (const r of p.riders) {
      rid = nextRidIn(rid, this.#routerSlot);
      r.rid = rid;
      r.pair = pair;
      r.dispatched = true;
      this.#requests.set(rid, r);
    }
    this.#lastRid = rid;
    if (p.riders.length > 0) {
      const { sampleSeeds: _, ...base } = p.sampling;
      p.sampling = { ...base, sampleSeeds: p.riders.map((r) => r.request.seed) };
    }
    pair.decode.usedPages += p.decodePages;
    pair.decode.running++;
    pair.prefill.usedPages += p.prefillPages;
    p.prefillHeld = true;
    this.#requests.set(p.rid, p);
    this.#step(pair, {
      type: "submit",
      rid: p.rid,
      tenant: p.request.tenant,
      promptLen: p.promptTokens.length,
      maxTokens: p.request.maxTokens,
      ...(p.riders.length === 0 ? {} : { samples: p.riders.map((r) => r.rid) }),
    });
    return true;
  }

  /** The attempt of `p` ended: its reservations leave the ledger. */
  #release(p: Pending): void {
    const pair = p.pair;
    // A rider's pages are in its group's reservation.
    if (pair === null || p.group !== null) return;
    pair.decode.usedPages -= p.decodePages;
    pair.decode.running--;
    this.#releasePrefill(p);
  }

  #releasePrefill(p: Pending): void {
    if (!p.prefillHeld || p.pair === null) return;
    p.prefillHeld = false;
    p.pair.prefill.usedPages -= p.prefillPages;
  }

  #poll(node: RouterNode): Promise<NodeStats | null> {
    const id = this.#nextStatsId++;
    return new Promise((resolve) => {
      // A node that does not answer a stats poll in time shows as unknown (it is not fenced for it).
      const timer = setTimeout(() => {
        if (this.#statsWaiters.delete(id)) resolve(null);
      }, STATS_TIMEOUT_MS);
      timer.unref();
      this.#statsWaiters.set(id, {
        node: node.id,
        resolve: (s) => {
          clearTimeout(timer);
          resolve(s);
        },
      });
      try {
        node.link.send({ kind: "stats", id });
      } catch {
        this.#statsWaiters.delete(id);
        resolve(null);
      }
    });
  }

  /** Sends a readiness ping to every node without one in flight; its deadline marks it not answering. */
  #pingAll(): void {
    for (const slot of this.#slots) {
      if (slot.lost || slot.ping !== null) continue;
      const id = this.#nextPingId++;
      const timer = setTimeout(() => {
        // Let pongs that arrived while this process was busy be read first (the poll phase runs
        // after timers): a router that lagged does not blame its nodes.
        setImmediate(() => {
          if (slot.ping?.id === id) slot.answering = false;
        });
      }, this.#pingTimeoutMs);
      timer.unref();
      slot.ping = { id, timer };
      try {
        slot.node.link.send({ kind: "ping", id });
      } catch {
        // The link is closing: its close event marks the node lost.
      }
    }
  }

  #onNodeMessage(slot: Slot, message: FromNode): void {
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
        this.#pong(slot, message.id);
        return;
      case "stats": {
        const waiter = this.#statsWaiters.get(message.id);
        if (waiter === undefined) return;
        this.#statsWaiters.delete(message.id);
        waiter.resolve(message.stats);
        return;
      }
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
      case "prefix_cached": {
        const pending = this.#requests.get(message.rid);
        if (pending !== undefined && pending.rid === message.rid) pending.cachedTokens = message.cachedTokens;
        return;
      }
      default:
        return;
    }
  }

  /** A protocol message from a node of the request's pair (from any other node, dropped). */
  #onProtocol(slot: Slot, msg: ControlMessage): void {
    const pending = this.#requests.get(msg.rid);
    if (pending === undefined || pending.pair === null) return;
    const pair = pending.pair;
    if (slot !== pair.prefill && slot !== pair.decode) return;
    if (msg.type === "finished") pending.completionTokens = msg.completionTokens;
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

  /** A node answered readiness ping `id`: it is answering again if it was not. */
  #pong(slot: Slot, id: number): void {
    if (slot.ping?.id !== id) return;
    clearTimeout(slot.ping.timer);
    slot.ping = null;
    if (!slot.answering) {
      slot.answering = true;
      this.#share.pump();
    }
  }

  /**
   * Decode node `decode` lost its transfer channel to `prefill` (it fenced that prefill node): the
   * pair's requests that still need a transfer fail with 503; the pair takes no new ones.
   */
  #prefillDown(decode: Slot, prefill: string): void {
    for (const pair of this.#pairs) {
      if (pair.prefill.id !== prefill || pair.decode !== decode) continue;
      pair.up = false;
      this.#step(pair, { type: "peer_lost", role: "prefill" });
    }
    this.#failWaitingIfNoPair();
  }

  /** With no pair left up, the waiting requests cannot be served: they end with 503 now. */
  #failWaitingIfNoPair(): void {
    if (this.#pairs.some((p) => p.up && !p.prefill.lost && !p.decode.lost)) return;
    this.#share.failWaiting({
      code: "node_unavailable",
      message: "Every prefill/decode node pair went down while the request waited; retry later",
      retryAfter: 1,
    });
  }

  #nodeLost(slot: Slot): void {
    if (slot.lost) return;
    slot.lost = true;
    if (slot.ping !== null) clearTimeout(slot.ping.timer);
    slot.ping = null;
    for (const [id, waiter] of this.#statsWaiters) {
      if (waiter.node === slot.id) {
        this.#statsWaiters.delete(id);
        waiter.resolve(null);
      }
    }
    const role = slot.role;
    if (role === "prefill") {
      // Decode nodes fence the lost prefill node (close its channel) before releasing its pages.
      for (const pair of this.#pairs) {
        if (pair.prefill !== slot || pair.decode.lost) continue;
        try {
          pair.decode.node.link.send({ kind: "prefill_lost", prefill: slot.id });
        } catch {
          // That decode node is going too.
        }
      }
    }
    for (const pair of this.#pairs) {
      if (pair.prefill === slot || pair.decode === slot) {
        pair.up = false;
        this.#step(pair, { type: "peer_lost", role });
      }
    }
    this.#failWaitingIfNoPair();
  }

  #step(pair: Pair, event: RouterEvent): void {
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
    if (n < effect.tokens.length) pending.stopped = true;
    if (n > 0) {
      this.#timeTokens(pending, n);
      const all = n === effect.tokens.length;
      pending.events.onTokens(
        all ? effect.tokens : effect.tokens.slice(0, n),
        lp === undefined || lp.length < n ? undefined : all ? lp : lp.slice(0, n),
      );
    }
  }

  /** `n` tokens reach the client now: the first token's time, or each token's share of the gap. */
  #timeTokens(pending: Pending, n: number): void {
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
  #respond(pair: Pair, effect: RespondEffect): void {
    const pending = this.#requests.get(effect.rid);
    delete pair.state.requests[effect.rid];
    if (pending === undefined) return;
    this.#requests.delete(effect.rid);
    const group = pending.group;
    if (
      group !== null &&
      (pending.rid !== effect.rid || (group.pair === null && this.#open.has(group.request.rid)))
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
    if (effect.error?.code === "node_unavailable" && this.#moveToAnotherPair(pending)) return;
    this.#open.delete(pending.request.rid);
    if (group === null) this.#share.finished(pending);
    if (pending.silenced) return;
    if (effect.error === null) {
      // A stop token ends it with `stop` even as its last allowed token (max_tokens 1: decode
      // finished the request at commit, by its length).
      pending.events.onFinish(pending.stopped ? "stop" : (effect.finishReason ?? "length"), {
        promptTokens: pending.promptTokens.length,
        completionTokens: pending.completionTokens,
        ...(pending.cachedTokens === null ? {} : { cachedTokens: pending.cachedTokens }),
      });
    } else pending.events.onError(effect.error);
  }

  /**
   * A node of its pair refused `pending` for want of pages: it goes back to the front of its
   * tenant's queue and that node takes nothing more until it frees pages. False when it cannot
   * wait (the queue takes none, the pair is down, or the request is larger than that whole pool:
   * it would wait forever); the refusal then reaches the client.
   */
  #waitForPages(pending: Pending): boolean {
    const slot = pending.refusedForPages!;
    pending.refusedForPages = null;
    // Decode reserves the prompt and max_tokens, prefill the prompt's pages.
    const needed = slot.role === "decode" ? pending.decodePages : pending.prefillPages;
    if (this.#closed || needed > poolPages(slot) || pending.pair === null || !pending.pair.up) return false;
    slot.full = true;
    pending.pair = null;
    if (!this.#share.returned(pending)) return false;
    this.#share.pump();
    return true;
  }

  /**
   * Its pair lost a node before the request's first token: it goes back to the front of its
   * tenant's queue, to run as a fresh attempt on a pair that is up (once; false when it cannot:
   * a token already streamed, aborted, moved before, or no other pair is usable).
   */
  #moveToAnotherPair(pending: Pending): boolean {
    if (pending.silenced || pending.firstToken || pending.moved >= MAX_MOVES || this.#closed) return false;
    const from = pending.pair;
    if (!this.#pairs.some((p) => p !== from && this.#usable(p))) return false;
    pending.moved++;
    pending.pair = null;
    if (!this.#share.returned(pending)) return false;
    this.#share.pump();
    return true;
  }

  #send(pair: Pair, slot: Slot, msg: ControlMessage): void {
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
                promptTokens: pending.promptTokens,
                cacheSalt: pending.request.cacheSalt ?? null,
                cacheScope: pending.request.cacheScope ?? "",
              },
        ...(pending === undefined ? {} : { sampling: pending.sampling }),
        ...(trace === undefined ? {} : { trace }),
      };
    } else if (msg.type === "reserve" && pending !== undefined) {
      const sampling = pending.sampling;
      const readsPrompt = (sampling.controls?.repetitionPenalty ?? 1) !== 1;
      pending.reserveSentAt = performance.now();
      message = {
        kind: "protocol",
        prefill: pair.prefill.id,
        msg,
        sampling: readsPrompt ? { ...sampling, prompt: pending.promptTokens } : sampling,
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

/** A node's slot as it joins: up, answering, nothing booked on it, in the membership. */
function newSlot(node: RouterNode): Slot {
  return {
    id: node.id,
    role: node.hello.role,
    node,
    lost: false,
    answering: true,
    ping: null,
    usedPages: 0,
    running: 0,
    full: false,
    member: true,
    cachedPages: null,
  };
}

/** A router phase of `p` that began at `startMs` (`performance.now()`) and ends now, as a span (tracing on). */
function traceSince(p: Pending, name: string, startMs: number): void {
  if (tracing() !== null) traceSpan(p.request.trace, name, epochOf(startMs));
}
