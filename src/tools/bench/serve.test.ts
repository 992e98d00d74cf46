import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { once } from "node:events";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { fakePromptTokens, startFakeOpenAiServer } from "../../../testing/fake-openai-server.js";
import { assertFiguresMatch } from "../../../testing/serve-bench-check.js";
import { Rng } from "../probe/canary.js";
import { arrivalTimes, parseRates, parseSlo, runServeBench, type ServeBenchOptions } from "./serve.js";
import { buildDataset } from "./serve-datasets.js";
import type { ServeRunResult } from "./serve-report.js";

const MAIN = fileURLToPath(new URL("../../cli/main.js", import.meta.url));

async function benchFake(
  fakeOptions: Parameters<typeof startFakeOpenAiServer>[0],
  bench: Partial<ServeBenchOptions>,
) {
  const fake = await startFakeOpenAiServer(fakeOptions);
  try {
    const report = await runServeBench({
      baseUrl: fake.url,
      progress: null,
      numPrompts: 8,
      inputLen: 120,
      ...bench,
    });
    return { fake, report, run: report.runs[0]! };
  } finally {
    await fake.close();
  }
}

test("bench serve's figures equal a hand computation over the recorded run, and the recorded times bound the fake's scripted stream", async () => {
  const slo = { ttft: 45, tpot: 12, e2el: 200 };
  const { fake, run } = await benchFake(
    { latencyMs: 30, tokenDelayMs: 15, chunkChars: 2 },
    { numPrompts: 9, maxConcurrency: 3, rangeRatio: 0.5, slo, seed: 3 },
  );
  assert.equal(run.completed, 9);
  assert.equal(run.failed, 0);
  assertFiguresMatch(run, slo);
  // The figures are not all zero: goodput is some of the requests, tokens come from usage.
  assert.ok(run.request_goodput !== null && run.request_goodput > 0);
  assert.ok(run.mean_itl_ms > 0 && run.mean_tpot_ms > 0);
  // The fake logged, on the same clock, when each request arrived and each chunk left. The warm-up
  // request is the first stream; every answer is a 7-character code in 2-character chunks.
  const streams = fake.streams.slice(1);
  assert.equal(streams.length, 9);
  const byText = new Map(streams.map((s) => [s.chunks.join(""), s]));
  run.generated_texts.forEach((text, i) => {
    const s = byText.get(text);
    assert.ok(s !== undefined, `request ${i}'s text ${text} was streamed by the fake`);
    assert.equal(run.output_lens[i], text.length, "output tokens from usage (bytes)");
    assert.equal(run.itls[i]!.length, s.chunks.length - 1, "one ITL per chunk after the first");
    // Sent before the fake received it, read after the fake wrote it.
    assert.ok(run.ttfts[i]! * 1000 >= s.writes[0]! - s.receivedAt, "TTFT ≥ the fake's first-chunk delay");
    assert.ok(run.latencies[i]! * 1000 >= s.writes.at(-1)! - s.receivedAt, "E2EL ≥ the fake's last write");
    assert.ok(s.writes.at(-1)! - s.writes[0]! >= 15 * (s.chunks.length - 1) - 1, "the fake paced its chunks");
  });
  // At most 3 in flight (the warm-up ran alone before).
  assert.ok(fake.maxInFlight <= 3, String(fake.maxInFlight));
  assert.equal(run.max_concurrency, 3);
  assert.equal(run.contamination.contaminated_responses, 0);
  assert.equal(run.contamination.own_nonce_repeated, 9);
});

test("bench serve counts input and output tokens from the stream when the server sends no usage", async () => {
  const { run } = await benchFake({ streamUsage: false, chunkChars: 3 }, { numPrompts: 4 });
  assert.equal(run.completed, 4);
  for (const [i, text] of run.generated_texts.entries()) {
    assert.equal(run.output_lens[i], Math.ceil(text.length / 3), "one token per chunk");
  }
  // Prompt tokens estimated at 1 character per token for kvfence-tiny: about the 120 asked for.
  for (const n of run.input_lens) assert.ok(n >= 100 && n <= 140, String(n));
  assertFiguresMatch(run);
});

test("bench serve counts the responses that hold another request's nonce, and names who planted it", async () => {
  const { run } = await benchFake(
    { misbehave: ["cross-request"] },
    { numPrompts: 10, maxConcurrency: 1, seed: 5 },
  );
  // Recompute from the dataset: a response is contaminated when its text is another request's code.
  const dataset = buildDataset({
    name: "random",
    numPrompts: 10,
    seed: 5,
    nonce: "ask",
    charsPerToken: 1,
    inputLen: 120,
    outputLen: 128,
    rangeRatio: 0,
    prefixGroups: 4,
    prefixLen: 512,
    turns: 3,
  });
  const codes = dataset.order.map(({ session }) => dataset.sessions[session]!.turns[0]!.nonce.code);
  const expected = run.generated_texts.filter((t, i) => codes.includes(t) && t !== codes[i]).length;
  assert.ok(expected >= 4, `the fake mixed every other answer: ${expected}`);
  assert.equal(run.contamination.contaminated_responses, expected);
  assert.equal(run.contamination.foreign_nonces, expected);
  assert.equal(run.contamination.own_nonce_repeated, 10 - expected);
  for (const e of run.contamination.examples) {
    assert.equal(codes[e.planted_by], e.code);
    assert.notEqual(e.planted_by, e.request);
    assert.equal(run.generated_texts[e.request], e.code);
  }
});

test("bench serve drives /v1/completions with a raw prompt", async () => {
  const { run, fake } = await benchFake({}, { endpoint: "/v1/completions", numPrompts: 4 });
  assert.equal(run.completed, 4, JSON.stringify(run.errors));
  assert.equal(run.backend, "openai");
  assert.equal(run.contamination.own_nonce_repeated, 4);
  // Completions count the prompt's bytes alone (no chat template).
  for (const n of run.input_lens) assert.ok(n >= 115 && n <= 125, String(n));
  assert.equal(fake.chatRequests, 5);
});

test("bench serve's multi-turn sessions resend the whole history, one turn after the other", async () => {
  const { run } = await benchFake(
    { latencyMs: 5 },
    { datasetName: "multi-turn", numPrompts: 6, turns: 3, seed: 8 },
  );
  assert.equal(run.completed, 6);
  const dataset = buildDataset({
    name: "multi-turn",
    numPrompts: 6,
    seed: 8,
    nonce: "ask",
    charsPerToken: 1,
    inputLen: 120,
    outputLen: 128,
    rangeRatio: 0,
    prefixGroups: 4,
    prefixLen: 512,
    turns: 3,
  });
  // Two sessions of three turns, dispatched turn by turn: request j is session j % 2, turn j ÷ 2.
  assert.deepEqual(
    dataset.order.map((o) => [o.session, o.turn]),
    [
      [0, 0],
      [1, 0],
      [0, 1],
      [1, 1],
      [0, 2],
      [1, 2],
    ],
  );
  dataset.order.forEach(({ session, turn }, j) => {
    // The fake's prompt tokens are bytes of every message (+4 each, +3): the whole history was sent.
    const messages: Array<{ role: string; content: string }> = [];
    for (let k = 0; k <= turn; k++) {
      messages.push({ role: "user", content: dataset.sessions[session]!.turns[k]!.content });
      if (k < turn) messages.push({ role: "assistant", content: run.generated_texts[j - 2 * (turn - k)]! });
    }
    assert.equal(run.input_lens[j], fakePromptTokens(messages), `request ${j}`);
    // A later turn was sent only after the session's previous turn ended.
    if (turn > 0) {
      const prev = j - 2;
      assert.ok(run.start_times[j]! >= run.start_times[prev]! + run.latencies[prev]! - 1e-3);
    }
  });
  // Each answer repeats the newest turn's nonce; earlier ones in the history are its own too.
  assert.equal(run.contamination.contaminated_responses, 0);
  assert.equal(run.contamination.own_nonce_repeated, 6);
});

test("bench serve sends Poisson arrivals: none before its time, spread over n / rate", async () => {
  const rate = 40;
  const { run } = await benchFake({ latencyMs: 1 }, { numPrompts: 20, requestRates: [rate], seed: 11 });
  const arrivals = arrivalTimes(20, rate, new Rng(11 + 0x9e37));
  assert.ok(Math.abs(arrivals.at(-1)! - 20 / rate) < 1e-9, "the last arrival is at n / rate");
  for (const [j, t] of run.start_times.entries()) {
    assert.ok(t >= arrivals[j]! - 0.002, `request ${j} sent at ${t}, due ${arrivals[j]}`);
  }

  assert.ok(run.duration >= 20 / rate - 0.002);
  assert.equal(run.request_rate, rate);
  // The gaps are not all equal (exponential, not a fixed interval).
  const gaps = arrivals.slice(1).map((a, i) => a - arrivals[i]!);
  assert.ok(Math.max(...gaps) > 3 * Math.min(...gaps));
});

test("arrivalTimes() is all at once for an infinite rate", () => {
  assert.deepEqual(arrivalTimes(3, Number.POSITIVE_INFINITY, new Rng(1)), [0, 0, 0]);
});

test("parseRates() and parseSlo() take the documented forms and refuse others with the form to use", () => {
  assert.deepEqual(parseRates("1,2.5,inf"), [1, 2.5, Number.POSITIVE_INFINITY]);
  assert.throws(() => parseRates("0"), /inf or a rate > 0/);
  assert.throws(() => parseRates("1,,2"), /inf or a rate > 0/);
  assert.deepEqual(parseSlo("ttft=500,tpot=50"), { ttft: 500, tpot: 50 });
  assert.deepEqual(parseSlo("e2el=2000"), { e2el: 2000 });
  assert.throws(() => parseSlo("ttft:500"), /ttft=MS,tpot=MS/);
  assert.throws(() => parseSlo("latency=5"), /ttft=MS,tpot=MS/);
  assert.throws(() => parseSlo("ttft=1,ttft=2"), /twice/);
});

test("bench serve refuses to start when the first request fails, saying why", async () => {
  const fake = await startFakeOpenAiServer({ apiKeys: ["right"] });
  try {
    await assert.rejects(
      runServeBench({
        baseUrl: fake.url,
        apiKey: "right",
        model: "other-model",
        progress: null,
        numPrompts: 2,
      }),
      /first request .* failed.*HTTP 404: The model does not exist: other-model/,
    );
    await assert.rejects(
      runServeBench({ baseUrl: fake.url, apiKey: "wrong", progress: null, numPrompts: 2 }),
      /v1\/models gave no model \(HTTP 401\)/,
    );
  } finally {
    await fake.close();
  }
});

async function cli(args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  const child = spawn(process.execPath, [MAIN, "bench", "serve", ...args], {
    stdio: ["ignore", "pipe", "pipe"],
  });
  let stdout = "";
  let stderr = "";
  child.stdout.on("data", (d: Buffer) => {
    stdout += d.toString();
  });
  child.stderr.on("data", (d: Buffer) => {
    stderr += d.toString();
  });
  const [code] = (await once(child, "exit")) as [number];
  return { code, stdout, stderr };
}

test("kvfence bench serve: a sweep saves vLLM's result fields and a self-contained plot; a contaminated run exits 1", async () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-bench-serve-"));
  const clean = await startFakeOpenAiServer({ tokenDelayMs: 1 });
  const mixed = await startFakeOpenAiServer({ misbehave: ["cross-request"] });
  try {
    const result = join(dir, "result.json");
    const plot = join(dir, "plot.html");
    const ok = await cli([
      `${clean.url}/v1`,
      "--num-prompts",
      "6",
      "--random-input-len",
      "100",
      "--request-rate",
      "50,inf",
      "--max-concurrency",
      "2",
      "--slo",
      "ttft=1000,tpot=100",
      "--save-result",
      result,
      "--plot",
      plot,
    ]);
    assert.equal(ok.code, 0, ok.stderr);
    assert.match(ok.stdout, /Serving Benchmark Result/);
    assert.match(ok.stdout, /Contaminated responses: +0 of 6/);
    assert.match(ok.stdout, /\| offered rate \(req\/s\) \|/);
    assert.match(ok.stderr, /rate 50 \(1\/2\): 6\/6 requests done/, "plain progress lines off a TTY");
    const runs = JSON.parse(readFileSync(result, "utf8")) as Array<Record<string, unknown>>;
    assert.equal(runs.length, 2);
    assert.deepEqual(
      runs.map((r) => r.request_rate),
      [50, "inf"],
    );
    const vllmFields = [
      "date",
      "backend",
      "model_id",
      "num_prompts",
      "request_rate",
      "burstiness",
      "max_concurrency",
      "duration",
      "completed",
      "failed",
      "total_input_tokens",
      "total_output_tokens",
      "request_throughput",
      "request_goodput",
      "output_throughput",
      "total_token_throughput",
      "input_lens",
      "output_lens",
      "ttfts",
      "itls",
      "latencies",
      "start_times",
      "generated_texts",
      "errors",
      "max_concurrent_requests",
      ...["ttft", "tpot", "itl", "e2el"].flatMap((m) =>
        ["mean", "median", "std", "p99"].map((s) => `${s}_${m}_ms`),
      ),
    ];
    for (const run of runs) {
      for (const f of vllmFields) assert.ok(f in run, `the result has ${f}`);
      assert.equal(run.completed, 6);
      assert.equal(run.model_id, "kvfence-tiny");
      assert.deepEqual(run.slo, { ttft: 1000, tpot: 100 });
      assertFiguresMatch(run as unknown as ServeRunResult, { ttft: 1000, tpot: 100 });
    }
    const html = readFileSync(plot, "utf8");
    assert.match(html, /^<!doctype html>/);
    assert.ok(html.includes("uPlot"), "the chart library is inlined");
    // Nothing is loaded from elsewhere: no script or stylesheet by URL, no CSS import or url().
    assert.doesNotMatch(html, /<script[^>]+src=|<link[^>]+href=|@import|url\(\s*['"]?https?:/i);
    assert.ok(
      !runs.some((r) => html.includes(String((r.generated_texts as string[])[0]))),
      "no generated text",
    );

    const bad = await cli([mixed.url, "--num-prompts", "6", "--max-concurrency", "1", "--no-progress"]);
    assert.equal(bad.code, 1, bad.stderr);
    assert.match(
      bad.stdout,
      /contamination: request \d+'s response holds [A-Z0-9]{3}-[A-Z0-9]{3} \(planted by request \d+/,
    );
    assert.match(bad.stderr, /responses hold another request's nonce/);
    assert.doesNotMatch(bad.stderr, /requests done/);

    const wrong = await cli([clean.url, "--dataset-name", "sharegpt"]);
    assert.equal(wrong.code, 2);
    assert.equal(
      wrong.stderr.trim().split("\n").at(-1),
      "kvfence bench serve: The sharegpt dataset needs --dataset-path FILE",
    );
  } finally {
    await clean.close();
    await mixed.close();
    rmSync(dir, { recursive: true, force: true });
  }
});
