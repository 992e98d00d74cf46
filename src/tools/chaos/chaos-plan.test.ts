/**
 * The chaos campaign's pure parts, without namespaces: the fault plan is the seed's (the same seed
 * the same faults, every kind in every round, the last one over before the workload ends)
 * and each request is judged against its fault-free answer (a 200 must be it exactly; a stream cut
 * by an error event is a failure while its text is a prefix of it, a wrong answer otherwise).
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import type { ChatOutcome } from "../probe/chat-client.js";
import { FAULT_KINDS, planFaults } from "./faults.js";
import { classify } from "./workload.js";

const targets = ["prefill-0", "prefill-1", "prefill-2", "decode-0", "decode-1", "decode-2"];

test("planFaults() gives the same plan for the same seed, every kind in every round, all over before the end", () => {
  const a = planFaults({ seed: 36, durationMs: 300_000, gapMs: 6000, targets });
  assert.deepEqual(planFaults({ seed: 36, durationMs: 300_000, gapMs: 6000, targets }), a);
  assert.notDeepEqual(planFaults({ seed: 37, durationMs: 300_000, gapMs: 6000, targets }), a);
  assert.ok(a.length >= 15, `${a.length} faults in 300 s`);
  const n = FAULT_KINDS.length;
  for (let i = 0; i + n <= a.length; i += n)
    assert.deepEqual(
      a
        .slice(i, i + n)
        .map((f) => f.kind)
        .sort(),
      [...FAULT_KINDS].sort(),
      `round ${i / n}`,
    );
  const end = a.reduce((t, f) => t + f.gapMs + f.holdMs, 0);
  assert.ok(end + 5000 <= 300_000, `the last fault is over at ${end} ms`);
  assert.ok(a.every((f) => targets.includes(f.target)));
});

const outcome = (o: Partial<ChatOutcome>): ChatOutcome => ({
  status: 200,
  text: "",
  streamed: true,
  promptTokens: null,
  error: null,
  inBandError: false,
  rawExcerpt: "",
  elapsedMs: 1,
  ...o,
});

test("classify() judges a request against its fault-free answer", () => {
  assert.equal(classify(outcome({ text: "QX7-PL2." }), "QX7-PL2."), "completed");
  assert.equal(classify(outcome({ text: "QX7-PL3." }), "QX7-PL2."), "wrong");
  assert.equal(
    classify(outcome({ text: "QX7", inBandError: true, error: "node_unavailable" }), "QX7-PL2."),
    "failed",
  );
  assert.equal(
    classify(outcome({ text: "QX9", inBandError: true, error: "node_unavailable" }), "QX7-PL2."),
    "wrong",
  );
  assert.equal(classify(outcome({ status: 503, text: "" }), "QX7-PL2."), "failed");
  assert.equal(classify(outcome({ status: 0, text: "" }), "QX7-PL2."), "failed");
});
