/**
 * Answers the requests Node's HTTP parser refuses before the router sees them (a request target
 * with bytes over 0x7F, a malformed request line or header, headers over the size limit, a client
 * too slow to send its headers). Node's own answer is a bare status line; this one carries the
 * OpenAI error envelope like every other 4xx (docs/errors.md), then closes the connection, whose
 * byte stream can no longer be trusted.
 */
import { STATUS_CODES } from "node:http";
import type { Duplex } from "node:stream";
import { KvfenceError, toOpenAiError } from "../lib/errors.js";

function errorFor(err: Error & { code?: string }): KvfenceError {
  switch (err.code) {
    case "HPE_HEADER_OVERFLOW":
      return new KvfenceError(
        "headers_too_large",
        "The request headers are larger than the server's limit: send fewer or shorter headers",
      );
    case "HPE_CHUNK_EXTENSIONS_OVERFLOW":
      return new KvfenceError(
        "payload_too_large",
        "The chunk extensions of the request body are too large: send the body without chunk extensions",
      );
    case "ERR_HTTP_REQUEST_TIMEOUT":
      return new KvfenceError(
        "request_timeout",
        "The request was not received in time: send it again, faster",
      );
    default:
      return new KvfenceError(
        "invalid_request",
        `The HTTP request is malformed (${err.code ?? "parse error"}): send a valid HTTP/1.1 request; a path must be ASCII, percent-encode other bytes`,
      );
  }
}

/**
 * The server's `clientError` listener. It answers only when no response is pending on the
 * connection (a keep-alive connection may have carried others before): with one pending (a
 * pipelined request before the bad one), the client would take our answer for that one's, so the
 * connection is just closed.
 */
export function answerClientError(err: Error & { code?: string; rawPacket?: unknown }, socket: Duplex): void {
  const pending = (socket as Duplex & { _httpMessage?: unknown })._httpMessage;
  if (err.code === "ECONNRESET" || !socket.writable || (pending !== undefined && pending !== null)) {
    socket.destroy();
    return;
  }
  const { status, body } = toOpenAiError(errorFor(err));
  const text = JSON.stringify(body);
  // The answer to HEAD has no body (a client would read it as the start of the next response).
  const raw = err.rawPacket;
  const head = Buffer.isBuffer(raw) && raw.subarray(0, 5).toString("latin1") === "HEAD ";
  socket.end(
    `HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\n` +
      "Content-Type: application/json; charset=utf-8\r\n" +
      `Content-Length: ${Buffer.byteLength(text)}\r\n` +
      "Connection: close\r\n\r\n" +
      (head ? "" : text),
  );
}
