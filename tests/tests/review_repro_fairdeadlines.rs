//! Review repros for the fair lock's queue deadlines (lib.lua: needed, keep_place,
//! foreign_ahead) with Redisson's fair-lock scripts at their default 5 min wait.

use latchkey_client::{Client, LockKind, Lease};
use latchkey_server::keys::Keys;
use latchkey_tests::redisson::{random_owner, RedissonFairLock};
use latchkey_tests::server::Latchkey;
use latchkey_tests::{redis_client, RedisServer};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const T: Duration = Duration::from_secs(10);
const WAIT: Duration = Duration::from_secs(60);
/// Redisson's default `fairLockWaitTimeout`.
const REDISSON_WAIT_MS: i64 = 300_000;

/// A fair waiter (its stream's own owner id unless `owner`) that keeps its lease once
/// granted; returned once queued.
async fn holding_waiter(client: &Client, name: &str, owner: Option<&str>) -> JoinHandle<Lease> {
    let (tx, rx) = oneshot::channel();
    let mut tx = Some(tx);
    let mut lock = client.lock(name).kind(LockKind::Fair).wait(WAIT);
    if let Some(owner) = owner {
        lock = lock.owner(owner);
    }
    let lock = lock.on_queued(move |_| {
        if let Some(tx) = tx.take() {
            let _ = tx.send(());
        }
    });
    let task = tokio::spawn(async move { lock.acquire().await.expect("a holding waiter acquires") });
    tokio::time::timeout(T, rx)
        .await
        .expect("the waiter is queued in time")
        .expect("the waiter got a Queued event");
    task
}

fn deadline_of(redis: &RedisServer, timeouts: &str, owner: &str) -> i64 {
    redis
        .cli(&["ZSCORE", timeouts, owner])
        .trim()
        .parse::<f64>()
        .unwrap_or_else(|_| panic!("{owner} has a deadline")) as i64
}

fn queue_of(redis: &RedisServer, queue: &str) -> Vec<String> {
    redis
        .cli(&["LRANGE", queue, "0", "-1"])
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// Tries as a Redisson client polling its fair lock until it is granted (bounded).
async fn redisson_takes(java: &RedissonFairLock) {
    let deadline = Instant::now() + T;
    while java.try_lock(30_000).await.is_some() {
        assert!(Instant::now() < deadline, "the Redisson waiter {} is granted", java.owner());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Redisson and latchkey waiters alternating in a fair queue that never empties (a hot
/// lock shared by a Java service at Redisson's default 5 min wait and latchkey clients).
/// A latchkey waiter behind a Redisson waiter takes that waiter's deadline + 5 min
/// (needed), a Redisson waiter joining behind it takes its deadline + 5 min (Redisson's
/// own rule), and the walk in keep_place only raises: but a latchkey grant takes
/// nothing off, only a Redisson grant takes 5 min off. Each round therefore leaves the
/// newest Redisson waiter 5 minutes further out than the one before it: the deadlines
/// ratchet without bound, and a Java client that dies while queued (or a latchkey
/// server's waiter that dies behind it, which takes its deadline + 5 min) then keeps
/// the free lock from everyone that long at the head. In Redisson's own queues (and
/// with the latchkey waiters' 5 min given back at their grant) each newcomer would stay
/// at about the same distance.
#[tokio::test]
async fn alternating_redisson_and_latchkey_waiters_ratchet_redisson_deadlines() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--fair-wait-timeout", "2s"]).await;
    let client = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let name = "alternate";
    let keys = Keys::default().lock(name);
    let (queue, timeouts) = (keys.queue(), keys.timeouts());
    let java = || RedissonFairLock::new(&conn, name, &random_owner()).with_thread_wait(REDISSON_WAIT_MS);

    let mut holder = client
        .lock(name)
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .expect("the first latchkey holder");
    // Queue: R1 L1 R2 L2 behind the latchkey holder.
    let mut javas = std::collections::VecDeque::new();
    let mut ours = std::collections::VecDeque::new();
    let mut arrival = Vec::new();
    for _ in 0..2 {
        let r = java();
        assert!(r.try_lock(30_000).await.is_some(), "a Redisson waiter queues");
        arrival.push(r.owner().to_owned());
        javas.push_back(r);
        ours.push_back(holding_waiter(&client, name, None).await);
        let line = queue_of(&redis, &queue);
        arrival.push(line.last().unwrap().clone());
    }
    let mut granted = Vec::new();
    let mut offsets = Vec::new();
    for _round in 0..5 {
        // The latchkey holder releases: the Redisson waiter at the head is granted.
        holder.release().await.unwrap();
        let r = javas.pop_front().unwrap();
        redisson_takes(&r).await;
        granted.push(r.owner().to_owned());
        // A Redisson waiter and a latchkey waiter join at the end.
        let newest = java();
        assert!(newest.try_lock(30_000).await.is_some(), "a Redisson waiter queues");
        arrival.push(newest.owner().to_owned());
        let offset = deadline_of(&redis, &timeouts, newest.owner()) - redis.now_ms();
        offsets.push(offset / 1000);
        javas.push_back(newest);
        ours.push_back(holding_waiter(&client, name, None).await);
        arrival.push(queue_of(&redis, &queue).last().unwrap().clone());
        // The Redisson holder unlocks: the latchkey waiter next in line is granted.
        assert_eq!(r.unlock().await, Some(true));
        let next = ours.pop_front().unwrap();
        holder = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
        granted.push(holder.owner().to_owned());
    }
    let at_head = queue_of(&redis, &queue);
    let head_left = deadline_of(&redis, &timeouts, &at_head[0]) - redis.now_ms();

    // Clean up: the latchkey waiters give up, the Redisson waiters leave as Java's
    // acquireFailed does, the holder releases; nothing is left of the queue.
    for task in ours {
        task.abort();
        let _ = task.await;
    }
    for r in &javas {
        r.acquire_failed(REDISSON_WAIT_MS).await;
    }
    holder.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let exists = redis.cli(&["EXISTS", &queue, &timeouts, name]);
    assert_eq!(exists.trim(), "0", "queue keys left: {:?}", redis.cli(&["KEYS", "*"]));
    assert_eq!(granted, arrival[..granted.len()], "granted in arrival order");

    // Each newcomer should stay about as far out as the first (R behind L behind R:
    // ~10-15 min), not 5 min further each round.
    assert!(
        offsets.last().unwrap() - offsets[0] < 120,
        "the newest Redisson waiter's deadline, round by round (s from now): {offsets:?}; \
         the Redisson waiter now at the head would block a free lock for {} s should its \
         client die",
        head_left / 1000
    );
}

/// Coverage (passes): latchkey waiters of two servers behind a named owner and
/// between Redisson waiters at Redisson's default 5 min wait. The named owner leaves:
/// the waiter behind it comes back to its wait timeout (lowered) while the Redisson
/// waiter behind that keeps its own deadline; then each Redisson grant (5 min off every
/// deadline) leaves every latchkey waiter queued with minutes to spare; all are granted
/// in arrival order across both servers, and nothing is left in Redis.
#[tokio::test]
async fn latchkey_waiters_between_redisson_waiters_keep_their_turn_after_lowering() {
    let redis = RedisServer::start();
    let args = ["--fair-wait-timeout", "2s"];
    let a = Latchkey::start_with(&redis.url(), &args).await;
    let b = Latchkey::start_with(&redis.url(), &args).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let conn = redis_client(&redis.url()).await;
    let name = "between";
    let keys = Keys::default().lock(name);
    let (queue, timeouts) = (keys.queue(), keys.timeouts());
    let java = || RedissonFairLock::new(&conn, name, &random_owner()).with_thread_wait(REDISSON_WAIT_MS);
    let holder = java();
    assert_eq!(holder.try_lock(30_000).await, None, "a Redisson client holds");

    // A named owner shaped like Redisson's ids (a Java thread's id shared by a client):
    // it may be a Redisson waiter, and pushes those behind it out.
    let named_owner = random_owner();
    let named = holding_waiter(&ca, name, Some(&named_owner)).await;
    let l1 = holding_waiter(&cb, name, None).await;
    let r1 = java();
    assert!(r1.try_lock(30_000).await.is_some());
    let l2 = holding_waiter(&ca, name, None).await;
    let r2 = java();
    assert!(r2.try_lock(30_000).await.is_some());
    let l3 = holding_waiter(&cb, name, None).await;
    let line = queue_of(&redis, &queue);
    assert_eq!(line.len(), 6, "{line:?}");
    let d = |o: &str| deadline_of(&redis, &timeouts, o);
    let now = redis.now_ms();
    let shown: Vec<i64> = line.iter().map(|o| d(o) - now).collect();
    assert!(d(&line[1]) >= d(&line[0]) + REDISSON_WAIT_MS - 1000, "L1 behind the named owner: {line:?} {shown:?}");
    assert!(d(&line[3]) >= d(&line[2]) + REDISSON_WAIT_MS - 1000, "L2 behind R1");
    assert!(d(&line[5]) >= d(&line[4]) + REDISSON_WAIT_MS - 1000, "L3 behind R2");
    let r1_before = d(r1.owner());

    // The named owner gives up: L1's next refresh lowers it; R1 keeps its deadline.
    named.abort();
    let _ = named.await;
    let lowered = latchkey_tests::poll_until(Duration::from_secs(4), || d(&line[1]) - redis.now_ms() <= 2_500).await;
    assert!(lowered, "L1 lowered: {} ms out", d(&line[1]) - redis.now_ms());
    assert!(d(r1.owner()) >= r1_before, "R1's deadline was not lowered");
    assert!(d(&line[3]) >= d(r1.owner()) + REDISSON_WAIT_MS - 3000, "L2 stays behind R1");

    let mut granted = Vec::new();
    assert_eq!(holder.unlock().await, Some(true));
    let lease = tokio::time::timeout(T, l1).await.expect("L1 granted").unwrap();
    granted.push(lease.owner().to_owned());
    lease.release().await.unwrap();
    for (r, next) in [(r1, l2), (r2, l3)] {
        redisson_takes(&r).await;
        granted.push(r.owner().to_owned());
        let now = redis.now_ms();
        for owner in queue_of(&redis, &queue) {
            let left = d(&owner) - now;
            assert!(left > 60_000, "{owner} keeps its place after a Redisson grant: {left} ms left");
        }
        // Past a refresh: the latchkey waiter at the head is still in place.
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(r.unlock().await, Some(true));
        let lease = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
        granted.push(lease.owner().to_owned());
        lease.release().await.unwrap();
    }
    assert_eq!(granted, line[1..], "granted in arrival order");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let exists = redis.cli(&["EXISTS", &queue, &timeouts, name]);
    assert_eq!(exists.trim(), "0", "left: {:?}", redis.cli(&["KEYS", "*"]));
}


/// latchkey alone, with named owners in the shape DESIGN.md gives them (Redisson's
/// `uuid:threadId`): such an owner counts as a possible Redisson waiter, so the waiter
/// behind it takes its deadline + 5 min (needed), and it is never lowered
/// (keep_place: `current > at and not refreshed(owner)`). A named owner joining behind
/// a latchkey waiter pushed out so takes the nearest such owner's deadline + 5 min; no
/// latchkey grant takes anything off. With named owners and stream-owned waiters
/// alternating in a queue that never empties, each named owner that joins is five
/// minutes further out than the one before: the ratchet the last commit set out to
/// end, back through owners that look like Redisson's. A server that dies with its
/// waiters there (a named owner, or one of its own behind one) keeps the free lock from
/// everyone that long at the head.
#[tokio::test]
async fn alternating_redisson_shaped_named_owners_ratchet_deadlines_without_redisson() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--fair-wait-timeout", "2s"]).await;
    let client = server.client().await;
    let name = "named-alternate";
    let keys = Keys::default().lock(name);
    let (queue, timeouts) = (keys.queue(), keys.timeouts());
    let mut holder = client
        .lock(name)
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .expect("the first holder");
    let mut line = std::collections::VecDeque::new();
    for _ in 0..2 {
        line.push_back(holding_waiter(&client, name, Some(&random_owner())).await);
        line.push_back(holding_waiter(&client, name, None).await);
    }
    let mut offsets = Vec::new();
    for _round in 0..5 {
        // Two grants: a named owner's, then a stream-owned waiter's.
        for _ in 0..2 {
            holder.release().await.unwrap();
            let next = line.pop_front().unwrap();
            holder = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
        }
        let named = random_owner();
        line.push_back(holding_waiter(&client, name, Some(&named)).await);
        offsets.push((deadline_of(&redis, &timeouts, &named) - redis.now_ms()) / 1000);
        line.push_back(holding_waiter(&client, name, None).await);
    }
    let in_line = queue_of(&redis, &queue);
    let now = redis.now_ms();
    let left: Vec<i64> = in_line
        .iter()
        .map(|o| (deadline_of(&redis, &timeouts, o) - now) / 1000)
        .collect();
    for task in line {
        task.abort();
        let _ = task.await;
    }
    holder.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let exists = redis.cli(&["EXISTS", &queue, &timeouts, name]);
    assert_eq!(exists.trim(), "0", "left: {:?}", redis.cli(&["KEYS", "*"]));
    assert!(
        offsets.last().unwrap() - offsets[0] < 120,
        "each named owner joining, s from now: {offsets:?}; the queue at the end (s left): {left:?}"
    );
}

/// latchkey alone, every stream naming its owner as DESIGN.md describes it (Redisson's
/// `uuid:threadId`): each owner joining takes the deadline of the one ahead + 5 min
/// (needed: a possible Redisson waiter ahead), is never lowered, and no latchkey grant
/// takes the 5 min off as Redisson's grant does. In a queue that never empties the
/// newcomers' deadlines climb 5 min per grant, and the waiter at the head (whose
/// server's last refresh had nobody ahead of it) keeps a free lock from everyone that
/// long should its server die.
#[tokio::test]
async fn a_hot_queue_of_redisson_shaped_named_owners_ratchets_deadlines() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--fair-wait-timeout", "2s"]).await;
    let client = server.client().await;
    let name = "named-hot";
    let keys = Keys::default().lock(name);
    let (queue, timeouts) = (keys.queue(), keys.timeouts());
    let mut holder = client
        .lock(name)
        .kind(LockKind::Fair)
        .owner(random_owner())
        .try_once()
        .acquire()
        .await
        .expect("the first holder");
    let mut line = std::collections::VecDeque::new();
    for _ in 0..2 {
        line.push_back(holding_waiter(&client, name, Some(&random_owner())).await);
    }
    let mut offsets = Vec::new();
    for _round in 0..6 {
        holder.release().await.unwrap();
        let next = line.pop_front().unwrap();
        holder = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
        let named = random_owner();
        line.push_back(holding_waiter(&client, name, Some(&named)).await);
        offsets.push((deadline_of(&redis, &timeouts, &named) - redis.now_ms()) / 1000);
    }
    // Past several refreshes: the head's own refreshes, with nobody ahead, leave it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let in_line = queue_of(&redis, &queue);
    let head_left = (deadline_of(&redis, &timeouts, &in_line[0]) - redis.now_ms()) / 1000;
    for task in line {
        task.abort();
        let _ = task.await;
    }
    holder.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let exists = redis.cli(&["EXISTS", &queue, &timeouts, name]);
    assert_eq!(exists.trim(), "0", "left: {:?}", redis.cli(&["KEYS", "*"]));
    assert!(
        offsets.last().unwrap() - offsets[0] < 120 && head_left < 400,
        "each named owner joining, s from now: {offsets:?}; the head, first in line with \
         nobody ahead for 1.5 s of refreshes, keeps {head_left} s"
    );
}

/// A server dies with its waiter first in line, a named owner shaped like Redisson's
/// ids that had nobody ahead at its last refreshes: README.md says it is dropped
/// `--fair-wait-timeout` (2 s) after its last refresh. It joined behind another such
/// owner (5 min past that one's deadline), and since such an entry is never lowered
/// (keep_place), its refreshes at the head kept that deadline: the waiter behind it
/// waits five minutes for the free lock.
#[tokio::test]
async fn a_crashed_servers_redisson_shaped_owner_at_the_head_blocks_past_its_wait_timeout() {
    let redis = RedisServer::start();
    let args = ["--fair-wait-timeout", "2s"];
    let mut argv = vec!["--redis-url".to_owned(), redis.url(), "--no-metrics".to_owned()];
    argv.extend(args.iter().map(|a| a.to_string()));
    let mut process = latchkey_tests::LatchkeyProcess::spawn(&argv);
    let server = Latchkey::start_with(&redis.url(), &args).await;
    let client = server.client().await;
    let remote = Client::connect(&process.endpoint()).await.expect("connect to the process");
    let name = "crash-named";
    let keys = Keys::default().lock(name);
    let (queue, timeouts) = (keys.queue(), keys.timeouts());
    let holder = client.lock(name).kind(LockKind::Fair).acquire().await.unwrap();
    let first = holding_waiter(&client, name, Some(&random_owner())).await;
    let doomed_owner = random_owner();
    let doomed = holding_waiter(&remote, name, Some(&doomed_owner)).await;
    holder.release().await.unwrap();
    let first = tokio::time::timeout(T, first).await.expect("granted").unwrap();
    let survivor = holding_waiter(&client, name, None).await;
    // The doomed owner is first in line, nobody ahead: its server refreshes it twice.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(queue_of(&redis, &queue)[0], doomed_owner);
    let left = deadline_of(&redis, &timeouts, &doomed_owner) - redis.now_ms();
    process.kill();
    let killed = Instant::now();
    first.release().await.unwrap();
    let granted = tokio::time::timeout(Duration::from_secs(8), survivor).await;
    let took = killed.elapsed();
    doomed.abort();
    let _ = doomed.await;
    match granted {
        Ok(lease) => lease.unwrap().release().await.unwrap(),
        Err(_) => {
            redis.cli(&["DEL", &queue, &timeouts]);
            panic!(
                "the waiter behind the crashed server's owner was not granted within 8 s \
                 ({took:?}); that owner's deadline was {left} ms out at the kill"
            );
        }
    }
}
