/**
 * The decode node (docs/design.md §2): the engine in decode mode, driven by the protocol's decode state
 * machine (`decodeStep`), with the transport injected — the same class runs in a worker thread
 * (shared-memory receiver) and in a process (TCP receiver). What both roles share (the parts built
 * from the options, `pages_freed`, the statistics) is `NodeCore`'s (node-core.ts).
 *
 * One decode state machine per prefill peer, all over this node's one pool and one incarnation:
 * the router pairs each attempt with a prefill node and says which, so a prefill node's fence
 * (its channel closed, its worker gone) releases exactly the pages it could still write.
 *
 * Effects: `commit` → `Engine.submitDecode` with the committed pages and prefill's first token.
 * Before each of its steps the engine asks this node to check the pages (`ExternalPages.checkStep`
 * → the machine's `check`: the one page-tag check of a token, with the engine's own rule set; a
 * failure fails the attempt and the engine drops the request), and each token it samples feeds the
 * machine's `step` (which stamps the page the step wrote; at `max_tokens` it frees the pages and
 * reports `finished`). A stop token ends the attempt (the machine frees the committed pages) and
 * reports `finished` with reason `stop`; `stop` → `Engine.abort`. A fence closes the channel first,
 * so no further frame of that prefill node can land, and only then feeds `peer_lost`. Nothing is
 * released on a timer.
 *
 * The per-token path allocates nothing (decode-node.test.ts measures it): the events are the
 * attempt's own, reused; the attempt key is built once, at commit; the `tokens` message and its
 * envelope to the router are reused, so `toRouter` must send a message on before it returns and
 * never keep it.
 *
 * Whenever a step frees pages the node tells the router (`pages_freed`), which retries the
 * requests it holds back because this pool was full.
 *
 * Checksums are taken as pages land, off the commit's critical path: the transport's `pagesLanded`
 * (through the peer's `prefillLink`, the one receiver wiring both forms use) hashes each landed
 * page of a reserved lease (`PageChecksums`, with the page's generation, writer stamp and filled
 * tokens), and the machine's commit check reads those records through the protocol pool's `pageChecksum` — a page whose record no longer matches
 * its table entry (another writer stamped it, it was freed or reallocated) is hashed again then.
 */

import type { WireError } from "../lib/errors.js";
import { PHASE } from "../lib/phase-recorder.js";
import type { TokenLogprobs } from "../lib/token-logprobs.js";
import { epochNow, epochOf, type RequestTrace, traceSpan, tracing } from "../lib/tracing.js";
import type { NodeStats, ToNode } from "../links/node-messages.js";
import {
  type DecodeContext,
  type DecodeEvent,
  type DecodeState,
  decodeContext,
  decodeStep,
  initialDecodeState,
  leasedPage,
} from "../protocol/decode-machine.js";
import type { CommitEffect, Effects } from "../protocol/effects.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { guardOn } from "../protocol/safety.js";
import { GREEDY_SAMPLING, type SamplingParams } from "../protocol/sampling-params.js";
import { attemptKey, type ControlMessage, type FirstLogprobs } from "../protocol/wire.js";
import type { TransferMetrics } from "../transfer/transfer-metrics.js";
import type { TransferHandlers } from "../transfer/transport.js";
import { DecodeNodePrefix, recordToken } from "./decode-prefix.js";
import { addTransfer, NodeCore, type NodeOptions } from "./node-core.js";

/** What the router sent for an attempt that its engine request needs. */
interface AttemptInput {
  readonly sampling: SamplingParams;
  /** The prompt's ids, sent only when the sampling reads them (a repetition penalty). */
  readonly prompt: Int32Array | undefined;
}

/** `toRouter` must send a message on before it returns and never keep it: the node reuses the one carrying each token. */
export type DecodeNodeOptions = NodeOptions;

/** The decode end of one prefill peer's transfer channel. */
export interface PrefillChannel {
  sendControl(message: ControlMessage): void;
  /** Closes the channel: after it, no frame of this peer lands any more. */
  close(): void | Promise<void>;
  readonly metrics?: TransferMetrics;
}

/** The decode end of one prefill peer's transfer receiver, for either form (shared memory, TCP). */
export interface PrefillLink {
  /**
   * The handlers to give the receiver (the form adds its own `closed`): control messages feed the
   * peer's machine once attached, landed pages are hashed for the commit check, a landed lease's
   * GB/s is recorded, and a write the lease check dropped fails its attempt if it still awaits it.
   */
  readonly handlers: Required<
    Pick<TransferHandlers, "control" | "pagesLanded" | "leaseLanded" | "writeDropped">
  >;
  /** The receiver is connected: its channel to the prefill node of `incarnation` is up. */
  attach(channel: PrefillChannel, incarnation: number): void;
  /** Decode's page for logical page `index` of `(rid, epoch)`, or -1 (the receiver's lease check). */
  leasedPage(rid: number, epoch: number, index: number): number;
}

interface PrefillPeer {
  readonly id: string;
  readonly state: DecodeState;
  channel: PrefillChannel | null;
  /** The incarnation of the prefill node behind `channel` (0 before the first one). */
  incarnation: number;
}

/**
 * With the `quarantine` guard off (`--unsafe-disable-guard quarantine`), quarantined pages are
 * released on this timer instead of on the writer's ABORT_ACK or fence — the deferred-release
 * timeout of SGLang #35049, "itself a use-after-free window" (#38961). Never used with the guard on.
 */
export const QUARANTINE_TIMEOUT_MS = 2000;

export class DecodeNode {
  readonly incarnation: number;
  readonly #core: NodeCore;
  readonly #engine;
  readonly #safety;
  readonly #peers = new Map<string, PrefillPeer>();
  /** Per attempt: the sampling the router sent, and the prompt's ids when that sampling reads them. */
  readonly #inputs = new Map<string, AttemptInput>();
  /** n > 1 as one group, until its first sample ends: the later samples' rids, by the group's attempt key. */
  readonly #groups = new Map<string, readonly number[]>();
  /** Samples of n > 1 that started from their group's one transfer (forked at its commit). */
  #forkedSamples = 0;
  /** Tracing on: each attempt's request trace, and when it committed (epoch ms; 0: not yet). */
  readonly #traces = new Map<string, { readonly trace: RequestTrace; committedAt: number }>();
  /** rid → epoch of the attempt the engine runs now. */
  readonly #running = new Map<number, number>();
  /** Attempts whose abort was relayed to prefill, with the time, for the ABORT_ACK latency. */
  readonly #abortSent = new Map<string, bigint>();
  /**
   * The machine's effects sink. Its first entry is a placeholder that is never handled, so the
   * array is never truncated to length 0: V8 drops an array's backing store then, and the next
   * push — every token's — would allocate a new one.
   */
  readonly #out: Effects = [{ kind: "stop", rid: -1, epoch: -1 }];
  readonly #context: DecodeContext;
  /** The envelope of every `tokens` message to the router, reused (see `NodeOptions.toRouter`). */
  readonly #tokensEnvelope: { kind: "protocol"; msg: ControlMessage; logprobs?: TokenLogprobs[] } = {
    kind: "protocol",
    msg: { type: "tokens", rid: 0, epoch: 0, tokens: [] },
  };
  /** Per attempt that asked: what prefill computed of its log-probabilities (from its manifest). */
  readonly #firstLogprobs = new Map<string, FirstLogprobs>();
  /** The log-probabilities of the token being stepped now (the engine's), or null. */
  #stepLogprobs: TokenLogprobs[] | null = null;
  /** The rid whose page check runs now (its failure ends it in the engine, which asked): or -1. */
  #checking = -1;
  #checksumFailures = 0;
  #coverageFailures = 0;
  /** Page-tag failures of the decode machine (at commit or a step), beside the engine's own. */
  #machineTagFailures = 0;
  #ackSeconds: number[] = [];
  /** Quarantine release timers (only with the quarantine guard off), by attempt key. */
  readonly #quarantineTimers = new Map<string, NodeJS.Timeout>();
  /** Decode-side reuse (the engine's prefix cache on): each attempt's tokens, for the machine's cache. */
  readonly #prefix: DecodeNodePrefix | null;

  constructor(options: DecodeNodeOptions) {
    this.#core = new NodeCore(options);
    this.incarnation = options.incarnation;
    this.#engine = options.engine;
    this.#safety = options.safety;
    const core = this.#core;
    const cache = options.engine.prefixCache;
    this.#prefix = cache === null ? null : new DecodeNodePrefix(cache, core.safety);
    this.#context = decodeContext(core.pool, core.config, core.safety, this.#out, this.#prefix?.prefix);
  }

  /**
   * The link to prefill node `id`, for the form to wire its transfer receiver with (see
   * `PrefillLink`); `attach` once the receiver is connected.
   */
  prefillLink(id: string): PrefillLink {
    let channel: PrefillChannel | null = null;
    let onControl = (_message: ControlMessage): void => {};
    return {
      handlers: {
        control: (message) => onControl(message),
        // Logical pages [from, to) of (rid, epoch) landed: hash them now (while later pages are
        // still in flight), for the commit check to read.
        pagesLanded: (rid, epoch, from, to) => {
          const peer = this.#peers.get(id);
          if (peer === undefined || !guardOn(this.#safety, "checksum")) return;
          for (let i = from; i < to; i++) {
            const page = leasedPage(peer.state, rid, epoch, i);
            if (page >= 0) this.#core.checksums.record(page, rid, epoch, i);
          }
        },
        leaseLanded: () => this.#core.recordGbps(channel?.metrics?.lastTransferGbps ?? 0),
        writeDropped: (rid, epoch, page) => this.#writeDropped(id, rid, epoch, page),
      },
      attach: (c, incarnation) => {
        channel = c;
        onControl = this.#attachPrefill(id, c, incarnation);
      },
      leasedPage: (rid, epoch, index) => {
        const peer = this.#peers.get(id);
        return peer === undefined ? -1 : leasedPage(peer.state, rid, epoch, index);
      },
    };
  }

  /**
   * The transfer channel to prefill node `id` (of `incarnation`) is up; returns the handler for
   * its control messages.
   */
  #attachPrefill(
    id: string,
    channel: PrefillChannel,
    incarnation: number,
  ): (message: ControlMessage) => void {
    const peer = this.#peer(id);
    peer.channel = channel;
    peer.incarnation = incarnation;
    this.#step(peer, { type: "peer_up", role: "prefill", incarnation });
    return (message) => {
      if (peer.channel !== channel) return;
      if (message.type === "manifest" && message.logprobs !== undefined)
        this.#firstLogprobs.set(attemptKey(message.rid, message.epoch), message.logprobs);
      this.#step(peer, { type: "message", msg: message });
    };
  }

  /**
   * The receiver's lease check dropped a write of prefill node `id` for `(rid, epoch)`. If that
   * attempt still awaits its transfer, the transfer is wrong: fail it closed (5xx, never a commit
   * over a page that did not get its data); a write of an attempt that already ended is only stale.
   */
  #writeDropped(id: string, rid: number, epoch: number, page: number): void {
    const peer = this.#peers.get(id);
    const a = peer?.state.attempts[attemptKey(rid, epoch)];
    if (peer === undefined || a === undefined || a.phase !== "reserved") return;
    this.#core.toRouter({
      kind: "protocol",
      msg: {
        type: "failed",
        rid,
        epoch,
        error: {
          code: "transfer_failed",
          message: `The lease check refused a KV page write of request ${rid} outside its lease: page ${page}`,
        },
      },
    });
    this.#step(peer, { type: "message", msg: { type: "abort", rid, epoch } });
  }

  /**
   * Prefill node `id` is gone (its channel closed, its worker exited, or the router saw it go):
   * close the channel first — the fence: no frame of it lands after this — then release what only
   * it could still write.
   */
  prefillLost(id: string): void {
    const peer = this.#peers.get(id);
    if (peer === undefined) return;
    const channel = peer.channel;
    peer.channel = null;
    if (channel !== null) {
      if (channel.metrics !== undefined) addTransfer(this.#core.closedTotals, channel.metrics);
      void channel.close();
    }
    this.#step(peer, { type: "peer_lost", role: "prefill", incarnation: peer.incarnation });
    // Aborts relayed to the lost node will never be acknowledged: stop timing them.
    for (const key of this.#abortSent.keys()) {
      let open = false;
      for (const p of this.#peers.values()) if (p.state.attempts[key] !== undefined) open = true;
      if (!open) this.#abortSent.delete(key);
    }
  }

  onRouter(message: ToNode): void {
    if (message.kind === "prefill_lost") {
      this.prefillLost(message.prefill);
      return;
    }
    if (message.kind !== "protocol") return;
    const msg = message.msg;
    this.#core.seeRouter(msg);
    const peer = this.#peer(message.prefill);
    if (msg.type === "reserve") {
      if (peer.channel === null) {
        this.#core.toRouter({
          kind: "protocol",
          msg: {
            type: "rejected",
            rid: msg.rid,
            epoch: msg.epoch,
            from: "decode",
            error: {
              code: "node_unavailable",
              message: `The decode node has no transfer channel to prefill node: ${message.prefill}`,
            },
          },
        });
        return;
      }
      this.#inputs.set(attemptKey(msg.rid, msg.epoch), {
        sampling: message.sampling ?? GREEDY_SAMPLING,
        prompt: msg.promptTokens,
      });
      this.#prefix?.reserve(msg);
      // n > 1 as one group: its later samples decode with their own seeds once the commit forks them.
      if (msg.samples !== undefined && msg.samples.length > 0)
        this.#groups.set(attemptKey(msg.rid, msg.epoch), msg.samples);
      if (message.trace !== undefined && tracing() !== null)
        this.#traces.set(attemptKey(msg.rid, msg.epoch), { trace: message.trace, committedAt: 0 });
    }
    this.#step(peer, { type: "message", msg });
  }

  /** See `NodeCore.ridFloor`. */
  ridFloor(slot: number): number {
    return this.#core.ridFloor(slot);
  }

  /**
   * The link of the router of `slot` closed (its fence): each of its attempts is aborted as its
   * ABORT would (docs/protocol.md §3, item 13); other routers' attempts go on.
   */
  routerLost(slot: number): void {
    for (const peer of this.#peers.values()) this.#step(peer, { type: "router_lost", slot });
  }

  stats(): NodeStats {
    const stats = this.#core.stats("decode", this.#peers.values(), (peer) => peer.channel?.metrics);
    const ack = this.#ackSeconds;
    this.#ackSeconds = [];
    return {
      ...stats,
      counters: {
        ...stats.counters,
        tagCheckFailures: stats.counters.tagCheckFailures + this.#machineTagFailures,
        forkedSamples: this.#forkedSamples,
      },
      transfer: {
        ...stats.transfer,
        checksumFailures: this.#checksumFailures,
        coverageFailures: this.#coverageFailures,
        pagesReused: this.#prefix?.pagesReused ?? 0,
      },
      // Decode's lookups save no compute (prefill's do: its hits are the prompt's cached tokens);
      // they are counted as pages reused by the transfer instead. Its pages and evictions count.
      ...(stats.prefixCache === undefined
        ? {}
        : { prefixCache: { ...stats.prefixCache, hits: 0, misses: 0, hitTokens: 0 } }),
      abortAckSeconds: ack,
    };
  }

  /** Attempts in flight over every prefill peer (a role switch waits for none). */
  inFlight(): number {
    let n = 0;
    for (const peer of this.#peers.values()) n += Object.keys(peer.state.attempts).length;
    return n;
  }

  /** Stops the node; `keepEngine`: its engine and pool serve the node's next role (role-switch.ts). */
  close(keepEngine = false): void {
    // The engine goes on under the next role: each prefill peer is fenced as if lost (its channel
    // closed first), so its attempts release their pages now.
    if (keepEngine) for (const id of [...this.#peers.keys()]) this.prefillLost(id);
    this.#core.loop.stop(keepEngine);
    for (const timer of this.#quarantineTimers.values()) clearTimeout(timer);
    this.#quarantineTimers.clear();
    for (const peer of this.#peers.values()) void peer.channel?.close();
  }

  /** The quarantine guard is off: release each newly quarantined attempt on a timer. */
  #armQuarantineTimers(peer: PrefillPeer): void {
    for (const key in peer.state.attempts) {
      const a = peer.state.attempts[key]!;
      if (a.phase !== "quarantined" || this.#quarantineTimers.has(key)) continue;
      const { rid, epoch } = a;
      const timer = setTimeout(() => {
        this.#quarantineTimers.delete(key);
        this.#step(peer, { type: "quarantine_timeout", rid, epoch });
      }, QUARANTINE_TIMEOUT_MS);
      timer.unref();
      this.#quarantineTimers.set(key, timer);
    }
  }

  #peer(id: string): PrefillPeer {
    let peer = this.#peers.get(id);
    if (peer === undefined) {
      peer = { id, state: initialDecodeState(this.incarnation, 0), channel: null, incarnation: 0 };
      this.#peers.set(id, peer);
    }
    return peer;
  }

  #step(peer: PrefillPeer, event: DecodeEvent): void {
    if (event.type === "message" && event.msg.type === "abort_ack") this.#ackReceived(event.msg);
    const out = this.#out;
    const start = out.length;
    const table = this.#core.pool.table;
    const freeBefore = this.#core.freePages();
    const sharedBefore = table.sharedPages();
    const stepStart = event.type === "message" ? performance.now() : 0;
    decodeStep(peer.state, event, this.#context);
    const freeAfter = this.#core.freePages();
    // An attempt's end frees its pages or hands them to the cache (SHARED, evictable): both make
    // room (O(1) counts: this runs per token).
    const freed = freeAfter + Math.max(0, table.sharedPages() - sharedBefore);
    // Effects [start, end) are this event's; a call nested in their handling (a router message
    // handled synchronously) appends after `end` and truncates back to it.
    const end = out.length;
    if (!guardOn(this.#safety, "quarantine")) this.#armQuarantineTimers(peer);
    // Commits start after the batch's messages are out: a first token that is a stop token ends
    // the attempt at once, and the router must see `committed` before that `finished` (sent the
    // other way round, the router dropped the `finished` and waited for tokens forever).
    let commits: [CommitEffect, number][] | null = null;
    for (let i = start; i < end; i++) {
      const effect = out[i]!;
      switch (effect.kind) {
        case "send":
          if (effect.to === "router") this.#sendRouter(effect.msg);
          else if (effect.to === "prefill") this.#sendPrefill(peer, effect.msg);
          break;
        case "commit":
          // The committed message (with prefill's first token) follows in the same batch.
          commits ??= [];
          commits.push([effect, committedToken(out, effect.rid, i + 1, end)]);
          break;
        case "copy": {
          // n > 1: a later sample's copy of the prompt's partial last page, before any of its steps.
          const pool = this.#engine.pool;
          const pf = pool.pageFloats;
          pool.data.copyWithin(effect.to * pf, effect.from * pf, (effect.from + 1) * pf);
          break;
        }
        case "stop":
          this.#stop(effect.rid, effect.epoch);
          break;
        default:
          break;
      }
    }
    out.length = start;
    // After the machine's own messages (a `finished` before its pages' news): requests the router
    // holds back for want of pages may try again.
    this.#core.reportFreed(freeBefore, freed);
    if (commits === null) return;
    // The machine's commit check (coverage, checksums, tags) ran in that step: its time.
    this.#core.engine.phases.since(PHASE.commit, stepStart);
    if (this.#traces.size > 0) this.#traceCommits(commits, stepStart);
    for (const [effect, firstToken] of commits) this.#commit(peer, effect, firstToken);
  }

  /** Tracing on: each commit's check as a span; the attempt's decode span starts now. */
  #traceCommits(commits: readonly [CommitEffect, number][], stepStart: number): void {
    const now = epochNow();
    for (const [effect] of commits) {
      const t = this.#traces.get(attemptKey(effect.rid, effect.epoch));
      if (t === undefined) continue;
      traceSpan(t.trace, "commit", epochOf(stepStart), { "kvfence.pages": effect.pages.length });
      t.committedAt = now;
    }
  }

  /** An ABORT_ACK came: its latency since the abort was relayed. */
  #ackReceived(msg: { readonly rid: number; readonly epoch: number }): void {
    const key = attemptKey(msg.rid, msg.epoch);
    const sent = this.#abortSent.get(key);
    if (sent === undefined) return;
    this.#abortSent.delete(key);
    this.#ackSeconds.push(Number(process.hrtime.bigint() - sent) / 1e9);
  }

  #sendRouter(msg: ControlMessage): void {
    if (msg.type === "tokens") {
      // The hot path: one token, in the machine's reused message and this reused envelope.
      const envelope = this.#tokensEnvelope;
      envelope.msg = msg;
      if (this.#stepLogprobs !== null) envelope.logprobs = this.#stepLogprobs;
      else if (envelope.logprobs !== undefined) delete envelope.logprobs;
      this.#core.toRouter(envelope);
      return;
    }
    if (msg.type === "committed") {
      const key = attemptKey(msg.rid, msg.epoch);
      const lp = this.#firstLogprobs.get(key);
      this.#firstLogprobs.delete(key);
      if (lp !== undefined) {
        this.#core.toRouter({
          kind: "protocol",
          msg,
          ...(lp.first === undefined ? {} : { logprobs: [lp.first] }),
          ...(lp.prompt === undefined ? {} : { promptLogprobs: lp.prompt }),
        });
        return;
      }
    }
    if (msg.type === "failed") {
      this.#countFailure(msg.error);
      if (msg.error.code === "page_tag_mismatch") this.#machineTagFailures++;
    }
    if (msg.type === "finished" || msg.type === "failed" || msg.type === "rejected") this.#ended(msg);
    if (msg.type === "finished" && msg.tokens.length > 0 && this.#stepLogprobs !== null) {
      this.#core.toRouter({ kind: "protocol", msg, logprobs: this.#stepLogprobs });
      return;
    }
    this.#core.toRouter({ kind: "protocol", msg });
  }

  /** An attempt ended: forget its sampling, log-probabilities and trace (ending its decode span). */
  #ended(msg: Extract<ControlMessage, { type: "finished" | "failed" | "rejected" }>): void {
    const key = attemptKey(msg.rid, msg.epoch);
    this.#inputs.delete(key);
    this.#prefix?.forget(key);
    this.#groups.delete(key);
    this.#firstLogprobs.delete(key);
    const t = this.#traces.get(key);
    if (t !== undefined && t.committedAt > 0)
      traceSpan(t.trace, "decode", t.committedAt, {
        "kvfence.outcome": msg.type,
        ...(msg.type === "finished" ? { "kvfence.completion_tokens": msg.completionTokens } : {}),
      });
    this.#traces.delete(key);
  }

  #sendPrefill(peer: PrefillPeer, msg: ControlMessage): void {
    if (msg.type === "abort") this.#abortSent.set(attemptKey(msg.rid, msg.epoch), process.hrtime.bigint());
    try {
      peer.channel?.sendControl(msg);
    } catch {
      // The channel is closing: its fence releases what this message would have.
    }
  }

  /** The machine ended an attempt: the engine stops it, if it runs it. */
  #stop(rid: number, epoch: number): void {
    if (this.#running.get(rid) === epoch) {
      this.#running.delete(rid);
      // A failed page check ends the request in the engine that asked for it.
      if (this.#checking !== rid) this.#engine.abort(rid);
    }
    this.#inputs.delete(attemptKey(rid, epoch));
    this.#prefix?.forget(attemptKey(rid, epoch));
    this.#groups.delete(attemptKey(rid, epoch));
    this.#traces.delete(attemptKey(rid, epoch));
  }

  /**
   * A later sample's input, as its commit forks it: its group's prompt and sampling, with the
   * sample's own seed (kept under its own key from now on, until it ends). Undefined when it is no
   * such sample.
   */
  #sampleInput(group: number | undefined, rid: number, epoch: number): AttemptInput | undefined {
    if (group === undefined || group === rid) return undefined;
    const groupKey = attemptKey(group, epoch);
    const base = this.#inputs.get(groupKey);
    const j = this.#groups.get(groupKey)?.indexOf(rid) ?? -1;
    if (base === undefined || j < 0) return undefined;
    const seed = base.sampling.sampleSeeds?.[j] ?? null;
    const own = { sampling: { ...base.sampling, seed }, prompt: base.prompt };
    this.#inputs.set(attemptKey(rid, epoch), own);
    return own;
  }

  /**
   * The engine's page check of the next step of `(rid, epoch)`: the machine's `check`. True when
   * the step may run; false when the attempt failed (reported) or is gone.
   */
  #check(peer: PrefillPeer, rid: number, epoch: number, event: DecodeEvent & { type: "check" }): boolean {
    this.#checking = rid;
    try {
      this.#step(peer, event);
    } finally {
      this.#checking = -1;
    }
    if (peer.state.attempts[event.key]?.phase === "decoding") return true;
    if (this.#running.get(rid) === epoch) this.#running.delete(rid);
    return false;
  }

  #commit(peer: PrefillPeer, effect: CommitEffect, firstToken: number): void {
    const { rid, epoch } = effect;
    const key = attemptKey(rid, epoch);
    const attempt = peer.state.attempts[key];
    // max_tokens 1: the machine finished the request at commit.
    if (attempt === undefined || attempt.phase !== "decoding") return;
    if (attempt.group !== undefined && attempt.group !== rid) this.#forkedSamples++;
    // Decode-side reuse: the pages it held, and its tokens from here on (for its cached pages).
    const record = this.#prefix?.committed(key, effect.held ?? 0);
    recordToken(record, firstToken);
    const { sampling, prompt } = this.#inputs.get(key) ??
      this.#sampleInput(attempt.group, rid, epoch) ?? { sampling: GREEDY_SAMPLING, prompt: undefined };
    if (sampling.stopTokenIds.includes(firstToken)) {
      this.#endStopped(peer, rid, epoch, 1, firstToken);
      return;
    }
    const request: GenerationRequest = {
      rid,
      tenant: attempt.tenant,
      // The ids only when the sampling reads them (a repetition penalty); else the length.
      promptTokens: prompt?.length === effect.promptLen ? prompt : new Int32Array(effect.promptLen),
      maxTokens: attempt.maxTokens,
      sampling,
    };
    this.#running.set(rid, epoch);
    // This attempt's events, built once: a token reuses them (the key is the attempt's own string).
    const check = { type: "check" as const, key };
    const step = { type: "step" as const, key, token: 0 };
    const pages = { epoch, pages: effect.pages, checkStep: () => this.#check(peer, rid, epoch, check) };
    this.#engine.submitDecode(request, pages, firstToken, {
      onTokens: (ids, lp) => {
        for (let i = 0; i < ids.length; i++) {
          step.token = ids[i]!;
          recordToken(record, step.token);
          this.#stepLogprobs = lp === undefined ? null : [lp[i]!];
          try {
            this.#step(peer, step);
          } finally {
            this.#stepLogprobs = null;
          }
        }
        if (peer.state.attempts[key] === undefined && this.#running.get(rid) === epoch)
          this.#running.delete(rid);
      },
      onFinish: (reason, usage) => {
        if (this.#running.get(rid) === epoch) this.#running.delete(rid);
        if (reason === "stop") this.#endStopped(peer, rid, epoch, usage.completionTokens, usage.stopTokenId);
      },
      onError: (error) => {
        if (this.#running.get(rid) !== epoch) return;
        this.#running.delete(rid);
        this.#countFailure(error);
        this.#core.toRouter({ kind: "protocol", msg: { type: "failed", rid, epoch, error } });
        // Ends the attempt in the machine; it frees the committed pages.
        this.#step(peer, { type: "message", msg: { type: "abort", rid, epoch } });
      },
    });
    this.#core.loop.kick();
  }

  /** A stop token (`stopTokenId`, when known) ended a committed attempt: end it in the machine (it frees the pages), report it. */
  #endStopped(
    peer: PrefillPeer,
    rid: number,
    epoch: number,
    completionTokens: number,
    stopTokenId: number | undefined,
  ): void {
    this.#running.delete(rid);
    this.#step(peer, { type: "message", msg: { type: "abort", rid, epoch } });
    const stop = stopTokenId === undefined ? {} : { stopTokenId };
    this.#core.toRouter({
      kind: "protocol",
      msg: { type: "finished", rid, epoch, reason: "stop", tokens: [], completionTokens, ...stop },
    });
  }

  #countFailure(error: WireError): void {
    if (error.code === "checksum_mismatch") this.#checksumFailures++;
    else if (error.code === "coverage_mismatch") this.#coverageFailures++;
  }
}

/** Prefill's first token of `rid`: its `committed` message's among effects `[from, end)`, or 0. */
function committedToken(out: Effects, rid: number, from: number, end: number): number {
  for (let j = from; j < end; j++) {
    const e = out[j]!;
    if (e.kind === "send" && e.msg.type === "committed" && e.msg.rid === rid) return e.msg.firstToken;
  }
  return 0;
}
