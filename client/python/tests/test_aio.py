"""The asyncio client against a real latchkey-server and Redis."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time

import grpc
import pytest

import latchkey
import latchkey.aio
from conftest import free_within, freeze, interrupt_while_queued, python_child, read_line, wait_until

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


async def test_redis_restarted_empty_tells_the_holder_not_held(start_redis, start_server, name):
    """As the blocking client's test: every ``wait_lost()`` returns True, the reason is
    ``NOT_HELD``, the stream ends ABORTED with that reason, ``release()`` returns False."""
    r = start_redis()
    srv = start_server("--watchdog-timeout", "900ms", redis_url=r.url)
    async with latchkey.aio.Client(srv.target) as client:
        lease = await client.acquire(name, wait=5)
        waiters = [asyncio.ensure_future(lease.wait_lost(10)) for _ in range(3)]
        await asyncio.get_running_loop().run_in_executor(None, r.restart)
        assert await asyncio.wait_for(asyncio.gather(*waiters), 15) == [True, True, True]
        assert lease.lost_reason == "NOT_HELD"
        assert await lease.release() is False  # waits for the stream's end
        assert lease.lost_code == grpc.StatusCode.ABORTED
        assert lease.lost_info.get("lostReason") == "NOT_HELD"


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
                await asyncio.sleep(max(0.0, asked + 0.5 - time.monotonic()))
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


async def test_a_fixed_lease_is_told_lost_before_redis_can_give_it_back(start_server, name):
    """``lost`` is set at the lease's end by the client's clock (the lease the server
    granted, a tenth short of the 0.5 s asked for), not after the wait that lets a
    notice name the reason: Redis gives the lock back 0.5 s after the server's try, and
    the holder must know by then, though its server is frozen."""
    srv = start_server()
    async with latchkey.aio.Client(srv.target) as client:
        asked = time.monotonic()
        lease = await client.acquire(name, wait=5, lease=0.5)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            try:
                await asyncio.wait_for(lease.lost.wait(), asked + 0.5 - time.monotonic())
            except asyncio.TimeoutError:
                pytest.fail(f"lost was not set {time.monotonic() - asked:.3f}s after the lease was asked for")
            assert lease.lost_reason == "LEASE_EXPIRED"
            assert not lease.held
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)


async def test_a_fixed_lease_queued_longer_than_itself_is_held_for_its_length(target, name):
    """As the blocking client's test: the lease counts from the try that granted it."""
    async with latchkey.aio.Client(target) as client:
        holder = await client.acquire(name, wait=5)
        waiter = asyncio.ensure_future(client.acquire(name, wait=10, lease=0.8))
        await asyncio.sleep(1.2)
        assert await holder.release()
        lease = await asyncio.wait_for(waiter, 10)
        granted = time.monotonic()
        await asyncio.wait_for(lease.lost.wait(), 5)
        assert lease.lost_reason == "LEASE_EXPIRED"
        held_for = time.monotonic() - granted
        assert held_for >= 0.5, f"held {held_for:.2f}s of a 0.8 s lease"


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


async def test_a_cancel_mid_wait_leaves_no_fair_waiter(client, target, name):
    """A task cancelled while its acquire waits in a fair lock's queue, or a
    ``wait_for`` that runs out on it, withdraws the request: no waiter is left."""
    holder = client.acquire(name, kind="fair", wait=5)
    async with latchkey.aio.Client(target) as ac:
        queued = asyncio.Event()
        task = asyncio.ensure_future(ac.acquire(name, kind="fair", on_queued=lambda q: queued.set()))
        await asyncio.wait_for(queued.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert wait_until(lambda: len(client.describe(name).waiters) == 0, 5)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ac.acquire(name, kind="fair"), 0.5)
        assert wait_until(lambda: len(client.describe(name).waiters) == 0, 5)
    assert holder.release()
    assert free_within(client, name, 2.0)


async def test_a_process_that_exits_holding_a_lease_exits_and_frees_the_lock(client, target, name):
    """A program whose loop ends with a lease still held (no release, no ``close()``,
    the client kept alive) exits promptly, and its lock is freed."""
    child = python_child(
        f"""
        import asyncio, latchkey.aio
        async def main():
            c = latchkey.aio.Client({target!r})
            lease = await c.acquire({name!r}, wait=5)
            print("held", flush=True)
            globals()["keep"] = (c, lease)
        asyncio.run(main())
        """
    )
    assert read_line(child) == "held"
    child.wait(10)
    assert free_within(client, name, 3.0)


async def test_sigint_inside_async_with_releases_and_mid_wait_leaves_no_waiter(client, target, name):
    """Ctrl-C under ``asyncio.run()`` (which cancels the main task) inside ``async with
    client.lock()`` releases the lease on the way out; during an acquire that waits in
    a fair lock's queue, it withdraws the request."""
    child = python_child(
        f"""
        import asyncio, latchkey.aio
        async def main():
            async with latchkey.aio.Client({target!r}) as c:
                try:
                    async with c.lock({name!r}, wait=5) as lease:
                        print("held", flush=True)
                        await asyncio.sleep(30)
                finally:
                    print("released", lease.released, flush=True)
        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """
    )
    assert read_line(child) == "held"
    child.send_signal(signal.SIGINT)
    assert read_line(child) == "released True"
    assert read_line(child) == "interrupted"
    child.wait(10)
    assert free_within(client, name, 2.0)

    holder = client.acquire(name, kind="fair", wait=5)
    child = python_child(
        f"""
        import asyncio, latchkey.aio
        async def main():
            async with latchkey.aio.Client({target!r}) as c:
                await c.acquire({name!r}, kind="fair", on_queued=lambda q: print("queued", flush=True))
        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """
    )
    interrupt_while_queued(child, client, name)
    assert holder.release()


async def test_semaphore_kind(target, name):
    async with latchkey.aio.Client(target) as client:
        async with client.lock(name, kind="semaphore", limit=2, wait=5):
            async with client.lock(name, kind=latchkey.pb.LOCK_KIND_SEMAPHORE, limit=2, wait=0):
                with pytest.raises(latchkey.LockTimeout):
                    async with client.lock(name, kind="semaphore", limit=2, wait=0):
                        pass


async def test_one_lock_request_serves_blocks_in_several_tasks(target, name):
    """A ``client.lock(...)`` shared as an ``asyncio.Semaphore`` is: each task's block
    releases the lease it took, not the one entered last, and none is dropped early."""
    async with latchkey.aio.Client(target) as client:
        sem = client.lock(name, kind="semaphore", limit=2, wait=5)
        entered = [asyncio.Event(), asyncio.Event()]
        leave = [asyncio.Event(), asyncio.Event()]

        async def block(i: int) -> None:
            async with sem:
                entered[i].set()
                await leave[i].wait()

        tasks = [asyncio.create_task(block(i)) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in entered)), 10)
        gc.collect()
        assert len((await client.describe(name)).holders) == 2
        leave[0].set()
        await asyncio.wait_for(tasks[0], 10)
        assert len((await client.describe(name)).holders) == 1, "the second block's hold went with the first"
        leave[1].set()
        await asyncio.wait_for(tasks[1], 10)
        assert (await client.describe(name)).locked is False


async def test_a_block_entered_in_a_task_of_its_own_gives_back_its_lease(target, name):
    """``asyncio.wait_for`` runs ``__aenter__`` in a task of its own: the block, left in
    the caller's, gives back that lease (it used to give back nothing)."""
    async with latchkey.aio.Client(target) as client:
        req = client.lock(name, wait=5)
        lease = await asyncio.wait_for(req.__aenter__(), 10)
        await req.__aexit__(None, None, None)
        assert lease.released
        assert (await client.describe(name)).locked is False


async def test_an_infinite_timeout_is_no_bound(target, name):
    """``math.inf`` as a unary call's timeout (or the client's) is no deadline, not one
    already past."""
    import math

    async with latchkey.aio.Client(target, timeout=math.inf) as client:
        lease = await client.acquire(name, wait=5)
        assert (await client.describe(name, timeout=math.inf)).locked
        assert [s.name for s in await client.list(name, timeout=math.inf)] == [name]
        assert await lease.release(timeout=math.inf) is True
        assert await lease.wait_lost(timeout=math.inf) is False
        assert await client.force_release(name, timeout=math.inf) is False


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


async def test_a_watch_read_cancelled_by_a_timeout_ends_the_watch_with_lock_error(target, name):
    """grpc.aio cancels the call with a cancelled read: the next read raised a bare
    ``CancelledError`` in a task nobody cancelled, ending a watcher loop as if cancelled.
    It raises ``LockError`` CANCELLED."""
    async with latchkey.aio.Client(target) as client:
        async with client.watch(name) as watch:
            await asyncio.wait_for(watch.__anext__(), 5)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(watch.__anext__(), 0.2)
            with pytest.raises(latchkey.LockError) as err:
                await asyncio.wait_for(watch.__anext__(), 5)
            assert err.value.code == grpc.StatusCode.CANCELLED
        # Once its client is closed, such a watch ends as every other watch does.
        async with client.watch(name) as watch:
            await asyncio.wait_for(watch.__anext__(), 5)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(watch.__anext__(), 0.2)
            await client.close()
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(watch.__anext__(), 5)


async def test_watch_of_a_refused_name_raises_lock_error(target):
    async with latchkey.aio.Client(target) as client:
        with pytest.raises(latchkey.LockError) as info:
            async with client.watch("") as watch:
                await asyncio.wait_for(watch.__anext__(), 5)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_watch_raises_unavailable_at_server_shutdown(start_server, name):
    """The server ends a Watch only at its shutdown, UNAVAILABLE (``SHUTTING_DOWN``):
    the iteration raises that ``LockError``, as ``Watch``'s docstring says and as the
    blocking and Node clients do, rather than ending as if closed."""
    srv = start_server()
    async with latchkey.aio.Client(srv.target) as client:
        async with client.watch(name) as watch:
            first = await asyncio.wait_for(watch.__anext__(), 5)
            assert first.name == name
            srv.stop(signal.SIGTERM)

            async def rest():
                return [s async for s in watch]

            with pytest.raises(latchkey.LockError) as info:
                await asyncio.wait_for(rest(), 10)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
            assert info.value.reason == "SHUTTING_DOWN"


async def test_a_release_cancelled_before_its_message_went_still_frees_the_lock(target, name, monkeypatch):
    """A task cancelled while its ``release()`` has not sent the message yet (before
    Python 3.12, ``wait_for`` may cancel the send's task before it ever ran) cancels the
    stream, which frees the lock. The stream stayed open, the lock renewed by the server
    with ``held`` already False, until the lease was collected."""
    async with latchkey.aio.Client(target) as client, latchkey.aio.Client(target) as other:
        lease = await client.acquire(name, wait=5)
        started = asyncio.Event()

        async def send_that_never_went():
            started.set()
            await asyncio.Event().wait()

        monkeypatch.setattr(lease._stream, "send_release", send_that_never_went)
        task = asyncio.ensure_future(lease.release())
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not lease.held
        async with other.lock(name, wait=5):
            pass


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


async def test_list_stops_at_a_repeated_page_token(fake_server):
    target, servicer = fake_server
    async with latchkey.aio.Client(target) as client:
        locks = await client.list("x", timeout=5)
    assert [s.name for s in locks] == ["lock-1", "lock-2"]
    assert servicer.calls == 2


async def test_a_release_confirmed_unasked_reads_as_lost(fake_server):
    """As the blocking client's: a ``released`` nobody asked for is a loss
    (``DISCONNECTED``), and a later ``release()`` returns False."""
    target, _ = fake_server
    async with latchkey.aio.Client(target) as client:
        lease = await client.acquire("unasked")
        await asyncio.wait_for(lease.lost.wait(), 2)
        assert lease.lost_reason == "DISCONNECTED"
        assert not lease.held
        assert await lease.wait_lost(2) is True
        assert not lease.released
        assert await lease.release(timeout=2) is False
        assert not lease.released


async def test_a_loss_told_before_the_released_of_a_release_stays(fake_server):
    """As the blocking client's: ``lost`` before the ``released`` answering a release
    makes the release return False."""
    target, _ = fake_server
    async with latchkey.aio.Client(target) as client:
        lease = await client.acquire("lost-then-released")
        assert await lease.release(timeout=2) is False
        assert lease.lost.is_set() and lease.lost_reason == "FORCE_RELEASED"
        assert not lease.released and not lease.held


async def acquirable(client, name) -> bool:
    """Whether a try-once acquire of ``name`` gets it now (released again at once);
    False while it is held or the server cannot reach Redis."""
    try:
        await (await client.acquire(name, wait=0)).release()
        return True
    except latchkey.LockError as err:
        if err.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
            return False  # held, or Redis not reached again yet
        raise


async def test_a_failed_release_raises_and_the_lock_is_given_back_once_redis_returns(
    start_redis, start_server, name
):
    """As the blocking client's test: a release the server could not take to Redis
    raises ``LockError`` UNAVAILABLE (leaving ``async with`` too, unless the body
    raised), the lease is not lost, and the server gives the lock back once Redis is
    back. It used to read as a lease lost (``DISCONNECTED``) and ``release()`` False."""
    from test_lock import GIVEN_BACK_WITHIN

    redis = start_redis("--appendonly", "yes", "--appendfsync", "always")
    srv = start_server("--redis-timeout", "300ms", redis_url=redis.url)
    names = [f"{name}/release", f"{name}/with", f"{name}/with-raising"]
    async with latchkey.aio.Client(srv.target) as client:
        leases = [await client.acquire(n, wait=5, lease=3600) for n in names]
        redis.stop()
        for _ in range(2):  # idempotent: the second call tells the same
            with pytest.raises(latchkey.LockError) as info:
                await leases[0].release()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
            assert not isinstance(info.value, latchkey.LockTimeout)
        with pytest.raises(latchkey.LockError) as info:
            async with leases[1]:
                pass
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
        with pytest.raises(RuntimeError, match="the body's"):
            async with leases[2]:
                raise RuntimeError("the body's error is the one raised")
        for lease in leases:
            assert not lease.lost.is_set() and lease.lost_reason is None, lease
            assert not lease.released and not lease.held
            assert await lease.wait_lost(1.0) is False  # the stream is over: no wait
        redis.restart()
        deadline = time.monotonic() + GIVEN_BACK_WITHIN
        for n in names:
            while not await acquirable(client, n):
                assert time.monotonic() < deadline, f"{n!r} is still held"
                await asyncio.sleep(0.2)


async def test_a_release_with_no_answer_raises_deadline_exceeded(start_server, name):
    """As the blocking client's test: no answer in time is ``LockError``
    DEADLINE_EXCEEDED, not ``LockTimeout`` nor a lost lease."""
    srv = start_server()
    async with latchkey.aio.Client(srv.target) as client:
        lease = await client.acquire(name, wait=5)
        freeze(srv.proc)
        try:
            t0 = time.monotonic()
            with pytest.raises(latchkey.LockError) as info:
                await lease.release(timeout=0.5)
            assert time.monotonic() - t0 < 2.5
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
            assert not isinstance(info.value, latchkey.LockTimeout)
            assert not lease.lost.is_set() and not lease.released
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        async with latchkey.aio.Client(srv.target) as other:
            async with other.lock(name, wait=5):
                pass


async def test_a_dropped_lease_is_released(target, name):
    """A lease the program drops without ``release()`` is released when garbage
    collected, as the blocking client's is: its reader task holds the stream, not the
    lease. It used to hold the lock until the channel closed."""
    async with latchkey.aio.Client(target) as a, latchkey.aio.Client(target) as b:

        async def work():
            lease = await a.acquire(name, wait=5)
            return lease.lost  # the lease itself is garbage on return

        lost = await work()
        gc.collect()
        try:
            async with b.lock(name, wait=5):
                pass
        except latchkey.LockTimeout:
            pytest.fail(f"a dropped aio lease still holds {name!r}")
        # whoever kept the lease's event learns the lock is gone
        await asyncio.wait_for(lost.wait(), 5)


async def test_a_force_release_read_after_a_stalled_loop_is_not_lease_expired(target, name):
    """A ``lost`` that arrived while the loop was stalled past a fixed lease's end is
    the reason, not the end by the client's clock: a notice already received is read
    before the end is judged. It used to read ``LEASE_EXPIRED``: the end's timer (or a
    getter, or ``release()``) ran before the reader task had read the notice."""
    async with latchkey.aio.Client(target) as client:
        read, released = [await client.acquire(f"{name}/{n}", wait=5, lease=1.0) for n in ("read", "release")]
        with latchkey.Client(target) as admin:  # blocks the loop: nothing runs on it
            assert admin.force_release(f"{name}/read")
            assert admin.force_release(f"{name}/release")
        time.sleep(1.5)  # the loop stalls past the leases' end
        assert not read.held  # past the end: never read held, whatever the reason
        assert read.lost_reason != "LEASE_EXPIRED"  # not judged before the notice is read
        assert await released.release() is False
        assert released.lost_reason == "FORCE_RELEASED"
        await asyncio.wait_for(read.lost.wait(), 2)
        assert read.lost_reason == "FORCE_RELEASED"


async def test_closing_the_client_fails_a_pending_acquire_with_cancelled(target, name):
    """``close()`` during an acquire that waits raises ``LockError`` CANCELLED in the
    acquiring task, which nobody cancelled; a cancel of that task itself still raises
    ``CancelledError``. It used to raise ``CancelledError`` in both cases."""
    async with latchkey.aio.Client(target) as a, latchkey.aio.Client(target) as c:
        async with a.lock(name, wait=5):
            b = latchkey.aio.Client(target)
            task = asyncio.ensure_future(b.acquire(name))
            cancelled = asyncio.ensure_future(c.acquire(name))
            await asyncio.sleep(0.5)  # both queued
            assert not task.done() and not cancelled.done()
            await b.close()
            with pytest.raises(latchkey.LockError) as info:
                await asyncio.wait_for(task, 5)
            assert info.value.code == grpc.StatusCode.CANCELLED, info.value
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled


async def test_closing_the_client_fails_an_acquire_whose_call_is_starting_with_cancelled(target, name):
    """``close()`` while an acquire's call has not sent its headers yet (a new client
    still connecting, or any acquire in the few ms after its call is created) raises
    ``LockError`` CANCELLED in it, as in an acquire that waits. grpc.aio's first
    ``write()`` waits for the headers to be sent, which a cancelled call never does: the
    acquire hung for good, past its own ``wait``, and a shutdown that gathered its
    workers hung with it."""
    client = latchkey.aio.Client(target)
    task = asyncio.ensure_future(client.acquire(name, wait=5))
    await asyncio.sleep(0)  # the acquire created its call and awaits its first write
    await client.close()
    try:
        await asyncio.wait_for(task, 10)
    except latchkey.LockError as err:
        assert err.code == grpc.StatusCode.CANCELLED, err
    except asyncio.TimeoutError:
        pytest.fail("acquire() still pending 10 s after close() (its wait was 5 s)")
    else:
        pytest.fail("acquire() returned a lease after close()")


async def test_close_amid_many_lock_loops_ends_each_with_lock_error_and_leaves_nothing(client, target, name):
    """As the blocking client's test: ``close()`` amid tasks that take and release a
    fair lock in a loop ends every loop with ``LockError`` CANCELLED, whichever step it
    was at (an acquire whose call was starting among them), and leaves the lock free."""
    ac = latchkey.aio.Client(target)
    outcomes = []

    async def loop():
        try:
            while True:
                async with ac.lock(name, wait=10, kind="fair"):
                    await asyncio.sleep(0.002)
        except latchkey.LockError as err:
            outcomes.append(("LockError", err.code))
        except BaseException as err:  # reported below
            outcomes.append((type(err).__name__, repr(err)))

    tasks = [asyncio.ensure_future(loop()) for _ in range(12)]
    await asyncio.sleep(0.7)
    await ac.close()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    bad = [o for o in outcomes if o != ("LockError", grpc.StatusCode.CANCELLED)]
    assert not bad, bad
    assert free_within(client, name, 3.0)


async def test_closing_the_client_fails_a_pending_unary_call_with_cancelled(target, freezable_proxy, name):
    """``close()`` while ``describe()``, ``list()`` or ``force_release()`` waits for its
    answer raises ``LockError`` CANCELLED in the calling task, as for a pending acquire:
    grpc.aio raises ``CancelledError`` from the await of a call the channel's close
    cancelled, and the task ended cancelled, though nobody had cancelled it. A cancel of
    the task itself, even as the client closes, is still ``CancelledError``."""
    calls = {
        "describe": lambda client: client.describe(name),
        "list": lambda client: client.list(name),
        "force_release": lambda client: client.force_release(name),
    }
    for what, call in calls.items():
        proxy = freezable_proxy(int(target.rsplit(":", 1)[1]))
        client = latchkey.aio.Client(proxy.target)
        await client.describe(name)  # connected
        proxy.frozen.set()  # no answer comes
        task = asyncio.ensure_future(call(client))
        await asyncio.sleep(0.3)
        assert not task.done(), what
        await client.close()
        with pytest.raises(latchkey.LockError) as info:
            await asyncio.wait_for(task, 5)
        assert info.value.code == grpc.StatusCode.CANCELLED, (what, info.value)

    if not hasattr(asyncio.Task, "cancelling"):
        return  # before 3.11 a cancel that comes with close() is taken for the close
    proxy = freezable_proxy(int(target.rsplit(":", 1)[1]))
    client = latchkey.aio.Client(proxy.target)
    await client.describe(name)
    proxy.frozen.set()
    task = asyncio.ensure_future(client.describe(name))
    await asyncio.sleep(0.3)
    task.cancel()
    await client.close()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def test_closing_the_client_fails_a_release_under_way_with_cancelled(target, name):
    """``close()`` while ``release()`` sends ``release``: grpc.aio raises
    ``CancelledError`` from the write (or the half-close) of a call the channel's close
    cancelled before gRPC core took the message, and ``release()`` raised it in a task
    nobody cancelled. It raises ``LockError`` CANCELLED now, as after the write: the
    release's outcome is unknown, and the server releases on the cancel. The window is
    microseconds wide (a real close hit it about once in 40 releases), so the write
    here closes the client and raises what grpc.aio raises then."""
    client = latchkey.aio.Client(target)
    lease = await client.acquire(name, wait=5)

    async def write_cut_by_close(request):
        await client.close()
        raise asyncio.CancelledError()  # grpc.aio's, for a call cancelled on this side

    lease._stream.call.write = write_cut_by_close
    with pytest.raises(latchkey.LockError) as info:
        await asyncio.wait_for(lease.release(), 5)
    assert info.value.code == grpc.StatusCode.CANCELLED, info.value
    async with latchkey.aio.Client(target) as other:
        async with other.lock(name, wait=5):
            pass


async def test_wait_lost_returns_when_the_lease_ends_without_loss(target, name):
    """``wait_lost()`` returns False once the lease is released (a watcher task does not
    hang), True when it is lost; ``lost`` is set only on loss."""
    async with latchkey.aio.Client(target) as client:
        lease = await client.acquire(name, wait=5)
        watcher = asyncio.ensure_future(lease.wait_lost())
        assert await lease.wait_lost(0.3) is False  # held: a timeout says False too
        assert not watcher.done()
        assert await lease.release()
        assert await asyncio.wait_for(watcher, 5) is False
        assert not lease.lost.is_set()

        lease = await client.acquire(name, wait=5)
        assert await client.force_release(name)
        assert await lease.wait_lost(5) is True
        assert lease.lost_reason == "FORCE_RELEASED"


async def test_releasing_a_lost_lease_returns_false_on_every_path(target, freezable_proxy, name):
    """As the blocking client's test: a lease lost before or during the release (its
    stream ended with ``lost``, a fixed lease past its end, a ``lost`` while the release
    was on its way, a closed client) makes ``release()`` return False."""
    async with latchkey.aio.Client(target) as client:
        ended = await client.acquire(f"{name}/ended", wait=5)
        assert await client.force_release(f"{name}/ended")
        assert await ended.wait_lost(5) and ended.lost_reason == "FORCE_RELEASED"
        await asyncio.wait_for(asyncio.shield(ended._stream.reader), 5)
        assert await ended.release() is False

        fixed = await client.acquire(f"{name}/fixed", wait=5, lease=0.3)
        await asyncio.sleep(0.4)
        assert await fixed.release() is False
        assert fixed.lost_reason == "LEASE_EXPIRED"

        proxy = freezable_proxy(int(target.rsplit(":", 1)[1]))
        async with latchkey.aio.Client(proxy.target) as far:
            in_flight = await far.acquire(f"{name}/in-flight", wait=5)
            proxy.hold_requests()  # the release waits in the proxy
            releasing = asyncio.ensure_future(in_flight.release(timeout=5))
            await asyncio.sleep(0.1)
            assert await client.force_release(f"{name}/in-flight")
            try:
                assert await asyncio.wait_for(releasing, 6) is False
            finally:
                proxy.pass_requests()
            assert in_flight.lost_reason == "FORCE_RELEASED"

    for _ in range(5):  # the close and the release race: each order says the same
        closed = latchkey.aio.Client(target)
        lease = await closed.acquire(f"{name}/closed", wait=5)
        await closed.close()
        assert await lease.release() is False
        assert lease.lost_reason == "DISCONNECTED"


async def test_a_unary_call_with_no_answer_in_time_is_not_a_lock_timeout(target, freezable_proxy, name):
    """As the blocking client's test: a unary call past its ``timeout`` raises
    ``LockError`` DEADLINE_EXCEEDED, not ``LockTimeout``."""
    proxy = freezable_proxy(int(target.rsplit(":", 1)[1]))
    async with latchkey.aio.Client(proxy.target, timeout=0.3) as client:
        await client.describe(name)  # connected
        proxy.frozen.set()
        calls = {
            "describe": lambda: client.describe(name),
            "list": lambda: client.list(name),
            "force_release": lambda: client.force_release(name, timeout=0.3),
        }
        for what, call in calls.items():
            with pytest.raises(latchkey.LockError) as info:
                await asyncio.wait_for(call(), 3)
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, (what, info.value)
            assert not isinstance(info.value, latchkey.LockTimeout), what


@pytest.mark.parametrize("token", ["tökén", "line\nbreak"])
async def test_a_token_that_is_not_printable_ascii_is_refused_by_the_constructor(target, token):
    with pytest.raises(ValueError, match="the token must be printable ASCII") as info:
        latchkey.aio.Client(target, token=token)
    assert token not in str(info.value)


async def test_lock_error_carries_the_servers_error_info(target, name):
    """As the blocking client's test: ``reason``, ``info`` and ``metadata`` from the
    server's ``ErrorInfo``, and ``lost_info`` on a lost lease."""
    async with latchkey.aio.Client(target) as client:
        async with client.lock(name, kind="semaphore", limit=2, wait=5):
            with pytest.raises(latchkey.LockError) as info:
                await client.acquire(name, kind="semaphore", limit=3, wait=0)
            assert info.value.reason == "LIMIT_MISMATCH", info.value
            assert info.value.info == {"lockName": name, "limit": "2"}
            with pytest.raises(latchkey.LockTimeout) as info:
                await client.acquire(name, kind="semaphore", limit=2, permits=2, wait=0)
            assert info.value.reason == "WAIT_TIMEOUT"
        with pytest.raises(latchkey.LockError) as info:
            await client.acquire("", wait=0)
        assert info.value.reason == "INVALID_ARGUMENT" and info.value.info["field"] == "open.name"
        with pytest.raises(latchkey.LockError) as info:
            await client.describe("")
        assert info.value.info["field"] == "name"
        with pytest.raises(latchkey.LockError) as info:
            async with client.watch("") as watch:
                await asyncio.wait_for(watch.__anext__(), 5)
        assert info.value.info["field"] == "name"

        lease = await client.acquire(name, wait=5)
        assert await client.force_release(name)
        await asyncio.wait_for(asyncio.shield(lease._stream.reader), 5)
        assert lease.lost_code == grpc.StatusCode.ABORTED
        assert lease.lost_info == {"lockName": name, "lostReason": "FORCE_RELEASED"}


async def test_closing_the_client_ends_a_watch_without_cancelling_its_task(target, name):
    """``close()`` ends an iteration of a ``Watch`` in another task, which nobody
    cancelled: grpc.aio raises ``CancelledError`` from the read of a call the channel's
    close cancelled, and the task ended cancelled (``await task`` raised
    ``CancelledError``, which its awaiter takes for its own). As for a pending acquire."""
    client = latchkey.aio.Client(target)
    first = asyncio.Event()

    async def follow():
        async for _ in client.watch(name):
            first.set()
        return "ended"

    task = asyncio.ensure_future(follow())
    await asyncio.wait_for(first.wait(), 5)
    await client.close()
    assert await asyncio.wait_for(task, 5) == "ended"

    # a cancel of the iterating task itself is still a cancel
    async with latchkey.aio.Client(target) as client:
        first.clear()
        task = asyncio.ensure_future(follow())
        await asyncio.wait_for(first.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)


async def test_reading_a_lease_off_the_loop_past_its_end_schedules_the_verdict_safely(target, name):
    """A thread (``run_in_executor``) that reads ``held`` past a fixed lease's end, before
    the loop's own timer ran, scheduled the end's verdict on the loop from that thread:
    not thread-safe, a ``RuntimeError`` in asyncio's debug mode, and an idle loop was not
    woken for it. The read now hands the end over to the loop."""
    async with latchkey.aio.Client(target) as client:
        lease = await client.acquire(name, wait=5, lease=0.2)
        loop = asyncio.get_running_loop()
        loop.set_debug(True)
        try:
            read = []

            def reader():
                time.sleep(0.3)  # past the end, while the loop stalls
                try:
                    read.append((lease.held, lease.lost_reason))
                except Exception as err:  # reported below
                    read.append(err)

            thread = threading.Thread(target=reader, daemon=True)
            thread.start()
            time.sleep(0.45)  # the loop stalls past the end: its timer has not run
            thread.join(5)
            assert read == [(False, None)], read
            assert await asyncio.wait_for(lease.wait_lost(), 2) is True
            assert lease.lost_reason == "LEASE_EXPIRED"
        finally:
            loop.set_debug(False)


async def test_a_one_name_list_is_a_plain_lock(target, name):
    async with latchkey.aio.Client(target) as client:
        async with client.lock([name], wait=5) as lease:
            assert lease.name == [name] and lease.fencing_tokens == [lease.fencing_token]
            assert (await client.describe(name)).locked


async def test_a_lock_request_of_an_iterator_of_names_serves_every_block(target, name):
    """As the blocking client's test: ``lock()`` reads an iterator of names once, and
    refuses no name at all; the second block used to send an Open with no name."""
    async with latchkey.aio.Client(target) as client:
        one = client.lock(iter([name]), wait=1)
        multi = client.lock((n for n in (f"{name}/a", f"{name}/b")), wait=1)
        for _ in range(2):
            async with one as lease:
                assert lease.name == [name]
                assert (await client.describe(name)).locked
            async with multi as lease:
                assert lease.name == [f"{name}/a", f"{name}/b"]
                assert len(lease.fencing_tokens) == 2
        for empty in ([], (), iter([])):
            with pytest.raises(ValueError, match="^name "):
                client.lock(empty)
        with pytest.raises(ValueError, match="^name "):
            await client.acquire([], wait=0)


async def test_calls_after_close_raise_lock_error_cancelled(target, name):
    """As the blocking client's test; it raised ``grpc.aio.UsageError``."""
    client = latchkey.aio.Client(target)
    await client.close()
    calls = {
        "acquire": lambda: client.acquire(name, wait=0),
        "describe": lambda: client.describe(name),
        "list": lambda: client.list(name),
        "force_release": lambda: client.force_release(name),
        "watch": lambda: client.watch(name).__anext__(),
    }
    for what, call in calls.items():
        with pytest.raises(latchkey.LockError) as info:
            await call()
        assert info.value.code == grpc.StatusCode.CANCELLED, (what, info.value)


async def test_on_queued_and_wait_inf(target, name):
    """``on_queued`` gets each ``Queued`` event, as in the blocking client;
    ``wait=math.inf`` waits until granted."""
    import math

    async with latchkey.aio.Client(target) as a, latchkey.aio.Client(target) as b:
        holder = await a.acquire(name, wait=5)
        queued = []
        waiter = asyncio.ensure_future(b.acquire(name, wait=math.inf, on_queued=queued.append))
        deadline = time.monotonic() + 5
        while not queued:
            assert time.monotonic() < deadline, "on_queued was not called"
            await asyncio.sleep(0.02)
        assert isinstance(queued[0], latchkey.pb.Queued)
        assert await holder.release()
        lease = await asyncio.wait_for(waiter, 10)
        assert await lease.release()


async def test_a_grpc_error_of_on_queued_is_the_callers(target, name):
    """A gRPC error that ``on_queued`` raises (a call to another service) propagates as
    it is and withdraws the request, as in the blocking client: it was read as the
    Acquire call's own failure, and the call left waiting."""
    async with latchkey.aio.Client(target) as a, latchkey.aio.Client(target) as b:
        holder = await a.acquire(name, wait=5, kind="fair")

        def fail(_queued):
            empty = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, empty, empty, "another call")

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await b.acquire(name, wait=10, kind="fair", on_queued=fail)
        assert info.value.details() == "another call"
        deadline = time.monotonic() + 5
        while (await a.describe(name)).waiters:
            assert time.monotonic() < deadline, "the waiter stayed in the queue"
            await asyncio.sleep(0.02)
        assert await holder.release()


async def test_a_grant_read_as_the_client_closes_is_not_held(target, name):
    """A grant read just as ``close()`` ran came back as a lease that read held, though
    the close had cancelled its call and the server was giving the lock back."""
    async with latchkey.aio.Client(target) as other:
        client = latchkey.aio.Client(target)
        real_acquire = client._stub.Acquire

        def acquire(*args, **kwargs):
            call = real_acquire(*args, **kwargs)
            real_read = call.read

            async def read():
                resp = await real_read()
                if resp is not grpc.aio.EOF and resp.WhichOneof("event") == "acquired":
                    await client.close()
                return resp

            call.read = read
            return call

        client._stub.Acquire = acquire
        lease = await client.acquire(name, wait=5)
        assert not lease.held, "granted while close() ran, yet it reads held"
        assert lease.lost.is_set()
        async with other.lock(name, wait=5):
            pass


async def test_a_task_cancelled_as_its_watch_closes_stays_cancelled(target, name):
    """A task cancelled as its watch was being closed ended its iteration and ran on:
    the cancel is the task's own, and it must stay cancelled."""
    async with latchkey.aio.Client(target) as client:
        watch = client.watch(name)
        first = asyncio.Event()

        async def iterate():
            async for _ in watch:
                first.set()

        task = asyncio.create_task(iterate())
        await asyncio.wait_for(first.wait(), 5)
        watch.close()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)


async def test_a_call_to_an_address_that_drops_connection_attempts_fails_unavailable_within_seconds(dropping_address):
    """As the blocking client's: the keepalive timeout bounds the connection attempt."""
    async with latchkey.aio.Client(dropping_address) as c:
        started = time.monotonic()
        with pytest.raises(latchkey.LockError) as info:
            await asyncio.wait_for(c.acquire("dropped", wait=0), 30)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
        assert time.monotonic() - started < 10


async def test_a_release_the_revoke_overtook_returns_false_the_lease_lost_as_revoked(
    start_server, workdir, freezable_proxy, name
):
    """As the sync client's test: a revoke that ends the stream before the server read
    the release loses the lease (REVOKED); the release returns False."""
    from conftest import free_within, start_revocable

    srv, revoke = start_revocable(start_server, workdir)
    proxy = freezable_proxy(srv.port)
    async with latchkey.aio.Client(proxy.target, token="py-token") as c:
        lease = await c.acquire("py/" + name, wait=5)
        proxy.hold_requests()
        releasing = asyncio.ensure_future(lease.release(20))
        await asyncio.sleep(0)
        revoke()
        assert await asyncio.wait_for(releasing, 30) is False
        assert lease.lost.is_set()
        assert lease.lost_reason == latchkey.REVOKED
    with latchkey.Client(srv.target, token="admin-token") as ops:
        assert free_within(ops, "py/" + name, 2.0)


async def test_blocks_entered_in_tasks_of_their_own_each_give_back_their_lease(target, name):
    """``asyncio.wait_for`` runs ``__aenter__`` in a task of its own before Python 3.12
    (a task does here on every version): with two such blocks open, an exit raised
    ``RuntimeError`` and gave back nothing, and so did every exit after it: both leases
    stayed held. Each exit now gives back a block whose entering task has ended."""
    async with latchkey.aio.Client(target) as client:
        sem = client.lock(name, kind="semaphore", limit=2, wait=5)
        leases = [await asyncio.create_task(sem.__aenter__()) for _ in range(2)]
        for _ in leases:
            await sem.__aexit__(None, None, None)
        assert all(lease.released for lease in leases)
        assert (await client.describe(name)).locked is False


async def test_a_task_started_inside_a_block_does_not_leave_that_block(target, name):
    """A task copies the context of the one that starts it, and so saw the block open
    there as its own: a child task started inside ``async with sem as outer:``, whose
    block's enter ran in a task of its own (``asyncio.wait_for`` before Python 3.12),
    released ``outer`` at its exit, and the lease its enter took stayed held. An exit
    now counts as its blocks only those its own task entered."""
    async with latchkey.aio.Client(target) as client:
        sem = client.lock(name, kind="semaphore", limit=2, wait=5)
        async with sem as outer:

            async def child():
                inner = await asyncio.create_task(sem.__aenter__())
                await sem.__aexit__(None, None, None)
                return inner

            inner = await asyncio.wait_for(asyncio.create_task(child()), 10)
            assert outer.held and not outer.released, "the child's exit released the parent's block"
            assert inner.released
            assert len((await client.describe(name)).holders) == 1
        assert outer.released
        assert (await client.describe(name)).locked is False


async def test_an_exit_shielded_in_a_task_of_its_own_ends_its_innermost_block(target, name):
    """An exit run in a task of its own (``asyncio.shield``) has entered no block; its
    context, a copy of its starter's, tells which block it ends: the innermost. It
    raised that several blocks were open elsewhere."""
    async with latchkey.aio.Client(target) as client:
        sem = client.lock(name, kind="semaphore", limit=2, wait=5)
        async with sem as outer:
            inner = await sem.__aenter__()
            await asyncio.shield(sem.__aexit__(None, None, None))
            assert inner.released
            assert outer.held and not outer.released
        assert outer.released
        assert (await client.describe(name)).locked is False


async def test_a_shielded_exit_beside_a_block_entered_through_wait_for_ends_its_own(target, name):
    """A block whose enter ran in a task that ended (``asyncio.wait_for`` before Python
    3.12) is the one to end for an exit whose context holds what the enter's did; not
    for another task's exit run in a task of its own, which ends its own block."""
    async with latchkey.aio.Client(target) as client:
        sem = client.lock(name, kind="semaphore", limit=2, wait=5)
        first = await asyncio.wait_for(sem.__aenter__(), 5)

        async def other():
            lease = await sem.__aenter__()
            await asyncio.shield(sem.__aexit__(None, None, None))
            return lease

        second = await asyncio.wait_for(asyncio.create_task(other()), 10)
        assert second.released, "the shielded exit ended another block"
        assert first.held and not first.released
        await sem.__aexit__(None, None, None)
        assert first.released
        assert (await client.describe(name)).locked is False


async def test_a_watch_the_other_side_cancels_raises_cancelled(fake_server):
    """As the blocking client's: a CANCELLED the other side sent raises."""
    target, _ = fake_server
    async with latchkey.aio.Client(target) as client:
        states = []
        with pytest.raises(latchkey.LockError) as info:
            async for state in client.watch("reset"):
                states.append(state)
        assert info.value.code == grpc.StatusCode.CANCELLED
        assert len(states) == 1
