/**
 * No source file outside the kernels over 800 lines (issue #32): a file that grows past it holds
 * more than one role and is split by role, as the engine, the cluster's engine handle and the
 * router were. Functions are held to 100 lines by the linter (biome.jsonc,
 * `noExcessiveLinesPerFunction`), test files excepted; the kernels keep each hot loop in one body.
 */
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { dirname, join, relative, resolve } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
export const MAX_FILE_LINES = 800;

/** Every non-test .ts file under `dir` (relative to src/) whose line count is over `max`, outside src/kernels. */
export function oversizedFiles(dir: string, max: number): string[] {
  const walk = (d: string): string[] =>
    readdirSync(d, { withFileTypes: true }).flatMap((entry) => {
      const path = join(d, entry.name);
      if (entry.isDirectory()) return entry.name === "kernels" && d === dir ? [] : walk(path);
      return entry.name.endsWith(".ts") && !entry.name.endsWith(".test.ts") ? [path] : [];
    });
  return walk(dir)
    .map((path) => ({ path, lines: readFileSync(path, "utf8").split("\n").length }))
    .filter((f) => f.lines > max)
    .map((f) => `${relative(dir, f.path)}: ${f.lines} lines`);
}

test("oversizedFiles() finds no source file outside the kernels over 800 lines", () => {
  assert.deepEqual(oversizedFiles(join(ROOT, "src"), MAX_FILE_LINES), []);
});

test("oversizedFiles() names a file over the limit and skips tests and the kernels", () => {
  const src = join(ROOT, "src");
  const found = oversizedFiles(src, 500);
  assert.ok(found.length > 0, "some source file is over 500 lines");
  assert.ok(
    found.every((f) => !f.startsWith("kernels/") && !/\.test\.ts:/.test(f)),
    found.join("\n"),
  );
});
