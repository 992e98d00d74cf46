/**
 * Hosts as Linux network namespaces on one bridge, for the multi-host tests and the chaos campaign
 * (`kvfence chaos`; testing/netns.ts re-exports this for the tests): each host is a
 * namespace with a veth into the bridge and its own 10.213.N.x address; the bridge has .254 in this
 * (the test's) namespace, so the test reaches every host. `run` starts a process inside a host;
 * `linkDown`/`linkUp` cut and restore a host's cable (its veth's bridge end); `partition`/`heal`
 * cut a host off from inside its namespace (a policy-routing rule that blackholes every packet it
 * sends, so neither a reply nor a retransmission leaves it; no iptables or netem needed). `cleanup` kills what
 * it started and deletes the namespaces and the bridge; it also runs on process exit, so a failed
 * or interrupted test leaves nothing behind. Needs root and `ip` (iproute2).
 */
import { type ChildProcess, spawn, spawnSync } from "node:child_process";

export interface Host {
  readonly name: string;
  readonly ns: string;
  readonly address: string;
  /** The veth end on the bridge (in this namespace). */
  readonly cable: string;
}

const ip = (...args: string[]): void => {
  const r = spawnSync("ip", args, { encoding: "utf8" });
  if (r.status !== 0) throw new Error(`ip ${args.join(" ")}: ${r.stderr.trim()}`);
};

/** Why namespaces cannot be made here, or null when they can. */
export function netnsUnavailable(): string | null {
  if (process.getuid?.() !== 0) return "not root";
  const probe = `kvfp${process.pid % 100000}`;
  const r = spawnSync("ip", ["netns", "add", probe], { encoding: "utf8" });
  if (r.status !== 0) return `ip netns add failed: ${(r.stderr ?? r.error?.message ?? "").trim()}`;
  spawnSync("ip", ["netns", "del", probe]);
  return null;
}

export class Hosts {
  readonly subnet: string;
  readonly #tag: string;
  readonly #bridge: string;
  readonly #hosts: Host[] = [];
  readonly #children = new Set<ChildProcess>();
  #clean = false;
  readonly #onExit = () => this.cleanupSync();

  constructor() {
    const n = 1 + (process.pid % 250);
    this.subnet = `10.213.${n}`;
    this.#tag = `kv${process.pid % 100000}`;
    this.#bridge = `${this.#tag}br`;
    ip("link", "add", this.#bridge, "type", "bridge");
    ip("addr", "add", `${this.subnet}.254/24`, "dev", this.#bridge);
    ip("link", "set", this.#bridge, "up");
    process.on("exit", this.#onExit);
  }

  /** A new host `name` at `<subnet>.<last>`. */
  add(name: string, last: number): Host {
    const ns = `${this.#tag}-${name}`;
    const cable = `${this.#tag}${last}a`;
    const inside = `${this.#tag}${last}b`;
    ip("netns", "add", ns);
    ip("link", "add", cable, "type", "veth", "peer", "name", inside);
    ip("link", "set", inside, "netns", ns);
    ip("link", "set", cable, "master", this.#bridge, "up");
    ip("-n", ns, "addr", "add", `${this.subnet}.${last}/24`, "dev", inside);
    ip("-n", ns, "link", "set", inside, "up");
    ip("-n", ns, "link", "set", "lo", "up");
    const host = { name, ns, address: `${this.subnet}.${last}`, cable };
    this.#hosts.push(host);
    return host;
  }

  /** Starts `command args` inside `host`. */
  run(host: Host, command: string, args: readonly string[], env?: NodeJS.ProcessEnv): ChildProcess {
    const child = spawn("ip", ["netns", "exec", host.ns, command, ...args], {
      env: { ...process.env, ...env },
      stdio: ["ignore", "pipe", "pipe"],
    });
    this.#children.add(child);
    child.once("exit", () => this.#children.delete(child));
    return child;
  }

  linkDown(host: Host): void {
    ip("link", "set", host.cable, "down");
  }

  linkUp(host: Host): void {
    ip("link", "set", host.cable, "up");
  }

  /** Every packet `host` sends is dropped (rule 1 of its namespace: after `local`, before `main`). */
  partition(host: Host): void {
    ip("-n", host.ns, "rule", "add", "priority", "1", "blackhole");
  }

  heal(host: Host): void {
    ip("-n", host.ns, "rule", "del", "priority", "1");
  }

  async cleanup(): Promise<void> {
    await Promise.all(
      [...this.#children].map(
        (c) =>
          new Promise<void>((resolve) => {
            if (c.exitCode !== null || c.signalCode !== null) return resolve();
            c.once("exit", () => resolve());
            c.kill("SIGCONT");
            c.kill("SIGKILL");
          }),
      ),
    );
    this.cleanupSync();
  }

  cleanupSync(): void {
    if (this.#clean) return;
    this.#clean = true;
    for (const c of this.#children) c.kill("SIGKILL");
    for (const h of this.#hosts) {
      spawnSync("ip", ["netns", "pids", h.ns], { encoding: "utf8" })
        .stdout?.split("\n")
        .filter(Boolean)
        .forEach((pid) => {
          try {
            process.kill(Number(pid), "SIGKILL");
          } catch {
            // Gone already.
          }
        });
      spawnSync("ip", ["netns", "del", h.ns]);
      spawnSync("ip", ["link", "del", h.cable]);
    }
    spawnSync("ip", ["link", "del", this.#bridge]);
    process.off("exit", this.#onExit);
  }
}
