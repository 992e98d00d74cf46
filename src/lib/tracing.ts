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
 * the phase ends, with the times it started and ended, so nothing is kept open per request; the
 * SDK builds the recorded spans in batches (`startTracing`), not on the step that ended the phase.
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
 * How long a finished span waits in this thread's buffer before the SDK builds it (ms), and how
 * many make it build at once. Building spans one at a time, where each phase ends, cost 60–200 µs
 * of CPU a span on a busy node (the SDK's code runs cold between two spans); built in a batch it
 * costs a fraction of that (docs/benchmarks.md §8).
 */
export const SPAN_BUILD_DELAY_MS = 1000;
export const SPAN_BUILD_BATCH = 256;

/** A finished span waiting to be built: its times, attributes, and its parent (or its own ids, for a root). */
interface FinishedSpan {
  readonly name: string;
  readonly startEpochMs: number;
  readonly endEpochMs: number;
  readonly attributes: SpanAttributes;
  /** The parent's W3C traceparent; "" for a root span. */
  readonly parent: string;
  /** A root span's ids, chosen when it opened (its traceparent went out with the request). */
  readonly ids: { readonly traceId: string; readonly spanId: string } | null;
}

/**
 * Starts this thread's tracer exporting to `endpoint` as service `serviceName` (idempotent: a
 * second call returns the first tracer). Loads the OpenTelemetry SDK now, not before.
 *
 * A phase's span is buffered when the phase ends (its name, times and attributes: one small
 * object) and the SDK builds the buffered spans together, `SPAN_BUILD_DELAY_MS` later or every
 * `SPAN_BUILD_BATCH` spans, off the step that ended the phase. A request span's ids are chosen
 * when it opens, since its `traceparent` travels with the request; the SDK is handed them through
 * its `idGenerator` hook when it builds that span. Every request is traced (`AlwaysOnSampler`:
 * a phase's parent is always a sampled request span). The batch exporter keeps the SDK's defaults
 * (a batch of up to 512 spans every 5 s) and its standard `OTEL_BSP_*` environment variables.
 */
export async function startTracing(endpoint: string, serviceName: string): Promise<Tracing> {
  if (active !== null) return active;
  const [api, sdk, exporterModule, resources] = await Promise.all([
    import("@opentelemetry/api"),
    import("@opentelemetry/sdk-trace-base"),
    import("@opentelemetry/exporter-trace-otlp-http"),
    import("@opentelemetry/resources"),
  ]);
  const random = new sdk.RandomIdGenerator();
  // The ids the SDK gives the span it is building: a root's own, else random.
  let preset: FinishedSpan["ids"] = null;
  const idGenerator = {
    generateTraceId: () => preset?.traceId ?? random.generateTraceId(),
    generateSpanId: () => preset?.spanId ?? random.generateSpanId(),
  };
  const exporter = new exporterModule.OTLPTraceExporter({ url: tracesUrl(endpoint) });
  const provider = new sdk.BasicTracerProvider({
    resource: resources.resourceFromAttributes({ "service.name": serviceName }),
    sampler: new sdk.AlwaysOnSampler(),
    idGenerator,
    spanProcessors: [new sdk.BatchSpanProcessor(exporter)],
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
  let buffer: FinishedSpan[] = [];
  let timer: ReturnType<typeof setTimeout> | null = null;
  const build = (): void => {
    if (timer !== null) clearTimeout(timer);
    timer = null;
    const spans = buffer;
    buffer = [];
    // A request's phases share its traceparent: one parsed context for them.
    const contexts = new Map<string, ReturnType<typeof parentOf>>();
    for (const s of spans) {
      let context = api.ROOT_CONTEXT;
      if (s.parent !== "") {
        context = contexts.get(s.parent) ?? parentOf(s.parent);
        contexts.set(s.parent, context);
      }
      preset = s.ids;
      try {
        tracer
          .startSpan(
            s.name,
            {
              startTime: s.startEpochMs,
              attributes: s.attributes,
              kind: s.ids === null ? api.SpanKind.INTERNAL : api.SpanKind.SERVER,
            },
            context,
          )
          .end(s.endEpochMs);
      } finally {
        preset = null;
      }
    }
  };
  const finish = (span: FinishedSpan): void => {
    buffer.push(span);
    if (buffer.length >= SPAN_BUILD_BATCH) build();
    else if (timer === null) {
      timer = setTimeout(build, SPAN_BUILD_DELAY_MS);
      timer.unref();
    }
  };
  active = {
    startRequest(name, attributes, startEpochMs) {
      const ids = { traceId: random.generateTraceId(), spanId: random.generateSpanId() };
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
    async shutdown() {
      build();
      await provider.shutdown();
      active = null;
    },
  };
  return active;
}
