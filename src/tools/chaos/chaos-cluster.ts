/**
 * The chaos campaign's cluster: every process on a host of its own (a network namespace,
 * ./netns.ts) — etcd, the routers and the prefill and decode node processes, membership in etcd
 * (`--registry`), plaintext links beyond loopback by the explicit `--insecure-plaintext-links`.
 * It starts them, and does to a node what a fault does: kill -9 and restart it on its address (a
 * new incarnation), SIGSTOP and SIGCONT it, cut its host off and heal it, switch its role
 * (`kvfence role`). It reads what the routers
 * say: the nodes each lists (up, member), `/ready`, and each node's KV pages by state from
 * `/metrics` (`kvfence_node_kv_pages{node,role,state}`).
 */
import { type ChildProcess, execFile } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import type { NodesInfo } from "../../admin-api/admin-wire.js";
import { parsePrometheusText } from "../incident/prometheus-text.js";
import { type Host, Hosts } from "./netns.js";

const MAIN = fileURLToPath(new URL("../../cli/main.js", import.meta.url));

export interface ClusterShape {
  readonly routers: number;
  readonly prefill: number;
  readonly decode: number;
  readonly model: string;
  readonly kvPages: number;
  /** API key → tenant name. */
  readonly keys: Readonly<Record<string, string>>;
  /** More `kvfence serve` flags for every node, and for every router (e.g. `--max-migrations 0`). */
  readonly nodeArgs: readonly string[];
  readonly routerArgs: readonly string[];
}

/** One node's KV pages by state, as a router's /metrics reports them. */
export interface NodePages {
  readonly node: string;
  readonly role: string;
  readonly pages: Record<string, number>;
}

/**
 * Resolves on the first stdout line matching `pattern` (its first group), rejects if it exits first
 * or after `timeoutMs`. (The netns e2e test starts its hosts' processes with it too.)
 */
export function started(
  child: ChildProcess,
  pattern: RegExp,
  what: string,
  timeoutMs = 120_000,
): Promise<string> {
  return new Promise((resolve, reject) => {
    let out = "";
    let err = "";
    const timer = setTimeout(
      () => reject(new Error(`${what} did not start in ${timeoutMs / 1000} s:\n${err}`)),
      timeoutMs,
    );
    child.stderr!.on("data", (d: Buffer) => {
      err = (err + d.toString()).slice(-3000);
    });
    child.stdout!.on("data", (d: Buffer) => {
      out = (out + d.toString()).slice(-3000);
      const m = pattern.exec(out);
      if (m !== null) {
        clearTimeout(timer);
        resolve(m[1] ?? m[0]);
      }
    });
    child.once("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`${what} exited with ${code} during startup:\n${err}`));
    });
  });
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

export class ChaosCluster {
  readonly operatorKey = `op-${randomBytes(12).toString("hex")}`;
  readonly #secret = randomBytes(24).toString("hex");
  readonly #shape: ClusterShape;
  readonly #hosts = new Hosts();
  readonly #dir = mkdtempSync(path.join(os.tmpdir(), "kvfence-chaos-"));
  readonly #host = new Map<string, Host>();
  readonly #procs = new Map<string, ChildProcess>();
  /** Each node's role now (a role fault switches it and back). */
  readonly #roles = new Map<string, "prefill" | "decode">();
  readonly routerUrls: string[] = [];

  private constructor(shape: ClusterShape) {
    this.#shape = shape;
  }

  /** Node names: prefill-0…, decode-0…; routers router-0…. */
  get nodes(): string[] {
    const { prefill, decode } = this.#shape;
    return [
      ...Array.from({ length: prefill }, (_, i) => `prefill-${i}`),
      ...Array.from({ length: decode }, (_, i) => `decode-${i}`),
    ];
  }

  static async start(shape: ClusterShape): Promise<ChaosCluster> {
    const c = new ChaosCluster(shape);
    try {
      await c.#start();
    } catch (err) {
      await c.stop();
      throw err;
    }
    return c;
  }

  async #start(): Promise<void> {
    writeFileSync(path.join(this.#dir, "keys.json"), JSON.stringify(this.#shape.keys));
    this.#host.set("etcd", this.#hosts.add("etcd", 1));
    for (let i = 0; i < this.#shape.routers; i++)
      this.#host.set(`router-${i}`, this.#hosts.add(`r${i}`, 2 + i));
    for (const name of this.nodes) {
      const [role, i] = name.split("-") as [string, string];
      this.#host.set(name, this.#hosts.add(`${role[0]}${i}`, (role === "prefill" ? 20 : 40) + Number(i)));
    }
    await this.#startEtcd();
    await Promise.all(this.nodes.map((n) => this.startNode(n)));
    for (let i = 0; i < this.#shape.routers; i++) this.routerUrls.push(await this.#startRouter(i));
    await this.allServing(180_000);
  }

  get #registry(): string {
    return `etcd://${this.#host.get("etcd")!.address}:2379`;
  }

  async #startEtcd(): Promise<void> {
    const a = this.#host.get("etcd")!.address;
    const peer = "http://127.0.0.1:2380";
    this.#procs.set(
      "etcd",
      this.#hosts.run(this.#host.get("etcd")!, "etcd", [
        ...["--name", "e1", "--data-dir", path.join(this.#dir, "etcd")],
        ...["--listen-client-urls", `http://${a}:2379`, "--advertise-client-urls", `http://${a}:2379`],
        ...["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer],
        ...["--initial-cluster", `e1=${peer}`, "--log-level", "error"],
      ]),
    );
    const deadline = Date.now() + 30_000;
    while (
      !(await fetch(`http://${a}:2379/health`).then(
        (r) => r.ok,
        () => false,
      ))
    ) {
      if (Date.now() > deadline) throw new Error(`etcd did not come up at: ${a}:2379`);
      await sleep(100);
    }
  }

  roleOf(name: string): "prefill" | "decode" {
    return this.#roles.get(name) ?? (name.startsWith("prefill") ? "prefill" : "decode");
  }

  /** The node's port: its first role's (a role switch keeps the process and its port). */
  #port(name: string): string {
    return name.startsWith("prefill") ? "9001" : "9002";
  }

  /**
   * `kvfence role ROLE@ADDRESS:PORT NEW --registry …` for node `name`: resolves once the node is
   * registered in its new role (the command waits for it); throws with its stderr when it fails.
   */
  async switchRole(name: string, role: "prefill" | "decode"): Promise<void> {
    const node = `${this.roleOf(name)}@${this.address(name)}:${this.#port(name)}`;
    const args = [
      MAIN,
      "role",
      node,
      role,
      "--registry",
      this.#registry,
      "--drain-timeout",
      "10",
      "--timeout",
      "60",
    ];
    await new Promise<void>((resolve, reject) =>
      execFile(process.execPath, args, { timeout: 90_000 }, (err, _out, stderr) =>
        err === null
          ? resolve()
          : reject(new Error(`kvfence role ${node} ${role}: ${stderr.trim() || err.message}`)),
      ),
    );
    this.#roles.set(name, role);
  }

  /** Starts (or restarts, on the same address) node `name`; resolves once it listens. */
  async startNode(name: string): Promise<void> {
    const role = this.roleOf(name);
    const host = this.#host.get(name)!;
    const args = [
      ...[MAIN, "serve", "--role", role, "--host", host.address, "--port", this.#port(name)],
      ...["--model", this.#shape.model, "--kv-pages", String(this.#shape.kvPages)],
      ...["--registry", this.#registry, "--insecure-plaintext-links", "--log-level", "warn"],
      ...this.#shape.nodeArgs,
    ];
    const child = this.#hosts.run(host, process.execPath, args, { KVFENCE_CLUSTER_SECRET: this.#secret });
    this.#procs.set(name, child);
    await started(child, /listening at/, name);
  }

  async #startRouter(slot: number): Promise<string> {
    const host = this.#host.get(`router-${slot}`)!;
    const args = [
      ...[MAIN, "serve", "--role", "router", "--host", host.address, "--port", "8000"],
      ...["--model", this.#shape.model, "--registry", this.#registry, "--router-slot", String(slot)],
      ...["--insecure-plaintext-links", "--operator-key", this.operatorKey],
      ...["--api-keys", path.join(this.#dir, "keys.json"), "--log-level", "warn"],
      ...this.#shape.routerArgs,
    ];
    const child = this.#hosts.run(host, process.execPath, args, { KVFENCE_CLUSTER_SECRET: this.#secret });
    this.#procs.set(`router-${slot}`, child);
    return started(child, / at (http:\/\/\S+) /, `router-${slot}`);
  }

  /**
   * One engine (`--no-disaggregation`) on etcd's host, apart from the cluster: the reference whose
   * greedy answers every 200 of the cluster must equal. Returns its URL and its stop.
   */
  async startReferenceEngine(): Promise<{ url: string; stop: () => Promise<void> }> {
    const host = this.#host.get("etcd")!;
    const args = [
      ...[MAIN, "serve", "--no-disaggregation", "--host", host.address, "--port", "8100"],
      ...["--model", this.#shape.model, "--kv-pages", String(this.#shape.kvPages)],
      ...["--api-keys", path.join(this.#dir, "keys.json"), "--log-level", "warn"],
    ];
    const child = this.#hosts.run(host, process.execPath, args);
    const url = await started(child, / at (http:\/\/\S+) /, "the reference engine");
    const stop = async () => {
      const exited = new Promise((r) => child.once("exit", r));
      if (child.exitCode === null && child.signalCode === null) child.kill("SIGTERM");
      await exited;
    };
    return { url, stop };
  }

  /** kill -9 of `name`; resolves once it exited. */
  async kill(name: string): Promise<void> {
    const c = this.#procs.get(name)!;
    if (c.exitCode !== null || c.signalCode !== null) return;
    const exited = new Promise((r) => c.once("exit", r));
    c.kill("SIGKILL");
    await exited;
  }

  signal(name: string, signal: "SIGSTOP" | "SIGCONT"): void {
    this.#procs.get(name)!.kill(signal);
  }

  partition(name: string): void {
    this.#hosts.partition(this.#host.get(name)!);
  }

  heal(name: string): void {
    this.#hosts.heal(this.#host.get(name)!);
  }

  address(name: string): string {
    return this.#host.get(name)!.address;
  }

  #get(url: string, p: string): Promise<Response> {
    return fetch(`${url}${p}`, {
      headers: { authorization: `Bearer ${this.operatorKey}` },
      signal: AbortSignal.timeout(10_000),
    });
  }

  /** The id the routers serve the model under (the first of /v1/models). */
  async modelId(): Promise<string> {
    const res = await fetch(`${this.routerUrls[0]}/v1/models`, {
      headers: { authorization: `Bearer ${Object.keys(this.#shape.keys)[0]}` },
    });
    const body = (await res.json()) as { data?: Array<{ id: string }> };
    const id = body.data?.[0]?.id;
    if (id === undefined) throw new Error(`The router lists no model: ${res.status}`);
    return id;
  }

  /** What each router lists: its nodes (empty when it did not answer). */
  async listed(): Promise<NodesInfo["nodes"][]> {
    return Promise.all(
      this.routerUrls.map((u) =>
        this.#get(u, "/kvfence/nodes").then(
          async (r) => ((await r.json()) as NodesInfo).nodes,
          () => [],
        ),
      ),
    );
  }

  /** Until every router is ready and lists every node up and a member; false at the deadline. */
  async allServing(timeoutMs: number): Promise<boolean> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const lists = await this.listed();
      const ready = await Promise.all(
        this.routerUrls.map((u) =>
          fetch(`${u}/ready`).then(
            (r) => r.status === 200,
            () => false,
          ),
        ),
      );
      const full = lists.every((l) => l.filter((n) => n.up && n.member).length === this.nodes.length);
      if (full && ready.every(Boolean)) return true;
      if (Date.now() > deadline) return false;
      await sleep(200);
    }
  }

  /** Each node's pages by state from router `url`'s /metrics. */
  async nodePages(url: string): Promise<NodePages[]> {
    const m = parsePrometheusText(await (await this.#get(url, "/metrics")).text());
    const byNode = new Map<string, NodePages>();
    for (const [key, value] of m) {
      const match = /^kvfence_node_kv_pages\{node="([^"]+)",role="([^"]+)",state="([^"]+)"\}$/.exec(key);
      if (match === null) continue;
      const [, node, role, state] = match as unknown as [string, string, string, string];
      const entry = byNode.get(node) ?? { node, role, pages: {} };
      entry.pages[state] = value;
      byNode.set(node, entry);
    }
    return [...byNode.values()].sort((a, b) => a.node.localeCompare(b.node));
  }

  async stop(): Promise<void> {
    for (const c of this.#procs.values()) if (c.exitCode === null) c.kill("SIGCONT");
    await this.#hosts.cleanup();
    rmSync(this.#dir, { recursive: true, force: true });
  }
}
