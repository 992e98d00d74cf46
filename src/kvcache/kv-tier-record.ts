/**
 * One stored page of the KV tiers (docs/design.md §3b): the page's identity and owner, its KV bytes,
 * and two keyed checksums (HMAC-SHA256 under the node's tier secret), so a record a node did not
 * write itself — a file planted in the directory, a byte flipped on disk — is never accepted.
 *
 * Layout (little-endian):
 *
 * | bytes | what |
 * |---|---|
 * | 4 | magic `KVT1` |
 * | 4 | header length H |
 * | H | header, JSON (`TierRecordHeader`) |
 * | 32 | header MAC: HMAC(secret, "kvfence tier header", magic … header) |
 * | N | the page's KV bytes (all layers' K and V, the pool's layout), N = `header.byteLength` |
 * | 32 | record MAC: HMAC(secret, "kvfence tier record", everything before) |
 *
 * The header MAC lets a node rebuild its disk index at start from the headers alone; a load checks
 * the record MAC over the whole record. `openRecord` then checks the owner — the chain key, parent
 * key, tenant and token ids are the ones looked up, the layout is the pool's — and the tenant's
 * cache epoch, BEFORE any byte is handed out. Each check is a guard (`tier-mac`, `tier-owner`,
 * `tier-epoch`, src/protocol/safety.ts), passed in as plain flags: this folder imports no protocol.
 */
import { createHmac, timingSafeEqual } from "node:crypto";

/** The format version a record carries (`header.v`). */
export const TIER_RECORD_VERSION = 1;

const MAGIC = Buffer.from("KVT1", "latin1");
const MAC_BYTES = 32;
const PREFIX_BYTES = 8;

/** What a record says of its page. */
export interface TierRecordHeader {
  readonly v: number;
  /** The writing node's tier id (its secret's fingerprint). */
  readonly node: string;
  readonly tenant: number;
  /** The page's chain key (`prefixBlockKey`) and its parent's (the root key for a first page). */
  readonly key: string;
  readonly parentKey: string;
  readonly tokens: readonly number[];
  /** The pool's `layoutSignature`. */
  readonly layout: string;
  readonly byteLength: number;
  /** The tenant's cache epoch when the page was computed (keys file `cache_epoch`). */
  readonly cacheEpoch: number;
}

/** What a load expects of the record it reads: the page it looked up. */
export interface TierPageIdentity {
  readonly key: string;
  readonly parentKey: string;
  readonly tenant: number;
  readonly tokens: ArrayLike<number>;
  readonly cacheEpoch: number;
}

/** Why a record was refused. `format`: unreadable; the others name the guard that refused it. */
export type TierRejectReason = "format" | "mac" | "owner" | "epoch";

/** Which checks `openRecord` runs (all true but in tests and the fault matrix). */
export interface TierGuards {
  readonly mac: boolean;
  readonly owner: boolean;
  readonly epoch: boolean;
}

export const ALL_TIER_GUARDS: TierGuards = Object.freeze({ mac: true, owner: true, epoch: true });

/** A node's tier secret: its HMAC key, and the fingerprint the manifest and headers name it by. */
export interface TierSecret {
  readonly key: Buffer;
  readonly fingerprint: string;
}

/** The secret of `key` (32 bytes or more) with its fingerprint (not the key: an HMAC of a constant). */
export function tierSecret(key: Buffer): TierSecret {
  const fingerprint = createHmac("sha256", key).update("kvfence tier fingerprint").digest("hex").slice(0, 32);
  return Object.freeze({ key, fingerprint });
}

/**
 * A sealed record of `bytes` (copied now, synchronously) under `header`: the buffer a tier keeps in
 * memory or writes to disk as it is.
 */
export function sealRecord(secret: TierSecret, header: TierRecordHeader, bytes: Uint8Array): Buffer {
  const json = Buffer.from(JSON.stringify(header), "utf8");
  const out = Buffer.allocUnsafe(PREFIX_BYTES + json.length + MAC_BYTES + bytes.length + MAC_BYTES);
  MAGIC.copy(out, 0);
  out.writeUInt32LE(json.length, 4);
  json.copy(out, PREFIX_BYTES);
  const headerEnd = PREFIX_BYTES + json.length;
  headerMac(secret, out.subarray(0, headerEnd)).copy(out, headerEnd);
  out.set(bytes, headerEnd + MAC_BYTES);
  const macAt = out.length - MAC_BYTES;
  recordMac(secret, out.subarray(0, macAt)).copy(out, macAt);
  return out;
}

/**
 * The header of a record's first bytes (`head` may stop anywhere after the header MAC), its header
 * MAC checked when `checkMac`; the reason it was refused otherwise.
 */
export function readRecordHeader(
  secret: TierSecret,
  head: Uint8Array,
  checkMac: boolean,
): { ok: true; header: TierRecordHeader; recordBytes: number } | { ok: false; reason: TierRejectReason } {
  const buf = Buffer.from(head.buffer, head.byteOffset, head.byteLength);
  if (buf.length < PREFIX_BYTES || !buf.subarray(0, 4).equals(MAGIC)) return { ok: false, reason: "format" };
  const headerEnd = PREFIX_BYTES + buf.readUInt32LE(4);
  if (buf.length < headerEnd + MAC_BYTES) return { ok: false, reason: "format" };
  if (
    checkMac &&
    !timingSafeEqual(
      headerMac(secret, buf.subarray(0, headerEnd)),
      buf.subarray(headerEnd, headerEnd + MAC_BYTES),
    )
  )
    return { ok: false, reason: "mac" };
  let header: TierRecordHeader;
  try {
    header = JSON.parse(buf.subarray(PREFIX_BYTES, headerEnd).toString("utf8")) as TierRecordHeader;
  } catch {
    return { ok: false, reason: "format" };
  }
  if (
    header === null ||
    typeof header !== "object" ||
    header.v !== TIER_RECORD_VERSION ||
    !Number.isInteger(header.byteLength) ||
    header.byteLength < 0 ||
    !Array.isArray(header.tokens)
  )
    return { ok: false, reason: "format" };
  return { ok: true, header, recordBytes: headerEnd + MAC_BYTES + header.byteLength + MAC_BYTES };
}

/**
 * The page bytes of `record` (a view into it) when it is whole, its MAC verifies, and it is the page
 * `expect` names (owner, epoch) in a pool of `layout` with pages of `byteLength`; else the reason it
 * is refused. No byte of a refused record is handed out.
 */
export function openRecord(
  secret: TierSecret,
  record: Uint8Array,
  expect: TierPageIdentity & { readonly layout: string; readonly byteLength: number },
  guards: TierGuards,
): { ok: true; bytes: Uint8Array; header: TierRecordHeader } | { ok: false; reason: TierRejectReason } {
  const read = readRecordHeader(secret, record, guards.mac);
  if (!read.ok) return read;
  const { header, recordBytes } = read;
  if (
    recordBytes !== record.length ||
    header.byteLength !== expect.byteLength ||
    header.layout !== expect.layout
  )
    return { ok: false, reason: "format" };
  const macAt = record.length - MAC_BYTES;
  const buf = Buffer.from(record.buffer, record.byteOffset, record.byteLength);
  if (guards.mac && !timingSafeEqual(recordMac(secret, buf.subarray(0, macAt)), buf.subarray(macAt)))
    return { ok: false, reason: "mac" };
  if (guards.owner && !sameOwner(header, expect)) return { ok: false, reason: "owner" };
  if (guards.epoch && header.cacheEpoch !== expect.cacheEpoch) return { ok: false, reason: "epoch" };
  return { ok: true, bytes: buf.subarray(macAt - header.byteLength, macAt), header };
}

/** The header of `record` as stored (no check: for tests and tools that inspect a directory). */
export function recordHeaderOf(record: Uint8Array): TierRecordHeader {
  const buf = Buffer.from(record.buffer, record.byteOffset, record.byteLength);
  return JSON.parse(buf.subarray(PREFIX_BYTES, PREFIX_BYTES + buf.readUInt32LE(4)).toString("utf8"));
}

function sameOwner(header: TierRecordHeader, expect: TierPageIdentity): boolean {
  if (
    header.key !== expect.key ||
    header.parentKey !== expect.parentKey ||
    header.tenant !== expect.tenant ||
    header.tokens.length !== expect.tokens.length
  )
    return false;
  for (let i = 0; i < header.tokens.length; i++) if (header.tokens[i] !== expect.tokens[i]) return false;
  return true;
}

function headerMac(secret: TierSecret, bytes: Uint8Array): Buffer {
  return createHmac("sha256", secret.key).update("kvfence tier header\u0000").update(bytes).digest();
}

function recordMac(secret: TierSecret, bytes: Uint8Array): Buffer {
  return createHmac("sha256", secret.key).update("kvfence tier record\u0000").update(bytes).digest();
}
