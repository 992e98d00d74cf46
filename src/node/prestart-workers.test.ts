/**
 * The node threads started before their options (prestart-workers.ts): asked to, the prefill
 * thread runs the process's native kernel self-test while it waits, and reports what this thread's
 * own run finds.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { nativeSelfTest } from "../engine/kernels-choice.js";
import { prestartNodeWorkers } from "./prestart-workers.js";

test("prestartNodeWorkers({ selfTest }) reports the prefill thread's self-test, the same as this thread's", async () => {
  const workers = prestartNodeWorkers({ selfTest: true });
  try {
    const here = await nativeSelfTest();
    assert.deepEqual(await workers.selfTest, here);
  } finally {
    await workers.terminate();
  }
});

test("prestartNodeWorkers() runs no self-test unless asked, and a thread gone first reports none", async () => {
  const plain = prestartNodeWorkers();
  assert.equal(plain.selfTest, undefined);
  await plain.terminate();
  const gone = prestartNodeWorkers({ selfTest: true });
  await gone.terminate();
  assert.equal(await gone.selfTest, undefined);
});
