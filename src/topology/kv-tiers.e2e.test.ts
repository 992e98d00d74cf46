/**
 * Acceptance (issue #35, item 1): the KV tiers below the prefix cache, with the official `openai`
 * client over real HTTP and real processes. A conversation's pages are evicted from a small pool
 * by other conversations; its next turn still hits (`usage.prompt_tokens_details.cached_tokens`),
 * its pages loaded back from host memory (`--cache-ram`) or from disk (`--cache-disk`), on one
 * engine (`--no-disaggregation`) and on a prefill node process of a TCP cluster; and a prefill node
 * restarted on the same `--cache-disk` and key finds its pages again.
 */
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, describe, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import OpenAI from "openai";
import { type ServeProcess, spawnServe } from "../../testing/serve-process.js";
import { modelDir, scrape, TEST_OPERATOR_KEY } from "../../testing/start-server.js";

const MODEL = "kvfence-tiny";
const env = { KVFENCE_CLUSTER_SECRET: randomBytes(24).toString("hex") };
/** 40 pages of 16 tokens; a request spans at most 512 tokens (32 pages). */
const POOL = ["--model", modelDir(MODEL), "--kv-pages", "40", "--max-model-len", "512"];
const root = mkdtempSync(join(tmpdir(), "kvfence-tiers-e2e-"));
after(() => rmSync(root, { recursive: true, force: true }));

type Message = OpenAI.Chat.Completions.ChatCompletionMessageParam;
type UsageWithDetails = OpenAI.CompletionUsage & { prompt_tokens_details?: { cached_tokens?: number } };

/** A user message of about `sentences` × 36 tokens (this tokenizer), distinct per `topic`. */
function text(topic: string, sentences: number): string {
  const parts: string[] = [];
  for (let i = 0; i < sentences; i++) parts.push(`the ${topic} ledger line ${i} reads ${(i * 7919) % 1000}.`);
  return parts.join(" ");
}

async function chat(url: string, messages: Message[]): Promise<{ answer: string; cached: number }> {
  const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: "unused", maxRetries: 0, timeout: 60_000 });
  const reply = await client.chat.completions.create({
    model: MODEL,
    messages,
    max_tokens: 8,
    temperature: 0,
  });
  const usage = reply.usage as UsageWithDetails | undefined;
  return {
    answer: reply.choices[0]!.message.content ?? "",
    cached: usage?.prompt_tokens_details?.cached_tokens ?? 0,
  };
}

/** Other conversations, long enough together to evict every cached page of a 40-page pool. */
async function crowdOut(url: string): Promise<void> {
  for (const topic of ["amber", "birch", "cobalt", "dune"]) {
    const { cached } = await chat(url, [{ role: "user", content: text(topic, 10) }]);
    assert.equal(cached, 0, `${topic} shares nothing with the conversation`);
  }
}

/**
 * Turn 1 of a conversation, other conversations that evict its pages, then turn 2 (turn 1, its
 * answer, a new question): turn 2's cached tokens, and its messages (for a turn 3).
 */
async function evictedConversation(
  url: string,
  topic: string,
): Promise<{ cached: number; messages: Message[] }> {
  const messages: Message[] = [{ role: "user", content: text(topic, 6) }];
  const first = await chat(url, messages);
  assert.equal(first.cached, 0);
  await crowdOut(url);
  messages.push({ role: "assistant", content: first.answer }, { role: "user", content: "and line 3?" });
  const second = await chat(url, messages);
  return { cached: second.cached, messages };
}

describe("KV tiers on one engine (--no-disaggregation)", { timeout: 180_000 }, () => {
  test("a turn whose pages were evicted hits from --cache-ram", async () => {
    const server = await spawnServe(["--no-disaggregation", "--port", "0", ...POOL, "--cache-ram", "64MiB"]);
    try {
      const { cached } = await evictedConversation(server.url, "ram");
      assert.ok(cached >= 10 * 16, `turn 2 hit its first turn's pages from RAM: cached_tokens ${cached}`);
    } finally {
      await server.stop();
    }
  });
});

describe("KV tiers in the default topology (prefill and decode threads)", { timeout: 180_000 }, () => {
  test("turns loading from --cache-disk while other requests run all succeed, and hit", async () => {
    const dir = join(root, "threads");
    const tierArgs = ["--cache-disk", join(dir, "tier"), "--cache-disk-size", "64MiB"];
    const server = await spawnServe([
      "--port",
      "0",
      ...POOL,
      ...tierArgs,
      "--cache-disk-key",
      join(dir, "key"),
    ]);
    try {
      // Six conversations' first turns (13 pages each) and the crowd push every page to disk.
      const topics = ["ash", "bay", "cedar", "delta", "elm", "fjord"];
      const conversations: Message[][] = [];
      for (const topic of topics) {
        const messages: Message[] = [{ role: "user", content: text(topic, 6) }];
        const first = await chat(server.url, messages);
        messages.push({ role: "assistant", content: first.answer }, { role: "user", content: "and line 3?" });
        conversations.push(messages);
      }
      await crowdOut(server.url);
      // Their next turns wait for disk reads while fresh prompts step beside them: each waiting
      // prompt must reach the prefill engine whole (it reached it empty, a 400, before the fix).
      const fresh = ["gale", "heath", "inlet", "jade"].map((topic) => [
        { role: "user", content: text(topic, 8) } as Message,
      ]);
      const replies = await Promise.all(
        [...conversations, ...fresh].map((messages) => chat(server.url, messages)),
      );
      const hits = replies.slice(0, topics.length).filter((r) => r.cached >= 10 * 16).length;
      assert.ok(
        hits >= 1,
        `a second turn hit its pages from disk: ${replies.map((r) => r.cached).join(", ")}`,
      );
    } finally {
      await server.stop();
    }
  });
});

describe("KV tiers on a prefill node process (TCP cluster)", { timeout: 240_000 }, () => {
  const processes: ServeProcess[] = [];
  after(() => Promise.all(processes.map((p) => p.stop())));
  const node = (role: "prefill" | "decode", port: number, extra: readonly string[] = []) =>
    spawnServe(["--role", role, "--port", String(port), ...POOL, ...extra], { env });

  async function routerOver(prefill: ServeProcess, decode: ServeProcess): Promise<ServeProcess> {
    const router = await spawnServe(
      [
        "--role",
        "router",
        "--port",
        "0",
        "--model",
        modelDir(MODEL),
        "--max-model-len",
        "512",
        "--operator-key",
        TEST_OPERATOR_KEY,
      ].concat(["--prefill", prefill.url, "--decode", decode.url]),
      { env },
    );
    processes.push(router);
    await readyAgain(router.url);
    return router;
  }

  test("a turn whose pages were evicted hits from --cache-ram", async () => {
    const prefill = await node("prefill", 0, ["--cache-ram", "64MiB"]);
    const decode = await node("decode", 0);
    processes.push(prefill, decode);
    const router = await routerOver(prefill, decode);
    const { cached } = await evictedConversation(router.url, "ram");
    assert.ok(cached >= 10 * 16, `turn 2 hit its first turn's pages from RAM: cached_tokens ${cached}`);
    // The router's KV index heard of the spill (the tiers' changes go out as cache events): turn 2,
    // whose pages had left the pool, was routed by the pages in host memory.
    const decisions = await scrape(router.url);
    const hits = decisions.get('kvfence_routing_decisions_total{reason="cache_hit"}') ?? 0;
    assert.equal(hits, 1, "turn 2 (and only it) was routed by the pages the node holds in RAM");
  });

  test("from --cache-disk alone, and again after the prefill node restarts on the same directory and key", async (t) => {
    const disk = ["--cache-disk", join(root, "tier"), "--cache-disk-size", "64MiB"];
    const tierArgs = [...disk, "--cache-disk-key", join(root, "tier.key")];
    let prefill = await node("prefill", 0, tierArgs);
    const decode = await node("decode", 0);
    processes.push(prefill, decode);
    const router = await routerOver(prefill, decode);
    const { cached, messages } = await evictedConversation(router.url, "disk");
    assert.ok(cached >= 10 * 16, `turn 2 hit its first turn's pages from disk: cached_tokens ${cached}`);

    await prefill.stop();
    prefill = await node("prefill", prefill.port, tierArgs);
    processes.push(prefill);
    const back = await readyAgain(router.url);
    t.diagnostic(`prefill restarted: ready again after ${back} ms`);
    messages.push({ role: "assistant", content: "noted" }, { role: "user", content: "and line 5?" });
    const third = await chat(router.url, messages);
    assert.ok(
      third.cached >= 10 * 16,
      `turn 3 after the restart hit from disk: cached_tokens ${third.cached}`,
    );
  });
});

/** Polls the router's /ready until 200: the milliseconds that took. */
async function readyAgain(url: string): Promise<number> {
  const t0 = performance.now();
  for (;;) {
    const res = await fetch(`${url}/ready`, { signal: AbortSignal.timeout(5000) }).catch(() => null);
    if (res?.status === 200) return Math.round(performance.now() - t0);
    if (performance.now() - t0 > 30_000) assert.fail("the router did not become ready in 30 s");
    await sleep(50);
  }
}
