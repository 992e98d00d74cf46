/**
 * The engine's two doors for the disaggregated nodes: `submitPrefill` (compute a prompt into pages
 * a host leased, report the first token, leave the pages to the host) and `submitDecode` (continue
 * from a prompt whose KV arrived in host-leased pages). Together they must reproduce the local
 * engine's greedy output exactly, check page tags before every step, and never free host pages.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import {
  makeEngine,
  prompt,
  recorder,
  request,
  runAll,
  runUntilIdle,
  withSampling,
} from "../../testing/engine-harness.js";
import { PageState } from "../kvcache/ownership-table.js";
import type { Engine } from "./engine.js";

const P = 4;

function lease(engine: Engine, count: number, rid: number, epoch: number) {
  const pages = new Int32Array(count);
  const generations = new Uint32Array(count);
  assert.ok(engine.pool.table.allocate(count, rid, epoch, 0, pages, generations));
  return Array.from(pages, (page, i) => ({ page, generation: generations[i]! }));
}

/** Prefill on one engine, copy the pages into a decode engine's leased pages (a one-sided write), decode there. */
function disaggregated(promptTokens: number[], maxTokens: number, epoch: number) {
  const prefill = makeEngine({ pageSize: P });
  const decode = makeEngine({ pageSize: P });
  const promptPages = Math.ceil(promptTokens.length / P);
  const source = lease(prefill, promptPages, 7, epoch);
  const first = recorder();
  prefill.submitPrefill(request(7, promptTokens, 1), { epoch, pages: source }, first.events);
  runUntilIdle(prefill);
  assert.equal(first.outcome.tokens.length, 1);
  assert.equal(first.outcome.finish, "length");
  for (const s of source) {
    assert.equal(prefill.pool.table.state(s.page), PageState.READY, "prefill pages READY, still held");
    assert.equal(prefill.pool.table.writerRid(s.page), 7);
    assert.equal(prefill.pool.table.writerEpoch(s.page), epoch);
  }
  const total = Math.ceil((promptTokens.length + maxTokens - 1) / P);
  const dest = lease(decode, Math.max(total, promptPages), 7, epoch);
  const pf = prefill.pool.pageFloats;
  for (let i = 0; i < promptPages; i++) {
    decode.pool.data.set(
      prefill.pool.data.subarray(source[i]!.page * pf, (source[i]!.page + 1) * pf),
      dest[i]!.page * pf,
    );
    decode.pool.table.stampWriter(dest[i]!.page, 7, epoch, Math.min(P, promptTokens.length - i * P));
    decode.pool.table.markReady(dest[i]!.page, dest[i]!.generation, 7, epoch);
  }
  return { prefill, decode, source, dest, firstToken: first.outcome.tokens[0]! };
}

/** The host's part of a decode step (the decode state machine's `step`): stamp the page written. */
function stampStep(
  engine: Engine,
  dest: { page: number; generation: number }[],
  position: number,
  epoch: number,
) {
  const j = Math.floor(position / P);
  engine.pool.table.stampWriter(dest[j]!.page, 7, epoch, (position % P) + 1);
  if (position % P === 0) engine.pool.table.markReady(dest[j]!.page, dest[j]!.generation, 7, epoch);
}

for (const length of [1, 4, 9, 13]) {
  test(`Engine.submitPrefill + submitDecode reproduce the local engine's greedy output (prompt ${length})`, () => {
    const p = prompt(length, length);
    const maxTokens = 7;
    const [local] = runAll(makeEngine({ pageSize: P }), [request(7, p, maxTokens)]);
    const { decode, dest, firstToken, prefill, source } = disaggregated(p, maxTokens, 3);
    const out = recorder();
    let position = length;
    decode.submitDecode(request(7, Array(length).fill(0), maxTokens), { epoch: 3, pages: dest }, firstToken, {
      ...out.events,
      onTokens(ids) {
        stampStep(decode, dest, position++, 3);
        out.events.onTokens(ids);
      },
    });
    runUntilIdle(decode);
    assert.deepEqual([firstToken, ...out.outcome.tokens], local!.tokens);
    assert.equal(out.outcome.finish, "length");
    assert.deepEqual(out.outcome.usage, { promptTokens: length, completionTokens: maxTokens });
    // The engine never freed host pages: they are still leased (the host frees them).
    for (const d of dest) assert.notEqual(decode.pool.table.state(d.page), PageState.FREE);
    for (const s of source) assert.equal(prefill.pool.table.state(s.page), PageState.READY);
    assert.equal(decode.busy, false);
  });
}

test("Engine.submitPrefill + submitDecode reproduce seeded sampling of the local engine", () => {
  const p = prompt(6, 4);
  const sampled = withSampling({ temperature: 1.3, topP: 0.95, seed: 1234 });
  const [local] = runAll(makeEngine({ pageSize: P }), [request(7, p, 8, sampled)]);
  const prefill = makeEngine({ pageSize: P });
  const decode = makeEngine({ pageSize: P });
  const source = lease(prefill, 2, 7, 1);
  const first = recorder();
  prefill.submitPrefill(request(7, p, 1, sampled), { epoch: 1, pages: source }, first.events);
  runUntilIdle(prefill);
  const dest = lease(decode, 4, 7, 1);
  const pf = prefill.pool.pageFloats;
  for (let i = 0; i < 2; i++) {
    decode.pool.data.set(
      prefill.pool.data.subarray(source[i]!.page * pf, (source[i]!.page + 1) * pf),
      dest[i]!.page * pf,
    );
    decode.pool.table.stampWriter(dest[i]!.page, 7, 1, Math.min(P, 6 - i * P));
    decode.pool.table.markReady(dest[i]!.page, dest[i]!.generation, 7, 1);
  }
  const out = recorder();
  let position = 6;
  decode.submitDecode(
    request(7, Array(6).fill(0), 8, sampled),
    { epoch: 1, pages: dest },
    first.outcome.tokens[0]!,
    {
      ...out.events,
      onTokens(ids) {
        stampStep(decode, dest, position++, 1);
        out.events.onTokens(ids);
      },
    },
  );
  runUntilIdle(decode);
  assert.deepEqual([...first.outcome.tokens, ...out.outcome.tokens], local!.tokens);
});

test("Engine.submitDecode refuses to read a transferred page that is not the request's own", () => {
  const p = prompt(9, 2);
  const { decode, dest, firstToken } = disaggregated(p, 4, 1);
  // A page of the lease still holds another request's stamp (it was reserved but never written).
  decode.pool.table.stampWriter(dest[1]!.page, 99, 1, P);
  const out = recorder();
  decode.submitDecode(request(7, Array(9).fill(0), 4), { epoch: 1, pages: dest }, firstToken, out.events);
  runUntilIdle(decode);
  assert.equal(out.outcome.error?.code, "page_tag_mismatch");
  assert.deepEqual(out.outcome.tokens, []);
  assert.equal(decode.stats().counters.tagCheckFailures, 1);
  assert.notEqual(decode.pool.table.state(dest[0]!.page), PageState.FREE, "the host still owns the pages");
});

test("Engine.submitDecode with a wrong epoch fails the tag check instead of reading", () => {
  const p = prompt(5, 3);
  const { decode, dest, firstToken } = disaggregated(p, 3, 2);
  const out = recorder();
  decode.submitDecode(request(7, Array(5).fill(0), 3), { epoch: 1, pages: dest }, firstToken, out.events);
  runUntilIdle(decode);
  assert.equal(out.outcome.error?.code, "page_tag_mismatch");
});

test("Engine.abort of an external request leaves its host pages leased", () => {
  const engine = makeEngine({ pageSize: P, maxPrefillTokens: 2 });
  const pages = lease(engine, 3, 5, 0);
  const out = recorder();
  engine.submitPrefill(request(5, prompt(10, 1), 1), { epoch: 0, pages }, out.events);
  engine.step();
  engine.abort(5);
  assert.equal(engine.busy, false);
  for (const s of pages) assert.notEqual(engine.pool.table.state(s.page), PageState.FREE);
  assert.equal(out.outcome.finish, null);
});

test("Engine.submitDecode with the host's check asks the host before every step, instead of checking itself", () => {
  const p = prompt(9, 2);
  const { decode, dest, firstToken } = disaggregated(p, 4, 1);
  // A foreign stamp the engine's own check would refuse: with a host check, the host decides.
  decode.pool.table.stampWriter(dest[1]!.page, 99, 1, P);
  const asked: number[] = [];
  let position = 9;
  const out = recorder();
  const pages = {
    epoch: 1,
    pages: dest,
    checkStep: () => {
      asked.push(position);
      return true;
    },
  };
  decode.submitDecode(request(7, Array(9).fill(0), 4), pages, firstToken, {
    ...out.events,
    onTokens(ids) {
      stampStep(decode, dest, position++, 1);
      out.events.onTokens(ids);
    },
  });
  runUntilIdle(decode);
  assert.deepEqual(asked, [9, 10, 11], "once per step, before it");
  assert.equal(out.outcome.tokens.length, 3);
  assert.equal(decode.stats().counters.tagCheckFailures, 0, "the engine did not check too");
});

test("Engine.submitDecode drops a request whose host check failed, without an event, leaving its pages", () => {
  const p = prompt(9, 2);
  const { decode, dest, firstToken } = disaggregated(p, 4, 1);
  const out = recorder();
  let position = 9;
  const pages = { epoch: 1, pages: dest, checkStep: () => position < 10 };
  decode.submitDecode(request(7, Array(9).fill(0), 4), pages, firstToken, {
    ...out.events,
    onTokens(ids) {
      stampStep(decode, dest, position++, 1);
      out.events.onTokens(ids);
    },
  });
  runUntilIdle(decode);
  assert.equal(out.outcome.tokens.length, 1, "the step the host refused never ran");
  assert.equal(out.outcome.finish, null);
  assert.equal(out.outcome.error, null, "the host reports its own failure");
  assert.equal(decode.busy, false);
  assert.equal(decode.stats().counters.aborts, 0);
  for (const s of dest)
    assert.notEqual(decode.pool.table.state(s.page), PageState.FREE, "the host owns the pages");
});
