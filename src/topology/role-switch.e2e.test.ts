/**
 * A node changes role at run time under load (issue #36 item 2, docs/topologies.md "Roles that
 * follow the load"), with a real etcd, a router process, a prefill and a decode node process and
 * one more prefill node in this process (so the test can read its pool at the switch), the
 * official `openai` client streaming all the while, and the real `kvfence role` command: the node
 * drains its prefill work, scrubs its pool — read at the switch: not one non-zero byte, its prefix
 * cache empty — and serves as a decode node; every request of the stream gets its whole answer,
 * the greedy one.
 */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import OpenAI from "openai";
import { type ServeProcess, spawnServe } from "../../testing/serve-process.js";
import { assertPoolIdle, modelDir, operatorGet, TEST_OPERATOR_KEY } from "../../testing/start-server.js";
import type { NodesInfo } from "../admin-api/admin-wire.js";
import type { Engine } from "../engine/engine.js";
import { createLogger } from "../lib/logger.js";
import type { NodeServer } from "../node/node-server.js";
import { parseServeConfig } from "../server/serve-config.js";
import { startNode } from "../server/start-server.js";
import { etcdAvailable, type LocalEtcd, startEtcd } from "./local-etcd.js";

const MODEL = "tiny-qwen2";
const MAIN = fileURLToPath(new URL("../cli/main.js", import.meta.url));
const SECRET = randomBytes(24).toString("hex");
const env = { KVFENCE_CLUSTER_SECRET: SECRET };
const PROMPTS = [
  "hello there, how are you?",
  "tell me about the sea and its tides",
  "what is a prefill node for, in short?",
];

/** What the pool held when the switch scrubbed it (read before the new role takes any work). */
interface AtScrub {
  nonZero: number;
  cachedPages: number;
}

function nonZeroElements(engine: Engine): number {
  let n = 0;
  for (const v of engine.pool.data) if (v !== 0) n++;
  return n;
}

describe("a node that changes role under load", () => {
  let etcd: LocalEtcd;
  let router: ServeProcess;
  const processes: ServeProcess[] = [];
  let switching: { node: NodeServer; close(): Promise<void> };
  let atScrub: AtScrub | null = null;

  const listed = async (): Promise<NodesInfo["nodes"]> =>
    ((await (await operatorGet(router.url, "/kvfence/nodes")).json()) as NodesInfo).nodes;
  const until = async (what: string, ok: () => boolean | Promise<boolean>) => {
    const deadline = Date.now() + 30_000;
    while (!(await ok())) {
      if (Date.now() > deadline)
        assert.fail(`${what}: /kvfence/nodes says ${JSON.stringify(await listed())}`);
      await new Promise((r) => setTimeout(r, 100));
    }
  };
  const client = () => new OpenAI({ baseURL: `${router.url}/v1`, apiKey: "unused", maxRetries: 0 });
  /** One streamed greedy chat: its status is 200 or it throws; the text of its deltas. */
  const streamChat = async (prompt: string): Promise<string> => {
    const stream = await client().chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: prompt }],
      max_tokens: 12,
      temperature: 0,
      stream: true,
    });
    let text = "";
    for await (const chunk of stream) text += chunk.choices[0]?.delta.content ?? "";
    return text;
  };

  before(async () => {
    assert.ok(
      etcdAvailable(),
      "etcd is not installed: apt-get install -y etcd-server (npm test's pretest step does)",
    );
    etcd = await startEtcd();
    const node = (role: string) =>
      spawnServe(
        [
          "--role",
          role,
          "--port",
          "0",
          "--model",
          modelDir(MODEL),
          "--kv-pages",
          "128",
          "--registry",
          etcd.url,
        ],
        { env },
      );
    processes.push(...(await Promise.all([node("prefill"), node("decode")])));
    const config = parseServeConfig({
      role: "prefill",
      host: "127.0.0.1",
      port: "0",
      model: modelDir(MODEL),
      kvPages: "128",
      pageSize: "16",
      scrubOnFree: false,
      disaggregation: true,
      registry: etcd.url,
      clusterSecret: SECRET,
      logLevel: "silent",
    });
    switching = await startNode(config, {
      logger: createLogger({ level: "silent" }),
      onScrubbed: (engine) => {
        atScrub = { nonZero: nonZeroElements(engine), cachedPages: engine.prefixCache?.size ?? -1 };
      },
    });
    router = await spawnServe(
      ["--role", "router", "--port", "0", "--model", modelDir(MODEL), "--registry", etcd.url],
      { env: { ...env, KVFENCE_OPERATOR_KEY: TEST_OPERATOR_KEY } },
    );
  });
  after(async () => {
    await router?.stop();
    await switching?.close();
    await Promise.all(processes.map((p) => p.stop()));
    await etcd?.stop();
  });

  test("kvfence role: the node drains, scrubs its whole pool and serves as decode; no request of the stream is lost", async () => {
    const address = switching.node.advertised;
    await until("three nodes up", async () => {
      const l = await listed();
      return l.length === 3 && l.every((n) => n.up && n.member);
    });
    // The greedy answers, before anything moves; then the node's prefill work shows in its pool.
    const reference = new Map<string, string>();
    for (const p of PROMPTS) reference.set(p, await streamChat(p));
    for (let i = 0; i < 12 && (switching.node.engine.prefixCache?.size ?? 0) === 0; i++)
      await streamChat(PROMPTS[i % PROMPTS.length]!);
    assert.ok(
      (switching.node.engine.prefixCache?.size ?? 0) > 0,
      "the node prefilled prompts before its switch",
    );
    assert.ok(nonZeroElements(switching.node.engine) > 0, "its pool holds the prefill role's KV");

    // A steady stream of requests from three clients while the node switches role.
    let switched = false;
    const results: { prompt: string; text: string }[] = [];
    const errors: string[] = [];
    const worker = async (w: number) => {
      for (let i = 0; !switched || i % 4 !== 0; i++) {
        const prompt = PROMPTS[(w + i) % PROMPTS.length]!;
        try {
          results.push({ prompt, text: await streamChat(prompt) });
        } catch (err) {
          errors.push(`${prompt}: ${(err as Error).message}`);
        }
      }
    };
    const load = Promise.all([0, 1, 2].map(worker));
    await new Promise((r) => setTimeout(r, 300));
    const role = spawn(
      process.execPath,
      [MAIN, "role", `prefill@${address}`, "decode", "--registry", etcd.url, "--timeout", "60"],
      { stdio: ["ignore", "pipe", "pipe"] },
    );
    let out = "";
    role.stdout.on("data", (d: Buffer) => (out += d.toString()));
    role.stderr.on("data", (d: Buffer) => (out += d.toString()));
    const code = await new Promise<number | null>((r) => role.on("exit", r));
    assert.equal(code, 0, `kvfence role: ${out}`);
    assert.match(out, new RegExp(`serves as decode@${address.replace(/\./g, "\\.")}`));
    assert.equal(switching.node.role, "decode");

    // It serves as decode: the router lists it so, and decode steps run on its engine.
    await until("the node is a decode member", async () => {
      const l = await listed();
      return (
        l.some((n) => n.id === `decode@${address}` && n.up && n.member) &&
        !l.some((n) => n.id === `prefill@${address}`)
      );
    });
    // Prompts no node has cached go by load, so some reach the new decode node.
    const decodeSteps = () => switching.node.engine.stats().counters.decodeSteps ?? 0;
    const stepsAtSwitch = decodeSteps();
    let fresh = 0;
    await until("decode steps on the switched node", async () => {
      await Promise.all([0, 1, 2, 3].map(() => streamChat(`a fresh prompt, number ${fresh++}`)));
      return decodeSteps() > stepsAtSwitch;
    });
    switched = true;
    await load;

    assert.deepEqual(errors, [], "every request of the stream got its answer");
    assert.ok(results.length >= 12, `a steady stream: ${results.length} requests`);
    for (const r of results)
      assert.equal(r.text, reference.get(r.prompt), `the greedy answer to ${r.prompt}`);
    assert.ok(atScrub !== null, "the switch scrubbed the pool");
    assert.deepEqual(atScrub, { nonZero: 0, cachedPages: 0 }, "no byte of the prefill role's KV is left");
    const m = await assertPoolIdle(router.url, { key: TEST_OPERATOR_KEY });
    // What an autoscaler reads per role (docs/api.md): the switched node counts as decode now.
    assert.equal(m.get('kvfence_role_nodes{role="prefill"}'), 1);
    assert.equal(m.get('kvfence_role_nodes{role="decode"}'), 2);
    for (const r of ["prefill", "decode"]) {
      assert.equal(m.get(`kvfence_role_queue_depth{role="${r}"}`), 0, `nothing waits on ${r} when idle`);
      assert.ok(m.has(`kvfence_role_queue_wait_seconds{role="${r}"}`));
      assert.ok((m.get(`kvfence_role_kv_pool_used_ratio{role="${r}"}`) ?? -1) >= 0);
    }
  });
});
