// Loads latchkey.v1 with @grpc/proto-loader at runtime, and a tiny decoder for the
// google.rpc.Status / ErrorInfo that the server attaches to its error statuses.
import { existsSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

const PKG_DIR = join(dirname(fileURLToPath(import.meta.url)), '..');
const PROTO_REL = join('latchkey', 'v1', 'latchkey.proto');

/**
 * The directory holding `latchkey/v1/latchkey.proto`:
 * 1. `$LATCHKEY_PROTO_DIR` when set;
 * 2. `<package>/proto` (the copy `npm pack` puts into a published package);
 * 3. `<package>/../../proto` (the repository's proto, when used from the repo).
 * The packaged copy comes before the repository path so that an installed package
 * never picks up an unrelated `proto/` of the project that installed it.
 */
export function protoRoot() {
  const candidates = [];
  if (process.env.LATCHKEY_PROTO_DIR) candidates.push(process.env.LATCHKEY_PROTO_DIR);
  candidates.push(join(PKG_DIR, 'proto'), join(PKG_DIR, '..', '..', 'proto'));
  for (const dir of candidates) {
    if (existsSync(join(dir, PROTO_REL))) return dir;
  }
  throw new Error(
    `latchkey: cannot find ${PROTO_REL} (looked in ${candidates.join(', ')}); ` +
      'set LATCHKEY_PROTO_DIR or install a packed build of the package',
  );
}

export const LOADER_OPTIONS = Object.freeze({
  keepCase: false, // lowerCamelCase fields: fencingToken, holdCount, waitTimeout
  longs: String, // uint64 fencing tokens arrive as decimal strings, turned into BigInt
  enums: String, // LockKind and Lost.Reason arrive as their names
  defaults: true,
  oneofs: true, // msg.event / msg.action name the set member of a oneof
});

/**
 * A lost reason's name. One this client's proto does not know (a newer server's: the
 * reasons are open to additions) arrives as its number, and is named `REASON_<n>`, as
 * the Python client names it, so that `lostReason` is always a string.
 */
export function lostReasonName(reason) {
  return typeof reason === 'number' ? `REASON_${reason}` : reason;
}

let cached = null;

/** The `latchkey.v1.LockService` client constructor (loaded once). */
export function lockServiceConstructor() {
  if (!cached) {
    const root = protoRoot();
    const def = protoLoader.loadSync(PROTO_REL, { ...LOADER_OPTIONS, includeDirs: [root] });
    const pkg = grpc.loadPackageDefinition(def);
    cached = pkg.latchkey.v1.LockService;
  }
  return cached;
}

// google.rpc.Status with its details as opaque Any values, and google.rpc.ErrorInfo.
// Declared in a private package (not google.protobuf.Any) so that no well-known-type
// conversion kicks in; a dummy service gives us the (de)serializers.
const STATUS_JSON = {
  nested: {
    latchkey_client_internal: {
      nested: {
        Any: { fields: { typeUrl: { type: 'string', id: 1 }, value: { type: 'bytes', id: 2 } } },
        Status: {
          fields: {
            code: { type: 'int32', id: 1 },
            message: { type: 'string', id: 2 },
            details: { rule: 'repeated', type: 'Any', id: 3 },
          },
        },
        ErrorInfo: {
          fields: {
            reason: { type: 'string', id: 1 },
            domain: { type: 'string', id: 2 },
            metadata: { keyType: 'string', type: 'string', id: 3 },
          },
        },
        Decoder: {
          methods: {
            Status: { requestType: 'Status', responseType: 'Status' },
            ErrorInfo: { requestType: 'ErrorInfo', responseType: 'ErrorInfo' },
          },
        },
      },
    },
  },
};

let decoder = null;

/**
 * The `google.rpc.ErrorInfo` in a gRPC error's `grpc-status-details-bin` trailer,
 * as `{reason, domain, metadata}`, or null when there is none.
 */
export function errorInfo(metadata) {
  try {
    const raw = metadata?.get?.('grpc-status-details-bin')?.[0];
    if (!raw) return null;
    if (!decoder) {
      const def = protoLoader.fromJSON(STATUS_JSON, { longs: String, defaults: true });
      decoder = def['latchkey_client_internal.Decoder'];
    }
    const status = decoder.Status.responseDeserialize(Buffer.from(raw));
    for (const any of status.details ?? []) {
      if (any.typeUrl.endsWith('/google.rpc.ErrorInfo')) {
        const info = decoder.ErrorInfo.responseDeserialize(Buffer.from(any.value));
        return { reason: info.reason, domain: info.domain, metadata: { ...info.metadata } };
      }
    }
  } catch {
    // A malformed or foreign details trailer is not worth failing over.
  }
  return null;
}
