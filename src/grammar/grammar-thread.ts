/**
 * An engine's grammar threads: worker threads, the first started on the engine's first constrained
 * request, each owning its own xgrammar, per-tenant cache of compiled grammars and matchers
 * (grammar-thread-worker.ts). Compiled grammars and matchers live in one wasm instance and cannot
 * move between threads, so everything grammatical happens there and the engine's step thread never
 * compiles. A compile goes to a thread holding no matcher (`GrammarThreads`), so no running
 * sequence's mask waits behind it.
 *
 * - Binding a sequence (`bind`) is a message: the thread compiles (or takes from the tenant's
 *   cache), makes the matcher, accepts the tokens the sequence already has and computes its first
 *   mask, then answers; the engine keeps the sequence out of the batch meanwhile. A refusal
 *   rejects with `invalid_request`.
 * - Each step is synchronous and cheap on the step thread: each constrained sequence has a slot of
 *   shared memory (a state word, then ceil(vocab / 32) words of bitmask). `accept(token)` clears the
 *   state and posts the token; the thread accepts it, writes the next mask and sets the state
 *   (`Atomics.notify`). `mask(logits)` waits for that state (a short spin, then `Atomics.wait`) and
 *   applies the mask with `maskLogits`: the mask is computed beside the next forward pass. An
 *   unconstrained sequence never touches the threads.
 * - `dispose` (the sequence's end) frees its matcher; `close` (the engine's end) terminates the threads.
 */
import { Worker } from "node:worker_threads";
import { KvfenceError, type WireError } from "../lib/errors.js";
import type { OutputConstraint } from "../protocol/output-constraint.js";
import { TenantGrammarCache } from "./grammar-cache.js";
import { type GrammarSource, maskLogits, type SequenceGrammar } from "./grammar-engine.js";

const WORKER_URL = new URL("./grammar-thread-worker.js", import.meta.url);

/** A slot's state word: the mask is being computed, or ready to apply. */
export const SLOT_PENDING = 0;
export const SLOT_READY = 1;

/** Spins on a slot's state before sleeping in `Atomics.wait` (a mask usually lands within the forward pass). */
const SPIN_CHECKS = 2_000;
/** How long a step waits for one mask before it fails (the grammar thread is stuck or gone). */
export const MASK_WAIT_MS = 60_000;
/** Grammar threads an engine starts at most (each holds its own xgrammar and vocabulary). */
export const MAX_GRAMMAR_THREADS = 4;
/** How long a compile waits for a grammar thread without matchers before it takes the least loaded one. */
export const COMPILE_QUEUE_MS = 2_000;
/** Keys of compiled grammars remembered per thread (past it, forgotten: a hit compiles again elsewhere). */
const MAX_KEYS_KNOWN = 4096;

/** What the grammar thread is started with. */
export interface GrammarThreadData {
  readonly tokenizerPath: string;
  readonly vocabSize: number;
}

/** Messages to the grammar thread. */
export type ToGrammarThread =
  | {
      readonly type: "bind";
      readonly id: number;
      readonly tenant: number;
      readonly constraint: OutputConstraint;
      readonly stopTokenIds: readonly number[];
      readonly accepted: readonly number[];
      readonly slot: SharedArrayBuffer;
    }
  | { readonly type: "accept"; readonly id: number; readonly token: number }
  | { readonly type: "free"; readonly id: number };

/** The grammar thread's answer to a bind: its matcher is ready, or why it was refused. */
export interface FromGrammarThread {
  readonly id: number;
  readonly error?: WireError;
}

/** One grammar thread of an engine and what the engine knows of it. */
interface Lane {
  readonly worker: Worker;
  /** Its matchers not yet disposed. */
  live: number;
  /** Binds sent and not yet answered (any may be compiling). */
  binding: number;
  /** tenant + constraint keys it has compiled (its cache: `bind` sends a hit there). */
  readonly compiled: Set<string>;
}

/**
 * An engine's grammar threads. A constraint no thread has compiled for its tenant compiles on a
 * thread that holds no matcher and is answering no bind, started if none is (at most
 * `MAX_GRAMMAR_THREADS`), so no running sequence's mask ever waits behind a compile; a cache hit
 * goes to the thread that compiled it. With every thread holding matchers, a compile waits for one
 * to empty, at most `COMPILE_QUEUE_MS`, then goes to the one holding fewest (whose masks then wait
 * for it: docs/structured-output.md).
 */
export class GrammarThreads implements GrammarSource {
  readonly #data: GrammarThreadData;
  readonly #lanes: Lane[] = [];
  readonly #queue: { resolve: (lane: Lane) => void; timer: ReturnType<typeof setTimeout> }[] = [];
  #nextId = 1;
  #closed = false;
  readonly #pending = new Map<number, { resolve: () => void; reject: (err: unknown) => void }>();

  constructor(data: GrammarThreadData) {
    this.#data = data;
  }

  async bind(
    tenant: number,
    constraint: OutputConstraint,
    stopTokenIds: readonly number[],
    accepted: readonly number[],
  ): Promise<SequenceGrammar> {
    const key = `${tenant}:${TenantGrammarCache.key(constraint)}`;
    const lane = this.#lanes.find((l) => l.compiled.has(key)) ?? (await this.#freeLane());
    const id = this.#nextId++;
    const words = Math.ceil(this.#data.vocabSize / 32);
    const slot = new SharedArrayBuffer(4 * (1 + words));
    const message: ToGrammarThread = { type: "bind", id, tenant, constraint, stopTokenIds, accepted, slot };
    lane.binding++;
    try {
      await new Promise<void>((resolve, reject) => {
        this.#pending.set(id, { resolve, reject });
        lane.worker.postMessage(message);
      });
    } finally {
      lane.binding--;
      this.#wake();
    }
    if (lane.compiled.size >= MAX_KEYS_KNOWN) lane.compiled.clear();
    lane.compiled.add(key);
    lane.live++;
    return new ThreadMatcher(lane.worker, id, slot, this.#data.vocabSize, () => {
      lane.live--;
      this.#wake();
    });
  }

  close(): void {
    this.#closed = true;
    for (const { timer } of this.#queue.splice(0)) clearTimeout(timer);
    for (const lane of this.#lanes.splice(0)) void lane.worker.terminate();
  }

  /** Grammar threads started (tests). */
  get threads(): number {
    return this.#lanes.length;
  }

  /** A thread to compile on: an idle one, a new one, else the first to empty (or the least loaded, past the queue's wait). */
  #freeLane(): Promise<Lane> {
    const idle = this.#idle();
    if (idle !== undefined) return Promise.resolve(idle);
    if (this.#lanes.length < MAX_GRAMMAR_THREADS) return Promise.resolve(this.#start());
    return new Promise((resolve) => {
      const entry = {
        resolve,
        timer: setTimeout(() => {
          this.#queue.splice(this.#queue.indexOf(entry), 1);
          if (this.#closed) return;
          const lanes = this.#lanes;
          resolve(
            lanes.length === 0
              ? this.#start()
              : lanes.reduce((a, b) => (b.live + b.binding < a.live + a.binding ? b : a)),
          );
        }, COMPILE_QUEUE_MS),
      };
      this.#queue.push(entry);
    });
  }

  #idle(): Lane | undefined {
    return this.#lanes.find((l) => l.live === 0 && l.binding === 0);
  }

  /** A matcher ended: a compile waiting for a free thread takes it. */
  #wake(): void {
    const lane = this.#idle();
    const next = lane === undefined ? undefined : this.#queue.shift();
    if (lane === undefined || next === undefined) return;
    clearTimeout(next.timer);
    next.resolve(lane);
  }

  #start(): Lane {
    if (this.#closed) throw new KvfenceError("internal", "The engine's grammar threads are closed");
    const worker = new Worker(WORKER_URL, { workerData: this.#data });
    // It never keeps the process alive; its engine's end terminates it.
    worker.unref();
    const lane: Lane = { worker, live: 0, binding: 0, compiled: new Set() };
    worker.on("message", (answer: FromGrammarThread) => {
      const waiter = this.#pending.get(answer.id);
      if (waiter === undefined) return;
      this.#pending.delete(answer.id);
      if (answer.error === undefined) waiter.resolve();
      else waiter.reject(KvfenceError.fromWire(answer.error));
    });
    const fail = (reason: string): void => {
      const at = this.#lanes.indexOf(lane);
      if (at >= 0) this.#lanes.splice(at, 1);
      for (const [id, waiter] of this.#pending) {
        this.#pending.delete(id);
        waiter.reject(new KvfenceError("internal", `A grammar thread ended: ${reason}`));
      }
    };
    worker.on("error", (err) => fail(err.message));
    worker.on("exit", (code) => fail(`exit code ${code}`));
    this.#lanes.push(lane);
    return lane;
  }
}

/** A sequence's matcher on the grammar thread, seen through its shared slot. */
class ThreadMatcher implements SequenceGrammar {
  readonly #worker: Worker;
  readonly #id: number;
  readonly #state: Int32Array;
  readonly #bitmask: Int32Array;
  readonly #vocabSize: number;
  readonly #ended: () => void;
  #disposed = false;

  constructor(worker: Worker, id: number, slot: SharedArrayBuffer, vocabSize: number, ended: () => void) {
    this.#worker = worker;
    this.#ended = ended;
    this.#id = id;
    this.#state = new Int32Array(slot, 0, 1);
    this.#bitmask = new Int32Array(slot, 4);
    this.#vocabSize = vocabSize;
  }

  mask(logits: Float32Array): void {
    const state = this.#state;
    let spins = 0;
    while (Atomics.load(state, 0) !== SLOT_READY) {
      if (++spins < SPIN_CHECKS) continue;
      if (Atomics.wait(state, 0, SLOT_PENDING, MASK_WAIT_MS) === "timed-out") {
        throw new Error(`The grammar thread computed no mask within ${MASK_WAIT_MS} ms`);
      }
    }
    maskLogits(logits, this.#bitmask, this.#vocabSize);
  }

  accept(token: number): void {
    Atomics.store(this.#state, 0, SLOT_PENDING);
    this.#worker.postMessage({ type: "accept", id: this.#id, token } satisfies ToGrammarThread);
  }

  dispose(): void {
    if (this.#disposed) return;
    this.#disposed = true;
    this.#worker.postMessage({ type: "free", id: this.#id } satisfies ToGrammarThread);
    this.#ended();
  }
}
