// Locks, exclusion, withLock, fencing, wake-ups, admin calls and the other kinds,
// against one real redis-server + latchkey-server for the whole file.
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { execFileSync } from 'node:child_process';
import { getEventListeners } from 'node:events';
import * as grpc from '@grpc/grpc-js';
import { Client, KEEPALIVE_CHANNEL_OPTIONS, LeaseLostError, LockError, LockTimeoutError, status, withLock } from '../lib/index.js';
import { lockServiceConstructor } from '../lib/proto.js';
import { startServer, sleep } from './helpers/server.js';
import { aborted, uniqueName, until, within } from './helpers/util.js';

let srv;
let a;
let b;

before(async () => {
  srv = await startServer({ unixSocket: true });
  a = new Client(srv.target);
  b = new Client(srv.target);
});

after(async () => {
  a?.close();
  b?.close();
  await srv?.stop();
});

/** The other client can take `name` at once (try-once). */
async function takeAtOnce(client, name, options = {}) {
  const lease = await within(client.acquire(name, { wait: 0, ...options }), 5000, `acquire ${name}`);
  return lease;
}

/** How many requests wait in the queue of `name`. */
const waiters = async (client, name) => (await client.describe(name)).waiters.length;

/** Whether `name` has neither holders nor waiters. */
const free = async (client, name) => {
  const state = await client.describe(name);
  return !state.locked && state.waiters.length === 0;
};

describe('mutex', () => {
  test('a held lock excludes others; wait: 0 rejects with LockTimeoutError', async () => {
    const name = uniqueName('hold');
    const lease = await a.acquire(name);
    assert.equal(lease.held, true);
    assert.equal(lease.holdCount, 1);
    assert.equal(typeof lease.fencingToken, 'bigint');
    assert.ok(lease.fencingToken > 0n);
    assert.ok(lease.owner.length > 0);
    assert.equal(lease.signal.aborted, false);

    const err = await b.acquire(name, { wait: 0 }).then(
      () => assert.fail('second acquire succeeded'),
      (e) => e,
    );
    assert.ok(err instanceof LockTimeoutError, `got ${err}`);
    assert.ok(err instanceof LockError);
    assert.equal(err.code, status.DEADLINE_EXCEEDED);
    assert.equal(err.reason, 'WAIT_TIMEOUT');
    assert.match(err.details, new RegExp(name));

    // A bounded wait also times out.
    const started = Date.now();
    await assert.rejects(b.acquire(name, { wait: 300 }), LockTimeoutError);
    assert.ok(Date.now() - started >= 250, 'the wait lasted about 300 ms');

    assert.equal(await lease.release(), true);
    assert.equal(lease.held, false);
    assert.equal(lease.signal.aborted, false, 'a deliberate release does not abort the signal');
    assert.equal(await lease.release(), true, 'release is idempotent');
    const next = await takeAtOnce(b, name);
    await next.release();
  });

  test('withLock releases after fn returns and returns its result', async () => {
    const name = uniqueName('with');
    let seen = null;
    const result = await withLock(a, name, async (lease) => {
      seen = lease;
      assert.equal(lease.held, true);
      await assert.rejects(b.acquire(name, { wait: 0 }), LockTimeoutError);
      return 42;
    });
    assert.equal(result, 42);
    assert.equal(seen.held, false);
    const next = await takeAtOnce(b, name);
    await next.release();
  });

  test('withLock releases when fn throws and rethrows', async () => {
    const name = uniqueName('throw');
    const boom = new Error('boom');
    await assert.rejects(
      a.withLock(name, async () => {
        throw boom;
      }),
      (err) => err === boom,
    );
    const next = await takeAtOnce(b, name);
    await next.release();
  });

  test('fencing tokens strictly increase per name', async () => {
    const name = uniqueName('fence');
    const tokens = [];
    for (let i = 0; i < 4; i++) {
      const client = i % 2 ? b : a;
      tokens.push(await client.withLock(name, (lease) => lease.fencingToken));
    }
    for (let i = 1; i < tokens.length; i++) {
      assert.ok(tokens[i] > tokens[i - 1], `token ${tokens[i]} > ${tokens[i - 1]}`);
    }
    const state = await a.describe(name);
    assert.equal(state.lastFencingToken, tokens.at(-1));
  });

  test('a lock larger than 4 MiB is described whole', async () => {
    const name = uniqueName('big');
    const many = "for i = 1, 5000 do redis.call('hset', KEYS[1], string.rep('o', 1000) .. i, 1) end "
      + "redis.call('pexpire', KEYS[1], 60000)";
    execFileSync('redis-cli', ['-p', String(srv.redisPort), 'EVAL', many, '1', name], { timeout: 10000 });
    assert.equal((await a.describe(name)).holders.length, 5000);
  });

  test('a waiter gets the lock right after the holder releases', async () => {
    const name = uniqueName('wake');
    const holder = await a.acquire(name);
    let queued = null;
    const waiting = b.acquire(name, { onQueued: (q) => (queued = q) });
    await sleep(300);
    assert.ok(queued, 'the waiter was told it is queued');
    assert.ok(queued.holderTtlMs > 0);

    const releasedAt = Date.now();
    await holder.release();
    const lease = await within(waiting, 5000, 'waiter acquire');
    const elapsed = Date.now() - releasedAt;
    assert.ok(elapsed < 1000, `waiter acquired ${elapsed} ms after the release`);
    assert.ok(lease.fencingToken > holder.fencingToken);
    await lease.release();
  });

  test('many leases on one client exclude each other and leave the lock free', async () => {
    const name = uniqueName('many');
    let inside = 0;
    let overlaps = 0;
    await Promise.all(
      Array.from({ length: 10 }, async () => {
        for (let i = 0; i < 5; i++) {
          await a.withLock(name, async () => {
            inside++;
            if (inside > 1) overlaps++;
            await sleep(2);
            inside--;
          });
        }
      }),
    );
    assert.equal(overlaps, 0);
    assert.equal(await free(a, name), true);
  });

  test('the same owner holds reentrantly', async () => {
    const name = uniqueName('reentrant');
    const owner = 'node-test-owner:1';
    const first = await a.acquire(name, { owner });
    const second = await b.acquire(name, { owner, wait: 0 });
    assert.equal(first.owner, owner);
    assert.equal(second.holdCount, 2);
    await second.release();
    assert.equal((await a.describe(name)).holders[0].holdCount, 1);
    await first.release();
    assert.equal((await a.describe(name)).locked, false);
  });

  test('an AbortSignal withdraws a pending acquire', async () => {
    const name = uniqueName('abort');
    const holder = await a.acquire(name);
    const ac = new AbortController();
    const waiting = b.acquire(name, { signal: ac.signal });
    await sleep(200);
    ac.abort(new Error('gave up'));
    await assert.rejects(within(waiting, 5000, 'aborted acquire'), /gave up/);
    await holder.release();
    // The cancel and the release travel on different connections: the release may
    // hand the lock to the withdrawn waiter before the server sees the cancel, and
    // the server then gives it back at once. A short wait covers that moment; a
    // waiter that kept the lock would hold it for the whole watchdog timeout.
    const next = await within(b.acquire(name, { wait: 2000 }), 5000, `acquire ${name}`);
    await next.release();
  });

  test('an abort as the grant is handed on rejects rather than resolve a cancelled lease', async () => {
    const name = uniqueName('abort-at-grant');
    const ac = new AbortController();
    // Aborts while grpc-js hands the grant on, after it read it and before the client
    // sees it: the cancel then comes too late for the call, not for the acquire.
    const abortAtGrant = (options, nextCall) =>
      new grpc.InterceptingCall(nextCall(options), {
        start(metadata, _listener, next) {
          const onGrant = new grpc.ListenerBuilder()
            .withOnReceiveMessage((message, nextMessage) => {
              if (message?.event === 'acquired') ac.abort(new Error('gave up'));
              nextMessage(message);
            })
            .build();
          next(metadata, onGrant);
        },
      });
    const client = new Client(srv.target, { channelOptions: { interceptors: [abortAtGrant] } });
    try {
      const acquiring = client.acquire(name, { signal: ac.signal });
      await assert.rejects(within(acquiring, 5000, 'acquire aborted at its grant'), /gave up/);
      // The server gives the lock back at the cancel.
      const next = await within(a.acquire(name, { wait: 2000 }), 5000, `acquire ${name}`);
      await next.release();
    } finally {
      client.close();
    }
  });

  test('a close() as the grant is handed on rejects CANCELLED rather than resolve a dead lease', async () => {
    const name = uniqueName('close-at-grant');
    let client;
    // Closes the client while grpc-js hands the grant on, after it read it and before
    // the client sees it: the lease resolved, already cancelled.
    const closeAtGrant = (options, nextCall) =>
      new grpc.InterceptingCall(nextCall(options), {
        start(metadata, _listener, next) {
          const onGrant = new grpc.ListenerBuilder()
            .withOnReceiveMessage((message, nextMessage) => {
              if (message?.event === 'acquired') client.close();
              nextMessage(message);
            })
            .build();
          next(metadata, onGrant);
        },
      });
    client = new Client(srv.target, { channelOptions: { interceptors: [closeAtGrant] } });
    try {
      const acquiring = client.acquire(name);
      await assert.rejects(within(acquiring, 5000, 'acquire closed at its grant'), (e) => e.code === grpc.status.CANCELLED);
      const next = await within(a.acquire(name, { wait: 2000 }), 5000, `acquire ${name}`);
      await next.release();
    } finally {
      client.close();
    }
  });

  test('a signal that is not an AbortSignal is refused before a call starts', async () => {
    // `{ signal: ms && AbortSignal.timeout(ms) }` with ms = 0, or the controller itself:
    // the call started first and was left with no 'error' listener, so its CANCELLED at
    // close() (or the server's INVALID_ARGUMENT 30 s later) crashed the process.
    const client = new Client(srv.target);
    const uncaught = [];
    const onUncaught = (e) => uncaught.push(e);
    process.on('uncaughtException', onUncaught);
    const refusals = [];
    try {
      for (const signal of [false, 0, new AbortController()]) {
        const name = uniqueName('bad-signal');
        refusals.push(await client.acquire(name, { signal }).then(() => 'acquired', (e) => e));
        refusals.push(await client.withLock(name, () => {}, { signal }).then(() => 'acquired', (e) => e));
        refusals.push(await client.watch(name, { signal }).next().then(() => 'watched', (e) => e));
      }
      client.close(); // cancels whatever the refused calls might have left behind
      await sleep(300);
    } finally {
      process.off('uncaughtException', onUncaught);
    }
    assert.deepEqual(uncaught.map(String), []);
    for (const err of refusals) {
      assert.ok(err instanceof TypeError, `got ${err}`);
      assert.match(err.message, /^latchkey: signal must be an AbortSignal/);
    }
  });

  test('a list of one name is a plain lock', async () => {
    // A multi-lock needs 2 to 64 names: the server refused a one-name array
    // (INVALID_ARGUMENT open.names), where the Rust client's lock_all sends it as `name`.
    const name = uniqueName('one-name');
    const lease = await within(a.acquire([name]), 5000, 'acquire');
    assert.deepEqual(lease.name, [name]);
    assert.deepEqual(lease.fencingTokens, [lease.fencingToken]);
    assert.equal((await a.describe(name)).locked, true);
    await assert.rejects(b.acquire(name, { wait: 0 }), LockTimeoutError);
    assert.equal(await lease.release(), true);
  });

  test('bad arguments reject', async () => {
    await assert.rejects(a.acquire(uniqueName(), { kind: 'bogus' }), TypeError);
    await assert.rejects(a.acquire(uniqueName(), { wait: -1 }), TypeError);
    // A name or owner that is no string names no other lock: `[id, undefined]` took the
    // lock "undefined" (the names were turned into strings).
    await assert.rejects(a.acquire([uniqueName(), undefined]), /name\[1\] must be a string/);
    await assert.rejects(a.acquire([42]), /name\[0\] must be a string/);
    await assert.rejects(a.acquire(uniqueName(), { owner: 7 }), /owner must be a string/);
    // An array's hole is no name either (map skips holes: it was sent as "undefined").
    const holed = new Array(2);
    holed[1] = uniqueName();
    await assert.rejects(a.acquire(holed, { wait: 0 }), /name\[0\] must be a string/);
    assert.equal((await a.describe('undefined')).locked, false);
    // The admin calls refuse a name that is no string as acquire does: a multi-lock's
    // names given to forceRelease were sent as "a,b", and broke nothing.
    const multi = await a.acquire([uniqueName(), uniqueName()]);
    await assert.rejects(a.forceRelease(multi.name), /name must be a string/);
    assert.equal(multi.held, true);
    await multi.release();
    await assert.rejects(a.describe(42), /name must be a string/);
    await assert.rejects(a.list(null), /prefix must be a string/);
    await assert.rejects(a.watch({}).next(), /name must be a string/);
    // A duration past protobuf's (10 000 years) is refused; one past 2^63 s wrapped.
    await assert.rejects(a.acquire(uniqueName(), { wait: 1e22 }), /wait must be 0 to/);
    await assert.rejects(a.acquire(uniqueName(), { lease: 1e22 }), /lease must be 0 to/);
    // Reconnection backs off 5 s at most, not grpc-js's 120 s.
    assert.equal(KEEPALIVE_CHANNEL_OPTIONS['grpc.max_reconnect_backoff_ms'], 5000);
    const err = await a.acquire('{}').catch((e) => e);
    assert.ok(err instanceof LockError);
    assert.equal(err.code, status.INVALID_ARGUMENT);
    assert.equal(err.info.field, 'open.name');
  });

  test('permits 0 and an empty owner reject rather than go out unset', async () => {
    // proto3 sends neither 0 nor "": the server read 1 permit (a mutex took `permits: 0`
    // where it refuses `permits: 1`) and no owner (a fresh one per stream, so two streams
    // meant to share an owner waited on each other).
    const name = uniqueName('unset');
    for (const options of [{ permits: 0 }, { kind: 'semaphore', limit: 2, permits: 0 }]) {
      await assert.rejects(a.acquire(name, { wait: 0, ...options }), { name: 'TypeError', message: /\bpermits\b/ });
    }
    await assert.rejects(a.acquire(name, { wait: 0, owner: '' }), { name: 'TypeError', message: /\bowner\b/ });
    assert.equal((await a.describe(name)).locked, false);
    // Unset (or null) is the default: 1 permit, an owner of the stream's own.
    const lease = await takeAtOnce(a, name, { kind: 'semaphore', limit: 2, permits: null, owner: null });
    assert.equal(lease.holdCount, 1);
    assert.equal(await lease.release(), true);
  });

  test('unix:// targets work', async () => {
    const client = new Client(srv.unixTarget);
    try {
      const name = uniqueName('unix');
      const lease = await client.acquire(name);
      await assert.rejects(a.acquire(name, { wait: 0 }), LockTimeoutError);
      await lease.release();
    } finally {
      client.close();
    }
  });

  test('close() drops held leases: signal CLOSED, the lock is freed', async () => {
    const name = uniqueName('close');
    const client = new Client(srv.target);
    const lease = await client.acquire(name);
    const waiting = a.acquire(name, { wait: 5000 });
    await sleep(100);
    client.close();
    const reason = await aborted(lease.signal);
    assert.ok(reason instanceof LeaseLostError);
    assert.equal(reason.reason, 'CLOSED');
    assert.equal(reason.code, status.CANCELLED);
    const next = await within(waiting, 5000, 'acquire after close');
    await next.release();
    await assert.rejects(client.acquire(name), LockError);
  });

  test('close() while an acquire connects rejects it CANCELLED', async () => {
    const client = new Client(srv.target);
    const pending = client.acquire(uniqueName('acquire-close')).then(() => null, (e) => e);
    client.close();
    const err = await within(pending, 5000, 'the end of the acquire');
    assert.ok(err instanceof LockError, `got ${err}`);
    assert.equal(err.code, status.CANCELLED);
  });

  test('close() amid many withLock loops ends each with a LockError CANCELLED and leaves nothing', async () => {
    // Whichever step each loop is at (connecting, queued, holding, releasing).
    const name = uniqueName('close-amid');
    const client = new Client(srv.target);
    const outcomes = [];
    const loops = Array.from({ length: 10 }, async () => {
      try {
        for (;;) {
          await client.withLock(name, () => sleep(2), { kind: 'fair', wait: 10000 });
        }
      } catch (err) {
        const cancelled = err instanceof LockError && !(err instanceof LeaseLostError);
        outcomes.push(cancelled ? `LockError ${err.code}` : `${err?.name} ${err?.message}`);
      }
    });
    await sleep(700);
    client.close();
    await within(Promise.all(loops), 10000, 'the loops');
    assert.deepEqual(outcomes.filter((o) => o !== `LockError ${status.CANCELLED}`), []);
    await until(() => free(a, name), 3000, 'the lock free');
  });
});

/**
 * A watch of `name` on `watcher` whose first state was read, then `n` changes made by
 * `changer` and left unread (received and buffered by the client).
 */
async function watchWithUnreadStates(watcher, changer, name, options, n = 3) {
  const states = watcher.watch(name, options);
  assert.equal((await within(states.next(), 5000, 'the first state')).done, false);
  for (let i = 0; i < n; i++) {
    const lease = await changer.acquire(name);
    await sleep(50);
    await lease.release();
    await sleep(50);
  }
  await sleep(200); // the server's states reach the client, unread
  return states;
}

/** The states `states` still yields until it ends. */
async function drain(states) {
  const rest = [];
  for (;;) {
    const r = await within(states.next(), 5000, 'the next state');
    if (r.done) return rest;
    rest.push(r.value);
  }
}

describe('administration', () => {
  test('describe and list show the holder', async () => {
    const prefix = uniqueName('admin');
    const l1 = await a.acquire(`${prefix}/one`);
    const l2 = await b.acquire(`${prefix}/two`);

    const state = await a.describe(`${prefix}/one`);
    assert.equal(state.name, `${prefix}/one`);
    assert.equal(state.kind, 'mutex');
    assert.equal(state.locked, true);
    assert.deepEqual(
      state.holders.map((h) => [h.owner, h.holdCount]),
      [[l1.owner, 1]],
    );
    assert.ok(state.ttlMs > 0);
    assert.equal(state.lastFencingToken, l1.fencingToken);

    const listed = await a.list(prefix);
    assert.deepEqual(
      listed.map((s) => [s.name, s.holders[0]?.owner]),
      [
        [`${prefix}/one`, l1.owner],
        [`${prefix}/two`, l2.owner],
      ],
    );
    // Pages are followed.
    const paged = await a.list(prefix, { pageSize: 1 });
    assert.deepEqual(
      paged.map((s) => s.name),
      [`${prefix}/one`, `${prefix}/two`],
    );

    await l1.release();
    await l2.release();
    const free = await a.describe(`${prefix}/one`);
    assert.equal(free.locked, false);
    assert.equal(free.kind, null);
    assert.deepEqual(free.holders, []);
  });

  test('list stops at a page token the server already gave', async () => {
    // A fake server whose List always gives the same next page token; its sixth call
    // fails, so a client that pages forever fails instead of hanging.
    const server = new grpc.Server();
    let calls = 0;
    server.addService(lockServiceConstructor().service, {
      List(call, callback) {
        calls += 1;
        if (calls > 5) callback({ code: status.FAILED_PRECONDITION, details: 'paged forever' });
        else callback(null, { locks: [{ name: `lock-${calls}` }], nextPageToken: 'again' });
      },
    });
    const port = await new Promise((resolve, reject) => {
      server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p)));
    });
    const client = new Client(`127.0.0.1:${port}`, { callTimeoutMs: 5000 });
    try {
      const locks = await within(client.list('x'), 10000, 'list');
      assert.deepEqual(
        locks.map((l) => l.name),
        ['lock-1', 'lock-2'],
      );
      assert.equal(calls, 2);
    } finally {
      client.close();
      server.forceShutdown();
    }
  });

  test('watch yields the current state, then each change', async () => {
    const name = uniqueName('watch');
    const controller = new AbortController();
    const states = b.watch(name, { signal: controller.signal });
    const next = async () => (await within(states.next(), 2000, 'a watched state')).value;
    assert.equal((await next()).locked, false);
    const lease = await a.acquire(name);
    const held = await next();
    assert.equal(held.locked, true);
    assert.equal(held.holders[0].owner, lease.owner);
    await lease.release();
    assert.equal((await next()).locked, false);
    controller.abort();
    assert.equal((await states.next()).done, true);
  });

  test('close() ends a watch; a watch with an aborted signal yields nothing', async () => {
    // grpc-js's close() fails only calls not started yet: a watch kept yielding states
    // after close(), and its HTTP/2 session kept the process alive. An AbortSignal
    // already aborted was never heard (its 'abort' event had passed).
    const client = new Client(srv.target);
    const name = uniqueName('watch-close');
    const states = client.watch(name);
    assert.equal((await within(states.next(), 2000, 'a watched state')).value.locked, false);
    client.close();
    assert.equal((await within(states.next(), 1000, 'the end of the watch')).done, true);

    const none = b.watch(name, { signal: AbortSignal.abort() });
    assert.equal((await within(none.next(), 1000, 'the end of the watch')).done, true);
  });

  test('a watch waiting for its client to connect ends at close(), as every other watch does', async () => {
    // It rejected with a LockError CANCELLED (the client's check after the wait).
    const client = new Client(srv.target);
    const states = client.watch(uniqueName('watch-connecting'));
    const first = states.next();
    client.close();
    const end = await within(first.then((v) => v, (e) => e), 5000, 'the end of the watch');
    assert.ok(!(end instanceof Error), `the watch rejected: ${end}`);
    assert.equal(end.done, true);
  });

  test('a watch dropped unfinished is cancelled once collected', async () => {
    // Its call stayed open until close(), holding the server's stream slot.
    assert.equal(typeof globalThis.gc, 'function', 'the tests run with node --expose-gc');
    const one = await startServer({ args: ['--max-streams-per-connection', '1'] });
    const client = new Client(one.target);
    try {
      const name = uniqueName('watch-dropped');
      await (async () => {
        const states = client.watch(name);
        assert.equal((await within(states.next(), 2000, 'a watched state')).value.locked, false);
      })();
      const deadline = performance.now() + 5000;
      let again;
      while (performance.now() < deadline) {
        globalThis.gc();
        await sleep(50);
        again = await client.watch(name).next().then((v) => v, (e) => e);
        if (!(again instanceof Error)) break;
      }
      assert.ok(!(again instanceof Error), `a second watch on the connection: ${again}`);
    } finally {
      client.close();
      await one.stop();
    }
  });

  test('a watch dropped unfinished leaves nothing on its signal once collected', async () => {
    // Its abort listener stayed on a long-lived signal for good, with its cancelled call
    // in the client, one more for each watch dropped.
    const controller = new AbortController();
    const client = new Client(srv.target);
    const listening = () => getEventListeners(controller.signal, 'abort').length;
    try {
      await (async () => {
        const states = client.watch(uniqueName('watch-dropped-signal'), { signal: controller.signal });
        assert.equal((await within(states.next(), 2000, 'a watched state')).value.locked, false);
      })();
      assert.equal(listening(), 1, 'the watch listens for its signal');
      const deadline = performance.now() + 5000;
      while (listening() > 0 && performance.now() < deadline) {
        globalThis.gc();
        await sleep(50);
      }
      assert.equal(listening(), 0, 'the collected watch still listens for its signal');
    } finally {
      client.close();
    }
  });

  test('a watch yields nothing more once its signal aborted, though states came before', async () => {
    // States already received and not yet read were still yielded after the abort.
    const controller = new AbortController();
    const states = await watchWithUnreadStates(a, b, uniqueName('watch-abort'), { signal: controller.signal });
    controller.abort();
    const after = await drain(states);
    assert.equal(after.length, 0, `${after.length} states yielded after the signal aborted`);
  });

  test('a watch yields nothing more once its client is closed, though states came before', async () => {
    const client = new Client(srv.target);
    const states = await watchWithUnreadStates(client, b, uniqueName('watch-closed'), {});
    client.close();
    const after = await drain(states);
    assert.equal(after.length, 0, `${after.length} states yielded after client.close()`);
  });

  test('forceRelease ends the holder with FORCE_RELEASED', async () => {
    const name = uniqueName('force');
    const lease = await a.acquire(name);
    assert.equal(await b.forceRelease(name), true);
    const reason = await aborted(lease.signal);
    assert.ok(reason instanceof LeaseLostError);
    assert.equal(reason.reason, 'FORCE_RELEASED');
    assert.equal(reason.code, status.ABORTED, 'the status that ended the stream');
    assert.equal(reason.info.lostReason, 'FORCE_RELEASED');
    assert.equal(lease.lostReason, 'FORCE_RELEASED');
    assert.equal(lease.held, false);
    assert.equal(await lease.release(), false, 'nothing left to release');
    assert.equal(await b.forceRelease(name), false, 'a free lock is not released');
    const next = await takeAtOnce(b, name);
    assert.ok(next.fencingToken > lease.fencingToken);
    await next.release();
  });
});

describe('other kinds', () => {
  test('fair: an AbortSignal mid-wait and a wait that runs out leave no waiter', async () => {
    const name = uniqueName('fair-abort');
    const holder = await a.acquire(name, { kind: 'fair' });
    const controller = new AbortController();
    let queued;
    const isQueued = new Promise((r) => {
      queued = r;
    });
    const pending = b.acquire(name, { kind: 'fair', signal: controller.signal, onQueued: () => queued() });
    await within(isQueued, 5000, 'queued');
    await until(async () => (await waiters(a, name)) === 1, 5000, 'one waiter');
    controller.abort();
    await assert.rejects(pending, (e) => e.name === 'AbortError' || e === controller.signal.reason);
    await until(async () => (await waiters(a, name)) === 0, 5000, 'no waiter after the abort');

    await assert.rejects(b.acquire(name, { kind: 'fair', wait: 300 }), LockTimeoutError);
    await until(async () => (await waiters(a, name)) === 0, 5000, 'no waiter after the timeout');
    assert.equal(await holder.release(), true);
  });

  test('semaphore: limit permits, then exclusion', async () => {
    const name = uniqueName('sem');
    const s1 = await a.acquire(name, { kind: 'semaphore', limit: 3 });
    const s2 = await b.acquire(name, { kind: 'semaphore', limit: 3, permits: 2, wait: 0 });
    assert.equal(s1.holdCount, 1);
    assert.equal(s2.holdCount, 2);
    await assert.rejects(a.acquire(name, { kind: 'semaphore', limit: 3, wait: 0 }), LockTimeoutError);

    const state = await a.describe(name);
    assert.equal(state.kind, 'semaphore');
    assert.equal(state.holders.length, 2);

    const mismatch = await a.acquire(name, { kind: 'semaphore', limit: 5, wait: 0 }).catch((e) => e);
    assert.ok(mismatch instanceof LockError);
    assert.equal(mismatch.code, status.FAILED_PRECONDITION);

    await s2.release();
    const s3 = await a.acquire(name, { kind: 'LOCK_KIND_SEMAPHORE', limit: 3, wait: 0 });
    await s3.release();
    await s1.release();
  });

  test('read/write: shared readers, exclusive writer', async () => {
    const name = uniqueName('rw');
    const r1 = await a.acquire(name, { kind: 'read' });
    const r2 = await b.acquire(name, { kind: 'read', wait: 0 });
    await assert.rejects(a.acquire(name, { kind: 'write', wait: 0 }), LockTimeoutError);

    const wrong = await b.acquire(name, { wait: 0 }).catch((e) => e);
    assert.ok(wrong instanceof LockError);
    assert.equal(wrong.code, status.FAILED_PRECONDITION, 'a mutex on a read-held name');

    const writer = b.acquire(name, { kind: 'write' });
    await r1.release();
    await r2.release();
    const w = await within(writer, 5000, 'writer acquire');
    assert.ok(w.fencingToken > r2.fencingToken);
    await assert.rejects(a.acquire(name, { kind: 'read', wait: 0 }), LockTimeoutError);
    await w.release();
    const r3 = await takeAtOnce(a, name, { kind: 'read' });
    await r3.release();
  });
});
