/**
 * End to end (issue #17 item 4): the sampling controls of OpenAI, vLLM and SGLang change the
 * answer as those servers define them, and give the same answer in every topology — one engine
 * (`--no-disaggregation`), the threaded default, and a TCP cluster of one prefill and one decode
 * process — since they run where the token is sampled (the prefill node samples the first token,
 * the decode node the rest: the controls travel to both). Official `openai` client over real
 * HTTP on 127.0.0.1 (tiny-qwen2); every pool FREE after.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { assertPoolIdle, modelDir } from "../../testing/start-server.js";
import { startCluster, startInProcess, type TopologyServer } from "../../testing/topology-servers.js";
import { ModelTokenizer } from "../model/tokenizer.js";

const MODEL = "tiny-qwen2";
const KEY = "sk-sampling-controls-1";
const EOS = 258; // <|im_end|>, one of tiny-qwen2's EOS ids

/** Extension fields the `openai` types do not know: sent as they are in the body. */
type Extra = Record<string, unknown>;

interface Answer {
  readonly text: string;
  readonly finish: string | null;
  readonly stopReason: unknown;
  readonly completionTokens: number;
}

describe("sampling controls, in every topology", { timeout: 120_000 }, () => {
  const tokenizer = ModelTokenizer.fromFolder(modelDir(MODEL));
  const X = tokenizer.encode("x", { addSpecialTokens: false })[0]!;
  const servers: { name: string; server: TopologyServer; client: OpenAI }[] = [];

  before(async () => {
    const options = { model: modelDir(MODEL), kvPages: 128, maxModelLen: 512, apiKeys: { [KEY]: "alpha" } };
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
});
