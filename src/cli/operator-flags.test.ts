/**
 * `kvfence preflight` and `kvfence probe` read a kvfence router's /kvfence/nodes where the router
 * serves it: on its operator listener (`--operator-url`) when it has no operator key, or on the
 * front door with the key (`--operator-key` or env KVFENCE_OPERATOR_KEY). Against real servers,
 * the commands run as child processes of the built CLI.
 */
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import { modelDir, startTestServer, TEST_OPERATOR_KEY, type TestServer } from "../../testing/start-server.js";

const MAIN = fileURLToPath(new URL("./main.js", import.meta.url));
/** 160 pages of 16 tokens: the pool holds the model's whole 2,048-token context. */
const POOL_TOKENS = 2560;

function kvfence(
  args: readonly string[],
  env: NodeJS.ProcessEnv = {},
): Promise<{ code: number; stdout: string; stderr: string }> {
  const { KVFENCE_OPERATOR_KEY: _, ...inherited } = process.env;
  return new Promise((resolve) => {
    execFile(
      process.execPath,
      [MAIN, ...args],
      { env: { ...inherited, ...env }, timeout: 60_000 },
      (err, stdout, stderr) => {
        const code = err === null ? 0 : typeof err.code === "number" ? err.code : -1;
        resolve({ code, stdout, stderr });
      },
    );
  });
}

describe("the operator flags of preflight and probe", { timeout: 120_000 }, () => {
  let listener: TestServer;
  let keyed: TestServer;

  before(async () => {
    [listener, keyed] = await Promise.all([
      startTestServer({ model: modelDir("tiny-qwen2"), kvPages: 160, operatorKey: null }),
      startTestServer({ model: modelDir("tiny-qwen2"), kvPages: 160, operatorKey: TEST_OPERATOR_KEY }),
    ]);
  });
  after(async () => {
    await Promise.all([listener.close(), keyed.close()]);
  });

  test("preflight: --operator-url reads the operator listener, the key (flag or env) the front door", async () => {
    const operatorUrl = listener.operatorUrl!;
    const refused = await kvfence(["preflight", "--url", listener.url]);
    assert.equal(refused.code, 2, refused.stdout);
    assert.match(refused.stdout, /--operator-url/, "the refusal names the flag");
    const read = await kvfence(["preflight", "--url", listener.url, "--operator-url", operatorUrl]);
    assert.equal(read.code, 0, read.stdout + read.stderr);
    assert.match(read.stdout, /engine-0 +engine +2,560 +2,048 +PASS/);
    const alone = await kvfence(["preflight", "--operator-url", operatorUrl]);
    assert.equal(alone.code, 0, "the operator listener is enough on its own");

    const noKey = await kvfence(["preflight", "--url", keyed.url]);
    assert.equal(noKey.code, 2, noKey.stdout);
    assert.match(noKey.stdout, /--operator-key/);
    const flag = await kvfence(["preflight", "--url", keyed.url, "--operator-key", TEST_OPERATOR_KEY]);
    assert.equal(flag.code, 0, flag.stdout);
    const env = await kvfence(["preflight", "--url", keyed.url], { KVFENCE_OPERATOR_KEY: TEST_OPERATOR_KEY });
    assert.equal(env.code, 0, env.stdout);
    assert.match(env.stdout, /engine-0 +engine +2,560 +2,048 +PASS/);
  });

  test("probe: --operator-url finds the pool on the operator listener", async () => {
    const dir = mkdtempSync(join(tmpdir(), "kvfence-probe-"));
    try {
      const json = join(dir, "report.json");
      const r = await kvfence([
        "probe",
        listener.baseURL,
        "--operator-url",
        listener.operatorUrl!,
        "--requests",
        "0",
        "--plants",
        "1",
        "--max-tokens",
        "8",
        "--seed",
        "3",
        "--quiet",
        "--json",
        json,
      ]);
      assert.notEqual(r.code, 2, `the probe ran: ${r.stdout}${r.stderr}`);
      const report = JSON.parse(readFileSync(json, "utf8")) as {
        poolTokens: number;
        poolTokensSource: string;
      };
      assert.deepEqual(
        { poolTokens: report.poolTokens, source: report.poolTokensSource },
        { poolTokens: POOL_TOKENS, source: "/kvfence/nodes (smallest node pool)" },
      );
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
