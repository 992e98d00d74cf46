/**
 * The decode side's commit check (docs/design.md §4 step 5, docs/prior-art.md H1/H4/H9): a transfer
 * commits only when the manifest is for this `(rid, epoch)`, its token coverage equals the
 * reservation exactly, and every page checksum equals decode's own recomputation over the bytes in
 * its pool. Pure: the caller recomputes the checksums (`checksumLeasePages`, possibly on another
 * core while pages land) and passes them in. Expected failures are data, not exceptions.
 */
import { KvfenceError } from "../lib/errors.js";
import type { Manifest } from "./transport.js";

/** What decode reserved for the request: coverage `[tokenStart, tokenEnd)` over `numPages` pages. */
export interface TransferReservation {
  readonly rid: number;
  readonly epoch: number;
  readonly tokenStart: number;
  readonly tokenEnd: number;
  readonly numPages: number;
}

export type ManifestVerdict =
  | { readonly code: "ok" }
  | {
      readonly code: "stale_manifest";
      readonly expected: { readonly rid: number; readonly epoch: number };
      readonly actual: { readonly rid: number; readonly epoch: number };
    }
  | {
      readonly code: "coverage_mismatch";
      readonly reserved: {
        readonly tokenStart: number;
        readonly tokenEnd: number;
        readonly numPages: number;
      };
      readonly manifest: {
        readonly tokenStart: number;
        readonly tokenEnd: number;
        readonly numPages: number;
      };
    }
  | {
      readonly code: "checksum_mismatch";
      /** Logical page index of the first mismatch. */
      readonly page: number;
      /** Hex checksums: the manifest's and decode's own. */
      readonly expected: string;
      readonly actual: string;
    };

/**
 * `expected` checksums come from the manifest (prefill's hash of what it sent); `actual` from
 * `localChecksums` (decode's hash of what it holds, one per reserved page; fewer is a caller bug and
 * throws). Checks in order: key, coverage, checksums.
 */
export function verifyManifest(
  reservation: TransferReservation,
  manifest: Pick<Manifest, "rid" | "epoch" | "tokenStart" | "tokenEnd" | "checksums">,
  localChecksums: readonly string[],
): ManifestVerdict {
  if (manifest.rid !== reservation.rid || manifest.epoch !== reservation.epoch) {
    return {
      code: "stale_manifest",
      expected: { rid: reservation.rid, epoch: reservation.epoch },
      actual: { rid: manifest.rid, epoch: manifest.epoch },
    };
  }
  if (
    manifest.tokenStart !== reservation.tokenStart ||
    manifest.tokenEnd !== reservation.tokenEnd ||
    manifest.checksums.length !== reservation.numPages
  ) {
    return {
      code: "coverage_mismatch",
      reserved: {
        tokenStart: reservation.tokenStart,
        tokenEnd: reservation.tokenEnd,
        numPages: reservation.numPages,
      },
      manifest: {
        tokenStart: manifest.tokenStart,
        tokenEnd: manifest.tokenEnd,
        numPages: manifest.checksums.length,
      },
    };
  }
  if (localChecksums.length !== reservation.numPages) {
    throw new KvfenceError(
      "internal",
      `Local checksums must cover all ${reservation.numPages} reserved pages, got: ${localChecksums.length}`,
    );
  }
  for (let i = 0; i < reservation.numPages; i++) {
    const expected = manifest.checksums[i]!;
    const actual = localChecksums[i]!;
    if (actual !== expected) return { code: "checksum_mismatch", page: i, expected, actual };
  }
  return { code: "ok" };
}
