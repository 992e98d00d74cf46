/**
 * Attack reproduction, finding 4 of the second adversarial run (issue #31): a request that can
 * never fit waited 30 s, then got a retryable 429. With two tenants each may run 8 generations at
 * once (half of 16 sequence slots); `n: 64` with a large `max_tokens` (or with `logprobs`, where the
 * disaggregated topologies run every sample as its own request) could never run at once, yet it
 * waited the whole queue timeout, 8 of its samples ran and their work was thrown away, and the
 * answer was 429 with `Retry-After: 1`, which the `openai` client retried twice. (On the bundled
 * tiny model the samples are short enough that the old code ran them all, 8 at a time, and served
 * the request; either way nothing refused it.)
 *
 * Now, in every topology — one engine (`EngineClient`), the threaded and the TCP cluster
 * (`DisaggregatedEngine`) — the request's generations are admitted as one group
 * (src/fair-share/fair-share.ts): such a request gets 400 `request_exceeds_capacity` at once, naming the
 * limit, sent once by the official client (a 400 is not retried), and no prompt token is computed
 * and no token decoded for it (the servers' counters do not move). A group that fits is admitted
 * whole: behind one running request of its tenant, `n: 8` waits until all 8 can run, so none of its
 * samples starts before that request ends. Real servers, real processes and sockets on 127.0.0.1.
 */
import assert from "node:assert/strict";
import { performance } from "node:perf_hooks";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { modelDir, scrape } from "../../testing/start-server.js";
import { linkTlsInTests } from "../../testing/tls-fixtures.js";
import { startCluster, startInProcess, type TopologyServer } from "../../testing/topology-servers.js";

/** Its 1,000 tokens take a second or more, on every topology: the request ahead outlasts the group's start. */
const MODEL = "kvfence-tiny";
const KEY_A = "sk-tenant-attack-0001";
const KEYS = { [KEY_A]: "attacker", "sk-tenant-other-00001": "other" };
/** `--queue-timeout`'s default: what the request used to wait before its 429. */
const QUEUE_TIMEOUT_MS = 30_000;
/** What shows that work ran for a request: prompt tokens computed, decode steps, tokens answered. */
const WORK = ["kvfence_prefill_tokens_total", "kvfence_decode_steps_total"];

/** An `openai` client with its default retries, and how many HTTP requests it sent. */
function countingClient(server: TopologyServer): { client: OpenAI; sent: () => number } {
  let sent = 0;
  const client = new OpenAI({
    baseURL: server.baseURL,
    apiKey: KEY_A,
    timeout: 20_000,
    fetch: (url, init) => {
      sent++;
      return fetch(url, init);
    },
  });
  return { client, sent: () => sent };
}

async function work(server: TopologyServer): Promise<number[]> {
  const m = await scrape(server.url);
  for (const name of WORK) assert.ok(m.has(name), `/metrics has ${name}`);
  const completion = [...m].filter(([k]) => k.startsWith("kvfence_completion_tokens_total"));
  return [...WORK.map((name) => m.get(name) ?? 0), completion.reduce((s, [, v]) => s + v, 0)];
}

const TOPOLOGIES = ["single", "threads", "tcp 1+1"] as const;

describe("a request that can never fit its tenant's caps is refused at once, whole", {
  timeout: 240_000,
}, () => {
  const servers = new Map<string, TopologyServer>();
  const options = { model: modelDir(MODEL), kvPages: 256, maxModelLen: 1024, apiKeys: KEYS };

  before(async () => {
    const started = await Promise.all([
      startInProcess("single", options),
      startInProcess("threads", options),
      startCluster(1, 1, { ...options, linkTls: linkTlsInTests(true) }),
    ]);
    for (const [i, name] of TOPOLOGIES.entries()) servers.set(name, started[i]!);
  });
  after(async () => {
    await Promise.all([...servers.values()].map((server) => server.close()));
  });

  const attacks: { name: string; body: OpenAI.CompletionCreateParamsNonStreaming }[] = [
    {
      name: "n: 64 with a large max_tokens",
      body: { model: MODEL, prompt: "Hello", n: 64, max_tokens: 512 },
    },
    {
      name: "n: 64 with logprobs",
      body: { model: MODEL, prompt: "Hello", n: 64, max_tokens: 16, logprobs: 2 },
    },
  ];
  for (const name of TOPOLOGIES) {
    for (const attack of attacks) {
      test(`${name}: ${attack.name} gets 400 request_exceeds_capacity at once, sent once, and nothing of it runs`, async () => {
        const server = servers.get(name)!;
        const { client, sent } = countingClient(server);
        const before = await work(server);
        const start = performance.now();
        const err = await client.completions.create(attack.body).then(
          () => assert.fail("the request was served"),
          (e: unknown) => e,
        );
        const elapsedMs = performance.now() - start;
        assert.ok(err instanceof OpenAI.APIError, String(err));
        assert.equal(err.status, 400, err.message);
        assert.equal(err.code, "request_exceeds_capacity");
        assert.equal(err.param, "n");
        assert.match(err.message, /64 generations .*at once.*: 64 > 8; lower n to at most 8/);
        assert.equal(sent(), 1, "the client does not retry a 400");
        // Not a bound on speed: the old answer came only after the whole queue timeout.
        assert.ok(elapsedMs < QUEUE_TIMEOUT_MS / 2, `answered in ${elapsedMs.toFixed(0)} ms`);
        assert.deepEqual(await work(server), before, "no prompt token computed, no token decoded");
      });
    }

    for (const logprobs of [undefined, 1]) {
      const what = logprobs === undefined ? "" : " (with logprobs: each sample its own request)";
      test(`${name}: a group that fits is admitted whole: n = 8 behind a running request of its tenant starts after it${what}`, async () => {
        const { client } = countingClient(servers.get(name)!);
        const running = await client.completions.create({
          model: MODEL,
          prompt: "Hello",
          max_tokens: 1000,
          stream: true,
          ignore_eos: true,
        } as OpenAI.CompletionCreateParamsStreaming);
        const iterator = running[Symbol.asyncIterator]();
        await iterator.next(); // its first token: it runs, and holds 1 of its tenant's 8
        let runningEndedAt = 0;
        const drained = (async () => {
          for (let r = await iterator.next(); !r.done; r = await iterator.next());
          runningEndedAt = performance.now();
        })();
        const sentAt = performance.now();
        const group = await client.completions.create({
          model: MODEL,
          prompt: "Hi",
          n: 8,
          max_tokens: 4,
          stream: true,
          ...(logprobs === undefined ? {} : { logprobs }),
        });
        let firstAt = 0;
        const indexes = new Set<number>();
        for await (const chunk of group) {
          firstAt ||= performance.now();
          for (const c of chunk.choices) indexes.add(c.index);
        }
        await drained;
        assert.equal(indexes.size, 8, "every choice answered");
        const times = `sent at ${(sentAt - runningEndedAt).toFixed(0)} ms, first token at ${(firstAt - runningEndedAt).toFixed(0)} ms from the end of the request ahead`;
        assert.ok(sentAt < runningEndedAt, `the request ahead still ran when the group was sent (${times})`);
        assert.ok(firstAt > runningEndedAt, `no sample started before the request ahead ended (${times})`);
      });
    }
  }
});
