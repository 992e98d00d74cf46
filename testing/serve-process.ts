/**
 * One `kvfence serve` child process (a router, a node, or one engine) on 127.0.0.1, for tests that
 * need a real process they can kill, stop (SIGSTOP) or restart on the same port. Resolves once the
 * process printed its address; `stop()` ends it (SIGCONT first, in case it was stopped; SIGTERM,
 * then SIGKILL).
 */
import { type ChildProcess, spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { stopProcess } from "../src/topology/local-cluster.js";

export { stopProcess };

const MAIN = fileURLToPath(new URL("../src/cli/main.js", import.meta.url));

export interface ServeProcess {
  readonly url: string;
  /** The port it listens on (a node's control port, a router's HTTP port). */
  readonly port: number;
  readonly process: ChildProcess;
  stop(): Promise<void>;
}

export async function spawnServe(
  args: readonly string[],
  options: { env?: NodeJS.ProcessEnv; timeoutMs?: number; stderr?: (text: string) => void } = {},
): Promise<ServeProcess> {
  const child = spawn(
    process.execPath,
    [MAIN, "serve", "--host", "127.0.0.1", "--log-level", "warn", ...args],
    {
      env: { ...process.env, ...options.env },
      stdio: ["ignore", "pipe", "pipe"],
    },
  );
  let err = "";
  child.stderr!.on("data", (chunk: Buffer) => {
    err = (err + chunk.toString()).slice(-4000);
    options.stderr?.(chunk.toString());
  });
  const url = await new Promise<string>((resolve, reject) => {
    let out = "";
    const timer = setTimeout(() => {
      child.kill("SIGKILL");
      reject(new Error(`kvfence serve ${args.join(" ")} did not start in time:\n${err}`));
    }, options.timeoutMs ?? 60_000);
    const onData = (chunk: Buffer): void => {
      out += chunk.toString();
      const match = /(?:listening at| at) (https?:\/\/\S+)/.exec(out);
      if (match === null) return;
      clearTimeout(timer);
      child.off("exit", onExit);
      child.stdout!.off("data", onData);
      child.stdout!.resume();
      resolve(match[1]!);
    };
    const onExit = (code: number | null): void => {
      clearTimeout(timer);
      reject(new Error(`kvfence serve ${args.join(" ")} exited with ${code} during startup:\n${err}`));
    };
    child.stdout!.on("data", onData);
    child.on("exit", onExit);
  });
  return {
    url,
    port: Number(new URL(url).port),
    process: child,
    stop: () => stopProcess(child),
  };
}
