/**
 * The Kubernetes example (deploy/kubernetes/kvfence.yaml, docs/topologies.md) is checked offline:
 * every object against the Kubernetes API's JSON schemas bundled in `kubernetes-models`, and every
 * flag a kvfence container passes against `kvfence serve`'s own options. The autoscaling example
 * (deploy/kubernetes/autoscaling.yaml) the same way, and each autoscaler against what it scales:
 * a Deployment of the example running the role its metrics select, on metrics the router exports
 * and the Prometheus adapter's rules serve.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { Deployment, StatefulSet } from "kubernetes-models/apps/v1";
import { HorizontalPodAutoscaler } from "kubernetes-models/autoscaling/v2";
import { NetworkPolicy } from "kubernetes-models/networking.k8s.io/v1";
import { ConfigMap, Secret, Service } from "kubernetes-models/v1";
import { parseAllDocuments } from "yaml";
import { command as serveCommand } from "./cli/serve.js";

const FILE = new URL("../../deploy/kubernetes/kvfence.yaml", import.meta.url);
const AUTOSCALING = new URL("../../deploy/kubernetes/autoscaling.yaml", import.meta.url);
const METRICS_SOURCE = new URL("../../src/cluster/cluster-metrics.ts", import.meta.url);

const MODELS: Record<string, new (data: never) => { validate(): void }> = {
  "apps/v1/Deployment": Deployment,
  "apps/v1/StatefulSet": StatefulSet,
  "autoscaling/v2/HorizontalPodAutoscaler": HorizontalPodAutoscaler,
  "v1/ConfigMap": ConfigMap,
  "networking.k8s.io/v1/NetworkPolicy": NetworkPolicy,
  "v1/Secret": Secret,
  "v1/Service": Service,
};

function objects(text: string): Record<string, unknown>[] {
  return parseAllDocuments(text).map((d) => {
    assert.equal(d.errors.length, 0, String(d.errors[0]));
    return d.toJSON() as Record<string, unknown>;
  });
}

function validate(obj: Record<string, unknown>): void {
  const Model = MODELS[`${obj.apiVersion}/${obj.kind}`];
  assert.ok(Model !== undefined, `no schema for ${obj.apiVersion} ${obj.kind}`);
  new Model(obj as never).validate();
}

test("the Kubernetes example validates against the Kubernetes schemas, and its kvfence flags exist", () => {
  const all = objects(readFileSync(FILE, "utf8"));
  assert.deepEqual(
    all.map((o) => o.kind),
    [
      "Secret",
      "Service",
      "StatefulSet",
      "Deployment",
      "Deployment",
      "Deployment",
      "Service",
      "NetworkPolicy",
    ],
  );
  for (const obj of all) validate(obj);
  const known = new Set(serveCommand().options.map((o) => o.long));
  const roles: string[] = [];
  for (const obj of all.filter((o) => o.kind === "Deployment")) {
    const spec = obj.spec as { template: { spec: { containers: { args: string[] }[] } } };
    const args = spec.template.spec.containers[0]!.args;
    assert.equal(args[0], "serve");
    for (const a of args.slice(1)) {
      const flag = a.split("=")[0]!;
      assert.ok(known.has(flag), `kvfence serve has no ${flag}`);
    }
    roles.push(args.find((a) => a.startsWith("--role="))!.slice(7));
    assert.ok(args.includes("--registry=etcd://kvfence-etcd:2379"));
  }
  assert.deepEqual(roles, ["prefill", "decode", "router"]);
});

test("the schema check refuses a broken manifest (it is a check that can fail)", () => {
  const [deployment] = objects(readFileSync(FILE, "utf8")).filter((o) => o.kind === "Deployment");
  const broken = { ...deployment!, spec: { ...(deployment!.spec as object), replicas: "two" } };
  assert.throws(() => validate(broken), /replicas/);
  const noSelector = { ...deployment!, spec: { ...(deployment!.spec as object), selector: undefined } };
  assert.throws(() => validate(noSelector));
});

interface Hpa {
  metadata: { name: string };
  spec: {
    scaleTargetRef: { kind: string; name: string };
    metrics: {
      type: string;
      external: { metric: { name: string; selector: { matchLabels: { role: string } } } };
    }[];
  };
}

test("the autoscaling example validates, and each role's autoscaler scales that role on metrics the router exports and the adapter serves", () => {
  const all = objects(readFileSync(AUTOSCALING, "utf8"));
  assert.deepEqual(
    all.map((o) => o.kind),
    ["ConfigMap", "HorizontalPodAutoscaler", "HorizontalPodAutoscaler"],
  );
  for (const obj of all) validate(obj);
  // The adapter's rules: each names a metric the router registers, by role.
  const adapter = parseAllDocuments(
    (all[0]!.data as Record<string, string>)["config.yaml"]!,
  )[0]!.toJSON() as {
    externalRules: { seriesQuery: string; name: { as: string }; metricsQuery: string }[];
  };
  const exported = readFileSync(METRICS_SOURCE, "utf8");
  const served = new Set<string>();
  for (const rule of adapter.externalRules) {
    assert.ok(exported.includes(`"${rule.name.as}"`), `the router exports no ${rule.name.as}`);
    assert.ok(rule.seriesQuery.startsWith(`${rule.name.as}{role`), rule.seriesQuery);
    assert.match(rule.metricsQuery, /by \(role\)/);
    served.add(rule.name.as);
  }
  // Each autoscaler: a Deployment of kvfence.yaml, its --role the role its metrics select.
  const deployments = objects(readFileSync(FILE, "utf8")).filter((o) => o.kind === "Deployment");
  const roleOf = (name: string): string | undefined => {
    const d = deployments.find((o) => (o.metadata as { name: string }).name === name);
    if (d === undefined) return undefined;
    const spec = d.spec as { template: { spec: { containers: { args: string[] }[] } } };
    return spec.template.spec.containers[0]?.args.find((a) => a.startsWith("--role="))?.slice(7);
  };
  const scaled: string[] = [];
  for (const hpa of all.slice(1) as unknown as Hpa[]) {
    const target = hpa.spec.scaleTargetRef;
    assert.equal(target.kind, "Deployment");
    const role = roleOf(target.name);
    assert.ok(
      role === "prefill" || role === "decode",
      `${hpa.metadata.name} scales no node Deployment: ${target.name}`,
    );
    for (const m of hpa.spec.metrics) {
      assert.equal(m.type, "External");
      assert.ok(served.has(m.external.metric.name), `the adapter serves no ${m.external.metric.name}`);
      assert.equal(
        m.external.metric.selector.matchLabels.role,
        role,
        `${hpa.metadata.name} reads its own role`,
      );
    }
    scaled.push(role);
  }
  assert.deepEqual(scaled, ["prefill", "decode"]);
});
