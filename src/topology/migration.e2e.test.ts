/**
 * Acceptance of issue #36 item 1, migration mid-stream, in TCP clusters of node processes (2
 * prefill + 2 decode, a router process), with the official `openai` client:
 *
 * - (a) the decode node under a streaming greedy request is killed (SIGKILL) after the client has
 *   its 10th token: the request re-runs on the other pair from its prompt plus the tokens already
 *   sent and the client gets the whole answer, text and token count those of the fault-free run;
 *   the router's trace has a `migration` span and `/metrics` counts it. A seeded, sampled request
 *   with a frequency penalty, not streamed, migrates the same way (the sampler's position and the
 *   penalties' counts carried over): its one answer is the fault-free one.
 * - (b) the prefill node killed during the transfer: prefill-0 runs the `stall-transfer` node
 *   fault (it writes half of a lease's pages and stops), so once decode reports pages of the lease
 *   landed the kill lands mid-transfer, deterministically; the request goes on on the other pair and
 *   the client gets the fault-free answer; the trace shows the move.
 * - (c) with `--max-migrations 0` the decode node's loss mid-stream ends the stream with the error
 *   event the client surfaces (503 `node_unavailable`), as before, and `/metrics` counts it as
 *   `budget_spent`.
 *
 * The threaded topology runs the same router code (`DisaggregatedEngine`) over MessagePorts, but
 * with one pair: a lost worker leaves no other pair to migrate to (that case is (c)'s error).
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { type OtlpReceiver, type ReceivedSpan, startOtlpReceiver } from "../../testing/otlp-receiver.js";
import { assertPoolIdle, modelDir, scrape } from "../../testing/start-server.js";
import { startCluster, type TopologyServer } from "../../testing/topology-servers.js";
import { UNSAFE_OPT_IN_FLAG } from "../server/unsafe-switches.js";

const MODEL = "tiny-qwen2";
const KEY = "sk-tenant-alpha-0001";
process.env.OTEL_BSP_SCHEDULE_DELAY = "200";
/**
 * Long enough that the kill after the 10th chunk lands while decode still generates: at 600 a
 * loaded CI machine once let the tiny model finish the answer first (no migration to count). The
 * long prompt's 700 tokens plus these fit the model's 2,048.
 */
const MAX_TOKENS = 1300;
const PROMPT = "Tell me a very long story about the sea and the ships on it";
/** About 700 prompt tokens: a lease of about 45 pages of 16 tokens (its transfer takes many writes). */
const LONG = "x ".repeat(350);
const options = { model: modelDir(MODEL), kvPages: 512, maxModelLen: 2048, apiKeys: { [KEY]: "alpha" } };

interface Answer {
  text: string;
  completionTokens: number;
  error: Error | null;
}

function client(server: TopologyServer, requestId: string): OpenAI {
  return new OpenAI({
    baseURL: server.baseURL,
    apiKey: KEY,
    maxRetries: 0,
    defaultHeaders: { "x-request-id": requestId },
  });
}

/** A greedy streamed answer of `MAX_TOKENS` tokens; `onChunk` sees the count of text chunks so far. */
async function streamed(
  server: TopologyServer,
  requestId: string,
  onChunk: (chunks: number) => void = () => {},
  prompt = PROMPT,
): Promise<Answer> {
  const answer: Answer = { text: "", completionTokens: 0, error: null };
  let chunks = 0;
  try {
    const stream = await client(server, requestId).chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: prompt }],
      max_tokens: MAX_TOKENS,
      temperature: 0,
      stream: true,
      stream_options: { include_usage: true },
      ...({ ignore_eos: true } as object),
    });
    for await (const chunk of stream) {
      const delta = chunk.choices[0]?.delta.content ?? "";
      if (delta !== "") {
        answer.text += delta;
        onChunk(++chunks);
      }
      if (chunk.usage) answer.completionTokens = chunk.usage.completion_tokens;
    }
  } catch (err) {
    answer.error = err as Error;
  }
  return answer;
}

/** A seeded, sampled answer with a frequency penalty, not streamed. */
async function sampled(server: TopologyServer, requestId: string): Promise<Answer> {
  const res = await client(server, requestId).chat.completions.create({
    model: MODEL,
    messages: [{ role: "user", content: `${PROMPT}, sampled` }],
    max_tokens: MAX_TOKENS,
    temperature: 0.9,
    seed: 1234,
    frequency_penalty: 0.5,
    ...({ ignore_eos: true } as object),
  });
  return {
    text: res.choices[0]!.message.content ?? "",
    completionTokens: res.usage!.completion_tokens,
    error: null,
  };
}

/**
 * Waits until neither decode node reports an attempt: the nodes' figures reach the router by
 * polling, so one could still show an earlier request's attempt when the next request starts.
 */
async function idleDecodes(server: TopologyServer): Promise<void> {
  const deadline = Date.now() + 20_000;
  for (;;) {
    const m = await scrape(server.url);
    const busy = [0, 1].some(
      (i) => (m.get(`kvfence_node_protocol_attempts{node="decode-${i}",role="decode"}`) ?? 0) > 0,
    );
    if (!busy) return;
    assert.ok(Date.now() < deadline, "the decode nodes hold no attempt between requests");
    await new Promise((r) => setTimeout(r, 5));
  }
}

/** The decode node holding an attempt now (the one under the one request in flight). */
async function busyDecode(server: TopologyServer): Promise<number> {
  const deadline = Date.now() + 20_000;
  for (;;) {
    const m = await scrape(server.url);
    for (const i of [0, 1]) {
      if ((m.get(`kvfence_node_protocol_attempts{node="decode-${i}",role="decode"}`) ?? 0) > 0) return i;
    }
    assert.ok(Date.now() < deadline, "a decode node holds the request");
    await new Promise((r) => setTimeout(r, 5));
  }
}

async function kill(server: TopologyServer, role: "prefill" | "decode", i: number): Promise<void> {
  const child = server.cluster![role][i]!.process;
  const exited = new Promise((r) => child.once("exit", r));
  assert.ok(child.kill("SIGKILL"));
  await exited;
}

const migrations = (m: Map<string, number>, reason: string, result: string): number =>
  m.get(`kvfence_migrations_total{reason="${reason}",result="${result}"}`) ?? 0;

/** The router's `migration` spans of `requestId` (built after they end, exported in batches). */
async function migrationSpans(
  receiver: OtlpReceiver,
  requestId: string,
  count: number,
): Promise<ReceivedSpan[]> {
  const deadline = Date.now() + 20_000;
  for (;;) {
    const spans = receiver.spans.filter(
      (s) => s.name === "migration" && s.attributes["kvfence.request_id"] === requestId,
    );
    if (spans.length >= count || Date.now() > deadline) return spans;
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** The fault-free answers, from the first cluster before any kill (greedy and seeded: the same in every cluster). */
let reference: Answer;
let referenceLong: Answer;

describe("migration mid-stream: 2 prefill + 2 decode processes, the decode node killed", {
  timeout: 240_000,
}, () => {
  let receiver: OtlpReceiver;
  let server: TopologyServer;

  before(async () => {
    receiver = await startOtlpReceiver();
    server = await startCluster(2, 2, { ...options, otlpEndpoint: receiver.url });
    reference = await streamed(server, "reference");
    assert.equal(reference.error, null);
    assert.equal(reference.completionTokens, MAX_TOKENS);
    referenceLong = await streamed(server, "reference-long", undefined, LONG);
    assert.equal(referenceLong.error, null);
  });
  after(async () => {
    await server?.close();
    await receiver?.close();
  });

  test("DisaggregatedEngine migrates a streamed request whose decode node is killed after its 10th token: the whole fault-free answer", async () => {
    const { answer, chunksAtKill, endedBeforeKill } = await killDecodeAfterTenth(server, "migrated");
    const got = await answer;
    assert.equal(got.error, null, `the stream goes on: ${got.error?.message}`);
    assert.ok(!endedBeforeKill && chunksAtKill >= 10, `killed mid-stream, at chunk ${chunksAtKill}`);
    assert.equal(got.completionTokens, reference.completionTokens, "the fault-free token count");
    assert.equal(got.text, reference.text, "the fault-free text: nothing sent twice, nothing missing");
    const m = await scrape(server.url);
    assert.equal(migrations(m, "node_unavailable", "migrated"), 1, "/metrics counts the migration");
    const spans = await migrationSpans(receiver, "migrated", 1);
    assert.equal(spans.length, 1, "the trace shows the migration");
    assert.equal(spans[0]!.service, "kvfence-router");
    assert.equal(spans[0]!.attributes["kvfence.migration.reason"], "node_unavailable");
    const sent = spans[0]!.attributes["kvfence.migration.tokens_sent"] as number;
    assert.ok(sent >= 10 && sent < MAX_TOKENS, `the migration resumed after the tokens sent: ${sent}`);
    await assertPoolIdle(server.url);
  });
});

describe("migration mid-stream: a seeded, sampled, penalised request, not streamed (1 prefill + 2 decode)", {
  timeout: 240_000,
}, () => {
  let server: TopologyServer;

  before(async () => {
    server = await startCluster(1, 2, options);
  });
  after(async () => {
    await server?.close();
  });

  test("DisaggregatedEngine migrates it with the sampler's position and the penalties' counts: the one fault-free answer", async () => {
    const faultFree = await sampled(server, "sampled-reference");
    const answer = sampled(server, "sampled-migrated");
    const victim = await busyDecode(server);
    // Some tokens in: the router's ledger shows none, so wait for the stream to be well under way.
    await new Promise((r) => setTimeout(r, 50));
    await kill(server, "decode", victim);
    const got = await answer;
    const m = await scrape(server.url);
    assert.equal(migrations(m, "node_unavailable", "migrated"), 1, "it migrated mid-stream");
    assert.equal(got.completionTokens, faultFree.completionTokens);
    assert.equal(got.text, faultFree.text, "the seeded draws and the penalties went on where they were");
  });
});

describe("the prefill node killed during the transfer; --max-migrations 0 (2 prefill + 2 decode)", {
  timeout: 240_000,
}, () => {
  let receiver: OtlpReceiver;
  let server: TopologyServer;

  before(async () => {
    receiver = await startOtlpReceiver();
    server = await startCluster(2, 2, {
      ...options,
      otlpEndpoint: receiver.url,
      routerArgs: ["--max-migrations", "0"],
      // prefill-0 writes the first half of each lease's pages and stalls: a kill lands mid-transfer.
      prefillArgsAt: (i) => (i === 0 ? ["--unsafe-fault", "stall-transfer", UNSAFE_OPT_IN_FLAG] : []),
    });
  });
  after(async () => {
    await server?.close();
    await receiver?.close();
  });

  test("DisaggregatedEngine moves a request whose prefill node is killed mid-transfer: the whole fault-free answer", async () => {
    const landed0 = (await scrape(server.url)).get("kvfence_transfer_pages_total") ?? 0;
    // A fresh router sends its first request to the first pair, (prefill-0, decode-0).
    const answer = streamed(server, "moved", undefined, LONG);
    const deadline = Date.now() + 20_000;
    for (;;) {
      const landed = (await scrape(server.url)).get("kvfence_transfer_pages_total") ?? 0;
      if (landed > landed0) break;
      assert.ok(Date.now() < deadline, "pages of the lease land on decode");
      await new Promise((r) => setTimeout(r, 10));
    }
    await kill(server, "prefill", 0);
    const got = await answer;
    assert.equal(got.error, null, `the stream goes on: ${got.error?.message}`);
    assert.equal(got.completionTokens, referenceLong.completionTokens);
    assert.equal(got.text, referenceLong.text, "the fault-free answer");
    const spans = await migrationSpans(receiver, "moved", 1);
    assert.equal(spans.length, 1, "the trace shows the move");
    assert.equal(spans[0]!.attributes["kvfence.migration.tokens_sent"], 0, "before its first token");
    await assertPoolIdle(server.url);
  });

  test("DisaggregatedEngine ends the stream with the error event under --max-migrations 0, and counts it", async () => {
    const { answer } = await killDecodeAfterTenth(server, "budget");
    const got = await answer;
    assert.ok(got.error instanceof OpenAI.APIError, `the client surfaces the error event: ${got.error}`);
    assert.match(got.error.message, /not available now/);
    assert.ok(got.text.length > 0, "tokens streamed before it");
    const m = await scrape(server.url);
    assert.equal(migrations(m, "node_unavailable", "budget_spent"), 1, "/metrics counts it");
    assert.equal(migrations(m, "node_unavailable", "migrated"), 0);
    await assertPoolIdle(server.url);
  });
});

/** Streams the greedy request and kills its decode node once the client has its 10th token. */
async function killDecodeAfterTenth(
  server: TopologyServer,
  requestId: string,
): Promise<{ answer: Promise<Answer>; chunksAtKill: number; endedBeforeKill: boolean }> {
  let tenth: () => void = () => {};
  const tenthSeen = new Promise<void>((r) => {
    tenth = r;
  });
  let chunks = 0;
  let ended = false;
  await idleDecodes(server);
  const answer = streamed(server, requestId, (n) => {
    chunks = n;
    if (n === 10) tenth();
  }).finally(() => {
    ended = true;
  });
  // The victim is found while the answer starts (a scrape polls the nodes), so the kill follows the
  // 10th chunk at once: found after it, a short answer on a fast machine had ended before the kill.
  const victim = await busyDecode(server);
  await Promise.race([tenthSeen, answer]);
  const chunksAtKill = chunks;
  const endedBeforeKill = ended;
  await kill(server, "decode", victim);
  return { answer, chunksAtKill, endedBeforeKill };
}
