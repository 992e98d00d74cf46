/**
 * The disk tier of the KV tiers (docs/design.md §3b, `--cache-disk DIR --cache-disk-size SIZE`): sealed
 * records (`kv-tier-record.ts`), one file per page named by its chain key, bounded in bytes, least
 * recently used dropped first, written asynchronously (one write at a time, to a temporary name then
 * renamed, so a crash never leaves half a record under a key's name).
 *
 * The directory belongs to one node: its manifest (`kvfence-tiers.json`) names the fingerprint of the
 * secret the records are sealed under and the pool's layout, and a lock file holds the process id of
 * the node using it. `DiskTier.open` refuses a directory another secret or another layout wrote, a
 * non-empty directory without a manifest, and a directory a live process holds. At start the index
 * is rebuilt from the records' headers (header MAC checked; a record of another layout, a foreign or
 * damaged one, and a temporary file left by a crash are deleted), so a restarted node finds its
 * pages again. A record is read whole and verified by the caller (`KvTiers.load`) before any byte
 * is used; one that fails is deleted here (`drop`).
 */
import { constants as fsConstants } from "node:fs";
import { mkdir, open, readdir, readFile, rename, rm, unlink, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { KvfenceError } from "../lib/errors.js";
import { readRecordHeader, type TierRejectReason, type TierSecret } from "./kv-tier-record.js";

export const MANIFEST_FILE = "kvfence-tiers.json";
const LOCK_FILE = "kvfence-tiers.lock";
const RECORD_EXT = ".kvt";
const TEMP_EXT = ".tmp";
/** Bytes read of each record at start: enough for any header (a page's token ids as JSON). */
const HEAD_BYTES = 64 * 1024;

/** What the manifest of a tier directory says. */
interface Manifest {
  readonly format: 1;
  readonly keyFingerprint: string;
  readonly layout: string;
}

export interface DiskTierOptions {
  readonly dir: string;
  readonly maxBytes: number;
  readonly secret: TierSecret;
  readonly layout: string;
  /** Check each header's MAC and key while rebuilding the index (the `tier-mac`/`tier-owner` guards). */
  readonly checkMac: boolean;
  readonly checkOwner: boolean;
  /** A key left the tier (evicted for room, or found bad at start). */
  readonly dropped: (key: string, tenant: number) => void;
}

interface IndexEntry {
  readonly bytes: number;
  readonly tenant: number;
}

export class DiskTier {
  readonly dir: string;
  readonly maxBytes: number;
  readonly #options: DiskTierOptions;
  /** Records on disk (or being written), least recently used first (Map order). */
  readonly #index = new Map<string, IndexEntry>();
  /** Records not yet on disk: a load reads them from here. */
  readonly #pending = new Map<string, Buffer>();
  #bytes = 0;
  /** The chain of writes and deletes, one at a time. */
  #queue: Promise<void> = Promise.resolve();
  /** Records found at start, and files deleted then (records refused, by reason, among them). */
  readonly startup = {
    records: 0,
    deleted: 0,
    rejected: { format: 0, mac: 0, owner: 0, epoch: 0 } as Record<TierRejectReason, number>,
  };
  #closed = false;

  private constructor(options: DiskTierOptions) {
    this.dir = options.dir;
    this.maxBytes = options.maxBytes;
    this.#options = options;
  }

  /** Opens (or creates) the tier directory, refusing a foreign one, and rebuilds the index. */
  static async open(options: DiskTierOptions): Promise<DiskTier> {
    const tier = new DiskTier(options);
    await mkdir(options.dir, { recursive: true });
    await tier.#checkManifest();
    await tier.#lock();
    await tier.#scan();
    return tier;
  }

  get pages(): number {
    return this.#index.size;
  }

  get bytes(): number {
    return this.#bytes;
  }

  has(key: string): boolean {
    return this.#index.has(key);
  }

  /** Stores the sealed `record` of `key` (asynchronously), dropping the least recently used when over. */
  put(key: string, tenant: number, record: Buffer): boolean {
    if (this.#closed || record.length > this.maxBytes) return false;
    this.#forget(key);
    this.#index.set(key, { bytes: record.length, tenant });
    this.#bytes += record.length;
    this.#pending.set(key, record);
    const file = this.#file(key);
    this.#enqueue(async () => {
      if (this.#pending.get(key) !== record) return; // replaced or dropped before its turn
      await writeFile(`${file}${TEMP_EXT}`, record);
      await rename(`${file}${TEMP_EXT}`, file);
      if (this.#pending.get(key) === record) this.#pending.delete(key);
    });
    while (this.#bytes > this.maxBytes) {
      const oldest = this.#index.keys().next().value as string;
      const entry = this.#index.get(oldest)!;
      this.drop(oldest);
      this.#options.dropped(oldest, entry.tenant);
    }
    return true;
  }

  /** The record of `key` (whole, unverified), or null when it is gone; marks it recently used. */
  async read(key: string): Promise<Buffer | null> {
    const entry = this.#index.get(key);
    if (entry === undefined) return null;
    this.#index.delete(key);
    this.#index.set(key, entry);
    const pending = this.#pending.get(key);
    if (pending !== undefined) return pending;
    try {
      return await readFile(this.#file(key));
    } catch {
      return null;
    }
  }

  /** Deletes `key`'s record (a failed load, or room). */
  drop(key: string): void {
    if (!this.#forget(key)) return;
    const file = this.#file(key);
    this.#enqueue(() => unlink(file).catch(() => {}));
  }

  /** Resolves when every write and delete queued so far is done. */
  flush(): Promise<void> {
    return this.#queue;
  }

  /** Finishes the queued writes and releases the directory's lock. */
  async close(): Promise<void> {
    this.#closed = true;
    await this.#queue;
    await rm(join(this.dir, LOCK_FILE), { force: true });
  }

  #forget(key: string): boolean {
    const entry = this.#index.get(key);
    if (entry === undefined) return false;
    this.#index.delete(key);
    this.#pending.delete(key);
    this.#bytes -= entry.bytes;
    return true;
  }

  #enqueue(work: () => Promise<void>): void {
    this.#queue = this.#queue.then(work).catch(() => {});
  }

  #file(key: string): string {
    if (!/^[0-9a-f]{1,64}$/.test(key)) throw new Error(`A tier key is not hex: ${key}`);
    return join(this.dir, `${key}${RECORD_EXT}`);
  }

  async #checkManifest(): Promise<void> {
    const { dir, secret, layout } = this.#options;
    const path = join(dir, MANIFEST_FILE);
    let text: string | null = null;
    try {
      text = await readFile(path, "utf8");
    } catch {
      const entries = await readdir(dir);
      if (entries.length > 0)
        throw startupError(
          `--cache-disk holds files but no ${MANIFEST_FILE}: it is not a kvfence tier directory; give an empty or new directory: ${dir}`,
        );
      const manifest: Manifest = { format: 1, keyFingerprint: secret.fingerprint, layout };
      await writeFile(path, `${JSON.stringify(manifest, null, 2)}\n`);
      return;
    }
    let manifest: Partial<Manifest>;
    try {
      manifest = JSON.parse(text) as Partial<Manifest>;
    } catch {
      throw startupError(`--cache-disk's ${MANIFEST_FILE} is not JSON: ${path}`);
    }
    if (manifest.keyFingerprint !== secret.fingerprint)
      throw startupError(
        `--cache-disk was written by another node or under another --cache-disk-key (its key fingerprint ${String(manifest.keyFingerprint)}, this node's ${secret.fingerprint}); give this node its own directory: ${dir}`,
      );
    if (manifest.layout !== layout)
      throw startupError(
        `--cache-disk holds pages of another model or KV layout (${String(manifest.layout)}, this node's ${layout}); give this model its own directory: ${dir}`,
      );
  }

  /** Takes the directory's lock: a live process holding it (another node on the same directory) refuses. */
  async #lock(): Promise<void> {
    const path = join(this.dir, LOCK_FILE);
    for (let attempt = 0; attempt < 2; attempt++) {
      try {
        const handle = await open(
          path,
          fsConstants.O_CREAT | fsConstants.O_EXCL | fsConstants.O_WRONLY,
          0o600,
        );
        await handle.writeFile(String(process.pid));
        await handle.close();
        return;
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== "EEXIST") throw err;
      }
      const pid = Number.parseInt(await readFile(path, "utf8").catch(() => ""), 10);
      if (Number.isInteger(pid) && pid > 0 && pid !== process.pid && alive(pid))
        throw startupError(
          `--cache-disk is in use by another running node (process ${pid}); give each node its own directory: ${this.dir}`,
        );
      await rm(path, { force: true }); // left by a node that stopped without closing it
    }
    throw startupError(`--cache-disk's lock could not be taken: ${path}`);
  }

  /**
   * The tenant of the record file `key` of `size` bytes whose first bytes are `head`, or why it is
   * refused: its header MAC (`tier-mac`), its size or layout, or a header under another key's file
   * name — a record copied there (`tier-owner`).
   */
  #checkHeader(
    head: Buffer,
    size: number,
    key: string,
  ): { ok: true; tenant: number } | { ok: false; reason: TierRejectReason } {
    const { secret, layout, checkMac, checkOwner } = this.#options;
    const read = readRecordHeader(secret, head, checkMac);
    if (!read.ok) return read;
    if (read.recordBytes !== size || read.header.layout !== layout) return { ok: false, reason: "format" };
    if (checkOwner && read.header.key !== key) return { ok: false, reason: "owner" };
    return { ok: true, tenant: read.header.tenant };
  }

  /** Rebuilds the index from the records' headers, oldest file first (the LRU order of before). */
  async #scan(): Promise<void> {
    const found: { key: string; tenant: number; bytes: number; mtimeMs: number }[] = [];
    for (const name of await readdir(this.dir)) {
      const path = join(this.dir, name);
      if (name.endsWith(TEMP_EXT)) {
        await unlink(path).catch(() => {});
        this.startup.deleted++;
        continue;
      }
      if (!name.endsWith(RECORD_EXT)) continue;
      const key = name.slice(0, -RECORD_EXT.length);
      const handle = await open(path, "r");
      let keep: { tenant: number; bytes: number; mtimeMs: number } | null = null;
      try {
        const stat = await handle.stat();
        const head = Buffer.alloc(Math.min(HEAD_BYTES, stat.size));
        await handle.read(head, 0, head.length, 0);
        const read = this.#checkHeader(head, stat.size, key);
        if (read.ok) keep = { tenant: read.tenant, bytes: stat.size, mtimeMs: stat.mtimeMs };
        else this.startup.rejected[read.reason]++;
      } finally {
        await handle.close();
      }
      if (keep === null) {
        await unlink(path).catch(() => {});
        this.startup.deleted++;
      } else found.push({ key, ...keep });
    }
    found.sort((a, b) => a.mtimeMs - b.mtimeMs);
    for (const f of found) {
      this.#index.set(f.key, { bytes: f.bytes, tenant: f.tenant });
      this.#bytes += f.bytes;
    }
    this.startup.records = found.length;
    while (this.#bytes > this.maxBytes) this.drop(this.#index.keys().next().value as string);
    await this.#queue;
  }
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === "EPERM";
  }
}

function startupError(message: string): KvfenceError {
  return new KvfenceError("config_invalid", message);
}
