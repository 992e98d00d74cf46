/**
 * One error type for the whole server. Every failure that can reach a client carries a `code` from
 * the closed list below; the table maps each code to its HTTP status, its OpenAI error `type` and
 * whether a retry can help. Errors cross threads and processes as plain `{code, message}` data
 * (`toWire`/`fromWire`) and are matched on `code`, never on the message text.
 */

export const ERROR_TABLE = {
  invalid_request: { status: 400, type: "invalid_request_error", retryable: false },
  context_length_exceeded: { status: 400, type: "invalid_request_error", retryable: false },
  invalid_json: { status: 400, type: "invalid_request_error", retryable: false },
  model_not_found: { status: 404, type: "invalid_request_error", retryable: false },
  invalid_api_key: { status: 401, type: "authentication_error", retryable: false },
  not_found: { status: 404, type: "invalid_request_error", retryable: false },
  method_not_allowed: { status: 405, type: "invalid_request_error", retryable: false },
  payload_too_large: { status: 413, type: "invalid_request_error", retryable: false },
  rate_limit_exceeded: { status: 429, type: "requests", retryable: true },
  pool_exhausted: { status: 503, type: "server_error", retryable: true },
  server_busy: { status: 503, type: "server_error", retryable: true },
  queue_timeout: { status: 503, type: "server_error", retryable: true },
  not_ready: { status: 503, type: "server_error", retryable: true },
  node_unavailable: { status: 503, type: "server_error", retryable: true },
  aborted: { status: 499, type: "server_error", retryable: false },
  transfer_failed: { status: 503, type: "server_error", retryable: true },
  checksum_mismatch: { status: 500, type: "server_error", retryable: true },
  coverage_mismatch: { status: 500, type: "server_error", retryable: true },
  page_tag_mismatch: { status: 500, type: "server_error", retryable: true },
  layout_mismatch: { status: 500, type: "server_error", retryable: false },
  bad_model_folder: { status: 500, type: "server_error", retryable: false },
  unsupported_model: { status: 500, type: "server_error", retryable: false },
  config_invalid: { status: 500, type: "server_error", retryable: false },
  internal: { status: 500, type: "server_error", retryable: false },
} as const satisfies Record<string, { status: number; type: string; retryable: boolean }>;

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
