/** CPU time of other processes (a bench's servers), from Linux's /proc. */
import { spawnSync } from "node:child_process";
import { readdirSync, readFileSync } from "node:fs";

/** Clock ticks per second of /proc/PID/stat's times (`getconf CLK_TCK`; 100 where it cannot say). */
const CLOCK_TICKS = (() => {
  const out = spawnSync("getconf", ["CLK_TCK"], { encoding: "utf8" });
  const n = Number.parseInt(out.stdout ?? "", 10);
  return Number.isInteger(n) && n > 0 ? n : 100;
})();

/** utime + stime of a /proc …/stat line, in ticks. */
function statTicks(stat: string): number {
  // Fields after the command name (which may hold spaces, in parentheses): utime, stime are 14, 15.
  const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  return Number(fields[11]) + Number(fields[12]);
}

/** CPU seconds (user + system, every thread) the processes used so far; NaN without /proc. */
export function cpuSeconds(pids: readonly number[]): number {
  let ticks = 0;
  for (const pid of pids) {
    try {
      ticks += statTicks(readFileSync(`/proc/${pid}/stat`, "utf8"));
    } catch {
      return Number.NaN;
    }
  }
  return ticks / CLOCK_TICKS;
}

/** CPU seconds (user + system) each live thread of the processes used so far, by "pid:tid". */
export function threadCpuSeconds(pids: readonly number[]): Map<string, number> {
  const out = new Map<string, number>();
  for (const pid of pids) {
    let tids: string[];
    try {
      tids = readdirSync(`/proc/${pid}/task`);
    } catch {
      continue; // the process ended
    }
    for (const tid of tids) {
      try {
        out.set(
          `${pid}:${tid}`,
          statTicks(readFileSync(`/proc/${pid}/task/${tid}/stat`, "utf8")) / CLOCK_TICKS,
        );
      } catch {
        // the thread ended
      }
    }
  }
  return out;
}
