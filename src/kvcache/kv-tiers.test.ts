import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, test } from "node:test";
import { MANIFEST_FILE } from "./kv-tier-disk.js";
import {
  ALL_TIER_GUARDS,
  recordHeaderOf,
  sealRecord,
  type TierGuards,
  type TierPageIdentity,
  tierSecret,
} from "./kv-tier-record.js";
import { KvTiers, type KvTiersOptions, readTierKeyFile, type TierName } from "./kv-tiers.js";

const PAGE_BYTES = 256;
const LAYOUT = "test|kv=f16|page=4|layers=1|kvh=1|hd=16";
const roots: string[] = [];
after(() => {
  for (const r of roots) rmSync(r, { recursive: true, force: true });
});

function tempDir(): string {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-tiers-"));
  roots.push(dir);
  return dir;
}

/** Page `n` of tenant `tenant`: a distinct key, parent, tokens and bytes. */
function page(n: number, tenant = 1, cacheEpoch = 0): { id: TierPageIdentity; bytes: Uint8Array } {
  const key = (n + tenant * 1000).toString(16).padStart(64, "0");
  const bytes = new Uint8Array(PAGE_BYTES).fill((n * 7 + tenant) & 0xff);
  return {
    id: { key, parentKey: "f".repeat(64), tenant, tokens: Int32Array.of(n, n + 1, n + 2, n + 3), cacheEpoch },
    bytes,
  };
}

/** A record's size for a page of this test (header + bytes + MACs): pages 1 to 9 of a tenant are alike. */
function recordBytes(): number {
  const p = page(1);
  const header = {
    v: 1,
    node: "0".repeat(32),
    tenant: 1,
    key: p.id.key,
    parentKey: p.id.parentKey,
    tokens: Array.from(p.id.tokens),
    layout: LAYOUT,
    byteLength: PAGE_BYTES,
    cacheEpoch: 0,
  };
  return sealRecord(tierSecret(randomBytes(32)), header, p.bytes).length;
}

async function openTiers(options: Partial<KvTiersOptions> = {}): Promise<KvTiers> {
  return KvTiers.open({ ramBytes: 0, layout: LAYOUT, pageBytes: PAGE_BYTES, ...options });
}

async function loadedFrom(
  tiers: KvTiers,
  id: TierPageIdentity,
): Promise<{ tier: TierName; bytes: number[] } | null> {
  const r = await tiers.load(id);
  return r === null ? null : { tier: r.tier, bytes: Array.from(r.bytes.subarray(0, 2)) };
}

test("KvTiers.spill() copies the page at once: the RAM tier loads the bytes it had then, verified", async () => {
  const tiers = await openTiers({ ramBytes: 64 * 1024 });
  const p = page(1);
  const pool = p.bytes.slice();
  tiers.spill(p.id, pool);
  pool.fill(0xee); // the pool page is freed and reused right after `evicting`
  await new Promise((r) => setImmediate(r));
  assert.equal(tiers.find(p.id.key), "ram");
  assert.deepEqual(await loadedFrom(tiers, p.id), { tier: "ram", bytes: [p.bytes[0], p.bytes[1]] });
  const stats = tiers.stats();
  assert.equal(stats.spills, 1);
  assert.equal(stats.loads.ram, 1);
  assert.equal(stats.ram.pages, 1);
});

test("KvTiers.spillLater() (the spill-race fault) with the tier-spill-copy guard off reads the pool page after it was reused", async () => {
  const loaded: ({ tier: TierName; bytes: number[] } | null)[] = [];
  for (const spillCopy of [true, false]) {
    const tiers = await openTiers({ ramBytes: 64 * 1024, spillCopy });
    const p = page(1);
    const pool = p.bytes.slice();
    tiers.spillLater(p.id, () => pool);
    pool.fill(0xee); // freed and reused within the step, before the late seal
    await new Promise((r) => setImmediate(r));
    loaded.push(await loadedFrom(tiers, p.id));
  }
  // The guard: the bytes copied at the spill. The bug: another request's KV under this page's key, with a valid MAC.
  assert.deepEqual(loaded, [
    { tier: "ram", bytes: [8, 8] },
    { tier: "ram", bytes: [0xee, 0xee] },
  ]);
});

test("KvTiers: the RAM tier's overflow goes to disk (least recently used first) and loads back from there", async () => {
  const dir = tempDir();
  const tiers = await openTiers({
    ramBytes: 2 * recordBytes(),
    disk: { dir: join(dir, "tier"), maxBytes: 1 << 20 },
    secretKey: randomBytes(32),
  });
  const changes: string[] = [];
  tiers.onTierChange((tenant, keys, tier, change) =>
    changes.push(`${tenant}:${keys[0]!.slice(-2)}:${tier}:${change}`),
  );
  const pages = [page(1), page(2), page(3)];
  for (const p of pages) tiers.spill(p.id, p.bytes);
  await tiers.flush();
  assert.equal(tiers.find(pages[0]!.id.key), "disk");
  assert.equal(tiers.find(pages[2]!.id.key), "ram");
  assert.deepEqual(await loadedFrom(tiers, pages[0]!.id), { tier: "disk", bytes: [8, 8] });
  assert.ok(changes.includes("1:e9:ram:stored") && changes.includes("1:e9:ram:dropped"), changes.join(" "));
  assert.ok(changes.includes("1:e9:disk:stored"), changes.join(" "));
  assert.equal(tiers.stats().loads.disk, 1);
  await tiers.close();
});

test("KvTiers: the disk tier is bounded and drops its least recently used record", async () => {
  const dir = join(tempDir(), "tier");
  const size = recordBytes();
  const tiers = await openTiers({ disk: { dir, maxBytes: 2 * size + 10 }, secretKey: randomBytes(32) });
  const pages = [page(1), page(2), page(3)];
  tiers.spill(pages[0]!.id, pages[0]!.bytes);
  tiers.spill(pages[1]!.id, pages[1]!.bytes);
  assert.notEqual(await tiers.load(pages[0]!.id), null); // page 1 is now more recent than page 2
  tiers.spill(pages[2]!.id, pages[2]!.bytes);
  await tiers.flush();
  assert.equal(tiers.find(pages[1]!.id.key), null);
  assert.equal(tiers.find(pages[0]!.id.key), "disk");
  assert.equal(readdirSync(dir).filter((f) => f.endsWith(".kvt")).length, 2);
  assert.ok(tiers.stats().disk!.bytes <= 2 * size + 10);
  assert.equal(tiers.stats().dropped, 1);
  await tiers.close();
});

test("KvTiers.open() on the same directory and key after a restart finds its pages again", async () => {
  const dir = join(tempDir(), "tier");
  const secretKey = randomBytes(32);
  const first = await openTiers({ disk: { dir, maxBytes: 1 << 20 }, secretKey });
  const pages = [page(1), page(2, 2)];
  for (const p of pages) first.spill(p.id, p.bytes);
  await first.close();
  writeFileSync(join(dir, `${"a".repeat(64)}.kvt.tmp`), "half a record"); // a crash mid-write
  const second = await openTiers({ disk: { dir, maxBytes: 1 << 20 }, secretKey });
  assert.deepEqual(second.disk, { dir, records: 2, deleted: 1 });
  assert.deepEqual(await loadedFrom(second, pages[1]!.id), { tier: "disk", bytes: [16, 16] });
  assert.deepEqual(await loadedFrom(second, pages[0]!.id), { tier: "disk", bytes: [8, 8] });
  await second.close();
});

test("KvTiers.open() refuses a directory another key, another layout or a live process holds, or foreign files", async () => {
  const dir = join(tempDir(), "tier");
  const tiers = await openTiers({ disk: { dir, maxBytes: 1 << 20 }, secretKey: randomBytes(32) });
  await assert.rejects(
    openTiers({ disk: { dir, maxBytes: 1 << 20 }, secretKey: randomBytes(32) }),
    /--cache-disk was written by another node or under another --cache-disk-key/,
  );
  const manifest = JSON.parse(readFileSync(join(dir, MANIFEST_FILE), "utf8")) as { keyFingerprint: string };
  assert.match(manifest.keyFingerprint, /^[0-9a-f]{32}$/);
  await tiers.close();
  const key = randomBytes(32);
  const other = join(tempDir(), "tier");
  await (await openTiers({ disk: { dir: other, maxBytes: 1 << 20 }, secretKey: key })).close();
  await assert.rejects(
    openTiers({ disk: { dir: other, maxBytes: 1 << 20 }, secretKey: key, layout: "other" }),
    /--cache-disk holds pages of another model or KV layout/,
  );
  writeFileSync(join(other, "kvfence-tiers.lock"), String(process.ppid)); // a live process
  await assert.rejects(
    openTiers({ disk: { dir: other, maxBytes: 1 << 20 }, secretKey: key }),
    new RegExp(`--cache-disk is in use by another running node \\(process ${process.ppid}\\)`),
  );
  const foreign = tempDir();
  writeFileSync(join(foreign, "notes.txt"), "mine");
  await assert.rejects(
    openTiers({ disk: { dir: foreign, maxBytes: 1 << 20 }, secretKey: key }),
    /--cache-disk holds files but no kvfence-tiers.json/,
  );
});

/** A disk tier holding `p`, closed (its file written), and the path of `p`'s record. */
async function diskWith(
  p: { id: TierPageIdentity; bytes: Uint8Array },
  secretKey: Buffer,
  guards: TierGuards = ALL_TIER_GUARDS,
) {
  const dir = join(tempDir(), "tier");
  const tiers = await openTiers({ disk: { dir, maxBytes: 1 << 20 }, secretKey, guards });
  tiers.spill(p.id, p.bytes);
  await tiers.flush();
  return { dir, tiers, file: join(dir, `${p.id.key}.kvt`) };
}

test("KvTiers.load() refuses a record corrupted on disk (tier-mac), deletes it and counts it; with the guard off the corrupt bytes load", async () => {
  const key = randomBytes(32);
  const p = page(1);
  for (const guardOn of [true, false]) {
    const { dir, tiers, file } = await diskWith(p, key);
    await tiers.close();
    const record = readFileSync(file);
    record.writeUInt8(record.readUInt8(record.length - 40) ^ 0xff, record.length - 40); // a page byte
    writeFileSync(file, record);
    const reopened = await openTiers({
      disk: { dir, maxBytes: 1 << 20 },
      secretKey: key,
      guards: { ...ALL_TIER_GUARDS, mac: guardOn },
    });
    const loaded = await reopened.load(p.id);
    if (guardOn) {
      assert.equal(loaded, null);
      assert.equal(reopened.stats().rejected.mac, 1);
      await reopened.flush();
      assert.equal(existsSync(file), false, "the bad record is deleted");
    } else assert.notDeepEqual(Array.from(loaded!.bytes), Array.from(p.bytes), "the corrupt page loads");
    await reopened.close();
  }
});

test("KvTiers.load() refuses another tenant's valid record planted under this key's file name (tier-owner)", async () => {
  const key = randomBytes(32);
  const mine = page(1, 1);
  const theirs = page(1, 2);
  for (const guardOn of [true, false]) {
    const { tiers, file } = await diskWith(mine, key, { ...ALL_TIER_GUARDS, owner: guardOn });
    const planted = await diskWith(theirs, key);
    await planted.tiers.close();
    writeFileSync(file, readFileSync(planted.file)); // valid MAC: the same node secret wrote it
    const loaded = await tiers.load(mine.id);
    if (guardOn) {
      assert.equal(loaded, null);
      assert.equal(tiers.stats().rejected.owner, 1);
    } else {
      assert.equal(recordHeaderOf(readFileSync(file)).tenant, 2);
      assert.deepEqual(
        Array.from(loaded!.bytes),
        Array.from(theirs.bytes),
        "tenant 2's KV served to tenant 1",
      );
    }
    await tiers.close();
  }
});

test("KvTiers.load() refuses a record from before the tenant's cache-epoch rotation (tier-epoch)", async () => {
  const key = randomBytes(32);
  const before = page(1, 1, 0);
  const now = { ...before.id, cacheEpoch: 1 };
  for (const guardOn of [true, false]) {
    const { tiers } = await diskWith(before, key, { ...ALL_TIER_GUARDS, epoch: guardOn });
    const loaded = await tiers.load(now);
    if (guardOn) {
      assert.equal(loaded, null);
      assert.equal(tiers.stats().rejected.epoch, 1);
      assert.equal(tiers.find(now.key), null);
    } else assert.deepEqual(Array.from(loaded!.bytes), Array.from(before.bytes), "a retired page served");
    await tiers.close();
  }
});

test("readTierKeyFile() makes a 0600 key of 32 random bytes once, and refuses one inside the tier directory", () => {
  const root = tempDir();
  const file = join(root, "keys", "tier.key");
  const key = readTierKeyFile(file, join(root, "tier"));
  assert.equal(key.length, 32);
  assert.equal(statSync(file).mode & 0o777, 0o600);
  assert.deepEqual(readTierKeyFile(file, null), key);
  assert.throws(
    () => readTierKeyFile(join(root, "tier", "k"), join(root, "tier")),
    /--cache-disk-key must not be inside --cache-disk/,
  );
  writeFileSync(join(root, "short"), "abc");
  assert.throws(() => readTierKeyFile(join(root, "short"), null), /at least 32 bytes .*: 3 bytes in/);
});
