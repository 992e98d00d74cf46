/**
 * `--scheduling-policy` (docs/api.md, "Fair sharing") against real servers, one per policy, in
 * both topologies that queue at a router: one engine (`--no-disaggregation`) and the default
 * (prefill and decode nodes in worker threads). Each server runs one sequence at a time
 * (`--max-num-seqs 1`: it holds two requests, one in its step and one next) and no per-tenant
 * cap, so requests wait at the router's queue. Tenant A sends six long requests (500 tokens),
 * then tenant B two short ones. `fair` serves B's between A's (weighted fair queuing: B's first
 * request goes after at most one of A's waiting ones), so it finishes before A's last; `fcfs`
 * serves the queue in arrival order, so both of B's finish after all of A's. The test fails if the flag is ignored
 * (one policy's order in both servers).
 */
import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { type AddressInfo, createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { type ServeProcess, spawnServe } from "../../testing/serve-process.js";
import { modelDir } from "../../testing/start-server.js";

const KEY_A = "sk-policy-tenant-a-0001";
const KEY_B = "sk-policy-tenant-b-0001";

/** One chat of `key`'s tenant that writes `maxTokens` tokens; resolves with `label` when it ends. */
async function chat(url: string, key: string, label: string, maxTokens: number): Promise<string> {
  const res = await fetch(`${url}/v1/chat/completions`, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${key}` },
    body: JSON.stringify({
      model: "kvfence-tiny",
      messages: [{ role: "user", content: `request ${label}` }],
      max_tokens: maxTokens,
      ignore_eos: true,
      temperature: 0,
    }),
  });
  const body = (await res.json()) as { usage?: { completion_tokens: number } };
  assert.equal(res.status, 200, JSON.stringify(body));
  assert.equal(body.usage?.completion_tokens, maxTokens);
  return label;
}

/** A port no one listens on now (the system's choice, released at once), for an operator listener. */
async function freePort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address() as AddressInfo;
  await new Promise((resolve) => server.close(resolve));
  return port;
}

/** The router's `kvfence_requests_in_flight` (requests it holds: running or queued), from its operator listener. */
async function inFlight(metricsUrl: string): Promise<number> {
  const text = await (await fetch(`${metricsUrl}/metrics`)).text();
  const match = /^kvfence_requests_in_flight (\d+)$/m.exec(text);
  assert.ok(match !== null, "kvfence_requests_in_flight in /metrics");
  return Number(match[1]);
}

/** The order in which A's six and then B's two requests finish on the server at `url`. */
async function finishOrder(url: string, metricsUrl: string): Promise<string[]> {
  const order: string[] = [];
  const done = (p: Promise<string>) => p.then((label) => void order.push(label));
  const sent: Promise<void>[] = [];
  for (let i = 0; i < 6; i++) sent.push(done(chat(url, KEY_A, `A${i}`, 500)));
  // B's are sent once the router holds all six of A's (prepared and queued, A's first running):
  // on a loaded machine a fixed pause once let one of A's bodies arrive after B's first.
  const deadline = Date.now() + 30_000;
  while ((await inFlight(metricsUrl)) < 6) {
    assert.ok(Date.now() < deadline, "the router holds A's six requests within 30 s");
    await new Promise((r) => setTimeout(r, 20));
  }
  for (let i = 0; i < 2; i++) {
    sent.push(done(chat(url, KEY_B, `B${i}`, 50)));
    await new Promise((r) => setTimeout(r, 30));
  }
  await Promise.all(sent);
  return order;
}

for (const topology of ["single", "threads"] as const) {
  describe(`--scheduling-policy (${topology}): fair serves B between A's queued requests, fcfs after them`, {
    timeout: 180_000,
  }, () => {
    let keysDir: string;
    const servers = new Map<"fair" | "fcfs", ServeProcess & { metricsUrl: string }>();

    before(async () => {
      keysDir = mkdtempSync(join(tmpdir(), "kvfence-keys-"));
      const keys = join(keysDir, "keys.json");
      writeFileSync(keys, JSON.stringify({ [KEY_A]: "a", [KEY_B]: "b" }));
      const args = (policy: string, metricsPort: number) => [
        ...(topology === "single" ? ["--no-disaggregation", "--kernel-threads", "1"] : []),
        "--port",
        "0",
        "--metrics-port",
        String(metricsPort),
        "--model",
        modelDir("kvfence-tiny"),
        "--kv-pages",
        "400",
        "--max-num-seqs",
        "1",
        "--tenant-max-concurrency",
        "0",
        "--tenant-max-pages",
        "0",
        "--api-keys",
        keys,
        "--scheduling-policy",
        policy,
      ];
      const [fairPort, fcfsPort] = [await freePort(), await freePort()];
      const [fair, fcfs] = await Promise.all([
        spawnServe(args("fair", fairPort)),
        spawnServe(args("fcfs", fcfsPort)),
      ]);
      servers.set("fair", { ...fair, metricsUrl: `http://127.0.0.1:${fairPort}` });
      servers.set("fcfs", { ...fcfs, metricsUrl: `http://127.0.0.1:${fcfsPort}` });
    });
    after(async () => {
      await Promise.all([...servers.values()].map((s) => s.stop()));
      rmSync(keysDir, { recursive: true, force: true });
    });

    test("the order served follows the policy", async (t) => {
      const fair = await finishOrder(servers.get("fair")!.url, servers.get("fair")!.metricsUrl);
      const fcfs = await finishOrder(servers.get("fcfs")!.url, servers.get("fcfs")!.metricsUrl);
      t.diagnostic(`fair: ${fair.join(" ")}; fcfs: ${fcfs.join(" ")}`);
      const lastA = Math.max(...fair.map((label, i) => (label.startsWith("A") ? i : -1)));
      assert.ok(
        fair.indexOf("B0") < lastA,
        `fair: B's first request finishes before A's last: ${fair.join(" ")}`,
      );
      assert.deepEqual(
        fcfs.slice(-2).sort(),
        ["B0", "B1"],
        `fcfs: B's finish after all of A's: ${fcfs.join(" ")}`,
      );
    });
  });
}
