/**
 * Multi-host (issue #19 item 5): every process on a host of its own — Linux network namespaces on
 * one bridge (testing/netns.ts), each with its own 10.213.N.x address: etcd, the router, two
 * prefill and two decode nodes, membership in etcd (`--registry`), plaintext links beyond
 * loopback by the explicit `--insecure-plaintext-links` (docs/security.md). Two tenants' traffic
 * through the official `openai` client must get exactly the single engine's greedy answers; then,
 * each with traffic in flight: kill -9 of a decode node and of a prefill node (each restarted on
 * its address, a new incarnation that rejoins), a decode host's cable down for 10 s and back,
 * SIGSTOP/SIGCONT of a prefill node, etcd restarted, kill -9 of the router (restarted). In every
 * case no HTTP 200 carries a wrong answer (a failure is a 5xx or a dropped connection), and after
 * each the cluster serves everything again; at the end every page is FREE and all four nodes are
 * up and members. Namespaces are deleted even when a step fails (and on exit). Where namespaces
 * cannot be made (not root, no iproute2) the suite says why and skips.
 */
import assert from "node:assert/strict";
import type { ChildProcess } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import OpenAI from "openai";
import { type Host, Hosts, netnsUnavailable } from "../../testing/netns.js";
import { type ServeProcess, spawnServe } from "../../testing/serve-process.js";
import { assertPoolIdle, modelDir, operatorGet, TEST_OPERATOR_KEY } from "../../testing/start-server.js";
import type { NodesInfo } from "../admin-api/admin-wire.js";
import { started } from "../tools/chaos/chaos-cluster.js";

const MODEL = "tiny-qwen2";
const MAIN = fileURLToPath(new URL("../cli/main.js", import.meta.url));
const SECRET = "netns-test-cluster-secret-7f3a9c";
const KEYS = { "sk-netns-alpha-0001": "alpha", "sk-netns-beta-00002": "beta" };
const PROMPTS = Array.from({ length: 8 }, (_, i) => `tell me about item number ${i * 7 + 3} please`);
const unavailable = netnsUnavailable();

describe("multi-host: router, etcd, two prefill and two decode nodes, each in its own network namespace", {
  skip: unavailable === null ? false : `network namespaces cannot be made here: ${unavailable}`,
}, () => {
  let hosts: Hosts;
  const h: Record<string, Host> = {};
  const procs: Record<string, ChildProcess> = {};
  let single: ServeProcess;
  const reference = new Map<string, string>();
  let dir: string;
  let routerUrl: string;

  const registry = () => `etcd://${h.etcd!.address}:2379`;
  const startEtcd = async () => {
    const a = h.etcd!.address;
    procs.etcd = hosts.run(h.etcd!, "etcd", [
      "--name",
      "e1",
      "--data-dir",
      path.join(dir, "etcd"),
      "--listen-client-urls",
      `http://${a}:2379`,
      "--advertise-client-urls",
      `http://${a}:2379`,
      "--listen-peer-urls",
      "http://127.0.0.1:2380",
      "--initial-advertise-peer-urls",
      "http://127.0.0.1:2380",
      "--initial-cluster",
      "e1=http://127.0.0.1:2380",
      "--log-level",
      "error",
    ]);
    const deadline = Date.now() + 20_000;
    for (;;) {
      const ok = await fetch(`http://${a}:2379/health`).then(
        (r) => r.ok,
        () => false,
      );
      if (ok) return;
      assert.ok(Date.now() < deadline, "etcd did not come up");
      await new Promise((r) => setTimeout(r, 50));
    }
  };
  const startNode = async (name: string) => {
    const role = name.startsWith("prefill") ? "prefill" : "decode";
    const args = [
      MAIN,
      "serve",
      "--role",
      role,
      "--host",
      h[name]!.address,
      "--port",
      role === "prefill" ? "9001" : "9002",
      "--model",
      modelDir(MODEL),
      "--kv-pages",
      "128",
      "--registry",
      registry(),
      "--insecure-plaintext-links",
      "--log-level",
      "warn",
    ];
    procs[name] = hosts.run(h[name]!, process.execPath, args, { KVFENCE_CLUSTER_SECRET: SECRET });
    await started(procs[name]!, /listening at/, name, 60_000);
  };
  const startRouter = async () => {
    const args = [
      MAIN,
      "serve",
      "--role",
      "router",
      "--host",
      h.router!.address,
      "--port",
      "8000",
      "--model",
      modelDir(MODEL),
      "--registry",
      registry(),
      "--insecure-plaintext-links",
      "--operator-key",
      TEST_OPERATOR_KEY,
      "--api-keys",
      path.join(dir, "keys.json"),
      "--log-level",
      "warn",
    ];
    procs.router = hosts.run(h.router!, process.execPath, args, { KVFENCE_CLUSTER_SECRET: SECRET });
    routerUrl = await started(procs.router, / at (http:\/\/\S+) /, "router", 60_000);
  };
  const kill = async (name: string, signal: NodeJS.Signals = "SIGKILL") => {
    const c = procs[name]!;
    const exited = new Promise((r) => c.once("exit", r));
    c.kill(signal);
    await exited;
  };
  const listed = async (): Promise<NodesInfo["nodes"]> =>
    ((await (await operatorGet(routerUrl, "/kvfence/nodes")).json()) as NodesInfo).nodes;
  /** Until all four nodes are up and members (a node back is its new incarnation). */
  const allServing = async (what: string) => {
    const deadline = Date.now() + 45_000;
    let last: NodesInfo["nodes"] = [];
    for (;;) {
      last = await listed().catch(() => []);
      const ready = await fetch(`${routerUrl}/ready`).then(
        (r) => r.status,
        () => 0,
      );
      if (ready === 200 && last.filter((n) => n.up && n.member).length === 4) return;
      if (Date.now() > deadline) assert.fail(`${what}: not all four nodes serve: ${JSON.stringify(last)}`);
      await new Promise((r) => setTimeout(r, 100));
    }
  };
  /**
   * `n` requests, alternating tenants, 8 in flight: every 200 must be the single engine's answer;
   * returns how many got 200 (the rest failed cleanly: a 5xx or 429, or the connection dropped).
   */
  const traffic = async (n: number, during?: () => Promise<void>) => {
    let ok = 0;
    let next = 0;
    const keys = Object.keys(KEYS);
    const worker = async () => {
      while (next < n) {
        const i = next++;
        const prompt = PROMPTS[i % PROMPTS.length]!;
        const client = new OpenAI({
          baseURL: `${routerUrl}/v1`,
          apiKey: keys[i % 2]!,
          maxRetries: 0,
          timeout: 60_000,
        });
        try {
          const r = await client.chat.completions.create({
            model: MODEL,
            messages: [{ role: "user", content: prompt }],
            max_tokens: 8,
            temperature: 0,
          });
          assert.equal(
            r.choices[0]!.message.content,
            reference.get(prompt),
            `a 200 with another answer for ${prompt}`,
          );
          ok++;
        } catch (err) {
          if (err instanceof assert.AssertionError) throw err;
          const status = (err as { status?: number }).status;
          assert.ok(
            status === undefined || status >= 429,
            `a clean failure, not ${status}: ${(err as Error).message}`,
          );
        }
      }
    };
    await Promise.all([...Array.from({ length: 8 }, worker), during?.()]);
    return ok;
  };

  before(async () => {
    dir = mkdtempSync(path.join(os.tmpdir(), "kvfence-netns-"));
    writeFileSync(path.join(dir, "keys.json"), JSON.stringify(KEYS));
    hosts = new Hosts();
    h.etcd = hosts.add("etcd", 1);
    h.router = hosts.add("router", 2);
    h["prefill-0"] = hosts.add("p0", 11);
    h["prefill-1"] = hosts.add("p1", 12);
    h["decode-0"] = hosts.add("d0", 21);
    h["decode-1"] = hosts.add("d1", 22);
    single = await spawnServe([
      "--port",
      "0",
      "--model",
      modelDir(MODEL),
      "--no-disaggregation",
      "--kv-pages",
      "128",
    ]);
    const client = new OpenAI({ baseURL: `${single.url}/v1`, apiKey: "unused", maxRetries: 0 });
    await startEtcd();
    const nodes = Promise.all(["prefill-0", "prefill-1", "decode-0", "decode-1"].map(startNode));
    for (const prompt of PROMPTS) {
      const r = await client.chat.completions.create({
        model: MODEL,
        messages: [{ role: "user", content: prompt }],
        max_tokens: 8,
        temperature: 0,
      });
      reference.set(prompt, r.choices[0]!.message.content ?? "");
    }
    await nodes;
    await startRouter();
    await allServing("at the start");
  });
  after(async () => {
    await single?.stop();
    await hosts?.cleanup();
    if (dir !== undefined) rmSync(dir, { recursive: true, force: true });
  });

  test("two tenants' concurrent traffic gets the single engine's answers", async () => {
    assert.equal(await traffic(24), 24);
  });

  test("kill -9 of a decode node and of a prefill node mid-traffic; each restarted rejoins and serves", async () => {
    for (const name of ["decode-0", "prefill-1"]) {
      await traffic(16, async () => {
        await new Promise((r) => setTimeout(r, 150));
        await kill(name);
      });
      await startNode(name);
      await allServing(`${name} back`);
      assert.equal(await traffic(8), 8, `all served after ${name} came back`);
    }
  });

  test("a decode host's cable down for 10 s and back: served meanwhile, and it serves again", async () => {
    await traffic(8, async () => {
      await new Promise((r) => setTimeout(r, 100));
      hosts.linkDown(h["decode-1"]!);
    });
    // The other decode node carries the traffic while the cable is out.
    const during = traffic(8);
    await new Promise((r) => setTimeout(r, 10_000));
    hosts.linkUp(h["decode-1"]!);
    assert.ok((await during) > 0, "served through decode-0 while decode-1 was cut off");
    await allServing("decode-1's cable back");
    assert.equal(await traffic(8), 8);
  });

  test("SIGSTOP/SIGCONT of a prefill node mid-traffic", async () => {
    await traffic(12, async () => {
      await new Promise((r) => setTimeout(r, 100));
      procs["prefill-0"]!.kill("SIGSTOP");
      await new Promise((r) => setTimeout(r, 2000));
      procs["prefill-0"]!.kill("SIGCONT");
    });
    await allServing("prefill-0 continued");
    assert.equal(await traffic(8), 8);
  });

  test("etcd restarted: the members stay, requests are served", async () => {
    await traffic(8, async () => {
      await kill("etcd", "SIGTERM");
      await startEtcd();
    });
    await allServing("etcd back");
    assert.equal(await traffic(8), 8);
  });

  test("kill -9 of the router mid-traffic; restarted, it finds the nodes in etcd and serves; every page FREE", async () => {
    await traffic(8, async () => {
      await new Promise((r) => setTimeout(r, 150));
      await kill("router");
    });
    await startRouter();
    await allServing("the router back");
    assert.equal(await traffic(16), 16);
    await assertPoolIdle(routerUrl, { key: TEST_OPERATOR_KEY });
  });
});
