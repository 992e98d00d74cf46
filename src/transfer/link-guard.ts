/**
 * What an unauthenticated connection may cost a listening port (the node's control port, prefill's
 * transfer port): nothing that outlives a short deadline or grows with the number of connections.
 *
 * `PreAuthGuard` watches every connection from accept until its handshake completes:
 * - a handshake deadline (`handshakeTimeoutMs`, default 5 s): a connection that has not proved
 *   itself by then is closed;
 * - a cap on connections still in their handshake (`maxPending`, default 64): the oldest is closed
 *   to admit a new one, so a flood of half-open links cannot keep the real peer out for longer than
 *   it takes to connect;
 * - the bytes buffered before the handshake are bounded by the callers (4 KiB: a handshake message
 *   is small, a declared length above that is refused before anything is buffered), so the memory
 *   held by pending connections is at most `maxPending × 4 KiB`.
 *
 * Every refusal is counted by reason (`LinkAuthFailures`, exported as
 * `kvfence_link_auth_failures_total{node,port,reason}` on the router's /metrics) and reported to
 * `onRefused` (the node logs it) — at most `REPORTS_PER_WINDOW` per `REPORT_WINDOW_MS`, so a flood
 * cannot flood the log too; the next report after a quiet spell says how many were left out.
 */
import type net from "node:net";

/** Largest message a peer may send before its handshake completed (hello, proof). */
export const MAX_PREAUTH_BYTES = 4096;
export const DEFAULT_HANDSHAKE_TIMEOUT_MS = 5000;
export const DEFAULT_MAX_PENDING = 64;
export const REPORTS_PER_WINDOW = 20;
export const REPORT_WINDOW_MS = 10_000;
/** A refused connection that was sent a last message is closed outright after this (its peer may never close it). */
export const REFUSAL_LINGER_MS = 1000;

/** Why a connection was refused before (or instead of) admission. */
export type LinkAuthReason =
  /** The first message's MAC does not verify under the cluster secret (another secret, or forged). */
  | "bad_hello"
  /** The handshake's last message does not prove the peer saw this connection's challenge (a replay). */
  | "bad_proof"
  /** Not the framing of this port (garbage), or a message out of order. */
  | "malformed"
  /** A message declared or reached a length above the pre-handshake limit. */
  | "oversized"
  /** The handshake did not complete before the deadline. */
  | "timeout"
  /** Closed to make room: too many connections were in their handshake at once. */
  | "too_many_pending"
  /** A peer with the same identity is still connected (no silent takeover). */
  | "peer_connected"
  /** The peer runs another model, dtype or page size. */
  | "layout_mismatch"
  /**
   * The address the initiator dialled is not the one the acceptor advertises (link-address.ts): a
   * relay, or a registry entry copied to another address. Counted by the side that refuses.
   */
  | "address_mismatch"
  /** The TLS handshake failed: no certificate, one of another CA, or a plaintext peer (docs/tls.md). */
  | "tls_handshake";

/** Refusal counts by reason of one port. */
export type LinkAuthFailures = Partial<Record<LinkAuthReason, number>>;

export interface PreAuthGuardOptions {
  readonly handshakeTimeoutMs?: number;
  readonly maxPending?: number;
  /** The log window: at most `REPORTS_PER_WINDOW` reports per this many ms. Default 10 s. */
  readonly reportWindowMs?: number;
  /** Called once per refused connection (after the count), within the log window's budget. */
  readonly onRefused?: (reason: LinkAuthReason, detail: string) => void;
}

export class PreAuthGuard {
  readonly failures: LinkAuthFailures = {};
  readonly #pending = new Map<net.Socket, NodeJS.Timeout>();
  readonly #refused = new WeakSet<net.Socket>();
  readonly #timeoutMs: number;
  readonly #maxPending: number;
  readonly #onRefused: ((reason: LinkAuthReason, detail: string) => void) | undefined;
  readonly #reportWindowMs: number;
  #windowStart = 0;
  #reportsInWindow = 0;
  #unreported = 0;

  constructor(options: PreAuthGuardOptions = {}) {
    this.#timeoutMs = options.handshakeTimeoutMs ?? DEFAULT_HANDSHAKE_TIMEOUT_MS;
    this.#maxPending = options.maxPending ?? DEFAULT_MAX_PENDING;
    this.#onRefused = options.onRefused;
    this.#reportWindowMs = options.reportWindowMs ?? REPORT_WINDOW_MS;
  }

  /** Connections in their handshake now. */
  get pending(): number {
    return this.#pending.size;
  }

  /** A connection was accepted: start its deadline; close the oldest pending one above the cap. */
  accepted(socket: net.Socket, remote: string): void {
    while (this.#pending.size >= this.#maxPending) {
      const oldest = this.#pending.keys().next().value as net.Socket;
      this.refuse(oldest, "too_many_pending", `more than ${this.#maxPending} connections in their handshake`);
    }
    const timer = setTimeout(
      () => this.refuse(socket, "timeout", `no handshake within ${this.#timeoutMs} ms from ${remote}`),
      this.#timeoutMs,
    );
    timer.unref();
    this.#pending.set(socket, timer);
    socket.once("close", () => this.#forget(socket));
  }

  /** The connection completed its handshake: it is no longer the guard's. */
  admitted(socket: net.Socket): void {
    this.#forget(socket);
  }

  /**
   * Counts and reports the refusal of `socket` and closes it (once; later calls do nothing): at
   * once, or after sending `last` (a REFUSE frame, a challenge naming the advertised address) and
   * at most `REFUSAL_LINGER_MS` later. False when it was refused already.
   */
  refuse(socket: net.Socket, reason: LinkAuthReason, detail: string, last?: Uint8Array): boolean {
    if (!this.count(socket, reason, detail)) return false;
    if (last === undefined || socket.destroyed) socket.destroy();
    else {
      socket.end(last);
      setTimeout(() => socket.destroy(), REFUSAL_LINGER_MS).unref();
    }
    return true;
  }

  /**
   * Counts and reports a refusal the caller closes itself (e.g. after sending a REFUSE frame);
   * false when `socket` was refused already.
   */
  count(socket: net.Socket, reason: LinkAuthReason, detail: string): boolean {
    if (this.#refused.has(socket)) return false;
    this.#refused.add(socket);
    this.#forget(socket);
    this.failures[reason] = (this.failures[reason] ?? 0) + 1;
    this.#report(reason, detail);
    return true;
  }

  /** Stops every deadline (the server closes). */
  close(): void {
    for (const timer of this.#pending.values()) clearTimeout(timer);
    this.#pending.clear();
  }

  #report(reason: LinkAuthReason, detail: string): void {
    if (this.#onRefused === undefined) return;
    const now = Date.now();
    if (now - this.#windowStart >= this.#reportWindowMs) {
      this.#windowStart = now;
      this.#reportsInWindow = 0;
    }
    if (this.#reportsInWindow >= REPORTS_PER_WINDOW) {
      this.#unreported++;
      return;
    }
    this.#reportsInWindow++;
    const left = this.#unreported;
    this.#unreported = 0;
    this.#onRefused(reason, left === 0 ? detail : `${detail} (${left} earlier refusals not logged)`);
  }

  #forget(socket: net.Socket): void {
    const timer = this.#pending.get(socket);
    if (timer === undefined) return;
    clearTimeout(timer);
    this.#pending.delete(socket);
  }
}
