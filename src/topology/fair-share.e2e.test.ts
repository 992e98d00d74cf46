/**
 * Acceptance (issue #22 item 2): one tenant's flood does not starve another, against real servers
 * — a TCP cluster (router, prefill and decode processes, 600 KV pages per node) and one engine
 * (`--no-disaggregation`, 600 pages), each a child process, spoken to with the `openai` client.
 *
 * Tenant A sends 100 long requests at once (about 1,400 prompt tokens and 400 out: 113 of the
 * 600 pages each, so the pool holds five). Tenant B, meanwhile, sends short requests one after
 * another. Before fair sharing, A's flood took every page: on the cluster all of B's requests
 * failed with 503 `pool_exhausted` once the router's queue filled with A's, and on one engine B
 * waited behind all of A's. Now A holds at most half the pool (two tenants: the default cap),
 * B's requests start at once, every one succeeds, and B's median latency stays within twice its
 * median alone (measured in the same test, before and after the flood, the larger taken: the
 * machine is shared). Every one of A's requests gets an answer: 200, or — waiting past
 * `--queue-timeout` behind its own tenant's requests — 429 `rate_limit_exceeded` with the OpenAI
 * error envelope and `Retry-After`; none is left hanging.
 */
import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { spawnServe } from "../../testing/serve-process.js";
import { assertPoolIdle, modelDir } from "../../testing/start-server.js";
import { type LocalCluster, startLocalCluster } from "./local-cluster.js";

const MODEL = "tiny-qwen2";
const KEY_A = "sk-tenant-flood-0001";
const KEY_B = "sk-tenant-quiet-0001";
/** About 1,400 prompt tokens. */
const LONG = "x ".repeat(700);
/** The fair-share flags of the test: A's waiting requests give up after 5 s (the default is 30). */
const FAIR_FLAGS = ["--queue-timeout", "5"];

const median = (xs: readonly number[]): number => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)]!;
};

interface Outcome {
  readonly status: number;
  readonly code: string | null;
  readonly retryAfter: string | null;
  readonly type: string | null;
}

async function flood(client: OpenAI, i: number): Promise<Outcome> {
  try {
    await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: `${LONG}${i}` }],
      max_tokens: 400,
      temperature: 0,
    });
    return { status: 200, code: null, retryAfter: null, type: null };
  } catch (err) {
    if (!(err instanceof OpenAI.APIError)) throw err;
    const body = err.error as { code?: string; type?: string; message?: string } | undefined;
    return {
      status: err.status ?? 0,
      code: body?.code ?? null,
      type: body?.type ?? null,
      retryAfter: err.headers?.get("retry-after") ?? null,
    };
  }
}

/** B's requests, one after another; each must succeed. Latencies in ms. */
async function quiet(client: OpenAI, n: number, tag: string): Promise<number[]> {
  const ms: number[] = [];
  for (let i = 0; i < n; i++) {
    const t0 = performance.now();
    const reply = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: `a short question ${tag} ${i}: ${"y".repeat(120)}` }],
      max_tokens: 32,
      temperature: 0,
    });
    ms.push(performance.now() - t0);
    assert.equal(reply.choices.length, 1);
  }
  return ms;
}

for (const topology of ["cluster", "single"] as const) {
  describe(`fair sharing (${topology}): a flood of one tenant does not starve another`, {
    timeout: 180_000,
  }, () => {
    let keysDir: string;
    let url: string;
    let stop: () => Promise<void>;

    before(async () => {
      keysDir = mkdtempSync(join(tmpdir(), "kvfence-keys-"));
      const keys = join(keysDir, "keys.json");
      writeFileSync(keys, JSON.stringify({ [KEY_A]: "flood", [KEY_B]: "quiet" }));
      if (topology === "cluster") {
        const cluster: LocalCluster = await startLocalCluster({
          prefill: 1,
          decode: 1,
          model: modelDir(MODEL),
          nodeArgs: ["--kv-pages", "600"],
          routerArgs: ["--api-keys", keys, ...FAIR_FLAGS],
        });
        url = cluster.url;
        stop = () => cluster.close();
      } else {
        const server = await spawnServe([
          "--no-disaggregation",
          "--port",
          "0",
          "--model",
          modelDir(MODEL),
          "--kv-pages",
          "600",
          "--api-keys",
          keys,
          ...FAIR_FLAGS,
        ]);
        url = server.url;
        stop = () => server.stop();
      }
    });
    after(async () => {
      await stop?.();
      rmSync(keysDir, { recursive: true, force: true });
    });

    test("B is served while A floods, within 2x of its latency alone; every A request gets an answer", async () => {
      const a = new OpenAI({ baseURL: `${url}/v1`, apiKey: KEY_A, maxRetries: 0, timeout: 60_000 });
      const b = new OpenAI({ baseURL: `${url}/v1`, apiKey: KEY_B, maxRetries: 0, timeout: 60_000 });
      await quiet(b, 3, "warm-up");
      const aloneBefore = await quiet(b, 10, "alone");

      let settled = 0;
      const floods = Array.from({ length: 100 }, (_, i) =>
        flood(a, i).finally(() => {
          settled++;
        }),
      );
      await new Promise((r) => setTimeout(r, 300));
      const underFlood = await quiet(b, 15, "flood");
      assert.ok(settled < 100, `A's flood was still on while B ran (${settled} of 100 settled)`);

      const outcomes = await Promise.all(floods);
      const aloneAfter = await quiet(b, 10, "after");
      const served = outcomes.filter((o) => o.status === 200).length;
      const refused = outcomes.filter((o) => o.status !== 200);
      assert.ok(served >= 2, `A is served too: ${served} of 100`);
      for (const o of refused) {
        assert.deepEqual(
          { status: o.status, code: o.code, type: o.type },
          { status: 429, code: "rate_limit_exceeded", type: "requests" },
          "A's requests that waited past --queue-timeout behind its own get 429",
        );
        assert.equal(o.retryAfter, "1");
      }

      const baseline = Math.max(median(aloneBefore), median(aloneAfter));
      const p50 = median(underFlood);
      const shown = (xs: number[]) => xs.map((x) => Math.round(x)).join(" ");
      assert.ok(
        p50 <= 2 * baseline,
        `B's median under A's flood ${p50.toFixed(1)} ms is within 2x of alone (${baseline.toFixed(1)} ms): ` +
          `alone ${shown(aloneBefore)} | flood ${shown(underFlood)} | after ${shown(aloneAfter)}`,
      );
      await assertPoolIdle(url);
    });
  });
}
