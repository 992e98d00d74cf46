/**
 * Explicit-state breadth-first search over `ModelWorld`. Visited states are kept as 53-bit
 * fingerprints of their canonical JSON (hash compaction, as SPIN's bitstate and TLC's fingerprints
 * do: a collision could only hide a state, never invent a violation; at a million states the chance
 * of any collision is about 1e-4). Each state keeps its parent and the index of the event that
 * reached it, so a counterexample is rebuilt by replaying events from the initial world — and
 * because the search is breadth-first, the first violation found has a shortest trace.
 */
import type { ModelWorld } from "./model-world.js";
import type { EnvEvent, Violation, World } from "./world-state.js";

export interface ExploreOptions {
  /** Stop (incomplete) after this many distinct states. */
  readonly maxStates: number;
  /** Stop expanding at this depth (incomplete if anything was cut). */
  readonly maxDepth?: number;
  /** Wall-clock budget in milliseconds; stops incomplete when exceeded. */
  readonly timeLimitMs?: number;
}

export interface TraceStep {
  readonly event: string;
  /** Both pools after the event. */
  readonly pools: string;
}

export interface Counterexample {
  readonly violation: Violation;
  readonly initialPools: string;
  readonly steps: readonly TraceStep[];
}

export interface ExploreResult {
  readonly states: number;
  readonly transitions: number;
  readonly depth: number;
  readonly elapsedMs: number;
  /** True when every reachable state within the bounds was explored. */
  readonly complete: boolean;
  readonly counterexample: Counterexample | null;
}

/** cyrb53: a fast 53-bit string hash. */
function fingerprint(s: string): number {
  let h1 = 0xdeadbeef;
  let h2 = 0x41c6ce57;
  for (let i = 0; i < s.length; i++) {
    const ch = s.charCodeAt(i);
    h1 = Math.imul(h1 ^ ch, 2654435761);
    h2 = Math.imul(h2 ^ ch, 1597334677);
  }
  h1 = Math.imul(h1 ^ (h1 >>> 16), 2246822507) ^ Math.imul(h2 ^ (h2 >>> 13), 3266489909);
  h2 = Math.imul(h2 ^ (h2 >>> 16), 2246822507) ^ Math.imul(h1 ^ (h1 >>> 13), 3266489909);
  return 4294967296 * (2097151 & h2) + (h1 >>> 0);
}

class GrowableInt32 {
  data = new Int32Array(1 << 16);
  push(index: number, value: number): void {
    if (index >= this.data.length) {
      const next = new Int32Array(this.data.length * 2);
      next.set(this.data);
      this.data = next;
    }
    this.data[index] = value;
  }
}

/** The next level of the search: its worlds and their state ids, in the same order. */
interface Level {
  readonly worlds: World[];
  readonly ids: number[];
}

/** The visited states (by fingerprint), each with its parent and the event that reached it. */
class Search {
  readonly visited = new Map<number, number>();
  readonly #parent = new GrowableInt32();
  readonly #via = new GrowableInt32();
  readonly #model: ModelWorld;
  readonly #maxStates: number;
  transitions = 0;

  /** The search from world `initial`, state 0. */
  constructor(model: ModelWorld, maxStates: number, initial: World) {
    this.#model = model;
    this.#maxStates = maxStates;
    const initialKey = model.key(initial);
    this.visited.set(fingerprint(initialKey), 0);
    this.#parent.push(0, -1);
    this.#via.push(0, -1);
  }

  /**
   * Every successor of state `id` (world `base`, which the last successor takes over): a new state
   * joins `next`. A counterexample when one breaks an invariant (or `base` is stuck), "full" when
   * the state budget ran out, else null.
   */
  expand(base: World, id: number, next: Level): Counterexample | "full" | null {
    const model = this.#model;
    const { events, progress } = model.enabled(base);
    if (progress === 0) {
      const stuck = model.checkQuiescent(base);
      if (stuck !== null) return this.#trace(id, null, stuck);
    }
    for (let e = 0; e < events.length; e++) {
      const w = e === events.length - 1 ? base : model.clone(base);
      const violations = model.apply(w, events[e]!);
      this.transitions++;
      if (violations.length > 0) return this.#trace(id, e, violations[0]!);
      const h = fingerprint(model.key(w));
      if (this.visited.has(h)) continue;
      const nid = this.visited.size;
      this.visited.set(h, nid);
      this.#parent.push(nid, id);
      this.#via.push(nid, e);
      next.worlds.push(w);
      next.ids.push(nid);
      if (this.visited.size >= this.#maxStates) return "full";
    }
    return null;
  }

  /** Replays the path to state `id` (then event `lastEvent`, if any) into a readable trace. */
  #trace(id: number, lastEvent: number | null, violation: Violation): Counterexample {
    const model = this.#model;
    const parent = this.#parent.data;
    const via = this.#via.data;
    const path: number[] = [];
    for (let at = id; at > 0; at = parent[at]!) path.push(via[at]!);
    path.reverse();
    if (lastEvent !== null) path.push(lastEvent);
    let w = model.initial();
    const initialPools = model.describePools(w);
    const steps: TraceStep[] = [];
    for (const index of path) {
      const { events } = model.enabled(w);
      const event: EnvEvent = events[index]!;
      const label = model.describeEvent(w, event);
      w = model.clone(w);
      model.apply(w, event);
      steps.push({ event: label, pools: model.describePools(w) });
    }
    return { violation, initialPools, steps };
  }
}

export function explore(model: ModelWorld, options: ExploreOptions): ExploreResult {
  const started = performance.now();
  const initial = model.initial();
  const search = new Search(model, options.maxStates, initial);
  // The frontier holds worlds as objects (a level is at most tens of thousands wide here), so a
  // state is parsed never and cloned once per successor.
  let frontier: (World | undefined)[] = [initial];
  let frontierIds: number[] = [0];
  let depth = 0;
  let complete = true;
  const maxDepth = options.maxDepth ?? Number.POSITIVE_INFINITY;
  const timeLimit = options.timeLimitMs ?? Number.POSITIVE_INFINITY;

  const result = (counterexample: Counterexample | null): ExploreResult => ({
    states: search.visited.size,
    transitions: search.transitions,
    depth,
    elapsedMs: performance.now() - started,
    complete: complete && counterexample === null,
    counterexample,
  });

  while (frontier.length > 0) {
    if (depth >= maxDepth) {
      complete = false;
      break;
    }
    const next: Level = { worlds: [], ids: [] };
    for (let f = 0; f < frontier.length; f++) {
      const base = frontier[f]!;
      frontier[f] = undefined;
      const outcome = search.expand(base, frontierIds[f]!, next);
      if (outcome === "full") {
        complete = false;
        depth++;
        return result(null);
      }
      if (outcome !== null) return result(outcome);
      if ((f & 255) === 0 && performance.now() - started > timeLimit) {
        complete = false;
        return result(null);
      }
    }
    frontier = next.worlds;
    frontierIds = next.ids;
    if (next.worlds.length > 0) depth++;
  }
  return result(null);
}
