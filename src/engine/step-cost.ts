/**
 * What a step's work costs, estimated from the model's shape: the multiply-adds of computing
 * tokens [start, start + n) of one sequence. The engine's scheduler uses it to share each step's
 * compute fairly between tenants (`src/engine/tenant-shares.ts`): on this CPU engine a step's time
 * grows with the work in it, so a tenant's prompt chunk that costs as much as a hundred decode
 * tokens makes another tenant's token wait as long as a hundred of its own steps. Counting tokens
 * alone is not enough: attention over a long context costs more per token than the matrices (the
 * tiny test model's decode at 1,600 positions costs twice one at 500).
 *
 * Per token: the layers' projections and MLP (`linear`), plus attention over every position up to
 * it (`attention` per position: the query's dot products and the weighted sum of values, all
 * heads, all layers). The LM head runs once per sequence per step at most and is left out. An
 * estimate, not a timing: deterministic, so the scheduler's choices are the same on any machine.
 */
import type { ModelConfig } from "../model/model-config.js";

export class StepCost {
  /** Multiply-adds per token of the projections and the MLP, all layers. */
  readonly linear: number;
  /** Multiply-adds per token per attended position, all heads and layers. */
  readonly attention: number;

  constructor(config: ModelConfig) {
    const q = config.numHeads * config.headDim;
    const kv = config.numKvHeads * config.headDim;
    const h = config.hiddenSize;
    this.linear = config.numLayers * (h * (2 * q + 2 * kv) + 3 * h * config.intermediateSize);
    this.attention = config.numLayers * 2 * q;
  }

  /** The cost of tokens [start, start + n): each attends to the positions up to and including its own. */
  of(start: number, n: number): number {
    return n * this.linear + this.attention * (n * start + (n * (n + 1)) / 2);
  }

  /** The most tokens from `start` whose cost is at most `budget` (0 when not even one fits). */
  tokensWithin(start: number, budget: number): number {
    if (budget === Number.POSITIVE_INFINITY) return Number.MAX_SAFE_INTEGER;
    if (!(budget > 0)) return 0;
    // a/2 n² + (linear + a (start + 1/2)) n ≤ budget, for n.
    const a = this.attention;
    const b = this.linear + a * (start + 0.5);
    let n = a === 0 ? Math.floor(budget / b) : Math.floor((-b + Math.sqrt(b * b + 2 * a * budget)) / a);
    // Floating point: step back while over, forward while the next one still fits.
    while (n > 0 && this.of(start, n) > budget) n--;
    while (this.of(start, n + 1) <= budget) n++;
    return n;
  }
}
