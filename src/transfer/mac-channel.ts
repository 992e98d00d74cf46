/**
 * The MACs of the TCP transfer link's control frames (tcp-transport.ts): each HELLO, PROOF, CONTROL,
 * LEASE_END and REFUSE frame ends with an HMAC-SHA256 over its header and payload (and, for the
 * handshake's frames, a context or the transcript as `prefix`) under the sending direction's key.
 * The header's index is a per-direction sequence number, so a frame cannot be altered, replayed,
 * reordered or moved to another connection. Before the handshake both keys are the cluster secret;
 * the handshake sets the session keys (control-auth.ts).
 */
import { hmac, MAC_BYTES, verifyHmac } from "./control-auth.js";
import { type FrameHeader, type FrameType, frameHeaderBytes } from "./frame-codec.js";

/** MACs and sequence numbers of the control frames of one connection. */
export class MacChannel {
  sendKey: Buffer;
  recvKey: Buffer;
  #sendSeq = 0;
  #recvSeq = 0;

  constructor(key: Buffer) {
    this.sendKey = key;
    this.recvKey = key;
  }

  /** Header + payload + MAC of a control-type frame, as one buffer. */
  frame(
    type: FrameType,
    rid: number,
    epoch: number,
    tokens: number,
    payload: Uint8Array,
    prefix?: Buffer,
  ): Buffer {
    const header: FrameHeader = {
      type,
      rid,
      epoch,
      page: 0,
      generation: 0,
      index: this.#sendSeq++ >>> 0,
      tokens,
      length: payload.length + MAC_BYTES,
    };
    const headerBytes = frameHeaderBytes(header);
    const mac =
      prefix === undefined
        ? hmac(this.sendKey, headerBytes, payload)
        : hmac(this.sendKey, prefix, headerBytes, payload);
    return Buffer.concat([headerBytes, payload, mac]);
  }

  /** The payload of a MACed frame, or null when the MAC or the sequence number is wrong. */
  open(header: FrameHeader, body: Uint8Array, prefix?: Buffer): Uint8Array | null {
    if (body.length < MAC_BYTES || header.index !== this.#recvSeq >>> 0) return null;
    const headerBytes = frameHeaderBytes(header);
    const payload = body.subarray(0, body.length - MAC_BYTES);
    const mac = body.subarray(body.length - MAC_BYTES);
    const ok =
      prefix === undefined
        ? verifyHmac(this.recvKey, mac, headerBytes, payload)
        : verifyHmac(this.recvKey, mac, prefix, headerBytes, payload);
    if (!ok) return null;
    this.#recvSeq++;
    return payload;
  }
}
