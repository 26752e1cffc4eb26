"""The asyncio client, on grpc.aio.

    async with latchkey.aio.Client("127.0.0.1:50051") as client:
        async with client.lock("orders", wait=10) as lease:
            ...  # lease.lost is an asyncio.Event

Create the client inside the event loop that uses it.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import grpc
import grpc.aio

from latchkey._common import (
    DISCONNECTED,
    LEASE_EXPIRED,
    RELEASE_TIMEOUT,
    Blocks,
    Kind,
    LeaseInfo,
    LockError,
    LockTimeout,
    ProcessBound,
    Seconds,
    acquire_error,
    authorization,
    build_open,
    channel_options,
    client_made,
    closed_error,
    ended_reason,
    ends_a_release,
    error_from_rpc,
    fixed_lease_end,
    forked_error,
    given_names,
    grpc_target,
    judgement_time,
    keep_inherited,
    lost_reason_name,
    next_page_token,
    release_error,
    release_outcome,
    text,
    time_bound,
)
from latchkey.v1 import latchkey_pb2 as pb
from latchkey.v1 import latchkey_pb2_grpc as pb_grpc

__all__ = ["Client", "Lease", "LockError", "LockTimeout", "Watch"]

Metadata = Sequence[Tuple[str, str]]


#: How long the verdict on a fixed lease's end waits for the notices already received
#: (then ``SETTLE_TURNS`` loop turns more). A notice that arrived while the loop was
#: stalled (the server's ``lost``) is in gRPC, not yet read by the reader task: a read
#: under way is completed at the loop's next poll and read the turn after, a read the
#: reader issues only after the stall completes a little later, from gRPC's poller
#: thread. Waiting for both lets the notice say why the lease ended, rather than
#: ``LEASE_EXPIRED`` by the client's clock. The wait starts this long before the end, so
#: on a loop that runs on time ``lost`` is set at the end itself (the holder must know
#: before Redis can give the lock to another); after a stall, this long after it.
#: ``held`` reads False from the end on, at once.
SETTLE_SECONDS = 0.05
SETTLE_TURNS = 3

#: What to do in a process forked while a client of this module existed: gRPC's asyncio
#: layer (one completion queue per process, polled by a thread of its own) was in use at
#: the fork, and a new channel's calls hang in the child, where that thread is gone.
_AFTER_FORK = (
    "gRPC's asyncio layer does not work in a process forked while it was in use: fork before "
    "creating any latchkey.aio.Client (or start the process with 'spawn' or 'forkserver'), "
    "or use latchkey.Client here"
)

#: Whether this process was forked while a client of this module existed (see
#: ``_AFTER_FORK``): a new client raises at once rather than hang at its first call.
_grpc_aio_inherited = False

#: The running reader tasks: the loop keeps only weak references to tasks, and a lease
#: must not keep its own, or it would never be garbage collected.
_READERS: Set["asyncio.Task[None]"] = set()


class _Stream(ProcessBound):
    """The open Acquire stream of a lease and what its reader task learnt from it.

    The reader task (and a fixed lease's end timer) holds this, never the ``Lease``: a
    lease the program no longer references is garbage collected, and its finalizer
    cancels the stream, as the blocking client's does.
    """

    def __init__(self, call: grpc.aio.StreamStreamCall, ends: Optional[float]) -> None:
        self.call = call
        self.loop = asyncio.get_running_loop()
        #: A fixed lease's end on the loop's clock; None for a watchdog lease.
        self.ends = ends
        self.lost = asyncio.Event()
        #: Set once the lease is over: lost, or its stream ended (released, or a
        #: release that failed), so that ``wait_lost()`` does not wait for good.
        self.over = asyncio.Event()
        self.lost_reason: Optional[str] = None
        self.lost_code: Optional[grpc.StatusCode] = None
        self.lost_info: Dict[str, str] = {}
        self.released = False
        self.releasing = False
        self.ended = False
        #: The client's ``close()`` ran, which cancels the call.
        self.closed = False
        #: What the release raises: the status that ended the stream while it was under way.
        self.failure: Optional[LockError] = None
        #: The release got no answer in time (its ``timeout``, in s).
        self.timed_out: Optional[float] = None
        #: Resolved once a fixed lease's end has been judged (see ``SETTLE_SECONDS``).
        self.judged: Optional[asyncio.Future] = None
        super().__init__()
        self.timer = None if ends is None else self.loop.call_at(ends - SETTLE_SECONDS, self.expire)
        self.reader = self.loop.create_task(self.read())
        _READERS.add(self.reader)
        self.reader.add_done_callback(_READERS.discard)
        self.reader.add_done_callback(self.reader_done)

    def forked(self) -> None:
        """In a child process after ``os.fork()``: as the blocking client's ``forked``,
        the lease is lost here at once (``DISCONNECTED``, with no code) and no path calls
        into gRPC again. The loop, its reader task and its timer are the parent's: the
        child runs them only if it goes on running the parent's loop, which asyncio does
        not support either, and which no care here makes safe: grpc.aio's own reader of
        the call cancels it when its task is cancelled (as ``asyncio.run`` does on its
        way out), which can end the parent's stream. A child forked inside a running
        loop must end with ``os._exit()``, as multiprocessing's do, and never return
        into that loop."""
        super().forked()
        keep_inherited(self.call)
        self.timer = None
        if not (self.lost.is_set() or self.released or self.ended):
            self.lost_reason = DISCONNECTED
            _set_in_child(self.lost)
        self.ended = True
        _set_in_child(self.over)

    def cancel(self) -> None:
        self.cancel_own(self.call)

    def reader_done(self, reader: asyncio.Task) -> None:
        """A reader cancelled before its first step (code that cancels every other task
        right after an acquire) never ran its ``finally``: the stream is over all the
        same. Its call is cancelled, which gives the lock back, and the lease ends
        lost, as after a cancel mid-read; a release under way then returns False (the
        lock is given back either way, and no answer can be read)."""
        if reader.cancelled() and not self.ended:
            self.cancel()
            self.disarm()
            self.mark_lost(DISCONNECTED, grpc.StatusCode.CANCELLED)
            self.end(LockError(grpc.StatusCode.CANCELLED, "the lease's reader was cancelled"))

    async def reader_over(self) -> None:
        """Waits for the reader's end, however it ended (a cancelled reader too, which
        ``shield`` would raise into the waiting task), without cancelling it."""
        await asyncio.wait([self.reader])

    def mark_lost(self, reason: str, code: Optional[grpc.StatusCode] = None) -> None:
        if self.lost.is_set() or self.released:
            return
        self.lost_reason = reason
        self.lost_code = code
        self.lost.set()
        self.over.set()

    def close(self) -> None:
        """The client is being closed, which cancels the stream: the lease is lost
        (``DISCONNECTED``, code CANCELLED) now, before the reader hears of the cancel,
        so that a ``release()`` that follows returns False as after any loss. A release
        already under way is not a loss: its outcome says how it ended."""
        self.closed = True
        if not (self.releasing or self.ended):
            self.mark_lost(DISCONNECTED, grpc.StatusCode.CANCELLED)
        # The channel's close cancels it too; this one does not depend on how it finds
        # its calls.
        self.cancel()

    def due(self) -> bool:
        """Whether a fixed lease has reached its end by the loop's clock."""
        return self.ends is not None and self.loop.time() >= self.ends

    def expire_if_due(self) -> None:
        """Reads of the lease's state see its end even before the timer has run. A read
        on another thread (``run_in_executor``) hands the end over to the loop: the
        verdict's future and timer are the loop's, and a loop asleep must be woken. A
        child process's copy has nothing left to judge, and its loop is the parent's."""
        if self.inherited or not self.due():
            return
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self.expire()
            return
        try:
            self.loop.call_soon_threadsafe(self.expire)
        except RuntimeError:
            pass  # the loop is closed, and its channel with it: the stream is over

    def expire(self) -> None:
        """A fixed lease's end by the client's clock, near (``SETTLE_SECONDS`` before
        it) or past: judged at the end, and no sooner than the notices already received
        have been read."""
        if self.judged is None and not (self.releasing or self.ended or self.lost.is_set()):
            assert self.ends is not None
            self.judged = self.loop.create_future()
            at = judgement_time(self.ends, self.loop.time(), SETTLE_SECONDS)
            self.loop.call_at(at, self.judge, SETTLE_TURNS)

    def judge(self, turns: int) -> None:
        """Unless a notice came first, the lease is lost (``LEASE_EXPIRED``) whether or
        not the server's ``lost`` can arrive, and the stream cancelled (the server
        releases whatever is left of the lock), so that no release waits for an
        unreachable server."""
        if turns > 0:
            self.loop.call_soon(self.judge, turns - 1)
            return
        if not (self.releasing or self.ended or self.lost.is_set()):
            self.mark_lost(LEASE_EXPIRED)
            self.cancel()
        assert self.judged is not None
        self.judged.set_result(None)

    async def judge_end(self) -> None:
        """Past a fixed lease's end: waits for its verdict (a release asked for before
        the end goes ahead)."""
        self.expire_if_due()
        if self.judged is not None and self.due():
            await asyncio.shield(self.judged)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def confirm_release(self) -> None:
        """The server sent ``released``. It confirms a release this client asked for,
        unless the lease's end was told before (a ``lost`` that came first stays, as in
        the Rust client: the release returns False). One that nobody asked for ends the
        lease as lost (``DISCONNECTED``), as in the Rust client; the stream, which has
        nothing more to say, is cancelled, so no release waits for its end."""
        if self.lost.is_set() or self.released:
            return
        if self.releasing:
            self.released = True
            return
        self.mark_lost(DISCONNECTED)
        self.disarm()
        self.cancel()

    def drop(self) -> None:
        """The lease was garbage collected: cancels the stream and the timer, unless they
        are the parent's (see ``drop_soon``)."""
        if self.inherited:
            return
        self.disarm()
        self.cancel()

    def drop_soon(self) -> None:
        """The finalizer: it may run on any thread, the call is the loop's. In a child
        process, the loop is the parent's, and so is the call: waking the loop would
        write to the parent's self-pipe."""
        if self.inherited:
            return
        try:
            self.loop.call_soon_threadsafe(self.drop)
        except RuntimeError:
            pass  # the loop is closed, and its channel with it: the stream is over

    async def read(self) -> None:
        """The reader task: follows the stream to its end."""
        ended = LockError(grpc.StatusCode.UNKNOWN, "the lease's reader failed")
        try:
            while True:
                resp = await self.call.read()
                if resp is grpc.aio.EOF:
                    break
                event = resp.WhichOneof("event")
                if event == "released":
                    self.confirm_release()
                elif event == "lost":
                    self.mark_lost(lost_reason_name(resp.lost.reason))
            ended = LockError(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as err:
            ended = error_from_rpc(err)
        except asyncio.CancelledError:
            # grpc.aio raises this from read() on a call cancelled on this side (a
            # lease's end, a drop, a release with no answer, the channel's close), and
            # into this task when the loop shuts down: either way the stream is over,
            # and this task, the lease's own, just ends.
            ended = LockError(grpc.StatusCode.CANCELLED, "the call was cancelled")
        finally:
            self.disarm()  # the stream is over: nothing left for the timer to end
            self.end(ended)

    def end(self, ended: LockError) -> None:
        """The stream ended with the status ``ended``. While a release is under way,
        before ``released``, that is the release's failure, not a loss: its outcome is
        unknown (the server gives the lock back once it can). But for a revoke, which
        overtook the release: the server gave the lock back, the lease was lost."""
        if self.lost.is_set():
            if self.lost_code is None and ended.code != grpc.StatusCode.OK:
                self.lost_code = ended.code
                self.lost_info = ended.info
        elif self.released:
            pass
        elif self.releasing and ends_a_release(ended_reason(ended)):
            self.failure = release_error(ended)
        else:
            self.mark_lost(ended_reason(ended), ended.code)
            self.lost_info = ended.info
        self.ended = True
        self.over.set()

    async def send_release(self) -> None:
        """Sends ``release``, half-closes, and waits for the end of the stream."""
        try:
            await self.call.write(pb.AcquireRequest(release=pb.Release()))
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass  # the stream is over: its end says how
        except asyncio.CancelledError:
            # grpc.aio raises this from a write or half-close on a call cancelled on this
            # side (the client's close(), the lease's reader task cancelled, which
            # cancels its call): the stream is over, and its end says how, as for an
            # acquire. A cancel of the task is its own.
            # Before Python 3.11 it is the call's only when the stream is known over.
            cancelling = _task_cancelling()
            if cancelling or (cancelling is None and not (self.closed or self.call.done())):
                raise
        await self.reader_over()

    def outcome(self) -> bool:
        """What ``release()`` returns once the stream ended (or the wait gave up):
        True when released, False when the lease had been lost, else it raises."""
        return release_outcome(self.released, self.lost.is_set(), self.timed_out, self.failure)


class Lease(LeaseInfo):
    """A held lock; like ``latchkey.Lease`` but ``lost`` is an ``asyncio.Event`` and
    ``release()`` and ``wait_lost()`` are coroutines. A fixed lease is lost
    (``LEASE_EXPIRED``) at its end by the client's own clock too, as the blocking
    client's is: one ``call_at`` on the loop. ``held`` reads False from the end on, and
    ``lost`` is set then on a loop that runs on time; after a stall past the end,
    ``SETTLE_SECONDS`` later, once a notice already received (a ``FORCE_RELEASED`` read
    late) has had its say.

    A lease the program drops without ``release()`` is released when it is garbage
    collected (at once in CPython): its stream is cancelled, and the server releases
    the lock; ``lost`` is then set (``DISCONNECTED``, code CANCELLED).

    In a child process after ``os.fork()``, a lease of the parent's is lost
    (``DISCONNECTED``, no code), and nothing the client does with it there calls into
    gRPC. A child forked inside a running loop must still end with ``os._exit()`` and
    never return into that loop: its tasks are the parent's, and grpc.aio's own, once
    cancelled there (``asyncio.run`` cancels them on its way out), cancel the parent's
    call.

    The lease belongs to its loop. Only its read-only properties (``held``,
    ``lost_reason``, ``lost_code``, ``lost_info``, ``released`` and the grant's
    attributes) may be read from another thread, e.g. a ``run_in_executor`` job that
    checks ``held`` between steps; ``release()``, ``wait_lost()`` and ``lost`` are for
    the loop's own tasks."""

    def __init__(
        self, name, call: grpc.aio.StreamStreamCall, acquired: pb.Acquired, ends: Optional[float] = None
    ) -> None:
        self._set_acquired(name, acquired)
        self._stream = stream = _Stream(call, ends)
        self.lost = stream.lost
        # Holds the stream, not the lease. Not at exit: the process's end closes the
        # connection, and the server releases then.
        self._finalizer = weakref.finalize(self, stream.drop_soon)
        self._finalizer.atexit = False

    @property
    def lost_reason(self) -> Optional[str]:  # type: ignore[override]
        """Why the lease was lost, or None (also just after a fixed lease's end, before
        its verdict: see ``SETTLE_SECONDS``)."""
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
        stream.expire_if_due()
        return not (stream.ended or stream.lost.is_set() or stream.releasing or stream.due())

    @property
    def released(self) -> bool:
        """True once the server confirmed a release this client asked for."""
        return self._stream.released

    async def release(self, timeout: float = RELEASE_TIMEOUT) -> bool:
        """Sends ``release``, waits (at most ``timeout`` s) for ``released`` and the end
        of the stream, cancels the stream otherwise. Idempotent. As
        ``latchkey.Lease.release``: True when the server confirmed, False whenever the
        lease was lost, before the call or while the release was on its way,
        ``LockError`` when the release failed (the stream's status, or
        DEADLINE_EXCEEDED when no answer came in ``timeout``). In a child process after
        ``os.fork()``, a lease of the parent's was lost at the fork: False at once."""
        stream = self._stream
        if stream.inherited:
            return stream.outcome()  # nothing of the parent's loop or call is awaited
        await stream.judge_end()
        stream.disarm()
        first = not stream.releasing
        stream.releasing = True
        try:
            if first and not (stream.ended or stream.lost.is_set()):
                await asyncio.wait_for(stream.send_release(), timeout)
            else:
                await asyncio.wait_for(stream.reader_over(), timeout)
        except asyncio.TimeoutError:
            stream.timed_out = timeout
            stream.cancel()
            try:
                await asyncio.wait_for(stream.reader_over(), 1.0)
            except asyncio.TimeoutError:
                pass
        except asyncio.CancelledError:
            # Cancelled before the release was known to reach the server (before Python
            # 3.12, ``wait_for`` may cancel the send's task before it ever ran): the call
            # is cancelled, which frees the lock once the server hears of it, rather
            # than leave the stream open, renewed, with ``held`` already False.
            stream.cancel()
            raise
        return stream.outcome()

    async def wait_lost(self, timeout: Optional[float] = None) -> bool:
        """Waits until the lease is over (or ``timeout`` s ran out); returns whether it
        was lost. Unlike ``lost.wait()``, it also returns (False) once the stream ended
        otherwise: released, or a release that failed."""
        stream = self._stream
        stream.expire_if_due()
        try:
            await asyncio.wait_for(stream.over.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return stream.lost.is_set()

    async def __aenter__(self) -> "Lease":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        # Release even if the task is being cancelled (as LockRequest does). A
        # release's failure is raised only when the block did not raise.
        try:
            await asyncio.shield(self.release())
        except LockError:
            if exc_type is None:
                raise


class LockRequest:
    """What ``Client.lock`` returns: ``async with`` acquires and releases. One may serve
    blocks in several tasks at once, or nested: each block releases the lease it took."""

    def __init__(self, client: "Client", name, kwargs) -> None:
        self._client = client
        self._name = name
        self._kwargs = kwargs
        self._blocks = Blocks()

    async def __aenter__(self) -> Lease:
        lease = await self._client.acquire(self._name, **self._kwargs)
        self._blocks.push(lease)
        return lease

    async def __aexit__(self, *exc) -> None:
        lease = self._blocks.pop()
        if lease is not None:
            await lease.__aexit__(*exc)


class Client(ProcessBound):
    """An asyncio latchkey client; same arguments as ``latchkey.Client``."""

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
        if _grpc_aio_inherited:
            raise RuntimeError(f"latchkey.aio: {_AFTER_FORK}")
        header = None if token is None else authorization(token)
        target, credentials = grpc_target(target, credentials)
        self.target = target
        opts = channel_options(target, options)
        if credentials is not None:
            self._channel = grpc.aio.secure_channel(target, credentials, options=opts)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=opts)
        self._stub = pb_grpc.LockServiceStub(self._channel)
        self._metadata = tuple(metadata or ())
        if header is not None:
            self._metadata += (header,)
        self._timeout = timeout
        self._closed = False
        #: The streams of this client's leases, for ``close()``; weak: a stream lives
        #: as long as its reader task.
        self._streams: "weakref.WeakSet[_Stream]" = weakref.WeakSet()
        super().__init__()
        client_made()

    def forked(self) -> None:
        """In a child process after ``os.fork()``: the channel (and its loop) are the
        parent's. Every call raises (``forked_error``), and ``close()`` leaves the
        channel alone, as in the blocking client. gRPC's asyncio layer is of no use
        in this process any more (``_AFTER_FORK``)."""
        global _grpc_aio_inherited
        _grpc_aio_inherited = True
        super().forked()
        self._closed = True
        keep_inherited(self._channel)

    @property
    def stub(self) -> pb_grpc.LockServiceStub:
        return self._stub

    async def close(self) -> None:
        """Closes the channel: open leases are lost (``DISCONNECTED``; the server
        releases them), an acquire still waiting raises ``LockError`` CANCELLED, as do a
        ``describe()``, ``list()`` or ``force_release()`` waiting for its answer, a
        ``release()`` under way whose outcome is then unknown, and calls made
        afterwards; a ``Watch`` being iterated ends."""
        self._closed = True
        for stream in list(self._streams):
            stream.close()
        if not self.inherited:
            await self._channel.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

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
        """``async with client.lock("orders", wait=10) as lease:``; see
        ``latchkey.Client.lock``. ``on_queued`` is a plain function, called on the loop."""
        if self.inherited:
            raise forked_error(_AFTER_FORK)  # no block of it could be entered here
        return LockRequest(
            self,
            given_names(name),
            dict(
                wait=wait, lease=lease, owner=owner, kind=kind, permits=permits, limit=limit, redlock=redlock,
                on_queued=on_queued,
            ),
        )

    async def acquire(
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
        """Acquires and returns the ``Lease``; the arguments are ``lock()``'s."""
        self._check_open()
        name = given_names(name)
        first = build_open(
            name, wait=wait, lease=lease, owner=owner, kind=kind, permits=permits, limit=limit, redlock=redlock
        )
        asked = asyncio.get_running_loop().time()
        call = self._stub.Acquire(metadata=self._metadata)
        # What `on_queued` raises is the caller's (see the blocking client's acquire).
        in_callback = False
        try:
            await _write_first(call, first)
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    # A failed stream raises from read(); EOF with OK means no grant.
                    code = await call.code()
                    if code != grpc.StatusCode.OK:
                        raise acquire_error(_StatusError(code, await call.details(), await call.trailing_metadata()))
                    raise LockError(grpc.StatusCode.UNKNOWN, "Acquire stream ended before the lock was acquired")
                event = resp.WhichOneof("event")
                if event == "acquired":
                    ends = fixed_lease_end(asked, first.open, resp.acquired)
                    lease = Lease(name, call, resp.acquired, ends)
                    if self._closed:
                        lease._stream.close()  # granted as close() ran: its call is cancelled
                    else:
                        self._streams.add(lease._stream)
                    return lease
                if event == "queued" and on_queued is not None:
                    in_callback = True
                    on_queued(resp.queued)
                    in_callback = False
                if event == "lost":
                    raise LockError(grpc.StatusCode.ABORTED, f"lost before acquired: {lost_reason_name(resp.lost.reason)}")
        except asyncio.CancelledError:
            call.cancel()
            # grpc.aio raises this from read() on a call that close() cancelled too: the
            # task was not cancelled, the call was.
            self._raise_if_closed()
            raise
        except BaseException as err:
            if isinstance(err, grpc.aio.AioRpcError) and not in_callback:
                raise acquire_error(err) from None
            call.cancel()
            raise

    def _check_open(self) -> None:
        if self._closed or self.inherited:
            raise forked_error(_AFTER_FORK) if self.inherited else closed_error()

    def _raise_if_closed(self) -> None:
        """Called on a ``CancelledError`` from grpc.aio: when ``close()`` ran and the
        task was not asked to cancel, the error is the channel's close cancelling the
        call, and the task, which nobody cancelled, gets ``LockError`` CANCELLED, as a
        call on the closed client does; its awaiter would take ``CancelledError`` for its
        own cancellation (``asyncio.gather`` cancels the others)."""
        if self._closed and not _task_cancelling():
            raise LockError(grpc.StatusCode.CANCELLED, "the client was closed") from None

    async def _unary(self, method, request, timeout):
        self._check_open()
        try:
            timeout = time_bound(self._timeout if timeout is None else timeout)
            return await method(request, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        except asyncio.CancelledError:
            # grpc.aio raises this from the await of a unary call close() cancelled.
            self._raise_if_closed()
            raise

    async def describe(self, name: str, *, timeout: Optional[float] = None) -> pb.LockState:
        return await self._unary(self._stub.Describe, pb.DescribeRequest(name=text(name, "name")), timeout)

    async def list(self, prefix: str = "", *, page_size: int = 0, timeout: Optional[float] = None) -> List[pb.LockState]:
        prefix = text(prefix, "prefix")
        out: List[pb.LockState] = []
        token = ""
        seen: set = set()
        while True:
            page = await self._unary(
                self._stub.List, pb.ListRequest(prefix=prefix, page_size=page_size, page_token=token), timeout
            )
            out.extend(page.locks)
            token = next_page_token(seen, page.next_page_token)
            if not token:
                return out

    async def force_release(self, name: str, *, timeout: Optional[float] = None) -> bool:
        request = pb.ForceReleaseRequest(name=text(name, "name"))
        return (await self._unary(self._stub.ForceRelease, request, timeout)).released

    def watch(self, name: str) -> "Watch":
        """Streams ``LockState`` snapshots of one lock, the current one first, then one
        per change: ``async with client.watch(name) as watch: async for state in watch:``.
        Leaving the ``async with`` block (or ``close()``, or the client's) stops it."""
        self._check_open()
        return Watch(self._stub.Watch(pb.WatchRequest(name=text(name, "name")), metadata=self._metadata), self)


class Watch(ProcessBound):
    """An async iterator of ``LockState``; an async context manager that cancels the
    stream. Iteration ends (``StopAsyncIteration``) when the stream is closed or its
    client is closed (a CANCELLED the other side sent raises ``LockError``). The server ends a watch only at its shutdown, which raises
    ``LockError`` UNAVAILABLE (reason ``SHUTTING_DOWN``), as in the blocking and Node
    clients; other failures raise ``LockError`` too. A read cancelled (a timeout around
    ``anext``) ends the stream, as grpc.aio cancels the call with it: the reads after it
    raise ``LockError`` CANCELLED."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, client: "Client") -> None:
        self._call = call
        self._client = client
        self._closed = False
        # A read was cancelled, and grpc.aio cancelled the call with it.
        self._interrupted = False
        super().__init__()

    def forked(self) -> None:
        """In a child process after ``os.fork()``: the stream is the parent's. Reading it
        raises, and ``close()`` does not cancel it."""
        super().forked()
        keep_inherited(self._call)

    def __aiter__(self) -> "Watch":
        return self

    async def __anext__(self) -> pb.LockState:
        if self.inherited:
            raise forked_error(_AFTER_FORK)
        if self._interrupted and not self._stopped():
            # grpc.aio would raise CancelledError, in a task nobody cancelled.
            raise LockError(grpc.StatusCode.CANCELLED, "an earlier read of this watch was cancelled, and the watch with it")
        try:
            state = await self._call.read()
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and self._stopped():
                raise StopAsyncIteration from None
            raise error_from_rpc(err) from None
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError from read() on a call cancelled here:
            # close(), or the client's (the channel's close cancels its calls), ends the
            # iteration, as it fails a pending acquire; any other cancel is the task's own.
            if self._stopped() and not _task_cancelling():
                raise StopAsyncIteration from None
            self._interrupted = True
            raise
        if state is grpc.aio.EOF:
            raise StopAsyncIteration
        return state

    def _stopped(self) -> bool:
        """Whether this watch or its client was closed."""
        return self._closed or (self._client is not None and self._client._closed)

    def close(self) -> None:
        """Cancels the stream; an iteration waiting on it ends."""
        self._closed = True
        self.cancel_own(self._call)

    async def __aenter__(self) -> "Watch":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


async def _write_first(call: grpc.aio.StreamStreamCall, request) -> None:
    """Writes the first request of a stream. grpc.aio's first ``write()`` waits until the
    call has sent its headers, which a call cancelled before then (``close()`` while the
    call starts: a new client still connecting, or the few ms after the call is created)
    never does, and the write waited for good. It is raced against the call's end here:
    a call cancelled on this side raises ``CancelledError``, as grpc.aio raises from a
    read or a write of such a call, which ``acquire()`` turns into ``LockError``
    CANCELLED when the client was closed; a call the transport ended raises its status."""
    ended = asyncio.get_running_loop().create_future()
    call.add_done_callback(lambda _: ended.done() or ended.set_result(None))
    write = asyncio.ensure_future(call.write(request))
    try:
        await asyncio.wait((write, ended), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not write.done():
            write.cancel()  # the call is over (or the task was cancelled): nothing to send
    if write.done() and not write.cancelled() and write.exception() is None:
        return
    if not call.done():
        return write.result()  # raises the write's own error
    if call.cancelled():
        raise asyncio.CancelledError()
    code = await call.code()
    if code != grpc.StatusCode.OK:
        raise acquire_error(_StatusError(code, await call.details(), await call.trailing_metadata()))


def _set_in_child(event: asyncio.Event) -> None:
    """Sets ``event`` in a child process after ``os.fork()``. Its waiters, if any, are
    tasks of the parent's loop, and a closed loop refuses to wake them: nobody is left
    there to wake."""
    try:
        event.set()
    except RuntimeError:
        pass


def _task_cancelling() -> Optional[bool]:
    """Whether the current task was asked to cancel; None where Python does not tell
    (before 3.11), and a cancel that comes with ``close()`` is taken for the close."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return None if cancelling is None else bool(cancelling())


class _StatusError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata=None) -> None:
        self._code = code
        self._details = details
        self._trailing_metadata = trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return self._trailing_metadata
