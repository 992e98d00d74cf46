/**
 * The KV tiers in the prefix cache's model (docs/protocol.md §5a, docs/design.md §3b): an abstract
 * tier below the model's pool — the disk tier, which survives a restart — that keeps, per chain key,
 * the record a spill sealed: its header (key, parent key, tenant, token ids, the tenant's cache
 * epoch), the content its KV was computed from, and whether its MAC still verifies.
 *
 * - **Spill**: the cache's observer hears `evicting` and the record is sealed then (the real
 *   `KvTiers.spill`). Under `spill-race` the seal runs after the action that evicted (the step that
 *   reused the freed page has written it by then); the `tier-spill-copy` guard copies the content at
 *   `evicting` even so.
 * - **Load**: the pages after the pool's run that the tier holds are verified — MAC (`tier-mac`),
 *   owner (`tier-owner`: key, parent, tenant, tokens), the tenant's current epoch (`tier-epoch`) —
 *   in the order of `openRecord`, and promoted in chain order into the real `PrefixCache`
 *   (`promote`); a record that fails is deleted and ends the run (the real `TierPrefetch`).
 * - **The adversary** writes the tier directory: under `tier-corrupt` it flips a record's bytes,
 *   under `tier-planted` it copies one tenant's record over another tenant's file; both at most once.
 *   Under `stale-epoch` a rotation (a restart with tenant 1's `cache_epoch` raised: the pool
 *   empties, the tier stays) may happen once when no request is live, and it changes no key.
 */
import type { CachedPage, PromotedPage } from "../../protocol/prefix-cache.js";
import { faultOn, guardOn, type Safety } from "../../protocol/safety.js";

/** A sealed record as the model keeps it. */
export interface TierRecordModel {
  readonly key: string;
  readonly parentKey: string;
  readonly tenant: number;
  readonly tokens: string;
  readonly epoch: number;
  /** The prefix its KV was computed from (`t0|11,12`, `t1@1|…` after a rotation; `!…`: corrupted). */
  readonly content: string;
  readonly macValid: boolean;
}

export type TierAction =
  | { readonly kind: "load"; readonly r: number }
  | { readonly kind: "corrupt"; readonly key: string }
  | { readonly kind: "plant"; readonly from: string; readonly to: string }
  | { readonly kind: "rotate" };

export class AbstractTier {
  readonly #safety: Safety;
  readonly records = new Map<string, TierRecordModel>();
  /** Seals of the `spill-race` fault, run after the current action: the page and its identity. */
  #pending: { readonly page: CachedPage; readonly content: string | null }[] = [];
  /** The adversary's writes so far (each at most once). */
  corrupted = false;
  planted = false;
  /** Records refused at load, by the guard that refused them. */
  readonly rejected: Record<"mac" | "owner" | "epoch", number> = { mac: 0, owner: 0, epoch: 0 };

  constructor(safety: Safety) {
    this.#safety = safety;
  }

  /** The cache evicts `page`, whose pool page holds `content` now. */
  spill(page: CachedPage, content: string): void {
    if (!faultOn(this.#safety, "spill-race")) this.#seal(page, content);
    else
      this.#pending.push({
        page: { ...page, tokens: page.tokens.slice() },
        content: guardOn(this.#safety, "tier-spill-copy") ? content : null,
      });
  }

  /** Runs the late seals of `spill-race`, reading each pool page as it is now (`contentOf`). */
  settle(contentOf: (page: number) => string): void {
    for (const { page, content } of this.#pending) this.#seal(page, content ?? contentOf(page.page));
    this.#pending = [];
  }

  #seal(page: CachedPage, content: string): void {
    if (this.records.has(page.key)) return; // already below: keep that record
    this.records.set(page.key, {
      key: page.key,
      parentKey: page.parentKey,
      tenant: page.tenant,
      tokens: Array.from(page.tokens).join(","),
      epoch: page.cacheEpoch,
      content,
      macValid: true,
    });
  }

  /**
   * The content of the record `expect` names once verified, or null (no record, or one refused:
   * deleted and counted), as `KvTiers.load` does.
   */
  load(expect: PromotedPage): string | null {
    const rec = this.records.get(expect.key);
    if (rec === undefined) return null;
    const reason =
      guardOn(this.#safety, "tier-mac") && !rec.macValid
        ? "mac"
        : guardOn(this.#safety, "tier-owner") &&
            (rec.key !== expect.key ||
              rec.parentKey !== expect.parentKey ||
              rec.tenant !== expect.tenant ||
              rec.tokens !== Array.from(expect.tokens).join(","))
          ? "owner"
          : guardOn(this.#safety, "tier-epoch") && rec.epoch !== expect.cacheEpoch
            ? "epoch"
            : null;
    if (reason === null) return rec.content;
    this.rejected[reason]++;
    this.records.delete(expect.key);
    return null;
  }

  /** The adversary's writes enabled now (by its faults). */
  adversary(): TierAction[] {
    const out: TierAction[] = [];
    const recs = [...this.records.values()];
    if (faultOn(this.#safety, "tier-corrupt") && !this.corrupted)
      for (const r of recs) out.push({ kind: "corrupt", key: r.key });
    if (faultOn(this.#safety, "tier-planted") && !this.planted)
      for (const from of recs)
        for (const to of recs)
          if (from.tenant !== to.tenant) out.push({ kind: "plant", from: from.key, to: to.key });
    return out;
  }

  /** Applies an adversary's write; returns the trace line. */
  write(a: TierAction): string {
    if (a.kind === "corrupt") {
      const rec = this.records.get(a.key)!;
      this.corrupted = true;
      this.records.set(a.key, { ...rec, content: `!${rec.content}`, macValid: false });
      return `the adversary flips bytes of the tier record of ${rec.content} (key ${a.key.slice(0, 6)})`;
    }
    if (a.kind === "plant") {
      const from = this.records.get(a.from)!;
      const to = this.records.get(a.to)!;
      this.planted = true;
      this.records.set(a.to, from);
      return `the adversary copies tenant ${from.tenant}'s valid record (${from.content}) over tenant ${to.tenant}'s file of ${to.content}`;
    }
    return "";
  }

  /** Everything the future depends on. */
  signature(): string {
    const recs = [...this.records.values()]
      .map(
        (r) =>
          `${r.key.slice(0, 8)}>${r.parentKey.slice(0, 4)}:t${r.tenant}@${r.epoch}:${r.content}:${r.macValid ? 1 : 0}`,
      )
      .sort();
    return `${recs.join(";")}|${this.corrupted ? 1 : 0}${this.planted ? 1 : 0}`;
  }

  describe(): string {
    // Each record: its file (the key's tenant and tokens) = the content its KV was computed from.
    const recs = [...this.records.entries()]
      .map(([, r]) => `t${r.tenant}[${r.tokens}]=${r.content}${r.macValid ? "" : "(bad MAC)"}`)
      .sort();
    return `tier [${recs.join(" ")}]`;
  }
}
