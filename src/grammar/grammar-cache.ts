/**
 * Compiled grammars kept per tenant (issue #34's fence on the grammar cache): a cache shared
 * between tenants would tell one tenant, by the time its request takes to start, which schemas
 * another tenant sends. Each tenant has its own least-recently-used map of `PER_TENANT` entries,
 * keyed by a SHA-256 of the constraint (a 1 MB schema is not kept as its own key); the tenants are
 * themselves bounded (`MAX_TENANTS`, least recently used first out). An evicted grammar is disposed
 * (a matcher still using it holds its own reference in xgrammar).
 *
 * What stays observable: a tenant's own entries (its own schemas come back faster), and, beyond
 * `MAX_TENANTS` tenants on one engine, that some tenant's entries were evicted — not which schemas.
 * xgrammar's compiler keeps a cache of its own, keyed by the grammar alone: it is switched off
 * (`GrammarEngine`), or it would share across tenants.
 */
import { createHash } from "node:crypto";
import type { OutputConstraint } from "../protocol/output-constraint.js";

export const PER_TENANT = 32;
export const MAX_TENANTS = 64;

/** What the cache holds: anything with a `dispose()` (a compiled grammar). */
export interface Disposable {
  dispose(): void;
}

export class TenantGrammarCache<T extends Disposable> {
  readonly #tenants = new Map<number, Map<string, T>>();

  /** The digest a constraint is cached under. */
  static key(constraint: OutputConstraint): string {
    return createHash("sha256").update(JSON.stringify(constraint)).digest("base64");
  }

  /** `tenant`'s entry for `key` (marked recently used), else undefined. */
  get(tenant: number, key: string): T | undefined {
    const entries = this.#tenants.get(tenant);
    if (entries === undefined) return undefined;
    this.#touch(tenant, entries);
    const value = entries.get(key);
    if (value !== undefined) {
      entries.delete(key);
      entries.set(key, value);
    }
    return value;
  }

  /** Keeps `value` as `tenant`'s entry for `key`, evicting that tenant's oldest past `PER_TENANT`. */
  set(tenant: number, key: string, value: T): void {
    let entries = this.#tenants.get(tenant);
    if (entries === undefined) {
      entries = new Map();
      if (this.#tenants.size >= MAX_TENANTS) this.#dropTenant(this.#tenants.keys().next().value as number);
    }
    this.#touch(tenant, entries);
    entries.get(key)?.dispose();
    entries.delete(key);
    entries.set(key, value);
    if (entries.size > PER_TENANT) {
      const [oldest, grammar] = entries.entries().next().value as [string, T];
      entries.delete(oldest);
      grammar.dispose();
    }
  }

  /** Entries held for `tenant` (tests). */
  size(tenant: number): number {
    return this.#tenants.get(tenant)?.size ?? 0;
  }

  #touch(tenant: number, entries: Map<string, T>): void {
    this.#tenants.delete(tenant);
    this.#tenants.set(tenant, entries);
  }

  #dropTenant(tenant: number): void {
    for (const grammar of this.#tenants.get(tenant)?.values() ?? []) grammar.dispose();
    this.#tenants.delete(tenant);
  }
}
