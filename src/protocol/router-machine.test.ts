import assert from "node:assert/strict";
import { test } from "node:test";
import type { Effect } from "./effects.js";
import { initialRouterState, type RouterEvent, routerStep } from "./router-machine.js";
import { makeSafety, SAFE, type Safety } from "./safety.js";
import type { ControlMessage } from "./wire.js";

const CONFIG = { maxModelLen: 16, prefillPoolTokens: 6, decodePoolTokens: 8, maxAttempts: 2 };

/** Runs the router machine; its effects without the watermarks (their own test below). */
function harness(safety: Safety = SAFE) {
  const state = initialRouterState();
  const run = (event: RouterEvent): Effect[] => {
    const out: Effect[] = [];
    routerStep(state, event, { config: CONFIG, safety, out });
    return out.filter((e) => e.kind !== "send" || e.msg.type !== "watermark");
  };
  const msg = (m: ControlMessage) => run({ type: "message", msg: m });
  return { state, run, msg };
}

const LEASE = {
  type: "lease" as const,
  rid: 1,
  epoch: 1,
  pages: [{ page: 0, generation: 1 }],
  pageSize: 1,
  layoutSignature: "x",
  incarnation: 1,
  writerIncarnation: 1,
};

test("routerStep() rejects over the effective context with 400, contacting no node", () => {
  const h = harness();
  const out = h.run({ type: "submit", rid: 1, tenant: 0, promptLen: 5, maxTokens: 2 });
  assert.equal(out.length, 1);
  const respond = out[0]!;
  assert.ok(respond.kind === "respond");
  assert.equal(respond.status, 400);
  assert.equal(respond.error?.code, "context_length_exceeded");
  assert.match(respond.error?.message ?? "", /: 6;/);
});

test("routerStep() under undersized-pool admits by the model's window alone", () => {
  const h = harness(makeSafety({ faults: ["undersized-pool"] }));
  const out = h.run({ type: "submit", rid: 1, tenant: 0, promptLen: 5, maxTokens: 2 });
  assert.equal(out[0]?.kind === "send" ? out[0].msg.type : "", "reserve");
});

test("routerStep() drives reserve, prefill, commit and finish to a 200", () => {
  const h = harness();
  h.run({ type: "submit", rid: 1, tenant: 0, promptLen: 1, maxTokens: 2 });
  const prefill = h.msg(LEASE);
  assert.ok(prefill[0]?.kind === "send" && prefill[0].to === "prefill" && prefill[0].msg.type === "prefill");
  assert.deepEqual(h.msg({ type: "committed", rid: 1, epoch: 1, firstToken: 3 }), [
    { kind: "tokens", rid: 1, epoch: 1, tokens: [3] },
  ]);
  const done = h.msg({
    type: "finished",
    rid: 1,
    epoch: 1,
    reason: "length",
    tokens: [4],
    completionTokens: 2,
  });
  assert.deepEqual(
    done.map((e) => e.kind),
    ["tokens", "respond"],
  );
  assert.ok(done[1]?.kind === "respond" && done[1].status === 200);
});

test("routerStep() passes a node's rejection to the client unchanged", () => {
  const h = harness();
  h.run({ type: "submit", rid: 1, tenant: 0, promptLen: 1, maxTokens: 2 });
  const error = { code: "context_length_exceeded" as const, message: "Prompt too long at decode: 4" };
  const out = h.msg({ type: "rejected", rid: 1, epoch: 1, from: "decode", error });
  assert.deepEqual(out, [{ kind: "respond", rid: 1, epoch: 1, status: 400, error, finishReason: null }]);
});

test("routerStep() ignores and counts a message of another epoch", () => {
  const h = harness();
  h.run({ type: "submit", rid: 1, tenant: 0, promptLen: 1, maxTokens: 2 });
  assert.deepEqual(h.msg({ ...LEASE, epoch: 2 }), []);
  assert.equal(h.state.stale, 1);
});

test("routerStep() aborts at decode and answers 499 when the client goes away", () => {
  const h = harness();
  h.run({ type: "submit", rid: 1, tenant: 0, promptLen: 1, maxTokens: 2 });
  h.msg(LEASE);
  const out = h.run({ type: "client_abort", rid: 1 });
  assert.deepEqual(out[0], { kind: "send", to: "decode", msg: { type: "abort", rid: 1, epoch: 1 } });
  assert.ok(out[1]?.kind === "respond" && out[1].status === 499);
});

test("routerStep() retries a retryable failure as a new epoch, then gives up", () => {
  const h = harness();
  h.run({ type: "submit", rid: 1, tenant: 0, promptLen: 1, maxTokens: 2 });
  const busy = { code: "pool_exhausted" as const, message: "busy" };
  const retry = h.msg({ type: "rejected", rid: 1, epoch: 1, from: "decode", error: busy });
  assert.ok(retry[0]?.kind === "send" && retry[0].msg.type === "reserve" && retry[0].msg.epoch === 2);
  const out = h.msg({ type: "rejected", rid: 1, epoch: 2, from: "decode", error: busy });
  assert.ok(out[0]?.kind === "respond" && out[0].status === 503);
});

test("routerStep() aborts at decode after a prefill rejection, so decode can release its lease", () => {
  const h = harness(makeSafety({}));
  h.run({ type: "submit", rid: 1, tenant: 0, promptLen: 1, maxTokens: 2 });
  h.msg(LEASE);
  const error = { code: "context_length_exceeded" as const, message: "Too long at prefill: 6" };
  const out = h.msg({ type: "rejected", rid: 1, epoch: 1, from: "prefill", error });
  assert.deepEqual(
    out.map((e) => e.kind),
    ["send", "respond"],
  );
  assert.ok(out[1]?.kind === "respond" && out[1].error?.message === "Too long at prefill: 6");
});

test("routerStep() sends the pair's watermark (the lowest rid in flight) to both nodes as requests end", () => {
  const state = initialRouterState();
  const run = (event: RouterEvent, watermarkStep?: number): ControlMessage[] => {
    const out: Effect[] = [];
    const config = watermarkStep === undefined ? CONFIG : { ...CONFIG, watermarkStep };
    routerStep(state, event, { config, safety: SAFE, out });
    return out.flatMap((e) => (e.kind === "send" && e.msg.type === "watermark" ? [e.msg] : []));
  };
  const submit = (rid: number) => run({ type: "submit", rid, tenant: 0, promptLen: 1, maxTokens: 1 });
  // The rids of one router slot (slot 0): 16, 32, 48.
  for (const rid of [16, 32, 48]) assert.deepEqual(submit(rid), []);
  // Request 32 ends first: rid 16 is still in flight, so the watermark stays (batched by the step).
  assert.deepEqual(run({ type: "client_abort", rid: 32 }), []);
  assert.deepEqual(run({ type: "client_abort", rid: 16 }, 1), [
    { type: "watermark", rid: 0, epoch: 0, below: 48 },
    { type: "watermark", rid: 0, epoch: 0, below: 48 },
  ]);
  // Nothing in flight: the watermark is the next rid, sent at once.
  assert.equal(run({ type: "client_abort", rid: 48 }).length, 2);
  assert.equal(state.watermark, 64);
  // A node back (a new incarnation) hears it again; a rid before the watermark is never taken.
  assert.deepEqual(run({ type: "peer_up", role: "prefill" }), [
    { type: "watermark", rid: 0, epoch: 0, below: 64 },
  ]);
  submit(32);
  assert.equal(state.requests["32"]?.phase, "done");
  assert.equal(state.stale, 1);
  // A rid of another router's slot is never taken either (nodes keep one watermark per slot).
  submit(65);
  assert.equal(state.requests["65"], undefined);
  assert.equal(state.stale, 2);
});

test("routerStep() carries a group's samples on one attempt until decode's commit forks them; a failure before it ends them all, unretried", () => {
  // Rids of router slot 1 (1, 17, 33, …): a group's samples take the next rids of its slot.
  const h = harness();
  const out = h.run({ type: "submit", rid: 1, tenant: 0, promptLen: 2, maxTokens: 2, samples: [17, 33] });
  const reserves = out.flatMap((e) => (e.kind === "send" && e.msg.type === "reserve" ? [e.msg] : []));
  assert.equal(reserves.length, 1, "one reserve for the group");
  assert.deepEqual(reserves[0]!.samples, [17, 33]);
  const prefill = h.msg(LEASE);
  assert.deepEqual(
    prefill.map((e) => (e.kind === "send" ? e.msg.type : e.kind)),
    ["prefill"],
  );
  // The commit forks them: each sample's tokens and finish are its own.
  for (const rid of [1, 17, 33]) {
    const tokens = h.msg({ type: "committed", rid, epoch: 1, firstToken: 10 + rid });
    assert.deepEqual(
      tokens.map((e) => (e.kind === "tokens" ? [e.rid, ...e.tokens] : e.kind)),
      [[rid, 10 + rid]],
    );
  }
  const done = h.msg({
    type: "finished",
    rid: 17,
    epoch: 1,
    reason: "length",
    tokens: [7],
    completionTokens: 2,
  });
  assert.deepEqual(
    done.map((e) => (e.kind === "respond" ? `${e.rid} ${e.status}` : e.kind)),
    ["tokens", "17 200"],
  );
  assert.equal(h.state.requests[1]!.phase, "decoding", "the others go on");

  // Another group, refused by prefill before its commit (retryable, and attempts remain): no retry,
  // every sample it carries ends with the refusal.
  h.run({ type: "submit", rid: 49, tenant: 0, promptLen: 2, maxTokens: 2, samples: [65] });
  h.msg({ ...LEASE, rid: 49 });
  const refused = h.msg({
    type: "rejected",
    rid: 49,
    epoch: 1,
    from: "prefill",
    error: { code: "node_unavailable", message: "gone" },
  });
  assert.deepEqual(
    refused.map((e) =>
      e.kind === "respond" ? `${e.rid} ${e.status}` : e.kind === "send" ? e.msg.type : e.kind,
    ),
    ["abort", "49 503", "65 503"],
  );
  // A client abort of a group before its commit ends the samples it carries too.
  h.run({ type: "submit", rid: 81, tenant: 0, promptLen: 2, maxTokens: 2, samples: [97] });
  const aborted = h.run({ type: "client_abort", rid: 81 });
  assert.deepEqual(
    aborted.map((e) =>
      e.kind === "respond" ? `${e.rid} ${e.error?.code}` : e.kind === "send" ? e.msg.type : e.kind,
    ),
    ["abort", "81 aborted", "97 aborted"],
  );
  // A sample's rid of another router slot (the nodes would track it under that router's watermark)
  // makes the submit stale: nothing is sent.
  const stale = h.state.stale;
  assert.deepEqual(
    h.run({ type: "submit", rid: 113, tenant: 0, promptLen: 2, maxTokens: 2, samples: [114] }),
    [],
  );
  assert.equal(h.state.stale, stale + 1);
  assert.equal(h.state.requests[113], undefined);
});
