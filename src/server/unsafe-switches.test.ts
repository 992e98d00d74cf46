import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { parseServeConfig } from "./serve-config.js";
import { UNSAFE_OPT_IN_FLAG, unsafeArgs, unsafeSwitchesProblem, unsafeWarning } from "./unsafe-switches.js";

const MAIN = fileURLToPath(new URL("../cli/main.js", import.meta.url));
const NONE = { unsafeFault: [], unsafeDisableGuard: [], iUnderstandThisLeaksData: false };

test("unsafeSwitchesProblem() refuses a fault or a disabled guard without the opt-in flag", () => {
  assert.equal(unsafeSwitchesProblem(NONE), null);
  const fault = unsafeSwitchesProblem({ ...NONE, unsafeFault: ["placeholder-reject"] });
  assert.match(fault ?? "", /--i-understand-this-leaks-data/);
  assert.match(fault ?? "", /--unsafe-fault placeholder-reject/);
  const guard = unsafeSwitchesProblem({ ...NONE, unsafeDisableGuard: ["checksum"] });
  assert.match(guard ?? "", /--i-understand-this-leaks-data/);
  assert.equal(
    unsafeSwitchesProblem({
      unsafeFault: ["late-write"],
      unsafeDisableGuard: ["quarantine"],
      iUnderstandThisLeaksData: true,
    }),
    null,
  );
});

test("unsafeSwitchesProblem() takes the stall-transfer node fault behind the same opt-in flag", () => {
  assert.match(
    unsafeSwitchesProblem({ ...NONE, unsafeFault: ["stall-transfer"] }) ?? "",
    /--unsafe-fault stall-transfer .*--i-understand-this-leaks-data/,
  );
  assert.equal(
    unsafeSwitchesProblem({ ...NONE, unsafeFault: ["stall-transfer"], iUnderstandThisLeaksData: true }),
    null,
  );
  assert.match(
    unsafeSwitchesProblem({ ...NONE, unsafeFault: ["stall"], iUnderstandThisLeaksData: true }) ?? "",
    /use one of .*stall-transfer/,
  );
});

test("unsafeSwitchesProblem() names the valid names for an unknown fault or guard", () => {
  const fault = unsafeSwitchesProblem({ ...NONE, unsafeFault: ["nope"], iUnderstandThisLeaksData: true });
  assert.match(fault ?? "", /unknown fault name: nope; use one of placeholder-reject/);
  const guard = unsafeSwitchesProblem({
    ...NONE,
    unsafeDisableGuard: ["walls"],
    iUnderstandThisLeaksData: true,
  });
  assert.match(guard ?? "", /unknown guard name: walls; use one of admission-doors/);
});

test("unsafeWarning() and unsafeArgs() are empty for a safe server and carry the opt-in otherwise", () => {
  assert.equal(unsafeWarning("router", [], []), null);
  assert.match(
    unsafeWarning("decode", ["early-free"], ["quarantine"]) ?? "",
    /UNSAFE.*\n.*early-free\n.*quarantine/,
  );
  assert.deepEqual(unsafeArgs([], []), []);
  assert.deepEqual(unsafeArgs(["corrupt-transfer"], ["checksum"]), [
    "--unsafe-fault",
    "corrupt-transfer",
    "--unsafe-disable-guard",
    "checksum",
    UNSAFE_OPT_IN_FLAG,
  ]);
});

test("parseServeConfig() refuses --unsafe-disable-guard without the opt-in flag", () => {
  const raw = {
    host: "127.0.0.1",
    port: "0",
    model: "m",
    pageSize: "16",
    scrubOnFree: false,
    disaggregation: true,
    logLevel: "silent",
  };
  assert.throws(
    () => parseServeConfig({ ...raw, unsafeDisableGuard: ["page-tags"] }),
    /--i-understand-this-leaks-data/,
  );
  const config = parseServeConfig({
    ...raw,
    unsafeDisableGuard: ["page-tags"],
    iUnderstandThisLeaksData: true,
  });
  assert.deepEqual(config.unsafeDisableGuard, ["page-tags"]);
});

for (const args of [
  ["serve", "--unsafe-fault", "placeholder-reject"],
  ["serve", "--role", "decode", "--unsafe-disable-guard", "coverage"],
  ["cluster", "--unsafe-fault", "early-free"],
]) {
  test(`kvfence ${args.join(" ")} exits 2 naming the opt-in flag`, () => {
    const run = spawnSync(process.execPath, [MAIN, ...args], { encoding: "utf8", timeout: 30_000 });
    assert.equal(run.status, 2, run.stderr);
    assert.match(run.stderr, /--i-understand-this-leaks-data/);
  });
}
