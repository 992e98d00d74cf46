import assert from "node:assert/strict";
import { test } from "node:test";
import { KvfenceError } from "../lib/errors.js";
import { FAULT_NAMES, FAULT_TABLE, faultOn, GUARD_NAMES, guardOn, makeSafety, SAFE } from "./safety.js";

test("makeSafety() turns faults on and guards off by name", () => {
  const safety = makeSafety({ faults: ["early-free"], disabledGuards: ["quarantine"] });
  assert.equal(faultOn(safety, "early-free"), true);
  assert.equal(faultOn(safety, "late-write"), false);
  assert.equal(guardOn(safety, "quarantine"), false);
  assert.equal(guardOn(safety, "checksum"), true);
});

test("makeSafety() rejects an unknown name and lists the valid ones", () => {
  assert.throws(
    () => makeSafety({ faults: ["no-such-fault"] }),
    (err: unknown) =>
      err instanceof KvfenceError && err.code === "invalid_request" && /early-free/.test(err.message),
  );
  assert.throws(() => makeSafety({ disabledGuards: ["nope"] }), /Unknown guard name: nope/);
});

test("makeSafety() returns a frozen config whose sets cannot change", () => {
  const safety = makeSafety({ faults: ["early-free"] });
  assert.ok(Object.isFrozen(safety));
  assert.throws(() => (safety.faults as Set<string>).add("late-write"), TypeError);
  assert.throws(() => (SAFE.disabledGuards as Set<string>).add("checksum"), TypeError);
});

test("FAULT_TABLE names a known guard for every fault", () => {
  for (const fault of FAULT_NAMES) {
    assert.ok(FAULT_TABLE[fault].caughtBy.length > 0);
    for (const guard of FAULT_TABLE[fault].caughtBy) assert.ok(GUARD_NAMES.includes(guard));
  }
});
