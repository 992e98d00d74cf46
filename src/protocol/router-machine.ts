/**
 * The router's side of the transfer protocol (docs/design.md §4), sans-IO: `routerStep(state, event,
 * ctx)` mutates a plain-data state (cheap to copy and hash) and pushes effects into `ctx.out`.
 *
 * Per request: admit (the router's door, against the effective context: the minimum of the model's
 * window and every node's pool; a rejection contacts nobody and allocates nothing) → reserve at
 * decode → prefill into the lease → decoding (HTTP 200 from the commit on) → done. Any message whose
 * `(rid, epoch)` is not the request's current attempt is ignored and counted. A node's rejection
 * reaches the client unchanged. Abandoning an attempt (client abort, transfer timeout, node loss,
 * a prefill rejection) always sends ABORT to decode, which relays it to prefill and keeps the
 * leased pages quarantined until prefill acknowledges that its writes drained. A retry is a new
 * epoch with a new reservation. Nothing here runs on a timer: `attempt_timeout` is an event the host
 * feeds, and it only aborts and retries, it never releases pages.
 */
import { ERROR_TABLE, type WireError } from "../lib/errors.js";
import type { Effects } from "./effects.js";
import { faultOn, type Safety } from "./safety.js";
import { type ControlMessage, nextRidIn, ROUTER_SLOTS, ridBefore, routerSlotOf } from "./wire.js";

export interface RouterConfig {
  /** The model's context window (tokens). */
  readonly maxModelLen: number;
  /** Capacity in tokens of each node's KV pool. */
  readonly prefillPoolTokens: number;
  readonly decodePoolTokens: number;
  /** Attempts per request (1 = no retry). */
  readonly maxAttempts: number;
  /** See `WATERMARK_STEP` (the default); the model checker sends every move (1). */
  readonly watermarkStep?: number;
}

/** Everything `routerStep` works with besides its state and event: config, guards and faults, effects sink. */
export interface RouterContext {
  readonly config: RouterConfig;
  readonly safety: Safety;
  readonly out: Effects;
}

export type RouterPhase = "reserving" | "prefilling" | "decoding" | "done";

export interface RouterRequest {
  rid: number;
  tenant: number;
  promptLen: number;
  maxTokens: number;
  epoch: number;
  phase: RouterPhase;
  /** Tokens streamed so far. */
  streamed: number;
  /** n > 1 as one group, on its first sample: the later samples' rids (each its own request here). */
  samples?: number[];
  /** A later sample of a group: the group's (first sample's) rid, whose attempt carries it until the commit. */
  of?: number;
}

export interface RouterState {
  /** Requests by rid (decimal string keys, so the state stays JSON). */
  requests: Record<string, RouterRequest>;
  /** Messages ignored because their (rid, epoch) was not current. */
  stale: number;
  /**
   * The rid of its router slot after the newest one submitted (0: none yet). Rids are submitted in
   * serial order, all of one router slot (`routerSlotOf`, docs/protocol.md §3, item 13).
   */
  next: number;
  /** The last watermark sent to the pair's nodes (0: none yet). */
  watermark: number;
}

/**
 * While requests are in flight a watermark is sent once it moved this many rids (batched, so a
 * busy pair sends one per this many requests); with none in flight it is sent at once, so idle
 * nodes hold no tombstone.
 */
export const WATERMARK_STEP = 16;

export type RouterEvent =
  | {
      readonly type: "submit";
      readonly rid: number;
      readonly tenant: number;
      readonly promptLen: number;
      readonly maxTokens: number;
      /** n > 1 as one group: the later samples' rids, after `rid` in serial order (docs/protocol.md §3, item 13). */
      readonly samples?: readonly number[];
    }
  | { readonly type: "message"; readonly msg: ControlMessage }
  | { readonly type: "client_abort"; readonly rid: number }
  /** The transfer phase of the current attempt took too long: abort it, retry if attempts remain. */
  | { readonly type: "attempt_timeout"; readonly rid: number }
  /** A node's connection closed or its worker terminated. */
  | { readonly type: "peer_lost"; readonly role: "prefill" | "decode" }
  /** A node of the pair is connected (again, possibly a new incarnation): it hears the watermark. */
  | { readonly type: "peer_up"; readonly role: "prefill" | "decode" };

export function initialRouterState(): RouterState {
  return { requests: {}, stale: 0, next: 0, watermark: 0 };
}

/**
 * The effective context length: the longest prompt + max_tokens every stage can hold. Under the
 * `undersized-pool` fault the router trusts the model's window alone, as in the incident.
 */
export function effectiveContext(config: RouterConfig, safety: Safety): number {
  if (faultOn(safety, "undersized-pool")) return config.maxModelLen;
  return Math.min(config.maxModelLen, config.prefillPoolTokens, config.decodePoolTokens);
}

/** The admission error of every door, with both numbers and the fix. */
export function contextLengthError(promptLen: number, maxTokens: number, limit: number): WireError {
  return {
    code: "context_length_exceeded",
    message: `Prompt of ${promptLen} tokens plus max_tokens ${maxTokens} exceeds the context length: ${limit}; shorten the prompt or lower max_tokens`,
    param: "messages",
  };
}

export function routerStep(state: RouterState, event: RouterEvent, ctx: RouterContext): void {
  const start = ctx.out.length;
  step(state, event, ctx);
  // A request refused at the door touched no node: the watermark can wait for the next ending.
  if (event.type === "submit") return;
  for (let i = start; i < ctx.out.length; i++) {
    if (ctx.out[i]!.kind === "respond") {
      advanceWatermark(state, ctx);
      return;
    }
  }
}

/**
 * A request ended: the lowest rid still in flight (or the next one, with none) is the pair's
 * watermark; tell both nodes when it moved far enough (see `WATERMARK_STEP`).
 */
function advanceWatermark(state: RouterState, { config, out }: RouterContext): void {
  let low = state.next;
  let live = false;
  for (const key in state.requests) {
    const req = state.requests[key]!;
    if (req.phase === "done") continue;
    if (!live || ridBefore(req.rid, low)) low = req.rid;
    live = true;
  }
  if (low === 0 || low === state.watermark) return;
  if (state.watermark !== 0 && !ridBefore(state.watermark, low)) return;
  const step = config.watermarkStep ?? WATERMARK_STEP;
  // A router hands out the rids of its own slot only (`nextRidIn`): `step` counts those.
  if (live && (low - state.watermark) >>> 0 < step * ROUTER_SLOTS) return;
  state.watermark = low;
  sendWatermark(state, "decode", out);
  sendWatermark(state, "prefill", out);
}

function sendWatermark(state: RouterState, to: "prefill" | "decode", out: Effects): void {
  out.push({ kind: "send", to, msg: { type: "watermark", rid: 0, epoch: 0, below: state.watermark } });
}

function step(state: RouterState, event: RouterEvent, ctx: RouterContext): void {
  const { out } = ctx;
  switch (event.type) {
    case "submit":
      submit(state, event, ctx);
      return;
    case "message":
      onMessage(state, event.msg, ctx);
      return;
    case "client_abort":
      clientAbort(state, event.rid, out);
      return;
    case "attempt_timeout": {
      const req = state.requests[event.rid];
      if (
        req === undefined ||
        riding(state, req) ||
        (req.phase !== "reserving" && req.phase !== "prefilling")
      )
        return;
      abortAttempt(req, out);
      retryOrFail(
        state,
        req,
        {
          code: "transfer_failed",
          message: `The KV transfer of request ${req.rid} timed out: attempt ${req.epoch}`,
        },
        ctx,
      );
      return;
    }
    case "peer_up":
      // A new incarnation (or a new link) heard nothing the router sent before; no message of a
      // rid below the watermark will follow.
      if (state.watermark !== 0) sendWatermark(state, event.role, out);
      return;
    case "peer_lost":
      peerLost(state, event.role, ctx);
      return;
  }
}

/** The client went away: the attempt ends; a group's samples before the commit go with it (decode frees them with it). */
function clientAbort(state: RouterState, rid: number, out: Effects): void {
  const req = state.requests[rid];
  if (req === undefined || req.phase === "done") return;
  const error = { code: "aborted" as const, message: "The client closed the request" };
  const samples = req.phase === "decoding" ? [] : carried(state, req);
  abortAttempt(req, out);
  respondError(req, error, out);
  for (const sample of samples) respondError(sample, error, out);
}

/** A node of the pair is gone: every attempt that needs it ends, or is tried again. */
function peerLost(state: RouterState, role: "prefill" | "decode", ctx: RouterContext): void {
  for (const key in state.requests) {
    const req = state.requests[key]!;
    if (req.phase === "done") continue;
    // A decoding request no longer needs prefill: its KV is committed at decode.
    if (req.phase === "decoding" && role === "prefill") continue;
    // A sample its group's attempt still carries ends with it.
    if (riding(state, req)) continue;
    abortAttempt(req, ctx.out);
    retryOrFail(
      state,
      req,
      { code: "node_unavailable", message: `The ${role} node went away during request ${req.rid}` },
      ctx,
    );
  }
}

function submit(
  state: RouterState,
  event: Extract<RouterEvent, { type: "submit" }>,
  ctx: RouterContext,
): void {
  const { config, safety, out } = ctx;
  if (
    state.requests[event.rid] !== undefined ||
    (state.next !== 0 && ridBefore(event.rid, state.next)) ||
    (state.next !== 0 && routerSlotOf(event.rid) !== routerSlotOf(state.next)) ||
    event.rid === 0
  ) {
    // A rid reused, out of serial order or of another router's slot: the nodes may have forgotten it (below the watermark).
    state.stale++;
    return;
  }
  // A group's later samples: rids of the same slot, each after the one before.
  const samples = event.samples ?? [];
  let last = event.rid;
  for (const rid of samples) {
    if (
      state.requests[rid] !== undefined ||
      rid === 0 ||
      routerSlotOf(rid) !== routerSlotOf(event.rid) ||
      !ridBefore(last, rid)
    ) {
      state.stale++;
      return;
    }
    last = rid;
  }
  state.next = nextRidIn(last, routerSlotOf(last));
  const fresh = (rid: number): RouterRequest => ({
    rid,
    tenant: event.tenant,
    promptLen: event.promptLen,
    maxTokens: event.maxTokens,
    epoch: 1,
    phase: "reserving",
    streamed: 0,
  });
  const req: RouterRequest = {
    ...fresh(event.rid),
    ...(samples.length === 0 ? {} : { samples: [...samples] }),
  };
  state.requests[event.rid] = req;
  // Each later sample is a request of its own from the commit on; until then the group's attempt carries it.
  for (const rid of samples) state.requests[rid] = { ...fresh(rid), of: event.rid };
  const limit = effectiveContext(config, safety);
  if (event.promptLen + event.maxTokens > limit) {
    // Door 1: nothing allocated, no node contacted.
    const error = contextLengthError(event.promptLen, event.maxTokens, limit);
    respondError(req, error, out);
    for (const sample of carried(state, req)) respondError(sample, error, out);
    return;
  }
  sendReserve(req, out);
}

function onMessage(state: RouterState, msg: ControlMessage, ctx: RouterContext): void {
  const { out } = ctx;
  const req = state.requests[msg.rid];
  if (req === undefined || req.epoch !== msg.epoch || req.phase === "done") {
    state.stale++;
    return;
  }
  switch (msg.type) {
    case "lease":
      if (req.phase !== "reserving" || req.of !== undefined) break;
      req.phase = "prefilling";
      for (const sample of carried(state, req)) sample.phase = "prefilling";
      out.push({
        kind: "send",
        to: "prefill",
        msg: {
          type: "prefill",
          rid: req.rid,
          epoch: req.epoch,
          tenant: req.tenant,
          promptLen: req.promptLen,
          maxTokens: req.maxTokens,
          lease: msg,
        },
      });
      return;
    case "rejected":
      if (req.phase !== "reserving" && req.phase !== "prefilling") break;
      // Decode holds a reservation; it relays the abort so prefill acknowledges (it wrote nothing).
      if (msg.from === "prefill") abortAttempt(req, out);
      retryOrFail(state, req, msg.error, ctx);
      return;
    case "committed":
      if (req.phase !== "prefilling") break;
      req.phase = "decoding";
      req.streamed = 1;
      out.push({ kind: "tokens", rid: req.rid, epoch: req.epoch, tokens: [msg.firstToken] });
      return;
    case "tokens":
      if (req.phase !== "decoding") break;
      req.streamed += msg.tokens.length;
      out.push({ kind: "tokens", rid: req.rid, epoch: req.epoch, tokens: msg.tokens });
      return;
    case "finished":
      if (req.phase !== "decoding") break;
      req.streamed += msg.tokens.length;
      if (msg.tokens.length > 0)
        out.push({ kind: "tokens", rid: req.rid, epoch: req.epoch, tokens: msg.tokens });
      req.phase = "done";
      out.push({
        kind: "respond",
        rid: req.rid,
        epoch: req.epoch,
        status: 200,
        error: null,
        finishReason: msg.reason,
      });
      return;
    case "failed":
      if (req.phase === "decoding") {
        // Tokens already streamed: the error ends the stream, no retry.
        respondError(req, msg.error, out);
        return;
      }
      if (req.phase !== "prefilling") break;
      retryOrFail(state, req, msg.error, ctx);
      return;
    default:
      break;
  }
  state.stale++;
}

function sendReserve(req: RouterRequest, out: Effects): void {
  out.push({
    kind: "send",
    to: "decode",
    msg: {
      type: "reserve",
      rid: req.rid,
      epoch: req.epoch,
      tenant: req.tenant,
      promptLen: req.promptLen,
      maxTokens: req.maxTokens,
      ...(req.samples === undefined ? {} : { samples: req.samples }),
    },
  });
}

/**
 * Whether `req` is a later sample its group's attempt still carries (the group before its commit):
 * the group's fate is its own. A sample whose group ended or committed is a request on its own,
 * even before its own `committed` arrives.
 */
function riding(state: RouterState, req: RouterRequest): boolean {
  if (req.of === undefined || req.phase === "decoding") return false;
  const group = state.requests[req.of];
  return group !== undefined && (group.phase === "reserving" || group.phase === "prefilling");
}

/** The later samples of group `req` still riding on its attempt (before the commit forks them). */
function carried(state: RouterState, req: RouterRequest): RouterRequest[] {
  const out: RouterRequest[] = [];
  for (const rid of req.samples ?? []) {
    const sample = state.requests[rid];
    if (sample !== undefined && (sample.phase === "reserving" || sample.phase === "prefilling"))
      out.push(sample);
  }
  return out;
}

/**
 * ABORT goes to decode, which holds the reservation; decode relays it to prefill whenever it
 * quarantines pages, because it is the one that needs prefill's ABORT_ACK. (A router-to-prefill
 * abort cannot be relied on: a prefill restart between it and decode's reservation loses it, and
 * decode would wait for an ack forever — `kvfence check` found exactly that.)
 */
function abortAttempt(req: RouterRequest, out: Effects): void {
  out.push({ kind: "send", to: "decode", msg: { type: "abort", rid: req.rid, epoch: req.epoch } });
}

function retryOrFail(
  state: RouterState,
  req: RouterRequest,
  error: WireError,
  { config, out }: RouterContext,
): void {
  if (req.samples !== undefined || req.of !== undefined) {
    // A group of samples is not retried: the attempt ends for every sample it still carries.
    respondError(req, error, out);
    for (const rid of req.samples ?? []) {
      const sample = state.requests[rid];
      if (sample !== undefined && sample.phase !== "done" && sample.phase !== "decoding")
        respondError(sample, error, out);
    }
    return;
  }
  if (ERROR_TABLE[error.code].retryable && req.epoch < config.maxAttempts && req.streamed === 0) {
    req.epoch++;
    req.phase = "reserving";
    sendReserve(req, out);
    return;
  }
  respondError(req, error, out);
}

function respondError(req: RouterRequest, error: WireError, out: Effects): void {
  req.phase = "done";
  out.push({
    kind: "respond",
    rid: req.rid,
    epoch: req.epoch,
    status: ERROR_TABLE[error.code].status,
    error,
    finishReason: null,
  });
}
