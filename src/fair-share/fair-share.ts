/**
 * Fair sharing of a server between tenants (docs/api.md, "Fair sharing"): the one place where
 * requests wait before they reach an engine, in every topology — the one-engine client
 * (`src/topology/engine-client.ts`) and the router of the disaggregated topologies
 * (`src/cluster/disaggregated-engine.ts`) each run one `FairShare` in front of their backend.
 *
 * A request is *offered*; it is dispatched at once when its tenant is under its caps and the
 * backend has room, else it waits in its tenant's queue. Waiting requests are served by weighted
 * fair queuing over tenants (`src/lib/fair-queue.ts`), costed by the KV pages each request may hold, so a
 * tenant with a thousand queued requests delays another tenant's request by about one of them
 * (`--scheduling-policy fcfs`: in arrival order across tenants instead, `SchedulingPolicy`). Per tenant, at most `maxConcurrency` requests and `maxPages` KV pages (the
 * most each request may hold: its prompt plus `max_tokens`) are dispatched at once; a tenant with
 * nothing dispatched may always start one request, so a cap below one request's pages only
 * serialises that tenant. The backend says whether it has room (`dispatch` returns false when it
 * has none: the request stays first in line) and calls `pump()` when room frees.
 *
 * The generations of one HTTP request (`n` > 1 samples, several prompts: `hooks.group`) are
 * admitted as one: they wait as one entry, counted at all their generations and pages, and start
 * together, so none of them waits, times out and throws away the others' work. Those the backend
 * has no room for once the first started wait as admitted, ahead of the queue and without a
 * timeout, holding their share. A group whose worst case could never run at once — more
 * generations than its tenant's `maxConcurrency`, or more KV pages than its tenant's `maxPages` or
 * the whole pool — is refused at once with 400 `request_exceeds_capacity`, naming the limit,
 * before anything of it runs (a single generation keeps the rule above: alone, it always may run).
 *
 * Queues are bounded: a tenant with `maxQueue` requests waiting gets 429 `rate_limit_exceeded`;
 * when the whole queue (`maxQueue` over all tenants) is full, 429 again for a tenant holding at
 * least its even share of it while others wait too, else 503 `server_busy`. A request waiting longer than the queue
 * timeout ends with 429 (its own tenant's requests held its place: it is over its share) or 503
 * `queue_timeout` (the server was full). Every refusal carries `Retry-After`. A waiting request
 * holds nothing, so ending it frees nothing; KV pages are never released on a timer here.
 *
 * Default caps: with two or more tenants configured, each tenant may take half of the backend's
 * KV pages and sequence slots and half of the queue; with one tenant (or none: anonymous), no cap.
 * `--tenant-max-concurrency`, `--tenant-max-pages` and `--tenant-max-queue` set them for every
 * tenant (0: no cap), and the API keys file per tenant (`src/router/api-keys.ts`).
 */
import type { WireError } from "../lib/errors.js";
import { FairQueue } from "../lib/fair-queue.js";

/**
 * `--scheduling-policy`: `fair` (default) serves the tenants' queues by weighted fair queuing;
 * `fcfs` serves one queue in arrival order across tenants (as vLLM's `--scheduling-policy fcfs`).
 * The caps, the queue bounds and the timeout apply under both.
 */
export const SCHEDULING_POLICIES = ["fair", "fcfs"] as const;
export type SchedulingPolicy = (typeof SCHEDULING_POLICIES)[number];

/** What one tenant may hold and queue. `Infinity`: no cap. */
export interface TenantLimits {
  /** Requests dispatched at once. */
  readonly maxConcurrency: number;
  /** KV pages its dispatched requests may hold at once (each counted at its prompt + max_tokens). */
  readonly maxPages: number;
  /** Requests waiting at once. */
  readonly maxQueue: number;
  /** Share of the backend when tenants compete: an integer from 1. */
  readonly weight: number;
}

/** Per-tenant settings from the API keys file; absent fields take the server's. 0: no cap. */
export interface TenantOverrides {
  readonly maxConcurrency?: number;
  readonly maxPages?: number;
  readonly maxQueue?: number;
  readonly weight?: number;
}

/** The fair-share flags of `kvfence serve` (docs/api.md). */
export interface FairShareConfig {
  /** Tenants the API keys define (1 when anonymous): the default caps split the backend when ≥ 2. */
  readonly tenants: number;
  /** `--tenant-max-concurrency`: undefined = the default (see the module header), 0 = no cap. */
  readonly tenantMaxConcurrency?: number | undefined;
  /** `--tenant-max-pages`. */
  readonly tenantMaxPages?: number | undefined;
  /** `--tenant-max-queue`. */
  readonly tenantMaxQueue?: number | undefined;
  /** `--max-queue`: requests waiting over all tenants. Default 256. */
  readonly maxQueue?: number | undefined;
  /** `--queue-timeout` in ms. Default 30 s. */
  readonly queueTimeoutMs?: number | undefined;
  /** `--scheduling-policy`. Default fair. */
  readonly schedulingPolicy?: SchedulingPolicy | undefined;
  /** By tenant index. */
  readonly overrides?: ReadonlyMap<number, TenantOverrides>;
}

export const DEFAULT_MAX_QUEUE = 256;
export const DEFAULT_QUEUE_TIMEOUT_MS = 30_000;
/** Seconds a refused client is asked to wait (`Retry-After`). */
export const RETRY_AFTER_SECONDS = 1;

/** What the backend can hold at once, for the default caps. */
export interface BackendCapacity {
  /** KV pages over all pools a request can be placed in (decode pools, or the one engine's). */
  readonly pages: number;
  /** Sequence slots (requests one forward step batches) over all engines that decode. */
  readonly slots: number;
}

export interface ResolvedFairShare {
  readonly limits: (tenant: number) => TenantLimits;
  /** KV pages the backend holds (`BackendCapacity.pages`): a group's worst case must fit them at once. */
  readonly poolPages: number;
  readonly maxQueue: number;
  readonly queueTimeoutMs: number;
  readonly policy: SchedulingPolicy;
}

const cap = (n: number): number => (n === 0 ? Number.POSITIVE_INFINITY : n);

/** The limits of every tenant, from the flags, the key file's overrides and the backend's size. */
export function resolveFairShare(config: FairShareConfig, capacity: BackendCapacity): ResolvedFairShare {
  const maxQueue = config.maxQueue ?? DEFAULT_MAX_QUEUE;
  const split = config.tenants >= 2;
  const base: TenantLimits = {
    maxConcurrency:
      config.tenantMaxConcurrency !== undefined
        ? cap(config.tenantMaxConcurrency)
        : split
          ? Math.max(1, Math.floor(capacity.slots / 2))
          : Number.POSITIVE_INFINITY,
    maxPages:
      config.tenantMaxPages !== undefined
        ? cap(config.tenantMaxPages)
        : split
          ? Math.max(1, Math.floor(capacity.pages / 2))
          : Number.POSITIVE_INFINITY,
    maxQueue:
      config.tenantMaxQueue !== undefined
        ? cap(config.tenantMaxQueue)
        : split
          ? Math.ceil(maxQueue / 2)
          : Number.POSITIVE_INFINITY,
    weight: 1,
  };
  const byTenant = new Map<number, TenantLimits>();
  for (const [tenant, o] of config.overrides ?? []) {
    byTenant.set(
      tenant,
      Object.freeze({
        maxConcurrency: o.maxConcurrency === undefined ? base.maxConcurrency : cap(o.maxConcurrency),
        maxPages: o.maxPages === undefined ? base.maxPages : cap(o.maxPages),
        maxQueue: o.maxQueue === undefined ? base.maxQueue : cap(o.maxQueue),
        weight: o.weight ?? base.weight,
      }),
    );
  }
  Object.freeze(base);
  return {
    limits: (tenant) => byTenant.get(tenant) ?? base,
    poolPages: capacity.pages,
    maxQueue,
    queueTimeoutMs: config.queueTimeoutMs ?? DEFAULT_QUEUE_TIMEOUT_MS,
    policy: config.schedulingPolicy ?? "fair",
  };
}

/**
 * The generations of one HTTP request when it has several (`n` > 1, or several prompts): the rid of
 * its first and how many there are (`GenerationRequest.group`, src/protocol/engine-api.ts).
 */
export interface AdmissionGroup {
  readonly first: number;
  readonly size: number;
}

export interface FairShareHooks<T> {
  /** The tenant (index) of a request. */
  tenant(item: T): number;
  /** The KV pages a request may hold (its prompt + max_tokens, in pages). */
  pages(item: T): number;
  /** The generations a request runs (a group of n samples forked on one node: n). Default 1. */
  size?(item: T): number;
  /**
   * Its HTTP request's group, when that has several generations: `offer` holds each one (holding
   * nothing) until all of them came, then admits them as one. Absent or undefined: on its own.
   */
  group?(item: T): AdmissionGroup | undefined;
  /**
   * Start `item` on the backend now; false when the backend has no room for it (it stays first
   * in its tenant's line until `pump()`). May end `item` (call `finished`) before it returns.
   */
  dispatch(item: T): boolean;
  /** `item` waited past the queue timeout, or was refused with its group: end it with `error` (it holds nothing). */
  expire(item: T, error: WireError): void;
}

interface TenantCounts {
  /** Generations held: dispatched, or admitted and waiting for room on the backend. */
  running: number;
  pages: number;
}

/** What the queue holds: one request, or every generation of an HTTP request (admitted together). */
interface Entry<T> {
  readonly tenant: number;
  readonly items: T[];
  /** Generations and KV pages of its items. */
  size: number;
  pages: number;
}

/** What a held item counts for in its tenant's share (as it was admitted), and whether it came in a group. */
interface Held {
  readonly size: number;
  readonly pages: number;
  readonly grouped: boolean;
}

export class FairShare<T> {
  readonly #hooks: FairShareHooks<T>;
  readonly #settings: ResolvedFairShare;
  readonly #queue: FairQueue<Entry<T>>;
  /** When each request still open was offered (ms). */
  readonly #offeredAt = new Map<T, number>();
  /** Each waiting request's entry in the queue. */
  readonly #entryOf = new Map<T, Entry<T>>();
  /** Groups whose generations are still coming, by their first one's rid (they hold nothing). */
  readonly #assembling = new Map<number, { readonly entry: Entry<T>; total: number }>();
  /** Items counted in their tenant's share: dispatched (`#running`) or admitted, waiting for room (`#admitted`). */
  readonly #held = new Map<T, Held>();
  readonly #running = new Set<T>();
  /** Admitted with their group, not yet dispatched: first at every pump, never expired. */
  #admitted: T[] = [];
  readonly #counts = new Map<number, TenantCounts>();
  /** Items waiting in the queue, per tenant. */
  readonly #waitingOf = new Map<number, number>();
  /** Requests dispatched at once over all tenants (the backend's own limit; Infinity: none). */
  readonly #window: number;
  readonly #now: () => number;
  #pumping = false;
  #again = false;
  #timer: NodeJS.Timeout | null = null;
  #closed = false;

  constructor(
    settings: ResolvedFairShare,
    hooks: FairShareHooks<T>,
    options: { window?: number; now?: () => number } = {},
  ) {
    this.#settings = settings;
    this.#hooks = hooks;
    this.#window = options.window ?? Number.POSITIVE_INFINITY;
    this.#now = options.now ?? Date.now;
    this.#queue = new FairQueue<Entry<T>>({
      flow: (entry) => entry.tenant,
      cost: (entry) => entry.pages,
      weight: (tenant) => settings.limits(tenant).weight,
      order: settings.policy === "fcfs" ? "arrival" : "fair",
    });
  }

  get settings(): ResolvedFairShare {
    return this.#settings;
  }

  /** Requests waiting: in the queue, or admitted with their group and waiting for room. */
  get waiting(): number {
    let n = this.#admitted.length;
    for (const count of this.#waitingOf.values()) n += count;
    return n;
  }

  /** Requests dispatched and not yet finished. */
  get running(): number {
    return this.#running.size;
  }

  /** Requests of `tenant` waiting in the queue. */
  waitingOf(tenant: number): number {
    return this.#waitingOf.get(tenant) ?? 0;
  }

  /** Generations `tenant` holds: dispatched, or admitted with their group. */
  runningOf(tenant: number): number {
    return this.#counts.get(tenant)?.running ?? 0;
  }

  pagesOf(tenant: number): number {
    return this.#counts.get(tenant)?.pages ?? 0;
  }

  /** True while `item` waits: in the queue, or admitted with its group and waiting for room. */
  isWaiting(item: T): boolean {
    return this.#entryOf.has(item) || this.#admitted.includes(item);
  }

  /**
   * A new request: dispatched now when nothing is ahead of it and its tenant and the backend have
   * room, else queued. Returns the refusal (nothing queued): 429 or 503 when the queues are full,
   * 400 `request_exceeds_capacity` when its group could never run at once under its tenant's caps or
   * in the pool (`#neverFits`). A generation of a group is held until its group is complete; a
   * refusal of the group returns to the one that completed it and reaches the others by `expire`.
   */
  offer(item: T): WireError | null {
    if (this.#closed) {
      return {
        code: "node_unavailable",
        message: "The server is shutting down: request not accepted; retry",
      };
    }
    this.#offeredAt.set(item, this.#now());
    const tenant = this.#hooks.tenant(item);
    const size = this.#sizeOf(item);
    const pages = this.#hooks.pages(item);
    const group = this.#hooks.group?.(item);
    if (group === undefined || group.size <= size) {
      return this.#offerEntry({ tenant, items: [item], size, pages });
    }
    let assembly = this.#assembling.get(group.first);
    if (assembly === undefined) {
      assembly = { entry: { tenant, items: [], size: 0, pages: 0 }, total: group.size };
      this.#assembling.set(group.first, assembly);
    }
    const { entry } = assembly;
    entry.items.push(item);
    entry.size += size;
    entry.pages += pages;
    if (entry.size < assembly.total) return null;
    this.#assembling.delete(group.first);
    const refusal = this.#offerEntry(entry);
    if (refusal !== null)
      for (const other of entry.items) if (other !== item) this.#hooks.expire(other, refusal);
    return refusal;
  }

  /** Takes a waiting `item` out (its client went away); false when it is not waiting. */
  cancel(item: T): boolean {
    const entry = this.#entryOf.get(item);
    if (entry !== undefined) {
      this.#entryOf.delete(item);
      this.#countWaiting(entry.tenant, -1);
      this.#leave(entry, item);
      if (entry.items.length === 0) this.#queue.remove(entry);
    } else if (!(this.#admitted.includes(item) && this.#release(item)) && !this.#leaveAssembly(item)) {
      return false;
    }
    this.#offeredAt.delete(item);
    return true;
  }

  /** A dispatched `item` ended: its tenant's share frees, and waiting requests may start. */
  finished(item: T): void {
    if (!this.#release(item)) return;
    this.#offeredAt.delete(item);
    this.pump();
  }

  /**
   * A dispatched `item` came back unserved (the backend refused it for want of room). Alone, it
   * goes to the front of its tenant's queue, its wait still counted from its offer; with its group,
   * it keeps its share and waits for room ahead of the queue, as admitted. Call `pump()` once the
   * backend has room again. False when the server queues nothing (`maxQueue` 0) or is closing:
   * end it yourself.
   */
  returned(item: T): boolean {
    if (!this.#running.has(item)) return false;
    if (this.#held.get(item)!.grouped && !this.#closed) {
      this.#running.delete(item);
      this.#admitted.unshift(item);
      return true;
    }
    this.#release(item);
    if (this.#settings.maxQueue === 0 || this.#closed) {
      this.#offeredAt.delete(item);
      return false;
    }
    const entry: Entry<T> = {
      tenant: this.#hooks.tenant(item),
      items: [item],
      size: this.#sizeOf(item),
      pages: this.#hooks.pages(item),
    };
    this.#enqueue(entry, true);
    return true;
  }

  /** Dispatch waiting requests, fairly, while their tenants and the backend have room. */
  pump(): void {
    if (this.#pumping) {
      this.#again = true;
      return;
    }
    this.#pumping = true;
    try {
      do {
        this.#again = false;
        if (!this.#dispatchAdmitted()) break;
        while (!this.#closed && this.#running.size < this.#window) {
          const entry = this.#queue.peek((tenant, front) => this.#eligible(tenant, front));
          if (entry === undefined) break;
          this.#queue.take();
          this.#unmap(entry);
          if (!this.#admit(entry)) {
            // No room after all: back to where it was, and wait for the backend's next pump().
            this.#queue.untake(entry);
            this.#map(entry);
            break;
          }
        }
      } while (this.#again);
    } finally {
      this.#pumping = false;
    }
  }

  /** Ends every request still waiting in the queue past the queue timeout (the timer calls it). */
  expireWaiting(now = this.#now()): void {
    const timeout = this.#settings.queueTimeoutMs;
    const expired = [...this.#queue].filter(
      (entry) => now - this.#offeredAt.get(entry.items[0]!)! >= timeout,
    );
    for (const entry of expired) {
      this.#queue.remove(entry);
      this.#unmap(entry);
      for (const item of entry.items) this.#offeredAt.delete(item);
      const limits = this.#settings.limits(entry.tenant);
      const seconds = Math.round(timeout / 100) / 10;
      const running = this.runningOf(entry.tenant);
      const error: WireError =
        running + entry.size > limits.maxConcurrency ||
        this.pagesOf(entry.tenant) + entry.pages > limits.maxPages
          ? {
              code: "rate_limit_exceeded",
              message: `The request waited ${seconds} s behind ${running} requests of this API key's tenant, its share of the server; send fewer at once or retry`,
              retryAfter: RETRY_AFTER_SECONDS,
            }
          : {
              code: "queue_timeout",
              message: `The request waited ${seconds} s for room on the server (--queue-timeout): the server is busy; retry later`,
              retryAfter: RETRY_AFTER_SECONDS,
            };
      for (const item of entry.items) this.#hooks.expire(item, error);
    }
  }

  /** Ends every waiting request with `error` and refuses new ones (shutdown). */
  close(error: WireError): void {
    this.#closed = true;
    if (this.#timer !== null) clearTimeout(this.#timer);
    this.#timer = null;
    this.failWaiting(error);
  }

  /** Ends every waiting request with `error` (the backend cannot serve any now). */
  failWaiting(error: WireError): void {
    const all = [
      ...[...this.#queue].flatMap((entry) => entry.items),
      ...this.#admitted,
      ...[...this.#assembling.values()].flatMap((a) => a.entry.items),
    ];
    for (const item of all) this.cancel(item);
    for (const item of all) this.#hooks.expire(item, error);
  }

  #sizeOf(item: T): number {
    return this.#hooks.size?.(item) ?? 1;
  }

  /** A new entry: admitted now when nothing waits ahead of it and there is room, else queued (or refused). */
  #offerEntry(entry: Entry<T>): WireError | null {
    const refuse = (error: WireError): WireError => {
      for (const item of entry.items) this.#offeredAt.delete(item);
      return error;
    };
    const never = this.#neverFits(entry);
    if (never !== null) return refuse(never);
    if (
      this.#queue.length === 0 &&
      this.#admitted.length === 0 &&
      this.#running.size < this.#window &&
      this.#eligible(entry.tenant, entry) &&
      this.#admit(entry)
    )
      return null;
    const limits = this.#settings.limits(entry.tenant);
    const waitingOfTenant = this.#queue.lengthOf(entry.tenant);
    if (waitingOfTenant >= limits.maxQueue) {
      return refuse({
        code: "rate_limit_exceeded",
        message: `Too many requests of this API key's tenant are waiting: ${waitingOfTenant} (its limit is ${limits.maxQueue}); retry when some of them finished`,
        retryAfter: RETRY_AFTER_SECONDS,
      });
    }
    if (this.#queue.length >= this.#settings.maxQueue) {
      // Over its share when others wait too; alone in the queue, the server is simply full.
      const share = Math.ceil(this.#settings.maxQueue / Math.max(1, this.#queue.flows));
      if (this.#queue.flows > 1 && waitingOfTenant >= share) {
        return refuse({
          code: "rate_limit_exceeded",
          message: `The server's queue is full and this API key's tenant holds ${waitingOfTenant} of its ${this.#settings.maxQueue} places, at least its share of ${share}; retry when some of them finished`,
          retryAfter: RETRY_AFTER_SECONDS,
        });
      }
      return refuse({
        code: "server_busy",
        message: `The server is full: ${this.#queue.length} requests are waiting, the most it queues; retry later`,
        retryAfter: RETRY_AFTER_SECONDS,
      });
    }
    this.#enqueue(entry, false);
    this.pump();
    return null;
  }

  /**
   * Why `entry` could never run at once, or null: a group (more than one generation) needs all its
   * generations and their worst-case KV pages at once, so it must fit its tenant's caps and the
   * pool. One generation alone always may run (the context length, src/router/admission.ts,
   * bounds it by the pool).
   */
  #neverFits(entry: Entry<T>): WireError | null {
    if (entry.size <= 1) return null;
    const limits = this.#settings.limits(entry.tenant);
    const fix = "lower n or max_tokens, or send the samples as separate requests";
    if (entry.size > limits.maxConcurrency) {
      return {
        code: "request_exceeds_capacity",
        message: `This request needs its ${entry.size} generations (n for each prompt) running at once, more than this API key's tenant may run at once (--tenant-max-concurrency or its key's max_concurrency): ${entry.size} > ${limits.maxConcurrency}; lower n to at most ${limits.maxConcurrency}, or send the samples as separate requests`,
        param: "n",
      };
    }
    const [what, most] =
      limits.maxPages <= this.#settings.poolPages
        ? [
            "this API key's tenant may hold at once (--tenant-max-pages or its key's max_pages)",
            limits.maxPages,
          ]
        : ["the server's KV pool holds", this.#settings.poolPages];
    if (entry.pages > most) {
      return {
        code: "request_exceeds_capacity",
        message: `This request's ${entry.size} generations may hold ${entry.pages} KV pages at once (each its prompt + max_tokens), more than ${what}: ${entry.pages} > ${most} pages; ${fix}`,
        param: "n",
      };
    }
    return null;
  }

  #eligible(tenant: number, entry: Entry<T>): boolean {
    const limits = this.#settings.limits(tenant);
    const counts = this.#counts.get(tenant);
    if (counts === undefined || counts.running === 0) return true;
    return (
      counts.running + entry.size <= limits.maxConcurrency && counts.pages + entry.pages <= limits.maxPages
    );
  }

  /**
   * Admit `entry`: every item counted in its tenant's share, then dispatched in order. False (and
   * nothing counted) when the backend takes none; the items it has no room for after the first
   * wait as admitted (`#admitted`).
   */
  #admit(entry: Entry<T>): boolean {
    const grouped = entry.items.length > 1;
    for (const item of entry.items) this.#hold(item, grouped);
    const [first, ...rest] = entry.items;
    if (!this.#start(first!)) {
      for (const item of entry.items) this.#release(item);
      return false;
    }
    let room = true;
    for (const item of rest) {
      room = room && this.#start(item);
      if (!room) this.#admitted.push(item);
    }
    return true;
  }

  /** Dispatch the admitted items in order; false when the backend has no room for the first. */
  #dispatchAdmitted(): boolean {
    while (!this.#closed && this.#admitted.length > 0) {
      const item = this.#admitted.shift()!;
      if (!this.#start(item)) {
        this.#admitted.unshift(item);
        return false;
      }
    }
    return true;
  }

  /** Dispatch a held `item` (the backend may end it before `dispatch` returns); false: no room. */
  #start(item: T): boolean {
    this.#running.add(item);
    if (this.#hooks.dispatch(item)) return true;
    this.#running.delete(item);
    return false;
  }

  /** Count `item` in its tenant's share. */
  #hold(item: T, grouped: boolean): void {
    const tenant = this.#hooks.tenant(item);
    let counts = this.#counts.get(tenant);
    if (counts === undefined) {
      counts = { running: 0, pages: 0 };
      this.#counts.set(tenant, counts);
    }
    const held: Held = { size: this.#sizeOf(item), pages: this.#hooks.pages(item), grouped };
    counts.running += held.size;
    counts.pages += held.pages;
    this.#held.set(item, held);
  }

  #release(item: T): boolean {
    const held = this.#held.get(item);
    if (held === undefined) return false;
    this.#held.delete(item);
    if (!this.#running.delete(item)) this.#admitted = this.#admitted.filter((x) => x !== item);
    const tenant = this.#hooks.tenant(item);
    const counts = this.#counts.get(tenant)!;
    counts.running -= held.size;
    counts.pages -= held.pages;
    if (counts.running === 0) this.#counts.delete(tenant);
    return true;
  }

  /** Queue `entry` (at the front of its tenant's line when it came back from the backend). */
  #enqueue(entry: Entry<T>, front: boolean): void {
    this.#map(entry);
    if (front) this.#queue.pushFront(entry);
    else this.#queue.push(entry);
    this.#armTimer();
  }

  #map(entry: Entry<T>): void {
    for (const item of entry.items) this.#entryOf.set(item, entry);
    this.#countWaiting(entry.tenant, entry.items.length);
  }

  #unmap(entry: Entry<T>): void {
    for (const item of entry.items) this.#entryOf.delete(item);
    this.#countWaiting(entry.tenant, -entry.items.length);
  }

  #countWaiting(tenant: number, delta: number): void {
    const n = (this.#waitingOf.get(tenant) ?? 0) + delta;
    if (n === 0) this.#waitingOf.delete(tenant);
    else this.#waitingOf.set(tenant, n);
  }

  /** `item` leaves `entry` (its size and pages with it). */
  #leave(entry: Entry<T>, item: T): void {
    entry.items.splice(entry.items.indexOf(item), 1);
    entry.size -= this.#sizeOf(item);
    entry.pages -= this.#hooks.pages(item);
  }

  /** `item` leaves a group still coming, which then waits for one fewer; false when it is in none. */
  #leaveAssembly(item: T): boolean {
    for (const [first, assembly] of this.#assembling) {
      if (!assembly.entry.items.includes(item)) continue;
      assembly.total -= this.#sizeOf(item);
      this.#leave(assembly.entry, item);
      if (assembly.entry.items.length === 0) this.#assembling.delete(first);
      return true;
    }
    return false;
  }

  #armTimer(): void {
    if (this.#timer !== null || this.#closed) return;
    const period = Math.max(10, Math.min(1000, this.#settings.queueTimeoutMs / 4));
    this.#timer = setTimeout(() => {
      this.#timer = null;
      this.expireWaiting();
      if (this.#queue.length > 0) this.#armTimer();
    }, period);
    this.#timer.unref();
  }
}
