/**
 * API keys → tenants. Keys come from a file (`--api-keys FILE`: a JSON object `{"sk-…": "tenant"}`
 * or lines `key tenant`, `#` comments allowed) or from `KVFENCE_API_KEYS` (same formats, inline).
 * Each distinct tenant name gets a small index (the u32 the engine tags pages with). With no keys
 * configured the server runs one anonymous tenant and accepts any or no key.
 *
 * Keys are compared in constant time over their SHA-256 digests, so the time to reject a key does
 * not reveal how much of it matched.
 */
import { createHash, timingSafeEqual } from "node:crypto";
import { readFileSync } from "node:fs";
import { KvfenceError } from "../lib/errors.js";

export interface Tenant {
  /** Index used on the engine side (page tags, metrics labels stay by name). */
  readonly index: number;
  readonly name: string;
}

export const ANONYMOUS_TENANT: Tenant = Object.freeze({ index: 0, name: "anonymous" });

const TENANT_NAME_RE = /^[A-Za-z0-9_.@-]{1,64}$/;

function digest(key: string): Buffer {
  return createHash("sha256").update(key, "utf8").digest();
}

export class TenantDirectory {
  readonly #entries: ReadonlyArray<{ digest: Buffer; tenant: Tenant }>;
  readonly tenants: readonly Tenant[];

  private constructor(pairs: ReadonlyArray<readonly [string, string]>) {
    const byName = new Map<string, Tenant>();
    const entries: Array<{ digest: Buffer; tenant: Tenant }> = [];
    for (const [key, name] of pairs) {
      let tenant = byName.get(name);
      if (tenant === undefined) {
        tenant = Object.freeze({ index: byName.size, name });
        byName.set(name, tenant);
      }
      entries.push({ digest: digest(key), tenant });
    }
    this.#entries = entries;
    this.tenants = [...byName.values()];
  }

  /** True when no keys are configured (one anonymous tenant, no authentication). */
  get anonymous(): boolean {
    return this.#entries.length === 0;
  }

  /** The tenant for an `Authorization` header value, or null when the key is wrong or missing. */
  authenticate(authorization: string | undefined): Tenant | null {
    if (this.anonymous) return ANONYMOUS_TENANT;
    const match = /^Bearer\s+(\S+)\s*$/i.exec(authorization ?? "");
    if (match === null) return null;
    const given = digest(match[1]!);
    let found: Tenant | null = null;
    for (const entry of this.#entries) {
      if (timingSafeEqual(entry.digest, given)) found = entry.tenant;
    }
    return found;
  }

  /** A directory with no keys: every request is the anonymous tenant. */
  static anonymous(): TenantDirectory {
    return new TenantDirectory([]);
  }

  /** Build from `key → tenant` pairs; validates keys and names. */
  static fromPairs(pairs: ReadonlyArray<readonly [string, string]>, source = "API keys"): TenantDirectory {
    const seen = new Set<string>();
    for (const [key, name] of pairs) {
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
      if (seen.has(key))
        throw new KvfenceError("config_invalid", `${source}: duplicate API key: ${mask(key)}`);
      seen.add(key);
    }
    return new TenantDirectory(pairs);
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
      const pairs: Array<[string, string]> = [];
      for (const [key, name] of Object.entries(json as Record<string, unknown>)) {
        if (typeof name !== "string") {
          throw new KvfenceError(
            "config_invalid",
            `${source}: tenant for key ${mask(key)} must be a string: ${JSON.stringify(name)}`,
          );
        }
        pairs.push([key, name]);
      }
      return TenantDirectory.fromPairs(pairs, source);
    }
    const pairs: Array<[string, string]> = [];
    const lines = trimmed.split(/\r?\n/);
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i]!.trim();
      if (line === "" || line.startsWith("#")) continue;
      const parts = line.split(/\s+/);
      if (parts.length !== 2) {
        throw new KvfenceError(
          "config_invalid",
          `${source}: line ${i + 1} must be "key tenant": ${JSON.stringify(mask(line))}`,
        );
      }
      pairs.push([parts[0]!, parts[1]!]);
    }
    return TenantDirectory.fromPairs(pairs, source);
  }

  /** Keys from `file` when given, else from `env` (`KVFENCE_API_KEYS`), else anonymous. */
  static load(options: { file?: string | undefined; env?: string | undefined }): TenantDirectory {
    if (options.file !== undefined) {
      let text: string;
      try {
        text = readFileSync(options.file, "utf8");
      } catch (err) {
        throw new KvfenceError(
          "config_invalid",
          `Cannot read the API key file: ${options.file}: ${(err as Error).message}`,
        );
      }
      return TenantDirectory.parse(text, options.file);
    }
    if (options.env !== undefined && options.env.trim() !== "")
      return TenantDirectory.parse(options.env, "KVFENCE_API_KEYS");
    return TenantDirectory.anonymous();
  }
}

/** Show a key without revealing it. */
function mask(key: string): string {
  return key.length <= 6 ? "***" : `${key.slice(0, 3)}…${key.slice(-2)}`;
}
