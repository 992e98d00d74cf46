/**
 * The role policy's rule (`RolePolicy.decide`) and the roles' load it reads (`RoleLoadMeter.read`),
 * over synthetic numbers: no clock, no timing.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { NB, PHASE, PHASES } from "../lib/phase-recorder.js";
import type { NodeStats } from "../links/node-messages.js";
import type { NodeAnswer } from "./node-stats.js";
import type { RoleLoad, RolesLoad } from "./role-load.js";
import { RoleLoadMeter } from "./role-load.js";
import { DEFAULT_ROLE_POLICY, RolePolicy } from "./role-policy.js";

const role = (nodes: number, waiting: number, waitSeconds = 0): RoleLoad => ({
  nodes,
  waiting,
  running: 0,
  waitSeconds,
  poolUsed: 0,
});
const load = (prefill: RoleLoad, decode: RoleLoad): RolesLoad => ({ prefill, decode });
/** Decode pressed (6 waiting per node), prefill slack (nothing waiting, 2 nodes). */
const decodePressed = load(role(2, 0), role(1, 6));
const calm = load(role(2, 1), role(1, 1));

test("RolePolicy.decide() moves one slack node to the pressed role after `streak` reads in a row, then waits `cooldown` reads", () => {
  const policy = new RolePolicy();
  assert.equal(policy.decide(decodePressed), null);
  assert.equal(policy.decide(decodePressed), null);
  assert.deepEqual(policy.decide(decodePressed), { from: "prefill", to: "decode" });
  // The cooldown: the same pressure asks nothing for 10 reads (the switched node joins meanwhile).
  for (let i = 0; i < DEFAULT_ROLE_POLICY.cooldown; i++)
    assert.equal(policy.decide(decodePressed), null, `read ${i} of the cooldown`);
  assert.deepEqual(policy.decide(decodePressed), { from: "prefill", to: "decode" });
});

test("RolePolicy.decide() asks nothing when the pressure does not hold `streak` reads in a row, or flips direction", () => {
  const policy = new RolePolicy();
  const prefillPressed = load(role(1, 0, 2), role(2, 0));
  const sequence = [
    decodePressed,
    decodePressed,
    calm,
    decodePressed,
    decodePressed,
    prefillPressed,
    prefillPressed,
  ];
  for (const read of sequence) assert.equal(policy.decide(read), null);
  assert.deepEqual(
    policy.decide(prefillPressed),
    { from: "decode", to: "prefill" },
    "pressed by its wait (2 s)",
  );
});

test("RolePolicy.decide() never takes a role's last node, nor a node of a role that is not slack", () => {
  const policy = new RolePolicy();
  // Prefill has one node only: it stays.
  for (let i = 0; i < 20; i++) assert.equal(policy.decide(load(role(1, 0), role(1, 50))), null);
  // Between slack and pressed (1 waiting per node): no move either.
  for (let i = 0; i < 20; i++) assert.equal(policy.decide(load(role(2, 2), role(1, 50))), null);
  // Waits too long on prefill (0.5 s > 0.1 s): not slack.
  for (let i = 0; i < 20; i++) assert.equal(policy.decide(load(role(2, 0, 0.5), role(1, 50))), null);
});

function answer(id: string, r: "prefill" | "decode", incarnation: number, s: Partial<NodeStats>): NodeAnswer {
  const hello = {
    kind: "hello" as const,
    role: r,
    incarnation,
    poolTokens: 1600,
    pageSize: 16,
    maxModelLen: 64,
    layoutSignature: "x",
  };
  const node = { id, url: id, hello, link: { send() {}, onMessage() {}, onClose() {}, close() {} } };
  return { node, stats: s as NodeStats };
}

function waits(count: number, sumSeconds: number): NonNullable<NodeStats["phases"]> {
  const seconds = new Array<number>(PHASES.length * NB).fill(0);
  seconds[PHASE.queue_wait * NB + 3] = count;
  const secondsSum = new Array<number>(PHASES.length).fill(0);
  secondsSum[PHASE.queue_wait] = sumSeconds;
  return { seconds, secondsSum, bytes: [], bytesSum: 0 };
}

test("RoleLoadMeter.read() sums each role's queue and pool, its queue wait as the mean since the previous read, a restart from zero", () => {
  const meter = new RoleLoadMeter();
  const pages = (free: number) => ({ free, reserved: 100 - free, ready: 0, quarantined: 0, total: 100 });
  const stats = (waiting: number, free: number, phases: NonNullable<NodeStats["phases"]>, evictable = 0) => ({
    queue: { waiting, running: 1, preempted: 0 },
    pages: pages(free),
    phases,
    prefixCache: {
      hits: 0,
      misses: 0,
      hitTokens: 0,
      evictions: 0,
      collisions: 0,
      sharedPages: 0,
      evictablePages: evictable,
    },
  });
  const first = meter.read([
    answer("p", "prefill", 1, stats(2, 50, waits(4, 2), 30)),
    answer("d", "decode", 1, stats(3, 90, waits(10, 1))),
    { node: answer("x", "decode", 1, {}).node, stats: null },
  ]);
  assert.deepEqual(first.prefill, { nodes: 1, waiting: 2, running: 1, waitSeconds: 0.5, poolUsed: 0.2 });
  assert.deepEqual(first.decode, { nodes: 1, waiting: 3, running: 1, waitSeconds: 0.1, poolUsed: 0.1 });
  // Since then: prefill 2 more waits of 3 s in all; decode restarted (a new incarnation): 1 wait of 2 s.
  const second = meter.read([
    answer("p", "prefill", 1, stats(0, 100, waits(6, 5))),
    answer("d", "decode", 2, stats(0, 100, waits(1, 2))),
  ]);
  assert.equal(second.prefill.waitSeconds, 1.5);
  assert.equal(second.decode.waitSeconds, 2);
  assert.equal(meter.read([answer("p", "prefill", 1, stats(0, 100, waits(6, 5)))]).prefill.waitSeconds, 0);
});
