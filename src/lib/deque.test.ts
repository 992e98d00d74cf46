import assert from "node:assert/strict";
import { test } from "node:test";
import fc from "fast-check";
import { Deque } from "./deque.js";

test("Deque keeps FIFO order from the back and LIFO from the front, across growth and wrap-around", () => {
  const d = new Deque<number>(2);
  for (let i = 0; i < 5; i++) d.pushBack(i);
  d.pushFront(-1);
  assert.equal(d.popFront(), -1);
  assert.equal(d.popFront(), 0);
  d.pushBack(5);
  d.pushFront(-2);
  assert.deepEqual([...d], [-2, 1, 2, 3, 4, 5]);
  assert.equal(d.peekFront(), -2);
  assert.equal(d.at(5), 5);
  assert.equal(d.at(6), undefined);
  assert.equal(d.length, 6);
});

test("Deque.remove() takes one element out of the middle and keeps the order", () => {
  const d = new Deque<string>(4);
  for (const s of ["a", "b", "c", "d"]) d.pushBack(s);
  d.popFront();
  d.pushBack("e"); // wraps around
  assert.equal(d.remove("c"), true);
  assert.equal(d.remove("x"), false);
  assert.deepEqual([...d], ["b", "d", "e"]);
  assert.equal(d.popFront(), "b");
  assert.equal(d.popFront(), "d");
  assert.equal(d.popFront(), "e");
  assert.equal(d.popFront(), undefined);
  assert.equal(d.peekFront(), undefined);
});

test("Deque behaves as an array with push/unshift/shift/splice under random operations (fast-check)", () => {
  const op = fc.oneof(
    fc.record({ k: fc.constant("pushBack" as const), v: fc.integer() }),
    fc.record({ k: fc.constant("pushFront" as const), v: fc.integer() }),
    fc.record({ k: fc.constant("popFront" as const) }),
    fc.record({ k: fc.constant("remove" as const), v: fc.integer({ min: -3, max: 3 }) }),
  );
  fc.assert(
    fc.property(fc.array(op, { maxLength: 200 }), (ops) => {
      const d = new Deque<number>(1);
      const model: number[] = [];
      for (const o of ops) {
        if (o.k === "pushBack") {
          d.pushBack(o.v);
          model.push(o.v);
        } else if (o.k === "pushFront") {
          d.pushFront(o.v);
          model.unshift(o.v);
        } else if (o.k === "popFront") {
          assert.equal(d.popFront(), model.shift());
        } else {
          const i = model.indexOf(o.v);
          assert.equal(d.remove(o.v), i >= 0);
          if (i >= 0) model.splice(i, 1);
        }
        assert.equal(d.length, model.length);
        assert.equal(d.peekFront(), model[0]);
      }
      assert.deepEqual([...d], model);
    }),
  );
});
