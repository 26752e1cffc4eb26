import { status as Status } from '@grpc/grpc-js';
import { errorInfo } from './proto.js';

const CODE_NAMES = Object.fromEntries(Object.entries(Status).map(([k, v]) => [v, k]));

/** The name of a gRPC status code, e.g. 4 → "DEADLINE_EXCEEDED". */
export function codeName(code) {
  return CODE_NAMES[code] ?? String(code);
}

/**
 * A call to latchkey failed. `code` is the gRPC status code (a number, see
 * `grpc.status`), `codeName` its name, `details` the server's message, `reason` the
 * `google.rpc.ErrorInfo` reason (e.g. "WAIT_TIMEOUT", "WRONG_KIND") when the server
 * sent one and `info` that ErrorInfo's metadata.
 */
export class LockError extends Error {
  constructor(message, { code, details, metadata, reason, info, cause } = {}) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = 'LockError';
    this.code = code;
    this.codeName = code === undefined ? undefined : codeName(code);
    this.details = details ?? '';
    this.metadata = metadata;
    this.reason = reason;
    this.info = info ?? {};
  }

  /**
   * A plain LockError from a grpc-js error, whatever the code: DEADLINE_EXCEEDED on a
   * unary call or a release is a call that got no answer in time, not a wait for a
   * lock that ran out.
   */
  static fromGrpc(err, what) {
    return new LockError(...grpcArgs(err, what));
  }

  /**
   * What an acquire that was not granted rejects with: a LockTimeoutError for
   * DEADLINE_EXCEEDED, which on an Acquire stream (it has no deadline of its own) is
   * the server's wait running out, else a LockError.
   */
  static fromAcquire(err, what) {
    const Class = err.code === Status.DEADLINE_EXCEEDED ? LockTimeoutError : LockError;
    return new Class(...grpcArgs(err, what));
  }
}

/**
 * What grpc-js says when TLS refused the connection, passing on Node's TLS (OpenSSL): a
 * server certificate that did not verify or is not for the name dialled, a client
 * certificate the server asked for and did not get, a server that speaks no TLS. Only
 * a connection's failure (a server's own UNAVAILABLE, Redis's TLS failing behind it,
 * reads as it is).
 */
const TLS_REFUSED = /^No connection established\b.*(SSL routines|ERR_TLS_|certificate|unable to verify)/is;

/**
 * A connection TLS refused is FAILED_PRECONDITION, as in the Rust and Python clients
 * and the CLI: trying again never mends it, where a wrapper retries an UNAVAILABLE (a
 * server down, Redis out of reach) for good. grpc-js says UNAVAILABLE, with the TLS
 * error in its details, the one sign it gives.
 */
function codeAndDetails(err) {
  const details = err.details ?? err.message;
  if (err.code === Status.UNAVAILABLE && TLS_REFUSED.test(details)) {
    return [Status.FAILED_PRECONDITION, `TLS refused the connection: ${details}`];
  }
  return [err.code, details];
}

/** The constructor arguments of a LockError for a grpc-js error. */
function grpcArgs(err, what) {
  const info = errorInfo(err.metadata);
  const [code, details] = codeAndDetails(err);
  const fields = {
    code,
    details,
    metadata: err.metadata,
    reason: info?.reason,
    info: info?.metadata,
    cause: err,
  };
  return [`${what}: ${codeName(code)}: ${fields.details}`, fields];
}

/**
 * The wait for a lock ran out (`DEADLINE_EXCEEDED`), e.g. `wait: 0` on a held lock. Only
 * an acquire rejects with it: a release, describe, list or forceRelease with no answer
 * in time is a plain LockError with code DEADLINE_EXCEEDED.
 */
export class LockTimeoutError extends LockError {
  constructor(message, fields) {
    super(message, fields);
    this.name = 'LockTimeoutError';
  }
}

/**
 * A lease ended without the holder asking. It is the `reason` of the lease's aborted
 * `signal`. Its `reason` (also `lostReason`) is one of "LEASE_EXPIRED", "NOT_HELD",
 * "FORCE_RELEASED", "SHUTDOWN" (sent by the server in a `lost` event),
 * "DISCONNECTED" (the stream broke without a `lost` event), "REVOKED" (the server
 * ended the stream UNAUTHENTICATED or PERMISSION_DENIED: a reload of its auth file took
 * the caller's right to the lock away), "CLOSED"
 * (`client.close()` dropped the lease) or "DROPPED" (the Lease was garbage-collected
 * while held). `code`, `details`, `metadata` and `info` are
 * those of the status that ended the stream, whatever the reason: `ABORTED` with
 * `info.lostReason` after a `lost` event (`UNAVAILABLE` for SHUTDOWN), `UNAVAILABLE`
 * for a broken connection, `CANCELLED` for CLOSED, DROPPED and for a fixed lease's end on the
 * client's own clock (LEASE_EXPIRED, told before the server's notice: the client
 * cancels the stream then). (A `lost` event whose status does not follow within a
 * second aborts the signal without them.)
 */
export class LeaseLostError extends LockError {
  constructor(name, lostReason, fields = {}) {
    super(`lease on ${JSON.stringify(name)} lost: ${lostReason}`, fields);
    this.name = 'LeaseLostError';
    this.lockName = name;
    this.reason = lostReason;
    this.lostReason = lostReason;
  }

  toString() {
    return `${this.name}: ${this.lostReason}`;
  }
}
