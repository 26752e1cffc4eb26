import type { ChannelCredentials, ChannelOptions, Metadata } from '@grpc/grpc-js';

export type LockKind =
  | 'mutex'
  | 'fair'
  | 'read'
  | 'write'
  | 'semaphore'
  | 'LOCK_KIND_MUTEX'
  | 'LOCK_KIND_FAIR'
  | 'LOCK_KIND_READ'
  | 'LOCK_KIND_WRITE'
  | 'LOCK_KIND_SEMAPHORE';

export type LostReason =
  | 'LEASE_EXPIRED'
  | 'NOT_HELD'
  | 'FORCE_RELEASED'
  | 'SHUTDOWN'
  | 'DISCONNECTED'
  /** An auth file reload took the caller's right to the lock away (UNAUTHENTICATED, PERMISSION_DENIED). */
  | 'REVOKED'
  | 'CLOSED'
  /** The Lease was garbage-collected while held; the client cancelled its stream. */
  | 'DROPPED'
  /** A reason this client does not know yet (a newer server's), by its number. */
  | `REASON_${number}`;

export interface ClientOptions {
  /**
   * PEM (text or Buffer): the CAs that sign the server's certificate, trusted instead of
   * the default roots. Without it TLS trusts grpc-js's defaults: Node's bundled Mozilla
   * roots plus NODE_EXTRA_CA_CERTS (or the file GRPC_DEFAULT_SSL_ROOTS_FILE_PATH names),
   * not the operating system's store.
   */
  ca?: string | Uint8Array;
  /** PEM: the client certificate (chain) for mTLS; with `key`. */
  cert?: string | Uint8Array;
  /** PEM: the private key of `cert`. */
  key?: string | Uint8Array;
  /**
   * The name the server's certificate is checked for (and sent as SNI) instead of the
   * target's host, e.g. for an IP address target.
   */
  serverName?: string;
  /**
   * Default: insecure for "host:port", "unix://…" and "http://…"; TLS for "https://…"
   * and whenever `ca`, `cert`, `key` or `serverName` is given (built with latchkey's
   * own grpc-js). Not with `ca`, `cert` or `key`. Must come from the @grpc/grpc-js
   * latchkey uses (the `credentials` export): another copy's are refused with a
   * TypeError, as grpc-js refuses them.
   */
  credentials?: ChannelCredentials;
  /** Headers sent with every call. */
  metadata?: Record<string, string>;
  /**
   * Bearer token sent as `authorization: Bearer <token>` with every call. Printable
   * ASCII only: the constructor throws a TypeError otherwise.
   */
  token?: string;
  /** grpc-js channel options, merged over KEEPALIVE_CHANNEL_OPTIONS. */
  channelOptions?: ChannelOptions;
  /**
   * Deadline of Describe / List / ForceRelease in ms (default 10000; at most 2^31-1, or
   * Infinity for none, else the constructor throws a TypeError); past it they reject
   * with a LockError DEADLINE_EXCEEDED (not a LockTimeoutError).
   */
  callTimeoutMs?: number;
}

export interface AcquireOptions {
  /** ms; unset/null/Infinity = wait until acquired, 0 = try once. */
  wait?: number | null;
  /**
   * ms; unset = held while the stream is open (server watchdog); set = fixed lease, which
   * also ends on the client's own clock, at `acquired.lease` (this less what the server
   * takes off its end: a tenth, at most 100 ms, a RedLock lease at least its drift) after the
   * request was sent plus the wait the server reports (`acquired.waited`): the signal
   * aborts with LEASE_EXPIRED then, before the server can give the lock back, even if
   * the server's notice cannot arrive.
   */
  lease?: number | null;
  /**
   * Reentrancy identity; unset = a fresh id per stream. `""` rejects with a TypeError:
   * it would go out unset (an unset environment variable would turn reentrancy off).
   */
  owner?: string;
  kind?: LockKind;
  /**
   * Semaphore: permits to take, an integer from 1 (unset = 1). `0` rejects with a
   * TypeError: it would go out unset, and take 1.
   */
  permits?: number;
  /** Semaphore: number of permits of the semaphore. */
  limit?: number;
  redlock?: boolean;
  /**
   * Withdraws a pending request; the promise rejects with the signal's reason. Any
   * other value than an AbortSignal, null or undefined rejects with a TypeError before
   * a call starts.
   */
  signal?: AbortSignal | null;
  onQueued?: (queued: { position: number; holderTtlMs: number | null }) => void;
  metadata?: Record<string, string>;
}

export interface CallOptions {
  /** Overrides callTimeoutMs for this call (at most 2^31-1, or Infinity). */
  timeoutMs?: number;
  metadata?: Record<string, string>;
}

export interface Holder {
  owner: string;
  holdCount: number;
  ttlMs: number | null;
}

export interface LockState {
  name: string;
  /** null when the lock is free. */
  kind: 'mutex' | 'fair' | 'read' | 'write' | 'semaphore' | `KIND_${number}` | null;
  locked: boolean;
  holders: Holder[];
  waiters: { owner: string; position: number }[];
  /** A BigInt: JSON.stringify throws on it unless given a replacer (see the README). */
  lastFencingToken: bigint;
  ttlMs: number | null;
}

export declare class Lease {
  readonly name: string | string[];
  /** Strictly increasing per lock name; pass it to the protected resource. */
  readonly fencingToken: bigint;
  /** For an array of names: one token per name (an array of one name too). */
  readonly fencingTokens: bigint[];
  readonly holdCount: number;
  readonly owner: string;
  /** The lease in force, ms: the watchdog timeout, or how long a fixed lease lasts (a tenth less than asked, at most 100 ms and a thousandth of the lease, for RedLock at least the clock drift, 1% plus 2 ms, less: the server gives it back that early). */
  readonly leaseMs: number | null;
  /**
   * Aborted when the lease is lost; `signal.reason` is a LeaseLostError. Keep the
   * `Lease` itself while the lock is wanted: one the program drops is released once
   * garbage-collected (its signal aborts with `DROPPED`), so code that keeps only the
   * signal sees its lock freed at a moment nobody can predict.
   */
  readonly signal: AbortSignal;
  /** True until released or lost; a fixed lease is lost at its end at the latest. */
  readonly held: boolean;
  /**
   * Why the lease was lost, from the moment `held` turns false (the signal aborts when
   * the status that ends the stream follows). Read right after a stall past a fixed
   * lease's end it says LEASE_EXPIRED until the event loop has read what came meanwhile
   * (a FORCE_RELEASED notice, say).
   */
  readonly lostReason: LostReason | null;
  /**
   * Resolves true when the server confirmed the release, false whenever the lease was
   * lost: before the call (its stream ended with `lost`, a fixed lease past its end, a
   * closed client, a `released` nobody asked for: DISCONNECTED) or while the release was
   * on its way (`lost` came instead of, or before, `released`, or a revoke ended the stream first: REVOKED; the signal aborts). Rejects only when the outcome is unknown (the
   * signal does not abort): with a LockError carrying the status that ended the stream
   * when it ended unconfirmed (UNAVAILABLE: the server could not reach Redis and gives
   * the lock back once it answers); with a LockError of code DEADLINE_EXCEEDED (not a
   * LockTimeoutError) when no answer came within `timeoutMs` (default 5000): the stream
   * is cancelled then, which releases the lock once the cancel arrives. `timeoutMs` may
   * be Infinity (no limit), else at most 2^31-1 (a TypeError otherwise). A `false`
   * comes once the signal has aborted, so `signal.reason` says why. Idempotent.
   */
  release(options?: { timeoutMs?: number }): Promise<boolean>;
  /**
   * `await using lease = await client.acquire(name)` releases at the end of the scope
   * (TS 5.2+). Promise<void>, as AsyncDisposable requires (Promise<boolean> is refused
   * with TS2851); call release() for whether the server confirmed. Rejects as withLock
   * does after its function returned.
   */
  [Symbol.asyncDispose](): Promise<void>;
}

export declare class Client {
  constructor(target?: string, options?: ClientOptions);
  readonly target: string;
  callTimeoutMs: number;
  acquire(name: string | string[], options?: AcquireOptions): Promise<Lease>;
  /**
   * Acquire, run fn, release. When fn threw, rejects with fn's error (a failed release
   * is not reported); when it returned, rejects if the release's outcome is unknown (a
   * LockError as release() gives), but not for a lease lost meanwhile (see its signal).
   */
  withLock<T>(name: string | string[], fn: (lease: Lease) => T | Promise<T>, options?: AcquireOptions): Promise<T>;
  describe(name: string, options?: CallOptions): Promise<LockState>;
  list(prefix?: string, options?: CallOptions & { pageSize?: number }): Promise<LockState[]>;
  /**
   * The lock's state now, then one per change, until broken out of, aborted (a signal
   * already aborted yields nothing) or the client is closed. A `signal` that is not an
   * AbortSignal (nor null or undefined) rejects the first next() with a TypeError.
   */
  watch(
    name: string,
    options?: { signal?: AbortSignal | null; metadata?: Record<string, string> },
  ): AsyncGenerator<LockState>;
  forceRelease(name: string, options?: CallOptions): Promise<boolean>;
  /**
   * Cancels pending acquires, held leases (signal reason CLOSED), watches and the
   * describe, list and forceRelease calls under way; those and later calls reject
   * with a LockError CANCELLED.
   */
  close(): void;
}

export declare function withLock<T>(
  client: Client,
  name: string | string[],
  fn: (lease: Lease) => T | Promise<T>,
  options?: AcquireOptions,
): Promise<T>;

export declare class LockError extends Error {
  /**
   * gRPC status code (number): CANCELLED for a call on a closed client; undefined for
   * other client-side errors.
   */
  readonly code: number | undefined;
  readonly codeName: string | undefined;
  readonly details: string;
  readonly metadata: Metadata | undefined;
  /** google.rpc.ErrorInfo reason (e.g. "WAIT_TIMEOUT", "WRONG_KIND") when sent. */
  readonly reason: string | undefined;
  /** google.rpc.ErrorInfo metadata, e.g. { field: "open.name" }. */
  readonly info: Record<string, string>;
}

/**
 * An acquire's wait ran out (DEADLINE_EXCEEDED); never a release's timeout nor a
 * describe / list / forceRelease past its deadline (a plain LockError DEADLINE_EXCEEDED).
 */
export declare class LockTimeoutError extends LockError {}

/**
 * `code`, `details`, `metadata` and `info` are the status's that ended the stream:
 * CANCELLED for CLOSED, DROPPED and for a fixed lease's end on the client's clock
 * (LEASE_EXPIRED).
 */
export declare class LeaseLostError extends LockError {
  readonly reason: LostReason;
  readonly lostReason: LostReason;
  readonly lockName: string | string[];
}

export declare const DEFAULT_TARGET: string;
/** How long a call waits for the channel to connect before it fails UNAVAILABLE (5000). */
export declare const CONNECT_TIMEOUT_MS: number;
/**
 * HTTP/2 keepalive on by default: a ping every 2 s, dead after 6 s without its ack. A
 * holder behind a silent partition is so told within 8 s, before the server's own
 * keepalive (10 s + 10 s by default) releases its lock. The ack is read only when the
 * event loop polls for I/O: a lease survives a blocked loop of up to about 6 s.
 */
export declare const KEEPALIVE_CHANNEL_OPTIONS: Readonly<ChannelOptions>;
export declare const status: typeof import('@grpc/grpc-js').status;
/** grpc-js's credentials factory, of the copy latchkey uses (for `credentials`). */
export declare const credentials: typeof import('@grpc/grpc-js').credentials;
export declare function codeName(code: number): string;
export declare function durationFromMs(ms: number, field?: string): { seconds: string; nanos: number };
export declare function durationToMs(d: { seconds: string | number; nanos?: number } | null | undefined): number | null;
export default Client;
