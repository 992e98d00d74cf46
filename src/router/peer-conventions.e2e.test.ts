/**
 * SGLang's `matched_stop` on the real server, on both topologies (one engine in its worker thread;
 * prefill and decode nodes): the bundled kvfence-tiny has two EOS ids (258 and 256), so the router
 * cannot guess which one ended an answer — the engine names it (the worker's finish, the decode
 * node's `finished` message, prefill's first token). `logit_bias` makes the model write one EOS id;
 * `min_tokens` holds it back so that the decode node, not prefill, samples it. vLLM's
 * `stop_reason` stays null for EOS.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { modelDir, startTestServer, type TestServer } from "../../testing/start-server.js";

for (const disaggregation of [false, true]) {
  describe(`matched_stop names the EOS id (${disaggregation ? "prefill and decode nodes" : "one engine"})`, () => {
    let server: TestServer;
    let client: OpenAI;

    before(async () => {
      server = await startTestServer({ model: modelDir("kvfence-tiny"), kvPages: 128, disaggregation });
      client = new OpenAI({ baseURL: server.baseURL, apiKey: "unused", maxRetries: 0 });
    });
    after(() => server.close());

    test("matched_stop is the EOS id the model wrote, first or later token, whole and streamed", async () => {
      for (const eos of [258, 256])
        for (const minTokens of [0, 2]) {
          const body = {
            model: "kvfence-tiny",
            messages: [{ role: "user" as const, content: "hi" }],
            max_tokens: 8,
            logit_bias: { [eos]: 100 },
            ...(minTokens === 0 ? {} : { min_tokens: minTokens }),
          };
          const whole = await client.chat.completions.create(body);
          const choice = whole.choices[0] as unknown as {
            finish_reason: string;
            stop_reason: unknown;
            matched_stop: unknown;
          };
          assert.deepEqual(
            [choice.finish_reason, choice.stop_reason, choice.matched_stop, whole.usage!.completion_tokens],
            ["stop", null, eos, minTokens + 1],
            `EOS ${eos}, min_tokens ${minTokens}`,
          );
          let last: unknown;
          for await (const chunk of await client.chat.completions.create({ ...body, stream: true }))
            if (chunk.choices[0]?.finish_reason) last = chunk.choices[0];
          assert.equal((last as { matched_stop: unknown }).matched_stop, eos);
        }
    });
  });
}
