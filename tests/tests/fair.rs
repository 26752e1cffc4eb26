//! The fair lock (`LOCK_KIND_FAIR`, Redisson's `RFairLock` layout) end to end: strict
//! FIFO grants across server replicas and on a cluster, queue positions, waiters that
//! leave or crash, try-once, reentrancy, fencing, and interoperation with Redisson's
//! fair-lock scripts on the same Redis.

use latchkey_client::{Client, Error, Lease, LockKind, LockState};
use latchkey_server::keys::Keys;
use latchkey_tests::proxy::Proxy;
use latchkey_tests::redisson::{random_owner, scripts, PublishCommand, RedissonFairLock};
use latchkey_tests::server::{holding_fair_waiter, spawn_queued, Latchkey};
use latchkey_tests::{poll_until, redis_client, LatchkeyProcess, RedisCluster, RedisServer};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Code;

/// Bound on anything that should happen promptly but is not timed by the spec.
const T: Duration = Duration::from_secs(10);
/// How long a queued test waiter waits for its grant.
const WAIT: Duration = Duration::from_secs(20);

/// The grants in the order `acquire()` returned: (owner, fencing token).
type Grants = Arc<Mutex<Vec<(String, u64)>>>;

/// Polls Describe every 20 ms until `pred` holds; panics after `limit` with the last state.
async fn wait_state(client: &Client, name: &str, limit: Duration, pred: impl Fn(&LockState) -> bool) -> LockState {
    let deadline = Instant::now() + limit;
    loop {
        let state = client.describe(name).await.expect("describe");
        if pred(&state) {
            return state;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: condition not met within {limit:?}: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The owners Describe lists as waiters, in order.
fn waiter_owners(state: &LockState) -> Vec<String> {
    state.waiters.iter().map(|w| w.owner.clone()).collect()
}

/// Starts a fair waiter as `owner` (its stream's own when empty) that records its grant
/// in `grants` and releases at once; returns its task and the position of its `Queued`
/// event, once queued.
async fn queue_waiter(client: Client, name: &str, owner: String, grants: Grants) -> (JoinHandle<()>, u32) {
    let (tx, rx) = oneshot::channel();
    let mut tx = Some(tx);
    let name = name.to_owned();
    let task = tokio::spawn(async move {
        let mut lock = client.lock(name).kind(LockKind::Fair).wait(WAIT);
        if !owner.is_empty() {
            lock = lock.owner(owner.clone());
        }
        let lease = lock
            .on_queued(move |q| {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(q.position);
                }
            })
            .acquire()
            .await
            .unwrap_or_else(|err| panic!("fair waiter {owner} acquires: {err}"));
        grants
            .lock()
            .unwrap()
            .push((lease.owner().to_owned(), lease.fencing_token()));
        lease.release().await.expect("waiter releases");
    });
    let position = tokio::time::timeout(T, rx)
        .await
        .expect("the waiter is queued in time")
        .expect("the waiter got a Queued event before ending");
    (task, position)
}

/// A holder holds; `n` waiters queue one after another, alternating over `servers`;
/// released one by one, they are granted in exactly arrival order with increasing
/// fencing tokens.
async fn assert_fifo(servers: &[&Latchkey], name: &str, n: usize) {
    let mut clients = Vec::new();
    for server in servers {
        clients.push(server.client().await);
    }
    let holder = clients[0]
        .lock(name)
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .expect("holder");
    let grants: Grants = Arc::default();
    let mut tasks = Vec::new();
    let mut arrival = Vec::new();
    for i in 0..n {
        let owner = format!("fifo-{i}:1");
        let client = clients[i % clients.len()].clone();
        let (task, position) = queue_waiter(client, name, owner.clone(), grants.clone()).await;
        assert_eq!(position as usize, i + 1, "queued position of waiter {i}");
        tasks.push(task);
        arrival.push(owner);
    }
    let state = clients[0].describe(name).await.unwrap();
    assert_eq!(state.kind(), LockKind::Fair, "{state:?}");
    assert!(state.locked);
    assert_eq!(waiter_owners(&state), arrival, "Describe lists the waiters in order");
    let positions: Vec<u32> = state.waiters.iter().map(|w| w.position).collect();
    assert_eq!(positions, (1..=n as u32).collect::<Vec<_>>());
    assert!(state.last_fencing_token >= holder.fencing_token());
    let holder_token = holder.fencing_token();

    holder.release().await.unwrap();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("every waiter is granted in time")
            .expect("waiter task");
    }
    let grants = grants.lock().unwrap().clone();
    let order: Vec<String> = grants.iter().map(|(o, _)| o.clone()).collect();
    assert_eq!(order, arrival, "granted in arrival order");
    let mut last = holder_token;
    for (owner, token) in &grants {
        assert!(*token > last, "{owner}'s token {token} follows {last}");
        last = *token;
    }
}

#[tokio::test]
async fn waiters_on_two_servers_are_granted_in_arrival_order() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    assert_fifo(&[&a, &b], "fifo", 12).await;
    assert_eq!(redis.cli(&["LLEN", "redisson_lock_queue:{fifo}"]).trim(), "0");
    assert_eq!(redis.cli(&["EXISTS", "fifo"]).trim(), "0");
}

#[tokio::test]
async fn cluster_grants_in_arrival_order() {
    let cluster = RedisCluster::start(3, 0);
    let server = Latchkey::start(&cluster.url()).await;
    assert_fifo(&[&server], "fifo-cluster", 6).await;
}

#[tokio::test]
async fn the_queue_lives_in_redissons_keys() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let holder = client
        .lock("layout")
        .kind(LockKind::Fair)
        .owner("holder:1")
        .acquire()
        .await
        .unwrap();
    assert_eq!(redis.cli(&["HGET", "layout", "holder:1"]).trim(), "1");
    let grants: Grants = Arc::default();
    let (w1, _) = queue_waiter(client.clone(), "layout", "w:1".into(), grants.clone()).await;
    let (w2, _) = queue_waiter(client.clone(), "layout", "w:2".into(), grants.clone()).await;
    assert_eq!(
        redis.cli(&["LRANGE", "redisson_lock_queue:{layout}", "0", "-1"]).trim(),
        "w:1\nw:2"
    );
    // Each waiter has a deadline in the timeout set, in Redis time (ms), in the future.
    let now_ms = redis.now_ms();
    for owner in ["w:1", "w:2"] {
        let score: f64 = redis
            .cli(&["ZSCORE", "redisson_lock_timeout:{layout}", owner])
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{owner} has a deadline"));
        assert!(
            score as i64 > now_ms,
            "{owner}'s deadline {score} is after now {now_ms}"
        );
    }
    holder.release().await.unwrap();
    for w in [w1, w2] {
        tokio::time::timeout(T, w).await.unwrap().unwrap();
    }
    assert_eq!(redis.cli(&["EXISTS", "redisson_lock_queue:{layout}"]).trim(), "0");
}

#[tokio::test]
async fn a_cancelled_waiter_leaves_the_queue_at_once() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let holder = client.lock("cancel").kind(LockKind::Fair).acquire().await.unwrap();
    let grants: Grants = Arc::default();
    let (a, pa) = queue_waiter(client.clone(), "cancel", "a:1".into(), grants.clone()).await;
    let (b, pb) = queue_waiter(client.clone(), "cancel", "b:1".into(), grants.clone()).await;
    assert_eq!((pa, pb), (1, 2));

    a.abort();
    let _ = a.await;
    let state = wait_state(&client, "cancel", Duration::from_secs(1), |s| {
        !s.waiters.iter().any(|w| w.owner == "a:1")
    })
    .await;
    assert_eq!(waiter_owners(&state), ["b:1"], "{state:?}");
    assert_eq!(state.waiters[0].position, 1, "b moved to the head");
    assert_eq!(
        redis.cli(&["LRANGE", "redisson_lock_queue:{cancel}", "0", "-1"]).trim(),
        "b:1"
    );

    let released_at = Instant::now();
    holder.release().await.unwrap();
    tokio::time::timeout(Duration::from_secs(1), b)
        .await
        .expect("b is granted within 1 s of the release")
        .unwrap();
    assert!(released_at.elapsed() < Duration::from_secs(1));
    assert_eq!(
        *grants.lock().unwrap().iter().map(|(o, _)| o).collect::<Vec<_>>(),
        ["b:1"]
    );
}

/// A cancelled waiter whose leave fails (Redis out of reach for a moment) leaves the
/// queue once Redis answers again, not when its place times out (20 s here): the
/// leave is tried again. It used to be tried once, and everyone behind it waited.
#[tokio::test]
async fn a_cancelled_waiter_whose_leave_failed_leaves_once_redis_answers() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let flags = ["--redis-timeout", "300ms", "--fair-wait-timeout", "20s"];
    let server = Latchkey::start_with(&proxy.redis_url(), &flags).await;
    let client = server.client().await;
    let holder = client.lock("retry-leave").kind(LockKind::Fair).acquire().await.unwrap();
    let grants: Grants = Arc::default();
    let (a, _) = queue_waiter(client.clone(), "retry-leave", "a:1".into(), grants.clone()).await;
    let (b, _) = queue_waiter(client.clone(), "retry-leave", "b:1".into(), grants.clone()).await;

    proxy.freeze();
    a.abort();
    let _ = a.await;
    // Past the leave's 300 ms timeout: it failed.
    tokio::time::sleep(Duration::from_millis(800)).await;
    proxy.thaw();
    let left = poll_until(Duration::from_secs(5), || {
        redis
            .cli(&["LRANGE", "redisson_lock_queue:{retry-leave}", "0", "-1"])
            .trim()
            == "b:1"
    })
    .await;
    assert!(
        left,
        "a is still queued: {}",
        redis.cli(&["LRANGE", "redisson_lock_queue:{retry-leave}", "0", "-1"])
    );
    holder.release().await.unwrap();
    tokio::time::timeout(Duration::from_secs(2), b)
        .await
        .expect("b is granted soon after the release")
        .unwrap();
    assert_eq!(
        *grants.lock().unwrap().iter().map(|(o, _)| o).collect::<Vec<_>>(),
        ["b:1"]
    );
}

/// A waiter behind a stream of a client-named owner (whose place, as a Redisson
/// waiter's, is not kept fresh) has a place that lasts 5 minutes: one that left while
/// Redis was away for longer than `--fair-wait-timeout` still leaves once Redis answers,
/// rather than stop trying and hold up everyone behind it for minutes.
#[tokio::test]
async fn a_leave_behind_a_named_owner_is_tried_until_redis_answers() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let flags = ["--redis-timeout", "300ms", "--fair-wait-timeout", "1s"];
    let direct = Latchkey::start_with(&redis.url(), &flags).await;
    let cut = Latchkey::start_with(&proxy.redis_url(), &flags).await;
    let client = direct.client().await;
    let holder = client.lock("stuck").kind(LockKind::Fair).acquire().await.unwrap();
    let grants: Grants = Arc::default();
    let (named, _) = queue_waiter(client.clone(), "stuck", "n:1".into(), grants.clone()).await;
    let (gone, at) = queue_waiter(cut.client().await, "stuck", "g:1".into(), grants.clone()).await;
    assert_eq!(at, 2);
    let (last, _) = queue_waiter(client.clone(), "stuck", "c:1".into(), grants.clone()).await;
    proxy.freeze();
    gone.abort();
    let _ = gone.await;
    // Past the fair wait timeout the leave was tried for.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    proxy.thaw();
    let queue = || redis.cli(&["LRANGE", "redisson_lock_queue:{stuck}", "0", "-1"]);
    let left = poll_until(Duration::from_secs(5), || queue().split_whitespace().eq(["n:1", "c:1"])).await;
    assert!(left, "the waiter that left is still queued: {}", queue());
    holder.release().await.unwrap();
    for task in [named, last] {
        tokio::time::timeout(T, task).await.expect("granted in turn").unwrap();
    }
    assert_eq!(granted(&grants), ["n:1", "c:1"]);
}

/// A try-once of an owner whose other stream waits in the fair queue, reset by its
/// client while its try is on the way to Redis, gives up nothing: the place is the
/// waiting stream's, which keeps it and is granted first.
#[tokio::test]
async fn a_try_once_cut_off_during_its_try_leaves_its_owners_place() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let direct = Latchkey::start(&redis.url()).await;
    // Its cut try gives up within 300 ms, long before the check below.
    let slow = Latchkey::start_with(&proxy.redis_url(), &["--redis-timeout", "300ms"]).await;
    let client = direct.client().await;
    let holder = client
        .lock("cut-try")
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .unwrap();
    let grants: Grants = Arc::default();
    let (first, _) = queue_waiter(client.clone(), "cut-try", "o:1".into(), grants.clone()).await;
    let (second, _) = queue_waiter(client.clone(), "cut-try", "c:1".into(), grants.clone()).await;
    let slow_client = slow.client().await;
    // The try-once's script is lost in the proxy: its outcome is unknown, and undone
    // once its call gives up (a failed try, whose owner's place is not the stream's).
    proxy.freeze();
    let before = proxy.dropped();
    let try_once = tokio::spawn(async move {
        slow_client
            .lock("cut-try")
            .kind(LockKind::Fair)
            .owner("o:1")
            .try_once()
            .acquire()
            .await
    });
    // The try's script is lost, not still on its way.
    let lost = poll_until(T, || proxy.dropped() > before).await;
    assert!(lost, "the try reached the proxy");
    try_once.abort();
    let _ = try_once.await;
    proxy.thaw();
    // Long enough for the cut call to give up and be undone.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let queue = redis.cli(&["LRANGE", "redisson_lock_queue:{cut-try}", "0", "-1"]);
    assert!(queue.split_whitespace().eq(["o:1", "c:1"]), "the queue: {queue}");
    holder.release().await.unwrap();
    for task in [first, second] {
        tokio::time::timeout(T, task).await.expect("granted in turn").unwrap();
    }
    assert_eq!(granted(&grants), ["o:1", "c:1"]);
}

/// A server process that will crash and an in-process one beside it, both with a 2 s
/// fair wait timeout, and a holder of the fair lock `crash` on the latter.
struct CrashRig {
    redis: RedisServer,
    process: LatchkeyProcess,
    /// A client of the process.
    remote: Client,
    _server: Latchkey,
    /// A client of the in-process server.
    client: Client,
    holder: latchkey_client::Lease,
}

impl CrashRig {
    async fn start() -> Self {
        let redis = RedisServer::start();
        let args = ["--fair-wait-timeout", "2s"];
        let mut argv = vec!["--redis-url".to_owned(), redis.url(), "--no-metrics".to_owned()];
        argv.extend(args.iter().map(|a| a.to_string()));
        let process = LatchkeyProcess::spawn(&argv);
        let server = Latchkey::start_with(&redis.url(), &args).await;
        let client = server.client().await;
        let holder = client.lock("crash").kind(LockKind::Fair).acquire().await.unwrap();
        let remote = Client::connect(&process.endpoint())
            .await
            .expect("connect to the process");
        Self {
            redis,
            process,
            remote,
            _server: server,
            client,
            holder,
        }
    }
}

#[tokio::test]
async fn a_crashed_replicas_waiter_blocks_the_queue_only_for_its_wait_timeout() {
    let CrashRig {
        redis: _redis,
        mut process,
        remote,
        _server,
        client,
        holder,
    } = CrashRig::start().await;

    let grants: Grants = Arc::default();
    let (doomed, p1) = queue_waiter(remote, "crash", "doomed:1".into(), grants.clone()).await;
    let (survivor, p2) = queue_waiter(client.clone(), "crash", "survivor:1".into(), grants.clone()).await;
    assert_eq!((p1, p2), (1, 2));

    let killed_at = Instant::now();
    process.kill();
    holder.release().await.unwrap();
    // The doomed waiter's deadline was refreshed at most 2 s before the kill.
    tokio::time::timeout(Duration::from_secs(5), survivor)
        .await
        .unwrap_or_else(|_| panic!("the survivor is granted within 2 s + 3 s of the crash"))
        .unwrap();
    let took = killed_at.elapsed();
    assert!(took < Duration::from_secs(5), "took {took:?}");
    doomed.abort();
    let _ = doomed.await;
    assert_eq!(
        *grants.lock().unwrap().iter().map(|(o, _)| o).collect::<Vec<_>>(),
        ["survivor:1"]
    );
}

/// A server with `--fair-wait-timeout 2s`, a holder of the fair lock `name`, a waiter
/// named `owner` queued first and `behind` waiters of their streams' own owners after it.
struct BehindNamed {
    redis: RedisServer,
    _server: Latchkey,
    _holder: latchkey_client::Lease,
    /// The waiters' owners, in line.
    owners: Vec<String>,
    tasks: Vec<JoinHandle<()>>,
}

impl BehindNamed {
    async fn start(name: &str, owner: String, behind: usize) -> Self {
        let redis = RedisServer::start();
        let server = Latchkey::start_with(&redis.url(), &["--fair-wait-timeout", "2s"]).await;
        let client = server.client().await;
        let holder = client.lock(name).kind(LockKind::Fair).acquire().await.unwrap();
        let grants: Grants = Arc::default();
        let mut tasks = vec![queue_waiter(client.clone(), name, owner, grants.clone()).await.0];
        for _ in 0..behind {
            tasks.push(
                queue_waiter(client.clone(), name, String::new(), grants.clone())
                    .await
                    .0,
            );
        }
        let owners = waiter_owners(&client.describe(name).await.unwrap());
        assert_eq!(owners.len(), behind + 1, "{owners:?}");
        Self {
            redis,
            _server: server,
            _holder: holder,
            owners,
            tasks,
        }
    }
}

/// Waiters behind a client-named owner shaped like Redisson's (which may be a Redisson
/// waiter) take one Redisson wait past it, not one more each, and only while it is
/// ahead: every waiter
/// behind one whose deadline lay further out than its own took that deadline and five
/// minutes more, so deadlines grew by five minutes a waiter in a queue that never
/// emptied, and a crashed server's waiter among them blocked the free lock for as long
/// at the head.
#[tokio::test]
async fn waiters_behind_a_named_owner_take_one_redisson_wait_not_one_each() {
    let BehindNamed {
        redis,
        _server,
        _holder,
        owners,
        mut tasks,
    } = BehindNamed::start("spaced", random_owner(), 4).await;
    let timeouts = Keys::default().lock("spaced").timeouts();
    let deadline = |owner: &str| deadline_of(&redis, &timeouts, owner);
    let (named, first, last) = (deadline(&owners[0]), deadline(&owners[1]), deadline(&owners[4]));
    assert!(
        first - named >= 300_000,
        "the first behind the named owner: {} ms after it",
        first - named
    );
    assert!(last - first < 5_000, "the last: {} ms after the first", last - first);
    // Once the named owner leaves, their next refreshes (every third of 2 s) bring them
    // back within a wait timeout.
    tasks.remove(0).abort();
    let near = poll_until(Duration::from_secs(3), || {
        let now = redis.now_ms();
        owners[1..].iter().all(|owner| deadline(owner) - now <= 2_500)
    })
    .await;
    assert!(
        near,
        "{:?}",
        owners[1..].iter().map(|o| deadline(o)).collect::<Vec<_>>()
    );
    for task in tasks {
        task.abort();
    }
}

/// A named owner no Redisson client would make (not `<uuid>:<thread>`) is queued by
/// latchkey alone and refreshed by its server: the waiters behind it keep their own
/// wait timeout, so a crashed server's waiter among them blocks no one for five
/// minutes.
#[tokio::test]
async fn a_named_owner_unlike_redissons_pushes_nobody_out() {
    let BehindNamed {
        redis,
        _server,
        _holder,
        owners,
        tasks,
    } = BehindNamed::start("named-job", "job-42:1".into(), 2).await;
    let timeouts = Keys::default().lock("named-job").timeouts();
    let now = redis.now_ms();
    for owner in &owners {
        let left = deadline_of(&redis, &timeouts, owner) - now;
        assert!(left <= 2_500, "{owner}'s deadline is {left} ms out");
    }
    for task in tasks {
        task.abort();
    }
}

/// A crashed replica's waiters queued behind a live one cost the queue no more than
/// one wait timeout from the crash, however many they are: they were kept alive by the
/// live waiter ahead (each refresh raised those behind it, as a Redisson waiter's
/// deadline must be), and each then blocked the lock for two wait timeouts at the head.
#[tokio::test]
async fn a_crashed_replicas_waiters_behind_a_live_one_do_not_block_the_queue_in_turn() {
    let CrashRig {
        redis: _redis,
        mut process,
        remote,
        _server,
        client,
        holder,
    } = CrashRig::start().await;
    let grants: Grants = Arc::default();
    let mut tasks = Vec::new();
    let (live, _) = queue_waiter(client.clone(), "crash", String::new(), grants.clone()).await;
    for _ in 0..3 {
        tasks.push(
            queue_waiter(remote.clone(), "crash", String::new(), grants.clone())
                .await
                .0,
        );
    }
    let (last, position) = queue_waiter(client.clone(), "crash", String::new(), grants.clone()).await;
    assert_eq!(position, 5);
    process.kill();
    // Past the doomed waiters' own deadlines, while the live waiter ahead keeps its place.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let released = Instant::now();
    holder.release().await.unwrap();
    tokio::time::timeout(T, live)
        .await
        .expect("the live waiter is granted")
        .unwrap();
    tokio::time::timeout(T, last)
        .await
        .expect("the last waiter is granted")
        .unwrap();
    let took = released.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "the waiters were granted {took:?} after the release"
    );
    assert_eq!(
        grants.lock().unwrap().len(),
        2,
        "the doomed waiters were granted nothing"
    );
    for task in tasks {
        assert!(task.await.is_err(), "a doomed waiter's stream ended with its server");
    }
}

/// Named owners shaped like Redisson's ids passing through a fair queue that never
/// empties leave latchkey's own waiters the deadlines they need, not more: every own
/// waiter took the deadline of the own entry ahead (pushed out by five minutes behind a
/// named owner, which may be a Redisson waiter), a refresh never lowered it, and each
/// named owner passing added five minutes more. After four, waiters were 20 minutes out, and a crashed server's
/// waiter at the head kept the free lock from everyone that long.
#[tokio::test]
async fn named_owners_passing_through_leave_no_deadline_pushed_out() {
    let CrashRig {
        redis,
        mut process,
        remote,
        _server,
        client,
        holder,
    } = CrashRig::start().await;
    let name = "crash";
    let timeouts = Keys::default().lock(name).timeouts();
    let queue = Keys::default().lock(name).queue();
    // A named owner, then a waiter of each server, behind the holder.
    let mut line = std::collections::VecDeque::new();
    let mut holder = holder;
    for round in 0..=4 {
        if round < 4 {
            line.push_back(holding_fair_waiter(&client, name, Some(&random_owner())).await);
        }
        line.push_back(holding_fair_waiter(&remote, name, None).await);
        line.push_back(holding_fair_waiter(&client, name, None).await);
        if round == 4 {
            break;
        }
        // On to the named owner: the holder and the two waiters ahead of it pass.
        let ahead = if round == 0 { 1 } else { 3 };
        for _ in 0..ahead {
            holder.release().await.unwrap();
            let next = line.pop_front().unwrap();
            holder = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
        }
        assert!(!holder.owner().starts_with("latchkey-"), "{}", holder.owner());
    }
    // The last named owner passes on to the two waiters queued behind it in its round.
    for _ in 0..2 {
        holder.release().await.unwrap();
        let next = line.pop_front().unwrap();
        holder = tokio::time::timeout(T, next).await.expect("granted in turn").unwrap();
    }
    let in_line = redis.cli(&["LRANGE", &queue, "0", "-1"]);
    let in_line: Vec<&str> = in_line.split_whitespace().collect();
    assert_eq!(in_line.len(), 2, "{in_line:?}");
    // Every deadline is within a wait timeout (2 s) of now, however many passed.
    let now = redis.now_ms();
    for owner in &in_line {
        let left = deadline_of(&redis, &timeouts, owner) - now;
        assert!(left <= 2_500, "{owner}'s deadline is {left} ms out");
    }

    // The remote server dies with its waiter first in line: it blocks the free lock for
    // no more than its wait timeout.
    process.kill();
    let killed = Instant::now();
    holder.release().await.unwrap();
    let survivor = line.pop_back().unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(5), survivor)
        .await
        .expect("the waiter behind the crashed server's is granted within its wait timeout")
        .unwrap();
    assert!(killed.elapsed() < Duration::from_secs(5), "{:?}", killed.elapsed());
    lease.release().await.unwrap();
    line.pop_back().unwrap().abort();
    let state = client.describe(name).await.unwrap();
    assert!(!state.locked && state.waiters.is_empty(), "{state:?}");
}

/// A waiter that keeps its own place is not raised by the refreshes of a waiter ahead:
/// a crashed latchkey server's entry, its deadline gone by, is swept out by the next
/// refresh that passes it (it would be at the head). A Redisson entry behind it is
/// still raised, as it never refreshes its own.
#[tokio::test]
async fn refreshes_raise_redisson_entries_but_not_a_crashed_servers() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--fair-wait-timeout", "2s"]).await;
    let client = server.client().await;
    let holder = client.lock("raise").kind(LockKind::Fair).acquire().await.unwrap();
    let grants: Grants = Arc::default();
    let (live, _) = queue_waiter(client.clone(), "raise", String::new(), grants.clone()).await;
    let keys = Keys::default().lock("raise");
    let (queue, timeouts) = (keys.queue(), keys.timeouts());
    let dead = "latchkey-00000000-0000-0000-0000-000000000000:7";
    let java = "2b8f6a8e-2c1f-4c3e-9f1e-6d1a1c9b7e55:1";
    let now = redis.now_ms();
    let dead_deadline = (now + 1000).to_string();
    redis.cli(&["RPUSH", &queue, dead, java]);
    redis.cli(&["ZADD", &timeouts, &dead_deadline, dead, &(now + 1500).to_string(), java]);
    // Past both entries' first deadlines: the live waiter refreshes its own meanwhile,
    // and a refresh (due within a third of the wait, a loaded machine's timers later)
    // sweeps the dead entry out.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let swept = latchkey_tests::poll_until(T, || !redis.cli(&["LRANGE", &queue, "0", "-1"]).contains(dead)).await;
    assert!(swept, "the crashed server's entry is swept out");
    assert_eq!(redis.cli(&["ZSCORE", &timeouts, dead]).trim(), "", "and its deadline");
    assert!(
        deadline_of(&redis, &timeouts, java) > redis.now_ms(),
        "the Redisson entry is kept"
    );
    let state = client.describe("raise").await.unwrap();
    assert_eq!(waiter_owners(&state)[1..], [java.to_owned()], "{state:?}");
    holder.release().await.unwrap();
    tokio::time::timeout(T, live).await.expect("granted").unwrap();
}

#[tokio::test]
async fn try_once_on_a_held_fair_lock_fails_without_queueing() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let _holder = client.lock("busy").kind(LockKind::Fair).acquire().await.unwrap();
    let err = client
        .lock("busy")
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    assert!(err.to_string().contains("busy"), "{err}");
    assert_eq!(redis.cli(&["LLEN", "redisson_lock_queue:{busy}"]).trim(), "0");
    assert_eq!(redis.cli(&["ZCARD", "redisson_lock_timeout:{busy}"]).trim(), "0");
    assert!(client.describe("busy").await.unwrap().waiters.is_empty());
}

/// Each in line learns how long the holder's lease has left, as a mutex waiter does:
/// the first when its check is at the lease's end, those behind when it is sooner.
#[tokio::test]
async fn fair_waiters_are_told_the_holders_ttl() {
    let redis = RedisServer::start();
    let (a, b) = (Latchkey::start(&redis.url()).await, Latchkey::start(&redis.url()).await);
    let _holder = a
        .client()
        .await
        .lock("told")
        .kind(LockKind::Fair)
        .acquire()
        .await
        .unwrap();
    let mut waiters = Vec::new();
    for (position, server) in [(1, &a), (2, &b)] {
        let lock = server.client().await.lock("told").kind(LockKind::Fair);
        let (waiter, queued) = spawn_queued(lock, T).await;
        assert_eq!(queued.position, position);
        let ttl = queued.holder_ttl.expect("told the holder's TTL");
        assert!(ttl.seconds > 20 && ttl.seconds <= 30, "waiter {position}: {ttl:?}");
        waiters.push(waiter);
    }
    waiters.iter().for_each(JoinHandle::abort);
}

#[tokio::test]
async fn a_timed_out_fair_waiter_leaves_the_queue() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let _holder = client.lock("timeout").kind(LockKind::Fair).acquire().await.unwrap();
    let err = client
        .lock("timeout")
        .kind(LockKind::Fair)
        .wait(Duration::from_millis(400))
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    wait_state(&client, "timeout", Duration::from_secs(1), |s| s.waiters.is_empty()).await;
    assert_eq!(redis.cli(&["LLEN", "redisson_lock_queue:{timeout}"]).trim(), "0");
}

#[tokio::test]
async fn the_same_owner_holds_a_fair_lock_reentrantly() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let first = client
        .lock("re")
        .kind(LockKind::Fair)
        .owner("svc:1")
        .acquire()
        .await
        .unwrap();
    let second = client
        .lock("re")
        .kind(LockKind::Fair)
        .owner("svc:1")
        .try_once()
        .acquire()
        .await
        .expect("the owner re-enters");
    assert_eq!((first.hold_count(), second.hold_count()), (1, 2));
    assert!(second.fencing_token() > first.fencing_token());
    assert_eq!(redis.cli(&["HGET", "re", "svc:1"]).trim(), "2");
    first.release().await.unwrap();
    let err = client
        .lock("re")
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    second.release().await.unwrap();
    client
        .lock("re")
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .expect("free after both holds");
}

#[tokio::test]
async fn fencing_tokens_increase_in_grant_order() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let mut last = 0;
    for _ in 0..10 {
        let lease = client.lock("fence").kind(LockKind::Fair).acquire().await.unwrap();
        assert!(lease.fencing_token() > last);
        last = lease.fencing_token();
        assert_eq!(client.describe("fence").await.unwrap().last_fencing_token, last);
        lease.release().await.unwrap();
    }
}

/// A handoff reserves fencing tokens for passes in memory only when passes may follow
/// (every waiter queued is this server's). Reserved on every handoff, a lock changing
/// hands between servers thousands of times a second would raise its counter faster
/// than the clock, the floor tokens start from once the counter is lost (a Redis
/// restarted empty): tokens told after that could repeat.
#[tokio::test]
async fn a_handoff_with_another_servers_waiter_queued_reserves_no_tokens() {
    let redis = RedisServer::start();
    let a = Latchkey::start(&redis.url()).await;
    let b = Latchkey::start(&redis.url()).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let name = "reserve";
    let holder = ca.lock(name).kind(LockKind::Fair).acquire().await.unwrap();
    let waiter = |client: &Client| {
        let client = client.clone();
        tokio::spawn(async move { client.lock(name).kind(LockKind::Fair).wait(WAIT).acquire().await })
    };
    // A waiter of this server first in line, another server's behind it.
    let here = waiter(&ca);
    wait_state(&ca, name, T, |s| s.waiters.len() == 1).await;
    let there = waiter(&cb);
    wait_state(&ca, name, T, |s| s.waiters.len() == 2).await;
    holder.release().await.unwrap();
    let lease = tokio::time::timeout(T, here)
        .await
        .expect("granted in time")
        .unwrap()
        .unwrap();
    let keys = Keys::default().lock(name);
    let counter: u64 = redis.cli(&["GET", &keys.fence()]).trim().parse().expect("a counter");
    assert_eq!(counter, lease.fencing_token(), "tokens reserved past the grant");
    assert_eq!(redis.cli(&["EXISTS", &keys.fence_passed()]).trim(), "0");
    lease.release().await.unwrap();
    let next = tokio::time::timeout(T, there)
        .await
        .expect("granted in time")
        .unwrap()
        .unwrap();
    assert!(next.fencing_token() > counter);
    next.release().await.unwrap();
}

#[tokio::test]
async fn a_latchkey_waiter_is_woken_by_redissons_fair_unlock() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let conn = redis_client(&redis.url()).await;
    let java = RedissonFairLock::new(&conn, "shared", &random_owner()).with_publish(PublishCommand::Publish);
    assert_eq!(java.try_lock(30_000).await, None, "redisson takes the fair lock");
    let client = server.client().await;
    let grants: Grants = Arc::default();
    let (waiter, position) = queue_waiter(client.clone(), "shared", "lk:1".into(), grants.clone()).await;
    assert_eq!(position, 1);
    assert_eq!(
        java.queue().await,
        ["lk:1"],
        "the latchkey waiter is in Redisson's queue"
    );
    let state = client.describe("shared").await.unwrap();
    assert_eq!(state.holders[0].owner, java.owner());

    let unlocked_at = Instant::now();
    assert_eq!(java.unlock().await, Some(true));
    tokio::time::timeout(Duration::from_secs(1), waiter)
        .await
        .expect("the latchkey waiter is granted within 1 s of Redisson's unlock")
        .unwrap();
    assert!(unlocked_at.elapsed() < Duration::from_secs(1));
    assert_eq!(grants.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn a_redisson_fair_waiter_is_woken_by_latchkeys_release() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let lease = client.lock("shared").kind(LockKind::Fair).acquire().await.unwrap();
    let conn = redis_client(&redis.url()).await;
    let java = Arc::new(RedissonFairLock::new(&conn, "shared", &random_owner()));
    // A second listener on the Java waiter's own channel, to see the wake-up itself.
    let mut sub = java.subscribe().await;
    let waiting = {
        let java = java.clone();
        tokio::spawn(async move {
            let acquired = java.lock(T, 30_000).await;
            (acquired, Instant::now())
        })
    };
    let owner = java.owner().to_owned();
    let state = wait_state(&client, "shared", T, |s| s.waiters.iter().any(|w| w.owner == owner)).await;
    assert_eq!(state.waiters[0].position, 1);
    assert_eq!(java.queue().await, std::slice::from_ref(&owner));

    let released_at = Instant::now();
    lease.release().await.unwrap();
    assert!(
        sub.next_message(Duration::from_secs(1)).await.is_some(),
        "latchkey publishes to the head's channel {}",
        java.owner_channel()
    );
    sub.close().await;
    let (acquired, at) = tokio::time::timeout(Duration::from_millis(1500), waiting)
        .await
        .expect("Redisson's waiter acquires promptly")
        .unwrap();
    assert!(acquired);
    assert!(at - released_at < Duration::from_millis(1500), "{:?}", at - released_at);
    assert_eq!(redis.cli(&["HGET", "shared", &owner]).trim(), "1");
    let err = client
        .lock("shared")
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    assert_eq!(java.unlock().await, Some(true));
}

/// Redisson's fair waiters wait `fairLockWaitTimeout`, 5 min by default, and a Redisson
/// client granted the lock from the queue takes that off every deadline in it. A
/// latchkey waiter takes a Redisson wait past its own for each Redisson waiter ahead of
/// it, so such a grant leaves it (and the Redisson waiter behind it) in place; all are
/// then granted in arrival order.
#[tokio::test]
async fn a_redisson_grant_at_the_default_wait_leaves_everyone_queued_in_place() {
    const WAIT_MS: i64 = 300_000;
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let java = || RedissonFairLock::new(&conn, "five-minutes", &random_owner()).with_thread_wait(WAIT_MS);
    let (holder, first, last) = (java(), java(), java());
    assert_eq!(holder.try_lock(30_000).await, None, "a Redisson client holds");
    assert!(first.try_lock(30_000).await.is_some(), "a Redisson waiter queues first");
    let grants = Grants::default();
    let (latchkey, at) = queue_waiter(client.clone(), "five-minutes", String::new(), grants.clone()).await;
    assert_eq!(at, 2);
    let (second, at) = queue_waiter(client.clone(), "five-minutes", String::new(), grants.clone()).await;
    assert_eq!(at, 3);
    assert!(last.try_lock(30_000).await.is_some(), "a Redisson waiter queues last");
    let queue = first.queue().await;
    assert_eq!(queue.len(), 4, "{queue:?}");
    let (ours, ours_next) = (queue[1].clone(), queue[2].clone());

    assert_eq!(holder.unlock().await, Some(true));
    assert_eq!(
        first.try_lock(30_000).await,
        None,
        "the first Redisson waiter is granted"
    );
    let timeouts = first.timeout_set_name();
    let now = redis.now_ms();
    // Each latchkey waiter had one Redisson wait counted past its own for the Redisson
    // waiter ahead, which the grant took off: it keeps its own wait (5 s, refreshed
    // every third). The Redisson waiter keeps minutes.
    for owner in [ours.as_str(), ours_next.as_str()] {
        let left = deadline_of(&redis, &timeouts, owner) - now;
        assert!(left > 1_000, "{owner} keeps its place: {left} ms left");
    }
    let left = deadline_of(&redis, &timeouts, last.owner()) - now;
    assert!(left > 60_000, "the Redisson waiter keeps its place: {left} ms left");
    let in_line = [ours.clone(), ours_next.clone(), last.owner().to_owned()];
    assert_eq!(first.queue().await, in_line);

    // The latchkey waiter is woken by the unlock, takes its turn and releases.
    assert_eq!(first.unlock().await, Some(true));
    for waiter in [latchkey, second] {
        tokio::time::timeout(T, waiter).await.expect("granted in time").unwrap();
    }
    assert_eq!(granted(&grants), [ours, ours_next]);
    let deadline = Instant::now() + T;
    while last.try_lock(30_000).await.is_some() {
        assert!(Instant::now() < deadline, "the last Redisson waiter is granted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(last.unlock().await, Some(true));
}

/// Fair streams of one client-named owner share its place in the queue (the queue
/// holds owner ids). A try-once of that owner, or another of its streams that gives up
/// waiting, leaves the place to the stream still waiting, which keeps its turn.
#[tokio::test]
async fn streams_of_one_owner_keep_their_shared_place_in_the_queue() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let holder = client
        .lock("shared-place")
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .unwrap();
    let grants = Grants::default();
    let (first, at) = queue_waiter(client.clone(), "shared-place", "o:1".into(), grants.clone()).await;
    assert_eq!(at, 1);
    let (second, at) = queue_waiter(client.clone(), "shared-place", "c:1".into(), grants.clone()).await;
    assert_eq!(at, 2);
    let same_owner = || client.lock("shared-place").kind(LockKind::Fair).owner("o:1");
    let tried = same_owner().try_once().acquire().await.unwrap_err();
    assert!(tried.is_timeout(), "{tried}");
    let waited = same_owner()
        .wait(Duration::from_millis(300))
        .acquire()
        .await
        .unwrap_err();
    assert!(waited.is_timeout(), "{waited}");
    // What either left behind in the background would have run by now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let queue = redis.cli(&["LRANGE", "redisson_lock_queue:{shared-place}", "0", "-1"]);
    assert_eq!(queue.split_whitespace().collect::<Vec<_>>(), ["o:1", "c:1"]);
    holder.release().await.unwrap();
    for task in [first, second] {
        tokio::time::timeout(T, task).await.expect("granted in time").unwrap();
    }
    assert_eq!(granted(&grants), ["o:1", "c:1"], "o:1 kept its turn");
}

/// A fair lock `name` held, and a latchkey waiter queued behind the holder.
async fn held_with_a_waiter(client: &Client, name: &'static str) -> (Lease, JoinHandle<Result<Lease, Error>>) {
    let holder = client
        .lock(name)
        .kind(LockKind::Fair)
        .try_once()
        .acquire()
        .await
        .unwrap();
    let client = client.clone();
    let waiter = tokio::spawn(async move { client.lock(name).kind(LockKind::Fair).wait(T).acquire().await });
    (holder, waiter)
}

/// Releases `holder`, lets `waiter` take the lock and release it, then takes the free
/// lock within the waiter's 5 s wait and a Java entry's 2 s behind it: not kept from it
/// by a dead Java entry for a Redisson wait.
async fn free_within_a_wait(client: &Client, name: &str, holder: Lease, waiter: JoinHandle<Result<Lease, Error>>) {
    holder.release().await.unwrap();
    let lease = tokio::time::timeout(T, waiter).await.unwrap().unwrap().unwrap();
    lease.release().await.unwrap();
    let started = Instant::now();
    let next = client
        .lock(name)
        .kind(LockKind::Fair)
        .wait(Duration::from_secs(15))
        .acquire()
        .await;
    assert!(
        next.is_ok(),
        "kept from the free lock for {:?}: {:?}",
        started.elapsed(),
        next.err()
    );
    assert!(started.elapsed() < Duration::from_secs(9), "{:?}", started.elapsed());
}

fn granted(grants: &Grants) -> Vec<String> {
    grants.lock().unwrap().iter().map(|(o, _)| o.clone()).collect()
}

/// The deadline of `owner` in the timeout set `timeouts`, in Redis time (ms).
fn deadline_of(redis: &RedisServer, timeouts: &str, owner: &str) -> i64 {
    redis.score(timeouts, owner)
}

/// Has the latchkey waiter `l` give up, and waits (bounded by `T`) until `java` alone is
/// queued.
async fn leaves_java_alone(l: JoinHandle<()>, java: &RedissonFairLock) {
    l.abort();
    let _ = l.await;
    let deadline = Instant::now() + T;
    while java.queue().await != [java.owner().to_owned()] {
        assert!(
            Instant::now() < deadline,
            "L leaves the queue: {:?}",
            java.queue().await
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits (bounded by `T`) until `java`'s queue has `len` entries.
async fn until_queued(java: &RedissonFairLock, len: usize) {
    let deadline = Instant::now() + T;
    while java.queue().await.len() < len {
        assert!(Instant::now() < deadline, "{len} queued: {:?}", java.queue().await);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Redisson's `RedissonLock.lock(leaseTime)` loop for a fair lock, as the Java client
/// runs it: try; subscribe to the owner's channel; try again, and wait for a message
/// for the returned TTL (with no bound when the TTL is negative: `latch.acquire()`),
/// bounded here by `limit`. Records the grant (token 0), then unlocks.
fn java_waiter(java: Arc<RedissonFairLock>, lease_ms: i64, limit: Duration, grants: Grants) -> JoinHandle<bool> {
    tokio::spawn(async move {
        let deadline = Instant::now() + limit;
        let mut acquired = java.try_lock(lease_ms).await.is_none();
        if !acquired {
            let mut sub = java.subscribe().await;
            loop {
                let Some(ttl) = java.try_lock(lease_ms).await else {
                    acquired = true;
                    break;
                };
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                let wait = u64::try_from(ttl).map(Duration::from_millis).unwrap_or(left).min(left);
                sub.next_message(wait).await;
            }
            sub.close().await;
        }
        if acquired {
            grants.lock().unwrap().push((java.owner().to_owned(), 0));
            assert_eq!(java.unlock().await, Some(true), "the Java waiter unlocks");
        }
        acquired
    })
}

/// A server, a Java holder of the fair lock `name` (a lease of `lease_ms`) and a
/// latchkey waiter, `lk-first:1`, queued first behind it.
struct BehindJava {
    redis: RedisServer,
    _server: Latchkey,
    client: Client,
    conn: fred::clients::Client,
    holder: RedissonFairLock,
    grants: Grants,
    l: JoinHandle<()>,
}

impl BehindJava {
    async fn start(name: &str, lease_ms: i64) -> Self {
        let redis = RedisServer::start();
        let server = Latchkey::start(&redis.url()).await;
        let client = server.client().await;
        let conn = redis_client(&redis.url()).await;
        let holder = RedissonFairLock::new(&conn, name, &random_owner());
        assert_eq!(holder.try_lock(lease_ms).await, None, "the Java holder takes the lock");
        let grants: Grants = Arc::default();
        let (l, position) = queue_waiter(client.clone(), name, "lk-first:1".into(), grants.clone()).await;
        assert_eq!(position, 1);
        Self {
            redis,
            _server: server,
            client,
            conn,
            holder,
            grants,
            l,
        }
    }
}

/// Redisson gives a fair waiter the deadline of the waiter ahead plus its 5 s wait time
/// once, and never refreshes it; latchkey's waiters keep theirs by polling, and raise
/// those behind them as they do. Java holder (15 s lease, held 11.5 s); queue: latchkey
/// L, Java J, latchkey M. J's first deadline is L's (now + 5 s) + 5 s: without the raise,
/// J heads the queue past it once L is granted, is dropped without a wake-up, and M is
/// granted before it.
#[tokio::test]
async fn a_redisson_waiter_behind_a_latchkey_waiter_keeps_its_turn() {
    let BehindJava {
        redis,
        _server,
        client,
        conn,
        holder,
        grants,
        l,
    } = BehindJava::start("turns", 15_000).await;
    let name = "turns";
    let java = Arc::new(RedissonFairLock::new(&conn, name, &random_owner()));
    let j = java_waiter(java.clone(), 30_000, Duration::from_secs(40), grants.clone());
    until_queued(&java, 2).await;
    let (m, pm) = queue_waiter(client.clone(), name, "lk-later:1".into(), grants.clone()).await;
    assert_eq!(pm, 3);
    let arrival = vec![
        "lk-first:1".to_owned(),
        java.owner().to_owned(),
        "lk-later:1".to_owned(),
    ];
    assert_eq!(java.queue().await, arrival, "queued in arrival order");

    // The holder's critical section: 11.5 s, within its 15 s lease, past J's first deadline.
    tokio::time::sleep(Duration::from_millis(11_500)).await;
    let timeouts = java.timeout_set_name();
    let ahead = deadline_of(&redis, &timeouts, "lk-first:1");
    let left = deadline_of(&redis, &timeouts, java.owner()) - redis.now_ms();
    assert!(
        left > 5_000,
        "L's polls raised J's deadline ({left} ms left, L's in {} ms)",
        ahead - redis.now_ms()
    );
    assert!(
        deadline_of(&redis, &timeouts, java.owner()) >= ahead + 5_000,
        "J stays 5 s behind L"
    );
    assert_eq!(holder.unlock().await, Some(true));

    for task in [l, m] {
        tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .expect("latchkey waiters are granted")
            .unwrap();
    }
    let acquired = tokio::time::timeout(Duration::from_secs(45), j)
        .await
        .expect("the Java waiter ends")
        .unwrap();
    assert!(acquired, "the Java waiter acquires");
    assert_eq!(
        granted(&grants),
        arrival,
        "granted in arrival order across Redisson and latchkey"
    );
}

/// latchkey L queues first (it creates Redisson's queue keys and gives them a lifetime),
/// Java J queues behind it (its deadline L's + 5 s; Redisson sets no lifetime), then L's
/// client gives up. The queue keys must outlive J's deadline: J is still queued 7 s
/// later, and a latchkey waiter that comes then queues behind it.
#[tokio::test]
async fn a_redisson_waiters_queue_entry_outlives_the_latchkey_waiter_that_made_the_queue() {
    let BehindJava {
        redis,
        _server,
        client,
        conn,
        holder: _holder,
        grants,
        l,
    } = BehindJava::start("expiring", 30_000).await;
    let name = "expiring";
    let java = RedissonFairLock::new(&conn, name, &random_owner());
    assert!(java.try_lock(30_000).await.is_some(), "the Java waiter queues");
    // L's client gives up at once (before its next refresh).
    leaves_java_alone(l, &java).await;
    let j_deadline = deadline_of(&redis, &java.timeout_set_name(), java.owner());

    tokio::time::sleep(Duration::from_millis(7_000)).await;
    let now = redis.now_ms();
    assert!(
        now < j_deadline,
        "J's own deadline has not passed ({} ms left)",
        j_deadline - now
    );
    assert_eq!(
        java.queue().await,
        [java.owner().to_owned()],
        "J is still queued before its deadline"
    );
    let (m, pm) = queue_waiter(client.clone(), name, "lk-later:1".into(), grants.clone()).await;
    assert_eq!(pm, 2, "M queues behind the Java waiter");
    m.abort();
    let _ = m.await;
}

/// Java holder with a 25 s lease; latchkey L queued first, Java J behind it (its
/// deadline L's + 5 s, L's own a --fair-wait-timeout out), then L's client gives up.
/// Redisson spaces its first waiter from the holder's lease left; J, first in line
/// now, kept its place only until L's deadline + 5 s, about 10 s, and was swept out of
/// its turn while the lock was still held (a pre-3.32 `lock()` then waits for good).
/// J's deadline is raised to the lease left + its 5 s, and J takes the lock once the
/// holder lets go.
#[tokio::test]
async fn a_redisson_waiter_first_in_line_once_a_latchkey_waiter_leaves_keeps_its_place_through_the_lease() {
    let BehindJava {
        redis,
        _server,
        client: _client,
        conn,
        holder,
        grants: _grants,
        l,
    } = BehindJava::start("long-lease", 25_000).await;
    let name = "long-lease";
    let java = RedissonFairLock::new(&conn, name, &random_owner());
    assert!(java.try_lock(30_000).await.is_some(), "the Java waiter queues");
    leaves_java_alone(l, &java).await;
    let lease_ends = redis.now_ms() + redis.cli(&["PTTL", name]).trim().parse::<i64>().unwrap();
    let j_deadline = deadline_of(&redis, &java.timeout_set_name(), java.owner());
    assert!(
        j_deadline >= lease_ends + 4_000,
        "J stays queued through the holder's lease and its own wait: {} ms past the lease's end",
        j_deadline - lease_ends
    );
    assert_eq!(holder.unlock().await, Some(true));
    assert_eq!(
        java.try_lock(30_000).await,
        None,
        "J, first in line, takes the free lock"
    );
}

/// Java's `lock()` on a fair lock with a pre-3.32 Redisson, queued behind a latchkey
/// waiter. Its retries answer "your deadline less 5 s": were its deadline left at the
/// latchkey waiter's first + 5 s, that would turn negative 5 s after it queued, and it
/// would wait for a message only; the holder releases 11.5 s in, the latchkey waiter is
/// granted and releases, and the Java waiter, past its deadline at the head, would be
/// dropped without a message, waiting for good on a free lock. With its deadline raised
/// behind the latchkey waiter's, it is woken and acquires.
#[tokio::test]
async fn a_pre_3_32_redisson_lock_behind_a_latchkey_waiter_is_woken() {
    let BehindJava {
        redis: _redis,
        _server,
        client: _client,
        conn,
        holder,
        grants,
        l,
    } = BehindJava::start("stranded", 15_000).await;
    let name = "stranded";

    let java = Arc::new(RedissonFairLock::new(&conn, name, &random_owner()));
    let j = pre_3_32_lock(&conn, java.clone(), 5_000, grants.clone());
    until_queued(&java, 2).await;

    tokio::time::sleep(Duration::from_millis(11_500)).await;
    assert_eq!(holder.unlock().await, Some(true));
    tokio::time::timeout(Duration::from_secs(20), l)
        .await
        .expect("the latchkey waiter is granted")
        .unwrap();
    let released_at = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(10), j).await;
    assert!(
        matches!(outcome, Ok(Ok(true))),
        "the Java waiter acquires the free lock within 10 s of the latchkey waiter's release \
         (waited {:?}; grants {:?}; Redis queue {:?})",
        released_at.elapsed(),
        granted(&grants),
        java.queue().await
    );
    assert_eq!(granted(&grants), ["lk-first:1".to_owned(), java.owner().to_owned()]);
}

/// Java's `lock()` on a fair lock with a pre-3.32 Redisson (`fairLockWaitTimeout`
/// `thread_wait_ms`), bounded here at 40 s: try, subscribe to the owner's channel, then
/// try again and wait for the returned TTL, or, once it is negative, for a message
/// only (`latch.acquireUninterruptibly()`). Records its grant (token 0) in `grants`;
/// holds what it took. Whether it acquired.
fn pre_3_32_lock(
    conn: &fred::clients::Client,
    java: Arc<RedissonFairLock>,
    thread_wait_ms: i64,
    grants: Grants,
) -> JoinHandle<bool> {
    use fred::prelude::*;
    let keys = vec![java.name().to_owned(), java.queue_name(), java.timeout_set_name()];
    let try_lock = {
        let conn = conn.clone();
        let owner = java.owner().to_owned();
        move || {
            let conn = conn.clone();
            let keys = keys.clone();
            let args = vec![
                "30000".to_owned(),
                owner.clone(),
                thread_wait_ms.to_string(),
                latchkey_tests::redisson::now_ms().to_string(),
            ];
            async move {
                let ttl: Option<i64> = conn
                    .eval(scripts::FAIR_TRY_LOCK_BEFORE_3_32, keys, args)
                    .await
                    .expect("pre-3.32 fair tryLock");
                ttl
            }
        }
    };
    tokio::spawn(async move {
        let limit = Instant::now() + Duration::from_secs(40);
        if try_lock().await.is_none() {
            grants.lock().unwrap().push((java.owner().to_owned(), 0));
            return true;
        }
        let mut sub = java.subscribe().await;
        let acquired = loop {
            let Some(ttl) = try_lock().await else { break true };
            let left = limit.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break false;
            }
            let wait = u64::try_from(ttl).map(Duration::from_millis).unwrap_or(left).min(left);
            sub.next_message(wait).await;
        };
        sub.close().await;
        if acquired {
            grants.lock().unwrap().push((java.owner().to_owned(), 0));
        }
        acquired
    })
}

/// A pre-3.32 Java `lock()` first in line behind a latchkey holder whose server died:
/// its retries answer a negative TTL once the holder's lease was renewed past its
/// join, so it waits for a message only, and a lease that runs out publishes none. A
/// latchkey waiter behind it, which looks at the free lock every second, tells it: it
/// takes the lock within seconds, not (at Redisson's 5 min `fairLockWaitTimeout`)
/// never, swept out at its deadline by the latchkey waiter that then took its turn.
#[tokio::test]
async fn a_pre_3_32_redisson_lock_first_in_line_is_woken_once_a_dead_servers_lease_runs_out() {
    let redis = RedisServer::start();
    let (mut doomed, doomed_client) = LatchkeyProcess::to_crash(&redis.url()).await;
    let server = Latchkey::start(&redis.url()).await;
    let name = "dead-holder";
    let held = doomed_client.lock(name).kind(LockKind::Fair).acquire().await.unwrap();
    let conn = redis_client(&redis.url()).await;
    let grants: Grants = Arc::default();
    let java = Arc::new(RedissonFairLock::new(&conn, name, &random_owner()));
    let j = pre_3_32_lock(&conn, java.clone(), 300_000, grants.clone());
    until_queued(&java, 1).await;
    let (m, position) = queue_waiter(server.client().await, name, "lk-behind:1".into(), grants.clone()).await;
    assert_eq!(position, 2);
    // The doomed server renews past the Java waiter's join (its 1.5 s lease, renewed
    // every 0.5 s): the retries answer a negative TTL from then on.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    doomed.kill();
    drop(held);
    let killed = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(20), j).await;
    assert!(
        matches!(outcome, Ok(Ok(true))),
        "the Java waiter takes the lock its dead holder's lease left (waited {:?}; grants {:?}; queue {:?})",
        killed.elapsed(),
        granted(&grants),
        java.queue().await
    );
    assert!(
        killed.elapsed() < Duration::from_secs(6),
        "woken within seconds of the lease's end: {:?}",
        killed.elapsed()
    );
    assert_eq!(granted(&grants), [java.owner().to_owned()], "the Java waiter first");
    assert_eq!(java.unlock().await, Some(true));
    tokio::time::timeout(WAIT, m)
        .await
        .expect("the latchkey waiter follows")
        .unwrap();
    assert_eq!(granted(&grants), [java.owner().to_owned(), "lk-behind:1".to_owned()]);
}

/// A queue with a Redisson waiter at its end lives as Redisson's queues do, with no
/// lifetime. latchkey gave a queue it made a lifetime past its latest deadline, which a
/// Redisson waiter that joined later never extends: its entry (60 s of wait) vanished
/// with the queue once the latchkey waiter had gone, and a later Redisson waiter went
/// first.
#[tokio::test]
async fn a_queue_a_redisson_waiter_joined_loses_its_lifetime() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let name = "mixed-lifetime";
    let holder = client.lock(name).kind(LockKind::Fair).acquire().await.unwrap();
    let (waiter, _) = queue_waiter(client.clone(), name, String::new(), Grants::default()).await;
    let conn = redis_client(&redis.url()).await;
    let java = RedissonFairLock::new(&conn, name, &random_owner());
    let pttl = |key: &str| redis.cli(&["PTTL", key]).trim().parse::<i64>().unwrap();
    assert!(pttl(&java.queue_name()) > 0, "the queue latchkey made has a lifetime");
    assert!(java.try_lock_waiting(60_000, 30_000).await.is_some(), "Redisson queues");
    // The latchkey waiter leaves: its script sees the Redisson waiter at the end.
    waiter.abort();
    let kept = poll_until(T, || {
        pttl(&java.queue_name()) == -1 && pttl(&java.timeout_set_name()) == -1
    })
    .await;
    assert!(kept, "the queue keeps no lifetime: {} ms", pttl(&java.queue_name()));
    assert_eq!(java.queue().await, [java.owner().to_owned()]);
    holder.release().await.unwrap();
}

/// A refresh of a waiter's deadline raises the Redisson entries behind it and stops at
/// the first live latchkey entry, whose own refreshes carry on from there. It read the
/// whole queue behind it: in a queue of latchkey waiters, every refresh cost the queue's
/// length, and every waiter refreshes.
#[tokio::test]
async fn a_refresh_reads_no_further_than_the_next_live_waiter() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--fair-wait-timeout", "900ms"]).await;
    let client = server.client().await;
    let name = "long-queue";
    let holder = client.lock(name).kind(LockKind::Fair).acquire().await.unwrap();
    let (live, _) = queue_waiter(client.clone(), name, String::new(), Grants::default()).await;
    let keys = latchkey_server::keys::Keys::default().lock(name);
    let (queue, timeouts) = (keys.queue(), keys.timeouts());
    // 400 waiters of another server behind it, queued at once (one script).
    let queue_them = "for i = 1, 400 do local e = ARGV[1] .. i \
        redis.call('rpush', KEYS[1], e) redis.call('zadd', KEYS[2], ARGV[2], e) end";
    let far = (redis.now_ms() + 60_000).to_string();
    let prefix = "latchkey-00000000-0000-0000-0000-00000000beef:";
    redis.cli(&["EVAL", queue_them, "2", &queue, &timeouts, prefix, &far]);
    redis.cli(&["CONFIG", "RESETSTAT"]);
    // The live waiter refreshes every third of its 900 ms: about four times.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let reads = redis.command_calls("lrange");
    assert!(reads < 20, "{reads} reads of the queue in four refreshes");
    holder.release().await.unwrap();
    tokio::time::timeout(T, live).await.expect("granted").unwrap();
}

/// Redisson's names make the fair lock `orders`'s channel for owner `w1` the unlock
/// channel of the lock `{orders}:w1`. A Redisson client's unlock of `{orders}:w1`
/// woke one waiter of that channel, the fair waiter of `orders` (first there), which
/// found its lock still held; the mutex waiter slept until the TTL it was told (a
/// minute), the lock free. Each lock's first waiter looks now.
#[tokio::test]
async fn a_channel_two_locks_share_wakes_a_waiter_of_each() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let fair_holder = client.lock("orders").kind(LockKind::Fair).acquire().await.unwrap();
    let (fair_waiter, _) = latchkey_tests::server::spawn_queued(
        client
            .lock("orders")
            .kind(LockKind::Fair)
            .owner("w1")
            .wait(Duration::from_secs(60)),
        T,
    )
    .await;
    let java =
        latchkey_tests::redisson::RedissonLock::new(&redis_client(&redis.url()).await, "{orders}:w1", &random_owner());
    assert!(
        java.try_lock(60_000).await.is_none(),
        "the Java client takes {{orders}}:w1"
    );
    let (mutex_waiter, queued) =
        latchkey_tests::server::spawn_queued(client.lock("{orders}:w1").wait(Duration::from_secs(90)), T).await;
    assert!(queued.holder_ttl.is_some(), "told the Java hold's TTL");
    assert_eq!(java.unlock().await, Some(true));
    let lease = tokio::time::timeout(Duration::from_secs(5), mutex_waiter)
        .await
        .expect("the mutex waiter woken by the unlock, not its minute-long recheck")
        .unwrap()
        .expect("granted");
    lease.release().await.unwrap();
    fair_holder.release().await.unwrap();
    let fair = tokio::time::timeout(T, fair_waiter)
        .await
        .expect("the fair waiter too")
        .unwrap();
    fair.expect("granted").release().await.unwrap();
}

/// A fair queue in which nobody waits any more (a crashed client's entries past their
/// deadlines, which only a fair request sweeps, on a queue that has no lifetime behind
/// a Java or a named waiter) keeps no other kind off the name: every mutex, read,
/// write or semaphore request on it answered FAILED_PRECONDITION for good, while
/// Describe showed it free.
#[tokio::test]
async fn a_fair_queue_of_waiters_gone_refuses_no_other_kind() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let kinds = [LockKind::Mutex, LockKind::Read, LockKind::Write, LockKind::Semaphore];
    for kind in kinds {
        let name = format!("gone-{kind:?}");
        let keys = Keys::default().lock(&name);
        let time = redis.cli(&["TIME"]);
        let seconds: u64 = time.lines().next().unwrap().trim().parse().unwrap();
        let past = ((seconds - 1) * 1000).to_string();
        redis.cli(&["RPUSH", &keys.queue(), "dead-jvm:1"]);
        redis.cli(&["ZADD", &keys.timeouts(), &past, "dead-jvm:1"]);
        let state = client.describe(&name).await.unwrap();
        assert!(!state.locked && state.waiters.is_empty(), "{state:?}");
        let lock = client.lock(name.as_str()).kind(kind).try_once();
        let lock = if kind == LockKind::Semaphore {
            lock.permits(1).limit(2)
        } else {
            lock
        };
        let lease = lock.acquire().await.unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        lease.release().await.unwrap();
    }
}

/// A Java thread queues with `tryLock(2 s, …)` behind a latchkey fair waiter: Redisson
/// gives its entry the deadline of the entry ahead plus 2 s. The latchkey waiter's
/// refreshes raise the Java entry by as much as they raise their own, keeping those
/// 2 s, so once the Java process dies its entry at the head of the queue keeps the free
/// lock from the others for seconds, as among Redisson's own waiters. It was raised to
/// 5 minutes past the waiter ahead, whatever wait the Java thread gave, and kept the
/// free lock from everyone for minutes.
#[tokio::test]
async fn a_dead_java_try_lock_waiter_keeps_the_lock_for_its_own_wait_only() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let name = "short-java-wait";
    let (holder, waiter) = held_with_a_waiter(&client, name).await;
    let java = RedissonFairLock::new(&conn, name, &random_owner());
    until_queued(&java, 1).await;
    // Java's tryLock(2 s): one try, queued behind the latchkey waiter; its process dies.
    assert!(java.try_lock_waiting(2_000, 30_000).await.is_some(), "queued");
    let timeouts = java.timeout_set_name();
    let scores = || -> Vec<i64> {
        let both = redis.cli(&["ZRANGE", &timeouts, "0", "-1", "WITHSCORES"]);
        both.lines()
            .skip(1)
            .step_by(2)
            .filter_map(|s| s.trim().parse().ok())
            .collect()
    };
    let queued = scores();
    assert_eq!(queued.len(), 2, "{queued:?}");
    // The latchkey waiter's next refresh (a third of its 5 s wait) raises its deadline.
    assert!(poll_until(T, || scores()[0] > queued[0] + 1_000).await, "refreshed");
    let refreshed = scores();
    assert_eq!(
        refreshed[1] - refreshed[0],
        2_000,
        "still 2 s behind: {queued:?} then {refreshed:?}"
    );
    // The lock is free, the dead Java entry heads the queue: gone within its 2 s after
    // the waiter ahead's deadline, at most the waiter's 5 s wait from now.
    free_within_a_wait(&client, name, holder, waiter).await;
}

/// As above, with a waiter of a crashed server (its deadline passed, never refreshed
/// again) between the live waiter and the dead Java `tryLock(2 s)` entry: the crashed
/// waiter is swept out by the next refresh, and the Java entry keeps its 2 s behind the
/// live waiter refresh after refresh. It was raised a whole Redisson wait more (10
/// minutes behind), then, measured from the crashed waiter's deadline, further at each
/// refresh, and kept the free lock that long.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_java_waiter_behind_a_crashed_servers_waiter_keeps_its_own_wait_only() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let conn = redis_client(&redis.url()).await;
    let name = "dead-behind-crashed";
    let (holder, waiter) = held_with_a_waiter(&client, name).await;
    let java = RedissonFairLock::new(&conn, name, &random_owner());
    until_queued(&java, 1).await;
    let (queue, timeouts) = (java.queue_name(), java.timeout_set_name());
    // A waiter of a server that crashed (latchkey's own entry shape), its deadline soon.
    let crashed = "0123456789abcdef0123456789abcdef:crashed-waiter";
    let crashed_deadline = redis.now_ms() + 2_500;
    redis.cli(&["RPUSH", &queue, crashed]);
    redis.cli(&["ZADD", &timeouts, &crashed_deadline.to_string(), crashed]);
    assert!(java.try_lock_waiting(2_000, 30_000).await.is_some(), "queued");
    let queued = java.queue().await;
    assert_eq!(queued.len(), 3, "{queued:?}");
    let (live, dead) = (queued[0].clone(), queued[2].clone());
    let score = |member: &str| redis.score(&timeouts, member);
    // The live waiter's first refresh after the crashed one's deadline passed.
    let past = crashed_deadline + 500;
    assert!(
        poll_until(T, || redis.now_ms() > past && score(&live) > past + 2_000).await,
        "refreshed"
    );
    let gone = || !redis.cli(&["LRANGE", &queue, "0", "-1"]).contains(crashed);
    assert!(poll_until(T, gone).await, "the crashed waiter swept out");
    let behind = || score(&dead) - score(&live);
    assert!(
        poll_until(T, || behind() == 2_000).await,
        "kept 2 s behind: {} ms",
        behind()
    );
    // Three refreshes more (every 5/3 s): still 2 s behind.
    let later = score(&live) + 4_000;
    assert!(poll_until(T, || score(&live) > later).await, "refreshed");
    // (Polled: the two scores are read apart, and a refresh may come between.)
    assert!(
        poll_until(T, || behind() == 2_000).await,
        "still 2 s behind: {} ms",
        behind()
    );
    free_within_a_wait(&client, name, holder, waiter).await;
}

/// A waiter behind another that finds the lock free (the holder's lease ran out, the
/// waiter ahead not yet in) looks again within a second: the waiter ahead, a Java one
/// here, then takes the lock for a lease nothing announces. It looked again only at the
/// waiter ahead's deadline: with the Java hold gone (its JVM dead) the lock stayed
/// free for nobody until then, a minute here (the full run's flake of the test below,
/// whose waiter tried in the moment between a release and the Java grant).
#[tokio::test]
async fn a_waiter_behind_another_on_a_free_lock_looks_again_soon() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--fair-wait-timeout", "90s"]).await;
    let client = server.client().await;
    let fair = || client.lock("between").kind(LockKind::Fair);
    let _holder = fair().lease(Duration::from_secs(1)).try_once().acquire().await.unwrap();
    let conn = redis_client(&redis.url()).await;
    let java = RedissonFairLock::new(&conn, "between", &random_owner()).with_thread_wait(60_000);
    assert!(java.try_lock(2_000).await.is_some(), "the Java waiter queues");
    let (waiter, _) = latchkey_tests::server::spawn_queued(fair().wait(Duration::from_secs(60)), T).await;
    // The holder's lease runs out (no release wakes anyone): the waiter looks again by
    // then and finds the lock free, the Java waiter ahead.
    assert!(
        poll_until(T, || redis.cli(&["EXISTS", "between"]).trim() == "0").await,
        "the lease ran out"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    granted_after_a_java_hold(&java, waiter, Instant::now(), Duration::from_secs(5)).await;
}

/// A waiter behind another looks again by the holder's lease end too: the waiter ahead
/// may be granted the lock meanwhile (its grant wakes nobody behind it), and a holder
/// gone without a release leaves the lock then to the next in line. It looked again at
/// the waiter ahead's deadline or a third of `--fair-wait-timeout` only: with 90 s, a
/// Java waiter granted and then gone (its JVM dead, its lease 2 s) left the lock free
/// for nobody until about 30 s.
#[tokio::test]
async fn a_waiter_behind_another_looks_again_by_the_holders_lease_end() {
    released_behind_a_java_waiter("behind", false).await;
}

/// A waiter behind an entry past its deadline (a dead server's or JVM's, not yet at the
/// head, where it is swept) ignores that deadline: it looks again by the holder's lease
/// end. It read the passed deadline as no TTL at all and looked again at a third of
/// `--fair-wait-timeout` (30 s here).
#[tokio::test]
async fn a_waiter_behind_a_lapsed_entry_looks_again_by_the_holders_lease_end() {
    released_behind_a_java_waiter("lapsed-ahead", true).await;
}

/// A holder of `name` (a 3 s lease), a Java waiter queued behind it (and, with
/// `lapsed`, an entry past its deadline behind that one), then a latchkey waiter: the
/// holder releases, and the waiter is granted by the Java hold's end
/// ([`granted_after_a_java_hold`]).
async fn released_behind_a_java_waiter(name: &str, lapsed: bool) {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--fair-wait-timeout", "90s"]).await;
    let client = server.client().await;
    let fair = || client.lock(name).kind(LockKind::Fair);
    let holder = fair().lease(Duration::from_secs(3)).try_once().acquire().await.unwrap();
    let conn = redis_client(&redis.url()).await;
    let java = RedissonFairLock::new(&conn, name, &random_owner());
    assert!(java.try_lock(2_000).await.is_some(), "the Java waiter queues");
    if lapsed {
        let dead = random_owner();
        redis.cli(&["RPUSH", &format!("redisson_lock_queue:{{{name}}}"), &dead]);
        let passed = (redis.now_ms() - 1).to_string();
        redis.cli(&["ZADD", &format!("redisson_lock_timeout:{{{name}}}"), &passed, &dead]);
    }
    let (waiter, _) = latchkey_tests::server::spawn_queued(fair().wait(Duration::from_secs(60)), T).await;
    let started = Instant::now();
    holder.release().await.unwrap();
    granted_after_a_java_hold(&java, waiter, started, Duration::from_secs(6)).await;
}

/// The Java waiter `java` takes the lock for 2 s and is gone without a release:
/// `waiter`, behind it, is granted within `bound` of `since`, by the Java hold's end,
/// not the Java waiter's deadline.
async fn granted_after_a_java_hold(
    java: &RedissonFairLock,
    waiter: latchkey_tests::server::Waiting,
    since: Instant,
    bound: Duration,
) {
    assert_eq!(
        java.try_lock(2_000).await,
        None,
        "the Java waiter takes the lock for 2 s"
    );
    let lease = tokio::time::timeout(T, waiter)
        .await
        .expect("granted once the Java hold ran out")
        .unwrap()
        .expect("granted");
    assert!(
        since.elapsed() < bound,
        "granted {:?} on; the Java hold ran out by 2 s",
        since.elapsed()
    );
    lease.release().await.unwrap();
}

/// Two streams of one client-named owner share its place in the queue. A grant to the
/// first that ended before it took it (here, gone while the handoff that granted it ran)
/// is given back with the place at the head of the queue, and the lock goes to the
/// second, still waiting: it went to the next owner in line, and the second stream
/// queued again behind it.
#[tokio::test]
async fn a_grant_given_back_unheld_keeps_its_owners_place_for_its_other_stream() {
    let redis = RedisServer::start();
    let proxy = Proxy::to_redis(&redis).await;
    let server = LatchkeyProcess::start(&proxy.redis_url());
    let client = server.serving_client().await;
    let fair = |owner: &str| {
        let lock = client.lock("shared-place").kind(LockKind::Fair).wait(WAIT);
        if owner.is_empty() {
            lock
        } else {
            lock.owner(owner)
        }
    };
    let holder = fair("").acquire().await.unwrap();
    let (first, _) = spawn_queued(fair("pair-owner"), T).await;
    let (second, _) = spawn_queued(fair("pair-owner"), T).await;
    let (next, _) = spawn_queued(fair(""), T).await;
    let owners = waiter_owners(&client.describe("shared-place").await.unwrap());
    assert_eq!(owners.len(), 2, "one place for the pair: {owners:?}");
    assert_eq!(owners[0], "pair-owner");

    // The handoff to the pair's first stream waits in the proxy while that stream goes.
    let handoff = latchkey_server::scripts::Scripts::new(false).handoff.sha().to_owned();
    proxy.hold_back_matching(Some((handoff.as_bytes(), Duration::from_millis(1500))));
    let release = tokio::spawn(async move { holder.release().await });
    assert!(poll_until(T, || proxy.holding() > 0).await, "the handoff was held back");
    first.abort();
    assert!(
        poll_until(T, || server.metric("latchkey_waiters") == 2.0).await,
        "the first stream's end was heard"
    );
    // Only the first handoff: the lock's next ones go as they come.
    assert!(
        poll_until(T, || proxy.first_held().is_some()).await,
        "the handoff went on"
    );
    proxy.hold_back_matching(None);
    let second = tokio::time::timeout(T, second)
        .await
        .expect("the second stream took its owner's place")
        .unwrap()
        .expect("granted");
    assert!(!next.is_finished(), "the next owner in line waits");
    release.await.unwrap().unwrap();
    drop(second);
    tokio::time::timeout(T, next)
        .await
        .expect("then the next owner")
        .unwrap()
        .unwrap();
}
