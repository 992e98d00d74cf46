/**
 * For the grammar tests (src/grammar/): whether xgrammar accepts a text under an EBNF grammar
 * (xgrammar as the judge of grammars kvfence writes), and a seeded generator so that a failure
 * names a reproducible case.
 */
import { loadXgrammar } from "../src/grammar/xgrammar-binding.js";

/** Whether `ebnf` (start rule `root`) accepts the whole of `text`. */
export async function accepts(ebnf: string, text: string): Promise<boolean> {
  const xg = (await loadXgrammar()).api;
  const grammar = await xg.Grammar.fromEBNF(ebnf);
  try {
    return await xg.Testings.isGrammarAcceptString(grammar, text);
  } finally {
    grammar.dispose();
  }
}

/** A deterministic generator of numbers in [0, 1) (mulberry32). */
export function seededRandom(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
