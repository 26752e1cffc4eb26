"""The asyncio client against a real latchkey-server and Redis."""

from __future__ import annotations

import asyncio
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
