/**
 * The native kernels under AddressSanitizer and UBSan: builds the sanitizer variant of the addon
 * (KVFENCE_NATIVE_SANITIZE=1 scripts/build-native.mjs → dist/native/kvfence-kernels-asan.node, -O1)
 * and runs the native kernel tests in a child Node with the ASan runtime preloaded
 * (LD_PRELOAD=$(gcc -print-file-name=libasan.so)), leak checks off (V8's own allocations) and UBSan
 * stopping at the first report. An out-of-bounds read or write of a malloc'd or stack object (the
 * glue's checked records, a kernel's locals) or undefined behaviour (a misaligned load, a signed
 * overflow) fails the run. Solo: the child runs five test files at -O1 with shadow memory.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { it } from "node:test";
import { fileURLToPath } from "node:url";

/** The package root (this file runs from dist/src/kernels). */
const root = fileURLToPath(new URL("../../..", import.meta.url));

it("the native kernel tests pass under AddressSanitizer and UBSan", () => {
  const build = spawnSync(process.execPath, [join(root, "scripts", "build-native.mjs")], {
    env: { ...process.env, KVFENCE_NATIVE_SANITIZE: "1" },
    encoding: "utf8",
  });
  const addon = join(root, "dist", "native", "kvfence-kernels-asan.node");
  assert.ok(build.status === 0 && existsSync(addon), `the sanitizer build failed: ${build.stderr}`);
  const asan = spawnSync("gcc", ["-print-file-name=libasan.so"], { encoding: "utf8" }).stdout.trim();
  assert.ok(existsSync(asan), `gcc has no libasan.so: ${asan}`);
  const tests = ["native-guards", "wasm-kernels", "wasm-weights", "wasm-kquants", "kv-dtype"].map((f) =>
    join(root, "dist", "src", "kernels", `${f}.test.js`),
  );
  // Without NODE_TEST_CONTEXT, which would make the child report to this runner, not print TAP.
  const { NODE_TEST_CONTEXT: _, ...env } = process.env;
  const run = spawnSync(
    process.execPath,
    ["--test", "--test-reporter=tap", "--test-concurrency=1", ...tests],
    {
      env: {
        ...env,
        KVFENCE_NATIVE_ADDON: addon,
        LD_PRELOAD: asan,
        ASAN_OPTIONS: "detect_leaks=0",
        UBSAN_OPTIONS: "halt_on_error=1:print_stacktrace=1",
      },
      encoding: "utf8",
      maxBuffer: 64 << 20,
    },
  );
  const sanitizer = /ERROR: AddressSanitizer|runtime error:/.exec(`${run.stdout}${run.stderr}`);
  assert.equal(sanitizer, null, `the sanitizer reported: ${run.stderr.slice(-4000)}`);
  assert.equal(
    run.status,
    0,
    `the native kernel tests failed under the sanitizers:\n${run.stdout.slice(-4000)}\n${run.stderr.slice(-4000)}`,
  );
  assert.match(run.stdout, /# fail 0/);
});
