import assert from "node:assert/strict";
import { test } from "node:test";
import { FAULT_NAMES, type FaultName } from "../../protocol/safety.js";
import { counterexampleToDot, DECODE_CACHE_BOUND, formatReport, runCheck } from "./run-check.js";

/** The invariant each fault variant breaks first (shortest trace) in its scenario. */
const EXPECTED: Record<FaultName, string> = {
  "placeholder-reject": "2",
  "undersized-pool": "4",
  "early-free": "3",
  "late-write": "3",
  "corrupt-transfer": "2",
  "misaddressed-write": "3",
  "drop-abort-ack": "3",
  "stale-commit": "1",
  "shared-prefix": "P1",
  "prefix-collision": "P1",
  "held-unpinned": "1",
  "tier-corrupt": "P3",
  "tier-planted": "P3",
  "stale-epoch": "P3",
  "spill-race": "P3",
};

for (const fault of FAULT_NAMES) {
  test(`runCheck() finds a counterexample for the ${fault} fault variant`, () => {
    const report = runCheck({ fault, maxStates: 50_000 });
    const cex = report.result.counterexample;
    assert.ok(cex !== null, `no counterexample for ${fault}`);
    assert.equal(cex.violation.invariant, EXPECTED[fault]);
    assert.ok(cex.steps.length > 0);
    assert.match(formatReport(report), /VIOLATION of invariant/);
  });
}

test("runCheck() holds every invariant of the real protocol on a small bound with crashes and duplicates", () => {
  const report = runCheck({ requests: 1, crashes: 1, duplicates: 1, timeouts: true });
  assert.equal(report.result.counterexample, null);
  assert.equal(report.result.complete, true);
  assert.ok(report.result.states > 1000);
});

test("runCheck() holds every invariant with a request of two samples forked on decode, through a crash of either node", () => {
  // Found a stuck sample before the router machine let a sample whose group already ended (its
  // client gone after the commit) fail on its own when decode crashed before its `committed` came.
  const report = runCheck({ requests: 1, samples: 1, crashes: 1 });
  assert.equal(report.result.counterexample, null);
  assert.equal(report.result.complete, true);
  assert.ok(report.result.states > 10_000);
});

test("runCheck() with guards kept shows the checksum and the epoch keys catch their faults", () => {
  for (const fault of ["corrupt-transfer", "stale-commit"] as const) {
    const report = runCheck({ fault, keepGuards: true, requests: 1, clientAborts: false });
    assert.equal(report.result.counterexample, null, fault);
    assert.equal(report.result.complete, true);
  }
});

test("runCheck() with guards kept shows the TCP lease check stops late and misaddressed writes", () => {
  for (const fault of ["early-free", "late-write", "misaddressed-write"] as const) {
    const report = runCheck({ fault, keepGuards: true, transport: "tcp", requests: 1 });
    assert.equal(report.result.counterexample, null, fault);
  }
});

test("runCheck() with a dropped abort ack keeps pages quarantined rather than freeing them", () => {
  const report = runCheck({ fault: "drop-abort-ack", keepGuards: true, requests: 1 });
  assert.equal(report.result.counterexample?.violation.invariant, "liveness");
  assert.match(report.result.counterexample?.violation.message ?? "", /quarantined 1/);
});

test("runCheck() explores the prefix cache completely with its guards kept, and finds each fault's leak without them", () => {
  for (const fault of ["shared-prefix", "prefix-collision"] as const) {
    const report = runCheck({ fault, keepGuards: true });
    assert.equal(report.result.counterexample, null, fault);
    assert.equal(report.result.complete, true, fault);
    assert.match(formatReport(report), /P1-P3/);
  }
  // The page tags stop a cross-tenant read, but not a collision within a tenant: the stored tokens do.
  const withTags = runCheck({ fault: "shared-prefix", keepGuards: true, disabledGuards: ["tenant-salt"] });
  assert.equal(withTags.result.counterexample, null);
  const collision = runCheck({
    fault: "prefix-collision",
    keepGuards: true,
    disabledGuards: ["prefix-tokens"],
  });
  assert.equal(collision.result.counterexample?.violation.invariant, "P3");
});

test("runCheck() with decode-side reuse holds every invariant completely, and each guard alone catches held-unpinned", () => {
  // A conversation's second turn holds decode's cached pages of its first; another tenant's copy
  // of it never does (invariant 1 checks a held page is a referenced cache page of the reader's
  // tenant holding its own prefix's KV; invariant 3 that no write lands in one).
  const report = runCheck(DECODE_CACHE_BOUND);
  assert.equal(report.result.counterexample, null);
  assert.equal(report.result.complete, true);
  assert.ok(report.result.states > 1000);
  assert.match(formatReport(report), /decode keeps a prefix cache/);
  const tcp = runCheck({ ...DECODE_CACHE_BOUND, transport: "tcp" });
  assert.equal(tcp.result.counterexample, null);
  for (const guard of ["held-pages", "page-tags"] as const) {
    const other = guard === "held-pages" ? "page-tags" : "held-pages";
    const caught = runCheck({ fault: "held-unpinned", keepGuards: true, disabledGuards: [other] });
    assert.equal(caught.result.counterexample, null, `${guard} alone`);
    assert.equal(caught.result.complete, true, `${guard} alone`);
  }
});

test("runCheck() explores the KV tiers' spills and loads completely with their guards kept, and finds each tier fault's foreign page without its guard", () => {
  for (const fault of ["tier-corrupt", "tier-planted", "stale-epoch", "spill-race"] as const) {
    const kept = runCheck({ fault, keepGuards: true });
    assert.equal(kept.result.counterexample, null, fault);
    assert.equal(kept.result.complete, true, fault);
    assert.match(formatReport(kept), /KV tier below it/);
    const cex = runCheck({ fault }).result.counterexample;
    assert.equal(cex?.violation.invariant, "P3", fault);
    assert.ok(
      cex.steps.some((s) => /load from the tier/.test(s.event)),
      `${fault}: the foreign page came from a load`,
    );
  }
});

test("counterexampleToDot() renders a trace as a Graphviz digraph", () => {
  const cex = runCheck({ fault: "early-free" }).result.counterexample;
  assert.ok(cex !== null);
  const dot = counterexampleToDot(cex);
  assert.match(dot, /^digraph counterexample \{/);
  assert.equal((dot.match(/ -> s\d+/g) ?? []).length, cex.steps.length);
});

test("runCheck() with two routers over the pair: a small bound holds completely, and every fault still has its counterexample", () => {
  const report = runCheck({ routers: 2, requests: 2, duplicates: 0, clientAborts: false });
  assert.equal(report.result.counterexample, null);
  assert.equal(report.result.complete, true);
  assert.ok(report.result.states > 1000);
  assert.match(formatReport(report), /routers 2/);
  // The shortest trace may differ (placeholder-reject's is its companion fault's, invariant 4).
  for (const fault of FAULT_NAMES) {
    const cex = runCheck({ fault, routers: 2, maxStates: 50_000 }).result.counterexample;
    assert.ok(cex !== null, `no counterexample for ${fault} with two routers`);
  }
  assert.throws(() => runCheck({ routers: 3 }), /1 or 2 routers: 3/);
});

test("runCheck() rejects a request count outside the model", () => {
  assert.throws(() => runCheck({ requests: 9 }), /1 to 3 requests: 9/);
});
