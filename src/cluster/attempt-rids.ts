/**
 * The rids a router's attempts go out under: of its router slot only, so several routers over the
 * same nodes never share a rid, and in serial order, which the pairs' watermarks rely on
 * (docs/protocol.md §3, item 13). A restarted router starts after every rid an earlier router of
 * its slot sent any of its nodes (each node's hello says its floor), so it never reuses one.
 */

import type { NodeHello } from "../links/node-messages.js";
import { nextRidIn, ridBefore, routerSlotOf } from "../protocol/wire.js";

export class AttemptRids {
  readonly #routerSlot: number;
  /** The newest rid an attempt went out under (0: none yet). */
  #last = 0;

  constructor(routerSlot: number) {
    this.#routerSlot = routerSlot;
  }

  /** Rids go out after every rid an earlier router of this slot sent this node (its hello's floor). */
  raiseFloor(hello: NodeHello): void {
    const floor = hello.ridFloor ?? 0;
    if (floor === 0) return;
    const last = floor === 1 ? 0xffff_ffff : (floor - 1) >>> 0;
    if (this.#last === 0 || ridBefore(this.#last, last)) this.#last = last;
  }

  /**
   * The rid of the next attempt: `wanted` (the client's rid; 0: none) when it is of this router's
   * slot and newer than every rid yet, else the next rid of the slot.
   */
  take(wanted = 0): number {
    const slot = this.#routerSlot;
    const fresh =
      wanted !== 0 && routerSlotOf(wanted) === slot && (this.#last === 0 || ridBefore(this.#last, wanted));
    this.#last = fresh ? wanted : nextRidIn(this.#last, slot);
    return this.#last;
  }
}
