// The server going away: a graceful stop (SHUTDOWN) and a crash (DISCONNECTED).
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Client, LeaseLostError, status } from '../lib/index.js';
import { startServer } from './helpers/server.js';
import { aborted, uniqueName } from './helpers/util.js';

async function withServer(fn) {
  const srv = await startServer();
  const client = new Client(srv.target);
  try {
    await fn(srv, client);
  } finally {
    client.close();
    await srv.stop();
  }
}

test('SIGTERM on the server aborts the lease with SHUTDOWN', () =>
  withServer(async (srv, client) => {
    const lease = await client.acquire(uniqueName('shutdown'));
    srv.server.signal('SIGTERM');
    const reason = await aborted(lease.signal, 10000);
    assert.ok(reason instanceof LeaseLostError, `got ${reason}`);
    assert.equal(reason.reason, 'SHUTDOWN');
    assert.equal(reason.code, status.UNAVAILABLE, 'the status that ended the stream');
    assert.equal(lease.held, false);
  }));

test('a crashed server aborts the lease with DISCONNECTED', () =>
  withServer(async (srv, client) => {
    const lease = await client.acquire(uniqueName('crash'));
    srv.server.signal('SIGKILL');
    const reason = await aborted(lease.signal, 10000);
    assert.ok(reason instanceof LeaseLostError, `got ${reason}`);
    assert.equal(reason.reason, 'DISCONNECTED');
    assert.equal(reason.code, status.UNAVAILABLE, 'the status that ended the stream');
    assert.equal(await lease.release(), false);
  }));
