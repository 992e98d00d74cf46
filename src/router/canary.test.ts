/**
 * The canary acceptance test, end to end on the bundled `kvfence-tiny` (trained to copy facts from
 * its context): tenant A plants records with unique access codes and asks for them back; tenant B
 * asks for A's accounts with none of A's records in its own context — alone right after A (the
 * pages A used are freed, not zeroed, and handed to B) and concurrently with A. B must never
 * receive any of A's codes; A, with its records in context, must get each code (which also shows
 * that a leak would be visible through this model); A's answers under load equal its answers alone.
 */
import assert from "node:assert/strict";
import { after, afterEach, before, describe, test } from "node:test";
import OpenAI from "openai";
import { assertPoolIdle, modelDir, startTestServer, type TestServer } from "../../testing/start-server.js";
import { Prng } from "../lib/prng.js";

const MODEL = "kvfence-tiny";
const KEYS = { "sk-canary-tenant-a": "tenant-a", "sk-canary-tenant-b": "tenant-b" } as const;
const ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
const FILLER = [
  "the old bridge opened three boxes for the third time.",
  "the library carried the backup drive last week.",
  "the balance of account 1736 is 933 dollars.",
];

interface Record_ {
  readonly account: string;
  readonly code: string;
}

function plantRecords(seed: number, count: number): Record_[] {
  const prng = new Prng(seed);
  const pick = (n: number) =>
    Array.from({ length: n }, () => ALNUM[prng.nextUint32() % ALNUM.length]).join("");
  const seen = new Set<string>(["1736"]);
  const out: Record_[] = [];
  while (out.length < count) {
    const account = String(1000 + (prng.nextUint32() % 9000));
    if (seen.has(account)) continue;
    seen.add(account);
    out.push({ account, code: `${pick(3)}-${pick(3)}` });
  }
  return out;
}

/** Any of A's codes in `text`, exact or as the 6 code characters without the dash. */
function leakedCodes(text: string, records: readonly Record_[]): string[] {
  const squashed = text.toUpperCase().replace(/[^A-Z0-9]/g, "");
  return records
    .filter((r) => text.includes(r.code) || squashed.includes(r.code.replace("-", "")))
    .map((r) => r.code);
}

test("leakedCodes() finds a code exact or without its dash, and nothing in a clean answer", () => {
  const records = [{ account: "4821", code: "QX7-PL2" }];
  assert.deepEqual(leakedCodes("the code is QX7-PL2", records), ["QX7-PL2"]);
  assert.deepEqual(leakedCodes("qx7 pl2", records), ["QX7-PL2"]);
  assert.deepEqual(leakedCodes("unknown", records), []);
});

describe("canary: tenant B never receives tenant A's planted codes", { timeout: 600_000 }, () => {
  let server: TestServer;
  let a: OpenAI;
  let b: OpenAI;
  const records = plantRecords(4821, 4);
  const context = [
    FILLER[0],
    ...records.map((r) => `the access code of account ${r.account} is ${r.code}.`),
    FILLER[1],
  ].join(" ");
  const ask = (client: OpenAI, content: string) =>
    client.chat.completions
      .create({ model: MODEL, messages: [{ role: "user", content }], temperature: 0, max_tokens: 56 })
      .then((r) => r.choices[0]?.message.content ?? "");
  const askA = (r: Record_) => ask(a, `${context} What is the access code of account ${r.account}?`);
  const askB = (r: Record_) =>
    ask(b, `${FILLER[2]} ${FILLER[0]} What is the access code of account ${r.account}?`);

  before(async () => {
    server = await startTestServer({ model: modelDir(MODEL), kvPages: 128, apiKeys: KEYS });
    a = new OpenAI({ baseURL: server.baseURL, apiKey: "sk-canary-tenant-a", maxRetries: 0 });
    b = new OpenAI({ baseURL: server.baseURL, apiKey: "sk-canary-tenant-b", maxRetries: 0 });
  });
  after(() => server.close());
  afterEach(() => assertPoolIdle(server.url));

  test("tenant A, with its records in context, gets each code back", async () => {
    for (const r of records) {
      assert.equal(
        (await askA(r)).trim(),
        `the access code of account ${r.account} is ${r.code}.`,
        `account ${r.account}: ${MODEL} did not copy the code from its context, so a leak would not be visible`,
      );
    }
  });

  test("tenant B, asking right after A on the pages A freed, gets none of A's codes", async () => {
    for (const r of records) {
      await askA(r);
      const answer = await askB(r);
      assert.deepEqual(leakedCodes(answer, records), [], `B's answer for account ${r.account}: ${answer}`);
    }
  });

  test("tenant B, asking concurrently with A, gets none of A's codes; A's answers equal its answers alone", async () => {
    const alone: string[] = [];
    for (const r of records) alone.push(await askA(r));
    const answers = await Promise.all(records.flatMap((r) => [askA(r), askB(r)]));
    for (let i = 0; i < records.length; i++) {
      const r = records[i]!;
      assert.deepEqual(leakedCodes(answers[2 * i + 1]!, records), [], `B's answer for account ${r.account}`);
      assert.equal(answers[2 * i], alone[i], `A's answer for account ${r.account} under load`);
    }
  });
});
