/**
 * How tenants are named in /metrics (and coloured on the dashboard): by opaque ids unless
 * `--metrics-tenant-names` asks for their names, so that a scrape tells an onlooker nothing of who
 * the tenants are. The ids are `t-` and 12 hex digits of an HMAC-SHA256 of the name, keyed with the
 * operator key when there is one (the labels then stay the same across restarts), else with a
 * random key; the log says, once at startup, which id is which tenant.
 */
import { createHmac, randomBytes } from "node:crypto";
import type { Logger } from "../lib/logger.js";

export interface TenantLabelOptions {
  /** Every tenant's name. */
  readonly names: readonly string[];
  /** `--metrics-tenant-names`: label by name. */
  readonly byName: boolean;
  /** `--operator-key`, or undefined. */
  readonly operatorKey: string | undefined;
}

/** Tenant name → its label in metrics; logs the opaque ids given. */
export function tenantLabels(options: TenantLabelOptions, log: Logger): (name: string) => string {
  if (options.byName) return (name) => name;
  const label = opaqueTenantLabels(options.operatorKey ?? randomBytes(32).toString("hex"));
  log.info(
    { labels: Object.fromEntries(options.names.map((name) => [name, label(name)])) },
    "tenants are labelled in /metrics by these opaque ids (--metrics-tenant-names shows names)",
  );
  return label;
}

/** Tenant names → opaque metric labels, keyed with `key`, each computed once. */
function opaqueTenantLabels(key: string): (name: string) => string {
  const labels = new Map<string, string>();
  return (name) => {
    let label = labels.get(name);
    if (label === undefined) {
      label = `t-${createHmac("sha256", key).update(`kvfence tenant label\0${name}`).digest("hex").slice(0, 12)}`;
      labels.set(name, label);
    }
    return label;
  };
}
