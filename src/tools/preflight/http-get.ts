/**
 * Minimal GET helper for the preflight readers: one request, a timeout, and a typed outcome so a
 * missing endpoint (404) can fall back to an older path while an unreachable host is an error.
 */
import { KvfenceError } from "../../lib/errors.js";

export type GetResult =
  | { ok: true; status: number; text: string }
  | { ok: false; status: number; text: string };

/** GET `url`; resolves for any HTTP status, throws `node_unavailable` when the host cannot be reached. */
export async function httpGet(
  url: string,
  options: { timeoutMs: number; apiKey?: string },
): Promise<GetResult> {
  const headers: Record<string, string> = { accept: "application/json, text/plain" };
  if (options.apiKey !== undefined) headers.authorization = `Bearer ${options.apiKey}`;
  let res: Response;
  try {
    res = await fetch(url, { headers, signal: AbortSignal.timeout(options.timeoutMs) });
  } catch (err) {
    throw new KvfenceError(
      "node_unavailable",
      `Cannot reach the server, check the URL and that it runs: ${url}`,
      {
        cause: err,
      },
    );
  }
  const text = await res.text();
  return { ok: res.ok, status: res.status, text };
}

/** Parse JSON from a response body, naming the URL when it is not JSON. */
export function parseJsonBody(text: string, url: string): unknown {
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new KvfenceError("invalid_json", `The server did not answer with JSON, check the URL: ${url}`, {
      cause: err,
    });
  }
}
