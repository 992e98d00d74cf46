/**
 * The prefill node (docs/design.md §2): the engine in prefill-only mode, driven by the protocol's
 * prefill state machine (`prefillStep`), with the transport injected — the same class runs in a
 * worker thread (shared-memory writer) and in a process (TCP writer). What both roles share (the
 * parts built from the options, `pages_freed`, the statistics) is `NodeCore`'s (node-core.ts).
 *
 * One prefill state machine per connected decode node, all over this node's one pool: a machine's
 * `decodeIncarnation` is its decode peer's, so a `prefill` request goes to the machine whose peer
 * granted the lease, and a decode peer's fence (`closed`) frees exactly that peer's attempts.
 *
 * The glue only carries out effects: `compute` → `Engine.submitPrefill` (its first token feeds
 * `computed`); `write` → `TransferWriter.writePages` then `endLease`, each page then feeds
 * `write_done`; `send` → the router link or the writer's ordered control channel (so a manifest or
 * an ABORT_ACK never overtakes the writes before it). Nothing here runs on a timer. Whenever a
 * step frees source pages the node tells the router (`pages_freed`), which retries the requests it
 * holds back because this pool was full.
 *
 * Checksums are taken at production, off the transfer's critical path: after every engine step
 * the node hashes each source page that step completed (`PageChecksums.record`), so when the
 * machine builds the manifest at `computed` it reads recorded values — only the pages of the last
 * chunk (the last, partial page included) are hashed then, as they were produced in that step.
 *
 * With the engine's prefix cache on, the machine's `prefix` is `PrefillPrefix` (prefill-prefix.ts):
 * a prompt's cached full pages are the attempt's first source pages and only the rest is computed;
 * the node tells the router how many prompt tokens came from the cache (`prefix_cached`, for the
 * response's `usage.prompt_tokens_details.cached_tokens`).
 *
 * The `stall-transfer` node fault (tests only): prefill writes the first half of a lease's pages,
 * ends the lease there and stops — no further writes, no manifest, no ABORT_ACK (its writes never
 * drain) — as a prefill that hangs mid-transfer; decode's pages wait for the fence.
 */

import type { WireError } from "../lib/errors.js";
import { PHASE } from "../lib/phase-recorder.js";
import { epochNow, type RequestTrace, traceSpan, tracing } from "../lib/tracing.js";
import type { NodeStats, ToNode } from "../links/node-messages.js";
import type { ComputeEffect, Effects, WriteEffect } from "../protocol/effects.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import {
  initialPrefillState,
  type PrefillContext,
  type PrefillEvent,
  type PrefillState,
  prefillStep,
} from "../protocol/prefill-machine.js";
import { faultOn } from "../protocol/safety.js";
import { GREEDY_SAMPLING, type SamplingParams } from "../protocol/sampling-params.js";
import {
  attemptKey,
  type ControlMessage,
  type FirstLogprobs,
  type LeasePage,
  type PrefillRequest,
  type Watermark,
} from "../protocol/wire.js";
import type { TransferMetrics } from "../transfer/transfer-metrics.js";
import type { PageWrite, TransferHandlers, TransferWriter } from "../transfer/transport.js";
import { addTransfer, NodeCore, type NodeOptions } from "./node-core.js";
import { pageBytesOf } from "./node-pool.js";
import { PrefillPrefix } from "./prefill-prefix.js";

export type PrefillNodeOptions = NodeOptions;

/** Watermarks kept for decode incarnations that have not connected yet (the newest ones). */
const EARLY_WATERMARKS = 8;

/** A writer to a decode peer: the transport's, with the metrics of its channel. */
export type DecodeWriter = TransferWriter & { readonly metrics?: TransferMetrics };

/** The prefill end of one decode peer's transfer channel, for either form (shared memory, TCP). */
export interface DecodeLink {
  /** The handlers to give the writer: its control messages feed the peer's machine, its close is the fence. */
  readonly handlers: Required<Pick<TransferHandlers, "control" | "closed">>;
  /** The writer exists: the peer is attached (a peer of the same incarnation before it is fenced). */
  attach(writer: DecodeWriter): void;
}

interface DecodePeer {
  readonly writer: TransferWriter;
  readonly metrics: TransferMetrics | undefined;
  readonly state: PrefillState;
  open: boolean;
}

export class PrefillNode {
  readonly incarnation: number;
  readonly #core: NodeCore;
  readonly #engine;
  /** Per attempt still computing: how many of its source pages (from the first) are hashed. */
  readonly #produced = new Map<string, number>();
  readonly #peers = new Map<number, DecodePeer>();
  /** Per attempt: the peer it writes to, and the prompt and sampling the router sent. */
  readonly #inputs = new Map<
    string,
    { peer: DecodePeer; tokens: Int32Array; sampling: SamplingParams; trace?: RequestTrace }
  >();
  /**
   * Attempts whose `prefill` message waits for its pages to load back from the KV tiers: the
   * machine has not seen them yet, so the end-of-step sweep of `#inputs` must keep their inputs.
   */
  readonly #loading = new Set<string>();
  readonly #out: Effects = [];
  readonly #context: PrefillContext;
  /** n > 1 as one group: per attempt, its later samples' first tokens, for its manifest. */
  readonly #sampleFirst = new Map<string, number[]>();
  /** Per attempt that asked: the first token's and the prompt's log-probabilities, for its manifest. */
  readonly #logprobs = new Map<string, FirstLogprobs>();
  /** Watermarks for decode incarnations not attached yet (see `#watermark`). */
  readonly #early = new Map<number, Watermark>();
  readonly #prefix: PrefillPrefix | null;

  constructor(options: PrefillNodeOptions) {
    this.#core = new NodeCore(options, () => this.#hashProduced());
    this.incarnation = options.incarnation;
    this.#engine = options.engine;
    const core = this.#core;
    const cache = options.engine.prefixCache;
    this.#prefix =
      cache === null
        ? null
        : new PrefillPrefix(
            cache,
            core.safety,
            core.pool.pageSize,
            (key) => this.#inputs.get(key)?.sampling.promptLogprobs !== undefined,
            options.engine.tierPrefetch,
          );
    this.#context = {
      pool: core.pool,
      config: core.config,
      safety: core.safety,
      out: this.#out,
      ...(this.#prefix === null ? {} : { prefix: this.#prefix }),
    };
  }

  /**
   * The link to a decode node of `incarnation`, for the form to wire its writer with (see
   * `DecodeLink`). A writer's close fences the peer only while the peer still writes through it.
   */
  decodeLink(incarnation: number): DecodeLink {
    let writer: DecodeWriter | undefined;
    let onControl = (_message: ControlMessage): void => {};
    return {
      handlers: {
        control: (message) => onControl(message),
        closed: () => this.decodeLost(incarnation, writer),
      },
      attach: (w) => {
        writer = w;
        onControl = this.#attachDecode(w, incarnation);
      },
    };
  }

  /**
   * A decode node of `incarnation` connected through `writer`. Its control messages (abort,
   * release) feed that peer's machine; its channel closing is its fence.
   */
  #attachDecode(writer: DecodeWriter, incarnation: number): (message: ControlMessage) => void {
    const old = this.#peers.get(incarnation);
    if (old !== undefined) this.#fence(incarnation, old);
    const peer: DecodePeer = {
      writer,
      metrics: writer.metrics,
      state: initialPrefillState(this.incarnation, incarnation),
      open: true,
    };
    this.#peers.set(incarnation, peer);
    const early = this.#early.get(incarnation);
    if (early !== undefined) {
      this.#early.delete(incarnation);
      this.#step(peer, { type: "message", msg: early });
    }
    return (message) => {
      if (peer.open) this.#step(peer, { type: "message", msg: message });
    };
  }

  /**
   * The decode peer's channel closed (or its worker exited): fence it, then free its attempts.
   * With `writer`, only if that peer still writes through it (not a newer connection).
   */
  decodeLost(incarnation: number, writer?: TransferWriter): void {
    const peer = this.#peers.get(incarnation);
    if (peer !== undefined && (writer === undefined || peer.writer === writer))
      this.#fence(incarnation, peer);
  }

  onRouter(message: ToNode): void {
    if (message.kind !== "protocol") return;
    const msg = message.msg;
    this.#core.seeRouter(msg);
    if (msg.type === "watermark") {
      this.#watermark(message.decode ?? 0, msg);
      return;
    }
    if (msg.type !== "prefill") return;
    const peer = this.#peers.get(msg.lease.incarnation);
    if (peer === undefined) {
      this.#reject(msg, {
        code: "node_unavailable",
        message: `The decode node that leased request ${msg.rid} is not connected to this prefill node: incarnation ${msg.lease.incarnation}`,
      });
      return;
    }
    const key = attemptKey(msg.rid, msg.epoch);
    const tokens = msg.promptTokens;
    if (tokens !== undefined && !(tokens instanceof Int32Array)) {
      // A router of another kvfence version: it sent the ids in another form.
      this.#reject(msg, {
        code: "invalid_request",
        message: `The prefill request ${msg.rid} carries its prompt tokens in another form than an Int32Array; run the same kvfence version on every process: ${Array.isArray(tokens) ? "array" : typeof tokens}`,
      });
      return;
    }
    if (tokens === undefined || tokens.length !== msg.promptLen) {
      this.#reject(msg, {
        code: "invalid_request",
        message: `The prefill request ${msg.rid} carries ${tokens?.length ?? 0} prompt tokens, its promptLen is: ${msg.promptLen}`,
      });
      return;
    }
    if (!this.#inputs.has(key))
      this.#inputs.set(key, {
        peer,
        tokens,
        sampling: message.sampling ?? GREEDY_SAMPLING,
        ...(message.trace === undefined ? {} : { trace: message.trace }),
      });
    // Pages of the prompt below the pool (KV tiers) load first; the machine sees the request after.
    const loads = this.#prefix?.prefetch(msg) ?? null;
    if (loads === null) {
      this.#step(peer, { type: "message", msg });
      return;
    }
    this.#loading.add(key);
    void loads.then(() => {
      this.#loading.delete(key);
      this.#step(peer, { type: "message", msg });
    });
  }

  /**
   * The router's watermark for the pair with decode `incarnation`: to that peer's machine, or kept
   * for it if its transfer connection is not attached yet (the router sends it when the pair comes
   * up, which can be before this node admitted decode's connection).
   */
  #watermark(incarnation: number, msg: Watermark): void {
    const peer = this.#peers.get(incarnation);
    if (peer !== undefined) {
      this.#step(peer, { type: "message", msg });
      return;
    }
    this.#early.delete(incarnation);
    this.#early.set(incarnation, msg);
    // Incarnations that never connect: keep only the newest few.
    for (const old of this.#early.keys()) {
      if (this.#early.size <= EARLY_WATERMARKS) break;
      this.#early.delete(old);
    }
  }

  /** See `NodeCore.ridFloor`. */
  ridFloor(slot: number): number {
    return this.#core.ridFloor(slot);
  }

  stats(): NodeStats {
    const stats = this.#core.stats("prefill", this.#peers.values(), (peer) => peer.metrics);
    // Dropped writes are the receiver's lease check's (decode reports them), never a writer's.
    return { ...stats, transfer: { ...stats.transfer, droppedStaleWrites: 0, droppedMisaddressedWrites: 0 } };
  }

  /** Attempts in flight over every decode peer (a role switch waits for none). */
  inFlight(): number {
    let n = 0;
    for (const peer of this.#peers.values()) n += Object.keys(peer.state.attempts).length;
    return n;
  }

  /** Stops the node; `keepEngine`: its engine and pool serve the node's next role (role-switch.ts). */
  close(keepEngine = false): void {
    this.#core.loop.stop(keepEngine);
  }

  #fence(incarnation: number, peer: DecodePeer): void {
    if (!peer.open) return;
    peer.open = false;
    this.#peers.delete(incarnation);
    if (peer.metrics !== undefined) addTransfer(this.#core.closedTotals, peer.metrics);
    // Stop computing for the lost peer; the machine frees the source pages.
    for (const key in peer.state.attempts) this.#engine.abort(peer.state.attempts[key]!.rid);
    this.#step(peer, { type: "peer_lost", role: "decode", incarnation }, true);
    for (const [key, input] of this.#inputs) if (input.peer === peer) this.#inputs.delete(key);
  }

  /** After an engine step: hash every source page the step completed (see the module header). */
  #hashProduced(): void {
    const table = this.#engine.pool.table;
    const P = this.#engine.pool.pageSize;
    const produced = this.#produced;
    for (const peer of this.#peers.values()) {
      for (const key in peer.state.attempts) {
        const a = peer.state.attempts[key]!;
        if (a.phase !== "computing") continue;
        let i = produced.get(key) ?? firstOwnPage(a.shared);
        for (; i < a.pages.length; i++) {
          const page = a.pages[i]!;
          if (
            table.writerRid(page) !== a.rid ||
            table.writerEpoch(page) !== a.epoch ||
            table.filledTokens(page) < Math.min(P, a.promptLen - i * P)
          )
            break;
          this.#core.checksums.record(page, a.rid, a.epoch, i);
        }
        produced.set(key, i);
      }
    }
    for (const key of produced.keys()) {
      let computing = false;
      for (const peer of this.#peers.values())
        if (peer.state.attempts[key]?.phase === "computing") computing = true;
      if (!computing) produced.delete(key);
    }
  }

  #reject(msg: PrefillRequest, error: WireError): void {
    this.#core.toRouter({
      kind: "protocol",
      msg: { type: "rejected", rid: msg.rid, epoch: msg.epoch, from: "prefill", error },
    });
  }

  /** A manifest carries its attempt's log-probabilities to decode, when the request asked. */
  #withLogprobs(msg: ControlMessage): ControlMessage {
    if (msg.type !== "manifest") return msg;
    const key = attemptKey(msg.rid, msg.epoch);
    const logprobs = this.#logprobs.get(key);
    const sampleFirstTokens = this.#sampleFirst.get(key);
    if (logprobs === undefined && sampleFirstTokens === undefined) return msg;
    this.#logprobs.delete(key);
    this.#sampleFirst.delete(key);
    return {
      ...msg,
      ...(logprobs === undefined ? {} : { logprobs }),
      ...(sampleFirstTokens === undefined ? {} : { sampleFirstTokens }),
    };
  }

  #step(peer: DecodePeer, event: PrefillEvent, force = false): void {
    if (!peer.open && !force) return;
    const out = this.#out;
    const start = out.length;
    const freeBefore = this.#reclaimablePages();
    prefillStep(peer.state, event, this.#context);
    const freeAfter = this.#reclaimablePages();
    const effects = out.splice(start);
    let writes: WriteEffect[] | null = null;
    for (const effect of effects) {
      switch (effect.kind) {
        case "send":
          if (effect.to === "router") this.#core.toRouter({ kind: "protocol", msg: effect.msg });
          else if (peer.open) peer.writer.sendControl(this.#withLogprobs(effect.msg)).catch(() => {});
          if (effect.msg.type === "abort_ack" || effect.msg.type === "rejected") {
            this.#inputs.delete(attemptKey(effect.msg.rid, effect.msg.epoch));
            this.#logprobs.delete(attemptKey(effect.msg.rid, effect.msg.epoch));
            this.#sampleFirst.delete(attemptKey(effect.msg.rid, effect.msg.epoch));
          }
          break;
        case "compute":
          this.#compute(peer, effect);
          break;
        case "write":
          if (writes === null) writes = [effect];
          else writes.push(effect);
          break;
        default:
          break;
      }
    }
    if (writes !== null) this.#write(peer, writes);
    this.#core.reportFreed(freeBefore, freeAfter);
    // Attempts that ended here (released, acknowledged, fenced, refused as stale) need no inputs
    // any more.
    for (const [key, input] of this.#inputs) {
      if (input.peer !== peer || peer.state.attempts[key] !== undefined || this.#loading.has(key)) continue;
      this.#inputs.delete(key);
      this.#logprobs.delete(key);
      this.#sampleFirst.delete(key);
      const [rid, epoch] = key.split(":").map(Number) as [number, number];
      this.#prefix?.forget(rid, epoch);
    }
  }

  /** FREE pages, plus cached pages no one references (the machine evicts them when short). */
  #reclaimablePages(): number {
    const cache = this.#engine.prefixCache;
    return this.#core.freePages() + (cache === null || cache.size === 0 ? 0 : cache.evictable());
  }

  #compute(peer: DecodePeer, { rid, epoch, tenant, promptLen, pages, cachedPages }: ComputeEffect): void {
    const key = attemptKey(rid, epoch);
    const input = this.#inputs.get(key);
    const tokens = input?.tokens ?? new Int32Array(0);
    const request: GenerationRequest = {
      rid,
      tenant,
      // promptLen is 1 only under the placeholder-reject fault: the placeholder is the first token.
      promptTokens: tokens.subarray(0, Math.max(1, promptLen)),
      maxTokens: 1,
      sampling: input?.sampling ?? GREEDY_SAMPLING,
    };
    let done = false;
    // The clock is read for a span only (tracing off: nothing).
    const submittedAt = tracing() === null ? 0 : epochNow();
    if (this.#prefix !== null) {
      const cachedTokens = (cachedPages ?? 0) * this.#core.pool.pageSize;
      this.#core.toRouter({ kind: "prefix_cached", rid, epoch, cachedTokens });
    }
    this.#engine.submitPrefill(
      request,
      { epoch, pages, ...(cachedPages === undefined ? {} : { cachedPages }) },
      {
        onPromptLogprobs: (entries) => {
          this.#logprobs.set(key, { ...this.#logprobs.get(key), prompt: [...entries] });
        },
        onTokens: (ids, lp) => {
          if (done) return;
          done = true;
          if (lp?.[0] !== undefined) this.#logprobs.set(key, { ...this.#logprobs.get(key), first: lp[0] });
          // n > 1 as one group: the later samples' first tokens ride with the manifest.
          if (ids.length > 1) this.#sampleFirst.set(key, ids.slice(1));
          traceSpan(input?.trace, "prefill", submittedAt, { "kvfence.prompt_tokens": promptLen });
          this.#step(peer, { type: "computed", rid, epoch, firstToken: ids[0]! });
        },
        onFinish: () => {},
        onError: (error) => {
          if (done) return;
          done = true;
          // The engine refused or failed it: end the attempt (the machine frees the source pages
          // and acknowledges), and tell the router with the engine's error, unchanged.
          this.#step(peer, { type: "message", msg: { type: "abort", rid, epoch } });
          this.#step(peer, { type: "computed", rid, epoch, firstToken: 0 });
          this.#core.toRouter({
            kind: "protocol",
            msg: { type: "rejected", rid, epoch, from: "prefill", error },
          });
        },
      },
    );
    this.#core.loop.kick();
  }

  #write(peer: DecodePeer, effects: readonly WriteEffect[]): void {
    // Group by attempt (one `computed` issues all of one attempt's writes).
    const byAttempt = new Map<string, WriteEffect[]>();
    for (const e of effects) {
      const key = attemptKey(e.header.rid, e.header.epoch);
      const list = byAttempt.get(key);
      if (list === undefined) byAttempt.set(key, [e]);
      else list.push(e);
    }
    const pool = this.#engine.pool;
    for (const list of byAttempt.values()) {
      const { rid, epoch } = list[0]!.header;
      const pages: LeasePage[] = [];
      const writes: PageWrite[] = [];
      // The stall-transfer fault: only the first half of the pages is ever written.
      if (faultOn(this.#core.safety, "stall-transfer"))
        list.length = Math.max(1, Math.floor(list.length / 2));
      for (const e of list) {
        pages[e.header.index] = { page: e.header.page, generation: e.header.generation };
        let bytes = pageBytesOf(pool, e.sourcePage);
        if (e.corrupt) {
          // The corrupt-transfer fault: one byte flipped in flight.
          bytes = bytes.slice();
          bytes[0] = bytes[0]! ^ 0xff;
        }
        writes.push({ index: e.header.index, bytes, filledTokens: e.header.filledTokens });
      }
      for (let i = 0; i < pages.length; i++) pages[i] ??= { page: -1, generation: 0 };
      const lease = { rid, epoch, pages };
      const started = process.hrtime.bigint();
      const startedAt = tracing() === null ? 0 : epochNow();
      const trace = this.#inputs.get(attemptKey(rid, epoch))?.trace;
      let bytesSent = 0;
      for (const w of writes) bytesSent += w.bytes.length;
      peer.writer
        .writePages(lease, writes)
        .then(() => peer.writer.endLease(lease, writes.length))
        .then(
          () => {
            const seconds = Number(process.hrtime.bigint() - started) / 1e9;
            if (seconds > 0) this.#core.recordGbps(bytesSent / seconds / 1e9);
            this.#core.engine.phases.observe(PHASE.transfer, seconds);
            this.#core.engine.phases.observeBytes(bytesSent);
            traceSpan(trace, "transfer", startedAt, {
              "kvfence.bytes": bytesSent,
              "kvfence.pages": writes.length,
            });
            // Under stall-transfer the unwritten pages never drain: no manifest, no ABORT_ACK.
            for (const w of writes) this.#step(peer, { type: "write_done", rid, epoch, index: w.index });
          },
          () => {
            // The channel failed: the peer is being fenced (its `closed` frees everything).
          },
        );
    }
  }
}

/** The first source page that is the attempt's own (computed by it), after its cached references. */
function firstOwnPage(shared: readonly number[]): number {
  const i = shared.indexOf(0);
  return i < 0 ? shared.length : i;
}
