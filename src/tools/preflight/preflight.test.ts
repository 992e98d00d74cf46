import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { startStaticServer } from "../../../testing/fake-openai-server.js";
import { sglangServerInfo, startFakeSglang } from "../../../testing/fake-sglang.js";
import { startFakeVllm, vllmMetricsText } from "../../../testing/fake-vllm.js";
import { renderPreflightTable, runPreflight } from "./preflight.js";
import { sglangCapacityFromInfo } from "./sglang-info.js";
import { vllmPoolFromMetrics } from "./vllm-info.js";

const CONTEXT = 1_048_576;
const INCIDENT_POOL = 681_280;
const GOOD_POOL = 2_040_000;

test("runPreflight() fails a kvfence prefill node whose pool is smaller than the router's context", async () => {
  const fake = await startStaticServer({
    "/kvfence/nodes": {
      json: {
        max_model_len: CONTEXT,
        nodes: [
          {
            id: "prefill-0",
            role: "prefill",
            url: "tcp://10.0.0.1:7000",
            pool_tokens: INCIDENT_POOL,
            page_size: 16,
            max_model_len: CONTEXT,
          },
          {
            id: "decode-0",
            role: "decode",
            url: "tcp://10.0.0.2:7000",
            pool_tokens: GOOD_POOL,
            page_size: 16,
            max_model_len: CONTEXT,
          },
        ],
      },
    },
  });
  try {
    const report = await runPreflight({ kvfenceUrl: fake.url });
    assert.equal(report.exitCode, 1);
    assert.deepEqual(
      report.rows.map((r) => [r.node, r.role, r.verdict]),
      [
        ["prefill-0", "prefill", "fail"],
        ["decode-0", "decode", "pass"],
      ],
    );
    const table = renderPreflightTable(report);
    assert.match(table, /prefill-0\s+prefill\s+681,280\s+1,048,576\s+FAIL/);
  } finally {
    await fake.close();
  }
});

test("runPreflight() reports an error row (exit 2) when /kvfence/nodes does not match admin-wire", async () => {
  const fake = await startStaticServer({
    "/kvfence/nodes": { json: { max_model_len: CONTEXT, nodes: [{ id: "x" }] } },
  });
  try {
    const report = await runPreflight({ kvfenceUrl: fake.url });
    assert.equal(report.exitCode, 2);
    assert.equal(report.rows[0]?.verdict, "error");
    assert.match(report.rows[0]?.note ?? "", /admin-wire/);
  } finally {
    await fake.close();
  }
});

test("runPreflight() reads SGLang's /server_info, taking the context from /v1/models when the arg is null", async () => {
  const bad = await startFakeSglang({
    contextLength: CONTEXT,
    maxTotalNumTokens: INCIDENT_POOL,
    disaggregationMode: "prefill",
  });
  const good = await startFakeSglang({
    contextLength: CONTEXT,
    maxTotalNumTokens: GOOD_POOL,
    disaggregationMode: "decode",
  });
  try {
    const report = await runPreflight({ sglangUrls: [bad.url, good.url] });
    assert.equal(report.exitCode, 1);
    const [p, d] = report.rows;
    assert.equal(p?.role, "prefill");
    assert.equal(p?.poolTokens, INCIDENT_POOL);
    assert.equal(p?.contextLength, CONTEXT);
    assert.equal(p?.verdict, "fail");
    assert.match(p?.note ?? "", /v1\/models/);
    assert.equal(d?.role, "decode");
    assert.equal(d?.verdict, "pass");
  } finally {
    await bad.close();
    await good.close();
  }
});

test("runPreflight() falls back to SGLang's older /get_server_info", async () => {
  const fake = await startFakeSglang({ contextLength: CONTEXT, maxTotalNumTokens: GOOD_POOL, legacy: true });
  try {
    const report = await runPreflight({ sglangUrls: [fake.url] });
    assert.equal(report.exitCode, 0);
    assert.equal(report.rows[0]?.verdict, "pass");
    assert.deepEqual(fake.hits.slice(0, 2), ["/server_info", "/get_server_info"]);
    assert.ok(!fake.hits.includes("/v1/models"), "context_length was set, /v1/models is not needed");
  } finally {
    await fake.close();
  }
});

test("sglangCapacityFromInfo() reads the pool from internal_states when the top level lacks it", () => {
  const info = sglangServerInfo({ contextLength: 4096, maxTotalNumTokens: 20_480, pageSize: 64 });
  delete info.max_total_num_tokens;
  const c = sglangCapacityFromInfo(info);
  assert.equal(c.poolTokens, 20_480);
  assert.equal(c.pageSize, 64);
  assert.equal(c.contextLength, null);
  assert.equal(c.role, "engine");
});

test("runPreflight() reads vLLM's cache_config_info blocks × block_size and /v1/models max_model_len", async () => {
  const bad = await startFakeVllm({
    maxModelLen: CONTEXT,
    blockSize: 16,
    numGpuBlocks: [INCIDENT_POOL / 16],
  });
  const good = await startFakeVllm({ maxModelLen: CONTEXT, blockSize: 16, numGpuBlocks: [GOOD_POOL / 16] });
  try {
    const failing = await runPreflight({ vllmUrls: [bad.url] });
    assert.equal(failing.exitCode, 1);
    assert.equal(failing.rows[0]?.poolTokens, INCIDENT_POOL);
    assert.equal(failing.rows[0]?.pageSize, 16);
    const passing = await runPreflight({ vllmUrls: [good.url] });
    assert.equal(passing.exitCode, 0);
    assert.equal(passing.rows[0]?.poolTokens, GOOD_POOL);
  } finally {
    await bad.close();
    await good.close();
  }
});

test("vllmPoolFromMetrics() takes the smallest engine and ignores num_gpu_blocks=None", () => {
  assert.equal(
    vllmPoolFromMetrics(vllmMetricsText({ maxModelLen: 1, blockSize: 16, numGpuBlocks: [100, 50] }))
      .poolTokens,
    800,
  );
  const none = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n';
  assert.deepEqual(vllmPoolFromMetrics(none), { poolTokens: null, blockSize: 16 });
});

test("runPreflight() marks an unreachable server as an error (exit 2)", async () => {
  const fake = await startStaticServer({});
  const url = fake.url;
  await fake.close();
  const report = await runPreflight({ vllmUrls: [url], timeoutMs: 2000 });
  assert.equal(report.exitCode, 2);
  assert.equal(report.rows[0]?.verdict, "error");
  assert.match(report.rows[0]?.note ?? "", /Cannot reach/);
});

test("runPreflight() offline computes an MLA pool with SGLang's formula and states the weights estimate", async () => {
  const config = {
    hidden_size: 7168,
    num_hidden_layers: 61,
    num_attention_heads: 128,
    intermediate_size: 18432,
    moe_intermediate_size: 2048,
    n_routed_experts: 256,
    n_shared_experts: 1,
    first_k_dense_replace: 3,
    q_lora_rank: 1536,
    kv_lora_rank: 512,
    qk_nope_head_dim: 128,
    qk_rope_head_dim: 64,
    v_head_dim: 128,
    vocab_size: 129280,
  };
  const gib = 2 ** 30;
  const given = await runPreflight({
    offline: {
      config,
      gpuMemoryBytes: 141 * gib,
      dtype: "fp8",
      kvDtype: "bf16",
      tp: 8,
      memFraction: 0.88,
      weightsBytes: 84 * gib,
      contextLength: CONTEXT,
    },
  });
  const expected = Math.floor((141 * gib * 0.88 - 84 * gib) / ((512 + 64) * 61 * 2));
  assert.equal(given.rows[0]?.poolTokens, expected);
  assert.equal(given.rows[0]?.verdict, expected >= CONTEXT ? "pass" : "fail");
  const estimated = await runPreflight({
    offline: {
      config,
      gpuMemoryBytes: 141 * gib,
      dtype: "fp8",
      kvDtype: "bf16",
      tp: 8,
      contextLength: CONTEXT,
    },
  });
  assert.ok(
    estimated.notes.some((n) => /ESTIMATED/.test(n)),
    estimated.notes.join("\n"),
  );
});

const CLI = fileURLToPath(new URL("../../cli/preflight.js", import.meta.url));
const run = promisify(execFile);

async function cli(args: string[]): Promise<{ code: number; stdout: string }> {
  const script = `const m = await import(${JSON.stringify(CLI)}); await m.command().parseAsync(${JSON.stringify(args)}, { from: "user" });`;
  try {
    const { stdout } = await run(process.execPath, ["--input-type=module", "-e", script], {
      timeout: 30_000,
    });
    return { code: 0, stdout };
  } catch (err) {
    const e = err as { code: number; stdout: string };
    return { code: e.code, stdout: e.stdout };
  }
}

test("kvfence preflight exits 1 for the incident's numbers and 0 for a pool of 2,040,000", async () => {
  const fail = await cli(["--pool-tokens", "681280", "--context-length", "1048576"]);
  assert.equal(fail.code, 1, fail.stdout);
  assert.match(fail.stdout, /FAIL/);
  const pass = await cli(["--pool-tokens", "2040000", "--context-length", "1048576"]);
  assert.equal(pass.code, 0, pass.stdout);
  assert.match(pass.stdout, /PASS/);
});

test("kvfence preflight --config sizes a pool offline from a config file", async () => {
  const dir = await mkdtemp(join(tmpdir(), "kvfence-preflight-"));
  try {
    const file = join(dir, "config.json");
    await writeFile(
      file,
      JSON.stringify({
        hidden_size: 4096,
        num_hidden_layers: 32,
        num_attention_heads: 32,
        num_key_value_heads: 8,
        intermediate_size: 14336,
        vocab_size: 128256,
      }),
    );
    const r = await cli([
      "--config",
      file,
      "--gpu-memory",
      "80GiB",
      "--tp",
      "1",
      "--context-length",
      "131072",
      "--json",
    ]);
    const report = JSON.parse(r.stdout) as { rows: Array<{ poolTokens: number; verdict: string }> };
    // (80 GiB × 0.88 − ~16.06 GB of bf16 weights) ÷ 131,072 B per token ≈ 454k tokens: holds 131,072.
    assert.equal(report.rows[0]?.verdict, "pass");
    assert.ok(
      report.rows[0]!.poolTokens > 440_000 && report.rows[0]!.poolTokens < 470_000,
      String(report.rows[0]?.poolTokens),
    );
    assert.equal(r.code, 0);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
