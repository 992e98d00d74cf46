import assert from "node:assert/strict";
import { test } from "node:test";
import { parsePrometheusText } from "./prometheus-text.js";

test("parsePrometheusText() reads each sample as name{labels} → value, skipping comments and blank lines", () => {
  const text = [
    "# HELP a_total A",
    "# TYPE a_total counter",
    'a_total{tenant="we\\"ird",status="200"} 3',
    "",
    "# TYPE b histogram",
    'b_bucket{le="+Inf",endpoint="chat"} +Inf',
    "b_sum 0.25",
    "",
  ].join("\n");
  assert.deepEqual(
    [...parsePrometheusText(text)],
    [
      ['a_total{tenant="we\\"ird",status="200"}', 3],
      ['b_bucket{le="+Inf",endpoint="chat"}', Number.POSITIVE_INFINITY],
      ["b_sum", 0.25],
    ],
  );
});
