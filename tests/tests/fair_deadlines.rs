//! The fair queue's deadlines over time, with Redisson's fair-lock scripts at their
//! default 5 min wait and named owners shaped like Redisson's ids (`uuid:threadId`):
//! a latchkey waiter takes its own wait plus one Redisson wait for each entry ahead that
//! Redisson may have queued, each such entry granted or giving up gives that wait back
//! to the latchkey waiters behind it, so deadlines stay level in a queue that
//! never empties, and a crashed server's waiter blocks a free lock no longer than its
//! wait timeout once nothing of Redisson's stands ahead of it.

use latchkey_client::LockKind;
use latchkey_server::keys::Keys;
use latchkey_tests::redisson::{random_owner, RedissonFairLock};
use latchkey_tests::server::{holding_fair_waiter, Latchkey};
use latchkey_tests::{poll_until, redis_client, LatchkeyProcess, RedisServer};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Bound on anything that should happen promptly.
const T: Duration = Duration::from_secs(10);
/// Redisson's default `fairLockWaitTimeout`.
const REDISSON_WAIT_MS: i64 = 300_000;
/// The servers' `--fair-wait-timeout`.
const ARGS: [&str; 2] = ["--fair-wait-timeout", "2s"];

/// Tries as a Redisson client polling its fair lock until it is granted (bounded).
async fn redisson_takes(java: &RedissonFairLock) {
    let deadline = Instant::now() + T;
    while java.try_lock(30_000).await.is_some() {
        assert!(
            Instant::now() < deadline,
            "the Redisson waiter {} is granted",
            java.owner()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The queue and deadline keys of `name`.
fn queue_keys(name: &str) -> (String, String) {
    let keys = Keys::default().lock(name);
    (keys.queue(), keys.timeouts())
}

/// `member`'s deadline in `timeouts` less Redis' clock (ms), read in one step, or None
/// when it is not queued.
fn left_ms(redis: &RedisServer, timeouts: &str, member: &str) -> Option<i64> {
    let script = "local s = redis.call('zscore', KEYS[1], ARGV[1]) \
        if not s then return 'absent' end \
        local t = redis.call('time') \
        return tostring(tonumber(s) - (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))";
    let out = redis.cli(&["EVAL", script, "1", timeouts, member]);
    out.trim().parse::<f64>().ok().map(|v| v as i64)
}

/// A server started as its own process with `ARGS` (to be killed), and a client of it.
async fn remote_server(redis: &RedisServer) -> (LatchkeyProcess, latchkey_client::Client) {
    let mut argv = vec!["--redis-url".to_owned(), redis.url(), "--no-metrics".to_owned()];
    argv.extend(ARGS.iter().map(|a| a.to_string()));
    let process = LatchkeyProcess::spawn(&argv);
    let client = latchkey_client::Client::connect(&process.endpoint()).await.unwrap();
    (process, client)
}

/// A Redis and a latchkey server with `ARGS` on it, and a client of the server.
async fn one_server() -> (RedisServer, Latchkey, latchkey_client::Client) {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &ARGS).await;
    let client = server.client().await;
    (redis, server, client)
}

/// Ends the test's waiters in `line` and releases `holder`: nothing of the queue is
/// left.
async fn leave_all(
    redis: &RedisServer,
    name: &str,
    line: impl IntoIterator<Item = tokio::task::JoinHandle<latchkey_client::Lease>>,
    holder: latchkey_client::Lease,
) {
    for task in line {
        task.abort();
        let _ = task.await;
    }
    holder.release().await.unwrap();
    assert_queue_gone(redis, name).await;
}

/// After the test's waiters left: nothing of the queue is left.
async fn assert_queue_gone(redis: &RedisServer, name: &str) {
    let (queue, timeouts) = queue_keys(name);
    let gone = poll_until(T, || redis.cli(&["EXISTS", &queue, &timeouts, name]).trim() == "0").await;
    assert!(gone, "queue keys left: {:?}", redis.cli(&["KEYS", "*"]));
}

/// Redisson and latchkey waiters alternating in a fair queue that never empties (a hot
/// lock shared by a Java service and latchkey clients). A latchkey grant gave nothing
/// back, so each round left the newest Redisson waiter five minutes further out than
/// the one before (1 229 s, 1 529 s, …), and a Java client dying while queued blocked
/// the free lock that long.
#[tokio::test]
async fn redisson_and_latchkey_waiters_alternating_keep_deadlines_level() {
    let (redis, _server, client) = one_server().await;
    let conn = redis_client(&redis.url()).await;
    let name = "alternate";
    let (queue, timeouts) = queue_keys(name);
    let java = || RedissonFairLock::new(&conn, name, &random_owner()).with_thread_wait(REDISSON_WAIT_MS);
    let mut holder = client
        .lock(name)
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .unwrap();
    // Queue: R1 L1 R2 L2 behind the latchkey holder.
    let (mut javas, mut ours, mut arrival) = (VecDeque::new(), VecDeque::new(), Vec::new());
    for _ in 0..2 {
        let r = java();
        assert!(r.try_lock(30_000).await.is_some(), "a Redisson waiter queues");
        arrival.push(r.owner().to_owned());
        javas.push_back(r);
        ours.push_back(holding_fair_waiter(&client, name, None).await);
        arrival.push(redis.list(&queue).last().unwrap().clone());
    }
    let (mut granted, mut offsets) = (Vec::new(), Vec::new());
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
        offsets.push((redis.score(&timeouts, newest.owner()) - redis.now_ms()) / 1000);
        javas.push_back(newest);
        ours.push_back(holding_fair_waiter(&client, name, None).await);
        arrival.push(redis.list(&queue).last().unwrap().clone());
        // The Redisson holder unlocks: the latchkey waiter next in line is granted.
        assert_eq!(r.unlock().await, Some(true));
        let next = ours.pop_front().unwrap();
        holder = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
        granted.push(holder.owner().to_owned());
    }
    assert_eq!(granted, arrival[..granted.len()], "granted in arrival order");
    for task in ours {
        task.abort();
        let _ = task.await;
    }
    for r in &javas {
        r.acquire_failed(REDISSON_WAIT_MS).await;
    }
    holder.release().await.unwrap();
    assert_queue_gone(&redis, name).await;
    assert!(
        offsets.last().unwrap() - offsets[0] < 120,
        "the newest Redisson waiter's deadline, round by round (s from now): {offsets:?}"
    );
}

/// latchkey alone, named owners shaped like Redisson's ids (which may be Redisson
/// waiters) alternating with streams' own waiters in a queue that never empties: each
/// named owner joining was five minutes further out than the one before, as no latchkey
/// grant took the wait it had added off.
#[tokio::test]
async fn redisson_shaped_owners_alternating_keep_deadlines_level() {
    let (redis, _server, client) = one_server().await;
    let name = "named-alternate";
    let (queue, timeouts) = queue_keys(name);
    let mut holder = client
        .lock(name)
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .unwrap();
    let mut line = VecDeque::new();
    for _ in 0..2 {
        line.push_back(holding_fair_waiter(&client, name, Some(&random_owner())).await);
        line.push_back(holding_fair_waiter(&client, name, None).await);
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
        line.push_back(holding_fair_waiter(&client, name, Some(&named)).await);
        offsets.push((redis.score(&timeouts, &named) - redis.now_ms()) / 1000);
        line.push_back(holding_fair_waiter(&client, name, None).await);
    }
    let now = redis.now_ms();
    let left: Vec<i64> = redis
        .list(&queue)
        .iter()
        .map(|o| (redis.score(&timeouts, o) - now) / 1000)
        .collect();
    leave_all(&redis, name, line, holder).await;
    assert!(
        offsets.last().unwrap() - offsets[0] < 120,
        "each named owner joining, s from now: {offsets:?}; the queue at the end (s left): {left:?}"
    );
}

/// A hot queue of named owners shaped like Redisson's ids, latchkey alone: newcomers'
/// deadlines climbed five minutes a grant, and the waiter at the head kept the deadline
/// it joined with (such an entry was never lowered) though nobody was ahead of it.
#[tokio::test]
async fn a_hot_queue_of_redisson_shaped_owners_keeps_deadlines_level() {
    let (redis, _server, client) = one_server().await;
    let name = "named-hot";
    let (queue, timeouts) = queue_keys(name);
    let mut holder = client
        .lock(name)
        .kind(LockKind::Fair)
        .owner(random_owner())
        .try_once()
        .acquire()
        .await
        .unwrap();
    let mut line = VecDeque::new();
    for _ in 0..2 {
        line.push_back(holding_fair_waiter(&client, name, Some(&random_owner())).await);
    }
    let mut offsets = Vec::new();
    for _round in 0..6 {
        holder.release().await.unwrap();
        let next = line.pop_front().unwrap();
        holder = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
        let named = random_owner();
        line.push_back(holding_fair_waiter(&client, name, Some(&named)).await);
        offsets.push((redis.score(&timeouts, &named) - redis.now_ms()) / 1000);
    }
    // The head, nobody ahead of it, comes back to its own wait at its next refresh.
    let head = redis.list(&queue)[0].clone();
    let back = poll_until(T, || redis.score(&timeouts, &head) - redis.now_ms() <= 2_500).await;
    let head_left = redis.score(&timeouts, &head) - redis.now_ms();
    leave_all(&redis, name, line, holder).await;
    assert!(back, "the head keeps {head_left} ms with nobody ahead");
    assert!(
        offsets.last().unwrap() - offsets[0] < 120,
        "each named owner joining, s from now: {offsets:?}"
    );
}

/// A server dies with its waiter first in line, a named owner shaped like Redisson's ids
/// that had nobody ahead at its last refreshes: the waiter behind it is granted within
/// the wait timeout (2 s). It had joined five minutes past another such owner and kept
/// that at the head, and the waiter behind it waited five minutes.
#[tokio::test]
async fn a_crashed_servers_redisson_shaped_owner_at_the_head_blocks_only_its_wait_timeout() {
    let redis = RedisServer::start();
    let (mut process, remote) = remote_server(&redis).await;
    let server = Latchkey::start_with(&redis.url(), &ARGS).await;
    let client = server.client().await;
    let name = "crash-named";
    let (queue, timeouts) = queue_keys(name);
    let holder = client.lock(name).kind(LockKind::Fair).acquire().await.unwrap();
    let first = holding_fair_waiter(&client, name, Some(&random_owner())).await;
    let doomed_owner = random_owner();
    let doomed = holding_fair_waiter(&remote, name, Some(&doomed_owner)).await;
    holder.release().await.unwrap();
    let first = tokio::time::timeout(T, first).await.expect("granted").unwrap();
    let survivor = holding_fair_waiter(&client, name, None).await;
    // The doomed owner is first in line, nobody ahead: its next refresh brings it back.
    assert_eq!(redis.list(&queue)[0], doomed_owner);
    let back = poll_until(T, || redis.score(&timeouts, &doomed_owner) - redis.now_ms() <= 2_500).await;
    assert!(
        back,
        "{} ms out",
        redis.score(&timeouts, &doomed_owner) - redis.now_ms()
    );
    process.kill();
    let killed = Instant::now();
    first.release().await.unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(5), survivor)
        .await
        .expect("the waiter behind the crashed server's owner is granted within its wait timeout")
        .unwrap();
    assert!(killed.elapsed() < Duration::from_secs(5), "{:?}", killed.elapsed());
    lease.release().await.unwrap();
    doomed.abort();
    let _ = doomed.await;
    assert_queue_gone(&redis, name).await;
}

/// Latchkey waiters of two servers behind a named owner shaped like Redisson's ids and
/// between Redisson waiters: the named owner gives up and the waiter behind it comes
/// back to its own wait while the Redisson waiter behind that keeps its deadline; each
/// Redisson grant (5 min off every deadline) leaves every waiter queued; all are granted
/// in arrival order across both servers, and nothing is left in Redis.
#[tokio::test]
async fn latchkey_waiters_between_redisson_waiters_keep_their_turn() {
    let redis = RedisServer::start();
    let a = Latchkey::start_with(&redis.url(), &ARGS).await;
    let b = Latchkey::start_with(&redis.url(), &ARGS).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let conn = redis_client(&redis.url()).await;
    let name = "between";
    let (queue, timeouts) = queue_keys(name);
    let java = || RedissonFairLock::new(&conn, name, &random_owner()).with_thread_wait(REDISSON_WAIT_MS);
    let holder = java();
    assert_eq!(holder.try_lock(30_000).await, None, "a Redisson client holds");
    let named = holding_fair_waiter(&ca, name, Some(&random_owner())).await;
    let l1 = holding_fair_waiter(&cb, name, None).await;
    let r1 = java();
    assert!(r1.try_lock(30_000).await.is_some());
    let l2 = holding_fair_waiter(&ca, name, None).await;
    let r2 = java();
    assert!(r2.try_lock(30_000).await.is_some());
    let l3 = holding_fair_waiter(&cb, name, None).await;
    let line = redis.list(&queue);
    assert_eq!(line.len(), 6, "{line:?}");
    let d = |o: &str| redis.score(&timeouts, o);
    let now = redis.now_ms();
    // Each latchkey waiter counts a Redisson wait for each such entry ahead of it.
    for (at, ahead) in [(1, 1), (3, 2), (5, 3)] {
        let left = d(&line[at]) - now;
        let counted = REDISSON_WAIT_MS * ahead;
        assert!(
            (counted..counted + 2_500).contains(&left),
            "{}: {left} ms left, {ahead} ahead",
            line[at]
        );
    }
    let r1_before = d(r1.owner());

    // The named owner gives up: those behind it get its wait back; R1 keeps its place.
    named.abort();
    let _ = named.await;
    let lowered = poll_until(T, || d(&line[1]) - redis.now_ms() <= 2_500).await;
    assert!(lowered, "L1 lowered: {} ms out", d(&line[1]) - redis.now_ms());
    assert!(d(r1.owner()) > redis.now_ms() + 60_000, "R1 keeps minutes");
    assert!(
        d(r1.owner()) >= r1_before - REDISSON_WAIT_MS,
        "R1 got one wait back at most"
    );

    let mut granted = Vec::new();
    assert_eq!(holder.unlock().await, Some(true));
    let lease = tokio::time::timeout(T, l1).await.expect("L1 granted").unwrap();
    granted.push(lease.owner().to_owned());
    lease.release().await.unwrap();
    for (r, next) in [(r1, l2), (r2, l3)] {
        redisson_takes(&r).await;
        granted.push(r.owner().to_owned());
        let now = redis.now_ms();
        for owner in redis.list(&queue) {
            let left = d(&owner) - now;
            assert!(
                left > 1_000,
                "{owner} keeps its place after a Redisson grant: {left} ms left"
            );
        }
        // Past a refresh: the latchkey waiter at the head is still in place.
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(r.unlock().await, Some(true));
        let lease = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
        granted.push(lease.owner().to_owned());
        lease.release().await.unwrap();
    }
    assert_eq!(granted, line[1..], "granted in arrival order");
    assert_queue_gone(&redis, name).await;
}

/// `name` taken as a fair lock at once (tried once).
async fn fair_held(client: &latchkey_client::Client, name: &str) -> latchkey_client::Lease {
    client
        .lock(name)
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .unwrap()
}

/// A fair lock on a server of its own, held by a latchkey stream (tried once), with
/// three queued behind it in this order: a latchkey stream named `named`, shaped like
/// Redisson's ids, a Redisson waiter at Redisson's default wait (`java`), and a
/// latchkey stream of its own owner (`behind`).
struct ShapedLine {
    redis: RedisServer,
    _server: Latchkey,
    queue: String,
    timeouts: String,
    named: String,
    java: RedissonFairLock,
    behind: tokio::task::JoinHandle<latchkey_client::Lease>,
}

impl ShapedLine {
    /// The line, the holder's lease, and the named owner's wait.
    async fn start(
        name: &str,
    ) -> (
        Self,
        latchkey_client::Lease,
        tokio::task::JoinHandle<latchkey_client::Lease>,
    ) {
        let (redis, _server, client) = one_server().await;
        let conn = redis_client(&redis.url()).await;
        let (queue, timeouts) = queue_keys(name);
        let holder = fair_held(&client, name).await;
        let named = random_owner();
        let first = holding_fair_waiter(&client, name, Some(&named)).await;
        let java = RedissonFairLock::new(&conn, name, &random_owner()).with_thread_wait(REDISSON_WAIT_MS);
        assert!(java.try_lock(30_000).await.is_some(), "the Redisson waiter queues");
        let behind = holding_fair_waiter(&client, name, None).await;
        let line = Self {
            redis,
            _server,
            queue,
            timeouts,
            named,
            java,
            behind,
        };
        (line, holder, first)
    }

    /// How long the Redisson waiter's deadline is ahead of Redis' clock (ms).
    fn java_left(&self) -> Option<i64> {
        left_ms(&self.redis, &self.timeouts, self.java.owner())
    }

    /// The queue, and the Redisson waiter's deadline, 3 s on: a little longer than
    /// `--fair-wait-timeout`, while the latchkey waiter behind refreshes.
    async fn three_seconds_on(&self) -> (Vec<String>, Option<i64>) {
        tokio::time::sleep(Duration::from_millis(3_000)).await;
        (self.redis.list(&self.queue), self.java_left())
    }

    /// Ends the waiter behind and the Redisson waiter, and releases `lease`.
    async fn end(self, lease: latchkey_client::Lease) {
        self.behind.abort();
        let _ = self.behind.await;
        self.java.acquire_failed(REDISSON_WAIT_MS).await;
        lease.release().await.unwrap();
    }
}

/// Asserts the Redisson waiter `java` heads `line`, quoting its deadline (ms from now)
/// before and right after `what`, and 3 s later.
fn assert_java_heads(line: &[String], java: &str, what: &str, deadlines: [Option<i64>; 3]) {
    let [before, after, later] = deadlines;
    assert!(
        line.first().map(String::as_str) == Some(java),
        "the live Redisson waiter was swept out of its turn: queue {line:?}; its \
         deadline (ms from now) before {what} {before:?}, right after {after:?}, \
         3 s later {later:?}"
    );
}

/// A Redisson waiter queued right behind a latchkey stream whose `owner` is shaped like
/// Redisson's ids keeps its turn when latchkey grants that owner the lock and it holds
/// longer than `--fair-wait-timeout`. The grant took a Redisson wait off every deadline
/// behind, as Redisson's grant does; but the owner, refreshed with nobody ahead, was
/// only its own wait out, the Redisson waiter five minutes past that, and so it was
/// left seconds, swept out, and overtaken by the latchkey waiter behind it.
#[tokio::test]
async fn a_redisson_waiter_behind_a_granted_redisson_shaped_owner_keeps_its_turn() {
    let (line, holder, first) = ShapedLine::start("granted-shaped").await;
    let queued = line.redis.list(&line.queue);
    assert_eq!(queued.len(), 3, "{queued:?}");
    assert_eq!(queued[1], line.java.owner());
    let before = line.java_left();

    holder.release().await.unwrap();
    let first = tokio::time::timeout(T, first)
        .await
        .expect("the named owner granted")
        .unwrap();
    let after_grant = line.java_left();
    let (line_then, left_then) = line.three_seconds_on().await;
    let java = line.java.owner().to_owned();
    line.end(first).await;

    assert_java_heads(&line_then, &java, "the grant", [before, after_grant, left_then]);
}

/// The same when that owner gives up (fair_leave.lua, as Redisson's acquireFailed).
#[tokio::test]
async fn a_redisson_waiter_behind_a_redisson_shaped_owner_that_gives_up_keeps_its_turn() {
    let (line, holder, first) = ShapedLine::start("leaving-shaped").await;
    let before = line.java_left();

    // The named owner gives up.
    first.abort();
    let _ = first.await;
    let left = poll_until(T, || !line.redis.list(&line.queue).contains(&line.named)).await;
    assert!(left, "the named owner left the queue");
    let after_leave = line.java_left();
    let (line_then, left_then) = line.three_seconds_on().await;
    let java = line.java.owner().to_owned();
    line.end(holder).await;

    assert_java_heads(&line_then, &java, "the give-up", [before, after_leave, left_then]);
}

/// With `--sync-replicas`, a grant to a Redisson-shaped owner that no replica
/// acknowledges is given back and the owner put back at the head, then granted again.
/// Each grant gave a Redisson wait back to the latchkey waiters behind, and the owner
/// put back at the head took none: the waiter behind, which counted the owner once,
/// went five minutes below Redis' clock at each round, to be swept out of its turn.
#[tokio::test]
async fn a_synced_redisson_shaped_owners_given_back_grant_gives_its_wait_back_once() {
    let (primary, replica) = RedisServer::with_replica().await;
    let flags = [
        "--sync-replicas",
        "1",
        "--sync-timeout",
        "1s",
        "--redis-timeout",
        "500ms",
        "--fair-wait-timeout",
        "5s",
    ];
    let server = Latchkey::start_with(&primary.url(), &flags).await;
    let client = server.client().await;
    let name = "synced-shaped";
    let (queue, timeouts) = queue_keys(name);
    let holder = client.lock(name).kind(LockKind::Fair).acquire().await.unwrap();
    let named = random_owner();
    let first = holding_fair_waiter(&client, name, Some(&named)).await;
    let behind = holding_fair_waiter(&client, name, None).await;
    let line = primary.list(&queue);
    assert_eq!(line.len(), 2, "{line:?}");
    let behind_owner = line[1].clone();

    replica.freeze();
    holder.release().await.unwrap();
    // Two or three give-backs of the named owner's grant (one each --sync-timeout).
    let watch = Instant::now();
    let (mut lowest, mut absent) = (i64::MAX, 0);
    while watch.elapsed() < Duration::from_millis(3_500) {
        match left_ms(&primary, &timeouts, &behind_owner) {
            Some(left) => lowest = lowest.min(left),
            None => absent += 1,
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    replica.resume();
    let first = tokio::time::timeout(T, first)
        .await
        .expect("the named owner granted")
        .unwrap();
    let line_after = primary.list(&queue);
    first.release().await.unwrap();
    let lease = tokio::time::timeout(T, behind)
        .await
        .expect("the waiter behind granted")
        .unwrap();
    lease.release().await.unwrap();

    assert!(
        lowest > 0 && absent == 0,
        "the live waiter behind the named owner had its deadline {lowest} ms from Redis' \
         now at its lowest, and was out of the queue in {absent} samples (queue once the \
         replica answered: {line_after:?})"
    );
}

/// A queue whose end a Redisson-shaped owner once held (no lifetime, as Redisson's
/// queues) gets one back once latchkey's waiters are last, and goes once they crash:
/// a lifetime was given back only to a queue the script had just created, so it stayed
/// for good on a lock nobody touched again.
#[tokio::test]
async fn a_queue_once_ended_by_a_redisson_shaped_owner_expires_after_its_waiters_crash() {
    let (redis, _server, client) = one_server().await;
    let (mut process, remote) = remote_server(&redis).await;
    let name = "persisted-queue";
    let (queue, timeouts) = queue_keys(name);
    let holder = fair_held(&client, name).await;
    let mut doomed = vec![holding_fair_waiter(&remote, name, None).await];
    let named = random_owner();
    let passing = holding_fair_waiter(&client, name, Some(&named)).await;
    doomed.push(holding_fair_waiter(&remote, name, None).await);
    doomed.push(holding_fair_waiter(&remote, name, None).await);
    // The named owner leaves: latchkey's own waiters alone remain, refreshed.
    passing.abort();
    let _ = passing.await;
    assert!(poll_until(T, || !redis.list(&queue).contains(&named)).await);
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let ttl_alive = redis.cli(&["PTTL", &queue]).trim().to_owned();
    // Their server crashes; the holder lets go at once (the crashed waiters' deadlines
    // have not passed yet), and nobody uses the lock again.
    process.kill();
    holder.release().await.unwrap();
    for task in doomed {
        task.abort();
        let _ = task.await;
    }
    let gone = poll_until(Duration::from_secs(12), || {
        redis.cli(&["EXISTS", &queue, &timeouts]).trim() == "0"
    })
    .await;
    assert!(
        gone,
        "queue of crashed latchkey waiters left for good: {:?}, PTTL {} (while its \
         waiters still refreshed: {ttl_alive})",
        redis.list(&queue),
        redis.cli(&["PTTL", &queue]).trim()
    );
}

/// A latchkey waiter behind a crashed server's entry whose deadline passed keeps
/// counting the Redisson waiter further ahead. Its refresh took the dead entry's past
/// deadline for a live one's and counted nothing ahead, so the Redisson waiter's grant
/// (which takes five minutes off every deadline behind it) left the live waiter's
/// deadline minutes past: swept out at the next script, it queued again behind a
/// newcomer.
#[tokio::test]
async fn a_waiter_behind_a_dead_entry_keeps_counting_the_redisson_waiter_ahead() {
    let (redis, _server, client) = one_server().await;
    let conn = redis_client(&redis.url()).await;
    let name = "behind-a-dead-entry";
    let (queue, timeouts) = queue_keys(name);
    let java = || RedissonFairLock::new(&conn, name, &random_owner()).with_thread_wait(REDISSON_WAIT_MS);
    let holder = java();
    assert_eq!(holder.try_lock(30_000).await, None, "a Redisson client holds");
    let ahead = java();
    assert!(ahead.try_lock(30_000).await.is_some(), "a Redisson waiter queues");
    let (mut crashing, crashing_client) = remote_server(&redis).await;
    let dead = holding_fair_waiter(&crashing_client, name, None).await;
    let live = holding_fair_waiter(&client, name, None).await;
    let line = redis.list(&queue);
    assert_eq!(line.len(), 3, "{line:?}");
    let d = |o: &str| redis.score(&timeouts, o);
    assert!(
        d(&line[2]) - redis.now_ms() > REDISSON_WAIT_MS - 10_000,
        "the Redisson waiter counted"
    );
    // The dead entry's server crashed long ago: its deadline has passed.
    crashing.kill();
    dead.abort();
    redis.cli(&["ZADD", &timeouts, &(redis.now_ms() - 1).to_string(), &line[1]]);
    let before = d(&line[2]);
    assert!(
        poll_until(T, || d(&line[2]) != before).await,
        "the live waiter refreshes"
    );
    assert_eq!(holder.unlock().await, Some(true));
    redisson_takes(&ahead).await;
    let left = d(&line[2]) - redis.now_ms();
    assert!(
        left > 0,
        "the live waiter's deadline passed at the Redisson grant: {left} ms"
    );
    let newcomer = holding_fair_waiter(&client, name, None).await;
    assert_eq!(ahead.unlock().await, Some(true));
    let lease = tokio::time::timeout(T, live).await.expect("granted in turn").unwrap();
    assert!(!newcomer.is_finished(), "the newcomer went first");
    lease.release().await.unwrap();
    let lease = tokio::time::timeout(T, newcomer).await.expect("granted next").unwrap();
    lease.release().await.unwrap();
    assert_queue_gone(&redis, name).await;
}
