/**
 * The router's role policy (`--role-policy queue`, off by default; docs/topologies.md, "Roles
 * that follow the load"): from each role's queue depth per node and mean queue wait
 * (src/cluster/role-load.ts), read every `--role-policy-interval`, it moves one node at a time
 * from a role with nothing waiting to a role whose requests wait, with hysteresis:
 *
 * - a role is *pressed* when its queue depth per node is at least `pressedDepth` or its mean
 *   queue wait at least `pressedWaitSeconds`; *slack* when its depth per node is at most
 *   `slackDepth` and its wait at most `slackWaitSeconds` (between the two: neither);
 * - a switch from the slack role to the pressed one is asked when that holds on `streak`
 *   consecutive reads (the same direction each time), the slack role keeps at least one node
 *   (`minNodes`), and `cooldown` reads passed since the last switch (the switched node drains,
 *   scrubs and joins meanwhile; its effect shows only after).
 *
 * The rule is a pure function of the reads (`RolePolicy.decide`): no clock, so it is tested over
 * synthetic numbers.
 */
import type { Role, RolesLoad } from "./role-load.js";

export interface RolePolicyConfig {
  readonly pressedDepth: number;
  readonly pressedWaitSeconds: number;
  readonly slackDepth: number;
  readonly slackWaitSeconds: number;
  readonly streak: number;
  readonly cooldown: number;
  readonly minNodes: number;
}

export const DEFAULT_ROLE_POLICY: RolePolicyConfig = {
  pressedDepth: 4,
  pressedWaitSeconds: 1,
  slackDepth: 0.5,
  slackWaitSeconds: 0.1,
  streak: 3,
  cooldown: 10,
  minNodes: 1,
};

/** A switch the policy asks: one node of `from` to take role `to`. */
export interface RoleMove {
  readonly from: Role;
  readonly to: Role;
}

const other = (role: Role): Role => (role === "prefill" ? "decode" : "prefill");

export class RolePolicy {
  readonly #config: RolePolicyConfig;
  /** Consecutive reads that asked the same move. */
  #streak = 0;
  #streakTo: Role | null = null;
  /** Reads since the last move (starts past the cooldown). */
  #sinceMove: number;

  constructor(config: RolePolicyConfig = DEFAULT_ROLE_POLICY) {
    this.#config = config;
    this.#sinceMove = config.cooldown;
  }

  /** One read of the roles' load: the move to ask now, or null. */
  decide(load: RolesLoad): RoleMove | null {
    this.#sinceMove++;
    const to = this.#pressedOverSlack(load);
    if (to === null || to !== this.#streakTo) {
      this.#streakTo = to;
      this.#streak = to === null ? 0 : 1;
    } else this.#streak++;
    if (to === null || this.#streak < this.#config.streak || this.#sinceMove <= this.#config.cooldown)
      return null;
    this.#streak = 0;
    this.#streakTo = null;
    this.#sinceMove = 0;
    return { from: other(to), to };
  }

  /** The pressed role whose other role is slack and can give a node, or null. */
  #pressedOverSlack(load: RolesLoad): Role | null {
    const c = this.#config;
    const depth = (r: Role) => load[r].waiting / Math.max(1, load[r].nodes);
    const pressed = (r: Role) =>
      load[r].nodes > 0 && (depth(r) >= c.pressedDepth || load[r].waitSeconds >= c.pressedWaitSeconds);
    const slack = (r: Role) =>
      load[r].nodes > c.minNodes && depth(r) <= c.slackDepth && load[r].waitSeconds <= c.slackWaitSeconds;
    for (const r of ["prefill", "decode"] as const) if (pressed(r) && slack(other(r))) return r;
    return null;
  }
}
