/**
 * The world `kvfence check` explores: the real protocol modules (router, prefill and decode state
 * machines of src/protocol, each node's real `OwnershipTable`) composed with an abstract
 * environment — a network that reorders, duplicates and (optionally) loses control messages and
 * delays page writes past later events, clients that submit and abort at any point, nodes that crash
 * and restart empty, and a router transfer timeout.
 *
 * `ModelWorld` lists the events a world enables and applies one: it steps the machines, carries
 * out their effects (sends onto channels, writes in flight, the engine's compute into the ghost
 * contents) and hands what it sees to the invariant checks. The world itself is plain data
 * (world-state.ts); the pools' ghost contents are in ghost-pool.ts, the checks in invariants.ts,
 * the trace's words in describe-world.ts. A page write copies its source page's content *when it
 * lands*, so a source page freed too early shows up.
 */
import { PageState } from "../../kvcache/ownership-table.js";
import { DecodePrefix } from "../../protocol/decode-held.js";
import {
  type DecodeConfig,
  type DecodeEvent,
  decodeContext,
  decodeStep,
  initialDecodeState,
} from "../../protocol/decode-machine.js";
import type { Effect } from "../../protocol/effects.js";
import { stampLandedWrite, writeLands } from "../../protocol/page-write.js";
import {
  initialPrefillState,
  type PrefillConfig,
  type PrefillEvent,
  prefillStep,
} from "../../protocol/prefill-machine.js";
import { PrefixCache, type SavedPrefixCache } from "../../protocol/prefix-cache.js";
import { prefixCacheSalt } from "../../protocol/prefix-key.js";
import {
  initialRouterState,
  type RouterConfig,
  type RouterEvent,
  routerStep,
} from "../../protocol/router-machine.js";
import { guardOn } from "../../protocol/safety.js";
import { attemptKey, type ControlMessage, ROUTER_SLOTS, routerSlotOf } from "../../protocol/wire.js";
import { describeEvent, describeTable } from "./describe-world.js";
import { copyGhost, GHOST_WORDS, GhostPool, writeGhost } from "./ghost-pool.js";
import {
  checkAnswer,
  checkDoorReject,
  checkQuiescent,
  checkRead,
  checkState,
  goodCommit,
  holdsPrefix,
  type InvariantContext,
  requestOf,
} from "./invariants.js";
import {
  CHANNELS,
  CHANNELS_2,
  cloneWorld,
  type EnvEvent,
  FIRST_TOKEN,
  type InflightWrite,
  landingSite,
  type ModelConfig,
  normalizeWorld,
  type Party,
  type PendingFence,
  routerParty,
  STEP_TOKEN,
  type Violation,
  type World,
} from "./world-state.js";

const EMPTY_CACHE = JSON.stringify({ nextId: 1, clock: 0, entries: [] });

/** The composed system: applies environment events to worlds and checks the invariants. */
export class ModelWorld {
  readonly config: ModelConfig;
  readonly #decodePool: GhostPool;
  readonly #prefillPool: GhostPool;
  readonly #routerConfig: RouterConfig;
  readonly #nodeConfig: DecodeConfig & PrefillConfig;
  readonly #invariants: InvariantContext;
  /** Decode's prefix cache over its table (`decodeCache`), and the machine's view of it. */
  readonly #decodeCache: PrefixCache | null;
  readonly #decodePrefix: DecodePrefix | undefined;
  #violations: Violation[] = [];
  #current: World | null = null;
  /** `CHANNELS`, or `CHANNELS_2` in a two-router world. */
  readonly channels: readonly (readonly [Party, Party])[];

  constructor(config: ModelConfig) {
    this.config = config;
    this.channels = (config.routers ?? 1) === 2 ? CHANNELS_2 : CHANNELS;
    this.#decodePool = new GhostPool(config.decodePages, config.pageSize);
    this.#prefillPool = new GhostPool(config.prefillPages, config.pageSize);
    this.#routerConfig = {
      maxModelLen: config.maxModelLen,
      prefillPoolTokens: config.prefillPages * config.pageSize,
      decodePoolTokens: config.decodePages * config.pageSize,
      maxAttempts: config.maxAttempts,
      watermarkStep: 1,
    };
    this.#nodeConfig = {
      maxModelLen: config.maxModelLen,
      layoutSignature: `kvfence-check|f32|page=${config.pageSize}`,
    };
    this.#decodePool.onRead = (attempt, count, fresh) => {
      const w = this.#current!;
      // The step's forward pass writes the new token's KV into its fresh page, then reads.
      if (fresh >= 0) writeGhost(w.dContent, attempt.pages[fresh]!, attempt.rid, attempt.epoch, fresh);
      checkRead(w, this.#invariants, attempt, count, this.#violations);
    };
    this.#decodeCache =
      config.decodeCache === true
        ? new PrefixCache(this.#decodePool.table, config.pageSize, config.safety)
        : null;
    this.#decodePrefix =
      this.#decodeCache === null
        ? undefined
        : new DecodePrefix(this.#decodeCache, {
            prompt: (msg) => this.#sequence(msg.rid, msg.tenant, msg.promptLen),
            sequence: (a) => this.#sequence(a.rid, a.tenant, a.promptLen + a.generated),
          });
    this.#invariants = {
      config,
      decodeTable: this.#decodePool.table,
      effectiveContext: Math.min(
        config.maxModelLen,
        config.prefillPages * config.pageSize,
        config.decodePages * config.pageSize,
      ),
    };
  }

  initial(): World {
    this.#decodePool.table.reset();
    this.#prefillPool.table.reset();
    return {
      routers: Array.from({ length: this.config.routers ?? 1 }, () => initialRouterState()),
      prefill: initialPrefillState(1, 1),
      decode: initialDecodeState(1, 1),
      dTable: Array.from(this.#decodePool.words),
      pTable: Array.from(this.#prefillPool.words),
      dContent: new Array(this.config.decodePages * GHOST_WORDS).fill(-1),
      pContent: new Array(this.config.prefillPages * GHOST_WORDS).fill(-1),
      chans: this.channels.map(() => []),
      writes: [],
      submitted: 0,
      order: [],
      dIncarnation: 1,
      pIncarnation: 1,
      fences: [],
      crashes: this.config.crashes,
      duplicates: this.config.duplicates,
      losses: this.config.losses,
      lossy: 0,
      good: [],
      dCache: this.#decodeCache === null ? "" : EMPTY_CACHE,
    };
  }

  /** Canonical key of a world (also its stored form). */
  key(w: World): string {
    return JSON.stringify(w);
  }

  /** A deep copy of `w`, several times faster than a JSON round trip. */
  clone(w: World): World {
    return cloneWorld(w);
  }

  /**
   * The events enabled in `w`, in a deterministic order. `progress` counts the leading events that
   * are the system's own progress (deliveries, landings, decode steps, timer releases when the
   * quarantine guard is off): a world with none is quiescent.
   */
  enabled(w: World): { events: EnvEvent[]; progress: number } {
    const events: EnvEvent[] = [];
    this.#progressEvents(w, events);
    const progress = events.length;
    this.#environmentEvents(w, events);
    return { events, progress };
  }

  /** The system's own progress: deliveries, landings, fences, decode steps, timer releases. */
  #progressEvents(w: World, events: EnvEvent[]): void {
    this.#eachMessage(w, (c, j) => events.push({ k: "deliver", c, j }));
    for (let j = 0; j < w.writes.length; j++)
      if (j === 0 || w.writes[j] !== w.writes[j - 1]) events.push({ k: "land", j });
    for (let j = 0; j < w.fences.length; j++)
      if (j === 0 || w.fences[j] !== w.fences[j - 1]) events.push({ k: "fence", j });
    const timers = !guardOn(this.config.safety, "quarantine");
    for (const key in w.decode.attempts) {
      const a = w.decode.attempts[key]!;
      if (a.phase === "decoding" && a.generated < a.maxTokens)
        events.push({ k: "step", rid: a.rid, epoch: a.epoch });
      if (a.phase === "quarantined" && timers)
        events.push({ k: "quarantine_timeout", rid: a.rid, epoch: a.epoch });
    }
  }

  /** What the environment may do: submit, abort, time out, crash a node, duplicate or lose a message. */
  #environmentEvents(w: World, events: EnvEvent[]): void {
    const reqs = this.config.requests;
    for (let i = 0; i < reqs.length; i++) if ((w.submitted & (1 << i)) === 0) events.push({ k: "submit", i });
    for (const router of w.routers) {
      for (const key in router.requests) {
        const r = router.requests[key]!;
        if (r.phase === "done") continue;
        if (this.config.clientAborts) events.push({ k: "client_abort", rid: r.rid });
        if (this.config.timeouts && r.phase !== "decoding" && r.epoch < this.config.maxAttempts) {
          events.push({ k: "timeout", rid: r.rid });
        }
      }
    }
    // A crash matters only while the node holds or awaits something (else it is a no-op restart).
    if (w.crashes > 0) {
      if (this.#busy(w, "prefill")) events.push({ k: "crash", role: "prefill" });
      if (this.#busy(w, "decode")) events.push({ k: "crash", role: "decode" });
    }
    if (w.duplicates > 0) this.#eachMessage(w, (c, j) => events.push({ k: "duplicate", c, j }));
    if (w.losses > 0) this.#eachMessage(w, (c, j) => events.push({ k: "lose", c, j }));
  }

  /**
   * Applies `event` to `w` (mutating it) and returns the violations it exposed: those found in the
   * effects (invariants 1, 2, 4) and those of the resulting state (3, 5).
   */
  apply(w: World, event: EnvEvent): Violation[] {
    this.#violations = [];
    this.#current = w;
    this.#load(w);
    switch (event.k) {
      case "submit":
        this.#submit(w, event.i);
        break;
      case "deliver": {
        const msg = JSON.parse(w.chans[event.c]![event.j]!) as ControlMessage;
        w.chans[event.c]!.splice(event.j, 1);
        this.#deliver(w, this.channels[event.c]![1], msg);
        break;
      }
      case "land": {
        const write = JSON.parse(w.writes[event.j]!) as InflightWrite;
        w.writes.splice(event.j, 1);
        this.#land(w, write);
        break;
      }
      case "fence": {
        const fence = JSON.parse(w.fences[event.j]!) as PendingFence;
        w.fences.splice(event.j, 1);
        if (fence.to === "decode") this.#decode(w, fence.event as DecodeEvent);
        else this.#prefill(w, fence.event as PrefillEvent);
        break;
      }
      case "step": {
        // One engine step on the decode node: its page check, then (if that passed) its forward
        // pass and the machine's step. The engine runs both in one synchronous call.
        const key = attemptKey(event.rid, event.epoch);
        this.#decode(w, { type: "check", key });
        if (w.decode.attempts[key]?.phase === "decoding")
          this.#decode(w, { type: "step", key, token: STEP_TOKEN });
        break;
      }
      case "client_abort":
        this.#router(w, routerSlotOf(event.rid), { type: "client_abort", rid: event.rid });
        break;
      case "timeout":
        this.#router(w, routerSlotOf(event.rid), { type: "attempt_timeout", rid: event.rid });
        break;
      case "quarantine_timeout":
        this.#decode(w, { type: "quarantine_timeout", rid: event.rid, epoch: event.epoch });
        break;
      case "crash":
        w.crashes--;
        this.#crash(w, event.role);
        break;
      case "duplicate":
        w.duplicates--;
        w.chans[event.c]!.push(w.chans[event.c]![event.j]!);
        break;
      case "lose":
        w.losses--;
        w.lossy = 1;
        w.chans[event.c]!.splice(event.j, 1);
        break;
    }
    this.#decodePool.save(w.dTable);
    this.#prefillPool.save(w.pTable);
    if (this.#decodeCache !== null) w.dCache = JSON.stringify(this.#decodeCache.save());
    normalizeWorld(w, this.config.reorder);
    checkState(w, this.#invariants, this.#violations);
    return this.#violations;
  }

  /** Bounded liveness: a quiescent world must be idle (everything answered, every page FREE). */
  checkQuiescent(w: World): Violation | null {
    const decode = this.#decodePool.countsOf(w.dTable);
    // Decode's cached pages no request references are idle too (decode-side reuse).
    let cached = 0;
    const table = this.#decodePool.table;
    for (let p = 0; p < table.numPages; p++)
      if (table.state(p) === PageState.SHARED && table.refcount(p) === 0) cached++;
    return checkQuiescent(w, this.config, decode, this.#prefillPool.countsOf(w.pTable), cached);
  }

  /** A one-line summary of both pools, for traces. */
  describePools(w: World): string {
    this.#load(w);
    return `decode [${describeTable(this.#decodePool)}]  prefill [${describeTable(this.#prefillPool)}]`;
  }

  /** A readable label of an event in the context of the world it applies to. */
  describeEvent(w: World, event: EnvEvent): string {
    return describeEvent(w, event, this.config, this.channels);
  }

  /** Makes `w`'s tables and ghost contents the pools'. */
  #load(w: World): void {
    this.#decodePool.load(w.dTable, w.dContent);
    this.#prefillPool.load(w.pTable, w.pContent);
    this.#decodeCache?.restore(JSON.parse(w.dCache) as SavedPrefixCache);
  }

  /**
   * The first `length` token ids of request `rid` (its prompt, then `FIRST_TOKEN` and a
   * `STEP_TOKEN` per decode step) and the salt of its tenant's keys; null without tokens.
   */
  #sequence(rid: number, tenant: number, length: number): { tokens: Int32Array; salt: string } | null {
    const r = requestOf(this.#current!, this.config, rid);
    if (r?.tokens === undefined) return null;
    const tokens = new Int32Array(length);
    for (let i = 0; i < length; i++)
      tokens[i] = i < r.tokens.length ? r.tokens[i]! : i === r.tokens.length ? FIRST_TOKEN : STEP_TOKEN;
    return { tokens, salt: prefixCacheSalt(this.config.safety, tenant, null) };
  }

  // --- dispatch -------------------------------------------------------------------------------

  /** A client submits request `i` (with its samples, as one group) to its router. */
  #submit(w: World, i: number): void {
    const r = this.config.requests[i]!;
    w.submitted |= 1 << i;
    const slot = r.router ?? 0;
    const rid = (w.order.length + 1) * ROUTER_SLOTS + slot;
    const samples = Array.from({ length: r.samples ?? 0 }, (_, j) => rid + (1 + j) * ROUTER_SLOTS);
    for (let j = 0; j <= samples.length; j++) w.order.push(i);
    this.#router(w, slot, {
      type: "submit",
      rid,
      tenant: r.tenant,
      promptLen: r.promptLen,
      maxTokens: r.maxTokens,
      ...(samples.length === 0 ? {} : { samples }),
    });
  }

  #router(w: World, slot: number, event: RouterEvent): void {
    const out: Effect[] = [];
    routerStep(w.routers[slot]!, event, { config: this.#routerConfig, safety: this.config.safety, out });
    checkDoorReject(event, out, this.#violations);
    this.#effects(w, routerParty(slot), out);
  }

  #decode(w: World, event: DecodeEvent): void {
    const out: Effect[] = [];
    decodeStep(
      w.decode,
      event,
      decodeContext(this.#decodePool, this.#nodeConfig, this.config.safety, out, this.#decodePrefix),
    );
    this.#effects(w, "decode", out);
  }

  #prefill(w: World, event: PrefillEvent): void {
    const out: Effect[] = [];
    prefillStep(w.prefill, event, {
      pool: this.#prefillPool,
      config: this.#nodeConfig,
      safety: this.config.safety,
      out,
    });
    this.#effects(w, "prefill", out);
  }

  #deliver(w: World, to: Party, msg: ControlMessage): void {
    const event = { type: "message" as const, msg };
    if (to === "router" || to === "router1") this.#router(w, to === "router" ? 0 : 1, event);
    else if (to === "decode") this.#decode(w, event);
    else this.#prefill(w, event);
  }

  #busy(w: World, role: "prefill" | "decode"): boolean {
    const attempts = role === "prefill" ? w.prefill.attempts : w.decode.attempts;
    for (const _ in attempts) return true;
    if (w.writes.length > 0) return true;
    for (let c = 0; c < this.channels.length; c++) {
      const [from, to] = this.channels[c]!;
      if ((from === role || to === role) && w.chans[c]!.length > 0) return true;
    }
    return false;
  }

  /** Calls `fn` for each deliverable message: channel heads (FIFO), or every distinct one (reorder). */
  #eachMessage(w: World, fn: (c: number, j: number) => void): void {
    for (let c = 0; c < w.chans.length; c++) {
      const chan = w.chans[c]!;
      if (chan.length === 0) continue;
      if (!this.config.reorder) fn(c, 0);
      else for (let j = 0; j < chan.length; j++) if (j === 0 || chan[j] !== chan[j - 1]) fn(c, j);
    }
  }

  #land(w: World, write: InflightWrite): void {
    const h = write.header;
    const table = this.#decodePool.table;
    if (writeLands(table, h, landingSite(w, h, this.config))) {
      // The bytes copied are the source page's bytes now.
      copyGhost(w.dContent, h.page, w.pContent, write.sourcePage);
      if (write.corrupt) w.dContent[h.page * GHOST_WORDS + 3] = 1;
      stampLandedWrite(table, h);
    }
    this.#prefill(w, { type: "write_done", rid: h.rid, epoch: h.epoch, index: h.index });
  }

  #crash(w: World, role: "prefill" | "decode"): void {
    // The node restarts empty; its connections close, so everything in flight to or from it is gone.
    for (let c = 0; c < this.channels.length; c++) {
      const [from, to] = this.channels[c]!;
      if (from === role || to === role) w.chans[c] = [];
    }
    w.writes = [];
    // Notifications still pending for the crashed node died with it; its peer will observe the old
    // connection's close and the new handshake later, in either order.
    w.fences = w.fences.filter((s) => (JSON.parse(s) as PendingFence).to !== role);
    let old: number;
    if (role === "prefill") {
      old = w.pIncarnation++;
      w.prefill = initialPrefillState(w.pIncarnation, w.dIncarnation);
      this.#prefillPool.table.reset();
      w.pContent.fill(-1);
    } else {
      old = w.dIncarnation++;
      w.decode = initialDecodeState(w.dIncarnation, w.pIncarnation);
      this.#decodePool.table.reset();
      w.dContent.fill(-1);
      // Decode's cache was in its memory: gone with it.
      this.#decodeCache?.restore(JSON.parse(EMPTY_CACHE) as SavedPrefixCache);
    }
    const to = role === "prefill" ? "decode" : "prefill";
    const incarnation = role === "prefill" ? w.pIncarnation : w.dIncarnation;
    w.fences.push(
      JSON.stringify({ to, event: { type: "peer_lost", role, incarnation: old } }),
      JSON.stringify({ to, event: { type: "peer_up", role, incarnation } }),
    );
    for (let slot = 0; slot < w.routers.length; slot++) {
      this.#router(w, slot, { type: "peer_lost", role });
      this.#router(w, slot, { type: "peer_up", role });
    }
  }

  #channelIndex(from: Party, to: Party): number {
    return this.channels.findIndex(([f, t]) => f === from && t === to);
  }

  #effects(w: World, from: Party, out: readonly Effect[]): void {
    for (const e of out) {
      switch (e.kind) {
        case "send": {
          // A node's message to "the router" goes to the router of its rid's slot.
          const to = e.to === "router" ? routerParty(routerSlotOf(e.msg.rid)) : e.to;
          w.chans[this.#channelIndex(from, to)]!.push(JSON.stringify(e.msg));
          break;
        }
        case "write":
          w.writes.push(JSON.stringify({ header: e.header, sourcePage: e.sourcePage, corrupt: e.corrupt }));
          break;
        case "compute": {
          // The engine: computes the prompt's KV into the source pages, stamps them and marks them READY.
          const table = this.#prefillPool.table;
          for (let i = 0; i < e.pages.length; i++) {
            const { page, generation } = e.pages[i]!;
            writeGhost(w.pContent, page, e.rid, e.epoch, i);
            table.stampWriter(
              page,
              e.rid,
              e.epoch,
              Math.min(this.config.pageSize, e.promptLen - i * this.config.pageSize),
            );
            table.markReady(page, generation, e.rid, e.epoch);
          }
          this.#prefill(w, { type: "computed", rid: e.rid, epoch: e.epoch, firstToken: FIRST_TOKEN });
          break;
        }
        case "commit": {
          const group = w.decode.attempts[attemptKey(e.rid, e.epoch)]?.group ?? e.rid;
          const held = e.held ?? 0;
          const heldOk = (i: number) => holdsPrefix(w, this.#invariants, e.pages[i]!.page, e.rid, i);
          if (goodCommit(w.dContent, e, group, this.config.pageSize, held, heldOk))
            w.good.push(attemptKey(e.rid, e.epoch));
          break;
        }
        case "tokens":
          checkAnswer(
            w,
            this.#invariants,
            { rid: e.rid, epoch: e.epoch, status: 200, code: null },
            this.#violations,
          );
          break;
        case "respond":
          checkAnswer(
            w,
            this.#invariants,
            { rid: e.rid, epoch: e.epoch, status: e.status, code: e.error?.code ?? null },
            this.#violations,
          );
          break;
        case "copy":
          // n > 1 (not explored here): the copied page holds the source page's data.
          copyGhost(w.dContent, e.to, w.dContent, e.from);
          break;
        case "stop":
          break;
      }
    }
  }
}
