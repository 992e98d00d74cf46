/**
 * xgrammar's WebAssembly build (`@mlc-ai/web-xgrammar`, pinned) loaded once per thread, with a
 * synchronous API for the engine's step.
 *
 * Two things stand between the package as published and a Node engine thread:
 * - its `lib/index.js` is a UMD bundle inside a `"type": "module"` package: imported as ES it
 *   throws (`require is not defined in ES module scope`, from its Emscripten loader). So its text
 *   is evaluated here as the CommonJS module it is written as (a function of `exports`, `module`,
 *   `require`, `__filename`), which works on the main thread and in worker threads alike.
 * - its classes are async only to await the binding's initialisation (every method is
 *   `await asyncInitBinding(); <synchronous wasm call>`), and the Emscripten module (`binding`)
 *   is private to the bundle. The engine's step is synchronous, so at evaluation the bundle's one
 *   `let binding = null;` also exports a getter of it; after `loadXgrammar()` resolves, this
 *   module calls the binding's classes directly (`GrammarCompiler`, `GrammarMatcher`,
 *   `vecIntToView` for a zero-copy view of a mask). The pinned version is checked: another
 *   version may not have that line, and `loadXgrammar` then fails by name.
 * - a grammar or schema xgrammar refuses aborts the wasm call (`Aborted()`), its reason only
 *   printed on stderr as `[FATAL] file:line: message`: the bundle's stderr is routed here, so the
 *   refusal can name the construct (`takeXgrammarError`). The module keeps working after it.
 */
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { KvfenceError } from "../lib/errors.js";

/** The version whose bundle this loader patches (package.json pins it exactly). */
export const XGRAMMAR_VERSION = "0.1.27";

const BINDING_LINE = "let binding = null;";
/** The Emscripten module's stderr: xgrammar's `[FATAL] file:line: message` before it throws. */
const PRINT_ERR = 'var err=Module["printErr"]||console.error.bind(console);';

/** The embind handles this module uses (xgrammar's C++ classes). */
// biome-ignore lint/suspicious/noExplicitAny: embind objects are untyped.
type Handle = any;

/** The Emscripten module of xgrammar (its embind classes and helpers). */
export interface XgrammarBinding {
  readonly TokenizerInfo: new (
    vocab: Handle,
    vocabType: Handle,
    vocabSize: number | undefined,
    stopTokenIds: Handle,
    prependSpace: boolean,
  ) => Handle;
  readonly GrammarCompiler: new (tokenizerInfo: Handle, maxThreads: number, cacheEnabled: boolean) => Handle;
  readonly GrammarMatcher: new (
    compiled: Handle,
    overrideStopTokens: Handle,
    terminateWithoutStopToken: boolean,
    maxRollbackTokens: number,
  ) => Handle;
  readonly Grammar: Handle;
  readonly VocabType: Handle;
  vecIntFromJSArray(values: readonly number[]): Handle;
  vecStringFromJSArray(values: readonly string[]): Handle;
  vecIntToView(vector: Handle): Int32Array;
}

/** What the bundle exports (its high-level classes) plus the binding. */
export interface Xgrammar {
  // biome-ignore lint/suspicious/noExplicitAny: the bundle's classes, used only for their builders.
  readonly api: any;
  readonly binding: XgrammarBinding;
}

let lastFatal = "";

/** Keeps xgrammar's last `[FATAL]` line (the reason of the failure it throws next). */
function noteStderr(text: string): void {
  const at = text.indexOf("[FATAL]");
  if (at >= 0) lastFatal = text.slice(at + 7).replace(/^\s*\S+:\d+:\s*/, "");
}

/**
 * What xgrammar said when its last call failed (its C++ check's message, without the source
 * file), cleared by reading; "" when it said nothing.
 */
export function takeXgrammarError(): string {
  const text = lastFatal;
  lastFatal = "";
  return text;
}

let loading: Promise<Xgrammar> | null = null;
let loaded: Xgrammar | null = null;

/** Loads and initialises xgrammar in this thread (once; later calls share the first). */
export function loadXgrammar(): Promise<Xgrammar> {
  loading ??= load().then((x) => {
    loaded = x;
    return x;
  });
  return loading;
}

/** The loaded xgrammar of this thread; throws when `loadXgrammar()` has not resolved yet. */
export function xgrammar(): Xgrammar {
  if (loaded === null) throw new KvfenceError("internal", "xgrammar is not loaded in this thread yet");
  return loaded;
}

async function load(): Promise<Xgrammar> {
  const require = createRequire(import.meta.url);
  const file = require.resolve("@mlc-ai/web-xgrammar");
  const pkg = JSON.parse(readFileSync(require.resolve("@mlc-ai/web-xgrammar/package.json"), "utf8")) as {
    version: string;
  };
  const source = readFileSync(file, "utf8");
  if (
    pkg.version !== XGRAMMAR_VERSION ||
    source.split(BINDING_LINE).length !== 2 ||
    source.split(PRINT_ERR).length !== 2
  ) {
    throw new KvfenceError(
      "internal",
      `@mlc-ai/web-xgrammar must be version ${XGRAMMAR_VERSION} (its binding is reached by one line of its bundle): ${pkg.version}`,
    );
  }
  const patched = source
    .replace(BINDING_LINE, `${BINDING_LINE} exports.__kvfenceBinding = () => binding;`)
    .replace(PRINT_ERR, "var err=(text)=>exports.__kvfenceStderr(text);");
  const module = { exports: { __kvfenceStderr: noteStderr } as Record<string, unknown> };
  // The bundle's own CommonJS wrapper: it reads nothing of this module's scope.
  new Function("exports", "module", "require", "__filename", "__dirname", patched)(
    module.exports,
    module,
    require,
    file,
    file.slice(0, file.lastIndexOf("/")),
  );
  // biome-ignore lint/suspicious/noExplicitAny: the bundle's exports.
  const api = module.exports as any;
  // Any async class method initialises the binding; this one builds nothing.
  await api.Grammar.builtinJSONGrammar().then((g: { dispose(): void }) => g.dispose());
  const binding = (api.__kvfenceBinding as () => XgrammarBinding | null)();
  if (binding === null) throw new KvfenceError("internal", "xgrammar's binding did not initialise");
  return { api, binding };
}
