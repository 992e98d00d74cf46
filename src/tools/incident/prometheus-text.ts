/**
 * A Prometheus text exposition read into `name{labels}` → value, the labels as rendered (for the
 * incident tool's guard counters and the tests' checks of /metrics). Kept here rather than taken
 * from npm: `parse-prometheus-text-format`, the parser there (prom-client renders but does not
 * parse), folds every series of a labelled histogram into one, losing their labels, sums and counts
 * (a fix has waited unmerged since 2019), and /metrics is mostly labelled histograms.
 */

/** Each sample line of `text` as `name{labels}` → value (HELP, TYPE and blank lines skipped). */
export function parsePrometheusText(text: string): Map<string, number> {
  const out = new Map<string, number>();
  for (const line of text.split("\n")) {
    if (line === "" || line.startsWith("#")) continue;
    const space = line.lastIndexOf(" ");
    const value = line.slice(space + 1);
    out.set(line.slice(0, space), value === "+Inf" ? Number.POSITIVE_INFINITY : Number(value));
  }
  return out;
}
