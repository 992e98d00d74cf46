import assert from "node:assert/strict";
import { test } from "node:test";
import type { WireError } from "../lib/errors.js";
import { FairShare, type FairShareConfig, resolveFairShare } from "./fair-share.js";

interface Req {
  readonly tenant: number;
  readonly n: number;
  readonly pages: number;
  /** One of an HTTP request's several generations. */
  readonly group?: { readonly first: number; readonly size: number };
}

/** A backend with `slots` places; it records what started and what expired. */
function setup(config: Partial<FairShareConfig> & { tenants: number }, slots = 4, clock = { now: 0 }) {
  const started: Req[] = [];
  const expired: { req: Req; error: WireError }[] = [];
  let room = slots;
  const share = new FairShare<Req>(
    resolveFairShare(config, { pages: 100, slots }),
    {
      tenant: (r) => r.tenant,
      pages: (r) => r.pages,
      group: (r) => r.group,
      dispatch: (r) => {
        if (room === 0) return false;
        room--;
        started.push(r);
        return true;
      },
      expire: (req, error) => expired.push({ req, error }),
    },
    { now: () => clock.now },
  );
  const end = (r: Req): void => {
    room++;
    share.finished(r);
  };
  /** The backend refused `r` after all (no room for it there): its slot frees, it goes back. */
  const refuse = (r: Req): boolean => {
    room++;
    return share.returned(r);
  };
  return { share, started, expired, end, refuse, clock };
}

const req = (tenant: number, n: number, pages = 1): Req => ({ tenant, n, pages });

/** The `size` generations of one HTTP request (`first`: its first rid), each of `pages` pages. */
const group = (tenant: number, first: number, size: number, pages = 1): Req[] =>
  Array.from({ length: size }, (_, j) => ({ tenant, n: first + j, pages, group: { first, size } }));

test("FairShare: a flood of one tenant leaves room for another, whose requests start at once", () => {
  const { share, started } = setup({ tenants: 2 }, 8);
  for (let n = 0; n < 100; n++) assert.equal(share.offer(req(0, n)), null);
  assert.equal(started.length, 4, "tenant 0 holds half the slots, its default cap");
  assert.equal(share.waiting, 96);
  for (let n = 0; n < 4; n++) assert.equal(share.offer(req(1, n)), null);
  assert.deepEqual(
    started.slice(4).map((r) => r.tenant),
    [1, 1, 1, 1],
    "tenant 1 is not behind tenant 0's queue",
  );
});

test("FairShare serves waiting tenants in turn when the backend frees room", () => {
  const { share, started, end } = setup({ tenants: 2, tenantMaxConcurrency: 0 }, 2);
  for (let n = 0; n < 10; n++) share.offer(req(0, n));
  for (let n = 0; n < 3; n++) share.offer(req(1, n));
  assert.deepEqual(
    started.map((r) => r.tenant),
    [0, 0],
  );
  for (let i = 0; i < 6; i++) end(started[i]!);
  assert.deepEqual(
    started.slice(2).map((r) => `${r.tenant}:${r.n}`),
    ["0:2", "1:0", "0:3", "1:1", "0:4", "1:2"],
  );
});

test("FairShare with --scheduling-policy fcfs serves in arrival order across tenants; the caps still apply", () => {
  const order = (policy: "fair" | "fcfs"): string[] => {
    const { share, started, end } = setup(
      { tenants: 2, tenantMaxConcurrency: 0, schedulingPolicy: policy },
      2,
    );
    for (let n = 0; n < 10; n++) share.offer(req(0, n));
    for (let n = 0; n < 3; n++) share.offer(req(1, n));
    for (let i = 0; i < 8; i++) end(started[i]!);
    return started.slice(2).map((r) => `${r.tenant}:${r.n}`);
  };
  assert.deepEqual(order("fair"), ["0:2", "1:0", "0:3", "1:1", "0:4", "1:2", "0:5", "0:6"]);
  assert.deepEqual(order("fcfs"), ["0:2", "0:3", "0:4", "0:5", "0:6", "0:7", "0:8", "0:9"]);
  assert.equal(resolveFairShare({ tenants: 2 }, { pages: 100, slots: 2 }).policy, "fair");

  // A tenant at its cap is passed over; its requests keep their places for when it has room.
  const { share, started, end } = setup({ tenants: 2, tenantMaxConcurrency: 1, schedulingPolicy: "fcfs" }, 2);
  for (let n = 0; n < 3; n++) share.offer(req(0, n));
  share.offer(req(1, 0));
  share.offer(req(1, 1));
  assert.deepEqual(
    started.map((r) => `${r.tenant}:${r.n}`),
    ["0:0", "1:0"],
  );
  end(started[1]!); // tenant 1 has room again; tenant 0 is still at its cap of 1
  end(started[0]!);
  end(started[3]!);
  assert.deepEqual(
    started.map((r) => `${r.tenant}:${r.n}`),
    ["0:0", "1:0", "1:1", "0:1", "0:2"],
  );
});

test("FairShare caps a tenant's pages; a tenant with nothing running may still start one larger request", () => {
  const { share, started, end } = setup({ tenants: 1, tenantMaxPages: 15 }, 8);
  share.offer(req(0, 0, 10));
  share.offer(req(0, 1, 10));
  assert.equal(started.length, 1, "10 + 10 pages are over the cap of 15");
  end(started[0]!);
  assert.equal(started.length, 2);
  const { share: s2, started: st2 } = setup({ tenants: 1, tenantMaxPages: 5 }, 8);
  s2.offer(req(0, 0, 10));
  assert.equal(st2.length, 1, "alone, a request over the cap runs (one at a time)");
  assert.equal(share.pagesOf(0), 10);
  assert.equal(share.runningOf(0), 1);
});

test("FairShare refuses with 429 a tenant over its share of the queue, with 503 only when the server is full", () => {
  const { share } = setup({ tenants: 2, maxQueue: 6, tenantMaxQueue: 4, tenantMaxConcurrency: 1 }, 2);
  // Each tenant runs one request (its cap) and queues the rest.
  for (let n = 0; n < 5; n++) assert.equal(share.offer(req(0, n)), null);
  const over = share.offer(req(0, 5));
  assert.equal(over?.code, "rate_limit_exceeded", "tenant 0 has 4 waiting, its limit");
  assert.equal(over?.retryAfter, 1);
  assert.match(over!.message, /waiting: 4 \(its limit is 4\)/);
  for (let n = 0; n < 3; n++) assert.equal(share.offer(req(1, n)), null);
  assert.equal(share.waiting, 6, "the whole queue is full");
  assert.equal(share.offer(req(0, 6))?.code, "rate_limit_exceeded", "tenant 0 holds 4 of 6: over its share");
  const full = share.offer(req(2, 0));
  assert.equal(full?.code, "server_busy", "tenant 2 holds nothing: the server is full");
  assert.equal(full?.retryAfter, 1);
});

test("FairShare ends a request waiting past the queue timeout: 429 behind its own tenant, 503 when the server was full", () => {
  const clock = { now: 0 };
  const { share, expired, started } = setup(
    { tenants: 2, queueTimeoutMs: 1000, tenantMaxConcurrency: 1 },
    2,
    clock,
  );
  share.offer(req(0, 0));
  share.offer(req(0, 1));
  share.offer(req(1, 0));
  share.offer(req(2, 0)); // both slots are taken: waits for the server
  assert.equal(started.length, 2);
  clock.now = 999;
  share.expireWaiting();
  assert.equal(expired.length, 0);
  clock.now = 1000;
  share.expireWaiting();
  assert.deepEqual(
    expired.map((e) => `${e.req.tenant}:${e.error.code}`),
    ["0:rate_limit_exceeded", "2:queue_timeout"],
  );
  assert.ok(expired.every((e) => e.error.retryAfter === 1));
  assert.match(expired[1]!.error.message, /waited 1 s for room on the server/);
  assert.equal(share.waiting, 0);
});

test("FairShare.returned() puts a refused request first in its tenant's line; cancel() and close() end waiting ones", () => {
  const { share, started, expired, end, refuse } = setup({ tenants: 1 }, 1);
  const a = req(0, 0);
  const b = req(0, 1);
  share.offer(a);
  share.offer(b);
  assert.deepEqual(started, [a]);
  assert.equal(refuse(a), true);
  assert.equal(share.waiting, 2);
  share.pump();
  assert.deepEqual(started, [a, a], "the returned request goes first");
  assert.equal(share.cancel(b), true);
  assert.equal(share.cancel(b), false);
  end(a);
  assert.equal(share.running, 0);
  share.offer(req(0, 2));
  share.offer(req(0, 3));
  share.close({ code: "node_unavailable", message: "closing" });
  assert.deepEqual(
    expired.map((e) => e.req.n),
    [3],
  );
  assert.equal(share.offer(req(0, 4))?.code, "node_unavailable");
  const none = setup({ tenants: 1, maxQueue: 0 }, 1);
  none.share.offer(req(0, 0));
  assert.equal(none.share.offer(req(0, 1))?.code, "server_busy", "a server that queues nothing refuses");
  assert.equal(none.refuse(none.started[0]!), false, "and ends a refused request");
});

test("resolveFairShare: half the backend per tenant with two or more tenants, no cap with one, flags and overrides win", () => {
  const capacity = { pages: 600, slots: 16 };
  const two = resolveFairShare({ tenants: 2 }, capacity);
  assert.deepEqual(two.limits(0), { maxConcurrency: 8, maxPages: 300, maxQueue: 128, weight: 1 });
  assert.equal(two.maxQueue, 256);
  assert.equal(two.queueTimeoutMs, 30_000);
  const one = resolveFairShare({ tenants: 1 }, capacity).limits(0);
  assert.equal(one.maxConcurrency, Number.POSITIVE_INFINITY);
  assert.equal(one.maxPages, Number.POSITIVE_INFINITY);
  const small = resolveFairShare({ tenants: 2 }, { pages: 1, slots: 1 }).limits(0);
  assert.deepEqual(
    [small.maxConcurrency, small.maxPages],
    [1, 1],
    "at least one (and one request always may run)",
  );
  const set = resolveFairShare(
    {
      tenants: 3,
      tenantMaxConcurrency: 0,
      tenantMaxPages: 50,
      overrides: new Map([[2, { maxConcurrency: 3, weight: 2, maxPages: 0 }]]),
    },
    capacity,
  );
  assert.deepEqual(set.limits(0), {
    maxConcurrency: Number.POSITIVE_INFINITY,
    maxPages: 50,
    maxQueue: 128,
    weight: 1,
  });
  assert.deepEqual(set.limits(2), {
    maxConcurrency: 3,
    maxPages: Number.POSITIVE_INFINITY,
    maxQueue: 128,
    weight: 2,
  });
});

test("FairShare.offer() admits a group whole: it waits until every generation fits its tenant's cap, then all start", () => {
  const { share, started, end } = setup({ tenants: 2 }, 8); // two tenants: a cap of 4 each
  share.offer(req(0, 0));
  share.offer(req(0, 1));
  const three = group(0, 10, 3);
  for (const r of three) assert.equal(share.offer(r), null);
  assert.equal(started.length, 2, "2 running + 3 are over the cap of 4: none of the group starts");
  assert.equal(share.waitingOf(0), 3);
  assert.equal(share.runningOf(0), 2);
  end(started[0]!);
  assert.deepEqual(started.slice(2), three, "with room for all three, they start together");
  assert.equal(share.runningOf(0), 4);
  assert.equal(share.waiting, 0);
});

test("FairShare.offer() refuses at once a group that could never run at once: its tenant's concurrency, pages, the pool", () => {
  const { share, started, expired } = setup({ tenants: 2 }, 8); // caps: 4 requests, 50 pages
  const five = group(0, 1, 5);
  for (const r of five.slice(0, 4)) assert.equal(share.offer(r), null, "held until the group is complete");
  const refusal = share.offer(five[4]!);
  assert.equal(refusal?.code, "request_exceeds_capacity");
  assert.equal(refusal?.param, "n");
  assert.equal(refusal?.retryAfter, undefined, "not a retryable refusal");
  assert.match(refusal!.message, /5 generations .*at once.*: 5 > 4; lower n to at most 4/);
  assert.deepEqual(
    expired.map((e) => [e.req, e.error]),
    five.slice(0, 4).map((r) => [r, refusal]),
    "the others of the group get the same refusal",
  );
  assert.equal(started.length, 0, "nothing of it ran");
  assert.equal(share.waiting, 0);

  const pages = group(1, 10, 2, 30);
  share.offer(pages[0]!);
  assert.match(
    share.offer(pages[1]!)!.message,
    /may hold 60 KV pages .*tenant may hold at once.*: 60 > 50 pages; lower n or max_tokens/,
  );
  const pool = setup({ tenants: 1 }, 8); // no tenant caps; the pool holds 100 pages
  const big = group(0, 1, 2, 60);
  pool.share.offer(big[0]!);
  assert.match(pool.share.offer(big[1]!)!.message, /the server's KV pool holds: 120 > 100 pages/);
  assert.equal(pool.share.offer(req(0, 9, 100)), null, "a single request keeps its rule: alone, it runs");
});

test("FairShare: the generations of an admitted group that the backend has no room for wait first, never expired", () => {
  const clock = { now: 0 };
  const { share, started, expired, end } = setup({ tenants: 1, queueTimeoutMs: 1000 }, 2, clock);
  const three = group(0, 1, 3);
  for (const r of three) share.offer(r);
  const other = req(0, 9);
  share.offer(other);
  assert.deepEqual(started, three.slice(0, 2), "the backend has room for two");
  assert.equal(share.runningOf(0), 3, "the third holds its share, admitted");
  assert.equal(share.isWaiting(three[2]!), true);
  clock.now = 5000;
  share.expireWaiting();
  assert.deepEqual(
    expired.map((e) => e.req),
    [other],
    "only the request in the queue times out",
  );
  end(three[0]!);
  assert.deepEqual(started, three, "the admitted one goes first when room frees");
  end(three[1]!);
  end(three[2]!);
  assert.equal(share.runningOf(0), 0);

  // A dispatched generation of a group that the backend gives back keeps its share; cancel frees it.
  const b = setup({ tenants: 1 }, 2);
  const two = group(0, 1, 2);
  for (const r of two) b.share.offer(r);
  assert.equal(b.refuse(two[1]!), true);
  assert.equal(b.share.runningOf(0), 2);
  assert.equal(b.share.cancel(two[1]!), true);
  assert.equal(b.share.runningOf(0), 1);
  assert.equal(b.share.cancel(two[1]!), false);
});

test("FairShare.cancel() takes a generation out of a group still coming, which then waits for one fewer", () => {
  const { share, started } = setup({ tenants: 1 }, 8);
  const three = group(0, 1, 3);
  share.offer(three[0]!);
  share.offer(three[1]!);
  assert.equal(share.cancel(three[1]!), true);
  share.offer(three[2]!);
  assert.deepEqual(started, [three[0], three[2]]);
  const gone = group(0, 10, 2);
  share.offer(gone[0]!);
  assert.equal(share.cancel(gone[0]!), true);
  share.close({ code: "node_unavailable", message: "closing" });
});
