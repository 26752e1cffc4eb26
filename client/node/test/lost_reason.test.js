// A lost reason and a lock kind this client's proto does not know (a newer server's), a
// `lost` after a confirmed release, a `released` nobody asked for, a `lost` before the
// `released` that answers a release, and a Watch the other side cancels, against an
// in-process server that speaks those streams and nothing else: the real server sends
// only the reasons and kinds this client knows, nothing after `released`, and ends a
// Watch UNAVAILABLE, never CANCELLED.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import * as grpc from '@grpc/grpc-js';
import { Client } from '../lib/index.js';
import { lockServiceConstructor } from '../lib/proto.js';
import { until, within } from './helpers/util.js';

/** A reason no version of the proto names yet. */
const NEWER_REASON = 9;
/** A lock kind no version of the proto names yet. */
const NEWER_KIND = 9;

let server;
let target;

before(async () => {
  server = new grpc.Server();
  server.addService(lockServiceConstructor().service, {
    // Grants at once, then says the lease was lost for a reason this client does not
    // know, and ends the stream ABORTED, as the server ends a lost lease's stream.
    acquire(call) {
      call.once('data', (first) => {
        if (first.open?.name === 'ended-unanswered') {
          // Ends the stream OK before any grant.
          call.end();
          return;
        }
        call.write({ acquired: { fencingToken: '1', holdCount: 1, owner: 'o', lease: { seconds: 30 } } });
        if (first.open?.name === 'unasked') {
          // Confirms a release nobody asked for, and keeps the stream open until the
          // client cancels it.
          call.write({ released: {} });
          return;
        }
        if (first.open?.name === 'lost-then-released') {
          // Answers the release with `lost` (FORCE_RELEASED) first, then `released`.
          call.once('data', () => {
            call.write({ lost: { reason: 3 } });
            call.write({ released: {} });
            call.end();
          });
          return;
        }
        if (first.open?.name === 'release-unanswered') {
          // Ends the stream OK on the release, without confirming it.
          call.once('data', () => call.end());
          return;
        }
        if (first.open?.name === 'released-then-lost') {
          // Confirms the release, then says the lease was lost (a server or proxy out
          // of step), and ends the stream.
          call.once('data', () => {
            call.write({ released: {} });
            call.write({ lost: { reason: 1 } });
            call.end();
          });
          return;
        }
        call.write({ lost: { reason: NEWER_REASON } });
        call.emit('error', { code: grpc.status.ABORTED, details: 'lost' });
      });
      call.on('error', () => {});
    },
    // A lock held as a kind no version of the proto names yet.
    describe(call, callback) {
      callback(null, { name: call.request.name, locked: true, kind: NEWER_KIND });
    },
    // One state, then CANCELLED, as a proxy that resets the stream may send.
    watch(call) {
      call.write({ name: call.request.name, locked: false });
      setTimeout(() => call.emit('error', { code: grpc.status.CANCELLED, details: 'reset' }), 20);
    },
  });
  const port = await new Promise((resolve, reject) => {
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (err, bound) =>
      err ? reject(err) : resolve(bound),
    );
  });
  target = `127.0.0.1:${port}`;
});

after(() => server?.forceShutdown());

test('a lost reason this client does not know is named by its number, as a string', async () => {
  const client = new Client(target);
  try {
    const lease = await within(client.acquire('newer'), 5000, 'acquire');
    await until(() => !lease.held, 5000, 'the lease lost');
    assert.equal(lease.lostReason, `REASON_${NEWER_REASON}`);
    await until(() => lease.signal.aborted, 5000, 'the signal aborted');
    assert.equal(lease.signal.reason.lostReason, `REASON_${NEWER_REASON}`);
  } finally {
    client.close();
  }
});

test('a lock kind this client does not know is named by its number, not read as free', async () => {
  const client = new Client(target);
  try {
    const state = await within(client.describe('newer-kind'), 5000, 'describe');
    assert.equal(state.locked, true);
    assert.equal(state.kind, `KIND_${NEWER_KIND}`);
  } finally {
    client.close();
  }
});

test('a Watch the other side cancels rejects with CANCELLED rather than end as if done', async () => {
  const client = new Client(target);
  try {
    const states = [];
    const watching = (async () => {
      for await (const state of client.watch('reset')) states.push(state);
    })();
    const err = await within(watching.then(() => null, (e) => e), 5000, 'the watch ends');
    assert.equal(states.length, 1);
    assert.ok(err, 'ended as if the caller were done');
    assert.equal(err.code, grpc.status.CANCELLED);
  } finally {
    client.close();
  }
});

test('a lost after a confirmed release neither fails the release nor aborts the signal', async () => {
  const client = new Client(target);
  try {
    const lease = await within(client.acquire('released-then-lost'), 5000, 'acquire');
    assert.equal(await within(lease.release(), 5000, 'release'), true);
    // Past the wait for a lost lease's status, when a lost heard would abort it.
    await new Promise((resolve) => setTimeout(resolve, 1500));
    assert.equal(lease.signal.aborted, false, 'a deliberate release does not abort the signal');
    assert.equal(lease.lostReason, null);
  } finally {
    client.close();
  }
});

test('a released nobody asked for reads as lost, DISCONNECTED, and release() resolves false', async () => {
  const client = new Client(target);
  try {
    const lease = await within(client.acquire('unasked'), 5000, 'acquire');
    await until(() => !lease.held, 2000, 'the lease no longer held');
    assert.equal(lease.lostReason, 'DISCONNECTED');
    await until(() => lease.signal.aborted, 2000, 'the signal aborted');
    assert.equal(lease.signal.reason.lostReason, 'DISCONNECTED');
    assert.equal(await within(lease.release(), 2000, 'release'), false);
  } finally {
    client.close();
  }
});

test('a lost before the released that answers a release stays: release() resolves false', async () => {
  const client = new Client(target);
  try {
    const lease = await within(client.acquire('lost-then-released'), 5000, 'acquire');
    assert.equal(await within(lease.release(), 5000, 'release'), false);
    assert.equal(lease.held, false);
    assert.equal(lease.lostReason, 'FORCE_RELEASED');
    assert.equal(lease.signal.aborted, true);
  } finally {
    client.close();
  }
});

test('a stream that ends without an answer is UNKNOWN, as in the Python client', async () => {
  const client = new Client(target);
  try {
    const refused = await client.acquire('ended-unanswered').catch((e) => e);
    assert.equal(refused.code, grpc.status.UNKNOWN, String(refused));
    const lease = await within(client.acquire('release-unanswered'), 5000, 'acquire');
    const unconfirmed = await lease.release().catch((e) => e);
    assert.equal(unconfirmed.code, grpc.status.UNKNOWN, String(unconfirmed));
  } finally {
    client.close();
  }
});
