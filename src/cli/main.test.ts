import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { once } from "node:events";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const MAIN = fileURLToPath(new URL("./main.js", import.meta.url));

test("kvfence turns a subcommand's refusal into one line on stderr and exit 2, not a stack trace", async () => {
  const child = spawn(process.execPath, [MAIN, "check", "--requests", "99"], {
    stdio: ["ignore", "pipe", "pipe"],
  });
  let stderr = "";
  child.stderr.on("data", (d: Buffer) => {
    stderr += d.toString();
  });
  const [code] = await once(child, "exit");
  assert.equal(code, 2);
  assert.equal(stderr, "kvfence check: The checker models 1 to 3 requests: 99\n");
});
