// A bearer token through the `token` option, against a server with --auth-file.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { Client, status } from '../lib/index.js';
import { startServer } from './helpers/server.js';
import { uniqueName } from './helpers/util.js';

let dir;
let srv;

before(async () => {
  dir = mkdtempSync(join(tmpdir(), 'latchkey-node-auth-'));
  const auth = join(dir, 'auth.toml');
  // The readiness check describes "latchkey-node-ready", so that name is allowed too.
  writeFileSync(
    auth,
    '[[identity]]\nname = "node"\ntokens = ["node-token"]\nprefixes = ["node/", "latchkey-node-ready"]\n',
  );
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
