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
  unsupported_content_type: { status: 415, type: "invalid_request_error", retryable: false },
  headers_too_large: { status: 431, type: "invalid_request_error", retryable: false },
  request_timeout: { status: 408, type: "invalid_request_error", retryable: false },
  pool_exhausted: { status: 503, type: "server_error", retryable: true },
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
}

export class KvfenceError extends Error {
  override readonly name = "KvfenceError";
  readonly code: ErrorCode;
  readonly param: string | undefined;

  constructor(code: ErrorCode, message: string, options?: { param?: string; cause?: unknown }) {
    super(message, options?.cause === undefined ? undefined : { cause: options.cause });
    this.code = code;
    this.param = options?.param;
  }

  get status(): number {
    return ERROR_TABLE[this.code].status;
  }

  get retryable(): boolean {
    return ERROR_TABLE[this.code].retryable;
  }

  toWire(): WireError {
    return this.param === undefined
      ? { code: this.code, message: this.message }
      : { code: this.code, message: this.message, param: this.param };
  }

  static fromWire(wire: WireError): KvfenceError {
    return new KvfenceError(wire.code, wire.message, wire.param === undefined ? {} : { param: wire.param });
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
