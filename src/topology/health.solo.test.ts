/**
 * Acceptance (issue #22 item 3): health that tells the truth, against real processes — a router,
 * one prefill and one decode node, each a `kvfence serve` child process on 127.0.0.1, so that a
 * node can be killed, frozen (SIGSTOP) and restarted on its port.
 *
 * `/health` is liveness: 200 while the router process answers, whatever its nodes do. `/ready` is
 * readiness: 200 only while a prefill/decode pair is up and both nodes answer the router's pings
 * within the deadline, else 503 `not_ready` — and it answers at once even while a node is frozen
 * (the state is kept in the background; the handler never waits on a node). `kill -9` of a node
 * makes `/ready` 503 within a second; so does a SIGSTOP. SIGCONT, or the node restarted on its
 * port (a new incarnation), makes it 200 again and requests are served — without restarting the
 * router: it re-dials a lost node and pairs it again. Throughout, /metrics answers 200 and no
 * counter goes down (a frozen, lost or restarted node keeps its counts in the totals).
 */
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { type ServeProcess, spawnServe } from "../../testing/serve-process.js";
import { modelDir } from "../../testing/start-server.js";
import { parsePrometheusText } from "../tools/incident/prometheus-text.js";

const MODEL = "tiny-qwen2";
const env = { KVFENCE_CLUSTER_SECRET: randomBytes(24).toString("hex") };
const OPERATOR_KEY = randomBytes(16).toString("hex");
const nodeArgs = (role: "prefill" | "decode", port: number) => [
  "--role",
  role,
  "--port",
  String(port),
  "--model",
  modelDir(MODEL),
  "--kv-pages",
  "256",
];

/** GET `path`, with how long the answer took. */
async function get(url: string, path: string): Promise<{ status: number; ms: number; body: unknown }> {
  const t0 = performance.now();
  const res = await fetch(`${url}${path}`, { signal: AbortSignal.timeout(10_000) });
  const body: unknown = await res.json();
  return { status: res.status, ms: performance.now() - t0, body };
}

/** Polls /ready every 10 ms until it answers `status`; the time that took (ms) and the slowest answer. */
async function readyBecomes(url: string, status: number, timeoutMs: number) {
  const t0 = performance.now();
  let slowest = 0;
  for (;;) {
    const r = await get(url, "/ready");
    slowest = Math.max(slowest, r.ms);
    if (r.status === status) return { after: performance.now() - t0, slowest, body: r.body };
    if (performance.now() - t0 > timeoutMs) assert.fail(`/ready did not become ${status} in ${timeoutMs} ms`);
    await new Promise((res) => setTimeout(res, 10));
  }
}

/**
 * /metrics answers 200 whatever the nodes do, and no counter (`*_total`) is below its value in
 * `before`: a node that misses the scrape, is lost or comes back as a new incarnation keeps its
 * counts in the totals. The counters now.
 */
async function countersHold(url: string, before: Map<string, number>, what: string) {
  const res = await fetch(`${url}/metrics`, {
    headers: { authorization: `Bearer ${OPERATOR_KEY}` },
    signal: AbortSignal.timeout(10_000),
  });
  const text = await res.text();
  assert.equal(res.status, 200, `/metrics ${what}: ${text.slice(0, 200)}`);
  const counters = new Set([...text.matchAll(/^# TYPE (\S+) counter$/gm)].map((m) => m[1]!));
  const now = new Map([...parsePrometheusText(text)].filter(([k]) => counters.has(k.split("{")[0]!)));
  for (const [k, v] of before)
    assert.ok((now.get(k) ?? 0) >= v, `${k} went down ${what}: ${v} -> ${now.get(k)}`);
  return now;
}

async function served(url: string, what: string): Promise<void> {
  const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: "unused", maxRetries: 0, timeout: 20_000 });
  const reply = await client.chat.completions.create({
    model: MODEL,
    messages: [{ role: "user", content: `hello after ${what}` }],
    max_tokens: 4,
    temperature: 0,
  });
  assert.equal(reply.choices.length, 1, `a request is served after ${what}`);
}

describe("/health and /ready tell the truth about the nodes", { timeout: 180_000 }, () => {
  let prefill: ServeProcess;
  let decode: ServeProcess;
  let router: ServeProcess;

  before(async () => {
    [prefill, decode] = await Promise.all([
      spawnServe(nodeArgs("prefill", 0), { env }),
      spawnServe(nodeArgs("decode", 0), { env }),
    ]);
    router = await spawnServe(
      [
        "--role",
        "router",
        "--port",
        "0",
        "--model",
        modelDir(MODEL),
        "--prefill",
        prefill.url,
        "--decode",
        decode.url,
        "--operator-key",
        OPERATOR_KEY,
      ],
      { env },
    );
  });
  after(async () => {
    await Promise.all([router, prefill, decode].map((p) => p?.stop()));
  });

  test("ready while the pair is up; kill -9 → 503 within 1 s; a restarted node is paired again, no router restart", async (t) => {
    const url = router.url;
    const up = await readyBecomes(url, 200, 10_000);
    assert.deepEqual(up.body, {
      status: "ready",
      prefill: { ready: 1, total: 1 },
      decode: { ready: 1, total: 1 },
    });
    await served(url, "startup");
    let counters = await countersHold(url, new Map(), "at startup");
    const lookups = [...counters].filter(([k]) => k.startsWith("kvfence_prefix_cache_lookups_total"));
    assert.ok(
      lookups.some(([, v]) => v > 0),
      "prefill's counters are in /metrics",
    );

    for (const role of ["prefill", "decode"] as const) {
      const node = role === "prefill" ? prefill : decode;
      const exited = new Promise((r) => node.process.once("exit", r));
      const killedAt = performance.now();
      node.process.kill("SIGKILL");
      await exited;
      const down = await readyBecomes(url, 503, 5000);
      const lost = performance.now() - killedAt;
      assert.ok(lost < 1000, `/ready went 503 ${lost.toFixed(0)} ms after kill -9 of ${role}`);
      t.diagnostic(`kill -9 ${role}: /ready 503 after ${lost.toFixed(0)} ms`);
      const body = down.body as { error: { code: string; type: string; message: string } };
      assert.equal(body.error.code, "not_ready");
      assert.equal(body.error.type, "server_error");
      // Which the router hears first — the node's own link closing, or decode's transfer channel to
      // prefill dropping — is a race; either says why, with no internal id.
      assert.match(
        body.error.message,
        new RegExp(
          `no ${role} node answers \\(0 of 1\\)|no decode node that answers has its transfer channel`,
        ),
      );
      assert.doesNotMatch(body.error.message, /127\.0\.0\.1|prefill-0|decode-0/, "no internal address or id");
      const health = await get(url, "/health");
      assert.equal(health.status, 200, "liveness: the router itself is fine");
      counters = await countersHold(url, counters, `with ${role} killed`);

      // The node comes back on its port as a new incarnation; the router re-dials and re-pairs it.
      const again = await spawnServe(nodeArgs(role, node.port), { env });
      if (role === "prefill") prefill = again;
      else decode = again;
      const back = await readyBecomes(url, 200, 20_000);
      t.diagnostic(`${role} restarted: /ready 200 ${back.after.toFixed(0)} ms after it listened`);
      await served(url, `${role} restarted`);
      counters = await countersHold(url, counters, `with ${role} restarted (its counts start at 0)`);
    }
  });

  test("SIGSTOP of a node → 503 within about a second, /ready still answering at once; SIGCONT → 200 and served", async (t) => {
    const url = router.url;
    await readyBecomes(url, 200, 10_000);
    await served(url, "before SIGSTOP");
    let counters = await countersHold(url, new Map(), "before SIGSTOP");
    for (const [role, node] of [
      ["decode", decode],
      ["prefill", prefill],
    ] as const) {
      const stoppedAt = performance.now();
      node.process.kill("SIGSTOP");
      try {
        const down = await readyBecomes(url, 503, 5000);
        const noticed = performance.now() - stoppedAt;
        assert.ok(noticed < 1500, `/ready went 503 ${noticed.toFixed(0)} ms after SIGSTOP`);
        assert.ok(
          down.slowest < 250,
          `/ready answered in ${down.slowest.toFixed(1)} ms at most while a node froze`,
        );
        const answers: number[] = [];
        for (let i = 0; i < 10; i++) answers.push((await get(url, "/ready")).ms);
        const slowest = Math.max(...answers);
        assert.ok(
          slowest < 250,
          `/ready answers at once with a frozen node: the slowest took ${slowest.toFixed(1)} ms`,
        );
        t.diagnostic(
          `SIGSTOP ${role}: /ready 503 after ${noticed.toFixed(0)} ms; /ready answered in ${Math.max(down.slowest, slowest).toFixed(1)} ms at most while frozen`,
        );
        const health = await get(url, "/health");
        assert.equal(health.status, 200);
        assert.ok(health.ms < 250, `/health answers at once: ${health.ms.toFixed(1)} ms`);
        counters = await countersHold(url, counters, `with ${role} frozen`);
      } finally {
        node.process.kill("SIGCONT");
      }
      const back = await readyBecomes(url, 200, 10_000);
      t.diagnostic(`SIGCONT ${role}: /ready 200 after ${back.after.toFixed(0)} ms`);
      await served(url, "SIGCONT");
    }
  });
});
