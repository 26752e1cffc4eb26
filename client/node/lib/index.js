// latchkey — thin Node.js client for the latchkey lock service.
//
// A lock is a gRPC stream: `acquire` opens `LockService/Acquire`, writes `open`, and
// holds the lock for as long as the stream stays open. `Lease.release()` sends
// `release` and waits for the server's `released`; a lease that ends without being
// asked to (a `lost` event, a broken stream, a fixed lease's end on the client's own
// clock, a Lease garbage-collected while held) aborts `lease.signal`.
import * as grpc from '@grpc/grpc-js';
import { LeaseLostError, LockError, LockTimeoutError, codeName } from './errors.js';
import { lockServiceConstructor, lostReasonName } from './proto.js';

export { LeaseLostError, LockError, LockTimeoutError };

export const DEFAULT_TARGET = '127.0.0.1:50051';

/** How long a call waits for the channel to connect, as in the Rust client. */
export const CONNECT_TIMEOUT_MS = 5000;
const { IDLE, CONNECTING } = grpc.connectivityState;

/**
 * HTTP/2 keepalive, on by default as in the Rust client: a ping every 2 s, even while
 * no call is open and no data flows (an idle lease sends nothing), and a connection
 * whose ping goes 6 s unanswered counts as dead, failing its calls (a held lease's
 * signal aborts with DISCONNECTED). Without it a lease behind a silent network
 * partition (no FIN, no RST) is never reported lost, though the server, which pings
 * too, has long released the lock, and a waiting acquire can hang for good. A silent
 * connection is so found dead within 8 s; the server's own keepalive (a ping every
 * 10 s, 10 s to answer, by default) finds it no sooner than 10 s after it went silent,
 * and only then releases its locks: a holder behind a partition is told it lost the
 * lock before the next one can be granted it.
 *
 * The time to answer is long because it also bounds how long the event loop may block.
 * The ack is read only when the loop polls for I/O, after its timers: a block (a
 * synchronous chunk of work, a *Sync call) that starts while a ping is out and outlasts
 * the timeout has the connection declared dead, though the ack came in time, and every
 * lease on it lost (under the Python client, gRPC core reads acks on threads of its
 * own). 6 s lets a block of up to about 6 s cost no lease, and a ping every 2 s keeps
 * the sum under the server's 10 s. The server (tonic/h2) sets no limit on the pings it
 * receives, so a ping every 2 s never earns a GOAWAY `too_many_pings`.
 * `options.channelOptions` override any of these.
 */
export const KEEPALIVE_CHANNEL_OPTIONS = Object.freeze({
  'grpc.keepalive_time_ms': 2000,
  'grpc.keepalive_timeout_ms': 6000,
  'grpc.keepalive_permit_without_calls': 1,
  // grpc-js backs reconnection off up to 120 s: after a long outage (a server restarted
  // late, a network cut for minutes) every call would fail at once, UNAVAILABLE, for up
  // to two minutes after the server came back. A lease's holder wants its lock again
  // soon: the channel tries again at least every 5 s.
  'grpc.max_reconnect_backoff_ms': 5000,
});

/**
 * How long a lease told `lost` waits for the status that ends its stream (sent right
 * after it) before its signal aborts without it: the LeaseLostError carries that
 * status's code, details and ErrorInfo.
 */
const LOST_STATUS_WAIT_MS = 1000;

/**
 * The longest delay a timer takes: Node fires a setTimeout longer than 2^31-1 ms (about
 * 24.8 days), or of Infinity, after 1 ms. A fixed lease may be longer (the server takes
 * up to 365 days): its end is waited for in steps.
 */
const MAX_TIMER_MS = 2 ** 31 - 1;

/** A release's or call's timeout in ms: 0 to MAX_TIMER_MS, or Infinity for none. */
function checkTimeout(ms, field) {
  if (ms === Infinity || (typeof ms === 'number' && ms >= 0 && ms <= MAX_TIMER_MS)) return ms;
  throw new TypeError(`latchkey: ${field} must be 0 to 2^31-1 milliseconds, or Infinity, got ${ms}`);
}

/**
 * An AbortSignal, or undefined for none. Anything else (false, 0, an AbortController) is
 * refused here, before a call starts: `?.` lets it through, and its addEventListener
 * would throw only once the call was under way, leaving that call with no 'error'
 * listener, whose CANCELLED at close() or end by the server would crash the process.
 */
function checkSignal(signal) {
  if (signal === undefined || signal === null) return undefined;
  if (typeof signal.addEventListener === 'function' && typeof signal.aborted === 'boolean') return signal;
  let what = signal?.constructor?.name ?? 'an object';
  if (Object(signal) !== signal) what = typeof signal === 'string' ? JSON.stringify(signal) : String(signal);
  throw new TypeError(`latchkey: signal must be an AbortSignal, got ${what}`);
}

/** Resolves once `signal` has aborted. */
function whenAborted(signal) {
  if (signal.aborted) return Promise.resolve();
  return new Promise((resolve) => signal.addEventListener('abort', () => resolve(), { once: true }));
}

/**
 * When a fixed lease asked for at `askedAt` (a `performance.now()` reading taken before
 * the stream was opened) and granted with `acquired` has ended in Redis at the latest;
 * null for a watchdog lease. Its holder is told LEASE_EXPIRED then by the client's own
 * clock, as by the Rust client, even when the server's `lost` cannot arrive (a silent
 * partition, which keepalive notices only up to 8 s later). The server counts the
 * lease from its try, `acquired.waited` after it read the request, so after
 * `askedAt + waited`; `acquired.lease` is how long it lasts from there, less than asked
 * for by what the server takes off its end (a tenth, at most 100 ms and a thousandth
 * of the lease; a RedLock grant at least its clock drift). So the end is never after
 * the server gave the lock back.
 */
function fixedLeaseEnd(askedAt, open, acquired) {
  const asked = durationToMs(open.lease);
  if (asked === null) return null;
  let lease = durationToMs(acquired.lease) ?? asked;
  // An older server sends the lease asked for: never past a RedLock grant's validity
  // (the drift allowed, 1% plus 2 ms, taken off).
  if (open.redlock) lease = Math.min(lease, asked - (asked / 100 + 2));
  return askedAt + (durationToMs(acquired.waited) ?? 0) + Math.max(lease, 0);
}

const KINDS = {
  mutex: 'LOCK_KIND_MUTEX',
  fair: 'LOCK_KIND_FAIR',
  read: 'LOCK_KIND_READ',
  write: 'LOCK_KIND_WRITE',
  semaphore: 'LOCK_KIND_SEMAPHORE',
};
const KIND_NAMES = Object.fromEntries(Object.entries(KINDS).map(([k, v]) => [v, k]));

/** "semaphore" / "LOCK_KIND_SEMAPHORE" → "LOCK_KIND_SEMAPHORE". */
function kindEnum(kind) {
  if (typeof kind !== 'string') throw new TypeError(`latchkey: kind must be a string, got ${kind}`);
  const lower = kind.toLowerCase();
  if (KINDS[lower]) return KINDS[lower];
  if (KIND_NAMES[kind.toUpperCase()]) return kind.toUpperCase();
  throw new TypeError(
    `latchkey: unknown lock kind ${JSON.stringify(kind)} (one of ${Object.keys(KINDS).join(', ')})`,
  );
}

/**
 * "LOCK_KIND_SEMAPHORE" → "semaphore"; unspecified (a free lock) → null. A kind this
 * client's proto does not know (a newer server's; kinds are open to additions) arrives
 * as its number, and is named `KIND_<n>`, as lost reasons are: read as null, a held
 * lock would pass for a free one.
 */
function kindName(value) {
  if (typeof value === 'number' && value !== 0) return `KIND_${value}`;
  return KIND_NAMES[value] ?? null;
}

/**
 * The longest google.protobuf.Duration, in ms (10 000 years): past it, its seconds no
 * longer fit what the encoder writes exactly, and a larger one wrapped to another.
 */
const MAX_DURATION_MS = 315_576_000_000_000;

/** Milliseconds → google.protobuf.Duration. */
export function durationFromMs(ms, field) {
  if (typeof ms !== 'number' || !Number.isFinite(ms) || ms < 0 || ms > MAX_DURATION_MS) {
    throw new TypeError(
      `latchkey: ${field} must be 0 to ${MAX_DURATION_MS} milliseconds (10 000 years), got ${ms}`,
    );
  }
  let seconds = Math.floor(ms / 1000);
  let nanos = Math.round((ms - seconds * 1000) * 1e6);
  if (nanos >= 1e9) {
    seconds += 1;
    nanos -= 1e9;
  }
  return { seconds: String(seconds), nanos };
}

/** google.protobuf.Duration → milliseconds (null when unset). */
export function durationToMs(d) {
  if (!d) return null;
  return Number(d.seconds) * 1000 + (d.nanos ?? 0) / 1e6;
}

/** `value` for a uint32 field, from `least`, else a TypeError naming `field`. */
function u32(value, field, least = 0) {
  if (!Number.isInteger(value) || value < least || value > 0xffffffff) {
    throw new TypeError(`latchkey: ${field} must be an integer from ${least} to 4294967295, got ${value}`);
  }
  return value;
}

/**
 * `value` if it is a string, else a TypeError naming `field`: turned into one, an
 * `undefined` or a number would name another lock (`acquire([id, undefined])` took the
 * lock "undefined"), as the Python client refuses it too.
 */
function checkString(value, field) {
  if (typeof value === 'string') return value;
  throw new TypeError(`latchkey: ${field} must be a string, got ${typeof value}`);
}

function buildOpen(name, options) {
  const open = {};
  // An array of one name is that lock (`name`), as the Rust client's lock_all sends it:
  // the server takes `names` only for a multi-lock of 2 to 64 names.
  if (Array.isArray(name) && name.length === 1) open.name = checkString(name[0], 'name[0]');
  // (Array.from, not map: map skips an array's holes, which would be sent as "undefined".)
  else if (Array.isArray(name)) open.names = Array.from(name, (n, i) => checkString(n, `name[${i}]`));
  else if (typeof name === 'string') open.name = name;
  else throw new TypeError('latchkey: the lock name must be a string (or an array for a multi-lock)');
  const { wait, lease, owner, kind, permits, limit, redlock } = options;
  if (kind !== undefined && kind !== null) open.kind = kindEnum(kind);
  // `wait`: undefined / null / Infinity = wait until acquired; 0 = try once.
  if (wait !== undefined && wait !== null && wait !== Infinity) open.waitTimeout = durationFromMs(wait, 'wait');
  if (lease !== undefined && lease !== null) open.lease = durationFromMs(lease, 'lease');
  // proto3 sends neither "" nor 0: the server would read no owner (a fresh one per
  // stream, so no reentrancy: streams meant to share an owner wait on each other) and
  // the default 1 permit, not what was asked. Unset (or null) is how to ask for those.
  if (owner !== undefined && owner !== null) {
    open.owner = checkString(owner, 'owner');
    if (open.owner === '') throw new TypeError('latchkey: owner must not be empty (unset: a fresh owner per stream)');
  }
  if (permits !== undefined && permits !== null) open.permits = u32(permits, 'permits', 1);
  if (limit !== undefined && limit !== null) open.limit = u32(limit, 'limit');
  if (redlock) open.redlock = true;
  return open;
}

/** A PEM option (`ca`, `cert`, `key`) as the Buffer grpc-js takes; null when unset. */
function pemOption(value, field) {
  if (value === undefined || value === null) return null;
  if (typeof value === 'string' || value instanceof Uint8Array) return Buffer.from(value);
  throw new TypeError(`latchkey: ${field} must be PEM text (a string or a Buffer), got ${typeof value}`);
}

const FOREIGN_CREDENTIALS =
  'latchkey: credentials must come from the @grpc/grpc-js latchkey uses; these come from ' +
  'another copy of @grpc/grpc-js (or are no ChannelCredentials), which grpc-js refuses. ' +
  'Pass the PEM as the ca, cert and key options (and serverName) instead, or build them ' +
  "with latchkey's `credentials` export";

/**
 * The channel's credentials, built with latchkey's own grpc-js: grpc-js takes only
 * credentials made by the same copy of itself (an instanceof check), and an application
 * whose @grpc/grpc-js is of another version has another copy. `scheme` is "http",
 * "https" or null (a bare host:port or unix://). TLS is on for https:// and whenever
 * `ca`, `cert`, `key` or `serverName` is given; without `ca` it trusts grpc-js's default
 * roots (Node's bundled ones), not the system's store.
 */
function channelCredentials(options, scheme) {
  const ca = pemOption(options.ca, 'ca');
  const cert = pemOption(options.cert, 'cert');
  const key = pemOption(options.key, 'key');
  const pem = ca || cert || key;
  if (options.credentials != null) {
    if (pem) throw new TypeError('latchkey: give credentials or the ca, cert and key options, not both');
    if (!(options.credentials instanceof grpc.ChannelCredentials)) throw new TypeError(FOREIGN_CREDENTIALS);
    return options.credentials;
  }
  const tls = pem || options.serverName != null;
  if (tls && scheme === 'http') {
    throw new TypeError('latchkey: an http:// target is plaintext; ca, cert, key and serverName need TLS');
  }
  if (!tls && scheme !== 'https') return grpc.credentials.createInsecure();
  // grpc-js would say "Private key must be given with accompanying certificate chain".
  if (!cert !== !key) throw new TypeError('latchkey: cert and key go together (a client certificate for mTLS)');
  return grpc.credentials.createSsl(ca, key, cert);
}

/**
 * The channel option that checks the server's certificate for `serverName` (and sends
 * it as SNI) instead of the target's host, as the Rust client's `domain_name`.
 */
function serverNameOption(serverName) {
  if (serverName === undefined || serverName === null) return {};
  if (typeof serverName !== 'string' || serverName === '') {
    throw new TypeError(`latchkey: serverName must be a non-empty string, got ${JSON.stringify(serverName)}`);
  }
  return { 'grpc.ssl_target_name_override': serverName };
}

/**
 * The `authorization` header for `token`. A header value must be printable ASCII;
 * grpc-js would refuse any other only at the first call, with an error that shows the
 * token, so it is refused here, as the Rust client does, without repeating it.
 */
function bearer(token) {
  const value = String(token);
  if (!/^[\x20-\x7e]*$/.test(value)) throw new TypeError('latchkey: the token must be printable ASCII');
  return `Bearer ${value}`;
}

function normalizeState(s) {
  return {
    name: s.name,
    kind: kindName(s.kind),
    locked: Boolean(s.locked),
    holders: (s.holders ?? []).map((h) => ({
      owner: h.owner,
      holdCount: h.holdCount,
      ttlMs: durationToMs(h.ttl),
    })),
    waiters: (s.waiters ?? []).map((w) => ({ owner: w.owner, position: w.position })),
    lastFencingToken: BigInt(s.lastFencingToken ?? '0'),
    ttlMs: durationToMs(s.ttl),
  };
}

/**
 * A Lease garbage-collected while held cancels its stream, so that a lease nobody
 * released does not keep its lock until `client.close()`. Only the Session is held
 * here, and nothing the live call reaches refers to the Lease (its listeners close over
 * the Session), so a Lease can be collected while its stream is open; code that kept
 * only `lease.signal` sees it abort with DROPPED.
 */
const dropped = new FinalizationRegistry((session) => session.collected());

/** A watch's iterator garbage-collected unfinished: its call, which the client keeps
 * open for close(), is cancelled (the server's reader and its stream slot with it). */
const abandoned = new FinalizationRegistry((stopping) => stopping.stop?.());

/** A call made while the channel spent CONNECT_TIMEOUT_MS connecting. */
function notConnected(target) {
  const details = `no connection to ${target} within ${CONNECT_TIMEOUT_MS} ms`;
  return new LockError(`latchkey: UNAVAILABLE: ${details}`, { code: grpc.status.UNAVAILABLE, details });
}

/** A call on a closed client, or one under way that close() ended: CANCELLED. */
function closedError() {
  const details = 'the client is closed';
  return new LockError(`latchkey: CANCELLED: ${details}`, { code: grpc.status.CANCELLED, details });
}

/**
 * Why a held lease's stream ended without a `lost` event: REVOKED when the server
 * ended it for the caller's rights (an auth file reload revoked the token or narrowed
 * the identity: UNAUTHENTICATED, PERMISSION_DENIED), DISCONNECTED otherwise.
 */
function endedReason(ended) {
  const revoked = ended?.code === grpc.status.UNAUTHENTICATED || ended?.code === grpc.status.PERMISSION_DENIED;
  return revoked ? 'REVOKED' : 'DISCONNECTED';
}

function abortError(signal) {
  if (signal?.reason !== undefined) return signal.reason;
  const err = new Error('latchkey: acquire aborted');
  err.name = 'AbortError';
  return err;
}

/**
 * A held lock. The lock stays held while the underlying stream is open; call
 * `release()` when done. `signal` aborts when the lease is lost.
 */
export class Lease {
  #session;

  constructor(session, acquired) {
    this.#session = session;
    /** The lock name (or names, for a multi-lock). */
    this.name = session.name;
    /**
     * The fencing token as a BigInt: strictly greater than every earlier grant's token
     * for this name. Tokens are ~1.8e15 (below 2^53 today) but are uint64 on the
     * wire, so a BigInt is used to never lose precision; `String(token)` for headers.
     */
    this.fencingToken = BigInt(acquired.fencingToken ?? '0');
    /** For an array of names: one token per name, in the order of the names. */
    this.fencingTokens = (acquired.fencingTokens ?? []).map((t) => BigInt(t));
    // An array of one name went as a plain lock: one token per name still.
    if (this.fencingTokens.length === 0 && Array.isArray(this.name)) this.fencingTokens = [this.fencingToken];
    /** Holds this owner has on the lock, this one included (permits, for a semaphore). */
    this.holdCount = acquired.holdCount;
    /** The owner id in force (the requested one or a server-generated one). */
    this.owner = acquired.owner;
    /** The lease in force in milliseconds (fixed lease, or the watchdog timeout). */
    this.leaseMs = durationToMs(acquired.lease);
    /**
     * Aborted when the lease is lost; `signal.reason` is a LeaseLostError. Keep the
     * Lease while the lock is wanted: one dropped is released once garbage-collected.
     */
    this.signal = session.controller.signal;
    dropped.register(this, session, session);
  }

  /** True until the lease is released or lost (a fixed lease: until its end at the latest). */
  get held() {
    this.#session.expireIfDue();
    return this.#session.state === 'held';
  }

  /**
   * Why the lease was lost ("LEASE_EXPIRED", …), or null: from the moment `held` turns
   * false, before the signal aborts. Read right after a stall past a fixed lease's end,
   * it says LEASE_EXPIRED until the loop has read what came meanwhile.
   */
  get lostReason() {
    this.#session.expireIfDue();
    return this.#session.lostReason();
  }

  /**
   * Release the lock: writes `release`, half-closes, and waits (at most `timeoutMs`,
   * default 5000) for the server's `released` and the end of the stream. Resolves to
   * true when the server confirmed the release, false whenever the lease was lost: before
   * the call (its stream ended with `lost`, a fixed lease past its end, a closed client,
   * a `released` nobody asked for) or while the release was on its way (a `lost`
   * came instead of, or before, `released`: the first end told stays), and only
   * once the signal has aborted. Rejects, with the release's outcome unknown and the
   * signal not aborted, with a LockError carrying the status that ended the stream when
   * it ended without either (UNAVAILABLE: the server could not reach Redis; it gives
   * the lock back once Redis answers), or with a LockError whose code is
   * DEADLINE_EXCEEDED (not a LockTimeoutError) when no answer came in time: the stream
   * is then cancelled, which releases the lock server-side once the cancel arrives.
   * `timeoutMs` may be Infinity (no limit), else at most 2^31-1; another value rejects
   * with a TypeError. Idempotent: a second call returns the first one's promise.
   */
  release(options = {}) {
    return this.#session.release(options.timeoutMs ?? 5000);
  }

  /**
   * `await using lease = await client.acquire(...)` support (Node ≥ 22 / TS 5.2):
   * releases at the end of the scope. Resolves to undefined, as AsyncDisposable says;
   * rejects as `withLock` does after its function returned.
   */
  async [Symbol.asyncDispose ?? Symbol.for('Symbol.asyncDispose')]() {
    await this.release();
  }
}

class Session {
  constructor(client, name) {
    this.client = client;
    this.name = name;
    this.call = null;
    // waiting → held → releasing → released | unconfirmed | lost; held → lost; or failed
    this.state = 'waiting';
    this.controller = new AbortController();
    this.releasedEvent = false;
    /** The reason of the `lost` heard; LEASE_EXPIRED while `expiring`. */
    this.heard = null;
    /** A fixed lease's end passed; the verdict waits for what the socket holds. */
    this.expiring = false;
    this.ended = false;
    this.status = null;
    this.error = null;
    this.finished = false;
    /** drop() cancelled the call: a grant still handed on grants nothing. */
    this.cancelled = false;
    this.releasePromise = null;
    this.onFinish = [];
    /** A fixed lease's end on `performance.now()`; null for a watchdog lease. */
    this.ends = null;
    this.endTimer = null;
  }

  lose(reason, fields) {
    this.expiring = false;
    if (this.controller.signal.aborted) return;
    this.state = 'lost';
    clearTimeout(this.lostTimer);
    clearTimeout(this.endTimer);
    this.controller.abort(new LeaseLostError(this.name, reason, fields));
  }

  lostReason() {
    const { signal } = this.controller;
    if (signal.aborted) return signal.reason?.reason ?? null;
    return this.state === 'lost' ? this.heard : null;
  }

  /**
   * A fixed lease's one timer, set at the grant for its end (`fixedLeaseEnd`). Unref'd:
   * it keeps no process alive. Cleared once the lease is released or lost. An end
   * further than MAX_TIMER_MS away is waited for in steps.
   */
  armEnd(ends) {
    this.ends = ends;
    if (ends === null) return;
    const left = ends - performance.now();
    const step = () => (left > MAX_TIMER_MS ? this.armEnd(ends) : this.expire());
    this.endTimer = setTimeout(step, Math.min(Math.max(0, left), MAX_TIMER_MS));
    this.endTimer.unref?.();
  }

  /** Reads of the lease's state see its end even before the timer has run. */
  expireIfDue() {
    if (this.ends !== null && this.state === 'held' && performance.now() >= this.ends) this.expire();
  }

  /**
   * A fixed lease's end by the client's clock: `held` turns false at once, and the
   * verdict follows once the event loop has polled for I/O. After a stall (a long
   * synchronous task, a GC pause) both the end timer, which runs before that poll, and
   * a getter read at once see the end before a `lost` notice already waiting in the
   * socket; the notice, read first, then says why the lease ended (FORCE_RELEASED, …).
   * Two check phases make sure one poll came between: one immediate queued from the
   * poll phase would run before the next poll.
   */
  expire() {
    if (this.state !== 'held') return;
    this.state = 'lost';
    this.heard = 'LEASE_EXPIRED';
    this.expiring = true;
    clearTimeout(this.endTimer);
    setImmediate(() => setImmediate(() => this.expired()));
  }

  /**
   * No notice came: the signal aborts with LEASE_EXPIRED whether or not the server's
   * `lost` can arrive, and the stream is cancelled (the server releases whatever is
   * left of the lock), so that no release waits for a server that may be unreachable.
   * The error carries that cancel as the status that ended it.
   */
  expired() {
    if (!this.expiring) return;
    this.lose('LEASE_EXPIRED', {
      code: grpc.status.CANCELLED,
      details: "the fixed lease ran out on the client's clock; the client cancelled the stream",
    });
    this.call.cancel();
  }

  /**
   * The server said `lost` (while held, releasing, or with a fixed lease's end not yet
   * told): the lease is over now (`held` is false, `lostReason` says why), and the
   * signal aborts when the status that ends the stream arrives (at most
   * LOST_STATUS_WAIT_MS later), so that the error carries it.
   */
  heardLost(reason) {
    // A release the server confirmed is over: nothing said after it loses the lease.
    if (this.releasedEvent) return;
    if (this.state !== 'held' && this.state !== 'releasing' && !this.expiring) return;
    this.state = 'lost';
    this.heard = reason;
    this.expiring = false;
    clearTimeout(this.endTimer);
    this.lostTimer = setTimeout(() => this.lose(reason, {}), LOST_STATUS_WAIT_MS);
    this.lostTimer.unref?.();
  }

  /**
   * The server said `released`. It confirms a release this client asked for, unless the
   * lease's end was told before (a `lost` that came first stays: the release resolves
   * false, as the Rust client's fails with Lost). One nobody asked for (no release under
   * way) ends the lease as lost, DISCONNECTED, as in the Rust client; the stream, which
   * has nothing more to say, is cancelled, and the signal aborts with that cancel as
   * the status that ended it.
   */
  heardReleased() {
    if (this.state === 'releasing') {
      this.releasedEvent = true;
      return;
    }
    if (this.state !== 'held' && !this.expiring) return;
    this.heardLost('DISCONNECTED');
    this.call.cancel();
  }

  release(timeoutMs) {
    if (this.releasePromise) return this.releasePromise;
    try {
      checkTimeout(timeoutMs, 'timeoutMs');
    } catch (err) {
      return Promise.reject(err);
    }
    this.expireIfDue();
    clearTimeout(this.endTimer);
    if (this.state !== 'held') {
      // Lost: false once the signal has aborted, a few loop turns after `held` turned
      // false (see `expire`, `heardLost`), so that whoever checks `lease.signal` after
      // release() or withLock sees the loss and its reason.
      const lost = this.state === 'lost' ? whenAborted(this.controller.signal) : Promise.resolve();
      this.releasePromise = lost.then(() => false);
      return this.releasePromise;
    }
    this.state = 'releasing';
    this.releasePromise = new Promise((resolve, reject) => {
      const settle = (timedOut) => {
        clearTimeout(timer);
        try {
          resolve(this.releaseOutcome(timedOut, timeoutMs));
        } catch (err) {
          reject(err);
        }
      };
      const timer =
        timeoutMs === Infinity
          ? null
          : setTimeout(() => {
              settle(true);
              // The server did not confirm in time: cancelling also releases the lock.
              this.call.cancel();
            }, timeoutMs);
      this.onFinish.push(() => settle(false));
      try {
        this.call.write({ release: {} });
        this.call.end();
      } catch {
        this.call.cancel();
      }
    });
    return this.releasePromise;
  }

  /**
   * What a release resolves to once the stream ended (or `timedOut`): true once the
   * server confirmed, whatever came after; false when a `lost` or a revoke came
   * instead, as for a lease lost before the call (the signal tells why). Else it throws an error that
   * says the release's outcome is unknown, never a LockTimeoutError (that is the wait
   * for a lock running out).
   */
  releaseOutcome(timedOut, timeoutMs) {
    if (this.releasedEvent) return true;
    if (this.state === 'lost') {
      this.lose(this.heard, {});
      return false;
    }
    const what = `release ${JSON.stringify(this.name)}`;
    if (timedOut) {
      const details = `no answer within ${timeoutMs} ms; the client cancelled the stream`;
      const code = grpc.status.DEADLINE_EXCEEDED;
      throw new LockError(`${what}: DEADLINE_EXCEEDED: ${details}`, { code, details });
    }
    if (this.error) throw LockError.fromGrpc(this.error, what);
    // UNKNOWN, as the Python client says it: the server never answered.
    const details = 'the stream ended without confirming the release';
    throw new LockError(`${what}: UNKNOWN: ${details}`, { code: grpc.status.UNKNOWN, details });
  }

  /** Closing the client: cancel the stream, which makes the server release the lock. */
  drop(reason = 'CLOSED', details = 'the client was closed') {
    if (this.finished) return;
    if (this.state === 'held' || this.state === 'lost') {
      this.lose(this.heard ?? reason, { code: grpc.status.CANCELLED, details });
    }
    this.cancelled = true;
    this.call?.cancel();
  }

  /** The Lease was garbage-collected: a lease still held can never be released now. */
  collected() {
    if (this.state !== 'held') return;
    this.drop('DROPPED', 'the Lease was garbage-collected without release(); the client cancelled the stream');
  }
}

/**
 * The grpc-js target for `target`, read as the Rust client, the CLI and the Python
 * client read it (`LATCHKEY_SERVER`): an `http://` or `https://` URL (the scheme in any
 * case) is its host and port, port 80 when an `http://` URL gives none (grpc-js alone
 * would dial 443) and the bare host, which grpc-js dials at 443, for `https://`; its
 * user, path, query and fragment left out (grpc-js took a user for part of the host
 * name, and a path for a malformed address); a URL without a host, or with a port not
 * from 1 to 65535, is a TypeError naming `target` (it fell back to the default server,
 * or failed later as a server away). Any other target is grpc-js's own (`host:port`,
 * `unix:///path`, `dns:///host:port`).
 */
function grpcTarget(target, scheme) {
  if (scheme === null) return target.replace(/\/+$/, '') || DEFAULT_TARGET;
  const rest = target.slice(`${scheme}://`.length); // the scheme in any case
  const authority = rest.split(/[/?#]/, 1)[0];
  const at = authority.lastIndexOf('@');
  const hostPort = authority.slice(at + 1);
  // The user part may hold a password: it is not repeated.
  const shown = at < 0 ? target : `${scheme}://…@${rest.slice(at + 1)}`;
  const refused = (reason) => new TypeError(`target ${JSON.stringify(shown)}: ${reason}`);
  const afterHost = hostPort.lastIndexOf(']') + 1;
  const colon = hostPort.indexOf(':', afterHost) < 0 ? -1 : hostPort.lastIndexOf(':');
  const host = colon < 0 ? hostPort : hostPort.slice(0, colon);
  const port = colon < 0 ? null : hostPort.slice(colon + 1);
  if (!host) throw refused('the host is missing');
  const bracketed = host.startsWith('[');
  const v6ok = host.endsWith(']') && host.length >= 3 && !/[[\]]/.test(host.slice(1, -1));
  if ((bracketed && !v6ok) || (!bracketed && /[:[\]]/.test(host))) {
    throw refused('an IPv6 address goes in brackets, as [::1]');
  }
  // grpc-js dials 443 itself, and the authority it sends stays the bare host, which a
  // proxy's virtual host for that name matches (`host:443` it might not).
  if (port === null) return scheme === 'https' ? host : `${host}:80`;
  if (!/^[0-9]+$/.test(port) || Number(port) < 1 || Number(port) > 65535) {
    throw refused('the port must be 1 to 65535');
  }
  return `${host}:${Number(port)}`;
}

/** A client for one latchkey server. */
export class Client {
  #stub;
  #metadata;
  #sessions = new Set();
  /**
   * The stop functions of the Watch calls under way (each marks its watch stopped and
   * cancels its call): grpc-js's close() ends only calls not started yet.
   */
  #watches = new Set();
  /** The unary calls under way (Describe, List, ForceRelease), cancelled by close(). */
  #calls = new Set();
  #closed = false;

  /**
   * @param target "host:port" (default 127.0.0.1:50051), "unix:///path/to.sock", or
   *   "http://host:port" / "https://host:port" (read as `grpcTarget` says; https uses
   *   TLS; without `ca` it trusts
   *   grpc-js's default roots: Node's bundled Mozilla store plus NODE_EXTRA_CA_CERTS, or
   *   the file GRPC_DEFAULT_SSL_ROOTS_FILE_PATH names; not the operating system's store).
   * @param options `ca` (PEM, string or Buffer: the CAs trusted instead of the default
   *   roots), `cert` and `key` (PEM: the client certificate and its key, for mTLS),
   *   `serverName` (the name the server's certificate is checked for, instead of the
   *   target's host): any of them turns TLS on, also for a bare "host:port", and they
   *   are built with latchkey's own grpc-js. `credentials` (a grpc.ChannelCredentials
   *   instead of ca/cert/key, made by latchkey's grpc-js: its `credentials` export; a
   *   copy of @grpc/grpc-js of another version makes credentials grpc-js refuses, a
   *   TypeError here), `token` (sent as
   *   `authorization: Bearer <token>` with every call; printable ASCII, else a
   *   TypeError here), `metadata` (an object of headers sent with every call),
   *   `channelOptions` (grpc-js channel options, merged over
   *   KEEPALIVE_CHANNEL_OPTIONS), `callTimeoutMs` (deadline of
   *   Describe/List/ForceRelease, default 10000, at most 2^31-1, Infinity for none;
   *   past it a LockError DEADLINE_EXCEEDED, not a LockTimeoutError).
   */
  constructor(target = DEFAULT_TARGET, options = {}) {
    const authorization = options.token == null ? null : bearer(options.token);
    const scheme = /^(https?):\/\//i.exec(target)?.[1].toLowerCase() ?? null;
    target = grpcTarget(target, scheme);
    const credentials = channelCredentials(options, scheme);
    const LockService = lockServiceConstructor();
    this.target = target;
    // Messages of any size: a lock's state grows with its holders and waiters past
    // gRPC's default 4 MiB, and the server sends it whole.
    const unbounded = { 'grpc.max_receive_message_length': -1 };
    this.#stub = new LockService(target, credentials, {
      ...KEEPALIVE_CHANNEL_OPTIONS,
      ...unbounded,
      ...serverNameOption(options.serverName),
      ...options.channelOptions,
    });
    this.#metadata = { ...(options.metadata ?? {}) };
    if (authorization !== null) this.#metadata.authorization = authorization;
    this.callTimeoutMs = checkTimeout(options.callTimeoutMs ?? 10000, 'callTimeoutMs');
  }

  #md(extra) {
    const md = new grpc.Metadata();
    for (const [k, v] of Object.entries({ ...this.#metadata, ...(extra ?? {}) })) md.set(k, v);
    return md;
  }

  /**
   * Resolves once the channel is connected, or has failed to connect (a call then fails
   * at once, UNAVAILABLE); rejects UNAVAILABLE when it is still connecting after
   * CONNECT_TIMEOUT_MS, or with the signal's reason when it aborts first. grpc-js bounds
   * no connection attempt: against an address that drops packets a call would wait for
   * the kernel's SYN retries, over two minutes, even a try-once acquire. At `until`
   * (a call's deadline) before then it resolves, and the call meets its deadline.
   */
  #connected(signal, until = Infinity) {
    const channel = this.#stub.getChannel();
    const connecting = (state) => state === IDLE || state === CONNECTING;
    const first = channel.getConnectivityState(true);
    if (!connecting(first)) return Promise.resolve();
    const deadline = Math.min(Date.now() + CONNECT_TIMEOUT_MS, Number(until));
    return new Promise((resolve, reject) => {
      const done = (settle) => {
        signal?.removeEventListener('abort', onAbort);
        settle();
      };
      const onAbort = () => done(() => reject(abortError(signal)));
      signal?.addEventListener('abort', onAbort, { once: true });
      const watch = (state) =>
        channel.watchConnectivityState(state, deadline, (err) => {
          if (signal?.aborted) return;
          // Closed meanwhile (the channel went SHUTDOWN): the caller's next check
          // rejects CANCELLED. Asking the state with a connect then would start the
          // shut channel's resolver again and open a connection nobody closes.
          if (this.#closed) return done(resolve);
          const now = channel.getConnectivityState(true);
          if (!err && connecting(now)) watch(now);
          else if (err && Number(until) > deadline) done(() => reject(notConnected(this.target)));
          else done(resolve);
        });
      watch(first);
    });
  }

  /** A call on a closed client: CANCELLED, as in the Python clients. */
  #checkOpen() {
    if (this.#closed) throw closedError();
  }

  /**
   * Take a lock. Resolves with a Lease once the server sends `acquired` (`queued` is
   * reported through `options.onQueued` only).
   *
   * Options: `wait` (ms; unset = wait forever, 0 = try once), `lease` (ms; unset = held
   * while the stream is open, renewed by the server's watchdog; set = a fixed lease,
   * lost with LEASE_EXPIRED at its end, counted from before the request was sent, on
   * the client's own clock too), `owner`, `kind`
   * ("mutex" | "fair" | "read" | "write" | "semaphore", or LOCK_KIND_*), `permits`,
   * `limit` (semaphore), `redlock` (boolean), `signal` (AbortSignal that withdraws a
   * pending request; any other value but null is a TypeError, before the call starts),
   * `onQueued({position, holderTtlMs})`, `metadata`.
   *
   * Rejects with LockTimeoutError when the wait runs out, LockError otherwise, or the
   * signal's reason when aborted. `name` may be an array for a multi-lock (an array of
   * one name is that lock).
   */
  async acquire(name, options = {}) {
    this.#checkOpen();
    const open = buildOpen(name, options);
    const abortSignal = checkSignal(options.signal);
    if (abortSignal?.aborted) throw abortError(abortSignal);
    await this.#connected(abortSignal);
    return this.#open(name, open, abortSignal, options);
  }

  /** The Acquire stream of `acquire`, once its arguments are checked. */
  #open(name, open, abortSignal, options) {
    return new Promise((resolve, reject) => {
      this.#checkOpen();
      if (abortSignal?.aborted) throw abortError(abortSignal);

      const session = new Session(this, Array.isArray(name) ? name.map(String) : open.name);
      // The promise's functions reach the promise, and so the Lease it resolved to: the
      // stream's listeners let go of them at the grant, or nothing they hold could be
      // collected (see `dropped`).
      let waiter = { resolve, reject };
      const askedAt = performance.now();
      const call = this.#stub.Acquire(this.#md(options.metadata));
      session.call = call;
      this.#sessions.add(session);
      let aborted = false;
      const onAbort = () => {
        if (session.state !== 'waiting') return;
        aborted = true;
        call.cancel();
      };
      abortSignal?.addEventListener('abort', onAbort, { once: true });

      let fallback = null;
      const finish = () => {
        if (session.finished) return;
        session.finished = true;
        clearTimeout(fallback);
        this.#sessions.delete(session);
        dropped.unregister(session);
        abortSignal?.removeEventListener('abort', onAbort);
        const err = session.error;
        // A revoke that overtook a release: the server gave the lock back and ended the
        // stream before it read the release. The lease was lost, as without a release.
        const revokedReleasing = session.state === 'releasing' && !session.releasedEvent && endedReason(err) === 'REVOKED';
        if (session.state === 'waiting') {
          session.state = 'failed';
          if (aborted) waiter.reject(abortError(abortSignal));
          else if (err) waiter.reject(LockError.fromAcquire(err, `acquire ${JSON.stringify(session.name)}`));
          else {
            const details = 'the stream ended before the lock was acquired';
            const code = grpc.status.UNKNOWN;
            waiter.reject(new LockError(`acquire ${JSON.stringify(session.name)}: UNKNOWN: ${details}`, { code, details }));
          }
        } else if (session.state === 'held' || session.state === 'lost' || revokedReleasing) {
          // The stream ended although nobody asked: a lost event, a server error, a
          // broken connection. The error carries the status that ended the stream.
          const ended = err ? LockError.fromGrpc(err, 'acquire') : null;
          const fields = ended
            ? { code: ended.code, details: ended.details, metadata: ended.metadata, info: ended.info, cause: err }
            : { code: grpc.status.OK, details: 'the stream ended without a release' };
          session.lose(session.heard ?? ended?.info?.lostReason ?? endedReason(ended), fields);
        } else if (session.state === 'releasing') {
          session.state = session.releasedEvent ? 'released' : 'unconfirmed';
        }
        for (const f of session.onFinish) f();
      };
      // The stream is over once both the status arrived and every message was read.
      const maybeFinish = () => {
        if (session.status && session.ended) finish();
        else if (session.status && !fallback) fallback = setTimeout(finish, 1000);
      };

      call.on('data', (msg) => {
        switch (msg.event) {
          case 'queued':
            try {
              const told = options?.onQueued?.({
                position: msg.queued.position,
                holderTtlMs: durationToMs(msg.queued.holderTtl),
              });
              // An async callback's rejection is ignored as a throw is: left unhandled,
              // it would end the process (Node's default for unhandled rejections).
              if (typeof told?.then === 'function') told.then(undefined, () => {});
            } catch {
              // a throwing callback must not break the stream
            }
            break;
          case 'acquired':
            // An abort or a close() that came while grpc-js handed the grant on cancelled
            // the call: the server gives the lock back, and the acquire rejects.
            if (session.state !== 'waiting' || aborted || session.cancelled) break;
            abortSignal?.removeEventListener('abort', onAbort);
            session.state = 'held';
            session.armEnd(fixedLeaseEnd(askedAt, open, msg.acquired));
            waiter.resolve(new Lease(session, msg.acquired));
            // Nor what the caller handed for the wait: its onQueued or its signal's
            // listeners may reach the Lease too.
            waiter = null;
            options = null;
            abortSignal = null;
            break;
          case 'released':
            session.heardReleased();
            break;
          case 'lost':
            session.heardLost(lostReasonName(msg.lost.reason));
            break;
          default:
            break;
        }
      });
      call.on('end', () => {
        session.ended = true;
        maybeFinish();
      });
      call.on('error', (err) => {
        session.error = err;
      });
      call.on('status', (status) => {
        session.status = status;
        if (status.code !== grpc.status.OK && !session.error) {
          session.error = Object.assign(new Error(status.details), status);
        }
        maybeFinish();
      });

      call.write({ open });
    });
  }

  /**
   * Acquire `name`, run `fn(lease)`, release afterwards (also when fn throws) and
   * return fn's result. Pass `lease.signal` to whatever fn starts so it stops when
   * the lease is lost, and `lease.fencingToken` to the resource it writes.
   *
   * When fn threw, its error is what rejects (a failed release is not reported: fn's
   * error matters more). When fn returned, a release whose outcome is unknown rejects
   * as `release()` does; a lease lost meanwhile does not (see `lease.signal`).
   */
  async withLock(name, fn, options = {}) {
    const lease = await this.acquire(name, options);
    let result;
    try {
      result = await fn(lease);
    } catch (err) {
      await lease.release().catch(() => {});
      throw err;
    }
    await lease.release();
    return result;
  }

  async #unary(method, request, options = {}) {
    this.#checkOpen();
    const timeoutMs = checkTimeout(options.timeoutMs ?? this.callTimeoutMs, 'timeoutMs');
    const deadline = timeoutMs === Infinity ? Infinity : new Date(Date.now() + timeoutMs);
    await this.#connected(null, deadline);
    this.#checkOpen();
    return new Promise((resolve, reject) => {
      const call = this.#stub[method](request, this.#md(options.metadata), { deadline }, (err, res) => {
        this.#calls.delete(call);
        if (err && this.#closed && err.code === grpc.status.CANCELLED) reject(closedError());
        else if (err) reject(LockError.fromGrpc(err, `${method} ${JSON.stringify(request.name ?? request.prefix ?? '')}`));
        else resolve(res);
      });
      this.#calls.add(call);
    });
  }

  /**
   * The state of one lock: {name, kind ("mutex", …; null when free), locked,
   * holders [{owner, holdCount, ttlMs}], waiters [{owner, position}],
   * lastFencingToken (BigInt), ttlMs (null when free)}.
   */
  async describe(name, options) {
    checkString(name, 'name');
    return normalizeState(await this.#unary('Describe', { name }, options));
  }

  /**
   * Every lock whose name starts with `prefix` (all pages, stopping at a page token
   * the server already gave), sorted by name.
   */
  async list(prefix = '', options = {}) {
    checkString(prefix, 'prefix');
    const locks = [];
    const seen = new Set();
    let pageToken = '';
    for (;;) {
      const res = await this.#unary('List', { prefix, pageSize: options.pageSize ?? 0, pageToken }, options);
      locks.push(...res.locks.map(normalizeState));
      pageToken = res.nextPageToken;
      // A token the server gave before would page forever.
      if (!pageToken || seen.has(pageToken)) break;
      seen.add(pageToken);
    }
    return locks;
  }

  /**
   * Watch a lock: an async iterator of states (as `describe` returns them), the current
   * one first, then one per change (acquired, released, lost, queue change). Stop it by
   * breaking out of the loop, with `options.signal` (one already aborted yields
   * nothing; anything but an AbortSignal is a TypeError, before the call starts) or
   * `client.close()`. A watch dropped unfinished (read, then neither finished nor
   * `return()`ed) is cancelled once it is garbage-collected, as a dropped Lease is.
   */
  watch(name, options = {}) {
    const stopping = { stop: null };
    const states = this.#watch(name, options, stopping);
    abandoned.register(states, stopping);
    return states;
  }

  async *#watch(name, options, stopping) {
    checkString(name, 'name');
    this.#checkOpen();
    const signal = checkSignal(options.signal);
    if (signal?.aborted) return;
    try {
      await this.#connected(signal);
    } catch (err) {
      if (signal?.aborted || this.#closed) return;
      throw err;
    }
    // A client closed while the watch waited for the connection ends it, as it ends a
    // watch under way (and as a signal that aborted meanwhile does).
    if (this.#closed || signal?.aborted) return;
    const call = this.#stub.Watch({ name }, this.#md(options.metadata));
    // Set on abort and by close(): the states the call received and the loop has not
    // read yet are not yielded once the watch is stopped.
    let stopped = false;
    // Also what a watch collected unfinished runs (`abandoned`), whose `finally` never
    // runs: the client and the signal keep nothing of a stopped watch.
    const stop = () => {
      stopped = true;
      this.#watches.delete(stop);
      signal?.removeEventListener('abort', stop);
      call.cancel();
    };
    this.#watches.add(stop);
    stopping.stop = stop;
    signal?.addEventListener('abort', stop, { once: true });
    try {
      for await (const state of call) {
        if (stopped) return;
        yield normalizeState(state);
      }
    } catch (err) {
      // Stopped here (an abort, close()): the cancel is this client's own. A CANCELLED
      // the other side sent (a proxy resetting the stream) is an error: the watch did
      // not end because the caller was done with it.
      if (stopped || this.#closed) return;
      throw LockError.fromGrpc(err, `Watch ${JSON.stringify(name)}`);
    } finally {
      stopping.stop = null;
      stop();
    }
  }

  /** Break a lock (Redisson forceUnlock). Resolves to true when it was held. */
  async forceRelease(name, options) {
    checkString(name, 'name');
    const res = await this.#unary('ForceRelease', { name }, options);
    return Boolean(res.released);
  }

  /**
   * Close the channel. Pending acquires and held leases are cancelled (the server
   * releases their locks); held leases' signals abort with reason "CLOSED"; watches
   * end; describe, list and forceRelease calls under way reject with a LockError
   * CANCELLED, as calls made afterwards do.
   */
  close() {
    if (this.#closed) return;
    this.#closed = true;
    for (const session of [...this.#sessions]) session.drop();
    for (const stop of [...this.#watches]) stop();
    for (const call of [...this.#calls]) call.cancel();
    this.#stub.close();
  }
}

/** `withLock(client, name, fn, options)` — same as `client.withLock(name, fn, options)`. */
export function withLock(client, name, fn, options) {
  return client.withLock(name, fn, options);
}

export { codeName };
export const status = grpc.status;
/**
 * grpc-js's credentials factory, of the copy latchkey uses: credentials for the
 * `credentials` option when an application's own @grpc/grpc-js is another copy.
 */
export const credentials = grpc.credentials;
export default Client;
