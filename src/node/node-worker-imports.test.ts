/**
 * What a node worker thread loads as it starts (its static imports, followed through the compiled
 * modules): the start-up path of `kvfence serve`'s prefill and decode threads. The packages only
 * the router uses — the metrics renderer, the request schemas, the tokenizer and chat template,
 * the GGUF reader — stay out, so each thread starts without compiling them.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const ROUTER_ONLY = [
  "prom-client",
  "zod",
  "@huggingface/tokenizers",
  "@huggingface/jinja",
  "@huggingface/gguf",
];

/** Every module `entry` imports statically (not `import type`, not `import()`), transitively: file paths and package names. */
function staticImports(entry: string): Map<string, string> {
  const from = new Map<string, string>([[entry, ""]]);
  const queue = [entry];
  while (queue.length > 0) {
    const file = queue.shift()!;
    const text = readFileSync(file, "utf8");
    for (const m of text.matchAll(/^(?:import|export)\s+(?!type\s)(?:[^;]*?\sfrom\s+)?"([^"]+)";/gm)) {
      const spec = m[1]!;
      const target = spec.startsWith(".") ? resolve(dirname(file), spec) : spec;
      if (from.has(target)) continue;
      from.set(target, file);
      if (target.startsWith("/")) queue.push(target);
    }
  }
  return from;
}

test("a node worker thread's static imports load none of the router-only packages", () => {
  const entry = fileURLToPath(new URL("./node-worker.js", import.meta.url));
  const graph = staticImports(entry);
  assert.ok(graph.size > 20, `the walk found the worker's modules: ${graph.size}`);
  for (const pkg of ROUTER_ONLY) {
    const hit = [...graph.keys()].find((k) => k === pkg || k.startsWith(`${pkg}/`));
    if (hit === undefined) continue;
    const chain = [hit];
    for (let f = graph.get(hit); f !== undefined && f !== ""; f = graph.get(f)) chain.push(f);
    assert.fail(`${pkg} is loaded by: ${chain.reverse().join(" -> ")}`);
  }
});
