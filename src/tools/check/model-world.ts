/**
 * The world `kvfence check` explores: the real protocol modules (router, prefill and decode state
 * machines of src/protocol, each node's real `OwnershipTable`) composed with an abstract
 * environment — a network that reorders, duplicates and (optionally) loses control messages and
 * delays page writes past later events, clients that submit and abort at any point, nodes that crash
 * and restart empty, and a router transfer timeout.
 *
 * A world is plain JSON, so a state is cloned by `JSON.parse` and identified by its canonical
 * `JSON.stringify` (records re-sorted, metric counters zeroed). In-flight messages and writes are
 * kept as sorted JSON strings: a multiset, so delivery order is free (any reordering) and identical
 * duplicates collapse.
 *
 * Page contents are abstracted exactly as far as the invariants need: each page holds the
 * `(rid, epoch, logical index, corrupt)` of the data last written into it (the "ghost" content),
 * beside the ownership table's writer stamp. A page write copies its source page's content *when
 * it lands* (so a source page freed too early shows up), and the checksum of a page is the pair of
 * its content and the key it is computed under, exactly the equality a keyed xxhash64 gives.
 */
import { OwnershipTable, PageState } from "../../kvcache/ownership-table.js";
import {
  type DecodeConfig,
  type DecodeEvent,
  type DecodeState,
  decodeContext,
  decodeStep,
  initialDecodeState,
  leasedPage,
} from "../../protocol/decode-machine.js";
import type { CommitEffect, Effect, KvPool, ReadingAttempt } from "../../protocol/effects.js";
import {
  type LandingSite,
  stampLandedWrite,
  type TransportKind,
  writeLands,
} from "../../protocol/page-write.js";
import {
  initialPrefillState,
  type PrefillConfig,
  type PrefillEvent,
  type PrefillState,
  prefillStep,
} from "../../protocol/prefill-machine.js";
import {
  initialRouterState,
  type RouterConfig,
  type RouterEvent,
  type RouterState,
  routerStep,
} from "../../protocol/router-machine.js";
import { guardOn, type Safety } from "../../protocol/safety.js";
import {
  attemptKey,
  type ControlMessage,
  type NodeRole,
  type PageWriteHeader,
  ROUTER_SLOTS,
  routerSlotOf,
} from "../../protocol/wire.js";

export interface CheckRequest {
  readonly rid: number;
  /** Which router submits it (0 default; 1 only in a two-router world, `ModelConfig.routers`). */
  readonly router?: number;
  readonly tenant: number;
  readonly promptLen: number;
  readonly maxTokens: number;
  /** n > 1: samples after the first, as one group (docs/protocol.md §3, item 13); absent: none. */
  readonly samples?: number;
}

export interface ModelConfig {
  readonly decodePages: number;
  readonly prefillPages: number;
  readonly pageSize: number;
  readonly maxModelLen: number;
  readonly requests: readonly CheckRequest[];
  readonly maxAttempts: number;
  /** Budgets of environment faults over a whole run. */
  readonly crashes: number;
  readonly duplicates: number;
  readonly losses: number;
  readonly clientAborts: boolean;
  readonly timeouts: boolean;
  readonly transport: TransportKind;
  /**
   * False (default): each directed channel is FIFO, as a TCP connection or a MessagePort is, and
   * channels interleave freely. True: any in-flight message may overtake any other.
   */
  readonly reorder: boolean;
  readonly safety: Safety;
  /**
   * Routers over the one prefill/decode pair (default 1): with 2, router i is router slot i and
   * hands out rids of that slot (docs/protocol.md §3, item 13); each has its own FIFO channels.
   */
  readonly routers?: number;
}

/** A party of the world: a node role, or the second router (`router1`, router slot 1). */
export type Party = NodeRole | "router1";

/** The directed control channels, one per ordered pair of roles. */
export const CHANNELS: readonly (readonly [Party, Party])[] = [
  ["router", "decode"],
  ["router", "prefill"],
  ["decode", "router"],
  ["decode", "prefill"],
  ["prefill", "router"],
  ["prefill", "decode"],
];

/** The channels of a two-router world: `CHANNELS`, then the second router's four. */
export const CHANNELS_2: readonly (readonly [Party, Party])[] = [
  ...CHANNELS,
  ["router1", "decode"],
  ["router1", "prefill"],
  ["decode", "router1"],
  ["prefill", "router1"],
];

/** The router of router slot `slot` in the world. */
function routerParty(slot: number): "router" | "router1" {
  return slot === 0 ? "router" : "router1";
}

interface Envelope {
  readonly from: Party;
  readonly to: Party;
  readonly msg: ControlMessage;
}

interface PendingFence {
  readonly to: "decode" | "prefill";
  readonly event: { readonly type: "peer_lost" | "peer_up"; readonly incarnation: number };
}

interface InflightWrite {
  readonly header: PageWriteHeader;
  readonly sourcePage: number;
  readonly corrupt: boolean;
}

export interface World {
  /** The routers' machines; router i is router slot i. */
  routers: RouterState[];
  prefill: PrefillState;
  decode: DecodeState;
  /** The ownership tables' 32-bit words. */
  dTable: number[];
  pTable: number[];
  /** Ghost page contents, 4 numbers per page: rid, epoch, logical index, corrupt (rid -1: never written). */
  dContent: number[];
  pContent: number[];
  /**
   * In-flight control messages per directed channel (see `CHANNELS`), as JSON strings in send
   * order; with `reorder` each channel is a sorted multiset instead. Page writes in flight are a
   * sorted multiset: they may land in any order, and after any later control message.
   */
  chans: string[][];
  writes: string[];
  /** Bit i: request i was submitted. */
  submitted: number;
  /**
   * The request (an index into the config's) of each rid, in the order they went out: the k-th
   * goes out under rid k of its router's slot (`k * ROUTER_SLOTS + slot`) and is `order[k - 1]`, as
   * the real router hands out rids in serial order (its watermark relies on it), whichever request
   * it is; a group's later samples take the rids of its slot after its first's.
   */
  order: number[];
  /** Boot counts of the nodes. */
  dIncarnation: number;
  pIncarnation: number;
  /**
   * Connection events a node has yet to observe after its peer restarted (the old connection's
   * close and the new one's handshake, in either order), as sorted JSON strings.
   */
  fences: string[];
  crashes: number;
  duplicates: number;
  losses: number;
  /** 1 once a control message was lost without its connection closing (liveness is not required after). */
  lossy: number;
  /** Attempt keys whose commit was truly good: full coverage, every page holding its own data. */
  good: string[];
}

export type EnvEvent =
  | { readonly k: "submit"; readonly i: number }
  | { readonly k: "deliver"; readonly c: number; readonly j: number }
  | { readonly k: "land"; readonly j: number }
  | { readonly k: "fence"; readonly j: number }
  | { readonly k: "step"; readonly rid: number; readonly epoch: number }
  | { readonly k: "client_abort"; readonly rid: number }
  | { readonly k: "timeout"; readonly rid: number }
  | { readonly k: "crash"; readonly role: "prefill" | "decode" }
  | { readonly k: "duplicate"; readonly c: number; readonly j: number }
  | { readonly k: "lose"; readonly c: number; readonly j: number }
  | { readonly k: "quarantine_timeout"; readonly rid: number; readonly epoch: number };

/** An invariant violation found while applying an event or in the resulting state. */
export interface Violation {
  /** "1".."5" for docs/design.md §7 invariants, "liveness" for the bounded liveness check. */
  readonly invariant: string;
  readonly message: string;
}

const FIRST_TOKEN = 7;

class ModelPool implements KvPool {
  readonly table: OwnershipTable;
  readonly pageSize: number;
  readonly words: Uint32Array;
  content: number[] = [];
  onRead: ((attempt: ReadingAttempt, count: number, fresh: number) => void) | null = null;

  observeRead(attempt: ReadingAttempt, count: number, fresh: number): void {
    this.onRead?.(attempt, count, fresh);
  }

  constructor(numPages: number, pageSize: number) {
    this.table = new OwnershipTable(numPages);
    this.pageSize = pageSize;
    const bytes = this.table.bytes;
    this.words = new Uint32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
  }

  pageChecksum(page: number, rid: number, epoch: number, index: number): string {
    const c = this.content;
    const at = page * 4;
    return `${c[at]},${c[at + 1]},${c[at + 2]},${c[at + 3]}@${rid},${epoch},${index}`;
  }
}

/** The composed system: applies environment events to worlds and checks the invariants. */
export class ModelWorld {
  readonly config: ModelConfig;
  readonly #decodePool: ModelPool;
  readonly #prefillPool: ModelPool;
  readonly #routerConfig: RouterConfig;
  readonly #nodeConfig: DecodeConfig & PrefillConfig;
  readonly #effectiveContext: number;
  #violations: Violation[] = [];
  #current: World | null = null;
  /** `CHANNELS`, or `CHANNELS_2` in a two-router world. */
  readonly channels: readonly (readonly [Party, Party])[];

  constructor(config: ModelConfig) {
    this.config = config;
    this.channels = (config.routers ?? 1) === 2 ? CHANNELS_2 : CHANNELS;
    this.#decodePool = new ModelPool(config.decodePages, config.pageSize);
    this.#prefillPool = new ModelPool(config.prefillPages, config.pageSize);
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
    this.#decodePool.onRead = (attempt, count, fresh) =>
      this.#ghostRead(this.#current!, { attempt, count, fresh });
    this.#effectiveContext = Math.min(
      config.maxModelLen,
      config.prefillPages * config.pageSize,
      config.decodePages * config.pageSize,
    );
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
      dContent: new Array(this.config.decodePages * 4).fill(-1),
      pContent: new Array(this.config.prefillPages * 4).fill(-1),
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
    };
  }

  /** Canonical key of a world (also its stored form). */
  key(w: World): string {
    return JSON.stringify(w);
  }

  /** A deep copy of `w`, several times faster than a JSON round trip. */
  clone(w: World): World {
    return {
      routers: w.routers.map((r) => ({
        requests: cloneRecord(r.requests),
        stale: 0,
        next: r.next,
        watermark: r.watermark,
      })),
      prefill: {
        incarnation: w.prefill.incarnation,
        decodeIncarnation: w.prefill.decodeIncarnation,
        decodeLost: w.prefill.decodeLost,
        attempts: cloneRecord(w.prefill.attempts),
        ended: { ...w.prefill.ended },
        watermarks: { ...w.prefill.watermarks },
        stale: 0,
      },
      decode: {
        incarnation: w.decode.incarnation,
        prefillIncarnation: w.decode.prefillIncarnation,
        prefillLost: w.decode.prefillLost,
        attempts: cloneRecord(w.decode.attempts),
        ended: { ...w.decode.ended },
        acks: { ...w.decode.acks },
        watermarks: { ...w.decode.watermarks },
        stale: 0,
        tagFailures: 0,
      },
      dTable: w.dTable.slice(),
      pTable: w.pTable.slice(),
      dContent: w.dContent.slice(),
      pContent: w.pContent.slice(),
      chans: w.chans.map((c) => c.slice()),
      writes: w.writes.slice(),
      submitted: w.submitted,
      order: w.order.slice(),
      dIncarnation: w.dIncarnation,
      pIncarnation: w.pIncarnation,
      fences: w.fences.slice(),
      crashes: w.crashes,
      duplicates: w.duplicates,
      losses: w.losses,
      lossy: w.lossy,
      good: w.good.slice(),
    };
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
    this.#decodePool.words.set(w.dTable);
    this.#prefillPool.words.set(w.pTable);
    this.#decodePool.content = w.dContent;
    this.#prefillPool.content = w.pContent;
    switch (event.k) {
      case "submit": {
        const r = this.config.requests[event.i]!;
        w.submitted |= 1 << event.i;
        const slot = r.router ?? 0;
        const rid = (w.order.length + 1) * ROUTER_SLOTS + slot;
        const samples = Array.from({ length: r.samples ?? 0 }, (_, j) => rid + (1 + j) * ROUTER_SLOTS);
        for (let j = 0; j <= samples.length; j++) w.order.push(event.i);
        this.#router(w, slot, {
          type: "submit",
          rid,
          tenant: r.tenant,
          promptLen: r.promptLen,
          maxTokens: r.maxTokens,
          ...(samples.length === 0 ? {} : { samples }),
        });
        break;
      }
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
        if (w.decode.attempts[key]?.phase === "decoding") this.#decode(w, { type: "step", key, token: 100 });
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
    copyInto(w.dTable, this.#decodePool.words);
    copyInto(w.pTable, this.#prefillPool.words);
    this.#normalize(w);
    this.#checkState(w);
    return this.#violations;
  }

  /** Bounded liveness: a quiescent world must be idle (everything answered, every page FREE). */
  checkQuiescent(w: World): Violation | null {
    if (w.lossy === 1) return null;
    const busy: string[] = [];
    for (const router of w.routers) {
      for (const key in router.requests) {
        if (router.requests[key]!.phase !== "done") busy.push(`request ${key} never answered`);
      }
    }
    const d = this.#countStates(w.dTable, this.#decodePool);
    const p = this.#countStates(w.pTable, this.#prefillPool);
    if (d.free !== this.config.decodePages) busy.push(`decode pool not all FREE (${describeCounts(d)})`);
    if (p.free !== this.config.prefillPages) busy.push(`prefill pool not all FREE (${describeCounts(p)})`);
    if (busy.length === 0) return this.#checkBound(w);
    return {
      invariant: "liveness",
      message: `The system is stuck with no message, write or step left to make progress: ${busy.join("; ")}`,
    };
  }

  /**
   * Bounded protocol state: with every request answered and nothing in flight, the node machines
   * hold no attempt and no record of one (the router's watermark reached both and pruned them).
   */
  #checkBound(w: World): Violation | null {
    const held: string[] = [];
    const count = (what: string, record: object) => {
      const n = Object.keys(record).length;
      if (n > 0) held.push(`${what} ${n} (${Object.keys(record).join(", ")})`);
    };
    count("decode attempts", w.decode.attempts);
    count("decode tombstones", w.decode.ended);
    count("decode early acks", w.decode.acks);
    count("prefill attempts", w.prefill.attempts);
    count("prefill tombstones", w.prefill.ended);
    if (held.length === 0) return null;
    return {
      invariant: "bound",
      message: `The system is idle but the node machines still hold protocol state: ${held.join("; ")}`,
    };
  }

  /** The page counts of a world's table, read by the real table (its layout is its own). */
  #countStates(words: readonly number[], pool: ModelPool) {
    pool.words.set(words);
    return pool.table.counts();
  }

  // --- dispatch -------------------------------------------------------------------------------

  #router(w: World, slot: number, event: RouterEvent): void {
    const out: Effect[] = [];
    routerStep(w.routers[slot]!, event, { config: this.#routerConfig, safety: this.config.safety, out });
    if (
      event.type === "submit" &&
      out.some((e) => e.kind === "respond") &&
      out.some((e) => e.kind === "send")
    ) {
      this.#violations.push({
        invariant: "4",
        message: `The router rejected request ${event.rid} at its door but still contacted a node`,
      });
    }
    this.#effects(w, routerParty(slot), out);
  }

  #decode(w: World, event: DecodeEvent): void {
    const out: Effect[] = [];
    decodeStep(w.decode, event, decodeContext(this.#decodePool, this.#nodeConfig, this.config.safety, out));
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

  #describeMessage(w: World, c: number, j: number): string {
    const [from, to] = this.channels[c]!;
    return describeEnvelope({ from, to, msg: JSON.parse(w.chans[c]![j]!) as ControlMessage });
  }

  #land(w: World, write: InflightWrite): void {
    const h = write.header;
    const table = this.#decodePool.table;
    if (writeLands(table, h, this.#site(w, h))) {
      // The bytes copied are the source page's bytes now.
      const src = write.sourcePage * 4;
      const dst = h.page * 4;
      w.dContent[dst] = w.pContent[src]!;
      w.dContent[dst + 1] = w.pContent[src + 1]!;
      w.dContent[dst + 2] = w.pContent[src + 2]!;
      w.dContent[dst + 3] = write.corrupt ? 1 : w.pContent[src + 3]!;
      stampLandedWrite(table, h);
    }
    this.#prefill(w, { type: "write_done", rid: h.rid, epoch: h.epoch, index: h.index });
  }

  /** Where write `h` arrives in world `w`: decode's pool now, over the configured transport. */
  #site(w: World, h: PageWriteHeader): LandingSite {
    return {
      incarnation: w.decode.incarnation,
      leasedPage: leasedPage(w.decode, h.rid, h.epoch, h.index),
      transport: this.config.transport,
      safety: this.config.safety,
    };
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
    if (role === "prefill") {
      const old = w.pIncarnation++;
      w.prefill = initialPrefillState(w.pIncarnation, w.dIncarnation);
      this.#prefillPool.table.reset();
      w.pContent.fill(-1);
      w.fences.push(
        JSON.stringify({ to: "decode", event: { type: "peer_lost", role: "prefill", incarnation: old } }),
        JSON.stringify({
          to: "decode",
          event: { type: "peer_up", role: "prefill", incarnation: w.pIncarnation },
        }),
      );
    } else {
      const old = w.dIncarnation++;
      w.decode = initialDecodeState(w.dIncarnation, w.pIncarnation);
      this.#decodePool.table.reset();
      w.dContent.fill(-1);
      w.fences.push(
        JSON.stringify({ to: "prefill", event: { type: "peer_lost", role: "decode", incarnation: old } }),
        JSON.stringify({
          to: "prefill",
          event: { type: "peer_up", role: "decode", incarnation: w.dIncarnation },
        }),
      );
    }
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
            const at = page * 4;
            w.pContent[at] = e.rid;
            w.pContent[at + 1] = e.epoch;
            w.pContent[at + 2] = i;
            w.pContent[at + 3] = 0;
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
        case "commit":
          this.#ghostCommit(w, e, w.decode.attempts[attemptKey(e.rid, e.epoch)]?.group ?? e.rid);
          break;
        case "tokens":
          this.#ghostAnswer(w, { rid: e.rid, epoch: e.epoch, status: 200, code: null });
          break;
        case "respond":
          this.#ghostAnswer(w, { rid: e.rid, epoch: e.epoch, status: e.status, code: e.error?.code ?? null });
          break;
        case "copy":
          // n > 1 (not explored here): the copied page holds the source page's data.
          for (let k = 0; k < 4; k++) w.dContent[e.to * 4 + k] = w.dContent[e.from * 4 + k]!;
          break;
        case "stop":
          break;
      }
    }
  }

  // --- invariants -----------------------------------------------------------------------------

  /** A commit is good when its prompt pages hold its request's transfer (a sample's: its group's). */
  #ghostCommit(w: World, { rid, epoch, promptLen, coverage, pages }: CommitEffect, group: number): void {
    const leaseCount = Math.ceil(promptLen / this.config.pageSize);
    let good = coverage === promptLen;
    for (let i = 0; i < leaseCount && good; i++) {
      const at = pages[i]!.page * 4;
      const c = w.dContent;
      good = c[at] === group && c[at + 1] === epoch && c[at + 2] === i && c[at + 3] === 0;
    }
    if (good) w.good.push(attemptKey(rid, epoch));
  }

  #ghostRead(
    w: World,
    { attempt, count, fresh }: { attempt: ReadingAttempt; count: number; fresh: number },
  ): void {
    const { rid, epoch, pages, generations } = attempt;
    // A sample of n > 1 reads its group's sibling pages (the first `shared`), and its group's data
    // in them and in its copy of the partial page; never another request's, nor another sample's.
    const { group = rid, shared = 0 } = attempt as { group?: number; shared?: number };
    const table = this.#decodePool.table;
    if (fresh >= 0) {
      const at = pages[fresh]! * 4;
      w.dContent[at] = rid;
      w.dContent[at + 1] = epoch;
      w.dContent[at + 2] = fresh;
      w.dContent[at + 3] = 0;
    }
    for (let i = 0; i < count; i++) {
      const page = pages[i]!;
      const generation = generations[i]!;
      const at = page * 4;
      const c = w.dContent;
      const owner = i < shared ? group : rid;
      const ok =
        table.state(page) === (i < shared ? PageState.SHARED : PageState.READY) &&
        table.generation(page) === generation &&
        table.owner(page) === owner &&
        table.ownerEpoch(page) === epoch &&
        (c[at] === owner || c[at] === group) &&
        c[at + 1] === epoch &&
        c[at + 2] === i;
      if (!ok) {
        const holder =
          c[at] === -1
            ? "never-written bytes"
            : `the KV of request ${c[at]} epoch ${c[at + 1]} page ${c[at + 2]}`;
        this.#violations.push({
          invariant: "1",
          message: `Decode step of request ${rid} epoch ${epoch} read decode page ${page} (its page ${i}), which holds ${holder}`,
        });
        return;
      }
    }
  }

  #ghostAnswer(
    w: World,
    { rid, epoch, status, code }: { rid: number; epoch: number; status: number; code: string | null },
  ): void {
    const r = this.config.requests[w.order[Math.floor(rid / ROUTER_SLOTS) - 1]!]!;
    const oversized = r.promptLen + r.maxTokens > this.#effectiveContext;
    if (status === 200 && !w.good.includes(attemptKey(rid, epoch))) {
      this.#violations.push({
        invariant: "2",
        message: `Request ${rid} got HTTP 200 without a good commit of epoch ${epoch} (coverage short or a page not holding its own data)`,
      });
    }
    if (
      oversized &&
      (status !== 400 || code !== "context_length_exceeded") &&
      (status === 200 || code !== "aborted")
    ) {
      this.#violations.push({
        invariant: "4",
        message: `Request ${rid} (prompt ${r.promptLen} + max_tokens ${r.maxTokens} over the effective context ${this.#effectiveContext}) got ${status}${code === null ? "" : ` ${code}`} instead of 400 context_length_exceeded`,
      });
    }
  }

  #checkState(w: World): void {
    const table = this.#decodePool.table;
    // Invariant 3: a write that may still land targets the page leased for it, still leased to
    // that write's attempt (RESERVED, or QUARANTINED waiting for the drain).
    for (const s of w.writes) {
      const { header: h } = JSON.parse(s) as InflightWrite;
      if (!writeLands(table, h, this.#site(w, h))) {
        continue;
      }
      const state = table.state(h.page);
      const attempt = w.decode.attempts[attemptKey(h.rid, h.epoch)];
      const leased =
        attempt === undefined || (h.index < attempt.leaseCount && attempt.pages[h.index] === h.page);
      const live =
        leased &&
        (state === PageState.RESERVED || state === PageState.QUARANTINED) &&
        table.generation(h.page) === h.generation &&
        table.owner(h.page) === h.rid &&
        table.ownerEpoch(h.page) === h.epoch;
      if (!live) {
        this.#violations.push({
          invariant: "3",
          message: `A write of request ${h.rid} epoch ${h.epoch} (its page ${h.index}) may still land in decode page ${h.page}, which is ${leased ? "" : "outside its lease and "}${describePage(table, h.page)}`,
        });
        break;
      }
    }
    // Invariant 5 (second half): a QUARANTINED page belongs to an attempt still waiting for its ack.
    for (let p = 0; p < this.config.decodePages; p++) {
      if (table.state(p) !== PageState.QUARANTINED) continue;
      const a = w.decode.attempts[attemptKey(table.owner(p), table.ownerEpoch(p))];
      if (a === undefined || a.phase !== "quarantined") {
        this.#violations.push({
          invariant: "5",
          message: `Decode page ${p} is QUARANTINED for request ${table.owner(p)} epoch ${table.ownerEpoch(p)}, which waits for no acknowledgement`,
        });
        break;
      }
    }
  }

  #normalize(w: World): void {
    if (this.config.reorder) for (const chan of w.chans) chan.sort();
    w.writes.sort();
    w.fences.sort();
    w.good.sort();
    for (const router of w.routers) router.stale = 0;
    w.decode.stale = 0;
    w.decode.tagFailures = 0;
    w.prefill.stale = 0;
    w.decode.attempts = sortRecord(w.decode.attempts);
    w.decode.ended = sortRecord(w.decode.ended);
    w.decode.acks = sortRecord(w.decode.acks);
    w.prefill.attempts = sortRecord(w.prefill.attempts);
    w.prefill.ended = sortRecord(w.prefill.ended);
  }

  /** A one-line summary of both pools, for traces. */
  describePools(w: World): string {
    this.#decodePool.words.set(w.dTable);
    this.#prefillPool.words.set(w.pTable);
    this.#decodePool.content = w.dContent;
    this.#prefillPool.content = w.pContent;
    return `decode [${describeTable(this.#decodePool)}]  prefill [${describeTable(this.#prefillPool)}]`;
  }

  /** A readable label of an event in the context of the world it applies to. */
  describeEvent(w: World, event: EnvEvent): string {
    switch (event.k) {
      case "submit": {
        const r = this.config.requests[event.i]!;
        return `client submits request ${w.order.length + 1} (tenant ${r.tenant}, prompt ${r.promptLen}, max_tokens ${r.maxTokens})`;
      }
      case "deliver":
        return `deliver ${this.#describeMessage(w, event.c, event.j)}`;
      case "land": {
        const { header: h, corrupt } = JSON.parse(w.writes[event.j]!) as InflightWrite;
        return `page write of r${h.rid}#${h.epoch} page ${h.index} lands in decode page ${h.page}${corrupt ? " (corrupted in flight)" : ""}`;
      }
      case "fence": {
        const f = JSON.parse(w.fences[event.j]!) as PendingFence;
        const what = f.event.type === "peer_lost" ? "the connection close of" : "the handshake of";
        return `${f.to} observes ${what} ${f.to === "decode" ? "prefill" : "decode"} incarnation ${f.event.incarnation}`;
      }
      case "step":
        return `decode step of r${event.rid}#${event.epoch}`;
      case "client_abort":
        return `client of request ${event.rid} disconnects`;
      case "timeout":
        return `router's transfer timeout fires for request ${event.rid}`;
      case "quarantine_timeout":
        return `decode's deferred-release timer fires for r${event.rid}#${event.epoch}`;
      case "crash":
        return `${event.role} node crashes and restarts empty (peers see the connection close)`;
      case "duplicate":
        return `network duplicates ${this.#describeMessage(w, event.c, event.j)}`;
      case "lose":
        return `network loses ${this.#describeMessage(w, event.c, event.j)}`;
    }
  }
}

function copyInto(to: number[], from: Uint32Array): void {
  for (let i = 0; i < from.length; i++) to[i] = from[i]!;
}

/** Copies a record of flat objects whose array fields hold numbers, strings or flat objects. */
function cloneRecord<T extends object>(record: Record<string, T>): Record<string, T> {
  const out: Record<string, T> = {};
  for (const k in record) {
    const src = record[k]! as Record<string, unknown>;
    const copy: Record<string, unknown> = {};
    for (const f in src) {
      const v = src[f];
      copy[f] = Array.isArray(v) ? v.map((x) => (typeof x === "object" && x !== null ? { ...x } : x)) : v;
    }
    out[k] = copy as T;
  }
  return out;
}

function sortRecord<T>(record: Record<string, T>): Record<string, T> {
  const keys = Object.keys(record);
  if (keys.length < 2) return record;
  keys.sort();
  const out: Record<string, T> = {};
  for (const k of keys) out[k] = record[k]!;
  return out;
}

const SHORT_STATE = ["F", "R", "Y", "Q", "S"] as const;

function describeTable(pool: ModelPool): string {
  const t = pool.table;
  const parts: string[] = [];
  for (let p = 0; p < t.numPages; p++) {
    const s = t.state(p);
    const c = pool.content;
    const data =
      c[p * 4] === -1 ? "-" : `r${c[p * 4]}#${c[p * 4 + 1]}.${c[p * 4 + 2]}${c[p * 4 + 3] === 1 ? "!" : ""}`;
    parts.push(
      s === PageState.FREE ? `F(${data})` : `${SHORT_STATE[s]}:r${t.owner(p)}#${t.ownerEpoch(p)}(${data})`,
    );
  }
  return parts.join(" ");
}

function describePage(table: OwnershipTable, page: number): string {
  const s = table.state(page);
  const name = ["FREE", "RESERVED", "READY", "QUARANTINED"][s]!;
  return s === PageState.FREE
    ? "FREE"
    : `${name} for request ${table.owner(page)} epoch ${table.ownerEpoch(page)}`;
}

function describeCounts(c: { free: number; reserved: number; ready: number; quarantined: number }): string {
  return `free ${c.free}, reserved ${c.reserved}, ready ${c.ready}, quarantined ${c.quarantined}`;
}

function describeEnvelope(env: Envelope): string {
  const m = env.msg;
  let detail = "";
  if (m.type === "lease") detail = ` pages [${m.pages.map((p) => p.page).join(",")}]`;
  else if (m.type === "rejected" || m.type === "failed") detail = ` ${m.error.code}`;
  else if (m.type === "manifest")
    detail = ` tokens [${m.tokenStart},${m.tokenEnd}) ${m.checksums.length} checksums`;
  else if (m.type === "prefill")
    detail = ` prompt ${m.promptLen} into [${m.lease.pages.map((p) => p.page).join(",")}]`;
  return `${env.from}→${env.to} ${m.type.toUpperCase()} r${m.rid}#${m.epoch}${detail}`;
}
