/**
 * A fair queue over flows (tenants): weighted fair queuing in its self-clocked form (Golestani,
 * "A Self-Clocked Fair Queueing Scheme for Broadband Applications", 1994), the scheduling that
 * multi-tenant serving uses so that one flow's backlog never delays another flow by more than
 * about one item.
 *
 * Each flow has its own FIFO queue (a `Deque`). An item pushed to flow f gets a virtual finish tag
 * `max(V, F_f) + cost / weight_f`, where `F_f` is the tag of f's previous item and `V` the tag of
 * the item served last (the virtual clock). Serving always takes the front item with the smallest
 * tag (ties: the one pushed first). So a flow that pushed a thousand items at once has tags far in
 * the virtual future, and an item of a quiet flow, tagged from the present, goes before all but
 * about one of them; a flow that was idle starts from the present too (no credit banked while
 * idle). Over any time two flows stay backlogged, their service (the sum of costs, per weight)
 * differs by at most the two largest costs. Costs here are KV pages, so a tenant of small
 * requests is not held behind a tenant of large ones. A pick scans the flows' front items:
 * O(flows).
 *
 * `peek(eligible)` returns the item served next among the flows the predicate accepts (a flow at
 * its cap is skipped), without removing it; `take()` removes it and advances the clock, `untake()`
 * undoes that when the item could not be served after all. A
 * dispatched item that comes back (its backend refused it for now) goes to the front of its flow
 * with `pushFront`, tagged with the present, so it is served before that flow's later items. With
 * one flow the queue is FIFO.
 *
 * Order `"arrival"` (`--scheduling-policy fcfs`) tags each item with its push order instead: one
 * queue in arrival order across flows, as vLLM's `fcfs`, where a flood delays a later flow's item
 * behind all of it. The per-flow queues, `eligible` (a flow at its cap is skipped, its items keep
 * their places) and `pushFront` stay as they are.
 */
import { Deque } from "./deque.js";

export interface FairQueueOptions<T> {
  /** The flow (tenant) of an item. */
  readonly flow: (item: T) => number;
  /** The cost of serving an item (e.g. the KV pages it may hold), at least 0. */
  readonly cost: (item: T) => number;
  /** A flow's weight, positive (default 1): its share is proportional to it. */
  readonly weight?: (flow: number) => number;
  /** "fair" (default): virtual finish tags; "arrival": push order over all flows (first come, first served). */
  readonly order?: QueueOrder;
}

/** How a `FairQueue` orders items of different flows. */
export type QueueOrder = "fair" | "arrival";

interface Flow<T> {
  readonly id: number;
  readonly queue: Deque<T>;
  /** The finish tag of the flow's last pushed item. */
  lastTag: number;
}

export class FairQueue<T> {
  readonly #flowOf: (item: T) => number;
  readonly #costOf: (item: T) => number;
  readonly #weight: (flow: number) => number;
  readonly #arrival: boolean;
  readonly #flows = new Map<number, Flow<T>>();
  /** Each waiting item's finish tag and push order. */
  readonly #tags = new Map<T, { tag: number; seq: number }>();
  /** The virtual clock: the tag of the item served last. */
  #clock = 0;
  #seq = 0;
  #length = 0;
  /** The flow of the item the last `peek` returned, until `take` or a change. */
  #peeked: Flow<T> | null = null;
  /** The last item taken, with its tag and the clock before, for `untake`. */
  #taken: { item: T; tag: { tag: number; seq: number }; clock: number } | null = null;

  constructor(options: FairQueueOptions<T>) {
    this.#flowOf = options.flow;
    this.#costOf = options.cost;
    this.#weight = options.weight ?? (() => 1);
    this.#arrival = options.order === "arrival";
  }

  /** Items waiting, over all flows. */
  get length(): number {
    return this.#length;
  }

  /** Items of `flow` waiting. */
  lengthOf(flow: number): number {
    return this.#flows.get(flow)?.queue.length ?? 0;
  }

  /** Flows with waiting items. */
  get flows(): number {
    return this.#flows.size;
  }

  /** Appends `item` to the back of its flow's queue. */
  push(item: T): void {
    const flow = this.#flow(this.#flowOf(item));
    const seq = this.#seq++;
    flow.lastTag = this.#arrival
      ? seq
      : Math.max(this.#clock, flow.lastTag) + this.#cost(item) / this.#weightOf(flow.id);
    this.#tags.set(item, { tag: flow.lastTag, seq });
    flow.queue.pushBack(item);
    this.#added();
  }

  /** Puts a dispatched `item` back at the front of its flow's queue, tagged with the present. */
  pushFront(item: T): void {
    const flow = this.#flow(this.#flowOf(item));
    const front = flow.queue.peekFront();
    const tag = Math.min(this.#clock, front === undefined ? this.#clock : this.#tags.get(front)!.tag);
    if (front === undefined) flow.lastTag = Math.max(flow.lastTag, tag);
    this.#tags.set(item, { tag, seq: -1 - this.#seq++ });
    flow.queue.pushFront(item);
    this.#added();
  }

  /** Removes a waiting `item` (an abort, a timeout); false when it is not queued. */
  remove(item: T): boolean {
    const flow = this.#flows.get(this.#flowOf(item));
    if (flow === undefined || !flow.queue.remove(item)) return false;
    this.#tags.delete(item);
    this.#removed(flow);
    return true;
  }

  /**
   * The item served next among the flows `eligible` accepts (called with each flow and its front
   * item), or undefined when there is none. Does not remove it: `take()` does.
   */
  peek(eligible?: (flow: number, front: T) => boolean): T | undefined {
    this.#peeked = null;
    if (this.#length === 0) return undefined;
    let best: { tag: number; seq: number } | null = null;
    for (const flow of this.#flows.values()) {
      const front = flow.queue.peekFront()!;
      const t = this.#tags.get(front)!;
      if (best !== null && (t.tag > best.tag || (t.tag === best.tag && t.seq > best.seq))) continue;
      if (eligible !== undefined && !eligible(flow.id, front)) continue;
      best = t;
      this.#peeked = flow;
    }
    return this.#peeked?.queue.peekFront();
  }

  /** Removes and returns the item the last `peek` returned, advancing the virtual clock to its tag. */
  take(): T {
    const flow = this.#peeked;
    if (flow === null) throw new Error("FairQueue.take() without a peek that found an item");
    const item = flow.queue.popFront()!;
    const tag = this.#tags.get(item)!;
    this.#taken = { item, tag, clock: this.#clock };
    this.#clock = Math.max(this.#clock, tag.tag);
    this.#tags.delete(item);
    this.#removed(flow);
    return item;
  }

  /**
   * Undoes the last `take` of `item` (it could not be served after all): back at the front of its
   * flow with its own tag, and the clock as it was.
   */
  untake(item: T): void {
    const taken = this.#taken;
    if (taken === null || taken.item !== item) {
      this.pushFront(item);
      return;
    }
    this.#taken = null;
    const flow = this.#flow(this.#flowOf(item));
    if (flow.queue.length === 0) flow.lastTag = Math.max(flow.lastTag, taken.tag.tag);
    if (this.#length === 0 && this.#clock === 0) this.#seq = Math.max(this.#seq, taken.tag.seq + 1);
    this.#clock = taken.clock;
    this.#tags.set(item, taken.tag);
    flow.queue.pushFront(item);
    this.#added();
  }

  /** Every waiting item, flow by flow, each flow front to back. */
  *[Symbol.iterator](): IterableIterator<T> {
    for (const flow of [...this.#flows.values()]) yield* [...flow.queue];
  }

  #cost(item: T): number {
    return Math.max(this.#costOf(item), 0);
  }

  #weightOf(flow: number): number {
    const w = this.#weight(flow);
    return w > 0 ? w : 1;
  }

  #flow(id: number): Flow<T> {
    let flow = this.#flows.get(id);
    if (flow === undefined) {
      flow = { id, queue: new Deque<T>(4), lastTag: 0 };
      this.#flows.set(id, flow);
    }
    return flow;
  }

  #added(): void {
    this.#length++;
    this.#peeked = null;
    this.#taken = null;
  }

  /** An item left `flow`: an empty flow is forgotten, and an empty queue restarts the clock. */
  #removed(flow: Flow<T>): void {
    this.#length--;
    this.#peeked = null;
    if (flow.queue.length > 0) return;
    this.#flows.delete(flow.id);
    if (this.#length === 0) {
      this.#clock = 0;
      this.#seq = 0;
    }
  }
}
