/**
 * For the grammar tests (src/grammar/): whether xgrammar accepts a text under an EBNF grammar
 * (xgrammar as the judge of grammars kvfence writes). Their random cases come from a seeded
 * `Prng` (src/lib/prng.ts), so that a failure names a reproducible case.
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
