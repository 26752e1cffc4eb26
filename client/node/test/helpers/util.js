import { randomUUID } from 'node:crypto';
import { spawn } from 'node:child_process';
import net from 'node:net';

/** A lock name no other test uses. */
export function uniqueName(prefix = 'node') {
  return `${prefix}-${randomUUID()}`;
}

/** Resolves with signal.reason once the signal aborts; rejects after `ms`. */
export function aborted(signal, ms = 5000) {
  if (signal.aborted) return Promise.resolve(signal.reason);
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`signal not aborted within ${ms} ms`)), ms);
    signal.addEventListener(
      'abort',
      () => {
        clearTimeout(timer);
        resolve(signal.reason);
      },
      { once: true },
    );
  });
}

/** Resolves once `lease.held` reads false (polled each turn); rejects after `ms`. */
export async function noLongerHeld(lease, ms = 5000) {
  const deadline = performance.now() + ms;
  while (lease.held) {
    if (performance.now() > deadline) throw new Error(`the lease still reads held after ${ms} ms`);
    await new Promise((r) => setImmediate(r));
  }
}

/** Resolves once `pred()` (may be async) is true, polled every 50 ms; rejects after `ms`. */
export async function until(pred, ms = 5000, what = 'condition') {
  const deadline = performance.now() + ms;
  for (;;) {
    if (await pred()) return;
    if (performance.now() > deadline) throw new Error(`${what} not met within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** Rejects if `promise` does not settle within `ms`. */
export function within(promise, ms, what = 'operation') {
  let timer;
  return Promise.race([
    promise,
    new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(`${what} did not finish within ${ms} ms`)), ms);
    }),
  ]).finally(() => clearTimeout(timer));
}

/**
 * A loopback TCP proxy to `upstreamPort` that can stop forwarding without closing
 * anything, as a network partition does: `freeze()` drops every byte from then on.
 * One end's close is never passed on to the other (until `close()`): a close, like any
 * byte, does not cross a partition. `holdRequests()` keeps what the clients send (a
 * release, a cancel) from the server, while the server's bytes still come through,
 * until `passRequests()`.
 */
export function freezableProxy(upstreamPort) {
  const state = { frozen: false, held: null, sockets: new Set(), accepted: 0, onAccept: null };
  const server = net.createServer((client) => {
    const upstream = net.connect({ port: upstreamPort, host: '127.0.0.1' });
    for (const s of [client, upstream]) {
      state.sockets.add(s);
      s.on('error', () => {});
    }
    state.accepted += 1;
    state.onAccept?.();
    client.on('data', (d) => {
      if (state.frozen) return;
      if (state.held) state.held.push(() => upstream.write(d));
      else upstream.write(d);
    });
    upstream.on('data', (d) => {
      if (!state.frozen) client.write(d);
    });
  });
  return new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      resolve({
        target: `127.0.0.1:${server.address().port}`,
        freeze() {
          state.frozen = true;
        },
        holdRequests() {
          state.held ??= [];
        },
        /** How many connections it accepted. */
        accepted() {
          return state.accepted;
        },
        /** Resolves at its next accepted connection. */
        nextAccept() {
          return new Promise((resolve) => {
            state.onAccept = () => {
              state.onAccept = null;
              resolve();
            };
          });
        },
        passRequests() {
          const held = state.held ?? [];
          state.held = null;
          for (const write of held) write();
        },
        close() {
          for (const s of state.sockets) s.destroy();
          server.close();
        },
      });
    });
  });
}

/**
 * A loopback address that drops connection attempts, as a firewall or a dead host
 * does: a listener that never accepts, its one-place backlog filled, so the kernel
 * drops further SYNs (Node accepts every connection itself, so the listener is a
 * python3 process's). `close()` ends it.
 */
export async function droppingAddress() {
  const script = [
    'import socket, sys, time',
    'srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(0)',
    'port = srv.getsockname()[1]; fill = []',
    'for _ in range(4):',
    '    s = socket.socket(); s.setblocking(False); s.connect_ex(("127.0.0.1", port)); fill.append(s)',
    'time.sleep(0.2); print(port, flush=True); sys.stdin.read()',
  ].join('\n');
  const child = spawn('python3', ['-c', script], { stdio: ['pipe', 'pipe', 'inherit'] });
  const port = await new Promise((resolve, reject) => {
    child.once('error', reject);
    child.once('exit', (code) => reject(new Error(`python3 exited (${code}) before listening`)));
    child.stdout.once('data', (d) => resolve(Number(String(d).trim())));
  });
  return {
    target: `127.0.0.1:${port}`,
    close() {
      child.kill();
    },
  };
}
