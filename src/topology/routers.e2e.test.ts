/**
 * Several routers over the same nodes (issue #19 item 3), with real processes: an etcd of its own,
 * one prefill and one decode node that register with `--registry`, and two router processes that
 * watch it, each in a router slot it claimed in etcd (0 and 1; docs/topologies.md). Two tenants' concurrent
 * traffic goes through both routers with the official `openai` client; the decode pool is small,
 * so the two routers' ledgers together overbook it and decode's own admission (`pool_exhausted`,
 * retried when it frees pages) is what keeps them apart. Every answer equals the single engine's
 * greedy one, no guard counter moves, every page is FREE when idle; a node killed (-9) and one that
 * joins show on both routers' `/kvfence/nodes` and `kvfence_node_up` within a second of each other.
 */
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { type ServeProcess, spawnServe } from "../../testing/serve-process.js";
import {
  assertPoolIdle,
  modelDir,
  operatorGet,
  scrape,
  TEST_OPERATOR_KEY,
} from "../../testing/start-server.js";
import type { NodesInfo } from "../admin-api/admin-wire.js";
import { etcdAvailable, type LocalEtcd, startEtcd } from "./local-etcd.js";

const MODEL = "tiny-qwen2";
const env = { KVFENCE_CLUSTER_SECRET: randomBytes(24).toString("hex") };
const KEYS = { "sk-routers-alpha-001": "alpha", "sk-routers-beta-0002": "beta" };
const PROMPTS = [
  "hello there, how are you?",
  "what is the capital of france",
  "tell me a story about a fox",
  "count from one to ten please",
];
/** The guards' counters: any move is a guard that caught something (none may here). */
const GUARDS = /checksum_failures|coverage_failures|tag_check_failures|misaddressed/;

describe("two routers over the same nodes, membership in etcd", () => {
  let etcd: LocalEtcd;
  let dir: string;
  let single: ServeProcess;
  const routers: ServeProcess[] = [];
  const nodes: ServeProcess[] = [];
  const reference = new Map<string, string>();
  let decode: ServeProcess;
  const node = async (role: "prefill" | "decode", pages: number) => {
    const args = ["--role", role, "--port", "0", "--model", modelDir(MODEL), "--kv-pages", String(pages)];
    args.push("--max-model-len", "128");
    const p = await spawnServe([...args, "--registry", etcd.url], { env });
    nodes.push(p);
    return p;
  };
  /** A router; without `slot` it claims the lowest free router slot in etcd. */
  const router = (slot?: number) =>
    spawnServe(
      [
        ...["--role", "router", "--port", "0", "--model", modelDir(MODEL), "--registry", etcd.url],
        ...(slot === undefined ? [] : ["--router-slot", String(slot)]),
        ...["--api-keys", path.join(dir, "keys.json")],
      ],
      { env: { ...env, KVFENCE_OPERATOR_KEY: TEST_OPERATOR_KEY } },
    );
  /** What a router says of the membership: each node's address, up and member. */
  const membership = async (r: ServeProcess): Promise<string> => {
    const info = (await (await operatorGet(r.url, "/kvfence/nodes")).json()) as NodesInfo;
    const up = await scrape(r.url);
    return info.nodes
      .map((n) => {
        const gauge = [...up].find(([k]) => k.startsWith("kvfence_node_up{") && k.includes(`"${n.id}"`));
        return `${n.role}@${n.url.replace(/^\w+:\/\//, "")} up=${n.up} member=${n.member} node_up=${gauge?.[1]}`;
      })
      .sort()
      .join("; ");
  };
  /** Polls both routers until each shows `ok`; returns how far apart (ms) they first did. */
  const agree = async (what: string, ok: (m: string) => boolean): Promise<number> => {
    const seen: (number | undefined)[] = [undefined, undefined];
    const last = ["", ""];
    const deadline = Date.now() + 30_000;
    while (Date.now() < deadline && seen.some((t) => t === undefined)) {
      await Promise.all(
        routers.map(async (r, i) => {
          last[i] = await membership(r);
          if (seen[i] === undefined && ok(last[i]!)) seen[i] = Date.now();
        }),
      );
      await new Promise((r) => setTimeout(r, 50));
    }
    assert.ok(
      seen.every((t) => t !== undefined),
      `${what}: the routers say ${JSON.stringify(last)}`,
    );
    assert.equal(last[0], last[1], `${what}: both routers list the same membership`);
    return Math.abs(seen[0]! - seen[1]!);
  };
  /** Two tenants, 6 concurrent clients over both routers: every answer is the single engine's. */
  const traffic = async () => {
    const keys = Object.keys(KEYS);
    const worker = async (w: number) => {
      for (let i = 0; i < 3; i++) {
        const prompt = PROMPTS[(w + i) % PROMPTS.length]!;
        const client = new OpenAI({
          baseURL: `${routers[(w + i) % 2]!.url}/v1`,
          apiKey: keys[w % 2]!,
          maxRetries: 0,
          timeout: 60_000,
        });
        const r = await client.chat.completions.create({
          model: MODEL,
          messages: [{ role: "user", content: prompt }],
          max_tokens: 8,
          temperature: 0,
        });
        assert.equal(
          r.choices[0]!.message.content,
          reference.get(prompt),
          `the single engine's answer to ${prompt}`,
        );
      }
    };
    await Promise.all(Array.from({ length: 6 }, (_, w) => worker(w)));
  };
  const guardCounts = async () => {
    let n = 0;
    for (const r of routers) for (const [k, v] of await scrape(r.url)) if (GUARDS.test(k)) n += v;
    return n;
  };

  before(async () => {
    assert.ok(
      etcdAvailable(),
      "etcd is not installed: apt-get install -y etcd-server (npm test's pretest step does)",
    );
    dir = mkdtempSync(path.join(os.tmpdir(), "kvfence-routers-"));
    writeFileSync(path.join(dir, "keys.json"), JSON.stringify(KEYS));
    etcd = await startEtcd();
    single = await spawnServe(["--port", "0", "--model", modelDir(MODEL), "--no-disaggregation"]);
    // A decode pool of 8 pages (16 tokens each): one router alone may fill it, two overbook it.
    [, decode] = await Promise.all([node("prefill", 64), node("decode", 8)]);
    const client = new OpenAI({ baseURL: `${single.url}/v1`, apiKey: "unused", maxRetries: 0 });
    for (const prompt of PROMPTS) {
      const r = await client.chat.completions.create({
        model: MODEL,
        messages: [{ role: "user", content: prompt }],
        max_tokens: 8,
        temperature: 0,
      });
      reference.set(prompt, r.choices[0]!.message.content ?? "");
    }
    // Both claim a router slot in etcd (0 and 1, in either order).
    routers.push(...(await Promise.all([router(), router()])));
  });
  after(async () => {
    await Promise.all(routers.map((r) => r.stop()));
    await Promise.all(nodes.map((n) => n.stop()));
    await single?.stop();
    await etcd?.stop();
    if (dir !== undefined) rmSync(dir, { recursive: true, force: true });
  });

  test("both routers serve two tenants' concurrent traffic with the single engine's answers, and agree on membership", async () => {
    await agree(
      "both nodes up on both routers",
      (m) => (m.match(/up=true member=true node_up=1/g) ?? []).length === 2,
    );
    const guards = await guardCounts();
    await traffic();
    assert.equal(await guardCounts(), guards, "no guard counter moved");
    for (const r of routers) await assertPoolIdle(r.url, { key: TEST_OPERATOR_KEY });
  });

  test("a third router given a router slot the others hold is refused at startup, with the fix", async () => {
    await assert.rejects(
      router(1),
      /Router slot 1 is held by another running router of this cluster; give each router its own --router-slot/,
    );
  });

  test("a node killed and one that joins show on both routers within a second of each other", async () => {
    const gone = decode.url.replace(/^\w+:\/\//, "");
    // kill -9: its links close at once (up false), its etcd entry goes when its lease expires.
    const exited = new Promise((r) => decode.process.once("exit", r));
    decode.process.kill("SIGKILL");
    await exited;
    const apart = await agree("the stopped decode node is out on both", (m) =>
      m.includes(`decode@${gone} up=false member=false node_up=0`),
    );
    assert.ok(apart < 1000, `both routers saw the node go within a second of each other: ${apart} ms`);
    const joined = await node("decode", 8);
    const at = joined.url.replace(/^\w+:\/\//, "");
    const apartJoin = await agree("the new decode node is in on both", (m) =>
      m.includes(`decode@${at} up=true member=true node_up=1`),
    );
    assert.ok(
      apartJoin < 1000,
      `both routers saw the node join within a second of each other: ${apartJoin} ms`,
    );
    const guards = await guardCounts();
    await traffic();
    assert.equal(await guardCounts(), guards, "no guard counter moved");
    for (const r of routers) await assertPoolIdle(r.url, { key: TEST_OPERATOR_KEY });
  });
});
