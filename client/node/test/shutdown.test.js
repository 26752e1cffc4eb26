// The server going away: a graceful stop (SHUTDOWN, SHUTTING_DOWN) and a crash (DISCONNECTED).
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Client, LeaseLostError, LockError, status } from '../lib/index.js';
import { startServer } from './helpers/server.js';
import { aborted, uniqueName, within } from './helpers/util.js';

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

test('SIGTERM on the server rejects a waiting acquire UNAVAILABLE SHUTTING_DOWN', () =>
  withServer(async (srv, client) => {
    const waiter = new Client(srv.target);
    try {
      const name = uniqueName('stop-mid-wait');
      const holder = await client.acquire(name);
      let queued;
      const isQueued = new Promise((r) => {
        queued = r;
      });
      const pending = waiter.acquire(name, { onQueued: () => queued() });
      pending.catch(() => {});
      await within(isQueued, 5000, 'queued');
      srv.server.signal('SIGTERM');
      // Never granted: a shutdown hands no lock to a waiter of its own server.
      const outcome = await within(pending.then((lease) => lease, (e) => e), 10000, 'the pending acquire');
      assert.ok(outcome instanceof LockError, `got ${outcome}`);
      assert.equal(outcome.code, status.UNAVAILABLE);
      assert.equal(outcome.reason, 'SHUTTING_DOWN');
      assert.equal((await aborted(holder.signal, 10000)).reason, 'SHUTDOWN');
    } finally {
      waiter.close();
    }
  }));

test('SIGTERM on the server rejects a watch UNAVAILABLE SHUTTING_DOWN', () =>
  withServer(async (srv, client) => {
    const states = client.watch(uniqueName('watch-stop'));
    assert.equal((await within(states.next(), 5000, 'the first state')).done, false);
    srv.server.signal('SIGTERM');
    // The server ends every Watch so at shutdown; the watch does not end as if closed.
    const err = await within(states.next().then(() => null, (e) => e), 10000, 'the end of the watch');
    assert.ok(err instanceof LockError, `got ${err}`);
    assert.equal(err.code, status.UNAVAILABLE);
    assert.equal(err.reason, 'SHUTTING_DOWN');
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
