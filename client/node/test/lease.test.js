// Lease lifetimes against a server with a short watchdog timeout; keepalive through a
// proxy that can go silent (a network partition).
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { after, before, test } from 'node:test';
import { Client, Lease, LeaseLostError, LockTimeoutError, status } from '../lib/index.js';
import { sleep, startServer } from './helpers/server.js';
import { aborted, freezableProxy, noLongerHeld, uniqueName, until, within } from './helpers/util.js';

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
  // A tenth less than asked: the server gives it back that early.
  assert.equal(lease.leaseMs, 360);
  const started = Date.now();
  const reason = await aborted(lease.signal, 5000);
  assert.ok(reason instanceof LeaseLostError, `got ${reason}`);
  assert.equal(reason.reason, 'LEASE_EXPIRED');
  assert.ok(Date.now() - started < 3000);
  assert.equal(lease.held, false);
  assert.equal(await lease.release(), false);
  // The client's clock ends the lease a little before Redis expires the lock (it counts
  // from before the request was sent), so the next holder may wait those few ms.
  const next = await within(client.acquire(name, { wait: 1000 }), 5000, 'acquire after expiry');
  await next.release();
});

// How late the client's own clock may tell a fixed lease's end (one timer).
const TOLD_AT_THE_END_WITHIN_MS = 1000;

test("a fixed lease is told lost at its end by the client's clock when the server is frozen", async () => {
  // SIGSTOP after the grant: the server's `lost` cannot arrive, and keepalive would
  // notice only 6 to 8 s later. The client's own timer tells the holder at the lease's
  // end (counted from before the request was sent) and cancels the stream.
  const own = await startServer();
  const near = new Client(own.target);
  try {
    const askedAt = performance.now();
    const lease = await within(near.acquire(uniqueName('frozen'), { wait: 5000, lease: 1000 }), 5000, 'acquire');
    own.server.signal('SIGSTOP');
    try {
      await sleep(Math.max(0, askedAt + 500 - performance.now()));
      assert.equal(lease.signal.aborted, false, `lost before its end: ${lease.signal.reason}`);
      assert.equal(lease.held, true);
      const left = askedAt + 1000 + TOLD_AT_THE_END_WITHIN_MS - performance.now();
      const reason = await aborted(lease.signal, Math.max(0, left)).catch(() =>
        assert.fail(
          `the fixed lease of a frozen server reads held=${lease.held} ` +
            `${Math.round(performance.now() - askedAt)} ms after it was asked for`,
        ),
      );
      assert.ok(reason instanceof LeaseLostError, `got ${reason}`);
      assert.equal(reason.reason, 'LEASE_EXPIRED');
      assert.equal(reason.code, status.CANCELLED, 'the client cancelled the stream');
      assert.equal(lease.held, false);
      assert.equal(lease.lostReason, 'LEASE_EXPIRED');
      // Nothing waits for the frozen server: the stream is over already.
      assert.equal(await within(lease.release(), 1000, 'release after the end'), false);
    } finally {
      own.server.signal('SIGCONT');
    }
  } finally {
    near.close();
    await own.stop();
  }
});

test('a fixed lease queued longer than itself is held for its length', async () => {
  // The lease counts from the try that granted it, and the client counts from there too
  // (the server says how long it waited first): a waiter queued longer than its lease
  // was told LEASE_EXPIRED the moment it was granted.
  const name = uniqueName('queued-fixed');
  const holder = await client.acquire(name);
  const waiter = client.acquire(name, { wait: 10000, lease: 800 });
  await sleep(1200);
  assert.equal(await holder.release(), true);
  const lease = await within(waiter, 10000, 'the waiter is granted');
  const granted = performance.now();
  const reason = await aborted(lease.signal, 5000);
  assert.equal(reason.reason, 'LEASE_EXPIRED');
  const heldFor = performance.now() - granted;
  assert.ok(heldFor >= 500, `held ${Math.round(heldFor)} ms of an 800 ms lease`);
});

test('a released fixed lease is not told lost at its end', async () => {
  // The release clears the lease's one timer: its end passes with no spurious abort.
  const lease = await client.acquire(uniqueName('released'), { lease: 400 });
  assert.equal(await lease.release(), true);
  await sleep(800);
  assert.equal(lease.signal.aborted, false, `lost after the release: ${lease.signal.reason}`);
  assert.equal(lease.lostReason, null);
  assert.equal(lease.held, false);
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

// How long the client may take at most to notice a dead connection: an HTTP/2 keepalive
// ping every 2 s that goes 6 s unanswered (dead within 8 s), and slack.
const NOTICES_A_DEAD_CONNECTION_WITHIN_MS = 12000;
// How long the server may take at most to release the lock of a dead connection: its
// default keepalive, a ping every 10 s that goes 10 s unanswered, and slack.
const RELEASES_A_DEAD_CONNECTION_WITHIN_MS = 25000;

test('keepalive (on by default) reports a partitioned lease lost', async () => {
  // After a silent partition (no FIN, no RST) the partitioned lease learns it lost the
  // lock from the client's own keepalive before the server, with its default keepalive,
  // drops the connection and releases the lock: when the holder is told, no other
  // client can take the lock yet; later one does.
  const own = await startServer();
  const proxy = await freezableProxy(Number(own.target.split(':')[1]));
  const far = new Client(proxy.target);
  const near = new Client(own.target);
  try {
    const name = uniqueName('partition');
    const lease = await within(far.acquire(name, { wait: 5000 }), 10000, 'first acquire');
    proxy.freeze();
    const frozenAt = performance.now();
    const reason = await aborted(lease.signal, NOTICES_A_DEAD_CONNECTION_WITHIN_MS).catch(() =>
      assert.fail(`the partitioned lease says held=${lease.held}`),
    );
    const told = Math.round(performance.now() - frozenAt);
    assert.ok(reason instanceof LeaseLostError, `got ${reason}`);
    assert.equal(reason.reason, 'DISCONNECTED');
    assert.equal(reason.code, status.UNAVAILABLE);
    await assert.rejects(
      within(near.acquire(name, { wait: 0 }), 5000, 'try-once acquire'),
      LockTimeoutError,
      `another client got ${name} as the holder was told, ${told} ms after the partition`,
    );
    const other = await within(
      near.acquire(name, { wait: RELEASES_A_DEAD_CONNECTION_WITHIN_MS }),
      RELEASES_A_DEAD_CONNECTION_WITHIN_MS + 5000,
      'second acquire',
    );
    try {
      assert.ok(other.fencingToken > lease.fencingToken);
    } finally {
      await other.release();
    }
  } finally {
    far.close();
    near.close();
    proxy.close();
    await own.stop();
  }
});

test('keepalive pings of an idle lease every second are not refused', async () => {
  // Three times the default rate, through several pings: the server sends no GOAWAY
  // too_many_pings. The pings do flow: a partition is then noticed within seconds.
  const proxy = await freezableProxy(Number(srv.target.split(':')[1]));
  const fast = new Client(proxy.target, {
    channelOptions: { 'grpc.keepalive_time_ms': 1000, 'grpc.keepalive_timeout_ms': 1000 },
  });
  const name = uniqueName('pings');
  try {
    const lease = await within(fast.acquire(name, { wait: 5000 }), 10000, 'acquire');
    await sleep(6000);
    assert.equal(lease.signal.aborted, false, `lost: ${lease.signal.reason}`);
    assert.equal(lease.held, true);
    proxy.freeze();
    const reason = await aborted(lease.signal, 5000);
    assert.equal(reason.reason, 'DISCONNECTED');
  } finally {
    fast.close();
    proxy.close();
    await client.forceRelease(name); // the server still holds it for the frozen connection
  }
});

test('an event loop busy in 5 s chunks keeps its lease', async () => {
  // CPU-bound work under a lock, yielding with setImmediate between chunks: a ping goes
  // out between two chunks, and its ack, in the socket all along, is read only after the
  // next chunk, once the timers have run. With 4 s to answer the connection was declared
  // dead after the second chunk, and every lease on it lost with DISCONNECTED.
  const name = uniqueName('busy');
  const lease = await client.acquire(name);
  for (let i = 0; i < 3; i++) {
    await new Promise((r) => setImmediate(r));
    const started = performance.now();
    while (performance.now() - started < 5000);
  }
  await sleep(100);
  assert.equal(lease.signal.aborted, false, `lost: ${lease.signal.reason}`);
  assert.equal(await lease.release(), true);
});

test('a lost lease carries the status that ended its stream', async () => {
  // The server's `lost`: the status the server ended the stream with.
  const name = uniqueName('status');
  const lease = await client.acquire(name, { lease: 10000 });
  assert.equal(await client.forceRelease(name), true);
  const reason = await aborted(lease.signal, 5000);
  assert.equal(reason.reason, 'FORCE_RELEASED');
  assert.equal(reason.code, status.ABORTED);
  assert.equal(reason.codeName, 'ABORTED');
  assert.equal(reason.info.lostReason, 'FORCE_RELEASED');
  assert.equal(reason.info.lockName, name);
  // A fixed lease's end: the server's `lost` (it ends a fixed lease a tenth early), or
  // the client's own clock if that comes first (the cancel the client sent).
  const fixed = await client.acquire(uniqueName('status'), { lease: 300 });
  const ended = await aborted(fixed.signal, 5000);
  assert.equal(ended.reason, 'LEASE_EXPIRED');
  assert.ok([status.ABORTED, status.CANCELLED].includes(ended.code), `code ${ended.code}`);
  assert.equal(ended.codeName, ended.code === status.ABORTED ? 'ABORTED' : 'CANCELLED');
});

test('Redis restarted empty tells the holder NOT_HELD, with ABORTED', async () => {
  // The server's renewal finds the lock gone: the lease is lost, not held on.
  const own = await startServer({ args: ['--watchdog-timeout', '900ms'] });
  const c = new Client(own.target);
  try {
    const lease = await c.acquire(uniqueName('restart'));
    await own.restartRedis();
    const reason = await aborted(lease.signal, 10000);
    assert.ok(reason instanceof LeaseLostError);
    assert.equal(reason.reason, 'NOT_HELD');
    assert.equal(reason.code, status.ABORTED);
    assert.equal(lease.held, false);
    assert.equal(await lease.release(), false);
  } finally {
    c.close();
    await own.stop();
  }
});

test('index.d.ts declares the Symbol.asyncDispose that Lease has at runtime', async () => {
  // `await using lease = await client.acquire(...)` (TS 5.2) needs the declaration;
  // AsyncDisposable wants Promise<void> (Promise<boolean> fails with TS2851).
  assert.equal(typeof Lease.prototype[Symbol.asyncDispose ?? Symbol.for('Symbol.asyncDispose')], 'function');
  const dts = readFileSync(new URL('../index.d.ts', import.meta.url), 'utf8');
  const declared = dts.slice(dts.indexOf('export declare class Lease'), dts.indexOf('export declare class Client'));
  assert.match(declared, /\[Symbol\.asyncDispose\]\(\): Promise<void>/);

  const name = uniqueName('dispose');
  const lease = await client.acquire(name);
  assert.equal(await lease[Symbol.asyncDispose ?? Symbol.for('Symbol.asyncDispose')](), undefined);
  assert.equal(lease.held, false);
  await (await within(client.acquire(name, { wait: 0 }), 5000, 'acquire after dispose')).release();
});

test('lostReason is the lost event\'s reason as soon as held turns false', async () => {
  // The signal aborts only when the status after the event arrives; the reason is known
  // before that.
  const name = uniqueName('reason');
  const lease = await client.acquire(name);
  assert.equal(await client.forceRelease(name), true);
  await noLongerHeld(lease);
  assert.equal(lease.lostReason, 'FORCE_RELEASED');
  assert.equal((await aborted(lease.signal)).reason, 'FORCE_RELEASED');
});

test('a process that exits holding a lease frees its lock', async () => {
  // No release, no close(): process.exit() ends the connection, and the server the lease.
  const name = uniqueName('exit');
  const lib = new URL('../lib/index.js', import.meta.url).href;
  const script =
    `import { Client } from ${JSON.stringify(lib)};\n` +
    `const lease = await new Client(${JSON.stringify(srv.target)}).acquire(${JSON.stringify(name)});\n` +
    `console.log('held', lease.held);\n` +
    'setTimeout(() => process.exit(0), 50);\n';
  const run = spawnSync(process.execPath, ['--input-type=module', '-e', script], { encoding: 'utf8', timeout: 10000 });
  assert.equal(run.status, 0, `${run.stdout}\n${run.stderr}`);
  assert.equal(run.stdout.trim(), 'held true');
  await until(async () => !(await client.describe(name)).locked, 3000, 'the lock freed');
});

/** Runs `clientCall(client)` in another process, which blocks this one meanwhile. */
function blockingCall(target, clientCall) {
  const lib = new URL('../lib/index.js', import.meta.url).href;
  const script =
    `import { Client } from ${JSON.stringify(lib)};\n` +
    `const client = new Client(${JSON.stringify(target)});\n` +
    `try { console.log(JSON.stringify(await (${clientCall})(client))); } finally { client.close(); }\n`;
  const run = spawnSync(process.execPath, ['--input-type=module', '-e', script], { encoding: 'utf8', timeout: 20000 });
  assert.equal(run.status, 0, `${run.stdout}\n${run.stderr}`);
  return JSON.parse(run.stdout);
}

test('a lost notice that came during a stall wins over the fixed lease\'s end read after it', async () => {
  // Both leases are force-released while this process is blocked, and their ends pass
  // before it runs again: the `lost` notices are in the socket, unread. One lease is read
  // at once (a getter), the other is left to its end timer, which runs before the poll
  // for I/O: both must end up FORCE_RELEASED, not LEASE_EXPIRED.
  const LEASE_MS = 3000;
  const askedAt = performance.now();
  const names = [uniqueName('stall-read'), uniqueName('stall-timer')];
  const [read, timer] = await Promise.all(names.map((name) => client.acquire(name, { lease: LEASE_MS })));
  const released = blockingCall(srv.target, `(c) => Promise.all(${JSON.stringify(names)}.map((n) => c.forceRelease(n)))`);
  assert.deepEqual(released, [true, true]);
  assert.ok(performance.now() < askedAt + LEASE_MS, 'force-released before the leases ended');
  while (performance.now() < askedAt + LEASE_MS + 300); // a stall past the leases' ends
  assert.equal(read.held, false, 'past its end');
  for (let i = 0; i < 5; i++) await new Promise((r) => setImmediate(r));
  for (const lease of [read, timer]) {
    assert.equal(lease.lostReason, 'FORCE_RELEASED');
    const reason = await aborted(lease.signal);
    assert.equal(reason.reason, 'FORCE_RELEASED');
    assert.equal(reason.code, status.ABORTED);
  }
});

test('a Lease collected while held gives its lock back and aborts its signal with DROPPED', async () => {
  // Only the signal is kept, as by code that hands it on and forgets release().
  assert.equal(typeof globalThis.gc, 'function', 'the tests run with node --expose-gc');
  const name = uniqueName('dropped');
  const signal = await (async () => (await client.acquire(name)).signal)();
  const deadline = performance.now() + 5000;
  while (!signal.aborted && performance.now() < deadline) {
    globalThis.gc();
    await sleep(20);
  }
  assert.equal(signal.aborted, true, 'the dropped lease was not collected');
  assert.ok(signal.reason instanceof LeaseLostError, `got ${signal.reason}`);
  assert.equal(signal.reason.reason, 'DROPPED');
  assert.equal(signal.reason.code, status.CANCELLED);
  await (await within(client.acquire(name, { wait: 5000 }), 10000, 'acquire after the drop')).release();
});

test('a Lease whose onQueued or signal reaches it is collected all the same', async () => {
  // The stream's listeners kept the caller's options: a callback or an abort listener
  // that reaches the Lease (a job object holding both) kept it from being collected,
  // and its lock held until close().
  const signals = [];
  for (const how of ['onQueued', 'signal']) {
    const name = uniqueName(`dropped-${how}`);
    signals.push(
      await (async () => {
        const job = {};
        const controller = new AbortController();
        controller.signal.addEventListener('abort', () => job);
        const options = how === 'onQueued' ? { onQueued: () => job } : { signal: controller.signal };
        job.lease = await client.acquire(name, options);
        return job.lease.signal;
      })(),
    );
  }
  const deadline = performance.now() + 5000;
  while (!signals.every((s) => s.aborted) && performance.now() < deadline) {
    globalThis.gc();
    await sleep(20);
  }
  assert.deepEqual(
    signals.map((s) => s.reason?.reason),
    ['DROPPED', 'DROPPED'],
    'a dropped Lease reached from what acquire was handed was not collected',
  );
});

test('a Lease kept alive is not collected', async () => {
  const name = uniqueName('kept');
  const lease = await client.acquire(name);
  for (let i = 0; i < 5; i++) {
    globalThis.gc();
    await sleep(20);
  }
  assert.equal(lease.held, true);
  assert.equal(await lease.release(), true);
});

test('a fixed lease longer than a timer can wait (2^31-1 ms) is held', async () => {
  // Node fires a setTimeout longer than 2^31-1 ms (about 24.8 days) after 1 ms: the end
  // timer of a 25-day lease ran at once, aborted the signal with LEASE_EXPIRED and
  // cancelled the stream, so the server gave the lock up a millisecond after the grant.
  const name = uniqueName('long-lease');
  const lease = await client.acquire(name, { lease: 25 * 86400 * 1000 });
  await sleep(100);
  assert.equal(lease.signal.aborted, false, `lost: ${lease.signal.reason}`);
  assert.equal(lease.held, true);
  assert.equal((await client.describe(name)).locked, true);
  assert.equal(await lease.release(), true);
});
