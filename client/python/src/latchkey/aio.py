"""The asyncio client, on grpc.aio.

    async with latchkey.aio.Client("127.0.0.1:50051") as client:
        async with client.lock("orders", wait=10) as lease:
            ...  # lease.lost is an asyncio.Event

Create the client inside the event loop that uses it.
"""

from __future__ import annotations

import asyncio
from typing import List, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from latchkey._common import (
    DISCONNECTED,
    LEASE_EXPIRED,
    RELEASE_TIMEOUT,
    Kind,
    LeaseInfo,
    LockError,
    LockTimeout,
    Seconds,
    build_open,
    channel_options,
    error_from_rpc,
    fixed_lease_end,
    lost_reason_name,
    next_page_token,
)
from latchkey.v1 import latchkey_pb2 as pb
from latchkey.v1 import latchkey_pb2_grpc as pb_grpc

__all__ = ["Client", "Lease", "LockError", "LockTimeout", "Watch"]

Metadata = Sequence[Tuple[str, str]]


class Lease(LeaseInfo):
    """A held lock; like ``latchkey.Lease`` but ``lost`` is an ``asyncio.Event`` and
    ``release()`` is a coroutine. A fixed lease is lost (``LEASE_EXPIRED``) at its end by
    the client's own clock too, as the blocking client's is: one ``call_at`` on the loop."""

    def __init__(
        self, name, call: grpc.aio.StreamStreamCall, acquired: pb.Acquired, ends: Optional[float] = None
    ) -> None:
        self._set_acquired(name, acquired)
        self._call = call
        self.lost = asyncio.Event()
        self._lost_reason: Optional[str] = None
        self.lost_code: Optional[grpc.StatusCode] = None
        self._released = False
        self._releasing = False
        # A fixed lease's end on the loop's clock; None for a watchdog lease.
        self._ends = ends
        self._expired = False
        self._loop = asyncio.get_running_loop()
        self._end_timer = None if ends is None else self._loop.call_at(ends, self._expire)
        self._reader = asyncio.ensure_future(self._read())

    @property
    def lost_reason(self) -> Optional[str]:  # type: ignore[override]
        """Why the lease was lost, or None."""
        self._expire_if_due()
        return self._lost_reason

    def _mark_lost(self, reason: str, code: Optional[grpc.StatusCode] = None) -> None:
        if self.lost.is_set() or self._released:
            return
        self._lost_reason = reason
        self.lost_code = code
        self.lost.set()

    def _expire_if_due(self) -> None:
        """Reads of the lease's state see its end even before the timer has run."""
        if self._ends is not None and self._loop.time() >= self._ends:
            self._expire()

    def _expire(self) -> None:
        """A fixed lease's end by the client's clock: lost (``LEASE_EXPIRED``) whether or
        not the server's ``lost`` can arrive, and the stream cancelled (the server releases
        whatever is left of the lock), so that no release waits for an unreachable server."""
        if self._releasing or self._released or self.lost.is_set():
            return
        self._mark_lost(LEASE_EXPIRED)
        self._expired = True
        self._call.cancel()

    def _disarm(self) -> None:
        if self._end_timer is not None:
            self._end_timer.cancel()

    async def _read(self) -> None:
        try:
            while True:
                resp = await self._call.read()
                if resp is grpc.aio.EOF:
                    break
                event = resp.WhichOneof("event")
                if event == "released":
                    self._released = True
                elif event == "lost":
                    self._mark_lost(lost_reason_name(resp.lost.reason))
            if not self._released and not self._releasing:
                self._mark_lost(DISCONNECTED, grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if self.lost.is_set():
                if self.lost_code is None:
                    self.lost_code = code
            elif not (self._releasing and code == grpc.StatusCode.CANCELLED):
                self._mark_lost(DISCONNECTED, code)
        except asyncio.CancelledError:
            if self._expired:
                # grpc.aio raises this from read() on the call the lease's end cancelled:
                # the stream is over, the task was not cancelled.
                self.lost_code = self.lost_code or grpc.StatusCode.CANCELLED
                return
            if not self._releasing:
                self._mark_lost(DISCONNECTED, grpc.StatusCode.CANCELLED)
            raise
        except Exception:  # pragma: no cover - defensive
            self._mark_lost(DISCONNECTED)
        finally:
            self._disarm()  # the stream is over: nothing left for the timer to end

    @property
    def held(self) -> bool:
        self._expire_if_due()
        return not self._reader.done() and not self.lost.is_set() and not self._releasing

    @property
    def released(self) -> bool:
        return self._released

    async def release(self, timeout: float = RELEASE_TIMEOUT) -> bool:
        """Sends ``release``, waits (bounded) for ``released`` and the end of the stream,
        cancels the stream otherwise. Idempotent. True when the server confirmed."""
        self._expire_if_due()
        self._disarm()
        first = not self._releasing
        self._releasing = True
        if first and not self._reader.done():
            try:
                await asyncio.wait_for(self._call.write(pb.AcquireRequest(release=pb.Release())), timeout)
                await asyncio.wait_for(self._call.done_writing(), timeout)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, asyncio.TimeoutError, grpc.aio.UsageError):
                pass  # the stream is over or stuck: the wait below decides
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), timeout)
        except asyncio.TimeoutError:
            self._call.cancel()
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), 1.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        return self._released

    async def __aenter__(self) -> "Lease":
        return self

    async def __aexit__(self, *exc) -> None:
        # Release even if the task is being cancelled (as LockRequest does).
        await asyncio.shield(self.release())


class LockRequest:
    """What ``Client.lock`` returns: ``async with`` acquires and releases."""

    def __init__(self, client: "Client", name, kwargs) -> None:
        self._client = client
        self._name = name
        self._kwargs = kwargs
        self.lease: Optional[Lease] = None

    async def __aenter__(self) -> Lease:
        self.lease = await self._client.acquire(self._name, **self._kwargs)
        return self.lease

    async def __aexit__(self, *exc) -> None:
        if self.lease is not None:
            # Release even if the task is being cancelled.
            await asyncio.shield(self.lease.release())


class Client:
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
        self.target = target
        opts = channel_options(target, options)
        if credentials is not None:
            self._channel = grpc.aio.secure_channel(target, credentials, options=opts)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=opts)
        self._stub = pb_grpc.LockServiceStub(self._channel)
        self._metadata = tuple(metadata or ())
        if token is not None:
            self._metadata += (("authorization", f"Bearer {token}"),)
        self._timeout = timeout

    @property
    def stub(self) -> pb_grpc.LockServiceStub:
        return self._stub

    async def close(self) -> None:
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
    ) -> LockRequest:
        """``async with client.lock("orders", wait=10) as lease:``; see ``latchkey.Client.lock``."""
        return LockRequest(
            self,
            name,
            dict(wait=wait, lease=lease, owner=owner, kind=kind, permits=permits, limit=limit, redlock=redlock),
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
    ) -> Lease:
        first = build_open(
            name, wait=wait, lease=lease, owner=owner, kind=kind, permits=permits, limit=limit, redlock=redlock
        )
        ends = fixed_lease_end(asyncio.get_running_loop().time(), first.open)
        call = self._stub.Acquire(metadata=self._metadata)
        try:
            await call.write(first)
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    # A failed stream raises from read(); EOF with OK means no grant.
                    code = await call.code()
                    if code != grpc.StatusCode.OK:
                        raise error_from_rpc(_StatusError(code, await call.details()))
                    raise LockError(grpc.StatusCode.UNKNOWN, "Acquire stream ended before the lock was acquired")
                event = resp.WhichOneof("event")
                if event == "acquired":
                    return Lease(name, call, resp.acquired, ends)
                if event == "lost":
                    raise LockError(grpc.StatusCode.ABORTED, f"lost before acquired: {lost_reason_name(resp.lost.reason)}")
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None
        except BaseException:
            call.cancel()
            raise

    async def _unary(self, method, request, timeout):
        try:
            return await method(request, timeout=self._timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise error_from_rpc(err) from None

    async def describe(self, name: str, *, timeout: Optional[float] = None) -> pb.LockState:
        return await self._unary(self._stub.Describe, pb.DescribeRequest(name=name), timeout)

    async def list(self, prefix: str = "", *, page_size: int = 0, timeout: Optional[float] = None) -> List[pb.LockState]:
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
        return (await self._unary(self._stub.ForceRelease, pb.ForceReleaseRequest(name=name), timeout)).released

    def watch(self, name: str) -> "Watch":
        """Streams ``LockState`` snapshots of one lock, the current one first, then one
        per change: ``async with client.watch(name) as watch: async for state in watch:``.
        Leaving the ``async with`` block (or ``close()``) stops it."""
        return Watch(self._stub.Watch(pb.WatchRequest(name=name), metadata=self._metadata))


class Watch:
    """An async iterator of ``LockState``; an async context manager that cancels the
    stream. Iteration ends (``StopAsyncIteration``) when the stream is closed or the
    server ends it; other failures raise ``LockError``."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._closed = False

    def __aiter__(self) -> "Watch":
        return self

    async def __anext__(self) -> pb.LockState:
        try:
            state = await self._call.read()
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:
                raise StopAsyncIteration from None
            raise error_from_rpc(err) from None
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError from read() on a call cancelled here:
            # close() ends the iteration; any other cancel is the task's own.
            if self._closed:
                raise StopAsyncIteration from None
            raise
        if state is grpc.aio.EOF:
            raise StopAsyncIteration
        return state

    def close(self) -> None:
        """Cancels the stream; an iteration waiting on it ends."""
        self._closed = True
        self._call.cancel()

    async def __aenter__(self) -> "Watch":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class _StatusError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
