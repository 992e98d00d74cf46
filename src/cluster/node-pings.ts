/**
 * Readiness pings from the router to its nodes. Every node gets a ping every `PING_INTERVAL_MS`
 * (one in flight at most); a node whose pong has not come within the ping timeout is marked not
 * answering (a frozen process, a wedged link) and gets no new requests until it answers again.
 * A ping timeout only marks a node: it never fails a request or frees a page (docs/protocol.md:
 * pages are freed by an ABORT_ACK or the fence).
 */

import type { NodeSlot } from "./pair-pool.js";

/** Readiness pings: one per node in flight at most, every this often. */
export const PING_INTERVAL_MS = 200;
export const DEFAULT_PING_TIMEOUT_MS = 500;

export interface NodePingsOptions {
  /** The slots to ping (read at each round: nodes that join are pinged too). */
  readonly slots: () => readonly NodeSlot[];
  /** A pong later than this marks its node not answering. Default `DEFAULT_PING_TIMEOUT_MS`. */
  readonly timeoutMs?: number;
  /** A node that was not answering answered again: it may take requests. */
  readonly onAnswering: () => void;
}

export class NodePings {
  readonly #options: NodePingsOptions;
  readonly #timeoutMs: number;
  readonly #timer: NodeJS.Timeout;
  /** Each node's unanswered ping, if any. */
  readonly #unanswered = new Map<NodeSlot, { readonly id: number; readonly timer: NodeJS.Timeout }>();
  #nextId = 1;

  constructor(options: NodePingsOptions) {
    this.#options = options;
    this.#timeoutMs = options.timeoutMs ?? DEFAULT_PING_TIMEOUT_MS;
    this.#timer = setInterval(() => this.#pingAll(), PING_INTERVAL_MS);
    this.#timer.unref();
  }

  /** `slot`'s node answered ping `id`: it is answering again if it was not. */
  pong(slot: NodeSlot, id: number): void {
    const ping = this.#unanswered.get(slot);
    if (ping?.id !== id) return;
    clearTimeout(ping.timer);
    this.#unanswered.delete(slot);
    if (!slot.answering) {
      slot.answering = true;
      this.#options.onAnswering();
    }
  }

  /** `slot`'s node was lost or came back: its unanswered ping, if any, no longer counts. */
  forget(slot: NodeSlot): void {
    const ping = this.#unanswered.get(slot);
    if (ping === undefined) return;
    clearTimeout(ping.timer);
    this.#unanswered.delete(slot);
  }

  /** No more pings. */
  close(): void {
    clearInterval(this.#timer);
    for (const ping of this.#unanswered.values()) clearTimeout(ping.timer);
  }

  /** Sends a readiness ping to every node without one in flight; its deadline marks it not answering. */
  #pingAll(): void {
    for (const slot of this.#options.slots()) {
      if (slot.lost || this.#unanswered.has(slot)) continue;
      const id = this.#nextId++;
      const timer = setTimeout(() => {
        // Let pongs that arrived while this process was busy be read first (the poll phase runs
        // after timers): a router that lagged does not blame its nodes.
        setImmediate(() => {
          if (this.#unanswered.get(slot)?.id === id) slot.answering = false;
        });
      }, this.#timeoutMs);
      timer.unref();
      this.#unanswered.set(slot, { id, timer });
      try {
        slot.node.link.send({ kind: "ping", id });
      } catch {
        // The link is closing: its close event marks the node lost.
      }
    }
  }
}
