/**
 * `assertAllClose(actual, expected, {rtol, atol})`: the element-wise check every fast kernel is
 * tested with against its reference (|a − e| ≤ atol + rtol·|e|, as numpy's allclose). On failure
 * it reports the worst index, both values and the largest absolute difference.
 */
import { AssertionError } from "node:assert";

type Numbers = ArrayLike<number>;

/** Largest |a[i] − b[i]| over the common length; NaN anywhere yields Infinity. */
export function maxAbsDiff(a: Numbers, b: Numbers): number {
  let max = 0;
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) {
    const d = Math.abs(a[i] - b[i]);
    if (!(d <= max)) max = Number.isNaN(d) ? Number.POSITIVE_INFINITY : d;
  }
  return max;
}

export function assertAllClose(
  actual: Numbers,
  expected: Numbers,
  options: { rtol?: number; atol?: number; message?: string } = {},
): void {
  const rtol = options.rtol ?? 1e-5;
  const atol = options.atol ?? 1e-6;
  const prefix = options.message === undefined ? "" : `${options.message}: `;
  if (actual.length !== expected.length) {
    throw new AssertionError({ message: `${prefix}Lengths differ: ${actual.length} vs ${expected.length}` });
  }
  let worst = -1;
  let worstExcess = 0;
  for (let i = 0; i < actual.length; i++) {
    const a = actual[i];
    const e = expected[i];
    const excess = Math.abs(a - e) - (atol + rtol * Math.abs(e));
    if (Number.isNaN(a) !== Number.isNaN(e) || excess > worstExcess || (worst < 0 && excess > 0)) {
      worst = i;
      worstExcess = Number.isNaN(excess) ? Number.POSITIVE_INFINITY : excess;
    }
  }
  if (worst >= 0) {
    throw new AssertionError({
      message: `${prefix}Not close at index ${worst}: actual ${actual[worst]}, expected ${expected[worst]} (rtol ${rtol}, atol ${atol}; max |diff| ${maxAbsDiff(actual, expected)})`,
    });
  }
}
