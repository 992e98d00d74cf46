/**
 * Acceptance (issue #4): `kill -9` of a prefill process provably mid-transfer, in a TCP cluster (2
 * prefill + 1 decode processes and a router process, 127.0.0.1).
 *
 * prefill-0 runs the `stall-transfer` node fault: it writes the first half of each lease's pages
 * and stops — no further writes, no manifest, and (its writes never drain) no ABORT_ACK. So before
 * the kill, decode's /metrics show the lease RESERVED with some of its pages landed and the rest
 * missing: the kill lands in the middle of a transfer, not while prefill computes. A second stalled
 * request whose client went away shows its pages QUARANTINED with no ack to release them. Then:
 * the waiting request (no token streamed yet) runs again on the pair that is up and is answered;
 * decode's pages stay non-FREE until the fence
 * (the transfer connection closing) and are all FREE after it — never on a timer; the cluster keeps
 * serving through prefill-1.
 *
 * Requests go to the (prefill, decode) pairs round-robin: on a fresh router the 1st, 3rd, …
 * request goes to prefill-0, the 2nd, 4th, … to prefill-1; a lost pair is skipped.
 */
import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import {
  assertPoolIdle,
  modelDir,
  operatorGet,
  scrape,
  TEST_OPERATOR_KEY,
} from "../../testing/start-server.js";
import { linkTlsArgs, linkTlsInTests } from "../../testing/tls-fixtures.js";
import type { NodesInfo } from "../admin-api/admin-wire.js";
import { UNSAFE_OPT_IN_FLAG } from "../server/unsafe-switches.js";
import { type LocalCluster, startLocalCluster } from "./local-cluster.js";

const MODEL = "tiny-qwen2";
const KEY = "sk-tenant-alpha-0001";
/** About 700 prompt tokens: a lease of about 45 pages of 16 tokens. */
const LONG = "x ".repeat(350);

function chat(url: string, content: string, maxTokens: number, signal?: AbortSignal) {
  return fetch(`${url}/v1/chat/completions`, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${KEY}` },
    body: JSON.stringify({
      model: MODEL,
      messages: [{ role: "user", content }],
      max_tokens: maxTokens,
      temperature: 0,
    }),
    ...(signal === undefined ? {} : { signal }),
  });
}

async function waitFor(
  what: string,
  url: string,
  ok: (m: Map<string, number>) => boolean,
  timeoutMs = 20_000,
) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const m = await scrape(url);
    if (ok(m)) return m;
    if (Date.now() > deadline) {
      const kv = [...m].filter(([k]) => /kv_pages|transfer_pages|quarantined/.test(k));
      assert.fail(`timed out waiting for ${what}: ${kv.map(([k, v]) => `${k} ${v}`).join(", ")}`);
    }
    await new Promise((r) => setTimeout(r, 20));
  }
}

const decodePages = (m: Map<string, number>, state: "reserved" | "quarantined" | "free") =>
  m.get(`kvfence_node_kv_pages{node="decode-0",role="decode",state="${state}"}`) ?? 0;
const landedPages = (m: Map<string, number>) => m.get("kvfence_transfer_pages_total") ?? 0;

describe("kill -9 of a prefill process mid-transfer", { timeout: 120_000 }, () => {
  let cluster: LocalCluster;
  let keysDir: string;

  before(async () => {
    keysDir = mkdtempSync(join(tmpdir(), "kvfence-keys-"));
    const keys = join(keysDir, "keys.json");
    writeFileSync(keys, JSON.stringify({ [KEY]: "alpha" }));
    cluster = await startLocalCluster({
      prefill: 2,
      decode: 1,
      model: modelDir(MODEL),
      // TLS links unless KVFENCE_TEST_LINK_TLS=off: a killed TLS peer is fenced like a TCP one.
      // No prefix cache: its affinity would send the repeated prompt back to the stalled prefill-0
      // (this test pins the round-robin order).
      nodeArgs: [
        "--kv-pages",
        "512",
        "--max-model-len",
        "2048",
        "--prefix-cache",
        "off",
        ...linkTlsArgs(linkTlsInTests(true)),
      ],
      prefillArgsAt: (i) => (i === 0 ? ["--unsafe-fault", "stall-transfer", UNSAFE_OPT_IN_FLAG] : []),
      routerArgs: ["--api-keys", keys, "--operator-key", TEST_OPERATOR_KEY],
    });
  });
  after(async () => {
    await cluster?.close();
    rmSync(keysDir, { recursive: true, force: true });
  });

  test("its request runs again on another pair, decode pages non-FREE until the fence and FREE after, the cluster keeps serving", async () => {
    const url = cluster.url;
    const before0 = await scrape(url);
    assert.equal(decodePages(before0, "reserved"), 0);
    const landed0 = landedPages(before0);

    // 1. A (prefill-0): computed, then half its pages written, then the transfer stalls.
    let aSettled = false;
    const a = chat(url, LONG, 8).finally(() => {
      aSettled = true;
    });
    await waitFor(
      "part of A's lease to land",
      url,
      (m) => decodePages(m, "reserved") > 0 && landedPages(m) > landed0,
    );
    // The stall holds: no manifest, no commit; at most half of the reservation (the prompt's pages
    // and a tail for the generated tokens) ever lands.
    await new Promise((r) => setTimeout(r, 300));
    const m1 = await scrape(url);
    const reservedA = decodePages(m1, "reserved");
    const landedA = landedPages(m1) - landed0;
    assert.ok(landedA > 0, "some of A's pages landed");
    assert.ok(
      landedA <= Math.ceil(reservedA / 2),
      `only part of A's lease landed: ${landedA} of ${reservedA} reserved pages`,
    );
    assert.equal(aSettled, false, "A is still waiting for its transfer");

    // 2. B (prefill-1) is served meanwhile; A's pages stay RESERVED.
    const b = await chat(url, "short prompt", 4);
    assert.equal(b.status, 200);
    await b.json();
    const m2 = await scrape(url);
    assert.equal(decodePages(m2, "reserved"), reservedA, "A's pages stay reserved");

    // 3. C (prefill-0) stalls too, then its client goes away: its pages go QUARANTINED, and with
    //    its writes never drained prefill-0 sends no ABORT_ACK, so only the fence can free them.
    const controller = new AbortController();
    const c = chat(url, `${LONG}y`, 8, controller.signal).catch((err: Error) => err);
    const m3 = await waitFor(
      "part of C's lease to land",
      url,
      (m) => decodePages(m, "reserved") > reservedA && landedPages(m) > landedPages(m2),
    );
    const reservedC = decodePages(m3, "reserved") - reservedA;
    controller.abort();
    assert.ok((await c) instanceof Error);
    // The leased (prompt) pages go QUARANTINED; the tail for generated tokens, never leased to a
    // writer, is freed at once.
    const q = decodePages(
      await waitFor("C's pages quarantined", url, (m) => decodePages(m, "quarantined") > 0),
      "quarantined",
    );
    assert.ok(q <= reservedC && q >= reservedC - 1, `C's leased pages quarantined: ${q} of ${reservedC}`);
    await new Promise((r) => setTimeout(r, 300));
    const beforeKill = await scrape(url);
    assert.equal(decodePages(beforeKill, "quarantined"), q, "no timer releases C's pages");
    assert.equal(decodePages(beforeKill, "reserved"), reservedA, "A's pages are still reserved");
    assert.equal(aSettled, false);

    // 4. kill -9 prefill-0 while A's transfer is half done.
    const killed = cluster.prefill[0]!.process;
    const exited = new Promise((r) => killed.once("exit", r));
    assert.ok(killed.kill("SIGKILL"));
    await exited;

    // No token of A had streamed: it runs again on the pair that is up (prefill-1) and is answered.
    const aRes = await a;
    assert.equal(aRes.status, 200, "A runs again on another pair before its first token");
    const aBody = (await aRes.json()) as { choices: { message: { content: string } }[] };
    assert.ok(aBody.choices[0]!.message.content.length > 0);

    // 5. After the fence every decode page is FREE, and the cluster keeps serving via prefill-1.
    const idle = await assertPoolIdle(url);
    assert.equal(decodePages(idle, "quarantined"), 0);
    assert.equal(decodePages(idle, "reserved"), 0);
    assert.equal(idle.get('kvfence_node_up{node="prefill-0",role="prefill"}'), 0);
    const listed = (await (await operatorGet(url, "/kvfence/nodes")).json()) as NodesInfo;
    assert.deepEqual(
      listed.nodes.map((n) => `${n.id} ${n.up}`),
      ["prefill-0 false", "prefill-1 true", "decode-0 true"],
    );
    for (let i = 0; i < 3; i++) {
      const res = await chat(url, `after the kill ${i}`, 4);
      assert.equal(res.status, 200, `request ${i} after the kill`);
      await res.json();
    }
    await assertPoolIdle(url);
  });
});
