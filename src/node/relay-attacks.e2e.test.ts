/**
 * Acceptance (issue #31, finding 2): a process that can write to etcd but holds no cluster secret
 * copies a prefill node's registry entry under its own address, deletes the real entry and relays
 * TCP both ways (testing/registry-relay.ts, a process of its own). The router dials the relay; the
 * relay passes the router's HELLO and PROOF and the node's CHALLENGE through unchanged, all of them
 * genuine. Before the address binding the node joined at the relay's address and, on plaintext
 * links, the relay read the prompts' token ids. Now the node answers that it is at another address
 * than the one dialled, inside the MACed transcript: the node refuses the link and the router
 * refuses the node, both count it (`kvfence_router_link_refusals_total{reason="address_mismatch"}`
 * on the router, `control address_mismatch` in the node's log), no request goes through the relay
 * and the cluster serves from the honest prefill node — on plaintext and on TLS links alike (with
 * TLS the node's certificate names 127.0.0.1, so it passes for the relay's address too).
 *
 * Real processes: an etcd of its own (src/topology/local-etcd.ts), two prefill and one decode
 * `kvfence serve` node processes registered in it, the relay process, and a router in this process
 * (real HTTP, the official `openai` client) that watches the registry.
 */
import assert from "node:assert/strict";
import { type ChildProcess, spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import OpenAI from "openai";
import { modelDir, operatorGet, TEST_OPERATOR_KEY } from "../../testing/start-server.js";
import { CLUSTER_TLS_ARGS, CLUSTER_TLS_FILES } from "../../testing/tls-fixtures.js";
import type { NodesInfo } from "../admin-api/admin-wire.js";
import { createLogger } from "../lib/logger.js";
import { parseServeConfig } from "../server/serve-config.js";
import { startServer } from "../server/start-server.js";
import { type NodeProcesses, startNodeProcesses, stopProcess } from "../topology/local-cluster.js";
import { etcdAvailable, type LocalEtcd, startEtcd } from "../topology/local-etcd.js";

const MODEL = "kvfence-tiny";
const RELAY = fileURLToPath(new URL("../../testing/registry-relay.js", import.meta.url));
/** A tenant's secret, as byte-level token ids (kvfence-tiny's first 256 ids are bytes). */
const SECRET_IDS = [...Buffer.from("account 4242, pin 7319:")];
/**
 * Request `i`'s prompt: its own first page (16 tokens), so that prefix affinity does not pin every
 * request to one prefill node and round-robin reaches each, then the secret.
 */
const promptIds = (i: number) => [...Buffer.from(`${i}: tenant alpha asks `.padEnd(16, ".")), ...SECRET_IDS];
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Starts the relay process; resolves with its address once its copied entry replaced the real one. */
function startRelay(
  args: readonly string[],
  lines: string[],
): Promise<{ address: string; process: ChildProcess }> {
  const child = spawn(process.execPath, [RELAY, ...args], { stdio: ["ignore", "pipe", "pipe"] });
  let err = "";
  child.stderr!.on("data", (d: Buffer) => {
    err += d.toString();
  });
  return new Promise((resolve, reject) => {
    let out = "";
    child.stdout!.on("data", (d: Buffer) => {
      out += d.toString();
      lines.splice(0, lines.length, ...out.split("\n").filter(Boolean));
      const m = /relay at (\S+)/.exec(out);
      if (m !== null) resolve({ address: m[1]!, process: child });
    });
    child.once("exit", (code) => reject(new Error(`the relay exited with ${code}: ${err}`)));
  });
}

for (const tls of [false, true]) {
  const links = tls ? "TLS" : "plaintext";
  describe(`an etcd writer relaying a prefill node, on ${links} links`, { timeout: 240_000 }, () => {
    const prefix = `/kvfence-relay-${links}`;
    let etcd: LocalEtcd;
    let nodes: NodeProcesses;
    let relay: { address: string; process: ChildProcess };
    let router: { url: string; close(): Promise<void> };
    let dir: string;
    const relayLines: string[] = [];
    /** The node processes' stderr (warn level and above). */
    const logs: string[] = [];

    const listed = async (): Promise<NodesInfo["nodes"]> =>
      ((await (await operatorGet(router.url, "/kvfence/nodes")).json()) as NodesInfo).nodes;
    const relayRefusals = async (): Promise<number> => {
      const text = await (await operatorGet(router.url, "/metrics")).text();
      const m = /^kvfence_router_link_refusals_total\{reason="address_mismatch"\} (\d+)$/m.exec(text);
      return m === null ? 0 : Number(m[1]);
    };

    before(async () => {
      assert.ok(etcdAvailable(), "etcd is not installed: apt-get install -y etcd-server (.ci/run does)");
      etcd = await startEtcd();
      dir = mkdtempSync(join(tmpdir(), "kvfence-relay-"));
      nodes = await startNodeProcesses({
        prefill: 2,
        decode: 1,
        model: modelDir(MODEL),
        registry: etcd.url,
        nodeArgs: ["--kv-pages", "256", "--registry-prefix", prefix, ...(tls ? CLUSTER_TLS_ARGS : [])],
        stderr: (line) => logs.push(line),
      });
      // The attacker: prefill-0's entry, copied to the relay's address; the real one deleted.
      const victim = nodes.prefill[0]!.url.replace(/^\w+:\/\//, "");
      relay = await startRelay([etcd.endpoint, prefix, "prefill", victim, join(dir, "up.bin")], relayLines);
      const config = parseServeConfig({
        host: "127.0.0.1",
        port: "0",
        model: modelDir(MODEL),
        pageSize: "16",
        scrubOnFree: false,
        disaggregation: true,
        logLevel: "silent",
        role: "router",
        registry: etcd.url,
        registryPrefix: prefix,
        clusterSecret: nodes.secret,
        operatorKey: TEST_OPERATOR_KEY,
        ...(tls
          ? { tlsCert: CLUSTER_TLS_FILES.cert, tlsKey: CLUSTER_TLS_FILES.key, tlsCa: CLUSTER_TLS_FILES.ca }
          : {}),
      });
      router = await startServer(config, { logger: createLogger({ level: "silent" }) });
      // Until the router has dealt with the relay's entry (admitted or refused it) and the honest
      // pair is up.
      const deadline = Date.now() + 60_000;
      for (;;) {
        const l = await listed();
        const decided = l.some((n) => n.id === `prefill@${relay.address}`) || (await relayRefusals()) > 0;
        if (decided && l.filter((n) => n.up && n.member).length >= 2) break;
        assert.ok(Date.now() < deadline, `the router did not settle: ${JSON.stringify(l)}`);
        await sleep(100);
      }
    });
    after(async () => {
      await router?.close();
      if (relay !== undefined) await stopProcess(relay.process);
      await nodes?.close();
      await etcd?.stop();
      if (dir !== undefined) rmSync(dir, { recursive: true, force: true });
    });

    test("no prompt goes through the relay: the node is refused at the relay's address, counted, and the cluster serves", async () => {
      const client = new OpenAI({
        baseURL: `${router.url}/v1`,
        apiKey: "unused",
        maxRetries: 0,
        timeout: 60_000,
      });
      // Round-robin over the pairs: with the relayed node admitted, some of these go through it.
      for (let i = 0; i < 4; i++) {
        const r = await client.completions.create({
          model: MODEL,
          prompt: promptIds(i),
          max_tokens: 4,
          temperature: 0,
        });
        assert.ok(r.choices[0]!.finish_reason !== null);
      }
      const captured = readFileSync(join(dir, "up.bin")).toString("latin1");
      assert.ok(
        !captured.includes(SECRET_IDS.join(",")),
        `the relay read the prompt's token ids: ${relayLines.join("; ")}`,
      );
      const l = await listed();
      assert.ok(
        !l.some((n) => n.id === `prefill@${relay.address}`),
        `a node joined at the relay's address: ${JSON.stringify(l)}`,
      );
      assert.ok((await relayRefusals()) >= 1, "the router counted the refusal");
      assert.match(
        logs.join("\n"),
        /control port: refused a connection \(address_mismatch\): the peer dialled 127\.0\.0\.1:/,
      );
      // The relay carried a handshake and no link: every connection it relayed is closed.
      const count = (what: RegExp) => relayLines.filter((x) => what.test(x)).length;
      for (let i = 0; i < 50 && count(/ closed: /) < count(/ opened$/); i++) await sleep(100);
      assert.ok(count(/ opened$/) >= 1, `the router dialled the relay: ${relayLines.join("; ")}`);
      assert.equal(
        count(/ closed: /),
        count(/ opened$/),
        `every relayed connection closed: ${relayLines.join("; ")}`,
      );
    });
  });
}
