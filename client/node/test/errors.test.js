// Which error a failure is: a unary call with no answer in time is not a lock's wait
// that ran out, and a token that cannot be sent is refused up front.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { CONNECT_TIMEOUT_MS, Client, LockError, LockTimeoutError, status } from '../lib/index.js';
import { startServer } from './helpers/server.js';
import { droppingAddress, freezableProxy, uniqueName, within } from './helpers/util.js';

let srv;

before(async () => {
  srv = await startServer();
});

after(async () => {
  await srv?.stop();
});

const portOf = (target) => Number(target.split(':')[1]);

test("a unary call's deadline is a LockError DEADLINE_EXCEEDED, not a LockTimeoutError", async () => {
  // Only an acquire's wait running out is a lock timeout; a Describe, List or
  // ForceRelease the server did not answer in time (a partition here) is a call that
  // failed.
  const proxy = await freezableProxy(portOf(srv.target));
  const far = new Client(proxy.target, { callTimeoutMs: 300 });
  try {
    const name = uniqueName('unary-deadline');
    await far.describe(name); // connected
    proxy.freeze();
    const calls = {
      describe: () => far.describe(name),
      list: () => far.list(name),
      forceRelease: () => far.forceRelease(name, { timeoutMs: 300 }),
    };
    for (const [what, call] of Object.entries(calls)) {
      const err = await within(call(), 5000, what).then(
        (v) => assert.fail(`${what} resolved ${v}`),
        (e) => e,
      );
      assert.ok(err instanceof LockError, `${what}: got ${err}`);
      assert.ok(!(err instanceof LockTimeoutError), `${what}: LockTimeoutError is for the wait for a lock`);
      assert.equal(err.code, status.DEADLINE_EXCEEDED, `${what}: got ${err}`);
      assert.match(err.message, /DEADLINE_EXCEEDED/);
    }
  } finally {
    far.close();
    proxy.close();
  }
});

test('an http:// or https:// target is read as the other clients read it', async () => {
  const read = (target) => {
    const client = new Client(target);
    client.close();
    return client.target;
  };
  // Port 80 for http:// when none is given (grpc-js dialled 443), the bare host for
  // https:// (443 its default); the user, path and query left out (they failed name
  // resolution or parsing); the scheme in any case.
  assert.equal(read('http://127.0.0.1'), '127.0.0.1:80');
  assert.equal(read('https://latchkey.internal'), 'latchkey.internal');
  assert.equal(read('HTTP://127.0.0.1:5'), '127.0.0.1:5');
  assert.equal(read('http://[::1]'), '[::1]:80');
  assert.equal(read('http://u:secret@127.0.0.1:5/path?q#f'), '127.0.0.1:5');
  assert.equal(read('unix:///run/latchkey.sock'), 'unix:///run/latchkey.sock');
  // No host (it silently used the default server), a bad port, an unbracketed IPv6
  // address: refused, naming the target without its user part.
  for (const [bad, why] of [
    ['http://', /host is missing/],
    ['http://h:0', /port must be 1 to 65535/],
    ['http://h:5005l', /port must be 1 to 65535/],
    ['http://::1:5', /brackets/],
  ]) {
    assert.throws(() => new Client(bad), (e) => e instanceof TypeError && why.test(e.message), bad);
  }
  assert.throws(() => new Client('http://u:secret@h:0'), (e) => !e.message.includes('secret'));
  // And such a target reaches the server.
  const client = new Client(`http://u@${srv.target}/x`);
  try {
    await client.describe(uniqueName('url'));
  } finally {
    client.close();
  }
});

test('a token that is not printable ASCII is refused by the constructor', () => {
  for (const token of ['tökén', 'line\nbreak', 'tab\there', '\u007f']) {
    assert.throws(
      () => new Client(srv.target, { token }),
      (e) => {
        assert.ok(e instanceof TypeError, `got ${e}`);
        assert.match(e.message, /the token must be printable ASCII/);
        assert.ok(!e.message.includes(token), 'the message does not show the token');
        return true;
      },
      JSON.stringify(token),
    );
  }
  // Printable ASCII, spaces included, is sent as it is.
  new Client(srv.target, { token: 'a token ~!' }).close();
});

test('callTimeoutMs: Infinity is no deadline; a timeout that is not a number is refused', async () => {
  // new Date(Date.now() + Infinity) is an Invalid Date, which grpc-js took for a
  // deadline already past: every call failed DEADLINE_EXCEEDED at once.
  const client = new Client(srv.target, { callTimeoutMs: Infinity });
  try {
    assert.equal((await client.describe(uniqueName('no-deadline'))).locked, false);
    assert.equal((await client.describe(uniqueName('no-deadline'), { timeoutMs: Infinity })).locked, false);
    await assert.rejects(client.describe('x', { timeoutMs: Number.NaN }), TypeError);
  } finally {
    client.close();
  }
  assert.throws(() => new Client(srv.target, { callTimeoutMs: -1 }), TypeError);
});

test('every call on a closed client rejects with a LockError CANCELLED', async () => {
  // As in the Python clients. A watch() ran on, and the others had no code.
  const client = new Client(srv.target);
  client.close();
  const calls = {
    acquire: () => client.acquire(uniqueName('closed')),
    describe: () => client.describe('x'),
    list: () => client.list('x'),
    forceRelease: () => client.forceRelease('x'),
    watch: () => client.watch('x').next(),
  };
  for (const [what, call] of Object.entries(calls)) {
    const err = await within(call(), 5000, what).then(
      (v) => assert.fail(`${what} resolved ${JSON.stringify(v)}`),
      (e) => e,
    );
    assert.ok(err instanceof LockError, `${what}: got ${err}`);
    assert.equal(err.code, status.CANCELLED, `${what}: got ${err}`);
    assert.match(err.message, /closed/);
  }
});

test('calls to an address that drops connection attempts fail UNAVAILABLE after the connect timeout', async () => {
  // grpc-js bounds no connection attempt: a try-once acquire waited for the kernel's
  // SYN retries, over two minutes. Every call now gives up after CONNECT_TIMEOUT_MS, as
  // the Rust client does, and an abort ends the wait at once.
  const hole = await droppingAddress();
  const client = new Client(hole.target, { callTimeoutMs: 60000 });
  try {
    const abort = new AbortController();
    const aborting = client.acquire(uniqueName('dropped'), { signal: abort.signal });
    setTimeout(() => abort.abort(new Error('gave up')), 200);
    assert.equal((await within(aborting.catch((e) => e), 2000, 'an aborted acquire')).message, 'gave up');

    const started = performance.now();
    const calls = {
      'try-once acquire': () => client.acquire(uniqueName('dropped'), { wait: 0 }),
      'waiting acquire': () => client.acquire(uniqueName('dropped')),
      describe: () => client.describe('x'),
      watch: () => client.watch('x').next(),
    };
    const errors = await Promise.all(
      Object.entries(calls).map(([what, call]) =>
        within(call(), CONNECT_TIMEOUT_MS + 5000, what).then(
          (v) => assert.fail(`${what} resolved ${JSON.stringify(v)}`),
          (e) => [what, e],
        ),
      ),
    );
    for (const [what, err] of errors) {
      assert.ok(err instanceof LockError, `${what}: got ${err}`);
      assert.equal(err.code, status.UNAVAILABLE, `${what}: got ${err}`);
      assert.match(err.details, /no connection .* within 5000 ms/, what);
    }
    assert.ok(performance.now() - started >= CONNECT_TIMEOUT_MS - 100, 'they waited the connect timeout');
  } finally {
    client.close();
    hole.close();
  }
});
