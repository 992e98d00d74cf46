/**
 * The default topology's decode thread faults in the weights mapped from their file once it said
 * hello (weight-pages.ts), so that the first prefill step does not: with no request served, every
 * page of the mapping becomes resident (its Rss in /proc/self/smaps reaches its Size).
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { modelDir, startTestServer } from "../../testing/start-server.js";

/** Size and Rss (kB) of each mapping of `file` in this process, from /proc/self/smaps. */
function mappingsOf(file: string): { sizeKb: number; rssKb: number }[] {
  const found: { sizeKb: number; rssKb: number }[] = [];
  let current: { sizeKb: number; rssKb: number } | null = null;
  for (const line of readFileSync("/proc/self/smaps", "utf8").split("\n")) {
    if (/^[0-9a-f]+-[0-9a-f]+ /.test(line)) {
      current = line.endsWith(` ${file}`) ? { sizeKb: 0, rssKb: 0 } : null;
      if (current !== null) found.push(current);
    } else if (current !== null) {
      const m = /^(Size|Rss):\s+(\d+) kB/.exec(line);
      if (m?.[1] === "Size") current.sizeKb = Number(m[2]);
      if (m?.[1] === "Rss") current.rssKb = Number(m[2]);
    }
  }
  return found;
}

test("The default topology's decode thread faults in the mapped weights before the first request", async () => {
  const dir = modelDir("kvfence-tiny");
  const file = join(dir, "model.safetensors");
  const server = await startTestServer({ model: dir, disaggregation: true, kernels: "native" });
  try {
    const deadline = Date.now() + 30_000;
    let maps = mappingsOf(file);
    while (Date.now() < deadline && !(maps.length > 0 && maps.every((m) => m.rssKb === m.sizeKb))) {
      await new Promise((resolve) => setTimeout(resolve, 50));
      maps = mappingsOf(file);
    }
    assert.equal(maps.length, 1, `one mapping of the weight file: ${JSON.stringify(maps)}`);
    assert.equal(
      maps[0]!.rssKb,
      maps[0]!.sizeKb,
      `every page of the mapping is resident: ${JSON.stringify(maps)}`,
    );
  } finally {
    await server.close();
  }
});
