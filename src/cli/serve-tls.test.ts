/**
 * `kvfence serve`'s TLS flags (docs/tls.md): a node that would expose its links in plaintext beyond
 * loopback is refused with one line and exit 2 before anything loads (nothing binds: the refusal
 * comes before the model, and the model path does not exist); TLS files are checked as early; the
 * front door serves HTTPS with `--https-cert/--https-key`; `kvfence cluster` passes the flags on.
 */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { once } from "node:events";
import { readFileSync } from "node:fs";
import https from "node:https";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { modelDir, operatorHeaders, TEST_OPERATOR_KEY } from "../../testing/start-server.js";
import {
  CLIENT_TLS_FILES,
  CLUSTER_TLS_ARGS,
  CLUSTER_TLS_FILES,
  OTHER_CA_TLS_FILES,
} from "../../testing/tls-fixtures.js";
import type { KvfenceError } from "../lib/errors.js";
import { createLogger } from "../lib/logger.js";
import { parseServeConfig } from "../server/serve-config.js";
import { startServer } from "../server/start-server.js";

const MAIN = fileURLToPath(new URL("./main.js", import.meta.url));
const NO_MODEL = "/nonexistent/kvfence-model";

async function serve(args: readonly string[]): Promise<{ code: number | null; stderr: string }> {
  const child = spawn(process.execPath, [MAIN, "serve", "--model", NO_MODEL, ...args], {
    stdio: ["ignore", "ignore", "pipe"],
    env: { ...process.env, KVFENCE_CLUSTER_SECRET: "a-cluster-secret-of-some-length" },
  });
  let stderr = "";
  child.stderr.on("data", (d: Buffer) => {
    stderr += d.toString();
  });
  const [code] = (await once(child, "exit")) as [number | null];
  return { code, stderr };
}

test("a node listening beyond loopback without TLS refuses to start: one line, exit 2, before the model", {
  timeout: 60_000,
}, async () => {
  for (const role of ["prefill", "decode"]) {
    const { code, stderr } = await serve(["--role", role, "--host", "0.0.0.0", "--port", "0"]);
    assert.equal(code, 2, stderr);
    assert.equal(stderr.split("\n").filter(Boolean).length, 1, stderr);
    assert.match(
      stderr,
      new RegExp(
        `^kvfence serve: The ${role} node would listen on 0\\.0\\.0\\.0 \\(beyond loopback\\) without TLS: prompt token ids, output tokens and KV page bodies .*plaintext.*--tls-cert.*--insecure-plaintext-links\\n$`,
      ),
    );
  }
  // A router dialling a node beyond loopback in plaintext is refused the same way.
  const router = await serve([
    "--role",
    "router",
    "--port",
    "0",
    "--prefill",
    "10.0.0.7:9001",
    "--decode",
    "127.0.0.1:9002",
  ]);
  assert.equal(router.code, 2, router.stderr);
  assert.match(
    router.stderr,
    /^kvfence serve: The router would reach the node at 10\.0\.0\.7 \(beyond loopback\) without TLS/,
  );
});

test("--insecure-plaintext-links or TLS lets such a node past the check (it then fails on the missing model)", {
  timeout: 60_000,
}, async () => {
  for (const extra of [["--insecure-plaintext-links"], [...CLUSTER_TLS_ARGS]]) {
    const { code, stderr } = await serve(["--role", "decode", "--host", "0.0.0.0", "--port", "0", ...extra]);
    assert.doesNotMatch(stderr, /beyond loopback/);
    assert.match(stderr, /nonexistent/, stderr);
    assert.equal(code, 1, stderr);
  }
});

test("TLS flags: all three together, files readable and matching, checked before the model (exit 2)", {
  timeout: 60_000,
}, async () => {
  assert.throws(
    () =>
      parseServeConfig({
        host: "127.0.0.1",
        port: "0",
        model: "m",
        pageSize: "16",
        scrubOnFree: false,
        disaggregation: true,
        logLevel: "info",
        tlsCert: CLUSTER_TLS_FILES.cert,
      }),
    (err: KvfenceError) => /--tls-cert: give --tls-cert, --tls-key and --tls-ca together/.test(err.message),
  );
  const missing = await serve([
    "--role",
    "decode",
    "--port",
    "0",
    "--tls-cert",
    "/nonexistent.crt",
    "--tls-key",
    CLUSTER_TLS_FILES.key,
    "--tls-ca",
    CLUSTER_TLS_FILES.ca,
  ]);
  assert.equal(missing.code, 2, missing.stderr);
  assert.match(missing.stderr, /^kvfence serve: Cannot read --tls-cert; give a PEM file .*ENOENT/);
  // The node's certificate with the router's key: not a pair.
  const mismatched = await serve([
    "--role",
    "decode",
    "--port",
    "0",
    "--tls-cert",
    CLUSTER_TLS_FILES.cert,
    "--tls-key",
    CLIENT_TLS_FILES.key,
    "--tls-ca",
    CLUSTER_TLS_FILES.ca,
  ]);
  assert.equal(mismatched.code, 2, mismatched.stderr);
  assert.match(mismatched.stderr, /^kvfence serve: --tls-cert and its key do not make a TLS identity/);
});

function get(
  url: string,
  ca?: Buffer,
  headers: Record<string, string> = {},
): Promise<{ status: number; body: string }> {
  return new Promise((resolve, reject) => {
    https
      .get(url, ca === undefined ? { headers } : { ca, headers }, (res) => {
        let body = "";
        res.on("data", (d: Buffer) => {
          body += d.toString();
        });
        res.on("end", () => resolve({ status: res.statusCode ?? 0, body }));
      })
      .on("error", reject);
  });
}

test("--https-cert/--https-key: the front door serves HTTPS; plain HTTP and an untrusted client fail", {
  timeout: 120_000,
}, async (t) => {
  const server = await startServer(
    parseServeConfig({
      host: "127.0.0.1",
      port: "0",
      model: modelDir("tiny-qwen2"),
      pageSize: "16",
      kvPages: "160",
      scrubOnFree: false,
      disaggregation: false,
      logLevel: "silent",
      httpsCert: CLUSTER_TLS_FILES.cert,
      httpsKey: CLUSTER_TLS_FILES.key,
    }),
    { logger: createLogger({ level: "silent" }) },
  );
  t.after(() => server.close());
  assert.match(server.url, /^https:\/\/127\.0\.0\.1:\d+$/);
  const ca = readFileSync(CLUSTER_TLS_FILES.ca);
  const health = await get(`${server.url}/health`, ca);
  assert.equal(health.status, 200, health.body);
  // A client that does not trust the CA refuses the server; plain HTTP gets no answer.
  await assert.rejects(get(`${server.url}/health`), /certificate/);
  await assert.rejects(fetch(`${server.url.replace("https:", "http:")}/health`));
});

/** Runs `kvfence cluster` until it prints its URL (resolves) or exits (rejects with its stderr). */
async function cluster(args: readonly string[]): Promise<{ url: string; stop(): Promise<void> }> {
  const child = spawn(
    process.execPath,
    [
      MAIN,
      "cluster",
      "--prefill",
      "1",
      "--decode",
      "1",
      "--port",
      "0",
      "--model",
      modelDir("tiny-qwen2"),
      "--kv-pages",
      "160",
      ...args,
    ],
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
      if (match !== null)
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

test("kvfence cluster passes --tls-* to every process and --https-* to its router", {
  timeout: 120_000,
}, async () => {
  const F = CLUSTER_TLS_FILES;
  const running = await cluster([
    ...CLUSTER_TLS_ARGS,
    "--https-cert",
    F.cert,
    "--https-key",
    F.key,
    "--operator-key",
    TEST_OPERATOR_KEY,
  ]);
  try {
    assert.match(running.url, /^https:\/\//);
    const nodes = await get(`${running.url}/kvfence/nodes`, readFileSync(F.ca), operatorHeaders());
    assert.equal(nodes.status, 200, nodes.body);
  } finally {
    await running.stop();
  }
  // Certificates from another CA on every process: the nodes refuse the router, so the flags did
  // reach the children (without them the cluster would start in plaintext).
  await assert.rejects(
    cluster([
      "--tls-cert",
      OTHER_CA_TLS_FILES.cert,
      "--tls-key",
      OTHER_CA_TLS_FILES.key,
      "--tls-ca",
      F.ca,
    ]).then(async (started) => {
      await started.stop(); // it should not have started; leave nothing running
      return started;
    }),
    /exited with code 1: .*Cannot reach the node .*certificate is issued by --tls-ca/s,
  );
});
