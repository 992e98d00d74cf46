/**
 * Migration mid-stream (issue #36 item 1): a request whose pair lost a node — or whose attempt a
 * node failed (a transfer that failed, a guard that refused its pages) — after tokens reached its
 * client runs on as a fresh attempt on another pair, from its prompt plus the tokens already sent,
 * and its client's stream goes on where it was: nothing sent twice, nothing missing.
 *
 * The new attempt's prompt is the request's prompt followed by its output so far, its `max_tokens`
 * what is left, and its sampling the request's with `resumedTokens` (src/protocol/sampling-params.ts):
 * the nodes' sampling step counts those tokens as generated — the penalties' counts and
 * `min_tokens`, the grammar's state (its matcher accepts them first) — and skips their draws of the
 * seeded generator, so a greedy or seeded request samples what the lost attempt would have. Stop
 * strings are matched by the HTTP layer over the one stream, which never restarts. The attempt is
 * fresh (a new rid, its own reservation and page tags: src/cluster/attempt-rids.ts), so nothing of
 * the lost one can land in it.
 *
 * The router keeps each request's output token ids for this (one array push per token it streams):
 * nothing else is added to a request that never migrates. A request migrates at most
 * `--max-migrations` times (default 2), to a pair sharing neither node with the one it failed on
 * when one can take it (`PairDemand.avoid`); a request of an n > 1 group does not migrate (its samples
 * share an attempt until the commit); nor does one when no other pair is usable. Those end with
 * their error, as before. Counted by reason (the error code that ended the attempt) and result.
 */

import type { ErrorCode, WireError } from "../lib/errors.js";
import { epochOf, traceSpan, tracing } from "../lib/tracing.js";
import type { PendingRequest } from "./pending-request.js";

/** `--max-migrations`' default: migrations per request. */
export const DEFAULT_MAX_MIGRATIONS = 2;

/** The errors that end an attempt because of a node, not the request: another pair may serve it. */
const MIGRATE_ON: ReadonlySet<ErrorCode> = new Set<ErrorCode>([
  "node_unavailable",
  "transfer_failed",
  "checksum_mismatch",
  "coverage_mismatch",
  "page_tag_mismatch",
]);

/**
 * What became of an attempt a node's loss or failure ended: after tokens were sent, `migrated` or
 * why not; before, `moved` (the once-only re-run on another pair).
 */
export type MigrationResult = "migrated" | "moved" | "budget_spent" | "no_pair" | "group";

/**
 * A request whose pair lost a node before its first token runs again on another pair, once (no
 * output to resume from: a plain fresh attempt).
 */
const MAX_MOVES = 1;

/**
 * Where a request goes when its attempt ended with an error: again to the queue, for a fresh
 * attempt on another pair (before its first token, once; after it, a migration, at most `max`
 * times), or to its client. Counts the migrations by reason and result.
 */
export class Migrations {
  readonly max: number;
  /** Counts by `reason result` (reason: the error code). */
  readonly #counts = new Map<string, number>();

  constructor(max = DEFAULT_MAX_MIGRATIONS) {
    if (!Number.isInteger(max) || max < 0) throw new Error(`max_migrations must be an integer ≥ 0: ${max}`);
    this.max = max;
  }

  /**
   * `pending`'s attempt ended with `error` (its reservations already released): "requeue" — it
   * waits again, its next attempt readied — or "finished" (it lost a node with nothing left to
   * generate: it ends now, as it would have), or the error to end it with. `otherPair`: a pair
   * other than its own is usable.
   */
  after(
    pending: PendingRequest,
    error: WireError,
    otherPair: boolean,
    pageSize: number,
  ): "requeue" | "finished" | WireError {
    if (pending.silenced) return error;
    if (!pending.firstToken) {
      if (error.code !== "node_unavailable" || pending.moved >= MAX_MOVES || !otherPair) return error;
      pending.moved++;
      pending.avoid = pending.pair;
      this.#record(pending, error, "moved");
      return "requeue";
    }
    if (!MIGRATE_ON.has(error.code)) return error;
    const result: MigrationResult =
      pending.group !== null
        ? "group"
        : pending.migrations >= this.max
          ? "budget_spent"
          : otherPair
            ? "migrated"
            : "no_pair";
    this.#record(pending, error, result);
    if (result !== "migrated") {
      const why =
        result === "budget_spent"
          ? `it migrated ${pending.migrations} times, --max-migrations ${this.max}`
          : WHY[result];
      return { ...error, message: `${error.message}; not migrated: ${why}` };
    }
    if (resumeAttempt(pending, pageSize)) {
      pending.avoid = pending.pair;
      return "requeue";
    }
    pending.completionTokens = pending.output.length + (pending.stopped ? 1 : 0);
    return "finished";
  }

  /**
   * Counts it; a move or a migration is also a `migration` span of its request (tracing on), from
   * its last token sent (a move: its submission) to now, with the tokens it resumes after.
   */
  #record(pending: PendingRequest, error: WireError, result: MigrationResult): void {
    const key = `${error.code} ${result}`;
    this.#counts.set(key, (this.#counts.get(key) ?? 0) + 1);
    if (tracing() === null || (result !== "migrated" && result !== "moved")) return;
    const since = result === "moved" ? pending.submittedAt : pending.lastTokenAt;
    traceSpan(pending.request.trace, "migration", epochOf(since), {
      "kvfence.migration.reason": error.code,
      "kvfence.migration.tokens_sent": pending.output.length,
      "kvfence.migration.number": pending.migrations + pending.moved + (result === "migrated" ? 1 : 0),
    });
  }

  /** The counts so far, by reason and result. */
  counts(): { reason: string; result: MigrationResult; count: number }[] {
    return [...this.#counts].map(([key, count]) => {
      const [reason, result] = key.split(" ") as [string, MigrationResult];
      return { reason, result, count };
    });
  }
}

const WHY: Record<"group" | "no_pair", string> = {
  group: "a sample of an n > 1 group does not migrate",
  no_pair: "no other prefill/decode pair is up",
};

/**
 * Readies `pending`'s next attempt to resume from its output so far: its prompt followed by that
 * output, what is left of `max_tokens`, and its sampling resuming after the output (no prompt
 * log-probabilities again: the client has them). Returns false when nothing is left to generate
 * (the output is `max_tokens` long, or ended on a stop token): the request is finished.
 */
export function resumeAttempt(pending: PendingRequest, pageSize: number): boolean {
  const { request, output } = pending;
  const left = request.maxTokens - output.length;
  if (left <= 0 || pending.stopped) return false;
  const prompt = new Int32Array(request.promptTokens.length + output.length);
  prompt.set(request.promptTokens);
  prompt.set(output, request.promptTokens.length);
  pending.prompt = prompt;
  pending.maxTokens = left;
  pending.prefillPages = Math.ceil(prompt.length / pageSize);
  const { promptLogprobs: _, ...sampling } = request.sampling;
  pending.sampling = { ...sampling, resumedTokens: output.length };
  pending.migrations++;
  return true;
}

/** The output tokens before the current attempt (0: it is the request's first). */
export function resumedTokens(pending: PendingRequest): number {
  return pending.prompt.length - pending.request.promptTokens.length;
}
