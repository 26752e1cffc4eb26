"""A client, its leases and its watches across ``os.fork()``: in the child, the copies
are lost and unusable at once, and nothing of them calls into the parent's gRPC state;
the parent keeps its locks. A forked child runs its checks, reports through a pipe and
ends with ``os._exit``; every wait is bounded.

Each scenario runs in a Python process of its own (``run_isolated``), which forks: a
fork of a process whose gRPC has calls of other kinds in flight crashes the child now
and then, in gRPC itself (an asyncio call, or a blocking stream while gRPC's asyncio
layer is up: SIGSEGV, or an abort in its mutexes), and the test run's process holds
whatever the tests before left there."""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import signal
import subprocess
import time
import traceback
from pathlib import Path

import grpc
import pytest

import latchkey
import latchkey.aio
from conftest import free_within, python_child

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX")

#: How long a child may take, and how long a path of the child may wait: the checks
#: are local, and a path that called into the parent's gRPC state could hang. Loose
#: enough for a loaded machine; a path that waits out a timeout of its own (5 s) or
#: hangs still exceeds it.
CHILD_TIMEOUT = 20.0
AT_ONCE = 5.0

#: How long the output of a scenario killed for hanging is waited for.
KILLED_OUTPUT_TIMEOUT = 10.0


def run_isolated(scenario, *args) -> None:
    """Runs ``scenario(*args)`` (a function of this module, or a coroutine function, on
    a loop of its own) in a new Python process; fails with what it printed unless it
    returned. The process leads a process group of its own, which its forked children
    join: one left behind (its parent died while it hung) holds the output pipes, and
    only killing the whole group ends the wait for them."""
    call = f"{scenario.__name__}(*{args!r})"
    if inspect.iscoroutinefunction(scenario):
        call = f"asyncio.run({call})"
    child = python_child(
        f"""
        import asyncio, sys, warnings
        # Python 3.12 and later warn of any fork of a process with threads (gRPC's, here).
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_fork import *
        {call}
        print("scenario passed", flush=True)
        """,
        start_new_session=True,
    )
    try:
        out, err = child.communicate(timeout=2 * CHILD_TIMEOUT + 20)
    except subprocess.TimeoutExpired:
        kill_group(child)
        try:
            out, err = child.communicate(timeout=KILLED_OUTPUT_TIMEOUT)
        except subprocess.TimeoutExpired:
            out, err = "", "(its output could not be read)"
        pytest.fail(f"{scenario.__name__} did not end:\n{out}\n{err}")
    except BaseException:
        # Interrupted (Ctrl-C, pytest's timeout): the group is out of the test's own
        # process group, and nothing else would end it.
        kill_group(child)
        raise
    assert child.returncode == 0 and "scenario passed" in out, f"{scenario.__name__} failed:\n{out}\n{err}"


def kill_group(proc: subprocess.Popen) -> None:
    """Kills ``proc``'s process group (it leads one: ``start_new_session``), its forked
    children with it, and reaps ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the whole group is gone already
    try:
        proc.wait(timeout=KILLED_OUTPUT_TIMEOUT)
    except subprocess.TimeoutExpired:
        pass


def in_fork(check) -> str:
    """Runs ``check()`` in a child process after ``os.fork()``; returns what it returned
    (as text), and fails with its traceback, or when it has not exited within
    ``CHILD_TIMEOUT`` (it is killed then)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it ends here
        code, report = 1, "the child reported nothing"
        try:
            os.close(read_end)
            report, code = str(check()), 0
        except BaseException:
            report = traceback.format_exc()
        finally:
            try:
                os.write(write_end, report.encode()[-8000:])
            finally:
                os._exit(code)
    os.close(write_end)
    try:
        status = wait_child(pid)
        report = _read_all(read_end)
    finally:
        os.close(read_end)
    assert status is not None, f"the forked child had not exited after {CHILD_TIMEOUT}s (killed): {report}"
    assert os.waitstatus_to_exitcode(status) == 0, f"the forked child failed:\n{report}"
    return report


def wait_child(pid: int):
    """The child's wait status, or None when it had not exited within ``CHILD_TIMEOUT``
    (it is killed and reaped then)."""
    deadline = time.monotonic() + CHILD_TIMEOUT
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks).decode(errors="replace")
        chunks.append(chunk)


def assert_lost_here(lease) -> None:
    """A lease of the parent's, as the child sees it: lost (``DISCONNECTED``, no code),
    not held, not released."""
    assert not lease.held
    assert lease.lost.is_set()
    assert lease.lost_reason == latchkey.DISCONNECTED
    assert lease.lost_code is None
    assert not lease.released


def assert_forked_error(call, what: str) -> None:
    """``call()`` raises the closed client's ``LockError`` CANCELLED, naming the fork."""
    with pytest.raises(latchkey.LockError) as info:
        call()
    assert info.value.code == grpc.StatusCode.CANCELLED, (what, info.value)
    assert "before a fork" in info.value.details, (what, info.value)


def test_sync_leases_held_across_a_fork_are_lost_in_the_child_and_stay_the_parents(target, name):
    """In the child, the parent's leases (a watchdog one and a fixed one, whose timer
    and reader threads are gone) are lost at once, ``wait_lost()`` and ``release()``
    return at once, and every call on the inherited client raises; releasing, closing
    and dropping it all ends nothing of the parent's, whose locks stay held."""
    run_isolated(leases_across_a_fork, target, name)


def leases_across_a_fork(target: str, name: str) -> None:
    fixed_name = f"{name}/fixed"
    # Only in here, so that the child can drop every reference it has.
    kept = {"client": latchkey.Client(target)}
    client = kept["client"]
    kept["lease"] = client.acquire(name, wait=5)
    kept["fixed"] = client.acquire(fixed_name, wait=5, lease=60)
    kept["watch"] = client.watch(name)
    assert next(kept["watch"]).locked
    del client

    def child():
        started = time.monotonic()
        for lease in (kept["lease"], kept["fixed"]):
            assert_lost_here(lease)
            assert lease.wait_lost(timeout=2 * AT_ONCE) is True
            assert lease.release(timeout=2 * AT_ONCE) is False
            assert lease.release(timeout=2 * AT_ONCE) is False, "a second release tells the same"
        client, watch = kept["client"], kept["watch"]
        for what, call in {
            "acquire": lambda: client.acquire(f"{name}/child", wait=0),
            "lock": lambda: client.lock(f"{name}/child", wait=0),
            "describe": lambda: client.describe(name),
            "list": lambda: client.list(name),
            "force_release": lambda: client.force_release(name),
            "watch": lambda: client.watch(name),
            "a read of its watch": lambda: next(watch),
        }.items():
            assert_forked_error(call, what)
        watch.close()
        client.close()
        del client, watch
        kept.clear()  # the leases' and the client's finalizers, and gRPC's
        gc.collect()
        waited = time.monotonic() - started
        assert waited < AT_ONCE, f"the child's paths took {waited:.2f}s: one waited on the parent's gRPC"
        return "ok"

    assert in_fork(child) == "ok"
    client, lease, fixed = kept["client"], kept["lease"], kept["fixed"]
    assert lease.held and fixed.held and not lease.lost.is_set()
    state = client.describe(name)
    assert state.locked and [h.owner for h in state.holders] == [lease.owner]
    assert client.describe(fixed_name).locked
    assert lease.release() is True and fixed.release() is True
    assert any(not state.locked for state in kept["watch"]), "the parent's watch goes on, and sees the release"
    assert free_within(client, name, 2.0) and free_within(client, fixed_name, 2.0)
    client.close()


def test_sync_a_block_open_across_a_fork_is_left_in_the_child_without_releasing(target, name):
    """The child leaves a ``with client.lock(...)`` block the parent had entered before
    the fork, and the client's ``with`` block: the lease was lost there, so no error,
    and nothing is sent; the parent's block still holds the lock, and its own exit
    releases it."""
    run_isolated(a_block_across_a_fork, target, name)


def a_block_across_a_fork(target: str, name: str) -> None:
    with latchkey.Client(target) as client:
        request = client.lock(name, wait=5)
        with request as lease:

            def child():
                request.__exit__(None, None, None)  # as the child's `with` statement would
                assert_lost_here(lease)
                client.__exit__(None, None, None)
                return "ok"

            assert in_fork(child) == "ok"
            assert lease.held
            assert client.describe(name).locked
        assert lease.released
        assert free_within(client, name, 2.0)


def test_sync_a_child_that_exits_normally_leaves_the_parents_lock_held(target, name):
    """A child that releases, closes and drops its copies, then exits as a program
    does (the interpreter's own exit, which finalizes what is left, gRPC's objects
    too), ends nothing of the parent's: its lease stays held, and releases."""
    run_isolated(a_child_exiting_normally, target, name)


def a_child_exiting_normally(target: str, name: str) -> None:
    client = latchkey.Client(target)
    lease = client.acquire(name, wait=5)
    watch = client.watch(name)
    next(watch)
    pid = os.fork()
    if pid == 0:
        lost = lease.release(timeout=5) is False and not lease.held
        watch.close()
        client.close()
        del lease, watch, client
        gc.collect()
        raise SystemExit(0 if lost else 3)  # unwinds, and exits as a program does
    status = wait_child(pid)
    assert status is not None, "the child hung"
    assert os.waitstatus_to_exitcode(status) == 0
    time.sleep(0.2)
    state = client.describe(name)
    assert lease.held and state.locked and [h.owner for h in state.holders] == [lease.owner]
    assert lease.release() is True
    client.close()


def test_a_client_made_in_a_child_uses_a_local_subchannel_pool(target):
    """A client made in the child of a process that had made one gets connections of
    its own (``grpc.use_local_subchannel_pool``): gRPC's process-wide pool handed it
    the parent's, on which gRPC refuses to write in the child, and its first call
    failed UNAVAILABLE ("Wrong file descriptor generation") in most children. The child
    of a process that had made none (a worker forked before any client) shares
    connections as usual. The option is checked, not a call: gRPC gives no guarantee
    of a call in the child of a process that used it (its core aborts there now and
    then)."""
    run_isolated(the_options_of_a_child, target)


def the_options_of_a_child(target: str) -> None:
    from latchkey._common import LOCAL_SUBCHANNEL_POOL, channel_options

    def child_before_any_client():
        assert LOCAL_SUBCHANNEL_POOL not in channel_options(target, None)
        return "ok"

    assert in_fork(child_before_any_client) == "ok"
    parent = latchkey.Client(target)  # gRPC in use at the fork
    parent.describe("latchkey-fork-test")
    assert LOCAL_SUBCHANNEL_POOL not in channel_options(target, None)

    def child():
        assert LOCAL_SUBCHANNEL_POOL in channel_options(target, None)
        given = channel_options(target, [(LOCAL_SUBCHANNEL_POOL[0], 0)])
        assert dict(given)[LOCAL_SUBCHANNEL_POOL[0]] == 0, "the caller's own value wins"
        return "ok"

    assert in_fork(child) == "ok"
    parent.close()


class _CountingCall:
    """An asyncio call that never answers and counts the cancels that reach it, for a
    lease (or a watch) driven by hand: a fork while gRPC's asyncio layer has a call in
    flight crashes the child now and then (see the module), so the asyncio test has
    none."""

    def __init__(self) -> None:
        self.cancels = 0

    def cancel(self) -> bool:
        self.cancels += 1
        return True

    async def read(self):
        await asyncio.Event().wait()


def test_aio_leases_held_across_a_fork_are_lost_in_the_child_and_stay_the_parents(target, name):
    """The asyncio client in the child: the parent's leases (a watchdog one and a fixed
    one, whose reader tasks and timer are the parent loop's) are lost at once, their
    coroutines return at once on a loop of the child's own, the inherited client and
    watch raise, and no path cancels a call of the parent's. A new asyncio client
    raises too (gRPC's asyncio layer does not survive the fork: its calls would hang).
    The parent's leases stay held."""
    run_isolated(aio_leases_across_a_fork, target, name)


async def aio_leases_across_a_fork(target: str, name: str) -> None:
    from latchkey.aio import Lease, Watch

    aclient = latchkey.aio.Client(target)
    await aclient.describe(name)  # its channel is up, and idle at the fork
    loop = asyncio.get_running_loop()
    granted = latchkey.pb.Acquired(fencing_token=7, hold_count=1, owner="parent")
    calls = {"lease": _CountingCall(), "fixed": _CountingCall(), "watch": _CountingCall()}
    kept = {
        "lease": Lease(name, calls["lease"], granted),
        "fixed": Lease(f"{name}/fixed", calls["fixed"], granted, loop.time() + 60),
    }
    watch = Watch(calls["watch"], aclient)

    async def in_child_loop():
        for lease in kept.values():
            assert await asyncio.wait_for(lease.wait_lost(5), AT_ONCE) is True
            assert await asyncio.wait_for(lease.release(), AT_ONCE) is False
        for what, call in {
            "acquire": lambda: aclient.acquire(f"{name}/child", wait=0),
            "describe": lambda: aclient.describe(name),
            "list": lambda: aclient.list(name),
            "force_release": lambda: aclient.force_release(name),
            "a read of its watch": lambda: watch.__anext__(),
        }.items():
            with pytest.raises(latchkey.LockError) as info:
                await asyncio.wait_for(call(), AT_ONCE)
            assert info.value.code == grpc.StatusCode.CANCELLED and "before a fork" in info.value.details, what
        watch.close()
        await asyncio.wait_for(aclient.close(), AT_ONCE)

    def child():
        for lease in kept.values():
            assert_lost_here(lease)
        assert_forked_error(lambda: aclient.lock(name), "lock")
        assert_forked_error(lambda: aclient.watch(name), "watch")
        asyncio.run(in_child_loop())  # the parent's loop does not run here
        kept.clear()
        gc.collect()
        assert all(call.cancels == 0 for call in calls.values()), {k: c.cancels for k, c in calls.items()}
        with pytest.raises(RuntimeError, match="asyncio layer"):
            latchkey.aio.Client(target)
        return "ok"

    assert in_fork(child) == "ok"
    for lease in kept.values():
        assert lease.held and not lease.lost.is_set()
    for lease in kept.values():
        lease._stream.drop()
    await aclient.close()


def test_a_grandchild_resets_what_its_parent_inherited(target, name):
    """A fork of a forked child resets the objects the child inherited once more: a
    lease's lock that a thread of the child held at the second fork is free in the
    grandchild, whose ``release()`` returns at once. One object whose reset fails does
    not stop the others'."""
    run_isolated(a_fork_of_a_forked_child, target, name)


class _FailsToReset:
    def forked(self) -> None:
        raise RuntimeError("this reset fails (on purpose)")


def a_fork_of_a_forked_child(target: str, name: str) -> None:
    import threading

    from latchkey._common import on_fork

    failing = _FailsToReset()
    on_fork(failing)
    client = latchkey.Client(target)
    lease = client.acquire(name, wait=5)

    def child():
        assert_lost_here(lease)
        holding, done = threading.Event(), threading.Event()

        def hold_the_lock():
            with lease._stream.state_lock, client._lock:
                holding.set()
                done.wait(3 * AT_ONCE)

        holder = threading.Thread(target=hold_the_lock, daemon=True)
        holder.start()
        assert holding.wait(AT_ONCE)

        def grandchild():
            started = time.monotonic()
            assert lease.release(timeout=AT_ONCE) is False
            client.close()
            waited = time.monotonic() - started
            assert waited < AT_ONCE, f"the grandchild waited {waited:.2f}s on a lock its parent's thread held"
            return "ok"

        try:
            return in_fork(grandchild)
        finally:
            done.set()

    assert in_fork(child) == "ok"
    assert lease.held and client.describe(name).locked
    assert lease.release() is True
    client.close()


def test_a_stream_of_another_process_calls_no_grpc_before_the_fork_hook(monkeypatch):
    """A finalizer may drop a lease in the child before the fork hook has marked its
    stream inherited (CPython clears the dead threads' state first): the process id
    tells it is the parent's, and nothing reaches its call or its loop."""
    import queue

    from latchkey._client import _Stream as SyncStream
    from latchkey.aio import _Stream as AioStream

    sync_call = _CountingCall()  # the blocking stream only cancels it
    sync_stream = SyncStream(sync_call, queue.Queue())
    real_pid = os.getpid()

    async def aio_stream():
        stream = AioStream(_CountingCall(), None)
        await asyncio.sleep(0)
        return stream

    loop = asyncio.new_event_loop()
    try:
        stream = loop.run_until_complete(aio_stream())
        monkeypatch.setattr(os, "getpid", lambda: real_pid + 1)
        sync_stream.drop()
        sync_stream.cancel()
        stream.drop_soon()
        stream.drop()
        assert sync_call.cancels == 0 and stream.call.cancels == 0
        assert loop._ready == type(loop._ready)(), "the finalizer scheduled work on the parent's loop"
        monkeypatch.undo()
        sync_stream.drop()
        stream.drop()
        assert sync_call.cancels == 1 and stream.call.cancels == 1
        stream.reader.cancel()
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()


class _RecordsReset:
    def __init__(self) -> None:
        self.resets = 0

    def forked(self) -> None:
        self.resets += 1


def test_one_reset_that_fails_stops_no_other(monkeypatch):
    """The fork hook resets every object, whichever order its registry yields them in:
    one whose reset raises is logged, and those after it are reset all the same (the
    hook's runner could not pass the error on)."""
    from latchkey import _common

    recorder = _RecordsReset()
    monkeypatch.setattr(_common, "_FORKABLE", [_FailsToReset(), recorder, _FailsToReset()])
    monkeypatch.setattr(_common, "_forked_child", False)
    _common.after_fork_in_child()
    assert recorder.resets == 1
