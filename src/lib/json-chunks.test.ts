import assert from "node:assert/strict";
import { test } from "node:test";
import {
  ArrayConcat,
  JSON_CHUNK_CHARS,
  jsonChunks,
  jsonText,
  LazyArray,
  SharedArray,
} from "./json-chunks.js";

/** Values of every kind JSON.stringify handles the way the chunker must. */
function samples(): unknown[] {
  const big = Array.from({ length: 3000 }, (_, i) => ({
    token: `t\u0000"${i}é😀`,
    logprob: -i / 7,
    top: { [`k${i}`]: { rank: i, nested: [i, null, "x"] }, plain: 1 },
  }));
  return [
    null,
    0,
    -0,
    1e21,
    -1.7976931348623157e308,
    Number.NaN,
    Number.POSITIVE_INFINITY,
    "",
    'quote " backslash \\ newline \n control \u0001 lone surrogate \ud800 emoji 😀',
    true,
    [],
    {},
    [undefined, () => 1, null, [[[]]]],
    { a: undefined, b: () => 1, c: [1, { d: undefined }], 'key "with" quotes': 2 },
    { toJSON: () => ({ replaced: true }) },
    new Date(0),
    Array.from({ length: 1000 }, (_, i) => i),
    Object.fromEntries(Array.from({ length: 300 }, (_, i) => [`key${i}`, i])),
    { choices: big, usage: { prompt_tokens: 1 } },
  ];
}

test("jsonChunks() yields exactly JSON.stringify's text", () => {
  for (const value of samples())
    assert.equal(jsonText(value), JSON.stringify(value), JSON.stringify(value)?.slice(0, 80));
});

test("jsonChunks() yields chunks of about its chunk size", () => {
  const value = { list: Array.from({ length: 20_000 }, (_, i) => ({ i, s: "x".repeat(i % 50) })) };
  const chunks = Array.from(jsonChunks(value, 4096));
  assert.ok(chunks.length > 100, `${chunks.length} chunks`);
  for (const chunk of chunks.slice(0, -1)) {
    assert.ok(chunk.length >= 4096 && chunk.length < 2 * 4096 + 200, `a chunk of ${chunk.length}`);
  }
  assert.ok(JSON_CHUNK_CHARS >= 4096);
});

test("jsonChunks() makes a LazyArray's items as it serialises them, a chunk's worth per step", () => {
  let made = 0;
  const lazy = new LazyArray(10_000, (i) => {
    made++;
    return { i, name: `item ${i}` };
  });
  const steps = jsonChunks({ lazy }, 1024);
  steps.next();
  assert.ok(made > 0 && made < 200, `${made} items made for the first chunk`);
  const rest = Array.from(steps);
  assert.equal(made, 10_000);
  assert.ok(rest.length > 100);
  assert.equal(
    jsonText({ lazy }),
    JSON.stringify({ lazy: Array.from({ length: 10_000 }, (_, i) => ({ i, name: `item ${i}` })) }),
  );
});

test("jsonChunks() serialises a SharedArray once however many places hold it", () => {
  let made = 0;
  const items = Array.from({ length: 2000 }, (_, i) => ({ position: i, top: { a: -i } }));
  const shared = new SharedArray(items.length, (i) => {
    made++;
    return items[i];
  });
  const value = { choices: Array.from({ length: 64 }, (_, index) => ({ index, prompt: shared })) };
  const text = jsonText(value);
  assert.equal(made, 2000);
  assert.equal(
    text,
    JSON.stringify({ choices: value.choices.map(({ index }) => ({ index, prompt: items })) }),
  );
  // Its text is kept for the next answer that holds it too.
  assert.equal(jsonText([shared]), JSON.stringify([items]));
  assert.equal(made, 2000);
  assert.equal(jsonText(SharedArray.of([1, 2])), "[1,2]");
});

test("jsonChunks() writes an ArrayConcat as one array, skipping empty parts", () => {
  const shared = SharedArray.of(["a", { b: 1 }]);
  const lazy = new LazyArray(2, (i) => i * 10);
  assert.equal(
    jsonText(new ArrayConcat([shared, [], lazy, [null]])),
    JSON.stringify(["a", { b: 1 }, 0, 10, null]),
  );
  assert.equal(jsonText(new ArrayConcat([[], SharedArray.of([])])), "[]");
  assert.equal(jsonText({ x: new ArrayConcat([[1], shared]) }), '{"x":[1,"a",{"b":1}]}');
});
