/**
 * Each tenant's share of an engine step's compute: deficit round robin over the estimated cost of
 * the tokens each tenant adds to a step (`StepCost`: the matrices plus attention over the context).
 *
 * A tenant's recent service is the cost of the tokens it was served, decayed per step
 * (`SERVICE_DECAY`). A tenant served more lately than another tenant with work in the step may add
 * to it — decodes and prompt chunks alike — no more compute than the most that tenant has in it,
 * plus what it was owed and could not use in the steps before (`credit`: a token that costs more
 * than its share waits until its owed share covers it). So a flood's prompt chunks and
 * long-context decodes make another tenant's step cost at most about twice its own, and the flood
 * gets every step's rest. The tenant served least lately, and a tenant alone, are not held back:
 * with one tenant none of this binds.
 *
 * The scheduler (`scheduler.ts`) asks `chunk` how many of a request's tokens its tenant may add,
 * reports what it added with `served` (negative: taken back), and calls `beginStep` / `endStep`
 * around each step. Every account is a plain object made once per tenant, and a step's list of
 * tenants is a reused array: nothing here allocates per step.
 */
import type { StepCost } from "./step-cost.js";

/**
 * How much of a tenant's recent service one step forgets: its compute counts for about the last
 * 1 / (1 − SERVICE_DECAY) steps (a thousand: several requests' worth, so a light tenant stays
 * light across its own prompt's burst, and a tenant that went quiet is soon light again).
 */
const SERVICE_DECAY = 0.999;

/** A tenant's account: its recent service and its share of the current step. */
export interface TenantService {
  /** Its recent service: the estimated cost (`StepCost`) of its tokens, decayed per step, as of `step`. */
  value: number;
  step: number;
  /**
   * The cost of its work in step `costStep`; `costStep` is the current step when it has work in
   * it or was held back in it (then it is in the step's list of tenants).
   */
  stepCost: number;
  costStep: number;
  /** Compute it was owed at the end of step `creditStep` and did not use (deficit round robin). */
  credit: number;
  creditStep: number;
  /** It had more work than its share in step `heldStep`. */
  heldStep: number;
  /** The scheduler listed it in step `orderStep`, with recent service `orderRecent`. */
  orderStep: number;
  orderRecent: number;
}

export class TenantShares {
  readonly #cost: StepCost;
  /** Each tenant's account. */
  readonly #services = new Map<number, TenantService>();
  /** The accounts of the tenants with work in this step, or held back in it: the first `#stepTenantCount`. */
  readonly #stepTenants: TenantService[] = [];
  #stepTenantCount = 0;
  /** The current step's number, counted from 1 by `beginStep` (read-only outside: a plain field, no getter on the hot path). */
  step = 0;

  constructor(cost: StepCost) {
    this.#cost = cost;
  }

  beginStep(): void {
    this.step++;
  }

  /** The tenant's account (made on its first request). */
  serviceOf(tenant: number): TenantService {
    let service = this.#services.get(tenant);
    if (service === undefined) {
      service = {
        value: 0,
        step: this.step,
        stepCost: 0,
        costStep: -1,
        credit: 0,
        creditStep: -1,
        heldStep: -1,
        orderStep: -1,
        orderRecent: 0,
      };
      this.#services.set(tenant, service);
    }
    return service;
  }

  /**
   * How many of `n` tokens from position `computed` the tenant of `service` may add to this step
   * (see the header). A tenant held back is listed in the step so that it keeps what it is owed.
   */
  chunk(service: TenantService, computed: number, n: number): number {
    const allowance = this.#allowance(service);
    if (allowance === Number.POSITIVE_INFINITY) return n;
    const fit = Math.min(n, this.#cost.tokensWithin(computed, allowance));
    if (fit < n) {
      this.#touch(service);
      service.heldStep = this.step;
    }
    return fit;
  }

  /** A tenant's recent service as of this step (each step's worth decayed by `SERVICE_DECAY`). */
  recent(service: TenantService): number {
    const age = this.step - service.step;
    return age === 0 ? service.value : service.value * SERVICE_DECAY ** age;
  }

  /** The tenant of `service` is served tokens [start, start + n) in this step (negative n: taken back). */
  served(service: TenantService, start: number, n: number): void {
    this.#touch(service);
    const cost = n > 0 ? this.#cost.of(start, n) : -this.#cost.of(start, -n);
    service.value += cost;
    service.stepCost += cost;
  }

  /**
   * After the step: what each tenant held back was owed and did not use, it keeps for the next
   * step; a tenant that did all it wanted keeps nothing.
   */
  endStep(): void {
    for (let i = 0; i < this.#stepTenantCount; i++) {
      const t = this.#stepTenants[i]!;
      if (t.heldStep !== this.step) continue;
      t.credit = Math.max(0, this.#allowance(t));
      t.creditStep = this.step;
    }
    this.#stepTenantCount = 0;
  }

  /** The compute `service`'s tenant may still add to this step (Infinity: no bound). */
  #allowance(service: TenantService): number {
    const lighter = this.#lighterCost(service);
    if (lighter < 0) return Number.POSITIVE_INFINITY;
    const credit = service.creditStep === this.step - 1 ? service.credit : 0;
    const own = service.costStep === this.step ? service.stepCost : 0;
    return credit + lighter - own;
  }

  /** The most work in this step of a tenant served less lately than `service`'s; -1: none. */
  #lighterCost(service: TenantService): number {
    const mine = this.recent(service);
    let lighter = -1;
    for (let i = 0; i < this.#stepTenantCount; i++) {
      const t = this.#stepTenants[i]!;
      if (t !== service && t.stepCost > 0 && t.value < mine) lighter = Math.max(lighter, t.stepCost);
    }
    return lighter;
  }

  /** Lists `service`'s tenant in this step (its recent service brought up to date). */
  #touch(service: TenantService): void {
    if (service.costStep === this.step) return;
    // Decayed in place as `recent` decays it, not through it: V8 13's Maglev tier did not inline
    // `recent` here and boxed the double it returned, 16 bytes a step on Node 24.
    const age = this.step - service.step;
    if (age !== 0) service.value *= SERVICE_DECAY ** age;
    service.step = this.step;
    service.costStep = this.step;
    service.stepCost = 0;
    this.#stepTenants[this.#stepTenantCount++] = service;
  }
}
