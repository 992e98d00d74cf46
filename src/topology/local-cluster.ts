/**
 * A local multi-process cluster on 127.0.0.1 (`kvfence cluster`, and the acceptance tests): N
 * prefill and M decode node processes (`kvfence serve --role prefill|decode --port 0`), then a
 * router process (`--role router --prefill … --decode …`, or all of them with `--registry` when
 * membership is in etcd), all sharing a fresh random cluster secret through the environment. Each child prints its address on stdout; `close()` stops them
 * all (SIGTERM, then SIGKILL for any that linger).
 */
import { type ChildProcess, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { fileURLToPath } from "node:url";
import { KvfenceError } from "../lib/errors.js";

const MAIN = fileURLToPath(new URL("../cli/main.js", import.meta.url));

export interface LocalClusterOptions {
  readonly prefill: number;
  readonly decode: number;
  readonly model: string;
  /** Extra `kvfence serve` arguments for every node (pool size, page size, ...). */
  readonly nodeArgs?: readonly string[];
  /** Extra arguments for the router (api keys, port, ...). */
  readonly routerArgs?: readonly string[];
  /** Extra arguments for the prefill nodes only (after `nodeArgs`). */
  readonly prefillArgs?: readonly string[];
  /** Extra arguments for prefill node `index` only (after `prefillArgs`), e.g. a fault on one node. */
  readonly prefillArgsAt?: (index: number) => readonly string[];
  /** Extra arguments for the decode nodes only (after `nodeArgs`). */
  readonly decodeArgs?: readonly string[];
  readonly host?: string;
  /**
   * `etcd://host:port`: membership in etcd (every process gets `--registry`; the router pairs the
   * nodes as they register) instead of the router's static `--prefill`/`--decode` lists.
   */
  readonly registry?: string;
  /** Router port (default 0: any free port). */
  readonly port?: number;
  /** Child stderr goes here (default: discarded). */
  readonly stderr?: (line: string) => void;
  readonly startTimeoutMs?: number;
}

export interface LocalCluster {
  readonly url: string;
  readonly router: ChildProcess;
  readonly prefill: readonly { readonly url: string; readonly process: ChildProcess }[];
  readonly decode: readonly { readonly url: string; readonly process: ChildProcess }[];
  close(): Promise<void>;
}

/** How a child is started: its environment, the stdout line with its URL, its stderr, its deadline. */
interface ChildStart {
  readonly env: NodeJS.ProcessEnv;
  readonly pattern: RegExp;
  readonly stderr: ((line: string) => void) | undefined;
  readonly timeoutMs: number;
}

function startChild(
  args: readonly string[],
  { env, pattern, stderr, timeoutMs }: ChildStart,
): Promise<{ url: string; process: ChildProcess }> {
  const child = spawn(process.execPath, [MAIN, ...args], { env, stdio: ["ignore", "pipe", "pipe"] });
  let err = "";
  child.stderr!.on("data", (chunk: Buffer) => {
    const text = chunk.toString();
    err = (err + text).slice(-4000);
    if (stderr !== undefined) for (const line of text.split("\n")) if (line.length > 0) stderr(line);
  });
  return new Promise((resolve, reject) => {
    let out = "";
    const timer = setTimeout(() => {
      child.kill("SIGKILL");
      reject(
        new KvfenceError(
          "node_unavailable",
          `A cluster process did not start in ${timeoutMs} ms: ${args.join(" ")}\n${err}`,
        ),
      );
    }, timeoutMs);
    const onData = (chunk: Buffer): void => {
      out += chunk.toString();
      const match = pattern.exec(out);
      if (match !== null) {
        clearTimeout(timer);
        child.stdout!.off("data", onData);
        child.stdout!.resume();
        child.off("exit", onExit);
        resolve({ url: match[1]!, process: child });
      }
    };
    const onExit = (code: number | null): void => {
      clearTimeout(timer);
      reject(
        new KvfenceError(
          "node_unavailable",
          `A cluster process exited during startup with code ${code}: ${args.join(" ")}\n${err}`,
        ),
      );
    };
    child.stdout!.on("data", onData);
    child.on("exit", onExit);
  });
}

/**
 * Ends `child`: SIGTERM (after SIGCONT, in case it was stopped), then SIGKILL after 5 s; resolves
 * when the process has exited.
 */
export async function stopProcess(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  await new Promise<void>((resolve) => {
    const timer = setTimeout(() => child.kill("SIGKILL"), 5000);
    child.once("exit", () => {
      clearTimeout(timer);
      resolve();
    });
    child.kill("SIGCONT");
    child.kill("SIGTERM");
  });
}

export interface NodeProcesses {
  readonly secret: string;
  readonly prefill: readonly { readonly url: string; readonly process: ChildProcess }[];
  readonly decode: readonly { readonly url: string; readonly process: ChildProcess }[];
  close(): Promise<void>;
}

/**
 * One node process, `--port 0` on `host`: every node gets `nodeArgs`, prefill node `index` also
 * `prefillArgs` and `prefillArgsAt(index)`, a decode node `decodeArgs`.
 */
function startNode(
  options: Omit<LocalClusterOptions, "routerArgs" | "port">,
  node: { readonly role: "prefill" | "decode"; readonly index: number; readonly env: NodeJS.ProcessEnv },
): Promise<{ url: string; process: ChildProcess }> {
  const { role, index } = node;
  return startChild(
    [
      "serve",
      "--role",
      role,
      "--host",
      options.host ?? "127.0.0.1",
      "--port",
      "0",
      "--model",
      options.model,
      "--log-level",
      "warn",
      ...(options.nodeArgs ?? []),
      ...(options.registry === undefined ? [] : ["--registry", options.registry]),
      ...(role === "prefill" ? (options.prefillArgs ?? []) : []),
      ...(role === "prefill" ? (options.prefillArgsAt?.(index) ?? []) : []),
      ...(role === "decode" ? (options.decodeArgs ?? []) : []),
    ],
    {
      env: node.env,
      pattern: /listening at (http:\/\/\S+)/,
      stderr: options.stderr,
      timeoutMs: options.startTimeoutMs ?? 60_000,
    },
  );
}

/** The prefill and decode nodes, started in parallel by role; each started child goes into `started`. */
async function startNodes(
  options: Omit<LocalClusterOptions, "routerArgs" | "port">,
  env: NodeJS.ProcessEnv,
  started: ChildProcess[],
): Promise<Pick<NodeProcesses, "prefill" | "decode">> {
  const node = async (role: "prefill" | "decode", index: number) => {
    const child = await startNode(options, { role, index, env });
    started.push(child.process);
    return child;
  };
  const prefill = await Promise.all(Array.from({ length: options.prefill }, (_, i) => node("prefill", i)));
  const decode = await Promise.all(Array.from({ length: options.decode }, (_, i) => node("decode", i)));
  return { prefill, decode };
}

/** Only the node processes (no router), for a router in this process (`connectCluster`). */
export async function startNodeProcesses(
  options: Omit<LocalClusterOptions, "routerArgs" | "port">,
): Promise<NodeProcesses> {
  const secret = randomBytes(24).toString("hex");
  const env = { ...process.env, KVFENCE_CLUSTER_SECRET: secret };
  const started: ChildProcess[] = [];
  try {
    const { prefill, decode } = await startNodes(options, env, started);
    return { secret, prefill, decode, close: async () => void (await Promise.all(started.map(stopProcess))) };
  } catch (err) {
    await Promise.all(started.map(stopProcess));
    throw err;
  }
}

export async function startLocalCluster(options: LocalClusterOptions): Promise<LocalCluster> {
  const host = options.host ?? "127.0.0.1";
  const env = { ...process.env, KVFENCE_CLUSTER_SECRET: randomBytes(24).toString("hex") };
  const started: ChildProcess[] = [];
  try {
    const { prefill, decode } = await startNodes(options, env, started);
    const router = await startChild(
      [
        "serve",
        "--role",
        "router",
        "--host",
        host,
        "--port",
        String(options.port ?? 0),
        "--model",
        options.model,
        "--log-level",
        "warn",
        ...(options.nodeArgs ?? []),
        ...(options.routerArgs ?? []),
        ...(options.registry === undefined
          ? ["--prefill", ...prefill.map((p) => p.url), "--decode", ...decode.map((d) => d.url)]
          : ["--registry", options.registry]),
      ],
      {
        env,
        pattern: / at (https?:\/\/\S+) /,
        stderr: options.stderr,
        timeoutMs: options.startTimeoutMs ?? 60_000,
      },
    );
    started.push(router.process);
    return {
      url: router.url,
      router: router.process,
      prefill,
      decode,
      async close() {
        await stopProcess(router.process);
        await Promise.all([...prefill, ...decode].map((c) => stopProcess(c.process)));
      },
    };
  } catch (err) {
    await Promise.all(started.map(stopProcess));
    throw err;
  }
}
