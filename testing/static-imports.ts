/**
 * What a compiled module loads as it starts: its static imports (not `import type`, not
 * `import()`), followed through our compiled modules (packages are named, not entered). For the
 * tests that keep a thread's start-up path free of modules it never uses.
 */
import { readFileSync } from "node:fs";
import { dirname, resolve } from "node:path";

/** Every module `entry` imports statically, transitively: file paths and package names, each with the file that imports it. */
export function staticImports(entry: string): Map<string, string> {
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

/** How `graph` (from `staticImports`) reaches `module`: the chain of importers, entry first. */
export function importChain(graph: ReadonlyMap<string, string>, module: string): string {
  const chain = [module];
  for (let f = graph.get(module); f !== undefined && f !== ""; f = graph.get(f)) chain.push(f);
  return chain.reverse().join(" -> ");
}
