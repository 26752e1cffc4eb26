// How release() and withLock report a release that failed: the server could not reach
// Redis, no answer came in time, or the lease was lost while the release was on its way.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { Client, LeaseLostError, LockError, LockTimeoutError, status } from '../lib/index.js';
import { sleep, startServer } from './helpers/server.js';
import { aborted, freezableProxy, noLongerHeld, uniqueName, within } from './helpers/util.js';

let srv;
let client;

before(async () => {
  srv = await startServer();
  client = new Client(srv.target);
});

after(async () => {
  client?.close();
  await srv?.stop();
});

const portOf = (target) => Number(target.split(':')[1]);

// How long the server may take to give a lock back once Redis answers again: it retries
// a failed release in the background.
const GIVEN_BACK_WITHIN_MS = 15000;

/** Resolves once `name` is free, polling Describe; rejects after `ms`. */
async function freeWithin(c, name, ms) {
  const deadline = performance.now() + ms;
  for (;;) {
    const state = await c.describe(name).catch(() => null);
    if (state && !state.locked) return;
    if (performance.now() > deadline) assert.fail(`${name} is still held ${ms} ms on: ${state?.holders.length} holders`);
    await sleep(100);
  }
}

/** A server whose Redis keeps its data across a restart (append-only, fsync always). */
async function withPersistentRedis(fn) {
  const own = await startServer({
    args: ['--redis-timeout', '300ms'],
    redisArgs: ['--appendonly', 'yes', '--appendfsync', 'always'],
  });
  const near = new Client(own.target);
  try {
    await fn(own, near);
  } finally {
    near.close();
    await own.stop();
  }
}

test('a release the server could not make rejects with its status; the signal stays', () =>
  withPersistentRedis(async (own, near) => {
    // The release's outcome is unknown (UNAVAILABLE), not a lease lost: the server
    // retries it in the background and gives the lock back once Redis answers.
    const name = uniqueName('redis-away');
    const lease = await near.acquire(name, { lease: 3600000 });
    await own.redis.stop();
    const err = await within(lease.release(), 10000, 'release').then(
      (v) => assert.fail(`release resolved ${v}`),
      (e) => e,
    );
    assert.ok(err instanceof LockError, `got ${err}`);
    assert.ok(!(err instanceof LeaseLostError), `got ${err}`);
    assert.equal(err.code, status.UNAVAILABLE, `got ${err}`);
    assert.equal(lease.signal.aborted, false, `aborted: ${lease.signal.reason}`);
    assert.equal(lease.held, false);
    assert.equal(lease.lostReason, null);
    assert.equal(await lease.release().catch((e) => e), err, 'release is idempotent');
    await own.restartRedis();
    await freeWithin(near, name, GIVEN_BACK_WITHIN_MS);
    await (await within(near.acquire(name, { wait: 0 }), 5000, 'acquire after the outage')).release();
  }));

test("withLock rejects with a failed release after fn returned, with fn's error after it threw", () =>
  withPersistentRedis(async (own, near) => {
    const name = uniqueName('with-redis-away');
    const returned = near.withLock(name, async () => {
      await own.redis.stop();
      return 42;
    }, { lease: 3600000 });
    const failed = (e) => e instanceof LockError && e.code === status.UNAVAILABLE;
    await assert.rejects(within(returned, 10000, 'withLock'), failed);
    await own.restartRedis();
    await freeWithin(near, name, GIVEN_BACK_WITHIN_MS);

    const boom = new Error('boom');
    const threw = near.withLock(name, async () => {
      await own.redis.stop();
      throw boom;
    }, { lease: 3600000 });
    await assert.rejects(within(threw, 10000, 'withLock'), (e) => e === boom);
    await own.restartRedis();
    await freeWithin(near, name, GIVEN_BACK_WITHIN_MS);
  }));

test('a release with no answer in time rejects with DEADLINE_EXCEEDED, not a timeout of the wait', async () => {
  // The release and the cancel wait in the proxy: the server hears of neither in time.
  const proxy = await freezableProxy(portOf(srv.target));
  const far = new Client(proxy.target);
  try {
    const name = uniqueName('release-timeout');
    const lease = await far.acquire(name);
    proxy.holdRequests();
    const started = performance.now();
    const err = await within(lease.release({ timeoutMs: 300 }), 5000, 'release').then(
      (v) => assert.fail(`release resolved ${v}`),
      (e) => e,
    );
    assert.ok(performance.now() - started >= 250, 'it waited for the answer');
    assert.ok(err instanceof LockError, `got ${err}`);
    assert.ok(!(err instanceof LockTimeoutError), 'LockTimeoutError is for the wait for a lock');
    assert.ok(!(err instanceof LeaseLostError), `got ${err}`);
    assert.equal(err.code, status.DEADLINE_EXCEEDED);
    assert.equal(lease.signal.aborted, false, `aborted: ${lease.signal.reason}`);
    assert.equal(lease.held, false);
    // Once the cancel reaches the server, it releases the lock.
    proxy.passRequests();
    await freeWithin(client, name, 5000);
  } finally {
    far.close();
    proxy.close();
  }
});

test('a lost heard while releasing resolves false and aborts the signal', async () => {
  const proxy = await freezableProxy(portOf(srv.target));
  const far = new Client(proxy.target);
  try {
    const name = uniqueName('lost-releasing');
    const lease = await far.acquire(name);
    proxy.holdRequests();
    const releasing = lease.release();
    await sleep(100); // the release waits in the proxy
    assert.equal(await client.forceRelease(name), true);
    assert.equal(await within(releasing, 5000, 'release'), false);
    assert.equal(await lease.release(), false, 'release is idempotent');
    assert.equal(lease.signal.aborted, true);
    const err = lease.signal.reason;
    assert.ok(err instanceof LeaseLostError, `got ${err}`);
    assert.equal(err.reason, 'FORCE_RELEASED');
    assert.equal(err.code, status.ABORTED, 'the status that ended the stream');
    assert.equal(lease.lostReason, 'FORCE_RELEASED');
  } finally {
    proxy.passRequests();
    far.close();
    proxy.close();
  }
});

test('release of a lost lease resolves false on every path', async () => {
  // Its stream ended with `lost`, a fixed lease is past its end on the client's clock,
  // a `lost` came while the release was on its way, or the client was closed: the
  // lease was lost, which release() tells by resolving false, never by rejecting.
  const name = uniqueName('lost-paths');
  const ended = await client.acquire(`${name}/ended`);
  assert.equal(await client.forceRelease(`${name}/ended`), true);
  await aborted(ended.signal, 5000);
  assert.equal(await within(ended.release(), 1000, 'release after lost'), false);

  const fixed = await client.acquire(`${name}/fixed`, { lease: 300 });
  await sleep(400);
  assert.equal(await within(fixed.release(), 1000, 'release past the end'), false);
  assert.equal(fixed.lostReason, 'LEASE_EXPIRED');

  const proxy = await freezableProxy(portOf(srv.target));
  const far = new Client(proxy.target);
  try {
    const inFlight = await far.acquire(`${name}/in-flight`);
    proxy.holdRequests();
    const releasing = inFlight.release();
    await sleep(100);
    assert.equal(await client.forceRelease(`${name}/in-flight`), true);
    assert.equal(await within(releasing, 5000, 'release in flight'), false);
  } finally {
    proxy.passRequests();
    far.close();
    proxy.close();
  }

  const closing = new Client(srv.target);
  const closed = await closing.acquire(`${name}/closed`);
  closing.close();
  assert.equal(await within(closed.release(), 1000, 'release after close'), false);
  assert.equal(closed.lostReason, 'CLOSED');
});

test('withLock resolves with the result when the lease was lost while releasing', async () => {
  const proxy = await freezableProxy(portOf(srv.target));
  const far = new Client(proxy.target);
  try {
    const name = uniqueName('with-lost-releasing');
    const result = far.withLock(name, async () => {
      proxy.holdRequests(); // the release that follows waits in the proxy
      setTimeout(() => client.forceRelease(name).catch(() => {}), 100);
      return 42;
    });
    assert.equal(await within(result, 5000, 'withLock'), 42);
  } finally {
    proxy.passRequests();
    far.close();
    proxy.close();
  }
});

test('release({ timeoutMs: Infinity }) waits for the answer; a timeout no timer can wait is refused', async () => {
  // setTimeout(Infinity) fires after 1 ms: the release was cancelled at once and
  // rejected with DEADLINE_EXCEEDED.
  const lease = await client.acquire(uniqueName('release-infinity'));
  await assert.rejects(lease.release({ timeoutMs: 2 ** 31 }), TypeError);
  await assert.rejects(lease.release({ timeoutMs: -1 }), TypeError);
  assert.equal(lease.held, true, 'a refused timeout leaves the lease held');
  assert.equal(await within(lease.release({ timeoutMs: Infinity }), 5000, 'release'), true);
});

test('release() of a lease past its end resolves false once the signal aborted', async () => {
  // A stall past a fixed lease's end, then release(): it resolved false within the
  // same macrotask, before the signal aborted, so the check the README asks for
  // (lease.signal after withLock or release) said the lease was fine.
  const lease = await client.acquire(uniqueName('stalled-release'), { lease: 200 });
  const start = performance.now();
  while (performance.now() - start < 300); // a stall past the end
  assert.equal(await lease.release(), false);
  assert.equal(lease.signal.aborted, true);
  assert.equal(lease.signal.reason.lostReason, 'LEASE_EXPIRED');

  let seen = null;
  const result = await client.withLock(uniqueName('stalled-with'), (l) => {
    seen = l;
    const t = performance.now();
    while (performance.now() - t < 300); // fn runs synchronously past the end
    return 'done';
  }, { lease: 200 });
  assert.equal(result, 'done');
  assert.equal(seen.signal.aborted, true, 'withLock resolved before the signal aborted');
  assert.equal(seen.signal.reason.lostReason, 'LEASE_EXPIRED');
});

test('release() of a lease told lost resolves false once the signal aborted', async () => {
  // After a `lost` event the signal aborts when the status that follows arrives; a
  // release() called in between resolved false before it.
  const name = uniqueName('heard-release');
  const lease = await client.acquire(name);
  assert.equal(await client.forceRelease(name), true);
  await noLongerHeld(lease);
  assert.equal(await within(lease.release(), 5000, 'release'), false);
  assert.equal(lease.signal.aborted, true);
  assert.equal(lease.signal.reason.lostReason, 'FORCE_RELEASED');
});
