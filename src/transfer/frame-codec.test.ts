import assert from "node:assert/strict";
import { test } from "node:test";
import fc from "fast-check";
import type { KvfenceError } from "../lib/errors.js";
import {
  DROP_BODY,
  encodeFrameHeader,
  FRAME_HEADER_BYTES,
  FrameDecoder,
  type FrameHeader,
  FrameType,
} from "./frame-codec.js";

interface Decoded {
  header: FrameHeader;
  body: number[];
}

const MAX_PAGE = 64;

function encodeStream(frames: readonly Decoded[]): Uint8Array {
  const total = frames.reduce((n, f) => n + FRAME_HEADER_BYTES + f.body.length, 0);
  const out = new Uint8Array(total);
  let at = 0;
  for (const f of frames) {
    encodeFrameHeader(out, at, f.header);
    at += FRAME_HEADER_BYTES;
    out.set(f.body, at);
    at += f.body.length;
  }
  return out;
}

/** Decodes `stream` split at `cuts`; PAGE bodies land in fresh destinations, dropped when `drop` says. */
function decode(stream: Uint8Array, cuts: readonly number[], drop = (_h: FrameHeader) => false) {
  const frames: Decoded[] = [];
  const errors: KvfenceError[] = [];
  const decoder = new FrameDecoder(
    {
      onHeader: (h) => {
        if (h.type !== FrameType.PAGE) return undefined;
        return drop(h) ? DROP_BODY : new Uint8Array(h.length);
      },
      onFrame: (h, body) => frames.push({ header: { ...h }, body: Array.from(body) }),
      onError: (e) => errors.push(e),
    },
    { maxPageBytes: MAX_PAGE, maxControlBytes: 48 },
  );
  const points = [...new Set(cuts.map((c) => c % (stream.length + 1)))].sort((a, b) => a - b);
  let prev = 0;
  for (const p of [...points, stream.length]) {
    // Copy each chunk into a reused buffer, as an `onread` receiver does.
    const chunk = new Uint8Array(stream.subarray(prev, p));
    decoder.push(chunk);
    chunk.fill(0xee);
    prev = p;
  }
  return { frames, errors, decoder };
}

const u32 = fc.integer({ min: 0, max: 0xffffffff });
const frameArb: fc.Arbitrary<Decoded> = fc
  .record({
    type: fc.constantFrom(FrameType.PAGE, FrameType.CONTROL, FrameType.LEASE_END, FrameType.HELLO),
    rid: u32,
    epoch: u32,
    page: u32,
    generation: u32,
    index: u32,
    tokens: u32,
    body: fc.uint8Array({ maxLength: 48 }),
  })
  .map(({ body, ...h }) => ({
    header: { ...h, length: body.length } as FrameHeader,
    body: Array.from(body),
  }));

test("FrameDecoder decodes any split of the stream into the same frames", () => {
  fc.assert(
    fc.property(
      fc.array(frameArb, { maxLength: 12 }),
      fc.array(fc.nat(), { maxLength: 20 }),
      (frames, cuts) => {
        const stream = encodeStream(frames);
        const whole = decode(stream, []);
        const split = decode(stream, cuts);
        assert.deepEqual(whole.errors, []);
        assert.deepEqual(split.errors, []);
        assert.deepEqual(split.frames, frames);
        assert.deepEqual(whole.frames, frames);
        assert.equal(split.decoder.idle, true);
      },
    ),
  );
});

test("FrameDecoder skips a dropped page body and keeps the frames after it aligned", () => {
  fc.assert(
    fc.property(
      fc.array(frameArb, { maxLength: 10 }),
      fc.array(fc.nat(), { maxLength: 10 }),
      (frames, cuts) => {
        const stream = encodeStream(frames);
        const { frames: out, errors } = decode(stream, cuts, (h) => h.page % 2 === 1);
        assert.deepEqual(errors, []);
        const expected = frames.map((f) =>
          f.header.type === FrameType.PAGE && f.header.page % 2 === 1 ? { header: f.header, body: [] } : f,
        );
        assert.deepEqual(out, expected);
      },
    ),
  );
});

test("FrameDecoder rejects an oversized length once, after the frames before it", () => {
  fc.assert(
    fc.property(
      fc.array(frameArb, { maxLength: 6 }),
      fc.constantFrom(FrameType.PAGE, FrameType.CONTROL),
      fc.integer({ min: 1, max: 0xffffffff }),
      fc.array(frameArb, { maxLength: 3 }),
      fc.array(fc.nat(), { maxLength: 10 }),
      (before, type, excess, after, cuts) => {
        const limit = type === FrameType.PAGE ? MAX_PAGE : 48;
        const length = Math.min(limit + excess, 0xffffffff);
        const bad: Decoded = {
          header: { type, rid: 1, epoch: 1, page: 0, generation: 0, index: 0, tokens: 0, length },
          body: [],
        };
        const stream = encodeStream([...before, bad, ...after]);
        const { frames, errors, decoder } = decode(stream, cuts);
        assert.deepEqual(frames, before);
        assert.equal(errors.length, 1);
        assert.match(errors[0]!.message, /longer than the limit/);
        assert.equal(errors[0]!.code, "transfer_failed");
        assert.equal(decoder.failed, true);
      },
    ),
  );
});

test("FrameDecoder rejects a bad magic, version or type cleanly", () => {
  for (const [offset, value, pattern] of [
    [0, 0x00, /magic/],
    [2, 9, /version/],
    [3, 0, /type/],
    [3, 77, /type/],
  ] as const) {
    const stream = encodeStream([
      {
        header: {
          type: FrameType.CONTROL,
          rid: 0,
          epoch: 0,
          page: 0,
          generation: 0,
          index: 0,
          tokens: 0,
          length: 0,
        },
        body: [],
      },
    ]);
    stream[offset] = value;
    const { frames, errors } = decode(stream, [5]);
    assert.deepEqual(frames, []);
    assert.equal(errors.length, 1);
    assert.match(errors[0]!.message, pattern);
  }
});

test("FrameDecoder never throws on arbitrary bytes and reports at most one error", () => {
  fc.assert(
    fc.property(fc.uint8Array({ maxLength: 400 }), fc.array(fc.nat(), { maxLength: 10 }), (bytes, cuts) => {
      const { errors } = decode(bytes, cuts);
      assert.ok(errors.length <= 1);
    }),
  );
});
