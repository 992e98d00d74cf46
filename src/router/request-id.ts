/**
 * The id of one HTTP request, carried into the engine and the nodes (`GenerationRequest.trace`),
 * every log line about the request and its spans: the `x-request-id` the response already carries
 * (set by the front door), else a well-formed one the client sent (a proxy's), else a fresh UUID.
 */
import { randomUUID } from "node:crypto";
import type { IncomingMessage, ServerResponse } from "node:http";

/** What a client may choose as its request id: 1–128 visible ASCII characters. */
const CLIENT_ID_RE = /^[\x21-\x7e]{1,128}$/;

export function requestIdOf(req: IncomingMessage, res: ServerResponse): string {
  const set = res.getHeader("x-request-id");
  if (typeof set === "string" && set !== "") return set;
  const sent = req.headers["x-request-id"];
  if (typeof sent === "string" && CLIENT_ID_RE.test(sent)) return sent;
  return randomUUID();
}
