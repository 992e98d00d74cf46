/**
 * The import direction of STYLE.md, enforced: kernels ← model ← engine ← node; protocol ← transfer,
 * router, node; tools and cli on top. The router never touches weights or the forward pass (it
 * tokenizes only), and the probe imports only protocol wire types and lib helpers, so that it
 * works against any server.
 */
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { dirname, join, relative, resolve } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const SRC = join(ROOT, "src");

/** For each folder under src/, the src/ paths (folders or files) it may import. */
const ALLOWED: Record<string, readonly string[]> = {
  kernels: ["kernels"],
  lib: ["lib"],
  model: ["model", "kernels", "lib", "kvcache/kv-layout.ts"],
  kvcache: ["kvcache", "lib", "protocol/safety.ts"],
  protocol: ["protocol", "lib", "kvcache/ownership-table.ts", "kvcache/kv-layout.ts"],
  transfer: ["transfer", "protocol", "kvcache", "lib"],
  engine: ["engine", "model", "kvcache", "kernels", "protocol", "lib"],
  router: [
    "router",
    "protocol",
    "lib",
    "model/tokenizer.ts",
    "engine/engine-types.ts",
    "tools/preflight/capacity.ts",
  ],
  node: ["node", "engine", "model", "kvcache", "kernels", "protocol", "transfer", "lib"],
  "tools/probe": ["tools/probe", "protocol", "lib"],
};

function sourceFiles(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const path = join(dir, entry.name);
    if (entry.isDirectory()) return entry.name === "assembly" ? [] : sourceFiles(path);
    return entry.name.endsWith(".ts") && !/\.test\.ts$/.test(entry.name) ? [path] : [];
  });
}

function rulesFor(file: string): readonly string[] | undefined {
  const rel = relative(SRC, file);
  const key = Object.keys(ALLOWED)
    .filter((k) => rel.startsWith(`${k}/`))
    .sort((a, b) => b.length - a.length)[0];
  return key === undefined ? undefined : ALLOWED[key];
}

const IMPORT = /^\s*(?:import|export)\s[^;]*?from\s+"(\.[^"]+)"|import\(\s*"(\.[^"]+)"\s*\)/gm;

test("src/ imports follow the layering of STYLE.md", () => {
  const violations: string[] = [];
  for (const file of sourceFiles(SRC)) {
    const allowed = rulesFor(file);
    if (allowed === undefined) continue;
    for (const m of readFileSync(file, "utf8").matchAll(IMPORT)) {
      const spec = m[1] ?? m[2] ?? "";
      const target = relative(SRC, resolve(dirname(file), spec.replace(/\.js$/, ".ts")));
      const ok = allowed.some((a) => target === a || target.startsWith(`${a}/`));
      if (!ok) violations.push(`${relative(ROOT, file)} imports ${target}`);
    }
  }
  assert.deepEqual(violations, []);
});

test("the layering check sees a forbidden import", () => {
  const rules = rulesFor(join(SRC, "router/server.ts"));
  assert.ok(rules !== undefined && !rules.some((a) => "model/forward.ts".startsWith(a)));
});
