import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const ROUTER_SRC = fileURLToPath(
  new URL(import.meta.url.includes("/dist/") ? "../../../src/router/" : "./", import.meta.url),
);

/** What the router may import from outside src/router: never weights, kernels, the forward pass or the engine itself. */
const ALLOWED = [
  /^\.\/.+\.js$/,
  /^\.\.\/lib\/.+\.js$/,
  /^\.\.\/protocol\/.+\.js$/,
  /^\.\.\/engine\/engine-types\.js$/,
  /^\.\.\/model\/tokenizer\.js$/,
  /^\.\.\/\.\.\/testing\/scripted-engine\.js$/,
  /^\.\.\/\.\.\/testing\/start-server\.js$/,
  /^node:/,
  /^(zod|pino|openai)$/,
];

test("src/router imports only tokenization, wire types and lib — never weights or the forward pass", () => {
  const files = readdirSync(ROUTER_SRC).filter((f) => f.endsWith(".ts"));
  assert.ok(files.length > 5);
  const offenders: string[] = [];
  for (const file of files) {
    const text = readFileSync(join(ROUTER_SRC, file), "utf8");
    for (const match of text.matchAll(/^\s*(?:import|export)[^;]*?from\s+"([^"]+)"/gms)) {
      const spec = match[1]!;
      if (file.endsWith(".test.ts") && spec.startsWith("../model/tokenizer")) continue;
      if (!ALLOWED.some((re) => re.test(spec))) offenders.push(`${file}: ${spec}`);
    }
  }
  assert.deepEqual(offenders, []);
});
