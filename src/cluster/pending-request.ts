/**
 * One request as the router holds it, from `submit` to its end (vLLM's `Request`): the client's
 * request and events, its current attempt (the rid it goes out under, its pair, its prompt), what it reserves
 * by the router's ledger (`PairDemand`), its n > 1 group (`GroupSample`), and what the router
 * times and counts of it.
 */

import { decodeReservationPages } from "../protocol/decode-machine.js";
import type { GenerationEvents, GenerationRequest, GenerationUsage } from "../protocol/engine-api.js";
import type { SamplingParams } from "../protocol/sampling-params.js";
import type { NodePair, NodeSlot, PairDemand, PromptChain } from "./pair-pool.js";
import type { GroupSample, SampleGroup } from "./sample-group.js";

export interface PendingRequest extends PairDemand, GroupSample<PendingRequest> {
  /** The pair of the current attempt; null while it waits. */
  pair: NodePair | null;
  /** The rid of the current attempt: `request.rid`, or an internal one after waiting for pages. */
  rid: number;
  /** Dispatched at least once (a later attempt needs a fresh rid). */
  dispatched: boolean;
  /** The node of its pair that refused the attempt for want of pages, if one did. */
  refusedForPages: NodeSlot | null;
  readonly request: GenerationRequest;
  readonly events: GenerationEvents;
  /**
   * The prompt and `max_tokens` of its current attempt: its request's, or after a migration
   * mid-stream (migration.ts) the prompt followed by the output so far and what is left.
   */
  prompt: Int32Array;
  maxTokens: number;
  /** The output token ids that reached its client (a migration re-runs from them). */
  readonly output: number[];
  /** Times it migrated mid-stream to another pair (migration.ts). */
  migrations: number;
  /** The pair its last attempt ended on by a node's loss or failure (`PairDemand.avoid`). */
  avoid: NodePair | null;
  /** Its request's sampling, as is; a group's first sample's: with its riders' seeds, set at each dispatch. */
  sampling: SamplingParams;
  /**
   * What the attempt reserves: on decode (prompt + max_tokens; a group: every sample's, the full
   * prompt pages once) and on prefill (the prompt).
   */
  decodePages: number;
  prefillPages: number;
  /** The prefill node's pages still count in the ledger (until the commit). */
  prefillHeld: boolean;
  /** Prompt tokens the prefill node served from its prefix cache (null: it has none, or not told). */
  cachedTokens: number | null;
  /** The pair policy's key of its prompt (prefix affinity: its first full pages), or null. */
  readonly affinityKey: string | null;
  /** Its prompt's chain keys for routing by the nodes' caches, or null. */
  readonly chain: PromptChain | null;
  completionTokens: number;
  stopped: boolean;
  /** The stop token (EOS) that ended it, when known (SGLang's matched_stop). */
  stopTokenId: number | null;
  silenced: boolean;
  /** `performance.now()` at submit, at the last `reserve` sent (0: none), and whether a token reached the client (no retry on another pair after that). */
  readonly submittedAt: number;
  reserveSentAt: number;
  firstToken: boolean;
  /** `performance.now()` when tokens last reached the client (0: none yet). */
  lastTokenAt: number;
  /** Times it went back to the queue because its pair lost a node before its first token. */
  moved: number;
  /** n > 1 as one group (src/cluster/sample-group.ts), its first sample's or a rider's; null: alone. */
  group: SampleGroup<PendingRequest> | null;
}

/** A request just submitted: waiting, alone, nothing reserved, reached, timed or counted yet. */
export function pendingRequest(
  request: GenerationRequest,
  events: GenerationEvents,
  reservation: {
    readonly pageSize: number;
    readonly affinityKey: string | null;
    readonly chain?: PromptChain | null;
  },
): PendingRequest {
  const { pageSize, affinityKey } = reservation;
  return {
    pair: null,
    rid: request.rid,
    dispatched: false,
    refusedForPages: null,
    request,
    events,
    prompt: request.promptTokens,
    maxTokens: request.maxTokens,
    output: [],
    migrations: 0,
    avoid: null,
    sampling: request.sampling,
    decodePages: decodeReservationPages(request.promptTokens.length, request.maxTokens, pageSize),
    prefillPages: Math.ceil(request.promptTokens.length / pageSize),
    prefillHeld: false,
    cachedTokens: null,
    affinityKey,
    chain: reservation.chain ?? null,
    completionTokens: 0,
    stopTokenId: null,
    stopped: false,
    silenced: false,
    submittedAt: performance.now(),
    reserveSentAt: 0,
    firstToken: false,
    lastTokenAt: 0,
    moved: 0,
    group: null,
  };
}

/** The usage its client learns at its finish: its prompt (its first attempt's), its output, its migrations. */
export function usageOf(pending: PendingRequest): GenerationUsage {
  return {
    promptTokens: pending.request.promptTokens.length,
    completionTokens: pending.completionTokens,
    ...(pending.cachedTokens === null ? {} : { cachedTokens: pending.cachedTokens }),
    ...(pending.stopTokenId === null ? {} : { stopTokenId: pending.stopTokenId }),
    ...(pending.migrations === 0 ? {} : { migrations: pending.migrations }),
  };
}
