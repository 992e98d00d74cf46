/**
 * The closed lists of fault names and guard names of docs/design.md §5, and the frozen `Safety` config
 * that the protocol state machines consult at each guarded decision.
 *
 * A **guard** is one defence of the real protocol; all are on unless listed in `disabledGuards`.
 * A **fault** reproduces one real bug inside the same code path the servers run (never a mock):
 * e.g. `placeholder-reject` really swaps an over-long prompt for one token and reports the
 * transfer complete. Faults exist only for tests, demos and `kvfence check`; servers switch them on
 * only behind an explicit `--unsafe-fault NAME` flag.
 */
import { KvfenceError } from "../lib/errors.js";

export const FAULT_NAMES = [
  "placeholder-reject",
  "undersized-pool",
  "early-free",
  "late-write",
  "corrupt-transfer",
  "misaddressed-write",
  "drop-abort-ack",
  "stale-commit",
  "shared-prefix",
  "prefix-collision",
  "held-unpinned",
  // The KV tiers (docs/design.md §3b). `tier-corrupt` and `tier-planted` are faults of the tier
  // directory, not of the code: whoever can write the directory does them (the fault matrix and the
  // tests write the files; in a server the name switches nothing on). `stale-epoch` and `spill-race`
  // are code faults.
  "tier-corrupt",
  "tier-planted",
  "stale-epoch",
  "spill-race",
] as const;
export type FaultName = (typeof FAULT_NAMES)[number];

/**
 * Faults of the node glue, outside the state machines, so `kvfence check` does not explore them
 * and the fault matrix does not list them. `stall-transfer`: prefill writes the first half of a
 * lease's pages and then stops writing (no manifest) — a liveness fault: the request waits with
 * decode's pages RESERVED until the client aborts (ABORT_ACK) or prefill is fenced, never a timer.
 */
export const NODE_FAULT_NAMES = ["stall-transfer"] as const;
export type NodeFaultName = (typeof NODE_FAULT_NAMES)[number];

export const GUARD_NAMES = [
  "admission-doors",
  "coverage",
  "checksum",
  "page-tags",
  "quarantine",
  "lease-check",
  "tenant-salt",
  "prefix-tokens",
  // The router's KV index is per tenant namespace (src/cluster/kv-index.ts).
  "route-namespace",
  // The KV tiers (docs/design.md §3b): a page loaded back is refused unless its MAC verifies, it is
  // the page looked up (owner) under the tenant's current cache epoch; a spill copies the page at once.
  "tier-mac",
  "tier-owner",
  "tier-epoch",
  "tier-spill-copy",
  "held-pages",
] as const;
export type GuardName = (typeof GUARD_NAMES)[number];

/** What each fault reproduces, and the guards that catch it (docs/design.md §5). */
export const FAULT_TABLE: Readonly<
  Record<FaultName, { readonly reproduces: string; readonly caughtBy: readonly GuardName[] }>
> = Object.freeze({
  "placeholder-reject": {
    reproduces:
      "prefill swaps an over-long prompt for a 1-token placeholder and reports the transfer complete (SGLang #30233)",
    caughtBy: ["admission-doors", "coverage", "checksum", "page-tags"],
  },
  "undersized-pool": {
    reproduces: "the router admits by the model's window alone, larger than a node's KV pool (the incident)",
    caughtBy: ["admission-doors"],
  },
  "early-free": {
    reproduces: "decode frees reserved pages on abort without waiting for the drain ack (SGLang #24527)",
    caughtBy: ["quarantine"],
  },
  "late-write": {
    reproduces:
      "prefill acknowledges an abort before its in-flight writes drained; a write lands after reuse",
    caughtBy: ["quarantine", "lease-check"],
  },
  "corrupt-transfer": {
    reproduces: "page bytes flipped in flight",
    caughtBy: ["checksum"],
  },
  "misaddressed-write": {
    reproduces: "prefill writes a page outside its lease",
    caughtBy: ["lease-check", "checksum", "page-tags"],
  },
  "drop-abort-ack": {
    reproduces: "the abort acknowledgement is lost; pages are released by a timer instead (SGLang #38961)",
    caughtBy: ["quarantine"],
  },
  "stale-commit": {
    reproduces: "decode commits a transfer manifest from an earlier epoch of the same request",
    caughtBy: ["checksum", "page-tags"],
  },
  "shared-prefix": {
    reproduces: "prefix-cache keys ignore the tenant, so one tenant's cached KV serves another's prompt",
    caughtBy: ["tenant-salt", "page-tags"],
  },
  "prefix-collision": {
    reproduces:
      "prefix-cache keys are cut to a few bits, so another prefix's cached page has the same key (weak block hashes)",
    caughtBy: ["prefix-tokens", "page-tags", "route-namespace"],
  },
  "held-unpinned": {
    reproduces:
      "decode leases its cached prefix pages as held without keeping a reference, so an eviction hands them to another request before the commit (a hit racing an eviction)",
    caughtBy: ["held-pages", "page-tags"],
  },
  "tier-corrupt": {
    reproduces:
      "a page's record is corrupted on disk (bytes of its KV flipped by the medium or a writer of the tier directory)",
    caughtBy: ["tier-mac"],
  },
  "tier-planted": {
    reproduces:
      "another tenant's valid record is copied under the file name of this tenant's page (a tier that drops the tenant: LMCache #4825, SGLang #37160)",
    caughtBy: ["tier-owner"],
  },
  "stale-epoch": {
    reproduces:
      "the prefix-cache salt omits the tenant's cache_epoch, so a page spilled before the tenant's key rotation is found again under the same key (vLLM #51640)",
    caughtBy: ["tier-epoch"],
  },
  "spill-race": {
    reproduces:
      "the spill reads the pool page on a later turn, after it was freed and reused: another request's KV under this page's key, with a valid MAC (vLLM #45704, SGLang #36738)",
    caughtBy: ["tier-spill-copy"],
  },
});

/** Which faults are on and which guards are off. Frozen; build it with `makeSafety`. */
export interface Safety {
  readonly faults: ReadonlySet<FaultName | NodeFaultName>;
  readonly disabledGuards: ReadonlySet<GuardName>;
}

class FrozenSet<T> extends Set<T> {
  #frozen = false;
  freeze(): this {
    this.#frozen = true;
    return this;
  }
  override add(value: T): this {
    if (this.#frozen) throw new TypeError("Safety sets are frozen");
    return super.add(value);
  }
  override delete(value: T): boolean {
    if (this.#frozen) throw new TypeError("Safety sets are frozen");
    return super.delete(value);
  }
  override clear(): void {
    if (this.#frozen) throw new TypeError("Safety sets are frozen");
    super.clear();
  }
}

export function isFaultName(name: string): name is FaultName {
  return (FAULT_NAMES as readonly string[]).includes(name);
}

export function isNodeFaultName(name: string): name is NodeFaultName {
  return (NODE_FAULT_NAMES as readonly string[]).includes(name);
}

export function isGuardName(name: string): name is GuardName {
  return (GUARD_NAMES as readonly string[]).includes(name);
}

/**
 * Builds a frozen `Safety` from names, rejecting unknown ones with a `KvfenceError`
 * (`invalid_request`) that lists the valid names.
 */
export function makeSafety(
  options: { readonly faults?: Iterable<string>; readonly disabledGuards?: Iterable<string> } = {},
): Safety {
  const faults = new FrozenSet<FaultName | NodeFaultName>();
  for (const name of options.faults ?? []) {
    if (!isFaultName(name) && !isNodeFaultName(name)) {
      throw new KvfenceError(
        "invalid_request",
        `Unknown fault name: ${name}; use one of ${[...FAULT_NAMES, ...NODE_FAULT_NAMES].join(", ")}`,
        { param: "fault" },
      );
    }
    faults.add(name);
  }
  const disabledGuards = new FrozenSet<GuardName>();
  for (const name of options.disabledGuards ?? []) {
    if (!isGuardName(name)) {
      throw new KvfenceError(
        "invalid_request",
        `Unknown guard name: ${name}; use one of ${GUARD_NAMES.join(", ")}`,
        { param: "guard" },
      );
    }
    disabledGuards.add(name);
  }
  return Object.freeze({ faults: faults.freeze(), disabledGuards: disabledGuards.freeze() });
}

/** Every guard on, no fault: the real protocol. */
export const SAFE: Safety = makeSafety();

/** True when `guard` is on in `safety`. */
export function guardOn(safety: Safety, guard: GuardName): boolean {
  return !safety.disabledGuards.has(guard);
}

/** True when `fault` is on in `safety`. */
export function faultOn(safety: Safety, fault: FaultName | NodeFaultName): boolean {
  return safety.faults.has(fault);
}
