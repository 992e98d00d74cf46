/**
 * JSON encoding of control messages (the protocol's wire types, plain JSON-able data) for the TCP
 * transport. Decoding checks only the envelope — an object with a string `type` — and leaves the
 * per-type checks to the protocol machines, which ignore and count what they do not expect.
 */
import { KvfenceError } from "../lib/errors.js";
import type { ControlMessage } from "./transport.js";

export function encodeControl(message: ControlMessage | Readonly<Record<string, unknown>>): Buffer {
  return Buffer.from(JSON.stringify(message), "utf8");
}

/** Parses a JSON object; throws `transfer_failed` on bad JSON or a non-object. */
export function decodeJsonObject(bytes: Uint8Array): Record<string, unknown> {
  const text = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString("utf8");
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch (cause) {
    throw new KvfenceError("transfer_failed", `Control message is not valid JSON: ${text.slice(0, 80)}`, {
      cause,
    });
  }
  if (value === null || typeof value !== "object" || Array.isArray(value)) {
    throw new KvfenceError("transfer_failed", `Control message must be a JSON object: ${text.slice(0, 80)}`);
  }
  return value as Record<string, unknown>;
}

/** Parses a control message: a JSON object with a string `type`. */
export function decodeControl(bytes: Uint8Array): ControlMessage {
  const value = decodeJsonObject(bytes);
  if (typeof value.type !== "string") {
    throw new KvfenceError(
      "transfer_failed",
      `Control message has no string type: ${JSON.stringify(value).slice(0, 80)}`,
    );
  }
  return value as unknown as ControlMessage;
}
