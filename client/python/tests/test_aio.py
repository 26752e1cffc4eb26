"""The asyncio client against a real latchkey-server and Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

import latchkey
import latchkey.aio

pytestmark = pytest.mark.asyncio


async def test_hold_exclusion_and_release(target, name):
    async with latchkey.aio.Client(target) as a, latchkey.aio.Client(target) as b:
        async with a.lock(name, wait=5) as lease:
            assert lease.fencing_token > 0
            assert isinstance(lease.lost, asyncio.Event)
            with pytest.raises(latchkey.LockTimeout) as info:
                async with b.lock(name, wait=0):
                    pytest.fail("second holder got the lock")
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            state = await b.describe(name)
            assert state.locked and state.holders[0].owner == lease.owner
            assert [s.name for s in await b.list(prefix=name)] == [name]
        assert lease.released and not lease.lost.is_set()
        async with b.lock(name, wait=0) as second:
            assert second.fencing_token > lease.fencing_token


async def test_waiter_acquires_promptly(target, name):
    async with latchkey.aio.Client(target) as a, latchkey.aio.Client(target) as b:
        holder = await a.acquire(name, wait=5)

        async def waiter():
            async with b.lock(name, wait=20) as lease:
                return time.monotonic(), lease.fencing_token

        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0.5)
        assert not task.done()
        released_at = time.monotonic()
        assert await holder.release()
        acquired_at, token = await asyncio.wait_for(task, 10)
        assert acquired_at - released_at < 1.0
        assert token > holder.fencing_token


async def test_force_release_and_lease_expiry(target, name):
    async with latchkey.aio.Client(target) as client:
        async with client.lock(name, wait=5) as lease:
            assert await client.force_release(name) is True
            await asyncio.wait_for(lease.lost.wait(), 5)
            assert lease.lost_reason == "FORCE_RELEASED"
        async with client.lock(name, wait=5, lease=0.5) as lease:
            await asyncio.wait_for(lease.lost.wait(), 5)
            assert lease.lost_reason == "LEASE_EXPIRED"


async def test_a_fixed_lease_is_told_lost_at_its_end_by_the_clients_clock(start_server, name):
    """As the blocking client's test: with the server frozen (SIGSTOP) after the grant,
    the loop's timer tells the holder at the fixed lease's end and cancels the stream, so
    leaving ``async with`` does not wait for the unreachable server."""
    from test_lock import TOLD_AT_THE_END_WITHIN

    srv = start_server()
    async with latchkey.aio.Client(srv.target) as client:
        asked = time.monotonic()
        lease = await client.acquire(name, wait=5, lease=1.0)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            async with lease:
                await asyncio.sleep(max(0.0, asked + 0.8 - time.monotonic()))
                assert not lease.lost.is_set(), lease.lost_reason
                assert lease.held
                try:
                    await asyncio.wait_for(lease.lost.wait(), asked + 1.0 + TOLD_AT_THE_END_WITHIN - time.monotonic())
                except asyncio.TimeoutError:
                    pytest.fail(
                        f"the fixed lease of a frozen server reads held={lease.held} "
                        f"{time.monotonic() - asked:.2f}s after it was asked for"
                    )
                assert lease.lost_reason == "LEASE_EXPIRED"
                assert not lease.held
                leaving = time.monotonic()
            assert time.monotonic() - leaving < 1.0, "leaving the block waited for the frozen server"
            assert not lease.released
            assert lease.lost_code == grpc.StatusCode.CANCELLED  # the client ended the stream
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)


async def test_a_released_fixed_lease_is_not_told_lost_at_its_end(target, name):
    """Releasing a fixed lease cancels its timer: the end passes with no spurious ``lost``."""
    async with latchkey.aio.Client(target) as client:
        lease = await client.acquire(name, wait=5, lease=0.5)
        assert await lease.release()
        await asyncio.sleep(1.0)
        assert not lease.lost.is_set(), lease.lost_reason
        assert lease.lost_reason is None
        assert lease.released and not lease.held


async def test_exception_and_cancel_still_release(target, name):
    async with latchkey.aio.Client(target) as client:
        with pytest.raises(RuntimeError):
            async with client.lock(name, wait=5) as lease:
                raise RuntimeError("boom")
        assert lease.released

        entered = asyncio.Event()

        async def hold_forever():
            async with client.lock(name, wait=5):
                entered.set()
                await asyncio.sleep(3600)

        task = asyncio.ensure_future(hold_forever())
        await asyncio.wait_for(entered.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with client.lock(name, wait=0):
            pass


async def test_semaphore_kind(target, name):
    async with latchkey.aio.Client(target) as client:
        async with client.lock(name, kind="semaphore", limit=2, wait=5):
            async with client.lock(name, kind=latchkey.pb.LOCK_KIND_SEMAPHORE, limit=2, wait=0):
                with pytest.raises(latchkey.LockTimeout):
                    async with client.lock(name, kind="semaphore", limit=2, wait=0):
                        pass


async def test_keepalive_reports_a_partitioned_lease_lost(start_server, freezable_proxy, name):
    """As the sync client's test: the aio client's keepalive (on by default) tells a
    lease behind a silent partition that it lost the lock before the server, with its
    default keepalive, releases it to another client."""
    from test_lock import NOTICES_A_DEAD_CONNECTION_WITHIN, RELEASES_A_DEAD_CONNECTION_WITHIN

    srv = start_server()
    proxy = freezable_proxy(srv.port)
    async with latchkey.aio.Client(proxy.target) as far, latchkey.aio.Client(srv.target) as near:
        lease = await far.acquire(name, wait=5)
        proxy.frozen.set()
        frozen = time.monotonic()
        try:
            await asyncio.wait_for(lease.lost.wait(), NOTICES_A_DEAD_CONNECTION_WITHIN)
        except asyncio.TimeoutError:
            pytest.fail(f"the partitioned aio lease reports held={lease.held} lost_reason={lease.lost_reason}")
        told = time.monotonic() - frozen
        assert lease.lost_reason == "DISCONNECTED"
        assert lease.lost_code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(latchkey.LockTimeout):
            async with near.lock(name, wait=0):
                pytest.fail(f"another client got {name!r} as the holder was told, {told:.1f}s after the partition")
        async with near.lock(name, wait=RELEASES_A_DEAD_CONNECTION_WITHIN) as other:
            assert other.fencing_token > lease.fencing_token


async def test_watch_yields_the_state_then_each_change_until_closed(target, name):
    async with latchkey.aio.Client(target) as client:
        async with client.watch(name) as watch:
            first = await asyncio.wait_for(watch.__anext__(), 5)
            assert first.name == name and first.locked is False
            async with client.lock(name, wait=5) as lease:
                state = await asyncio.wait_for(watch.__anext__(), 5)
                while not state.locked:
                    state = await asyncio.wait_for(watch.__anext__(), 5)
                assert state.holders[0].owner == lease.owner
            # close() from another task ends an iteration waiting on the stream
            states = []

            async def follow():
                async for s in watch:
                    states.append(s)

            task = asyncio.ensure_future(follow())
            await asyncio.sleep(0.3)
            watch.close()
            await asyncio.wait_for(task, 5)


async def test_watch_of_a_refused_name_raises_lock_error(target):
    async with latchkey.aio.Client(target) as client:
        with pytest.raises(latchkey.LockError) as info:
            async with client.watch("") as watch:
                await asyncio.wait_for(watch.__anext__(), 5)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_leaving_a_lease_block_releases_even_when_cancelled_again(target, name):
    """``async with lease:`` shields its release from cancellation, as ``async with
    client.lock()`` does: a task cancelled again while it releases still sends the
    release and hears it confirmed. (Cut off, the release's write was cancelled, which
    cancelled the stream: the server freed the lock, but ``released`` stayed False.)"""
    async with latchkey.aio.Client(target) as client, latchkey.aio.Client(target) as other:
        entered = asyncio.Event()
        leases = []  # kept here, so that no garbage collection ends the stream instead

        async def hold_forever():
            leases.append(await client.acquire(name, wait=5))
            async with leases[0]:
                entered.set()
                await asyncio.sleep(3600)

        task = asyncio.ensure_future(hold_forever())
        await asyncio.wait_for(entered.wait(), 5)
        task.cancel()
        await asyncio.sleep(0)  # the task leaves its block and starts the release
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with other.lock(name, wait=5):
            pass
        assert leases[0].released


async def test_list_stops_at_a_repeated_page_token(repeating_list_server):
    target, servicer = repeating_list_server
    async with latchkey.aio.Client(target) as client:
        locks = await client.list("x", timeout=5)
    assert [s.name for s in locks] == ["lock-1", "lock-2"]
    assert servicer.calls == 2
