/**
 * The operator's endpoints (docs/api.md, "Operator endpoints") other than /metrics: who may call
 * them, `/kvfence/nodes` (the nodes the router serves with), `/kvfence/state` and `/kvfence/ui`
 * (the dashboard, dashboard.ts). With an operator key configured (`--operator-key`) a request must
 * carry it, on either listener; without one only the operator listener serves them, and it answers
 * loopback `Host` names only (operator-host.ts).
 */
import { createHash, timingSafeEqual } from "node:crypto";
import type { IncomingMessage, ServerResponse } from "node:http";
import { performance } from "node:perf_hooks";
import type { NodesInfo } from "../admin-api/admin-wire.js";
import { KvfenceError } from "../lib/errors.js";
import type { EngineHandle } from "../protocol/engine-api.js";
import type { AnswerWriter } from "./answer-writer.js";
import {
  DASHBOARD_HEADERS,
  type DashboardState,
  dashboardAsset,
  dashboardState,
  STATE_REUSE_MS,
  tenantColour,
} from "./dashboard.js";
import { checkOperatorHost } from "./operator-host.js";

/** Which listener a request came in on: the front door, or the operator listener. */
export type Listener = "front" | "operator";

/** The routes of the operator listener: the operator endpoints and /health. */
export const OPERATOR_LISTENER_PATHS: ReadonlySet<string> = new Set([
  "/metrics",
  "/kvfence/nodes",
  "/health",
  "/kvfence/state",
  "/kvfence/ui",
  "/kvfence/ui/dashboard.js",
  "/kvfence/ui/dashboard.css",
]);

export interface OperatorEndpointsOptions {
  readonly engine: EngineHandle;
  readonly answers: AnswerWriter;
  /** `--operator-key`, or undefined. */
  readonly operatorKey: string | undefined;
  /** A tenant's label in metrics (the dashboard colours tenants by it). */
  readonly tenantLabel: (name: string) => string;
  /** The router's context length (`max_model_len`). */
  readonly contextLength: number;
  /** Generations in flight. */
  readonly activeRequests: () => number;
  /** The router's base URL once listening, else null. */
  readonly url: () => string | null;
}

export class OperatorEndpoints {
  readonly #options: OperatorEndpointsOptions;
  /** SHA-256 of the operator key, or null. */
  readonly #operatorKey: Buffer | null;
  /** The last /kvfence/state snapshot (`state`). */
  #lastState: { readonly at: number; readonly state: Promise<DashboardState> } | null = null;

  constructor(options: OperatorEndpointsOptions) {
    this.#options = options;
    this.#operatorKey = options.operatorKey === undefined ? null : sha256(options.operatorKey);
  }

  /** Keyless, the operator listener answers loopback Host names only (DNS rebinding). */
  checkListener(req: IncomingMessage, listener: Listener): void {
    if (listener === "operator" && this.#operatorKey === null) checkOperatorHost(req.headers.host);
  }

  /**
   * The operator endpoints: with an operator key configured, the request must carry it (on either
   * listener); without one, only the operator listener serves them.
   */
  authorize(req: IncomingMessage, listener: Listener): void {
    if (this.#operatorKey === null) {
      if (listener === "operator") return;
      throw new KvfenceError(
        "invalid_api_key",
        "This endpoint is for the server's operator: without --operator-key it is served only on the operator listener (--metrics-host, --metrics-port; docs/api.md)",
      );
    }
    const match = /^Bearer\s+(\S+)\s*$/i.exec(req.headers.authorization ?? "");
    if (match !== null && timingSafeEqual(sha256(match[1]!), this.#operatorKey)) return;
    throw new KvfenceError(
      "invalid_api_key",
      match === null
        ? "This endpoint needs the operator key: send it in the Authorization header as: Bearer OPERATOR_KEY"
        : "Incorrect operator key: send the server's --operator-key (or KVFENCE_OPERATOR_KEY) as: Bearer OPERATOR_KEY",
    );
  }

  /**
   * `/kvfence/state`: the dashboard's JSON (src/router/dashboard.ts). Polls within
   * `STATE_REUSE_MS` of the last one share its snapshot: one poll of the nodes however many
   * dashboards are open.
   */
  async state(res: ServerResponse): Promise<void> {
    const now = performance.now();
    let last = this.#lastState;
    if (last === null || now - last.at >= STATE_REUSE_MS) {
      // One HMAC per tenant, not per page.
      const colours = new Map<number, number>();
      const colour = (tenant: number) => {
        const known = colours.get(tenant);
        if (known !== undefined) return known;
        const c = tenantColour(this.#options.tenantLabel(`tenant#${tenant}`));
        colours.set(tenant, c);
        return c;
      };
      const taken = {
        at: now,
        state: dashboardState(this.#options.engine, colour, this.#options.activeRequests()),
      };
      taken.state.catch(() => {
        if (this.#lastState === taken) this.#lastState = null;
      });
      this.#lastState = last = taken;
    }
    this.#options.answers.json(res, 200, await last.state, { "Cache-Control": "no-store" });
  }

  /** `/kvfence/ui` and its files, as built into dist/ui/. */
  ui(res: ServerResponse, name: string): void {
    const asset = dashboardAsset(name);
    if (asset === null)
      throw new KvfenceError(
        "not_found",
        "The dashboard was not built: run npm run build (it bundles ui/ into dist/ui/)",
      );
    res.writeHead(200, {
      ...DASHBOARD_HEADERS,
      "Content-Type": asset.type,
      "Content-Length": String(asset.body.length),
    });
    res.end(asset.body);
  }

  /** `/kvfence/nodes`: the nodes and their pools, or this process's one engine. */
  async nodes(res: ServerResponse): Promise<void> {
    const engine = this.#options.engine;
    const capacity = engine.capacity;
    const cachedPages =
      engine.nodes === undefined ? (await engine.stats()).prefixCache?.sharedPages : undefined;
    const body: NodesInfo = {
      max_model_len: this.#options.contextLength,
      nodes: engine.nodes?.() ?? [
        {
          id: "engine-0",
          role: "engine",
          url: this.#options.url() ?? "",
          pool_tokens: capacity.poolTokens,
          page_size: capacity.pageSize,
          max_model_len: capacity.maxModelLen,
          up: true,
          ...(cachedPages === undefined ? {} : { cached_pages: cachedPages }),
        },
      ],
    };
    this.#options.answers.json(res, 200, body);
  }
}

function sha256(text: string): Buffer {
  return createHash("sha256").update(text, "utf8").digest();
}
