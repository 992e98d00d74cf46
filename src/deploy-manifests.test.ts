/**
 * The Kubernetes example (deploy/kubernetes/kvfence.yaml, docs/topologies.md) is checked offline:
 * every object against the Kubernetes API's JSON schemas bundled in `kubernetes-models`, and every
 * flag a kvfence container passes against `kvfence serve`'s own options.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import { Deployment, StatefulSet } from "kubernetes-models/apps/v1";
import { NetworkPolicy } from "kubernetes-models/networking.k8s.io/v1";
import { Secret, Service } from "kubernetes-models/v1";
import { parseAllDocuments } from "yaml";
import { command as serveCommand } from "./cli/serve.js";

const FILE = new URL("../../deploy/kubernetes/kvfence.yaml", import.meta.url);

const MODELS: Record<string, new (data: never) => { validate(): void }> = {
  "apps/v1/Deployment": Deployment,
  "apps/v1/StatefulSet": StatefulSet,
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
