/**
 * Concurrent transfers through one TCP writer: a cluster of one prefill and one decode process on
 * the bundled model (96 KiB pages), so every lease goes through the same connection and a burst of
 * requests crosses the writer's 1 MiB flush point while other transfers are in flight. Every answer
 * must equal the single engine's and no transfer may fail its checks. The writer once shared one
 * frame header between calls, and 2 of every 10 concurrent requests failed here (500
 * checksum_mismatch, 503 transfer_failed); the topology test's cluster (two writers per node, 4 KiB
 * pages) never crossed the flush point mid-call.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { assertPoolIdle, modelDir } from "../../testing/start-server.js";
import { linkTlsInTests } from "../../testing/tls-fixtures.js";
import { startCluster, startInProcess, type TopologyServer } from "../../testing/topology-servers.js";

const MODEL = "kvfence-tiny";
/** Plaintext links by default, the other half of topologies.e2e (KVFENCE_TEST_LINK_TLS=on: TLS). */
const LINK_TLS = linkTlsInTests(false);
const KEY = "sk-tenant-alpha-0001";
const REQUESTS = 12;

/** Short prompts (4–5 pages each), so that all of them finish prefill in one engine step and their
 * transfers start in the same turn of the event loop. */
function prompt(i: number): string {
  return `the access code of account ${4100 + i} is Q${i}X-PL${i % 10}.\nWhat is the access code of account ${4100 + i}?`;
}

async function ask(server: TopologyServer, i: number): Promise<string> {
  const client = new OpenAI({ baseURL: server.baseURL, apiKey: KEY, maxRetries: 0, timeout: 60_000 });
  const res = await client.chat.completions.create({
    model: MODEL,
    messages: [{ role: "user", content: prompt(i) }],
    max_tokens: 24,
    temperature: 0,
  });
  return `${res.choices[0]!.finish_reason}: ${res.choices[0]!.message.content}`;
}

describe("TCP cluster, one prefill and one decode process: concurrent transfers", { timeout: 90_000 }, () => {
  let single: TopologyServer;
  let cluster: TopologyServer;
  before(async () => {
    const options = { model: modelDir(MODEL), kvPages: 512, apiKeys: { [KEY]: "alpha" } };
    [single, cluster] = await Promise.all([
      startInProcess("single", options),
      startCluster(1, 1, { ...options, linkTls: LINK_TLS }),
    ]);
  });
  after(async () => {
    await Promise.all([single?.close(), cluster?.close()]);
  });

  test(`${REQUESTS} requests at once get the single engine's answers, every transfer verified`, async () => {
    const baseline: string[] = [];
    for (let i = 0; i < REQUESTS; i++) baseline.push(await ask(single, i));
    const answers = await Promise.all(
      Array.from({ length: REQUESTS }, (_, i) =>
        ask(cluster, i).catch((err: Error) => `error: ${err.message}`),
      ),
    );
    assert.deepEqual(answers, baseline);
    const m = await assertPoolIdle(cluster.url);
    assert.equal(m.get("kvfence_transfer_gbps_count"), REQUESTS, "one transfer per request");
    assert.equal(m.get("kvfence_transfer_checksum_failures_total"), 0);
    assert.equal(m.get("kvfence_transfer_dropped_misaddressed_writes_total"), 0);
    assert.equal(m.get("kvfence_transfer_dropped_stale_writes_total"), 0);
  });
});
