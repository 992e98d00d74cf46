/**
 * The grammar thread's body (grammar-thread.ts): loads the model's tokenizer and xgrammar, then
 * answers its engine's messages in order — `bind` compiles a sequence's constraint (its tenant's
 * cache first), makes its matcher, accepts the tokens it already has, writes its first mask into
 * the sequence's shared slot and answers; `accept` advances a matcher and writes its next mask
 * (then sets the slot's state and wakes the step thread); `free` deletes a matcher.
 */
import { parentPort, workerData } from "node:worker_threads";
import { openTokenizer } from "../tokenizer/tokenizer.js";
import { type ConstraintMatcher, GrammarEngine, wireOf } from "./grammar-engine.js";
import {
  type FromGrammarThread,
  type GrammarThreadData,
  SLOT_READY,
  type ToGrammarThread,
} from "./grammar-thread.js";
import { grammarVocab } from "./grammar-vocab.js";

const data = workerData as GrammarThreadData;
const port = parentPort!;

/** A bound sequence: its matcher and its slot (a state word, then its bitmask). */
interface Bound {
  readonly matcher: ConstraintMatcher;
  readonly state: Int32Array;
  readonly bitmask: Int32Array;
}

const engine = openTokenizer(data.tokenizerPath).then(({ tokenizer }) =>
  GrammarEngine.create(grammarVocab(tokenizer), data.vocabSize),
);
// Keeps a failed load from being an unhandled rejection before the first message.
engine.catch(() => {});
const bound = new Map<number, Bound>();

/** Writes `b`'s next mask (none once its grammar is complete) and wakes the step thread. */
function publish(b: Bound): void {
  if (!b.matcher.terminated) b.matcher.writeMask(b.bitmask);
  Atomics.store(b.state, 0, SLOT_READY);
  Atomics.notify(b.state, 0);
}

function handle(grammar: GrammarEngine, message: ToGrammarThread): void {
  switch (message.type) {
    case "bind": {
      let b: Bound;
      try {
        const matcher = grammar.matcher(message.tenant, message.constraint, message.stopTokenIds);
        for (const token of message.accepted) matcher.accept(token);
        b = { matcher, state: new Int32Array(message.slot, 0, 1), bitmask: new Int32Array(message.slot, 4) };
      } catch (err) {
        port.postMessage({ id: message.id, error: wireOf(err) } satisfies FromGrammarThread);
        return;
      }
      bound.set(message.id, b);
      publish(b);
      port.postMessage({ id: message.id } satisfies FromGrammarThread);
      return;
    }
    case "accept": {
      const b = bound.get(message.id);
      if (b === undefined) return;
      b.matcher.accept(message.token);
      publish(b);
      return;
    }
    case "free":
      bound.get(message.id)?.matcher.dispose();
      bound.delete(message.id);
      return;
  }
}

port.on("message", (message: ToGrammarThread) => {
  // Every message waits for the same load, so they are handled in the order they came.
  engine.then(
    (grammar) => handle(grammar, message),
    (err: unknown) => {
      if (message.type === "bind")
        port.postMessage({ id: message.id, error: wireOf(err) } satisfies FromGrammarThread);
    },
  );
});
