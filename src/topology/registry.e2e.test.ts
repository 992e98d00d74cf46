/**
 * Membership in etcd (issue #19 items 1 and 6), with real processes: an etcd of its own (Debian's
 * etcd-server, installed by npm test's pretest step), node processes that register with `--registry`, a router
 * process that watches it, and the official `openai` client. Nodes join and leave a running
 * cluster; a node whose layout differs from the cluster's is refused at its join; a forged entry
 * (an address that does not prove the cluster secret, or an entry that misstates the node behind
 * its address) never gets traffic; the cluster serves through an etcd restart.
 */
import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import net from "node:net";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import { Etcd3 } from "etcd3";
import OpenAI from "openai";
import { type ServeProcess, spawnServe } from "../../testing/serve-process.js";
import { assertPoolIdle, modelDir, operatorGet, TEST_OPERATOR_KEY } from "../../testing/start-server.js";
import type { NodesInfo } from "../admin-api/admin-wire.js";
import { etcdAvailable, type LocalEtcd, startEtcd } from "./local-etcd.js";

const MODEL = "tiny-qwen2";
const MAIN = fileURLToPath(new URL("../cli/main.js", import.meta.url));
const env = { KVFENCE_CLUSTER_SECRET: randomBytes(24).toString("hex") };

describe("a cluster whose membership is in etcd", () => {
  let etcd: LocalEtcd;
  let router: ServeProcess;
  const nodes: ServeProcess[] = [];
  let outsider: net.Server;
  const sockets: net.Socket[] = [];
  const node = async (role: "prefill" | "decode", extra: string[] = []) => {
    const args = ["--role", role, "--port", "0", "--model", modelDir(MODEL), "--kv-pages", "128"];
    const p = await spawnServe([...args, "--registry", etcd.url, ...extra], { env });
    nodes.push(p);
    return p;
  };
  const listed = async (): Promise<NodesInfo["nodes"]> =>
    ((await (await operatorGet(router.url, "/kvfence/nodes")).json()) as NodesInfo).nodes;
  const until = async (what: string, ok: (n: NodesInfo["nodes"]) => boolean) => {
    const deadline = Date.now() + 30_000;
    let last: NodesInfo["nodes"] = [];
    while (Date.now() < deadline) {
      last = await listed();
      if (ok(last)) return last;
      await new Promise((r) => setTimeout(r, 100));
    }
    assert.fail(`${what}: /kvfence/nodes says ${JSON.stringify(last)}`);
  };
  const chat = async () => {
    const client = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: "unused", maxRetries: 0 });
    const r = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "hello there, how are you?" }],
      max_tokens: 4,
      temperature: 0,
    });
    return r.choices[0]!.message.content ?? "";
  };

  before(async () => {
    assert.ok(
      etcdAvailable(),
      "etcd is not installed: apt-get install -y etcd-server (npm test's pretest step does)",
    );
    etcd = await startEtcd();
    await Promise.all([node("prefill"), node("decode")]);
    router = await spawnServe(
      ["--role", "router", "--port", "0", "--model", modelDir(MODEL), "--registry", etcd.url],
      { env: { ...env, KVFENCE_OPERATOR_KEY: TEST_OPERATOR_KEY } },
    );
  });
  after(async () => {
    await router?.stop();
    await Promise.all(nodes.map((n) => n.stop()));
    for (const s of sockets) s.destroy();
    await new Promise((r) => (outsider === undefined ? r(null) : outsider.close(r)));
    await etcd?.stop();
  });

  test("the router pairs the registered nodes and serves", async () => {
    const first = await chat();
    assert.ok(first.length > 0);
    const n = await until("both nodes members", (l) => l.length === 2 && l.every((x) => x.up && x.member));
    assert.deepEqual(n.map((x) => x.role).sort(), ["decode", "prefill"]);
    assert.equal(await chat(), first, "greedy: the same answer again");
  });

  test("a forged entry never joins: an outsider that cannot prove the secret, an entry that misstates its node", async () => {
    outsider = net.createServer((s) => {
      sockets.push(s);
      s.end("not a kvfence node\n");
    });
    await new Promise<void>((r) => outsider.listen(0, "127.0.0.1", r));
    const port = (outsider.address() as net.AddressInfo).port;
    const prefill = (await listed()).find((x) => x.role === "prefill")!;
    const client = new Etcd3({ hosts: [etcd.endpoint] });
    try {
      const entry = (address: string, incarnation: number) =>
        JSON.stringify({
          role: "decode",
          incarnation,
          layoutSignature: "forged",
          poolTokens: 1 << 20,
          pageSize: 16,
          maxModelLen: 1 << 20,
          address,
        });
      await client.put(`/kvfence/nodes/decode/127.0.0.1:${port}`).value(entry(`127.0.0.1:${port}`, 7));
      // The real prefill node's address, claimed as a decode node: its hello says otherwise.
      const real = prefill.url.replace(/^\w+:\/\//, "");
      await client.put(`/kvfence/nodes/decode/${real}`).value(entry(real, 8));
      await new Promise((r) => setTimeout(r, 1500));
      const l = await listed();
      assert.equal(l.length, 2, `no forged node joined: ${JSON.stringify(l)}`);
      assert.ok(!l.some((x) => x.url.endsWith(`:${port}`)));
      assert.ok((await chat()).length > 0);
      await client.delete().key(`/kvfence/nodes/decode/127.0.0.1:${port}`).exec();
      await client.delete().key(`/kvfence/nodes/decode/${real}`).exec();
    } finally {
      client.close();
    }
  });

  test("a node joins the running cluster, one whose layout differs is refused, one that leaves takes no new requests", async () => {
    const joined = await node("decode");
    await until("the new decode node joined", (l) => l.length === 3 && l.every((x) => x.up && x.member));
    // Another page size: its KV layout is not the cluster's (the pre-flight of every join).
    await node("decode", ["--page-size", "8", "--kv-pages", "256"]);
    await new Promise((r) => setTimeout(r, 1500));
    assert.equal((await listed()).length, 3, "the node with another layout stays out");
    for (let i = 0; i < 4; i++) assert.ok((await chat()).length > 0);
    // It leaves (its entry goes with its lease): out of the membership.
    await joined.stop();
    await until("the stopped node is out", (l) =>
      l.some((x) => x.url.endsWith(`:${joined.port}`) && !x.member),
    );
    for (let i = 0; i < 3; i++) assert.ok((await chat()).length > 0);
    await assertPoolIdle(router.url, { key: TEST_OPERATOR_KEY });
  });

  test("kvfence drain NODE: no new requests, the ones in flight finish, then it leaves and exits", async () => {
    const drained = await node("decode");
    const id = `decode@127.0.0.1:${drained.port}`;
    await until("the node to drain joined", (l) => l.some((x) => x.id === id && x.up && x.member));
    const exited = new Promise<number | null>((r) => drained.process.once("exit", (code) => r(code)));
    const inFlight = Array.from({ length: 4 }, () => chat());
    const cli = spawn(process.execPath, [MAIN, "drain", id, "--registry", etcd.url, "--timeout", "60"], {
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    cli.stdout.on("data", (d: Buffer) => {
      out += d.toString();
    });
    cli.stderr.on("data", (d: Buffer) => {
      out += d.toString();
    });
    const code = await new Promise((r) => cli.once("exit", r));
    assert.equal(code, 0, out);
    assert.match(out, new RegExp(`${id} drained and left the cluster`));
    for (const text of await Promise.all(inFlight)) assert.ok(text.length > 0);
    assert.equal(await exited, 0, "the drained node exits by itself");
    await until("the drained node is out", (l) => l.some((x) => x.id === id && !x.member && !x.up));
    for (let i = 0; i < 3; i++) assert.ok((await chat()).length > 0);
    // A node that is not registered: a clear error.
    const bad = spawnSync(process.execPath, [MAIN, "drain", "decode@127.0.0.1:1", "--registry", etcd.url]);
    assert.equal(bad.status, 1);
    assert.match(bad.stderr.toString(), /No node decode@127\.0\.0\.1:1 is registered/);
  });

  test("the cluster serves through an etcd restart, and its members stay", async () => {
    await etcd.restart();
    for (let i = 0; i < 3; i++) assert.ok((await chat()).length > 0);
    await until("members again after the restart", (l) => {
      const up = l.filter((x) => x.up);
      return up.length === 2 && up.every((x) => x.member);
    });
  });
});
