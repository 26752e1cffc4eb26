// The lease's lifecycle at its edges: callbacks, cancellation, servers killed and
// frozen, what close() leaves, fencing tokens, error details, typings. Every wait is
// bounded.
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { spawn } from 'node:child_process';
import { readFileSync } from 'node:fs';
import * as lib from '../lib/index.js';
import { Client, LeaseLostError, LockError, LockTimeoutError, status } from '../lib/index.js';
import { startServer, sleep } from './helpers/server.js';
import { aborted, freezableProxy, uniqueName, until, within } from './helpers/util.js';

const LIB = new URL('../lib/index.js', import.meta.url).href;

/** Runs an ESM script in a child node; resolves {code, stdout, stderr, ms}; kills it after `ms`. */
function runChild(script, ms = 15000) {
  return new Promise((resolve) => {
    const started = performance.now();
    const child = spawn(process.execPath, ['--input-type=module', '-e', script], { stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d) => (stdout += d));
    child.stderr.on('data', (d) => (stderr += d));
    const killer = setTimeout(() => child.kill('SIGKILL'), ms);
    child.on('exit', (code, signal) => {
      clearTimeout(killer);
      resolve({ code, signal, stdout, stderr, ms: performance.now() - started });
    });
  });
}

describe('shared server', () => {
  let srv;
  let a;
  let b;

  before(async () => {
    srv = await startServer();
    a = new Client(srv.target);
    b = new Client(srv.target);
  });

  after(async () => {
    a?.close();
    b?.close();
    await srv?.stop();
  });

  test('an async onQueued that rejects does not become an unhandled rejection', async () => {
    const name = uniqueName('async-onqueued');
    const holder = await a.acquire(name);
    const unhandled = [];
    const onUnhandled = (reason) => unhandled.push(reason);
    process.on('unhandledRejection', onUnhandled);
    try {
      let queued;
      const isQueued = new Promise((r) => (queued = r));
      const pending = b.acquire(name, {
        onQueued: async () => {
          queued();
          throw new Error('callback failed');
        },
      });
      await within(isQueued, 5000, 'queued');
      await sleep(100);
      await holder.release();
      const lease = await within(pending, 5000, 'the waiter');
      await lease.release();
      await sleep(50);
      // Its rejection is ignored as a throw is (it used to escape, and end the process
      // under Node's default --unhandled-rejections=throw).
      assert.deepEqual(unhandled.map(String), [], 'unhandled rejections from onQueued');
    } finally {
      process.off('unhandledRejection', onUnhandled);
    }
  });

  test('fencing tokens: BigInt, exact, equal to Describe, per name in the order of names', async () => {
    const z = uniqueName('zz-multi');
    const m = uniqueName('aa-multi');
    const single = await a.acquire(z);
    assert.equal(typeof single.fencingToken, 'bigint');
    assert.equal((await a.describe(z)).lastFencingToken, single.fencingToken);
    await single.release();
    // names deliberately not sorted: the server takes them sorted, tokens come back in our order
    const multi = await a.acquire([z, m]);
    assert.equal(multi.fencingTokens.length, 2);
    const [tz, tm] = multi.fencingTokens;
    assert.equal((await a.describe(z)).lastFencingToken, tz);
    assert.equal((await a.describe(m)).lastFencingToken, tm);
    assert.ok(tz > single.fencingToken, 'strictly increasing per name');
    assert.equal(multi.fencingToken, tz, 'fencingToken of a multi-lock is the first name\'s (as Rust)');
    await multi.release();
  });

  test('error details name the field: semaphore permits above limit, limit on a mutex', async () => {
    const name = uniqueName('sem-field');
    const e1 = await a.acquire(name, { kind: 'semaphore', permits: 3, limit: 2, wait: 0 }).catch((e) => e);
    assert.ok(e1 instanceof LockError && !(e1 instanceof LockTimeoutError), `got ${e1}`);
    assert.equal(e1.code, status.INVALID_ARGUMENT);
    assert.equal(e1.info.field, 'open.permits');
    const e2 = await a.acquire(name, { limit: 2, wait: 0 }).catch((e) => e);
    assert.equal(e2.code, status.INVALID_ARGUMENT);
    assert.equal(e2.info.field, 'open.limit');
  });

  test('semaphore: a withdrawn waiter takes no permit', async () => {
    const name = uniqueName('sem-abort');
    const holder = await a.acquire(name, { kind: 'semaphore', limit: 1 });
    const ac = new AbortController();
    let queued;
    const isQueued = new Promise((r) => (queued = r));
    const pending = b.acquire(name, { kind: 'semaphore', limit: 1, signal: ac.signal, onQueued: () => queued() });
    await within(isQueued, 5000, 'queued');
    ac.abort(new Error('gave up'));
    await assert.rejects(within(pending, 5000, 'aborted'), /gave up/);
    await holder.release();
    await until(async () => !(await a.describe(name)).locked, 3000, 'the semaphore free');
    const again = await a.acquire(name, { kind: 'semaphore', limit: 1, wait: 0 });
    await again.release();
  });

  test('a shared AbortSignal over many sequential acquires leaves no listener behind', async () => {
    const warnings = [];
    const onWarning = (w) => warnings.push(w);
    process.on('warning', onWarning);
    try {
      const ac = new AbortController();
      for (let i = 0; i < 15; i++) {
        const lease = await a.acquire(uniqueName('shared-signal'), { signal: ac.signal });
        await lease.release();
      }
      const name = uniqueName('shared-signal-fail');
      const holder = await a.acquire(name);
      for (let i = 0; i < 15; i++) {
        await assert.rejects(b.acquire(name, { signal: ac.signal, wait: 0 }), LockTimeoutError);
      }
      await holder.release();
      await sleep(50);
      assert.deepEqual(warnings.map(String).filter((w) => /listener/i.test(w)), []);
    } finally {
      process.off('warning', onWarning);
    }
  });

  test('events after release: a released lease is never told lost, dispose is quiet', async () => {
    const name = uniqueName('after-release');
    const lease = await a.acquire(name);
    assert.equal(await lease.release(), true);
    await a.forceRelease(name);
    await sleep(200);
    assert.equal(lease.signal.aborted, false);
    assert.equal(lease.held, false);
    assert.equal(lease.lostReason, null);
    assert.equal(await lease[Symbol.asyncDispose](), undefined);
  });

  test('dispose of a lease lost to ForceRelease resolves, signal says FORCE_RELEASED', async () => {
    const name = uniqueName('dispose-lost');
    const lease = await a.acquire(name);
    await b.forceRelease(name);
    const reason = await aborted(lease.signal, 5000);
    assert.equal(reason.reason, 'FORCE_RELEASED');
    assert.equal(await lease[Symbol.asyncDispose](), undefined);
  });

  test('close() while a call waits for the connection opens no connection after it', async () => {
    const proxy = await freezableProxy(Number(srv.target.split(':')[1]));
    try {
      const client = new Client(proxy.target);
      const accepted = proxy.nextAccept();
      const describing = client.describe(uniqueName('close-connecting'));
      // The channel is connecting: its first connection is made, not yet ready.
      await within(accepted, 5000, 'the first connection');
      client.close();
      const outcome = await within(describing.then((v) => v, (e) => e), 5000, 'describe');
      assert.ok(outcome instanceof LockError, `describe resolved ${JSON.stringify(outcome)}`);
      assert.equal(outcome.code, status.CANCELLED);
      // A connection made after close() belongs to a channel brought back to life,
      // which stays connected (and pings) for good.
      await sleep(500);
      assert.equal(proxy.accepted(), 1, 'a connection was opened after close()');
    } finally {
      proxy.close();
    }
  });

  test('close() ends a describe under way: it rejects CANCELLED at once', async () => {
    const proxy = await freezableProxy(Number(srv.target.split(':')[1]));
    try {
      const client = new Client(proxy.target);
      await client.describe(uniqueName('close-describe'));
      proxy.holdRequests();
      const describing = client.describe(uniqueName('close-describe'), { timeoutMs: 60000 });
      await sleep(100);
      client.close();
      const outcome = await within(describing.then((v) => v, (e) => e), 2000, 'describe after close()');
      assert.ok(outcome instanceof LockError, `describe resolved ${JSON.stringify(outcome)}`);
      assert.equal(outcome.code, status.CANCELLED);
      assert.match(outcome.message, /the client is closed/);
    } finally {
      proxy.close();
    }
  });

  test('close() during a release in flight: the release rejects CANCELLED and the lock is freed', async () => {
    const client = new Client(srv.target);
    const name = uniqueName('close-mid-release');
    const lease = await client.acquire(name);
    const releasing = lease.release();
    client.close();
    const outcome = await within(releasing.then((v) => v, (e) => e), 5000, 'release');
    // README: a release() under way when the client closes rejects CANCELLED (its
    // outcome unknown to the client), as in the Python clients.
    assert.ok(outcome instanceof LockError, `release resolved ${outcome}`);
    assert.equal(outcome.code, status.CANCELLED);
    await until(async () => !(await a.describe(name)).locked, 3000, 'the lock freed');
  });

  test('a closed client exits promptly: release + close, pending acquire + close, fixed lease + close', async () => {
    const name = uniqueName('exit-prompt');
    const holder = await a.acquire(name);
    const script =
      `import { Client } from ${JSON.stringify(LIB)};\n` +
      `const c = new Client(${JSON.stringify(srv.target)});\n` +
      `const l1 = await c.acquire(${JSON.stringify(uniqueName('x'))});\n` +
      `await l1.release();\n` +
      `const l2 = await c.acquire(${JSON.stringify(uniqueName('y'))}, { lease: 600000 });\n` +
      `const p = c.acquire(${JSON.stringify(name)}); p.catch(() => {});\n` +
      `await new Promise((r) => setTimeout(r, 200));\n` +
      `c.close();\n` +
      `globalThis.t0 = Date.now();\n` +
      `process.on('exit', () => console.log('exit after', Date.now() - globalThis.t0));\n`;
    const run = await runChild(script, 15000);
    await holder.release();
    assert.equal(run.signal, null, `killed: ${run.stdout} ${run.stderr}`);
    assert.equal(run.code, 0, run.stderr);
    const after = Number(/exit after (\d+)/.exec(run.stdout)?.[1]);
    assert.ok(after < 1500, `process lived ${after} ms after close()`);
  });

  test('index.d.ts declares every runtime export and nothing more', () => {
    const dts = readFileSync(new URL('../index.d.ts', import.meta.url), 'utf8');
    const declared = new Set(
      [...dts.matchAll(/^export\s+(?:declare\s+)?(?:const|function|class|interface|type)\s+(\w+)/gm)].map((m) => m[1]),
    );
    const typeOnly = new Set(['LockKind', 'LostReason', 'ClientOptions', 'AcquireOptions', 'CallOptions', 'Holder', 'LockState']);
    const runtime = Object.keys(lib).filter((k) => k !== 'default');
    const missing = runtime.filter((k) => !declared.has(k));
    const extra = [...declared].filter((k) => !typeOnly.has(k) && !runtime.includes(k));
    assert.deepEqual({ missing, extra }, { missing: [], extra: [] });
  });
});

describe('server killed or frozen', () => {
  test('SIGKILL mid-wait rejects the waiting acquire UNAVAILABLE promptly, not a timeout', async () => {
    const srv = await startServer();
    const a = new Client(srv.target);
    const b = new Client(srv.target);
    try {
      const name = uniqueName('kill-wait');
      await a.acquire(name);
      let queued;
      const isQueued = new Promise((r) => (queued = r));
      const pending = b.acquire(name, { wait: 60000, onQueued: () => queued() });
      pending.catch(() => {});
      await within(isQueued, 5000, 'queued');
      srv.server.signal('SIGKILL');
      const err = await within(pending.then(() => null, (e) => e), 5000, 'the waiting acquire');
      assert.ok(err instanceof LockError && !(err instanceof LockTimeoutError), `got ${err}`);
      assert.equal(err.code, status.UNAVAILABLE);
    } finally {
      a.close();
      b.close();
      await srv.stop();
    }
  });

  test('a frozen server (SIGSTOP): keepalive tells the holder and fails the waiter within ~8 s', async () => {
    const srv = await startServer();
    const a = new Client(srv.target);
    const b = new Client(srv.target);
    try {
      const name = uniqueName('frozen');
      const lease = await a.acquire(name);
      let queued;
      const isQueued = new Promise((r) => (queued = r));
      const pending = b.acquire(name, { onQueued: () => queued() });
      pending.catch(() => {});
      await within(isQueued, 5000, 'queued');
      srv.server.signal('SIGSTOP');
      const t0 = performance.now();
      const reason = await aborted(lease.signal, 15000);
      assert.ok(reason instanceof LeaseLostError, `got ${reason}`);
      assert.equal(reason.reason, 'DISCONNECTED');
      const err = await within(pending.then(() => null, (e) => e), 15000, 'the waiting acquire');
      assert.ok(err instanceof LockError, `got ${err}`);
      assert.equal(err.code, status.UNAVAILABLE);
      assert.ok(performance.now() - t0 < 12000);
      assert.equal(await lease.release(), false);
    } finally {
      srv.server.signal('SIGCONT');
      a.close();
      b.close();
      await srv.stop();
    }
  });
});
