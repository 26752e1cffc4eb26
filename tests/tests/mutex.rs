//! The reentrant mutex end to end: exclusion, wake-ups, timeouts, leases, the
//! watchdog, reentrancy and fencing, against a real redis-server.

use latchkey_client::{LockKind, LostReason};
use latchkey_proto::v1::acquire_response::Event;
use latchkey_proto::v1::lost::Reason;
use latchkey_tests::server::{open, pd, spawn_queued, Latchkey, RawStream};
use latchkey_tests::{bounded, RedisServer};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::Code;

const T: Duration = Duration::from_secs(10);

#[tokio::test]
async fn many_clients_on_two_servers_never_overlap() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let inside = Arc::new(AtomicU32::new(0));
    let entries = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let client = if i % 2 == 0 { a.client().await } else { b.client().await };
        let (inside, entries) = (inside.clone(), entries.clone());
        tasks.push(tokio::spawn(async move {
            let mut last_token = 0;
            for _ in 0..15 {
                let lease = client.lock("hot").wait(T).acquire().await.expect("acquired");
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders at once");
                assert!(lease.fencing_token() > last_token);
                last_token = lease.fencing_token();
                tokio::time::sleep(Duration::from_millis(1)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                entries.fetch_add(1, Ordering::SeqCst);
                lease.release().await.expect("released");
            }
        }));
    }
    for t in tasks {
        // Each of the 15 rounds waits at most T, but not all of them do at once.
        bounded(T * 4, "a client's rounds", t).await.expect("task");
    }
    assert_eq!(entries.load(Ordering::SeqCst), 16 * 15);
}

/// A waiter wakes within a second of the holder leaving, far below the 30 s TTL.
async fn assert_handoff(end: impl AsyncFnOnce(latchkey_client::Lease), two_servers: bool) {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = if two_servers {
        Some(Latchkey::start(&redis.url()).await)
    } else {
        None
    };
    let holder = a.client().await.lock("handoff").acquire().await.expect("holder");
    let other = match &b {
        Some(b) => b.client().await,
        None => a.client().await,
    };
    let (waiter, _) = spawn_queued(other.lock("handoff").wait(T), T).await;
    let released_at = Instant::now();
    end(holder).await;
    let _lease = bounded(T, "the waiter", waiter)
        .await
        .expect("waiter")
        .expect("waiter acquires");
    let acquired_at = Instant::now();
    let handoff = acquired_at - released_at;
    assert!(handoff < Duration::from_secs(1), "handoff took {handoff:?}");
}

#[tokio::test]
async fn waiter_wakes_after_release() {
    assert_handoff(async |l| l.release().await.expect("release"), false).await;
}

#[tokio::test]
async fn waiter_wakes_after_cancel() {
    assert_handoff(async |l| drop(l), false).await;
}

#[tokio::test]
async fn waiter_on_another_server_wakes_after_release() {
    assert_handoff(async |l| l.release().await.expect("release"), true).await;
}

#[tokio::test]
async fn waiter_wakes_after_half_close() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut raw = server.raw().await;
    let mut holder = RawStream::open(&mut raw, Some(open("hc"))).await;
    assert!(matches!(
        holder.next(T).await.unwrap().unwrap().event,
        Some(Event::Acquired(_))
    ));
    let client = server.client().await;
    let (waiter, _) = spawn_queued(client.lock("hc").wait(T), T).await;
    let closed_at = Instant::now();
    holder.half_close();
    // Half-close answers `released`, then ends the stream with OK.
    assert!(matches!(
        holder.next(T).await.unwrap().unwrap().event,
        Some(Event::Released(_))
    ));
    assert!(holder.next(T).await.unwrap().is_none());
    bounded(T, "the waiter", waiter)
        .await
        .unwrap()
        .expect("waiter acquires");
    assert!(closed_at.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn try_once_and_wait_timeouts_end_with_deadline_exceeded() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let _held = client.lock("busy").acquire().await.unwrap();
    let err = client.lock("busy").try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    assert!(err.to_string().contains("busy"), "{err}");
    // The server's ErrorInfo, to branch on.
    let info = err.error_info().expect("the server's ErrorInfo");
    assert_eq!(
        (info.reason.as_str(), info.domain.as_str()),
        ("WAIT_TIMEOUT", "latchkey")
    );
    assert_eq!(info.metadata["lockName"], "busy");
    let started = Instant::now();
    let err = client
        .lock("busy")
        .wait(Duration::from_millis(400))
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(400) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
}

#[tokio::test]
async fn fixed_lease_expires_and_is_reported() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let lease = client
        .lock("fixed")
        .lease(Duration::from_millis(500))
        .acquire()
        .await
        .unwrap();
    let granted = std::time::Instant::now();
    // A tenth less than asked: the server gives it back that early.
    assert_eq!(lease.lease(), Some(Duration::from_millis(450)));
    let reason = tokio::time::timeout(T, lease.lost()).await.expect("lost in time");
    assert_eq!(reason, LostReason::LeaseExpired);
    // At the lease's end, not at once nor long after (450 ms from the asking).
    let lasted = granted.elapsed();
    assert!(
        lasted >= Duration::from_millis(400) && lasted < Duration::from_secs(2),
        "told lost {lasted:?} after the grant"
    );
    // The client tells the loss by its own clock too, at most a round trip before Redis
    // expires the lock: the lock is free within moments.
    client
        .lock("fixed")
        .wait(Duration::from_secs(2))
        .acquire()
        .await
        .expect("free after the lease");
}

/// A fixed lease whose lock vanished from Redis (deleted by hand, flushed, evicted, or
/// lost in a failover that broke no connection) is told `NOT_HELD` by the watchdog's
/// next round, as a stream-scoped lease is: another client may take the lock at once,
/// and the holder must not go on believing it holds it until its lease ends.
#[tokio::test]
async fn a_fixed_lease_whose_lock_vanished_is_told_not_held() {
    let redis = RedisServer::start();
    // Rounds every 500 ms.
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "1500ms"]).await;
    let client = server.client().await;
    let lease = client
        .lock("vanished")
        .lease(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    redis.cli(&["DEL", "vanished"]);
    let _other = client
        .lock("vanished")
        .try_once()
        .acquire()
        .await
        .expect("the lock is free in Redis");
    let reason = tokio::time::timeout(Duration::from_secs(3), lease.lost())
        .await
        .expect("the fixed lease is told within a few rounds, not at its end");
    assert_eq!(reason, LostReason::NotHeld);
}

/// A release that finds its hold gone (deleted, flushed, lost in a failover) before the
/// next round noticed is told `lost`: the holder's section may have overlapped another's. It was confirmed as
/// `released`, and the client never heard that its lease had ended.
#[tokio::test]
async fn a_release_of_a_lock_that_vanished_is_told_lost_not_released() {
    let redis = RedisServer::start();
    // The default lease: the next round is 10 s away.
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let lease = client.lock("vanished-release").acquire().await.unwrap();
    redis.cli(&["DEL", "vanished-release"]);
    let _other = client
        .lock("vanished-release")
        .try_once()
        .acquire()
        .await
        .expect("the lock is free in Redis");
    let err = lease
        .release()
        .await
        .expect_err("the lease was lost before the release");
    assert!(
        matches!(err, latchkey_client::Error::Lost(LostReason::NotHeld)),
        "{err}"
    );
}

#[tokio::test]
async fn watchdog_keeps_the_lock_past_many_periods() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "1500ms"]).await;
    let client = server.client().await;
    let lease = client.lock("kept").acquire().await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(!lease.is_lost());
    let err = client.lock("kept").try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    let pttl: i64 = redis.cli(&["PTTL", "kept"]).trim().parse().unwrap();
    assert!(pttl > 0 && pttl <= 1500, "pttl {pttl}");
    lease.release().await.unwrap();
    assert_eq!(redis.cli(&["EXISTS", "kept"]).trim(), "0");
}

#[tokio::test]
async fn same_owner_holds_reentrantly_and_each_stream_gives_one_back() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let first = client.lock("re").owner("svc:1").acquire().await.unwrap();
    let second = client.lock("re").owner("svc:1").try_once().acquire().await.unwrap();
    assert_eq!((first.hold_count(), second.hold_count()), (1, 2));
    // `fencing_tokens` is a multi-lock's: a single name's grant carries none.
    assert!(first.fencing_tokens().is_empty(), "{:?}", first.fencing_tokens());
    assert_eq!(second.owner(), "svc:1");
    assert!(second.fencing_token() > first.fencing_token());
    first.release().await.unwrap();
    assert_eq!(redis.cli(&["HGET", "re", "svc:1"]).trim(), "1");
    let err = client.lock("re").try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    second.release().await.unwrap();
    client.lock("re").try_once().acquire().await.expect("free");
}

/// Two waiting streams of one owner: the grant to the first lets the second reenter
/// at once, whichever way the lock came (a release handing it to the first, or the
/// unlock message that wakes one writer). The second was woken by nothing and waited
/// for the TTL of the holder it last saw (here 30 s, past its wait).
#[tokio::test]
async fn a_waiter_whose_owner_was_just_granted_the_lock_reenters_at_once() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let wait = Duration::from_secs(10);
    for kind in [LockKind::Mutex, LockKind::Write] {
        let name = format!("fellow-{kind:?}");
        let holder = client.lock(&name).kind(kind).acquire().await.expect("holder");
        let (first, _) = spawn_queued(client.lock(&name).kind(kind).owner("svc:1").wait(wait), wait).await;
        let (second, _) = spawn_queued(client.lock(&name).kind(kind).owner("svc:1").wait(wait), wait).await;
        holder.release().await.expect("released");
        let first = tokio::time::timeout(wait, first)
            .await
            .expect("bounded")
            .expect("task")
            .expect("first");
        let second = tokio::time::timeout(Duration::from_secs(1), second)
            .await
            .unwrap_or_else(|_| panic!("{kind:?}: the second stream of the owner reenters at once"))
            .expect("task")
            .expect("second");
        assert_eq!((first.hold_count(), second.hold_count()), (1, 2), "{kind:?}");
        first.release().await.expect("first released");
        second.release().await.expect("second released");
    }
}

#[tokio::test]
async fn fencing_tokens_increase_across_grants_and_describe_shows_the_last() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let mut last = 0;
    for _ in 0..20 {
        let lease = client.lock("fence").acquire().await.unwrap();
        assert!(lease.fencing_token() > last);
        last = lease.fencing_token();
        let state = client.describe("fence").await.unwrap();
        assert!(state.locked);
        assert_eq!(state.last_fencing_token, last);
        assert_eq!(state.holders.len(), 1);
        assert_eq!(state.holders[0].owner, lease.owner());
        lease.release().await.unwrap();
    }
    // The counter key may expire; tokens still increase (they follow Redis' clock).
    redis.cli(&["DEL", "latchkey_fence:{fence}"]);
    let lease = client.lock("fence").acquire().await.unwrap();
    assert!(lease.fencing_token() > last);
}

/// Polls `redis` with `args` until it answers `want` (at most 10 s).
async fn wait_answer(redis: &RedisServer, args: &[&str], want: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answer = redis.cli(args);
        if want(&answer) {
            return;
        }
        assert!(Instant::now() < deadline, "{args:?}: {answer}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A replica promoted while the last grants had not reached it (Redis replicates
/// asynchronously) has a fencing counter behind the old primary's. Grants there must
/// still answer tokens past every one the old primary gave: its last holder may write
/// on until its next renewal, and the resource must refuse it once the new holder
/// wrote. (The counter alone restarted at the replica's value: the new holder got the
/// same token as the old primary's first lost grant, below its last.)
#[tokio::test]
async fn fencing_tokens_increase_across_a_failover_to_a_replica_behind() {
    let primary = RedisServer::start();
    let replica = RedisServer::start();
    let port = primary.port().to_string();
    replica.cli(&["REPLICAOF", "127.0.0.1", &port]);
    wait_answer(&replica, &["INFO", "replication"], |i| {
        i.contains("master_link_status:up")
    })
    .await;
    let old = Latchkey::start(&primary.url()).await;
    let client = old.client().await;
    let first = client.lock("f").acquire().await.unwrap();
    let replicated = first.fencing_token().to_string();
    first.release().await.unwrap();
    wait_answer(&replica, &["GET", "latchkey_fence:{f}"], |v| v.trim() == replicated).await;
    // The replica stops replicating before the next grants: a promotion with lag.
    replica.cli(&["REPLICAOF", "NO", "ONE"]);
    let mut last = 0;
    for _ in 0..3 {
        let lease = client.lock("f").acquire().await.unwrap();
        last = lease.fencing_token();
        lease.release().await.unwrap();
    }
    let new = Latchkey::start(&replica.url()).await;
    let lease = new.client().await.lock("f").try_once().acquire().await.unwrap();
    assert!(
        lease.fencing_token() > last,
        "a token of the promoted replica ({}) is past the old primary's last ({last})",
        lease.fencing_token()
    );
}

#[tokio::test]
async fn force_release_ends_holders_on_every_server_and_wakes_waiters() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let holder = b.client().await.lock("stuck").acquire().await.unwrap();
    let client = a.client().await;
    let (waiter, _) = spawn_queued(client.lock("stuck").wait(T), T).await;
    assert!(client.force_release("stuck").await.unwrap());
    let reason = tokio::time::timeout(Duration::from_secs(2), holder.lost())
        .await
        .expect("told at once");
    assert_eq!(reason, LostReason::ForceReleased);
    tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .expect("woken")
        .unwrap()
        .expect("acquired");
    assert!(!client.force_release("never-held").await.unwrap());
}

#[tokio::test]
async fn lost_is_sent_as_an_event_then_aborted() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let mut raw = server.raw().await;
    let open = latchkey_proto::v1::Open {
        lease: Some(pd(Duration::from_millis(300))),
        ..open("ev")
    };
    let mut s = RawStream::open(&mut raw, Some(open)).await;
    match s.next(T).await.unwrap().unwrap().event {
        // A tenth less than asked: the server gives it back that early.
        Some(Event::Acquired(a)) => assert_eq!(a.lease, Some(pd(Duration::from_millis(270)))),
        other => panic!("{other:?}"),
    }
    match s.next(T).await.unwrap().unwrap().event {
        Some(Event::Lost(l)) => assert_eq!(l.reason, Reason::LeaseExpired as i32),
        other => panic!("{other:?}"),
    }
    let status = s.next(T).await.unwrap_err();
    assert_eq!(status.code(), Code::Aborted);
    let info = tonic_types::StatusExt::get_details_error_info(&status).expect("ErrorInfo");
    assert_eq!(info.reason, "LEASE_LOST");
    assert_eq!(info.metadata["lostReason"], "LEASE_EXPIRED");
}

#[tokio::test]
async fn a_waiter_is_told_queued_with_the_holder_ttl() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let _held = server.client().await.lock("q").acquire().await.unwrap();
    let mut raw = server.raw().await;
    let mut s = RawStream::open(&mut raw, Some(open("q"))).await;
    match s.next(T).await.unwrap().unwrap().event {
        Some(Event::Queued(q)) => {
            let ttl = q.holder_ttl.expect("ttl");
            assert!(ttl.seconds > 20 && ttl.seconds <= 30, "{ttl:?}");
        }
        other => panic!("{other:?}"),
    }
    // `release` while queued withdraws the request: answered `released`, then OK.
    s.release().await;
    assert!(matches!(
        s.next(T).await.unwrap().unwrap().event,
        Some(Event::Released(_))
    ));
    assert!(s.next(T).await.unwrap().is_none());
}

#[tokio::test]
async fn half_close_while_waiting_keeps_waiting_then_releases_after_the_grant() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let held = server.client().await.lock("hcw").acquire().await.unwrap();
    let mut raw = server.raw().await;
    let mut s = RawStream::open(&mut raw, Some(open("hcw"))).await;
    assert!(matches!(
        s.next(T).await.unwrap().unwrap().event,
        Some(Event::Queued(_))
    ));
    s.half_close();
    tokio::time::sleep(Duration::from_millis(200)).await;
    held.release().await.unwrap();
    assert!(matches!(
        s.next(T).await.unwrap().unwrap().event,
        Some(Event::Acquired(_))
    ));
    assert!(matches!(
        s.next(T).await.unwrap().unwrap().event,
        Some(Event::Released(_))
    ));
    assert!(s.next(T).await.unwrap().is_none());
    assert_eq!(redis.cli(&["EXISTS", "hcw"]).trim(), "0");
}

#[tokio::test]
async fn a_shorter_reentrant_lease_never_shortens_the_lock() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let long = client
        .lock("re-lease")
        .owner("o")
        .lease(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let short = client
        .lock("re-lease")
        .owner("o")
        .lease(Duration::from_millis(200))
        .acquire()
        .await
        .unwrap();
    assert_eq!(short.hold_count(), 2);
    let reason = tokio::time::timeout(T, short.lost())
        .await
        .expect("the short lease ends");
    assert_eq!(reason, LostReason::LeaseExpired);
    let pttl: i64 = redis.cli(&["PTTL", "re-lease"]).trim().parse().unwrap();
    assert!(pttl > 50_000, "the 60 s hold keeps its lease: {pttl}");
    let err = client.lock("re-lease").try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    assert!(!long.is_lost());
}

/// A fixed lease counts from the try that granted it, and the client counts it from
/// there too: the server says how long it waited first. A waiter queued longer than
/// its lease was told its lease was over the moment it was granted (the client counted
/// from its request), and `latchkey run --wait 2m --lease 30s` killed its command at
/// once.
#[tokio::test]
async fn a_fixed_lease_queued_longer_than_itself_is_held_for_its_length() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let holder = client.lock("queued-fixed").acquire().await.unwrap();
    let lease = Duration::from_millis(800);
    let (waiter, _) = spawn_queued(client.lock("queued-fixed").lease(lease).wait(T), T).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    holder.release().await.unwrap();
    let lease_held = tokio::time::timeout(T, waiter)
        .await
        .unwrap()
        .unwrap()
        .expect("granted");
    let granted = Instant::now();
    let reason = tokio::time::timeout(T, lease_held.lost())
        .await
        .expect("the lease ends");
    assert_eq!(reason, LostReason::LeaseExpired);
    let held_for = granted.elapsed();
    assert!(
        held_for >= Duration::from_millis(500),
        "held {held_for:?} of an 800 ms lease"
    );
}

/// A client opening thousands of streams at once on one connection keeps it: h2 closes
/// a connection whose small first messages pile up ahead of the sessions reading them,
/// unless the server's connection window leaves room for one per stream.
#[tokio::test]
async fn a_burst_of_streams_on_one_connection_keeps_the_connection() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let attempts = (0..4000).map(|i| client.lock(format!("burst:{i}")).try_once().acquire());
    let leases = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(attempts))
        .await
        .expect("4000 acquires within a minute");
    let errors: Vec<_> = leases.iter().filter_map(|l| l.as_ref().err()).collect();
    assert!(
        errors.is_empty(),
        "{} failed, the first: {:?}",
        errors.len(),
        errors.first()
    );
    let releases = leases.into_iter().flatten().map(|l| l.release());
    for released in futures::future::join_all(releases).await {
        released.expect("released");
    }
}

/// A force-release notice names the break's floor token: one that arrives after a newer
/// grant of the name (a floor below that grant's token) leaves that lease alone. The
/// notices are published by hand; a second one, for another lock, shows the first was
/// read.
#[tokio::test]
async fn a_late_force_notice_ends_only_the_holds_it_broke() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let newer = client.lock("late-notice").acquire().await.unwrap();
    let broken = client.lock("broken-notice").acquire().await.unwrap();
    let notice = |floor: u64, name: &str| format!("{name}\n{floor}");
    redis.cli(&[
        "PUBLISH",
        "latchkey:force_release",
        &notice(newer.fencing_token() - 1, "late-notice"),
    ]);
    redis.cli(&[
        "PUBLISH",
        "latchkey:force_release",
        &notice(broken.fencing_token(), "broken-notice"),
    ]);
    let reason = tokio::time::timeout(T, broken.lost()).await.expect("told");
    assert_eq!(reason, LostReason::ForceReleased);
    newer.release().await.expect("the newer lease was left alone");
}

/// A foreign key under one of a name's own keys (here a list where the fencing counter
/// belongs) fails the script before its first write: every kind is refused with
/// FAILED_PRECONDITION `WRONG_KIND` naming the lock, the lock is not left held, and the
/// name works again once the key is gone. (Redis keeps what a script wrote before an
/// error: a grant that took its token last would leave the lock held for a lease.)
#[tokio::test]
async fn a_foreign_key_under_a_names_counter_refuses_the_grant_and_holds_nothing() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    for kind in [LockKind::Mutex, LockKind::Fair, LockKind::Read, LockKind::Write] {
        let name = format!("foreign-{}", kind.as_str_name());
        let fence = format!("latchkey_fence:{{{name}}}");
        redis.cli(&["RPUSH", &fence, "not a counter"]);
        let err = client.lock(&name).kind(kind).try_once().acquire().await.unwrap_err();
        let status = err.status().expect("a status").clone();
        assert_eq!(status.code(), Code::FailedPrecondition, "{kind:?}: {status:?}");
        assert!(status.message().contains(&name), "{kind:?}: {}", status.message());
        let info = tonic_types::StatusExt::get_details_error_info(&status).expect("ErrorInfo");
        assert_eq!(info.reason, "WRONG_KIND", "{kind:?}");
        assert_eq!(
            redis.cli(&["EXISTS", &name]).trim(),
            "0",
            "{kind:?}: the lock was left held"
        );
        redis.cli(&["DEL", &fence]);
        let lease = client.lock(&name).kind(kind).try_once().acquire().await.unwrap();
        lease.release().await.unwrap();
    }
}

/// An application's key where latchkey keeps a mutex's claims (a string under
/// `latchkey_claims:{name}`) is no claim: a waiter of another server leaves none and
/// waits, the holder's release frees the lock for it, and the key is left alone. The
/// waiter's try and the release both failed `WRONGTYPE` on it (a multi-lock's release
/// left its other names held for their lease).
#[tokio::test]
async fn an_applications_key_under_a_mutexs_claims_is_no_claim() {
    let redis = RedisServer::start();
    let (a, b) = (Latchkey::start(&redis.url()).await, Latchkey::start(&redis.url()).await);
    let (holder_client, waiter_client) = (a.client().await, b.client().await);
    let claims = "latchkey_claims:{foreign-claims}";
    redis.cli(&["SET", claims, "an application's"]);
    let held = holder_client.lock("foreign-claims").acquire().await.unwrap();
    let (waiter, _) = spawn_queued(waiter_client.lock("foreign-claims").wait(T), T).await;
    held.release().await.expect("released");
    latchkey_tests::server::each_granted(vec![waiter], Duration::from_secs(3)).await;
    assert_eq!(redis.cli(&["GET", claims]).trim(), "an application's");
}

/// An application's hash under a lock's name is no lock to a try: one whose `mode` no
/// lock writes (`none`, `lock`), one whose field holds no hold count, and one with a
/// field beside a mutex holder's count. Every kind is refused `FAILED_PRECONDITION` at
/// once, whatever owner it names, and the hash is left as it was. `mode: none` read as
/// a free name (two mutex requests were both granted, and a read's release deleted the
/// hash); `{name: bob}` read as a held mutex (a waiter waited on it for good), and an
/// owner named like a numeric field (`created`) reentered it. A held lock whose
/// lifetime an operator took away (`PERSIST`) is still a lock: its waiter waits.
#[tokio::test]
async fn every_kind_refuses_an_applications_hash_and_leaves_it_alone() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let hashes: [(&str, &[&str], bool); 5] = [
        ("prefs", &["mode", "none", "theme", "dark"], true),
        ("visits", &["mode", "lock", "home", "5"], true),
        ("profile", &["name", "bob"], false),
        ("stamps", &["created", "1718000000000"], false),
        ("pair", &["home", "1", "away", "1"], true),
    ];
    let kinds = [LockKind::Mutex, LockKind::Fair, LockKind::Read, LockKind::Write];
    for (name, fields, lifetime) in hashes {
        redis.cli(&[&["HSET", name][..], fields].concat());
        if lifetime {
            redis.cli(&["PEXPIRE", name, "600000"]);
        }
        // An owner of its own, and one named like the hash's last field.
        for (kind, owner) in kinds
            .iter()
            .flat_map(|k| [(*k, "alice"), (*k, fields[fields.len() - 2])])
        {
            let wait = client
                .lock(name)
                .kind(kind)
                .owner(owner)
                .wait(Duration::from_millis(300));
            let got = bounded(T, "a try", wait.acquire()).await;
            let hash = redis.cli(&["HGETALL", name]).replace('\n', " ");
            let err = got
                .map(|_| ())
                .expect_err(&format!("{kind:?} of {owner} granted in {name}: {hash}"));
            assert_eq!(
                err.code(),
                Code::FailedPrecondition,
                "{kind:?} of {owner} in {name}: {err}"
            );
            assert_eq!(hash.trim(), fields.join(" "), "{kind:?} of {owner} in {name}");
            let ttl: i64 = redis.cli(&["PTTL", name]).trim().parse().unwrap();
            assert!(
                if lifetime { ttl > 500_000 } else { ttl == -1 },
                "{kind:?} in {name}: {ttl}"
            );
        }
    }
    let held = client.lock("persisted").acquire().await.unwrap();
    redis.cli(&["PERSIST", "persisted"]);
    let waiting = client.lock("persisted").wait(Duration::from_millis(1500)).acquire();
    let err = bounded(T, "a waiter", waiting)
        .await
        .map(|_| ())
        .expect_err("granted beside the holder");
    assert_eq!(err.code(), Code::DeadlineExceeded, "it waited: {err}");
    held.release().await.unwrap();
}

/// Tokens of one name grow with every grant, whichever path granted it: plain tries,
/// handoffs, passes in memory (many waiters of one server), claims granted by another
/// server's release, fixed-lease and named-owner waiters mixed in.
#[tokio::test]
async fn tokens_grow_across_every_grant_path() {
    let redis = RedisServer::start();
    let s1 = Latchkey::start(&redis.url()).await;
    let s2 = Latchkey::start(&redis.url()).await;
    let c1 = s1.client().await;
    let c2 = s2.client().await;
    let seen = latchkey_tests::server::Grants::default();
    let mut tasks = Vec::new();
    for i in 0..12 {
        let client = if i % 3 == 0 { c2.clone() } else { c1.clone() };
        let seen = seen.clone();
        tasks.push(tokio::spawn(async move {
            for round in 0..15 {
                let mut lock = client.lock("tok").wait(T);
                let what = match (i + round) % 5 {
                    0 => {
                        lock = lock.lease(Duration::from_secs(2));
                        "fixed"
                    }
                    1 => {
                        lock = lock.owner(format!("own{i}"));
                        "owner"
                    }
                    _ => "plain",
                };
                let lease = lock.acquire().await.expect("granted");
                seen.record(lease.fencing_token(), format!("{i}/{round} {what}"));
                if round % 4 == 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                lease.release().await.expect("released");
            }
        }));
    }
    for t in tasks {
        bounded(Duration::from_secs(60), "workers", t).await.unwrap();
    }
    seen.assert_increasing();
}

/// A Java holder hands a mutex to another Java thread on a short fixed lease (one
/// script: its unlock message, then the new hold) while two latchkey waiters of one
/// server sleep on the first holder's minute. The first waiter, woken, learns the
/// short lease, then leaves; the others slept on the minute, and past the short lease's
/// silent end, on a free lock. What the first learned now has them look again by then:
/// all of them, as the next one may leave too before it looks.
#[tokio::test]
async fn a_mutex_waiter_learns_the_shorter_lease_another_waiter_was_told() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let name = "handed-over";
    let java = latchkey_tests::redisson::random_owner();
    redis.cli(&["HSET", name, &java, "1"]);
    redis.cli(&["PEXPIRE", name, "60000"]);
    let first = client.lock(name).wait(Duration::from_secs(30));
    let (first, _) = spawn_queued(first, Duration::from_secs(10)).await;
    let second = client.lock(name).wait(Duration::from_secs(30));
    let (second, _) = spawn_queued(second, Duration::from_secs(10)).await;
    let third = client.lock(name).wait(Duration::from_secs(30));
    let (third, _) = spawn_queued(third, Duration::from_secs(10)).await;
    // Java's unlock and the next Java thread's lock on a 2 s lease, as one step.
    let hand_over = "redis.call('del', KEYS[1]) redis.call('publish', KEYS[2], '0') \
                     redis.call('hset', KEYS[1], ARGV[1], 1) redis.call('pexpire', KEYS[1], 2000)";
    let channel = latchkey_tests::redisson::lock_channel(name);
    let next = latchkey_tests::redisson::random_owner();
    redis.cli(&["EVAL", hand_over, "2", name, &channel, &next]);
    let handed = Instant::now();
    // The first waiter's woken try answers within a few ms; then its client leaves.
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    // The next one leaves too, before it looks.
    second.abort();
    assert!(second.await.unwrap_err().is_cancelled());
    let lease = bounded(Duration::from_secs(40), "the third waiter", third)
        .await
        .unwrap()
        .expect("granted once the short lease ran out");
    assert!(
        handed.elapsed() < Duration::from_secs(5),
        "granted {:?} after the hand-over, the short lease running out by 2 s",
        handed.elapsed()
    );
    lease.release().await.unwrap();
}
