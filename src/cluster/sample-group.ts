/**
 * n > 1 at the router as one group (vLLM's `ParentRequest`): a request's first sample carries its
 * later samples, the riders, on one attempt — one reserve naming them, one prefill, one transfer;
 * decode forks them at the commit (docs/protocol.md §3, item 13).
 *
 * The HTTP layer submits each sample as a request of its own, the first naming the others' rids
 * (`GenerationRequest.samples`), each other one its first's (`sample.of`). `SampleGroups` gathers
 * them as they come; the complete group then waits, dispatches and retries as one: it reserves
 * every sample's pages at once (the prompt's full pages once), the riders not aborted meanwhile
 * take the rids after the first's, their seeds ride in the first's sampling parameters, and each
 * sample's tokens and end reach its own events under its own rid. A group too large for a decode
 * pool splits: each sample goes alone, with its own prefill.
 */

import { decodeGroupPages } from "../protocol/decode-machine.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import type { SamplingParams } from "../protocol/sampling-params.js";

/** What a group needs of each of its samples (the router's record of one request). */
export interface GroupSample<S extends GroupSample<S>> {
  readonly request: GenerationRequest;
  /** The rid of its current attempt. */
  rid: number;
  /** Aborted: it gets no more events. */
  silenced: boolean;
  /** Its group (the first sample's too), or null: alone. */
  group: SampleGroup<S> | null;
}

export class SampleGroup<S extends GroupSample<S>> {
  readonly first: S;
  /** The later samples, as they were submitted (one aborted while the group waits stays until its dispatch). */
  riders: S[] = [];
  /** Later samples not submitted yet. */
  #awaiting: number;

  constructor(first: S) {
    this.first = first;
    this.#awaiting = first.request.samples?.length ?? 0;
    first.group = this;
  }

  /** The samples it runs (its share of the tenant's cap). */
  get size(): number {
    return 1 + this.riders.length;
  }

  /** Later sample `rider` was submitted: it rides on the first's attempt. True once all are here. */
  join(rider: S): boolean {
    rider.group = this;
    this.riders.push(rider);
    return --this.#awaiting === 0;
  }

  /** What its attempt reserves on decode: every sample's pages, the prompt's full pages once. */
  decodePages(pageSize: number): number {
    const { promptTokens, maxTokens } = this.first.request;
    return decodeGroupPages(promptTokens.length, maxTokens, pageSize, this.size);
  }

  /** The group ends: every sample goes on alone. Returns the riders. */
  split(): S[] {
    const riders = this.riders;
    this.riders = [];
    this.first.group = null;
    for (const r of riders) r.group = null;
    return riders;
  }

  /** An attempt goes out: the riders aborted while the group waited stay behind; the others go. */
  board(): readonly S[] {
    this.riders = this.riders.filter((r) => !r.silenced);
    return this.riders;
  }

  /** The first sample's sampling parameters for its attempt: `base` with each rider's seed, in order. */
  sampling(base: SamplingParams): SamplingParams {
    return { ...base, sampleSeeds: this.riders.map((r) => r.request.sampling.seed) };
  }

  /** The riders' rids, in order (the machine's `submit` names them). */
  rids(): number[] {
    return this.riders.map((r) => r.rid);
  }
}

/** Whether `s` is a later sample riding on its group's first sample. */
export function isRider<S extends GroupSample<S>>(s: S): boolean {
  return s.group !== null && s.group.first !== s;
}

/** `s` and, when it is a group's first sample, its riders: every sample its attempt answers for. */
export function withRiders<S extends GroupSample<S>>(s: S): readonly S[] {
  return s.group !== null && s.group.first === s ? [s, ...s.group.riders] : [s];
}

/** The groups whose first sample came and whose riders are still coming, by the first's rid. */
export class SampleGroups<S extends GroupSample<S>> {
  readonly #assembling = new Map<number, SampleGroup<S>>();

  /**
   * Sample `s` was submitted: what is ready to queue now — `s` alone, or the first sample of the
   * group it completes — or null while its group is still being assembled.
   */
  add(s: S): S | null {
    const of = s.request.sample?.of;
    const group = of === undefined ? undefined : this.#assembling.get(of);
    if (group !== undefined) {
      if (!group.join(s)) return null;
      this.#assembling.delete(group.first.request.rid);
      return group.first;
    }
    if ((s.request.samples?.length ?? 0) === 0) return s;
    this.#assembling.set(s.request.rid, new SampleGroup(s));
    return null;
  }
}
