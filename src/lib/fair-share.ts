/**
 * Fair sharing of a server between tenants (docs/api.md, "Fair sharing"): the one place where
 * requests wait before they reach an engine, in every topology — the one-engine client
 * (`src/topology/engine-client.ts`) and the router of the disaggregated topologies
 * (`src/cluster/disaggregated-engine.ts`) each run one `FairShare` in front of their backend.
 *
 * A request is *offered*; it is dispatched at once when its tenant is under its caps and the
 * backend has room, else it waits in its tenant's queue. Waiting requests are served by weighted
 * fair queuing over tenants (`fair-queue.ts`), costed by the KV pages each request may hold, so a
 * tenant with a thousand queued requests delays another tenant's request by about one of them
 * (`--scheduling-policy fcfs`: in arrival order across tenants instead, `SchedulingPolicy`). Per tenant, at most `maxConcurrency` requests and `maxPages` KV pages (the
 * most each request may hold: its prompt plus `max_tokens`) are dispatched at once; a tenant with
 * nothing dispatched may always start one request, so a cap below one request's pages only
 * serialises that tenant. The backend says whether it has room (`dispatch` returns false when it
 * has none: the request stays first in line) and calls `pump()` when room frees.
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
import type { WireError } from "./errors.js";
import { FairQueue } from "./fair-queue.js";

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
    maxQueue,
    queueTimeoutMs: config.queueTimeoutMs ?? DEFAULT_QUEUE_TIMEOUT_MS,
    policy: config.schedulingPolicy ?? "fair",
  };
}

export interface FairShareHooks<T> {
  /** The tenant (index) of a request. */
  tenant(item: T): number;
  /** The KV pages a request may hold (its prompt + max_tokens, in pages). */
  pages(item: T): number;
  /**
   * Start `item` on the backend now; false when the backend has no room for it (it stays first
   * in its tenant's line until `pump()`). May end `item` (call `finished`) before it returns.
   */
  dispatch(item: T): boolean;
  /** `item` waited past the queue timeout: end it with `error` (it holds nothing). */
  expire(item: T, error: WireError): void;
}

interface TenantCounts {
  running: number;
  pages: number;
}

export class FairShare<T> {
  readonly #hooks: FairShareHooks<T>;
  readonly #settings: ResolvedFairShare;
  readonly #queue: FairQueue<T>;
  /** When each request still open was offered (ms); the waiting ones; the dispatched ones. */
  readonly #offeredAt = new Map<T, number>();
  readonly #waiting = new Set<T>();
  readonly #running = new Set<T>();
  readonly #counts = new Map<number, TenantCounts>();
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
    this.#queue = new FairQueue<T>({
      flow: (item) => hooks.tenant(item),
      cost: (item) => hooks.pages(item),
      weight: (tenant) => settings.limits(tenant).weight,
      order: settings.policy === "fcfs" ? "arrival" : "fair",
    });
  }

  get settings(): ResolvedFairShare {
    return this.#settings;
  }

  /** Requests waiting. */
  get waiting(): number {
    return this.#queue.length;
  }

  /** Requests dispatched and not yet finished. */
  get running(): number {
    return this.#running.size;
  }

  waitingOf(tenant: number): number {
    return this.#queue.lengthOf(tenant);
  }

  runningOf(tenant: number): number {
    return this.#counts.get(tenant)?.running ?? 0;
  }

  pagesOf(tenant: number): number {
    return this.#counts.get(tenant)?.pages ?? 0;
  }

  /** True while `item` waits in the queue. */
  isWaiting(item: T): boolean {
    return this.#waiting.has(item);
  }

  /**
   * A new request: dispatched now when nothing is ahead of it and its tenant and the backend have
   * room, else queued. Returns the refusal (429 or 503, nothing queued) when the queues are full.
   */
  offer(item: T): WireError | null {
    const tenant = this.#hooks.tenant(item);
    const limits = this.#settings.limits(tenant);
    if (this.#closed) {
      return {
        code: "node_unavailable",
        message: "The server is shutting down: request not accepted; retry",
      };
    }
    this.#offeredAt.set(item, this.#now());
    if (
      this.#queue.length === 0 &&
      this.#running.size < this.#window &&
      this.#eligible(tenant, item) &&
      this.#start(item)
    )
      return null;
    const waitingOfTenant = this.#queue.lengthOf(tenant);
    const refuse = (error: WireError): WireError => {
      this.#offeredAt.delete(item);
      return error;
    };
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
    this.#waiting.add(item);
    this.#queue.push(item);
    this.#armTimer();
    this.pump();
    return null;
  }

  /** Takes a waiting `item` out of the queue (its client went away); false when it is not waiting. */
  cancel(item: T): boolean {
    if (!this.#waiting.delete(item)) return false;
    this.#offeredAt.delete(item);
    this.#queue.remove(item);
    return true;
  }

  /** A dispatched `item` ended: its tenant's share frees, and waiting requests may start. */
  finished(item: T): void {
    if (!this.#release(item)) return;
    this.#offeredAt.delete(item);
    this.pump();
  }

  /**
   * A dispatched `item` came back unserved (the backend refused it for want of room): it goes to
   * the front of its tenant's queue, its wait still counted from its offer. Call `pump()` once
   * the backend has room again. False when the server queues nothing (`maxQueue` 0) or is
   * closing: end it yourself.
   */
  returned(item: T): boolean {
    if (!this.#release(item)) return false;
    if (this.#settings.maxQueue === 0 || this.#closed) {
      this.#offeredAt.delete(item);
      return false;
    }
    this.#waiting.add(item);
    this.#queue.pushFront(item);
    this.#armTimer();
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
        while (!this.#closed && this.#running.size < this.#window) {
          const item = this.#queue.peek((tenant, front) => this.#eligible(tenant, front));
          if (item === undefined) break;
          this.#queue.take();
          this.#waiting.delete(item);
          if (!this.#start(item)) {
            // No room after all: back to where it was, and wait for the backend's next pump().
            this.#queue.untake(item);
            this.#waiting.add(item);
            break;
          }
        }
      } while (this.#again);
    } finally {
      this.#pumping = false;
    }
  }

  /** Ends every request still waiting past the queue timeout (the timer calls it). */
  expireWaiting(now = this.#now()): void {
    const timeout = this.#settings.queueTimeoutMs;
    const expired: T[] = [];
    for (const item of this.#waiting) if (now - this.#offeredAt.get(item)! >= timeout) expired.push(item);
    for (const item of expired) {
      this.cancel(item);
      const tenant = this.#hooks.tenant(item);
      const limits = this.#settings.limits(tenant);
      const seconds = Math.round(timeout / 100) / 10;
      const running = this.runningOf(tenant);
      this.#hooks.expire(
        item,
        running >= limits.maxConcurrency || this.pagesOf(tenant) + this.#hooks.pages(item) > limits.maxPages
          ? {
              code: "rate_limit_exceeded",
              message: `The request waited ${seconds} s behind ${running} requests of this API key's tenant, its share of the server; send fewer at once or retry`,
              retryAfter: RETRY_AFTER_SECONDS,
            }
          : {
              code: "queue_timeout",
              message: `The request waited ${seconds} s for room on the server (--queue-timeout): the server is busy; retry later`,
              retryAfter: RETRY_AFTER_SECONDS,
            },
      );
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
    const all = [...this.#waiting];
    for (const item of all) this.cancel(item);
    for (const item of all) this.#hooks.expire(item, error);
  }

  #eligible(tenant: number, item: T): boolean {
    const limits = this.#settings.limits(tenant);
    const counts = this.#counts.get(tenant);
    if (counts === undefined || counts.running === 0) return true;
    return (
      counts.running < limits.maxConcurrency && counts.pages + this.#hooks.pages(item) <= limits.maxPages
    );
  }

  /** Dispatch `item`: counted first (the backend may end it before `dispatch` returns). */
  #start(item: T): boolean {
    const tenant = this.#hooks.tenant(item);
    let counts = this.#counts.get(tenant);
    if (counts === undefined) {
      counts = { running: 0, pages: 0 };
      this.#counts.set(tenant, counts);
    }
    counts.running++;
    counts.pages += this.#hooks.pages(item);
    this.#running.add(item);
    if (this.#hooks.dispatch(item)) return true;
    this.#release(item);
    return false;
  }

  #release(item: T): boolean {
    if (!this.#running.delete(item)) return false;
    const tenant = this.#hooks.tenant(item);
    const counts = this.#counts.get(tenant)!;
    counts.running--;
    counts.pages -= this.#hooks.pages(item);
    if (counts.running === 0) this.#counts.delete(tenant);
    return true;
  }

  #armTimer(): void {
    if (this.#timer !== null || this.#closed) return;
    const period = Math.max(10, Math.min(1000, this.#settings.queueTimeoutMs / 4));
    this.#timer = setTimeout(() => {
      this.#timer = null;
      this.expireWaiting();
      if (this.#waiting.size > 0) this.#armTimer();
    }, period);
    this.#timer.unref();
  }
}
