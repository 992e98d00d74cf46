/**
 * `/kvfence/state` shares one snapshot between polls that come within `STATE_REUSE_MS` of each
 * other (src/router/dashboard.ts): several dashboards open cost the nodes one poll, not one each.
 * A real threaded server (nodes in worker threads) and real HTTP.
 */
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { modelDir, operatorGet } from "../../testing/start-server.js";
import { startInProcess, type TopologyServer } from "../../testing/topology-servers.js";
import { type DashboardState, STATE_REUSE_MS } from "./dashboard.js";

let server: TopologyServer;
before(async () => {
  server = await startInProcess("threads", {
    model: modelDir("kvfence-tiny"),
    kvPages: 128,
    apiKeys: { "sk-tenant-alpha-0001": "alpha" },
  });
});
after(async () => {
  await server?.close();
});

async function poll(): Promise<DashboardState> {
  const res = await operatorGet(server.url, "/kvfence/state");
  assert.equal(res.status, 200);
  return (await res.json()) as DashboardState;
}

test("polls at the same moment share one snapshot; a later poll takes a new one", async () => {
  const together = await Promise.all(Array.from({ length: 6 }, poll));
  assert.equal(new Set(together.map((s) => s.time_ms)).size, 1, "one snapshot for six polls at once");
  assert.equal(together[0]!.nodes.length, 2, "both nodes in it");
  await new Promise((r) => setTimeout(r, STATE_REUSE_MS + 50));
  const later = await poll();
  assert.ok(later.time_ms > together[0]!.time_ms, "a poll after the reuse interval gets a fresh snapshot");
});
