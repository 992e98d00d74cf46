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

test("kvfence --help lists every subcommand, and each one named on the command line loads alone", async () => {
  const run = async (args: string[]): Promise<{ code: number; stdout: string }> => {
    const child = spawn(process.execPath, [MAIN, ...args], { stdio: ["ignore", "pipe", "pipe"] });
    let stdout = "";
    child.stdout.on("data", (d: Buffer) => {
      stdout += d.toString();
    });
    const [code] = await once(child, "exit");
    return { code: code as number, stdout };
  };
  const names = [
    "bench",
    "check",
    "cluster",
    "drain",
    "gen-model",
    "generate",
    "preflight",
    "probe",
    "quantize",
    "serve",
  ];
  const help = await run(["--help"]);
  assert.equal(help.code, 0);
  for (const name of names) assert.match(help.stdout, new RegExp(`^  ${name} `, "m"));
  for (const name of ["serve", "bench"]) {
    const one = await run([name, "--help"]);
    assert.equal(one.code, 0);
    assert.match(one.stdout, new RegExp(`^Usage: kvfence ${name} `, "m"));
  }
});
