/**
 * An engine's grammar thread: a worker thread, started on the engine's first constrained request,
 * that owns xgrammar, the per-tenant cache of compiled grammars and every matcher of that engine
 * (grammar-thread-worker.ts). Compiled grammars and matchers live in one wasm instance and cannot
 * move between threads, so everything grammatical happens there and the engine's step thread never
 * compiles: a schema that takes a second to compile delays no other request's step.
 *
 * - Binding a sequence (`bind`) is a message: the thread compiles (or takes from the tenant's
 *   cache), makes the matcher, accepts the tokens the sequence already has and computes its first
 *   mask, then answers; the engine keeps the sequence out of the batch meanwhile. A refusal
 *   rejects with `invalid_request`.
 * - Each step is synchronous and cheap on the step thread: each constrained sequence has a slot of
 *   shared memory (a state word, then ceil(vocab / 32) words of bitmask). `accept(token)` clears the
 *   state and posts the token; the thread accepts it, writes the next mask and sets the state
 *   (`Atomics.notify`). `mask(logits)` waits for that state (a short spin, then `Atomics.wait`) and
 *   applies the mask with `maskLogits`: the mask is computed beside the next forward pass. A mask
 *   waits behind a compile in progress on the thread (docs/structured-output.md); an unconstrained
 *   sequence never touches the thread.
 * - `dispose` (the sequence's end) frees its matcher; `close` (the engine's end) terminates the thread.
 */
import { Worker } from "node:worker_threads";
import { KvfenceError, type WireError } from "../lib/errors.js";
import type { OutputConstraint } from "../protocol/output-constraint.js";
import { type GrammarSource, maskLogits, type SequenceGrammar } from "./grammar-engine.js";

const WORKER_URL = new URL("./grammar-thread-worker.js", import.meta.url);

/** A slot's state word: the mask is being computed, or ready to apply. */
export const SLOT_PENDING = 0;
export const SLOT_READY = 1;

/** Spins on a slot's state before sleeping in `Atomics.wait` (a mask usually lands within the forward pass). */
const SPIN_CHECKS = 2_000;
/** How long a step waits for one mask before it fails (the grammar thread is stuck or gone). */
export const MASK_WAIT_MS = 60_000;

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

export class GrammarThread implements GrammarSource {
  readonly #data: GrammarThreadData;
  #worker: Worker | null = null;
  #nextId = 1;
  readonly #pending = new Map<number, { resolve: () => void; reject: (err: unknown) => void }>();

  constructor(data: GrammarThreadData) {
    this.#data = data;
  }

  bind(
    tenant: number,
    constraint: OutputConstraint,
    stopTokenIds: readonly number[],
    accepted: readonly number[],
  ): Promise<SequenceGrammar> {
    const worker = this.#start();
    const id = this.#nextId++;
    const words = Math.ceil(this.#data.vocabSize / 32);
    const slot = new SharedArrayBuffer(4 * (1 + words));
    const message: ToGrammarThread = { type: "bind", id, tenant, constraint, stopTokenIds, accepted, slot };
    return new Promise((resolve, reject) => {
      this.#pending.set(id, {
        resolve: () => resolve(new ThreadMatcher(worker, id, slot, this.#data.vocabSize)),
        reject,
      });
      worker.postMessage(message);
    });
  }

  close(): void {
    this.#worker?.terminate();
    this.#worker = null;
  }

  #start(): Worker {
    if (this.#worker !== null) return this.#worker;
    const worker = new Worker(WORKER_URL, { workerData: this.#data });
    // It never keeps the process alive; its engine's end terminates it.
    worker.unref();
    worker.on("message", (answer: FromGrammarThread) => {
      const waiter = this.#pending.get(answer.id);
      if (waiter === undefined) return;
      this.#pending.delete(answer.id);
      if (answer.error === undefined) waiter.resolve();
      else waiter.reject(KvfenceError.fromWire(answer.error));
    });
    const fail = (reason: string): void => {
      if (this.#worker === worker) this.#worker = null;
      for (const [id, waiter] of this.#pending) {
        this.#pending.delete(id);
        waiter.reject(new KvfenceError("internal", `The grammar thread ended: ${reason}`));
      }
    };
    worker.on("error", (err) => fail(err.message));
    worker.on("exit", (code) => fail(`exit code ${code}`));
    this.#worker = worker;
    return worker;
  }
}

/** A sequence's matcher on the grammar thread, seen through its shared slot. */
class ThreadMatcher implements SequenceGrammar {
  readonly #worker: Worker;
  readonly #id: number;
  readonly #state: Int32Array;
  readonly #bitmask: Int32Array;
  readonly #vocabSize: number;
  #disposed = false;

  constructor(worker: Worker, id: number, slot: SharedArrayBuffer, vocabSize: number) {
    this.#worker = worker;
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
  }
}
