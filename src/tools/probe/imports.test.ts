import assert from "node:assert/strict";
import { readdir, readFile } from "node:fs/promises";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

// The compiled files sit in dist/src/tools/probe; read the sources beside them in src/.
const SRC = fileURLToPath(new URL("../../../../src/tools/probe/", import.meta.url));

test("src/tools/probe imports only src/lib, src/protocol, its own folder and node builtins", async () => {
  const files = (await readdir(SRC)).filter((f) => f.endsWith(".ts") && !f.endsWith(".test.ts"));
  assert.ok(files.includes("probe.ts"), `sources not found in ${SRC}`);
  for (const file of files) {
    const text = await readFile(join(SRC, file), "utf8");
    for (const m of text.matchAll(/^\s*(?:import|export)\s[^;]*?from\s+"([^"]+)"/gms)) {
      const spec = m[1]!;
      const allowed =
        spec.startsWith("./") ||
        spec.startsWith("../../lib/") ||
        spec.startsWith("../../protocol/") ||
        spec.startsWith("node:");
      assert.ok(allowed, `${file} imports ${spec}: the probe may use only src/lib and src/protocol`);
    }
  }
});
