import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { TenantDirectory } from "./api-keys.js";

test("TenantDirectory.parse() reads a JSON object and maps keys to tenant indexes", () => {
  const dir = TenantDirectory.parse(
    '{"sk-alpha-123": "alice", "sk-beta-4567": "bob", "sk-alpha-999": "alice"}',
    "keys.json",
  );
  assert.deepEqual(dir.authenticate("Bearer sk-alpha-123"), { index: 0, name: "alice" });
  assert.deepEqual(dir.authenticate("Bearer sk-alpha-999"), { index: 0, name: "alice" });
  assert.deepEqual(dir.authenticate("bearer sk-beta-4567"), { index: 1, name: "bob" });
  assert.equal(dir.authenticate("Bearer sk-wrong-000"), null);
  assert.equal(dir.authenticate(undefined), null);
  assert.equal(dir.authenticate("sk-alpha-123"), null);
});

test("TenantDirectory.parse() reads `key tenant` lines with comments", () => {
  const dir = TenantDirectory.parse("# keys\nsk-one-11111 a\n\nsk-two-22222   b\n", "keys.txt");
  assert.equal(dir.authenticate("Bearer sk-two-22222")?.name, "b");
  assert.equal(dir.tenants.length, 2);
});

test("TenantDirectory.parse() refuses malformed files with the line and the fix", () => {
  assert.throws(
    () => TenantDirectory.parse("sk-one-11111 a extra\n", "k.txt"),
    /k\.txt: line 1 must be "key tenant"/,
  );
  assert.throws(() => TenantDirectory.parse('{"sk-x-123456": 5}', "k.json"), /must be a string/);
  assert.throws(() => TenantDirectory.parse('{"short": "a"}', "k.json"), /8\+ characters/);
  assert.throws(() => TenantDirectory.parse('{"sk-x-123456": "a b"}', "k.json"), /tenant names/);
  assert.throws(() => TenantDirectory.parse("{nope", "k.json"), /invalid JSON/);
});

test("TenantDirectory.load() prefers the file, then the env value, else anonymous", () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-keys-"));
  try {
    const file = join(dir, "keys.json");
    writeFileSync(file, '{"sk-file-12345": "filetenant"}');
    assert.equal(
      TenantDirectory.load({ file, env: "sk-env-123456 envtenant" }).authenticate("Bearer sk-file-12345")
        ?.name,
      "filetenant",
    );
    assert.equal(
      TenantDirectory.load({ env: "sk-env-123456 envtenant" }).authenticate("Bearer sk-env-123456")?.name,
      "envtenant",
    );
    const anonymous = TenantDirectory.load({});
    assert.equal(anonymous.anonymous, true);
    assert.equal(anonymous.authenticate(undefined)?.name, "anonymous");
    assert.throws(
      () => TenantDirectory.load({ file: join(dir, "missing.json") }),
      /Cannot read the API key file/,
    );
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("TenantDirectory reads per-tenant fair-share limits from JSON objects and `key=value` fields, beside the old forms", () => {
  const json = TenantDirectory.parse(
    JSON.stringify({
      "sk-alpha-123": { tenant: "alice", max_concurrency: 4, max_pages: 0 },
      "sk-alpha-999": { tenant: "alice", weight: 3 },
      "sk-beta-4567": "bob",
    }),
    "keys.json",
  );
  assert.deepEqual(json.authenticate("Bearer sk-alpha-999"), { index: 0, name: "alice" });
  assert.deepEqual(json.limits.get(0), { maxConcurrency: 4, maxPages: 0, weight: 3 });
  assert.equal(json.limits.get(1), undefined, "bob takes the server's limits");
  const lines = TenantDirectory.parse(
    "sk-one-11111 a max_queue=2 weight=2\nsk-two-22222 b\nsk-three-333 a\n",
    "keys.txt",
  );
  assert.deepEqual(lines.limits.get(0), { maxQueue: 2, weight: 2 });
  assert.equal(lines.authenticate("Bearer sk-three-333")?.name, "a");
});

test("TenantDirectory refuses bad limits and keys of one tenant that disagree", () => {
  assert.throws(
    () => TenantDirectory.parse('{"sk-x-123456": {"tenant": "a", "max_pages": -1}}', "k.json"),
    /k\.json: key sk-…56: max_pages must be an integer from 0 to \d+ \(0: no cap\): -1/,
  );
  assert.throws(
    () => TenantDirectory.parse('{"sk-x-123456": {"tenant": "a", "weight": 0}}', "k.json"),
    /weight must be an integer from 1 to 100/,
  );
  assert.throws(
    () => TenantDirectory.parse('{"sk-x-123456": {"tenant": "a", "max_tokens": 5}}', "k.json"),
    /unknown field "max_tokens"; the fields are tenant, max_concurrency/,
  );
  assert.throws(
    () => TenantDirectory.parse('{"sk-x-123456": {"max_pages": 5}}', "k.json"),
    /must be a string or \{"tenant"/,
  );
  assert.throws(
    () => TenantDirectory.parse("sk-x-123456 a max_pages=5\nsk-y-123456 a max_pages=6\n", "k.txt"),
    /keys sk-…56 and sk-…56 of tenant a set different maxPages: 5 and 6/,
  );
  assert.throws(
    () => TenantDirectory.parse("sk-x-123456 a pages:5\n", "k.txt"),
    /line 1 must be "key tenant"/,
  );
});

test("TenantDirectory reads a tenant's cache_epoch from JSON and lines, and refuses keys that disagree", () => {
  const json = TenantDirectory.parse(
    '{"sk-alpha-123": {"tenant": "alice", "cache_epoch": 2}, "sk-alpha-999": "alice", "sk-beta-4567": "bob"}',
    "keys.json",
  );
  assert.equal(json.authenticate("Bearer sk-alpha-999")?.cacheEpoch, 2);
  assert.equal(json.authenticate("Bearer sk-beta-4567")?.cacheEpoch, undefined);
  const lines = TenantDirectory.parse("sk-alpha-123 alice cache_epoch=3 max_pages=10", "keys.txt");
  assert.equal(lines.authenticate("Bearer sk-alpha-123")?.cacheEpoch, 3);
  assert.equal(lines.limits.get(0)?.maxPages, 10);
  assert.throws(
    () =>
      TenantDirectory.parse("sk-alpha-123 alice cache_epoch=1\nsk-alpha-999 alice cache_epoch=2", "keys.txt"),
    /set different cache_epoch: 1 and 2; give the tenant's cache_epoch once/,
  );
  assert.throws(
    () => TenantDirectory.parse('{"sk-alpha-123": {"tenant": "a", "cache_epoch": -1}}', "keys.json"),
    /cache_epoch must be an integer from 0 to 2147483647: -1/,
  );
});
