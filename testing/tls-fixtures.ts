/**
 * The committed TLS test certificates (testing/fixtures/tls/, made by scripts/make-test-certs.sh)
 * as file paths and as loaded link options: the cluster's own identity, a client that trusts the CA
 * but presents no certificate, and a peer from another CA, for the tests of docs/tls.md.
 */
import { join } from "node:path";
import { packageRoot } from "../src/lib/package-root.js";
import { type LinkTls, loadLinkTls, type TlsFiles } from "../src/transfer/tls-config.js";

export const TLS_DIR = join(packageRoot(), "testing", "fixtures", "tls");

const file = (name: string): string => join(TLS_DIR, name);

/** The cluster's files: node certificate (SANs localhost, 127.0.0.1, ::1) and CA. */
export const CLUSTER_TLS_FILES: TlsFiles = {
  cert: file("node.crt"),
  key: file("node.key"),
  ca: file("ca.crt"),
};

/** A client-only certificate of the same CA (a router). */
export const CLIENT_TLS_FILES: TlsFiles = {
  cert: file("client.crt"),
  key: file("client.key"),
  ca: file("ca.crt"),
};

/**
 * A peer of another cluster: its certificate is issued by a CA we do not trust (other-ca.crt), while
 * it trusts ours, so the only failure is our side refusing its certificate.
 */
export const OTHER_CA_TLS_FILES: TlsFiles = {
  cert: file("other-node.crt"),
  key: file("other-node.key"),
  ca: file("ca.crt"),
};

/** `kvfence serve`/`cluster` flags for the cluster's identity. */
export const CLUSTER_TLS_ARGS: readonly string[] = [
  "--tls-cert",
  CLUSTER_TLS_FILES.cert,
  "--tls-key",
  CLUSTER_TLS_FILES.key,
  "--tls-ca",
  CLUSTER_TLS_FILES.ca,
];

/**
 * Whether a test's TCP cluster runs its links over TLS: `KVFENCE_TEST_LINK_TLS=on|off` forces every
 * cluster test one way (run the suite twice to see both); unset, each test file takes its own
 * default, chosen so that one run of the suite covers both (docs/tls.md, "Tests").
 */
export function linkTlsInTests(defaultOn: boolean): boolean {
  const forced = process.env.KVFENCE_TEST_LINK_TLS;
  if (forced === "on") return true;
  if (forced === "off") return false;
  return defaultOn;
}

/** The TLS flags for a cluster test when `on`, else none. */
export const linkTlsArgs = (on: boolean): string[] => (on ? [...CLUSTER_TLS_ARGS] : []);

export const clusterTls = (): LinkTls => loadLinkTls(CLUSTER_TLS_FILES);

/** A peer whose certificate another CA issued (it trusts ours). */
export const otherCaTls = (): LinkTls => loadLinkTls(OTHER_CA_TLS_FILES);

/** Trusts our CA, presents no certificate. */
export function noCertTls(): LinkTls {
  const full = clusterTls();
  const { cert: _c, key: _k, ...client } = full.client;
  const { cert: _sc, key: _sk, ...server } = full.server;
  return { client, server };
}
