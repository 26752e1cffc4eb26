"""The blocking client against a real latchkey-server and Redis."""

from __future__ import annotations

import concurrent.futures
import datetime
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

import latchkey
from latchkey import pb
from latchkey._common import judgement_time
from conftest import free_within, freeze, interrupt_while_queued, python_child, read_line, start_revocable, wait_until


def test_hold_and_exclusion(client, name):
    with client.lock(name, wait=5) as lease:
        assert lease.fencing_token > 0
        assert lease.hold_count == 1
        assert lease.owner
        assert not lease.lost.is_set()
        assert lease.held
        with pytest.raises(latchkey.LockTimeout) as info:
            with client.lock(name, wait=0):
                pytest.fail("second holder got the lock")
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert isinstance(info.value, latchkey.LockError)
        assert name in info.value.details
        # a short positive wait runs out too
        t0 = time.monotonic()
        with pytest.raises(latchkey.LockTimeout):
            with client.lock(name, wait=0.3):
                pass
        assert 0.2 < time.monotonic() - t0 < 3
    assert lease.released
    assert not lease.lost.is_set()


def test_release_on_leaving_block(target, name):
    with latchkey.Client(target) as a, latchkey.Client(target) as b:
        with a.lock(name, wait=5):
            pass
        t0 = time.monotonic()
        with b.lock(name, wait=0) as lease:
            assert lease.fencing_token > 0
        assert time.monotonic() - t0 < 1


def test_fencing_tokens_increase(client, name):
    tokens = []
    for _ in range(4):
        with client.lock(name, wait=5) as lease:
            tokens.append(lease.fencing_token)
    assert tokens == sorted(tokens) and len(set(tokens)) == 4, tokens
    assert client.describe(name).last_fencing_token == tokens[-1]


def test_waiter_acquires_promptly_after_release(target, name):
    acquired_at = []
    errors = []
    waiting = threading.Event()

    with latchkey.Client(target) as holder_client, latchkey.Client(target) as waiter_client:
        holder = holder_client.acquire(name, wait=5)

        def waiter():
            try:
                waiting.set()
                with waiter_client.lock(name, wait=20) as lease:
                    acquired_at.append((time.monotonic(), lease.fencing_token))
            except Exception as err:  # surfaced below
                errors.append(err)

        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        waiting.wait(5)
        # the waiter is queued behind the holder
        assert wait_until(lambda: not t.is_alive() or bool(acquired_at), 0.5) is False
        released_at = time.monotonic()
        assert holder.release()
        t.join(10)
        assert not t.is_alive()
        assert not errors, errors
        assert acquired_at, "waiter never acquired"
        latency = acquired_at[0][0] - released_at
        assert latency < 1.0, f"waiter acquired {latency:.3f}s after the release"
        assert acquired_at[0][1] > holder.fencing_token


def test_many_threads_on_one_client_exclude_each_other(client, name):
    """Threads sharing one client take the lock in turn: never two inside at once, and
    the lock is left free, with no waiter, when they are done."""
    inside = []
    overlaps = []
    lock = threading.Lock()

    def work():
        for _ in range(5):
            with client.lock(name, wait=30):
                with lock:
                    inside.append(1)
                    if len(inside) > 1:
                        overlaps.append(1)
                time.sleep(0.005)
                with lock:
                    inside.pop()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not overlaps
    assert free_within(client, name, 2.0)


def test_fixed_lease_expires_sets_lost(client, name):
    with client.lock(name, wait=5, lease=0.6) as lease:
        # A tenth less than asked: the server gives it back that early.
        assert lease.lease == datetime.timedelta(milliseconds=540)
        assert lease.lost.wait(5), "no lost event after the fixed lease"
        assert lease.lost_reason == "LEASE_EXPIRED"
        assert not lease.held
    assert not lease.released  # nothing to release any more; leaving the block did not raise
    # The client's clock ends the lease a little before Redis expires the lock (it counts
    # from before the request was sent), so the next holder may wait those few ms.
    with client.lock(name, wait=1):
        pass


def test_a_fixed_lease_queued_longer_than_itself_is_held_for_its_length(client, name):
    """The lease counts from the try that granted it, and the client counts from there
    too (the server says how long it waited first): a waiter queued longer than its
    lease was told ``LEASE_EXPIRED`` the moment it was granted."""
    holder = client.acquire(name, wait=5)
    done = []
    waiter = threading.Thread(target=lambda: done.append(client.acquire(name, wait=10, lease=0.8)))
    waiter.start()
    time.sleep(1.2)
    assert holder.release()
    waiter.join(10)
    granted = time.monotonic()
    lease = done[0]
    assert lease.lost.wait(5), "no lost event after the fixed lease"
    assert lease.lost_reason == "LEASE_EXPIRED"
    held_for = time.monotonic() - granted
    assert held_for >= 0.5, f"held {held_for:.2f}s of a 0.8 s lease"


# How late the client's own clock may tell a fixed lease's end (one timer thread).
TOLD_AT_THE_END_WITHIN = 1.0


def test_a_fixed_lease_is_told_lost_at_its_end_by_the_clients_clock(start_server, name):
    """With the server frozen (SIGSTOP) after the grant, its ``lost`` cannot arrive and
    keepalive would notice only 4 to 7 s later: the client's own clock tells the holder
    at the fixed lease's end (counted from before the request was sent) and cancels the
    stream, so leaving the block does not wait for the unreachable server."""
    srv = start_server()
    with latchkey.Client(srv.target) as client:
        asked = time.monotonic()
        lease = client.acquire(name, wait=5, lease=1.0)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            with lease:
                assert not lease.lost.wait(max(0.0, asked + 0.5 - time.monotonic())), lease.lost_reason
                assert lease.held
                assert lease.lost.wait(asked + 1.0 + TOLD_AT_THE_END_WITHIN - time.monotonic()), (
                    f"the fixed lease of a frozen server reads held={lease.held} "
                    f"{time.monotonic() - asked:.2f}s after it was asked for"
                )
                assert lease.lost_reason == "LEASE_EXPIRED"
                assert not lease.held
                assert wait_until(lambda: lease.lost_code is not None, 1.0)
                assert lease.lost_code == grpc.StatusCode.CANCELLED  # the client ended the stream
                leaving = time.monotonic()
            assert time.monotonic() - leaving < 1.0, "leaving the block waited for the frozen server"
            assert not lease.released
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)


def test_a_force_release_read_after_a_stalled_process_is_not_lease_expired(client, target, name):
    """A ``lost`` that arrived while the process was stalled (SIGSTOP) past a fixed
    lease's end is the reason, not the end by the client's clock: the reader thread is
    given a moment to deliver what gRPC already holds before the end is judged. It used
    to read ``LEASE_EXPIRED`` (with the code and info of the force release): the main
    thread's read of ``lost_reason`` ran before the reader thread did. Three rounds, as
    a round that passes by the threads' luck proves little."""
    rounds = 3
    # A wide settle window: how soon the reader thread runs after SIGCONT is the
    # machine's scheduling, which the test is not about.
    child = python_child(
        f"""
        import time, latchkey, latchkey._client
        latchkey._client.SETTLE_SECONDS = 0.5
        with latchkey.Client({target!r}) as c:
            for n in range({rounds}):
                lease = c.acquire(f"{name}/{{n}}", wait=5, lease=1.5)
                print("held", flush=True)
                while lease.lost_reason is None:
                    time.sleep(0.005)
                reason = lease.lost_reason
                deadline = time.monotonic() + 5
                while lease.lost_code is None and time.monotonic() < deadline:
                    time.sleep(0.005)
                print(reason, lease.lost_code, lease.lost_info.get("lostReason"), flush=True)
        """
    )
    try:
        for n in range(rounds):
            assert read_line(child) == "held"
            freeze(child)
            try:
                assert client.force_release(f"{name}/{n}")
                time.sleep(1.5)  # the child stalls past the lease's end, the notice waiting for it
            finally:
                os.kill(child.pid, signal.SIGCONT)
            assert read_line(child) == "FORCE_RELEASED StatusCode.ABORTED FORCE_RELEASED", f"round {n}"
        child.wait(10)
        assert child.returncode == 0, child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_lease_end_still_ahead_is_judged_at_the_end():
    """A fixed lease's end is judged at the end while it is ahead, however close (a
    lease shorter than the settle window, whose timer fires at once, was judged a
    settle window after its grant, past the end, where Redis may have given the lock
    to another), and a settle window after it is found passed."""
    assert judgement_time(10.0, 9.99, 0.05) == 10.0
    assert judgement_time(10.0, 9.0, 0.05) == 10.0
    assert judgement_time(10.0, 10.2, 0.05) == pytest.approx(10.25)


def test_a_released_fixed_lease_is_not_told_lost_at_its_end(client, name):
    """Releasing a fixed lease cancels its one timer: the end passes with no spurious
    ``lost``. A watchdog lease starts no timer at all."""
    def timers(lock_name):
        return [t for t in threading.enumerate() if t.name == f"latchkey-lease-end-{lock_name}"]

    lease = client.acquire(name, wait=5, lease=0.5)
    assert len(timers(name)) == 1
    assert lease.release()
    assert wait_until(lambda: not timers(name), 1.0), "the released lease's timer is still running"
    assert not lease.lost.wait(1.0), lease.lost_reason
    assert lease.lost_reason is None
    assert lease.released and not lease.held
    with client.lock(f"{name}/watchdog", wait=5) as watchdog:
        assert not timers(f"{name}/watchdog")
        assert watchdog.held


def test_force_release_sets_lost(target, name):
    with latchkey.Client(target) as a, latchkey.Client(target) as admin:
        with a.lock(name, wait=5) as lease:
            assert admin.force_release(name) is True
            assert lease.lost.wait(5)
            assert lease.lost_reason == "FORCE_RELEASED"
            # the status that ends the stream follows the lost event
            assert wait_until(lambda: lease.lost_code is not None, 5)
            assert lease.lost_code == grpc.StatusCode.ABORTED
            with admin.lock(name, wait=2) as other:
                assert other.fencing_token > lease.fencing_token
        assert admin.force_release(name) is False


def test_a_lock_larger_than_four_mib_is_described(client, redis, name):
    """A lock's state grows past gRPC's default 4 MiB with thousands of holders of long
    owner ids; the client takes it whole."""
    many = ("for i = 1, 5000 do redis.call('hset', KEYS[1], string.rep('o', 1000) .. i, 1) end "
            "redis.call('pexpire', KEYS[1], 60000)")
    subprocess.run(["redis-cli", "-p", str(redis.port), "EVAL", many, "1", name], check=True,
                   capture_output=True, timeout=10)
    assert len(client.describe(name).holders) == 5000


def test_describe_and_list_show_holder(client, name):
    owner = f"py-owner-{name}"
    assert client.describe(name).locked is False
    names = [f"{name}/a", f"{name}/b", f"{name}/c"]
    leases = [client.acquire(n, wait=5, owner=owner) for n in names]
    try:
        state = client.describe(names[0])
        assert isinstance(state, latchkey.LockState)
        assert state.locked
        assert state.name == names[0]
        assert [h.owner for h in state.holders] == [owner]
        assert state.holders[0].hold_count == 1
        assert state.last_fencing_token == leases[0].fencing_token
        assert leases[0].owner == owner
        listed = client.list(prefix=name + "/", page_size=1)  # follows three pages
        assert [s.name for s in listed] == names
        assert all(s.locked and s.holders[0].owner == owner for s in listed)
    finally:
        for lease in leases:
            lease.release()
    assert client.describe(names[0]).locked is False


def test_exception_in_block_still_releases(client, name):
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with client.lock(name, wait=5) as lease:
            raise Boom()
    assert lease.released
    with client.lock(name, wait=0):
        pass


def test_reentrant_owner(client, name):
    with client.lock(name, wait=5, owner="same-owner") as first:
        with client.lock(name, wait=0, owner="same-owner") as second:
            assert second.hold_count == 2
            assert client.describe(name).holders[0].hold_count == 2
        assert first.hold_count == 1
        assert client.describe(name).holders[0].hold_count == 1
    assert client.describe(name).locked is False


@pytest.mark.parametrize("kind", ["semaphore", "SEMAPHORE", "LOCK_KIND_SEMAPHORE", pb.LOCK_KIND_SEMAPHORE])
def test_semaphore(client, name, kind):
    with client.lock(name, kind=kind, limit=3, permits=2, wait=5) as a:
        with client.lock(name, kind=kind, limit=3, wait=0) as b:
            assert a.fencing_token and b.fencing_token
            with pytest.raises(latchkey.LockTimeout):
                with client.lock(name, kind=kind, limit=3, wait=0):
                    pass
            state = client.describe(name)
            assert state.kind == pb.LOCK_KIND_SEMAPHORE
        with client.lock(name, kind=kind, limit=3, wait=0):
            pass
    with pytest.raises(latchkey.LockError) as info:
        with client.lock(name, kind=kind, limit=5, wait=0):
            with client.lock(name, kind=kind, limit=4, wait=0):
                pass
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_read_write(client, name):
    with client.lock(name, kind="read", wait=5), client.lock(name, kind=pb.LOCK_KIND_READ, wait=0):
        assert client.describe(name).kind == pb.LOCK_KIND_READ
        with pytest.raises(latchkey.LockTimeout):
            with client.lock(name, kind="write", wait=0):
                pass
    with client.lock(name, kind="write", wait=0):
        with pytest.raises(latchkey.LockTimeout):
            with client.lock(name, kind="read", wait=0):
                pass


def test_fair_lock(client, name):
    with client.lock(name, kind="fair", wait=5) as lease:
        assert lease.fencing_token > 0
    with client.lock(name, kind="fair", wait=0):
        pass


def test_a_wait_that_runs_out_on_a_held_fair_lock_leaves_no_waiter(client, name):
    """A try-once or short wait on a held fair lock raises ``LockTimeout`` and leaves no
    entry in the lock's queue behind it."""
    holder = client.acquire(name, kind="fair", wait=5)
    with latchkey.Client(client.target) as other:
        with pytest.raises(latchkey.LockTimeout):
            other.acquire(name, kind="fair", wait=0)
        with pytest.raises(latchkey.LockTimeout):
            other.acquire(name, kind="fair", wait=0.3)
    assert client.describe(name).waiters == []
    assert holder.release()


def test_incompatible_kind_is_lock_error(client, name):
    with client.lock(name, wait=5):
        with pytest.raises(latchkey.LockError) as info:
            with client.lock(name, kind="write", wait=0):
                pass
    assert not isinstance(info.value, latchkey.LockTimeout)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_invalid_argument(client):
    with pytest.raises(latchkey.LockError) as info:
        with client.lock("", wait=0):
            pass
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValueError):
        client.lock("x", kind="nope").__enter__()


def test_watchdog_keeps_lease_alive(start_server, name):
    srv = start_server("--watchdog-timeout", "900ms")
    with latchkey.Client(srv.target) as client:
        with client.lock(name, wait=5) as lease:
            assert lease.lease == datetime.timedelta(milliseconds=900)
            assert not lease.lost.wait(2.5), lease.lost_reason
            assert client.describe(name).locked
        assert lease.released


def test_server_shutdown_sets_lost(start_server, name):
    srv = start_server()
    with latchkey.Client(srv.target) as client:
        with client.lock(name, wait=5) as lease:
            srv.stop(signal.SIGTERM)
            assert lease.lost.wait(5)
            assert lease.lost_reason == "SHUTDOWN"


def test_broken_stream_sets_disconnected(start_server, name):
    srv = start_server()
    with latchkey.Client(srv.target) as client:
        with client.lock(name, wait=5) as lease:
            srv.stop(signal.SIGKILL)
            assert lease.lost.wait(5)
            assert lease.lost_reason == "DISCONNECTED"
            assert lease.lost_code == grpc.StatusCode.UNAVAILABLE
    # the killed server's lease stays in Redis until its watchdog TTL: clean it up
    with latchkey.Client(start_server().target) as admin:
        admin.force_release(name)


def _stop_while_a_waiter_waits(start_server, name, sig, check):
    """Stops a server with ``sig`` while a waiter waits behind a holder of ``name`` on
    it; ``check(errors, holder)`` then reads what the waiter raised and the holder."""
    srv = start_server()
    with latchkey.Client(srv.target) as a, latchkey.Client(srv.target) as b:
        holder = a.acquire(name, wait=5)
        errors = []
        queued = threading.Event()

        def wait():
            try:
                b.acquire(name, wait=60, on_queued=lambda q: queued.set())
            except latchkey.LockError as err:
                errors.append(err)

        t = threading.Thread(target=wait)
        t.start()
        assert queued.wait(5)
        srv.stop(sig)
        t.join(10)
        assert not t.is_alive()
        check(errors, holder)


def test_a_server_killed_mid_wait_fails_the_wait_unavailable(start_server, name):
    """A server killed (SIGKILL) while an acquire waits fails the wait ``LockError``
    UNAVAILABLE, at once rather than at the wait's end, and its holder's lease reads
    lost (``DISCONNECTED``)."""

    def check(errors, holder):
        assert errors and errors[0].code == grpc.StatusCode.UNAVAILABLE, errors
        assert holder.wait_lost(5)
        assert holder.lost_reason == "DISCONNECTED"

    _stop_while_a_waiter_waits(start_server, name, signal.SIGKILL, check)
    with latchkey.Client(start_server().target) as admin:
        admin.force_release(name)


def test_a_server_stopping_mid_wait_fails_the_wait_unavailable_shutting_down(start_server, name):
    """A server stopped (SIGTERM) while an acquire waits refuses the wait UNAVAILABLE
    (``SHUTTING_DOWN``), never a ``LockTimeout`` nor a hang, and tells its holder
    ``SHUTDOWN``."""

    def check(errors, holder):
        # Never granted: a shutdown hands no lock to a waiter of its own server.
        assert [(e.code, e.reason) for e in errors] == [(grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")]
        assert not isinstance(errors[0], latchkey.LockTimeout)
        assert holder.wait_lost(5) and holder.lost_reason == "SHUTDOWN"

    _stop_while_a_waiter_waits(start_server, name, signal.SIGTERM, check)


@pytest.mark.parametrize("kind", ["mutex", "fair"])
def test_a_server_stopping_with_a_holder_and_a_waiter_leaves_nothing_in_redis(start_server, name, kind):
    """SIGTERM a server that has a holder and a queued waiter of one lock: the waiter's
    acquire fails UNAVAILABLE (a shutdown grants no waiter of its own), and once the server has exited
    nothing of the lock is left in Redis for a TTL to clean up (DESIGN: graceful
    shutdown releases every lease the process holds). Ten rounds, for the two orders."""
    for attempt in range(10):
        srv = start_server()
        n = f"{name}/{attempt}"
        outcome = []
        with latchkey.Client(srv.target) as a, latchkey.Client(srv.target) as b:
            holder = a.acquire(n, wait=5, kind=kind)
            queued = threading.Event()

            def wait():
                try:
                    got = b.acquire(n, wait=60, kind=kind, on_queued=lambda q: queued.set())
                    outcome.append(("granted", got.wait_lost(5), got.lost_reason))
                except latchkey.LockError as err:
                    outcome.append(("error", err.code, err.reason))

            t = threading.Thread(target=wait)
            t.start()
            assert queued.wait(5)
            srv.stop(signal.SIGTERM)
            assert srv.proc.returncode is not None
            t.join(10)
            assert holder.wait_lost(5) and holder.lost_reason == "SHUTDOWN"
        with latchkey.Client(start_server().target) as admin:
            state = admin.describe(n)
            assert not state.locked and not state.holders, (attempt, outcome, state)
        assert outcome == [("error", grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")], outcome


def test_a_fair_waiter_of_a_killed_server_leaves_the_queue_and_blocks_nobody(redis, start_server, name):
    """The queue entry of a fair waiter whose server was killed (no withdrawal sent)
    times out within seconds, and the next acquirer through another server gets the
    lock promptly once it is released: the dead waiter blocks nobody."""
    a_srv = start_server()
    b_srv = start_server()
    with latchkey.Client(a_srv.target) as a, latchkey.Client(b_srv.target) as b:
        holder = a.acquire(name, kind="fair", wait=5)
        waiting = threading.Thread(
            target=lambda: pytest.raises(latchkey.LockError, b.acquire, name, kind="fair"), daemon=True
        )
        waiting.start()
        assert wait_until(lambda: len(a.describe(name).waiters) == 1, 5)
        b_srv.stop(signal.SIGKILL)
        t0 = time.monotonic()
        # The dead server's queue entry times out (about 5 s, Redisson's thread wait).
        assert wait_until(lambda: len(a.describe(name).waiters) == 0, 15, 0.2)
        assert time.monotonic() - t0 < 10
        assert holder.release()
        t1 = time.monotonic()
        with latchkey.Client(a_srv.target) as c:
            nxt = c.acquire(name, kind="fair", wait=10)
            assert time.monotonic() - t1 < 2.0
            assert nxt.release()


def test_redis_restarted_empty_tells_the_holder_not_held(start_redis, start_server, name):
    """A Redis restarted empty under a watchdog lease: every ``wait_lost()`` returns
    True, the reason is ``NOT_HELD`` (the server's renewal found the lock gone), the
    stream ends ABORTED with that reason in its ``ErrorInfo``, and ``release()`` returns
    False."""
    r = start_redis()
    srv = start_server("--watchdog-timeout", "900ms", redis_url=r.url)
    with latchkey.Client(srv.target) as client:
        lease = client.acquire(name, wait=5)
        waits = []
        threads = [threading.Thread(target=lambda: waits.append(lease.wait_lost(10))) for _ in range(3)]
        for t in threads:
            t.start()
        r.restart()
        for t in threads:
            t.join(15)
        assert waits == [True, True, True]
        assert lease.lost_reason == "NOT_HELD"
        # The code is the status that ends the stream, right after the `lost` event.
        assert wait_until(lambda: lease.lost_code is not None, 5)
        assert lease.lost_code == grpc.StatusCode.ABORTED
        assert lease.lost_info.get("lostReason") == "NOT_HELD"
        assert lease.release() is False


def test_a_fixed_lease_whose_redis_restarted_empty_is_told_not_held_at_once(start_redis, start_server, name):
    """A fixed lease whose Redis restarted empty is told ``NOT_HELD`` by the server's
    check, within a renewal round, not at the lease's end (8 s) by the client's clock;
    a waiter then gets the lock."""
    r = start_redis()
    srv = start_server("--watchdog-timeout", "900ms", redis_url=r.url)
    with latchkey.Client(srv.target) as client:
        lease = client.acquire(name, wait=5, lease=8)
        waiter_errors = []
        got = []

        def wait():
            try:
                with latchkey.Client(srv.target) as c2:
                    l2 = c2.acquire(name, wait=15)
                    got.append(time.monotonic())
                    l2.release()
            except latchkey.LockError as err:
                waiter_errors.append(err)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        r.restart()
        assert lease.wait_lost(10)
        told = time.monotonic() - t0
        t.join(20)
        assert lease.lost_reason == "NOT_HELD"
        assert told < 3.0
        assert not waiter_errors and len(got) == 1


def test_unreachable_server_is_lock_error(name):
    from conftest import free_port

    with latchkey.Client(f"127.0.0.1:{free_port()}") as client:
        with pytest.raises(latchkey.LockError) as info:
            with client.lock(name, wait=0):
                pass
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_unix_socket_target(start_server, workdir, name):
    sock = workdir / f"lk-{time.monotonic_ns()}.sock"
    srv = start_server("--unix-socket", str(sock))
    assert wait_until(sock.exists, 5)
    with latchkey.Client(f"unix://{sock}") as client:
        with client.lock(name, wait=5) as lease:
            assert lease.fencing_token > 0
        assert client.describe(name).locked is False
    srv.stop()


def test_a_url_target_as_the_cli_writes_it(target, name):
    """``http://host:port``, the CLI's and ``LATCHKEY_SERVER``'s form, was refused by
    grpc's resolver."""
    with latchkey.Client(f"http://{target}/") as client:
        with client.lock(name, wait=5) as lease:
            assert lease.fencing_token > 0
        assert client.target == target


@pytest.mark.parametrize(
    "url, expected",
    [
        ("http://latchkey", "latchkey:80"),
        ("https://latchkey", "latchkey"),
        ("HTTP://latchkey:7", "latchkey:7"),
        ("http://latchkey/", "latchkey:80"),
        ("http://latchkey:50051", "latchkey:50051"),
        ("https://latchkey:50051/", "latchkey:50051"),
        ("http://[::1]", "[::1]:80"),
        ("https://[::1]", "[::1]"),
        ("http://[::1]:50051", "[::1]:50051"),
        ("http://h:1/x", "h:1"),
        ("http://h:1?x=1", "h:1"),
        ("http://h#x", "h:80"),
        ("http://u@h:1", "h:1"),
        ("https://user@host", "host"),
        ("https://u:p@host:7/x", "host:7"),
        # Any other target is gRPC's own, left as it is.
        ("127.0.0.1:50051", "127.0.0.1:50051"),
        ("latchkey", "latchkey"),
        ("unix:///tmp/latchkey.sock", "unix:///tmp/latchkey.sock"),
        ("dns:///h:1", "dns:///h:1"),
    ],
)
def test_a_url_target_reaches_the_port_the_cli_does(url, expected):
    """A URL's port is what the Rust client and the CLI connect to (``Connector::for_target``
    in ``client/src/connect.rs``): 80 for ``http://`` with none, 443 for ``https://``
    (gRPC's own default, so the bare host, whose authority a proxy's virtual host for
    that name matches).
    ``http://latchkey`` was ``latchkey``, which gRPC reaches on 443 even in plaintext:
    a ``LATCHKEY_SERVER`` the CLI used failed ``UNAVAILABLE`` here. A user, a path, a
    query and a fragment are left out, as the Rust client's connection leaves them
    (``latchkey``, with them, was a name gRPC's resolver could not resolve)."""
    from latchkey._common import grpc_target

    assert grpc_target(url, None)[0] == expected
    with latchkey.Client(url) as client:  # the channel connects at the first call
        assert client.target == expected


@pytest.mark.parametrize(
    "url",
    [
        "http://",
        "https://",
        "http:///x",
        "http://u@",
        "http://:50051",
        "http://h:",
        "http://h:0",
        "http://h:99999",
        "http://h:5005l",
        "https://[::1]:x",
        "http://::1",
        "http://[::1",
        "http://[]:1",
    ],
)
def test_a_url_target_the_cli_refuses_is_refused_by_its_name(url):
    """The URLs the Rust client refuses (``rejects_bad_targets`` in ``client/src/lib.rs``)
    raise ``ValueError`` naming ``target`` before any call: a port that is no port was
    gRPC's to read (``:0``, ``:5005l``) and an empty host reached the local machine."""
    import latchkey.aio
    from latchkey._common import grpc_target

    with pytest.raises(ValueError, match="^target '") as info:
        grpc_target(url, None)
    assert url.replace("u@", "…@") in str(info.value)  # a user part is not repeated
    with pytest.raises(ValueError, match="^target '"):
        latchkey.Client(url)
    with pytest.raises(ValueError, match="^target '"):
        latchkey.aio.Client(url)


def test_a_refused_url_target_does_not_repeat_its_user_part():
    """The user part of a URL may carry a password: the error leaves it out."""
    from latchkey._common import grpc_target

    with pytest.raises(ValueError) as info:
        grpc_target("https://me:s3cret@host:0", None)
    assert "s3cret" not in str(info.value) and "host:0" in str(info.value)


def test_client_close_ends_leases(target, name):
    client = latchkey.Client(target)
    lease = client.acquire(name, wait=5)
    client.close()
    assert lease.lost.wait(5)
    assert lease.lost_reason == "DISCONNECTED"
    with latchkey.Client(target) as other:
        with other.lock(name, wait=5):
            pass


def test_close_while_threads_wait_fails_them_cancelled_and_leaves_nothing(client, target, name):
    """``close()`` while other threads' acquires wait fails each with ``LockError``
    CANCELLED and leaves none of them in the fair lock's queue."""
    holder = client.acquire(name, kind="fair", wait=5)
    other = latchkey.Client(target)
    errors = []

    def wait():
        try:
            other.acquire(name, kind="fair")
        except latchkey.LockError as err:
            errors.append(err.code)

    threads = [threading.Thread(target=wait) for _ in range(4)]
    for t in threads:
        t.start()
    assert wait_until(lambda: len(client.describe(name).waiters) == 4, 5)
    other.close()
    for t in threads:
        t.join(10)
    assert errors == [grpc.StatusCode.CANCELLED] * 4
    assert wait_until(lambda: len(client.describe(name).waiters) == 0, 5)
    assert holder.release()


def test_close_amid_many_lock_loops_ends_each_with_lock_error_and_leaves_nothing(client, target, name):
    """``close()`` amid threads that take and release a fair lock in a loop ends every
    loop with ``LockError`` CANCELLED (whether it was waiting, holding or releasing) and
    leaves the lock free, with no waiter."""
    sc = latchkey.Client(target)
    outcomes = []

    def loop():
        try:
            while True:
                with sc.lock(name, wait=10, kind="fair"):
                    time.sleep(0.002)
        except latchkey.LockError as err:
            outcomes.append(("LockError", err.code))
        except BaseException as err:  # reported below
            outcomes.append((type(err).__name__, repr(err)))

    threads = [threading.Thread(target=loop) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.7)
    sc.close()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    bad = [o for o in outcomes if o != ("LockError", grpc.StatusCode.CANCELLED)]
    assert not bad, bad
    assert free_within(client, name, 3.0)


def test_a_process_that_exits_holding_a_lease_exits_and_frees_the_lock(client, target, name):
    """A program that ends with a lease still held (no release, no ``close()``) exits
    promptly, with status 0, and its lock is freed."""
    child = python_child(
        f"""
        import latchkey
        c = latchkey.Client({target!r})
        lease = c.acquire({name!r}, wait=5)
        print("held", flush=True)
        """
    )
    assert read_line(child) == "held"
    child.wait(10)
    assert child.returncode == 0, child.stderr.read()
    assert free_within(client, name, 3.0)


def test_sigint_inside_a_with_block_releases(client, target, name):
    """Ctrl-C (``KeyboardInterrupt``) inside a ``with client.lock()`` block releases the
    lease on the way out."""
    child = python_child(
        f"""
        import time, latchkey
        with latchkey.Client({target!r}) as c:
            try:
                with c.lock({name!r}, wait=5) as lease:
                    print("held", flush=True)
                    time.sleep(30)
            except KeyboardInterrupt:
                print("released", lease.released, flush=True)
        """
    )
    assert read_line(child) == "held"
    child.send_signal(signal.SIGINT)
    assert read_line(child) == "released True"
    child.wait(10)
    assert free_within(client, name, 2.0)


def test_sigint_while_waiting_leaves_no_fair_waiter(client, target, name):
    """Ctrl-C while an acquire waits in a fair lock's queue withdraws it: no waiter is
    left behind the holder."""
    holder = client.acquire(name, kind="fair", wait=5)
    child = python_child(
        f"""
        import latchkey
        with latchkey.Client({target!r}) as c:
            try:
                c.acquire({name!r}, kind="fair", on_queued=lambda q: print("queued", flush=True))
            except KeyboardInterrupt:
                print("interrupted", flush=True)
        """
    )
    interrupt_while_queued(child, client, name)
    assert holder.release()
    assert free_within(client, name, 2.0)


def test_watch(client, name):
    with client.watch(name) as watch:
        first = next(watch)
        assert first.locked is False
        with client.lock(name, wait=5) as lease:
            state = next(watch)
            while not state.locked:
                state = next(watch)
            assert state.holders[0].owner == lease.owner


def test_watch_raises_unavailable_at_server_shutdown(start_server, name):
    """The server ends every Watch UNAVAILABLE (``SHUTTING_DOWN``) at its shutdown: the
    iteration raises that ``LockError`` rather than ending as if closed."""
    srv = start_server()
    with latchkey.Client(srv.target) as client:
        watch = client.watch(name)
        first = next(watch)
        assert first.name == name
        srv.stop(signal.SIGTERM)
        with pytest.raises(latchkey.LockError) as info:
            list(watch)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert info.value.reason == "SHUTTING_DOWN"


def test_open_sets_durations_only_when_given():
    from latchkey._common import build_open

    req = build_open("n", wait=None, lease=None, owner=None, kind=None, permits=None, limit=None)
    assert req.WhichOneof("action") == "open"
    assert not req.open.HasField("wait_timeout") and not req.open.HasField("lease")
    assert req.open.owner == "" and req.open.kind == pb.LOCK_KIND_UNSPECIFIED
    req = build_open("n", wait=0, lease=datetime.timedelta(seconds=2), owner="o", kind="fair", permits=1, limit=2)
    assert req.open.HasField("wait_timeout") and req.open.wait_timeout.ToNanoseconds() == 0
    assert req.open.lease.seconds == 2
    assert req.open.kind == pb.LOCK_KIND_FAIR
    req = build_open(["a", "b"], wait=1.5, lease=None, owner=None, kind=None, permits=None, limit=None)
    assert list(req.open.names) == ["a", "b"] and req.open.name == ""
    assert req.open.wait_timeout.ToMilliseconds() == 1500


def test_a_redlock_fixed_lease_ends_its_validity_after_the_request():
    from latchkey._common import build_open, fixed_lease_end

    open_ = build_open("n", wait=None, lease=10, owner=None, kind=None, permits=None, limit=None, redlock=True).open
    acquired = pb.Acquired(fencing_token=1)
    acquired.lease.FromMilliseconds(9898)
    acquired.waited.FromMilliseconds(0)
    assert fixed_lease_end(1_000_000.0, open_, acquired) == pytest.approx(1_000_009.898)
    # An older server sends the lease asked for: the drift still comes off.
    acquired.lease.FromSeconds(10)
    assert fixed_lease_end(1_000_000.0, open_, acquired) == pytest.approx(1_000_009.898)


def test_a_redlock_fixed_lease_is_held_for_its_length(start_redis, start_server, name):
    nodes = [start_redis() for _ in range(3)]
    # The nodes were started just now: they count at once.
    urls = [a for r in nodes for a in ("--redlock-url", r.url)]
    server = start_server("--redlock-restart-delay", "0s", *urls)
    with latchkey.Client(server.target) as client:
        with client.lock(name, wait=5, lease=3.0, redlock=True) as lease:
            time.sleep(0.5)
            assert lease.held and not lease.lost.is_set(), lease.lost_reason
        assert lease.released


def test_token_authenticates(start_server, workdir, name):
    auth = workdir / "auth.toml"
    auth.write_text('[[identity]]\nname = "py"\ntokens = ["py-token"]\nprefixes = ["py/"]\n')
    server = start_server("--auth-file", str(auth))
    with latchkey.Client(server.target, token="py-token") as c:
        with c.lock("py/" + name, wait=5) as lease:
            assert lease.fencing_token > 0
        with pytest.raises(latchkey.LockError) as info:
            with c.lock("other/" + name, wait=0):
                pass
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    with latchkey.Client(server.target) as anonymous:
        with pytest.raises(latchkey.LockError) as info:
            with anonymous.lock("py/" + name, wait=0):
                pass
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_reload_that_revokes_the_token_ends_its_lease_as_revoked(start_server, workdir, name):
    """The server ends a lease whose token an auth file reload revoked: the lease reads
    lost, ``REVOKED`` with code UNAUTHENTICATED, and the lock is free."""
    server, revoke = start_revocable(start_server, workdir)
    with latchkey.Client(server.target, token="admin-token") as ops, latchkey.Client(
        server.target, token="py-token"
    ) as c:
        lease = c.acquire("py/" + name, wait=5)
        revoke()
        # Read every second, applied once two reads agree.
        assert lease.lost.wait(10), "the lease outlived the revocation"
        assert lease.lost_reason == latchkey.REVOKED
        assert lease.lost_code == grpc.StatusCode.UNAUTHENTICATED
        assert free_within(ops, "py/" + name, 2.0)


def test_a_release_the_revoke_overtook_returns_false_the_lease_lost_as_revoked(
    start_server, workdir, freezable_proxy, name
):
    """A release on its way (held back at a proxy) when a reload revokes the token: the
    server gives the lock back and ends the stream UNAUTHENTICATED before it reads the
    release. The lease was lost, as a revoke without a release is: ``release()`` returns
    False (it raised, the outcome said unknown, the lease not marked lost)."""
    server, revoke = start_revocable(start_server, workdir)
    proxy = freezable_proxy(server.port)
    with latchkey.Client(server.target, token="admin-token") as ops, latchkey.Client(
        proxy.target, token="py-token"
    ) as c:
        lease = c.acquire("py/" + name, wait=5)
        proxy.hold_requests()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            releasing = pool.submit(lease.release, 20)
            revoke()
            assert releasing.result(timeout=30) is False
        assert lease.lost.is_set()
        assert lease.lost_reason == latchkey.REVOKED
        assert free_within(ops, "py/" + name, 2.0)


# How long the client may take at most to notice a dead connection: an HTTP/2
# keepalive ping every 3 s that goes 4 s unanswered, as in the Rust client, and slack.
NOTICES_A_DEAD_CONNECTION_WITHIN = 12.0
# How long the server may take at most to release the lock of a dead connection: its
# default keepalive, a ping every 10 s that goes 10 s unanswered, and slack.
RELEASES_A_DEAD_CONNECTION_WITHIN = 25.0


def test_keepalive_reports_a_partitioned_lease_lost(start_server, freezable_proxy, name):
    """After a silent partition (no FIN, no RST) the partitioned lease learns it lost
    the lock from the client's own keepalive (on by default) before the server, with
    its default keepalive, drops the connection and releases the lock: when the holder
    is told, no other client can take the lock yet; later one does."""
    srv = start_server()
    proxy = freezable_proxy(srv.port)
    with latchkey.Client(proxy.target) as far, latchkey.Client(srv.target) as near:
        lease = far.acquire(name, wait=5)
        proxy.frozen.set()
        frozen = time.monotonic()
        assert lease.lost.wait(NOTICES_A_DEAD_CONNECTION_WITHIN), (
            f"the partitioned lease reports held={lease.held} lost_reason={lease.lost_reason}"
        )
        told = time.monotonic() - frozen
        assert lease.lost_reason == "DISCONNECTED"
        assert lease.lost_code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(latchkey.LockTimeout):
            with near.lock(name, wait=0):
                pytest.fail(f"another client got {name!r} as the holder was told, {told:.1f}s after the partition")
        with near.lock(name, wait=RELEASES_A_DEAD_CONNECTION_WITHIN) as other:
            assert other.fencing_token > lease.fencing_token


def test_keepalive_pings_of_an_idle_lease_are_not_refused(start_server, freezable_proxy, name):
    """A client pinging every second (three times the default) holds an idle lease
    through several pings: the server sends no GOAWAY too_many_pings. The pings do
    flow: a partition is then noticed within a couple of seconds."""
    srv = start_server()
    proxy = freezable_proxy(srv.port)
    fast = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 1000)]
    with latchkey.Client(proxy.target, options=fast) as client:
        lease = client.acquire(name, wait=5)
        assert not lease.lost.wait(6.0), (lease.lost_reason, lease.lost_code)
        assert lease.held
        proxy.frozen.set()
        assert lease.lost.wait(5.0), "no keepalive ping noticed the partition"
        assert lease.lost_reason == "DISCONNECTED"
    # the server still holds the lock for the frozen connection: free it
    with latchkey.Client(srv.target) as admin:
        admin.force_release(name)


def test_channel_options_turn_keepalive_on_and_keep_the_callers():
    from latchkey._common import KEEPALIVE_OPTIONS, MAX_RECEIVE, PING_TIMEOUT, channel_options

    assert channel_options("h:1", None) == [*KEEPALIVE_OPTIONS, (PING_TIMEOUT, 4000), MAX_RECEIVE]
    opts = dict(channel_options("h:1", [("grpc.keepalive_time_ms", 30000), ("grpc.max_send_message_length", 1)]))
    assert opts["grpc.keepalive_time_ms"] == 30000
    assert opts["grpc.keepalive_timeout_ms"] == 4000
    assert opts["grpc.http2.max_pings_without_data"] == 0
    assert opts["grpc.max_send_message_length"] == 1
    # reconnection backs off 5 s at most, not gRPC core's 120 s, unless the caller says
    assert opts["grpc.max_reconnect_backoff_ms"] == 5000
    assert dict(channel_options("h:1", [("grpc.max_reconnect_backoff_ms", 60000)]))["grpc.max_reconnect_backoff_ms"] == 60000
    # the ping timeout follows the caller's keepalive timeout, unless set itself
    assert dict(channel_options("h:1", [("grpc.keepalive_timeout_ms", 3000)]))[PING_TIMEOUT] == 3000
    assert dict(channel_options("h:1", [(PING_TIMEOUT, 5)]))[PING_TIMEOUT] == 5
    assert len(channel_options("h:1", [("grpc.keepalive_time_ms", 30000)])) == len(KEEPALIVE_OPTIONS) + 2
    # messages of any size, unless the caller bounds them
    assert dict(channel_options("h:1", [("grpc.max_receive_message_length", 9)]))["grpc.max_receive_message_length"] == 9
    assert dict(channel_options("unix:///s", None))["grpc.default_authority"] == "localhost"


def test_dropped_lease_is_released(target, name):
    """A lease from ``acquire()`` that the program drops (no release, no ``with``) is
    released when garbage collected, as the Rust client's is on drop: its reader
    thread holds the stream, not the lease."""
    with latchkey.Client(target) as a, latchkey.Client(target) as b:
        lost = None

        def work():
            nonlocal lost
            lease = a.acquire(name, wait=5)
            assert lease.fencing_token > 0
            lost = lease.lost
            # returns without releasing: the lease is garbage

        work()
        gc.collect()
        t0 = time.monotonic()
        try:
            with b.lock(name, wait=5):
                pass
        except latchkey.LockTimeout:
            pytest.fail(
                f"a dropped lease still holds {name!r} after {time.monotonic() - t0:.1f}s "
                f"(reader threads: {[t.name for t in threading.enumerate() if t.name.startswith('latchkey-lease')]})"
            )
        # whoever kept the lease's event learns the lock is gone
        assert lost.wait(5)
        assert wait_until(
            lambda: not any(t.name == f"latchkey-lease-{name}" for t in threading.enumerate()), 5
        ), "the dropped lease's reader thread is still running"


def test_list_stops_at_a_repeated_page_token(fake_server):
    target, servicer = fake_server
    with latchkey.Client(target) as client:
        locks = client.list("x", timeout=5)
    assert [s.name for s in locks] == ["lock-1", "lock-2"]
    assert servicer.calls == 2


def test_a_release_confirmed_unasked_reads_as_lost(fake_server):
    """A ``released`` the server sends while no release is under way ends the lease as
    lost (``DISCONNECTED``), as in the Rust client: not a release this client asked
    for, so ``released`` stays False and a later ``release()`` returns False."""
    target, _ = fake_server
    with latchkey.Client(target) as client:
        lease = client.acquire("unasked")
        assert lease.lost.wait(2)
        assert lease.lost_reason == "DISCONNECTED"
        assert not lease.held
        assert lease.wait_lost(2) is True
        assert not lease.released
        assert lease.release(timeout=2) is False
        assert not lease.released


def test_a_loss_told_before_the_released_of_a_release_stays(fake_server):
    """A ``lost`` that arrives before the ``released`` answering a release is the
    lease's end: the release returns False, as Rust's ``release()`` returns
    ``Err(Lost(ForceReleased))``."""
    target, _ = fake_server
    with latchkey.Client(target) as client:
        lease = client.acquire("lost-then-released")
        assert lease.release(timeout=2) is False
        assert lease.lost.is_set() and lease.lost_reason == "FORCE_RELEASED"
        assert not lease.released and not lease.held


def acquirable(client, name) -> bool:
    """Whether a try-once acquire of ``name`` gets it now (released again at once);
    False while it is held or the server cannot reach Redis."""
    try:
        client.acquire(name, wait=0).release()
        return True
    except latchkey.LockError as err:
        if err.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
            return False  # held, or Redis not reached again yet
        raise


# How long a server may take to give back a lock whose release failed, once Redis is back.
GIVEN_BACK_WITHIN = 15.0


def test_a_failed_release_raises_and_the_lock_is_given_back_once_redis_returns(start_redis, start_server, name):
    """A release the server could not take to Redis ends the stream UNAVAILABLE: that is
    the release's error (its outcome unknown), not a lease lost, and leaving a ``with``
    block raises it unless the body raised. The server gives the lock back once Redis
    answers (appendonly keeps the lock across the restart). It used to read as a lease
    lost (``DISCONNECTED``), ``release()`` returned False and ``with`` said nothing."""
    redis = start_redis("--appendonly", "yes", "--appendfsync", "always")
    srv = start_server("--redis-timeout", "300ms", redis_url=redis.url)
    names = [f"{name}/release", f"{name}/with", f"{name}/with-raising"]
    with latchkey.Client(srv.target) as client:
        leases = [client.acquire(n, wait=5, lease=3600) for n in names]
        redis.stop()
        for _ in range(2):  # idempotent: the second call tells the same
            with pytest.raises(latchkey.LockError) as info:
                leases[0].release()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
            assert not isinstance(info.value, latchkey.LockTimeout)
        with pytest.raises(latchkey.LockError) as info:
            with leases[1]:
                pass
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
        with pytest.raises(RuntimeError, match="the body's"):
            with leases[2]:
                raise RuntimeError("the body's error is the one raised")
        for lease in leases:
            assert not lease.lost.is_set() and lease.lost_reason is None, lease
            assert not lease.released and not lease.held
            assert lease.wait_lost(1.0) is False  # the stream is over: no wait
        redis.restart()
        for n in names:
            assert wait_until(lambda: acquirable(client, n), GIVEN_BACK_WITHIN, 0.2), f"{n!r} is still held"


def test_a_release_with_no_answer_raises_deadline_exceeded(start_server, name):
    """A release the server does not answer in time (frozen here) raises ``LockError``
    with DEADLINE_EXCEEDED, not ``LockTimeout`` (an acquire's wait) nor a lost lease; the
    stream is cancelled, so the server frees the lock once it runs again."""
    srv = start_server()
    with latchkey.Client(srv.target) as client:
        lease = client.acquire(name, wait=5)
        freeze(srv.proc)
        try:
            t0 = time.monotonic()
            with pytest.raises(latchkey.LockError) as info:
                lease.release(timeout=0.5)
            assert time.monotonic() - t0 < 2.5
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
            assert not isinstance(info.value, latchkey.LockTimeout)
            assert not lease.lost.is_set() and not lease.released
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        with latchkey.Client(srv.target) as other:
            with other.lock(name, wait=5):
                pass


def test_wait_lost_returns_when_the_lease_ends_without_loss(target, name):
    """``wait_lost()`` with no timeout returns False once the lease is released (a
    watcher thread does not hang), True when it is lost; ``lost`` is set only on loss."""
    with latchkey.Client(target) as client:
        lease = client.acquire(name, wait=5)
        result = []
        watcher = threading.Thread(target=lambda: result.append(lease.wait_lost()), daemon=True)
        watcher.start()
        assert not lease.wait_lost(0.3)  # held: a timeout says False too
        assert watcher.is_alive()
        assert lease.release()
        watcher.join(5)
        assert not watcher.is_alive(), "wait_lost() still waits after the release"
        assert result == [False] and not lease.lost.is_set()

        lease = client.acquire(name, wait=5)
        assert client.force_release(name)
        assert lease.wait_lost(5) is True
        assert lease.lost_reason == "FORCE_RELEASED"


def test_releasing_a_lost_lease_returns_false_on_every_path(target, freezable_proxy, name):
    """Whenever the lease was lost, ``release()`` returns False, never raises: its
    stream ended with ``lost``, a fixed lease is past its end on the client's clock, a
    ``lost`` came while the release was on its way, or the client was closed."""
    with latchkey.Client(target) as client:
        ended = client.acquire(f"{name}/ended", wait=5)
        assert client.force_release(f"{name}/ended")
        assert ended.wait_lost(5) and ended.lost_reason == "FORCE_RELEASED"
        assert wait_until(lambda: ended._stream.ended.is_set(), 5)
        assert ended.release() is False

        fixed = client.acquire(f"{name}/fixed", wait=5, lease=0.3)
        time.sleep(0.4)
        assert fixed.release() is False
        assert fixed.lost_reason == "LEASE_EXPIRED"

        proxy = freezable_proxy(int(target.rsplit(":", 1)[1]))
        with latchkey.Client(proxy.target) as far:
            in_flight = far.acquire(f"{name}/in-flight", wait=5)
            proxy.hold_requests()  # the release waits in the proxy
            result = []
            releasing = threading.Thread(target=lambda: result.append(in_flight.release(timeout=5)), daemon=True)
            releasing.start()
            time.sleep(0.1)
            assert client.force_release(f"{name}/in-flight")
            releasing.join(6)
            proxy.pass_requests()
            assert result == [False], result
            assert in_flight.lost_reason == "FORCE_RELEASED"

    for _ in range(5):  # the close and the release race: each order says the same
        closed = latchkey.Client(target)
        lease = closed.acquire(f"{name}/closed", wait=5)
        closed.close()
        assert lease.release() is False
        assert lease.lost_reason == "DISCONNECTED"


def test_a_unary_call_with_no_answer_in_time_is_not_a_lock_timeout(target, freezable_proxy, name):
    """A Describe, List or ForceRelease the server does not answer within its
    ``timeout`` (a partition here) raises ``LockError`` DEADLINE_EXCEEDED, not
    ``LockTimeout``, which only a wait for a lock that ran out raises."""
    proxy = freezable_proxy(int(target.rsplit(":", 1)[1]))
    with latchkey.Client(proxy.target, timeout=0.3) as client:
        client.describe(name)  # connected
        proxy.frozen.set()
        calls = {
            "describe": lambda: client.describe(name),
            "list": lambda: client.list(name),
            "force_release": lambda: client.force_release(name, timeout=0.3),
        }
        for what, call in calls.items():
            t0 = time.monotonic()
            with pytest.raises(latchkey.LockError) as info:
                call()
            assert time.monotonic() - t0 < 3, what
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, (what, info.value)
            assert not isinstance(info.value, latchkey.LockTimeout), what
            assert "DEADLINE_EXCEEDED" in str(info.value), what


@pytest.mark.parametrize("token", ["tökén", "line\nbreak", "tab\there", "\x7f"])
def test_a_token_that_is_not_printable_ascii_is_refused_by_the_constructor(target, token):
    """grpc core refused such a token only at the first call, with ``INTERNAL: Invalid
    metadata``; the Rust client refuses it up front, and so does this one, without
    repeating the token."""
    with pytest.raises(ValueError, match="the token must be printable ASCII") as info:
        latchkey.Client(target, token=token)
    assert token not in str(info.value)
    with latchkey.Client(target, token="a token ~!") as client:  # printable, spaces too
        assert client.describe("pytest/printable-token").locked is False


def test_lock_error_carries_the_servers_error_info(client, name):
    """The server's ``google.rpc.ErrorInfo`` is on the error (``reason``, ``info``) and on a
    lost lease (``lost_info``), as in the Node client: ``LIMIT_MISMATCH`` and
    ``WRONG_KIND`` share FAILED_PRECONDITION, and only the reason tells them apart. It
    used to be dropped, leaving only the code and the message."""
    with client.lock(name, kind="semaphore", limit=2, wait=5):
        with pytest.raises(latchkey.LockError) as info:
            client.acquire(name, kind="semaphore", limit=3, wait=0)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.reason == "LIMIT_MISMATCH", info.value
        assert info.value.info == {"lockName": name, "limit": "2"}
        assert any(k == "grpc-status-details-bin" for k, _ in info.value.metadata)
        with pytest.raises(latchkey.LockTimeout) as info:
            client.acquire(name, kind="semaphore", limit=2, permits=2, wait=0)
        assert info.value.reason == "WAIT_TIMEOUT" and info.value.info["lockName"] == name
    with pytest.raises(latchkey.LockError) as info:
        client.acquire("", wait=0)
    assert info.value.reason == "INVALID_ARGUMENT" and info.value.info["field"] == "open.name"
    with pytest.raises(latchkey.LockError) as info:
        client.describe("")
    assert info.value.info["field"] == "name", info.value.info

    lease = client.acquire(name, wait=5)
    assert lease.lost_info == {}
    assert client.force_release(name)
    assert lease.wait_lost(5)
    assert wait_until(lambda: lease.lost_code is not None, 5)
    assert lease.lost_info == {"lockName": name, "lostReason": "FORCE_RELEASED"}


def test_a_one_name_list_is_a_plain_lock(client, name):
    """A list of one name takes that lock, as the Rust client's ``lock_all`` does: a
    multi-lock needs two names, and the server refused it (INVALID_ARGUMENT
    ``open.names``), so code that locks "every account a transfer touches" failed on a
    self-transfer. ``name`` stays the list, ``fencing_tokens`` has its one token."""
    with client.lock([name], wait=5) as lease:
        assert lease.fencing_token > 0
        assert lease.name == [name]
        assert lease.fencing_tokens == [lease.fencing_token]
        assert client.describe(name).locked
    with client.lock((name, f"{name}/2"), wait=5) as multi:
        assert len(multi.fencing_tokens) == 2


def test_a_lock_request_of_an_iterator_of_names_serves_every_block(client, name):
    """``lock()`` reads an iterator of names once: each ``with`` of the request takes
    the same locks. It used to keep the iterator and read it on every enter, so the
    second block sent an Open with no name (INVALID_ARGUMENT from the server). No name
    at all is refused at once, naming the field."""
    one = client.lock(iter([name]), wait=1)
    multi = client.lock((n for n in (f"{name}/a", f"{name}/b")), wait=1)
    for _ in range(2):
        with one as lease:
            assert lease.name == [name]
            assert client.describe(name).locked
        with multi as lease:
            assert lease.name == [f"{name}/a", f"{name}/b"]
            assert len(lease.fencing_tokens) == 2
    for empty in ([], (), iter([])):
        with pytest.raises(ValueError, match="^name "):
            client.lock(empty)
    with pytest.raises(ValueError, match="^name "):
        client.acquire([], wait=0)


def test_wait_inf_waits_until_granted(client, name):
    """``wait=math.inf`` waits until granted, as ``wait: Infinity`` does in the Node
    client; it used to raise a bare ``OverflowError``. An infinite or NaN lease has no
    meaning and raises ``ValueError``."""
    import math

    from latchkey._common import build_open

    req = build_open(name, wait=math.inf, lease=None, owner=None, kind=None, permits=None, limit=None)
    assert not req.open.HasField("wait_timeout")
    with client.lock(name, wait=math.inf) as lease:
        assert lease.held
    for bad in (math.inf, math.nan):
        with pytest.raises(ValueError, match="lease"):
            client.acquire(name, wait=0, lease=bad)


def test_on_queued_is_called_while_the_request_waits(target, name):
    """``on_queued`` gets the server's ``Queued`` event, as Rust's ``on_queued`` and
    Node's ``onQueued`` do; the Python clients dropped it."""
    with latchkey.Client(target) as a, latchkey.Client(target) as b:
        holder = a.acquire(name, wait=5)
        queued = []
        done = []
        waiter = threading.Thread(target=lambda: done.append(b.acquire(name, wait=10, on_queued=queued.append)))
        waiter.start()
        assert wait_until(lambda: bool(queued), 5), "on_queued was not called"
        assert isinstance(queued[0], pb.Queued)
        assert queued[0].holder_ttl.ToMilliseconds() > 0
        assert holder.release()
        waiter.join(10)
        assert done and done[0].release()
        # A callback that raises withdraws the request, and its error propagates.
        holder = a.acquire(name, wait=5)

        def refuse(_queued):
            raise RuntimeError("not waiting")

        with pytest.raises(RuntimeError, match="not waiting"):
            b.acquire(name, wait=10, on_queued=refuse)
        assert holder.release()
        assert client_can_take(b, name)


class _OtherCallFailed(grpc.RpcError):
    """A gRPC error of another call than latchkey's (another service the callback used)."""

    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_grpc_error_of_on_queued_is_the_callers_and_withdraws_the_request(target, name):
    """A ``grpc.RpcError`` that ``on_queued`` raises (a call to another service) is the
    caller's and withdraws the request: it was read as the Acquire call's own failure
    (``LockTimeout``), and the call only half-closed, so a fair waiter kept its place in
    the queue for as long as the exception lived."""
    with latchkey.Client(target) as a, latchkey.Client(target) as b:
        holder = a.acquire(name, wait=5, kind="fair")

        def fail(_queued):
            raise _OtherCallFailed()

        with pytest.raises(_OtherCallFailed) as info:
            b.acquire(name, wait=10, kind="fair", on_queued=fail)
        # The exception (and its traceback, with the call) lives on here.
        assert info.value is not None
        assert wait_until(lambda: not a.describe(name).waiters, 5), a.describe(name)
        assert holder.release()


def test_a_signal_handler_that_closes_the_client_amid_an_acquire_does_not_hang(target, name):
    """A signal handler that closes the client (to hand its leases back on SIGTERM) can
    run on the thread that holds the client's lock, amid an acquire's bookkeeping: the
    close waited for a lock its own thread held, and the process hung. The lease the
    acquire returns reads lost."""
    import weakref

    client = latchkey.Client(target)

    class Interrupted(weakref.WeakSet):
        def add(self, item):
            os.kill(os.getpid(), signal.SIGUSR1)  # its handler runs at the next bytecode
            super().add(item)

    def give_up(*_):
        raise TimeoutError("close() waited for the lock its own thread held")

    client._streams = Interrupted()
    before = signal.signal(signal.SIGUSR1, lambda *_: client.close())
    alarm = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(5)
    try:
        lease = client.acquire(name, wait=5)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, alarm)
        signal.signal(signal.SIGUSR1, before)
    assert lease.lost_reason == "DISCONNECTED"


def client_can_take(client, name) -> bool:
    try:
        client.acquire(name, wait=2).release()
        return True
    except latchkey.LockTimeout:
        return False


def test_calls_after_close_raise_lock_error_cancelled(target, name):
    """Every call on a closed client raises ``LockError`` CANCELLED, as in the asyncio
    and Node clients; it used to raise grpc's ``ValueError`` ("Cannot invoke RPC on
    closed channel!")."""
    client = latchkey.Client(target)
    client.close()
    calls = {
        "acquire": lambda: client.acquire(name, wait=0),
        "describe": lambda: client.describe(name),
        "list": lambda: client.list(name),
        "force_release": lambda: client.force_release(name),
        "watch": lambda: client.watch(name),
    }
    for what, call in calls.items():
        with pytest.raises(latchkey.LockError) as info:
            call()
        assert info.value.code == grpc.StatusCode.CANCELLED, (what, info.value)
        assert "closed" in info.value.details, what


def test_closing_the_client_while_another_thread_acquires_raises_nothing(target, name):
    """``close()`` while another thread's acquire completes: the acquire added its lease
    to the set ``close()`` was going through, which raised ``RuntimeError: Set changed
    size during iteration`` and left the channel open and the other leases held. The
    set here pauses ``close()`` after its first lease until the other thread's acquire
    is done (at most 1 s), as a thread switch may."""
    import weakref

    with latchkey.Client(target) as other:
        blocker = other.acquire(f"{name}/b", wait=5)
        client = latchkey.Client(target)
        first = client.acquire(f"{name}/a", wait=5)
        added = threading.Event()

        class PausingSet(weakref.WeakSet):
            def add(self, item):
                super().add(item)
                added.set()

            def __iter__(self):
                items = super().__iter__()
                yield next(items)
                blocker.release()  # the other thread's acquire is granted now
                added.wait(1.0)
                yield from items

        client._streams = PausingSet(client._streams)
        added.clear()  # set by the copy of the first lease
        outcome = []

        def acquire():
            try:
                outcome.append(client.acquire(f"{name}/b", wait=10))
            except latchkey.LockError as err:
                outcome.append(err)

        waiter = threading.Thread(target=acquire, daemon=True)
        waiter.start()
        time.sleep(0.3)  # queued behind the blocker
        client.close()
        waiter.join(5)
        assert first.wait_lost(5) and first.lost_reason == "DISCONNECTED"
        assert len(outcome) == 1
        if isinstance(outcome[0], latchkey.Lease):
            assert outcome[0].wait_lost(5), "the lease granted during close() is still held"
        else:
            assert outcome[0].code == grpc.StatusCode.CANCELLED, outcome[0]
        with pytest.raises(latchkey.LockError):
            client.describe(name)
        with other.lock(f"{name}/a", wait=5), other.lock(f"{name}/b", wait=5):
            pass


_HTTPS_DESCRIBE = """
import asyncio, sys
import latchkey, latchkey.aio

target = sys.argv[1]
with latchkey.Client(target, timeout=10) as client:
    client.describe("system-cas")

async def main():
    async with latchkey.aio.Client(target, timeout=10) as client:
        await client.describe("system-cas")

asyncio.run(main())
"""


def test_an_https_target_trusts_the_system_cas(tls_server, pki):
    """``https://host:port`` with no ``credentials`` trusts the CAs the system does,
    here ``SSL_CERT_FILE``, as the docstrings say and as the CLI and the Rust client do
    (``https_trusts_the_system_cas_and_tls_settings_need_tls`` in ``tests/tests/cli.rs``).
    It used grpcio's own bundle, and the handshake failed (CERTIFICATE_VERIFY_FAILED).
    In a subprocess, with its own environment, in both clients."""

    def describe(trusted):
        env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_DIR", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH")}
        env["SSL_CERT_FILE"] = str(trusted)
        target = f"https://127.0.0.1:{tls_server.port}"
        return subprocess.run(
            [sys.executable, "-c", _HTTPS_DESCRIBE, target], env=env, capture_output=True, text=True, timeout=60
        )

    trusted = describe(tls_server.ca)
    assert trusted.returncode == 0, trusted.stderr
    untrusted = describe(pki("other").ca)
    assert untrusted.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr, untrusted.stderr


def test_a_connection_tls_refused_is_failed_precondition(tls_server, target, pki, name):
    """A connection TLS refused (the server's certificate is from another CA or for
    another name, or the server has no TLS) raises ``LockError`` FAILED_PRECONDITION, as the Rust client's
    ``Error::code()`` says: trying again never mends it. It was UNAVAILABLE, which a
    wrapper retries for good. gRPC's details are kept. Both clients, unary calls and
    acquire."""
    import asyncio

    import latchkey.aio

    other = grpc.ssl_channel_credentials(pki("other").ca_pem())

    def refused(err):
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "CERTIFICATE_VERIFY_FAILED" in err.details and "TLS refused" in err.details, err

    with latchkey.Client(tls_server.target, credentials=other, timeout=10) as client:
        for call in (lambda: client.describe(name), lambda: client.acquire(name, wait=0)):
            with pytest.raises(latchkey.LockError) as info:
                call()
            refused(info.value)

    async def aio():
        async with latchkey.aio.Client(tls_server.target, credentials=other, timeout=10) as client:
            for call in (lambda: client.describe(name), lambda: client.acquire(name, wait=0)):
                with pytest.raises(latchkey.LockError) as info:
                    await call()
                refused(info.value)

    asyncio.run(aio())
    with latchkey.Client(target, credentials=other, timeout=10) as client:  # a server with no TLS
        with pytest.raises(latchkey.LockError) as info:
            client.describe(name)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION, info.value
        assert "TLS refused" in info.value.details, info.value
    trusted = grpc.ssl_channel_credentials(tls_server.ca.read_bytes())
    # A certificate for another name than the one dialled (it read UNAVAILABLE).
    elsewhere = [("grpc.ssl_target_name_override", "elsewhere.example")]
    with latchkey.Client(tls_server.target, credentials=trusted, options=elsewhere, timeout=10) as client:
        for call in (lambda: client.describe(name), lambda: client.acquire(name, wait=0)):
            with pytest.raises(latchkey.LockError) as info:
                call()
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION, info.value
            assert "Hostname Verification" in info.value.details and "TLS refused" in info.value.details
    with latchkey.Client(tls_server.target, credentials=trusted, timeout=10) as client:
        assert client.describe(name).name == name


def test_lock_errors_survive_pickle_and_copy():
    """A ``LockError`` or ``LockTimeout`` comes back whole from ``pickle`` and ``copy``:
    rebuilt from its message as the code, it raised ``AttributeError``, and a
    ``ProcessPoolExecutor`` worker whose wait ran out broke the whole pool."""
    import copy
    import pickle

    errors = [
        latchkey.LockTimeout(
            grpc.StatusCode.DEADLINE_EXCEEDED, "lock 'x'", reason="WAIT_TIMEOUT", info={"lockName": "x"},
            metadata=(("grpc-status-details-bin", b"\x08\x04"), ("x-id", "7")),
        ),
        latchkey.LockError(grpc.StatusCode.FAILED_PRECONDITION, "limit", reason="LIMIT_MISMATCH", info={"limit": "2"}),
        latchkey.LockError(None),
    ]
    for err in errors:
        for again in (pickle.loads(pickle.dumps(err)), copy.copy(err), copy.deepcopy(err)):
            assert type(again) is type(err)
            assert (again.code, again.details, again.reason, again.info, again.metadata, str(again)) == (
                err.code, err.details, err.reason, err.info, err.metadata, str(err)
            )


def test_a_server_error_survives_pickle(client, name):
    """A ``LockTimeout`` the server sent pickles whole: its metadata came as gRPC's own
    objects, which pickle refused, so a ``ProcessPoolExecutor`` worker's wait that ran
    out reached the caller as a ``PicklingError``."""
    import pickle

    with client.lock(name, wait=5):
        with pytest.raises(latchkey.LockTimeout) as info:
            with client.lock(name, wait=0):
                pytest.fail("second holder got the lock")
    err = info.value
    assert err.metadata, "the server's error has trailing metadata"
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is latchkey.LockTimeout
    assert (again.code, again.details, again.reason, again.info, again.metadata) == (
        err.code, err.details, err.reason, err.info, err.metadata
    )


@pytest.mark.parametrize(
    "args, error, field",
    [
        (dict(permits=-1), ValueError, "permits"),
        # proto3 sends neither 0 nor "": the server would read the default (1 permit)
        # and no owner (reentrancy off), not what was asked
        (dict(permits=0), ValueError, "permits"),
        (dict(owner=""), ValueError, "owner"),
        (dict(limit=2**32), ValueError, "limit"),
        (dict(permits=1.5), TypeError, "permits"),
        (dict(owner=5), TypeError, "owner"),
        (dict(name=123), TypeError, "name"),
        (dict(name=["a", 2]), TypeError, "name"),
        # past protobuf's Duration: an OverflowError, or protobuf's "Value out of range"
        (dict(wait=1e19), ValueError, "wait"),
        (dict(wait=1e300), ValueError, "wait"),
        (dict(lease=10**400), ValueError, "lease"),
    ],
)
def test_a_bad_argument_is_refused_by_its_name(args, error, field):
    """A bad ``permits``, ``limit``, ``owner`` or ``name`` raises ``ValueError`` or
    ``TypeError`` naming it, before any call, as ``wait`` and ``lease`` do; protobuf's
    own ("Value out of range: -1", "bad argument type for built-in operation", "'int'
    object is not iterable") named nothing. ``permits=0`` and ``owner=""`` used to go
    out unset: 1 permit, and a fresh owner per stream (no reentrancy)."""
    kwargs = {"name": "n", "kind": "semaphore", "wait": 0, **args}
    with latchkey.Client("127.0.0.1:1") as client:  # nothing listens: no call is made
        with pytest.raises(error, match=rf"\b{field}\b"):
            client.acquire(kwargs.pop("name"), **kwargs)
        if field == "name":
            for call in (client.describe, client.force_release, client.watch):
                with pytest.raises(TypeError, match=r"\bname\b"):
                    call(args["name"])
            with pytest.raises(TypeError, match=r"\bprefix\b"):
                client.list(5)
    from latchkey._common import build_open

    # the bounds pass: permits from 1, a limit up to a uint32's
    op = build_open("n", wait=None, lease=None, owner="o", kind=None, permits=1, limit=2**32 - 1).open
    assert (op.permits, op.limit) == (1, 2**32 - 1)
    # None is the default: left unset
    op = build_open("n", wait=None, lease=None, owner=None, kind=None, permits=None, limit=None).open
    assert not op.HasField("lease") and (op.owner, op.permits, op.limit) == ("", 0, 0)


def test_a_call_to_an_address_that_drops_connection_attempts_fails_unavailable_within_seconds(dropping_address):
    """gRPC core gives a connection 20 s, and the kernel retries its SYNs for two
    minutes; the keepalive options also bound the attempt (gRPC core sets the socket's
    TCP_USER_TIMEOUT to the keepalive timeout, 4 s), so a try-once acquire gives up
    about as soon as the Rust client's (5 s)."""
    with latchkey.Client(dropping_address) as c:
        started = time.monotonic()
        with pytest.raises(latchkey.LockError) as info:
            c.acquire("dropped", wait=0)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
        assert time.monotonic() - started < 10
        # The channel failed to connect: the next calls fail at once.
        with pytest.raises(latchkey.LockError) as info:
            c.describe("dropped", timeout=60)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value


def test_a_close_on_another_thread_as_a_call_starts_reads_as_a_closed_client(target, name):
    """A ``close()`` on another thread between a call's check that the client is open
    and the call's start made gRPC raise ``ValueError`` (a closed channel), where any
    other call on a closed client raises ``LockError`` CANCELLED. The close is made to
    come in that instant: right after the check."""
    calls = {
        "acquire": lambda c: c.acquire(name, wait=0),
        "describe": lambda c: c.describe(name),
        "force_release": lambda c: c.force_release(name),
        "watch": lambda c: c.watch(name),
    }
    for what, call in calls.items():
        client = latchkey.Client(target)
        checked = client._check_open

        def check_then_close(client=client, checked=checked):
            checked()
            closing = threading.Thread(target=client.close)
            closing.start()
            closing.join(5)

        client._check_open = check_then_close
        with pytest.raises(latchkey.LockError) as info:
            call(client)
        assert info.value.code == grpc.StatusCode.CANCELLED, (what, info.value)



def test_a_watch_the_other_side_cancels_raises_cancelled(fake_server):
    """A Watch ended CANCELLED by the other side (a proxy resetting the stream) raises
    ``LockError`` CANCELLED: it ended as if its caller were done with it, and a leader
    observer's loop just stopped. Its own ``close()`` still ends the iteration."""
    target, _ = fake_server
    with latchkey.Client(target) as client:
        states = []
        with pytest.raises(latchkey.LockError) as info:
            for state in client.watch("reset"):
                states.append(state)
        assert info.value.code == grpc.StatusCode.CANCELLED
        assert len(states) == 1
