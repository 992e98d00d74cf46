import assert from "node:assert/strict";
import { test } from "node:test";
import { accepts } from "../../testing/grammar-judge.js";
import { KvfenceError } from "../lib/errors.js";
import { Prng } from "../lib/prng.js";
import { choiceToEbnf, ebnfString, MAX_REGEX_CHARS, regexToEbnf } from "./regex-to-ebnf.js";

const ALPHABET = [...'ab09xyzAZ_-.: "\\\n\t{}[],é😀'];

/** Hand-written strings (mostly matches) plus random ones (mostly not) for each pattern. */
const CASES: readonly (readonly [string, readonly string[]])[] = [
  ["\\d{3}-\\d{4}", ["555-1234", "55-1234", "5555-1234", "abc-defg", ""]],
  ["[A-Z][a-z]+( [A-Z][a-z]+)*", ["Ada", "Ada Lovelace", "ada", "Ada lovelace", "A"]],
  ["(?:true|false|null)", ["true", "false", "null", "nul", "truefalse"]],
  [
    '\\{"name": "[^"\\\\]*", "age": \\d{1,3}\\}',
    ['{"name": "Bo", "age": 42}', '{"name": "B\\"o", "age": 4}'],
  ],
  ["-?(0|[1-9]\\d*)(\\.\\d+)?([eE][+-]?\\d+)?", ["0", "-12.5e+3", "01", "1.", "3.14", "-0"]],
  ["^[\\w.+-]+@[\\w-]+\\.[a-z]{2,}$", ["a.b+c@d-e.org", "a@b.c", "@x.io", "ab@cd.ef"]],
  ["a{2}b{0,3}c{2,}", ["aacc", "aabbbccc", "aabbbbcc", "acc", "aab"]],
  ["(ab|cd)+?x??", ["ab", "abcdx", "x", "abab"]],
  ["\\s*\\S+\\s*", [" a ", "\t\nxy", "", "a b"]],
  ["[^a-z]{2}", ["AB", "0_", "ab", "A", "é😀", "\n\n"]],
  ['"(?:[^"\\\\\\x00-\\x1f]|\\\\["\\\\/bfnrt])*"', ['"hi"', '"a\\"b"', '"\n"', '"é"', '"\\x"']],
  ["x.y", ["x-y", "x\ny", "xzy", "xy"]],
  ["(?<year>\\d{4})-(\\d{2})", ["2026-12", "26-12"]],
  ["[\\]\\-\\^\\\\]+", ["]-^\\", "a"]],
  ["é(😀|ü)[àé]", ["é😀à", "éüé", "éüa", "e😀à"]],
  ["", ["", "a"]],
  ["a|", ["a", "", "b"]],
  ["\\t\\x41\\u0042\\0?", ["\tAB", "\tAB\0", "AB"]],
];

/** The cases using `.` or `\S`. */
const NARROWED = new Set(["\\s*\\S+\\s*", "x.y"]);

test("regexToEbnf() grammars accept exactly what JavaScript's RegExp fully matches (xgrammar as the judge)", async () => {
  const rng = new Prng(34);
  const next = (): number => rng.next();
  for (const [pattern, written] of CASES) {
    const ebnf = regexToEbnf(pattern);
    // With the `u` flag, as the grammar does, a class or `.` matches a code point (not a UTF-16 unit).
    const reference = new RegExp(`^(?:${pattern})$`, "u");
    const randoms = Array.from({ length: 40 }, () =>
      Array.from(
        { length: Math.floor(next() * 6) },
        () => ALPHABET[Math.floor(next() * ALPHABET.length)],
      ).join(""),
    );
    for (const text of [...written, ...randoms]) {
      const expected = reference.test(text);
      // `.` and `\S` keep only their ASCII members (the module's header): narrower, never wider.
      const narrowed = NARROWED.has(pattern) && [...text].some((ch) => ch.codePointAt(0)! > 0x7f);
      assert.equal(
        await accepts(ebnf, text),
        expected && !narrowed,
        `${JSON.stringify(pattern)} on ${JSON.stringify(text)} (RegExp: ${expected}); grammar: ${ebnf}`,
      );
    }
  }
});

test("regexToEbnf() keeps a class's non-ASCII members when all of them or a few are in it", async () => {
  const negated = regexToEbnf('[^"]');
  assert.equal(await accepts(negated, "é"), true);
  assert.equal(await accepts(negated, "😀"), true);
  assert.equal(await accepts(negated, '"'), false);
  const few = regexToEbnf("[a-cà-ÿ]");
  for (const ch of ["b", "à", "é", "ÿ"]) assert.equal(await accepts(few, ch), true, ch);
  for (const ch of ["d", "á".normalize("NFD"), "Ā"]) assert.equal(await accepts(few, ch), false, ch);
  // `.` excludes U+2028, which xgrammar cannot subtract from the non-ASCII characters: only ASCII is kept.
  assert.equal(await accepts(regexToEbnf("."), "é"), false);
  assert.equal(await accepts(regexToEbnf("."), "\u2028"), false);
});

test("regexToEbnf() refuses what a grammar cannot express, naming the construct and the field", () => {
  const cases: readonly (readonly [string, RegExp])[] = [
    ["(a)\\1", /backreference \\1 /],
    ["(?<n>a)\\k<n>", /backreference/],
    ["a(?=b)", /lookahead/],
    ["a(?!b)", /negativeLookahead/],
    ["(?<=a)b", /lookbehind/],
    ["\\bword\\b", /anchor \\b /],
    ["a^b", /anchor \^ /],
    ["a$b", /anchor \$ /],
    ["a{10001}", /repetition count above 10000/],
    ["[一-龥]", /no ASCII member/],
    ["[]", /matches no character/],
    ["\\ud800", /lone surrogate/],
    ["(unclosed", /Invalid regex: expected character at position 9: \)/],
    ["x".repeat(MAX_REGEX_CHARS + 1), /Regex too long/],
  ];
  for (const [pattern, message] of cases) {
    assert.throws(
      () => regexToEbnf(pattern, { param: "guided_regex" }),
      (err: unknown) =>
        err instanceof KvfenceError &&
        err.code === "invalid_request" &&
        err.param === "guided_regex" &&
        message.test(err.message),
      pattern.slice(0, 40),
    );
  }
});

test("choiceToEbnf() accepts exactly one of the strings, escaped", async () => {
  const choices = ['say "hi"', "back\\slash", "new\nline", "ümlaut 😀", ""];
  const ebnf = choiceToEbnf(choices);
  for (const choice of choices) assert.equal(await accepts(ebnf, choice), true, JSON.stringify(choice));
  for (const other of ["say hi", "back\\\\slash", "new", "ümlaut", 'say "hi"say "hi"'])
    assert.equal(await accepts(ebnf, other), false, JSON.stringify(other));
  assert.throws(() => choiceToEbnf([], { param: "guided_choice" }), { param: "guided_choice" });
});

test("ebnfString() escapes quotes, backslashes, control characters and non-ASCII", () => {
  assert.equal(ebnfString('a"b\\c\n\x7f\u00e9\u{1f600}'), '"a\\"b\\\\c\\u000a\\u007f\\u00e9\\U0001f600"');
  assert.equal(ebnfString("a\0b"), '"a" [\\u0000] "b"');
  assert.equal(ebnfString("\0\0"), "[\\u0000] [\\u0000]");
  assert.equal(ebnfString(""), '""');
});
