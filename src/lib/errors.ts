/**
 * One error type for the whole server. Every failure that can reach a client carries a `code` from
 * the closed list below; the table maps each code to its HTTP status, its OpenAI error `type`,
 * whether a retry can help and, for failures inside the server, the message a client sees in place
 * of the internal one (`publicError`: internal messages name request ids, pages, incarnations and
 * nodes, which stay in the log). Errors cross threads and processes as plain `{code, message}` data
 * (`toWire`/`fromWire`) and are matched on `code`, never on the message text.
 */

export const ERROR_TABLE = {
  invalid_request: {
    status: 400,
    type: "invalid_request_error",
    retryable: false,
    publicMessage: "The server refused the request it built from yours: this is a bug, tell the operator",
  },
  context_length_exceeded: { status: 400, type: "invalid_request_error", retryable: false },
  request_exceeds_capacity: { status: 400, type: "invalid_request_error", retryable: false },
  invalid_json: { status: 400, type: "invalid_request_error", retryable: false },
  json_too_deep: { status: 400, type: "invalid_request_error", retryable: false },
  array_above_max_length: { status: 400, type: "invalid_request_error", retryable: false },
  string_above_max_length: { status: 400, type: "invalid_request_error", retryable: false },
  response_too_large: { status: 400, type: "invalid_request_error", retryable: false },
  model_not_found: { status: 404, type: "invalid_request_error", retryable: false },
  invalid_api_key: { status: 401, type: "authentication_error", retryable: false },
  not_found: { status: 404, type: "invalid_request_error", retryable: false },
  method_not_allowed: { status: 405, type: "invalid_request_error", retryable: false },
  payload_too_large: { status: 413, type: "invalid_request_error", retryable: false },
  unsupported_content_type: { status: 415, type: "invalid_request_error", retryable: false },
  misdirected_request: { status: 421, type: "invalid_request_error", retryable: false },
  headers_too_large: { status: 431, type: "invalid_request_error", retryable: false },
  request_timeout: { status: 408, type: "invalid_request_error", retryable: false },
  rate_limit_exceeded: { status: 429, type: "requests", retryable: true },
  pool_exhausted: {
    status: 503,
    type: "server_error",
    retryable: true,
    publicMessage: "The server's KV cache has no room for this request now: retry later",
  },
  server_busy: { status: 503, type: "server_error", retryable: true },
  queue_timeout: { status: 503, type: "server_error", retryable: true },
  not_ready: { status: 503, type: "server_error", retryable: true },
  node_unavailable: {
    status: 503,
    type: "server_error",
    retryable: true,
    publicMessage: "A part of the server that this request needs is not available now: retry later",
  },
  aborted: { status: 499, type: "server_error", retryable: false, publicMessage: "The request was aborted" },
  transfer_failed: {
    status: 503,
    type: "server_error",
    retryable: true,
    publicMessage: "Moving this request's KV cache between the server's nodes failed: retry",
  },
  checksum_mismatch: {
    status: 500,
    type: "server_error",
    retryable: true,
    publicMessage: "This request's KV cache did not verify after a transfer, so it was not used: retry",
  },
  coverage_mismatch: {
    status: 500,
    type: "server_error",
    retryable: true,
    publicMessage: "This request's KV cache arrived incomplete after a transfer, so it was not used: retry",
  },
  page_tag_mismatch: {
    status: 500,
    type: "server_error",
    retryable: true,
    publicMessage: "A KV page was not this request's own, so it was not read: retry",
  },
  layout_mismatch: {
    status: 500,
    type: "server_error",
    retryable: false,
    publicMessage: "The server's nodes disagree on the KV cache layout: tell the operator",
  },
  bad_model_folder: {
    status: 500,
    type: "server_error",
    retryable: false,
    publicMessage: "Internal server error",
  },
  unsupported_model: {
    status: 500,
    type: "server_error",
    retryable: false,
    publicMessage: "Internal server error",
  },
  config_invalid: {
    status: 500,
    type: "server_error",
    retryable: false,
    publicMessage: "Internal server error",
  },
  internal: { status: 500, type: "server_error", retryable: false, publicMessage: "Internal server error" },
} as const satisfies Record<
  string,
  { status: number; type: string; retryable: boolean; publicMessage?: string }
>;

export type ErrorCode = keyof typeof ERROR_TABLE;

/** Plain-data form of a KvfenceError, safe to post between threads or send between processes. */
export interface WireError {
  readonly code: ErrorCode;
  readonly message: string;
  readonly param?: string | undefined;
  /** Seconds the client should wait before retrying (the `Retry-After` header). */
  readonly retryAfter?: number | undefined;
}

export class KvfenceError extends Error {
  override readonly name = "KvfenceError";
  readonly code: ErrorCode;
  readonly param: string | undefined;
  /** Seconds the client should wait before retrying (`Retry-After`), when the server knows. */
  readonly retryAfter: number | undefined;

  constructor(
    code: ErrorCode,
    message: string,
    options?: { param?: string; cause?: unknown; retryAfter?: number },
  ) {
    super(message, options?.cause === undefined ? undefined : { cause: options.cause });
    this.code = code;
    this.param = options?.param;
    this.retryAfter = options?.retryAfter;
  }

  get status(): number {
    return ERROR_TABLE[this.code].status;
  }

  get retryable(): boolean {
    return ERROR_TABLE[this.code].retryable;
  }

  toWire(): WireError {
    return {
      code: this.code,
      message: this.message,
      ...(this.param === undefined ? {} : { param: this.param }),
      ...(this.retryAfter === undefined ? {} : { retryAfter: this.retryAfter }),
    };
  }

  static fromWire(wire: WireError): KvfenceError {
    return new KvfenceError(wire.code, wire.message, {
      ...(wire.param === undefined ? {} : { param: wire.param }),
      ...(wire.retryAfter === undefined ? {} : { retryAfter: wire.retryAfter }),
    });
  }
}

/** The OpenAI error envelope for any thrown value; unknown errors become a 500 without internals. */
export function toOpenAiError(err: unknown): {
  status: number;
  body: { error: { message: string; type: string; param: string | null; code: string } };
} {
  const e = err instanceof KvfenceError ? err : new KvfenceError("internal", "Internal server error");
  const row = ERROR_TABLE[e.code];
  return {
    status: row.status,
    body: { error: { message: e.message, type: row.type, param: e.param ?? null, code: e.code } },
  };
}

/**
 * The error a client sees for one raised inside the server (the engine, a node, the protocol): the
 * table's public message in place of the internal one, for every code that has one. Errors about
 * the request itself (a context too long, the other 4xx) keep their message.
 */
export function publicError(err: KvfenceError): KvfenceError {
  const row = ERROR_TABLE[err.code];
  const message = "publicMessage" in row ? row.publicMessage : undefined;
  if (message === undefined || message === err.message) return err;
  return new KvfenceError(err.code, message, {
    ...(err.param === undefined ? {} : { param: err.param }),
    ...(err.retryAfter === undefined ? {} : { retryAfter: err.retryAfter }),
  });
}
