/**
 * Acceptance (issue #4): `kill -9` of a prefill process mid-request in a TCP cluster (2 prefill + 1
 * decode processes and a router process, 127.0.0.1). Its in-flight requests get 503
 * `node_unavailable`; decode pages that the killed node could still write stay QUARANTINED until
 * its connection is gone (the fence) — never released on a timer — and return to FREE after; the
 * cluster keeps serving through the other prefill node.
 *
 * The prefill nodes run with `--unsafe-fault drop-abort-ack` (SGLang #38961: the ack is lost), so
 * after a client disconnect mid-transfer the only way out for the quarantined pages is the fence.
 * Requests go to the (prefill, decode) pairs round-robin: on a fresh router, the 1st, 3rd, …
 * request goes to prefill-0, the 2nd, 4th, … to prefill-1.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { assertPoolIdle, modelDir, scrape } from "../../testing/start-server.js";
import { startCluster, type TopologyServer } from "../../testing/topology-servers.js";

const MODEL = "tiny-qwen2";
const KEY = "sk-tenant-alpha-0001";
/** About 1,400 prompt tokens; with 4 prefill tokens per step, prefill takes hundreds of steps. */
const LONG = "x ".repeat(700);

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
  timeoutMs = 15_000,
) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const m = await scrape(url);
    if (ok(m)) return m;
    if (Date.now() > deadline) assert.fail(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

const quarantined = (m: Map<string, number>) => m.get('kvfence_kv_pool_pages{state="quarantined"}') ?? 0;

describe("kill -9 of a prefill process", { timeout: 100_000 }, () => {
  let server: TopologyServer;

  before(async () => {
    server = await startCluster(2, 1, {
      model: modelDir(MODEL),
      kvPages: 512,
      maxModelLen: 2048,
      maxPrefillTokens: 4,
      apiKeys: { [KEY]: "alpha" },
      faults: ["drop-abort-ack"],
    });
  });
  after(() => server.close());

  test("503 for its requests, decode pages FREE only after the fence, the cluster keeps serving", async () => {
    const url = server.url;
    // 1. prefill-0: the client goes away while prefill is computing/writing; the ack is dropped.
    const controller = new AbortController();
    const a = chat(url, LONG, 8, controller.signal).catch((err: Error) => err);
    await waitFor(
      "the lease of request A",
      url,
      (m) => (m.get('kvfence_kv_pool_pages{state="reserved"}') ?? 0) > 0,
    );
    controller.abort();
    assert.ok((await a) instanceof Error);
    const q = quarantined(await waitFor("quarantined pages", url, (m) => quarantined(m) > 0));

    // 2. prefill-1 serves meanwhile; the quarantine holds (no timer releases it).
    const b = await chat(url, "short prompt", 4);
    assert.equal(b.status, 200);
    assert.equal(quarantined(await scrape(url)), q, "quarantined pages wait for the ack or the fence");

    // 3. One long request on each prefill node; kill -9 prefill-0 while it computes C.
    const c = chat(url, LONG, 8);
    const d = chat(url, `${LONG}y`, 8);
    await waitFor(
      "the leases of C and D",
      url,
      (m) => (m.get('kvfence_kv_pool_pages{state="reserved"}') ?? 0) > q,
    );
    assert.equal(quarantined(await scrape(url)), q, "still quarantined before the fence");
    const killed = server.cluster!.prefill[0]!.process;
    const exited = new Promise((r) => killed.once("exit", r));
    assert.ok(killed.kill("SIGKILL"));
    await exited;

    const cRes = await c;
    assert.equal(cRes.status, 503);
    const cBody = (await cRes.json()) as { error: { code: string; type: string } };
    assert.equal(cBody.error.code, "node_unavailable");
    assert.equal((await d).status, 200, "the request on the other prefill node completes");

    // 4. After the fence every decode page is FREE again, and the cluster keeps serving.
    const idle = await assertPoolIdle(url);
    assert.equal(quarantined(idle), 0);
    assert.equal(idle.get('kvfence_node_up{node="prefill-0",role="prefill"}'), 0);
    for (let i = 0; i < 3; i++) {
      const res = await chat(url, `after the kill ${i}`, 4);
      assert.equal(res.status, 200, `request ${i} after the kill`);
    }
    await assertPoolIdle(url);
  });
});
