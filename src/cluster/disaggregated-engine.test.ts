/**
 * `DisaggregatedEngine` against scripted nodes (in-memory links): what it sends, and how node
 * messages and node loss become the request's events.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import type { WireError } from "../lib/errors.js";
import type { FromNode, Link, NodeHello, ToNode } from "../links/node-messages.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { makeSafety, SAFE } from "../protocol/safety.js";
import type { ControlMessage } from "../protocol/wire.js";
import { DisaggregatedEngine, type RouterNode } from "./disaggregated-engine.js";

class FakeLink implements Link<ToNode, FromNode> {
  readonly sent: ToNode[] = [];
  /** Answer readiness pings (a node that turns); false: a frozen node. */
  answers = true;
  #onMessage: (m: FromNode) => void = () => {};
  #onClose: () => void = () => {};
  send(m: ToNode): void {
    this.sent.push(m);
    if (m.kind === "ping" && this.answers) queueMicrotask(() => this.deliver({ kind: "pong", id: m.id }));
  }
  onMessage(h: (m: FromNode) => void): void {
    this.#onMessage = h;
  }
  onClose(h: () => void): void {
    this.#onClose = h;
  }
  close(): void {}
  deliver(m: FromNode): void {
    this.#onMessage(m);
  }
  die(): void {
    this.#onClose();
  }
  /** The protocol messages sent, watermarks left out (see `watermarks`). */
  protocol(): ControlMessage[] {
    return this.sent.flatMap((m) => (m.kind === "protocol" && m.msg.type !== "watermark" ? [m.msg] : []));
  }
  watermarks(): ToNode[] {
    return this.sent.filter((m) => m.kind === "protocol" && m.msg.type === "watermark");
  }
}

function node(id: string, role: "prefill" | "decode", poolTokens: number): RouterNode & { link: FakeLink } {
  const hello: NodeHello = {
    kind: "hello",
    role,
    poolTokens,
    pageSize: 16,
    maxModelLen: 2048,
    layoutSignature: "x",
    incarnation: role === "prefill" ? 11 : 22,
  };
  return { id, url: `fake:${id}`, hello, link: new FakeLink() };
}

function setup() {
  const p = node("prefill-0", "prefill", 512);
  const d = node("decode-0", "decode", 1024);
  const engine = new DisaggregatedEngine({ prefill: [p], decode: [d], maxModelLen: 2048, safety: SAFE });
  d.link.deliver({ kind: "prefill_up", prefill: "prefill-0" });
  return { p, d, engine };
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** A request; `seed`: its sampling's (the rest greedy, stopping on 9). */
function request(
  rid: number,
  extra: Partial<GenerationRequest> = {},
  seed: number | null = null,
): GenerationRequest {
  return {
    rid,
    tenant: 2,
    promptTokens: Int32Array.from([5, 6, 7]),
    maxTokens: 4,
    sampling: { temperature: 0, topP: 1, topK: 0, seed, stopTokenIds: [9] },
    ...extra,
  };
}

function record() {
  const out = {
    tokens: [] as number[],
    finish: null as string | null,
    error: null as WireError | null,
    events: 0,
  };
  return {
    out,
    events: {
      onTokens: (ids: readonly number[]) => {
        out.events++;
        out.tokens.push(...ids);
      },
      onFinish: (reason: string) => {
        out.events++;
        out.finish = reason;
      },
      onError: (error: WireError) => {
        out.events++;
        out.error = error;
      },
    },
  };
}

const lease = (rid: number) =>
  ({
    type: "lease",
    rid,
    epoch: 1,
    pages: [{ page: 3, generation: 1 }],
    pageSize: 16,
    layoutSignature: "x",
    incarnation: 22,
    writerIncarnation: 11,
  }) as ControlMessage;

test("DisaggregatedEngine admits by the least pool and sends the prompt and sampling with the protocol", () => {
  const { p, d, engine } = setup();
  assert.equal(engine.capacity.maxModelLen, 512);
  const r = record();
  engine.submit(request(16), r.events);
  const reserve = d.link.sent.find((m) => m.kind === "protocol");
  assert.ok(
    reserve?.kind === "protocol" && reserve.msg.type === "reserve" && reserve.sampling?.stopTokenIds[0] === 9,
  );
  d.link.deliver({ kind: "protocol", msg: lease(16) });
  const prefill = p.link.protocol()[0]!;
  assert.ok(prefill.type === "prefill");
  assert.deepEqual(prefill.promptTokens, Int32Array.from([5, 6, 7]));
  d.link.deliver({ kind: "protocol", msg: { type: "committed", rid: 16, epoch: 1, firstToken: 40 } });
  d.link.deliver({ kind: "protocol", msg: { type: "tokens", rid: 16, epoch: 1, tokens: [41] } });
  d.link.deliver({
    kind: "protocol",
    msg: { type: "finished", rid: 16, epoch: 1, reason: "length", tokens: [42, 43], completionTokens: 4 },
  });
  assert.deepEqual(r.out, { tokens: [40, 41, 42, 43], finish: "length", error: null, events: 4 });
  assert.equal(engine.inFlight, 0);
});

test("DisaggregatedEngine streams nothing of a stop token prefill sampled first", () => {
  const { d, engine } = setup();
  const r = record();
  engine.submit(request(16), r.events);
  d.link.deliver({ kind: "protocol", msg: lease(16) });
  d.link.deliver({ kind: "protocol", msg: { type: "committed", rid: 16, epoch: 1, firstToken: 9 } });
  d.link.deliver({
    kind: "protocol",
    msg: { type: "finished", rid: 16, epoch: 1, reason: "stop", tokens: [], completionTokens: 1 },
  });
  assert.deepEqual(r.out, { tokens: [], finish: "stop", error: null, events: 1 });
});

test("DisaggregatedEngine.abort() sends ABORT to decode and silences the request", () => {
  const { d, engine } = setup();
  const r = record();
  engine.submit(request(16), r.events);
  d.link.deliver({ kind: "protocol", msg: lease(16) });
  engine.abort(16);
  assert.deepEqual(d.link.protocol().at(-1), { type: "abort", rid: 16, epoch: 1 });
  d.link.deliver({ kind: "protocol", msg: { type: "committed", rid: 16, epoch: 1, firstToken: 40 } });
  assert.equal(r.out.events, 0);
  assert.equal(engine.inFlight, 0);
});

test("DisaggregatedEngine fails requests with 503 when a pair's transfer channel goes down or a node is lost", () => {
  const { d, engine } = setup();
  const a = record();
  engine.submit(request(16), a.events);
  d.link.deliver({ kind: "protocol", msg: lease(16) });
  d.link.deliver({ kind: "prefill_down", prefill: "prefill-0" });
  assert.equal(a.out.error?.code, "node_unavailable");
  const b = record();
  engine.submit(request(32), b.events);
  assert.equal(b.out.error?.code, "node_unavailable", "no pair is up");

  const { p: p2, d: d2, engine: e2 } = setup();
  const c = record();
  e2.submit(request(48), c.events);
  d2.link.deliver({ kind: "protocol", msg: lease(48) });
  p2.link.die();
  assert.equal(c.out.error?.code, "node_unavailable");
  assert.ok(
    d2.link.sent.some((m) => m.kind === "prefill_lost" && m.prefill === "prefill-0"),
    "decode hears to fence the lost prefill node",
  );
});

test("DisaggregatedEngine passes a node's rejection to the client unchanged", () => {
  const { d, engine } = setup();
  const r = record();
  engine.submit(request(16), r.events);
  const error: WireError = {
    code: "context_length_exceeded",
    message:
      "Prompt of 3 tokens plus max_tokens 4 exceeds the context length: 6; shorten the prompt or lower max_tokens",
    param: "messages",
  };
  d.link.deliver({ kind: "protocol", msg: { type: "rejected", rid: 16, epoch: 1, from: "decode", error } });
  assert.deepEqual(r.out.error, error);
});

const poolFull = (rid: number): FromNode => ({
  kind: "protocol",
  msg: {
    type: "rejected",
    rid,
    epoch: 1,
    from: "decode",
    error: {
      code: "pool_exhausted",
      message: `The decode KV pool has no room for request ${rid} now: 9 pages needed; retry later`,
    },
  },
});

test("DisaggregatedEngine holds a request the full decode pool refused until decode frees pages", () => {
  const { p, d, engine } = setup();
  const r = record();
  engine.submit(request(16), r.events);
  d.link.deliver(poolFull(16));
  assert.equal(r.out.events, 0, "no 503: the request waits");
  assert.equal(engine.waiting, 1);
  assert.equal(engine.inFlight, 1);
  assert.equal(d.link.protocol().length, 1, "nothing is retried before pages free");

  d.link.deliver({ kind: "pages_freed", free: 12 });
  assert.equal(engine.waiting, 0);
  const retry = d.link.protocol().at(-1)!;
  assert.ok(retry.type === "reserve" && retry.rid !== 1, "a fresh attempt under a new internal rid");
  const rid = retry.rid;
  d.link.deliver({ kind: "protocol", msg: lease(rid) });
  const prefill = p.link.protocol().at(-1)!;
  assert.ok(prefill.type === "prefill" && prefill.rid === rid);
  assert.deepEqual(prefill.promptTokens, Int32Array.from([5, 6, 7]));
  d.link.deliver({ kind: "protocol", msg: { type: "committed", rid, epoch: 1, firstToken: 40 } });
  d.link.deliver({
    kind: "protocol",
    msg: { type: "finished", rid, epoch: 1, reason: "length", tokens: [41, 42, 43], completionTokens: 4 },
  });
  assert.deepEqual(r.out, { tokens: [40, 41, 42, 43], finish: "length", error: null, events: 3 });
  assert.equal(engine.inFlight, 0);
});

test("DisaggregatedEngine answers 503 only when its queue is full, and passes the refusal on when it queues nothing", () => {
  const p = node("prefill-0", "prefill", 512);
  const d = node("decode-0", "decode", 1024);
  const engine = new DisaggregatedEngine({
    prefill: [p],
    decode: [d],
    maxModelLen: 2048,
    safety: SAFE,
    fairShare: { tenants: 1, maxQueue: 1 },
  });
  d.link.deliver({ kind: "prefill_up", prefill: "prefill-0" });
  const a = record();
  const b = record();
  engine.submit(request(16), a.events);
  engine.submit(request(32), b.events);
  d.link.deliver(poolFull(16));
  d.link.deliver(poolFull(32));
  assert.equal(a.out.events + b.out.events, 0, "both refused requests wait: they were admitted");
  assert.equal(engine.waiting, 2);
  const c = record();
  engine.submit(request(48), c.events);
  assert.equal(c.out.error?.code, "server_busy", "the queue is full: 503");
  assert.equal(c.out.error?.retryAfter, 1);

  const p0 = node("prefill-0", "prefill", 512);
  const d0 = node("decode-0", "decode", 1024);
  const none = new DisaggregatedEngine({
    prefill: [p0],
    decode: [d0],
    maxModelLen: 2048,
    safety: SAFE,
    fairShare: { tenants: 1, maxQueue: 0 },
  });
  d0.link.deliver({ kind: "prefill_up", prefill: "prefill-0" });
  const r = record();
  none.submit(request(16), r.events);
  d0.link.deliver(poolFull(16));
  assert.equal(r.out.error?.code, "pool_exhausted", "no queue: the refusal reaches the client");
  const s = record();
  none.submit(request(32), s.events);
  assert.equal(s.out.error?.code, "server_busy", "decode is full and nothing may wait");
});

test("DisaggregatedEngine never holds back a request larger than the whole decode pool", () => {
  // Only reachable with the router's door open too wide (the undersized-pool fault): 1,020 prompt
  // tokens + 10 need 65 pages of 16, decode's whole pool is 64.
  const p = node("prefill-0", "prefill", 2048);
  const d = node("decode-0", "decode", 1024);
  const engine = new DisaggregatedEngine({
    prefill: [p],
    decode: [d],
    maxModelLen: 2048,
    safety: makeSafety({ faults: ["undersized-pool"], disabledGuards: ["admission-doors"] }),
  });
  d.link.deliver({ kind: "prefill_up", prefill: "prefill-0" });
  const r = record();
  engine.submit(request(16, { promptTokens: new Int32Array(1020), maxTokens: 10 }), r.events);
  d.link.deliver(poolFull(16));
  assert.equal(r.out.error?.code, "pool_exhausted");
  assert.equal(engine.waiting, 0);
});

test("DisaggregatedEngine drops a waiting request on abort and fails waiting ones when their node goes", () => {
  const { d, engine } = setup();
  const a = record();
  const b = record();
  engine.submit(request(16), a.events);
  engine.submit(request(32), b.events);
  d.link.deliver(poolFull(16));
  d.link.deliver(poolFull(32));
  engine.abort(16);
  assert.equal(engine.waiting, 1);
  assert.equal(a.out.events, 0, "an aborted request is silent");
  d.link.deliver({ kind: "pages_freed", free: 12 });
  const retries = d.link.protocol().filter((m) => m.type === "reserve");
  assert.equal(retries.length, 3, "only the request still waiting is submitted again");
  const c = record();
  engine.submit(request(48), c.events);
  d.link.deliver(poolFull(48));
  assert.equal(engine.waiting, 1);
  d.link.die();
  assert.equal(c.out.error?.code, "node_unavailable");
  assert.equal(engine.waiting, 0);
});

test("DisaggregatedEngine shares the nodes fairly: a tenant's flood waits at its page cap, another tenant's requests go at once", () => {
  const p = node("prefill-0", "prefill", 1024);
  const d = node("decode-0", "decode", 1024);
  const engine = new DisaggregatedEngine({
    prefill: [p],
    decode: [d],
    maxModelLen: 2048,
    safety: SAFE,
    fairShare: { tenants: 2 },
  });
  d.link.deliver({ kind: "prefill_up", prefill: "prefill-0" });
  // 400 prompt tokens + 80: 30 of decode's 64 pages; two tenants: a cap of 32 pages each.
  const big = (rid: number) => request(rid, { tenant: 0, promptTokens: new Int32Array(400), maxTokens: 80 });
  const flood = Array.from({ length: 5 }, () => record());
  for (const [i, r] of flood.entries()) engine.submit(big(16 * (i + 1)), r.events);
  const small = Array.from({ length: 3 }, () => record());
  for (const [i, r] of small.entries()) engine.submit(request(160 + 16 * i, { tenant: 1 }), r.events);
  const reserved = () => d.link.protocol().flatMap((m) => (m.type === "reserve" ? [m.rid] : []));
  assert.deepEqual(reserved(), [16, 160, 176, 192], "one of tenant 0's, then all of tenant 1's");
  assert.equal(engine.fairShare.waitingOf(0), 4);
  assert.equal(engine.fairShare.pagesOf(0), 30);
  // Tenant 0's first request ends: its next one goes.
  d.link.deliver({ kind: "protocol", msg: lease(16) });
  d.link.deliver({ kind: "protocol", msg: { type: "committed", rid: 16, epoch: 1, firstToken: 40 } });
  d.link.deliver({
    kind: "protocol",
    msg: { type: "finished", rid: 16, epoch: 1, reason: "length", tokens: [], completionTokens: 80 },
  });
  assert.equal(flood[0]!.out.finish, "length");
  // Tenant 0's second request goes out under the next rid: attempts leave in serial rid order.
  assert.deepEqual(reserved(), [16, 160, 176, 192, 208]);
});

test("DisaggregatedEngine tells both nodes of a pair its watermark once its requests ended, and again when the pair is back", () => {
  const { p, d, engine } = setup();
  const a = record();
  const b = record();
  engine.submit(request(16), a.events);
  engine.submit(request(32), b.events);
  const finish = (rid: number) => {
    d.link.deliver({ kind: "protocol", msg: { type: "committed", rid, epoch: 1, firstToken: 40 } });
    d.link.deliver({
      kind: "protocol",
      msg: { type: "finished", rid, epoch: 1, reason: "length", tokens: [], completionTokens: 1 },
    });
  };
  for (const rid of [16, 32]) {
    d.link.deliver({ kind: "protocol", msg: lease(rid) });
  }
  finish(32);
  // Request 16 is still in flight: the watermark (16) has not moved.
  assert.deepEqual(d.link.watermarks(), []);
  finish(16);
  const mark = { type: "watermark", rid: 0, epoch: 0, below: 48 };
  assert.deepEqual(d.link.watermarks(), [{ kind: "protocol", prefill: "prefill-0", msg: mark }]);
  // Prefill is told which decode incarnation's machine it is for.
  assert.deepEqual(p.link.watermarks(), [{ kind: "protocol", prefill: "prefill-0", msg: mark, decode: 22 }]);
  // The pair comes up again (a new incarnation of either node): both hear the watermark again.
  engine.pairUp("prefill-0", "decode-0");
  assert.equal(d.link.watermarks().length, 2);
  assert.equal(p.link.watermarks().length, 2);
});

test("DisaggregatedEngine readiness: a node that stops answering pings is not ready and gets no new request until it answers", async () => {
  const p = node("prefill-0", "prefill", 512);
  const d = node("decode-0", "decode", 1024);
  const engine = new DisaggregatedEngine({
    prefill: [p],
    decode: [d],
    maxModelLen: 2048,
    safety: SAFE,
    pingTimeoutMs: 50,
  });
  try {
    assert.equal(engine.health().ready, false, "no transfer channel yet");
    d.link.deliver({ kind: "prefill_up", prefill: "prefill-0" });
    await sleep(300);
    assert.deepEqual(engine.health(), {
      live: true,
      ready: true,
      reason: null,
      prefill: { ready: 1, total: 1 },
      decode: { ready: 1, total: 1 },
    });
    d.link.answers = false;
    await sleep(400);
    const h = engine.health();
    assert.equal(h.ready, false);
    assert.equal(h.reason, "no decode node answers (0 of 1)");
    const r = record();
    engine.submit(request(16), r.events);
    assert.equal(d.link.protocol().length, 0, "nothing is sent to a node that does not answer");
    assert.equal(engine.waiting, 1, "the request waits (no 503: the node may answer again)");
    d.link.answers = true;
    const last = d.link.sent.findLast((m) => m.kind === "ping");
    d.link.deliver({ kind: "pong", id: last?.kind === "ping" ? last.id : -1 });
    assert.equal(engine.health().ready, true);
    assert.equal(d.link.protocol()[0]?.type, "reserve", "sent once the node answers");
  } finally {
    await engine.close();
  }
});

test("DisaggregatedEngine.nodeBack() puts a lost node's new incarnation in its place; its pair serves again once up", () => {
  const { p, d, engine } = setup();
  p.link.die();
  assert.equal(engine.health().ready, false);
  const refused = record();
  engine.submit(request(16), refused.events);
  assert.equal(refused.out.error?.code, "node_unavailable");
  const back = node("prefill-0", "prefill", 512);
  const wrong = node("prefill-0", "decode", 512);
  assert.match(engine.nodeBack(wrong) ?? "", /decode node now/);
  assert.equal(engine.nodeBack({ ...back, hello: { ...back.hello, incarnation: 99 } }), null);
  assert.equal(engine.nodeBack(back), "node prefill-0 is not lost");
  assert.equal(engine.currentNodes[0]!.hello.incarnation, 99);
  assert.equal(engine.health().ready, false, "the pair is down until decode's channel is up");
  d.link.deliver({ kind: "prefill_up", prefill: "prefill-0" });
  const r = record();
  engine.submit(request(32), r.events);
  d.link.deliver({ kind: "protocol", msg: lease(32) });
  assert.equal(back.link.protocol()[0]?.type, "prefill", "the prompt goes to the new incarnation");
  p.link.deliver({ kind: "pong", id: 1 }); // the old link's messages are ignored
  void engine.close();
});

test("DisaggregatedEngine runs a request again on another pair when its node is lost before the first token, never after", () => {
  const p = node("prefill-0", "prefill", 512);
  const d0 = node("decode-0", "decode", 1024);
  const d1 = node("decode-1", "decode", 1024);
  const engine = new DisaggregatedEngine({ prefill: [p], decode: [d0, d1], maxModelLen: 2048, safety: SAFE });
  for (const d of [d0, d1]) d.link.deliver({ kind: "prefill_up", prefill: "prefill-0" });
  const moved = record();
  engine.submit(request(16), moved.events);
  assert.equal(d0.link.protocol().length, 1, "the first pair is (prefill-0, decode-0)");
  d0.link.deliver({ kind: "protocol", msg: lease(16) });
  d0.link.die();
  assert.equal(moved.out.events, 0, "no 503: it runs again");
  const retry = d1.link.protocol().at(-1)!;
  assert.ok(retry.type === "reserve" && retry.rid !== 1, "a fresh attempt on the other pair");
  d1.link.deliver({ kind: "protocol", msg: lease(retry.rid) });
  d1.link.deliver({ kind: "protocol", msg: { type: "committed", rid: retry.rid, epoch: 1, firstToken: 40 } });
  // Streaming now: a loss after the first token ends the request with 503.
  d1.link.die();
  assert.deepEqual(moved.out.tokens, [40]);
  assert.equal(moved.out.error?.code, "node_unavailable");
  assert.equal(engine.inFlight, 0);
});

test("DisaggregatedEngine hands each request to the pair its pairPolicy picks", () => {
  const p0 = node("prefill-0", "prefill", 512);
  const p1 = node("prefill-1", "prefill", 512);
  const d = node("decode-0", "decode", 1024);
  const offered: string[][] = [];
  const engine = new DisaggregatedEngine({
    prefill: [p0, p1],
    decode: [d],
    maxModelLen: 2048,
    safety: SAFE,
    pairPolicy: {
      pick: (candidates) => {
        offered.push(candidates.map((c) => c.key));
        return candidates.at(-1) ?? null;
      },
    },
  });
  for (const prefill of ["prefill-0", "prefill-1"]) d.link.deliver({ kind: "prefill_up", prefill });
  engine.submit(request(16), record().events);
  assert.deepEqual(offered, [["prefill-0|decode-0", "prefill-1|decode-0"]]);
  const reserve = d.link.sent.find((m) => m.kind === "protocol" && m.msg.type === "reserve");
  assert.ok(reserve?.kind === "protocol" && reserve.prefill === "prefill-1", "the pair the policy picked");
});

test("DisaggregatedEngine hands out rids after its nodes' rid floor (a restarted router never reuses an older one's rids)", () => {
  const p = node("prefill-0", "prefill", 512);
  const d = node("decode-0", "decode", 1024);
  const engine = new DisaggregatedEngine({
    prefill: [p],
    decode: [{ ...d, hello: { ...d.hello, ridFloor: 512 } }],
    maxModelLen: 2048,
    safety: SAFE,
  });
  d.link.deliver({ kind: "prefill_up", prefill: "prefill-0" });
  engine.submit(request(16), record().events);
  engine.submit(request(14400), record().events);
  // A client rid of another router slot (0 is this router's) is never taken as it is.
  engine.submit(request(14401), record().events);
  assert.deepEqual(
    d.link.protocol().map((m) => m.rid),
    [512, 14400, 14416],
  );
});

test("DisaggregatedEngine runs n > 1 as one group: one reserve naming the samples, each sample's tokens to its own events; a refused group waits and goes again whole", () => {
  const { p, d, engine } = setup();
  const rs = [record(), record(), record()];
  // Client rids of this router's slot (0): 16, 32, 48; a group's samples take the next ones.
  engine.submit(request(16, { samples: [32, 48] }, 7), rs[0]!.events);
  assert.equal(d.link.protocol().length, 0, "the group waits for its samples");
  engine.submit(request(32, { sample: { of: 16, index: 1 } }, 8), rs[1]!.events);
  engine.submit(request(48, { sample: { of: 16, index: 2 } }, 9), rs[2]!.events);
  const first = d.link.protocol();
  assert.equal(first.length, 1, "one reserve for the three samples");
  assert.ok(first[0]!.type === "reserve");
  assert.deepEqual(first[0]!.samples, [32, 48]);
  // Decode's pool is full: the whole group waits, and nobody hears of it.
  d.link.deliver(poolFull(16));
  assert.deepEqual(
    rs.map((r) => r.out.events),
    [0, 0, 0],
  );
  assert.equal(engine.inFlight, 3);
  d.link.deliver({ kind: "pages_freed", free: 40 });
  const retry = d.link.protocol().at(-1)!;
  assert.ok(retry.type === "reserve" && retry.rid !== 16);
  const rid = retry.rid;
  assert.deepEqual(retry.samples, [rid + 16, rid + 32], "the samples take the slot's rids after the group's");
  const reserveEnvelope = d.link.sent.at(-1)!;
  assert.ok(reserveEnvelope.kind === "protocol");
  assert.deepEqual(reserveEnvelope.sampling?.sampleSeeds, [8, 9]);
  d.link.deliver({ kind: "protocol", msg: lease(rid) });
  const prefill = p.link.protocol().at(-1)!;
  assert.ok(prefill.type === "prefill" && prefill.rid === rid);
  // Decode's commit forks the samples: each committed, decoded and finished on its own.
  for (const [j, r] of [rid, rid + 16, rid + 32].entries()) {
    d.link.deliver({ kind: "protocol", msg: { type: "committed", rid: r, epoch: 1, firstToken: 40 + j } });
  }
  for (const [j, r] of [rid, rid + 16, rid + 32].entries()) {
    d.link.deliver({
      kind: "protocol",
      msg: { type: "finished", rid: r, epoch: 1, reason: "length", tokens: [50 + j], completionTokens: 2 },
    });
  }
  assert.deepEqual(
    rs.map((r) => r.out),
    [0, 1, 2].map((j) => ({ tokens: [40 + j, 50 + j], finish: "length", error: null, events: 3 })),
  );
  assert.equal(engine.inFlight, 0);
  assert.equal(engine.waiting, 0);
});

test("DisaggregatedEngine sends the samples of a group too large for a decode pool alone, each its own request", () => {
  const { d, engine } = setup();
  const rs = [record(), record(), record()];
  // 3 samples of prompt 3 + max_tokens 500: 32 pages each, 96 together, over decode's 64.
  engine.submit(request(16, { maxTokens: 500, samples: [32, 48] }), rs[0]!.events);
  engine.submit(request(32, { maxTokens: 500, sample: { of: 16, index: 1 } }), rs[1]!.events);
  engine.submit(request(48, { maxTokens: 500, sample: { of: 16, index: 2 } }), rs[2]!.events);
  const reserves = d.link.protocol().filter((m) => m.type === "reserve");
  assert.deepEqual(
    reserves.map((m) => (m.type === "reserve" ? [m.rid, m.samples ?? null] : [])),
    [
      [16, null],
      [32, null],
    ],
    "one at a time as the ledger has room (two fit the pool), none as a group",
  );
  assert.equal(engine.inFlight, 3);
});
