/**
 * `kvfence cluster` passes the router's flags on: every one it forwards is a `kvfence serve`
 * flag and reaches the router's command line with its value; and, against a real cluster (router,
 * prefill and decode processes), the request limits it was given are the ones the router enforces.
 */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { once } from "node:events";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import OpenAI from "openai";
import { modelDir } from "../../testing/start-server.js";
import { command, nodeArgsOf, type RawOptions, routerArgsOf } from "./cluster.js";
import { command as serveCommand } from "./serve.js";

const MAIN = fileURLToPath(new URL("./main.js", import.meta.url));

/** Each forwarded router flag with a value, as a user would give it to `kvfence cluster`. */
const FORWARDED: ReadonlyArray<[flag: string, value: string]> = [
  ["--api-keys", "/tmp/keys.json"],
  ["--operator-key", "op-key-0123456789abcdef"],
  ["--metrics-port", "9100"],
  ["--max-body-bytes", "8KiB"],
  ["--max-prompt-bytes", "2000"],
  ["--max-response-bytes", "16MiB"],
  ["--max-messages", "3"],
  ["--max-json-depth", "8"],
  ["--tokenizer-threads", "1"],
  ["--reasoning-parser", "qwen3"],
  ["--tenant-max-concurrency", "2"],
  ["--tenant-max-pages", "50"],
  ["--tenant-max-queue", "4"],
  ["--max-queue", "16"],
  ["--queue-timeout", "5"],
  ["--scheduling-policy", "fcfs"],
  ["--ready-timeout", "0.25"],
  ["--max-migrations", "0"],
  ["--chat-template", "tools.jinja"],
  ["--tool-call-parser", "llama3_json"],
];

test("kvfence cluster forwards the limits, the tokenizer pool and the fair-share flags to its router", () => {
  const cmd = command().action(() => {});
  cmd.parse([...FORWARDED.flat(), "--metrics-tenant-names"], { from: "user" });
  const args = routerArgsOf(cmd.opts() as RawOptions);
  const serveFlags = new Set(serveCommand().options.map((o) => o.long));
  for (const [flag, value] of FORWARDED) {
    const at = args.indexOf(flag);
    assert.ok(at >= 0, `${flag} reaches the router`);
    assert.equal(args[at + 1], value, `${flag} keeps its value`);
    assert.ok(serveFlags.has(flag), `${flag} is a kvfence serve flag`);
  }
  assert.ok(args.includes("--metrics-tenant-names"));
  const none = command().action(() => {});
  none.parse([], { from: "user" });
  assert.deepEqual(routerArgsOf(none.opts() as RawOptions), [], "nothing given, nothing forwarded");
});

test("kvfence cluster forwards the model and pool flags to every node", () => {
  const given: [string, string][] = [
    ["--quantize", "q8_0"],
    ["--kv-cache-dtype", "bf16"],
    ["--kv-pages", "64"],
    ["--kernels", "ts"],
    ["--prefix-cache", "off"],
  ];
  const cmd = command().action(() => {});
  cmd.parse(given.flat(), { from: "user" });
  const raw = cmd.opts() as RawOptions;
  const args = nodeArgsOf(raw, { unsafeFault: [], unsafeDisableGuard: [] });
  const serveFlags = new Set(serveCommand().options.map((o) => o.long));
  for (const [flag, value] of given) {
    const at = args.indexOf(flag);
    assert.ok(at >= 0, `${flag} reaches the nodes`);
    assert.equal(args[at + 1], value, `${flag} keeps its value`);
    assert.ok(serveFlags.has(flag), `${flag} is a kvfence serve flag`);
  }
});

/** `kvfence cluster` as a child process; resolves with its router's URL once it printed it. */
async function cluster(args: readonly string[]): Promise<{ url: string; stop(): Promise<void> }> {
  const child = spawn(
    process.execPath,
    [MAIN, "cluster", "--port", "0", "--model", modelDir("tiny-qwen2"), "--kv-pages", "160", ...args],
    { stdio: ["ignore", "pipe", "pipe"] },
  );
  let stderr = "";
  child.stderr.on("data", (d: Buffer) => {
    stderr += d.toString();
  });
  let stdout = "";
  return new Promise((resolve, reject) => {
    child.stdout.on("data", (d: Buffer) => {
      stdout += d.toString();
      const match = /kvfence cluster at (\S+) /.exec(stdout);
      if (match === null) return;
      resolve({
        url: match[1]!,
        stop: async () => {
          const exited = once(child, "exit");
          child.kill("SIGTERM");
          await exited;
        },
      });
    });
    child.on("exit", (code) => reject(new Error(`kvfence cluster exited with code ${code}: ${stderr}`)));
  });
}

test("kvfence cluster's router enforces the request limits it was given", { timeout: 120_000 }, async () => {
  const c = await cluster([
    "--max-body-bytes",
    "4096",
    "--max-prompt-bytes",
    "1000",
    "--max-messages",
    "3",
    "--max-json-depth",
    "8",
    "--tokenizer-threads",
    "1",
  ]);
  try {
    const client = new OpenAI({ baseURL: `${c.url}/v1`, apiKey: "none", maxRetries: 0 });
    const model = (await client.models.list()).data[0]!.id;
    const refusal = async (body: Parameters<typeof client.chat.completions.create>[0]) => {
      try {
        await client.chat.completions.create(body);
      } catch (err) {
        if (err instanceof OpenAI.APIError) return { status: err.status, message: err.message };
        throw err;
      }
      assert.fail("the request was served");
    };
    const say = (content: string) => ({ role: "user" as const, content });
    const messages = await refusal({
      model,
      messages: [say("a"), say("b"), say("c"), say("d")],
      max_tokens: 1,
    });
    assert.equal(messages.status, 400);
    assert.match(messages.message, /--max-messages/);
    const prompt = await refusal({ model, messages: [say("x".repeat(1500))], max_tokens: 1 });
    assert.equal(prompt.status, 400);
    assert.match(prompt.message, /--max-prompt-bytes/);
    const post = (body: string) =>
      fetch(`${c.url}/v1/chat/completions`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body,
      });
    const big = await post(JSON.stringify({ model, messages: [say("y".repeat(5000))] }));
    assert.equal(big.status, 413);
    assert.match(((await big.json()) as { error: { message: string } }).error.message, /--max-body-bytes/);
    const deep = await post(`{"model":"${model}","messages":[],"x":${"[".repeat(10)}${"]".repeat(10)}}`);
    assert.equal(deep.status, 400);
    assert.match(((await deep.json()) as { error: { message: string } }).error.message, /--max-json-depth/);
    // Under every limit: served.
    const ok = await client.chat.completions.create({ model, messages: [say("hello")], max_tokens: 2 });
    assert.equal(ok.choices.length, 1);
  } finally {
    await c.stop();
  }
});
