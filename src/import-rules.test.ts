/**
 * The layering of src/, enforced for every folder. From the bottom: kernels and lib; the folders
 * over lib alone — kvcache, tokenizer (a model's text side: tokenizer, chat template, the GGUF
 * header), fair-share (per-tenant fair admission) and admin-api (the operator endpoints' wire
 * types); model (config, weights, the forward pass); protocol (the sans-IO machines and the wire and
 * engine contracts); transfer and engine; links (the router ↔ node messages and the links that
 * carry them, which both sides use); cluster (the router-side driver of the protocol: pairing,
 * cluster metrics); node (the prefill and decode nodes and their hosts); topology (threaded, local
 * cluster, serve topology, the single-engine worker); router (HTTP); server (boot: config, the
 * unsafe switches, topology, router); tools and cli on top. The router never touches weights or
 * the forward pass: of a model it imports the tokenizer folder only. The probe and the pre-flight
 * import only the admin-api wire types, lib helpers and (the pre-flight) kvcache's pure capacity
 * arithmetic, so that they work against any server. Every allowance is a folder: code that only
 * part of a folder may import lives in a folder of its own. Tests may import anything; a folder
 * with no rule is itself a failure. No source files import one another in a circle, not even
 * through a type-only import.
 */
import assert from "node:assert/strict";
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, relative, resolve } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../..");

interface Rule {
  /** The src/ folders the folder may import (folders only: a test below says so). */
  readonly src: readonly string[];
  /** The npm packages it may import (`node:` builtins always). Absent: any declared dependency. */
  readonly packages?: readonly string[];
}

/** For each folder under src/ (most specific wins), what it may import. */
export const RULES: Record<string, Rule> = {
  kernels: { src: ["kernels"] },
  lib: { src: ["lib"] },
  tokenizer: {
    src: ["tokenizer", "lib"],
    packages: ["@huggingface/tokenizers", "@huggingface/jinja", "@huggingface/gguf"],
  },
  model: { src: ["model", "tokenizer", "kernels", "kvcache", "lib"] },
  grammar: {
    src: ["grammar", "tokenizer", "protocol", "lib"],
    packages: ["@mlc-ai/web-xgrammar", "regjsparser"],
  },
  kvcache: { src: ["kvcache", "lib"] },
  "fair-share": { src: ["fair-share", "lib"] },
  "admin-api": { src: ["admin-api"], packages: ["zod"] },
  protocol: { src: ["protocol", "admin-api", "kvcache", "lib"] },
  transfer: { src: ["transfer", "protocol", "kvcache", "lib"] },
  engine: { src: ["engine", "grammar", "model", "kvcache", "kernels", "protocol", "lib"] },
  links: { src: ["links", "transfer", "protocol", "kvcache", "lib"] },
  cluster: { src: ["cluster", "links", "fair-share", "admin-api", "protocol", "transfer", "lib"] },
  node: { src: ["node", "links", "engine", "model", "kvcache", "protocol", "transfer", "lib"] },
  topology: {
    src: [
      "topology",
      "cluster",
      "node",
      "links",
      "engine",
      "model",
      "fair-share",
      "protocol",
      "transfer",
      "lib",
    ],
  },
  router: {
    src: ["router", "grammar", "tokenizer", "fair-share", "admin-api", "protocol", "lib"],
    packages: ["zod", "content-type", "prom-client"],
  },
  server: {
    src: [
      "server",
      "router",
      "topology",
      "node",
      "cluster",
      "engine",
      "transfer",
      "kvcache",
      "model",
      "tokenizer",
      "fair-share",
      "protocol",
      "lib",
    ],
  },
  "tools/bench": {
    src: [
      "tools/bench",
      "tools/probe",
      "topology",
      "cluster",
      "engine",
      "grammar",
      "model",
      "kvcache",
      "kernels",
      "transfer",
      "protocol",
      "lib",
    ],
  },
  "tools/chaos": { src: ["tools/chaos", "tools/incident", "tools/probe", "admin-api"] },
  "tools/check": { src: ["tools/check", "protocol", "kvcache", "lib"] },
  "tools/incident": {
    src: ["tools/incident", "tools/probe", "server", "topology", "protocol", "kvcache", "lib"],
  },
  "tools/preflight": { src: ["tools/preflight", "admin-api", "kvcache", "lib"], packages: [] },
  "tools/probe": { src: ["tools/probe", "admin-api", "lib"], packages: [] },
  cli: {
    src: ["cli", "server", "tools", "topology", "cluster", "model", "kernels", "kvcache", "protocol", "lib"],
  },
};

function sourceFiles(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const path = join(dir, entry.name);
    if (entry.isDirectory()) return entry.name === "assembly" ? [] : sourceFiles(path);
    return entry.name.endsWith(".ts") && !/\.test\.ts$/.test(entry.name) ? [path] : [];
  });
}

function ruleKey(rel: string): string | undefined {
  return Object.keys(RULES)
    .filter((k) => rel.startsWith(`${k}/`))
    .sort((a, b) => b.length - a.length)[0];
}

function ruleFor(rel: string): Rule | undefined {
  const key = ruleKey(rel);
  return key === undefined ? undefined : RULES[key];
}

const IMPORT = /^\s*(?:import|export)\s[^;]*?from\s+"([^"]+)"|import\(\s*"([^"]+)"\s*\)/gm;

/** Every import under `srcDir` that its folder's rule does not allow, and every file with no rule. */
export function layeringViolations(srcDir: string): string[] {
  return scan(srcDir).violations;
}

/** Every allowance of a rule (other than its own folder) that no file of the folder uses. */
export function unusedAllowances(srcDir: string): string[] {
  const { used } = scan(srcDir);
  return Object.entries(RULES).flatMap(([folder, rule]) =>
    rule.src.filter((a) => a !== folder && !used.has(`${folder} -> ${a}`)).map((a) => `${folder} -> ${a}`),
  );
}

function scan(srcDir: string): { violations: string[]; used: Set<string> } {
  const violations: string[] = [];
  const used = new Set<string>();
  for (const file of sourceFiles(srcDir)) {
    const rel = relative(srcDir, file);
    if (!rel.includes("/")) continue; // src/*.ts: only tests live there
    const rule = ruleFor(rel);
    if (rule === undefined) {
      violations.push(`${rel}: its folder has no layering rule`);
      continue;
    }
    for (const m of readFileSync(file, "utf8").matchAll(IMPORT)) {
      const spec = m[1] ?? m[2] ?? "";
      if (spec.startsWith("node:")) continue;
      const verdict = spec.startsWith(".")
        ? checkSourceImport({ srcDir, file, rel, rule }, spec)
        : checkPackageImport(rel, rule, spec);
      if (verdict.violation !== undefined) violations.push(verdict.violation);
      if (verdict.used !== undefined) used.add(verdict.used);
    }
  }
  return { violations, used };
}

/** An import of a file under src/: a violation, or the allowance it uses. */
function checkSourceImport(
  from: { readonly srcDir: string; readonly file: string; readonly rel: string; readonly rule: Rule },
  spec: string,
): { violation?: string; used?: string } {
  const target = relative(from.srcDir, resolve(dirname(from.file), spec.replace(/\.js$/, ".ts")));
  const allowance = from.rule.src.find((a) => target === a || target.startsWith(`${a}/`));
  if (allowance === undefined) return { violation: `${from.rel} imports ${target}` };
  return { used: `${ruleKey(from.rel)} -> ${allowance}` };
}

/** An import of an npm package: a violation when the folder's rule lists its packages and not this one. */
function checkPackageImport(rel: string, rule: Rule, spec: string): { violation?: string; used?: string } {
  const pkg = spec.startsWith("@") ? spec.split("/").slice(0, 2).join("/") : (spec.split("/")[0] ?? spec);
  if (rule.packages !== undefined && !rule.packages.includes(pkg))
    return { violation: `${rel} imports ${pkg}` };
  return {};
}

/** Each set of files under `srcDir` that import one another in a circle (type-only imports count). */
export function importCircles(srcDir: string): string[] {
  const graph = new Map<string, string[]>();
  for (const file of sourceFiles(srcDir)) {
    const targets = [...readFileSync(file, "utf8").matchAll(IMPORT)]
      .map((m) => m[1] ?? m[2] ?? "")
      .filter((spec) => spec.startsWith("."))
      .map((spec) => relative(srcDir, resolve(dirname(file), spec.replace(/\.js$/, ".ts"))));
    graph.set(relative(srcDir, file), targets);
  }
  return stronglyConnected(graph)
    .filter((files) => files.length > 1)
    .map((files) => files.sort().join(" ⇄ "))
    .sort();
}

/** The strongly connected components of `graph` (Tarjan's algorithm); edges to unknown nodes are passed over. */
function stronglyConnected(graph: ReadonlyMap<string, readonly string[]>): string[][] {
  const index = new Map<string, number>();
  const low = new Map<string, number>();
  const stack: string[] = [];
  const components: string[][] = [];
  const visit = (v: string): void => {
    index.set(v, index.size);
    low.set(v, index.size - 1);
    stack.push(v);
    for (const w of graph.get(v) ?? []) {
      if (!graph.has(w)) continue;
      if (!index.has(w)) {
        visit(w);
        low.set(v, Math.min(low.get(v) as number, low.get(w) as number));
      } else if (stack.includes(w)) {
        low.set(v, Math.min(low.get(v) as number, index.get(w) as number));
      }
    }
    if (low.get(v) === index.get(v)) components.push(stack.splice(stack.indexOf(v)));
  };
  for (const v of graph.keys()) if (!index.has(v)) visit(v);
  return components;
}

test("src/ imports follow the layering, every folder has a rule", () => {
  assert.deepEqual(layeringViolations(join(ROOT, "src")), []);
});

test("every allowance in the layering rules is used by some import (none left over from a move)", () => {
  assert.deepEqual(unusedAllowances(join(ROOT, "src")), []);
});

test("every allowance in the layering rules is a folder under src/, none a single file", () => {
  const notFolders = Object.entries(RULES).flatMap(([folder, rule]) =>
    rule.src
      .filter((a) => statSync(join(ROOT, "src", a), { throwIfNoEntry: false })?.isDirectory() !== true)
      .map((a) => `${folder} -> ${a}`),
  );
  assert.deepEqual(notFolders, []);
});

test("the layering check fails on planted violations: an upward import, a forbidden package, a folder with no rule", () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-layering-"));
  try {
    const plant = (path: string, text: string): void => {
      mkdirSync(dirname(join(dir, path)), { recursive: true });
      writeFileSync(join(dir, path), text);
    };
    plant("router/ok.ts", 'import { x } from "./other.js";\nimport { y } from "../lib/errors.js";\n');
    plant(
      "router/bad.ts",
      'import type { X } from "./ok.js";\nimport {\n  forward,\n} from "../model/forward.js";\n',
    );
    plant("node/up.ts", 'export { startServer } from "../server/start-server.js";\n');
    plant("tools/probe/pkg.ts", 'import OpenAI from "openai";\n');
    plant("newfolder/a.ts", "export const a = 1;\n");
    plant("cli/lazy.ts", 'const m = await import("../tools/check/run-check.js");\n');
    assert.deepEqual(layeringViolations(dir).sort(), [
      "newfolder/a.ts: its folder has no layering rule",
      "node/up.ts imports server/start-server.ts",
      "router/bad.ts imports model/forward.ts",
      "tools/probe/pkg.ts imports openai",
    ]);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("no files under src/ import one another in a circle, type-only imports included", () => {
  assert.deepEqual(importCircles(join(ROOT, "src")), []);
});

test("the circle check finds a planted circle closed by a type-only import, and nothing outside it", () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-circles-"));
  try {
    mkdirSync(join(dir, "engine"));
    writeFileSync(join(dir, "engine/a.ts"), 'import { b } from "./b.js";\n');
    writeFileSync(join(dir, "engine/b.ts"), 'import { c } from "./c.js";\n');
    writeFileSync(join(dir, "engine/c.ts"), 'import type { A } from "./a.js";\n');
    writeFileSync(join(dir, "engine/d.ts"), 'import { a } from "./a.js";\n');
    assert.deepEqual(importCircles(dir), ["engine/a.ts ⇄ engine/b.ts ⇄ engine/c.ts"]);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
