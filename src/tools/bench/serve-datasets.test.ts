import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { fakeAnswer } from "../../../testing/fake-openai-server.js";
import { KvfenceError } from "../../lib/errors.js";
import { Rng } from "../probe/canary.js";
import { buildDataset, type DatasetOptions, drawLength, readShareGpt } from "./serve-datasets.js";

const SAMPLE = fileURLToPath(new URL("../../../../testing/fixtures/sharegpt-sample.jsonl", import.meta.url));

const BASE: DatasetOptions = {
  name: "random",
  numPrompts: 40,
  seed: 1,
  nonce: "ask",
  charsPerToken: 1,
  inputLen: 300,
  outputLen: 64,
  rangeRatio: 0.5,
  prefixGroups: 3,
  prefixLen: 400,
  turns: 3,
};

function turns(options: Partial<DatasetOptions>) {
  return buildDataset({ ...BASE, ...options }).sessions.flatMap((s) => s.turns);
}

test("the random dataset draws lengths on [len·(1−r), len·(1+r)] and plants one unique nonce per request, asked back", () => {
  const all = turns({});
  assert.equal(all.length, 40);
  for (const t of all) {
    assert.ok(t.content.length >= 150 && t.content.length <= 450, String(t.content.length));
    assert.ok(t.outputLen >= 32 && t.outputLen <= 96, String(t.outputLen));
    assert.equal(t.prefix, "");
    // The nonce's record is in the prompt and the question asks for it: kvfence-tiny's (and the
    // fake's) answer is the nonce's code.
    assert.ok(t.content.includes(`the access code of account ${t.nonce.account} is ${t.nonce.code}.`));
    assert.equal(fakeAnswer(t.content).answer, t.nonce.code);
  }
  assert.equal(new Set(all.map((t) => t.nonce.code)).size, 40);
  assert.ok(new Set(all.map((t) => t.content.length)).size > 10, "lengths vary");
  // The same seed gives the same dataset.
  assert.deepEqual(turns({}), all);
});

test("drawLength() is vLLM's integer range, fixed when the ratio is 0", () => {
  const rng = new Rng(4);
  const seen = new Set(Array.from({ length: 400 }, () => drawLength(10, 0.2, rng, 1)));
  assert.deepEqual(
    [...seen].sort((a, b) => a - b),
    [8, 9, 10, 11, 12],
  );
  assert.equal(drawLength(10, 0, rng, 1), 10);
});

test("the plant style places the nonce without a question", () => {
  for (const t of turns({ nonce: "plant", numPrompts: 5 })) {
    assert.ok(t.content.includes(t.nonce.code));
    assert.doesNotMatch(t.content, /What is the access code/);
  }
});

test("the shared-prefix dataset gives each group one long prefix and each request its own nonce", () => {
  const all = turns({ name: "shared-prefix", numPrompts: 9 });
  const prefixes = all.map((t) => t.prefix);
  assert.equal(new Set(prefixes).size, 3);
  for (const [i, p] of prefixes.entries()) {
    assert.equal(p, prefixes[i % 3]);
    assert.ok(p.length >= 400, String(p.length));
    assert.doesNotMatch(p, /access code/, "the shared part carries no nonce");
  }
  assert.equal(new Set(all.map((t) => t.nonce.code)).size, 9);
});

test("the multi-turn dataset splits the requests into sessions of `turns` turns, dispatched turn by turn", () => {
  const d = buildDataset({ ...BASE, name: "multi-turn", numPrompts: 7, turns: 3 });
  assert.deepEqual(
    d.sessions.map((s) => s.turns.length),
    [3, 3, 1],
  );
  assert.deepEqual(
    d.order.map((o) => `${o.session}.${o.turn}`),
    ["0.0", "1.0", "2.0", "0.1", "1.1", "0.2", "1.2"],
  );
});

test("readShareGpt() reads JSON lines and JSON arrays, keeps the first human→gpt pair, skips the rest", () => {
  const { pairs, skipped } = readShareGpt(SAMPLE);
  assert.equal(pairs.length, 6);
  assert.equal(skipped, 0);
  assert.match(pairs[0]!.prompt, /KV cache/);
  const dir = mkdtempSync(join(tmpdir(), "kvfence-sharegpt-"));
  try {
    const file = join(dir, "array.json");
    writeFileSync(
      file,
      JSON.stringify([
        {
          conversations: [
            { from: "system", value: "be brief" },
            { from: "human", value: "Hello there" },
            { from: "gpt", value: "Hi! How can I help?" },
          ],
        },
        { conversations: [{ from: "human", value: "only a question" }] },
        { nothing: true },
      ]),
    );
    const read = readShareGpt(file);
    assert.deepEqual(read.pairs, [{ prompt: "Hello there", completion: "Hi! How can I help?" }]);
    assert.equal(read.skipped, 2);
    writeFileSync(file, "{not json");
    assert.throws(() => readShareGpt(file), /neither a JSON array nor JSON lines/);
    writeFileSync(file, "[]");
    assert.throws(() => readShareGpt(file), /no conversation with a human turn followed by a gpt turn/);
    assert.throws(
      () => readShareGpt(join(dir, "missing.json")),
      (e: unknown) => e instanceof KvfenceError && /Cannot read/.test(e.message),
    );
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("the sharegpt dataset appends a nonce to each human turn and sizes the output from the gpt turn", () => {
  const d = buildDataset({ ...BASE, name: "sharegpt", numPrompts: 8, datasetPath: SAMPLE });
  const all = d.sessions.flatMap((s) => s.turns);
  assert.equal(all.length, 8);
  assert.equal(d.notes.length, 1, "6 conversations for 8 requests: the operator is told");
  for (const t of all) {
    assert.ok(
      t.content.endsWith(
        `the access code of account ${t.nonce.account} is ${t.nonce.code}. What is the access code of account ${t.nonce.account}?`,
      ),
    );
    assert.ok(t.outputLen > 10);
  }
  assert.equal(
    turns({ name: "sharegpt", numPrompts: 2, datasetPath: SAMPLE, sharegptOutputLen: 7 })[0]!.outputLen,
    7,
  );
  assert.throws(() => buildDataset({ ...BASE, name: "sharegpt" }), /needs --dataset-path/);
});

test("a run holds at most 8999 requests (4-digit accounts)", () => {
  assert.throws(() => buildDataset({ ...BASE, numPrompts: 9000 }), /At most 8999 requests per run/);
});
