/**
 * The KV tiers below a node's pool (docs/design.md §3b): host memory (`--cache-ram SIZE`) and disk
 * (`--cache-disk DIR --cache-disk-size SIZE`, `kv-tier-disk.ts`). The pool's prefix cache stays the
 * first tier; a page it evicts is spilled here, and a lookup that leaves the pool loads the following
 * pages back (`src/engine/tier-prefetch.ts`).
 *
 * - `spill` seals the page into a record (`kv-tier-record.ts`: owner, tenant's cache epoch, token
 *   ids, HMAC under the node's tier secret) at once, synchronously, while the pool page still holds
 *   the entry's KV (the prefix cache's `evicting`). `spillLater` is the `spill-race` fault's spill:
 *   the seal runs on a later turn, as an asynchronous offload worker's would; the `tier-spill-copy`
 *   guard copies the bytes at once even then. Without the copy the seal reads the pool page after
 *   it was freed and reused — the "spill racing a hit" bug, which stores another request's KV under
 *   this key with a valid MAC.
 * - The RAM tier keeps records in memory, least recently used first out; what overflows goes to the
 *   disk tier (written asynchronously), or is dropped without one. With only a disk tier, a spill is
 *   written there directly.
 * - `load` reads a record (RAM: at once; disk: a file read, off the caller's step) and verifies its
 *   MAC, owner and epoch before returning any byte; a record that fails is deleted and counted by
 *   reason (`rejected`), never returned.
 *
 * Every page that enters or leaves a tier is told to the listeners (`onTierChange`), so a node can
 * publish where its tenants' KV lives (the routers' KV index).
 */
import { randomBytes } from "node:crypto";
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { dirname, relative, resolve } from "node:path";
import { KvfenceError } from "../lib/errors.js";
import { DiskTier } from "./kv-tier-disk.js";
import {
  ALL_TIER_GUARDS,
  openRecord,
  sealRecord,
  TIER_RECORD_VERSION,
  type TierGuards,
  type TierPageIdentity,
  type TierRejectReason,
  type TierSecret,
  tierSecret,
} from "./kv-tier-record.js";

export type TierName = "ram" | "disk";

/** A tier gained (`stored`) or lost (`dropped`) pages of `tenant` (opaque chain keys). */
export type TierChangeListener = (
  tenant: number,
  keys: readonly string[],
  tier: TierName,
  change: "stored" | "dropped",
) => void;

export interface KvTiersOptions {
  /** Bytes of records the RAM tier holds; 0: none. */
  readonly ramBytes: number;
  /** The disk tier, if any: its directory and size in bytes. */
  readonly disk?: { readonly dir: string; readonly maxBytes: number };
  /** The HMAC key (32 bytes; `--cache-disk-key`). Absent: a random one for this process (RAM only). */
  readonly secretKey?: Buffer;
  /** The pool's `layoutSignature` and page size in bytes. */
  readonly layout: string;
  readonly pageBytes: number;
  /** The load checks (`tier-mac`, `tier-owner`, `tier-epoch`); default all on. */
  readonly guards?: TierGuards;
  /** The `tier-spill-copy` guard: `spillLater` copies the page at once (default true). */
  readonly spillCopy?: boolean;
}

/** Counters and sizes of the tiers, for metrics. */
export interface KvTierStats {
  readonly ram: { pages: number; bytes: number; capacityBytes: number };
  readonly disk: { pages: number; bytes: number; capacityBytes: number } | null;
  /** Pages spilled from the pool. */
  spills: number;
  /** Pages loaded back (verified), by the tier they came from. */
  loads: Record<TierName, number>;
  /** Loads refused, by reason (the record was deleted), with the disk's start-up scan's refusals. */
  rejected: Record<TierRejectReason, number>;
  /** Pages dropped out of the last tier for room. */
  dropped: number;
}

export class KvTiers {
  readonly #secret: TierSecret;
  readonly #layout: string;
  readonly #pageBytes: number;
  readonly #guards: TierGuards;
  readonly #spillCopy: boolean;
  readonly #ramCapacity: number;
  /** RAM records, least recently used first (Map order), with their tenant. */
  readonly #ram = new Map<string, { record: Buffer; tenant: number }>();
  #ramBytes = 0;
  readonly #disk: DiskTier | null;
  readonly #listeners: TierChangeListener[] = [];
  readonly #counters = {
    spills: 0,
    loads: { ram: 0, disk: 0 } as Record<TierName, number>,
    rejected: { format: 0, mac: 0, owner: 0, epoch: 0 } as Record<TierRejectReason, number>,
    dropped: 0,
  };

  private constructor(options: KvTiersOptions, secret: TierSecret, disk: DiskTier | null) {
    this.#secret = secret;
    this.#layout = options.layout;
    this.#pageBytes = options.pageBytes;
    this.#guards = options.guards ?? ALL_TIER_GUARDS;
    this.#spillCopy = options.spillCopy ?? true;
    this.#ramCapacity = options.ramBytes;
    this.#disk = disk;
  }

  /** The tiers of `options`; the disk tier's directory is checked (and its index rebuilt) now. */
  static async open(options: KvTiersOptions, listener?: TierChangeListener): Promise<KvTiers> {
    const secret = tierSecret(options.secretKey ?? randomBytes(32));
    const guards = options.guards ?? ALL_TIER_GUARDS;
    let tiers: KvTiers | null = null;
    const disk =
      options.disk === undefined
        ? null
        : await DiskTier.open({
            dir: options.disk.dir,
            maxBytes: options.disk.maxBytes,
            secret,
            layout: options.layout,
            checkMac: guards.mac,
            checkOwner: guards.owner,
            dropped: (key, tenant) => {
              if (tiers !== null) tiers.#droppedOut(key, tenant, "disk");
            },
          });
    tiers = new KvTiers(options, secret, disk);
    if (listener !== undefined) tiers.onTierChange(listener);
    return tiers;
  }

  /** Adds a listener of pages entering and leaving each tier. */
  onTierChange(listener: TierChangeListener): void {
    this.#listeners.push(listener);
  }

  /**
   * Spills a page the pool is about to free: `bytes` is the pool page's view, read now (the
   * `tier-spill-copy` guard) while it still holds the entry's KV.
   */
  spill(page: TierPageIdentity, bytes: Uint8Array): void {
    if (bytes.length !== this.#pageBytes) return;
    this.#counters.spills++;
    // Already below (a page loaded back and evicted again): keep that record, just recently used.
    if (this.#ramRecord(page.key) !== null || this.#disk?.has(page.key) === true) return;
    this.#store(page, this.#seal(page, bytes));
  }

  /**
   * The `spill-race` fault's spill: sealed on a later turn (after the pool page was freed and, within
   * the same step, reused). `read` gives the pool page's bytes when called (a fresh view: the pool's
   * memory may have grown meanwhile). The `tier-spill-copy` guard reads and copies them now, so the
   * late seal seals the copy; without it the seal reads the pool page as it is then.
   */
  spillLater(page: TierPageIdentity, read: () => Uint8Array): void {
    const copy = this.#spillCopy ? read().slice() : null;
    setImmediate(() => this.spill(page, copy ?? read()));
  }

  /** The tier holding `key`, or null. */
  find(key: string): TierName | null {
    if (this.#ram.has(key)) return "ram";
    return this.#disk?.has(key) === true ? "disk" : null;
  }

  /**
   * The verified KV bytes of the page `expect` names, or null when no tier holds it or its record
   * fails a check (then it is deleted and counted in `rejected`). The bytes are the caller's until
   * the next call (a view into the record).
   */
  async load(expect: TierPageIdentity): Promise<{ bytes: Uint8Array; tier: TierName } | null> {
    const tier = this.find(expect.key);
    if (tier === null) return null;
    const record = tier === "ram" ? this.#ramRecord(expect.key) : await this.#disk!.read(expect.key);
    if (record === null) return null;
    const opened = openRecord(
      this.#secret,
      record,
      { ...expect, layout: this.#layout, byteLength: this.#pageBytes },
      this.#guards,
    );
    if (!opened.ok) {
      this.#counters.rejected[opened.reason]++;
      this.#remove(expect.key, expect.tenant);
      return null;
    }
    this.#counters.loads[tier]++;
    return { bytes: opened.bytes, tier };
  }

  stats(): KvTierStats {
    const disk = this.#disk;
    return {
      ram: { pages: this.#ram.size, bytes: this.#ramBytes, capacityBytes: this.#ramCapacity },
      disk: disk === null ? null : { pages: disk.pages, bytes: disk.bytes, capacityBytes: disk.maxBytes },
      spills: this.#counters.spills,
      loads: { ...this.#counters.loads },
      rejected: rejectedWithStartup(this.#counters.rejected, disk?.startup.rejected),
      dropped: this.#counters.dropped,
    };
  }

  /** The disk tier's directory and start-up scan, or null without one. */
  get disk(): { dir: string; records: number; deleted: number } | null {
    const disk = this.#disk;
    return disk === null
      ? null
      : { dir: disk.dir, records: disk.startup.records, deleted: disk.startup.deleted };
  }

  /** Resolves when every disk write queued so far is done (tests, shutdown). */
  async flush(): Promise<void> {
    await this.#disk?.flush();
  }

  async close(): Promise<void> {
    await this.#disk?.close();
  }

  #seal(page: TierPageIdentity, bytes: Uint8Array): Buffer {
    return sealRecord(
      this.#secret,
      {
        v: TIER_RECORD_VERSION,
        node: this.#secret.fingerprint,
        tenant: page.tenant,
        key: page.key,
        parentKey: page.parentKey,
        tokens: Array.from(page.tokens),
        layout: this.#layout,
        byteLength: bytes.length,
        cacheEpoch: page.cacheEpoch,
      },
      bytes,
    );
  }

  /** A sealed record into the first tier that takes it (RAM, else disk). */
  #store(page: TierPageIdentity, record: Buffer): void {
    if (this.#ramCapacity >= record.length) {
      this.#removeRam(page.key);
      this.#ram.set(page.key, { record, tenant: page.tenant });
      this.#ramBytes += record.length;
      this.#changed(page.tenant, page.key, "ram", "stored");
      while (this.#ramBytes > this.#ramCapacity) this.#overflowRam();
    } else this.#toDisk(page.key, page.tenant, record);
  }

  /** The least recently used RAM record goes down to disk, or out. */
  #overflowRam(): void {
    const [key, { record, tenant }] = this.#ram.entries().next().value as [
      string,
      { record: Buffer; tenant: number },
    ];
    this.#removeRam(key);
    this.#changed(tenant, key, "ram", "dropped");
    this.#toDisk(key, tenant, record);
  }

  #toDisk(key: string, tenant: number, record: Buffer): void {
    if (this.#disk?.put(key, tenant, record) === true) this.#changed(tenant, key, "disk", "stored");
    else this.#droppedOut(key, tenant, null);
  }

  #droppedOut(key: string, tenant: number, tier: TierName | null): void {
    this.#counters.dropped++;
    if (tier !== null) this.#changed(tenant, key, tier, "dropped");
  }

  #ramRecord(key: string): Buffer | null {
    const entry = this.#ram.get(key);
    if (entry === undefined) return null;
    this.#ram.delete(key);
    this.#ram.set(key, entry);
    return entry.record;
  }

  #removeRam(key: string): boolean {
    const entry = this.#ram.get(key);
    if (entry === undefined) return false;
    this.#ram.delete(key);
    this.#ramBytes -= entry.record.length;
    return true;
  }

  /** A record that failed its checks leaves every tier. */
  #remove(key: string, tenant: number): void {
    if (this.#removeRam(key)) this.#changed(tenant, key, "ram", "dropped");
    if (this.#disk?.has(key) === true) {
      this.#disk.drop(key);
      this.#changed(tenant, key, "disk", "dropped");
    }
  }

  #changed(tenant: number, key: string, tier: TierName, change: "stored" | "dropped"): void {
    for (const listener of this.#listeners) listener(tenant, [key], tier, change);
  }
}

function rejectedWithStartup(
  loads: Record<TierRejectReason, number>,
  startup: Record<TierRejectReason, number> | undefined,
): Record<TierRejectReason, number> {
  const out = { ...loads };
  if (startup !== undefined) for (const k of Object.keys(out) as TierRejectReason[]) out[k] += startup[k];
  return out;
}

/** Bytes of a tier key (`--cache-disk-key`). */
export const TIER_KEY_BYTES = 32;

/**
 * The tier secret in `file` (`--cache-disk-key`): created with 32 random bytes, mode 0600, when
 * absent. Refused inside the tier directory `dir` (whoever can write records there must not read
 * the key) and when shorter than 32 bytes.
 */
export function readTierKeyFile(file: string, dir: string | null): Buffer {
  const path = resolve(file);
  if (dir !== null) {
    const rel = relative(resolve(dir), path);
    if (rel === "" || (!rel.startsWith("..") && !rel.startsWith("/")))
      throw new KvfenceError(
        "config_invalid",
        `--cache-disk-key must not be inside --cache-disk (a writer of the directory would read the key); put it elsewhere: ${file}`,
      );
  }
  let key: Buffer;
  try {
    key = readFileSync(path);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== "ENOENT")
      throw new KvfenceError("config_invalid", `--cache-disk-key cannot be read: ${file}`);
    key = randomBytes(TIER_KEY_BYTES);
    mkdirSync(dirname(path), { recursive: true });
    writeFileSync(path, key, { mode: 0o600, flag: "wx" });
  }
  if (key.length < TIER_KEY_BYTES)
    throw new KvfenceError(
      "config_invalid",
      `--cache-disk-key must hold at least ${TIER_KEY_BYTES} bytes (delete it to have one made): ${key.length} bytes in ${file}`,
    );
  return key;
}
