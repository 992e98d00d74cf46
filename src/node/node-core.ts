/**
 * What a prefill node and a decode node share, written once: the parts both build from the same
 * options (the engine and its step loop, the protocol's view of the pool with its checksum cache,
 * the machines' config, the guards, the router link), the `pages_freed` report after a machine
 * step, and the statistics both report (the engine's pages, queue and counters; the attempts and
 * stale messages of every peer's machine; transfer totals of the open channels and of the closed
 * ones, kept so that totals never go down; the GB/s observations drained by each poll).
 */
import v8 from "node:v8";
import type { Engine } from "../engine/engine.js";
import type { PageCounts } from "../kvcache/ownership-table.js";
import type { FromNode, NodeStats } from "../links/node-messages.js";
import type { KvPool } from "../protocol/effects.js";
import type { Safety } from "../protocol/safety.js";
import { nextRidIn, ROUTER_SLOTS, ridBefore, routerSlotOf } from "../protocol/wire.js";
import type { PageChecksums } from "../transfer/page-checksum.js";
import type { TransferMetrics } from "../transfer/transfer-metrics.js";
import { pageChecksumsOf, protocolPool } from "./node-pool.js";
import { StepLoop } from "./step-loop.js";

export interface NodeOptions {
  readonly engine: Engine;
  readonly layoutSignature: string;
  readonly safety: Safety;
  /** This node's incarnation (a fresh value per start): stamped on leases, named in handshakes. */
  readonly incarnation: number;
  /**
   * Sends `message` to the router at once (post, encode). It must not keep `message`: a decode
   * node reuses the one carrying each token.
   */
  readonly toRouter: (message: FromNode) => void;
}

/** Transfer counters summed over channels. */
export interface TransferTotals {
  bytes: number;
  pages: number;
  transfers: number;
  droppedStaleWrites: number;
  droppedMisaddressedWrites: number;
}

/** What a peer's machine state tells the statistics. */
interface PeerState {
  readonly attempts: object;
  readonly ended: object;
  readonly acks?: object;
  readonly stale: number;
}

export class NodeCore {
  readonly incarnation: number;
  readonly engine: Engine;
  readonly checksums: PageChecksums;
  readonly pool: KvPool;
  readonly config: { readonly maxModelLen: number; readonly layoutSignature: string };
  readonly safety: Safety;
  readonly toRouter: (message: FromNode) => void;
  readonly loop: StepLoop;
  /** Transfer counters of channels that closed (kept so totals never go down). */
  readonly closedTotals: TransferTotals = emptyTotals();
  readonly #counts: PageCounts = { free: 0, reserved: 0, ready: 0, quarantined: 0, total: 0 };
  /**
   * Per router slot, the rid of that slot after the newest one any router of it sent this node (0:
   * none), for its hello: a router that (re)connects in that slot hands out rids after it, so they
   * never meet an older router's tombstones or watermark (docs/protocol.md §3, items 8 and 13).
   */
  readonly #ridFloors: number[] = new Array<number>(ROUTER_SLOTS).fill(0);
  #gbps: number[] = [];

  /** `afterStep` runs after every engine step of the step loop. */
  constructor(options: NodeOptions, afterStep?: () => void) {
    this.incarnation = options.incarnation;
    this.engine = options.engine;
    this.checksums = pageChecksumsOf(options.engine.pool);
    this.pool = protocolPool(options.engine.pool, this.checksums);
    this.config = {
      maxModelLen: options.engine.capacity.maxModelLen,
      layoutSignature: options.layoutSignature,
    };
    this.safety = options.safety;
    this.toRouter = options.toRouter;
    this.loop = new StepLoop(options.engine, afterStep);
  }

  /** A router message: its rid (or a watermark's) moves its slot's floor (see `ridFloor`). */
  seeRouter(msg: { readonly type: string; readonly rid: number; readonly below?: number }): void {
    const rid = msg.type === "watermark" ? (msg.below ?? 0) : msg.rid;
    if (rid === 0) return;
    const slot = routerSlotOf(rid);
    const after = nextRidIn(rid, slot);
    const floor = this.#ridFloors[slot]!;
    if (floor === 0 || ridBefore(floor, after)) this.#ridFloors[slot] = after;
  }

  /** The rid floor of router slot `slot`, for the hello to a router of that slot. */
  ridFloor(slot: number): number {
    return this.#ridFloors[slot] ?? 0;
  }

  /** FREE pages of the pool now (counts into a reused object: nothing allocates). */
  freePages(): number {
    return this.pool.table.countsInto(this.#counts).free;
  }

  /**
   * A machine step took FREE pages from `before` to `after`: if it freed any, requests the router
   * holds back because this pool was full may try again.
   */
  reportFreed(before: number, after: number): void {
    if (after > before) this.toRouter({ kind: "pages_freed", free: after });
  }

  /** A transfer completed at `gbps` (for the GB/s histogram). */
  recordGbps(gbps: number): void {
    if (gbps > 0) this.#gbps.push(gbps);
  }

  /**
   * The statistics of both roles over `peers` (their machines' states, their open channels'
   * transfer metrics); the role adds its own transfer failures and ABORT_ACK latencies.
   */
  stats<Peer extends { readonly state: PeerState }>(
    role: NodeStats["role"],
    peers: Iterable<Peer>,
    metricsOf: (peer: Peer) => TransferMetrics | undefined,
  ): NodeStats & { transfer: TransferTotals } {
    const engine = this.engine.stats();
    let attempts = 0;
    let stale = 0;
    let tombstones = 0;
    const transfer = { ...this.closedTotals };
    for (const peer of peers) {
      attempts += Object.keys(peer.state.attempts).length;
      stale += peer.state.stale;
      tombstones +=
        countKeys(peer.state.ended) + (peer.state.acks === undefined ? 0 : countKeys(peer.state.acks));
      const m = metricsOf(peer);
      if (m !== undefined) addTransfer(transfer, m);
    }
    const gbps = this.#gbps;
    this.#gbps = [];
    return {
      role,
      pages: engine.pages,
      queue: engine.queue,
      counters: engine.counters,
      ...(engine.prefixCache === undefined ? {} : { prefixCache: engine.prefixCache }),
      ...(engine.tiers === undefined ? {} : { tiers: engine.tiers }),
      attempts,
      staleMessages: stale,
      tombstones,
      heapUsedBytes: v8.getHeapStatistics().used_heap_size,
      transfer: { ...transfer, checksumFailures: 0, coverageFailures: 0 },
      checksums: this.checksums.counts(),
      transferGbps: gbps,
      abortAckSeconds: [],
      ...(engine.phases === undefined ? {} : { phases: engine.phases }),
      ...(engine.pageMap === undefined ? {} : { pageMap: engine.pageMap }),
    };
  }
}

function countKeys(record: object): number {
  let n = 0;
  for (const _ in record) n++;
  return n;
}

function emptyTotals(): TransferTotals {
  return { bytes: 0, pages: 0, transfers: 0, droppedStaleWrites: 0, droppedMisaddressedWrites: 0 };
}

/** Adds one channel's counters to `totals`. */
export function addTransfer(totals: TransferTotals, m: TransferMetrics): void {
  totals.bytes += m.bytesTransferred;
  totals.pages += m.pagesTransferred;
  totals.transfers += m.transfers;
  totals.droppedStaleWrites += m.droppedStaleWrites;
  totals.droppedMisaddressedWrites += m.droppedMisaddressedWrites;
}
