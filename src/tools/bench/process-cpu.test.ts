import assert from "node:assert/strict";
import { test } from "node:test";
import { cpuSeconds, threadCpuSeconds } from "./process-cpu.js";

test("threadCpuSeconds() lists this process's threads, their CPU within the process's total", () => {
  // Some CPU on the main thread first, so its figure is above zero.
  let x = 0;
  for (const t0 = Date.now(); Date.now() - t0 < 50; ) x += Math.sqrt(x + 1);
  assert.ok(x > 0);
  const threads = threadCpuSeconds([process.pid]);
  const total = cpuSeconds([process.pid]);
  const main = threads.get(`${process.pid}:${process.pid}`);
  assert.ok(main !== undefined && main > 0, `the main thread is listed with its CPU: ${main}`);
  const sum = [...threads.values()].reduce((s, v) => s + v, 0);
  assert.ok(sum <= total + 1e-9, `live threads ${sum} s ≤ the process ${total} s`);
  assert.deepEqual(threadCpuSeconds([2 ** 30]), new Map(), "an ended process has no threads");
});
