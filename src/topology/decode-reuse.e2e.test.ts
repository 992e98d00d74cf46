/**
 * Acceptance (issue #35, item 2): decode-side reuse, with the official `openai` client over real
 * HTTP, in the threaded topology (worker threads, shared memory) and a TCP cluster of processes.
 * A decode node keeps the full pages of a conversation's turn (prompt and answer) in its own
 * tenant-fenced prefix cache, so turn 2's transfer sends only the pages decode lacks:
 * `kvfence_transfer_pages_reused_total` goes up and `kvfence_transfer_pages_total` counts fewer
 * pages than turn 2's prompt has. Turn 2's greedy answer equals the answer with every cache off
 * (nothing reused on either node). Another tenant sending the same turn 2 reuses nothing.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { assertPoolIdle, modelDir, scrape } from "../../testing/start-server.js";
import {
  startCluster,
  startInProcess,
  type TopologyOptions,
  type TopologyServer,
} from "../../testing/topology-servers.js";

const KEYS = { "sk-reuse-alpha-0001": "alpha", "sk-reuse-beta-00002": "beta" } as const;
const PAGE_SIZE = 16;
const FIRST =
  "the access code of account 4821 is QX7-PL2. the weather was mild. the meeting moved to friday. " +
  "the access code of account 7719 is ZT4-MN8. the train left at nine.\nWhat is the access code of account 4821?";
const SECOND = "And what is the access code of account 7719?";

type Message = OpenAI.ChatCompletionMessageParam;

/** One turn: the conversation so far, answered greedily. */
async function turn(server: TopologyServer, key: string, messages: Message[]) {
  const client = new OpenAI({ baseURL: server.baseURL, apiKey: key, maxRetries: 0 });
  const r = await client.chat.completions.create({
    model: "kvfence-tiny",
    messages,
    max_tokens: 24,
    temperature: 0,
  });
  return { content: r.choices[0]!.message.content ?? "", promptTokens: r.usage?.prompt_tokens ?? 0 };
}

/** A two-turn conversation; the transfer pages sent and reused by each turn (metric deltas). */
async function conversation(server: TopologyServer, key: string) {
  const turns: { content: string; promptTokens: number; sent: number; reused: number }[] = [];
  const messages: Message[] = [{ role: "user", content: FIRST }];
  for (let i = 0; i < 2; i++) {
    const before = await scrape(server.url);
    const t = await turn(server, key, messages);
    const after = await scrape(server.url);
    const delta = (name: string) => (after.get(name) ?? 0) - (before.get(name) ?? 0);
    turns.push({
      ...t,
      sent: delta("kvfence_transfer_pages_total"),
      reused: delta("kvfence_transfer_pages_reused_total"),
    });
    messages.push({ role: "assistant", content: t.content }, { role: "user", content: SECOND });
  }
  return turns;
}

const options: TopologyOptions = { model: modelDir("kvfence-tiny"), kvPages: 128, apiKeys: KEYS };

/** Turn 1 and turn 2's answers with every cache off (threads, --prefix-cache off): nothing reused. */
let reference: string[];

before(async () => {
  const off = await startInProcess("threads", { ...options, prefixCache: "off" });
  try {
    const turns = await conversation(off, "sk-reuse-alpha-0001");
    assert.deepEqual(
      turns.map((t) => t.reused),
      [0, 0],
    );
    reference = turns.map((t) => t.content);
  } finally {
    await off.close();
  }
});

for (const topology of ["threads", "tcp"] as const) {
  describe(`decode-side reuse, ${topology === "tcp" ? "TCP cluster (1 prefill + 1 decode)" : "threaded"}`, {
    timeout: 180_000,
  }, () => {
    let server: TopologyServer;
    before(async () => {
      server =
        topology === "tcp" ? await startCluster(1, 1, options) : await startInProcess("threads", options);
    });
    after(() => server.close());

    test("turn 2 of a conversation holds decode's cached pages of turn 1: fewer pages sent, the answer of no cache", async (t) => {
      const [one, two] = await conversation(server, "sk-reuse-alpha-0001");
      assert.equal(one!.reused, 0, "nothing cached before turn 1");
      assert.equal(one!.sent, Math.ceil(one!.promptTokens / PAGE_SIZE), "turn 1 sends every page");
      const pages = Math.ceil(two!.promptTokens / PAGE_SIZE);
      assert.ok(two!.reused > 0, `turn 2 reuses decode's pages: ${JSON.stringify(two)}`);
      assert.equal(two!.sent + two!.reused, pages, `turn 2's ${pages} prompt pages: sent or held`);
      assert.ok(two!.sent < pages, `turn 2 sends fewer than its ${pages} pages: ${two!.sent}`);
      t.diagnostic(
        `turn 1: ${one!.sent} pages sent; turn 2: ${two!.sent} sent, ${two!.reused} held of ${pages}`,
      );
      assert.deepEqual([one!.content, two!.content], reference, "the answers of every cache off");
      // Another tenant sends alpha's turn 2 as it is, every page of which decode holds for alpha:
      // nothing of alpha's serves beta.
      const messages: Message[] = [
        { role: "user", content: FIRST },
        { role: "assistant", content: one!.content },
        { role: "user", content: SECOND },
      ];
      const before = await scrape(server.url);
      const other = await turn(server, "sk-reuse-beta-00002", messages);
      const after = await scrape(server.url);
      const reused = (m: Map<string, number>) => m.get("kvfence_transfer_pages_reused_total") ?? 0;
      assert.equal(reused(after) - reused(before), 0, "another tenant reuses nothing");
      assert.equal(other.content, two!.content);
      await assertPoolIdle(server.url);
    });
  });
}
