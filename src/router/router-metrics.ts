/**
 * The router's Prometheus metrics. Request and token counts are labelled by tenant (name, from the
 * API key), endpoint and status; pool pages, queue depths and engine counters are read from the
 * engine once per scrape (`EngineHandle.stats()`), so /metrics shows the pool as the engine sees it;
 * with the prefix cache on, its lookups, hit tokens, evictions, collisions and pages too.
 */

import { exponentialBuckets, MetricsRegistry } from "../lib/metrics.js";
import { type PhaseSource, renderPhaseMetrics } from "../lib/phase-histograms.js";
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
  readonly registry: MetricsRegistry;
  readonly requests;
  readonly promptTokens;
  readonly completionTokens;
  readonly admissionRejections;
  readonly inFlight;
  readonly timeToFirstToken;
  readonly interTokenLatency;
  readonly requestDuration;
  readonly poolPages;
  readonly poolPagesTotal;
  readonly queueRequests;
  readonly tagCheckFailures;
  readonly preemptions;
  readonly prefillTokens;
  readonly forkedSamples;
  readonly decodeSteps;
  readonly engineAborts;
  readonly clientDisconnects;

  constructor(engine: EngineHandle, registry = new MetricsRegistry()) {
    this.registry = registry;
    this.requests = registry.counter(
      "kvfence_requests_total",
      "HTTP requests by tenant, endpoint and status code",
      ["tenant", "endpoint", "status"],
    );
    this.promptTokens = registry.counter("kvfence_prompt_tokens_total", "Prompt tokens of served requests", [
      "tenant",
      "endpoint",
    ]);
    this.completionTokens = registry.counter(
      "kvfence_completion_tokens_total",
      "Generated tokens sent to clients",
      ["tenant", "endpoint"],
    );
    this.admissionRejections = registry.counter(
      "kvfence_admission_rejections_total",
      "Requests refused at admission, by reason",
      ["reason"],
    );
    this.inFlight = registry.gauge("kvfence_requests_in_flight", "Generation requests being served now");
    this.timeToFirstToken = registry.histogram(
      "kvfence_time_to_first_token_seconds",
      "Time from receiving a request to its first generated token",
      { labelNames: ["endpoint"], buckets: exponentialBuckets(0.005, 2, 14) },
    );
    this.interTokenLatency = registry.histogram(
      "kvfence_inter_token_latency_seconds",
      "Time between successive generated tokens of one request",
      { labelNames: ["endpoint"], buckets: exponentialBuckets(0.001, 2, 14) },
    );
    this.requestDuration = registry.histogram(
      "kvfence_request_duration_seconds",
      "Time from receiving a generation request to its last byte",
      { labelNames: ["endpoint"], buckets: exponentialBuckets(0.01, 2, 14) },
    );
    this.poolPages = registry.gauge("kvfence_kv_pool_pages", "KV pool pages by state", ["state"]);
    this.poolPagesTotal = registry.gauge("kvfence_kv_pool_pages_total", "KV pool pages in all");
    this.queueRequests = registry.gauge("kvfence_engine_requests", "Engine requests by queue state", [
      "state",
    ]);
    this.tagCheckFailures = registry.counter(
      "kvfence_tag_check_failures_total",
      "Page-tag checks that failed a request (a read of KV the request does not own)",
    );
    this.preemptions = registry.counter(
      "kvfence_preemptions_total",
      "Requests preempted when the pool ran out",
    );
    this.engineAborts = registry.counter("kvfence_engine_aborts_total", "Requests aborted in the engine");
    this.prefillTokens = registry.counter(
      "kvfence_prefill_tokens_total",
      "Prompt tokens the engine computed (a forked sample of n > 1 computes none)",
    );
    this.decodeSteps = registry.counter(
      "kvfence_decode_steps_total",
      "Engine steps that decoded at least one token (decode tokens over steps is the mean decode batch)",
    );
    this.forkedSamples = registry.counter(
      "kvfence_forked_samples_total",
      "Samples of n > 1 that started from a copy of their first sample's prompt KV",
    );
    this.clientDisconnects = registry.counter(
      "kvfence_client_disconnects_total",
      "Generation requests whose client went away before the end",
      ["endpoint"],
    );

    // Series that should read 0 (not be absent) before the first event.
    for (const reason of ["context_length_exceeded", "engine_door", "response_too_large"])
      this.admissionRejections.inc({ reason }, 0);
    for (const endpoint of ["chat", "completions"]) this.clientDisconnects.inc({ endpoint }, 0);

    // One engine's per-phase histograms (the disaggregated topology's come from its nodes: cluster-metrics.ts).
    let phases: PhaseSource[] = [];
    registry.onExpose(() => renderPhaseMetrics(phases));
    registry.onCollect(async () => {
      const stats = await engine.stats();
      phases = stats.phases === undefined ? [] : [{ node: "engine", role: "engine", snapshot: stats.phases }];
      for (const state of ["free", "reserved", "ready", "quarantined"] as const) {
        this.poolPages.set(stats.pages[state], { state });
      }
      this.poolPagesTotal.set(stats.pages.total);
      for (const state of ["waiting", "running", "preempted"] as const) {
        this.queueRequests.set(stats.queue[state], { state });
      }
      this.tagCheckFailures.setTotal(stats.counters.tagCheckFailures);
      this.preemptions.setTotal(stats.counters.preemptions);
      this.engineAborts.setTotal(stats.counters.aborts);
      this.prefillTokens.setTotal(stats.counters.prefillTokens ?? 0);
      this.forkedSamples.setTotal(stats.counters.forkedSamples ?? 0);
      this.decodeSteps.setTotal(stats.counters.decodeSteps ?? 0);
      if (stats.prefixCache !== undefined) {
        this.poolPages.set(stats.prefixCache.sharedPages, { state: "shared" });
        prefix ??= prefixCacheMetrics(registry);
        prefix.update(stats.prefixCache);
      }
    });
    let prefix: ReturnType<typeof prefixCacheMetrics> | undefined;
  }
}

/** The prefix cache's series (registered on the first scrape that finds the cache on). */
function prefixCacheMetrics(registry: MetricsRegistry) {
  const lookups = registry.counter(
    "kvfence_prefix_cache_lookups_total",
    "Prefix-cache lookups of prompts, by result (hit: at least one page reused)",
    ["result"],
  );
  const hitTokens = registry.counter(
    "kvfence_prefix_cache_hit_tokens_total",
    "Prompt tokens served from the prefix cache instead of computed",
  );
  const evictions = registry.counter(
    "kvfence_prefix_cache_evictions_total",
    "Cached pages evicted (least recently used, unreferenced) to make room",
  );
  const collisions = registry.counter(
    "kvfence_prefix_cache_collisions_total",
    "Prefix-cache keys that matched but whose stored tokens differ (served as a miss)",
  );
  const pages = registry.gauge("kvfence_prefix_cache_pages", "Pages held by the prefix cache, by reference", [
    "state",
  ]);
  return {
    update(c: NonNullable<EngineStats["prefixCache"]>): void {
      lookups.setTotal(c.hits, { result: "hit" });
      lookups.setTotal(c.misses, { result: "miss" });
      hitTokens.setTotal(c.hitTokens);
      evictions.setTotal(c.evictions);
      collisions.setTotal(c.collisions);
      pages.set(c.sharedPages - c.evictablePages, { state: "referenced" });
      pages.set(c.evictablePages, { state: "unreferenced" });
    },
  };
}
