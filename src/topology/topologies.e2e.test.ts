/**
 * Acceptance (issue #4): greedy outputs are identical under `--no-disaggregation`, the threaded
 * default topology and a TCP cluster of 2 prefill + 2 decode processes — one at a time and as 16
 * concurrent requests from 3 tenants (official `openai` client) — and every pool is all FREE when
 * idle. Real servers, real processes and sockets on 127.0.0.1.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { assertPoolIdle, modelDir, operatorGet } from "../../testing/start-server.js";
import { linkTlsInTests } from "../../testing/tls-fixtures.js";
import { startCluster, startInProcess, type TopologyServer } from "../../testing/topology-servers.js";

const MODEL = "tiny-qwen2";
/** The 2+2 cluster's links run over TLS (KVFENCE_TEST_LINK_TLS=off: plaintext; docs/tls.md). */
const LINK_TLS = linkTlsInTests(true);
const KEYS = {
  "sk-tenant-alpha-0001": "alpha",
  "sk-tenant-beta-00002": "beta",
  "sk-tenant-gamma-0003": "gamma",
};
const PROMPTS = [
  "Hello there",
  "Write one line about the sea and the wind over it",
  "a",
  "The KV cache of one request must never serve another request; explain why in detail, please.",
  "0123456789 ".repeat(12),
  "Tokens: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu",
];
const MAX_TOKENS = [8, 20, 3, 17, 12, 1];

interface Answer {
  readonly text: string;
  readonly finish: string | null;
  readonly completionTokens: number | undefined;
}

async function ask(client: OpenAI, i: number): Promise<Answer> {
  const res = await client.chat.completions.create({
    model: MODEL,
    messages: [{ role: "user", content: PROMPTS[i % PROMPTS.length]! }],
    max_tokens: MAX_TOKENS[i % MAX_TOKENS.length]!,
    temperature: 0,
  });
  const choice = res.choices[0]!;
  return {
    text: choice.message.content ?? "",
    finish: choice.finish_reason,
    completionTokens: res.usage?.completion_tokens,
  };
}

function clients(server: TopologyServer): OpenAI[] {
  return Object.keys(KEYS).map(
    (key) => new OpenAI({ baseURL: server.baseURL, apiKey: key, maxRetries: 0, timeout: 60_000 }),
  );
}

describe("topologies give identical greedy outputs", { timeout: 110_000 }, () => {
  const servers: { name: string; server: TopologyServer }[] = [];
  const options = { model: modelDir(MODEL), kvPages: 256, maxModelLen: 1024, apiKeys: KEYS };

  before(async () => {
    const [single, threads, cluster] = await Promise.all([
      startInProcess("single", options),
      startInProcess("threads", options),
      startCluster(2, 2, { ...options, linkTls: LINK_TLS }),
    ]);
    servers.push(
      { name: "single", server: single },
      { name: "threads", server: threads },
      { name: `tcp 2+2${LINK_TLS ? " (TLS links)" : ""}`, server: cluster },
    );
  });
  after(async () => {
    await Promise.all(servers.map((s) => s.server.close()));
  });

  const baseline: Answer[] = [];

  test("one at a time: every topology answers each prompt as the single engine does", async () => {
    for (const { name, server } of servers) {
      const [client] = clients(server);
      for (let i = 0; i < PROMPTS.length; i++) {
        const answer = await ask(client!, i);
        if (name === "single") baseline.push(answer);
        else assert.deepEqual(answer, baseline[i], `${name}, prompt ${i}`);
      }
      const m = await assertPoolIdle(server.url);
      if (name !== "single") {
        // Every request's prompt KV crossed the transport once, verified.
        assert.ok((m.get("kvfence_transfer_bytes_total") ?? 0) > 0, `${name}: bytes transferred`);
        assert.equal(
          m.get("kvfence_transfer_gbps_count"),
          PROMPTS.length,
          `${name}: one transfer per request`,
        );
        assert.equal(m.get("kvfence_transfer_checksum_failures_total"), 0);
        assert.equal(m.get("kvfence_transfer_coverage_failures_total"), 0);
      }
    }
    assert.equal(baseline.length, PROMPTS.length);
    assert.ok(
      baseline.some((a) => a.text.length > 0),
      "the model produced text",
    );
  });

  test("16 concurrent requests from 3 tenants: the same answers in every topology, pools all FREE after", async () => {
    for (const { name, server } of servers) {
      const cs = clients(server);
      const answers = await Promise.all(Array.from({ length: 16 }, (_, i) => ask(cs[i % cs.length]!, i)));
      for (let i = 0; i < 16; i++)
        assert.deepEqual(answers[i], baseline[i % PROMPTS.length], `${name}, request ${i}`);
      await assertPoolIdle(server.url);
    }
  });

  test("clients that disconnect mid-request or mid-stream leave every pool all FREE (HTTP, /metrics)", async () => {
    for (const { name, server } of servers) {
      const [client] = clients(server);
      const runs = [0, 1, 2, 5, 10].map(async (afterChunks) => {
        const controller = new AbortController();
        if (afterChunks === 0) setTimeout(() => controller.abort(), 5);
        try {
          const stream = await client!.chat.completions.create(
            {
              model: MODEL,
              messages: [{ role: "user", content: PROMPTS[3]!.repeat(4) }],
              max_tokens: 40,
              temperature: 0,
              stream: true,
            },
            { signal: controller.signal },
          );
          let chunks = 0;
          for await (const _ of stream) if (++chunks >= afterChunks) break;
          controller.abort();
        } catch (err) {
          assert.ok(controller.signal.aborted, `${name}: ${(err as Error).message}`);
        }
      });
      await Promise.all(runs);
      await assertPoolIdle(server.url);
    }
  });

  test("per-phase histograms in every topology, labelled by node and role only (issue #18 item 2)", async () => {
    for (const { name, server } of servers) {
      const text = await (await operatorGet(server.url, "/metrics")).text();
      const series = text.split("\n").filter((l) => l.startsWith("kvfence_phase_seconds_count{"));
      const count = (phase: string, role: string) =>
        series
          .filter((l) => l.includes(`phase="${phase}"`) && l.includes(`role="${role}"`))
          .reduce((s, l) => s + Number(l.slice(l.lastIndexOf(" ") + 1)), 0);
      // The earlier tests ran at least the prompts one at a time and 16 concurrent requests.
      const requests = PROMPTS.length + 16;
      if (name === "single") {
        for (const phase of ["queue_wait", "prefill", "first_token"])
          assert.ok(count(phase, "engine") >= requests, `${name}: ${phase}`);
        assert.ok(count("inter_token", "engine") > requests, `${name}: inter_token`);
      } else {
        for (const phase of ["queue_wait", "reservation", "first_token"])
          assert.ok(count(phase, "router") >= requests, `${name}: router ${phase}`);
        for (const phase of ["queue_wait", "prefill", "transfer"])
          assert.ok(count(phase, "prefill") >= requests, `${name}: prefill ${phase}`);
        for (const phase of ["commit", "inter_token"])
          assert.ok(count(phase, "decode") >= requests, `${name}: decode ${phase}`);
        assert.ok(text.includes("kvfence_phase_transfer_bytes_count{"), `${name}: transfer bytes histogram`);
      }
      for (const line of text.split("\n").filter((l) => l.startsWith("kvfence_phase_"))) {
        assert.doesNotMatch(line, /tenant|alpha|beta|gamma/, `${name}: no tenant in ${line}`);
        assert.match(line, /node="[^"]+".*role="[^"]+"|role="[^"]+".*node="[^"]+"|node="[^"]+",role=/, line);
      }
    }
  });

  test("/kvfence/nodes lists the prefill and decode nodes with their pools", async () => {
    for (const { name, server } of servers) {
      const body = (await (await operatorGet(server.url, "/kvfence/nodes")).json()) as {
        max_model_len: number;
        nodes: { role: string; pool_tokens: number }[];
      };
      const roles = body.nodes.map((n) => n.role).sort();
      const expected =
        name === "single"
          ? ["engine"]
          : name === "threads"
            ? ["decode", "prefill"]
            : ["decode", "decode", "prefill", "prefill"];
      assert.deepEqual(roles, expected, name);
      assert.ok(
        body.nodes.every((n) => n.pool_tokens === 256 * 16),
        name,
      );
      assert.equal(body.max_model_len, 1024, name);
    }
  });
});
