//! The mutex on a 3-master Redis Cluster started by the test: grants and handoffs
//! across slots and server replicas (sharded pub/sub, claims granted by the slot's
//! master), List over every master, batched script calls after a resharding, script
//! reloads beside a paused master, and a waiter's subscription after its slot moved or
//! its master failed over, also when either came straight back.

use fred::prelude::{Key, Value};
use latchkey_client::{LockKind, LostReason};
use latchkey_server::config::Config;
use latchkey_server::keys::Keys;
use latchkey_server::redis::Backend;
use latchkey_tests::redis_client;
use latchkey_tests::redisson::{random_owner, RedissonLock};
use latchkey_tests::server::{spawn_queued, Latchkey};
use latchkey_tests::{bounded, poll_until, LatchkeyProcess, RedisCluster};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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
        bounded(T, "the waiter", waiter)
            .await
            .unwrap()
            .expect("waiter on the other server acquires");
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
        let master = cluster.node(cluster.master_for_key(name));
        // A release hands over only once the server listens on the lock's channel.
        let channel = Keys::default().lock(name).channel();
        let listens = poll_until(T, || master.shard_subscribers(&channel) == 1).await;
        assert!(listens, "{name}: the waiter's subscription");
        holder.release().await.unwrap();
        let lease = bounded(T, "the waiter", waiter).await.unwrap().expect("handed over");
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
    let server = Latchkey::start_with(&cluster.url(), &["--watchdog-timeout", "1500ms"]).await;
    let client = server.client().await;
    let mut leases = Vec::new();
    for i in 0..30 {
        leases.push(client.lock(format!("renewed/{i}")).acquire().await.unwrap());
    }
    // A multi-lock across slots: each name renewed with its own token.
    let names = ["renewed/z", "renewed/c", "renewed/q", "renewed/a"];
    leases.push(client.lock_all(names).acquire().await.unwrap());
    tokio::time::sleep(Duration::from_secs(3)).await;
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
    let server = Latchkey::start_with(&cluster.url(), &["--watchdog-timeout", "1500ms"]).await;
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
        bounded(T, "the writer", writer)
            .await
            .unwrap()
            .expect("the writer acquires");
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
    tokio::time::sleep(Duration::from_millis(3500)).await;
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
    bounded(T, "the waiter", waiter)
        .await
        .unwrap()
        .expect("a permit came back");
}

#[tokio::test]
async fn a_batch_spans_the_slots_of_one_master() {
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

/// A master that stops answering costs no lease on the other masters: each master's
/// renewals run on their own. A round waited for every master's batch, and a failed
/// batch was retried one slot after another, each call waiting out the Redis timeout,
/// so one paused master held the next round back past the healthy masters' leases,
/// and every lease of the server was told `NOT_HELD` and released.
#[tokio::test]
async fn a_paused_master_costs_no_lease_on_the_other_masters() {
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start_with(
        &cluster.url(),
        &["--watchdog-timeout", "3s", "--redis-timeout", "500ms"],
    )
    .await;
    let client = server.client().await;
    let names: Vec<String> = (0..200).map(|i| format!("svc/{i}")).collect();
    let paused_port = cluster.master_for_key(&names[0]);
    let mut held = Vec::new();
    for name in names
        .iter()
        .filter(|n| cluster.master_for_key(n) == paused_port)
        .take(10)
    {
        held.push(client.lock(name.as_str()).acquire().await.unwrap());
    }
    let elsewhere = names
        .iter()
        .find(|n| cluster.master_for_key(n) != paused_port)
        .expect("a name on another master")
        .clone();
    let healthy = client.lock(elsewhere.as_str()).acquire().await.unwrap();
    let paused = cluster.node(paused_port);
    paused.cli(&["CLIENT", "PAUSE", "9000", "WRITE"]);
    // Two whole lease lengths.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let kept = !healthy.is_lost();
    paused.cli(&["CLIENT", "UNPAUSE"]);
    assert!(kept, "a lease on a healthy master is kept: {:?}", healthy.lost_reason());
    let err = client.lock(elsewhere.as_str()).try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "still held in Redis");
}

/// `count` names of `prefix` whose slot the master on `port` serves.
fn names_on(cluster: &RedisCluster, port: u16, prefix: &str, count: usize) -> Vec<String> {
    let ranges = cluster.slots_of(port);
    (0..10_000)
        .map(|i| format!("{prefix}/{i}"))
        .filter(|n| {
            let slot = slot_of(n);
            ranges.iter().any(|(lo, hi)| (*lo..=*hi).contains(&slot))
        })
        .take(count)
        .collect()
}

/// One try-once acquire of `name` and its release: `Ok` when granted within `limit`.
async fn try_once(client: &latchkey_client::Client, name: &str, limit: Duration) -> Result<(), String> {
    match tokio::time::timeout(limit, client.lock(name).try_once().acquire()).await {
        Ok(Ok(lease)) => {
            let _ = lease.release().await;
            Ok(())
        }
        Ok(Err(e)) => Err(format!("{name}: {:?} {e}", e.code())),
        Err(_) => Err(format!("{name}: no answer within {limit:?}")),
    }
}

/// Try-once acquires of `names` in turn, one after another, for `period`: the errors.
async fn failures_during(client: &latchkey_client::Client, names: &[String], period: Duration) -> Vec<String> {
    let until = Instant::now() + period;
    let mut failures = Vec::new();
    let mut i = 0;
    while Instant::now() < until {
        if let Err(e) = try_once(client, &names[i % names.len()], Duration::from_secs(2)).await {
            failures.push(e);
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    failures
}

/// A paused master (`CLIENT PAUSE WRITE`: a stuck fsync or fork, a failover's pause)
/// costs the other masters nothing even while one of them answers `NOSCRIPT` (its
/// scripts flushed, or a replica promoted: Redis 7 replicates no `SCRIPT LOAD`). The
/// script is loaded again on the node that lost it alone: a load sent to every primary
/// (fred's `script_load_cluster`, from the connection's one routing task, with no
/// timeout) waits for the paused master, and the connection writes nothing else
/// meanwhile, so names on the healthy masters would fail too.
#[tokio::test]
async fn a_script_reload_on_one_master_does_not_wait_for_a_paused_master() {
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start_with(
        &cluster.url(),
        &["--watchdog-timeout", "3s", "--redis-timeout", "500ms"],
    )
    .await;
    let client = server.client().await;
    let masters = cluster.master_ports();
    let (flushed_port, paused_port, healthy_port) = (masters[0], masters[1], masters[2]);
    let on_flushed = names_on(&cluster, flushed_port, "f", 8);
    let on_paused = names_on(&cluster, paused_port, "p", 9);
    let on_healthy = names_on(&cluster, healthy_port, "h", 8);
    let everywhere: Vec<String> = on_flushed
        .iter()
        .zip(&on_healthy)
        .flat_map(|(f, h)| [f.clone(), h.clone()])
        .collect();
    // Every name works to start with.
    for name in on_flushed.iter().chain(&on_paused).chain(&on_healthy) {
        try_once(&client, name, T).await.expect("granted before any fault");
    }
    // A lease on the master to be paused: its renewals go there every second.
    let _held = client.lock(on_paused[0].as_str()).acquire().await.unwrap();

    let paused = cluster.node(paused_port);
    paused.cli(&["CLIENT", "PAUSE", "12000", "WRITE"]);
    // Clients keep trying names on the paused master (each try times out there).
    let stop = Arc::new(AtomicBool::new(false));
    let mut background = Vec::new();
    for name in &on_paused[1..] {
        let (client, stop, name) = (client.clone(), stop.clone(), name.clone());
        background.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let _ = try_once(&client, &name, Duration::from_secs(3)).await;
            }
        }));
    }
    // The paused master alone costs the other masters nothing.
    let before = failures_during(&client, &everywhere, Duration::from_millis(2500)).await;
    // Then one master loses its scripts.
    let flush = cluster.node(flushed_port).cli(&["SCRIPT", "FLUSH"]);
    assert_eq!(flush.trim(), "OK");
    let after = failures_during(&client, &everywhere, Duration::from_millis(3500)).await;
    paused.cli(&["CLIENT", "UNPAUSE"]);
    stop.store(true, Ordering::Relaxed);
    for task in background {
        let _ = bounded(T, "background tries end", task).await;
    }
    assert!(
        before.is_empty(),
        "precondition: with one master paused, names on the others are granted: {before:?}"
    );
    assert!(
        after.is_empty(),
        "a script reload on {flushed_port} waited for the paused master {paused_port}: {} of the tries on the \
         healthy masters failed: {after:?}",
        after.len()
    );
}

/// A master that does not answer in time (paused past `--redis-timeout`) is asked
/// again by the next round, in its node-wide batch: a renewal call that timed out was
/// sent again as one call per slot of its leases, every one of which waited out the
/// timeout too and reached the master when it answered again (a call per lease here,
/// tens of thousands under many leases, each logged).
#[tokio::test]
async fn renewals_on_a_master_that_times_out_are_not_split_per_slot() {
    let args = ["--watchdog-timeout", "6s", "--redis-timeout", "300ms"];
    let (cluster, _server, port, held) = leases_on_one_master("r", &args).await;
    let paused = cluster.node(port);
    let before = paused.command_calls("evalsha");
    // Two renewal periods (2 s each) with every call timing out.
    paused.cli(&["CLIENT", "PAUSE", "4500", "WRITE"]);
    tokio::time::sleep(Duration::from_millis(4500)).await;
    paused.cli(&["CLIENT", "UNPAUSE"]);
    // The calls held up by the pause run once it ends; the next round's with them.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let calls = paused.command_calls("evalsha") - before;
    assert!(
        calls < 20,
        "{calls} renewal calls for {} leases in a pause of two periods",
        held.len()
    );
    for lease in held {
        let _ = lease.release().await;
    }
}

/// A cluster, a server started with `args`, and 60 leases it holds on names of
/// `prefix` that one master serves (its port).
async fn leases_on_one_master(
    prefix: &str,
    args: &[&str],
) -> (RedisCluster, Latchkey, u16, Vec<latchkey_client::Lease>) {
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start_with(&cluster.url(), args).await;
    let client = server.client().await;
    let port = cluster.master_ports()[0];
    let mut held = Vec::new();
    for name in names_on(&cluster, port, prefix, 60) {
        held.push(client.lock(name.as_str()).acquire().await.unwrap());
    }
    (cluster, server, port, held)
}

/// A master that refuses every write (`min-replicas-to-write` with no replica) refuses
/// its node-wide renewal batch as a whole, and each slot's call alike: the batch is
/// tried again as a whole by the next retry, not split into a call per slot, which
/// made a refused call (and a logged warning) per lease at every retry.
#[tokio::test]
async fn renewals_a_master_refuses_as_a_whole_are_not_split_per_slot() {
    // Rounds every 3 s; leases unrenewed are told lost 7.5 s after their last renewal.
    let args = ["--watchdog-timeout", "9s", "--redis-timeout", "500ms"];
    let (cluster, _server, port, held) = leases_on_one_master("refused", &args).await;
    let refusing = cluster.node(port);
    // Just after a round renewed the leases.
    let acquired = refusing.command_calls_sent("evalsha");
    let renewed = poll_until(T, || refusing.command_calls_sent("evalsha") > acquired).await;
    assert!(renewed, "a round renews the leases");
    let before = refusing.command_calls_sent("evalsha");
    refusing.cli(&["CONFIG", "SET", "min-replicas-to-write", "1"]);
    // The next round (3 s on) and its retries (every 750 ms).
    tokio::time::sleep(Duration::from_millis(5000)).await;
    refusing.cli(&["CONFIG", "SET", "min-replicas-to-write", "0"]);
    let calls = refusing.command_calls_sent("evalsha") - before;
    let lost = held.iter().filter(|lease| lease.is_lost()).count();
    assert_eq!(lost, 0, "leases told lost inside the window");
    assert!(calls >= 2, "{calls} renewal calls: the round and a retry were refused");
    assert!(
        calls < 12,
        "{calls} renewal calls for {} leases refused for two seconds",
        held.len()
    );
    for lease in held {
        let _ = lease.release().await;
    }
}

/// Two names of `prefix` on different masters: the first (`<prefix>/0`, which sorts
/// first) on the master to be paused, its port, and one on another master.
fn names_on_two_masters(cluster: &RedisCluster, prefix: &str) -> (String, u16, String) {
    let first = format!("{prefix}/0");
    let port = cluster.master_for_key(&first);
    let elsewhere = (1..200)
        .map(|i| format!("{prefix}/{i}"))
        .find(|n| cluster.master_for_key(n) != port)
        .expect("a name on another master");
    (first, port, elsewhere)
}

/// Renewals that failed on one master are tried again there alone: the other masters'
/// leases were renewed in the same round and wait for the next. Every retry renewed
/// every lease of the server again, each healthy master's too.
#[tokio::test]
async fn a_failed_masters_retries_renew_no_lease_of_the_others() {
    let cluster = RedisCluster::start(3, 0);
    // Rounds every 6 s; a failed master is tried again every 1.5 s or so (a 500 ms
    // timeout, a 500 ms call per slot, then the 1 s pause).
    let args = ["--watchdog-timeout", "18s", "--redis-timeout", "500ms"];
    let server = Latchkey::start_with(&cluster.url(), &args).await;
    let client = server.client().await;
    let (on_paused, paused_port, elsewhere) = names_on_two_masters(&cluster, "svc");
    let healthy = cluster.node(cluster.master_for_key(&elsewhere));
    let _paused_lease = client.lock(on_paused.as_str()).acquire().await.unwrap();
    let _healthy_lease = client.lock(elsewhere.as_str()).acquire().await.unwrap();
    let paused = cluster.node(paused_port);
    paused.cli(&["CLIENT", "PAUSE", "20000", "WRITE"]);
    // The next round renews the healthy master's lease (one call); its retries of the
    // paused master follow.
    let before = healthy.evalsha_calls();
    let renewed = poll_until(Duration::from_secs(10), || healthy.evalsha_calls() > before).await;
    assert!(renewed, "a round renews the healthy master's lease");
    let after_round = healthy.evalsha_calls();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let during_retries = healthy.evalsha_calls() - after_round;
    paused.cli(&["CLIENT", "UNPAUSE"]);
    assert_eq!(
        during_retries, 0,
        "the paused master's retries renewed the healthy master's leases"
    );
}

/// A multi-lock's release gives back every slot's names whatever another slot's master
/// answers: it stopped at the first group that failed, and the names on the healthy
/// masters stayed held by nobody until their lease ran out.
#[tokio::test]
async fn a_multi_lock_release_frees_the_names_of_the_masters_that_answer() {
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start_with(&cluster.url(), &["--redis-timeout", "500ms"]).await;
    let client = server.client().await;
    // Taken in name order: the name on the master to be paused comes first.
    let (on_paused, paused_port, healthy) = names_on_two_masters(&cluster, "multi");
    let lease = client.lock_all([on_paused, healthy.clone()]).acquire().await.unwrap();
    let paused = cluster.node(paused_port);
    paused.cli(&["CLIENT", "PAUSE", "6000", "WRITE"]);
    let release = tokio::spawn(lease.release());
    let healthy_master = cluster.node(cluster.master_for_key(&healthy));
    let freed = poll_until(Duration::from_secs(3), || {
        healthy_master.cli(&["EXISTS", healthy.as_str()]).trim() == "0"
    })
    .await;
    paused.cli(&["CLIENT", "UNPAUSE"]);
    assert!(freed, "the name on the master that answers is given back");
    let _ = release.await;
}

/// The force-release channel is subscribed again when the master that carried its
/// subscription leaves the slot map (a scale-in): the Redis client drops its connection
/// there with no reconnect, and the subscription went with it, silently. Holders then
/// heard of a ForceRelease only at their next renewal, while woken waiters could take
/// the lock.
#[tokio::test]
async fn force_notices_are_heard_after_their_master_is_emptied() {
    let cluster = RedisCluster::start(3, 0);
    let (_holding, carrier, to, name, lease) = held_beside_the_force_subscription(&cluster).await;
    cluster.empty_master(carrier, to);
    // At the hub's next check of the slot map (every 2 s).
    subscribed_again_elsewhere(&cluster, carrier).await;
    assert_broken_elsewhere_is_heard(&cluster, &name, &lease).await;
}

/// As above, with the master emptied a step at a time, as a reshard drains it: the
/// slot that placed the subscription moves first, its master leaves the slot map later.
/// The server looked for the master of that slot as it last saw it (the new one), never
/// subscribed again, and its holders heard a break made elsewhere only at their next
/// renewal.
#[tokio::test]
async fn force_notices_are_heard_after_their_master_is_drained_step_by_step() {
    let cluster = RedisCluster::start(3, 0);
    let (_holding, carrier, to, name, lease) = held_beside_the_force_subscription(&cluster).await;
    // Every slot but the last first, then the last one, each past a check of the slot
    // map (every 2 s).
    let mut ranges = cluster.slots_of(carrier);
    let (lo, hi) = ranges.pop().expect("the carrier has slots");
    if lo < hi {
        ranges.push((lo, hi - 1));
    }
    cluster.move_slots(carrier, to, &ranges);
    tokio::time::sleep(Duration::from_millis(3000)).await;
    cluster.move_slots(carrier, to, &[(hi, hi)]);
    subscribed_again_elsewhere(&cluster, carrier).await;
    assert_broken_elsewhere_is_heard(&cluster, &name, &lease).await;
}

/// The subscribers of the force-release channel on the node at `port`.
fn force_subscribers(cluster: &RedisCluster, port: u16) -> u32 {
    let channel = Keys::default().force_release_channel();
    cluster.node(port).subscribers(&channel)
}

/// Waits (bounded) until the force-release channel is subscribed on a master other
/// than `carrier`, which left the slot map.
async fn subscribed_again_elsewhere(cluster: &RedisCluster, carrier: u16) {
    let masters: Vec<u16> = cluster.master_ports().into_iter().filter(|p| *p != carrier).collect();
    let moved = poll_until(T, || masters.iter().any(|p| force_subscribers(cluster, *p) == 1)).await;
    assert!(
        moved,
        "the force channel is subscribed again on a master in the slot map"
    );
}

/// Starts a server, finds the master carrying its force-release subscription, another
/// master, and takes a lock there: (the server, carrier, other, name, lease).
async fn held_beside_the_force_subscription(
    cluster: &RedisCluster,
) -> (Latchkey, u16, u16, String, latchkey_client::Lease) {
    let holding = Latchkey::start(&cluster.url()).await;
    let masters = cluster.master_ports();
    let mut carrier = None;
    assert!(
        poll_until(T, || {
            carrier = masters.iter().copied().find(|p| force_subscribers(cluster, *p) == 1);
            carrier.is_some()
        })
        .await,
        "the force channel is subscribed on a master"
    );
    let carrier = carrier.unwrap();
    let to = *masters.iter().find(|p| **p != carrier).unwrap();
    let name = cluster.name_on(to, |i| format!("held/{i}"));
    let lease = holding.client().await.lock(name.as_str()).acquire().await.unwrap();
    (holding, carrier, to, name, lease)
}

/// Another server breaks `name`: only the notice tells the holding server, whose
/// holder hears it at once, not at its next renewal.
async fn assert_broken_elsewhere_is_heard(cluster: &RedisCluster, name: &str, lease: &latchkey_client::Lease) {
    let breaking = Latchkey::start(&cluster.url()).await;
    assert!(breaking.client().await.force_release(name).await.unwrap());
    let reason = tokio::time::timeout(Duration::from_secs(2), lease.lost()).await;
    assert_eq!(
        reason.expect("told at once, not at the next renewal"),
        LostReason::ForceReleased
    );
}

/// A waiter whose subscription has not been made when it tries (the hub is held up
/// unsubscribing on a master that does not answer) leaves no claim and looks again every
/// second until it listens. It left a claim it could not hear, and slept until its
/// recheck, the holder's whole lease: a release meanwhile reached nobody.
#[tokio::test]
async fn a_waiter_whose_subscription_is_late_hears_a_release_all_the_same() {
    let cluster = RedisCluster::start(3, 0);
    let s1 = Latchkey::start_with(&cluster.url(), &["--redis-timeout", "5s", "--watchdog-timeout", "20s"]).await;
    let s2 = Latchkey::start(&cluster.url()).await;
    let (c1, c2) = (s1.client().await, s2.client().await);
    let names: Vec<String> = (0..100).map(|i| format!("late/{i}")).collect();
    let a = names[0].clone();
    let m1 = cluster.master_for_key(&a);
    let b = names
        .iter()
        .find(|n| cluster.master_for_key(n) != m1)
        .expect("a name on another master")
        .clone();
    let _ha = c2.lock(a.as_str()).acquire().await.unwrap();
    let hb = c2.lock(b.as_str()).acquire().await.unwrap();
    let (wa, _) = spawn_queued(c1.lock(a.as_str()).wait(T), T).await;
    let frozen = cluster.node(m1);
    frozen.freeze();
    // Its waiter gone, `a`'s channel is unsubscribed on the frozen master: the hub waits.
    wa.abort();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (wb, _) = spawn_queued(c1.lock(b.as_str()).wait(Duration::from_secs(15)), T).await;
    // Past its wait for the subscription, and its try after it.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let released = Instant::now();
    hb.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    frozen.resume();
    let lease = tokio::time::timeout(T, wb)
        .await
        .expect("answered in time")
        .unwrap()
        .expect("granted");
    let took = released.elapsed();
    assert!(took < Duration::from_millis(2500), "granted {took:?} after the release");
    drop(lease);
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

/// After a resharding, a call for the moved slot that shares a round with calls of the
/// old master's other slots is sent there in their batch (the server's slot map is
/// stale). The master does not run it (its keys are not local), and the call goes alone,
/// so fred follows MOVED to the new master and refreshes its map.
#[tokio::test]
async fn a_batched_call_for_a_moved_slot_is_redirected() {
    let s = Resharded::start(6, 4);
    let backend = backend(&s.cluster.url()).await;
    s.move_slot();
    let moved = s.cluster.node(s.from).cli(&["GET", &s.moving[0]]);
    assert!(moved.contains("MOVED"), "the slot moved: {moved}");

    // Four lone calls (staying names), then the round: staying, moving, staying, ...
    let mut order: Vec<String> = s.staying[..4].to_vec();
    for (stay, mov) in s.staying[4..].iter().zip(&s.moving) {
        order.push(stay.clone());
        order.push(mov.clone());
    }
    order.extend(s.moving[2..].iter().cloned());
    let old_master = s.cluster.node(s.from);
    old_master.cli(&["CONFIG", "RESETSTAT"]);
    let failed = failures(&burst(&backend, &order).await);
    assert!(failed.is_empty(), "every acquire is granted:\n{}", failed.join("\n"));
    // The staying names' calls shared script calls on the old master: the round was
    // batched there. (The moved names' lone calls, answered MOVED there, did not run.)
    let scripts_run = old_master.command_calls("evalsha");
    assert!(
        scripts_run < s.staying.len(),
        "{scripts_run} script calls for {} names",
        s.staying.len()
    );
}

/// The other order: the round's first call is for the moved slot. fred follows the
/// batch's MOVED and sends the whole batch to the slot's new master, which runs that call
/// only; the others (slots that did not move) go alone, back to the old master.
#[tokio::test]
async fn a_batch_redirected_by_its_first_call_serves_its_other_calls() {
    let s = Resharded::start(8, 1);
    let backend = backend(&s.cluster.url()).await;
    s.move_slot();

    let mut order: Vec<String> = s.staying[..4].to_vec();
    order.push(s.moving[0].clone());
    order.extend(s.staying[4..].iter().cloned());
    let failed = failures(&burst(&backend, &order).await);
    assert!(failed.is_empty(), "every acquire is granted:\n{}", failed.join("\n"));
}

/// End to end: clients of a server acquire and release names on one master in bursts
/// right after a slot of that master moved. No name is contended; every cycle succeeds.
#[tokio::test]
async fn a_burst_right_after_a_resharding_is_served() {
    let s = Resharded::start(24, 24);
    let server = Latchkey::start(&s.cluster.url()).await;
    let client = server.client().await;
    // The server's connections have their map (a cycle on a staying name).
    let lease = bounded(T, "acquire", client.lock(s.staying[0].as_str()).acquire()).await;
    bounded(T, "release", lease.expect("granted").release())
        .await
        .expect("released");
    s.move_slot();

    let mut order = Vec::new();
    for (stay, mov) in s.staying.iter().zip(&s.moving) {
        order.push(stay.clone());
        order.push(mov.clone());
    }
    for round in 0..3 {
        let cycles = order.iter().cloned().map(|name| {
            let client = client.clone();
            async move {
                let result = tokio::time::timeout(T, async {
                    let lease = client.lock(name.as_str()).wait(T).acquire().await?;
                    lease.release().await
                })
                .await;
                (name, result)
            }
        });
        let failed: Vec<String> = futures::future::join_all(cycles)
            .await
            .into_iter()
            .filter_map(|(name, result)| match result {
                Ok(Ok(_)) => None,
                Ok(Err(e)) => Some(format!("{name}: {e}")),
                Err(_) => Some(format!("{name}: no answer within {T:?}")),
            })
            .collect();
        assert!(
            failed.is_empty(),
            "burst {round}: every cycle succeeds:\n{}",
            failed.join("\n")
        );
    }
}

/// While a slot is being migrated, a batched call whose keys the old master holds only
/// some of is refused before any of its commands, as Redis refuses such a call sent
/// alone: run, `fair_leave` would have taken the waiter's deadline and then failed on
/// the queue, which has moved.
#[tokio::test]
async fn a_batched_call_for_a_slot_being_migrated_writes_nothing() {
    use latchkey_server::redis::{batch_layout, BatchedCall};
    use latchkey_server::scripts::Scripts;
    let s = Resharded::start(1, 1);
    let client = bounded(T, "connect", latchkey_tests::redis_client(&s.cluster.url())).await;
    let leaving = Keys::default().lock(&s.moving[0]);
    let old_master = s.cluster.node(s.from);
    old_master.cli(&["ZADD", &leaving.timeouts(), "1", "waiter"]);
    old_master.cli(&["RPUSH", &leaving.queue(), "waiter"]);
    s.start_migrating();
    let to = s.to.to_string();
    let migrated = old_master.cli(&["MIGRATE", "127.0.0.1", &to, &leaving.queue(), "0", "5000"]);
    assert_eq!(migrated.trim(), "OK", "{migrated}");

    // The batch goes to the old master, routed by its first call (a name that stays).
    let staying = Keys::default().lock(&s.staying[0]);
    let acquire_keys: Vec<Key> = latchkey_server::lock::mutex_acquire_keys(&staying, "h0")
        .into_iter()
        .map(Key::from)
        .collect();
    let acquire_args = [
        Value::from(30_000),
        Value::from("owner"),
        Value::from(5_000),
        Value::from(""),
    ];
    let leave_keys = [
        leaving.lock.clone(),
        leaving.channel(),
        leaving.queue(),
        leaving.timeouts(),
    ]
    .map(Key::from);
    let leave_args = [Value::from("waiter"), Value::from("spublish"), Value::from(5_000)];
    let calls: [BatchedCall<'_>; 2] = [
        ("mutex_acquire", &acquire_keys, &acquire_args),
        ("fair_leave", &leave_keys, &leave_args),
    ];
    let (keys, args) = batch_layout(&calls).expect("strings and numbers pack");
    let batch = Scripts::new(true).batch;
    let replies: Vec<Value> = bounded(T, "the batch", batch.eval(&client, keys, args))
        .await
        .expect("the batch runs on the old master");
    assert_eq!(replies.len(), 4, "{replies:?}");
    assert_eq!(replies[0], Value::Integer(1), "the other call ran: {replies:?}");
    assert_eq!(replies[2], Value::Integer(2), "the call did not run: {replies:?}");
    let deadline = old_master.cli(&["ZSCORE", &leaving.timeouts(), "waiter"]);
    assert_eq!(deadline.trim(), "1", "the waiter's deadline stays");
}

/// While a lock's slot is being migrated, its keys move in batches: here the lock and its
/// fencing counter first, the hold record later. A renewal routed by the moved keys is
/// answered `ASK`; run on the new master, where the record is not yet, it would tell the
/// holder `lost{NOT_HELD}` for a lock it holds. The server does not follow `ASK` (its
/// calls are written once), so the renewal fails and is tried again, and once the slot
/// has moved it renews there: the holder keeps its lease through the move.
#[tokio::test]
async fn a_renewal_during_a_slot_migration_tells_no_holder_lost() {
    let r = Resharded::start(0, 1);
    // A renewal round every 3 s.
    let server = Latchkey::start_with(&r.cluster.url(), &["--watchdog-timeout", "9s"]).await;
    let name = r.moving[0].as_str();
    let lease = bounded(T, "acquire", server.client().await.lock(name).acquire())
        .await
        .expect("granted");
    let k = Keys::default().lock(name);
    r.start_migrating();
    let to = r.to.to_string();
    let old = r.cluster.node(r.from);
    let fence = k.fence();
    let moved = old.cli(&["MIGRATE", "127.0.0.1", &to, "", "0", "5000", "KEYS", &k.lock, &fence]);
    assert_eq!(moved.trim(), "OK", "{moved}");
    // A round with the keys split between the masters (less than the 6 s after which a
    // lease Redis has not confirmed counts as lost: its lock would expire unrenewed).
    let lost = tokio::time::timeout(Duration::from_millis(3_500), lease.lost()).await;
    assert!(lost.is_err(), "told {lost:?} while its lock is held");
    r.move_slot();
    let lost = tokio::time::timeout(Duration::from_secs(4), lease.lost()).await;
    assert!(lost.is_err(), "told {lost:?} after the move");
    bounded(T, "release", lease.release())
        .await
        .expect("released, not lost");
}

/// A waiter on one server waits for a lock held through another; the lock's slot moves
/// to another master with its keys, and the holder releases. The old master drops the
/// waiter's sharded subscription when the slot leaves it (a pushed `sunsubscribe` that
/// fred discards), and the release publishes on the new master: the waiter's server,
/// which sends no command for that slot, finds the move on its own, subscribes the
/// channel on the new master and wakes its waiter, which is granted within seconds
/// (not at its recheck, the holder's TTL).
#[tokio::test]
async fn a_waiter_hears_a_release_after_its_locks_slot_moved() {
    waiter_hears_a_release_after_a_move(false).await;
}

/// As above, but the waiter's server learns of the move through its subscriber first:
/// a Watch of another name of the slot subscribes there, its `SSUBSCRIBE` is answered
/// `MOVED`, and fred re-reads the subscriber's slot map itself. The hub's next check of
/// the map then found nothing moved (it compared the map after its re-read with the one
/// fred already had), and the waiter's channel, dropped by the old master, was never
/// subscribed on the new one: the release reached nobody, and the waiter waited for
/// its recheck (the holder's TTL).
#[tokio::test]
async fn a_waiter_hears_a_release_after_its_subscriber_learned_of_the_move_first() {
    waiter_hears_a_release_after_a_move(true).await;
}

/// The steps of the two tests above; with `learned_first`, a Watch of another name of
/// the moved slot makes the waiter's server learn of the move through its subscriber.
async fn waiter_hears_a_release_after_a_move(learned_first: bool) {
    let r = Resharded::start(0, if learned_first { 2 } else { 1 });
    let name = r.moving[0].as_str();
    let channel = latchkey_tests::redisson::lock_channel(name);
    let a = Latchkey::start(&r.cluster.url()).await;
    let b = Latchkey::start(&r.cluster.url()).await;
    let holder = bounded(T, "acquire", a.client().await.lock(name).acquire())
        .await
        .expect("granted");
    let client_b = b.client().await;
    let (waiting, _) = spawn_queued(client_b.lock(name).wait(Duration::from_secs(60)), T).await;
    let subscribers = |port: u16| r.cluster.node(port).shard_subscribers(&channel);
    assert!(
        poll_until(T, || subscribers(r.from) == 1).await,
        "subscribed on the old master"
    );
    r.move_slot();
    if !learned_first {
        assert_eq!(r.cluster.master_for_key(name), r.to, "the slot moved");
    }
    if learned_first {
        let mut watch = bounded(T, "watch", client_b.watch(r.moving[1].as_str()))
            .await
            .expect("watching");
        bounded(T, "the first state", watch.next())
            .await
            .expect("no error")
            .expect("a state");
        // Past the hub's next check of the slot map (every 2 s).
        tokio::time::sleep(Duration::from_millis(2500)).await;
    }
    let released_at = Instant::now();
    bounded(T, "release", holder.release()).await.expect("released");
    let granted = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .unwrap_or_else(|_| panic!("not granted within 5 s of the release ({:?})", released_at.elapsed()));
    granted.expect("task").expect("granted").release().await.unwrap();
    if !learned_first {
        // Unsubscribed in the background once the last waiter left.
        let left = poll_until(T, || subscribers(r.to) == 0).await;
        assert!(left, "still subscribed after the channel's last waiter left");
    }
}

/// A lock's slot moves to another master and straight back (a resharding step undone,
/// a rebalance that changed its mind), quicker than the hub's 2 s checks of the slot
/// map, while a waiter on one server waits for a holder on another. Each master drops
/// the sharded subscriptions of a slot that leaves it, so the waiter's channel is
/// subscribed nowhere once the slot is back, though the slot's owner is the same as at
/// the hub's last check: the waiter's server must subscribe it again all the same, and
/// the holder's release wakes the waiter within seconds, not at its recheck (the
/// holder's TTL) or the hub's 30 s re-sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_waiter_hears_a_release_after_its_slot_moved_away_and_back() {
    let r = Resharded::start(0, 3);
    let a = Latchkey::start(&r.cluster.url()).await;
    let b = Latchkey::start(&r.cluster.url()).await;
    let ca = a.client().await;
    let cb = b.client().await;
    let mut failures = Vec::new();
    for (round, name) in r.moving.iter().enumerate() {
        let channel = latchkey_tests::redisson::lock_channel(name);
        let holder = bounded(T, "holder", ca.lock(name.as_str()).acquire()).await.unwrap();
        let (waiting, _) = spawn_queued(cb.lock(name.as_str()).wait(Duration::from_secs(60)), T).await;
        assert!(
            poll_until(T, || shard_subscribers(&r.cluster, r.from, &channel) == 1).await,
            "subscribed on its master"
        );
        let moved = Instant::now();
        tokio::task::block_in_place(|| {
            r.move_slot();
            r.move_slot_back();
        });
        let took = moved.elapsed();
        assert_eq!(r.cluster.master_for_key(name), r.from, "back home");
        // Past the hub's next check of the slot map.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        bounded(T, "release", holder.release()).await.expect("released");
        match tokio::time::timeout(Duration::from_secs(5), waiting).await {
            Ok(granted) => granted.expect("task").expect("granted").release().await.unwrap(),
            Err(_) => failures.push(format!(
                "round {round}: not granted within 5 s of the release (slot away and back in {took:?}; \
                 subscribers: home {}, away {})",
                shard_subscribers(&r.cluster, r.from, &channel),
                shard_subscribers(&r.cluster, r.to, &channel)
            )),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Waiters of several kinds on names of one slot wait on one server for holders on
/// another; the slot moves (keys and all) to another master. After the move the waiters
/// hear the releases, and once they all left (given up, or granted) no lock channel is
/// left subscribed anywhere: the subscriptions made on the new master, and those the
/// old one dropped, are all accounted for.
#[tokio::test]
async fn cluster_waiters_across_a_slot_move_leave_no_subscription() {
    let r = Resharded::start(0, 6);
    let a = Latchkey::start(&r.cluster.url()).await;
    let b = Latchkey::start(&r.cluster.url()).await;
    let ca = a.client().await;
    let cb = b.client().await;
    let lock = |client: &latchkey_client::Client, name: &str, kind: LockKind| {
        let lock = client.lock(name).kind(kind).wait(Duration::from_secs(60));
        if kind == LockKind::Semaphore {
            lock.limit(1)
        } else {
            lock
        }
    };
    let kinds = [LockKind::Mutex, LockKind::Fair, LockKind::Semaphore];
    let mut holders = Vec::new();
    let mut waiters = Vec::new();
    for (i, name) in r.moving.iter().enumerate() {
        let kind = kinds[i % kinds.len()];
        holders.push(
            bounded(T, "holder", lock(&ca, name, kind).acquire())
                .await
                .expect("granted"),
        );
        for _ in 0..2 {
            waiters.push(spawn_queued(lock(&cb, name, kind), T).await.0);
        }
    }
    assert!(
        poll_until(T, || !lock_channels_on(&r.cluster, r.from).is_empty()).await,
        "subscribed on the old master"
    );
    r.move_slot();
    // Past the hub's next check of the slot map.
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Half the waiters give up; the holders release: the rest are granted in turn.
    let mut rest = Vec::new();
    for (i, w) in waiters.into_iter().enumerate() {
        if i % 2 == 0 {
            w.abort();
        } else {
            rest.push(w);
        }
    }
    let released = Instant::now();
    for h in holders {
        bounded(T, "release", h.release()).await.expect("released");
    }
    for w in rest {
        let lease = tokio::time::timeout(Duration::from_secs(6), w)
            .await
            .unwrap_or_else(|_| panic!("a waiter not granted within 6 s ({:?})", released.elapsed()))
            .expect("task")
            .expect("granted");
        lease.release().await.expect("released");
    }
    assert!(
        poll_until(T, || cluster_lock_channels(&r.cluster).is_empty()).await,
        "left: {:?}",
        cluster_lock_channels(&r.cluster)
    );
}

/// Subscribers of `channel` (sharded) on the node on `port`.
fn shard_subscribers(cluster: &RedisCluster, port: u16, channel: &str) -> u32 {
    cluster.node(port).shard_subscribers(channel)
}

/// The lock channels (plain and sharded) subscribed on the node on `port`, the
/// force-release channel left out.
fn lock_channels_on(cluster: &RedisCluster, port: u16) -> Vec<String> {
    let node = cluster.node(port);
    ["CHANNELS", "SHARDCHANNELS"]
        .into_iter()
        .flat_map(|cmd| {
            node.cli(&["PUBSUB", cmd])
                .lines()
                .map(str::trim)
                .filter(|c| !c.is_empty() && !c.contains("latchkey:force_release"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The lock channels subscribed on every node of `cluster`.
fn cluster_lock_channels(cluster: &RedisCluster) -> Vec<String> {
    cluster
        .ports()
        .into_iter()
        .flat_map(|port| lock_channels_on(cluster, port))
        .collect()
}

/// An idle server on a cluster leaves it alone but for its health checks and the
/// subscriber's slot-map check every 2 s. A re-sync of the slot map announces a change
/// itself (fred sends `Rebalance` when nothing changed): the subscriber's re-syncs once
/// triggered one another for good, each opening a connection for `CLUSTER SLOTS`
/// (thousands a second).
#[tokio::test]
async fn an_idle_server_leaves_the_cluster_alone() {
    let cluster = RedisCluster::start(3, 0);
    let _server = Latchkey::start(&cluster.url()).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let slots_calls = || -> usize {
        cluster
            .ports()
            .iter()
            .map(|p| cluster.node(*p).command_calls("cluster|slots"))
            .sum()
    };
    let before = slots_calls();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let calls = slots_calls() - before;
    assert!(calls <= 6, "an idle server ran CLUSTER SLOTS {calls} times in 5 s");
}

/// A cluster, names `moving` (one hash tag, so one slot) whose slot is about to move from
/// master `from` to master `to`, and names of other slots on `from` (which stay).
struct Resharded {
    cluster: RedisCluster,
    moving: Vec<String>,
    staying: Vec<String>,
    from: u16,
    to: u16,
}

impl Resharded {
    fn start(staying: usize, moving: usize) -> Self {
        Self::with_replicas(staying, moving, 0)
    }

    /// As [`Resharded::start`], with `replicas` replicas per master.
    fn with_replicas(staying: usize, moving: usize, replicas: usize) -> Self {
        let cluster = RedisCluster::start(3, replicas);
        let moving: Vec<String> = (0..moving).map(|i| format!("{{moved}}/{i}")).collect();
        let from = cluster.master_for_key(&moving[0]);
        let to = *cluster
            .master_ports()
            .iter()
            .find(|p| **p != from)
            .expect("another master");
        let moved_slot = slot_of(&moving[0]);
        let staying = (0..)
            .map(|i| format!("stay/{i}"))
            .filter(|n| slot_of(n) != moved_slot && cluster.master_for_key(n) == from)
            .take(staying)
            .collect();
        Self {
            cluster,
            moving,
            staying,
            from,
            to,
        }
    }

    /// Moves the slot of the moving names from `from` to `to` with its keys, as a
    /// resharding does (IMPORTING, MIGRATING, MIGRATE of every key, then NODE on every
    /// master).
    fn move_slot(&self) {
        self.move_slot_between(self.from, self.to);
    }

    /// Moves the slot of the moving names back from `to` to `from`, as
    /// [`Resharded::move_slot`] moved it there.
    fn move_slot_back(&self) {
        self.move_slot_between(self.to, self.from);
    }

    /// Moves the slot of the moving names from the master on `from` to the master on
    /// `to` with its keys.
    fn move_slot_between(&self, from: u16, to: u16) {
        self.cluster.move_slot_with_keys(slot_of(&self.moving[0]), from, to);
    }

    /// Starts moving the slot of the moving names: IMPORTING on `to`, MIGRATING on `from`.
    fn start_migrating(&self) {
        self.cluster
            .start_migrating(slot_of(&self.moving[0]), self.from, self.to);
    }

    /// `CLUSTER SETSLOT <the moving names' slot> <state…>` on the node on `port`.
    fn set_slot(&self, port: u16, state: &[&str]) {
        self.cluster.set_slot(port, slot_of(&self.moving[0]), state);
    }
}

fn slot_of(key: &str) -> u16 {
    fred::util::redis_keyslot(key.as_bytes())
}

/// A server's Redis backend on `url`, once it answers, with its scripts loaded (so each
/// call is one EVALSHA).
async fn backend(url: &str) -> Backend {
    let config = Config::from_args(["--listen", "127.0.0.1:0", "--no-metrics", "--redis-url", url]).expect("flags");
    let backend = Backend::connect(&config).expect("backend");
    let connected = async {
        while backend.ping().await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    bounded(T, "the backend connects", connected).await;
    bounded(T, "load the scripts", backend.load_scripts())
        .await
        .expect("scripts loaded");
    backend
}

/// `mutex_acquire` of `name` by a stream of its own, through the server's batched path
/// (`Backend::eval`): the reply, or the error.
async fn acquire(backend: &Backend, name: &str, hold: &str) -> Result<Vec<i64>, String> {
    let k = Keys::default().lock(name);
    let keys: Vec<Key> = latchkey_server::lock::mutex_acquire_keys(&k, hold)
        .into_iter()
        .map(Key::from)
        .collect();
    let args = vec![
        Value::from(30_000),
        Value::from(format!("owner-{hold}")),
        Value::from(5_000),
        Value::from(""),
    ];
    tokio::time::timeout(
        T,
        backend.eval::<Vec<i64>>(&backend.scripts().mutex_acquire, keys, args),
    )
    .await
    .map_err(|_| format!("no answer within {T:?}"))?
    .map_err(|e| format!("{e:?}"))
}

/// Runs `names` as one burst: the first four go alone (fewer than four others in
/// flight), the rest share one round, in this order. Returns each name's result.
async fn burst(backend: &Backend, names: &[String]) -> Vec<(String, Result<Vec<i64>, String>)> {
    let calls = names
        .iter()
        .enumerate()
        .map(|(i, name)| async move { (name.clone(), acquire(backend, name, &format!("h{i}")).await) });
    futures::future::join_all(calls).await
}

/// The names of `results` that were not granted, with what they got.
fn failures(results: &[(String, Result<Vec<i64>, String>)]) -> Vec<String> {
    results
        .iter()
        .filter_map(|(name, r)| match r {
            Ok(reply) if reply.first() == Some(&1) => None,
            other => Some(format!("{name}: {other:?}")),
        })
        .collect()
}

/// A cluster URL whose one seed node is down (here a replica; the cluster is healthy)
/// leaves the server serving: it reads the slot map again from the nodes it last
/// knew. It asked the URL's seed alone, without end: its subscriber stalled (health
/// NOT_SERVING within seconds, new waiters never subscribed), and so would the others
/// at their next slot move.
#[tokio::test]
async fn a_cluster_whose_url_seed_is_down_keeps_serving() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let mut cluster = RedisCluster::start(3, 1);
    let seed = cluster.replica_ports()[0];
    let server = Latchkey::start(&format!("redis-cluster://127.0.0.1:{seed}")).await;
    server.wait_health(ServingStatus::Serving, T).await;
    let client = server.client().await;
    cluster.kill_node(seed);
    // The hub reads the slot map again every 2 s: past two of its reads.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(server.health().await, Some(ServingStatus::Serving));
    let holder = client.lock("seedless").acquire().await.expect("granted");
    let (waiter, _) = spawn_queued(client.lock("seedless").wait(T), T).await;
    let released = Instant::now();
    holder.release().await.expect("released");
    let lease = bounded(T, "the waiter", waiter).await.unwrap().expect("granted");
    assert!(
        released.elapsed() < Duration::from_secs(2),
        "the waiter was granted {:?} after the release",
        released.elapsed()
    );
    lease.release().await.expect("released");
}

/// Health is NOT_SERVING while the cluster is down (a slot served by nobody): every
/// script with a key then answers `CLUSTERDOWN`, but Redis answers the health check's
/// keyless commands all the same, and readiness stayed green while nothing could be
/// granted.
#[tokio::test]
async fn health_is_not_serving_while_the_cluster_is_down() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start(&cluster.url()).await;
    let master = cluster.master_ports()[0];
    let node = cluster.node(master);
    // One slot served by nobody: the cluster is down.
    let slot = cluster_slot_of(node);
    assert_eq!(node.cli(&["CLUSTER", "DELSLOTS", &slot.to_string()]).trim(), "OK");
    server.wait_health(ServingStatus::NotServing, T).await;
    assert_eq!(node.cli(&["CLUSTER", "ADDSLOTS", &slot.to_string()]).trim(), "OK");
    server.wait_health(ServingStatus::Serving, T).await;
}

/// Health turns NOT_SERVING while a master is down, and List answers: a probe that
/// failed read the slot map again, and that read waited, unbounded, behind the Redis
/// client's reconnection to the dead master, so health stayed SERVING (and List hung)
/// for as long as the master was away. Bounded, each round's reads (and each List's)
/// stayed queued behind that reconnection, and all ran once the master was back: they
/// are not asked of a client reconnecting.
#[tokio::test]
async fn health_is_not_serving_while_a_master_is_dead() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let mut cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start_with(&cluster.url(), &["--redis-timeout", "500ms"]).await;
    let client = server.client().await;
    server.wait_health(ServingStatus::Serving, T).await;
    let master = cluster.master_ports()[0];
    cluster.kill_node(master);
    server.wait_health(ServingStatus::NotServing, T).await;
    for _ in 0..30 {
        let listed = tokio::time::timeout(T, client.list("", 0, "")).await;
        let answered = listed.expect("List answers while a master is dead");
        assert_eq!(answered.map(drop).map_err(|e| e.code()), Err(tonic::Code::Unavailable));
    }
    // Health rounds (one a second) while the master is away.
    tokio::time::sleep(Duration::from_secs(4)).await;
    // Every live node's (the master's counted from its restart).
    let slot_reads = |cluster: &RedisCluster, master_up: bool| -> usize {
        let live = cluster.ports().into_iter().filter(|p| *p != master || master_up);
        live.map(|p| cluster.node(p).command_calls("cluster|slots")).sum()
    };
    let before = slot_reads(&cluster, false);
    cluster.restart_node(master);
    cluster.wait_settled("the master back");
    server.wait_health(ServingStatus::Serving, T).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let reads = slot_reads(&cluster, true) - before;
    // The clients' own as they reconnect and follow the cluster settling (about 40
    // here), not one more for each List and health round meanwhile (200 before).
    assert!(reads <= 70, "{reads} slot map reads as the master came back");
}

/// Health stays SERVING while the slot of the lock its key check names moves between
/// masters: Redis answers that check `ASK` while the slot migrates and `MOVED` once it
/// moved (for a client whose slot map is behind), having checked the caller's
/// permissions first; only a refusal tells that grants would fail.
#[tokio::test]
async fn health_stays_serving_while_its_probe_lock_moves() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start(&cluster.url()).await;
    let from = cluster.master_for_key("latchkey-health");
    let to = cluster.master_ports().into_iter().find(|p| *p != from).unwrap();
    let slot = fred::util::redis_keyslot(b"latchkey-health");
    let serving_for = |limit: Duration| {
        let server = &server;
        async move {
            let until = std::time::Instant::now() + limit;
            while std::time::Instant::now() < until {
                let health = server.health().await;
                assert_eq!(health, Some(ServingStatus::Serving), "while the probe's slot moves");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    cluster.start_migrating(slot, from, to);
    serving_for(Duration::from_millis(2500)).await;
    cluster.hand_over(slot, from, to);
    serving_for(Duration::from_millis(2500)).await;
}

/// Health stays SERVING through a manual failover (`CLUSTER FAILOVER`: a maintenance
/// switch-over): every slot stays served. A client idle since (the health probe's own)
/// still took the demoted master for a primary, whose keyless write probe answered
/// `READONLY`, and every server read NOT_SERVING for a round.
#[tokio::test]
async fn health_stays_serving_through_a_manual_failover() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let cluster = Arc::new(RedisCluster::start(3, 1));
    let server = Latchkey::start(&cluster.url()).await;
    server.wait_health(ServingStatus::Serving, T).await;
    let master = cluster.master_ports()[0];
    let replica = cluster.replicas_of(master)[0];
    let switched = Arc::new(AtomicBool::new(false));
    let failover = {
        let (cluster, switched) = (cluster.clone(), switched.clone());
        tokio::task::spawn_blocking(move || {
            cluster.failover(replica);
            switched.store(true, Ordering::Release);
        })
    };
    // Through the switch-over, and three health rounds after it.
    let mut after = None;
    while after.is_none_or(|at: Instant| at.elapsed() < Duration::from_secs(3)) {
        let health = server.health().await;
        assert_eq!(health, Some(ServingStatus::Serving), "through the failover");
        if after.is_none() && switched.load(Ordering::Acquire) {
            after = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bounded(T, "the failover", failover).await.unwrap();
}

/// A cluster node named by a `redis://` URL (a seed address, a Service in front of a
/// cluster) answers the health probe, but every script whose name lives on another
/// master answers `MOVED`, which a standalone client does not follow: the server went
/// SERVING and answered most names `UNAVAILABLE`, logging nothing above debug. It now
/// refuses to start, naming the flag.
#[tokio::test]
async fn a_cluster_node_given_as_a_standalone_redis_is_refused_at_start() {
    let cluster = RedisCluster::start(3, 0);
    let url = format!("redis://127.0.0.1:{}", cluster.master_ports()[0]);
    let argv = ["--listen", "127.0.0.1:0", "--no-metrics", "--redis-url", &url];
    let config = Config::from_args(argv).expect("flags parse");
    let Err(refused) = latchkey_server::Server::start(config).await else {
        panic!("{url} is a cluster node: the server should not start")
    };
    let refused = refused.to_string();
    assert!(
        refused.contains("--redis-url") && refused.contains("redis-cluster://"),
        "{refused}"
    );
}

/// The other way round: a `redis-cluster://` URL of a Redis without cluster mode. The
/// cluster's client never connected (its `CLUSTER SLOTS` refused, tried again for good),
/// and the server started, NOT_SERVING for good, saying only that the slot map was not
/// known. It now refuses to start, naming the flag.
#[tokio::test]
async fn a_standalone_redis_given_as_a_cluster_is_refused_at_start() {
    let redis = latchkey_tests::RedisServer::start();
    let url = format!("redis-cluster://127.0.0.1:{}", redis.port());
    let argv = [
        "--listen",
        "127.0.0.1:0",
        "--no-metrics",
        "--redis-timeout",
        "500ms",
        "--redis-url",
        &url,
    ];
    let config = Config::from_args(argv).expect("flags parse");
    let started = latchkey_tests::bounded(
        Duration::from_secs(10),
        "the start",
        latchkey_server::Server::start(config),
    )
    .await;
    let Err(refused) = started else {
        panic!("{url} has no cluster mode: the server should not start")
    };
    let refused = refused.to_string();
    assert!(
        refused.contains("--redis-url") && refused.contains("without cluster mode"),
        "{refused}"
    );
}

/// The first slot the master `node` serves.
fn cluster_slot_of(node: &latchkey_tests::RedisServer) -> u16 {
    let id = node.cli(&["CLUSTER", "MYID"]).trim().to_owned();
    let nodes = node.cli(&["CLUSTER", "NODES"]);
    let line = nodes.lines().find(|l| l.starts_with(&id)).expect("its own line");
    let range = line.split_whitespace().nth(8).expect("a slot range");
    range.split('-').next().unwrap().parse().expect("a slot")
}

/// The server's subscriber keeps a connection to every master, most of which only
/// receive (sharded subscriptions): each is probed every second, so one that died
/// without a word (an idle flow a NAT dropped) is found and made again, not left to
/// lose its master's unlock messages until the kernel gives up on it.
#[tokio::test]
async fn the_subscriber_is_probed_on_every_master() {
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start(&cluster.url()).await;
    let (holder, waiter) = (server.client().await, server.client().await);
    let mut held = Vec::new();
    let mut waiting = Vec::new();
    for port in cluster.master_ports() {
        let name = cluster.name_on(port, |i| format!("probe/{i}"));
        held.push(holder.lock(name.as_str()).acquire().await.unwrap());
        waiting.push(
            spawn_queued(waiter.lock(name.as_str()).wait(Duration::from_secs(30)), T)
                .await
                .0,
        );
    }
    // Past what a burst of subscribes and the first checks leave behind.
    tokio::time::sleep(Duration::from_secs(8)).await;
    for port in cluster.master_ports() {
        let clients = cluster.node(port).cli(&["CLIENT", "LIST"]);
        let subscriber = clients
            .lines()
            .find(|l| l.split(' ').any(|f| f.starts_with("ssub=") && f != "ssub=0"))
            .unwrap_or_else(|| panic!("master {port} has the subscriber's connection:\n{clients}"));
        let idle: u64 = subscriber
            .split(' ')
            .find_map(|f| f.strip_prefix("idle="))
            .and_then(|v| v.parse().ok())
            .expect("idle=");
        assert!(idle <= 3, "master {port}: the subscriber idle {idle} s: {subscriber}");
    }
    for w in waiting {
        w.abort();
    }
    drop(held);
}

/// A ForceRelease answered `ASK` (its slot being migrated, none of its keys left on the
/// old master) fails that call alone: ForceRelease's connection writes a command once,
/// and fred, with no attempt left to follow the redirection, stopped serving that
/// connection, so every ForceRelease through the server answered `UNAVAILABLE` after it.
#[tokio::test]
async fn a_force_release_answered_ask_leaves_force_release_working() {
    let s = Resharded::start(1, 1);
    let server = Latchkey::start_with(&s.cluster.url(), &["--redis-timeout", "1s"]).await;
    let client = server.client().await;
    assert_eq!(client.force_release(&s.staying[0]).await.ok(), Some(false));
    s.start_migrating();
    let _ = bounded(
        T,
        "a ForceRelease during the migration",
        client.force_release(&s.moving[0]),
    )
    .await;
    s.set_slot(s.to, &["STABLE"]);
    s.set_slot(s.from, &["STABLE"]);
    for name in [&s.staying[0], &s.moving[0]] {
        let answer = bounded(T, "a ForceRelease after it", client.force_release(name.as_str())).await;
        assert_eq!(answer.map_err(|e| e.code()), Ok(false), "{name}");
    }
}

/// After a slot moved, the first ForceRelease of one of its names breaks the lock: the
/// connection learns the new owner from `MOVED` and the call goes there (the script did
/// not run where the redirection came from).
#[tokio::test]
async fn a_force_release_after_a_slot_moved_reaches_the_new_master() {
    let s = Resharded::start(0, 1);
    let server = Latchkey::start(&s.cluster.url()).await;
    let client = server.client().await;
    assert_eq!(client.force_release(&s.moving[0]).await.ok(), Some(false));
    let lease = client.lock(s.moving[0].as_str()).acquire().await.unwrap();
    s.move_slot();
    let answer = bounded(T, "ForceRelease", client.force_release(s.moving[0].as_str())).await;
    assert_eq!(answer.map_err(|e| e.code()), Ok(true));
    let reason = bounded(T, "the holder's lost", lease.lost()).await;
    assert_eq!(reason, LostReason::ForceReleased);
}

/// Grants that wait for a replica (`--sync-replicas`) go through connections of their
/// own that write each call once; tries answered `ASK` during a slot migration (fresh
/// names, none of whose keys is on the old master) fail alone, and once the slot is
/// stable again every grant goes through: fred stopped serving each such connection
/// for good, so after four every grant of the server failed.
#[tokio::test]
async fn synced_grants_answered_ask_leave_the_sync_connections_working() {
    let s = Resharded::with_replicas(1, 8, 1);
    let server = Latchkey::start_with(&s.cluster.url(), &["--sync-replicas", "1", "--redis-timeout", "1s"]).await;
    let client = server.client().await;
    let held = client
        .lock(s.staying[0].as_str())
        .try_once()
        .acquire()
        .await
        .expect("a synced grant");
    held.release().await.unwrap();
    s.start_migrating();
    for name in &s.moving {
        let _ = bounded(
            T,
            "a try during the migration",
            client.lock(name.as_str()).try_once().acquire(),
        )
        .await;
    }
    s.set_slot(s.to, &["STABLE"]);
    s.set_slot(s.from, &["STABLE"]);
    for name in [&s.staying[0], &s.moving[0]] {
        let lease = bounded(T, "a try after it", client.lock(name.as_str()).try_once().acquire()).await;
        let released = lease.unwrap_or_else(|e| panic!("{name}: {e}")).release().await;
        released.unwrap_or_else(|e| panic!("{name}'s release: {e}"));
    }
}

/// With `--sync-replicas` on a cluster each node's renewal round waits for that
/// node's replicas (the offset it reads is its own): leases on every master are
/// confirmed round after round (unconfirmed, each would be told lost 9 s after its
/// grant), and a master whose replica stops acknowledging costs its own leases only.
#[tokio::test]
async fn synced_renewals_keep_leases_on_every_master() {
    let cluster = RedisCluster::start(3, 1);
    let args = latchkey_tests::server::SYNCED_RENEWALS;
    let server = Latchkey::start_with(&cluster.url(), &args).await;
    let client = server.client().await;
    let mut leases = Vec::new();
    for master in cluster.master_ports() {
        let name = cluster.name_on(master, |i| format!("synced-renewal/{i}"));
        leases.push(
            bounded(T, "a synced grant", client.lock(name.as_str()).acquire())
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    for lease in &leases {
        assert!(
            !lease.is_lost(),
            "{}: lost with its replica acknowledging",
            lease.name()
        );
    }
    let frozen = cluster.node(cluster.replicas_of(cluster.master_ports()[0])[0]);
    frozen.freeze();
    let notice = "the notice of the lease on the unacknowledged master";
    let reason = bounded(Duration::from_secs(20), notice, leases[0].lost()).await;
    // Past another round of the other masters, whose confirmations run on.
    tokio::time::sleep(Duration::from_secs(5)).await;
    frozen.resume();
    assert_eq!(reason, LostReason::NotHeld);
    for lease in leases.into_iter().skip(1) {
        assert!(!lease.is_lost(), "{}: lost beside another master's", lease.name());
        lease.release().await.unwrap();
    }
}

/// List on a cluster scans the masters of the slot map as it is now: a master given
/// slots after the server last read the map holds locks too. They were left out of every
/// page: each Redis client scans the masters of its own map, which no scan corrects.
#[tokio::test]
async fn list_finds_locks_on_a_master_added_since() {
    let cluster = RedisCluster::start(3, 0);
    let masters = cluster.master_ports();
    let (kept, added) = (masters[0], masters[2]);
    cluster.empty_master(added, kept);
    let listing = Latchkey::start(&cluster.url()).await;
    let client = listing.client().await;
    assert!(client.list_all("").await.unwrap().is_empty());
    let first = cluster.slots_of(kept)[0];
    cluster.move_slots(kept, added, &[first]);
    let name = cluster.name_on(added, |i| format!("new/{i}"));
    let other = Latchkey::start(&cluster.url()).await;
    let _lease = other.client().await.lock(name.as_str()).acquire().await.unwrap();
    // Each page may go through another of the server's Redis clients.
    for _ in 0..4 {
        let names: Vec<String> = client.list_all("").await.unwrap().into_iter().map(|l| l.name).collect();
        assert_eq!(names, std::slice::from_ref(&name));
    }
}

/// At its memory limit (`noeviction`) Redis 7 refuses a script with flags whole unless
/// it declares `allow-oom`, and on a cluster the renewals carry flags: they declare
/// it, as they only lengthen what exists. Every lease stays held, on every master, a
/// semaphore's among them.
#[tokio::test]
async fn leases_stay_held_while_every_master_is_at_its_memory_limit() {
    let cluster = RedisCluster::start(3, 0);
    let args = ["--redis-url", &cluster.url(), "--watchdog-timeout", "3s"].map(str::to_owned);
    let server = LatchkeyProcess::spawn(&args);
    let client = server.serving_client().await;
    let leases = latchkey_tests::server::a_lease_of_every_kind(&client, "oom/", 12).await;
    let masters = cluster.master_ports();
    for port in &masters {
        let node = cluster.node(*port);
        node.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
        node.cli(&["CONFIG", "SET", "maxmemory", "1"]);
    }
    // Two whole rounds at the limit (a round a second).
    server.renewals_reach(2 * leases.len(), T).await;
    let lost: Vec<&str> = leases.iter().filter(|l| l.is_lost()).map(|l| l.name()).collect();
    assert!(lost.is_empty(), "told lost at the memory limit: {lost:?}");
    for port in &masters {
        cluster.node(*port).cli(&["CONFIG", "SET", "maxmemory", "0"]);
    }
    for lease in leases {
        lease.release().await.expect("released");
    }
}

/// A waiter whose lock's master fails over (CLUSTER FAILOVER on its replica, which
/// demotes the master and drops its sharded subscriptions without closing the
/// connection) hears the holder's release within seconds, not at its TTL recheck.
#[tokio::test]
async fn a_waiter_hears_a_release_after_its_master_failed_over() {
    let cluster = RedisCluster::start(3, 1);
    let a = Latchkey::start(&cluster.url()).await;
    let b = Latchkey::start(&cluster.url()).await;
    let name = "failover-lock";
    let channel = latchkey_tests::redisson::lock_channel(name);
    let master = cluster.master_for_key(&channel);
    let replica = cluster.replicas_of(master)[0];
    let holder = bounded(T, "holder", a.client().await.lock(name).acquire())
        .await
        .unwrap();
    let cb = b.client().await;
    let (waiting, _) = spawn_queued(cb.lock(name).wait(Duration::from_secs(60)), T).await;
    let subscribers = |port: u16| cluster.node(port).shard_subscribers(&channel);
    assert!(
        poll_until(T, || subscribers(master) == 1).await,
        "subscribed on the master"
    );
    cluster.failover(replica);
    assert_eq!(cluster.master_for_key(&channel), replica, "failed over");
    let released = Instant::now();
    bounded(T, "release", holder.release()).await.expect("released");
    let granted = tokio::time::timeout(Duration::from_secs(6), waiting)
        .await
        .unwrap_or_else(|_| panic!("not granted within 6 s of the release ({:?})", released.elapsed()));
    granted.expect("task").expect("granted").release().await.unwrap();
    assert!(
        poll_until(T, || subscribers(replica) == 0 && subscribers(master) == 0).await,
        "subscription left behind"
    );
}

/// A master fails over to its replica and straight back (`CLUSTER FAILOVER TAKEOVER`
/// twice: a maintenance switch-over undone), quicker than the hub's 2 s checks of the
/// slot map, while a waiter on one server waits for a holder on another. Each demotion
/// drops the sharded subscriptions of the shard's slots on the demoted node, so the
/// waiter's channel is subscribed nowhere, though the slot map names the same master
/// as at the hub's last check: the waiter's server must subscribe it again all the
/// same, and the holder's release wakes the waiter within seconds, not at its recheck
/// (the holder's TTL) or the hub's 30 s re-sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_waiter_hears_a_release_after_a_failover_and_back() {
    let cluster = RedisCluster::start(3, 1);
    let a = Latchkey::start(&cluster.url()).await;
    let b = Latchkey::start(&cluster.url()).await;
    let ca = a.client().await;
    let cb = b.client().await;
    let mut failures = Vec::new();
    // One round per shard: a master votes for no second failover of the same shard
    // for a while.
    for (round, master) in cluster.master_ports().into_iter().enumerate() {
        let name = (0..)
            .map(|i| format!("failback-{round}-{i}"))
            .find(|n| cluster.master_for_key(&latchkey_tests::redisson::lock_channel(n)) == master)
            .unwrap();
        let channel = latchkey_tests::redisson::lock_channel(&name);
        let replica = cluster.replicas_of(master)[0];
        let holder = bounded(T, "holder", ca.lock(name.as_str()).acquire()).await.unwrap();
        let (waiting, _) = spawn_queued(cb.lock(name.as_str()).wait(Duration::from_secs(60)), T).await;
        assert!(
            poll_until(T, || shard_subscribers(&cluster, master, &channel) == 1).await,
            "subscribed on the master"
        );
        // Let the subscription age a moment before the switch-over.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let switched = Instant::now();
        tokio::task::block_in_place(|| {
            quick_failover(&cluster, replica);
            // The demoted master must follow its new master before it can take over.
            let deadline = Instant::now() + T;
            while !cluster
                .node(master)
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up")
            {
                assert!(Instant::now() < deadline, "{master} never followed {replica}");
                std::thread::sleep(Duration::from_millis(10));
            }
            quick_failover(&cluster, master);
        });
        let took = switched.elapsed();
        tokio::task::block_in_place(|| cluster.wait_settled("settle after the failback"));
        assert_eq!(cluster.master_for_key(&channel), master, "failed back");
        // Past the hub's next check of the slot map.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        bounded(T, "release", holder.release()).await.expect("released");
        match tokio::time::timeout(Duration::from_secs(6), waiting).await {
            Ok(granted) => granted.expect("task").expect("granted").release().await.unwrap(),
            Err(_) => failures.push(format!(
                "round {round}: not granted within 6 s of the release (failover and back in {took:?}; \
                 subscribers: master {}, replica {})",
                shard_subscribers(&cluster, master, &channel),
                shard_subscribers(&cluster, replica, &channel)
            )),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// `CLUSTER FAILOVER TAKEOVER` on `replica` (an operator's switch-over that needs no
/// vote), returning once it says it is a master, without waiting for the whole
/// cluster to settle (unlike [`RedisCluster::failover`]).
fn quick_failover(cluster: &RedisCluster, replica: u16) {
    let deadline = Instant::now() + T;
    let mut asked: Option<Instant> = None;
    while cluster.node(replica).cli(&["ROLE"]).lines().next() != Some("master") {
        assert!(Instant::now() < deadline, "{replica} never became master");
        // A takeover not done in a while is asked again.
        if asked.is_none_or(|at| at.elapsed() > Duration::from_millis(400)) {
            let reply = cluster.node(replica).cli(&["CLUSTER", "FAILOVER", "TAKEOVER"]);
            assert_eq!(reply.trim(), "OK", "CLUSTER FAILOVER on {replica}: {reply}");
            asked = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A server holds leases on one master, one of them in a slot that then moves (with
/// its keys) to another master. The watchdog groups renewals by node from a slot map
/// nothing had refreshed, so the moved lease went on in the old master's batch, which
/// refused it alone ("non local key") with no redirection for the call (routed by
/// another lease's keys); each retry went the same way, and the holder was told
/// `lost{NOT_HELD}` while its lock was held on the new master. A lease refused in a
/// node-wide batch now goes again in a call of its own slot, which is redirected.
#[tokio::test]
async fn a_lease_whose_slot_moved_is_renewed_on_its_new_master() {
    let r = Resharded::start(15, 1);
    let server = Latchkey::start_with(&r.cluster.url(), &["--watchdog-timeout", "3s"]).await;
    let client = server.client().await;
    let mut held = Vec::new();
    for name in &r.staying {
        held.push(client.lock(name.as_str()).acquire().await.unwrap());
    }
    let moved = client.lock(r.moving[0].as_str()).acquire().await.unwrap();
    // A round or two before the move.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    r.move_slot();
    assert_eq!(r.cluster.master_for_key(&r.moving[0]), r.to);
    // Three lease lengths.
    let lost = tokio::time::timeout(Duration::from_secs(9), moved.lost()).await;
    let still = r.cluster.node(r.to).cli(&["EXISTS", &r.moving[0]]);
    assert!(
        lost.is_err(),
        "told {lost:?} after its slot moved (lock on the new master: {still})"
    );
    for lease in &held {
        assert!(!lease.is_lost(), "{} lost", lease.name());
    }
}

/// One channel Redis refuses to subscribe (here an ACL without it; a master down does
/// the same until its failover) holds back no other: each sharded channel is subscribed,
/// and counts, on its own. A refused SSUBSCRIBE failed the whole round's, retried with
/// every channel added meanwhile: no waiter that came while the refused one waited was
/// told it listened, and each looked again in Redis every second, as one that hears no
/// unlock must.
#[tokio::test]
async fn a_refused_channel_holds_back_no_other_waiters_subscription() {
    let cluster = RedisCluster::start(3, 0);
    // Every channel of latchkey's own, and the unlock channels of the names `ok*`.
    let allowed = ["&latchkey*", "&redisson_lock__channel:{ok*"];
    for port in cluster.master_ports() {
        let mut acl = vec!["ACL", "SETUSER", "default", "resetchannels"];
        acl.extend(allowed);
        assert_eq!(cluster.node(port).cli(&acl).trim(), "OK");
    }
    let refused_master = cluster.master_for_key("refused");
    let ok = (0..200)
        .map(|i| format!("ok{i}"))
        .find(|n| cluster.master_for_key(n) != refused_master)
        .expect("a name on another master");
    let ok_master = cluster.node(cluster.master_for_key(&ok));
    let server = Latchkey::start(&cluster.url()).await;
    let client = server.client().await;
    // Held elsewhere (a Redisson client, for a minute), so that the waiters listen on
    // their channels.
    let conn = redis_client(&cluster.url()).await;
    for name in ["refused", ok.as_str()] {
        let java = RedissonLock::new(&conn, name, &random_owner());
        assert_eq!(java.try_lock(60_000).await, None, "redisson locks {name}");
    }
    // A waiter whose channel Redis refuses: its subscription is tried again as long as
    // it waits.
    let (refused, _) = spawn_queued(client.lock("refused").wait(T), T).await;
    let (waiting, _) = spawn_queued(client.lock(ok.as_str()).wait(T), T).await;
    // Past its subscription and the try after it (its script calls stay still for a
    // while); then it waits for an unlock (or the holder's TTL).
    let channel = Keys::default().lock(&ok).channel();
    let port = cluster.master_for_key(&ok);
    assert!(
        poll_until(T, || shard_subscribers(&cluster, port, &channel) == 1).await,
        "the other waiter listens"
    );
    let mut before = ok_master.evalsha_calls();
    let settle = Instant::now() + T;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = ok_master.evalsha_calls();
        if now == before {
            break;
        }
        assert!(Instant::now() < settle, "the other waiter keeps trying");
        before = now;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let tries = ok_master.evalsha_calls() - before;
    assert_eq!(
        tries, 0,
        "the other waiter tried {tries} times in 3 s: it was taken for deaf"
    );
    refused.abort();
    waiting.abort();
}

/// A held lock whose slot moves during a List, from a master the listing has not
/// scanned yet to one it has: List reads the slot map again after its scan and scans
/// again when a slot moved, so the lock is listed (or, should the slots keep moving,
/// the call fails). It was left out, the answer OK and short, in 7 tries of 8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_whose_slot_moves_during_a_list_is_listed() {
    let (cluster, first, last) = cluster_with_a_slow_middle_scan();
    let server = Latchkey::start(&cluster.url()).await;
    let client = server.client().await;
    let names =
        |states: &[latchkey_client::LockState]| -> Vec<String> { states.iter().map(|s| s.name.clone()).collect() };
    let mut listed_during = 0;
    for delay_ms in [0u64, 10, 20, 40] {
        let name = cluster.name_on(last, |i| format!("{{moving{delay_ms}x{i}}}/lock"));
        let lease = bounded(T, "acquire", client.lock(name.as_str()).acquire())
            .await
            .unwrap();
        let slot = fred::util::redis_keyslot(name.as_bytes());
        let listed = list_during(&client, delay_ms, || cluster.move_slot_with_keys(slot, last, first)).await;
        match listed {
            Ok(states) => {
                assert!(
                    names(&states).contains(&name),
                    "{name} held, left out of {:?}",
                    names(&states)
                );
                listed_during += 1;
            }
            Err(e) => eprintln!("delay {delay_ms} ms: the list failed ({e})"),
        }
        lease.release().await.unwrap();
    }
    assert!(listed_during > 0, "no list during a move answered");
}

/// A held lock whose key moves during a List while its slot is still migrating (a
/// resharding under way: the key migrated, the slot not yet handed over), from a master
/// the listing has not scanned yet to one it has. The slot map does not change, so
/// scanning again on a changed map does not catch it; the masters importing a slot
/// are scanned again at the end. List then lists the lock or, its slot's locks out of
/// service while it migrates, fails `UNAVAILABLE`; it never answers OK without it, as
/// it did before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_whose_key_migrates_during_a_list_is_not_left_out() {
    let (cluster, first, last) = cluster_with_a_slow_middle_scan();
    let server = Latchkey::start(&cluster.url()).await;
    let client = server.client().await;
    for delay_ms in [0u64, 10, 20, 40] {
        let name = cluster.name_on(last, |i| format!("{{migrating{delay_ms}x{i}}}/lock"));
        let lease = bounded(T, "acquire", client.lock(name.as_str()).acquire())
            .await
            .unwrap();
        let slot = fred::util::redis_keyslot(name.as_bytes());
        let listed = list_during(&client, delay_ms, || cluster.migrate_keys(slot, last, first)).await;
        tokio::task::block_in_place(|| cluster.hand_over(slot, last, first));
        match listed {
            Ok(states) => {
                let names: Vec<&str> = states.iter().map(|s| s.name.as_str()).collect();
                assert!(names.contains(&name.as_str()), "{name} held, left out of {names:?}");
            }
            Err(e) => assert_eq!(e.code(), tonic::Code::Unavailable, "delay {delay_ms} ms: {e}"),
        }
        lease.release().await.unwrap();
    }
}

/// A List of every lock, with `change` made to the cluster `delay_ms` after it began;
/// its answer once both are done.
async fn list_during(
    client: &latchkey_client::Client,
    delay_ms: u64,
    change: impl FnOnce(),
) -> Result<Vec<latchkey_client::LockState>, latchkey_client::Error> {
    let listing = {
        let client = client.clone();
        tokio::spawn(async move { client.list_all("").await })
    };
    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    tokio::task::block_in_place(change);
    bounded(T, "the list during the change", listing).await.unwrap()
}

/// A 3-master cluster whose middle master (List scans masters in port order) holds
/// 300 000 keys that are no locks, so its scan takes its time: a lock moved from the
/// last master to the first meanwhile goes from one not yet scanned to one that was.
/// Returns the cluster and the first and last masters' ports.
fn cluster_with_a_slow_middle_scan() -> (RedisCluster, u16, u16) {
    let cluster = RedisCluster::start(3, 0);
    let masters = cluster.master_ports();
    let (first, middle, last) = (masters[0], masters[1], masters[2]);
    let tag = (0..)
        .map(|i| format!("fill{i}"))
        .find(|t| cluster.master_for_key(&format!("{{{t}}}")) == middle)
        .expect("a tag on the middle master");
    let fill = "for i = 1, tonumber(ARGV[1]) do redis.call('set', KEYS[1] .. i, '1') end return 1";
    cluster
        .node(middle)
        .cli(&["EVAL", fill, "1", &format!("{{{tag}}}:"), "300000"]);
    (cluster, first, last)
}

/// A fair waiter's leave that Redis refused is retried with the others of its master,
/// not behind another master's: with one master refusing writes (`NOREPLICAS`, too few
/// replicas for `min-replicas-to-write`) and the other taking them again, the second
/// master's waiter leaves its queue within a few retries. The leaves were retried one first,
/// the rest once that one went through, so the waiter that left first, on the master
/// still refusing, kept the other's place in its queue until its deadline, a minute
/// away, holding up everyone behind it.
#[tokio::test]
async fn a_refused_fair_leave_is_retried_beside_another_masters() {
    let cluster = RedisCluster::start(3, 0);
    let masters = cluster.master_ports();
    let (refusing, recovering) = (masters[0], masters[1]);
    let names = [
        names_on(&cluster, refusing, "leave", 1).remove(0),
        names_on(&cluster, recovering, "leave", 1).remove(0),
    ];
    let flags = ["--redis-timeout", "500ms", "--fair-wait-timeout", "60s"];
    let holding = Latchkey::start_with(&cluster.url(), &flags).await;
    let waiting = Latchkey::start_with(&cluster.url(), &flags).await;
    let (holder, client) = (holding.client().await, waiting.client().await);
    let mut held = Vec::new();
    let mut waiters = Vec::new();
    for name in &names {
        held.push(holder.lock(name.as_str()).kind(LockKind::Fair).acquire().await.unwrap());
        let lock = client
            .lock(name.as_str())
            .kind(LockKind::Fair)
            .wait(Duration::from_secs(60));
        waiters.push(spawn_queued(lock, T).await.0);
    }
    let queue_len = |name: &str| {
        let node = cluster.node(cluster.master_for_key(name));
        node.cli(&["LLEN", &Keys::new("").lock(name).queue()])
            .trim()
            .parse::<u32>()
            .unwrap_or(u32::MAX)
    };
    for name in &names {
        assert!(poll_until(T, || queue_len(name) == 1).await, "{name} queued in Redis");
    }
    let refuse_writes = |port: u16, refuse: bool| {
        let replicas = if refuse { "1" } else { "0" };
        cluster
            .node(port)
            .cli(&["CONFIG", "SET", "min-replicas-to-write", replicas]);
    };
    refuse_writes(refusing, true);
    refuse_writes(recovering, true);
    // The refusing master's waiter leaves first, and its leave is refused first.
    for waiter in waiters {
        waiter.abort();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(queue_len(&names[1]), 1, "the leave was refused");
    refuse_writes(recovering, false);
    let left = poll_until(Duration::from_secs(5), || queue_len(&names[1]) == 0).await;
    let still_queued = queue_len(&names[0]);
    refuse_writes(refusing, false);
    assert!(left, "the recovered master's waiter is still in its queue");
    assert_eq!(still_queued, 1, "the refusing master's waiter could not leave");
    assert!(
        poll_until(T, || queue_len(&names[0]) == 0).await,
        "and leaves once it can"
    );
    for lease in held {
        lease.release().await.expect("released");
    }
}

/// The common resharding onto a new node (`redis-cli --cluster add-node`, then
/// `reshard` to it): the target master holds no slot yet, so it is in no slot map.
/// While a slot migrates to it, the keys that already moved live on that master alone,
/// and the map does not change until the slot is handed over. The migrating master's
/// own line names the target, which List scans again too: the lock is listed, or List
/// fails `UNAVAILABLE`. The master without slots was never scanned, and List answered
/// OK without the held lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_migrating_to_a_master_without_slots_is_listed() {
    let cluster = RedisCluster::start(3, 0);
    let masters = cluster.master_ports();
    let (kept, added) = (masters[0], masters[2]);
    cluster.empty_master(added, kept);
    let server = Latchkey::start(&cluster.url()).await;
    let client = server.client().await;
    let name = cluster.name_on(kept, |i| format!("adding/{i}"));
    let lease = bounded(T, "acquire", client.lock(name.as_str()).acquire())
        .await
        .unwrap();
    let slot = fred::util::redis_keyslot(name.as_bytes());
    tokio::task::block_in_place(|| cluster.migrate_keys(slot, kept, added));
    let listed = bounded(T, "the list during the migration", client.list_all("")).await;
    tokio::task::block_in_place(|| cluster.hand_over(slot, kept, added));
    match listed {
        Ok(states) => {
            let names: Vec<&str> = states.iter().map(|s| s.name.as_str()).collect();
            assert!(
                names.contains(&name.as_str()),
                "{name} held (its keys on the new master {added}), left out of {names:?}"
            );
        }
        Err(e) => assert_eq!(e.code(), tonic::Code::Unavailable, "{e}"),
    }
    drop(lease);
}

/// The first slot of a reshard onto a new node starts migrating, a lock held on another
/// master entirely: List answers it, and leaves the Redis client's connections as they
/// are. The new master, missing from the slot map, was asked through the pool, where
/// fred found no route to it and reconnected the whole client on each try; the List
/// failed `UNAVAILABLE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_during_an_unrelated_migration_to_a_master_without_slots_answers() {
    let cluster = RedisCluster::start(3, 0);
    let masters = cluster.master_ports();
    let (kept, other, added) = (masters[0], masters[1], masters[2]);
    cluster.empty_master(added, kept);
    let server = Latchkey::start(&cluster.url()).await;
    let client = server.client().await;
    let name = cluster.name_on(other, |i| format!("far/{i}"));
    let _lease = bounded(T, "acquire", client.lock(name.as_str()).acquire())
        .await
        .unwrap();
    let connections = || -> u64 {
        [kept, other]
            .iter()
            .map(|port| {
                let info = cluster.node(*port).cli(&["INFO", "stats"]);
                info.lines()
                    .find_map(|l| l.strip_prefix("total_connections_received:"))
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .expect("total_connections_received")
            })
            .sum()
    };
    // What a List costs in connections with no migration (the slot map read anew).
    let start = connections();
    bounded(T, "the list before", client.list_all(""))
        .await
        .expect("List answers");
    let listing = connections() - start;
    let slot = cluster.slots_of(kept)[0].0;
    tokio::task::block_in_place(|| cluster.start_migrating(slot, kept, added));
    let before = connections();
    let listed = bounded(T, "the list during the migration", client.list_all("")).await;
    let during = connections() - before;
    tokio::task::block_in_place(|| cluster.hand_over(slot, kept, added));
    let names: Vec<String> = listed.expect("List answers").into_iter().map(|s| s.name).collect();
    assert!(names.contains(&name), "{name} left out of {names:?}");
    assert_eq!(during, listing, "the List reconnected to the mapped masters");
}

/// A cluster whose ACL refuses `COMMAND` (which the command check runs) is asked
/// whether it has cluster mode once, not at each health check: that question took a
/// new connection to the URL's first node and its `INFO cluster`, each second for as
/// long as the server ran.
#[tokio::test]
async fn a_cluster_that_refuses_the_command_check_is_asked_of_its_mode_once() {
    let cluster = RedisCluster::start(3, 0);
    for port in cluster.master_ports() {
        assert_eq!(
            cluster
                .node(port)
                .cli(&["ACL", "SETUSER", "default", "-command"])
                .trim(),
            "OK"
        );
    }
    let server = Latchkey::start(&cluster.url()).await;
    let client = server.client().await;
    client.lock("served").acquire().await.unwrap().release().await.unwrap();
    // What every node is asked during three health checks.
    let dir = tempfile::tempdir().expect("a directory for the commands seen");
    let monitors: Vec<_> = (cluster.nodes().iter().enumerate())
        .map(|(i, node)| {
            let seen = std::fs::File::create(dir.path().join(i.to_string())).expect("a file");
            std::process::Command::new(latchkey_tests::redis::REDIS_CLI)
                .args(["-p", &node.port().to_string(), "monitor"])
                .stdout(seen)
                .spawn()
                .expect("redis-cli monitor")
        })
        .collect();
    tokio::time::sleep(latchkey_server::health::INTERVAL * 3 + Duration::from_millis(500)).await;
    let mut asked = 0;
    for (i, mut monitor) in monitors.into_iter().enumerate() {
        monitor.kill().expect("stop the monitor");
        monitor.wait().expect("the monitor ends");
        let seen = std::fs::read_to_string(dir.path().join(i.to_string())).expect("the commands seen");
        asked += seen
            .lines()
            .filter(|l| l.to_ascii_lowercase().contains("\"info\" \"cluster\""))
            .count();
    }
    assert_eq!(asked, 0, "cluster mode asked during three health checks");
}

/// A burst of sharded subscriptions larger than the subscriber's command queue (the
/// channels of a thousand fair waiters, subscribed again after their master cut the
/// subscriber's connection) goes in bounded waves. Commands the Redis client refused
/// at its queue's bound left its count of queued commands stuck above zero for good,
/// and it then wrote every later subscription only when a ping came to flush it, up to
/// a second later: a new waiter, not yet subscribed, heard a release only when it
/// looked again a second later.
#[tokio::test]
async fn a_resubscribe_larger_than_the_command_queue_leaves_later_subscriptions_prompt() {
    const WAITERS: usize = 1300;
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start_with(&cluster.url(), &["--max-waiters-per-lock", "2000"]).await;
    let client = server.client().await;
    let master = cluster.master_for_key("crowd");
    let _holder = client.lock("crowd").kind(LockKind::Fair).acquire().await.unwrap();
    let mut waiting = Vec::new();
    for _ in 0..WAITERS {
        let (task, _) = spawn_queued(client.lock("crowd").kind(LockKind::Fair).wait(T * 6), T).await;
        waiting.push(task);
    }
    let subscribed = || lock_channels_on(&cluster, master).len() >= WAITERS;
    assert!(poll_until(T, subscribed).await, "the waiters' channels subscribed");
    cluster.node(master).cli(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    assert!(
        poll_until(T, subscribed).await,
        "the waiters' channels subscribed again"
    );
    // Fresh waiters on the other masters (the subscriber's count is one for all).
    let names: Vec<String> = (0..200)
        .map(|i| format!("fresh/{i}"))
        .filter(|n| cluster.master_for_key(n) != master)
        .take(5)
        .collect();
    for name in &names {
        let held = client.lock(name.as_str()).acquire().await.unwrap();
        let (wait, _) = spawn_queued(client.lock(name.as_str()).wait(T), T).await;
        let released = Instant::now();
        held.release().await.unwrap();
        let lease = tokio::time::timeout(T, wait).await.unwrap().unwrap().expect("granted");
        let took = released.elapsed();
        assert!(
            took < Duration::from_millis(500),
            "{name}: woken {took:?} after the release"
        );
        drop(lease);
    }
    for task in waiting {
        task.abort();
    }
}
