/**
 * What a node worker thread loads as it starts (its static imports, followed through the compiled
 * modules): the start-up path of `kvfence serve`'s prefill and decode threads. The packages only
 * the router uses — the metrics renderer, the request schemas, the tokenizer and chat template,
 * the GGUF reader — stay out, so each thread starts without compiling them.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { importChain, staticImports } from "../../testing/static-imports.js";

const ROUTER_ONLY = [
  "prom-client",
  "zod",
  "@huggingface/tokenizers",
  "@huggingface/jinja",
  "@huggingface/gguf",
];

test("a node worker thread's static imports load none of the router-only packages", () => {
  const entry = fileURLToPath(new URL("./node-worker.js", import.meta.url));
  const graph = staticImports(entry);
  assert.ok(graph.size > 20, `the walk found the worker's modules: ${graph.size}`);
  for (const pkg of ROUTER_ONLY) {
    const hit = [...graph.keys()].find((k) => k === pkg || k.startsWith(`${pkg}/`));
    if (hit !== undefined) assert.fail(`${pkg} is loaded by: ${importChain(graph, hit)}`);
  }
});
