"""Pieces shared by the blocking and the asyncio clients."""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import functools
import logging
import math
import operator
import os
import re
import ssl
import threading
import weakref
from typing import Dict, Optional, Sequence, Tuple, Union

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, duration_pb2, message_factory

from latchkey.v1 import latchkey_pb2 as pb

Seconds = Union[int, float, datetime.timedelta]
Kind = Union[str, int, None]

#: How long leaving a ``with`` block waits for ``released`` and the end of the stream
#: before it cancels the stream (a cancel releases the lock on the server too).
RELEASE_TIMEOUT = 5.0

#: ``lost_reason`` when the stream broke without a ``lost`` event (connection lost,
#: channel closed, unexpected status).
DISCONNECTED = "DISCONNECTED"

#: ``lost_reason`` when the server ended the stream for the caller's rights: a reload of
#: its auth file revoked the token or narrowed the identity (code ``UNAUTHENTICATED`` or
#: ``PERMISSION_DENIED``); the server released the lock.
REVOKED = "REVOKED"


def ended_reason(ended: "LockError") -> str:
    """The ``lost_reason`` of a held stream that ended with the status ``ended`` and no
    ``lost`` event read. A status that follows a ``lost`` event repeats its reason
    (``info["lostReason"]``; ``SHUTTING_DOWN`` for ``SHUTDOWN``), and gRPC Python can
    drop the event: it raises a status that came before a read was asked for, with a
    message still unread (a lease lost at its grant, before the reader's first read)."""
    told = ended.info.get("lostReason")
    if told:
        return told
    if ended.reason == "SHUTTING_DOWN":
        return SHUTDOWN
    if ended.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return REVOKED
    return DISCONNECTED


def ends_a_release(reason: str) -> bool:
    """Whether a stream that ended for ``reason`` (``ended_reason``) while its release was
    under way, before ``released``, ended the release (its outcome unknown: the server
    gives the lock back once it can) rather than the lease: a revoke, or a loss the
    status tells, overtook the release, and the lease was lost."""
    return reason in (DISCONNECTED, SHUTDOWN)


#: ``lost_reason`` when the server is stopping and ended the stream (it releases the
#: lock), told by its ``lost`` event or by the status that ends the stream.
SHUTDOWN = "SHUTDOWN"


#: ``lost_reason`` when a fixed lease ran out: told by the server, or by the client's own
#: clock at the lease's end (see ``fixed_lease_end``).
LEASE_EXPIRED = "LEASE_EXPIRED"


#: HTTP/2 keepalive, on by default as in the Rust client: a ping every 3 s, even
#: while no call is open and no data flows (an idle lease sends nothing), and a
#: connection whose ping goes 4 s unanswered counts as dead. Without it a lease behind
#: a silent network partition (no FIN, no RST) is never reported lost, though the
#: server, which pings too, has long released the lock, and a waiting acquire can hang
#: for good. A silent connection is so found dead within 7 s; the server's own
#: keepalive (a ping every 10 s, 10 s to answer, by default) finds it no sooner than
#: 10 s after it went silent, and only then releases its locks: a holder behind a
#: partition is told it lost the lock before the next one can be granted it. The
#: server (tonic/h2) sets no limit on the pings it receives, so a ping every 3 s never
#: earns a GOAWAY ``too_many_pings``. A caller's own value of any of these keys wins.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 3_000),
    ("grpc.keepalive_timeout_ms", 4_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # gRPC core otherwise stops pinging after 2 pings with no data in between.
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC core backs reconnection off up to 120 s: after a long outage every call
    # would fail at once, UNAVAILABLE, for up to two minutes after the server came
    # back. The channel tries again at least every 5 s.
    ("grpc.max_reconnect_backoff_ms", 5_000),
)

#: The option that bounds the wait for a ping's ack in recent gRPC core (1.85 waits
#: 60 s for a keepalive ping's ack whatever ``grpc.keepalive_timeout_ms`` says). Unless
#: the caller sets it, it gets the keepalive timeout in force.
PING_TIMEOUT = "grpc.http2.ping_timeout_ms"


def grpc_target(target: str, credentials):
    """The gRPC target and credentials for ``target``, which may also be written as a URL,
    as the CLI and the other clients take it (``LATCHKEY_SERVER``): ``http://host:port``
    is ``host:port``, and ``https://host:port`` is ``host:port`` over TLS (the system's
    roots, ``system_roots()``, unless ``credentials`` say otherwise).

    A URL is read as the Rust client and the CLI read it (``check_target`` and
    ``Connector::for_target`` in ``client/src``), its scheme in any case: without a port
    it is port 80 for ``http://`` (gRPC's own default would be 443, so
    ``http://latchkey-svc``, which the CLI reaches, failed ``UNAVAILABLE`` here) and
    gRPC's 443 for ``https://``; a
    user (``http://user@host:port``) and a path, query or fragment are left out, as the
    Rust client's connection leaves them; a URL with no host, or a port that is not 1 to
    65535 (``:0``, ``:5005l``, ``:``), raises ``ValueError`` naming ``target`` rather
    than reach another port or fail later as a server away. Any other target is gRPC's
    own (``host:port``, ``unix:///path``, ``dns:///host:port``) and is left to it."""
    for scheme, default_port in (("http://", 80), ("https://", 443)):
        if target[: len(scheme)].lower() == scheme:
            break
    else:
        return target.rstrip("/") or "127.0.0.1:50051", credentials
    authority = re.split(r"[/?#]", target[len(scheme):], maxsplit=1)[0]
    user, at, host_port = authority.rpartition("@")
    host, port = _split_port(host_port)

    def refused(reason: str) -> ValueError:
        # The user part may hold a password: it is not repeated.
        shown = scheme + "…@" + target[len(scheme) + len(user) + 1:] if at else target
        return ValueError(f"target {shown!r}: {reason}")

    if not host:
        raise refused("the host is missing")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3 or "[" in host[1:-1] or "]" in host[1:-1]:
            raise refused("an IPv6 address goes in brackets, as [::1]")
    elif any(c in host for c in ":[]"):
        raise refused("an IPv6 address goes in brackets, as [::1]")
    if port is None and scheme == "https://":
        # gRPC dials 443 itself, and the authority it sends stays the bare host, which a
        # proxy's virtual host for that name matches (``host:443`` it might not).
        port = None
    elif port is None:
        port = default_port
    elif re.fullmatch(r"[0-9]+", port) and 1 <= int(port) <= 65535:
        port = int(port)
    else:
        raise refused("the port must be 1 to 65535")
    if scheme == "https://" and credentials is None:
        credentials = grpc.ssl_channel_credentials(root_certificates=system_roots())
    return (host if port is None else f"{host}:{port}"), credentials


def _split_port(authority: str) -> Tuple[str, Optional[str]]:
    """``host:port`` (or ``[v6 address]:port``) split at the port's colon, if there is
    one, as the Rust client's ``split_port``."""
    after_host = authority.rfind("]") + 1
    colon = authority.rfind(":", after_host)
    if colon < 0:
        return authority, None
    return authority[:colon], authority[colon + 1:]


def system_roots() -> Optional[bytes]:
    """The CA certificates the system trusts (PEM), where OpenSSL looks for them: the
    file and the directory of ``ssl.get_default_verify_paths()``, that is
    ``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` or else the system's bundle and directory.
    gRPC's own default is the Mozilla bundle grpcio ships, never the system's store
    (grpc/grpc#40580), so a server whose CA the machine trusts (a company CA) failed to
    verify, where the CLI and the Rust client connect. None, for gRPC's default, when
    ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH`` names the roots or no certificate is found."""
    if os.environ.get("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"):
        return None
    paths = ssl.get_default_verify_paths()
    return _read_roots(paths.cafile, paths.capath)


_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n.+?\n-----END CERTIFICATE-----", re.S)


@functools.lru_cache(maxsize=4)
def _read_roots(cafile: Optional[str], capath: Optional[str]) -> Optional[bytes]:
    """The certificates of ``cafile`` and of the files in ``capath``, each once (a
    system directory holds each twice, by name and by hash, and the bundle too). Read
    once per process: a directory holds hundreds."""
    files = [cafile] if cafile else []
    if capath and os.path.isdir(capath):
        files += sorted(os.path.join(capath, f) for f in os.listdir(capath))
    certs: Dict[bytes, None] = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                certs.update(dict.fromkeys(_PEM_CERTIFICATE.findall(f.read())))
        except OSError:
            continue  # a dangling link, a subdirectory: OpenSSL skips them too
    return b"\n".join(certs) + b"\n" if certs else None


#: Messages of any size: a lock's state grows with its holders and waiters (a read lock
#: or semaphore of thousands, long owner ids) past gRPC's default 4 MiB, and the server
#: sends it whole.
MAX_RECEIVE = ("grpc.max_receive_message_length", -1)


#: A channel of its own connections, not shared through gRPC core's process-wide pool
#: with the other channels of the same target and options: in a child process after
#: ``os.fork()``, that pool holds the parent's connections, and a new client there took
#: one, on which gRPC refuses to write in the child ("Wrong file descriptor
#: generation"): its first call failed UNAVAILABLE.
LOCAL_SUBCHANNEL_POOL = ("grpc.use_local_subchannel_pool", 1)

#: Whether this process is the child of an ``os.fork()`` of a process that had made a
#: client (``after_fork_in_child``): only there does gRPC's pool hold connections that
#: cannot be used, and a worker whose parent never made one shares connections as usual.
_forked_child = False


def channel_options(target: str, options) -> list:
    """The caller's channel options, plus those it does not set of
    ``KEEPALIVE_OPTIONS``, ``PING_TIMEOUT`` and ``MAX_RECEIVE``, in the forked child of
    a process that had made a client ``LOCAL_SUBCHANNEL_POOL``, and, for Unix-socket targets,
    ``grpc.default_authority=localhost``: gRPC core otherwise sends the socket path as
    the HTTP/2 authority, which the server's HTTP/2 stack rejects (RST_STREAM
    PROTOCOL_ERROR)."""
    opts = list(options or [])
    given = {k for k, _ in opts}
    opts += [(k, v) for k, v in KEEPALIVE_OPTIONS if k not in given]
    if PING_TIMEOUT not in given:
        opts.append((PING_TIMEOUT, dict(opts)["grpc.keepalive_timeout_ms"]))
    if MAX_RECEIVE[0] not in given:
        opts.append(MAX_RECEIVE)
    if _forked_child and LOCAL_SUBCHANNEL_POOL[0] not in given:
        opts.append(LOCAL_SUBCHANNEL_POOL)
    if target.startswith(("unix:", "unix-abstract:")) and "grpc.default_authority" not in given:
        opts.append(("grpc.default_authority", "localhost"))
    return opts


def authorization(token: str) -> Tuple[str, str]:
    """The ``authorization`` header for ``token``. A header value must be printable
    ASCII; gRPC core would refuse any other only at the first call, with ``INTERNAL:
    Invalid metadata``, so it is refused here, as the Rust client does, without
    repeating the token."""
    if not isinstance(token, str):
        raise TypeError(f"latchkey: the token must be a string, not {type(token).__name__}")
    if any(not " " <= c <= "~" for c in token):
        raise ValueError("latchkey: the token must be printable ASCII")
    return ("authorization", f"Bearer {token}")


def next_page_token(seen: set, token: str) -> str:
    """The token of the next page of a List, or "" when there is none: also when the
    server gives a token it gave before, which would page forever."""
    if not token or token in seen:
        return ""
    seen.add(token)
    return token


def _status_types():
    """``google.rpc.Status`` (its details as opaque ``Any``) and ``google.rpc.ErrorInfo``,
    declared here in a private package and pool, as the Node client does, so that
    reading the server's ErrorInfo needs no dependency beyond ``protobuf``."""
    F = descriptor_pb2.FieldDescriptorProto
    package = "latchkey_client_internal"
    fd = descriptor_pb2.FileDescriptorProto(name=f"{package}/status.proto", package=package, syntax="proto3")

    def message(name, *fields, into=fd.message_type):
        # A field whose type is a name is a repeated message (Status.details, a map).
        m = into.add(name=name)
        for number, (field, kind) in enumerate(fields, 1):
            if isinstance(kind, str):
                m.field.add(name=field, number=number, type=F.TYPE_MESSAGE, type_name=f".{package}.{kind}",
                            label=F.LABEL_REPEATED)
            else:
                m.field.add(name=field, number=number, type=kind, label=F.LABEL_OPTIONAL)
        return m

    message("Any", ("type_url", F.TYPE_STRING), ("value", F.TYPE_BYTES))
    message("Status", ("code", F.TYPE_INT32), ("message", F.TYPE_STRING), ("details", "Any"))
    info = message("ErrorInfo", ("reason", F.TYPE_STRING), ("domain", F.TYPE_STRING),
                   ("metadata", "ErrorInfo.MetadataEntry"))
    entry = message("MetadataEntry", ("key", F.TYPE_STRING), ("value", F.TYPE_STRING), into=info.nested_type)
    entry.options.map_entry = True
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return tuple(
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))
        for name in ("Status", "ErrorInfo")
    )


_STATUS_TYPES = None


def error_info(metadata) -> Tuple[Optional[str], Dict[str, str]]:
    """The ``reason`` and metadata of the ``google.rpc.ErrorInfo`` in a status's
    ``grpc-status-details-bin`` trailer, or ``(None, {})`` when there is none. A
    malformed or foreign trailer is not worth failing over."""
    global _STATUS_TYPES
    try:
        raw = next((v for k, v in metadata or () if k == "grpc-status-details-bin"), None)
        if not raw:
            return None, {}
        if _STATUS_TYPES is None:
            _STATUS_TYPES = _status_types()
        status_type, info_type = _STATUS_TYPES
        for detail in status_type.FromString(raw).details:
            if detail.type_url.endswith("/google.rpc.ErrorInfo"):
                info = info_type.FromString(detail.value)
                return info.reason, dict(info.metadata)
    except Exception:
        pass
    return None, {}


class LockError(Exception):
    """A lock operation failed. Carries the gRPC status ``code`` and ``details``, and
    from the server's ``google.rpc.ErrorInfo`` its ``reason`` (e.g. "WAIT_TIMEOUT",
    "WRONG_KIND", "LIMIT_MISMATCH", "REDIS_UNAVAILABLE"; None when it sent none) and
    ``info``, its metadata (e.g. ``{"field": "open.name"}``, ``{"limit": "2"}``).
    ``metadata`` is the status's trailing metadata (None for an error of the client's
    own)."""

    def __init__(
        self,
        code: Optional[grpc.StatusCode],
        details: str = "",
        *,
        reason: Optional[str] = None,
        info: Optional[Dict[str, str]] = None,
        metadata: Optional[Sequence[Tuple[str, Union[str, bytes]]]] = None,
    ) -> None:
        self.code = code
        self.details = details
        self.reason = reason
        self.info = dict(info or {})
        self.metadata = metadata
        name = code.name if code is not None else "UNKNOWN"
        super().__init__(f"{name}: {details}" if details else name)

    def __reduce__(self):
        # Rebuilt from its code and details, then its attributes: the default rebuilds
        # it from ``args``, the formatted message, as the code, and fails. So pickle
        # (a ``ProcessPoolExecutor`` worker's error, which broke the whole pool) and
        # ``copy`` work.
        return type(self), (self.code, self.details), self.__dict__


class LockTimeout(LockError):
    """The wait ran out before the lock was granted (status DEADLINE_EXCEEDED). Only an
    acquire raises it: a unary call or a release with no answer in time raises a plain
    ``LockError`` with code DEADLINE_EXCEEDED."""


def error_from_rpc(err: grpc.RpcError) -> LockError:
    """Maps a gRPC error to a plain LockError, whatever its code: DEADLINE_EXCEEDED on a
    unary call is a call that got no answer within its ``timeout``, not a wait for a
    lock that ran out (``acquire_error``). A connection TLS refused reads
    FAILED_PRECONDITION (``tls_refused``)."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    # Plain (key, value) pairs: gRPC's own items do not pickle (a worker's error).
    metadata = tuple((key, value) for key, value in metadata) if metadata is not None else None
    reason, info = error_info(metadata)
    if code == grpc.StatusCode.UNAVAILABLE and tls_refused(details or ""):
        code, details = grpc.StatusCode.FAILED_PRECONDITION, f"TLS refused the connection: {details}"
    return LockError(code, details or "", reason=reason, info=info, metadata=metadata)


#: What gRPC core says when the TLS handshake itself failed (not the socket under it,
#: "Handshake read failed"): a certificate that did not verify or is not for the name
#: dialled, a server that speaks no TLS, no protocol in common.
_TLS_REFUSED = re.compile(r"handshake failed|CERTIFICATE_VERIFY_FAILED|Hostname Verification Check failed", re.I)


def tls_refused(details: str) -> bool:
    """Whether gRPC's details of an UNAVAILABLE say TLS refused the connection, which
    trying again never mends: so it is FAILED_PRECONDITION, as in the Rust client and
    the CLI, and a wrapper that retries on UNAVAILABLE (a server down, Redis out of
    reach) does not retry a wrong CA for good. Read from the text, as gRPC gives no
    other sign; a plaintext client that a TLS server hangs up on cannot be told from a
    server that went away, and stays UNAVAILABLE."""
    return bool(_TLS_REFUSED.search(details))


def acquire_error(err: grpc.RpcError) -> LockError:
    """What an acquire that was not granted raises: LockTimeout for DEADLINE_EXCEEDED,
    which on an Acquire stream (it has no deadline of its own) is the server's wait
    running out, else LockError."""
    error = error_from_rpc(err)
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return LockTimeout(error.code, error.details, reason=error.reason, info=error.info, metadata=error.metadata)
    return error


def closed_error() -> LockError:
    """What a call on a closed client raises, in both clients (and in Node's): CANCELLED,
    as an acquire the close cut short."""
    return LockError(grpc.StatusCode.CANCELLED, "the client is closed")


def forked_error(advice: str = "create a Client in this process, after the fork") -> LockError:
    """What a call raises on a client a child process inherited through ``os.fork()``:
    the error of a closed client, as the client is of no use here (see
    ``after_fork_in_child``), saying what to do instead."""
    return LockError(
        grpc.StatusCode.CANCELLED,
        f"the client was created before a fork (os.fork) and belongs to the parent process: {advice}",
    )


#: Whatever of this package holds gRPC state, threads or locks, weakly: after
#: ``os.fork()``, the child calls each one's ``forked()`` (``after_fork_in_child``). The
#: objects a child inherited stay in it, so that a fork of the child resets them again.
_FORKABLE: "weakref.WeakSet" = weakref.WeakSet()

#: Whether a client (blocking or asyncio) was ever made in this process, or in the
#: parent it was forked from: only then does a fork leave gRPC's process-wide
#: connections behind to the child (see ``LOCAL_SUBCHANNEL_POOL``).
_client_made = False

_log = logging.getLogger("latchkey")


def on_fork(obj) -> None:
    """Has ``obj.forked()`` called in a child process right after an ``os.fork()``."""
    _FORKABLE.add(obj)


def client_made() -> None:
    """Called by each new client: a child forked from here on inherits gRPC in use."""
    global _client_made
    _client_made = True


class ProcessBound:
    """The base of what holds gRPC state (a call, a channel) of the process that made it:
    a stream, a watch, a client. ``inherited`` tells a child process's copy, which must
    never call into gRPC: a cancel, or a channel's close, from the child could end the
    parent's stream on the connection they share, and give its lock away."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._inherited = False
        on_fork(self)

    @property
    def inherited(self) -> bool:
        """Whether this is the copy of an object of the parent's. Its ``forked()`` tells,
        and so does the process id, before then: CPython clears the dead threads' state
        in the child before, or while, it runs the fork hooks, and a finalizer that runs
        then (a lease's, dropping its stream) finds ``forked()`` not called yet; a fork
        made in C, that runs no hook, is caught too."""
        return self._inherited or os.getpid() != self._pid

    def forked(self) -> None:
        """In a child process after ``os.fork()`` (again in a grandchild: it must stay
        safe to run twice)."""
        self._inherited = True

    def cancel_own(self, call) -> None:
        """Cancels ``call`` (a stream's: the server releases what is left of its lock,
        or ends its watch), unless this is the parent's copy."""
        if not self.inherited:
            call.cancel()


def keep_inherited(grpc_object) -> None:
    """Keeps a gRPC object of the parent's (a call, a channel) from ever being finalized
    in the child: gRPC's own finalizers cancel a call, or close a channel, that nobody
    references any more, which would reach the parent's stream from the child. A list of
    them would not do: at the interpreter's exit (a worker that ends with ``sys.exit``)
    the module's globals are cleared, and the objects finalized then. So the object's
    count of references is raised for good, a leak of one object per inherited call or
    channel, which the child's exit ends."""
    try:
        # Imported here: an interpreter built without ctypes still imports the package.
        import ctypes

        ctypes.pythonapi.Py_IncRef(ctypes.py_object(grpc_object))
    except (ImportError, AttributeError, OSError):  # no ctypes API: the best left
        _INHERITED_GRPC.append(grpc_object)


#: Where ``keep_inherited`` keeps an object without ``ctypes.pythonapi``.
_INHERITED_GRPC: list = []


def after_fork_in_child() -> None:
    """Runs in the child process of an ``os.fork()``, before the code that forked goes
    on. Only the forking thread lives on: the leases' reader threads, their timers and
    gRPC's own threads do not, and gRPC Python cannot use a channel made before the fork
    (short of ``GRPC_ENABLE_FORK_SUPPORT``): a call into it may hang the child, or cancel
    a stream on the connection the child shares with the parent, which would give the
    parent's lock away. So every lease the parent had open is lost here (``DISCONNECTED``) and
    every client unusable, without a word to gRPC; the locks stay the parent's. When
    the parent had made a client, those made here connect on their own
    (``LOCAL_SUBCHANNEL_POOL``).

    One object's ``forked()`` that fails is logged, and the others' still run: the hook
    runner could not pass the error on to anyone."""
    global _forked_child
    _forked_child = _client_made
    for obj in list(_FORKABLE):
        try:
            obj.forked()
        except Exception:
            _log.exception("latchkey: resetting %r after os.fork() failed", obj)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=after_fork_in_child)


def reinit_after_fork(*events: threading.Event) -> None:
    """Frees the lock inside each of ``events`` in a child process: a thread of the
    parent's that held it at the fork (an instant, in a ``set()`` or a ``wait()``) does
    not exist here to let it go, and ``set()`` would wait for good. ``threading``
    resets its own objects so (``_at_fork_reinit``), keeping their state."""
    for event in events:
        reinit = getattr(event, "_at_fork_reinit", None)
        if reinit is not None:
            reinit()


def release_error(ended: LockError) -> LockError:
    """What ``release()`` raises when the stream ended with ``ended`` while the release
    was under way, before ``released``: the release's outcome is unknown, which is not a
    lease lost. UNAVAILABLE, say, is a server that could not reach Redis: it gives the
    lock back once Redis answers. Never ``LockTimeout``, which only an acquire's wait
    raises."""
    if ended.code == grpc.StatusCode.OK:
        return LockError(grpc.StatusCode.UNKNOWN, "the stream ended without confirming the release")
    return ended


def release_outcome(released: bool, lost: bool, timed_out: Optional[float], failure: Optional[LockError]) -> bool:
    """What ``release()`` returns once the stream ended (or the wait gave up): True
    when released, False when the lease had been lost, else it raises: the release
    timed out, or the stream ended with ``failure`` (its outcome is unknown)."""
    if released:
        return True
    if lost:
        return False
    if timed_out is not None:
        raise release_timeout_error(timed_out)
    raise failure or LockError(grpc.StatusCode.UNKNOWN, "the stream did not end after the release")


def release_timeout_error(timeout: float) -> LockError:
    """What ``release()`` raises when no answer came in ``timeout`` s: DEADLINE_EXCEEDED
    as a plain ``LockError`` (not ``LockTimeout``). The stream has been cancelled, and
    the server releases on a cancel."""
    return LockError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"no answer to the release in {timeout:g} s; the stream was cancelled (the server releases on a cancel)",
    )


#: The longest google.protobuf.Duration, in seconds (10 000 years).
MAX_DURATION_SECONDS = 315_576_000_000


def to_duration(value: Seconds, field: str) -> duration_pb2.Duration:
    """Seconds (int/float) or a timedelta as a google.protobuf.Duration. An infinite or
    NaN number raises ValueError (``build_open`` reads ``wait=math.inf`` as unset)."""
    d = duration_pb2.Duration()
    if isinstance(value, datetime.timedelta):
        d.FromTimedelta(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        # An int is never converted to a float here: a huge one would overflow.
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{field} must be a finite number of seconds, not {value}")
        # A huge float would overflow protobuf's int64, with an error naming no field.
        if not -MAX_DURATION_SECONDS <= value <= MAX_DURATION_SECONDS:
            raise ValueError(f"{field} must be at most {MAX_DURATION_SECONDS} seconds (10 000 years), not {value}")
        d.FromNanoseconds(int(round(value * 1e9)))
    else:
        raise TypeError(f"{field} must be seconds (int/float) or a datetime.timedelta, not {type(value).__name__}")
    return d


def to_kind(kind: Kind) -> int:
    """Accepts None, a LockKind value, or a name: "semaphore", "SEMAPHORE", "LOCK_KIND_SEMAPHORE"."""
    if kind is None:
        return pb.LOCK_KIND_UNSPECIFIED
    if isinstance(kind, bool):
        raise TypeError("kind must be a string or a LockKind value")
    if isinstance(kind, int):
        if kind not in pb.LockKind.values():
            raise ValueError(f"unknown lock kind {kind}")
        return kind
    if isinstance(kind, str):
        name = kind.strip().upper().replace("-", "_")
        if not name.startswith("LOCK_KIND_"):
            name = "LOCK_KIND_" + name
        try:
            return pb.LockKind.Value(name)
        except ValueError:
            known = ", ".join(n[len("LOCK_KIND_"):].lower() for n in pb.LockKind.keys() if n != "LOCK_KIND_UNSPECIFIED")
            raise ValueError(f"unknown lock kind {kind!r} (known: {known})") from None
    raise TypeError(f"kind must be a string or a LockKind value, not {type(kind).__name__}")


def build_open(
    name: Union[str, Sequence[str]],
    *,
    wait: Optional[Seconds],
    lease: Optional[Seconds],
    owner: Optional[str],
    kind: Kind,
    permits: Optional[int],
    limit: Optional[int],
    redlock: bool = False,
) -> pb.AcquireRequest:
    """The first message of an Acquire stream. Optional fields are set only when given.

    A list of one name is that one lock (``name``), as the Rust client's ``lock_all``
    sends it: the server takes ``names`` only for a multi-lock of 2 to 64 names, and
    code that locks "every account a transfer touches" must not fail on a
    self-transfer. ``wait=math.inf`` waits until granted, as ``None`` (and as
    ``wait: Infinity`` in the Node client)."""
    op = pb.Open(kind=to_kind(kind))
    if isinstance(name, str):
        op.name = name
    else:
        names = lock_names(name)
        if len(names) == 1:
            op.name = names[0]
        else:
            op.names.extend(names)
    if wait == math.inf:
        wait = None
    if wait is not None:
        op.wait_timeout.CopyFrom(to_duration(wait, "wait"))
        if op.wait_timeout.ToNanoseconds() < 0:
            raise ValueError(f"wait must not be negative (0 tries once), not {wait}")
    if lease is not None:
        op.lease.CopyFrom(to_duration(lease, "lease"))
        if op.lease.ToNanoseconds() <= 0:
            raise ValueError(f"lease must be positive (None: renewed while held), not {lease}")
    # proto3 sends neither "" nor 0: the server would read no owner (a fresh one per
    # stream, so no reentrancy: streams meant to share an owner wait on each other) and
    # the default 1 permit, not what was asked. None is how to ask for those.
    if owner is not None:
        op.owner = text(owner, "owner")
        if not op.owner:
            raise ValueError("owner must not be empty (None: a fresh owner per stream)")
    if permits is not None:
        op.permits = uint32(permits, "permits", least=1)
    if limit is not None:
        op.limit = uint32(limit, "limit")
    if redlock:
        op.redlock = True
    return pb.AcquireRequest(open=op)


def text(value: str, field: str) -> str:
    """``value``, a string, or a TypeError that names ``field``: protobuf's own
    ("bad argument type for built-in operation") names nothing."""
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a string, not {type(value).__name__}")
    return value


# Every request's blocks open in a context, as {weak Blocks: weak leases}: one variable for them all,
# as a variable once set stays in its context for as long as the context lives (a thread's
# or task's), and one per request would so grow each context by one per lock block. A
# value is never changed in place: a copied context keeps the dict it had. Both are held
# weakly (a weak reference to the Blocks, a tuple of weak references to its leases): the
# Blocks keeps its open blocks' leases, and the ``with`` statement (or an ``ExitStack``)
# keeps the request and so its Blocks while a block is open. A block entered and never
# left (an ``ExitStack`` dropped unclosed) is then garbage with its request, and its
# lease is released as a lease the program drops is, where the variable, which lives as
# long as the thread, held it for good.
_BLOCKS: contextvars.ContextVar[dict] = contextvars.ContextVar("latchkey_blocks", default={})


class Blocks:
    """The leases of the blocks one ``LockRequest`` entered, per thread and per asyncio
    task: a block gives back the lease its own enter took. One request may so serve
    several blocks at once, as a shared ``threading.Semaphore`` or ``asyncio.Semaphore``
    does, and blocks nested in one. A block left in another thread or task than its
    enter's (an executor's worker entered it, or ``asyncio.wait_for`` ran ``__aenter__``
    in a task of its own, as it does before Python 3.12) gives back a block open
    elsewhere: one entered by an asyncio task or a thread that has ended (``wait_for``'s,
    a short-lived thread's: nobody else will leave it), else the one block open. With
    several open in live threads or tasks, which one it ends cannot be told, and it
    raises rather than end another's block.

    Each context keeps its blocks' leases in a context variable, and a context may be a
    copy of another's: a task copies the context of the one that starts it
    (``asyncio.create_task``), and a thread may run in a copy (``asyncio.to_thread``,
    ``contextvars.copy_context().run``). The blocks a copy inherits stay its starter's:
    an exit counts as its own only those its own task (its thread, outside a task)
    entered. A task started inside ``async with sem:`` would otherwise end that block
    at its exit, and leave its own, entered elsewhere, held."""

    def __init__(self) -> None:
        # Every block's lease not given back yet, whatever context entered it, with the
        # asyncio task (None on a plain thread) and the thread that entered it.
        self._open: list = []
        self._lock = threading.Lock()
        on_fork(self)

    def forked(self) -> None:
        """In a child process: a thread of the parent's may have held the lock at the fork."""
        self._lock = threading.Lock()

    @staticmethod
    def _here() -> tuple:
        """The asyncio task (None outside one) and the thread an enter or exit runs in."""
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        return task, threading.current_thread()

    def push(self, lease) -> None:
        task, thread = self._here()
        before = self._held_here()
        with self._lock:
            # With the blocks its context held: an exit whose context holds the same
            # entered inside them (see ``pop``).
            self._open.append((lease, task, thread, before))
        self._hold_here(before + (lease,))

    def pop(self):
        """The lease of the innermost block entered here, by this task or thread, else
        one open elsewhere (see the class), or None when no block is open."""
        task, thread = self._here()
        leases = self._held_here()
        with self._lock:
            # This context's leases still open (an exit elsewhere may have given some
            # back) that this task or thread entered, not inherited with a copied context.
            own = [
                lease
                for lease in leases
                if any(entry[0] is lease and entry[1] is task and entry[2] is thread for entry in self._open)
            ]
            # Open ones the context holds that another task or thread entered: an exit
            # run in a task of its own (``asyncio.shield``, ``wait_for`` before 3.12)
            # ends the innermost. (A thread has no such idiom: one leaving a block it
            # did not enter leaves one entered elsewhere, as the class says.)
            inherited = [lease for lease in leases if any(entry[0] is lease for entry in self._open)]
            # A block whose enter ran in a task that ended (``wait_for`` before 3.12)
            # with this very context's blocks open was entered inside them all: this
            # exit's, in the task that awaited the enter (or in a child task of the
            # block's own starter, whose context it copied).
            entered_inside = [
                entry[0] for entry in self._open if self._gone(entry) and _same(entry[3], leases)
            ]
            if entered_inside:
                lease = entered_inside[-1]
            elif own:
                lease = own[-1]
            elif inherited and task is not None:
                lease = inherited[-1]
            elif not self._open:
                return None
            else:
                lease = self._elsewhere()
            self._open = [entry for entry in self._open if entry[0] is not lease]
            # Those given back, here or elsewhere, leave the context; inherited blocks
            # still open stay, as they are the starter's and read as nobody's here.
            leases = tuple(kept for kept in leases if any(entry[0] is kept for entry in self._open))
        self._hold_here(leases)
        return lease

    def _held_here(self) -> tuple:
        """The leases of these blocks this context holds (those still alive: a lease
        given back elsewhere may have been collected since)."""
        refs = _BLOCKS.get().get(weakref.ref(self), ())
        return tuple(lease for lease in (ref() for ref in refs) if lease is not None)

    def _hold_here(self, leases: tuple) -> None:
        """Records ``leases`` as these blocks' in this context, none leaving no entry.
        The entries of requests since collected go too."""
        held = {key: kept for key, kept in _BLOCKS.get().items() if key() not in (None, self)}
        if leases:
            held[weakref.ref(self)] = tuple(weakref.ref(lease) for lease in leases)
        _BLOCKS.set(held)

    @staticmethod
    def _gone(entry) -> bool:
        """Whether a block's enter ran in a task or thread that has ended."""
        _, task, thread, _ = entry
        # A block entered on a plain thread has no task to tell: its thread tells.
        return (task is not None and task.done()) or not thread.is_alive()

    def _elsewhere(self):
        """The lease of a block open in another context that this exit ends."""
        ended = [entry[0] for entry in self._open if self._gone(entry)]
        if ended:
            return ended[0]
        if len(self._open) > 1:
            raise RuntimeError(
                f"{len(self._open)} blocks of this lock request are open in other threads or tasks: "
                "leave each block in the thread or task that entered it"
            )
        return self._open[0][0]


def _same(these: tuple, those: tuple) -> bool:
    """Whether two contexts' tuples of leases hold the same leases, in order."""
    return len(these) == len(those) and all(a is b for a, b in zip(these, those))


def time_bound(timeout: Optional[float]) -> Optional[float]:
    """``timeout`` as a wait or a gRPC deadline takes it: ``math.inf``, or any time past
    what ``threading`` can wait, is no bound (``None``), as it is to the asyncio client
    and to Node's; ``threading`` overflows on it, and gRPC ends the call at once."""
    if timeout is None or timeout >= threading.TIMEOUT_MAX:
        return None
    return timeout


def judgement_time(ends: float, now: float, settle: float) -> float:
    """When a fixed lease's end found near or past at ``now`` is judged: at the end when
    it is still ahead (the holder must know before Redis can give the lock to another;
    the notices received meanwhile have had the time to be read), else ``settle`` from
    now, for the notices held while the process stalled to be read first."""
    return ends if now < ends else now + settle


def given_names(name: Union[str, Sequence[str]]) -> Union[str, list]:
    """``name`` as the request and the lease keep it: a string as it is, any other
    iterable read once into a list (an iterator would be used up by the request, and
    the lease's ``name`` left an empty iterator). ``lock()`` calls it too, so that each
    block of its request takes the same locks (an iterator would serve the first only)."""
    return name if isinstance(name, str) else lock_names(name)


def lock_names(name: Sequence[str]) -> list:
    """The names of a multi-lock as a list, or a TypeError that names ``name``: a name
    that is no string (``123``) gave "'int' object is not iterable". No names at all
    is a ValueError here, rather than the server's INVALID_ARGUMENT after a round trip."""
    if isinstance(name, (bytes, bytearray)) or not hasattr(name, "__iter__"):
        raise TypeError(f"name must be a string or a list of strings, not {type(name).__name__}")
    names = list(name)
    if not names:
        raise ValueError("name must be a string or a list of at least one name, not empty")
    for i, n in enumerate(names):
        if not isinstance(n, str):
            raise TypeError(f"name must be a string or a list of strings; name[{i}] is {type(n).__name__}")
    return names


#: The bounds of a ``uint32`` field (``permits``, ``limit``).
UINT32_MAX = 2**32 - 1


def uint32(value: int, field: str, least: int = 0) -> int:
    """``value`` for a ``uint32`` field, from ``least``, or a TypeError or ValueError
    that names ``field``: protobuf's own ("Value out of range: -1") names nothing."""
    if isinstance(value, bool):
        raise TypeError(f"{field} must be an int, not bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{field} must be an int, not {type(value).__name__}") from None
    if not least <= value <= UINT32_MAX:
        raise ValueError(f"{field} must be from {least} to {UINT32_MAX}, not {value}")
    return value


def fixed_lease_end(asked: float, open_: pb.Open, acquired: pb.Acquired) -> Optional[float]:
    """When a fixed lease asked for at ``asked`` (a monotonic reading taken before the
    stream was opened) and granted with ``acquired`` has ended in Redis at the latest,
    or None for a watchdog lease.

    Its holder is told ``LEASE_EXPIRED`` then by the client's own clock, as by the Rust
    client, even when the server's ``lost`` cannot arrive (a silent partition, which
    keepalive notices only up to 7 s later). The server counts the lease from its try,
    ``acquired.waited`` after it read the request, so after ``asked + waited``;
    ``acquired.lease`` is how long it lasts from there, less than asked for by what the
    server takes off its end (a tenth, at most 100 ms and a thousandth of the lease; a
    RedLock grant at least its clock drift).
    So the end is never after the server gave the lock back.
    """
    if not open_.HasField("lease"):
        return None
    granted = acquired.lease if acquired.HasField("lease") else open_.lease
    lease = granted.ToNanoseconds() / 1e9
    if open_.redlock:
        # An older server sends the lease asked for: never past a RedLock grant's
        # validity (the drift allowed, 1% plus 2 ms, taken off).
        asked_for = open_.lease.ToNanoseconds() / 1e9
        lease = min(lease, asked_for - (asked_for / 100 + 0.002))
    waited = acquired.waited.ToNanoseconds() / 1e9 if acquired.HasField("waited") else 0.0
    return asked + waited + max(lease, 0.0)


def lost_reason_name(reason: int) -> str:
    try:
        return pb.Lost.Reason.Name(reason)
    except ValueError:
        return f"REASON_{reason}"


class LeaseInfo:
    """What the ``acquired`` event said; the base of both lease classes."""

    name: Union[str, Sequence[str]]
    fencing_token: int
    fencing_tokens: list
    hold_count: int
    owner: str
    lease: Optional[datetime.timedelta]

    def _set_acquired(self, name: Union[str, Sequence[str]], acq: pb.Acquired) -> None:
        self.name = name
        self.fencing_token = int(acq.fencing_token)
        self.fencing_tokens = [int(t) for t in acq.fencing_tokens]
        if not self.fencing_token and self.fencing_tokens:
            self.fencing_token = self.fencing_tokens[0]
        if not self.fencing_tokens and not isinstance(name, str):
            # A list of one name was sent as a plain lock: one token per name still.
            self.fencing_tokens = [self.fencing_token]
        self.hold_count = int(acq.hold_count)
        self.owner = acq.owner
        self.lease = acq.lease.ToTimedelta() if acq.HasField("lease") else None

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} name={self.name!r} fencing_token={self.fencing_token} "
            f"hold_count={self.hold_count} owner={self.owner!r} lost={self.lost_reason!r}>"
        )

    lost_reason: Optional[str] = None
