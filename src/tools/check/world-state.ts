/**
 * The world `kvfence check` explores, as plain data: the bound it is built from (`ModelConfig`),
 * its state (`World`), the environment's events (`EnvEvent`) and what a violation reports.
 *
 * A world is plain JSON, so a state is identified by its canonical `JSON.stringify` (records
 * re-sorted and metric counters zeroed by `normalizeWorld`) and copied by `cloneWorld`. In-flight
 * messages and writes are kept as sorted JSON strings: a multiset, so delivery order is free (any
 * reordering) and identical duplicates collapse.
 */
import { type DecodeState, leasedPage } from "../../protocol/decode-machine.js";
import type { LandingSite, TransportKind } from "../../protocol/page-write.js";
import type { PrefillState } from "../../protocol/prefill-machine.js";
import type { RouterState } from "../../protocol/router-machine.js";
import type { Safety } from "../../protocol/safety.js";
import type { ControlMessage, NodeRole, PageWriteHeader } from "../../protocol/wire.js";

export interface CheckRequest {
  readonly rid: number;
  /** Which router submits it (0 default; 1 only in a two-router world, `ModelConfig.routers`). */
  readonly router?: number;
  readonly tenant: number;
  readonly promptLen: number;
  readonly maxTokens: number;
  /** n > 1: samples after the first, as one group (docs/protocol.md §3, item 13); absent: none. */
  readonly samples?: number;
  /**
   * Its prompt's token ids (`promptLen` of them), for decode's prefix cache (`ModelConfig.decodeCache`);
   * its generated tokens are the model's first token then one per decode step (`FIRST_TOKEN`, `STEP_TOKEN`).
   */
  readonly tokens?: readonly number[];
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
  /**
   * Decode keeps a prefix cache on its pool (decode-side reuse, src/protocol/decode-held.ts): the
   * real `PrefixCache`, its state kept with each world (`World.dCache`).
   */
  readonly decodeCache?: boolean;
}

/** The model's first token (prefill's) and the token of every decode step. */
export const FIRST_TOKEN = 7;
export const STEP_TOKEN = 100;

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
export function routerParty(slot: number): "router" | "router1" {
  return slot === 0 ? "router" : "router1";
}

/** A control message on its channel. */
export interface Envelope {
  readonly from: Party;
  readonly to: Party;
  readonly msg: ControlMessage;
}

/** A connection event a node has yet to observe after its peer restarted. */
export interface PendingFence {
  readonly to: "decode" | "prefill";
  readonly event: { readonly type: "peer_lost" | "peer_up"; readonly incarnation: number };
}

/** A page write on its way from prefill's source page to decode's leased page. */
export interface InflightWrite {
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
  /** Decode's prefix cache (`PrefixCache.save`, as JSON; "" without `decodeCache`). */
  dCache: string;
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

/** Where write `h` arrives in world `w`: decode's pool now, over the configured transport. */
export function landingSite(w: World, h: PageWriteHeader, config: ModelConfig): LandingSite {
  return {
    incarnation: w.decode.incarnation,
    leasedPage: leasedPage(w.decode, h.rid, h.epoch, h.index),
    transport: config.transport,
    safety: config.safety,
  };
}

/** A deep copy of `w`, several times faster than a JSON round trip. */
export function cloneWorld(w: World): World {
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
    dCache: w.dCache,
  };
}

/**
 * Puts `w` in canonical form: multisets sorted (and with `reorder` every channel), records in key
 * order, metric counters zeroed — so equal states have equal keys.
 */
export function normalizeWorld(w: World, reorder: boolean): void {
  if (reorder) for (const chan of w.chans) chan.sort();
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
