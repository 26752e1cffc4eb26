// A bearer token through the `token` option, against a server with --auth-file.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { Client, status } from '../lib/index.js';
import { startServer } from './helpers/server.js';
import { aborted, freezableProxy, uniqueName, until, within } from './helpers/util.js';

let dir;
let srv;

// The readiness check describes "latchkey-node-ready", so that name is allowed too.
const NODE_IDENTITY =
  '[[identity]]\nname = "node"\ntokens = ["node-token"]\nprefixes = ["node/", "latchkey-node-ready"]\n';
// Revoked by the last test.
const DOOMED_IDENTITY = '[[identity]]\nname = "doomed"\ntokens = ["doomed-token"]\nprefixes = ["node/"]\n';

before(async () => {
  dir = mkdtempSync(join(tmpdir(), 'latchkey-node-auth-'));
  const auth = join(dir, 'auth.toml');
  writeFileSync(auth, NODE_IDENTITY + DOOMED_IDENTITY);
  srv = await startServer({ args: ['--auth-file', auth], clientOptions: { token: 'node-token' } });
});

after(async () => {
  await srv?.stop();
  if (dir) rmSync(dir, { recursive: true, force: true });
});

test('the token authenticates; other prefixes and missing tokens are refused', async () => {
  const client = new Client(srv.target, { token: 'node-token' });
  const anonymous = new Client(srv.target);
  try {
    const name = uniqueName('node/auth');
    const lease = await client.acquire(name, { wait: 0 });
    assert.ok(lease.fencingToken > 0n);
    await lease.release();
    const denied = await client.acquire(uniqueName('other'), { wait: 0 }).catch((e) => e);
    assert.equal(denied.code, status.PERMISSION_DENIED);
    const refused = await anonymous.describe(name).catch((e) => e);
    assert.equal(refused.code, status.UNAUTHENTICATED);
  } finally {
    client.close();
    anonymous.close();
  }
});

test('a reload that revokes the token ends its lease as REVOKED, released', async () => {
  const client = new Client(srv.target, { token: 'node-token' });
  const doomed = new Client(srv.target, { token: 'doomed-token' });
  try {
    const name = uniqueName('node/revoked');
    const lease = await doomed.acquire(name, { wait: 0 });
    writeFileSync(join(dir, 'auth.toml'), NODE_IDENTITY);
    // The server reads the file every second and applies a change two reads agree on.
    const reason = await aborted(lease.signal, 10_000);
    assert.equal(reason.lostReason, 'REVOKED');
    assert.equal(reason.code, status.UNAUTHENTICATED);
    assert.equal(lease.lostReason, 'REVOKED');
    const state = await client.describe(name);
    assert.equal(state.locked, false);
  } finally {
    client.close();
    doomed.close();
  }
});

test('a release the revoke overtook resolves false, the lease lost as REVOKED', async () => {
  // The release is on its way (held back at a proxy) when a reload revokes the token:
  // the server gives the lock back and ends the stream UNAUTHENTICATED before it reads
  // the release. The lease was lost, as a revoke without a release is; the release's
  // outcome is known (the lock is free), not unknown.
  writeFileSync(join(dir, 'auth.toml'), NODE_IDENTITY + DOOMED_IDENTITY);
  const client = new Client(srv.target, { token: 'node-token' });
  const proxy = await freezableProxy(Number(srv.target.split(':')[1]));
  const doomed = new Client(proxy.target, { token: 'doomed-token' });
  // The server applies the file once it has read it back (every second) twice.
  const admitted = () => doomed.describe(uniqueName('node/admitted')).then(() => true, () => false);
  await until(admitted, 10_000, 'the doomed token admitted again');
  try {
    const name = uniqueName('node/revoked-releasing');
    const lease = await doomed.acquire(name, { wait: 0 });
    proxy.holdRequests();
    const releasing = lease.release({ timeoutMs: 20_000 });
    writeFileSync(join(dir, 'auth.toml'), NODE_IDENTITY);
    assert.equal(await within(releasing, 20_000, 'release'), false);
    assert.equal(lease.lostReason, 'REVOKED');
    assert.equal((await client.describe(name)).locked, false);
  } finally {
    proxy.close();
    client.close();
    doomed.close();
  }
});
