/**
 * JSON encoding of control messages for the TCP transport, with bigint values (page checksums)
 * carried as `{"$bigint": "<decimal>"}`.
 */
import { KvfenceError } from "../lib/errors.js";
import type { ControlMessage } from "./transport.js";

export function encodeControl(message: ControlMessage): Buffer {
  return Buffer.from(
    JSON.stringify(message, (_key, value: unknown) =>
      typeof value === "bigint" ? { $bigint: value.toString() } : value,
    ),
    "utf8",
  );
}

export function decodeControl(bytes: Uint8Array): ControlMessage {
  const text = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString("utf8");
  let value: unknown;
  try {
    value = JSON.parse(text, (_key, v: unknown) => {
      if (v !== null && typeof v === "object" && !Array.isArray(v)) {
        const big = (v as { $bigint?: unknown }).$bigint;
        if (typeof big === "string" && Object.keys(v).length === 1) return BigInt(big);
      }
      return v;
    });
  } catch (cause) {
    throw new KvfenceError("transfer_failed", `Control message is not valid JSON: ${text.slice(0, 80)}`, {
      cause,
    });
  }
  if (value === null || typeof value !== "object" || Array.isArray(value)) {
    throw new KvfenceError("transfer_failed", `Control message must be a JSON object: ${text.slice(0, 80)}`);
  }
  return value as ControlMessage;
}
