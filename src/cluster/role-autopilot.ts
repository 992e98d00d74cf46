/**
 * `--role-policy queue` at a router over a registry (docs/topologies.md, "Roles that follow the
 * load"): every `intervalMs` it polls the nodes' stats, reads each role's load
 * (src/cluster/role-load.ts) and asks its rule (src/cluster/role-policy.ts); a move it asks goes
 * to one node of the slack role — its member that joined last — as `kvfence role` would (`requestRole`, through etcd). One switch at a time:
 * no read is taken while one is under way.
 */
import type { Logger } from "../lib/logger.js";
import type { DisaggregatedEngine } from "./disaggregated-engine.js";
import { type RegistryOptions, requestRole } from "./registry.js";
import { RoleLoadMeter } from "./role-load.js";
import { DEFAULT_ROLE_POLICY, RolePolicy, type RolePolicyConfig } from "./role-policy.js";

/** How long a node switched by the policy may drain, and how long the router waits for it. */
const DRAIN_TIMEOUT_MS = 60_000;
const SWITCH_TIMEOUT_MS = 120_000;

export function startRoleAutopilot(
  engine: DisaggregatedEngine,
  registry: RegistryOptions,
  intervalMs: number,
  log: Logger | undefined,
  config: RolePolicyConfig = DEFAULT_ROLE_POLICY,
): { close(): void } {
  const meter = new RoleLoadMeter();
  const policy = new RolePolicy(config);
  let busy = false;
  const tick = async (): Promise<void> => {
    if (busy || engine.closed) return;
    busy = true;
    try {
      const load = meter.read(await engine.nodeStats());
      const move = policy.decide(load);
      if (move === null) return;
      const node = engine
        .nodes()
        .filter((n) => n.role === move.from && n.up && n.member)
        .at(-1);
      if (node === undefined) return;
      log?.warn({ node: node.id, to: move.to, load }, "role policy: switching a node");
      await requestRole(
        registry,
        node.id,
        { role: move.to, drainTimeoutMs: DRAIN_TIMEOUT_MS },
        SWITCH_TIMEOUT_MS,
      );
    } catch (err) {
      log?.error({ err: (err as Error).message }, "role policy: the switch failed");
    } finally {
      busy = false;
    }
  };
  const timer = setInterval(() => void tick(), intervalMs);
  timer.unref();
  return { close: () => clearInterval(timer) };
}
