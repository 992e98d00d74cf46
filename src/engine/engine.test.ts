import assert from "node:assert/strict";
import { test } from "node:test";
import fc from "fast-check";
import {
  makeEngine,
  prompt,
  recorder,
  request,
  runAll,
  runUntilIdle,
  testModel,
  withSampling,
} from "../../testing/engine-harness.js";
import { naiveForward } from "../../testing/random-model.js";
import { PageState } from "../kvcache/ownership-table.js";
import { PagePool } from "../kvcache/page-pool.js";
import { ForwardPass, type StepSequence } from "../model/forward.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { makeSafety } from "../protocol/safety.js";
import { Engine } from "./engine.js";
import { StepCost } from "./step-cost.js";

/** Prompts of assorted lengths, crossing page boundaries (pageSize 4 in these tests). */
const PROMPTS = [prompt(5, 1), prompt(13, 2), prompt(1, 3), prompt(8, 4), prompt(22, 5)];

function greedyRequests(maxTokens = 10, ridBase = 1): GenerationRequest[] {
  return PROMPTS.map((p, i) => request(ridBase + i, p, maxTokens));
}

function assertIdle(engine: Engine): void {
  const s = engine.stats();
  assert.deepEqual(s.pages, {
    free: s.pages.total,
    reserved: 0,
    ready: 0,
    quarantined: 0,
    total: s.pages.total,
  });
  assert.deepEqual(s.queue, { waiting: 0, running: 0, preempted: 0 });
}

/** Each prompt alone in a fresh, roomy engine: the reference output. */
function aloneOutputs(requests: readonly GenerationRequest[]): number[][] {
  return requests.map((r) => {
    const [o] = runAll(makeEngine(), [r]);
    assert.equal(o!.finish, "length");
    return o!.tokens;
  });
}

test("Engine greedy output of one request matches a naive dense forward pass", () => {
  const { config, weights } = testModel();
  const p = PROMPTS[1]!;
  const [o] = runAll(makeEngine(), [request(1, p, 6)]);
  const tokens = [...p];
  for (let i = 0; i < 6; i++) {
    const logits = naiveForward(config, weights, tokens).at(-1)!;
    let best = 0;
    for (let v = 1; v < logits.length; v++) if (logits[v]! > logits[best]!) best = v;
    tokens.push(best);
  }
  assert.deepEqual(o!.tokens, tokens.slice(p.length));
});

test("Engine batched greedy output equals single-request output", () => {
  const requests = greedyRequests();
  const alone = aloneOutputs(requests);
  const engine = makeEngine();
  const outcomes = runAll(engine, requests);
  assert.deepEqual(
    outcomes.map((o) => o.tokens),
    alone,
  );
  for (const o of outcomes) {
    assert.equal(o.finish, "length");
    assert.equal(o.lateEvents, 0);
  }
  assertIdle(engine);
  assert.equal(engine.stats().counters.completionTokens, 50);
});

test("Engine chunked prefill equals one-chunk prefill", () => {
  const requests = greedyRequests(6);
  const whole = runAll(makeEngine({ maxPrefillTokens: 64 }), requests).map((o) => o.tokens);
  for (const maxPrefillTokens of [1, 3, 4, 7]) {
    const engine = makeEngine({ maxPrefillTokens });
    const chunked = runAll(engine, requests).map((o) => o.tokens);
    assert.deepEqual(chunked, whole, `maxPrefillTokens ${maxPrefillTokens}`);
    assertIdle(engine);
  }
});

test("Engine preemption under a tiny pool gives the same output as without", () => {
  const requests = greedyRequests(12);
  const roomy = runAll(makeEngine(), requests).map((o) => o.tokens);
  // 9 pages of 4 tokens: the longest request (22 + 12) just fits alone, never all at once.
  const engine = makeEngine({ numPages: 9 });
  const outcomes = runAll(engine, requests);
  assert.deepEqual(
    outcomes.map((o) => o.tokens),
    roomy,
  );
  assert.ok(engine.stats().counters.preemptions > 0, "the tiny pool must force preemptions");
  for (const o of outcomes) assert.equal(o.finish, "length");
  assertIdle(engine);
});

test("Engine seeded sampling is reproducible alone, batched and preempted", () => {
  const sampled = PROMPTS.map((p, i) =>
    request(i + 1, p, 12, withSampling({ temperature: 1, topP: 0.9, topK: 20, seed: 1000 + i })),
  );
  const alone = aloneOutputs(sampled);
  assert.deepEqual(
    runAll(makeEngine(), sampled).map((o) => o.tokens),
    alone,
  );
  const tiny = makeEngine({ numPages: 9, maxPrefillTokens: 5 });
  assert.deepEqual(
    runAll(tiny, sampled).map((o) => o.tokens),
    alone,
  );
  assert.ok(tiny.stats().counters.preemptions > 0);
  const reseeded = runAll(makeEngine(), [
    { ...sampled[4]!, sampling: { ...sampled[4]!.sampling, seed: 7 } },
  ])[0]!.tokens;
  assert.notDeepEqual(reseeded, alone[4], "a different seed samples differently");
});

test("Engine aborting at every point frees the request's pages exactly once", () => {
  const requests = greedyRequests(8);
  const reference = runAll(makeEngine({ maxPrefillTokens: 4 }), requests).map((o) => o.tokens);
  const seen = new Set<string>();
  for (let victim = 0; victim < requests.length; victim++) {
    for (let abortAfter = 0; abortAfter < 16; abortAfter++) {
      const engine = makeEngine({ maxPrefillTokens: 4, numPages: 14 });
      const recs = requests.map((r) => {
        const rec = recorder();
        engine.submit(r, rec.events);
        return rec.outcome;
      });
      for (let s = 0; s < abortAfter; s++) engine.step();
      const rid = requests[victim]!.rid;
      const live = engine.liveBlockTables().find((t) => t.rid === rid);
      if (live === undefined) seen.add(recs[victim]!.finish === null ? "waiting" : "finished");
      else seen.add(live.computed < requests[victim]!.promptTokens.length ? "prefill" : "decode");
      if (engine.stats().queue.preempted > 0) seen.add("with a preempted request queued");
      const before = engine.stats().pages;
      engine.abort(rid);
      engine.abort(rid); // idempotent
      const after = engine.stats().pages;
      assert.equal(after.free + after.reserved + after.ready, after.total);
      if (recs[victim]!.finish === null) {
        assert.ok(after.free >= before.free, "abort only frees");
        assert.equal(engine.stats().counters.aborts, 1);
      }
      const tokensAtAbort = recs[victim]!.tokens.length;
      runUntilIdle(engine);
      assertIdle(engine);
      assert.equal(recs[victim]!.tokens.length, tokensAtAbort, "no tokens after abort");
      assert.equal(recs[victim]!.error, null);
      assert.deepEqual(recs[victim]!.tokens, reference[victim]!.slice(0, tokensAtAbort));
      recs.forEach((o, i) => {
        assert.equal(o.lateEvents, 0);
        if (i !== victim)
          assert.deepEqual(o.tokens, reference[i], `request ${i} after aborting ${victim} at ${abortAfter}`);
      });
      // Every page went through whole allocate/free pairs: its generation is even.
      for (let p = 0; p < engine.pool.numPages; p++)
        assert.equal(engine.pool.table.generation(p) % 2, 0, `page ${p}`);
    }
  }
});

test("Engine refuses a request over the context at the door, allocating nothing", () => {
  const engine = makeEngine({ numPages: 10, pageSize: 4 }); // 40 tokens, window 256
  assert.equal(engine.contextTokens, 40);
  const rec = recorder();
  engine.submit(request(1, prompt(30, 1), 11), rec.events);
  assert.equal(rec.outcome.error?.code, "context_length_exceeded");
  assert.match(rec.outcome.error!.message, /40 tokens/);
  assert.match(rec.outcome.error!.message, /30 prompt tokens plus 11 max_tokens: 41/);
  assertIdle(engine);
  assert.equal(engine.step(), false);
  const ok = recorder();
  engine.submit(request(2, prompt(30, 1), 10), ok.events);
  runUntilIdle(engine);
  assert.equal(ok.outcome.finish, "length");
  assert.equal(ok.outcome.tokens.length, 10);
});

test("Engine refuses bad requests: duplicate rid, empty prompt, token out of vocabulary, zero max_tokens, bad sampling", () => {
  const engine = makeEngine();
  const first = recorder();
  engine.submit(request(1, [1, 2], 2), first.events);
  const cases: GenerationRequest[] = [
    request(1, [3], 2),
    request(2, [], 2),
    request(3, [1, 64], 2),
    request(4, [1], 0),
    request(5, [1], 2, withSampling({ temperature: -1 })),
    request(6, [1], 2, withSampling({ topP: 0 })),
  ];
  for (const r of cases) {
    const rec = recorder();
    engine.submit(r, rec.events);
    assert.equal(rec.outcome.error?.code, "invalid_request", `rid ${r.rid}`);
  }
  runUntilIdle(engine);
  assert.equal(first.outcome.finish, "length");
  assertIdle(engine);
});

test("Engine finishes with stop on a stop token id, counted and named in usage but not reported", () => {
  const p = PROMPTS[3]!;
  const [free] = runAll(makeEngine(), [request(1, p, 10)]);
  const stopAt = free!.tokens.findIndex((t, i) => i >= 2 && free!.tokens.indexOf(t) === i);
  assert.ok(stopAt >= 2, "need a token that first appears at index 2 or later");
  const stopId = free!.tokens[stopAt]!;
  const [o] = runAll(makeEngine(), [request(1, p, 10, withSampling({ stopTokenIds: [stopId] }))]);
  assert.equal(o!.finish, "stop");
  assert.deepEqual(o!.tokens, free!.tokens.slice(0, stopAt));
  // The finish names the stop token (SGLang's matched_stop, issue #34).
  assert.deepEqual(o!.usage, { promptTokens: p.length, completionTokens: stopAt + 1, stopTokenId: stopId });
});

test("Engine tag check fails a request whose page carries another request's stamp; the rest go on", () => {
  for (const tagCheck of [true, false]) {
    const requests = greedyRequests(10);
    const alone = aloneOutputs(requests);
    const engine = makeEngine(tagCheck ? {} : { safety: makeSafety({ disabledGuards: ["page-tags"] }) });
    const recs = requests.map((r) => {
      const rec = recorder();
      engine.submit(r, rec.events);
      return rec.outcome;
    });
    for (let s = 0; s < 4; s++) engine.step();
    // Tamper: request 2's first page now claims to hold request 5's data.
    const table = engine.pool.table;
    const victimRid = requests[1]!.rid;
    let page = -1;
    for (let p = 0; p < engine.pool.numPages; p++) {
      if (table.owner(p) === victimRid && table.state(p) === PageState.READY) {
        page = p;
        break;
      }
    }
    assert.ok(page >= 0);
    table.stampWriter(page, requests[4]!.rid, 0, table.filledTokens(page));
    runUntilIdle(engine);
    if (tagCheck) {
      assert.equal(recs[1]!.error?.code, "page_tag_mismatch");
      assert.match(recs[1]!.error!.message, /writer 5\/0/);
      assert.equal(recs[1]!.finish, null);
      assert.equal(engine.stats().counters.tagCheckFailures, 1);
    } else {
      // Without the guard the request silently finishes: the check is what catches it.
      assert.equal(recs[1]!.error, null);
      assert.equal(recs[1]!.finish, "length");
    }
    recs.forEach((o, i) => {
      if (i !== 1) assert.deepEqual(o.tokens, alone[i], `request ${i} unaffected`);
    });
    assertIdle(engine);
  }
});

test("Engine tag check fails a request whose page was freed and re-leased under it (stale generation)", () => {
  for (const tagCheck of [true, false]) {
    const engine = makeEngine(tagCheck ? {} : { safety: makeSafety({ disabledGuards: ["page-tags"] }) });
    const rec = recorder();
    engine.submit(request(1, PROMPTS[4]!, 10), rec.events);
    engine.step();
    engine.step();
    const table = engine.pool.table;
    let page = -1;
    for (let p = 0; p < engine.pool.numPages && page < 0; p++) if (table.owner(p) === 1) page = p;
    // An early free (the bug class): the page goes back and another request leases it.
    assert.equal(table.free(page, table.generation(page), 1, 0), true);
    const outPages = new Int32Array(engine.pool.numPages);
    const outGens = new Uint32Array(engine.pool.numPages);
    assert.equal(table.allocate(1, 77, 0, 0, outPages, outGens), true);
    assert.equal(outPages[0], page, "the freed page is the next one handed out");
    runUntilIdle(engine);
    if (tagCheck) {
      assert.equal(rec.outcome.error?.code, "page_tag_mismatch");
      // The engine freed only its own pages: the intruder's lease is intact.
      assert.equal(table.owner(page), 77);
      assert.equal(table.state(page), PageState.RESERVED);
      assert.deepEqual(table.counts(), { free: 63, reserved: 1, ready: 0, quarantined: 0, total: 64 });
    } else {
      // Without the guard the request reads another lease's page and finishes as if nothing happened.
      assert.equal(rec.outcome.error, null);
      assert.equal(rec.outcome.finish, "length");
    }
  }
});

type Op =
  | { kind: "submit"; prompt: number; maxTokens: number }
  | { kind: "abort"; which: number }
  | { kind: "steps"; count: number };

/** A request of the random program, with what it got. */
interface Submitted {
  readonly prompt: number;
  readonly maxTokens: number;
  readonly outcome: ReturnType<typeof recorder>["outcome"];
  aborted: boolean;
}

/** An aborted request got a prefix of its tokens and no finish; any other all of them and `length`. */
function assertOutcome(s: Submitted, expected: readonly number[]): void {
  assert.equal(s.outcome.lateEvents, 0);
  assert.equal(s.outcome.error, null);
  if (s.aborted) {
    assert.deepEqual(s.outcome.tokens, expected.slice(0, s.outcome.tokens.length));
    assert.equal(s.outcome.finish, null);
  } else {
    assert.deepEqual(s.outcome.tokens, expected);
    assert.equal(s.outcome.finish, "length");
  }
}

test("Engine under random submits, aborts and steps keeps outputs exact and frees every page (fast-check)", () => {
  const reference = aloneOutputs(greedyRequests(10));
  const opArb: fc.Arbitrary<Op> = fc.oneof(
    fc.record({
      kind: fc.constant("submit" as const),
      prompt: fc.nat(PROMPTS.length - 1),
      maxTokens: fc.integer({ min: 1, max: 10 }),
    }),
    fc.record({ kind: fc.constant("abort" as const), which: fc.nat(20) }),
    fc.record({ kind: fc.constant("steps" as const), count: fc.integer({ min: 1, max: 6 }) }),
  );
  const configArb = fc.record({
    numPages: fc.integer({ min: 9, max: 24 }),
    maxSequences: fc.integer({ min: 1, max: 4 }),
    maxBatchTokens: fc.integer({ min: 4, max: 32 }),
    maxPrefillTokens: fc.integer({ min: 1, max: 32 }),
  });
  fc.assert(
    fc.property(configArb, fc.array(opArb, { maxLength: 25 }), (config, ops) => {
      const engine = makeEngine({
        ...config,
        maxPrefillTokens: Math.min(config.maxPrefillTokens, config.maxBatchTokens),
      });
      const submitted: Submitted[] = [];
      for (const op of ops) {
        if (op.kind === "submit") {
          const rec = recorder();
          engine.submit(request(submitted.length + 1, PROMPTS[op.prompt]!, op.maxTokens), rec.events);
          submitted.push({
            prompt: op.prompt,
            maxTokens: op.maxTokens,
            outcome: rec.outcome,
            aborted: false,
          });
        } else if (op.kind === "abort") {
          const s = submitted[op.which];
          if (s !== undefined) {
            engine.abort(op.which + 1);
            if (s.outcome.finish === null) s.aborted = true;
          }
        } else {
          for (let i = 0; i < op.count; i++) engine.step();
        }
        const pages = engine.stats().pages;
        assert.equal(pages.free + pages.reserved + pages.ready, pages.total);
      }
      runUntilIdle(engine);
      assertIdle(engine);
      for (const s of submitted) assertOutcome(s, reference[s.prompt]!.slice(0, s.maxTokens));
    }),
    { numRuns: 150 },
  );
});

test("Engine: one tenant's queued backlog does not hold another tenant's request behind it", () => {
  const engine = makeEngine({ maxSequences: 2 });
  const firstTokens: number[] = [];
  const outcomes = new Map<number, ReturnType<typeof recorder>>();
  const submit = (r: GenerationRequest): void => {
    const rec = recorder();
    outcomes.set(r.rid, rec);
    engine.submit(r, {
      ...rec.events,
      onTokens: (ids) => {
        if (rec.outcome.tokens.length === 0) firstTokens.push(r.rid);
        rec.events.onTokens(ids);
      },
    });
  };
  const backlog = Array.from({ length: 6 }, (_, i) => request(1 + i, prompt(5, i + 1), 20, { tenant: 0 }));
  const other = request(100, prompt(5, 9), 20, { tenant: 1 });
  for (const r of backlog) submit(r);
  submit(other);
  runUntilIdle(engine);
  const position = firstTokens.indexOf(100);
  assert.ok(
    position <= 2,
    `tenant 1 started before most of tenant 0's backlog (first tokens: ${firstTokens})`,
  );
  const alone = aloneOutputs([...backlog, other]);
  for (const [i, r] of [...backlog, other].entries())
    assert.deepEqual(outcomes.get(r.rid)!.outcome.tokens, alone[i]);
  assertIdle(engine);
});

test("Engine: another tenant's short prompt goes into the next step, not after a running long prompt's chunks", () => {
  const engine = makeEngine({ maxBatchTokens: 64 });
  const long = recorder();
  const short = recorder();
  const longRequest = request(1, prompt(200, 3), 4, { tenant: 0 });
  const shortRequest = request(2, prompt(5, 4), 4, { tenant: 1 });
  engine.submit(longRequest, long.events);
  engine.step(); // the long prompt's first 64-token chunk
  engine.submit(shortRequest, short.events);
  engine.step();
  assert.equal(short.outcome.tokens.length, 1, "the short prompt was computed in the very next step");
  assert.equal(long.outcome.tokens.length, 0, "the long prompt still has chunks to go");
  runUntilIdle(engine);
  const [aloneLong, aloneShort] = aloneOutputs([longRequest, shortRequest]);
  assert.deepEqual(long.outcome.tokens, aloneLong);
  assert.deepEqual(short.outcome.tokens, aloneShort);
  // One tenant alone: the oldest prompt first, as before.
  const fifo = makeEngine({ maxBatchTokens: 64 });
  const a = recorder();
  const b = recorder();
  fifo.submit(longRequest, a.events);
  fifo.step();
  fifo.submit({ ...shortRequest, tenant: 0 }, b.events);
  fifo.step();
  assert.equal(b.outcome.tokens.length, 0, "with one tenant the running prompt keeps its chunks");
  runUntilIdle(fifo);
  assertIdle(engine);
});

test("Engine: a heavier tenant's prompt adds no more compute to a step than a lighter tenant's decodes have in it", () => {
  const { config, weights } = testModel();
  const layout = {
    numLayers: config.numLayers,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    pageSize: 4,
  };
  const forward = new ForwardPass(config, weights, layout, { maxBatchTokens: 64, maxSequences: 8 });
  // Each step's sequences, by the identity of their step object (one per request).
  const steps: { seq: StepSequence; start: number; n: number }[][] = [];
  const recording = {
    config,
    maxBatchTokens: forward.maxBatchTokens,
    maxSequences: forward.maxSequences,
    step(pool: Float32Array, sequences: readonly StepSequence[]): void {
      steps.push(sequences.map((seq) => ({ seq, start: seq.startPos, n: seq.tokens.length })));
      forward.step(pool, sequences);
    },
  };
  const engine = new Engine(recording, new PagePool(layout, 64));
  const cost = new StepCost(config);
  // Tenant 0 was served a long prompt lately: it is the heavier tenant.
  runAll(engine, [request(1, prompt(150, 1), 4, { tenant: 0 })]);
  const light = recorder();
  const heavy = recorder();
  const lightRequest = request(2, prompt(5, 2), 60, { tenant: 1 });
  const heavyRequest = request(3, prompt(150, 3), 4, { tenant: 0 });
  engine.submit(lightRequest, light.events);
  engine.step();
  const lightSeq = steps.at(-1)![0]!.seq;
  engine.submit(heavyRequest, heavy.events);
  const from = steps.length;
  while (light.outcome.finish === null) engine.step();
  let lightCost = 0;
  let heavyCost = 0;
  let heavyTokens = 0;
  for (const step of steps.slice(from)) {
    for (const s of step) {
      if (s.seq === lightSeq) lightCost += cost.of(s.start, s.n);
      else {
        heavyCost += cost.of(s.start, s.n);
        heavyTokens += s.n;
      }
    }
  }
  assert.ok(heavyTokens > 0, "the heavier tenant's prompt moved on while the lighter one decoded");
  assert.ok(
    heavyCost <= lightCost + cost.of(150, 1),
    `the heavier tenant's prompt took no more compute than the lighter's decodes: ${heavyCost} vs ${lightCost} (${heavyTokens} tokens)`,
  );
  runUntilIdle(engine);
  const [aloneLight, aloneHeavy] = aloneOutputs([lightRequest, heavyRequest]);
  assert.deepEqual(light.outcome.tokens, aloneLight);
  assert.deepEqual(heavy.outcome.tokens, aloneHeavy);
  assertIdle(engine);
});
/** Sample 0 of n and the others (`sample: {of, index}`), seeded seed + index, as the router sends them. */
function samples(n: number, p: readonly number[], maxTokens: number, ridBase = 1): GenerationRequest[] {
  return Array.from({ length: n }, (_, index) =>
    request(ridBase + index, p, maxTokens, {
      ...withSampling({ temperature: 1, seed: 500 + index }),
      ...(index === 0 ? {} : { sample: { of: ridBase, index } }),
    }),
  );
}

test("Engine forks the samples of n > 1 from one prefill: outputs as separate requests, every page freed", () => {
  const p = prompt(22, 7);
  const requests = samples(4, p, 9);
  const alone = requests.map((r) => runAll(makeEngine(), [{ ...r, sample: undefined }])[0]!.tokens);
  // A page size that leaves the prompt's last page partly filled, which each sample then appends to.
  const engine = makeEngine({ maxPrefillTokens: 8 });
  const outcomes = runAll(engine, requests);
  assert.deepEqual(
    outcomes.map((o) => o.tokens),
    alone,
  );
  for (const o of outcomes) assert.deepEqual(o.usage, { promptTokens: 22, completionTokens: 9 });
  const { prefillTokens, forkedSamples } = engine.stats().counters;
  assert.equal(prefillTokens, 22, "the prompt is computed once");
  assert.equal(forkedSamples, 3);
  assertIdle(engine);
});

test("Engine: samples whose first sample ends before its prompt is computed, or that find no pages, compute their own", () => {
  const p = prompt(13, 3);
  const requests = samples(3, p, 6);
  const alone = requests.map((r) => runAll(makeEngine(), [{ ...r, sample: undefined }])[0]!.tokens);
  const engine = makeEngine({ maxPrefillTokens: 4 });
  const outcomes = requests.map((r) => {
    const rec = recorder();
    engine.submit(r, rec.events);
    return rec.outcome;
  });
  engine.step();
  engine.abort(requests[0]!.rid);
  runUntilIdle(engine);
  assert.deepEqual(outcomes[0]!.tokens, []);
  assert.deepEqual(
    outcomes.slice(1).map((o) => o.tokens),
    alone.slice(1),
  );
  assert.equal(engine.stats().counters.forkedSamples, 0);
  assertIdle(engine);
  // A pool with room for one request at a time: the samples wait, compute their own, same answers.
  const tiny = makeEngine({ numPages: 5 });
  assert.deepEqual(
    runAll(tiny, requests).map((o) => o.tokens),
    alone,
  );
  assert.equal(tiny.stats().counters.forkedSamples, 0);
  assertIdle(tiny);
});
