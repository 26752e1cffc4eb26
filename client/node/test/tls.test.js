// TLS through the client's own options (`ca`, `cert`, `key`, `serverName`), against a
// server with --tls-cert and --tls-client-ca (mTLS), with certificates made by openssl.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import * as grpc from '@grpc/grpc-js';
import * as latchkey from '../lib/index.js';
import { Client, LockError, status } from '../lib/index.js';
import { startServer } from './helpers/server.js';
import { uniqueName } from './helpers/util.js';

/** The one name the server's certificate is for: not the 127.0.0.1 the tests dial. */
const SERVER_NAME = 'latchkey.test';

let dir;
let pem;
let srv;

/**
 * A CA, a server certificate for SERVER_NAME and a client certificate, as PEM text.
 */
function makeCerts(at) {
  const file = (name) => join(at, name);
  const openssl = (...args) => execFileSync('openssl', args, { stdio: ['ignore', 'ignore', 'pipe'] });
  openssl('req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-days', '2',
    '-subj', '/CN=latchkey node test CA', '-keyout', file('ca-key.pem'), '-out', file('ca.pem'),
    '-addext', 'basicConstraints=critical,CA:true', '-addext', 'keyUsage=critical,keyCertSign,cRLSign');
  const issue = (stem, cn, ext) => {
    writeFileSync(file(`${stem}.ext`), `${ext}\n`);
    openssl('req', '-newkey', 'rsa:2048', '-nodes', '-subj', `/CN=${cn}`,
      '-keyout', file(`${stem}-key.pem`), '-out', file(`${stem}.csr`));
    openssl('x509', '-req', '-in', file(`${stem}.csr`), '-CA', file('ca.pem'), '-CAkey', file('ca-key.pem'),
      '-CAcreateserial', '-days', '2', '-extfile', file(`${stem}.ext`), '-out', file(`${stem}.pem`));
  };
  issue('server', SERVER_NAME, `subjectAltName=DNS:${SERVER_NAME}\nextendedKeyUsage=serverAuth`);
  issue('client', 'node', 'extendedKeyUsage=clientAuth');
  const read = (name) => readFileSync(file(name), 'utf8');
  return {
    ca: read('ca.pem'),
    serverCert: file('server.pem'),
    serverKey: file('server-key.pem'),
    clientCA: file('ca.pem'),
    cert: read('client.pem'),
    key: read('client-key.pem'),
  };
}

before(async () => {
  dir = mkdtempSync(join(tmpdir(), 'latchkey-node-tls-'));
  pem = makeCerts(dir);
  srv = await startServer({
    args: ['--tls-cert', pem.serverCert, '--tls-key', pem.serverKey, '--tls-client-ca', pem.clientCA],
    // The readiness check's client: `credentials` of the test's grpc-js, which is latchkey's.
    clientOptions: {
      credentials: grpc.credentials.createSsl(Buffer.from(pem.ca), Buffer.from(pem.key), Buffer.from(pem.cert)),
      channelOptions: { 'grpc.ssl_target_name_override': SERVER_NAME },
    },
  });
});

after(async () => {
  await srv?.stop();
  if (dir) rmSync(dir, { recursive: true, force: true });
});

test('ca, cert, key (PEM strings or Buffers) and serverName reach an mTLS server', async () => {
  const strings = new Client(srv.target, { ca: pem.ca, cert: pem.cert, key: pem.key, serverName: SERVER_NAME });
  const buffers = new Client(srv.target, {
    ca: Buffer.from(pem.ca),
    cert: Buffer.from(pem.cert),
    key: Buffer.from(pem.key),
    serverName: SERVER_NAME,
    callTimeoutMs: 5000,
  });
  try {
    const name = uniqueName('tls');
    const lease = await strings.acquire(name, { wait: 5000 });
    assert.deepEqual((await buffers.describe(name)).holders.map((h) => h.owner), [lease.owner]);
    assert.equal(await lease.release(), true);
  } finally {
    strings.close();
    buffers.close();
  }
});

test('each TLS option counts: without the client certificate, the server name or the CA, no call gets through, FAILED_PRECONDITION', async () => {
  // A connection TLS refused is FAILED_PRECONDITION, as in the Rust and Python clients:
  // it read UNAVAILABLE, which a wrapper retries for good.
  const options = { ca: pem.ca, cert: pem.cert, key: pem.key, serverName: SERVER_NAME, callTimeoutMs: 5000 };
  const cases = [
    ['cert and key', ['cert', 'key'], /certificate required/],
    ['serverName', ['serverName'], /altnames/],
    ['ca', ['ca'], /verify/],
  ];
  for (const [missing, fields, why] of cases) {
    const opts = { ...options };
    for (const f of fields) delete opts[f];
    const client = new Client(srv.target, opts);
    try {
      const err = await client.describe('tls-refused').catch((e) => e);
      assert.ok(err instanceof LockError, `without ${missing}: ${err}`);
      assert.equal(err.code, status.FAILED_PRECONDITION, `without ${missing}: ${err}`);
      assert.match(err.details, /^TLS refused the connection: /);
      assert.match(err.message, why);
      assert.match(err.message, /: FAILED_PRECONDITION: TLS refused/, `the message names the code it has: ${err.message}`);
      const acquired = await client.acquire('tls-refused', { wait: 0 }).catch((e) => e);
      assert.equal(acquired.code, status.FAILED_PRECONDITION, `acquire without ${missing}: ${acquired}`);
    } finally {
      client.close();
    }
  }
  // A server with no TLS.
  const plain = await startServer();
  const client = new Client(plain.target, { ca: pem.ca, callTimeoutMs: 5000 });
  try {
    const err = await client.describe('tls-refused').catch((e) => e);
    assert.equal(err.code, status.FAILED_PRECONDITION, `a server with no TLS: ${err}`);
    assert.match(err.message, /wrong version number/);
  } finally {
    client.close();
    await plain.stop();
  }
});

test('TLS options that cannot go together, or are not PEM, are refused naming them', () => {
  const refused = (target, options, message) =>
    assert.throws(() => new Client(target, options), { name: 'TypeError', message });
  refused(srv.target, { ca: pem.ca, cert: pem.cert }, /\bcert\b.*\bkey\b/);
  refused(srv.target, { key: pem.key }, /\bcert\b.*\bkey\b/);
  refused(srv.target, { ca: 42 }, /\bca\b.*PEM/);
  refused(srv.target, { serverName: '' }, /\bserverName\b/);
  refused(`http://${srv.target}`, { ca: pem.ca }, /http:\/\//);
  refused(srv.target, { ca: pem.ca, credentials: grpc.credentials.createInsecure() }, /\bcredentials\b.*\bca\b/);
});

test("credentials from latchkey's own grpc-js still work", async () => {
  // The test's grpc-js is latchkey's; `credentials` is the same, for an application
  // that has another.
  for (const made of [grpc.credentials, latchkey.credentials]) {
    const client = new Client(srv.target, {
      credentials: made.createSsl(Buffer.from(pem.ca), Buffer.from(pem.key), Buffer.from(pem.cert)),
      serverName: SERVER_NAME,
    });
    try {
      assert.equal((await client.describe(uniqueName('tls-creds'))).locked, false);
    } finally {
      client.close();
    }
  }
});

test('credentials made by another copy of @grpc/grpc-js are refused naming ca, cert and key', () => {
  // grpc-js refuses another copy's ChannelCredentials (an instanceof check), as an
  // application with its own @grpc/grpc-js of another version has: the error says how
  // to give the client its TLS settings instead.
  const require = createRequire(import.meta.url);
  const cached = Object.keys(require.cache).filter((k) => k.includes('/@grpc/grpc-js/'));
  const saved = Object.fromEntries(cached.map((k) => [k, require.cache[k]]));
  for (const k of cached) delete require.cache[k];
  let other;
  try {
    other = require('@grpc/grpc-js');
  } finally {
    Object.assign(require.cache, saved);
  }
  assert.notEqual(other.ChannelCredentials, grpc.ChannelCredentials, 'a second instance');
  const foreign = other.credentials.createSsl(Buffer.from(pem.ca), Buffer.from(pem.key), Buffer.from(pem.cert));
  assert.throws(() => new Client(srv.target, { credentials: foreign }).close(), {
    name: 'TypeError',
    message: /another copy of @grpc\/grpc-js.*\bca\b.*\bcert\b.*\bkey\b/s,
  });
});
