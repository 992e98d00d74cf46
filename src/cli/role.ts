/**
 * `kvfence role NODE prefill|decode --registry etcd://…`: changes the role of one node of a
 * registry cluster at run time (docs/topologies.md, "Roles that follow the load"): the node stops
 * taking work for its old role (its entry draining), lets its requests in flight finish (until
 * `--drain-timeout`, after which the rest are ended by its fence and their routers migrate them),
 * scrubs its KV pool, and registers again under the new role, where the routers pair it. Waits
 * until it is registered so; exit code 1 if not in time.
 */
import { Command } from "commander";
import { requestRole } from "../cluster/registry.js";
import { registryOf } from "../server/start-server.js";
import { type DrainCliOptions, secondsFlag, withRegistryOptions } from "./drain.js";

interface RoleCliOptions extends DrainCliOptions {
  drainTimeout: string;
}

export function command(): Command {
  return withRegistryOptions(
    new Command("role")
      .description(
        "Change a node's role at run time: it drains the old role's work, scrubs its KV pool and registers as the new role (NODE as /kvfence/nodes names it, e.g. prefill@10.0.0.11:9001)",
      )
      .argument("<node>", "the node: role@host:port")
      .argument("<role>", "its new role: prefill or decode"),
  )
    .option(
      "--drain-timeout <seconds>",
      "how long its requests in flight may run on before they are migrated",
      "60",
    )
    .option("--timeout <seconds>", "how long to wait for the node to register in its new role", "300")
    .action(async (node: string, role: string, o: RoleCliOptions) => {
      try {
        if (role !== "prefill" && role !== "decode")
          throw new Error(`The new role is prefill or decode: ${JSON.stringify(role)}`);
        const request = { role, drainTimeoutMs: secondsFlag("--drain-timeout", o.drainTimeout) } as const;
        const ms = await requestRole(registryOf(o), node, request, secondsFlag("--timeout", o.timeout));
        const address = node.slice(node.indexOf("@") + 1);
        process.stdout.write(`${node} serves as ${role}@${address} after ${(ms / 1000).toFixed(1)} s\n`);
      } catch (err) {
        process.stderr.write(`kvfence role: ${(err as Error).message}\n`);
        process.exitCode = 1;
      }
    });
}
