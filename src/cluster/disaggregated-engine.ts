/**
 * The router side of the disaggregated topology: an `EngineHandle` (so the HTTP layer is the same
 * as with one engine) that runs the protocol's router state machine (`routerStep`) and talks to the
 * prefill and decode nodes over `Link`s — MessagePorts of worker threads or authenticated TCP links
 * of processes.
 *
 * One router state machine per (prefill, decode) pair, so a node's loss (`peer_lost`) reaches only
 * the requests that use it; each request goes to one pair, round-robin over the pairs whose decode
 * node has its transfer channel to the prefill node up. The effective context length is the least
 * of the model's window and every node's pool and context length; each node re-checks at its own
 * door and its rejection reaches the client unchanged. Effects become link messages (the prompt's
 * token ids and the sampling parameters ride along), `GenerationEvents` calls, and, on `respond`,
 * the end of the request. A link's close is the node's loss: every in-flight request on it fails
 * with 503 `node_unavailable`; decode nodes hear of a lost prefill node and fence it.
 *
 * A full pool is a wait, not an error: when decode refuses a reservation, or prefill its source
 * pages, with `pool_exhausted`, the request joins that node's admission queue (FIFO, bounded by
 * `maxWaiting` over all nodes; 503 `pool_exhausted` only when the queue is full) and is submitted
 * again — as a fresh attempt under a new internal request id, since the refused one is tombstoned —
 * when that node reports freed pages (`pages_freed`). No timer: a node's freed pages are the only
 * wake-up, and a waiting request fails with 503 if its pair goes down.
 */

import type { WireError } from "../lib/errors.js";
import type { NodeInfo } from "../protocol/admin-wire.js";
import { decodeReservationPages } from "../protocol/decode-machine.js";
import type { Effects, RespondEffect, TokensEffect } from "../protocol/effects.js";
import type {
  EngineCapacity,
  EngineHandle,
  EngineStats,
  GenerationEvents,
  GenerationRequest,
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
import type { ControlMessage } from "../protocol/wire.js";
import type { FromNode, Link, NodeHello, NodeStats, SamplingParams, ToNode } from "./node-messages.js";

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
  /** Requests that may wait for pages at once (0: a full pool answers 503). Default 64. */
  readonly maxWaiting?: number;
}

interface Pair {
  readonly key: string;
  readonly prefill: RouterNode;
  readonly decode: RouterNode;
  readonly state: RouterState;
  up: boolean;
}

interface Pending {
  readonly pair: Pair;
  /** The rid of the current attempt: `request.rid`, or an internal one after waiting for pages. */
  rid: number;
  /** The node of its pair that refused the attempt for want of pages, if one did. */
  refusedForPages: RouterNode | null;
  readonly request: GenerationRequest;
  readonly events: GenerationEvents;
  readonly sampling: SamplingParams;
  readonly promptTokens: number[];
  completionTokens: number;
  stopped: boolean;
  silenced: boolean;
}

const STATS_TIMEOUT_MS = 5000;
/** Internal request ids of re-submitted requests, above the router's own (which count from 1). */
const FIRST_INTERNAL_RID = 0x8000_0000;
const LAST_INTERNAL_RID = 0xffff_fff0;

export class DisaggregatedEngine implements EngineHandle {
  readonly capacity: EngineCapacity;
  readonly #config: RouterConfig;
  readonly #safety: Safety;
  readonly #pairs: Pair[] = [];
  readonly #nodes: RouterNode[];
  readonly #lost = new Set<string>();
  readonly #requests = new Map<number, Pending>();
  readonly #statsWaiters = new Map<number, { node: string; resolve: (s: NodeStats | null) => void }>();
  readonly #out: Effects = [];
  readonly #routerContext: RouterContext;
  /** Per-transfer GB/s and ABORT_ACK latencies drained from the nodes, until `takeObservations`. */
  #gbps: number[] = [];
  #ackSeconds: number[] = [];
  readonly #observers: ((node: RouterNode, msg: ControlMessage) => void)[] = [];
  #nextPair = 0;
  #nextStatsId = 1;
  #closed = false;
  readonly #maxWaiting: number;
  /** Per node id: requests waiting for its pages, FIFO. */
  readonly #waiting = new Map<string, Pending[]>();
  #waitingCount = 0;
  /** Requests aborted by the router (`abort` of a live or waiting request). */
  #aborts = 0;
  /** The client's rid → the internal rid of its current attempt, for a request that waited. */
  readonly #aliases = new Map<number, number>();
  #nextInternalRid = FIRST_INTERNAL_RID;

  constructor(options: DisaggregatedEngineOptions) {
    if (options.prefill.length === 0 || options.decode.length === 0) {
      throw new Error("A disaggregated engine needs at least one prefill node and one decode node");
    }
    this.#safety = options.safety;
    this.#maxWaiting = options.maxWaiting ?? 64;
    this.#nodes = [...options.prefill, ...options.decode];
    const min = (f: (n: RouterNode) => number, nodes: readonly RouterNode[]) => Math.min(...nodes.map(f));
    const pageSize = options.decode[0]!.hello.pageSize;
    const nodeLimit = min((n) => Math.min(n.hello.maxModelLen, n.hello.poolTokens), this.#nodes);
    this.#config = {
      maxModelLen: Math.min(
        options.maxModelLen,
        min((n) => n.hello.maxModelLen, this.#nodes),
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
    this.capacity = Object.freeze({
      poolTokens: trustWindow
        ? Math.max(...this.#nodes.map((n) => n.hello.poolTokens), this.#config.maxModelLen)
        : min((n) => n.hello.poolTokens, this.#nodes),
      pageSize,
      maxModelLen: trustWindow ? this.#config.maxModelLen : Math.min(options.maxModelLen, nodeLimit),
    });
    for (const p of options.prefill) {
      for (const d of options.decode) {
        this.#pairs.push({
          key: `${p.id}|${d.id}`,
          prefill: p,
          decode: d,
          state: initialRouterState(),
          up: false,
        });
      }
    }
    for (const node of this.#nodes) {
      node.link.onMessage((m) => this.#onNodeMessage(node, m));
      node.link.onClose(() => this.#nodeLost(node));
    }
  }

  /** Marks the transfer channel of a (prefill, decode) pair up (the decode node connected to the prefill node). */
  pairUp(prefillId: string, decodeId: string, up = true): void {
    for (const pair of this.#pairs)
      if (pair.prefill.id === prefillId && pair.decode.id === decodeId) pair.up = up;
  }

  /** True when every pair's transfer channel is up. */
  get allPairsUp(): boolean {
    return this.#pairs.every((p) => p.up);
  }

  /** Requests submitted and not yet ended (waiting for pages included). */
  get inFlight(): number {
    return this.#requests.size + this.#waitingCount;
  }

  /** Requests waiting for a full pool now. */
  get waiting(): number {
    return this.#waitingCount;
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
    return this.#nodes.map((n) => ({
      id: n.id,
      role: n.hello.role,
      url: n.url,
      pool_tokens: n.hello.poolTokens,
      page_size: n.hello.pageSize,
      max_model_len: n.hello.maxModelLen,
      up: !this.#lost.has(n.id),
    }));
  }

  submit(request: GenerationRequest, events: GenerationEvents): void {
    const pair = this.#pickPair();
    if (pair === null) {
      events.onError({
        code: "node_unavailable",
        message: "No prefill/decode node pair is available: every pair has a node down; retry later",
      });
      return;
    }
    if (this.#requests.has(request.rid)) {
      events.onError({
        code: "invalid_request",
        message: `Request id is already in use: ${request.rid}; assign a fresh rid`,
      });
      return;
    }
    this.#requests.set(request.rid, {
      pair,
      rid: request.rid,
      refusedForPages: null,
      request,
      events,
      sampling: {
        temperature: request.temperature,
        topP: request.topP,
        topK: request.topK,
        seed: request.seed,
        stopTokenIds: request.stopTokenIds,
      },
      promptTokens: Array.from(request.promptTokens),
      completionTokens: 0,
      stopped: false,
      silenced: false,
    });
    this.#step(pair, {
      type: "submit",
      rid: request.rid,
      tenant: request.tenant,
      promptLen: request.promptTokens.length,
      maxTokens: request.maxTokens,
    });
  }

  abort(rid: number): void {
    const pending = this.#requests.get(this.#aliases.get(rid) ?? rid);
    if (pending === undefined) {
      // Waiting for pages: it holds nothing anywhere, so it just leaves the queue.
      this.#aborts += this.#dropWaiting((p) => p.request.rid === rid, null);
      return;
    }
    if (!pending.silenced) this.#aborts++;
    pending.silenced = true;
    this.#step(pending.pair, { type: "client_abort", rid: pending.rid });
  }

  /** Every node's stats (null for a node that did not answer or is lost). */
  async nodeStats(): Promise<{ node: RouterNode; stats: NodeStats | null }[]> {
    const all = await Promise.all(
      this.#nodes.map(async (node) => ({
        node,
        stats: this.#lost.has(node.id) ? null : await this.#poll(node),
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
      queue: { waiting: this.#waitingCount, running: 0, preempted: 0 },
      counters: { tagCheckFailures: 0, preemptions: 0, aborts: 0, promptTokens: 0, completionTokens: 0 },
    };
    let answered = 0;
    for (const { stats } of all) {
      if (stats === null) continue;
      answered++;
      for (const k of ["free", "reserved", "ready", "quarantined", "total"] as const)
        sum.pages[k] += stats.pages[k];
      for (const k of ["waiting", "running", "preempted"] as const) sum.queue[k] += stats.queue[k];
      for (const k of ["tagCheckFailures", "preemptions"] as const) sum.counters[k] += stats.counters[k];
    }
    if (answered === 0) throw new Error("No node answers");
    // Aborts are the router's (a client gone, a stop string matched), as on one engine; the nodes'
    // own counts would miss a request aborted before decode ran it and count some twice.
    sum.counters.aborts = this.#aborts;
    return sum;
  }

  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    this.#dropWaiting(() => true, {
      code: "node_unavailable",
      message: "The server is shutting down: request not finished; retry",
    });
    for (const [rid, pending] of this.#requests) {
      this.#requests.delete(rid);
      if (!pending.silenced) {
        pending.events.onError({
          code: "node_unavailable",
          message: "The server is shutting down: request not finished; retry",
        });
      }
    }
    for (const node of this.#nodes) node.link.close();
  }

  #pickPair(): Pair | null {
    const n = this.#pairs.length;
    for (let i = 0; i < n; i++) {
      const pair = this.#pairs[(this.#nextPair + i) % n]!;
      if (pair.up && !this.#lost.has(pair.prefill.id) && !this.#lost.has(pair.decode.id)) {
        this.#nextPair = (this.#nextPair + i + 1) % n;
        return pair;
      }
    }
    return null;
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

  #onNodeMessage(node: RouterNode, message: FromNode): void {
    switch (message.kind) {
      case "protocol":
        this.#onProtocol(node, message.msg);
        return;
      case "stats": {
        const waiter = this.#statsWaiters.get(message.id);
        if (waiter === undefined) return;
        this.#statsWaiters.delete(message.id);
        waiter.resolve(message.stats);
        return;
      }
      case "prefill_up":
        this.pairUp(message.prefill, node.id, true);
        return;
      case "prefill_down":
        this.#prefillDown(node, message.prefill);
        return;
      case "pages_freed":
        this.#wake(node.id);
        return;
      default:
        return;
    }
  }

  /** A protocol message from a node of the request's pair (from any other node, dropped). */
  #onProtocol(node: RouterNode, msg: ControlMessage): void {
    const pending = this.#requests.get(msg.rid);
    if (pending === undefined) return;
    const pair = pending.pair;
    if (node !== pair.prefill && node !== pair.decode) return;
    if (msg.type === "finished") pending.completionTokens = msg.completionTokens;
    if (msg.type === "rejected") pending.refusedForPages = msg.error.code === "pool_exhausted" ? node : null;
    this.#step(pair, { type: "message", msg });
    for (const listener of this.#observers) listener(node, msg);
  }

  /**
   * Decode node `decode` lost its transfer channel to `prefill` (it fenced that prefill node): the
   * pair's requests that still need a transfer fail with 503; the pair takes no new ones.
   */
  #prefillDown(decode: RouterNode, prefill: string): void {
    for (const pair of this.#pairs) {
      if (pair.prefill.id !== prefill || pair.decode !== decode) continue;
      pair.up = false;
      this.#step(pair, { type: "peer_lost", role: "prefill" });
    }
    this.#dropWaiting((p) => p.pair.prefill.id === prefill && p.pair.decode === decode, {
      code: "node_unavailable",
      message: `The prefill node went away while the request waited for pages: ${prefill}`,
    });
  }

  /**
   * Queues a request a node of its pair refused for want of pages; false when the queue is full (the
   * refusal then reaches the client).
   */
  #wait(pending: Pending): boolean {
    const node = pending.refusedForPages;
    if (node === null || this.#closed || this.#waitingCount >= this.#maxWaiting || !pending.pair.up)
      return false;
    // Only a request the whole pool can hold may wait for it; anything larger would wait forever.
    // Decode reserves the prompt and max_tokens, prefill the prompt's pages.
    const { poolTokens, pageSize } = node.hello;
    const r = pending.request;
    const needed =
      node === pending.pair.decode
        ? decodeReservationPages(r.promptTokens.length, r.maxTokens, pageSize)
        : Math.ceil(r.promptTokens.length / pageSize);
    if (needed > Math.floor(poolTokens / pageSize)) return false;
    pending.refusedForPages = null;
    const id = node.id;
    let queue = this.#waiting.get(id);
    if (queue === undefined) {
      queue = [];
      this.#waiting.set(id, queue);
    }
    queue.push(pending);
    this.#waitingCount++;
    return true;
  }

  /** Node `id` freed pages: submit the requests waiting for it again, oldest first. */
  #wake(id: string): void {
    const queue = this.#waiting.get(id);
    if (queue === undefined || queue.length === 0) return;
    this.#waiting.delete(id);
    this.#waitingCount -= queue.length;
    for (const pending of queue) {
      const rid = this.#nextInternalRid;
      this.#nextInternalRid = rid >= LAST_INTERNAL_RID ? FIRST_INTERNAL_RID : rid + 1;
      pending.rid = rid;
      this.#aliases.set(pending.request.rid, rid);
      this.#requests.set(rid, pending);
      this.#step(pending.pair, {
        type: "submit",
        rid,
        tenant: pending.request.tenant,
        promptLen: pending.request.promptTokens.length,
        maxTokens: pending.request.maxTokens,
      });
    }
  }

  /** Removes the waiting requests that `match`, failing each with `error` (null: silently); how many. */
  #dropWaiting(match: (p: Pending) => boolean, error: WireError | null): number {
    let dropped = 0;
    for (const [id, queue] of this.#waiting) {
      const keep = queue.filter((p) => !match(p));
      if (keep.length === queue.length) continue;
      dropped += queue.length - keep.length;
      this.#waitingCount -= queue.length - keep.length;
      if (keep.length === 0) this.#waiting.delete(id);
      else this.#waiting.set(id, keep);
      if (error !== null) for (const p of queue) if (match(p)) p.events.onError(error);
    }
    return dropped;
  }

  #nodeLost(node: RouterNode): void {
    if (this.#lost.has(node.id)) return;
    this.#lost.add(node.id);
    for (const [id, waiter] of this.#statsWaiters) {
      if (waiter.node === node.id) {
        this.#statsWaiters.delete(id);
        waiter.resolve(null);
      }
    }
    const role = node.hello.role;
    this.#dropWaiting((p) => p.pair.prefill === node || p.pair.decode === node, {
      code: "node_unavailable",
      message: `The ${role} node went away while the request waited for pages: ${node.id}`,
    });
    if (role === "prefill") {
      // Decode nodes fence the lost prefill node (close its channel) before releasing its pages.
      for (const pair of this.#pairs) {
        if (pair.prefill !== node || this.#lost.has(pair.decode.id)) continue;
        try {
          pair.decode.link.send({ kind: "prefill_lost", prefill: node.id });
        } catch {
          // That decode node is going too.
        }
      }
    }
    for (const pair of this.#pairs) {
      if (pair.prefill === node || pair.decode === node) {
        pair.up = false;
        this.#step(pair, { type: "peer_lost", role });
      }
    }
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
    // A stop token ends the stream; decode reports the finish.
    let n = 0;
    while (n < effect.tokens.length && !pending.sampling.stopTokenIds.includes(effect.tokens[n]!)) n++;
    if (n < effect.tokens.length) pending.stopped = true;
    if (n > 0)
      pending.events.onTokens(n === effect.tokens.length ? effect.tokens : effect.tokens.slice(0, n));
  }

  /**
   * The machine is done with a request: it waits for pages (refused by a full pool that can hold
   * it), or its client learns the finish or the error.
   */
  #respond(pair: Pair, effect: RespondEffect): void {
    const pending = this.#requests.get(effect.rid);
    delete pair.state.requests[effect.rid];
    if (pending === undefined) return;
    this.#requests.delete(effect.rid);
    const mayWait =
      !pending.silenced && effect.error?.code === "pool_exhausted" && pending.refusedForPages !== null;
    if (mayWait && this.#wait(pending)) return;
    if (pending.rid !== pending.request.rid) this.#aliases.delete(pending.request.rid);
    if (pending.silenced) return;
    if (effect.error === null) {
      pending.events.onFinish(effect.finishReason ?? "length", {
        promptTokens: pending.promptTokens.length,
        completionTokens: pending.completionTokens,
      });
    } else pending.events.onError(effect.error);
  }

  #send(pair: Pair, node: RouterNode, msg: ControlMessage): void {
    if (this.#lost.has(node.id)) return;
    const pending = this.#requests.get(msg.rid);
    let message: ToNode;
    if (msg.type === "prefill") {
      message = {
        kind: "protocol",
        prefill: pair.prefill.id,
        msg: pending === undefined ? msg : { ...msg, promptTokens: pending.promptTokens },
        ...(pending === undefined ? {} : { sampling: pending.sampling }),
      };
    } else if (msg.type === "reserve" && pending !== undefined) {
      message = { kind: "protocol", prefill: pair.prefill.id, msg, sampling: pending.sampling };
    } else message = { kind: "protocol", prefill: pair.prefill.id, msg };
    try {
      node.link.send(message);
    } catch {
      // The link is closing; its close event fails the request.
    }
  }
}
