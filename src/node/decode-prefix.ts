/**
 * The decode node's prefix cache (decode-side reuse, issue #35; docs/design.md §3a): the decode
 * machine's `DecodePrefixCache` (src/protocol/decode-held.ts) over the engine's `PrefixCache` of
 * this node's pool, with each attempt's token ids. A reserve brings the prompt's ids and the salt
 * inputs of its authenticated tenant (`prefixCacheSalt`: tenant, the server's scope, the client's
 * `cache_salt`, as prefill's keys); the node keeps them in a buffer sized for the prompt and
 * `max_tokens`, and appends each generated token as it is sampled (prefill's first token at the
 * commit, then one per decode step — nothing allocates per token), so when the attempt ends the
 * machine can cache its full pages of prompt and answer: the next turn of the conversation holds
 * them and the transfer sends only the rest.
 */
import { DecodePrefix, type HeldAttempt } from "../protocol/decode-held.js";
import type { PrefixCache } from "../protocol/prefix-cache.js";
import { prefixCacheSalt } from "../protocol/prefix-key.js";
import type { Safety } from "../protocol/safety.js";
import { attemptKey, type ReserveRequest } from "../protocol/wire.js";

/** One attempt's token ids so far (its prompt, then its generated tokens) and its keys' salt. */
export interface TokenRecord {
  readonly tokens: Int32Array;
  length: number;
  readonly salt: string;
}

export class DecodeNodePrefix {
  /** The machine's view (`DecodeContext.prefix`). */
  readonly prefix: DecodePrefix;
  readonly #safety: Safety;
  readonly #records = new Map<string, TokenRecord>();
  /** Prompt pages decode held instead of receiving them (`kvfence_transfer_pages_reused_total`). */
  pagesReused = 0;

  constructor(cache: PrefixCache, safety: Safety) {
    this.#safety = safety;
    this.prefix = new DecodePrefix(cache, {
      prompt: (msg) => this.#take(attemptKey(msg.rid, msg.epoch), msg.promptLen),
      sequence: (a: HeldAttempt) => this.#take(attemptKey(a.rid, a.epoch), a.promptLen + a.generated),
    });
  }

  /** A reserve arrived: keep its prompt's ids (when it brought them) for the lookup and the insert. */
  reserve(msg: ReserveRequest): void {
    const prompt = msg.promptTokens;
    if (!(prompt instanceof Int32Array) || prompt.length !== msg.promptLen || (msg.samples?.length ?? 0) > 0)
      return;
    const tokens = new Int32Array(msg.promptLen + msg.maxTokens);
    tokens.set(prompt);
    const salt = prefixCacheSalt(this.#safety, msg.tenant, msg.cacheSalt ?? null, msg.cacheScope ?? "");
    this.#records.set(attemptKey(msg.rid, msg.epoch), { tokens, length: prompt.length, salt });
  }

  /** The attempt committed with `held` pages it did not receive: its record, to append tokens to. */
  committed(key: string, held: number): TokenRecord | undefined {
    this.pagesReused += held;
    return this.#records.get(key);
  }

  /** The attempt ended: its ids are no longer needed. */
  forget(key: string): void {
    this.#records.delete(key);
  }

  /** The first `length` ids of attempt `key` and its salt, or null when they are not all known. */
  #take(key: string, length: number): { tokens: Int32Array; salt: string } | null {
    const r = this.#records.get(key);
    return r === undefined || r.length < length
      ? null
      : { tokens: r.tokens.subarray(0, length), salt: r.salt };
  }
}

/** Appends a sampled token to `record` (room for `max_tokens` was made at the reserve). */
export function recordToken(record: TokenRecord | undefined, token: number): void {
  if (record !== undefined && record.length < record.tokens.length) record.tokens[record.length++] = token;
}
