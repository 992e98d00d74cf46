/**
 * The first layer of reading a model from disk: a Hugging Face folder's JSON files
 * (`readJsonFile`) and the two errors every reader of a model throws, `bad_model_folder` and
 * `unsupported_model`, each naming the file. The tokenizer here and the config and weight readers
 * of src/model build on it.
 */
import { readFileSync } from "node:fs";
import { KvfenceError } from "../lib/errors.js";

/** `Bad model folder: FILE: PROBLEM` as a KvfenceError. */
export function badModelFolder(file: string, problem: string, cause?: unknown): KvfenceError {
  return new KvfenceError(
    "bad_model_folder",
    `Bad model folder: ${file}: ${problem}`,
    cause === undefined ? {} : { cause },
  );
}

/** `Unsupported model: FILE: PROBLEM` as a KvfenceError. */
export function unsupportedModel(file: string, problem: string): KvfenceError {
  return new KvfenceError("unsupported_model", `Unsupported model: ${file}: ${problem}`);
}

/**
 * Reads and parses a JSON file of a model folder. Returns undefined when the file is absent and
 * `optional` is set; a missing required file, an unreadable file or invalid JSON throws
 * `bad_model_folder` naming the file.
 */
export function readJsonFile(path: string, options: { optional: true }): unknown;
export function readJsonFile(path: string, options?: { optional?: false }): unknown;
export function readJsonFile(path: string, options?: { optional?: boolean }): unknown {
  let text: string;
  try {
    text = readFileSync(path, "utf8");
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === "ENOENT" && options?.optional === true) return undefined;
    throw badModelFolder(
      path,
      code === "ENOENT" ? "file is missing" : `cannot read the file: ${String(err)}`,
      err,
    );
  }
  try {
    return JSON.parse(text) as unknown;
  } catch (err) {
    throw badModelFolder(path, `not valid JSON: ${(err as Error).message}`, err);
  }
}
