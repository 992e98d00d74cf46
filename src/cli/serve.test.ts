import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { once } from "node:events";
import { copyFileSync, existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { modelDir } from "../../testing/start-server.js";
import { KvfenceError } from "../lib/errors.js";
import { createLogger } from "../lib/logger.js";
import { fairShareOf, kernelOptions, parseByteSize, parseServeConfig } from "../server/serve-config.js";
import { startNode, startServer } from "../server/start-server.js";

const MAIN = fileURLToPath(new URL("./main.js", import.meta.url));

const defaults = {
  host: "127.0.0.1",
  port: "8000",
  model: "m",
  pageSize: "16",
  scrubOnFree: false,
  disaggregation: true,
  logLevel: "info",
};

test("parseByteSize() reads binary and decimal units", () => {
  assert.equal(parseByteSize("256MiB"), 256 * 1024 * 1024);
  assert.equal(parseByteSize("1.5 GiB"), 1.5 * 1024 ** 3);
  assert.equal(parseByteSize("10MB"), 10_000_000);
  assert.equal(parseByteSize("4096"), 4096);
  assert.equal(parseByteSize("12 parsecs"), null);
  assert.equal(parseByteSize("-1MiB"), null);
});

test("parseServeConfig() returns a frozen typed config", () => {
  const config = parseServeConfig({ ...defaults, kvMemory: "64MiB", maxModelLen: "512" });
  assert.equal(config.port, 8000);
  assert.equal(config.kvMemory, 64 * 1024 * 1024);
  assert.equal(config.maxModelLen, 512);
  assert.ok(Object.isFrozen(config));
});

test("kernelOptions() takes the resolved kernels with 1 thread per node, 2 on one engine; --kernels defaults to auto; flags override", () => {
  // auto is resolved at start-up (withChosenKernels) before any engine options are made.
  assert.equal(parseServeConfig(defaults).kernels, "auto");
  assert.throws(() => kernelOptions(parseServeConfig(defaults)), /--kernels auto is resolved first/);
  const wasm = { ...defaults, kernels: "wasm" };
  assert.deepEqual(kernelOptions(parseServeConfig(wasm)), { kernels: "wasm", kernelThreads: 1 });
  assert.deepEqual(kernelOptions(parseServeConfig({ ...wasm, disaggregation: false })), {
    kernels: "wasm",
    kernelThreads: 2,
  });
  assert.deepEqual(kernelOptions(parseServeConfig({ ...defaults, kernels: "native" })), {
    kernels: "native",
    kernelThreads: 1,
  });
  assert.deepEqual(kernelOptions(parseServeConfig({ ...wasm, role: "decode" })), {
    kernels: "wasm",
    kernelThreads: 1,
  });
  assert.deepEqual(kernelOptions(parseServeConfig({ ...defaults, kernels: "ts", kernelThreads: "2" })), {
    kernels: "ts",
    kernelThreads: 2,
  });
  assert.throws(
    () => parseServeConfig({ ...defaults, kernels: "cuda", kernelThreads: "3" }),
    (err: unknown) =>
      err instanceof KvfenceError &&
      /--kernels: /.test(err.message) &&
      /--kernel-threads: must be an integer from 1 to 2: got "3"/.test(err.message),
  );
});

test("--otlp-endpoint takes an http(s) URL, --no-phase-metrics turns the histograms off; both off by default", () => {
  const plain = parseServeConfig(defaults);
  assert.equal(plain.otlpEndpoint, undefined);
  assert.equal(plain.phaseMetrics, true);
  const on = parseServeConfig({ ...defaults, otlpEndpoint: "http://127.0.0.1:4318", phaseMetrics: false });
  assert.equal(on.otlpEndpoint, "http://127.0.0.1:4318");
  assert.equal(on.phaseMetrics, false);
  for (const bad of ["127.0.0.1:4318", "ftp://collector/", "not a url"]) {
    assert.throws(
      () => parseServeConfig({ ...defaults, otlpEndpoint: bad }),
      (err: unknown) =>
        err instanceof KvfenceError &&
        /--otlp-endpoint: must be an http:\/\/ or https:\/\/ URL/.test(err.message),
      bad,
    );
  }
});

test("parseServeConfig() reports every problem with its flag", () => {
  assert.throws(
    () => parseServeConfig({ ...defaults, port: "http", pageSize: "0", kvMemory: "lots", kvPages: "9" }),
    (err: unknown) => {
      assert.ok(err instanceof KvfenceError);
      assert.equal(err.code, "config_invalid");
      assert.match(err.message, /--port: must be an integer from 0 to 65535: got "http"/);
      assert.match(err.message, /--page-size: must be an integer from 1 to 1024: got "0"/);
      assert.match(err.message, /--kv-memory: must be a size like 256MiB/);
      return true;
    },
  );
  assert.throws(
    () => parseServeConfig({ ...defaults, kvMemory: "1MiB", kvPages: "9" }),
    /--kv-pages: give either/,
  );
});

test("parseServeConfig() reads the fair-share and readiness flags; fairShareOf() adds the tenants and their limits", () => {
  const config = parseServeConfig({
    ...defaults,
    tenantMaxConcurrency: "4",
    tenantMaxPages: "0",
    maxQueue: "32",
    queueTimeout: "2.5",
    schedulingPolicy: "fcfs",
    readyTimeout: "0.25",
  });
  assert.deepEqual(fairShareOf(config, { count: 3, limits: new Map([[1, { weight: 2 }]]) }), {
    tenants: 3,
    tenantMaxConcurrency: 4,
    tenantMaxPages: 0,
    tenantMaxQueue: undefined,
    maxQueue: 32,
    queueTimeoutMs: 2500,
    schedulingPolicy: "fcfs",
    overrides: new Map([[1, { weight: 2 }]]),
  });
  assert.equal(config.readyTimeout, 0.25);
  assert.equal(fairShareOf(parseServeConfig(defaults), { count: 0, limits: new Map() }).tenants, 1);
  assert.equal(parseServeConfig(defaults).schedulingPolicy, "fair");
  assert.throws(() => parseServeConfig({ ...defaults, schedulingPolicy: "lifo" }), /--scheduling-policy/);
  assert.throws(() => parseServeConfig({ ...defaults, reasoningParser: "r1" }), /--reasoning-parser/);
  assert.equal(
    parseServeConfig({ ...defaults, reasoningParser: "deepseek_r1" }).reasoningParser,
    "deepseek_r1",
  );
  assert.throws(
    () => parseServeConfig({ ...defaults, tenantMaxQueue: "-1", queueTimeout: "soon", readyTimeout: "0" }),
    (err: unknown) =>
      err instanceof KvfenceError &&
      /--tenant-max-queue: must be an integer from 0/.test(err.message) &&
      /--queue-timeout: must be seconds above 0, at most 86400: got "soon"/.test(err.message) &&
      /--ready-timeout: must be seconds above 0/.test(err.message),
  );
});

test("kvfence serve exits 2 on bad options, listing each", { timeout: 30_000 }, async () => {
  const child = spawn(process.execPath, [MAIN, "serve", "--port", "abc", "--max-model-len", "-4"], {
    stdio: "pipe",
  });
  let stderr = "";
  child.stderr.on("data", (d: Buffer) => {
    stderr += d.toString();
  });
  const [code] = await once(child, "exit");
  assert.equal(code, 2);
  assert.match(stderr, /--port: /);
  assert.match(stderr, /--max-model-len: /);
});

test("kvfence serve prints its URL when ready and exits 0 on SIGTERM", { timeout: 60_000 }, async () => {
  const child = spawn(
    process.execPath,
    [
      MAIN,
      "serve",
      "--port",
      "0",
      "--model",
      modelDir("tiny-qwen2"),
      "--kv-pages",
      "160",
      "--no-disaggregation",
    ],
    { stdio: "pipe", env: { ...process.env, KVFENCE_LOG_LEVEL: "warn" } },
  );
  try {
    let stdout = "";
    let stderr = "";
    child.stderr.on("data", (d: Buffer) => {
      stderr += d.toString();
    });
    const url = await new Promise<string>((resolve, reject) => {
      child.stdout.on("data", (d: Buffer) => {
        stdout += d.toString();
        const match = /at (http:\/\/127\.0\.0\.1:\d+) /.exec(stdout);
        if (match !== null) resolve(match[1]!);
      });
      child.on("exit", (code) => reject(new Error(`kvfence serve exited early with code: ${code}`)));
    });
    const health = await fetch(`${url}/health`);
    assert.equal(health.status, 200);
    // The bundled model loads in well under a second: no progress bar, only the summary line.
    assert.doesNotMatch(stderr, /Loading weights/);
    assert.match(stderr, /Loaded tiny-qwen2: \d+ layers/);
    assert.match(stderr, /no API keys configured .*anonymous tenant/);
    const exited = once(child, "exit");
    child.kill("SIGTERM");
    const [code] = await exited;
    assert.equal(code, 0);
  } finally {
    if (child.exitCode === null) child.kill("SIGKILL");
  }
});

test("startServer() refuses a port that is taken before it loads the weights", async () => {
  const holder = net.createServer();
  await new Promise<void>((resolve) => holder.listen(0, "127.0.0.1", resolve));
  const port = (holder.address() as net.AddressInfo).port;
  const progress: string[] = [];
  try {
    await assert.rejects(
      startServer(
        parseServeConfig({
          ...defaults,
          port: String(port),
          model: modelDir("kvfence-tiny"),
          logLevel: "silent",
        }),
        { logger: createLogger({ level: "silent" }), progress: (line) => progress.push(line) },
      ),
      (err: KvfenceError) => {
        assert.equal(err.code, "config_invalid");
        assert.match(
          err.message,
          new RegExp(`^Cannot listen on 127\\.0\\.0\\.1:${port}: .*EADDRINUSE.*; pick another --port`),
        );
        return true;
      },
    );
    assert.deepEqual(progress, [], "no weights were loaded");
  } finally {
    holder.close();
  }
});

test("kvfence serve on a taken port exits 1, its node threads (started before the model loads) stopped", {
  timeout: 60_000,
}, async () => {
  const holder = net.createServer();
  await new Promise<void>((resolve) => holder.listen(0, "127.0.0.1", resolve));
  const port = (holder.address() as net.AddressInfo).port;
  try {
    const child = spawn(process.execPath, [MAIN, "serve", modelDir("kvfence-tiny"), "--port", String(port)], {
      stdio: "pipe",
    });
    let stderr = "";
    child.stderr.on("data", (d: Buffer) => {
      stderr += d.toString();
    });
    // A worker thread left running would keep the process alive past its refusal.
    const [code] = await once(child, "exit");
    assert.equal(code, 1);
    assert.match(stderr, /Cannot listen on 127\.0\.0\.1:\d+: .*EADDRINUSE/);
  } finally {
    holder.close();
  }
});

test("startNode() and startServer(--role router) refuse a weak cluster secret before they load the weights", async () => {
  // A model folder with its config but no weights: loading the weights would fail differently.
  const dir = mkdtempSync(join(tmpdir(), "kvfence-noweights-"));
  try {
    for (const file of ["config.json", "tokenizer.json", "tokenizer_config.json"]) {
      const from = join(modelDir("kvfence-tiny"), file);
      if (existsSync(from)) copyFileSync(from, join(dir, file));
    }
    const logger = createLogger({ level: "silent" });
    for (const role of ["decode", "prefill", "router"] as const) {
      const config = parseServeConfig({
        ...defaults,
        port: "0",
        role,
        model: dir,
        clusterSecret: "aaaaaaaaaaaaaaaaaaaa",
        ...(role === "router" ? { prefill: ["127.0.0.1:1"], decode: ["127.0.0.1:2"] } : {}),
        logLevel: "silent",
      });
      const progress: string[] = [];
      await assert.rejects(
        role === "router"
          ? startServer(config, { logger, progress: (l) => progress.push(l) })
          : startNode(config, { logger }),
        (err: KvfenceError) => {
          assert.equal(err.code, "config_invalid", role);
          assert.match(err.message, /^Cluster secret is too weak; .*too few distinct characters/, role);
          return true;
        },
      );
      assert.deepEqual(progress, [], "no weights were loaded");
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("kvfence serve MODEL with vLLM's serving flags: names, keys, seed, generation config, chat template, tool-call parser", {
  timeout: 60_000,
}, async () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-serve-flags-"));
  const template = join(dir, "template.jinja");
  // It renders tools but names no tool-call format: --tool-call-parser names it.
  writeFileSync(
    template,
    "{% for m in messages %}[{{ m.content }}]{% endfor %}{% if tools %}{{ tools | length }}{% endif %}",
  );
  const child = spawn(
    process.execPath,
    [
      MAIN,
      "serve",
      modelDir("tiny-qwen2"),
      "--port",
      "0",
      "--kv-pages",
      "160",
      "--no-disaggregation",
      "--served-model-name",
      "tiny",
      "tiny-alias",
      "--api-key",
      "sk-cli-key-0001",
      "--api-key",
      "sk-cli-key-0002",
      "--max-num-seqs",
      "4",
      "--max-queued-requests",
      "8",
      "--seed",
      "3",
      "--generation-config",
      "vllm",
      "--chat-template",
      template,
      "--tool-call-parser",
      "llama3_json",
    ],
    { stdio: "pipe", env: { ...process.env, KVFENCE_LOG_LEVEL: "warn" } },
  );
  try {
    let stdout = "";
    const url = await new Promise<string>((resolve, reject) => {
      child.stdout.on("data", (d: Buffer) => {
        stdout += d.toString();
        const match = /at (http:\/\/127\.0\.0\.1:\d+) /.exec(stdout);
        if (match !== null) resolve(match[1]!);
      });
      child.on("exit", (code) => reject(new Error(`kvfence serve exited early with code: ${code}`)));
    });
    const get = (path: string, key: string | null) =>
      fetch(`${url}${path}`, { headers: key === null ? {} : { authorization: `Bearer ${key}` } });
    assert.equal((await get("/v1/models", null)).status, 401);
    const models = (await (await get("/v1/models", "sk-cli-key-0002")).json()) as { data: { id: string }[] };
    assert.deepEqual(
      models.data.map((m) => m.id),
      ["tiny", "tiny-alias"],
    );
    const post = (path: string, body: object) =>
      fetch(`${url}${path}`, {
        method: "POST",
        headers: { "content-type": "application/json", authorization: "Bearer sk-cli-key-0001" },
        body: JSON.stringify(body),
      });
    // The template file renders the messages; the alias is served under the first name.
    const tokens = (await (
      await post("/tokenize", { messages: [{ role: "user", content: "hi" }] })
    ).json()) as {
      tokens: number[];
    };
    const plain = (await (await post("/tokenize", { prompt: "[hi]", add_special_tokens: false })).json()) as {
      tokens: number[];
    };
    assert.deepEqual(tokens.tokens, plain.tokens);
    const answer = (await (
      await post("/v1/chat/completions", {
        model: "tiny-alias",
        messages: [{ role: "user", content: "hi" }],
        max_tokens: 2,
      })
    ).json()) as { model: string; choices: unknown[] };
    assert.equal(answer.model, "tiny");
    assert.equal(answer.choices.length, 1);
    const tool = {
      type: "function",
      function: { name: "f", parameters: { type: "object", properties: {} } },
    };
    const withTools = await post("/v1/chat/completions", {
      model: "tiny",
      messages: [{ role: "user", content: "hi" }],
      tools: [tool],
      max_tokens: 2,
    });
    assert.equal(withTools.status, 200, await withTools.clone().text());
  } finally {
    if (child.exitCode === null) child.kill("SIGKILL");
    rmSync(dir, { recursive: true, force: true });
  }
});

test("startServer() refuses --max-model-len above the model's window, and --generation-config without one", async () => {
  await assert.rejects(
    startServer(
      parseServeConfig({
        ...defaults,
        model: modelDir("tiny-qwen2"),
        port: "0",
        maxModelLen: "4096",
        kvPages: "512",
      }),
      { logger: createLogger({ level: "silent" }) },
    ),
    /--max-model-len 4096 is above the model's window of 2048 tokens/,
  );
  assert.throws(
    () => parseServeConfig({ ...defaults, generationConfig: tmpdir() }),
    /--generation-config: must be auto, vllm, or a folder holding a generation_config.json/,
  );
});

test("--quantize takes q8_0 or q4_0 (default: keep the folder's format) and names itself when wrong", () => {
  assert.equal(parseServeConfig(defaults).quantize, undefined);
  assert.equal(parseServeConfig({ ...defaults, quantize: "q4_0" }).quantize, "q4_0");
  assert.throws(
    () => parseServeConfig({ ...defaults, quantize: "q5_k" }),
    (err: unknown) =>
      err instanceof KvfenceError && /--quantize: /.test(err.message) && /q8_0/.test(err.message),
  );
});
