import type { SpanContext, SpanKind } from "@opentelemetry/api";
import type { ReadableSpan } from "@opentelemetry/sdk-trace-base";

/**
 * OpenTelemetry spans of a request's phases (docs/api.md, "Traces"), exported over OTLP/HTTP
 * (JSON) when `--otlp-endpoint URL` is given, and nothing at all otherwise: `startTracing` loads
 * the SDK (`@opentelemetry/sdk-trace-base`, the OTLP exporter) with a dynamic import, so a server
 * without the flag never loads it, and every call site checks `tracing()` for null first.
 *
 * Each thread or process that records spans starts its own tracer (the router's main thread, each
 * prefill and decode node), since a worker thread has its own module state; the tree is one trace
 * because the router's request span travels with the request as a W3C `traceparent`
 * (`GenerationRequest.trace`, and the node envelopes of `reserve` and `prefill`): the router
 * records `request` with `queue_wait`, `reservation` and `first_token` under it, the prefill node
 * `prefill` and `transfer`, the decode node `commit` and `decode`. A phase's span is recorded when
 * the phase ends, with the times it started and ended, so nothing is kept open per request, and
 * handed to the SDK's batch span processor as a finished span (`startTracing`).
 * Spans carry the request id (the `x-request-id`) and never the tenant or the prompt.
 */

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

let active: Tracing | null = null;

/** This thread's tracer, or null when tracing is off (the default). */
export function tracing(): Tracing | null {
  return active;
}

/** Milliseconds since the epoch now, at sub-millisecond resolution (comparable across threads). */
export function epochNow(): number {
  return performance.timeOrigin + performance.now();
}

/** A `performance.now()` reading of this thread as milliseconds since the epoch. */
export function epochOf(performanceNow: number): number {
  return performance.timeOrigin + performanceNow;
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

/** Milliseconds since the epoch as OpenTelemetry's HrTime, [seconds, nanoseconds]. */
export function hrTimeOf(epochMs: number): [number, number] {
  const seconds = Math.floor(epochMs / 1000);
  const nanos = Math.round((epochMs - seconds * 1000) * 1e6);
  return nanos >= 1e9 ? [seconds + 1, nanos - 1e9] : [seconds, nanos];
}

/**
 * Starts this thread's tracer exporting to `endpoint` as service `serviceName` (idempotent: a
 * second call returns the first tracer). Loads the OpenTelemetry SDK now, not before.
 *
 * A phase is recorded once it has ended, with the times it started and ended, so each span is
 * handed to the SDK's batch span processor finished: a `ReadableSpan` (the processor's and the
 * exporter's own interface) of its name, ids, parent, times and attributes, and not built by the
 * SDK's tracer, which would start a live span (sampler, attribute checks, clock reads, its span
 * metrics) only to end it at once. Built by the tracer, a span cost 12 µs of CPU in a loop and
 * 60–200 µs between two model steps (docs/benchmarks.md §8). Every request is traced (a phase's
 * parent is always a sampled request span; the W3C flags say sampled). A request span's ids are
 * chosen when it opens, since its `traceparent` travels with the request. The batch exporter
 * keeps the SDK's defaults (a batch of up to 512 spans every 5 s) and its standard `OTEL_BSP_*`
 * environment variables.
 */
export async function startTracing(endpoint: string, serviceName: string): Promise<Tracing> {
  if (active !== null) return active;
  const [api, sdk, exporterModule, resources] = await Promise.all([
    import("@opentelemetry/api"),
    import("@opentelemetry/sdk-trace-base"),
    import("@opentelemetry/exporter-trace-otlp-http"),
    import("@opentelemetry/resources"),
  ]);
  const ids = new sdk.RandomIdGenerator();
  const processor = new sdk.BatchSpanProcessor(
    new exporterModule.OTLPTraceExporter({ url: tracesUrl(endpoint) }),
  );
  const resource = resources.resourceFromAttributes({ "service.name": serviceName });
  const instrumentationScope = { name: "kvfence" };
  const status = { code: api.SpanStatusCode.UNSET };
  const parentOf = (traceparent: string): SpanContext | undefined => {
    const m = TRACEPARENT_RE.exec(traceparent);
    if (m === null) return undefined;
    return { traceId: m[1]!, spanId: m[2]!, traceFlags: Number.parseInt(m[3]!, 16), isRemote: true };
  };
  const record = (
    name: string,
    kind: SpanKind,
    context: SpanContext,
    parent: SpanContext | undefined,
    startEpochMs: number,
    endEpochMs: number,
    attributes: SpanAttributes,
  ): void => {
    const startTime = hrTimeOf(startEpochMs);
    const endTime = hrTimeOf(endEpochMs);
    const span: ReadableSpan = {
      name,
      kind,
      spanContext: () => context,
      ...(parent === undefined ? {} : { parentSpanContext: parent }),
      startTime,
      endTime,
      duration: hrTimeOf(Math.max(0, endEpochMs - startEpochMs)),
      status,
      attributes,
      links: [],
      events: [],
      ended: true,
      resource,
      instrumentationScope,
      droppedAttributesCount: 0,
      droppedEventsCount: 0,
      droppedLinksCount: 0,
    };
    processor.onEnd(span);
  };
  active = {
    startRequest(name, attributes, startEpochMs) {
      const context = { traceId: ids.generateTraceId(), spanId: ids.generateSpanId(), traceFlags: 1 };
      let ended = false;
      return {
        traceparent: `00-${context.traceId}-${context.spanId}-01`,
        end(endAttributes, endEpochMs) {
          if (ended) return;
          ended = true;
          record(
            name,
            api.SpanKind.SERVER,
            context,
            undefined,
            startEpochMs,
            endEpochMs ?? epochNow(),
            endAttributes === undefined ? attributes : { ...attributes, ...endAttributes },
          );
        },
      };
    },
    phase(name, traceparent, startEpochMs, endEpochMs, attributes) {
      const parent = parentOf(traceparent);
      const context = {
        traceId: parent?.traceId ?? ids.generateTraceId(),
        spanId: ids.generateSpanId(),
        traceFlags: 1,
      };
      record(name, api.SpanKind.INTERNAL, context, parent, startEpochMs, endEpochMs, attributes ?? {});
    },
    async shutdown() {
      await processor.shutdown();
      active = null;
    },
  };
  return active;
}
