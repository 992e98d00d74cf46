/**
 * API keys → tenants. Keys come from a file (`--api-keys FILE`: a JSON object `{"sk-…": "tenant"}`
 * or lines `key tenant`, `#` comments allowed) or from `KVFENCE_API_KEYS` (same formats, inline).
 * Each distinct tenant name gets a small index (the u32 the engine tags pages with). With no keys
 * configured the server runs one anonymous tenant and accepts any or no key.
 *
 * A key may also set its tenant's fair share (docs/api.md, "Fair sharing"): in JSON as
 * `{"sk-…": {"tenant": "acme", "max_concurrency": 4, "max_pages": 2000, "max_queue": 16,
 * "weight": 2}}`, in lines as `key tenant max_concurrency=4 max_pages=2000`. Every field is
 * optional (the server's flags hold for the rest; 0: no cap); keys of one tenant must not disagree.
 *
 * A key may also set its tenant's `cache_epoch` (an integer, default 0; `cache_epoch=N` in lines):
 * part of the tenant's prefix-cache salt, so raising it retires every page cached for the tenant
 * before, in the pool and in the KV tiers (docs/design.md §3b).
 *
 * Keys are compared in constant time over their SHA-256 digests, so the time to reject a key does
 * not reveal how much of it matched.
 */
import { createHash, timingSafeEqual } from "node:crypto";
import { readFileSync } from "node:fs";
import type { TenantOverrides } from "../fair-share/fair-share.js";
import { KvfenceError } from "../lib/errors.js";

export interface Tenant {
  /** Index used on the engine side (page tags, metrics labels stay by name). */
  readonly index: number;
  readonly name: string;
  /** The keys file's `cache_epoch` (absent: 0). */
  readonly cacheEpoch?: number;
}

export const ANONYMOUS_TENANT: Tenant = Object.freeze({ index: 0, name: "anonymous" });

const TENANT_NAME_RE = /^[A-Za-z0-9_.@-]{1,64}$/;

/** The fair-share fields of a key, as written in the file → `TenantOverrides`. */
const LIMIT_FIELDS = {
  max_concurrency: "maxConcurrency",
  max_pages: "maxPages",
  max_queue: "maxQueue",
  weight: "weight",
} as const satisfies Record<string, keyof TenantOverrides>;

type LimitField = keyof typeof LIMIT_FIELDS;

/** One key as the file gives it. */
export interface KeyEntry {
  readonly key: string;
  readonly tenant: string;
  readonly limits?: TenantOverrides;
  readonly cacheEpoch?: number;
}

function digest(key: string): Buffer {
  return createHash("sha256").update(key, "utf8").digest();
}

/** The tenant of the keys given with `--api-key`. */
export const DEFAULT_TENANT = "default";

export class TenantDirectory {
  readonly #entries: ReadonlyArray<{ digest: Buffer; tenant: Tenant }>;
  readonly tenants: readonly Tenant[];
  /** The fair-share overrides of the tenants whose keys set any, by tenant index. */
  readonly limits: ReadonlyMap<number, TenantOverrides>;

  private constructor(keys: readonly KeyEntry[]) {
    const byName = new Map<string, Tenant>();
    const entries: Array<{ digest: Buffer; tenant: Tenant }> = [];
    const limits = new Map<number, TenantOverrides>();
    const epochs = new Map<string, number>();
    for (const k of keys)
      if (k.cacheEpoch !== undefined && k.cacheEpoch !== 0) epochs.set(k.tenant, k.cacheEpoch);
    for (const { key, tenant: name, limits: set } of keys) {
      let tenant = byName.get(name);
      if (tenant === undefined) {
        const cacheEpoch = epochs.get(name);
        tenant = Object.freeze({
          index: byName.size,
          name,
          ...(cacheEpoch === undefined ? {} : { cacheEpoch }),
        });
        byName.set(name, tenant);
      }
      entries.push({ digest: digest(key), tenant });
      if (set !== undefined) limits.set(tenant.index, Object.freeze({ ...limits.get(tenant.index), ...set }));
    }
    this.#entries = entries;
    this.tenants = [...byName.values()];
    this.limits = limits;
  }

  /** True when no keys are configured (one anonymous tenant, no authentication). */
  get anonymous(): boolean {
    return this.#entries.length === 0;
  }

  /** The tenant for an `Authorization` header value, or null when the key is wrong or missing. */
  authenticate(authorization: string | undefined): Tenant | null {
    return this.authenticateKey(authorization)?.tenant ?? null;
  }

  /**
   * The tenant and the key's own index (the prefix cache's `key` scope; -1 for the anonymous
   * tenant) for an `Authorization` header value, or null when the key is wrong or missing.
   */
  authenticateKey(authorization: string | undefined): { tenant: Tenant; keyIndex: number } | null {
    if (this.anonymous) return { tenant: ANONYMOUS_TENANT, keyIndex: -1 };
    const match = /^Bearer\s+(\S+)\s*$/i.exec(authorization ?? "");
    if (match === null) return null;
    const given = digest(match[1]!);
    let found: { tenant: Tenant; keyIndex: number } | null = null;
    this.#entries.forEach((entry, keyIndex) => {
      if (timingSafeEqual(entry.digest, given)) found = { tenant: entry.tenant, keyIndex };
    });
    return found;
  }

  /** A directory with no keys: every request is the anonymous tenant. */
  static anonymous(): TenantDirectory {
    return new TenantDirectory([]);
  }

  /** Build from `key → tenant` pairs; validates keys and names. */
  static fromPairs(pairs: ReadonlyArray<readonly [string, string]>, source = "API keys"): TenantDirectory {
    return TenantDirectory.fromEntries(
      pairs.map(([key, tenant]) => ({ key, tenant })),
      source,
    );
  }

  /** Build from key entries (with their fair-share fields); validates keys, names and limits. */
  static fromEntries(keys: readonly KeyEntry[], source = "API keys"): TenantDirectory {
    const seen = new Set<string>();
    const limitsOf = new Map<string, { key: string; limits: TenantOverrides }>();
    const epochOf = new Map<string, { key: string; cacheEpoch: number }>();
    for (const { key, tenant: name, limits, cacheEpoch } of keys) {
      checkKeyEntry(key, name, seen, source);
      seen.add(key);
      if (cacheEpoch !== undefined) {
        const other = epochOf.get(name);
        if (other !== undefined && other.cacheEpoch !== cacheEpoch)
          throw new KvfenceError(
            "config_invalid",
            `${source}: keys ${mask(other.key)} and ${mask(key)} of tenant ${name} set different cache_epoch: ${other.cacheEpoch} and ${cacheEpoch}; give the tenant's cache_epoch once`,
          );
        epochOf.set(name, { key, cacheEpoch });
      }
      if (limits === undefined) continue;
      const other = limitsOf.get(name);
      if (other !== undefined) {
        for (const field of Object.keys(limits) as (keyof TenantOverrides)[]) {
          if (other.limits[field] !== undefined && other.limits[field] !== limits[field]) {
            throw new KvfenceError(
              "config_invalid",
              `${source}: keys ${mask(other.key)} and ${mask(key)} of tenant ${name} set different ${field}: ${other.limits[field]} and ${limits[field]}; give the tenant's limits once`,
            );
          }
        }
      }
      limitsOf.set(name, { key, limits: { ...other?.limits, ...limits } });
    }
    return new TenantDirectory(keys);
  }

  /** Parse the text of a key file or of `KVFENCE_API_KEYS` (JSON object, or `key tenant` lines). */
  static parse(text: string, source: string): TenantDirectory {
    const trimmed = text.trim();
    if (trimmed.startsWith("{")) {
      let json: unknown;
      try {
        json = JSON.parse(trimmed);
      } catch (err) {
        throw new KvfenceError("config_invalid", `${source}: invalid JSON: ${(err as Error).message}`);
      }
      const keys: KeyEntry[] = [];
      for (const [key, value] of Object.entries(json as Record<string, unknown>)) {
        if (typeof value === "string") {
          keys.push({ key, tenant: value });
          continue;
        }
        const shape = `must be a string or {"tenant": "name", "max_concurrency": n, "max_pages": n, "max_queue": n, "weight": n}`;
        if (value === null || typeof value !== "object" || Array.isArray(value)) {
          throw new KvfenceError(
            "config_invalid",
            `${source}: tenant for key ${mask(key)} ${shape}: ${JSON.stringify(value)}`,
          );
        }
        const { tenant, ...rest } = value as Record<string, unknown>;
        if (typeof tenant !== "string") {
          throw new KvfenceError(
            "config_invalid",
            `${source}: tenant for key ${mask(key)} ${shape}: "tenant" is ${JSON.stringify(tenant)}`,
          );
        }
        keys.push({ key, tenant, ...limitsAndEpoch(rest, `${source}: key ${mask(key)}`) });
      }
      return TenantDirectory.fromEntries(keys, source);
    }
    const keys: KeyEntry[] = [];
    const lines = trimmed.split(/\r?\n/);
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i]!.trim();
      if (line === "" || line.startsWith("#")) continue;
      const parts = line.split(/\s+/);
      const fields: Record<string, unknown> = {};
      const extra = parts.slice(2);
      const ok =
        parts.length >= 2 &&
        extra.every((f) => {
          const m = /^([a-z_]+)=(-?\d+(?:\.\d+)?)$/.exec(f);
          if (m !== null) fields[m[1]!] = Number(m[2]);
          return m !== null;
        });
      if (!ok) {
        throw new KvfenceError(
          "config_invalid",
          `${source}: line ${i + 1} must be "key tenant" (then optionally max_concurrency=N max_pages=N max_queue=N weight=N): ${JSON.stringify(mask(line))}`,
        );
      }
      keys.push({
        key: parts[0]!,
        tenant: parts[1]!,
        ...(extra.length === 0 ? {} : limitsAndEpoch(fields, `${source}: line ${i + 1}`)),
      });
    }
    return TenantDirectory.fromEntries(keys, source);
  }

  /**
   * Keys from `file` when given, else from `env` (`KVFENCE_API_KEYS`), plus `keys` (`--api-key`,
   * each of tenant "default"); none at all: anonymous.
   */
  static load(options: {
    file?: string | undefined;
    env?: string | undefined;
    keys?: readonly string[];
  }): TenantDirectory {
    let text: string | null = null;
    let source = "";
    if (options.file !== undefined) {
      try {
        text = readFileSync(options.file, "utf8");
      } catch (err) {
        throw new KvfenceError(
          "config_invalid",
          `Cannot read the API key file: ${options.file}: ${(err as Error).message}`,
        );
      }
      source = options.file;
    } else if (options.env !== undefined && options.env.trim() !== "") {
      text = options.env;
      source = "KVFENCE_API_KEYS";
    }
    const keys = options.keys ?? [];
    if (keys.length > 0) {
      const lines = keys.map((key) => `${key} ${DEFAULT_TENANT}`).join("\n");
      if (text === null) [text, source] = [lines, "--api-key"];
      else if (text.trim().startsWith("{")) {
        // The JSON form: the keys go in as members (a JSON error is still the file's, below).
        const json = text.trim();
        const extra = keys
          .map((key) => `${JSON.stringify(key)}: ${JSON.stringify(DEFAULT_TENANT)}`)
          .join(", ");
        text = json === "{}" ? `{${extra}}` : `${json.slice(0, json.lastIndexOf("}"))}, ${extra}}`;
        source = `${source} and --api-key`;
      } else [text, source] = [`${text}\n${lines}`, `${source} and --api-key`];
    }
    return text === null ? TenantDirectory.anonymous() : TenantDirectory.parse(text, source);
  }
}

/** A key's fields: its tenant's `cache_epoch` (an integer from 0), and the fair-share ones. */
function limitsAndEpoch(
  fields: Record<string, unknown>,
  where: string,
): { limits?: TenantOverrides; cacheEpoch?: number } {
  const { cache_epoch: epoch, ...rest } = fields;
  if (
    epoch !== undefined &&
    (typeof epoch !== "number" || !Number.isInteger(epoch) || epoch < 0 || epoch > 0x7fff_ffff)
  )
    throw new KvfenceError(
      "config_invalid",
      `${where}: cache_epoch must be an integer from 0 to ${0x7fff_ffff}: ${JSON.stringify(epoch)}`,
    );
  return {
    ...(Object.keys(rest).length === 0 && epoch !== undefined ? {} : { limits: parseLimits(rest, where) }),
    ...(epoch === undefined ? {} : { cacheEpoch: epoch as number }),
  };
}

/** The fair-share fields of one key: integers from 0 (0: no cap), a weight from 1 to 100. */
function parseLimits(fields: Record<string, unknown>, where: string): TenantOverrides {
  const limits: Record<string, number> = {};
  for (const [name, value] of Object.entries(fields)) {
    const field = LIMIT_FIELDS[name as LimitField] as keyof TenantOverrides | undefined;
    if (field === undefined) {
      throw new KvfenceError(
        "config_invalid",
        `${where}: unknown field ${JSON.stringify(name)}; the fields are tenant, ${Object.keys(LIMIT_FIELDS).join(", ")}`,
      );
    }
    const [min, max] = field === "weight" ? [1, 100] : [0, 0x7fff_ffff];
    if (typeof value !== "number" || !Number.isInteger(value) || value < min || value > max) {
      throw new KvfenceError(
        "config_invalid",
        `${where}: ${name} must be an integer from ${min} to ${max}${field === "weight" ? "" : " (0: no cap)"}: ${JSON.stringify(value)}`,
      );
    }
    limits[field] = value;
  }
  return limits as TenantOverrides;
}

/** Show a key without revealing it. */
function mask(key: string): string {
  return key.length <= 6 ? "***" : `${key.slice(0, 3)}…${key.slice(-2)}`;
}

/** A key entry's own checks: the key's form, the tenant's name, no key twice. */
function checkKeyEntry(key: string, name: string, seen: ReadonlySet<string>, source: string): void {
  if (key.length < 8 || /\s/.test(key)) {
    throw new KvfenceError(
      "config_invalid",
      `${source}: an API key must be 8+ characters without spaces: ${mask(key)}`,
    );
  }
  if (!TENANT_NAME_RE.test(name)) {
    throw new KvfenceError(
      "config_invalid",
      `${source}: tenant names are 1-64 of [A-Za-z0-9_.@-]: ${JSON.stringify(name)}`,
    );
  }
  if (seen.has(key)) throw new KvfenceError("config_invalid", `${source}: duplicate API key: ${mask(key)}`);
}
