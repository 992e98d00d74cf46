import assert from "node:assert/strict";
import { test } from "node:test";
import { startIncidentServer } from "./incident.js";

test("RouterServer shows the unsafe switches in /health and /metrics", { timeout: 60_000 }, async (t) => {
  const server = await startIncidentServer({
    faults: ["corrupt-transfer"],
    disabledGuards: ["checksum", "page-tags"],
    undersizedPrefill: false,
  });
  t.after(() => server.close());
  const health = (await (await fetch(`${server.url}/health`)).json()) as Record<string, unknown>;
  assert.deepEqual(health.unsafe, {
    faults: ["corrupt-transfer"],
    disabled_guards: ["checksum", "page-tags"],
  });
  const metrics = await server.metrics();
  assert.equal(metrics.get('kvfence_unsafe_fault{name="corrupt-transfer"}'), 1);
  assert.equal(metrics.get('kvfence_guard_disabled{name="checksum"}'), 1);
  assert.equal(metrics.get('kvfence_guard_disabled{name="page-tags"}'), 1);
});

test("RouterServer shows no unsafe switches on a safe server", { timeout: 60_000 }, async (t) => {
  const server = await startIncidentServer({ faults: [], disabledGuards: [], undersizedPrefill: false });
  t.after(() => server.close());
  const health = (await (await fetch(`${server.url}/health`)).json()) as Record<string, unknown>;
  assert.deepEqual(health, { status: "ok" });
  const text = await (
    await fetch(`${server.url}/metrics`, { headers: { authorization: `Bearer ${server.operatorKey}` } })
  ).text();
  assert.doesNotMatch(text, /kvfence_unsafe_fault|kvfence_guard_disabled/);
});
