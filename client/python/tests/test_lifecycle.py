"""The lease's lifecycle at its edges: cancelled reader tasks and releases, servers
killed, frozen and shut down, what is left running after close, and arguments checked
before any call. Each wait is bounded."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import pytest

import latchkey
import latchkey.aio
from conftest import free_within, freeze, wait_until


# --------------------------------------------------------------------------- asyncio


@pytest.mark.asyncio
async def test_aio_reader_task_cancelled_does_not_leave_the_lock_held_after_release(client, target, name):
    """A shutdown that cancels every other task (``for t in asyncio.all_tasks(): t.cancel()``,
    then clean up) cancels the lease's reader task while it waits in ``call.read()``.
    grpc.aio then cancels the call, so the server frees the lock and the lease reads
    lost. (A reader cancelled before its first step: the test after the next.)"""
    async with latchkey.aio.Client(target) as ac:
        lease = await ac.acquire(name, wait=5)
        # What ``for t in asyncio.all_tasks(): t.cancel()`` does to the lease's own task
        # (only that one here, so grpc.aio's tasks are left alone).
        await asyncio.sleep(0.1)  # the reader task is waiting for the next event
        reader = next(t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "_Stream.read")
        reader.cancel()
        await asyncio.sleep(0.2)
        told_lost = lease.lost.is_set()
        released = await lease.release(timeout=2)
        # The client says the lease is over (lost or released) ...
        assert told_lost or released
        # ... so the server must not hold the lock any more.
        freed = await asyncio.get_running_loop().run_in_executor(None, free_within, client, name, 3.0)
        assert freed, (
            f"lease told lost={told_lost} ({lease.lost_reason}, {lease.lost_code}), release() -> {released}, "
            f"yet the server still holds the lock: {client.describe(name).holders}"
        )


@pytest.mark.asyncio
async def test_aio_cancelled_direct_release_still_frees_the_lock(client, target, name):
    """``await lease.release()`` (no ``async with``) in a task cancelled during it: the
    server must still give the lock back (the Rust client's dropped release future
    half-closes the stream)."""
    async with latchkey.aio.Client(target) as ac:
        lease = await ac.acquire(name, wait=5)
        task = asyncio.ensure_future(lease.release())
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, latchkey.LockError):
            pass
        freed = await asyncio.get_running_loop().run_in_executor(None, free_within, client, name, 3.0)
        assert freed, f"held={lease.held} released={lease.released} lost={lease.lost_reason}"


@pytest.mark.asyncio
async def test_aio_server_sigkill_tells_the_holder_and_fails_the_waiter(client, start_server, name):
    srv = start_server()
    async with latchkey.aio.Client(srv.target) as a, latchkey.aio.Client(srv.target) as b:
        holder = await a.acquire(name, wait=5)
        queued = asyncio.Event()
        waiter = asyncio.ensure_future(b.acquire(name, wait=60, on_queued=lambda q: queued.set()))
        await asyncio.wait_for(queued.wait(), 5)
        srv.stop(signal.SIGKILL)
        assert await holder.wait_lost(5)
        assert holder.lost_reason == "DISCONNECTED"
        assert holder.lost_code == grpc.StatusCode.UNAVAILABLE
        assert not holder.held
        with pytest.raises(latchkey.LockError) as info:
            await asyncio.wait_for(waiter, 5)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert not isinstance(info.value, latchkey.LockTimeout)
        assert await holder.release() is False
    client.force_release(name)  # the session server shares the Redis


@pytest.mark.asyncio
async def test_aio_server_shutdown_tells_shutdown_with_code_and_info(start_server, name):
    srv = start_server()
    async with latchkey.aio.Client(srv.target) as ac:
        lease = await ac.acquire(name, wait=5)
        threading.Thread(target=srv.stop, daemon=True).start()
        assert await lease.wait_lost(5)
        await asyncio.sleep(0.2)
        assert lease.lost_reason == "SHUTDOWN"
        assert lease.lost_code == grpc.StatusCode.UNAVAILABLE
        assert await lease.release() is False


@pytest.mark.asyncio
async def test_aio_frozen_server_fails_a_waiting_acquire_within_keepalive(client, start_server, name):
    srv = start_server()
    try:
        async with latchkey.aio.Client(srv.target) as a, latchkey.aio.Client(srv.target) as b:
            holder = await a.acquire(name, wait=5)
            queued = asyncio.Event()
            waiter = asyncio.ensure_future(b.acquire(name, wait=60, on_queued=lambda q: queued.set()))
            await asyncio.wait_for(queued.wait(), 5)
            await asyncio.get_running_loop().run_in_executor(None, freeze, srv.proc)
            started = time.monotonic()
            assert await holder.wait_lost(15)
            with pytest.raises(latchkey.LockError) as info:
                await asyncio.wait_for(waiter, 15)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 15
            assert holder.lost_reason == "DISCONNECTED"
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.stop(signal.SIGKILL)
    client.force_release(name)  # the session server shares the Redis


@pytest.mark.asyncio
async def test_aio_no_task_left_running_after_close(target, name):
    me = asyncio.current_task()
    before = {t for t in asyncio.all_tasks() if t is not me}
    ac = latchkey.aio.Client(target)
    leases = [await ac.acquire(f"{name}/{i}", wait=5, lease=30 if i % 2 else None) for i in range(3)]
    with pytest.raises(latchkey.LockTimeout):
        await ac.acquire(f"{name}/0", wait=0)
    pending = asyncio.ensure_future(ac.acquire(f"{name}/1", wait=60))
    await asyncio.sleep(0.3)
    watch = ac.watch(f"{name}/0")
    await ac.close()
    with pytest.raises(latchkey.LockError):
        await asyncio.wait_for(pending, 5)

    def leftover():
        return {t for t in asyncio.all_tasks() if t is not me and not t.done()} - before

    for _ in range(50):
        if not leftover():
            break
        await asyncio.sleep(0.05)
    assert not leftover(), leftover()
    assert all(lease.lost.is_set() for lease in leases)
    watch.close()


@pytest.mark.asyncio
async def test_aio_invalid_argument_names_the_field(target, name):
    async with latchkey.aio.Client(target) as ac:
        with pytest.raises(latchkey.LockError) as info:
            await ac.acquire("", wait=0)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.info.get("field") == "open.name", info.value.info
        with pytest.raises(latchkey.LockError) as info:
            await ac.acquire(name, kind="semaphore", wait=0)  # no limit
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.info.get("field") == "open.limit", info.value.info
        with pytest.raises(latchkey.LockError) as info:
            await ac.acquire([name, name], wait=0)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.info.get("field", "").startswith("open.names"), info.value.info


# --------------------------------------------------------------------------- blocking


def _latchkey_threads(before):
    return {t for t in threading.enumerate() if t.is_alive()} - before


def test_sync_no_thread_left_running_after_close(target, name):
    """Leases (watchdog and fixed), a failed acquire, a waiting acquire on another
    thread: after ``close()`` every thread they started ends."""
    before = set(threading.enumerate())
    c = latchkey.Client(target)
    leases = [c.acquire(f"{name}/{i}", wait=5, lease=30 if i % 2 else None) for i in range(3)]
    with pytest.raises(latchkey.LockTimeout):
        c.acquire(f"{name}/0", wait=0)
    errors = []

    def wait():
        try:
            c.acquire(f"{name}/1", wait=60)
        except latchkey.LockError as err:
            errors.append(err)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    c.close()
    t.join(5)
    assert errors and errors[0].code == grpc.StatusCode.CANCELLED
    assert wait_until(lambda: not _latchkey_threads(before), 5), _latchkey_threads(before)
    assert all(lease.lost.is_set() for lease in leases)


def test_sync_released_leases_leave_no_thread(client, name):
    before = set(threading.enumerate())
    for i in range(3):
        with client.lock(name, wait=5, lease=30 if i % 2 else None):
            pass
    assert wait_until(lambda: not _latchkey_threads(before), 5), _latchkey_threads(before)


def test_sync_server_shutdown_tells_shutdown_with_code_and_info(start_server, name):
    srv = start_server()
    with latchkey.Client(srv.target) as client:
        lease = client.acquire(name, wait=5)
        srv.stop(signal.SIGTERM)
        assert lease.wait_lost(5)
        assert wait_until(lambda: lease.lost_code is not None, 2)
        assert lease.lost_reason == "SHUTDOWN"
        assert lease.lost_code == grpc.StatusCode.UNAVAILABLE
        assert lease.release() is False


def test_sync_on_queued_plain_exception_withdraws_the_fair_waiter(client, target, name):
    holder = client.acquire(name, kind="fair", wait=5)
    with latchkey.Client(target) as other:

        def boom(q):
            raise RuntimeError("no thanks")

        with pytest.raises(RuntimeError):
            other.acquire(name, kind="fair", on_queued=boom)
        assert wait_until(lambda: len(client.describe(name).waiters) == 0, 5)
    assert holder.release()


def test_sync_frozen_server_fails_a_waiting_acquire_within_keepalive(client, start_server, name):
    """A server that stops answering (SIGSTOP) mid-wait: the wait (60 s) does not hang,
    keepalive fails it UNAVAILABLE in about 7 s; the holder is told DISCONNECTED."""
    srv = start_server()
    try:
        with latchkey.Client(srv.target) as a, latchkey.Client(srv.target) as b:
            holder = a.acquire(name, wait=5)
            queued = threading.Event()
            errors = []

            def wait():
                try:
                    b.acquire(name, wait=60, on_queued=lambda q: queued.set())
                except latchkey.LockError as err:
                    errors.append(err)

            t = threading.Thread(target=wait, daemon=True)
            t.start()
            assert queued.wait(5)
            freeze(srv.proc)
            started = time.monotonic()
            assert holder.wait_lost(15)
            t.join(15)
            assert errors, "the waiter still waits"
            assert errors[0].code == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 15
            assert holder.lost_reason == "DISCONNECTED"
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.stop(signal.SIGKILL)
    client.force_release(name)  # the session server shares the Redis


def test_multi_lock_tokens_follow_the_order_of_names(client, name):
    a, b = f"{name}/b", f"{name}/a"  # not sorted: the server takes them sorted
    with client.lock(b, wait=5):
        pass  # b gets a token first, so b's token differs from a's history
    with client.lock([a, b], wait=5) as lease:
        tokens = dict(zip([a, b], lease.fencing_tokens))
        assert len(lease.fencing_tokens) == 2
        assert lease.fencing_token == lease.fencing_tokens[0]
        for n in (a, b):
            assert client.describe(n).last_fencing_token == tokens[n], (n, tokens)


def test_multi_lock_name_given_as_an_iterator_keeps_the_names(client, name):
    """``name`` may be any iterable of strings: the lease's ``name`` is the names it
    locked (it used to be the iterator, used up by the request)."""
    names = [f"{name}/x", f"{name}/y"]
    with client.lock(iter(names), wait=5) as lease:
        assert len(lease.fencing_tokens) == 2
        assert list(lease.name) == names, f"lease.name is {lease.name!r}"


def test_one_lock_request_serves_blocks_in_several_threads(client, name):
    """A ``client.lock(...)`` shared as a semaphore object is: each thread's block
    releases the lease it took, not the one entered last, and none is dropped early."""
    sem = client.lock(name, kind="semaphore", limit=2, wait=5)
    inside = threading.Barrier(3, timeout=10)
    leave = [threading.Event(), threading.Event()]
    left = [threading.Event(), threading.Event()]

    def block(i: int) -> None:
        with sem:
            inside.wait()
            leave[i].wait(10)
        left[i].set()

    threads = [threading.Thread(target=block, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    inside.wait()
    assert len(client.describe(name).holders) == 2
    leave[0].set()
    assert left[0].wait(10)
    assert len(client.describe(name).holders) == 1, "the second block's hold went with the first"
    leave[1].set()
    for t in threads:
        t.join(10)
    assert client.describe(name).locked is False


def test_lock_blocks_leave_nothing_in_their_context(client, name):
    """Each ``client.lock(...)`` block left a context variable of its own in its thread's
    context for as long as the thread lived: a loop of blocks grew memory without bound."""
    import contextvars

    with client.lock(name, wait=5):
        pass
    before = len(contextvars.copy_context())
    for i in range(20):
        with client.lock(f"{name}/{i}", wait=5):
            pass
    assert len(contextvars.copy_context()) == before


def test_a_block_left_in_another_thread_gives_back_its_lease(client, name):
    """A block entered on an executor's worker and left on another thread gives back
    its lease (it used to give back nothing: the lock stayed held)."""
    import concurrent.futures

    req = client.lock(name, wait=5)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        lease = pool.submit(req.__enter__).result(10)
        leaving = threading.Thread(target=req.__exit__, args=(None, None, None))
        leaving.start()
        leaving.join(10)
    assert lease.released
    assert client.describe(name).locked is False


def test_an_exit_that_cannot_tell_its_block_raises(client, name):
    """Two blocks open on other threads: an exit elsewhere cannot tell which it ends,
    and says so rather than give back nothing; each thread then leaves its own."""
    import concurrent.futures

    req = client.lock(name, kind="semaphore", limit=2, wait=5)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        entered = threading.Barrier(3, timeout=10)

        def enter():
            lease = req.__enter__()
            entered.wait()
            entered.wait()
            req.__exit__(None, None, None)
            return lease

        blocks = [pool.submit(enter) for _ in range(2)]
        entered.wait()
        with pytest.raises(RuntimeError, match="2 blocks"):
            req.__exit__(None, None, None)
        assert len(client.describe(name).holders) == 2
        entered.wait()
        assert all(block.result(10).released for block in blocks)
    assert client.describe(name).locked is False


def test_blocks_entered_on_threads_that_ended_each_give_back_their_lease(client, name):
    """The blocking twin of the asyncio one: with two blocks open that threads since
    ended entered (``asyncio.current_task()`` is None there, so they never counted as
    ended), an exit raised ``RuntimeError`` and gave back nothing, and both leases
    stayed held until ``close()``. Each exit now gives back a block whose thread ended."""
    sem = client.lock(name, kind="semaphore", limit=2, wait=5)
    leases = []
    for _ in range(2):
        entering = threading.Thread(target=lambda: leases.append(sem.__enter__()))
        entering.start()
        entering.join(10)
    assert len(leases) == 2
    for _ in leases:
        sem.__exit__(None, None, None)
    assert all(lease.released for lease in leases)
    assert free_within(client, name, 2.0)


def test_a_thread_given_a_block_s_context_does_not_leave_that_block(client, name):
    """A thread run in a copy of the context of a thread inside ``with sem as outer:``
    (``asyncio.to_thread`` copies it, as ``contextvars.copy_context().run`` does) saw
    that block as its own: its exit of a block entered on another thread released
    ``outer``, and the lease that enter took stayed held. An exit now counts as its
    blocks only those its own thread entered."""
    import contextvars

    sem = client.lock(name, kind="semaphore", limit=2, wait=5)
    with sem as outer:

        def child():
            entered = []
            entering = threading.Thread(target=lambda: entered.append(sem.__enter__()))
            entering.start()
            entering.join(10)
            sem.__exit__(None, None, None)
            return entered[0]

        result = []
        context = contextvars.copy_context()
        running = threading.Thread(target=lambda: result.append(context.run(child)))
        running.start()
        running.join(10)
        (inner,) = result
        assert outer.held and not outer.released, "the thread's exit released the block it inherited"
        assert inner.released
        assert len(client.describe(name).holders) == 1
    assert outer.released
    assert free_within(client, name, 2.0)


def test_a_block_entered_and_never_left_is_released_when_collected(client, name):
    """A ``client.lock(...)`` block entered and never left (an ``ExitStack`` dropped
    unclosed) is released when garbage collected, as a lease from ``acquire()`` is: the
    thread's context variable held the request's blocks and their lease for as long as
    the thread lived, and the lock stayed held."""
    import contextlib
    import gc

    stack = contextlib.ExitStack()
    stack.enter_context(client.lock(name, wait=5))
    assert client.describe(name).locked
    del stack
    gc.collect()
    assert free_within(client, name, 5.0), "the block's lease still holds the lock"


@pytest.mark.asyncio
async def test_aio_a_block_entered_and_never_left_is_released_when_collected(target, name):
    """The asyncio twin: an ``async with client.lock(...)`` block whose
    ``AsyncExitStack`` is dropped unclosed is released once collected; the task's
    context variable held its lease."""
    import contextlib
    import gc

    async with latchkey.aio.Client(target) as aclient:
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(aclient.lock(name, wait=5))
        assert (await aclient.describe(name)).locked
        del stack
        gc.collect()
        for _ in range(100):  # the finalizer's cancel runs on the loop
            await asyncio.sleep(0.05)
            state = await aclient.describe(name)
            if not state.locked and not state.holders:
                break
        assert not state.locked and not state.holders, "the block's lease still holds the lock"


def test_nested_blocks_of_one_request_keep_their_leases_while_open(client, name):
    """The blocks' context variable holds its leases weakly: the blocks of a request,
    nested and entered without ``as``, keep theirs until they are left, whatever the
    garbage collector does meanwhile, and each exit gives back its own."""
    import gc

    sem = client.lock(name, kind="semaphore", limit=2, wait=5)
    with sem:
        with sem:
            gc.collect()
            assert len(client.describe(name).holders) == 2
        assert len(client.describe(name).holders) == 1
        gc.collect()
        assert len(client.describe(name).holders) == 1
    assert free_within(client, name, 2.0)


def test_an_infinite_timeout_is_no_bound(target, name):
    """``math.inf`` waits without bound wherever a timeout is taken, as in the asyncio
    client and Node's (``threading`` overflowed on it, gRPC ended the call at once)."""
    import math

    with latchkey.Client(target, timeout=math.inf) as client:
        lease = client.acquire(name, wait=5)
        assert client.describe(name, timeout=math.inf).locked
        assert [s.name for s in client.list(name, timeout=math.inf)] == [name]
        assert lease.release(timeout=math.inf) is True
        assert lease.wait_lost(timeout=math.inf) is False
        assert client.describe(name).locked is False
        assert client.force_release(name, timeout=math.inf) is False


def test_semaphore_hold_count_is_the_permits_taken(client, name):
    with client.lock(name, kind="semaphore", limit=5, permits=3, wait=5) as lease:
        assert lease.hold_count == 3
        with pytest.raises(latchkey.LockTimeout):
            client.acquire(name, kind="semaphore", limit=5, permits=3, wait=0)
        with client.lock(name, kind="semaphore", limit=5, permits=2, wait=0) as second:
            assert second.hold_count == 2
            assert second.fencing_token > lease.fencing_token


@pytest.mark.parametrize(
    "args, field",
    [({"wait": -1}, "wait"), ({"wait": -0.001}, "wait"), ({"lease": 0}, "lease"), ({"lease": -5}, "lease")],
)
def test_a_negative_wait_or_lease_is_refused_before_any_call(name, args, field):
    """The README: "An argument of the wrong type or out of range raises TypeError or
    ValueError naming it, before any call": a negative ``wait`` (it used to reach the
    server), a ``lease`` not above 0."""
    c = latchkey.Client("127.0.0.1:1")  # nothing listens: a call would fail UNAVAILABLE
    try:
        with pytest.raises(ValueError, match=field):
            c.acquire(name, **args)
    finally:
        c.close()


@pytest.mark.asyncio
async def test_aio_reader_cancelled_before_its_first_step_ends_the_lease(client, target, name):
    """The lease's reader task is created by ``acquire()`` and first runs at the loop's
    next turn. Cancelled before then (code that cancels every other task right after
    an acquire), its ``try/finally`` never runs; the lease ends all the same: told lost,
    ``wait_lost()`` returns, and the server gives the lock back. (It used to stay
    ``held`` for good, the stream unread, the lock held by the server.)"""
    async with latchkey.aio.Client(target) as ac:
        lease = await ac.acquire(name, wait=5)
        reader = next(t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "_Stream.read")
        reader.cancel()  # before its first step
        over = await lease.wait_lost(3)
        assert over and not lease.held, f"held={lease.held} lost={lease.lost_reason} (wait_lost -> {over})"
        assert lease.lost_code == grpc.StatusCode.CANCELLED, lease.lost_code
        freed = await asyncio.get_running_loop().run_in_executor(None, free_within, client, name, 3.0)
        assert freed, client.describe(name).holders
        assert await lease.release(timeout=2) is False


@pytest.mark.asyncio
async def test_aio_release_after_reader_cancelled_before_start_does_not_raise_cancelled(client, target, name):
    """``release()`` right after such a cancel returns (it used to raise the reader's
    ``CancelledError`` into a task nobody cancelled), and the lock is given back."""
    async with latchkey.aio.Client(target) as ac:
        lease = await ac.acquire(name, wait=5)
        reader = next(t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "_Stream.read")
        reader.cancel()
        try:
            outcome = await lease.release(timeout=2)
        except asyncio.CancelledError:
            pytest.fail("release() raised CancelledError into a task that nobody cancelled")
        assert outcome in (True, False)
        freed = await asyncio.get_running_loop().run_in_executor(None, free_within, client, name, 3.0)
        assert freed


def test_redlock_without_deployments_is_failed_precondition(client, name):
    with pytest.raises(latchkey.LockError) as info:
        client.acquire(name, redlock=True, wait=0)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.reason == "REDLOCK_NOT_CONFIGURED"


def test_a_reentrant_fixed_lease_does_not_cut_the_first_holders_lease_short(client, target, name):
    """Out of the client's hands (server semantics), checked for what a holder is told:
    two streams of one owner, the first with a 10 s lease, the second with a 1 s lease
    it releases at once. The first holder is still told ``held``: nobody else may get
    the lock meanwhile."""
    first = client.acquire(name, owner="reentrant-owner", lease=10, wait=5)
    second = client.acquire(name, owner="reentrant-owner", lease=1, wait=5)
    assert second.hold_count == 2
    time.sleep(1.6)
    with latchkey.Client(target) as other:
        got = None
        try:
            got = other.acquire(name, wait=0)
        except latchkey.LockTimeout:
            pass
        held = first.held
        if got is not None:
            got.release()
    second.release()
    first.release()
    assert got is None or not held, f"another client got the lock while the first holder reads held={held}"


class _SilentCall:
    """A call that never answers, for a lease's stream driven by hand."""

    def cancel(self) -> bool:
        return True

    def __iter__(self):
        return self

    async def read(self):
        await asyncio.Event().wait()


class _LateOver(threading.Event):
    """``over`` as it stands in the window after a loss was marked under the lock and
    before ``over`` is set, outside it."""

    def set(self) -> None:
        pass


def test_sync_a_fixed_lease_end_keeps_a_loss_already_told():
    """The lease's end on the client's clock, judged in the moment after the reader
    marked a ``lost`` event but before it set ``over``, overwrote the reason told with
    ``LEASE_EXPIRED``."""
    import queue

    from latchkey._client import _Stream

    stream = _Stream(_SilentCall(), queue.Queue(), ends=time.monotonic() - 1)
    stream.over = _LateOver()
    stream.mark_lost("FORCE_RELEASED")
    stream.judge()
    assert stream.lost_reason == "FORCE_RELEASED"


LOST_AT_THE_GRANT = latchkey.LockError(
    grpc.StatusCode.ABORTED, "lease lost", reason="LEASE_LOST", info={"lostReason": "FORCE_RELEASED", "lockName": "x"}
)
SHUT_AT_THE_GRANT = latchkey.LockError(grpc.StatusCode.UNAVAILABLE, "shutting down", reason="SHUTTING_DOWN")


def test_sync_a_lost_event_dropped_before_the_first_read_is_read_from_the_status():
    """gRPC Python raises a status that came before a read was asked for and drops a
    message still unread: a ``lost`` at the grant, before the reader's first read, was
    reported ``DISCONNECTED``. The status repeats the reason, and is read for it."""
    import queue

    from latchkey._client import _Stream

    for ended, reason in [(LOST_AT_THE_GRANT, "FORCE_RELEASED"), (SHUT_AT_THE_GRANT, "SHUTDOWN")]:
        stream = _Stream(_SilentCall(), queue.Queue())
        stream.end(ended)
        assert (stream.lost_reason, stream.lost_code) == (reason, ended.code)
    releasing = _Stream(_SilentCall(), queue.Queue())
    releasing.releasing = True
    releasing.end(LOST_AT_THE_GRANT)
    assert releasing.outcome() is False, "a loss that overtook the release"


@pytest.mark.asyncio
async def test_aio_a_lost_event_dropped_before_the_first_read_is_read_from_the_status():
    """As the sync client's test, for the asyncio client's stream."""
    from latchkey.aio import _Stream

    for ended, reason in [(LOST_AT_THE_GRANT, "FORCE_RELEASED"), (SHUT_AT_THE_GRANT, "SHUTDOWN")]:
        stream = _Stream(_SilentCall(), None)
        stream.end(ended)
        stream.reader.cancel()
        assert (stream.lost_reason, stream.lost_code) == (reason, ended.code)
