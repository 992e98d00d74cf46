import assert from "node:assert/strict";
import { test } from "node:test";
import { checksumLeasePages, pageChecksum, pageChecksumHex } from "./page-checksum.js";
import type { Manifest } from "./transport.js";
import { type TransferReservation, verifyManifest } from "./verify-manifest.js";

const PAGE_BYTES = 256;
const NUM_PAGES = 8;

function fixture() {
  const pool = new Uint8Array(new SharedArrayBuffer(NUM_PAGES * PAGE_BYTES));
  for (let i = 0; i < pool.length; i++) pool[i] = (i * 31 + 7 + (i >> 8) * 13) & 0xff;
  const lease = { rid: 42, epoch: 3, pages: [{ page: 5 }, { page: 1 }, { page: 6 }] };
  const reservation: TransferReservation = { rid: 42, epoch: 3, tokenStart: 0, tokenEnd: 40, numPages: 3 };
  const sent: string[] = [];
  checksumLeasePages(sent, pool, PAGE_BYTES, lease, 0, 3);
  const manifest: Manifest = {
    type: "manifest",
    rid: 42,
    epoch: 3,
    tokenStart: 0,
    tokenEnd: 40,
    firstToken: 9,
    checksums: sent,
  };
  const local = (): string[] => {
    const out: string[] = [];
    checksumLeasePages(out, pool, PAGE_BYTES, lease, 0, 3);
    return out;
  };
  return { pool, lease, reservation, manifest, local };
}

test("verifyManifest() accepts full coverage with matching checksums", () => {
  const { reservation, manifest, local } = fixture();
  assert.deepEqual(verifyManifest(reservation, manifest, local()), { code: "ok" });
});

test("verifyManifest() reports checksum_mismatch with the page and both values after a flipped byte", () => {
  const { pool, reservation, manifest, local } = fixture();
  pool[1 * PAGE_BYTES + 17]! ^= 0x40; // logical page 1 lives in physical page 1
  const actual = local();
  const verdict = verifyManifest(reservation, manifest, actual);
  assert.deepEqual(verdict, {
    code: "checksum_mismatch",
    page: 1,
    expected: manifest.checksums[1],
    actual: actual[1],
  });
  assert.notEqual(manifest.checksums[1], actual[1]);
});

test("verifyManifest() reports coverage_mismatch for a placeholder that covers one token", () => {
  const { reservation, manifest, local } = fixture();
  const placeholder = { ...manifest, tokenEnd: 1, checksums: manifest.checksums.slice(0, 1) };
  assert.deepEqual(verifyManifest(reservation, placeholder, local()), {
    code: "coverage_mismatch",
    reserved: { tokenStart: 0, tokenEnd: 40, numPages: 3 },
    manifest: { tokenStart: 0, tokenEnd: 1, numPages: 1 },
  });
});

test("verifyManifest() reports coverage_mismatch when the page count differs but the tokens agree", () => {
  const { reservation, manifest, local } = fixture();
  const short = { ...manifest, checksums: manifest.checksums.slice(0, 2) };
  const verdict = verifyManifest(reservation, short, local());
  assert.equal(verdict.code, "coverage_mismatch");
});

test("verifyManifest() reports stale_manifest for another epoch of the same request", () => {
  const { reservation, manifest, local } = fixture();
  const verdict = verifyManifest(reservation, { ...manifest, epoch: 2 }, local());
  assert.deepEqual(verdict, {
    code: "stale_manifest",
    expected: { rid: 42, epoch: 3 },
    actual: { rid: 42, epoch: 2 },
  });
});

test("verifyManifest() throws when decode passes fewer local checksums than it reserved", () => {
  const { reservation, manifest, local } = fixture();
  assert.throws(() => verifyManifest(reservation, manifest, local().slice(0, 2)), { code: "internal" });
});

test("pageChecksumHex() is 16 hex digits keyed by rid, epoch and logical index, not only the bytes", () => {
  assert.match(pageChecksumHex(new Uint8Array(8), 1, 1, 0), /^[0-9a-f]{16}$/);
  const bytes = new Uint8Array(PAGE_BYTES).fill(3);
  const base = pageChecksum(bytes, 1, 1, 0);
  assert.equal(pageChecksum(bytes, 1, 1, 0), base);
  assert.notEqual(pageChecksum(bytes, 2, 1, 0), base);
  assert.notEqual(pageChecksum(bytes, 1, 2, 0), base);
  assert.notEqual(pageChecksum(bytes, 1, 1, 1), base);
});

test("verifyManifest() catches pages holding the bytes of another logical position", () => {
  const { pool, reservation, manifest, local } = fixture();
  // Swap the contents of logical pages 0 and 2 (physical 5 and 6).
  const p5 = pool.slice(5 * PAGE_BYTES, 6 * PAGE_BYTES);
  pool.copyWithin(5 * PAGE_BYTES, 6 * PAGE_BYTES, 7 * PAGE_BYTES);
  pool.set(p5, 6 * PAGE_BYTES);
  const verdict = verifyManifest(reservation, manifest, local());
  assert.equal(verdict.code, "checksum_mismatch");
  assert.equal(verdict.code === "checksum_mismatch" && verdict.page, 0);
});
