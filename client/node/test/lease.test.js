// Lease lifetimes against a server with a short watchdog timeout.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { Client, LeaseLostError, LockTimeoutError } from '../lib/index.js';
import { sleep, startServer } from './helpers/server.js';
import { aborted, uniqueName, within } from './helpers/util.js';

let srv;
let client;

before(async () => {
  srv = await startServer({ args: ['--watchdog-timeout', '900ms'] });
  client = new Client(srv.target);
});

after(async () => {
  client?.close();
  await srv?.stop();
});

test('a fixed lease ends with LEASE_EXPIRED and frees the lock', async () => {
  const name = uniqueName('fixed');
  const lease = await client.acquire(name, { lease: 400 });
  assert.equal(lease.leaseMs, 400);
  const started = Date.now();
  const reason = await aborted(lease.signal, 5000);
  assert.ok(reason instanceof LeaseLostError, `got ${reason}`);
  assert.equal(reason.reason, 'LEASE_EXPIRED');
  assert.ok(Date.now() - started < 3000);
  assert.equal(lease.held, false);
  assert.equal(await lease.release(), false);
  const next = await within(client.acquire(name, { wait: 0 }), 5000, 'acquire after expiry');
  await next.release();
});

test('a watchdog lease outlives the watchdog timeout while the stream is open', async () => {
  const name = uniqueName('watchdog');
  const lease = await client.acquire(name);
  assert.equal(lease.leaseMs, 900);
  await sleep(2500);
  assert.equal(lease.signal.aborted, false);
  assert.equal(lease.held, true);
  await assert.rejects(client.acquire(name, { wait: 0 }), LockTimeoutError);
  const state = await client.describe(name);
  assert.deepEqual(state.holders.map((h) => h.owner), [lease.owner]);
  assert.ok(state.ttlMs <= 900);
  assert.equal(await lease.release(), true);
});

test('fetch-style consumers see the abort', async () => {
  const name = uniqueName('consumer');
  // A long-running job that stops when the lease is lost.
  const result = await client.withLock(
    name,
    (lease) =>
      new Promise((resolve) => {
        const timer = setTimeout(() => resolve('finished'), 10000);
        lease.signal.addEventListener('abort', () => {
          clearTimeout(timer);
          resolve(`stopped: ${lease.signal.reason.reason}`);
        });
      }),
    { lease: 300 },
  );
  assert.equal(result, 'stopped: LEASE_EXPIRED');
});
