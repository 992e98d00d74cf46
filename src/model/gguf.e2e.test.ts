/**
 * `kvfence serve --model FILE.gguf` end to end (issue #15 item 2): the bundled kvfence-tiny saved as
 * safetensors in bf16 and the same weights as a GGUF file in bf16 (testing/gguf-writer.ts), each
 * served in the default topology (prefill and decode nodes in worker threads), answer the same
 * greedy chat completions token for token through the official `openai` client; the GGUF's model
 * card names the file, and a Q8_0 GGUF serves as well; so do the committed Q4_K_M and Q5_K_M files
 * that ggml quantised (testing/fixtures, scripts/kquant-fixtures.mjs), the same answers in the
 * default topology as on one engine.
 */
import assert from "node:assert/strict";
import { copyFileSync, mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import OpenAI from "openai";
import { writeGgufFromFolder } from "../../testing/gguf-writer.js";
import { modelDir, startTestServer, type TestServer } from "../../testing/start-server.js";
import { packageRoot } from "../lib/package-root.js";
import { SafetensorsFile, writeSafetensors } from "./safetensors.js";

const tmp = mkdtempSync(join(tmpdir(), "kvfence-gguf-e2e-"));
const PROMPTS = [
  "the access code of account 4821 is QX7-PL2. the weather was mild.\nWhat is the access code of account 4821?",
  "the pin of locker 77 is 9031. lunch was late.\nWhat is the pin of locker 77?",
  "hello",
];

/** kvfence-tiny with its weights stored as BF16 safetensors. */
function bf16Folder(): string {
  const src = modelDir("kvfence-tiny");
  const dir = join(tmp, "kvfence-tiny-bf16");
  mkdirSync(dir);
  for (const f of ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"])
    copyFileSync(join(src, f), join(dir, f));
  const st = SafetensorsFile.open(join(src, "model.safetensors"));
  writeSafetensors(
    join(dir, "model.safetensors"),
    st.names().map((name) => ({
      name,
      shape: st.info(name)?.shape ?? [],
      data: st.toFloat32(name),
      dtype: "BF16" as const,
    })),
  );
  return dir;
}

let folder: string;
let bf16: string;
let q8: string;
const servers: TestServer[] = [];

before(() => {
  folder = bf16Folder();
  bf16 = join(tmp, "kvfence-tiny-bf16.gguf");
  q8 = join(tmp, "kvfence-tiny-q8_0.gguf");
  writeGgufFromFolder(folder, bf16, { dtype: "bf16" });
  writeGgufFromFolder(folder, q8, { dtype: "q8_0" });
});

after(async () => {
  await Promise.all(servers.map((s) => s.close()));
  rmSync(tmp, { recursive: true, force: true });
});

async function serve(model: string, kernels?: "wasm" | "native"): Promise<{ client: OpenAI; id: string }> {
  const server = await startTestServer({
    model,
    kvPages: 128,
    disaggregation: true,
    ...(kernels === undefined ? {} : { kernels }),
  });
  servers.push(server);
  const client = new OpenAI({ baseURL: server.baseURL, apiKey: "unused", maxRetries: 0 });
  const models = await client.models.list();
  return { client, id: models.data[0]?.id as string };
}

async function answers(client: OpenAI, id: string): Promise<string[]> {
  const out: string[] = [];
  for (const content of PROMPTS) {
    const r = await client.chat.completions.create({
      model: id,
      messages: [{ role: "user", content }],
      temperature: 0,
      max_tokens: 48,
    });
    out.push(`${r.choices[0]?.message.content}|${r.usage?.prompt_tokens}|${r.usage?.completion_tokens}`);
  }
  return out;
}

test("safetensors-bf16 and GGUF-bf16 of the same model give identical greedy answers (default topology)", async () => {
  const st = await serve(folder);
  const gg = await serve(bf16);
  assert.equal(gg.id, "kvfence-tiny-bf16", "the model card names the GGUF file");
  const expected = await answers(st.client, st.id);
  assert.ok(expected[0]?.includes("QX7-PL2"), `the model recalls the code: ${expected[0]}`);
  assert.deepEqual(await answers(gg.client, gg.id), expected);
});

test("a Q8_0 GGUF serves: the recall prompt is answered from its context", async () => {
  const q = await serve(q8);
  const [first] = await answers(q.client, q.id);
  assert.ok(first?.includes("QX7-PL2"), `Q8_0 answer: ${first}`);
});

for (const [file, kernels] of [
  ["kvfence-tiny-q4_k_m.gguf", "native"],
  ["kvfence-tiny-q4_k_m.gguf", "wasm"],
  ["kvfence-tiny-q5_k_m.gguf", "native"],
] as const) {
  // kvfence-tiny, a character-level model, mostly no longer recalls at 4–5 bits (nor in Q4_0): the
  // answers checked are the same file's on one engine, token for token (parity-kquant.test.ts
  // checks the numbers against the dequantised reference).
  test(`${file} (ggml's Q4_K/Q5_K/Q6_K mix) serves on the ${kernels} kernels in the default topology as on one engine`, async () => {
    const path = join(packageRoot(), "testing", "fixtures", file);
    const split = await serve(path, kernels);
    assert.equal(split.id, file.replace(/\.gguf$/, ""), "the model card names the GGUF file");
    const server = await startTestServer({ model: path, kvPages: 128, kernels });
    servers.push(server);
    const one = new OpenAI({ baseURL: server.baseURL, apiKey: "unused", maxRetries: 0 });
    const expected = await answers(one, split.id);
    assert.ok(
      expected.every((a) => /\|[1-9]\d*$/.test(a)),
      `every answer has tokens: ${expected}`,
    );
    assert.deepEqual(await answers(split.client, split.id), expected);
  });
}
