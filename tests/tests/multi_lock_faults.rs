//! The multi-lock through faults: a group's script or a give-back that outlives
//! `--redis-timeout`, replies late for a while, calls dropped at random moments among
//! overlapping sets on two servers, and the holding server stopped. No name stays held,
//! no two holders of a name overlap, and tokens per name only grow.

use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::{spawn_queued, Latchkey};
use latchkey_tests::RedisServer;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::Code;

const T: Duration = Duration::from_secs(10);

/// `names` in a multi-lock's order, which is by slot.
fn in_order<const N: usize>(mut names: [&'static str; N]) -> [&'static str; N] {
    names.sort_by_key(|n| fred::util::redis_keyslot(n.as_bytes()));
    names
}

/// A server whose Redis replies a proxy can hold back past its `--redis-timeout`, and
/// another beside it that reaches Redis directly, to look.
struct Slow {
    server: Latchkey,
    direct: Latchkey,
    proxy: Proxy,
    // Stopped last, as the fields drop in order.
    _redis: RedisServer,
}

impl Slow {
    async fn start() -> Slow {
        let redis = RedisServer::start();
        let proxy = Proxy::to_redis(&redis).await;
        let server = Latchkey::start_with(&proxy.redis_url(), &["--redis-timeout", "200ms"]).await;
        let direct = Latchkey::start(&redis.url()).await;
        Slow {
            _redis: redis,
            proxy,
            server,
            direct,
        }
    }
}

/// Waits (bounded) until no name of `names` is locked; panics naming the one left.
async fn all_free(client: &latchkey_client::Client, names: &[&str], within: Duration) {
    let until = Instant::now() + within;
    loop {
        let mut held = Vec::new();
        for n in names {
            if client.describe(*n).await.unwrap().locked {
                held.push(n.to_string());
            }
        }
        if held.is_empty() {
            return;
        }
        assert!(Instant::now() < until, "names left held: {held:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A try whose script for one group times out (held back past --redis-timeout): the
/// stream ends UNAVAILABLE and no name stays held (the late script grants nothing, or
/// its grant is given back).
#[tokio::test]
async fn a_timed_out_group_leaves_no_name_held() {
    let slow = Slow::start().await;
    let (proxy, client, observer) = (&slow.proxy, slow.server.client().await, slow.direct.client().await);
    let names = in_order(["t1", "t2", "t3"]);
    for late in [names[1], names[2]] {
        let fence = format!("latchkey_fence:{{{late}}}");
        proxy.hold_back_matching(Some((fence.as_bytes(), Duration::from_millis(700))));
        let err = client.lock_all(names).try_once().acquire().await.unwrap_err();
        assert_eq!(err.code(), Code::Unavailable, "{err}");
        tokio::time::sleep(Duration::from_millis(900)).await;
        proxy.hold_back_matching(None);
        all_free(&observer, &names, Duration::from_secs(4)).await;
        // And they stay free (a late grant after the give-back would show now).
        tokio::time::sleep(Duration::from_millis(800)).await;
        all_free(&observer, &names, Duration::from_millis(10)).await;
        let l = observer.lock_all(names).try_once().acquire().await.unwrap();
        l.release().await.unwrap();
    }
}

/// A multi-lock waiter in line outlasts a try that fails (its group's script held back
/// past `--redis-timeout`, reaching Redis late), as a single name's waiter does: it keeps
/// its place, tries again, and is granted every name, the late grant among them. It
/// used to end UNAVAILABLE at the first failed try after its wake.
#[tokio::test]
async fn a_multi_lock_waiter_in_line_outlasts_a_failed_try() {
    let slow = Slow::start().await;
    let (proxy, client, other) = (&slow.proxy, slow.server.client().await, slow.direct.client().await);
    let names = in_order(["w1", "w2"]);
    // The try the release wakes times out: its script, on the busy name's group first,
    // reaches Redis 700 ms late.
    let waiter = woken_into_a_late_call(&slow, &client, &other, &names, names[1], names[1]).await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    proxy.hold_back_matching(None);
    let lease = tokio::time::timeout(T, waiter)
        .await
        .expect("not stranded")
        .unwrap()
        .expect("granted after the failed try");
    for name in names {
        assert!(other.describe(name).await.unwrap().locked, "{name} held");
    }
    lease.release().await.unwrap();
    all_free(&other, &names, Duration::from_secs(4)).await;
}

/// A multi-lock waiter in line whose failed try reached its last name late holds that
/// name no longer than its next try: the first name busy again (another client took it
/// when the failed try gave it back), each try stopped there and gave back only what it
/// took, and the late grant of the last name stayed held, unseen, for its lease.
#[tokio::test]
async fn a_multi_lock_waiter_in_doubt_keeps_no_late_grant_while_it_waits() {
    let slow = Slow::start().await;
    let (proxy, client, other) = (&slow.proxy, slow.server.client().await, slow.direct.client().await);
    for round in [
        ["d0-a", "d0-b", "d0-c"],
        ["d1-a", "d1-b", "d1-c"],
        ["d2-a", "d2-b", "d2-c"],
        ["d3-a", "d3-b", "d3-c"],
        ["d4-a", "d4-b", "d4-c"],
        ["d5-a", "d5-b", "d5-c"],
        ["d6-a", "d6-b", "d6-c"],
        ["d7-a", "d7-b", "d7-c"],
    ] {
        let names = in_order(round);
        // The try the release wakes takes the first names; its call for the last
        // reaches Redis 700 ms late, after it failed and gave the others back.
        let waiter = woken_into_a_late_call(&slow, &client, &other, &names, names[0], names[2]).await;
        let taken = tokio::time::timeout(T, async {
            loop {
                if let Ok(lease) = other.lock(names[0]).try_once().acquire().await {
                    return lease;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        let taker = taken
            .await
            .expect("the first name is free once the failed try gave it back");
        tokio::time::sleep(Duration::from_millis(900)).await;
        proxy.hold_back_matching(None);
        if waiter.is_finished() {
            taker.release().await.unwrap();
            match waiter.await.unwrap() {
                // The waiter took every name before the taker did: the scenario did
                // not arise (a loaded machine), and the next round tries again.
                Ok(lease) => lease.release().await.unwrap(),
                // The give-back of what its failed try took went on the connection the
                // late call held up, and failed too: the wait ended (that give-back may
                // run after a later try), and the stream's end gives every name back.
                Err(e) => {
                    assert_eq!(e.code(), Code::Unavailable, "{e}");
                    all_free(&other, &names, Duration::from_secs(3)).await;
                }
            }
            continue;
        }
        // The last name, granted late, goes back at the waiter's next try.
        all_free(&other, &names[1..], Duration::from_secs(3)).await;
        taker.release().await.unwrap();
        let lease = tokio::time::timeout(T, waiter)
            .await
            .expect("granted")
            .unwrap()
            .expect("granted");
        lease.release().await.unwrap();
        return;
    }
    panic!("in no round did the waiter fail its try and wait behind another holder");
}

/// A multi-lock waiter in doubt whose failed try reached its last name late holds that
/// name no longer than its next try, though that try fails too, before it reaches the
/// name: the first name's calls time out (held back past `--redis-timeout`) while the
/// last name's Redis answers. Such tries gave back only what they took, nothing, and
/// the late grant stayed held, unseen, as long as they failed.
#[tokio::test]
async fn a_multi_lock_waiter_in_doubt_whose_tries_fail_keeps_no_late_grant() {
    let slow = Slow::start().await;
    let (proxy, client, other) = (&slow.proxy, slow.server.client().await, slow.direct.client().await);
    for round in [["f0-a", "f0-b"], ["f1-a", "f1-b"], ["f2-a", "f2-b"], ["f3-a", "f3-b"]] {
        let names = in_order(round);
        // The try the release wakes takes the first name; its call for the last reaches
        // Redis 700 ms late, after it failed and gave the first back.
        let waiter = woken_into_a_late_call(&slow, &client, &other, &names, names[0], names[1]).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        // From now on each try's call for the first name times out.
        let first = format!("latchkey_fence:{{{}}}", names[0]);
        proxy.hold_back_matching(Some((first.as_bytes(), Duration::from_secs(8))));
        let granted_late = tokio::time::timeout(Duration::from_secs(2), async {
            while !other.describe(names[1]).await.unwrap().locked {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        if waiter.is_finished() || granted_late.is_err() {
            // The give-back of the failed try's first name went on the connection the
            // late call held up and failed too (the wait ended), or the late call was
            // dropped with its connection: the scenario did not arise.
            proxy.hold_back_matching(None);
            if let Ok(Ok(lease)) = tokio::time::timeout(T, waiter).await.unwrap() {
                lease.release().await.unwrap();
            }
            continue;
        }
        // The waiter's next try, failing at the first name, gives the last back.
        all_free(&other, &names[1..], Duration::from_secs(4)).await;
        assert!(!waiter.is_finished(), "the waiter waits on");
        proxy.hold_back_matching(None);
        waiter.abort();
        return;
    }
    panic!("in no round did the waiter's failed try grant its last name late");
}

/// A multi-lock of `names` through the slow server, queued behind `other`'s hold of
/// `busy`, which is then released: the try that wakes it sends its call for `late`'s
/// group, which reaches Redis 700 ms late (`slow`'s proxy holds it back until told not
/// to), past the slow server's Redis timeout.
async fn woken_into_a_late_call(
    slow: &Slow,
    client: &latchkey_client::Client,
    other: &latchkey_client::Client,
    names: &[&'static str],
    busy: &str,
    late: &str,
) -> latchkey_tests::server::Waiting {
    let holder = other.lock(busy).acquire().await.unwrap();
    let (waiter, _) = spawn_queued(client.lock_all(names.to_vec()).wait(Duration::from_secs(30)), T).await;
    let fence = format!("latchkey_fence:{{{late}}}");
    slow.proxy
        .hold_back_matching(Some((fence.as_bytes(), Duration::from_millis(700))));
    holder.release().await.unwrap();
    waiter
}

/// A give-back (the multi-lock busy on a later name) that times out: nothing stays held.
#[tokio::test]
async fn a_timed_out_give_back_leaves_no_name_held() {
    let slow = Slow::start().await;
    let (proxy, client, observer) = (&slow.proxy, slow.server.client().await, slow.direct.client().await);
    let names = in_order(["g1", "g2", "g3"]);
    let busy = observer.lock(names[2]).acquire().await.unwrap();
    let channel = format!("redisson_lock__channel:{{{}}}", names[0]);
    proxy.hold_back_matching(Some((channel.as_bytes(), Duration::from_millis(700))));
    let err = client
        .lock_all(names)
        .wait(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    tokio::time::sleep(Duration::from_millis(900)).await;
    proxy.hold_back_matching(None);
    all_free(&observer, &names[..2], Duration::from_secs(4)).await;
    busy.release().await.unwrap();
    observer
        .lock_all(names)
        .try_once()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// A give-back between two tries of a waiter in line (its try, taking the name it was
/// blocked on first, found another busy) that outlives `--redis-timeout`: it may still
/// run after the waiter's next try found the record it gives back and took it for its
/// grant. It freed that name under the holder, which another client then took. The
/// wait ends instead (UNAVAILABLE), and nothing stays held.
#[tokio::test]
async fn a_give_back_outliving_its_timeout_frees_nothing_a_later_try_holds() {
    let slow = Slow::start().await;
    let (proxy, client, observer) = (&slow.proxy, slow.server.client().await, slow.direct.client().await);
    let names = in_order(["f1", "f2", "f3"]);
    let last = observer.lock(names[2]).acquire().await.unwrap();
    let (waiting, _) = spawn_queued(client.lock_all(names).wait(Duration::from_secs(30)), T).await;
    // Its next try takes the last name's group first, finds the first name busy and
    // gives the last back: that give-back is held 3 s.
    let first = observer.lock(names[0]).acquire().await.unwrap();
    let channel = format!("redisson_lock__channel:{{{}}}", names[2]);
    proxy.hold_back_matching(Some((channel.as_bytes(), Duration::from_secs(3))));
    last.release().await.unwrap();
    let held = latchkey_tests::poll_until(T, || proxy.holding() > 0).await;
    assert!(held, "the give-back was never sent");
    // Past its timeout, the first name freed: the waiter's next try would take every name.
    tokio::time::sleep(Duration::from_millis(400)).await;
    first.release().await.unwrap();
    let outcome = latchkey_tests::bounded(T, "the waiter", waiting).await.unwrap();
    // What is held goes through (give-backs sent again meanwhile among it).
    proxy.hold_back_matching(None);
    let gone = latchkey_tests::poll_until(T, || proxy.holding() == 0).await;
    assert!(gone, "the give-back was never let through");
    match outcome {
        Ok(lease) => {
            let taken = observer.lock(names[2]).try_once().acquire().await;
            assert!(
                taken.is_err() || lease.is_lost(),
                "{} taken by another while the multi-lock was told it holds it",
                names[2]
            );
            drop(taken);
            let _ = lease.release().await;
        }
        Err(e) => assert_eq!(e.code(), Code::Unavailable, "{e}"),
    }
    all_free(&observer, &names, Duration::from_secs(5)).await;
}

/// Many multi-locks over overlapping sets, in every order, cancelled at random moments
/// (the client drops the call mid-try), beside plain holders: no two holders of a name
/// at once, tokens per name increase in grant order, and nothing is left held after.
#[tokio::test]
async fn cancelled_and_contending_multi_locks_leave_nothing_and_never_overlap() {
    let redis = RedisServer::start();
    let (one, two) = (Latchkey::start(&redis.url()).await, Latchkey::start(&redis.url()).await);
    let pool = ["c1", "c2", "c3", "c4"];
    let inside: Arc<HashMap<&'static str, AtomicU32>> =
        Arc::new(pool.iter().map(|n| (*n, AtomicU32::new(0))).collect());
    let tokens: Arc<Mutex<HashMap<&'static str, u64>>> = Arc::default();
    let mut tasks = Vec::new();
    for i in 0..8u64 {
        let client = if i % 2 == 0 {
            one.client().await
        } else {
            two.client().await
        };
        let (inside, tokens) = (inside.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(i);
            for _ in 0..40 {
                let mut set: Vec<&'static str> = pool.to_vec();
                rng.shuffle(&mut set);
                set.truncate(rng.usize(1..=3));
                let request = if set.len() == 1 {
                    client.lock(set[0]).wait(Duration::from_secs(5))
                } else {
                    client.lock_all(set.clone()).wait(Duration::from_secs(5))
                };
                let cancel_after = Duration::from_micros(rng.u64(0..6000));
                let lease = match rng.bool() {
                    true => match tokio::time::timeout(cancel_after, request.acquire()).await {
                        Ok(r) => r,
                        Err(_) => continue,
                    },
                    false => request.acquire().await,
                };
                let lease = match lease {
                    Ok(l) => l,
                    Err(e) if e.code() == Code::DeadlineExceeded => continue,
                    Err(e) => panic!("{set:?}: {e}"),
                };
                let got: Vec<u64> = if set.len() == 1 {
                    vec![lease.fencing_token()]
                } else {
                    lease.fencing_tokens().to_vec()
                };
                assert_eq!(got.len(), set.len());
                {
                    let mut t = tokens.lock().unwrap();
                    for (n, tok) in set.iter().zip(&got) {
                        let prev = t.insert(*n, *tok).unwrap_or(0);
                        assert!(*tok > prev, "{n}: token {tok} after {prev}");
                    }
                }
                for n in &set {
                    assert_eq!(inside[n].fetch_add(1, Ordering::SeqCst), 0, "two holders of {n}");
                }
                tokio::time::sleep(Duration::from_millis(rng.u64(0..3))).await;
                for n in &set {
                    inside[n].fetch_sub(1, Ordering::SeqCst);
                }
                match rng.u8(0..4) {
                    0 => drop(lease),
                    _ => lease.release().await.unwrap(),
                }
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("finished")
            .unwrap();
    }
    let client = one.client().await;
    all_free(&client, &pool, Duration::from_secs(5)).await;
    let leftovers = redis.cli(&["KEYS", "latchkey_claims*"]);
    assert!(leftovers.trim().is_empty(), "claims left: {leftovers}");
}

/// A server stopped (SIGTERM) while one of its streams holds a multi-lock gives back
/// every name: another server's waiter is granted long before the lease would end.
#[tokio::test]
async fn shutdown_gives_back_every_name() {
    let redis = RedisServer::start();
    let one = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "30s"]).await;
    let two = Latchkey::start(&redis.url()).await;
    let (c1, c2) = (one.client().await, two.client().await);
    let _lease = c1.lock_all(["d1", "d2", "d3"]).acquire().await.unwrap();
    let (waiter, _) = spawn_queued(c2.lock_all(["d3", "d1"]).wait(T), T).await;
    let stopped = Instant::now();
    one.stop().await;
    let l = tokio::time::timeout(T, waiter)
        .await
        .expect("granted")
        .unwrap()
        .expect("granted");
    assert!(stopped.elapsed() < Duration::from_secs(5), "{:?}", stopped.elapsed());
    l.release().await.unwrap();
    all_free(&c2, &["d1", "d2", "d3"], Duration::from_secs(3)).await;
}
