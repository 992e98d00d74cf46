import assert from "node:assert/strict";
import { test } from "node:test";
import { fakeAnswer } from "../../../testing/fake-openai-server.js";
import { KvfenceError } from "../../lib/errors.js";
import {
  buildPrompt,
  CanaryFactory,
  CanaryIndex,
  checkTemplates,
  DEFAULT_QUESTION_TEMPLATE,
  DEFAULT_RECORD_TEMPLATE,
  Rng,
} from "./canary.js";

const TEMPLATES = checkTemplates(DEFAULT_RECORD_TEMPLATE, DEFAULT_QUESTION_TEMPLATE);

test("CanaryFactory.record() hands out unique accounts and codes in the bundled model's format", () => {
  const f = new CanaryFactory(new Rng(1));
  const records = f.records(500);
  assert.equal(new Set(records.map((r) => r.account)).size, 500);
  assert.equal(new Set(records.map((r) => r.code)).size, 500);
  for (const r of records) {
    assert.match(r.account, /^\d{4}$/);
    assert.match(r.code, /^[A-Z0-9]{3}-[A-Z0-9]{3}$/);
  }
});

test("Rng gives the same sequence for the same seed", () => {
  const a = new CanaryFactory(new Rng(42)).records(5);
  const b = new CanaryFactory(new Rng(42)).records(5);
  assert.deepEqual(a, b);
  assert.notDeepEqual(a, new CanaryFactory(new Rng(43)).records(5));
});

test("buildPrompt() hits the target length exactly and keeps every record and the question parseable", () => {
  const rng = new Rng(9);
  const records = new CanaryFactory(rng).records(12);
  for (const target of [50, 1000, 4097, 200_000]) {
    const ask = records[target % records.length]!;
    const p = buildPrompt({
      records,
      askAccount: ask.account,
      targetChars: target,
      templates: TEMPLATES,
      rng,
    });
    const minimum = records.length * 50;
    if (target >= minimum) assert.equal(p.length, target);
    for (const r of records) assert.ok(p.includes(`the access code of account ${r.account} is ${r.code}.`));
    assert.ok(p.endsWith(`What is the access code of account ${ask.account}?`));
    assert.equal(fakeAnswer(p).answer, ask.code);
  }
});

test("buildPrompt() spreads records through the filler rather than bunching them", () => {
  const rng = new Rng(2);
  const records = new CanaryFactory(rng).records(4);
  const p = buildPrompt({
    records,
    askAccount: records[0]!.account,
    targetChars: 10_000,
    templates: TEMPLATES,
    rng,
  });
  const positions = records.map((r) => p.indexOf(r.code));
  assert.ok(positions[0]! > 1000 && positions[3]! < 9000, String(positions));
  assert.ok(positions[1]! - positions[0]! > 1000);
});

test("CanaryIndex.scan() finds codes exactly and as dash-less, case-insensitive fragments", () => {
  const index = new CanaryIndex();
  index.add({ account: "4821", code: "QX7-PL2" });
  index.add({ account: "1234", code: "AB1-CD2" });
  assert.deepEqual(index.scan("QX7-PL2"), [{ code: "QX7-PL2", account: "4821", match: "exact" }]);
  assert.deepEqual(index.scan("the code is qx7 pl2"), [
    { code: "QX7-PL2", account: "4821", match: "fragment" },
  ]);
  assert.deepEqual(index.scan("QX7PL2"), [{ code: "QX7-PL2", account: "4821", match: "fragment" }]);
  assert.deepEqual(index.scan("unknown"), []);
  // Five characters of a code are not enough.
  assert.deepEqual(index.scan("QX7-PL"), []);
  assert.equal(index.scan("QX7-PL2 and AB1-CD2").length, 2);
});

test("CanaryIndex.scan() matches 6-character fragments of longer codes", () => {
  const index = new CanaryIndex();
  index.add({ account: "9999", code: "ABCD-EFGH-JKLM" });
  assert.equal(index.scan("...xxDEFGHJyy...")[0]?.match, "fragment");
  assert.deepEqual(index.scan("ABCDE"), []);
});

test("checkTemplates() rejects templates without their placeholders", () => {
  assert.throws(() => checkTemplates("account {account}", DEFAULT_QUESTION_TEMPLATE), KvfenceError);
  assert.throws(() => checkTemplates(DEFAULT_RECORD_TEMPLATE, "What is it?"), /needs \{account\}/);
});
