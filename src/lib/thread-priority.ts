/**
 * Lowers the CPU priority (raises the nice value) of the calling thread only, so that bulk work in a
 * worker thread yields the CPU to the threads that answer requests. Linux keeps a nice value per
 * thread and `setpriority` takes a thread id, which `/proc/thread-self` names; elsewhere, or when the
 * call is refused, nothing changes and false is returned (the work still runs, at normal priority).
 */
import { readlinkSync } from "node:fs";
import { setPriority } from "node:os";

export function lowerThreadPriority(nice: number): boolean {
  try {
    const tid = Number(readlinkSync("/proc/thread-self").split("/").at(-1));
    if (!Number.isInteger(tid) || tid <= 0) return false;
    setPriority(tid, nice);
    return true;
  } catch {
    return false;
  }
}
