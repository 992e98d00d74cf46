/**
 * Structured logs with pino: one JSON object per line on stderr (stdout stays free for a command's
 * own output). `KVFENCE_LOG_LEVEL` overrides the level; tests pass `level: "silent"`.
 */
import { type Logger, pino } from "pino";

export type { Logger } from "pino";

export type LogLevel = "fatal" | "error" | "warn" | "info" | "debug" | "trace" | "silent";

export interface LoggerOptions {
  readonly level?: LogLevel;
  readonly name?: string;
  /** Where lines go; defaults to stderr (file descriptor 2). */
  readonly destination?: NodeJS.WritableStream;
}

const LEVELS: readonly LogLevel[] = ["fatal", "error", "warn", "info", "debug", "trace", "silent"];

/** A pino logger writing JSON lines to stderr (or `destination`). */
export function createLogger(options: LoggerOptions = {}): Logger {
  const fromEnv = process.env.KVFENCE_LOG_LEVEL;
  const level = options.level ?? (LEVELS.includes(fromEnv as LogLevel) ? (fromEnv as LogLevel) : "info");
  const destination = options.destination ?? pino.destination({ fd: 2, sync: true });
  return pino({ level, name: options.name ?? "kvfence", base: { pid: process.pid } }, destination);
}
