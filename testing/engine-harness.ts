/**
 * Helpers for engine tests: an in-thread `Engine` over a small seeded random model, requests, and a
 * recorder of each request's events that also notices events arriving after the request ended.
 */
import { Engine, type EngineOptions } from "../src/engine/engine.js";
import { PagePool } from "../src/kvcache/page-pool.js";
import type { WireError } from "../src/lib/errors.js";
import { ForwardPass } from "../src/model/forward.js";
import type { ModelConfig, ModelWeights } from "../src/model/model-config.js";
import type { GenerationEvents, GenerationRequest } from "../src/protocol/engine-api.js";
import { GREEDY_SAMPLING, type SamplingParams } from "../src/protocol/sampling-params.js";
import { randomModel } from "./random-model.js";

export interface TestEngineOptions extends EngineOptions {
  readonly numPages?: number;
  readonly pageSize?: number;
  readonly maxBatchTokens?: number;
  readonly maxSequences?: number;
  readonly model?: { config: ModelConfig; weights: ModelWeights };
}

let cached: { config: ModelConfig; weights: ModelWeights } | undefined;

/** The shared small test model (2 layers, hidden 48, vocab 64, window 256). */
export function testModel(): { config: ModelConfig; weights: ModelWeights } {
  cached ??= randomModel({ seed: 11, vocabSize: 64, maxPositionEmbeddings: 256 });
  return cached;
}

export function makeEngine(options: TestEngineOptions = {}): Engine {
  const { config, weights } = options.model ?? testModel();
  const layout = {
    numLayers: config.numLayers,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    pageSize: options.pageSize ?? 4,
  };
  const forward = new ForwardPass(config, weights, layout, {
    maxBatchTokens: options.maxBatchTokens ?? 64,
    maxSequences: options.maxSequences ?? 8,
  });
  const pool = new PagePool(layout, options.numPages ?? 64);
  return new Engine(forward, pool, options);
}

export function request(
  rid: number,
  prompt: readonly number[],
  maxTokens: number,
  extra: Partial<GenerationRequest> = {},
): GenerationRequest {
  return {
    rid,
    tenant: 0,
    promptTokens: Int32Array.from(prompt),
    maxTokens,
    sampling: GREEDY_SAMPLING,
    ...extra,
  };
}

/** A request's `sampling` field: greedy, with `params` over it (for `request`'s `extra`). */
export function withSampling(params: Partial<SamplingParams>): { sampling: SamplingParams } {
  return { sampling: { ...GREEDY_SAMPLING, ...params } };
}

/** A deterministic prompt of `length` token ids below `vocab`. */
export function prompt(length: number, salt: number, vocab = 64): number[] {
  return Array.from({ length }, (_, i) => (i * 7 + salt * 13 + ((i * salt) % 5)) % vocab);
}

export interface Outcome {
  tokens: number[];
  finish: "stop" | "length" | null;
  usage: { promptTokens: number; completionTokens: number } | null;
  error: WireError | null;
  /** Events that arrived after onFinish/onError (must stay 0). */
  lateEvents: number;
}

export function recorder(): { events: GenerationEvents; outcome: Outcome } {
  const outcome: Outcome = { tokens: [], finish: null, usage: null, error: null, lateEvents: 0 };
  const ended = () => outcome.finish !== null || outcome.error !== null;
  const events: GenerationEvents = {
    onTokens(ids) {
      if (ended()) outcome.lateEvents++;
      outcome.tokens.push(...ids);
    },
    onFinish(reason, usage) {
      if (ended()) outcome.lateEvents++;
      outcome.finish = reason;
      outcome.usage = usage;
    },
    onError(error) {
      if (ended()) outcome.lateEvents++;
      outcome.error = error;
    },
  };
  return { events, outcome };
}

/** Submits every request, steps the engine until idle, and returns each request's outcome. */
export function runAll(
  engine: Engine,
  requests: readonly GenerationRequest[],
  maxSteps = 100_000,
): Outcome[] {
  const outcomes = requests.map((r) => {
    const { events, outcome } = recorder();
    engine.submit(r, events);
    return outcome;
  });
  runUntilIdle(engine, maxSteps);
  return outcomes;
}

/** Steps until the engine is idle; throws after `maxSteps` (a scheduler that stalls). */
export function runUntilIdle(engine: Engine, maxSteps = 100_000): number {
  let steps = 0;
  while (engine.step()) {
    if (++steps > maxSteps) throw new Error(`Engine still busy after ${maxSteps} steps`);
  }
  return steps;
}

/** Steps `engine` one step per event-loop turn until it is idle (as the step loop does: a grammar thread's answers arrive between steps). */
export async function stepUntilIdle(engine: Engine, maxSteps = 1_000_000): Promise<number> {
  let steps = 0;
  while (engine.step()) {
    if (++steps > maxSteps) throw new Error(`Engine still busy after ${maxSteps} steps`);
    await new Promise((resolve) => setImmediate(resolve));
  }
  return steps;
}
