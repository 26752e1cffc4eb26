"""The blocking client (threads)."""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import grpc

from latchkey._common import (
    DISCONNECTED,
    LEASE_EXPIRED,
    RELEASE_TIMEOUT,
    Blocks,
    Kind,
    LeaseInfo,
    LockError,
    ProcessBound,
    Seconds,
    acquire_error,
    authorization,
    build_open,
    given_names,
    channel_options,
    client_made,
    closed_error,
    ended_reason,
    ends_a_release,
    error_from_rpc,
    fixed_lease_end,
    forked_error,
    grpc_target,
    judgement_time,
    keep_inherited,
    lost_reason_name,
    next_page_token,
    reinit_after_fork,
    release_error,
    release_outcome,
    text,
    time_bound,
)
from latchkey.v1 import latchkey_pb2 as pb
from latchkey.v1 import latchkey_pb2_grpc as pb_grpc

Metadata = Sequence[Tuple[str, str]]

#: How long the verdict on a fixed lease's end waits for the notices already received.
#: After a stall of the process (SIGSTOP, swap, a debugger) past the end, the server's
#: ``lost`` may already be in gRPC's buffers, but the thread that reads the lease's state
#: (or the end's timer) often runs before the reader thread has delivered it: waiting a
#: moment for it lets the notice say why the lease ended, rather than ``LEASE_EXPIRED``
#: by the client's clock. The timer starts this long before the end, so on a process
#: that runs on time ``lost`` is set at the end itself (the holder must know before
#: Redis can give the lock to another); after a stall, this long after it. ``held``
#: reads False from the end on, at once. As ``latchkey.aio.SETTLE_SECONDS``.
SETTLE_SECONDS = 0.05


def _requests(q: "queue.Queue[Optional[pb.AcquireRequest]]") -> Iterator[pb.AcquireRequest]:
    # Feeds the Acquire stream; None half-closes it.
    while True:
        item = q.get()
        if item is None:
            return
        yield item


class _Stream(ProcessBound):
    """The open Acquire stream of a lease and what its reader thread learnt from it.

    The reader thread (and a fixed lease's end timer) holds this, never the ``Lease``: a
    lease the program no longer references is garbage collected, and its finalizer
    cancels the stream.
    """

    def __init__(
        self, call, requests: "queue.Queue[Optional[pb.AcquireRequest]]", ends: Optional[float] = None
    ) -> None:
        self.call = call
        self.requests = requests
        #: A fixed lease's end on ``time.monotonic()``; None for a watchdog lease.
        self.ends = ends
        #: When a fixed lease's end is judged on ``time.monotonic()``, once due (see
        #: ``SETTLE_SECONDS``); None before.
        self.judged_at: Optional[float] = None
        self.timer: Optional[threading.Timer] = None
        self.lost = threading.Event()
        self.lost_reason: Optional[str] = None
        self.lost_code: Optional[grpc.StatusCode] = None
        self.lost_info: Dict[str, str] = {}
        self.released = threading.Event()
        self.ended = threading.Event()
        #: Set once the lease is over: lost, or its stream ended (released, or a
        #: release that failed), so that ``wait_lost()`` does not wait for good.
        self.over = threading.Event()
        #: Reentrant, as the client's lock: ``close()`` may run in a signal handler
        #: that interrupts its own thread while it holds the lock.
        self.state_lock = threading.RLock()
        self.releasing = False
        #: What the release raises: the status that ended the stream while it was under way.
        self.failure: Optional[LockError] = None
        #: The release got no answer in time (its ``timeout``, in s).
        self.timed_out: Optional[float] = None
        super().__init__()

    def forked(self) -> None:
        """In a child process after ``os.fork()``: the stream, its reader thread and its
        timer are the parent's, and so is the lock. Here the lease is lost at once
        (``DISCONNECTED``, with no code), so that ``held`` reads False, ``wait_lost()``
        returns and ``release()`` returns False, and no path calls into the parent's gRPC
        state again (see ``cancel``). A lease over before the fork keeps its outcome."""
        super().forked()
        keep_inherited(self.call)
        self.timer = None
        self.state_lock = threading.RLock()
        reinit_after_fork(self.lost, self.released, self.ended, self.over)
        if not (self.lost.is_set() or self.released.is_set() or self.ended.is_set()):
            self.lost_reason = DISCONNECTED
            self.lost.set()
        self.ended.set()
        self.over.set()

    def cancel(self) -> None:
        self.cancel_own(self.call)

    def mark_lost(self, reason: str, code: Optional[grpc.StatusCode] = None) -> None:
        with self.state_lock:
            if self.lost.is_set() or self.released.is_set():
                return
            self.lost_reason = reason
            self.lost_code = code
            # Set under the lock, so that the reason of whoever came first stays.
            self.lost.set()
        self.over.set()

    def close(self) -> None:
        """The client is being closed, which cancels the stream: the lease is lost
        (``DISCONNECTED``, code CANCELLED) now, before the reader hears of the cancel,
        so that a ``release()`` that follows returns False as after any loss. A release
        already under way is not a loss: its outcome says how it ended."""
        with self.state_lock:
            if self.releasing or self.lost.is_set() or self.released.is_set() or self.ended.is_set():
                return
            self.lost_reason = DISCONNECTED
            self.lost_code = grpc.StatusCode.CANCELLED
            self.lost.set()
        self.over.set()

    def arm(self, name) -> None:
        """Starts a fixed lease's one timer (a daemon thread asleep until
        ``SETTLE_SECONDS`` before the end, then judging it at the end)."""
        if self.ends is None:
            return
        self.timer = threading.Timer(max(0.0, self.ends - SETTLE_SECONDS - time.monotonic()), self.expire)
        self.timer.name = f"latchkey-lease-end-{name}"
        self.timer.daemon = True
        self.timer.start()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def due(self) -> bool:
        """Whether a fixed lease has reached its end by the client's clock."""
        return self.ends is not None and time.monotonic() >= self.ends

    def expire_if_due(self) -> None:
        """Reads of the lease's state see its end even before the timer has run."""
        if self.due():
            self.expire()

    def settled(self) -> bool:
        """Whether nothing is left for the end to judge: a notice came, the stream
        ended, or a release is under way (one asked for before the end goes ahead).
        ``lost`` too: whoever marks the lease lost sets ``over`` only after leaving the
        lock, and a verdict in between would overwrite the reason already told."""
        return self.releasing or self.lost.is_set() or self.over.is_set() or self.released.is_set()

    def expire(self) -> None:
        """A fixed lease's end by the client's clock, near (``SETTLE_SECONDS`` before
        it) or past: judged at the end, and no sooner than the reader thread had a
        moment to deliver the notices gRPC already holds. Every caller (the timer, a
        read on any thread) waits for the one verdict, on ``over``, without the lock."""
        with self.state_lock:
            if self.settled():
                return
            if self.judged_at is None:
                assert self.ends is not None
                self.judged_at = judgement_time(self.ends, time.monotonic(), SETTLE_SECONDS)
            judged_at = self.judged_at
        self.over.wait(max(0.0, judged_at - time.monotonic()))
        self.judge()

    def judge(self) -> None:
        """Unless a notice came first, the lease is lost (``LEASE_EXPIRED``) whether or
        not the server's ``lost`` can arrive, and the stream is cancelled (the server
        releases whatever is left of the lock), so that no release waits for a server
        that may be unreachable."""
        with self.state_lock:
            if self.settled():
                return
            self.lost_reason = LEASE_EXPIRED
            self.lost.set()
        self.over.set()
        self.cancel()

    def confirm_release(self) -> None:
        """The server sent ``released``. It confirms a release this client asked for,
        unless the lease's end was told before (a ``lost`` that came first stays, as in
        the Rust client: the release returns False). One that nobody asked for ends the
        lease as lost (``DISCONNECTED``), as in the Rust client; the stream, which has
        nothing more to say, is cancelled, so no release waits for its end."""
        with self.state_lock:
            if self.lost.is_set() or self.released.is_set():
                return
            if self.releasing:
                self.released.set()
                return
            self.lost_reason = DISCONNECTED
            self.lost.set()
        self.over.set()
        self.disarm()
        self.cancel()

    def drop(self) -> None:
        """The lease was garbage collected: cancels the stream and the timer. In a child
        process the timer is the parent's too, and a cancel of it would touch a
        condition a thread of the parent's may have held at the fork."""
        if self.inherited:
            return
        self.disarm()
        self.cancel()

    def read(self) -> None:
        """The reader thread: follows the stream to its end."""
        ended = LockError(grpc.StatusCode.UNKNOWN, "the lease's reader failed")
        try:
            for resp in self.call:
                event = resp.WhichOneof("event")
                if event == "released":
                    self.confirm_release()
                elif event == "lost":
                    self.mark_lost(lost_reason_name(resp.lost.reason))
            ended = LockError(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            ended = error_from_rpc(err)
        finally:
            self.disarm()  # the stream is over: nothing left for the timer to end
            self.end(ended)
            self.requests.put(None)  # ends the request iterator thread

    def end(self, ended: LockError) -> None:
        """The stream ended with the status ``ended``. While a release is under way,
        before ``released``, that is the release's failure, not a loss: its outcome is
        unknown (the server gives the lock back once it can). But for a revoke, which
        overtook the release: the server gave the lock back, the lease was lost."""
        reason = ended_reason(ended)
        with self.state_lock:
            if self.lost.is_set():
                if self.lost_code is None and ended.code != grpc.StatusCode.OK:
                    self.lost_code = ended.code
                    self.lost_info = ended.info
            elif self.released.is_set():
                pass
            elif self.releasing and ends_a_release(reason):
                self.failure = release_error(ended)
            else:
                self.lost_reason = reason
                self.lost_code = ended.code
                self.lost_info = ended.info
                self.lost.set()
        self.ended.set()
        self.over.set()

    def outcome(self) -> bool:
        """What ``release()`` returns once the stream ended (or the wait gave up):
        True when released, False when the lease had been lost, else it raises."""
        return release_outcome(self.released.is_set(), self.lost.is_set(), self.timed_out, self.failure)


class Lease(LeaseInfo):
    """A held lock: the open Acquire stream.

    Attributes: ``fencing_token`` (int), ``fencing_tokens`` (multi-lock), ``hold_count``,
    ``owner``, ``lease`` (timedelta in force: the watchdog timeout, or how long a fixed
    lease lasts, a tenth less than asked and at most 100 ms and a thousandth of it,
    for RedLock at least the clock drift, 1% plus 2 ms, less), ``lost`` (a
    ``threading.Event`` set when the lease ended without the client asking) and
    ``lost_reason`` ("LEASE_EXPIRED",
    "NOT_HELD", "FORCE_RELEASED", "SHUTDOWN" or "DISCONNECTED"). ``lost`` is set only
    when the lease is lost, never on a release this client asked for: ``wait_lost()``
    also returns when the stream ends otherwise. A ``released`` the server sends while
    no release is under way is a loss (``DISCONNECTED``), as in the Rust client.

    A fixed lease is lost (``LEASE_EXPIRED``) at its end by the client's own clock too,
    counted from before the request was sent, so a holder the server's notice cannot
    reach (a silent partition) is told in time; its stream is then cancelled.

    Keep a reference to the lease for as long as the work needs the lock: a lease the
    program drops without ``release()`` is released when it is garbage collected (at
    once in CPython), as the Rust client's is on drop. Its stream is cancelled, and the
    server releases the lock; ``lost`` is then set (``DISCONNECTED``, code CANCELLED)
    for whoever still holds that event.

    In a child process after ``os.fork()``, a lease of the parent's is lost
    (``DISCONNECTED``, no code): the lock stays the parent's, and nothing done to the
    lease there (a release, leaving its block, dropping it) calls into gRPC. gRPC's
    own code is beyond the client's reach: end such a child with ``os._exit()`` where
    possible, as multiprocessing does.
    """

    def __init__(self, name, call, requests, acquired: pb.Acquired, ends: Optional[float] = None) -> None:
        self._set_acquired(name, acquired)
        self._stream = stream = _Stream(call, requests, ends)
        self.lost = stream.lost
        stream.arm(name)  # before the reader, which clears the timer when the stream ends
        self._reader = threading.Thread(target=stream.read, name=f"latchkey-lease-{name}", daemon=True)
        self._reader.start()
        # Holds the stream, not the lease. Not at exit: the process's end closes the
        # connection, and the server releases then.
        self._finalizer = weakref.finalize(self, stream.drop)
        self._finalizer.atexit = False

    @property
    def lost_reason(self) -> Optional[str]:  # type: ignore[override]
        """Why the lease was lost, or None."""
        self._stream.expire_if_due()
        return self._stream.lost_reason

    @property
    def lost_code(self) -> Optional[grpc.StatusCode]:
        """gRPC status code that ended the stream after a loss, when known."""
        return self._stream.lost_code

    @property
    def lost_info(self) -> Dict[str, str]:
        """The ``ErrorInfo`` metadata of that status (``lostReason``, ``lockName``
        after the server's ``lost``), or {}."""
        return self._stream.lost_info

    @property
    def held(self) -> bool:
        """True while the stream is open, no loss was reported and a fixed lease has
        not reached its end."""
        stream = self._stream
        if stream.due():  # False at once: the verdict (the reason) is the timer's
            return False
        return not stream.ended.is_set() and not stream.lost.is_set() and not stream.releasing

    @property
    def released(self) -> bool:
        """True once the server confirmed a release this client asked for."""
        return self._stream.released.is_set()

    def release(self, timeout: float = RELEASE_TIMEOUT) -> bool:
        """Releases the lock: sends ``release``, waits (at most ``timeout`` s) for
        ``released`` and the end of the stream, and cancels the stream if it does not
        come (the server releases on cancel too). Idempotent.

        Returns True when the server confirmed the release, False whenever the lease
        was lost: before the call (its stream ended with ``lost``, a fixed lease past
        its end, the client closed, a ``released`` nobody asked for, a lease of the
        parent's in a forked child, whose release sends nothing) or while the
        release was on its way (``lost`` came instead of, or before, ``released``: the
        first end told stays). Raises ``LockError`` when the release failed and
        the lease was not lost: with the status that ended the stream (UNAVAILABLE: the
        server could not reach Redis, and gives the lock back once it answers), or
        DEADLINE_EXCEEDED when no answer came in ``timeout`` (a plain ``LockError``,
        not ``LockTimeout``)."""
        stream = self._stream
        stream.expire_if_due()
        stream.disarm()
        with stream.state_lock:
            first = not stream.releasing
            stream.releasing = True
        if first and not stream.ended.is_set():
            stream.requests.put(pb.AcquireRequest(release=pb.Release()))
            stream.requests.put(None)  # half-close too
        if not stream.ended.wait(time_bound(timeout)):
            with stream.state_lock:
                stream.timed_out = timeout
            stream.cancel()
            stream.ended.wait(1.0)
        return stream.outcome()

    def wait_lost(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the lease is over (or ``timeout`` s ran out); returns whether it
        was lost. Unlike ``lost.wait()``, it also returns (False) once the stream ended
        otherwise: released, or a release that failed."""
        stream = self._stream
        stream.expire_if_due()
        stream.over.wait(time_bound(timeout))
        return stream.lost.is_set()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A release's failure is raised only when the block did not raise: the block's
        # own exception says more.
        try:
            self.release()
        except LockError:
            if exc_type is None:
                raise


class LockRequest:
    """What ``Client.lock`` returns: a context manager that acquires on ``__enter__``
    (returning the ``Lease``) and releases on ``__exit__``, even after an exception.
    One may serve blocks in several threads at once, or nested: each block releases
    the lease it took."""

    def __init__(self, client: "Client", name, kwargs) -> None:
        self._client = client
        self._name = name
        self._kwargs = kwargs
        self._blocks = Blocks()

    def __enter__(self) -> Lease:
        lease = self._client.acquire(self._name, **self._kwargs)
        self._blocks.push(lease)
        return lease

    def __exit__(self, *exc) -> None:
        lease = self._blocks.pop()
        if lease is not None:
            lease.__exit__(*exc)


class Client(ProcessBound):
    """A blocking latchkey client.

    ``target`` is a gRPC target: ``"host:port"`` or ``"unix:///path/to.sock"``; as a URL
    too, as the CLI and ``LATCHKEY_SERVER`` write it: ``"http://host:port"``, or
    ``"https://host:port"`` for TLS with the system's roots (port 80 or 443 when the
    URL gives none, as in the CLI; a URL with no host or a bad port raises ``ValueError``).
    ``credentials`` (``grpc.ChannelCredentials``) selects TLS, e.g.
    ``grpc.ssl_channel_credentials(root_certificates=ca_pem, private_key=key_pem,
    certificate_chain=cert_pem)`` for mTLS; ``token`` is sent as
    ``authorization: Bearer <token>`` with every call (printable ASCII, else
    ``ValueError`` here); ``metadata`` is sent with
    every call too; ``timeout`` bounds the unary calls (Describe, List,
    ForceRelease), not the lease.

    Create it in the process that uses it: in a child process after ``os.fork()``, a
    client of the parent's raises ``LockError`` CANCELLED on every call.
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Optional[Sequence[Tuple[str, object]]] = None,
        metadata: Optional[Metadata] = None,
        token: Optional[str] = None,
        timeout: Optional[float] = 30.0,
    ) -> None:
        header = None if token is None else authorization(token)
        target, credentials = grpc_target(target, credentials)
        self.target = target
        opts = channel_options(target, options)
        if credentials is not None:
            self._channel = grpc.secure_channel(target, credentials, options=opts)
        else:
            self._channel = grpc.insecure_channel(target, options=opts)
        self._stub = pb_grpc.LockServiceStub(self._channel)
        self._metadata = tuple(metadata or ())
        if header is not None:
            self._metadata += (header,)
        self._timeout = timeout
        self._closed = False
        #: The streams of this client's leases, for ``close()``; weak: a stream lives
        #: as long as its reader thread.
        self._streams: "weakref.WeakSet[_Stream]" = weakref.WeakSet()
        #: Guards ``_streams`` and ``_closed``: an acquire that completes on another
        #: thread adds to the set while ``close()`` goes through it, which raised
        #: ``RuntimeError: Set changed size during iteration``. Reentrant: a signal
        #: handler that closes the client (on SIGTERM, say) may interrupt the very
        #: thread that holds it, which a plain lock left waiting for itself for good.
        self._lock = threading.RLock()
        super().__init__()
        client_made()

    def forked(self) -> None:
        """In a child process after ``os.fork()``: the channel is the parent's, which gRPC
        does not carry over a fork. Every call raises (``forked_error``), and ``close()``
        leaves the channel alone: closing it would cancel the parent's streams. Its
        leases are lost here, each by its own ``forked``."""
        super().forked()
        self._lock = threading.RLock()
        self._closed = True
        keep_inherited(self._channel)

    @property
    def stub(self) -> pb_grpc.LockServiceStub:
        """The generated stub, for anything the wrapper does not cover."""
        return self._stub

    def close(self) -> None:
        """Closes the channel; open leases are lost (``DISCONNECTED``) and released by
        the server. Calls made afterwards raise ``LockError`` CANCELLED."""
        with self._lock:
            self._closed = True
            streams = list(self._streams)
        try:
            for stream in streams:
                stream.close()
        finally:
            if not self.inherited:
                self._channel.close()

    def _check_open(self) -> None:
        if self._closed or self.inherited:
            raise self._closed_error()

    def _closed_error(self) -> LockError:
        return forked_error() if self.inherited else closed_error()

    def _start(self, method, *args, **kwargs):
        """Calls the stub's ``method``. A ``close()`` on another thread since
        ``_check_open`` makes gRPC refuse the closed channel with ``ValueError``: that
        reads as any call on a closed client does, ``LockError`` CANCELLED."""
        try:
            return method(*args, **kwargs)
        except ValueError:
            if self._closed or self.inherited:
                raise self._closed_error() from None
            raise

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- locks -------------------------------------------------------------
    def lock(
        self,
        name: Union[str, Sequence[str]],
        *,
        wait: Optional[Seconds] = None,
        lease: Optional[Seconds] = None,
        owner: Optional[str] = None,
        kind: Kind = None,
        permits: Optional[int] = None,
        limit: Optional[int] = None,
        redlock: bool = False,
        on_queued: Optional[Callable[[pb.Queued], None]] = None,
    ) -> LockRequest:
        """``with client.lock("orders", wait=10) as lease:`` holds the lock for the block.

        ``wait``: None (or ``math.inf``) waits until granted, 0 tries once, >0 waits at
        most that many seconds (or a timedelta); ``LockTimeout`` when it runs out.
        ``lease``: None keeps the lock as long as the block runs (server watchdog); a
        value is a fixed lease, lost (``LEASE_EXPIRED``) at its end on the client's own
        clock too. ``kind``: "mutex" (default), "fair", "read", "write", "semaphore" (or
        the enum). ``name`` may be a list of names for a multi-lock (all or none; a list
        of one name is that lock; any iterable, read here once, so that each block of
        the request takes the same locks; an empty one is a ``ValueError``).
        ``on_queued`` is called with the server's ``pb.Queued`` (``position``,
        ``holder_ttl``) when the request has to wait, on the acquiring thread; an
        exception it raises withdraws the request and propagates.
        """
        if self.inherited:
            raise forked_error()  # no block of it could be entered here
        return LockRequest(
            self,
            given_names(name),
            dict(
                wait=wait, lease=lease, owner=owner, kind=kind, permits=permits, limit=limit, redlock=redlock,
                on_queued=on_queued,
            ),
        )

    def acquire(
        self,
        name: Union[str, Sequence[str]],
        *,
        wait: Optional[Seconds] = None,
        lease: Optional[Seconds] = None,
        owner: Optional[str] = None,
        kind: Kind = None,
        permits: Optional[int] = None,
        limit: Optional[int] = None,
        redlock: bool = False,
        on_queued: Optional[Callable[[pb.Queued], None]] = None,
    ) -> Lease:
        """Acquires and returns the ``Lease`` (call ``release()`` or use it in ``with``);
        the arguments are ``lock()``'s."""
        self._check_open()
        name = given_names(name)
        first = build_open(
            name, wait=wait, lease=lease, owner=owner, kind=kind, permits=permits, limit=limit, redlock=redlock
        )
        requests: "queue.Queue[Optional[pb.AcquireRequest]]" = queue.Queue()
        requests.put(first)
        asked = time.monotonic()
        call = self._start(self._stub.Acquire, _requests(requests), metadata=self._metadata)
        # What `on_queued` raises is the caller's, even a grpc.RpcError of another call:
        # it withdraws the request (the call cancelled) and propagates as it is.
        in_callback = False
        try:
            for resp in call:
                event = resp.WhichOneof("event")
                if event == "acquired":
                    ends = fixed_lease_end(asked, first.open, resp.acquired)
                    lease = Lease(name, call, requests, resp.acquired, ends)
                    with self._lock:
                        if not self._closed:
                            self._streams.add(lease._stream)
                    # Granted as close() ran (on another thread, or in a signal handler
                    # amid the add): its call is cancelled.
                    if self._closed:
                        lease._stream.close()
                    return lease
                if event == "queued":
                    if on_queued is not None:
                        in_callback = True
                        on_queued(resp.queued)
                        in_callback = False
                    continue
                if event == "lost":
                    raise LockError(grpc.StatusCode.ABORTED, f"lost before acquired: {lost_reason_name(resp.lost.reason)}")
            raise LockError(grpc.StatusCode.UNKNOWN, "Acquire stream ended before the lock was acquired")
        except BaseException as err:
            if isinstance(err, grpc.RpcError) and not in_callback:
                requests.put(None)
                raise acquire_error(err) from None
            call.cancel()
            requests.put(None)
            raise

    # -- inspection and administration ------------------------------------
    def _unary(self, method, request, timeout):
        self._check_open()
        try:
            timeout = time_bound(self._timeout if timeout is None else timeout)
            return self._start(method, request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None

    def describe(self, name: str, *, timeout: Optional[float] = None) -> pb.LockState:
        """The state of one lock (holders, waiters, last fencing token)."""
        return self._unary(self._stub.Describe, pb.DescribeRequest(name=text(name, "name")), timeout)

    def list(self, prefix: str = "", *, page_size: int = 0, timeout: Optional[float] = None) -> List[pb.LockState]:
        """Every lock whose name starts with ``prefix``, following the pages (and
        stopping at a page token the server already gave)."""
        prefix = text(prefix, "prefix")
        out: List[pb.LockState] = []
        token = ""
        seen: set = set()
        while True:
            page = self._unary(
                self._stub.List, pb.ListRequest(prefix=prefix, page_size=page_size, page_token=token), timeout
            )
            out.extend(page.locks)
            token = next_page_token(seen, page.next_page_token)
            if not token:
                return out

    def force_release(self, name: str, *, timeout: Optional[float] = None) -> bool:
        """Breaks a lock whatever its holders; True when it was held."""
        return self._unary(self._stub.ForceRelease, pb.ForceReleaseRequest(name=text(name, "name")), timeout).released

    def watch(self, name: str) -> "Watch":
        """Streams ``LockState`` snapshots of one lock: iterate it; ``close()`` (or leave
        its ``with`` block) to stop."""
        self._check_open()
        request = pb.WatchRequest(name=text(name, "name"))
        return Watch(self._start(self._stub.Watch, request, metadata=self._metadata), self)


class Watch(ProcessBound):
    """An iterator of ``LockState``; a context manager that cancels the stream.
    Iteration ends when the stream or its client is closed; a CANCELLED the other side
    sent (a proxy resetting the stream) raises ``LockError``, as any other failure."""

    def __init__(self, call, client: "Client") -> None:
        self._call = call
        self._client = client
        self._closed = False
        super().__init__()

    def forked(self) -> None:
        """In a child process after ``os.fork()``: the stream is the parent's. Reading it
        raises, and ``close()`` does not cancel it (see ``Client.forked``)."""
        super().forked()
        keep_inherited(self._call)

    def __iter__(self) -> "Watch":
        return self

    def __next__(self) -> pb.LockState:
        if self.inherited:
            raise forked_error()
        try:
            return next(self._call)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and (self._closed or self._client._closed):
                raise StopIteration from None
            raise error_from_rpc(err) from None

    def close(self) -> None:
        self._closed = True
        self.cancel_own(self._call)

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
