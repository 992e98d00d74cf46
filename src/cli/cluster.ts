/**
 * `kvfence cluster --prefill N --decode M`: a local multi-process cluster on 127.0.0.1 (N prefill
 * and M decode node processes and a router, TCP between them); prints the router's URL. Ctrl-C
 * stops every process. `--tls-cert/--tls-key/--tls-ca` go to every process (mutual TLS on every
 * cluster link), `--https-cert/--https-key` to the router (docs/tls.md), and so do the fair-share
 * and readiness flags (`--tenant-max-*`, `--max-queue`, `--queue-timeout`, `--ready-timeout`).
 */
import { Command } from "commander";
import { UNSAFE_OPT_IN_FLAG, unsafeArgs, unsafeSwitchesProblem } from "../node/unsafe-switches.js";
import { BUNDLED_MODEL_DIR } from "../server/serve-config.js";
import { startLocalCluster } from "../topology/local-cluster.js";

const collect = (value: string, previous: string[] = []): string[] => [...previous, value];

function count(flag: string, text: string): number {
  const n = Number(text);
  if (!Number.isInteger(n) || n < 1 || n > 16) {
    process.stderr.write(
      `kvfence cluster: ${flag} must be an integer from 1 to 16: ${JSON.stringify(text)}\n`,
    );
    process.exit(2);
  }
  return n;
}

export function command(): Command {
  return new Command("cluster")
    .description("Start a local multi-process cluster (router + prefill and decode node processes)")
    .option("--prefill <n>", "prefill node processes", "1")
    .option("--decode <n>", "decode node processes", "1")
    .option("--port <port>", "router port", "8000")
    .option("--model <dir>", "Hugging Face model folder", BUNDLED_MODEL_DIR)
    .option("--kv-pages <n>", "KV pool size of each node in pages")
    .option("--api-keys <file>", "API keys file for the router")
    .option("--max-model-len <tokens>", "longest request served (prompt + max_tokens)")
    .option("--prefill-kv-pages <n>", "the prefill nodes' KV pool in pages, when it differs from --kv-pages")
    .option("--kernels <kind>", "forward-pass kernels of every node: wasm (default) or ts")
    .option("--kernel-threads <n>", "threads of the wasm kernels per node: 1 (default) or 2")
    .option("--tls-cert <file>", "cluster links: every process's TLS certificate (PEM, SANs 127.0.0.1)")
    .option("--tls-key <file>", "cluster links: the private key of --tls-cert (PEM)")
    .option("--tls-ca <file>", "cluster links: the CA (PEM) every peer's certificate must chain to")
    .option("--https-cert <file>", "front door: the router serves HTTPS with this certificate (PEM)")
    .option("--https-key <file>", "front door: the private key of --https-cert (PEM)")
    .option(
      "--tenant-max-concurrency <n>",
      "router: requests one tenant may have running at once (0: no cap)",
    )
    .option("--tenant-max-pages <n>", "router: KV pages one tenant's running requests may hold (0: no cap)")
    .option("--tenant-max-queue <n>", "router: requests one tenant may have waiting (0: no cap)")
    .option("--max-queue <n>", "router: requests waiting over all tenants (default 256)")
    .option("--queue-timeout <seconds>", "router: a request waiting longer gets 429 or 503 (default 30)")
    .option(
      "--ready-timeout <seconds>",
      "router: a node that does not answer a ping within this is not ready (default 0.5)",
    )
    .option("--unsafe-fault <name>", "UNSAFE, tests and demos only: inject a fault (repeatable)", collect, [])
    .option(
      "--unsafe-disable-guard <name>",
      "UNSAFE, tests and demos only: switch a guard off (repeatable)",
      collect,
      [],
    )
    .option(UNSAFE_OPT_IN_FLAG, "required with --unsafe-fault or --unsafe-disable-guard", false)
    .action(async (raw: Record<string, string | undefined>) => {
      const opts = raw as unknown as {
        unsafeFault: string[];
        unsafeDisableGuard: string[];
        iUnderstandThisLeaksData: boolean;
      };
      const problem = unsafeSwitchesProblem(opts);
      if (problem !== null) {
        process.stderr.write(`kvfence cluster: ${problem}\n`);
        process.exit(2);
      }
      const nodeArgs = [
        ...(raw.kvPages === undefined ? [] : ["--kv-pages", raw.kvPages]),
        ...(raw.maxModelLen === undefined ? [] : ["--max-model-len", raw.maxModelLen]),
        ...(raw.kernels === undefined ? [] : ["--kernels", raw.kernels]),
        ...(raw.kernelThreads === undefined ? [] : ["--kernel-threads", raw.kernelThreads]),
        ...unsafeArgs(opts.unsafeFault, opts.unsafeDisableGuard),
        ...(raw.tlsCert === undefined ? [] : ["--tls-cert", raw.tlsCert]),
        ...(raw.tlsKey === undefined ? [] : ["--tls-key", raw.tlsKey]),
        ...(raw.tlsCa === undefined ? [] : ["--tls-ca", raw.tlsCa]),
      ];
      const routerArgs = [
        ...(raw.apiKeys === undefined ? [] : ["--api-keys", raw.apiKeys]),
        ...(raw.httpsCert === undefined ? [] : ["--https-cert", raw.httpsCert]),
        ...(raw.httpsKey === undefined ? [] : ["--https-key", raw.httpsKey]),
        ...(
          [
            ["--tenant-max-concurrency", raw.tenantMaxConcurrency],
            ["--tenant-max-pages", raw.tenantMaxPages],
            ["--tenant-max-queue", raw.tenantMaxQueue],
            ["--max-queue", raw.maxQueue],
            ["--queue-timeout", raw.queueTimeout],
            ["--ready-timeout", raw.readyTimeout],
          ] as const
        ).flatMap(([flag, value]) => (value === undefined ? [] : [flag, value])),
      ];
      const cluster = await startLocalCluster({
        prefill: count("--prefill", raw.prefill ?? "1"),
        decode: count("--decode", raw.decode ?? "1"),
        model: raw.model ?? BUNDLED_MODEL_DIR,
        port: Number(raw.port ?? 8000),
        nodeArgs,
        ...(raw.prefillKvPages === undefined
          ? {}
          : { prefillArgs: ["--prefill-kv-pages", raw.prefillKvPages] }),
        routerArgs,
        stderr: (line) => process.stderr.write(`${line}\n`),
      }).catch((err: Error) => {
        process.stderr.write(`kvfence cluster: ${err.message}\n`);
        process.exit(1);
      });
      process.stdout.write(
        `kvfence cluster at ${cluster.url} (OpenAI API at ${cluster.url}/v1): ` +
          `${cluster.prefill.length} prefill, ${cluster.decode.length} decode processes; Ctrl-C stops them all\n`,
      );
      let stopping = false;
      const shutdown = (): void => {
        if (stopping) process.exit(1);
        stopping = true;
        void cluster.close().then(() => process.exit(0));
      };
      process.on("SIGINT", shutdown);
      process.on("SIGTERM", shutdown);
    });
}
