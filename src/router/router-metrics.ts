/**
 * The router's Prometheus metrics, in a prom-client registry of their own (never prom-client's
 * global one, and none of its default process metrics). Requests and tokens are counted where they
 * happen, labelled by tenant (name, from the API key), endpoint and status; the time to first token
 * and a request's duration are prom-client histograms, observed once a request. The inter-token
 * latency is observed for every token on the router's main thread, so it is a `HistogramRecorder`
 * (allocation-free; src/lib/histogram-recorder.ts says why). Pool pages, queue depths and engine
 * counters are read from the engine once per scrape (`EngineHandle.stats()`, a read of `scrape`),
 * so /metrics shows the pool as the engine sees it; with the prefix cache on, its lookups, hit
 * tokens, evictions, collisions and pages too.
 */

import { Counter, exponentialBuckets, Gauge, Histogram, Registry } from "prom-client";
import { HistogramRecorder } from "../lib/histogram-recorder.js";
import { MetricsScrape, setCounter } from "../lib/metrics-scrape.js";
import { PhaseMetrics, type PhaseSource } from "../lib/phase-histograms.js";
import type { EngineHandle, EngineStats } from "../protocol/engine-api.js";

export type Endpoint =
  | "chat"
  | "completions"
  | "responses"
  | "tokenize"
  | "models"
  | "health"
  | "ready"
  | "metrics"
  | "nodes"
  | "state"
  | "ui"
  | "other";

export class RouterMetrics {
  readonly registry = new Registry();
  /** The reads of each scrape: the engine's stats here, the nodes' in the disaggregated topologies (cluster-metrics.ts). */
  readonly scrape = new MetricsScrape(this.registry);
  readonly requests = new Counter({
    name: "kvfence_requests_total",
    help: "HTTP requests by tenant, endpoint and status code",
    labelNames: ["tenant", "endpoint", "status"] as const,
    registers: [this.registry],
  });
  readonly promptTokens = new Counter({
    name: "kvfence_prompt_tokens_total",
    help: "Prompt tokens of served requests",
    labelNames: ["tenant", "endpoint"] as const,
    registers: [this.registry],
  });
  readonly completionTokens = new Counter({
    name: "kvfence_completion_tokens_total",
    help: "Generated tokens sent to clients",
    labelNames: ["tenant", "endpoint"] as const,
    registers: [this.registry],
  });
  readonly admissionRejections = new Counter({
    name: "kvfence_admission_rejections_total",
    help: "Requests refused at admission, by reason",
    labelNames: ["reason"] as const,
    registers: [this.registry],
  });
  readonly inFlight = new Gauge({
    name: "kvfence_requests_in_flight",
    help: "Generation requests being served now",
    registers: [this.registry],
  });
  readonly timeToFirstToken = endpointHistogram(this.registry, {
    name: "kvfence_time_to_first_token_seconds",
    help: "Time from receiving a request to its first generated token",
    first: 0.005,
  });
  /** Observed per token on the main thread: allocation-free (prom-client's `observe` allocates). */
  readonly interTokenLatency = new HistogramRecorder({
    name: "kvfence_inter_token_latency_seconds",
    help: "Time between successive generated tokens of one request",
    labelName: "endpoint",
    buckets: exponentialBuckets(0.001, 2, 14),
    registers: [this.registry],
  });
  readonly requestDuration = endpointHistogram(this.registry, {
    name: "kvfence_request_duration_seconds",
    help: "Time from receiving a generation request to its last byte",
    first: 0.01,
  });
  readonly clientDisconnects = new Counter({
    name: "kvfence_client_disconnects_total",
    help: "Generation requests whose client went away before the end",
    labelNames: ["endpoint"] as const,
    registers: [this.registry],
  });
  /** The per-phase histograms: the one engine's here, the router's and the nodes' in cluster-metrics.ts. */
  readonly phases: PhaseMetrics;

  constructor(engine: EngineHandle) {
    // Series that should read 0 (not be absent) before the first event.
    for (const reason of ["context_length_exceeded", "engine_door", "response_too_large"])
      this.admissionRejections.inc({ reason }, 0);
    for (const endpoint of ["chat", "completions"]) this.clientDisconnects.inc({ endpoint }, 0);

    const engineMetrics = engineStatsMetrics(this.scrape);
    const prefixCache = prefixCacheMetrics(this.scrape);
    const tiers = tierMetrics(this.scrape);
    // One engine's per-phase histograms (the disaggregated topology's come from its nodes: cluster-metrics.ts).
    let phases: PhaseSource[] = [];
    this.scrape.add(async () => {
      const stats = await engine.stats();
      phases = stats.phases === undefined ? [] : [{ node: "engine", role: "engine", snapshot: stats.phases }];
      engineMetrics(stats);
      if (stats.prefixCache !== undefined) prefixCache(stats.prefixCache);
      if (stats.tiers !== undefined) tiers(stats.tiers);
    });
    this.phases = new PhaseMetrics(this.registry, this.scrape);
    this.phases.add(() => phases);
  }

  /**
   * `kvfence_unsafe_fault` and `kvfence_guard_disabled`: 1 for each fault injected and each guard
   * switched off (tests and demos only; absent when none is).
   */
  showUnsafe(unsafe: {
    readonly faults: readonly string[];
    readonly disabledGuards: readonly string[];
  }): void {
    const switches = [
      [
        "kvfence_unsafe_fault",
        "1 for each fault injected with --unsafe-fault (tests and demos only)",
        unsafe.faults,
      ],
      [
        "kvfence_guard_disabled",
        "1 for each guard switched off with --unsafe-disable-guard (tests and demos only)",
        unsafe.disabledGuards,
      ],
    ] as const;
    for (const [name, help, names] of switches) {
      const gauge = new Gauge({ name, help, labelNames: ["name"] as const, registers: [this.registry] });
      for (const n of names) gauge.set({ name: n }, 1);
    }
  }
}

/**
 * A latency histogram per endpoint, 14 buckets doubling from `first` seconds, observed once a
 * request (prom-client's own: its `observe` allocates, which a request can afford).
 */
function endpointHistogram(registry: Registry, spec: { name: string; help: string; first: number }) {
  return new Histogram({
    name: spec.name,
    help: spec.help,
    labelNames: ["endpoint"] as const,
    buckets: exponentialBuckets(spec.first, 2, 14),
    registers: [registry],
  });
}

/** The pool pages, queue depths and engine counters of `EngineHandle.stats()`; returns their update. */
function engineStatsMetrics(scrape: MetricsScrape): (stats: EngineStats) => void {
  const poolPages = scrape.gauge("kvfence_kv_pool_pages", "KV pool pages by state", ["state"]);
  const poolPagesTotal = scrape.gauge("kvfence_kv_pool_pages_total", "KV pool pages in all");
  const queueRequests = scrape.gauge("kvfence_engine_requests", "Engine requests by queue state", ["state"]);
  const counters = scrape.totalCounters([
    {
      name: "kvfence_tag_check_failures_total",
      help: "Page-tag checks that failed a request (a read of KV the request does not own)",
      total: "tagCheckFailures",
    },
    {
      name: "kvfence_preemptions_total",
      help: "Requests preempted when the pool ran out",
      total: "preemptions",
    },
    { name: "kvfence_engine_aborts_total", help: "Requests aborted in the engine", total: "aborts" },
    {
      name: "kvfence_prefill_tokens_total",
      help: "Prompt tokens the engine computed (a forked sample of n > 1 computes none)",
      total: "prefillTokens",
    },
    {
      name: "kvfence_decode_steps_total",
      help: "Engine steps that decoded at least one token (decode tokens over steps is the mean decode batch)",
      total: "decodeSteps",
    },
    {
      name: "kvfence_forked_samples_total",
      help: "Samples of n > 1 that started from a copy of their first sample's prompt KV",
      total: "forkedSamples",
    },
  ]);
  return (stats) => {
    for (const state of ["free", "reserved", "ready", "quarantined"] as const)
      poolPages.set({ state }, stats.pages[state]);
    if (stats.prefixCache !== undefined) poolPages.set({ state: "shared" }, stats.prefixCache.sharedPages);
    poolPagesTotal.set(stats.pages.total);
    for (const state of ["waiting", "running", "preempted"] as const)
      queueRequests.set({ state }, stats.queue[state]);
    counters(stats.counters);
  };
}

/** The prefix cache's series (none until a scrape finds the cache on); returns their update. */
function prefixCacheMetrics(scrape: MetricsScrape): (cache: NonNullable<EngineStats["prefixCache"]>) => void {
  const lookups = scrape.counter(
    "kvfence_prefix_cache_lookups_total",
    "Prefix-cache lookups of prompts, by result (hit: at least one page reused)",
    ["result"],
  );
  const counters = scrape.totalCounters([
    {
      name: "kvfence_prefix_cache_hit_tokens_total",
      help: "Prompt tokens served from the prefix cache instead of computed",
      total: "hitTokens",
    },
    {
      name: "kvfence_prefix_cache_evictions_total",
      help: "Cached pages evicted (least recently used, unreferenced) to make room",
      total: "evictions",
    },
    {
      name: "kvfence_prefix_cache_collisions_total",
      help: "Prefix-cache keys that matched but whose stored tokens differ (served as a miss)",
      total: "collisions",
    },
  ]);
  const pages = scrape.gauge("kvfence_prefix_cache_pages", "Pages held by the prefix cache, by reference", [
    "state",
  ]);
  return (cache) => {
    setCounter(lookups, cache.hits, { result: "hit" });
    setCounter(lookups, cache.misses, { result: "miss" });
    counters(cache);
    pages.set({ state: "referenced" }, cache.sharedPages - cache.evictablePages);
    pages.set({ state: "unreferenced" }, cache.evictablePages);
  };
}

/** The KV tiers' series (none until a scrape finds tiers on, docs/design.md §3b); returns their update. */
function tierMetrics(scrape: MetricsScrape): (tiers: NonNullable<EngineStats["tiers"]>) => void {
  const pages = scrape.gauge("kvfence_kv_tier_pages", "Pages held in each KV tier below the pool", ["tier"]);
  const bytes = scrape.gauge("kvfence_kv_tier_bytes", "Bytes of records held in each KV tier", ["tier"]);
  const spills = scrape.counter(
    "kvfence_kv_tier_spills_total",
    "Cached pages spilled from the pool into the tiers",
  );
  const loads = scrape.counter(
    "kvfence_kv_tier_loads_total",
    "Records loaded back from a tier and verified (MAC, owner, epoch), by tier",
    ["tier"],
  );
  const hitTokens = scrape.counter(
    "kvfence_kv_tier_hit_tokens_total",
    "Prompt tokens of pages promoted from a tier into the pool, by tier",
    ["tier"],
  );
  const rejected = scrape.counter(
    "kvfence_kv_tier_rejected_total",
    "Tier records refused at load and deleted, by reason (format, or the guard: mac, owner, epoch)",
    ["reason"],
  );
  const dropped = scrape.counter(
    "kvfence_kv_tier_dropped_total",
    "Records dropped out of the last tier for room",
  );
  return (t) => {
    for (const tier of ["ram", "disk"] as const) {
      pages.set({ tier }, t.pages[tier]);
      bytes.set({ tier }, t.bytes[tier]);
      setCounter(loads, t.loads[tier], { tier });
      setCounter(hitTokens, t.hitTokens[tier], { tier });
    }
    setCounter(spills, t.spills);
    for (const reason of ["format", "mac", "owner", "epoch"] as const)
      setCounter(rejected, t.rejected[reason], { reason });
    setCounter(dropped, t.dropped);
  };
}
