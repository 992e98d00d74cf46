/**
 * Reads a request body as JSON with a size limit: a declared `Content-Length` over the limit is
 * refused before any byte is read; a body that grows past it is refused as soon as it does. The
 * bytes must be valid UTF-8 (decoded with a fatal decoder, never replaced with U+FFFD). The body
 * must be declared as JSON first (`checkJsonContentType`, docs/api.md "Content-Type"). A request
 * answered before its body was read gets at most a bounded amount of it read (`boundUnreadBody`).
 */
import type { IncomingMessage, ServerResponse } from "node:http";
import { parse as parseContentType } from "content-type";
import { KvfenceError } from "../lib/errors.js";

const SEND_JSON = "send the body as JSON with the header Content-Type: application/json";

/**
 * Refuses (415 `unsupported_content_type`) a body not declared as `application/json` (any case,
 * parameters allowed; a charset, if given, must be utf-8). A missing Content-Type is refused too,
 * as vLLM and SGLang do: the `openai` clients always send application/json, and `curl -d` without
 * `-H` sends application/x-www-form-urlencoded, which would otherwise be read as JSON by luck.
 */
export function checkJsonContentType(header: string | undefined): void {
  if (header === undefined || header.trim() === "") {
    throw new KvfenceError("unsupported_content_type", `Missing Content-Type: ${SEND_JSON}`);
  }
  const shown = header.length > 100 ? `${header.slice(0, 100)}…` : header;
  let parsed: { type: string; parameters: Record<string, string | undefined> };
  try {
    parsed = parseContentType(header);
  } catch {
    throw new KvfenceError("unsupported_content_type", `Malformed Content-Type: ${shown}; ${SEND_JSON}`);
  }
  const { type, parameters } = parsed;
  if (type !== "application/json") {
    const curl =
      type === "application/x-www-form-urlencoded"
        ? ` (curl -d sends application/x-www-form-urlencoded: add -H "Content-Type: application/json")`
        : "";
    throw new KvfenceError(
      "unsupported_content_type",
      `Unsupported Content-Type: ${shown}; ${SEND_JSON}${curl}`,
    );
  }
  const charset = parameters.charset?.toLowerCase();
  if (charset !== undefined && charset !== "utf-8" && charset !== "utf8") {
    throw new KvfenceError(
      "unsupported_content_type",
      `Unsupported charset in Content-Type: ${shown}; send the JSON encoded as UTF-8, with charset=utf-8 or no charset`,
    );
  }
}

function tooLarge(limitBytes: number, got: number | string): KvfenceError {
  return new KvfenceError(
    "payload_too_large",
    `Request body is larger than the limit of ${limitBytes} bytes (the server's --max-body-bytes): ${got} bytes; shorten the prompt`,
  );
}

/** The raw body, or a `payload_too_large` error. */
export function readBody(req: IncomingMessage, limitBytes: number): Promise<Buffer> {
  const declared = req.headers["content-length"];
  if (declared !== undefined && Number(declared) > limitBytes) {
    return Promise.reject(tooLarge(limitBytes, declared));
  }
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let total = 0;
    let failed = false;
    req.on("data", (chunk: Buffer) => {
      if (failed) return;
      total += chunk.length;
      if (total > limitBytes) {
        failed = true;
        chunks.length = 0;
        reject(tooLarge(limitBytes, `more than ${limitBytes}`));
        return;
      }
      chunks.push(chunk);
    });
    req.on("end", () => {
      if (!failed) resolve(Buffer.concat(chunks, total));
    });
    req.on("error", (err) => {
      if (!failed) {
        failed = true;
        reject(err);
      }
    });
  });
}

/** Bytes of an unwanted body read and dropped after an early answer, before the connection closes. */
export const DISCARD_LIMIT_BYTES = 1024 * 1024;
const DISCARD_MS = 2000;

/**
 * For a request answered before its body was read (413, 415, 401, ...): once the answer is out, the
 * rest of the body is read and dropped up to `DISCARD_LIMIT_BYTES` or for 2 s, so that a client still
 * sending gets to read the answer; past either, the connection is closed. (Node alone would read any
 * amount to keep the connection; closing at once resets the connection under a client that is still
 * writing, which then loses the answer.)
 */
export function boundUnreadBody(req: IncomingMessage, res: ServerResponse): void {
  if (req.complete) return;
  res.once("finish", () => {
    if (req.complete || req.destroyed) return;
    let dropped = 0;
    const close = () => req.socket.destroy();
    const timer = setTimeout(close, DISCARD_MS);
    const done = () => clearTimeout(timer);
    req.on("data", (chunk: Buffer) => {
      dropped += chunk.length;
      if (dropped > DISCARD_LIMIT_BYTES) {
        done();
        close();
      }
    });
    req.once("end", done);
    req.once("close", done);
    req.resume();
  });
}

const utf8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: false });

/** Decode UTF-8 strictly and parse JSON; `invalid_request` / `invalid_json` on failure. */
export function parseJsonBody(body: Uint8Array): unknown {
  let text: string;
  try {
    text = utf8.decode(body);
  } catch {
    throw new KvfenceError(
      "invalid_request",
      "Request body is not valid UTF-8: send the JSON encoded as UTF-8",
    );
  }
  if (text.trim() === "") throw new KvfenceError("invalid_json", "Request body is empty: send a JSON object");
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new KvfenceError("invalid_json", `Request body is not valid JSON: ${(err as Error).message}`);
  }
}
