/**
 * OpenTelemetry spans of a request's phases (docs/api.md, "Traces"), exported over OTLP/HTTP
 * (JSON) when `--otlp-endpoint URL` is given, and nothing at all otherwise: `startTracing` loads
 * the SDK (`@opentelemetry/sdk-trace-base`, the OTLP exporter) with a dynamic import, so a server
 * without the flag never loads it, and every call site checks `tracing()` for null first.
 *
 * Each process that records spans has one exporter: the router's main thread loads the SDK
 * (`startTracing`), and a prefill or decode node in a worker thread of the same process
 * (`startForwardedTracing`) records its phases the same way but hands each second's finished
 * spans to the main thread over its message port (`ForwardedSpans`), where the one SDK builds them
 * under the node's own service name; a node process (`kvfence node`) starts its own. The tree is one trace
 * because the router's request span travels with the request as a W3C `traceparent`
 * (`GenerationRequest.trace`, and the node envelopes of `reserve` and `prefill`): the router
 * records `request` with `queue_wait`, `reservation` and `first_token` under it, the prefill node
 * `prefill` and `transfer`, the decode node `commit` and `decode`. A phase's span is recorded when
 * the phase ends, with the times it started and ended, so nothing is kept open per request; the
 * SDK builds the recorded spans in batches (`startTracing`), not on the step that ended the phase.
 * Spans carry the request id (the `x-request-id`) and never the tenant or the prompt.
 */

import { randomBytes } from "node:crypto";
import type { SpanContext } from "@opentelemetry/api";
import type { ReadableSpan } from "@opentelemetry/sdk-trace-base";

/** A request's identity on its way through the nodes. */
export interface RequestTrace {
  /** The request id of the router's HTTP request (`x-request-id`): in every log line and span about it. */
  readonly requestId: string;
  /** W3C trace context of the router's request span (absent when tracing is off). */
  readonly traceparent?: string;
}

export type SpanAttributes = Readonly<Record<string, string | number | boolean>>;

/** An open request span (the router's). */
export interface RequestSpan {
  readonly traceparent: string;
  end(attributes?: SpanAttributes, endEpochMs?: number): void;
}

export interface Tracing {
  /** Opens a root span for one request, started at `startEpochMs`. */
  startRequest(name: string, attributes: SpanAttributes, startEpochMs: number): RequestSpan;
  /** Records a finished phase under `traceparent`. */
  phase(
    name: string,
    traceparent: string,
    startEpochMs: number,
    endEpochMs: number,
    attributes?: SpanAttributes,
  ): void;
  /** Exports what is buffered and stops. */
  shutdown(): Promise<void>;
}

/** The tracer that exports: it also builds the spans worker threads hand it. */
export interface ExportingTracing extends Tracing {
  /** Builds and exports a worker thread's finished spans, under that thread's service name. */
  adopt(forwarded: ForwardedSpans): void;
}

/**
 * A worker thread's finished spans, posted to the main thread in one message (structured-cloned):
 * what `startForwardedTracing` sends and `ExportingTracing.adopt` builds.
 */
export interface ForwardedSpans {
  readonly kind: "spans";
  /** The recording thread's service name (`kvfence-prefill`, `kvfence-decode`). */
  readonly service: string;
  readonly spans: readonly FinishedSpan[];
}

let active: Tracing | null = null;

/** This thread's tracer, or null when tracing is off (the default). */
export function tracing(): Tracing | null {
  return active;
}

/**
 * The wall-clock time of this thread's `performance.now()` zero, in ms since the epoch: Node's
 * `performance.timeOrigin` until a tracer starts, then `wallClockOrigin()`. Read from a variable
 * (the `timeOrigin` getter added ~30 ns to each 70 ns clock read on this VM).
 */
let timeOrigin = performance.timeOrigin;

/**
 * `performance.now()`'s zero as the wall clock puts it now. Node reads its two clocks for
 * `timeOrigin` once, when the thread starts, one after the other: a thread descheduled between the
 * reads, or a wall clock slewed since, puts its spans milliseconds off those of the other processes
 * of a host. Here the origin is taken at the instant `Date.now()` ticks, from the best of a few
 * ticks (the one read in the shortest window): within ~0.1 ms of the other threads' on a host.
 * Costs up to ~5 ms, once, when tracing starts.
 */
function wallClockOrigin(): number {
  let best = performance.timeOrigin;
  let window = Number.POSITIVE_INFINITY;
  for (let i = 0; i < 5; i++) {
    // Each read of the wall clock between two of performance.now(): the tick came after the
    // previous read began and before this one ended, whatever was descheduled where.
    let before = performance.now();
    let wall = Date.now();
    for (;;) {
      const start = performance.now();
      const now = Date.now();
      const end = performance.now();
      if (now !== wall) {
        if (end - before < window) {
          window = end - before;
          best = now - (before + end) / 2;
        }
        break;
      }
      wall = now;
      before = start;
    }
  }
  return best;
}

/** Milliseconds since the epoch now, at sub-millisecond resolution (comparable across threads). */
export function epochNow(): number {
  return timeOrigin + performance.now();
}

/** A `performance.now()` reading of this thread as milliseconds since the epoch. */
export function epochOf(performanceNow: number): number {
  return timeOrigin + performanceNow;
}

/** A phase of the request `trace` that began at `startEpochMs` and ends now, as a span (when tracing is on). */
export function traceSpan(
  trace: RequestTrace | undefined,
  name: string,
  startEpochMs: number,
  attributes: SpanAttributes = {},
): void {
  if (active === null || trace?.traceparent === undefined) return;
  active.phase(name, trace.traceparent, startEpochMs, epochNow(), {
    ...attributes,
    "kvfence.request_id": trace.requestId,
  });
}

/** The OTLP/HTTP traces URL for `endpoint`: a bare origin gets the standard `/v1/traces` path. */
export function tracesUrl(endpoint: string): string {
  const url = new URL(endpoint);
  if (url.pathname === "/" || url.pathname === "") url.pathname = "/v1/traces";
  return url.toString();
}

const TRACEPARENT_RE = /^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$/;

/**
 * How long a worker thread's finished spans wait before they are posted to the main thread (ms),
 * and how many make it post at once: one message a second, not one a span.
 */
export const SPAN_FORWARD_DELAY_MS = 1000;
export const SPAN_FORWARD_BATCH = 256;

/**
 * The batch span processor's settings as the SDK reads them (its defaults, or the standard
 * `OTEL_BSP_SCHEDULE_DELAY` and `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`): the exporting thread keeps its
 * spans as records until a batch is full or the delay is up, then builds them and flushes them at
 * once, so a built span (~1.6 KB of the SDK's objects, against ~180 bytes for a record) lives only
 * until it is serialized.
 */
function batchSettings(): { delayMs: number; batch: number } {
  const env = (name: string, fallback: number): number => {
    const v = Number(process.env[name]);
    return Number.isFinite(v) && v > 0 ? v : fallback;
  };
  return { delayMs: env("OTEL_BSP_SCHEDULE_DELAY", 5000), batch: env("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512) };
}

/** Finished spans gathered until `batch` are waiting or `delayMs` has passed since the first, then handed to `flush`. */
function batcher<T>(delayMs: number, batch: number, flush: (items: T[], count: number) => void) {
  let items: T[] = [];
  let count = 0;
  let timer: ReturnType<typeof setTimeout> | null = null;
  const flushNow = (): void => {
    if (timer !== null) clearTimeout(timer);
    timer = null;
    if (items.length === 0) return;
    const out = items;
    const n = count;
    items = [];
    count = 0;
    flush(out, n);
  };
  return {
    flushNow,
    add(item: T, spans = 1): void {
      items.push(item);
      count += spans;
      if (count >= batch) flushNow();
      else if (timer === null) {
        timer = setTimeout(flushNow, delayMs);
        timer.unref();
      }
    },
  };
}

/** A finished span waiting to be built: its times, attributes, and its parent (or its own ids, for a root). */
export interface FinishedSpan {
  readonly name: string;
  readonly startEpochMs: number;
  readonly endEpochMs: number;
  readonly attributes: SpanAttributes;
  /** The parent's W3C traceparent; "" for a root span. */
  readonly parent: string;
  /** A root span's ids, chosen when it opened (its traceparent went out with the request). */
  readonly ids: { readonly traceId: string; readonly spanId: string } | null;
}

/** Milliseconds since the epoch as OpenTelemetry's HrTime, [seconds, nanoseconds]. */
export function hrTimeOf(epochMs: number): [number, number] {
  const seconds = Math.floor(epochMs / 1000);
  const nanos = Math.round((epochMs - seconds * 1000) * 1e6);
  return nanos >= 1e9 ? [seconds + 1, nanos - 1e9] : [seconds, nanos];
}

/**
 * The recording half of a tracer: a phase's span is one small record when the phase ends (its
 * name, times and attributes), handed to `finish`; the SDK builds it later, in a batch, off the
 * step that ended the phase.
 */
function recorder(
  randomIds: () => { traceId: string; spanId: string },
  finish: (span: FinishedSpan) => void,
): Pick<Tracing, "startRequest" | "phase"> {
  return {
    startRequest(name, attributes, startEpochMs) {
      const ids = randomIds();
      let ended = false;
      return {
        traceparent: `00-${ids.traceId}-${ids.spanId}-01`,
        end(endAttributes, endEpochMs) {
          if (ended) return;
          ended = true;
          finish({
            name,
            startEpochMs,
            endEpochMs: endEpochMs ?? epochNow(),
            attributes: endAttributes === undefined ? attributes : { ...attributes, ...endAttributes },
            parent: "",
            ids,
          });
        },
      };
    },
    phase(name, traceparent, startEpochMs, endEpochMs, attributes) {
      finish({
        name,
        startEpochMs,
        endEpochMs,
        attributes: attributes ?? {},
        parent: traceparent,
        ids: null,
      });
    },
  };
}

/**
 * Starts this thread's tracer exporting to `endpoint` as service `serviceName` (idempotent: a
 * second call returns the first tracer). Loads the OpenTelemetry SDK now, not before.
 *
 * Phases are recorded as `recorder` says, this thread's and the ones worker threads forward
 * (`adopt`) alike, and kept as records until the batch span processor would export
 * (`batchSettings`: a batch of up to 512 spans, or 5 s after the first); then they are handed to
 * the SDK's `BatchSpanProcessor` together, each as a finished `ReadableSpan` (the interface the
 * processor and the OTLP exporter read) with its own service's resource, and the processor is
 * flushed, so the exporter groups them by service in one post. They are not built by the SDK's
 * tracer, which would start a live span (sampler, attribute checks, clock conversions, its span
 * metrics) only to end it at once: the tracer took ~4.5 µs more a span of the ~16 µs the exporting
 * thread spends on one (records to OTLP post, docs/benchmarks.md §8). A request span's ids are
 * chosen when it opens, since its `traceparent` travels with the request. Every request is traced
 * (a phase's parent is always a sampled request span; the W3C flags say sampled). The batch
 * processor keeps the SDK's defaults and its standard `OTEL_BSP_*` environment variables.
 */
export async function startTracing(endpoint: string, serviceName: string): Promise<ExportingTracing> {
  if (active !== null) {
    if (!("adopt" in active)) throw new Error("This thread's tracer forwards its spans; it cannot export");
    return active as ExportingTracing;
  }
  timeOrigin = wallClockOrigin();
  const [api, sdk, exporterModule, resources] = await Promise.all([
    import("@opentelemetry/api"),
    import("@opentelemetry/sdk-trace-base"),
    import("@opentelemetry/exporter-trace-otlp-http"),
    import("@opentelemetry/resources"),
  ]);
  const random = new sdk.RandomIdGenerator();
  const processor = new sdk.BatchSpanProcessor(
    new exporterModule.OTLPTraceExporter({ url: tracesUrl(endpoint) }),
  );
  const scope = { name: "kvfence" };
  const status = { code: api.SpanStatusCode.UNSET };
  const resourcesByService = new Map<string, ReturnType<typeof resources.resourceFromAttributes>>();
  const contextOf = (traceparent: string): SpanContext | undefined => {
    const m = TRACEPARENT_RE.exec(traceparent);
    if (m === null) return undefined;
    return { traceId: m[1]!, spanId: m[2]!, traceFlags: Number.parseInt(m[3]!, 16), isRemote: true };
  };
  // A batch of records as finished spans, handed to the processor as the SDK's tracer would end them.
  const build = (service: string, spans: readonly FinishedSpan[]): void => {
    let resource = resourcesByService.get(service);
    if (resource === undefined) {
      resource = resources.resourceFromAttributes({ "service.name": service });
      resourcesByService.set(service, resource);
    }
    // A request's phases share its traceparent: one parsed context for them.
    const parents = new Map<string, SpanContext | undefined>();
    for (const s of spans) {
      let parent: SpanContext | undefined;
      let context: SpanContext;
      if (s.ids !== null) context = { traceId: s.ids.traceId, spanId: s.ids.spanId, traceFlags: 1 };
      else {
        parent = parents.get(s.parent);
        if (parent === undefined) {
          parent = contextOf(s.parent);
          parents.set(s.parent, parent);
        }
        context = {
          traceId: parent?.traceId ?? random.generateTraceId(),
          spanId: random.generateSpanId(),
          traceFlags: 1,
        };
      }
      const span: ReadableSpan = {
        name: s.name,
        kind: s.ids === null ? api.SpanKind.INTERNAL : api.SpanKind.SERVER,
        spanContext: () => context,
        ...(parent === undefined ? {} : { parentSpanContext: parent }),
        startTime: hrTimeOf(s.startEpochMs),
        endTime: hrTimeOf(s.endEpochMs),
        duration: hrTimeOf(Math.max(0, s.endEpochMs - s.startEpochMs)),
        status,
        attributes: s.attributes,
        links: [],
        events: [],
        ended: true,
        resource,
        instrumentationScope: scope,
        droppedAttributesCount: 0,
        droppedEventsCount: 0,
        droppedLinksCount: 0,
      };
      processor.onEnd(span);
    }
  };
  // This thread's records (as a one-span group) and forwarded groups, in the order they came.
  const settings = batchSettings();
  const pending = batcher<{ service: string; spans: readonly FinishedSpan[] }>(
    settings.delayMs,
    settings.batch,
    (groups) => {
      for (const g of groups) build(g.service, g.spans);
      void processor.forceFlush();
    },
  );
  const own = recorder(
    () => ({ traceId: random.generateTraceId(), spanId: random.generateSpanId() }),
    (span) => pending.add({ service: serviceName, spans: [span] }),
  );
  const exporting: ExportingTracing = {
    ...own,
    adopt(forwarded) {
      if (forwarded.spans.length > 0)
        pending.add({ service: forwarded.service, spans: forwarded.spans }, forwarded.spans.length);
    },
    async shutdown() {
      pending.flushNow();
      await processor.shutdown();
      active = null;
    },
  };
  active = exporting;
  return exporting;
}

/**
 * Starts the tracer of a worker thread whose process exports from its main thread: phases are
 * recorded as `recorder` says and each flush is handed to `post` as one `ForwardedSpans` (the
 * worker posts it on its port; the main thread's `ExportingTracing.adopt` builds it). The SDK is
 * never loaded in this thread. Idempotent, as `startTracing`.
 */
export function startForwardedTracing(serviceName: string, post: (spans: ForwardedSpans) => void): Tracing {
  if (active !== null) return active;
  timeOrigin = wallClockOrigin();
  const pending = batcher<FinishedSpan>(SPAN_FORWARD_DELAY_MS, SPAN_FORWARD_BATCH, (spans) =>
    post({ kind: "spans", service: serviceName, spans }),
  );
  const own = recorder(
    () => ({ traceId: randomBytes(16).toString("hex"), spanId: randomBytes(8).toString("hex") }),
    (span) => pending.add(span),
  );
  active = {
    ...own,
    async shutdown() {
      pending.flushNow();
      active = null;
    },
  };
  return active;
}

/** Hands a worker thread's forwarded spans to this thread's exporting tracer (dropped when there is none). */
export function adoptSpans(forwarded: ForwardedSpans): void {
  if (active !== null && "adopt" in active) (active as ExportingTracing).adopt(forwarded);
}
