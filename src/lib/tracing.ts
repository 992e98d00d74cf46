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
 * the phase ends, with the times it started and ended, so nothing is kept open per request.
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

/**
 * Starts this thread's tracer exporting to `endpoint` as service `serviceName` (idempotent: a
 * second call returns the first tracer). Loads the OpenTelemetry SDK now, not before.
 */
export async function startTracing(endpoint: string, serviceName: string): Promise<Tracing> {
  if (active !== null) return active;
  const [api, sdk, exporterModule, resources] = await Promise.all([
    import("@opentelemetry/api"),
    import("@opentelemetry/sdk-trace-base"),
    import("@opentelemetry/exporter-trace-otlp-http"),
    import("@opentelemetry/resources"),
  ]);
  const exporter = new exporterModule.OTLPTraceExporter({ url: tracesUrl(endpoint) });
  const provider = new sdk.BasicTracerProvider({
    resource: resources.resourceFromAttributes({ "service.name": serviceName }),
    spanProcessors: [new sdk.BatchSpanProcessor(exporter, { scheduledDelayMillis: 500 })],
  });
  const tracer = provider.getTracer("kvfence");
  const parentOf = (traceparent: string) => {
    const m = TRACEPARENT_RE.exec(traceparent);
    if (m === null) return api.ROOT_CONTEXT;
    return api.trace.setSpanContext(api.ROOT_CONTEXT, {
      traceId: m[1]!,
      spanId: m[2]!,
      traceFlags: Number.parseInt(m[3]!, 16),
      isRemote: true,
    });
  };
  const traceparentOf = (span: {
    spanContext(): { traceId: string; spanId: string; traceFlags: number };
  }) => {
    const c = span.spanContext();
    return `00-${c.traceId}-${c.spanId}-${c.traceFlags.toString(16).padStart(2, "0")}`;
  };
  active = {
    startRequest(name, attributes, startEpochMs) {
      const span = tracer.startSpan(name, { startTime: startEpochMs, attributes, kind: api.SpanKind.SERVER });
      return {
        traceparent: traceparentOf(span),
        end(endAttributes, endEpochMs) {
          if (endAttributes !== undefined) span.setAttributes(endAttributes);
          span.end(endEpochMs ?? epochNow());
        },
      };
    },
    phase(name, traceparent, startEpochMs, endEpochMs, attributes) {
      const span = tracer.startSpan(
        name,
        { startTime: startEpochMs, ...(attributes === undefined ? {} : { attributes }) },
        parentOf(traceparent),
      );
      span.end(endEpochMs);
    },
    async shutdown() {
      await provider.shutdown();
      active = null;
    },
  };
  return active;
}
