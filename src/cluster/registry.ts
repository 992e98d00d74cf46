/**
 * Cluster membership in etcd (`--registry etcd://host:port[,host:port…]`, docs/topologies.md). A
 * node registers itself under `<prefix>/nodes/<role>/<address>` with a lease it keeps alive
 * (`etcd3`'s lease keepalive; a lost lease is granted again and the entry re-put); the value is
 * the node's `Registration`: incarnation, role, KV layout signature, pool capacity, context length
 * and control address. A router watches the prefix (`watchRegistry`): the initial listing, then
 * every put and delete, and a fresh listing whenever its watch reconnects (etcd restarted), so it
 * never misses an entry.
 *
 * The registry is only a directory. An entry is believed only once the node at its address proved
 * the cluster secret on its own control link, in a handshake that binds that address
 * (src/transfer/link-address.ts), and its hello says what the entry says (`cluster-router.ts`), so
 * a forged entry cannot pull traffic to an outsider — not even one copying a real node's entry to
 * the outsider's address, with a relay there to the real node. An etcd writer can deny service,
 * not read or steer traffic (docs/security.md, "The registry"). And an entry that
 * goes (lease expired, node drained) only stops new requests: nothing is freed for it — pages are
 * freed by an ABORT_ACK or the fence (the link's close), never by a lease expiry
 * (docs/protocol.md).
 */
import { readFileSync } from "node:fs";
import type { Etcd3, IOptions, Lease } from "etcd3";
import { KvfenceError } from "../lib/errors.js";

/** What a node says about itself in the registry. */
export interface Registration {
  readonly role: "prefill" | "decode";
  readonly incarnation: number;
  readonly layoutSignature: string;
  readonly poolTokens: number;
  readonly pageSize: number;
  readonly maxModelLen: number;
  /** Where its control link listens, host:port. */
  readonly address: string;
  /** True once the node asked to be drained: no new requests, in-flight ones finish. */
  readonly draining?: boolean;
}

export interface RegistryOptions {
  /** etcd endpoints, `http://host:port` or `https://host:port`. */
  readonly endpoints: readonly string[];
  /** Key prefix of this cluster (default `/kvfence`). */
  readonly prefix?: string;
  /** `--registry-ca/--registry-cert/--registry-key`: TLS to etcd (PEM files). */
  readonly ca?: string;
  readonly cert?: string;
  readonly key?: string;
  readonly user?: string;
  readonly password?: string;
  /** Lease TTL in seconds (default 5). */
  readonly ttlSeconds?: number;
}

export const DEFAULT_REGISTRY_PREFIX = "/kvfence";
export const DEFAULT_LEASE_TTL_SECONDS = 5;

/** `etcd://host:port[,host:port…]` → the endpoints; `https` with TLS files. */
export function parseRegistryUrl(url: string, tls: boolean): string[] {
  const match = /^etcd:\/\/(.+)$/.exec(url.trim());
  const hosts = match === null ? [] : match[1]!.split(",").map((h) => h.trim());
  if (hosts.length === 0 || hosts.some((h) => !/^(\[[^\]]+\]|[^:/[\]]+):\d{1,5}$/.test(h))) {
    throw new KvfenceError(
      "config_invalid",
      `--registry must look like etcd://127.0.0.1:2379[,host:port…]: ${JSON.stringify(url)}`,
    );
  }
  return hosts.map((h) => `${tls ? "https" : "http"}://${h}`);
}

/** An etcd client. The library (with its gRPC stack) loads only when a registry is used, not at every start. */
async function etcdClient(options: RegistryOptions): Promise<Etcd3> {
  const { Etcd3 } = await import("etcd3");
  return new Etcd3(clientOptions(options));
}

/** Revokes `lease` (its keys go at once) and closes the client; a lease etcd cannot revoke now expires by itself. */
async function revokeAndClose(client: Etcd3, lease: Lease | null): Promise<void> {
  try {
    await lease?.revoke();
  } catch {
    // The lease expires by itself.
  }
  client.close();
}

function clientOptions(options: RegistryOptions): IOptions {
  const read = (file: string) => readFileSync(file);
  return {
    hosts: [...options.endpoints],
    ...(options.ca === undefined
      ? {}
      : {
          credentials: {
            rootCertificate: read(options.ca),
            ...(options.key === undefined ? {} : { privateKey: read(options.key) }),
            ...(options.cert === undefined ? {} : { certChain: read(options.cert) }),
          },
        }),
    ...(options.user === undefined
      ? {}
      : { auth: { username: options.user, password: options.password ?? "" } }),
  };
}

const prefixOf = (options: RegistryOptions) => `${options.prefix ?? DEFAULT_REGISTRY_PREFIX}/nodes/`;

/** The key of a node's entry: one per role and address. */
export function registrationKey(
  options: RegistryOptions,
  reg: Pick<Registration, "role" | "address">,
): string {
  return `${prefixOf(options)}${reg.role}/${reg.address}`;
}

/** A node's registration, kept alive until `close` (which deletes it). */
export interface NodeRegistration {
  /** Puts the entry again with `draining: true` (the router stops sending new requests). */
  drain(): Promise<void>;
  /** Deletes the entry and stops the keepalive. */
  close(): Promise<void>;
}

/**
 * Registers `reg` under a lease of `ttlSeconds`, kept alive by etcd3; when the lease is lost (etcd
 * was away longer than the TTL, or restarted without it) a new one is granted and the entry put
 * again, retrying every second until it works or `close`.
 */
export async function registerNode(
  options: RegistryOptions,
  reg: Registration,
  log: (message: string) => void = () => {},
): Promise<NodeRegistration> {
  const client = await etcdClient(options);
  const key = registrationKey(options, reg);
  let value = reg;
  let lease: Lease | null = null;
  let closed = false;
  const grant = async (): Promise<void> => {
    const l = client.lease(options.ttlSeconds ?? DEFAULT_LEASE_TTL_SECONDS);
    lease = l;
    l.on("lost", (err) => {
      if (closed || lease !== l) return;
      log(`registry: lease lost (${err.message}); registering again`);
      void retry();
    });
    await l.put(key).value(JSON.stringify(value));
  };
  const retry = async (): Promise<void> => {
    while (!closed) {
      try {
        await grant();
        return;
      } catch (err) {
        log(`registry: cannot register (${(err as Error).message}); retrying`);
        await new Promise((r) => setTimeout(r, 1000).unref());
      }
    }
  };
  try {
    await grant();
  } catch (err) {
    client.close();
    throw new KvfenceError(
      "config_invalid",
      `Cannot register in the etcd registry at ${options.endpoints.join(",")}: ${(err as Error).message}`,
    );
  }
  return {
    async drain() {
      value = { ...value, draining: true };
      if (lease !== null) await lease.put(key).value(JSON.stringify(value));
    },
    async close() {
      closed = true;
      await revokeAndClose(client, lease);
    },
  };
}

/** A router's claim on its router slot in the registry, held until `close`. */
export interface RouterSlotClaim {
  readonly slot: number;
  close(): Promise<void>;
}

/** The key of router slot `slot`'s claim: `<prefix>/routers/<slot>`. */
export function routerSlotKey(options: RegistryOptions, slot: number): string {
  return `${options.prefix ?? DEFAULT_REGISTRY_PREFIX}/routers/${slot}`;
}

/**
 * Claims a router slot (docs/topologies.md, "Several routers"): `wanted` (`--router-slot`) or,
 * without one, the lowest of `0 … slots - 1` no router holds, each by an etcd transaction that puts
 * `<prefix>/routers/<slot>` only if it does not exist, under a lease kept alive like a node's entry.
 * A slot another router holds is refused at startup with the fix. The claim only keeps two routers
 * of one cluster from starting in one slot by mistake: safety never rests on it (a node admits one
 * router per slot, a newer incarnation fencing the older, docs/protocol.md §3, item 13). A lost
 * lease is claimed again for the same slot (logged loudly if another router took it meanwhile).
 */
export async function claimRouterSlot(
  options: RegistryOptions,
  wanted: number | undefined,
  slots: number,
  incarnation: number,
  log: (message: string) => void = () => {},
): Promise<RouterSlotClaim> {
  const client = await etcdClient(options);
  const value = JSON.stringify({ incarnation });
  let closed = false;
  let lease: Lease | null = null;
  const tryClaim = async (slot: number, l: Lease): Promise<boolean> => {
    const key = routerSlotKey(options, slot);
    const r = await client
      .if(key, "Create", "==", 0)
      .then(client.put(key).value(value).lease(l.grant()))
      .commit();
    return r.succeeded;
  };
  const grant = (slot: number | null): Lease => {
    const l = client.lease(options.ttlSeconds ?? DEFAULT_LEASE_TTL_SECONDS, { autoKeepAlive: true });
    lease = l;
    l.on("lost", (err) => {
      if (closed || lease !== l || slot === null) return;
      log(`registry: router slot lease lost (${err.message}); claiming router slot ${slot} again`);
      void reclaim(slot);
    });
    return l;
  };
  const reclaim = async (slot: number): Promise<void> => {
    while (!closed) {
      try {
        if (!(await tryClaim(slot, grant(slot))))
          log(
            `registry: router slot ${slot} is held by another router now; give each router its own --router-slot`,
          );
        return;
      } catch (err) {
        log(`registry: cannot claim router slot ${slot} (${(err as Error).message}); retrying`);
        await new Promise((r) => setTimeout(r, 1000).unref());
      }
    }
  };
  const candidates = wanted === undefined ? Array.from({ length: slots }, (_, i) => i) : [wanted];
  try {
    for (const slot of candidates) {
      if (await tryClaim(slot, grant(slot))) {
        return {
          slot,
          async close() {
            closed = true;
            await revokeAndClose(client, lease);
          },
        };
      }
      await (lease as Lease | null)?.revoke().catch(() => {});
    }
  } catch (err) {
    closed = true;
    client.close();
    throw new KvfenceError(
      "config_invalid",
      `Cannot claim a router slot in the etcd registry at ${options.endpoints.join(",")}: ${(err as Error).message}`,
    );
  }
  closed = true;
  client.close();
  throw new KvfenceError(
    "config_invalid",
    wanted === undefined
      ? `Every router slot (0-${slots - 1}) is held by a running router of this cluster: ${slots} routers at most`
      : `Router slot ${wanted} is held by another running router of this cluster; give each router its own --router-slot, or leave it out to claim a free one: ${wanted}`,
  );
}

/** The entries under the prefix now, by key; called on every change. */
export type RegistryListener = (entries: ReadonlyMap<string, Registration>) => void;

export interface RegistryWatch {
  close(): void;
}

/** Parses an entry; null for one that is not a registration (logged by the caller). */
export function parseRegistration(value: string): Registration | null {
  try {
    const v = JSON.parse(value) as Partial<Registration>;
    if (
      (v.role !== "prefill" && v.role !== "decode") ||
      typeof v.incarnation !== "number" ||
      typeof v.layoutSignature !== "string" ||
      typeof v.poolTokens !== "number" ||
      typeof v.pageSize !== "number" ||
      typeof v.maxModelLen !== "number" ||
      typeof v.address !== "string"
    )
      return null;
    return v as Registration;
  } catch {
    return null;
  }
}

/**
 * Watches the cluster's entries: `onChange` gets the whole set after the initial listing and after
 * every put or delete; a watch that reconnects lists again (a put or delete missed while etcd was
 * away is not lost).
 */
export async function watchRegistry(
  options: RegistryOptions,
  onChange: RegistryListener,
  log: (message: string) => void = () => {},
): Promise<RegistryWatch> {
  const client = await etcdClient(options);
  const prefix = prefixOf(options);
  const entries = new Map<string, Registration>();
  let closed = false;
  const list = async (): Promise<void> => {
    const all = await client.getAll().prefix(prefix).strings();
    entries.clear();
    for (const [k, v] of Object.entries(all)) {
      const reg = parseRegistration(v);
      if (reg === null) log(`registry: ignoring an entry that is not a node registration: ${k}`);
      else entries.set(k, reg);
    }
    if (!closed) onChange(entries);
  };
  try {
    await list();
  } catch (err) {
    client.close();
    throw new KvfenceError(
      "config_invalid",
      `Cannot read the etcd registry at ${options.endpoints.join(",")}: ${(err as Error).message}`,
    );
  }
  const watcher = await client.watch().prefix(prefix).create();
  let first = true;
  watcher.on("connected", () => {
    if (first) {
      first = false;
      return;
    }
    list().catch((err: Error) => log(`registry: cannot list after reconnecting: ${err.message}`));
  });
  watcher.on("put", (kv) => {
    const reg = parseRegistration(kv.value.toString());
    if (reg === null) return;
    entries.set(kv.key.toString(), reg);
    if (!closed) onChange(entries);
  });
  watcher.on("delete", (kv) => {
    entries.delete(kv.key.toString());
    if (!closed) onChange(entries);
  });
  watcher.on("error", (err) => log(`registry: watch error: ${err.message}`));
  return {
    close() {
      closed = true;
      void watcher.cancel().catch(() => {});
      client.close();
    },
  };
}

/** The key `kvfence drain` puts to ask the node at `address` to drain. */
export function drainKey(options: RegistryOptions, reg: Pick<Registration, "role" | "address">): string {
  return `${options.prefix ?? DEFAULT_REGISTRY_PREFIX}/drain/${reg.role}/${reg.address}`;
}

/**
 * Calls `onDrain` once when a drain of the node `reg` is asked (`requestDrain`): the node then
 * marks its entry draining (no new requests), lets its requests in flight finish and leaves.
 */
export async function watchDrain(
  options: RegistryOptions,
  reg: Pick<Registration, "role" | "address">,
  onDrain: () => void,
): Promise<RegistryWatch> {
  const client = await etcdClient(options);
  const key = drainKey(options, reg);
  let fired = false;
  const fire = () => {
    if (fired) return;
    fired = true;
    void client
      .delete()
      .key(key)
      .exec()
      .catch(() => {});
    onDrain();
  };
  const watcher = await client.watch().key(key).create();
  watcher.on("put", fire);
  watcher.on("error", () => {});
  if ((await client.get(key).string()) !== null) fire();
  return {
    close() {
      void watcher.cancel().catch(() => {});
      client.close();
    },
  };
}

/** `role@host:port` (as `/kvfence/nodes` names a node) → its role and address. */
function parseNodeId(id: string): Pick<Registration, "role" | "address"> {
  const match = /^(prefill|decode)@(.+)$/.exec(id);
  if (match === null)
    throw new KvfenceError(
      "invalid_request",
      `A node is named role@host:port, e.g. decode@10.0.0.21:9002: ${id}`,
    );
  return { role: match[1] as "prefill" | "decode", address: match[2]! };
}

/**
 * `kvfence drain NODE`: asks node `id` (`role@host:port`, as `/kvfence/nodes` lists it) to drain,
 * then waits until its entry is gone (it finished its requests and left) or `timeoutMs` passed.
 * Returns the milliseconds it took; throws when there is no such node or it did not leave in time.
 */
export async function requestDrain(options: RegistryOptions, id: string, timeoutMs: number): Promise<number> {
  const reg = parseNodeId(id);
  const client = await etcdClient(options);
  const t0 = Date.now();
  try {
    const key = registrationKey(options, reg);
    if ((await client.get(key).string()) === null)
      throw new KvfenceError("invalid_request", `No node ${id} is registered under ${prefixOf(options)}`);
    await client.put(drainKey(options, reg)).value(String(Date.now()));
    while (Date.now() - t0 < timeoutMs) {
      if ((await client.get(key).string()) === null) return Date.now() - t0;
      await new Promise((r) => setTimeout(r, 100));
    }
    throw new KvfenceError(
      "node_unavailable",
      `Node ${id} is draining but still registered after ${timeoutMs} ms (requests still in flight?): timeout`,
    );
  } finally {
    client.close();
  }
}

/** A role switch asked of a node (`kvfence role`): the role it is to take, and its drain deadline. */
export interface RoleRequest {
  readonly role: "prefill" | "decode";
  /** How long its requests in flight may run on before the rest are ended by its fence (and migrate). */
  readonly drainTimeoutMs: number;
}

/** The key `kvfence role` puts to ask the node at `address` (whatever its role now) to change role. */
export function roleKey(options: RegistryOptions, address: string): string {
  return `${options.prefix ?? DEFAULT_REGISTRY_PREFIX}/role/${address}`;
}

function parseRoleRequest(value: string): RoleRequest | null {
  try {
    const v = JSON.parse(value) as Partial<RoleRequest>;
    if ((v.role !== "prefill" && v.role !== "decode") || typeof v.drainTimeoutMs !== "number") return null;
    return { role: v.role, drainTimeoutMs: v.drainTimeoutMs };
  } catch {
    return null;
  }
}

/**
 * Calls `onRole` with each role switch asked of the node at `address` (`requestRole`), one at a
 * time: the key is deleted once `onRole` settled (so a request put meanwhile is seen after).
 */
export async function watchRole(
  options: RegistryOptions,
  address: string,
  onRole: (request: RoleRequest) => Promise<void>,
  log: (message: string) => void = () => {},
): Promise<RegistryWatch> {
  const client = await etcdClient(options);
  const key = roleKey(options, address);
  let busy = false;
  const fire = async (value: string | null): Promise<void> => {
    if (value === null || busy) return;
    const request = parseRoleRequest(value);
    busy = true;
    try {
      await client.delete().key(key).exec();
      if (request === null) log(`registry: ignoring a role request that is not one: ${value}`);
      else await onRole(request);
    } catch (err) {
      log(`registry: role switch failed: ${(err as Error).message}`);
    } finally {
      busy = false;
    }
    // One put while switching: take it now.
    void client
      .get(key)
      .string()
      .then(fire, () => {});
  };
  const watcher = await client.watch().key(key).create();
  watcher.on("put", (kv) => void fire(kv.value.toString()));
  watcher.on("error", () => {});
  void fire(await client.get(key).string());
  return {
    close() {
      void watcher.cancel().catch(() => {});
      client.close();
    },
  };
}

/**
 * `kvfence role NODE ROLE`: asks node `id` (`role@host:port`) to take `role`, then waits until it
 * is registered under it (drained, scrubbed, back as a new incarnation) or `timeoutMs` passed.
 * Returns the milliseconds it took; throws when there is no such node or it did not switch in time.
 */
export async function requestRole(
  options: RegistryOptions,
  id: string,
  request: RoleRequest,
  timeoutMs: number,
): Promise<number> {
  const reg = parseNodeId(id);
  const client = await etcdClient(options);
  const t0 = Date.now();
  try {
    if ((await client.get(registrationKey(options, reg)).string()) === null)
      throw new KvfenceError("invalid_request", `No node ${id} is registered under ${prefixOf(options)}`);
    if (reg.role === request.role)
      throw new KvfenceError("invalid_request", `Node ${id} is a ${reg.role} node already: ${request.role}`);
    await client.put(roleKey(options, reg.address)).value(JSON.stringify(request));
    const target = registrationKey(options, { role: request.role, address: reg.address });
    while (Date.now() - t0 < timeoutMs) {
      if ((await client.get(target).string()) !== null) return Date.now() - t0;
      await new Promise((r) => setTimeout(r, 100));
    }
    throw new KvfenceError(
      "node_unavailable",
      `Node ${id} is not registered as a ${request.role} node after ${timeoutMs} ms (its log says why): timeout`,
    );
  } finally {
    client.close();
  }
}
