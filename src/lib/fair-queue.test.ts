import assert from "node:assert/strict";
import { test } from "node:test";
import fc from "fast-check";
import { FairQueue } from "./fair-queue.js";

interface Item {
  readonly flow: number;
  readonly n: number;
  readonly cost: number;
}

function queue(weight?: (flow: number) => number) {
  return new FairQueue<Item>({
    flow: (i) => i.flow,
    cost: (i) => i.cost,
    ...(weight === undefined ? {} : { weight }),
  });
}

function drain(q: FairQueue<Item>, eligible?: (flow: number, front: Item) => boolean): Item[] {
  const out: Item[] = [];
  for (;;) {
    const item = q.peek(eligible);
    if (item === undefined) return out;
    assert.equal(q.take(), item);
    out.push(item);
  }
}

const items = (flow: number, count: number, cost = 1): Item[] =>
  Array.from({ length: count }, (_, n) => ({ flow, n, cost }));

test("FairQueue with one flow is FIFO", () => {
  const q = queue();
  for (const i of items(7, 5)) q.push(i);
  assert.deepEqual(
    drain(q).map((i) => i.n),
    [0, 1, 2, 3, 4],
  );
  assert.equal(q.length, 0);
});

test("FairQueue: a flow's backlog of 100 delays another flow's items by one item at most", () => {
  const q = queue();
  for (const i of items(0, 100)) q.push(i);
  assert.equal(q.peek()?.flow, 0);
  q.take();
  // one of flow 0's items is served, then flow 1 arrives
  for (const i of items(1, 3)) q.push(i);
  const order = drain(q).map((i) => i.flow);
  assert.deepEqual(order.slice(0, 7), [0, 1, 0, 1, 0, 1, 0]);
  assert.equal(order.length, 102);
});

test("FairQueue in arrival order: one queue over flows (fcfs), a flow skipped by `eligible` keeps its places", () => {
  const q = new FairQueue<Item>({ flow: (i) => i.flow, cost: (i) => i.cost, order: "arrival" });
  for (const i of items(0, 100)) q.push(i);
  q.peek();
  q.take();
  for (const i of items(1, 3)) q.push(i);
  const order = drain(q).map((i) => i.flow);
  assert.deepEqual(order.slice(0, 99), new Array(99).fill(0), "flow 1 waits behind all of flow 0");
  assert.deepEqual(order.slice(99), [1, 1, 1]);

  for (const i of [...items(0, 2, 50), ...items(1, 2, 1), ...items(0, 1, 50)]) q.push(i);
  const skipped = drain(q, (flow) => flow === 1).map((i) => `${i.flow}:${i.n}`);
  assert.deepEqual(skipped, ["1:0", "1:1"]);
  assert.deepEqual(
    drain(q).map((i) => `${i.flow}:${i.n}`),
    ["0:0", "0:1", "0:0"],
  );
});

test("FairQueue serves flows by cost: one 10-page item against ten 1-page ones", () => {
  const q = queue();
  for (const i of items(0, 5, 10)) q.push(i);
  for (const i of items(1, 30, 1)) q.push(i);
  const order = drain(q).map((i) => i.flow);
  // Ties (the 10th small item against the large one) go to the item pushed first.
  assert.deepEqual(order.slice(0, 21), [...Array(9).fill(1), 0, ...Array(10).fill(1), 0]);
});

test("FairQueue weights: a flow of weight 2 gets twice the service", () => {
  const q = queue((f) => (f === 1 ? 2 : 1));
  for (const i of items(0, 10)) q.push(i);
  for (const i of items(1, 10)) q.push(i);
  assert.deepEqual(
    drain(q)
      .slice(0, 9)
      .map((i) => i.flow),
    [1, 0, 1, 1, 0, 1, 1, 0, 1],
  );
});

test("FairQueue skips an ineligible flow, and peek does not remove", () => {
  const q = queue();
  for (const i of items(0, 3)) q.push(i);
  for (const i of items(1, 3)) q.push(i);
  const onlyOne = (flow: number) => flow === 1;
  assert.equal(q.peek(onlyOne)?.flow, 1);
  assert.equal(q.peek(onlyOne)?.flow, 1, "peek twice: the same item");
  assert.deepEqual(
    drain(q, onlyOne).map((i) => i.flow),
    [1, 1, 1],
  );
  assert.equal(
    q.peek(() => false),
    undefined,
  );
  assert.equal(q.length, 3);
  assert.deepEqual(
    drain(q).map((i) => `${i.flow}:${i.n}`),
    ["0:0", "0:1", "0:2"],
  );
  assert.throws(() => q.take(), /without a peek/);
});

test("FairQueue.pushFront() puts a returned item first in its flow; remove() takes one out", () => {
  const q = queue();
  const [a0, a1, a2] = items(0, 3, 4);
  q.push(a0!);
  q.push(a1!);
  q.push(a2!);
  assert.equal(q.peek(), a0);
  q.take();
  q.pushFront(a0!);
  assert.equal(q.peek(), a0, "the returned item goes first");
  assert.equal(q.remove(a1!), true);
  assert.equal(q.remove(a1!), false);
  assert.deepEqual(drain(q), [a0, a2]);
  assert.equal(q.lengthOf(0), 0);
  assert.equal(q.flows, 0);
});

test("FairQueue keeps each flow FIFO and, while two flows stay backlogged, their service within the two largest costs (random operations)", () => {
  const Q = 8;
  fc.assert(
    fc.property(
      fc.array(
        fc.oneof(
          fc.record({
            op: fc.constant("push" as const),
            flow: fc.integer({ min: 0, max: 3 }),
            cost: fc.integer({ min: 0, max: 12 }),
          }),
          fc.record({ op: fc.constant("take" as const) }),
          fc.record({ op: fc.constant("remove" as const), pick: fc.nat() }),
        ),
        { maxLength: 200 },
      ),
      (ops) => {
        const q = queue();
        const model = new Map<number, Item[]>();
        let n = 0;
        for (const o of ops) {
          if (o.op === "push") {
            const item = { flow: o.flow, n: n++, cost: o.cost };
            q.push(item);
            model.set(o.flow, [...(model.get(o.flow) ?? []), item]);
          } else if (o.op === "take") {
            const item = q.peek();
            const total = [...model.values()].reduce((s, l) => s + l.length, 0);
            assert.equal(item === undefined, total === 0);
            if (item === undefined) continue;
            q.take();
            const list = model.get(item.flow)!;
            assert.equal(list[0], item, "each flow is served in its own order");
            list.shift();
          } else {
            const all = [...model.values()].flat();
            if (all.length === 0) continue;
            const item = all[o.pick % all.length]!;
            assert.equal(q.remove(item), true);
            const list = model.get(item.flow)!;
            list.splice(list.indexOf(item), 1);
          }
          assert.equal(
            q.length,
            [...model.values()].reduce((s, l) => s + l.length, 0),
          );
        }
      },
    ),
  );
  // The fair-queuing bound: two flows backlogged throughout get service within the two largest costs.
  fc.assert(
    fc.property(
      fc.array(fc.integer({ min: 1, max: Q }), { minLength: 50, maxLength: 50 }),
      fc.array(fc.integer({ min: 1, max: Q }), { minLength: 50, maxLength: 50 }),
      (costsA, costsB) => {
        const q = queue();
        for (const [i, cost] of costsA.entries()) q.push({ flow: 0, n: i, cost });
        for (const [i, cost] of costsB.entries()) q.push({ flow: 1, n: i, cost });
        const served = [0, 0];
        const left = [50, 50];
        while (left[0]! > 0 && left[1]! > 0) {
          const item = q.peek()!;
          q.take();
          served[item.flow]! += item.cost;
          left[item.flow]!--;
          assert.ok(Math.abs(served[0]! - served[1]!) <= 2 * Q, `service ${served} apart by more than 2Q`);
        }
      },
    ),
  );
});
