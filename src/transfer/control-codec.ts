/**
 * JSON encoding of control messages (the protocol's wire types, plain JSON-able data) for the TCP
 * transport. Decoding checks only the envelope — an object with a string `type` — and leaves the
 * per-type checks to the protocol machines, which ignore and count what they do not expect.
 *
 * The router's control links (src/links/control-link.ts) also carry a prompt's token ids, an
 * `Int32Array` at both ends: `stringifyWithInt32Arrays` writes each one as `{"$i32": base64 of its
 * little-endian bytes}` and `parseWithInt32Arrays` turns that back into an `Int32Array`, so code on
 * either side of the link never sees the array in any other form.
 */
import { endianness } from "node:os";
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

/** The key of an `Int32Array` on a control link: `{"$i32": base64}`. */
const INT32_TAG = "$i32";
const INT32_MARK = `"${INT32_TAG}"`;
const BIG_ENDIAN = endianness() === "BE";

/** `message` as JSON, each `Int32Array` in it as `{"$i32": base64 of its little-endian bytes}`. */
export function stringifyWithInt32Arrays(message: unknown): string {
  return JSON.stringify(message, int32ToTagged);
}

/**
 * Parses JSON written by `stringifyWithInt32Arrays` (or plain JSON), each `{"$i32": base64}` back
 * into an `Int32Array`; throws `transfer_failed` on one whose bytes are not whole int32s.
 */
export function parseWithInt32Arrays(text: string): unknown {
  // Only a message that holds one pays for the reviver.
  return text.includes(INT32_MARK) ? JSON.parse(text, taggedToInt32) : JSON.parse(text);
}

function int32ToTagged(_key: string, value: unknown): unknown {
  if (!(value instanceof Int32Array)) return value;
  const bytes = Buffer.from(value.buffer, value.byteOffset, value.byteLength);
  return { [INT32_TAG]: (BIG_ENDIAN ? Buffer.from(bytes).swap32() : bytes).toString("base64") };
}

function taggedToInt32(_key: string, value: unknown): unknown {
  if (value === null || typeof value !== "object" || Array.isArray(value)) return value;
  const base64 = (value as Record<string, unknown>)[INT32_TAG];
  if (typeof base64 !== "string" || Object.keys(value).length !== 1) return value;
  const bytes = Buffer.from(base64, "base64");
  if (bytes.length % 4 !== 0) {
    throw new KvfenceError(
      "transfer_failed",
      `Control message holds an Int32Array whose byte length is not a multiple of 4: ${bytes.length}`,
    );
  }
  const out = new Int32Array(bytes.length / 4);
  const view = Buffer.from(out.buffer);
  view.set(bytes);
  if (BIG_ENDIAN) view.swap32();
  return out;
}
