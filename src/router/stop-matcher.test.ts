import assert from "node:assert/strict";
import { test } from "node:test";
import { StopMatcher } from "./stop-matcher.js";

function run(stops: string[], pieces: string[]): { out: string; stopped: boolean } {
  const m = new StopMatcher(stops);
  let out = "";
  for (const p of pieces) {
    const step = m.push(p);
    out += step.text;
    if (step.stopped) return { out, stopped: true };
  }
  return { out: out + m.flush(), stopped: false };
}

test("StopMatcher trims a stop string split across pieces", () => {
  assert.deepEqual(run(["END"], ["abc E", "N", "D tail"]), { out: "abc ", stopped: true });
});

test("StopMatcher holds back a possible prefix and releases it when it does not match", () => {
  const m = new StopMatcher(["END"]);
  assert.equal(m.push("abcE").text, "abc");
  assert.equal(m.push("N").text, "");
  assert.equal(m.push("x").text, "ENx");
  assert.equal(m.flush(), "");
});

test("StopMatcher picks the earliest of several stop strings", () => {
  assert.deepEqual(run(["world", "lo"], ["hello world"]), { out: "hel", stopped: true });
});

test("StopMatcher with no stops passes text through and flushes held text at the end", () => {
  assert.deepEqual(run([], ["a", "b"]), { out: "ab", stopped: false });
  assert.deepEqual(run(["xyz"], ["abx"]), { out: "abx", stopped: false });
});

test("StopMatcher emits nothing after a stop", () => {
  const m = new StopMatcher(["."]);
  assert.deepEqual(m.push("a.b"), { text: "a", stopped: true, matched: "." });
  assert.deepEqual(m.push("more"), { text: "", stopped: true });
  assert.equal(m.flush(), "");
});

test("StopMatcher keeps the stop string with includeStop, and matches nothing in a push that is not armed", () => {
  assert.deepEqual(new StopMatcher(["lo"], true).push("hello world"), {
    text: "hello",
    stopped: true,
    matched: "lo",
  });
  const m = new StopMatcher(["ab"]);
  // Not armed (min_tokens not reached): a whole stop string goes out; a partial one is held.
  assert.deepEqual(m.push("xaba", false), { text: "xab", stopped: false });
  assert.deepEqual(m.push("b", true), { text: "", stopped: true, matched: "ab" });
});
