"""Fixtures that start a real redis-server and the real latchkey-server binary.

The server binary is $LATCHKEY_SERVER_BIN, else <repo>/target/debug/latchkey-server
(build it with `cargo build -p latchkey-server`). redis-server must be on PATH.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT = 20.0
STOP_TIMEOUT = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_binary() -> Path:
    env = os.environ.get("LATCHKEY_SERVER_BIN")
    if env:
        path = Path(env)
        where = "$LATCHKEY_SERVER_BIN"
    else:
        target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO_ROOT / "target")
        if not target.is_absolute():
            target = REPO_ROOT / target
        path = target / "debug" / "latchkey-server"
        where = "the default location"
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            f"latchkey-server binary not found at {path} ({where}). Build it first with "
            f"`cd {REPO_ROOT} && cargo build -p latchkey-server`, or set LATCHKEY_SERVER_BIN.",
            pytrace=False,
        )
    return path


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(sig)
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(STOP_TIMEOUT)
    except ProcessLookupError:
        pass


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class RedisServer:
    """One redis-server process in its own directory; ``extra_args`` go after the
    defaults (no persistence), so ``--appendonly yes`` keeps the data across
    ``restart()``."""

    def __init__(self, workdir: Path, extra_args: Sequence[str] = ()) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not on PATH (apt-get install redis-server)", pytrace=False)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(exist_ok=True)
        self.log = workdir / f"redis-{self.port}.log"
        self.args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                     "--dir", str(self.dir), *extra_args]
        self._start()

    def _start(self) -> None:
        self._logf = open(self.log, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited with {self.proc.returncode}:\n{_tail(self.log)}", pytrace=False)
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"redis-server did not answer PING in {START_TIMEOUT}s:\n{_tail(self.log)}", pytrace=False)
            time.sleep(0.05)

    def stop(self) -> None:
        _stop(self.proc)
        if not self._logf.closed:
            self._logf.close()

    def restart(self) -> None:
        """Starts it again on the same port and directory (what it persisted stays)."""
        self.stop()
        self._start()


class Pki:
    """A throwaway CA that issues server certificates for ``localhost`` and 127.0.0.1,
    as PEM files in its own directory (``openssl``), as ``tests/src/certs.rs`` makes
    them for the Rust tests."""

    CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = latchkey test
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""

    def __init__(self, workdir: Path, name: str) -> None:
        if shutil.which("openssl") is None:
            pytest.fail("openssl is not on PATH (apt-get install openssl)", pytrace=False)
        self.dir = workdir / f"pki-{name}-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()
        self.config = self.dir / "openssl.cnf"
        self.config.write_text(self.CONFIG)
        self.ca = self.dir / "ca.pem"
        self._ca_key = self.dir / "ca-key.pem"
        self._openssl("req", "-x509", *self._new_key(self._ca_key), "-extensions", "ca", "-days", "2",
                      "-subj", f"/CN={name} test CA", "-out", self.ca)

    def _new_key(self, key: Path) -> list:
        return ["-config", self.config, "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", key]

    def _openssl(self, *args) -> None:
        done = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            pytest.fail(f"openssl {args[0]} exited with {done.returncode}:\n{done.stderr}", pytrace=False)

    def server(self, stem: str = "server") -> tuple:
        """A server certificate and its key: ``(cert, key)`` paths."""
        cert, key, csr = (self.dir / f"{stem}{end}" for end in (".pem", "-key.pem", ".csr"))
        self._openssl("req", "-new", *self._new_key(key), "-subj", "/CN=latchkey server", "-out", csr)
        self._openssl("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", self._ca_key,
                      "-set_serial", str(uuid.uuid4().int >> 64), "-days", "2",
                      "-extfile", self.config, "-extensions", "server", "-out", cert)
        return cert, key

    def ca_pem(self) -> bytes:
        return self.ca.read_bytes()


@pytest.fixture
def pki(workdir):
    """Factory for a throwaway CA: ``pki("name")``."""
    return lambda name: Pki(workdir, name)


class LatchkeyServer:
    """One latchkey-server process; ``target`` is its gRPC address. With ``tls_ca``
    (the CA of its ``--tls-cert``), its readiness is checked over TLS."""

    def __init__(self, workdir: Path, redis_url: str, extra_args: List[str], tls_ca: Optional[bytes] = None) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.tls_ca = tls_ca
        self.log = workdir / f"latchkey-{self.port}.log"
        self._logf = open(self.log, "wb")
        args = [str(server_binary()), "--listen", self.target, "--no-metrics", "--redis-url", redis_url, *extra_args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LATCHKEY_")}
        self.proc = subprocess.Popen(args, stdout=self._logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        last = "no attempt"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"latchkey-server exited with {self.proc.returncode}:\n{_tail(self.log)}", pytrace=False)
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                if self.tls_ca is None:
                    ch = grpc.insecure_channel(self.target)
                else:
                    ch = grpc.secure_channel(self.target, grpc.ssl_channel_credentials(self.tls_ca))
                with ch:
                    resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                    last = f"health status {resp.status}"
            except (OSError, grpc.RpcError) as err:
                last = repr(err)
            time.sleep(0.05)
        pytest.fail(f"latchkey-server not SERVING after {START_TIMEOUT}s ({last}):\n{_tail(self.log)}", pytrace=False)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        _stop(self.proc, sig)
        if not self._logf.closed:
            self._logf.close()


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("latchkey")


@pytest.fixture(scope="session")
def redis(workdir) -> Iterator[RedisServer]:
    r = RedisServer(workdir)
    yield r
    r.stop()


@pytest.fixture(scope="session")
def server(workdir, redis) -> Iterator[LatchkeyServer]:
    """A shared server with default flags."""
    s = LatchkeyServer(workdir, redis.url, [])
    yield s
    s.stop()


@pytest.fixture
def start_redis(workdir):
    """Factory for a dedicated redis-server with extra flags: ``start_redis("--appendonly", "yes")``."""
    started: List[RedisServer] = []

    def start(*extra_args: str) -> RedisServer:
        r = RedisServer(workdir, extra_args)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


@pytest.fixture
def start_server(workdir, redis):
    """Factory for a dedicated server with extra flags: ``start_server("--watchdog-timeout", "900ms")``;
    ``redis_url=`` points it at another Redis than the session's; ``tls_ca=`` is the CA
    (PEM) of its ``--tls-cert``, to check it is ready."""
    started: List[LatchkeyServer] = []

    def start(*extra_args: str, redis_url: Optional[str] = None, tls_ca: Optional[bytes] = None) -> LatchkeyServer:
        s = LatchkeyServer(workdir, redis_url or redis.url, list(extra_args), tls_ca)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def tls_server(pki, start_server) -> LatchkeyServer:
    """A dedicated server with ``--tls-cert``/``--tls-key`` from a throwaway CA, whose
    certificate file is ``tls_server.ca``."""
    ca = pki("latchkey")
    cert, key = ca.server()
    s = start_server("--tls-cert", str(cert), "--tls-key", str(key), tls_ca=ca.ca_pem())
    s.ca = ca.ca
    return s


@pytest.fixture
def target(server) -> str:
    return server.target


@pytest.fixture
def client(server):
    import latchkey

    with latchkey.Client(server.target) as c:
        yield c


@pytest.fixture
def name(request) -> str:
    """A lock name unique to the test."""
    return f"pytest/{request.node.name}/{uuid.uuid4().hex[:8]}"


def wait_until(pred, timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def start_revocable(start_server, workdir: Path):
    """A server with an auth file of two identities: "admin" (token ``admin-token``) and
    "py" (``py-token``, names under ``py/``). Returns it and a function that revokes
    "py": the server reads the file every second and applies a change two reads agree
    on."""
    auth = workdir / "auth.toml"
    admin = '[[identity]]\nname = "admin"\ntokens = ["admin-token"]\nadmin = true\n'
    doomed = '[[identity]]\nname = "py"\ntokens = ["py-token"]\nprefixes = ["py/"]\n'
    auth.write_text(admin + doomed)
    return start_server("--auth-file", str(auth)), lambda: auth.write_text(admin)


def free_within(client, name: str, timeout: float = 5.0) -> bool:
    """Whether the lock ``name`` has neither holders nor waiters within ``timeout`` s
    (``client`` is a blocking client)."""

    def free() -> bool:
        state = client.describe(name)
        return not state.locked and not state.holders and not state.waiters

    return wait_until(free, timeout, 0.05)


#: Runs first in every ``python_child``: Ctrl-C handling as in an interactive program,
#: whatever the test run inherited. A shell without job control (``bash -c 'run-tests &
#: ...'``, a script, a CI step that backgrounds the suite) starts its background jobs with
#: SIGINT ignored; pytest keeps that, its children inherit it across exec, and Python
#: installs its KeyboardInterrupt handler only when SIGINT is at its default: the SIGINT
#: tests' signal was then dropped and their child slept on. A blocked SIGINT is inherited
#: as well; unblocked here, before any thread starts, the threads started later inherit that.
CHILD_PRELUDE = """\
import signal as _signal
_signal.signal(_signal.SIGINT, _signal.default_int_handler)
_signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_signal.SIGINT})
del _signal
"""


def python_child(code: str, **popen) -> subprocess.Popen:
    """Runs ``code`` (dedented) in another Python process that imports this checkout's
    ``latchkey``; its stdout and stderr are pipes of text. SIGINT raises
    ``KeyboardInterrupt`` in it even when this run ignores SIGINT (``CHILD_PRELUDE``).
    ``popen`` goes to ``subprocess.Popen`` (``start_new_session=True``, say)."""
    src = str(REPO_ROOT / "client" / "python" / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen(
        [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        text=True,
        **popen,
    )


def interrupt_while_queued(child: subprocess.Popen, client, name: str) -> None:
    """Interrupts (SIGINT) a child that printed ``queued`` waiting for ``name``: it prints
    ``interrupted`` and exits, and its place in the queue goes with it."""
    assert read_line(child) == "queued"
    assert wait_until(lambda: len(client.describe(name).waiters) == 1, 5)
    child.send_signal(signal.SIGINT)
    assert read_line(child) == "interrupted"
    child.wait(10)
    assert wait_until(lambda: len(client.describe(name).waiters) == 0, 5)


def read_line(proc: subprocess.Popen, timeout: float = 10.0) -> str:
    """The next line ``proc`` prints, stripped; kills it and fails when none comes
    within ``timeout`` s."""
    out: List[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not out:
        proc.kill()
        pytest.fail(f"the child printed nothing in {timeout}s; stderr: {proc.stderr.read()}")
    return out[0].strip()


def freeze(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGSTOPs a process and waits until each of its threads has stopped: the stop
    takes effect a little after kill() returns, and a thread still running meanwhile
    may answer a request sent at once."""
    os.kill(proc.pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            tasks = Path(f"/proc/{proc.pid}/task").iterdir()
            states = [(t / "stat").read_text().rpartition(")")[2].split()[0] for t in tasks]
        except FileNotFoundError:  # a thread ended meanwhile: look again
            return False
        return all(state in "tT" for state in states)

    if not wait_until(stopped, timeout, 0.002):
        pytest.fail(f"pid {proc.pid} did not stop in {timeout}s after SIGSTOP", pytrace=False)


class FreezableProxy:
    """A loopback TCP proxy that can stop forwarding without closing anything, as a
    network partition does: both peers keep their sockets and hear nothing. One end's
    close is never passed on to the other (until ``close``): a close, like any byte,
    does not cross a partition. ``hold_requests()`` keeps what the clients send (a
    release, a cancel) from the server, while the server's bytes still come through,
    until ``pass_requests()``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.frozen = threading.Event()
        self._held_lock = threading.Lock()
        #: What the clients sent while requests are held, per server socket; None when not held.
        self._held: Optional[List[tuple]] = None
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._conns: List[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            server.settimeout(None)
            client.settimeout(None)
            self._conns += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, requests: bool = False) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if self.frozen.is_set():
                continue  # read and drop: the peer hears nothing, nothing is closed
            with self._held_lock:
                if requests and self._held is not None:
                    self._held.append((dst, data))
                    continue
            try:
                dst.sendall(data)
            except OSError:
                return

    def hold_requests(self) -> None:
        with self._held_lock:
            if self._held is None:
                self._held = []

    def pass_requests(self) -> None:
        with self._held_lock:
            held, self._held = self._held or [], None
            for dst, data in held:
                try:
                    dst.sendall(data)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        for s in [self._sock, *self._conns]:
            try:
                s.close()
            except OSError:
                pass


@pytest.fixture
def dropping_address() -> Iterator[str]:
    """A loopback address that drops connection attempts, as a firewall or a dead host
    does: a listener that never accepts, its one-place backlog filled, so the kernel
    drops further SYNs and a connect waits out its retries."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fill = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fill.append(s)
    time.sleep(0.2)  # the handshakes that fit the backlog complete
    yield f"127.0.0.1:{port}"
    for s in [*fill, listener]:
        s.close()


@pytest.fixture
def freezable_proxy():
    """Factory for a ``FreezableProxy`` in front of a port; closed after the test."""
    proxies: List[FreezableProxy] = []

    def start(upstream_port: int) -> FreezableProxy:
        p = FreezableProxy(upstream_port)
        proxies.append(p)
        return p

    yield start
    for p in proxies:
        p.close()


@pytest.fixture
def fake_server() -> Iterator[tuple]:
    """A fake LockService whose List always gives the same ``next_page_token``, and
    whose Watch sends one state and then CANCELLED (as a proxy that resets the stream
    may; the real server ends a Watch UNAVAILABLE): yields ``(target, servicer)``;
    ``servicer.calls`` counts the List calls, and the sixth one fails, so a client that
    pages forever fails instead of hanging. Its Acquire grants at once, then, for the
    name "unasked", sends ``released`` though no release was asked for and keeps the
    stream open until the client cancels it; for "lost-then-released", waits for the
    client's release, answers ``lost`` (FORCE_RELEASED) and only then ``released``, and
    ends the stream OK."""
    from concurrent import futures

    from latchkey.v1 import latchkey_pb2 as pb
    from latchkey.v1 import latchkey_pb2_grpc as pb_grpc

    class RepeatingList(pb_grpc.LockServiceServicer):
        calls = 0

        def List(self, request, context):
            self.calls += 1
            if self.calls > 5:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the client follows a repeated page token")
            return pb.ListResponse(locks=[pb.LockState(name=f"lock-{self.calls}")], next_page_token="again")

        def Watch(self, request, context):
            yield pb.LockState(name=request.name)
            context.abort(grpc.StatusCode.CANCELLED, "reset")

        def Acquire(self, request_iterator, context):
            name = next(request_iterator).open.name
            yield pb.AcquireResponse(acquired=pb.Acquired(fencing_token=7, hold_count=1, owner="fake"))
            if name == "unasked":
                yield pb.AcquireResponse(released=pb.Released())
                while context.is_active():
                    time.sleep(0.05)
            elif name == "lost-then-released":
                next(request_iterator, None)  # the client's release
                yield pb.AcquireResponse(lost=pb.Lost(reason=pb.Lost.FORCE_RELEASED))
                yield pb.AcquireResponse(released=pb.Released())

    servicer = RepeatingList()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_LockServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)
