/**
 * The kvfence package root (the folder holding its package.json), found from this module's own
 * location, so bundled files (`models/kvfence-tiny`, test fixtures) resolve the same from `src/`,
 * from `dist/src/` and from an installed package, whatever the current directory.
 */
import { existsSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

let cached: string | undefined;

export function packageRoot(): string {
  if (cached !== undefined) return cached;
  let dir = dirname(fileURLToPath(import.meta.url));
  for (;;) {
    const pkg = join(dir, "package.json");
    if (existsSync(pkg) && (JSON.parse(readFileSync(pkg, "utf8")) as { name?: unknown }).name === "kvfence") {
      cached = dir;
      return dir;
    }
    const parent = dirname(dir);
    if (parent === dir)
      throw new Error(`kvfence package.json not found above ${fileURLToPath(import.meta.url)}`);
    dir = parent;
  }
}

/** The bundled reference model, `models/kvfence-tiny` in the package. */
export function bundledModelDir(): string {
  return join(packageRoot(), "models", "kvfence-tiny");
}
