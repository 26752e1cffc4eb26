//! The mutex on a 3-master Redis Cluster started by the test: grants and handoffs
//! across slots and server replicas (sharded pub/sub, claims granted by the slot's
//! master), List over every master.

use latchkey_client::LostReason;
use latchkey_server::keys::Keys;
use latchkey_tests::server::{spawn_queued, Latchkey};
use latchkey_tests::{bounded, poll_until, LatchkeyProcess, RedisCluster};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(10);

#[tokio::test]
async fn cluster_grants_hands_off_and_lists_every_master() {
    let cluster = RedisCluster::start(3, 0);
    let a = Latchkey::start(&cluster.url()).await;
    let b = Latchkey::start(&cluster.url()).await;
    let client = a.client().await;

    // Names spread over every master.
    let names: Vec<String> = (0..24).map(|i| format!("svc/{i}")).collect();
    let masters: BTreeSet<u16> = names.iter().map(|n| cluster.master_for_key(n)).collect();
    assert_eq!(masters.len(), 3, "the names cover every master");
    let mut leases = Vec::new();
    for name in &names {
        leases.push(client.lock(name.as_str()).acquire().await.expect("granted"));
    }
    let _unrelated = client.lock("other/x").acquire().await.unwrap();

    // List pages through every master, sorted, with the prefix applied.
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = client.list("svc/", 7, token.clone()).await.expect("list");
        assert!(page.locks.len() <= 7);
        seen.extend(page.locks.into_iter().map(|l| {
            assert!(l.locked && l.holders.len() == 1);
            l.name
        }));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let mut want = names.clone();
    want.sort();
    assert_eq!(seen, want);

    // Handoff to a waiter on the other server, on every master: the waiter's claim is
    // granted by the release, in the slot's master (sharded pub/sub and its counts).
    let other = b.client().await;
    for name in ["svc/0", "svc/1", "svc/2"] {
        let idx = names.iter().position(|n| n == name).unwrap();
        let holder = leases.remove(idx);
        let waiter = {
            let other = other.clone();
            tokio::spawn(async move { other.lock(name).wait(T).acquire().await })
        };
        let master = cluster.node(cluster.master_for_key(name));
        let claims = format!("latchkey_claims:{{{name}}}");
        let claimed = poll_until(T, || master.cli(&["ZCARD", &claims]).trim() == "1").await;
        assert!(claimed, "{name}: the waiter on the other server claims");
        master.cli(&["CONFIG", "RESETSTAT"]);
        let released_at = Instant::now();
        holder.release().await.unwrap();
        waiter.await.unwrap().expect("waiter on the other server acquires");
        assert!(
            released_at.elapsed() < Duration::from_secs(1),
            "{name} handed off promptly"
        );
        assert_eq!(master.command_calls("hset"), 1, "{name}: the claim granted");
        assert_eq!(master.command_calls("hincrby"), 0, "{name}: no try of the waiter's");
        // Keep the indexes of the remaining names in step.
        leases.insert(idx, other.lock(format!("{name}-again")).acquire().await.unwrap());
    }
}

/// A handoff to a waiter of the same server, on every master: the script reserves
/// tokens for passes in memory and records the token it granted beside the counter (a
/// key the script builds, in the lock's slot), so Describe shows that grant's token.
#[tokio::test]
async fn cluster_hands_off_locally_and_describes_the_latest_grant() {
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start(&cluster.url()).await;
    let client = server.client().await;
    let names: Vec<String> = (0..12).map(|i| format!("local/{i}")).collect();
    let masters: BTreeSet<u16> = names.iter().map(|n| cluster.master_for_key(n)).collect();
    assert_eq!(masters.len(), 3, "the names cover every master");
    for name in &names {
        let holder = client.lock(name.as_str()).acquire().await.unwrap();
        let (waiter, _) = spawn_queued(client.lock(name.as_str()).wait(T), T).await;
        holder.release().await.unwrap();
        let lease = waiter.await.unwrap().expect("handed over");
        let master = cluster.node(cluster.master_for_key(name));
        let record = master.cli(&["GET", &Keys::default().lock(name).fence_passed()]);
        assert!(
            record.starts_with(&format!("{}:", lease.fencing_token())),
            "{name}: the grant recorded beside the counter: {record:?}"
        );
        let state = client.describe(name.as_str()).await.unwrap();
        assert_eq!(state.last_fencing_token, lease.fencing_token(), "{name}");
        lease.release().await.unwrap();
    }
}

#[tokio::test]
async fn cluster_watchdog_renews_leases_on_every_master() {
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start_with(&cluster.url(), &["--watchdog-timeout", "600ms"]).await;
    let client = server.client().await;
    let mut leases = Vec::new();
    for i in 0..30 {
        leases.push(client.lock(format!("renewed/{i}")).acquire().await.unwrap());
    }
    // A multi-lock across slots: each name renewed with its own token.
    let names = ["renewed/z", "renewed/c", "renewed/q", "renewed/a"];
    leases.push(client.lock_all(names).acquire().await.unwrap());
    tokio::time::sleep(Duration::from_secs(2)).await;
    for lease in &leases {
        assert!(!lease.is_lost(), "{} kept", lease.name());
    }
    let err = client.lock("renewed/7").try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded);
}

#[tokio::test]
async fn cluster_serves_read_write_locks_and_semaphores() {
    use latchkey_client::LockKind;
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start_with(&cluster.url(), &["--watchdog-timeout", "900ms"]).await;
    let client = server.client().await;
    // Readers share across slots; a writer waits for them and is woken over sharded pub/sub.
    let names = ["rw/a", "rw/b", "rw/c"];
    for name in names {
        let r1 = client.lock(name).kind(LockKind::Read).acquire().await.unwrap();
        let r2 = client.lock(name).kind(LockKind::Read).acquire().await.unwrap();
        let writer = {
            let client = client.clone();
            tokio::spawn(async move { client.lock(name).kind(LockKind::Write).wait(T).acquire().await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        r1.release().await.unwrap();
        let released = Instant::now();
        r2.release().await.unwrap();
        writer.await.unwrap().expect("the writer acquires");
        assert!(released.elapsed() < Duration::from_secs(1), "{name}");
    }
    // A semaphore's holds are renewed by the node-wide batch and survive several periods.
    let a = client
        .lock("sem/x")
        .kind(LockKind::Semaphore)
        .limit(2)
        .acquire()
        .await
        .unwrap();
    let b = client
        .lock("sem/x")
        .kind(LockKind::Semaphore)
        .limit(2)
        .acquire()
        .await
        .unwrap();
    let _r = client.lock("rw/a").kind(LockKind::Read).acquire().await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!a.is_lost() && !b.is_lost());
    let err = client
        .lock("sem/x")
        .kind(LockKind::Semaphore)
        .limit(2)
        .try_once()
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded);
    let waiter = {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .lock("sem/x")
                .kind(LockKind::Semaphore)
                .limit(2)
                .wait(T)
                .acquire()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    a.release().await.unwrap();
    waiter.await.unwrap().expect("a permit came back");
}

#[tokio::test]
async fn a_batch_spans_the_slots_of_one_master() {
    use fred::prelude::{Key, Value};
    use latchkey_server::keys::Keys;
    use latchkey_server::redis::{batch_layout, BatchedCall};
    use latchkey_server::scripts::Scripts;
    let cluster = RedisCluster::start(3, 0);
    let client = latchkey_tests::redis_client(&cluster.url()).await;
    // Two names on one master, in different slots.
    let first = "spread/0".to_owned();
    let second = (1..)
        .map(|i| format!("spread/{i}"))
        .find(|n| cluster.master_for_key(n) == cluster.master_for_key(&first))
        .expect("another name on that master");
    let lease = [Value::from(30_000), Value::from("owner"), Value::from(5_000)];
    let calls: Vec<(Vec<Key>, Vec<Value>)> = [&first, &second]
        .into_iter()
        .enumerate()
        .map(|(i, name)| {
            let k = Keys::default().lock(name);
            let keys = [k.lock.clone(), k.fence(), k.hold(&format!("h{i}")), k.queue()];
            (keys.map(Key::from).to_vec(), lease.to_vec())
        })
        .collect();
    let batched: Vec<BatchedCall<'_>> = calls
        .iter()
        .map(|(keys, args)| ("mutex_acquire", keys.as_slice(), args.as_slice()))
        .collect();
    // KEYS declares only the first key (it routes the call); each call is packed whole.
    let (keys, args) = batch_layout(&batched).expect("strings and numbers pack");
    assert_eq!(keys.len(), 1);
    let replies: Vec<Value> = Scripts::new(true)
        .batch
        .eval(&client, keys, args)
        .await
        .expect("the batch runs on that master");
    // Two entries per call: 1 and its grant.
    assert_eq!(replies.len(), 4, "{replies:?}");
    assert_eq!(replies[0], Value::Integer(1), "{replies:?}");
    assert_eq!(replies[2], Value::Integer(1), "{replies:?}");
}

/// A multi-lock whose names live on two masters: when one master stops taking the
/// renewals (paused), the holder is told `lost` once that name may have expired, though
/// the other master keeps renewing its name.
#[tokio::test]
async fn a_multi_lock_is_lost_when_one_masters_name_cannot_be_renewed() {
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start_with(
        &cluster.url(),
        &["--watchdog-timeout", "3s", "--redis-timeout", "200ms"],
    )
    .await;
    let client = server.client().await;
    let names: Vec<String> = (0..24).map(|i| format!("pair/{i}")).collect();
    let first = names[0].clone();
    let other = names
        .iter()
        .find(|n| cluster.master_for_key(n) != cluster.master_for_key(&first))
        .expect("names on two masters")
        .clone();
    let lease = client.lock_all([first.clone(), other]).acquire().await.unwrap();
    let paused = cluster.node(cluster.master_for_key(&first));
    paused.cli(&["CLIENT", "PAUSE", "8000", "WRITE"]);
    // Told within the watchdog timeout, while the master is still paused (8 s).
    let reason = tokio::time::timeout(Duration::from_secs(5), lease.lost()).await;
    paused.cli(&["CLIENT", "UNPAUSE"]);
    assert_eq!(reason.expect("told in time"), latchkey_client::LostReason::NotHeld);
}

/// ForceRelease keeps its break floor in the lock's slot on every master. A holder on
/// a frozen server is broken, its owner takes the lock again through another server,
/// and when the frozen server wakes and ends the broken stream, the owner's new hold
/// stays.
#[tokio::test]
async fn a_broken_hold_gives_back_nothing_of_its_owners_next_hold_on_every_master() {
    let cluster = RedisCluster::start(3, 0);
    let a = Latchkey::start(&cluster.url()).await;
    let mut b = LatchkeyProcess::start(&cluster.url());
    let (client, frozen) = (a.client().await, b.serving_client().await);
    for name in ["svc/0", "svc/1", "svc/2", "svc/3", "svc/4", "svc/5"] {
        let first = frozen
            .lock(name)
            .owner("shared")
            .wait(T)
            .acquire()
            .await
            .expect("granted");
        b.freeze();
        let broken = bounded(T, "force release", client.force_release(name)).await;
        assert!(broken.expect("force release"), "{name}: broken");
        let second = client.lock(name).owner("shared").wait(T).acquire().await;
        let second = second.expect("taken again");
        b.resume();
        let reason = bounded(T, "the broken holder told when awake", first.lost()).await;
        // Whichever the woken server reads first: the notice, or a renewal that was due
        // while it was frozen and found the hold broken.
        assert!(
            matches!(reason, LostReason::ForceReleased | LostReason::NotHeld),
            "{name}: {reason:?}"
        );
        let state = bounded(T, "describe", client.describe(name)).await.expect("describe");
        let holds: Vec<(String, u32)> = state.holders.iter().map(|h| (h.owner.clone(), h.hold_count)).collect();
        assert_eq!(holds, [("shared".to_owned(), 1)], "{name}: the new hold stays");
        bounded(T, "release", second.release()).await.expect("released");
    }
}
