// Test harness: a real redis-server and a real latchkey-server on free ports.
//
//   const srv = await startServer({ args: ['--watchdog-timeout', '900ms'] });
//   const client = new Client(srv.target);
//   ...
//   await srv.stop();
//
// `redisArgs` are extra redis-server flags (e.g. `['--appendonly', 'yes', '--appendfsync',
// 'always']`, so that `srv.restartRedis()` finds the locks again after `srv.redis.stop()`).
//
// Every wait is bounded; both processes are killed on stop() and, as a last resort,
// when the test process exits.
import { spawn, spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { Client } from '../../lib/index.js';

const HERE = dirname(fileURLToPath(import.meta.url));
export const REPO = resolve(HERE, '..', '..', '..', '..');

const live = new Set();
process.on('exit', () => {
  for (const child of live) {
    try {
      child.kill('SIGKILL');
    } catch {
      // already gone
    }
  }
});

export function serverBinary() {
  const bin = process.env.LATCHKEY_SERVER_BIN || join(REPO, 'target', 'debug', 'latchkey-server');
  if (!existsSync(bin)) {
    throw new Error(
      `latchkey-server binary not found at ${bin}: build it with ` +
        '`cargo build -p latchkey-server` in the repository root, or set LATCHKEY_SERVER_BIN',
    );
  }
  return bin;
}

function redisBinary() {
  const found = spawnSync('sh', ['-c', 'command -v redis-server'], { encoding: 'utf8' });
  const bin = found.stdout.trim();
  if (found.status !== 0 || !bin) {
    throw new Error('redis-server is not on PATH (apt-get install redis-server)');
  }
  return bin;
}

/** A TCP port that was free a moment ago. */
export function freePort() {
  return new Promise((res, rej) => {
    const srv = net.createServer();
    srv.unref();
    srv.on('error', rej);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address();
      srv.close(() => res(port));
    });
  });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function tryConnect(port) {
  return new Promise((res) => {
    const sock = net.connect({ port, host: '127.0.0.1' });
    const done = (ok) => {
      sock.destroy();
      res(ok);
    };
    sock.setTimeout(500, () => done(false));
    sock.once('connect', () => done(true));
    sock.once('error', () => done(false));
  });
}

/** Child env without LATCHKEY_* variables, so the caller's environment cannot leak in. */
function cleanEnv() {
  const env = {};
  for (const [k, v] of Object.entries(process.env)) if (!k.startsWith('LATCHKEY_')) env[k] = v;
  // Quiet, except the line that says the server listens (see startOnFreePort).
  env.RUST_LOG = `${env.RUST_LOG ?? 'warn'},latchkey_server=info`;
  return env;
}

class Proc {
  constructor(name, bin, args) {
    this.name = name;
    this.output = '';
    this.exit = null;
    this.child = spawn(bin, args, { stdio: ['ignore', 'pipe', 'pipe'], env: cleanEnv() });
    live.add(this.child);
    const keep = (chunk) => {
      this.output = (this.output + chunk.toString()).slice(-20000);
    };
    this.child.stdout.on('data', keep);
    this.child.stderr.on('data', keep);
    this.exited = new Promise((res) => {
      this.child.once('exit', (code, signal) => {
        this.exit = { code, signal };
        live.delete(this.child);
        res(this.exit);
      });
      this.child.once('error', (err) => {
        this.exit = { error: err };
        live.delete(this.child);
        res(this.exit);
      });
    });
  }

  /**
   * Wait (bounded) until this process printed `line` and `port` accepts TCP
   * connections: a port free a moment ago may have gone to another test file's
   * server, which would accept in this one's place.
   */
  async waitForPort(port, line, timeoutMs) {
    const deadline = Date.now() + timeoutMs;
    while (Date.now() < deadline) {
      if (this.exit) throw new Error(`${this.name} exited early (${JSON.stringify(this.exit)}):\n${this.output}`);
      if (this.output.includes(line) && (await tryConnect(port))) return;
      await sleep(50);
    }
    throw new Error(`${this.name} did not listen on ${port} within ${timeoutMs} ms:\n${this.output}`);
  }

  signal(sig) {
    if (!this.exit) this.child.kill(sig);
  }

  /** SIGTERM, then SIGKILL after `graceMs`; resolves once the process is gone. */
  async stop(graceMs = 5000) {
    if (this.exit) return this.exit;
    this.child.kill('SIGTERM');
    const kill = setTimeout(() => this.child.kill('SIGKILL'), graceMs);
    let giveUp;
    const res = await Promise.race([
      this.exited,
      new Promise((r) => {
        giveUp = setTimeout(() => r(null), graceMs + 5000);
      }),
    ]);
    clearTimeout(kill);
    clearTimeout(giveUp);
    if (!res) throw new Error(`${this.name} (pid ${this.child.pid}) did not exit after SIGKILL`);
    return res;
  }
}

/**
 * Start redis-server and latchkey-server. `args` are extra server flags, `redisArgs`
 * extra redis-server flags (its files go to a temporary directory).
 * `unixSocket: true` also serves on a Unix socket (`srv.unixTarget`). `clientOptions`
 * (e.g. `{ token }`) are the readiness check's, for a server with --auth-file.
 */
export async function startServer({
  args = [],
  redisArgs = [],
  unixSocket = false,
  timeoutMs = 20000,
  clientOptions = {},
} = {}) {
  const serverBin = serverBinary();
  const redisBin = redisBinary();
  let redis = null;
  let server = null;
  // Redis's files (an append-only file, when asked for) must not land in the cwd.
  const tmp = mkdtempSync(join(tmpdir(), 'latchkey-node-'));
  try {
    const redisArgsFor = (port) => [
      '--port', String(port),
      '--bind', '127.0.0.1',
      '--save', '',
      '--appendonly', 'no',
      '--dir', tmp,
      ...redisArgs,
    ];
    let redisPort;
    [redis, redisPort] = await startOnFreePort('redis-server', redisBin, redisArgsFor, REDIS_READY, timeoutMs);
    let unixTarget = null;
    const extra = [];
    if (unixSocket) {
      const sock = join(tmp, 'latchkey.sock');
      extra.push('--unix-socket', sock);
      unixTarget = `unix://${sock}`;
    }
    const serverArgs = (port) => [
      '--listen', `127.0.0.1:${port}`,
      '--no-metrics',
      '--redis-url', `redis://127.0.0.1:${redisPort}`,
      ...extra,
      ...args,
    ];
    let port;
    [server, port] = await startOnFreePort('latchkey-server', serverBin, serverArgs, SERVER_READY, timeoutMs);
    const target = `127.0.0.1:${port}`;
    await waitForService(target, server, timeoutMs, clientOptions);
    return {
      target,
      unixTarget,
      redisPort,
      server,
      redis,
      /** Start redis-server again on its port, with the same flags and directory. */
      async restartRedis() {
        await this.redis.stop();
        const again = new Proc('redis-server', redisBin, redisArgsFor(redisPort));
        redis = again;
        this.redis = again;
        await again.waitForPort(redisPort, REDIS_READY, timeoutMs);
      },
      async stop() {
        try {
          await server.stop();
        } finally {
          await redis.stop();
          rmSync(tmp, { recursive: true, force: true });
        }
      },
    };
  } catch (err) {
    await server?.stop(1000).catch(() => {});
    await redis?.stop(1000).catch(() => {});
    rmSync(tmp, { recursive: true, force: true });
    throw err;
  }
}

/** What redis-server and latchkey-server print once they listen. */
const REDIS_READY = 'Ready to accept connections';
const SERVER_READY = 'latchkey serving';
/** Attempts at free ports: another process may take one before the server binds it. */
const PORT_ATTEMPTS = 3;

/**
 * Spawn `bin` with `argsFor(port)` on a free port and wait until it listens; on
 * another port when this one was taken meanwhile. Resolves to `[proc, port]`.
 */
async function startOnFreePort(name, bin, argsFor, line, timeoutMs) {
  for (let attempt = 1; ; attempt++) {
    const port = await freePort();
    const proc = new Proc(name, bin, argsFor(port));
    try {
      await proc.waitForPort(port, line, timeoutMs);
      return [proc, port];
    } catch (err) {
      await proc.stop(1000).catch(() => {});
      if (attempt >= PORT_ATTEMPTS || !/address already in use/i.test(proc.output)) throw err;
    }
  }
}

/** Wait until a Describe call answers (the server reached Redis). */
async function waitForService(target, server, timeoutMs, clientOptions) {
  const client = new Client(target, { ...clientOptions, callTimeoutMs: 1000 });
  const deadline = Date.now() + timeoutMs;
  let last = null;
  try {
    while (Date.now() < deadline) {
      if (server.exit) throw new Error(`latchkey-server exited early (${JSON.stringify(server.exit)}):\n${server.output}`);
      try {
        await client.describe('latchkey-node-ready');
        return;
      } catch (err) {
        last = err;
        await sleep(100);
      }
    }
    throw new Error(`latchkey-server at ${target} did not answer Describe within ${timeoutMs} ms (${last}):\n${server.output}`);
  } finally {
    client.close();
  }
}

export { sleep };
