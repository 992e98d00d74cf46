/**
 * `kvfence drain NODE --registry etcd://…`: drains one node of a registry cluster (docs/topologies.md):
 * the node marks its entry draining (routers send it no new request), lets its requests in flight
 * finish, leaves the registry and exits. Waits until it left; exit code 1 if it did not in time.
 */
import { Command } from "commander";
import { requestDrain } from "../cluster/registry.js";
import { registryOf } from "../server/start-server.js";

export interface DrainCliOptions {
  registry: string;
  registryPrefix: string;
  registryCa?: string;
  registryCert?: string;
  registryKey?: string;
  registryUser?: string;
  timeout: string;
}

/** The registry flags of the commands that act on one node through etcd (`drain`, `role`). */
export function withRegistryOptions(cmd: Command): Command {
  return cmd
    .requiredOption("--registry <url>", "the cluster's etcd, etcd://host:port[,host:port…]")
    .option("--registry-prefix <key>", "the cluster's key prefix in etcd", "/kvfence")
    .option("--registry-ca <file>", "TLS to etcd: the CA (PEM)")
    .option("--registry-cert <file>", "TLS to etcd: a client certificate (PEM; with --registry-key)")
    .option("--registry-key <file>", "TLS to etcd: the private key of --registry-cert (PEM)")
    .option("--registry-user <name>", "etcd user (its password from env KVFENCE_REGISTRY_PASSWORD)");
}

/** `--timeout` (and the like) in seconds → milliseconds; throws on anything but a positive number. */
export function secondsFlag(flag: string, value: string): number {
  const ms = Number(value) * 1000;
  if (!Number.isFinite(ms) || ms <= 0)
    throw new Error(`${flag} must be a positive number of seconds: ${value}`);
  return ms;
}

export function command(): Command {
  return withRegistryOptions(
    new Command("drain")
      .description(
        "Drain a node of a registry cluster: no new requests, the ones in flight finish, then it leaves (NODE as /kvfence/nodes names it, e.g. decode@10.0.0.21:9002)",
      )
      .argument("<node>", "the node: role@host:port"),
  )
    .option("--timeout <seconds>", "how long to wait for the node to leave", "300")
    .action(async (node: string, o: DrainCliOptions) => {
      try {
        const timeoutMs = secondsFlag("--timeout", o.timeout);
        const ms = await requestDrain(registryOf(o), node, timeoutMs);
        process.stdout.write(`${node} drained and left the cluster in ${(ms / 1000).toFixed(1)} s\n`);
      } catch (err) {
        process.stderr.write(`kvfence drain: ${(err as Error).message}\n`);
        process.exitCode = 1;
      }
    });
}
