/**
 * End to end (issue #17), in every topology — one engine (`--no-disaggregation`), the threaded
 * default, and a TCP cluster of one prefill and one decode process — through the official
 * `openai` client over real HTTP on 127.0.0.1 (tiny-qwen2); every pool FREE after each answer.
 * - The sampling controls of OpenAI, vLLM and SGLang change the answer as those servers define
 *   them and give the same answer everywhere: they run where the token is sampled (the prefill
 *   node samples the first token, the decode node the rest: the controls travel to both).
 * - Log-probabilities equal a log-softmax of the float64 reference forward's logits (the golden
 *   fixture of scripts/golden.py) within 1e-4, their top lists ordered and complete, for the prompt
 *   (echo, vLLM's prompt_logprobs, computed on prefill) and for the output (decode), alike
 *   everywhere, streamed and not.
 * - `/v1/responses` (OpenAI's Responses API, text in and out) answers as chat does for the same
 *   messages — the same template, the same tokens — as a `response` object or its event stream
 *   (`client.responses.create`, `client.responses.stream`), and refuses what it does not serve.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { assertPoolIdle, modelDir, operatorGet, scrape } from "../../testing/start-server.js";
import { startCluster, startInProcess, type TopologyServer } from "../../testing/topology-servers.js";
import { loadChatTemplate, ModelTokenizer } from "../tokenizer/tokenizer.js";

const MODEL = "tiny-qwen2";
const KEY = "sk-sampling-controls-1";
const EOS = 258; // <|im_end|>, one of tiny-qwen2's EOS ids

/** Within 1e-4 (log-probabilities against the reference, or against themselves batched otherwise). */
function close(got: number | null | undefined, want: number, what: string): void {
  assert.ok(got != null && Math.abs(got - want) <= 1e-4, `${what}: ${got} vs ${want}`);
}

/** Extension fields the `openai` types do not know: sent as they are in the body. */
type Extra = Record<string, unknown>;

interface Answer {
  readonly text: string;
  readonly finish: string | null;
  readonly stopReason: unknown;
  readonly completionTokens: number;
}

describe("issue 17: the API clients expect, in every topology", { timeout: 180_000 }, () => {
  const tokenizer = ModelTokenizer.fromFolder(modelDir(MODEL));
  const X = tokenizer.encode("x", { addSpecialTokens: false })[0]!;
  const servers: { name: string; server: TopologyServer; client: OpenAI }[] = [];

  before(async () => {
    // An f32 KV cache: the log-probabilities are checked within 1e-4 of the f32 reference forward
    // (an f16 cache moves them by up to ~1e-3 here; its own bound is src/model/parity-kv-dtype.test.ts).
    const options = {
      model: modelDir(MODEL),
      kvPages: 128,
      maxModelLen: 512,
      apiKeys: { [KEY]: "alpha" },
      kvCacheDtype: "f32" as const,
    };
    const [single, threads, tcp] = await Promise.all([
      startInProcess("single", options),
      startInProcess("threads", options),
      startCluster(1, 1, options),
    ]);
    for (const [name, server] of [
      ["single", single],
      ["threads", threads],
      ["tcp 1+1", tcp],
    ] as const) {
      servers.push({
        name,
        server,
        client: new OpenAI({ baseURL: server.baseURL, apiKey: KEY, maxRetries: 0 }),
      });
    }
  });
  after(async () => {
    await Promise.all(servers.map(async ({ server }) => server.close()));
  });

  async function complete(client: OpenAI, extra: Extra, prompt = "a"): Promise<Answer> {
    const res = await client.completions.create({
      model: MODEL,
      prompt,
      max_tokens: 12,
      temperature: 0,
      ...extra,
    } as OpenAI.CompletionCreateParamsNonStreaming);
    const choice = res.choices[0]! as OpenAI.CompletionChoice & { stop_reason?: unknown };
    return {
      text: choice.text,
      finish: choice.finish_reason,
      stopReason: choice.stop_reason,
      completionTokens: res.usage!.completion_tokens,
    };
  }

  /** The answer with `extra`, the same in every topology. */
  async function everywhere(extra: Extra, prompt?: string): Promise<Answer> {
    const answers = await Promise.all(servers.map(({ client }) => complete(client, extra, prompt)));
    for (let i = 1; i < answers.length; i++)
      assert.deepEqual(
        answers[i],
        answers[0],
        `${servers[i]!.name} vs ${servers[0]!.name}: ${JSON.stringify(extra)}`,
      );
    await Promise.all(servers.map(({ server }) => assertPoolIdle(server.url)));
    return answers[0]!;
  }

  test("logit_bias, the repetition, frequency and presence penalties change the greedy answer, alike everywhere", async () => {
    const plain = await everywhere({});
    const biased = await everywhere({ logit_bias: { [String(X)]: 100 } });
    assert.equal(biased.text, "x".repeat(12));
    const banned = await everywhere({
      logit_bias: {
        [String(tokenizer.encode(plain.text.slice(0, 1), { addSpecialTokens: false })[0])]: -100,
      },
    });
    assert.notEqual(banned.text.slice(0, 1), plain.text.slice(0, 1));
    for (const extra of [{ repetition_penalty: 3 }, { frequency_penalty: 2 }, { presence_penalty: 2 }]) {
      const penalised = await everywhere(extra);
      assert.notEqual(penalised.text, plain.text, JSON.stringify(extra));
    }
    // The repetition penalty reads the prompt: a decode node that did not have it would differ.
    const prompt = "sssssssssss QnsQns";
    assert.notEqual(
      (await everywhere({ repetition_penalty: 1.8 }, prompt)).text,
      (await everywhere({}, prompt)).text,
    );
  });

  test("ignore_eos, min_tokens and skip_special_tokens around a forced EOS", async () => {
    const eos = { logit_bias: { [String(EOS)]: 100 } };
    assert.deepEqual(await everywhere(eos), {
      text: "",
      finish: "stop",
      stopReason: null,
      completionTokens: 1,
    });
    const ignored = await everywhere({ ...eos, ignore_eos: true });
    assert.deepEqual([ignored.text, ignored.finish, ignored.completionTokens], ["", "length", 12]);
    const shown = await everywhere({ ...eos, ignore_eos: true, skip_special_tokens: false, max_tokens: 3 });
    assert.equal(shown.text, "<|im_end|>".repeat(3));
    // EOS on the last allowed token is a stop, not a length (prefill's first token, and decode's).
    assert.deepEqual(await everywhere({ ...eos, max_tokens: 1 }), {
      text: "",
      finish: "stop",
      stopReason: null,
      completionTokens: 1,
    });
    const last = await everywhere({ ...eos, min_tokens: 2, max_tokens: 3 });
    assert.deepEqual([last.finish, last.completionTokens], ["stop", 3]);
    const held = await everywhere({ ...eos, min_tokens: 4 });
    assert.deepEqual([held.finish, held.completionTokens], ["stop", 5]);
    assert.ok(held.text.length > 0);
  });

  test("stop_token_ids, stop strings with min_tokens, include_stop_str_in_output, stop_reason", async () => {
    const xs = { logit_bias: { [String(X)]: 100 } };
    assert.deepEqual(await everywhere({ ...xs, stop_token_ids: [X] }), {
      text: "",
      finish: "stop",
      stopReason: X,
      completionTokens: 1,
    });
    assert.equal(
      (await everywhere({ ...xs, stop_token_ids: [X], include_stop_str_in_output: true })).text,
      "x",
    );
    // Under min_tokens the stop id cannot be drawn (the bias loses to −∞): it stops at token 3.
    const late = await everywhere({ ...xs, stop_token_ids: [X], min_tokens: 2 });
    assert.deepEqual([late.finish, late.stopReason, late.completionTokens], ["stop", X, 3]);
    assert.doesNotMatch(late.text, /x/);
    assert.deepEqual(await everywhere({ ...xs, stop: ["x"] }), {
      text: "",
      finish: "stop",
      stopReason: "x",
      completionTokens: 1,
    });
    // As vLLM: stop strings are looked for from min_tokens on, in the text that token completes.
    assert.deepEqual(await everywhere({ ...xs, stop: ["x"], min_tokens: 3 }), {
      text: "xx",
      finish: "stop",
      stopReason: "x",
      completionTokens: 3,
    });
    assert.deepEqual(await everywhere({ ...xs, stop: ["xx"], min_tokens: 3 }), {
      text: "x",
      finish: "stop",
      stopReason: "xx",
      completionTokens: 3,
    });
    assert.equal((await everywhere({ ...xs, stop: ["xx"], include_stop_str_in_output: true })).text, "xx");
  });

  test("min_p, top_k and the seed: seeded sampling with every control is the same everywhere", async () => {
    const greedy = await everywhere({});
    // min_p 1 keeps only the most likely token: greedy at any temperature.
    assert.deepEqual(await everywhere({ temperature: 2, seed: 5, min_p: 1 }), greedy);
    const loose = await everywhere({ temperature: 2, seed: 5 });
    const tight = await everywhere({ temperature: 2, seed: 5, min_p: 0.3 });
    assert.notEqual(tight.text, loose.text);
    await everywhere({
      temperature: 0.9,
      seed: 11,
      top_k: 20,
      top_p: 0.9,
      min_p: 0.05,
      repetition_penalty: 1.3,
      frequency_penalty: 0.5,
      presence_penalty: 0.4,
      logit_bias: { [String(X)]: 3 },
      min_tokens: 2,
      max_tokens: 20,
    });
  });

  test("chat takes the same controls; out-of-range values get a 400 naming the field", async () => {
    const { client } = servers[1]!;
    const res = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "hi" }],
      max_tokens: 4,
      temperature: 0,
      logit_bias: { [String(X)]: 100 },
    });
    assert.equal(res.choices[0]!.message.content, "xxxx");
    const cases: [Extra, string][] = [
      [{ logit_bias: { "9999": 1 } }, "logit_bias"],
      [{ logit_bias: { x: 1 } }, "logit_bias.x"],
      [{ logit_bias: { "5": 101 } }, "logit_bias.5"],
      [{ stop_token_ids: [264] }, "stop_token_ids"],
      [{ min_tokens: 13 }, "min_tokens"],
      [{ frequency_penalty: 2.5 }, "frequency_penalty"],
      [{ repetition_penalty: 0 }, "repetition_penalty"],
      [{ min_p: 2 }, "min_p"],
    ];
    for (const [extra, param] of cases) {
      await assert.rejects(complete(client, extra), (err: unknown) => {
        assert.ok(err instanceof OpenAI.BadRequestError, JSON.stringify(extra));
        assert.equal((err.error as { param?: string }).param, param, JSON.stringify(extra));
        return true;
      });
    }
  });

  describe("log-probabilities", () => {
    const golden = JSON.parse(
      readFileSync(join(modelDir(MODEL), "..", "..", "testing", "fixtures", `golden-${MODEL}.json`), "utf8"),
    ) as { vocabSize: number; prompts: { tokens: number[]; logits: string; greedy: number[] }[] };
    /** The reference's log-softmax at every position of a golden prompt, in float64. */
    const reference = (i: number): Float64Array[] => {
      const { tokens, logits } = golden.prompts[i]!;
      const bytes = Buffer.from(logits, "base64");
      const all = new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
      const vocab = golden.vocabSize;
      return tokens.map((_, p) => {
        const row = Float64Array.from(all.subarray(p * vocab, (p + 1) * vocab));
        const max = Math.max(...row);
        const lse = max + Math.log(row.reduce((sum, v) => sum + Math.exp(v - max), 0));
        return row.map((v) => v - lse);
      });
    };
    const sortedDesc = (row: Float64Array): number[] => [...row].sort((a, b) => b - a);

    type VllmEntry = Record<string, { logprob: number; rank: number; decoded_token: string }> | null;
    type Choice = OpenAI.CompletionChoice & { prompt_logprobs?: VllmEntry[] };

    /** Checks one position's vLLM entry against the reference row: the token, and the top `k` by rank. */
    function checkEntry(entry: VllmEntry, row: Float64Array, token: number, k: number, what: string): void {
      assert.ok(entry !== null, what);
      close(entry[String(token)]?.logprob, row[token]!, `${what}, the prompt's token`);
      const top = Object.entries(entry)
        .filter(([, e]) => e.rank <= k)
        .sort((a, b) => a[1].rank - b[1].rank);
      assert.deepEqual(
        top.map(([, e]) => e.rank),
        Array.from({ length: k }, (_, i) => i + 1),
        `${what}: ranks 1..${k}`,
      );
      const want = sortedDesc(row);
      top.forEach(([id, e], i) => {
        close(e.logprob, want[i]!, `${what}, rank ${i + 1}`);
        close(row[Number(id)]!, e.logprob, `${what}, rank ${i + 1} is token ${id}`);
      });
    }

    test("the prompt's (prompt_logprobs, echo; computed on prefill) equal the reference at every position", async () => {
      for (const i of [0, 1, 2]) {
        const { tokens, greedy } = golden.prompts[i]!;
        const ref = reference(i);
        const n = tokens.length;
        const answers = await Promise.all(
          servers.map(({ client }) =>
            client.completions.create({
              model: MODEL,
              prompt: tokens,
              max_tokens: 1,
              temperature: 0,
              logprobs: 5,
              echo: true,
              prompt_logprobs: 20,
            } as OpenAI.CompletionCreateParamsNonStreaming),
          ),
        );
        for (const [s, res] of answers.entries()) {
          const what = `${servers[s]!.name}, golden prompt ${i} (${n} tokens)`;
          const choice = res.choices[0] as Choice;
          const vllm = choice.prompt_logprobs!;
          assert.equal(vllm.length, n);
          assert.equal(vllm[0], null);
          for (let p = 1; p < n; p++)
            checkEntry(vllm[p]!, ref[p - 1]!, tokens[p]!, 20, `${what}, position ${p}`);
          const lp = choice.logprobs!;
          assert.equal(lp.token_logprobs!.length, n + 1);
          assert.equal(lp.token_logprobs![0], null);
          assert.equal(lp.top_logprobs![0], null);
          for (let p = 1; p < n; p++)
            close(lp.token_logprobs![p], ref[p - 1]![tokens[p]!]!, `${what}, echo ${p}`);
          // The generated token: the last position's distribution, at the greedy token.
          close(lp.token_logprobs![n], ref[n - 1]![greedy[0]!]!, `${what}, first token`);
          const top = Object.values(lp.top_logprobs![n]!).sort((a, b) => b - a);
          close(top[0], sortedDesc(ref[n - 1]!)[0]!, `${what}, first token's top`);
          assert.equal(choice.text, tokenizer.decode(tokens) + tokenizer.decode([greedy[0]!]));
          assert.deepEqual(
            lp.tokens,
            [...tokens, greedy[0]!].map((id) => tokenizer.tokenPiece(id).text),
          );
        }
        await Promise.all(servers.map(({ server }) => assertPoolIdle(server.url)));
      }
    });

    /** Completions: the output's log-probabilities against the same tokens' as a prompt. */
    async function decodeMatchesPrefill(name: string, client: OpenAI): Promise<void> {
      const { tokens, greedy } = golden.prompts[2]!;
      const n = tokens.length;
      const steps = 8;
      // The reference: the same tokens as a prompt (their log-probabilities checked above on prefill).
      const ref = (
        await client.completions.create({
          model: MODEL,
          prompt: [...tokens, ...greedy.slice(0, steps)],
          max_tokens: 1,
          temperature: 0,
          prompt_logprobs: 5,
        } as OpenAI.CompletionCreateParamsNonStreaming)
      ).choices[0] as Choice;
      const res = await client.completions.create({
        model: MODEL,
        prompt: tokens,
        max_tokens: steps,
        temperature: 0,
        logprobs: 5,
      });
      const lp = res.choices[0]!.logprobs!;
      assert.deepEqual(
        lp.tokens,
        greedy.slice(0, steps).map((id) => tokenizer.tokenPiece(id).text),
        name,
      );
      for (let j = 0; j < steps; j++) {
        const want = ref.prompt_logprobs![n + j]!;
        close(lp.token_logprobs![j], want[String(greedy[j])]!.logprob, `${name}, token ${j}`);
        const top = Object.values(lp.top_logprobs![j]!).sort((a, b) => b - a);
        const wantTop = Object.values(want)
          .map((e) => e.logprob)
          .sort((a, b) => b - a);
        close(top[0], wantTop[0]!, `${name}, token ${j}'s top`);
      }
      // text_offset: each token's text starts where the previous one's ended.
      for (const [j, offset] of lp.text_offset!.entries()) {
        assert.equal(offset, j === 0 ? 0 : lp.text_offset![j - 1]! + lp.tokens![j - 1]!.length);
      }
    }

    /** Chat, with the top 20: ordered, complete, bytes of each token; a stream carries the same. */
    async function chatTop20(name: string, client: OpenAI): Promise<void> {
      const ask = {
        model: MODEL,
        messages: [{ role: "user" as const, content: "hello" }],
        max_tokens: 6,
        temperature: 0,
        logprobs: true,
        top_logprobs: 20,
      };
      const whole = await client.chat.completions.create(ask);
      const content = whole.choices[0]!.logprobs!.content!;
      assert.equal(content.length, whole.usage!.completion_tokens, name);
      for (const item of content) {
        assert.equal(item.top_logprobs.length, 20);
        for (let r = 1; r < 20; r++)
          assert.ok(item.top_logprobs[r - 1]!.logprob >= item.top_logprobs[r]!.logprob);
        // Greedy: the chosen token is the most likely one.
        assert.equal(item.logprob, item.top_logprobs[0]!.logprob);
        assert.deepEqual(item.bytes, item.top_logprobs[0]!.bytes);
        assert.equal(Buffer.from(item.bytes!).toString("utf8"), item.token);
      }
      const streamed: typeof content = [];
      for await (const chunk of await client.chat.completions.create({ ...ask, stream: true })) {
        streamed.push(...(chunk.choices[0]?.logprobs?.content ?? []));
      }
      assert.deepEqual(streamed, content, name);
    }

    test("the output's (computed on decode) equal the prompt's of the same tokens, streamed and not", async () => {
      for (const { name, client, server } of servers) {
        await decodeMatchesPrefill(name, client);
        await chatTop20(name, client);
        await assertPoolIdle(server.url);
      }
    });

    test("out-of-range and inconsistent logprob fields get a 400 naming the field", async () => {
      const { client } = servers[0]!;
      const chat = { model: MODEL, messages: [{ role: "user" as const, content: "hi" }], max_tokens: 2 };
      for (const [extra, param] of [
        [{ logprobs: true, top_logprobs: 21 }, "top_logprobs"],
        [{ top_logprobs: 2 }, "top_logprobs"],
        [{ prompt_logprobs: 2, stream: true }, "prompt_logprobs"],
      ] as const) {
        await assert.rejects(
          client.chat.completions.create({
            ...chat,
            ...extra,
          } as OpenAI.ChatCompletionCreateParamsNonStreaming),
          (err: unknown) =>
            err instanceof OpenAI.BadRequestError && (err.error as { param?: string }).param === param,
        );
      }
      await assert.rejects(complete(client, { logprobs: 21 }), OpenAI.BadRequestError);
      await assert.rejects(complete(client, { prompt: [1, 300] } as Extra), (err: unknown) => {
        assert.ok(err instanceof OpenAI.BadRequestError);
        assert.match(err.message, /prompt\[1\] is token id 300, outside this model's vocabulary/);
        return true;
      });
    });
  });

  describe("n > 1", () => {
    /** A counter of the one-engine server's /metrics. */
    async function counter(url: string, name: string): Promise<number> {
      const text = await (await operatorGet(url, "/metrics")).text();
      const line = text.split("\n").find((l) => l.startsWith(`${name} `));
      return Number(line?.split(" ")[1] ?? Number.NaN);
    }

    test("completions: each choice its index, finish and seeded sampler (seed + index), usage over all", async () => {
      const ask = { model: MODEL, prompt: "a", max_tokens: 8, temperature: 1, seed: 7 };
      const alone = await Promise.all(
        [0, 1, 2, 3].map((i) => servers[0]!.client.completions.create({ ...ask, seed: 7 + i })),
      );
      for (const { name, client, server } of servers) {
        const res = await client.completions.create({ ...ask, n: 4 });
        assert.deepEqual(
          res.choices.map((c) => [c.index, c.text, c.finish_reason]),
          alone.map((a, i) => [i, a.choices[0]!.text, a.choices[0]!.finish_reason]),
          name,
        );
        assert.equal(res.usage!.prompt_tokens, alone[0]!.usage!.prompt_tokens);
        assert.equal(
          res.usage!.completion_tokens,
          alone.reduce((sum, a) => sum + a.usage!.completion_tokens, 0),
        );
        await assertPoolIdle(server.url);
      }
    });

    test("n=8 computes the prompt once and forks it into 8 samples, in every topology (one transfer when split)", async () => {
      const prompt = "The KV cache of one request must never serve another request.";
      const ask = { model: MODEL, prompt, max_tokens: 5, temperature: 0.8, seed: 11 };
      const alone = await Promise.all(
        [0, 1, 2, 3, 4, 5, 6, 7].map((j) => servers[0]!.client.completions.create({ ...ask, seed: 11 + j })),
      );
      for (const { name, client, server } of servers) {
        const before = await counter(server.url, "kvfence_prefill_tokens_total");
        const forkedBefore = await counter(server.url, "kvfence_forked_samples_total");
        const stepsBefore = await counter(server.url, "kvfence_decode_steps_total");
        const transfers = async () => (await scrape(server.url)).get("kvfence_transfer_gbps_count") ?? 0;
        const transfersBefore = await transfers();
        const res = await client.completions.create({ ...ask, n: 8 });
        assert.equal(res.choices.length, 8, name);
        // Each sample as it would be alone with seed + j (vLLM's rule), in every topology.
        assert.deepEqual(
          res.choices.map((c) => c.text),
          alone.map((a) => a.choices[0]!.text),
          name,
        );
        // (The prompt's pages the answers alone left in the prefix cache are not computed again.)
        const cached = res.usage!.prompt_tokens_details?.cached_tokens ?? 0;
        assert.equal(
          (await counter(server.url, "kvfence_prefill_tokens_total")) - before,
          res.usage!.prompt_tokens - cached,
          `${name}: the prompt computed once`,
        );
        assert.equal(
          (await counter(server.url, "kvfence_forked_samples_total")) - forkedBefore,
          7,
          `${name}: seven samples forked`,
        );
        // Decoded as one batch: the samples' tokens after their first share steps (one sample at a
        // time would take up to 8 × 4 steps).
        const steps = (await counter(server.url, "kvfence_decode_steps_total")) - stepsBefore;
        assert.ok(
          steps > 0 && steps <= ask.max_tokens,
          `${name}: ${steps} decode steps for 8 samples of ${ask.max_tokens} tokens`,
        );
        if (name !== "single") {
          assert.equal((await transfers()) - transfersBefore, 1, `${name}: one transfer`);
        }
        assert.equal(
          res.usage!.completion_tokens,
          alone.reduce((sum, a) => sum + a.usage!.completion_tokens, 0),
        );
        await assertPoolIdle(server.url);
      }
    });

    test("chat, streamed: chunks name their choice; each stream equals the whole answer", async () => {
      const ask = {
        model: MODEL,
        messages: [{ role: "user" as const, content: "hello" }],
        max_tokens: 6,
        temperature: 1,
        seed: 3,
        n: 3,
        logprobs: true,
        top_logprobs: 2,
      };
      for (const { name, client, server } of servers) {
        const whole = await client.chat.completions.create(ask);
        const texts = ["", "", ""];
        const finishes: (string | null)[] = [null, null, null];
        const logprobs: number[][] = [[], [], []];
        const chunks: OpenAI.ChatCompletionChunk.Choice[] = [];
        for await (const chunk of await client.chat.completions.create({ ...ask, stream: true })) {
          chunks.push(...chunk.choices);
        }
        for (const c of chunks) {
          texts[c.index] += c.delta.content ?? "";
          if (c.finish_reason !== null) finishes[c.index] = c.finish_reason;
          logprobs[c.index]!.push(...(c.logprobs?.content ?? []).map((item) => item.logprob));
        }
        assert.deepEqual(
          whole.choices.map((c) => [c.index, c.message.content, c.finish_reason]),
          texts.map((t, i) => [i, t, finishes[i]]),
          name,
        );
        // The same values, but for float rounding: the two runs batch their steps differently.
        whole.choices.forEach((c, i) => {
          const got = c.logprobs!.content!.map((item) => item.logprob);
          assert.equal(got.length, logprobs[i]!.length);
          for (const [j, v] of got.entries()) close(v, logprobs[i]![j]!, `${name}, choice ${i}, token ${j}`);
        });
        await assertPoolIdle(server.url);
      }
    });
  });

  test("completions: several prompts (text or token ids), each its n choices, in order; echo per prompt", async () => {
    const texts = ["a", "The sea"];
    const ids = texts.map((t) => Array.from(tokenizer.encode(t)));
    for (const { name, client, server } of servers) {
      const one = await Promise.all(
        texts.flatMap((prompt) =>
          [0, 1].map((j) =>
            client.completions.create({ model: MODEL, prompt, max_tokens: 5, temperature: 1, seed: 9 + j }),
          ),
        ),
      );
      for (const prompt of [texts, ids]) {
        const res = await client.completions.create({
          model: MODEL,
          prompt,
          max_tokens: 5,
          temperature: 1,
          seed: 9,
          n: 2,
          echo: true,
        });
        assert.deepEqual(
          res.choices.map((c) => [c.index, c.text]),
          one.map((o, i) => [i, texts[i >> 1]! + o.choices[0]!.text]),
          name,
        );
        assert.equal(res.usage!.prompt_tokens, one[0]!.usage!.prompt_tokens + one[2]!.usage!.prompt_tokens);
      }
      await assert.rejects(
        client.completions.create({ model: MODEL, prompt: [[1], [300]], max_tokens: 2 }),
        /prompt\[1\]\[0\] is token id 300/,
      );
      await assert.rejects(
        client.completions.create({ model: MODEL, prompt: ["a", "b", "c"], max_tokens: 2, n: 22 }),
        (err: unknown) =>
          err instanceof OpenAI.BadRequestError && (err.error as { param?: string }).param === "n",
      );
      await assertPoolIdle(server.url);
    }
  });

  describe("/v1/responses", () => {
    const input: OpenAI.Responses.ResponseInput = [
      { role: "user", content: "Say hello" },
      // An earlier answer passed back as it came (an output message item).
      {
        id: "msg_earlier",
        type: "message",
        role: "assistant",
        status: "completed",
        content: [{ type: "output_text", text: "Hello", annotations: [] }],
      },
      { type: "message", role: "user", content: [{ type: "input_text", text: "again, about the sea" }] },
    ];
    const instructions = "You answer in one line.";
    const chatMessages: OpenAI.ChatCompletionMessageParam[] = [
      { role: "system", content: instructions },
      { role: "user", content: "Say hello" },
      { role: "assistant", content: "Hello" },
      { role: "user", content: "again, about the sea" },
    ];

    /** A response and the chat answer to the same messages agree: text, status, usage, and the echoed fields. */
    function sameAsChat(
      res: OpenAI.Responses.Response,
      chat: OpenAI.ChatCompletion,
      max: number,
      instructed: boolean,
      what: string,
    ): void {
      assert.match(res.id, /^resp_[A-Za-z0-9]{24}$/, what);
      assert.equal(res.object, "response", what);
      assert.equal(res.output_text, chat.choices[0]!.message.content, what);
      assert.equal(res.output.length, 1, what);
      const item = res.output[0]! as OpenAI.Responses.ResponseOutputMessage;
      assert.deepEqual([item.type, item.role], ["message", "assistant"], what);
      assert.deepEqual(
        item.content.map((p) => p.type),
        ["output_text"],
        what,
      );
      const length = chat.choices[0]!.finish_reason === "length";
      assert.equal(res.status, length ? "incomplete" : "completed", what);
      assert.equal(item.status, res.status, what);
      assert.deepEqual(res.incomplete_details, length ? { reason: "max_output_tokens" } : null, what);
      assert.equal(res.max_output_tokens, max, what);
      assert.equal(res.instructions, instructed ? instructions : null, what);
      assert.equal(res.usage!.input_tokens, chat.usage!.prompt_tokens, what);
      assert.equal(res.usage!.output_tokens, chat.usage!.completion_tokens, what);
      assert.equal(res.usage!.total_tokens, chat.usage!.total_tokens, what);
    }

    test("a response object with the chat path's answer (its template), usage, incomplete at max_output_tokens", async () => {
      for (const { name, client, server } of servers) {
        for (const [max, extra] of [
          [12, { input, instructions }],
          [2, { input, instructions }],
          [6, { input: "the access code of account 4821 is" }],
        ] as const) {
          const messages =
            typeof extra.input === "string"
              ? [{ role: "user" as const, content: extra.input }]
              : chatMessages;
          const chat = await client.chat.completions.create({
            model: MODEL,
            messages,
            max_tokens: max,
            temperature: 0,
          });
          const res = await client.responses.create({
            model: MODEL,
            ...extra,
            max_output_tokens: max,
            temperature: 0,
          });
          const what = `${name}, max ${max}`;
          sameAsChat(res, chat, max, "instructions" in extra, what);
          if (max === 2) assert.equal(res.status, "incomplete", `${what}: two tokens end no answer here`);
        }
        await assertPoolIdle(server.url);
      }
    });

    test("streamed: the Responses event sequence, numbered, its deltas the whole answer", async () => {
      for (const { name, client, server } of servers) {
        for (const max of [10, 2]) {
          const ask = { model: MODEL, input, instructions, max_output_tokens: max, temperature: 0 };
          const whole = await client.responses.create(ask);
          const events: OpenAI.Responses.ResponseStreamEvent[] = [];
          for await (const event of await client.responses.create({ ...ask, stream: true }))
            events.push(event);
          const what = `${name}, max ${max}`;
          const types = events.map((e) => e.type);
          const deltas = types.filter((t) => t === "response.output_text.delta").length;
          assert.ok(deltas > 0, what);
          assert.deepEqual(
            types,
            [
              "response.created",
              "response.in_progress",
              "response.output_item.added",
              "response.content_part.added",
              ...Array(deltas).fill("response.output_text.delta"),
              "response.output_text.done",
              "response.content_part.done",
              "response.output_item.done",
              whole.status === "incomplete" ? "response.incomplete" : "response.completed",
            ],
            what,
          );
          assert.deepEqual(
            events.map((e) => e.sequence_number),
            events.map((_, i) => i),
            what,
          );
          const text = events
            .filter((e) => e.type === "response.output_text.delta")
            .map((e) => (e as OpenAI.Responses.ResponseTextDeltaEvent).delta)
            .join("");
          assert.equal(text, whole.output_text, what);
          const done = events.find((e) => e.type === "response.output_text.done");
          assert.equal((done as OpenAI.Responses.ResponseTextDoneEvent).text, text, what);
          const last = events.at(-1) as OpenAI.Responses.ResponseCompletedEvent;
          assert.equal(last.response.status, whole.status, what);
          // (cached_tokens may differ: the stream's prompt can hit pages the first answer cached.)
          assert.deepEqual(
            [last.response.usage?.input_tokens, last.response.usage?.output_tokens],
            [whole.usage?.input_tokens, whole.usage?.output_tokens],
            what,
          );
          assert.equal(
            last.response.id,
            events[0]!.type === "response.created" ? events[0].response.id : "",
            what,
          );
          // The client's own accumulator of the events builds the same response.
          const final = await client.responses.stream(ask).finalResponse();
          assert.equal(final.output_text, whole.output_text, what);
          assert.equal(final.status, whole.status, what);
        }
        await assertPoolIdle(server.url);
      }
    });

    test("what /v1/responses does not serve is refused, naming the field", async () => {
      const { client } = servers[1]!;
      const cases: [Extra, string][] = [
        // Function tools are served (tools.e2e.test.ts); built-in tools are not.
        [{ tools: [{ type: "web_search" }] }, "tools[0].type"],
        [{ previous_response_id: "resp_abc" }, "previous_response_id"],
        [{ store: true }, "store"],
        [{ reasoning: { effort: "high" } }, "reasoning.effort"],
        [{ background: true }, "background"],
        [{ text: { verbosity: "low" } }, "text.verbosity"],
        [{ top_logprobs: 3 }, "top_logprobs"],
        [{ truncation: "auto" }, "truncation"],
        [
          { input: [{ role: "user", content: [{ type: "input_image", image_url: "data:," }] }] },
          "input[0].content",
        ],
        [{ input: [{ type: "reasoning", id: "rs_1", summary: [] }] }, "input[0].type"],
      ];
      for (const [extra, param] of cases) {
        await assert.rejects(
          client.responses.create({ model: MODEL, input: "hi", max_output_tokens: 2, ...extra } as never),
          (err: unknown) => {
            assert.ok(err instanceof OpenAI.BadRequestError, `${param}: ${String(err)}`);
            assert.equal((err.error as { param?: string }).param, param, JSON.stringify(err.error));
            return true;
          },
        );
      }
    });
  });

  test("chat template controls: add_generation_prompt, continue_final_message, chat_template_kwargs", async () => {
    const { server } = servers[0]!;
    const template = loadChatTemplate(modelDir(MODEL), tokenizer)!;
    const tokenize = async (body: object) => {
      const res = await fetch(`${server.url}/tokenize`, {
        method: "POST",
        headers: { "content-type": "application/json", authorization: `Bearer ${KEY}` },
        body: JSON.stringify({ model: MODEL, ...body }),
      });
      return {
        status: res.status,
        body: (await res.json()) as { tokens: number[]; error?: { param: string } },
      };
    };
    const messages = [
      { role: "user" as const, content: "Say hi" },
      { role: "assistant" as const, content: "Hello the" },
    ];
    const ids = (text: string) => Array.from(tokenizer.encode(text, { addSpecialTokens: false }));
    // By default (as vLLM) the final assistant message is closed and a new turn opens.
    assert.deepEqual((await tokenize({ messages })).body.tokens, ids(template.render(messages)));
    assert.deepEqual(
      (await tokenize({ messages, add_generation_prompt: false })).body.tokens,
      ids(template.render(messages, { addGenerationPrompt: false })),
    );
    // Continued: the prompt ends with the assistant's text, no end of turn.
    const continued = (
      await tokenize({ messages, continue_final_message: true, add_generation_prompt: false })
    ).body;
    const text = tokenizer.decode(continued.tokens, { skipSpecialTokens: false });
    assert.ok(text.endsWith("Hello the"), text);
    const both = await tokenize({ messages, continue_final_message: true, add_generation_prompt: true });
    assert.equal(both.status, 400);
    assert.equal(both.body.error?.param, "continue_final_message");
    // The same prompt on the chat endpoint.
    const { client } = servers[1]!;
    const res = await client.chat.completions.create({
      model: MODEL,
      messages,
      max_tokens: 2,
      temperature: 0,
      continue_final_message: true,
      add_generation_prompt: false,
      chat_template_kwargs: { enable_thinking: false },
    } as OpenAI.ChatCompletionCreateParamsNonStreaming);
    assert.equal(res.usage!.prompt_tokens, continued.tokens.length);
  });
});
