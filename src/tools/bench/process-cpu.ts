/** CPU time of other processes (a bench's servers), from Linux's /proc. */
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";

/** Clock ticks per second of /proc/PID/stat's times (`getconf CLK_TCK`; 100 where it cannot say). */
const CLOCK_TICKS = (() => {
  const out = spawnSync("getconf", ["CLK_TCK"], { encoding: "utf8" });
  const n = Number.parseInt(out.stdout ?? "", 10);
  return Number.isInteger(n) && n > 0 ? n : 100;
})();

/** CPU seconds (user + system, every thread) the processes used so far; NaN without /proc. */
export function cpuSeconds(pids: readonly number[]): number {
  let ticks = 0;
  for (const pid of pids) {
    let stat: string;
    try {
      stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    } catch {
      return Number.NaN;
    }
    // Fields after the command name (which may hold spaces, in parentheses): utime, stime are 14, 15.
    const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    ticks += Number(fields[11]) + Number(fields[12]);
  }
  return ticks / CLOCK_TICKS;
}
