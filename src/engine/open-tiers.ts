/**
 * Opens an engine's KV tiers (docs/design.md §3b) from the plain options a server passes
 * (`--cache-ram`, `--cache-disk`, `--cache-disk-size`, `--cache-disk-key`): the tier secret read
 * (or made) from the key file, the guards from the engine's `Safety`, the disk directory checked and
 * its index rebuilt.
 */
import { layoutSignature } from "../kvcache/kv-layout.js";
import { KvTiers, readTierKeyFile } from "../kvcache/kv-tiers.js";
import type { PagePool } from "../kvcache/page-pool.js";
import type { ModelConfig } from "../model/model-config.js";
import { guardOn, type Safety } from "../protocol/safety.js";

/** What a server asks of an engine's tiers (plain data: it crosses into a worker thread). */
export interface TierConfig {
  /** `--cache-ram`: bytes of the host-memory tier (0: none). */
  readonly ramBytes: number;
  /** `--cache-disk DIR --cache-disk-size SIZE --cache-disk-key FILE`. */
  readonly disk?: { readonly dir: string; readonly maxBytes: number; readonly keyFile: string };
}

/**
 * The layout signature of an engine's pool for `config`'s model: what two nodes of a transfer
 * compare, and what a tier directory's manifest and records name.
 */
export function engineLayoutSignature(pool: PagePool, config: ModelConfig): string {
  return layoutSignature(
    pool.layout,
    `${config.architecture}-h${config.hiddenSize}-v${config.vocabSize}-l${config.numLayers}`,
  );
}

export async function openTiers(
  tiers: TierConfig,
  pool: PagePool,
  config: ModelConfig,
  safety: Safety,
): Promise<KvTiers> {
  const disk = tiers.disk;
  return KvTiers.open({
    ramBytes: tiers.ramBytes,
    ...(disk === undefined
      ? {}
      : {
          disk: { dir: disk.dir, maxBytes: disk.maxBytes },
          secretKey: readTierKeyFile(disk.keyFile, disk.dir),
        }),
    layout: engineLayoutSignature(pool, config),
    pageBytes: pool.pageBytes,
    guards: {
      mac: guardOn(safety, "tier-mac"),
      owner: guardOn(safety, "tier-owner"),
      epoch: guardOn(safety, "tier-epoch"),
    },
    spillCopy: guardOn(safety, "tier-spill-copy"),
  });
}
