/**
 * Every reference to a design document resolves in a fresh clone. Sources (src/, bench/,
 * testing/, scripts/) and the docs themselves (docs/, README.md) may cite only files in the
 * repository: a reference to the background notes that never were committed (the design, the
 * prior-art and the measurement notes by their old upper-case names) fails, so does `docs/<file>`
 * when that file does not exist, and so does a section or anchor that the cited file does not
 * have: `docs/design.md §4` needs a heading numbered 4 in docs/design.md, `docs/prior-art.md H7`
 * (or `H2/H7`) a heading `H7` in docs/prior-art.md. In markdown files, a source path
 * (`src/…`, `bench/…`, `testing/…`, `scripts/…`, `models/…`) must name a file that exists, so the
 * file map of docs/design.md cannot go stale unnoticed.
 */
import assert from "node:assert/strict";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { dirname, join, relative, resolve } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const SCANNED_DIRS = ["src", "bench", "testing", "scripts", "docs"];
const SCANNED_FILES = ["README.md"];
const TEXT_FILE = /\.(ts|mjs|js|py|md)$/;
/** This file names the forbidden documents in order to forbid them. */
const SELF = "src/docs-references.test.ts";

/** The old names of the notes outside the repository (split so that this line is not a hit). */
const GONE = new RegExp(["DESIGN", "PRIOR-ART", "MEASUREMENTS"].map((n) => `\\b${n}\\b`).join("|"));
/** `docs/<file>` with an optional `§1.2` section or `H7`/`H2/H7` anchors after it. */
const DOC_REF = /\bdocs\/([\w./-]+\.md)\b(?:\s+(§\s?\d+(?:\.\d+)*|H\d+(?:\/H\d+)*))?/g;
const HEADING = /^#{1,6}\s+(?:§\s?)?((?:\d+(?:\.\d+)*)|H\d+)\b/gm;
/** A repository path in prose (not the tail of a longer path such as `dist/src/…`). */
const SOURCE_PATH =
  /(?<![\w./-])((?:src|bench|testing|scripts|models)\/[\w./-]*\w\.(?:ts|mjs|py|md|json))\b/g;

export interface TextFile {
  /** Path relative to the repository root, for messages. */
  readonly path: string;
  readonly text: string;
}

/** What the check needs to know about the repository. */
export interface Repository {
  /** The section numbers and anchors of `docs/<doc>`, or undefined when there is no such file. */
  headingsOf(doc: string): ReadonlySet<string> | undefined;
  /** Whether a path relative to the repository root exists. */
  exists(path: string): boolean;
}

/** What is wrong with the references in `files`, one line per problem. */
export function badReferences(files: readonly TextFile[], repo: Repository): string[] {
  const problems: string[] = [];
  for (const { path, text } of files) {
    text.split("\n").forEach((line, i) => {
      const where = `${path}:${i + 1}`;
      const gone = GONE.exec(line);
      if (gone !== null) problems.push(`${where} cites ${gone[0]}, which is not in the repository`);
      for (const m of line.matchAll(DOC_REF)) problems.push(...docReferenceProblems(where, m, repo));
      if (!path.endsWith(".md")) return;
      for (const m of line.matchAll(SOURCE_PATH)) {
        const file = m[1] ?? "";
        if (!repo.exists(file)) problems.push(`${where} names ${file}, which does not exist`);
      }
    });
  }
  return problems;
}

/** One `docs/<doc> [§N | ANCHOR/ANCHOR]` reference: the document and each heading it names must exist. */
function docReferenceProblems(where: string, m: RegExpMatchArray, repo: Repository): string[] {
  const doc = m[1] ?? "";
  const headings = repo.headingsOf(doc);
  if (headings === undefined) return [`${where} cites docs/${doc}, which does not exist`];
  const anchor = m[2];
  if (anchor === undefined) return [];
  const section = anchor.startsWith("§");
  const wanted = section ? [anchor.replace(/^§\s?/, "")] : anchor.split("/");
  return wanted
    .filter((w) => !headings.has(w))
    .map((w) => `${where} cites docs/${doc} ${section ? `§${w}` : w}, which has no such heading`);
}

/** The section numbers (`4`, `3.2`) and anchors (`H7`) of a markdown text's headings. */
export function headingsIn(markdown: string): Set<string> {
  return new Set([...markdown.matchAll(HEADING)].map((m) => m[1] ?? ""));
}

function filesUnder(dir: string): string[] {
  if (!existsSync(dir)) return [];
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const path = join(dir, entry.name);
    if (entry.isDirectory()) return entry.name === "fixtures" ? [] : filesUnder(path);
    return TEXT_FILE.test(entry.name) ? [path] : [];
  });
}

function repositoryFiles(): TextFile[] {
  const paths = [
    ...SCANNED_DIRS.flatMap((d) => filesUnder(join(ROOT, d))),
    ...SCANNED_FILES.map((f) => join(ROOT, f)),
  ];
  return paths
    .map((p) => ({ path: relative(ROOT, p), text: readFileSync(p, "utf8") }))
    .filter((f) => f.path !== SELF);
}

const REPOSITORY: Repository = {
  headingsOf(doc) {
    const path = join(ROOT, "docs", doc);
    return existsSync(path) ? headingsIn(readFileSync(path, "utf8")) : undefined;
  },
  exists: (path) => existsSync(join(ROOT, path)),
};

test("every design-document reference in src/, bench/, testing/, scripts/, docs/ and README.md resolves", () => {
  const files = repositoryFiles();
  assert.ok(
    files.some((f) => f.path === "src/protocol/wire.ts"),
    "the scan must reach src/",
  );
  assert.deepEqual(badReferences(files, REPOSITORY), []);
});

test("badReferences() flags a gone document, a missing file and a missing section or anchor", () => {
  const repo: Repository = {
    headingsOf: (doc) =>
      doc === "design.md" ? headingsIn("# Design\n## 4. Protocol\n### H7 — x\n") : undefined,
    exists: (path) => path === "src/protocol/wire.ts",
  };
  const planted: TextFile[] = [
    { path: "a.ts", text: ` * The decode side (${"DESIGN"}.md §4 step 5).` },
    { path: "b.ts", text: ` * Numbers in ${"MEASUREMENTS"} §2.` },
    { path: "c.ts", text: " * See docs/no-such-file.md for the layout." },
    { path: "d.ts", text: " * See docs/design.md §9 and docs/design.md H2/H7." },
    { path: "e.ts", text: " * Fine: docs/design.md §4 step 1, docs/design.md H7, docs/design.md." },
    { path: "f.md", text: "`src/protocol/wire.ts` and `src/protocol/gone.ts`, run `dist/src/gone.test.js`" },
    { path: "g.ts", text: " * Source paths are checked in markdown only: src/protocol/gone.ts" },
  ];
  assert.deepEqual(badReferences(planted, repo), [
    "a.ts:1 cites DESIGN, which is not in the repository",
    "b.ts:1 cites MEASUREMENTS, which is not in the repository",
    "c.ts:1 cites docs/no-such-file.md, which does not exist",
    "d.ts:1 cites docs/design.md §9, which has no such heading",
    "d.ts:1 cites docs/design.md H2, which has no such heading",
    "f.md:1 names src/protocol/gone.ts, which does not exist",
  ]);
});

test("the scan of the repository sees a planted bad reference", () => {
  const files = [...repositoryFiles(), { path: "planted.ts", text: " * see docs/gone.md §1" }];
  assert.deepEqual(badReferences(files, REPOSITORY), [
    "planted.ts:1 cites docs/gone.md, which does not exist",
  ]);
});
