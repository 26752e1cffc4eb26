//! RedLock over three independent redis-server processes: a majority grants, a
//! minority never does, nothing is left behind on failure, and losing the majority
//! while holding is reported.

use latchkey_client::LostReason;
use latchkey_tests::proxy::Proxy;
use latchkey_tests::server::{spawn_queued, Latchkey};
use latchkey_tests::{bounded, metric, scrape_metrics, LatchkeyProcess, RedisServer};
use std::time::{Duration, Instant};
use tonic::Code;

const T: Duration = Duration::from_secs(10);

struct Nodes {
    nodes: Vec<RedisServer>,
    /// The servers' main Redis, none of the nodes.
    main: RedisServer,
}

impl Nodes {
    fn start() -> Nodes {
        Nodes {
            nodes: (0..3).map(|_| RedisServer::start()).collect(),
            main: RedisServer::start(),
        }
    }

    async fn server(&self, extra: &[&str]) -> Latchkey {
        let urls: Vec<String> = self.nodes.iter().map(RedisServer::url).collect();
        self.server_on(&urls, extra).await
    }

    /// A server that reaches the third node through a proxy.
    async fn server_with_proxy(&self, extra: &[&str]) -> (Latchkey, Proxy) {
        let proxy = Proxy::to_redis(&self.nodes[2]).await;
        let urls = [self.nodes[0].url(), self.nodes[1].url(), proxy.redis_url()];
        (self.server_on(&urls, extra).await, proxy)
    }

    async fn server_on(&self, urls: &[String], extra: &[&str]) -> Latchkey {
        server_with_redlock(&self.main, urls, extra).await
    }

    fn holders(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .filter(|n| n.cli(&["EXISTS", name]).trim() == "1")
            .count()
    }

    /// The values of node `i`'s hold records of lock `name`.
    fn hold_records(&self, i: usize, name: &str) -> Vec<String> {
        let node = &self.nodes[i];
        let keys = node.cli(&["KEYS", &format!("latchkey_hold:{{{name}}}:*")]);
        keys.lines()
            .filter(|k| !k.trim().is_empty())
            .map(|k| node.cli(&["GET", k.trim()]).trim().to_owned())
            .collect()
    }
}

/// A server on the main Redis `main` with the RedLock deployments at `urls`.
async fn server_with_redlock(main: &RedisServer, urls: &[String], extra: &[&str]) -> Latchkey {
    server_with_redlock_on(&main.url(), urls, extra).await
}

const RESTART_DELAY: &str = "--redlock-restart-delay";

/// A server on the main Redis at `main_url` with the RedLock deployments at `urls`.
/// The nodes were started just now: they count at once unless `extra` sets a
/// `--redlock-restart-delay`.
async fn server_with_redlock_on(main_url: &str, urls: &[String], extra: &[&str]) -> Latchkey {
    let mut args: Vec<String> = Vec::new();
    for url in urls {
        args.extend(["--redlock-url".to_owned(), url.clone()]);
    }
    if !extra.contains(&RESTART_DELAY) {
        args.extend([RESTART_DELAY.to_owned(), "0s".to_owned()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Latchkey::start_with(main_url, &args).await
}

#[tokio::test]
async fn a_majority_grants_and_waiters_wake_on_release() {
    let nodes = Nodes::start();
    let server = nodes.server(&[]).await;
    grants_by_majority_and_wakes_on_release(&nodes, &server).await;
}

/// With a cluster as the main Redis, the RedLock nodes (each a standalone Redis) run
/// the scripts as a standalone Redis does: they published the unlock message with the
/// cluster's `SPUBLISH`, which the waiters' `SUBSCRIBE` on the nodes never heard, and a
/// waiter was granted only when the holder's lease ran out.
#[tokio::test]
async fn waiters_wake_on_release_beside_a_cluster() {
    let nodes = Nodes::start();
    let cluster = latchkey_tests::RedisCluster::start(3, 0);
    let urls: Vec<String> = nodes.nodes.iter().map(RedisServer::url).collect();
    let server = server_with_redlock_on(&cluster.url(), &urls, &[]).await;
    // The nodes have the scripts they run loaded from the start, so that no first call
    // spends its part of the lease on a reload (the cluster's were loaded there).
    let standalone = latchkey_server::scripts::Scripts::new(false);
    for node in &nodes.nodes {
        for script in standalone.all() {
            let loaded = node.cli(&["SCRIPT", "EXISTS", script.sha()]);
            assert_eq!(loaded.trim(), "1", "{} on {}", script.sha(), node.url());
        }
    }
    grants_by_majority_and_wakes_on_release(&nodes, &server).await;
}

/// A RedLock granted on all three nodes, refused to a second try, and handed to a
/// waiter within a second of its release.
async fn grants_by_majority_and_wakes_on_release(nodes: &Nodes, server: &Latchkey) {
    let client = server.client().await;
    let first = client.lock("rl").redlock(true).acquire().await.expect("all three up");
    assert_eq!(nodes.holders("rl"), 3);
    let err = client.lock("rl").redlock(true).try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    assert_eq!(nodes.holders("rl"), 3, "the refused attempt left nothing of its own");
    let waiter = {
        let client = client.clone();
        tokio::spawn(async move { client.lock("rl").redlock(true).wait(T).acquire().await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    let token = first.fencing_token();
    first.release().await.unwrap();
    let second = bounded(T, "the waiter", waiter)
        .await
        .unwrap()
        .expect("woken by the unlock message");
    assert!(released.elapsed() < Duration::from_secs(1), "{:?}", released.elapsed());
    assert!(second.fencing_token() > token);
}

#[tokio::test]
async fn one_node_down_still_grants_two_down_fails_cleanly() {
    let mut nodes = Nodes::start();
    let server = nodes.server(&["--redis-timeout", "300ms"]).await;
    let client = server.client().await;
    nodes.nodes[2].stop();
    let lease = client.lock("rl1").redlock(true).acquire().await.expect("two of three");
    lease.release().await.unwrap();
    nodes.nodes[1].stop();
    let err = client
        .lock("rl2")
        .redlock(true)
        .wait(Duration::from_secs(2))
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert_eq!(
        nodes.nodes[0].cli(&["EXISTS", "rl2"]).trim(),
        "0",
        "nothing left on the survivor"
    );
    // Its fencing counter keeps the token it drew (never lowered), with a lifetime.
    let left = nodes.nodes[0].cli(&["KEYS", "*rl2*"]);
    assert!(
        left.lines()
            .all(|k| k.starts_with("latchkey_hold:") || k.starts_with("latchkey_fence:")),
        "no lock key of the failed attempt: {left}"
    );
    let fence = latchkey_server::keys::Keys::default().lock("rl2").fence();
    let ttl: i64 = nodes.nodes[0].cli(&["PTTL", &fence]).trim().parse().unwrap();
    assert!(ttl > 0, "the counter expires: {ttl}");
    // Its unanswered nodes may yet grant: its hold record stays revoked for a while.
    assert_eq!(nodes.hold_records(0, "rl2"), ["revoked"]);
}

#[tokio::test]
async fn a_node_down_does_not_hold_up_shutdown() {
    let mut nodes = Nodes::start();
    let server = nodes.server(&["--redis-timeout", "300ms"]).await;
    nodes.nodes[2].stop();
    let lease = server.client().await.lock("rl").redlock(true).acquire().await.unwrap();
    lease.release().await.unwrap();
    // The release goes on in the background on the node that is down; a shutdown
    // makes that one last call rather than waiting out the lease.
    let stopping = Instant::now();
    server.stop().await;
    assert!(stopping.elapsed() < Duration::from_secs(5), "{:?}", stopping.elapsed());
}

#[tokio::test]
async fn losing_the_majority_while_holding_is_reported() {
    let mut nodes = Nodes::start();
    let server = nodes
        .server(&["--watchdog-timeout", "3s", "--redis-timeout", "200ms"])
        .await;
    let lease = server.client().await.lock("rl").redlock(true).acquire().await.unwrap();
    // Two renewal rounds, each node given a tenth of the lease (300 ms) to answer.
    tokio::time::sleep(Duration::from_millis(2300)).await;
    assert!(!lease.is_lost(), "renewed on every node");
    nodes.nodes[0].stop();
    nodes.nodes[1].stop();
    let reason = tokio::time::timeout(T, lease.lost()).await.expect("told");
    assert_eq!(reason, LostReason::NotHeld);
}

/// A fixed RedLock lease is checked every round too: a majority of nodes that lost the
/// lock (restarted empty, flushed) may grant it to another at once. Only leases the
/// watchdog renews were looked at, and a fixed lease's holder heard nothing until its
/// lease ended.
#[tokio::test]
async fn a_fixed_redlock_lease_whose_majority_lost_it_is_told() {
    let nodes = Nodes::start();
    let server = nodes.server(&["--watchdog-timeout", "900ms"]).await;
    let client = server.client().await;
    let lease = client
        .lock("rl-fixed")
        .redlock(true)
        .lease(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    nodes.nodes[0].cli(&["FLUSHALL"]);
    nodes.nodes[1].cli(&["FLUSHALL"]);
    let reason = tokio::time::timeout(Duration::from_secs(3), lease.lost())
        .await
        .expect("told at the next round");
    assert_eq!(reason, LostReason::NotHeld);
}

/// A node that stops answering is a minority RedLock tolerates: it must cost neither the
/// main Redis's leases nor the RedLock leases the other two still renew. The watchdog's
/// rounds once waited a Redis timeout per call for it, and the main Redis's leases,
/// renewed in the same rounds, went unconfirmed past the expiry check's limit.
#[tokio::test]
async fn a_silent_node_loses_neither_main_redis_leases_nor_those_a_majority_renews() {
    let nodes = Nodes::start();
    let (server, proxy) = nodes
        .server_with_proxy(&["--watchdog-timeout", "1500ms", "--redis-timeout", "800ms"])
        .await;
    let client = server.client().await;
    let plain = client.lock("plain").acquire().await.expect("the main Redis grants");
    let red = client
        .lock("red")
        .redlock(true)
        .acquire()
        .await
        .expect("three nodes grant");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert!(!plain.is_lost() && !red.is_lost(), "renewed before the fault");
    proxy.freeze();
    let frozen = Instant::now();
    // Over three watchdog timeouts: every lease needs renewing while the node is silent.
    while frozen.elapsed() < Duration::from_secs(5) {
        assert!(
            !plain.is_lost(),
            "the main Redis's lease was told {:?} {:?} after a node went silent",
            plain.lost_reason(),
            frozen.elapsed()
        );
        assert!(
            !red.is_lost(),
            "a lease two of three nodes renew was told {:?} {:?} after a node went silent",
            red.lost_reason(),
            frozen.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.thaw();
    plain.release().await.expect("still held");
    red.release().await.expect("still held");
}

/// A majority of nodes silent through two renewal rounds, back well before the keys
/// the last round renewed expire: the lease stays held. The leases a round could not
/// settle are tried again after a second, as the main Redis's are; they waited for the
/// next round, after the holder had been told `NOT_HELD` while every node still held.
#[tokio::test]
async fn a_majority_back_before_the_lock_expires_keeps_the_lease() {
    let nodes = Nodes::start();
    // Rounds every 4 s; told lost 10.6 s after the last confirmation.
    let server = nodes
        .server(&["--watchdog-timeout", "12s", "--redis-timeout", "300ms"])
        .await;
    let lease = server.client().await.lock("rl").redlock(true).acquire().await.unwrap();
    // A round: node 2's TTL goes back up to ~12 s when the watchdog renews it.
    let pttl = || nodes.nodes[2].cli(&["PTTL", "rl"]).trim().parse::<i64>().unwrap();
    let mut last = pttl();
    let waited = Instant::now();
    let round = loop {
        assert!(waited.elapsed() < T, "no renewal round seen");
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = pttl();
        if now > last {
            break Instant::now();
        }
        last = now;
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    nodes.nodes[0].freeze();
    nodes.nodes[1].freeze();
    // Silent through the next two rounds (4 s and 8 s on), back 2.3 s before the holder
    // would be told and 3.7 s before the keys renewed at `round` expire.
    tokio::time::sleep_until((round + Duration::from_millis(8300)).into()).await;
    nodes.nodes[0].resume();
    nodes.nodes[1].resume();
    while round.elapsed() < Duration::from_millis(12_500) {
        assert!(
            !lease.is_lost(),
            "told {:?} {:?} after the last renewal; a majority answers since 8.3 s",
            lease.lost_reason(),
            round.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(nodes.holders("rl"), 3, "renewed on every node");
    lease.release().await.expect("still held");
}

#[tokio::test]
async fn a_node_restarted_empty_does_not_hand_out_a_second_majority() {
    let mut nodes = Nodes::start();
    let server = nodes.server(&[]).await;
    let client = server.client().await;
    let first = client.lock("rl").redlock(true).acquire().await.unwrap();
    nodes.nodes[0].restart();
    let err = client.lock("rl").redlock(true).try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "one node alone is no majority");
    assert_eq!(
        nodes.nodes[0].cli(&["EXISTS", "rl"]).trim(),
        "0",
        "the failed attempt gave back its node"
    );
    assert!(!first.is_lost());
    first.release().await.unwrap();
}

#[tokio::test]
async fn a_node_that_missed_the_release_is_released_once_it_answers() {
    let nodes = Nodes::start();
    let (server, proxy) = nodes.server_with_proxy(&["--redis-timeout", "300ms"]).await;
    let lease = server.client().await.lock("rl").redlock(true).acquire().await.unwrap();
    assert_eq!(nodes.holders("rl"), 3);
    proxy.freeze();
    lease.release().await.expect("a majority gave back");
    assert_eq!(nodes.holders("rl"), 1, "the cut-off node still holds");
    proxy.thaw();
    let released = Instant::now();
    while nodes.holders("rl") > 0 {
        // Its lease is the watchdog's 30 s: well before, the release went on there.
        assert!(released.elapsed() < T, "the cut-off node was never released");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_stream_that_a_node_failed_revokes_its_holds_on_release() {
    let nodes = Nodes::start();
    // A 2 s lease gives each node 200 ms to answer; the third answers after 500.
    let (server, proxy) = nodes.server_with_proxy(&["--watchdog-timeout", "2s"]).await;
    let client = server.client().await;
    proxy.set_delay(Duration::from_millis(500));
    let lease = client
        .lock("rl")
        .redlock(true)
        .acquire()
        .await
        .expect("two of three in time");
    proxy.set_delay(Duration::ZERO);
    lease.release().await.unwrap();
    // The late try may have granted on the third node; the release (after it on the
    // same connection) gave that back, and each node keeps a revoked record, so a try
    // resent after a reconnect grants nothing.
    for i in 0..3 {
        assert_eq!(nodes.hold_records(i, "rl"), ["revoked"], "node {i}");
    }
    assert_eq!(nodes.holders("rl"), 0);
    let again = client
        .lock("rl")
        .redlock(true)
        .acquire()
        .await
        .expect("free for a new stream");
    again.release().await.unwrap();
}

#[tokio::test]
async fn a_waiter_gone_during_a_try_that_a_node_failed_revokes_its_holds() {
    let nodes = Nodes::start();
    // A 2 s lease gives each node 200 ms to answer; the third answers after 500.
    let (server, proxy) = nodes.server_with_proxy(&["--watchdog-timeout", "2s"]).await;
    let client = server.client().await;
    let holder = client.lock("rl").redlock(true).acquire().await.unwrap();
    proxy.set_delay(Duration::from_millis(500));
    // The waiter's client gives up while its first try waits for the third node.
    let waiter = client.lock("rl").redlock(true).wait(T).acquire();
    assert!(tokio::time::timeout(Duration::from_millis(50), waiter).await.is_err());
    proxy.set_delay(Duration::ZERO);
    // Its try found the lock busy, but the third node may still grant it: each node
    // gets a revoked record of the waiter's stream beside the holder's record.
    let gone = Instant::now();
    while (0..3).any(|i| !nodes.hold_records(i, "rl").contains(&"revoked".to_owned())) {
        assert!(
            gone.elapsed() < T,
            "no revoked records: {:?}",
            nodes.hold_records(0, "rl")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    holder.release().await.unwrap();
    assert_eq!(nodes.holders("rl"), 0);
}

/// A busy try took nothing on a node that answered busy: it gives nothing back there
/// (a give-back there cost a script call per node and, from a slow node, put a stream
/// that held nothing in doubt).
#[tokio::test]
async fn a_busy_try_gives_nothing_back_where_it_took_nothing() {
    let nodes = Nodes::start();
    let server = nodes.server(&["--watchdog-timeout", "60s"]).await;
    let client = server.client().await;
    let _held = client.lock("nb").redlock(true).acquire().await.unwrap();
    let before: Vec<usize> = nodes.nodes.iter().map(RedisServer::evalsha_calls).collect();
    let err = client.lock("nb").redlock(true).try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    for (i, node) in nodes.nodes.iter().enumerate() {
        assert_eq!(
            node.evalsha_calls() - before[i],
            1,
            "node {i}: the try, and no give-back"
        );
    }
}

/// A node whose user may not publish refuses the try only at its announcement, after
/// the script took the lock there (Redis keeps a script's writes before its error): a
/// refusal is no proof that the node took nothing, and the give-back goes there too.
#[tokio::test]
async fn a_node_that_refused_the_try_after_taking_the_lock_is_given_back() {
    let no_channels = [
        "--user",
        "default",
        "off",
        "--user",
        "app",
        "on",
        ">pw",
        "~*",
        "resetchannels",
        "+@all",
    ];
    let nodes = [
        RedisServer::start(),
        RedisServer::start(),
        RedisServer::start_with(&no_channels),
    ];
    let main = RedisServer::start();
    let urls = [
        nodes[0].url(),
        nodes[1].url(),
        format!("redis://app:pw@127.0.0.1:{}", nodes[2].port()),
    ];
    let server = server_with_redlock(&main, &urls, &[]).await;
    let client = server.client().await;
    block(&nodes[0], "pc");
    block(&nodes[1], "pc");
    let err = client.lock("pc").redlock(true).try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    let exists = nodes[2].cli(&["--user", "app", "--pass", "pw", "--no-auth-warning", "EXISTS", "pc"]);
    assert_eq!(exists.trim(), "0", "nothing left held on the refusing node");
}

#[tokio::test]
async fn redlock_without_three_deployments_is_a_failed_precondition() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let err = server
        .client()
        .await
        .lock("rl")
        .redlock(true)
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
}

/// ForceRelease breaks a lock on the main Redis; a RedLock hold of the same name lives on
/// the RedLock deployments, which it does not touch. The break's notice names the key
/// and the main counter's floor, which a RedLock hold's token (the nodes' counters) is
/// no measure against: the RedLock hold is not told it was broken.
#[tokio::test]
async fn force_releasing_a_main_lock_leaves_a_redlock_hold_of_the_same_name() {
    let nodes = Nodes::start();
    let server = nodes.server(&[]).await;
    let client = server.client().await;
    let red = client
        .lock("shared")
        .redlock(true)
        .acquire()
        .await
        .expect("three nodes grant");
    // The main counter starts later from Redis' clock: its tokens are the larger.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let plain = client.lock("shared").acquire().await.expect("the main Redis grants");
    assert!(
        plain.fencing_token() > red.fencing_token(),
        "the premise: clock-based counters"
    );
    assert!(client.force_release("shared").await.unwrap(), "the main lock broken");
    let reason = tokio::time::timeout(T, plain.lost())
        .await
        .expect("the main holder is told");
    assert_eq!(reason, LostReason::ForceReleased);
    assert_eq!(nodes.holders("shared"), 3, "the RedLock hold stands");
    assert!(!red.is_lost(), "the RedLock hold was told {:?}", red.lost_reason());
    red.release().await.expect("still held");
}

/// A RedLock grant is valid for its lease less the drift allowed (1% of it plus 2 ms): a
/// fixed lease no longer than that could never be granted, and is refused at once
/// rather than waited out as if the lock were busy.
#[tokio::test]
async fn a_redlock_lease_no_longer_than_its_drift_is_refused() {
    let nodes = Nodes::start();
    let server = nodes.server(&[]).await;
    let client = server.client().await;
    // 2 ms is all drift; 6 ms leaves less than the 5 ms a try may take on the nodes
    // (a waiter on it took and gave back the lock on every node, again and again).
    for lease in [2, 6] {
        let refused = client
            .lock("tiny")
            .redlock(true)
            .lease(Duration::from_millis(lease))
            .wait(T)
            .acquire()
            .await
            .expect_err("refused");
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused}");
        assert_eq!(nodes.holders("tiny"), 0);
    }
}

/// A waiter on a lock held on a bare majority (the third node lost its copy) gets
/// the third node at each try and gives it back, which publishes an unlock there. Its
/// own give-back woke it: it tried again at once, thousands of times a second for as
/// long as the lock was held. A try that had to give back now waits a random, growing
/// pause before the next (the Redlock paper's retry delay).
#[tokio::test]
async fn a_waiter_is_not_woken_into_a_busy_loop_by_its_own_give_backs() {
    let nodes = Nodes::start();
    let server = nodes.server(&[]).await;
    let client = server.client().await;
    let holder = client.lock("bare").redlock(true).acquire().await.unwrap();
    nodes.nodes[2].cli(&["DEL", "bare"]);
    let before = nodes.nodes[2].evalsha_calls();
    let err = client
        .lock("bare")
        .redlock(true)
        .wait(Duration::from_secs(2))
        .acquire()
        .await
        .expect_err("held on a majority");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    let calls = nodes.nodes[2].evalsha_calls() - before;
    // A pause from 10 ms, doubling: about ten tries in two seconds, three calls each.
    assert!(calls < 60, "{calls} script calls on the third node in 2 s");
    holder.release().await.unwrap();
}

/// A waiter listens once a majority of the nodes has its subscription: a release
/// publishes only where it freed a hold. The holder here has the second and third
/// nodes (the first holds the name for someone else); the waiter's subscription
/// reached the first node at once and the others 1.5 s late. Counted as listening
/// after the first node alone, the waiter tried again, found the lock busy and slept
/// through the release, published on the two others before its subscription got
/// there, until the first node's holder's TTL (20 s).
#[tokio::test]
async fn a_redlock_waiter_listens_once_a_majority_of_nodes_has_its_subscription() {
    let nodes = Nodes::start();
    let (b, c) = (
        Proxy::to_redis(&nodes.nodes[1]).await,
        Proxy::to_redis(&nodes.nodes[2]).await,
    );
    let urls = [nodes.nodes[0].url(), b.redis_url(), c.redis_url()];
    let server = nodes.server_on(&urls, &[]).await;
    let client = server.client().await;
    nodes.nodes[0].cli(&["HSET", "sub-late", "someone-else:1", "1"]);
    nodes.nodes[0].cli(&["PEXPIRE", "sub-late", "20000"]);
    let holder = client
        .lock("sub-late")
        .redlock(true)
        .acquire()
        .await
        .expect("two of three");
    for proxy in [&b, &c] {
        proxy.hold_back_matching(Some((b"SUBSCRIBE", Duration::from_millis(1500))));
    }
    let lock = client.lock("sub-late").redlock(true).wait(T);
    let (waiting, _) = latchkey_tests::server::spawn_queued(lock, T).await;
    // The waiter's try after its subscription on the first node (which the old count
    // took for listening) comes within milliseconds.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let released = Instant::now();
    holder.release().await.unwrap();
    let lease = bounded(T, "the waiter", waiting).await.unwrap().expect("granted");
    let took = released.elapsed();
    assert!(took < Duration::from_secs(3), "granted {took:?} after the release");
    for proxy in [&b, &c] {
        proxy.hold_back_matching(None);
    }
    lease.release().await.unwrap();
}

/// One RedLock node that takes no calls (frozen) is what RedLock exists to ride out: a
/// grant by the other two comes within the per-node timeout, not after every later call
/// to the frozen node (the fence raise, the give-back) waited out the Redis timeout. A
/// 1.5 s fixed lease used to arrive after 2 s, already over.
#[tokio::test]
async fn a_frozen_node_delays_a_grant_by_no_more_than_its_try() {
    let nodes = Nodes::start();
    let (server, proxy) = nodes.server_with_proxy(&["--redis-timeout", "2s"]).await;
    let client = server.client().await;
    proxy.freeze();
    let asked = Instant::now();
    let lease = client
        .lock("frozen-third")
        .redlock(true)
        .lease(Duration::from_millis(1500))
        .acquire()
        .await
        .expect("two of three");
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "granted after {:?}",
        asked.elapsed()
    );
    assert!(!lease.is_lost());
    lease.release().await.unwrap();
    // A busy try (a holder on the other two) answers once its try and give-back have
    // had their per-node timeout (half a second each for a watchdog lease), not the
    // Redis timeout.
    let _held = client.lock("frozen-busy").redlock(true).acquire().await.unwrap();
    let busy = client
        .lock("frozen-busy")
        .redlock(true)
        .wait(Duration::from_millis(300));
    refused_within(busy, Duration::from_millis(1500)).await;
}

/// Asks `lock`, held by another, and checks it is refused (`DEADLINE_EXCEEDED`) within
/// `limit`.
async fn refused_within(lock: latchkey_client::LockBuilder, limit: Duration) {
    let asked = Instant::now();
    let err = lock.acquire().await.expect_err("held");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    let took = asked.elapsed();
    assert!(took < limit, "answered after {took:?}");
}

/// Nodes that hold the name as another kind (a plain string) refuse it, as the main
/// Redis does: FAILED_PRECONDITION, not UNAVAILABLE "only N deployments answered",
/// which told clients to try again.
#[tokio::test]
async fn nodes_holding_the_name_as_another_kind_refuse_it_as_such() {
    let nodes = Nodes::start();
    let server = nodes.server(&[]).await;
    for node in &nodes.nodes {
        node.cli(&["SET", "not-a-lock", "x"]);
    }
    let err = server
        .client()
        .await
        .lock("not-a-lock")
        .redlock(true)
        .try_once()
        .acquire()
        .await
        .expect_err("a string");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
}

/// A RedLock release that finds the lock gone on a majority of nodes is told `lost`;
/// one node that lost it is no loss while a majority still held it.
#[tokio::test]
async fn a_release_that_finds_a_majority_gone_is_told_lost() {
    let nodes = Nodes::start();
    let server = nodes.server(&[]).await;
    let client = server.client().await;
    let kept = client.lock("one-gone").redlock(true).acquire().await.unwrap();
    nodes.nodes[0].cli(&["DEL", "one-gone"]);
    kept.release().await.expect("a majority still held it");
    let lost = client.lock("two-gone").redlock(true).acquire().await.unwrap();
    nodes.nodes[0].cli(&["DEL", "two-gone"]);
    nodes.nodes[1].cli(&["DEL", "two-gone"]);
    let err = lost.release().await.expect_err("a majority lost it before the release");
    assert!(
        matches!(err, latchkey_client::Error::Lost(LostReason::NotHeld)),
        "{err}"
    );
}

/// A fencing counter under the name that is no counter (here a string that is no
/// number) fails a RedLock try before it writes, as it fails a try on the main Redis:
/// `FAILED_PRECONDITION`. Each node's error counted as a node that did not answer, so
/// the client was told `UNAVAILABLE` (`REDLOCK_QUORUM_UNREACHABLE`), to try again, and
/// the stream was put in doubt for nothing.
#[tokio::test]
async fn a_foreign_fencing_counter_on_the_nodes_is_a_failed_precondition() {
    let nodes = Nodes::start();
    let server = nodes.server(&[]).await;
    let fence = latchkey_server::keys::Keys::default().lock("fk").fence();
    for node in &nodes.nodes {
        node.cli(&["SET", &fence, "abc"]);
    }
    let err = server
        .client()
        .await
        .lock("fk")
        .redlock(true)
        .try_once()
        .acquire()
        .await
        .expect_err("no counter");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    for i in 0..3 {
        assert!(nodes.hold_records(i, "fk").is_empty(), "node {i}: nothing revoked");
    }
    assert_eq!(nodes.holders("fk"), 0);
}

/// Holds the lock `name` on `node` for an owner of no stream here.
fn block(node: &RedisServer, name: &str) {
    node.cli(&["HSET", name, "blocker", "1"]);
    node.cli(&["PEXPIRE", name, "600000"]);
}

/// The fencing counter of `name` on `node`.
fn counter(node: &RedisServer, name: &str) -> u64 {
    let fence = latchkey_server::keys::Keys::default().lock(name).fence();
    node.cli(&["GET", &fence]).trim().parse().unwrap_or(0)
}

/// Sets the fencing counter of `name` on each node (ahead of every clock, so each draw
/// is the counter plus one).
fn set_counters(nodes: &Nodes, name: &str, values: [u64; 3]) {
    let fence = latchkey_server::keys::Keys::default().lock(name).fence();
    for (node, value) in nodes.nodes.iter().zip(values) {
        node.cli(&["SET", &fence, &value.to_string(), "PX", "600000"]);
    }
}

/// A failed try gave back the token it drew on a node by stepping the node's counter
/// back, if the counter still held that token. A concurrent grant of the same token,
/// whose fence raise found that node's counter at its token already, had counted the
/// node as raised; once stepped back, a later majority of that node and one the raise
/// missed drew the same token again. Here X's try takes node a alone (token C+1 there)
/// and fails; Y is granted C+1 by b and c while a is taken by another, its raise a
/// no-op on a and b and lost on c; Z then takes a and c, and must draw past C+1. (The
/// raise also left a's counter to expire with X's short lease, during Y's.) A failed
/// try now leaves its token drawn: nothing lowers a counter.
#[tokio::test]
async fn a_failed_try_never_lowers_a_counter_that_a_grant_counted_as_raised() {
    const C: u64 = 9_000_000_000_000_000;
    const D: u64 = 8_000_000_000_000_000;
    let nodes = Nodes::start();
    let name = "fence-race";
    let (a, b, c) = (&nodes.nodes[0], &nodes.nodes[1], &nodes.nodes[2]);
    // a and b in step, c behind (it missed an earlier raise).
    set_counters(&nodes, name, [C, C, D]);
    let scripts = latchkey_server::scripts::Scripts::new(false);
    let to_c = Proxy::to_redis(c).await;
    let x_server = nodes.server_on(&[a.url(), b.url(), c.url()], &[]).await;
    let y_server = nodes.server_on(&[a.url(), b.url(), to_c.redis_url()], &[]).await;
    to_c.hold_back_matching(Some((scripts.fence_raise.sha().as_bytes(), Duration::from_secs(60))));
    block(b, name);
    block(c, name);
    let x = x_server.client().await;
    // A short lease: X's draw leaves a's counter to live 6 s.
    let err = x
        .lock(name)
        .redlock(true)
        .lease(Duration::from_secs(1))
        .try_once()
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    block(a, name);
    b.cli(&["DEL", name]);
    c.cli(&["DEL", name]);
    let y_client = y_server.client().await;
    let y = tokio::time::timeout(T, y_client.lock(name).redlock(true).acquire())
        .await
        .expect("granted in time")
        .expect("b and c grant");
    assert_eq!(y.fencing_token(), C + 1);
    // Counted as raised, a's counter lives as long as Y's lease (30 s) and grace: had
    // it expired first, a would draw from its clock, far below C.
    let fence = latchkey_server::keys::Keys::default().lock(name).fence();
    let ttl: i64 = a.cli(&["PTTL", &fence]).trim().parse().unwrap();
    assert!(ttl > 30_000, "a's counter expires in {ttl} ms, during Y's lease");
    let on_a = counter(a, name);
    // b gives back; with c's answer stuck behind the raise and a's that it had no hold,
    // the release confirms nothing (a and c may be a majority that lost it).
    let released = y.release().await;
    assert_eq!(released.map_err(|e| e.code()), Err(Code::Unavailable));
    // a free again, b taken by another, c without Y's hold (its release to c is stuck
    // behind the raise).
    a.cli(&["DEL", name]);
    block(b, name);
    c.cli(&["DEL", name]);
    let z = x
        .lock(name)
        .redlock(true)
        .try_once()
        .acquire()
        .await
        .expect("a and c grant");
    assert!(
        z.fencing_token() > C + 1,
        "Z was granted {} after Y's {}: a's counter, counted as raised to it, was {on_a}",
        z.fencing_token(),
        C + 1
    );
}

/// A try that finds a grant of its own stream on a node (an earlier try that reached the
/// node late, after its give-back, as a command resent after a reconnect does) replayed
/// that grant's token, which the node drew long before. The majority's token could then
/// be no larger than that of a grant in between, whose raise reached that node and
/// another but not the third. Here the grant in between (token RAISED) raised b and c;
/// the stream's try is granted by a, which it missed, and c, which replays.
#[tokio::test]
async fn a_replayed_grant_on_a_node_draws_a_new_token() {
    const RAISED: u64 = 9_000_000_000_000_000;
    const BEHIND: u64 = 8_000_000_000_000_000;
    const OLD: u64 = 7_000_000_000_000_000;
    let nodes = Nodes::start();
    let server = nodes.server(&[]).await;
    let client = server.client().await;
    // This server's stream ids: a probe's hold record names the next stream's.
    let probe = client.lock("probe").redlock(true).acquire().await.unwrap();
    let record = nodes.nodes[0].cli(&["KEYS", "latchkey_hold:{probe}:*"]);
    let id = record
        .trim()
        .strip_prefix("latchkey_hold:{probe}:")
        .expect("one record");
    let (server_id, n) = id.rsplit_once(':').expect("<server id>:<n>");
    let next_id = format!("{server_id}:{}", n.parse::<u64>().unwrap() + 1);
    probe.release().await.unwrap();
    let name = "replayed";
    set_counters(&nodes, name, [BEHIND, RAISED, RAISED]);
    block(&nodes.nodes[1], name);
    // The next stream's grant on c, made by an earlier try with the token c drew then.
    let c = &nodes.nodes[2];
    c.cli(&["HSET", name, "s-owner", "1"]);
    c.cli(&["PEXPIRE", name, "60000"]);
    let hold = latchkey_server::keys::Keys::default().lock(name).hold(&next_id);
    c.cli(&["SET", &hold, &OLD.to_string(), "PX", "65000"]);
    let s = client
        .lock(name)
        .redlock(true)
        .owner("s-owner")
        .try_once()
        .acquire()
        .await
        .expect("a and c grant");
    assert!(
        s.fencing_token() > RAISED,
        "granted {} after a grant of {RAISED}",
        s.fencing_token()
    );
    assert_eq!(
        c.cli(&["GET", &hold]).trim(),
        s.fencing_token().to_string(),
        "c's record"
    );
    s.release().await.unwrap();
}

/// A try that fails gives back on every node within the per-node timeout of its lease,
/// as the README says, not the 500 ms bound of a stream's release: with a frozen node a
/// try-once of a 200 ms lease answered after half a second, and each try of a waiter on
/// such a lock overshot its wait by as much.
#[tokio::test]
async fn a_failed_try_gives_back_within_its_per_node_timeout() {
    let nodes = Nodes::start();
    let (server, proxy) = nodes.server_with_proxy(&["--redis-timeout", "2s"]).await;
    let client = server.client().await;
    proxy.freeze();
    let _held = client.lock("fb").redlock(true).acquire().await.expect("two of three");
    // The try and the give-back, 20 ms each on the frozen node (the old code waited out
    // a release's 500 ms bound: room enough for a loaded machine in between).
    let busy = client
        .lock("fb")
        .redlock(true)
        .lease(Duration::from_millis(200))
        .try_once();
    refused_within(busy, Duration::from_millis(400)).await;
}

/// A grant is valid for its lease less the time its try took and the drift; the fence
/// raise after the try takes time too. Validity was counted before the raise, so a
/// short lease whose raise waited out a node's timeout was granted with nothing left:
/// `acquired`, then at once `lost{LEASE_EXPIRED}`, after holding every node. Here an
/// 8 ms lease (5 ms per node, 2.08 ms of drift) meets a raise held back on the third
/// node. The validation floor now counts the raise too, so such a lease is refused
/// before it tries; the give-back stays for a try and raise slower than their timeouts.
#[tokio::test]
async fn a_grant_with_no_validity_left_after_its_raise_is_given_back() {
    let nodes = Nodes::start();
    let (server, proxy) = nodes.server_with_proxy(&[]).await;
    let client = server.client().await;
    let raise = latchkey_server::scripts::Scripts::new(false).fence_raise;
    proxy.hold_back_matching(Some((raise.sha().as_bytes(), Duration::from_millis(500))));
    let err = client
        .lock("late-raise")
        .redlock(true)
        .lease(Duration::from_millis(8))
        .try_once()
        .acquire()
        .await
        .expect_err("no validity left once raised");
    assert!(
        matches!(err.code(), Code::DeadlineExceeded | Code::InvalidArgument),
        "{err}"
    );
    for i in 0..2 {
        assert_eq!(nodes.nodes[i].cli(&["EXISTS", "late-raise"]).trim(), "0", "node {i}");
    }
}

/// A server on the main Redis `main` with `redlock_urls`, or why it did not start.
async fn start_with_redlock(main: &str, redlock_urls: &[&str]) -> Result<latchkey_server::Server, String> {
    let mut args = vec!["--listen", "127.0.0.1:0", "--no-metrics", "--redis-url", main];
    for url in redlock_urls {
        args.extend(["--redlock-url", url]);
    }
    let config = latchkey_server::config::Config::from_args(args).expect("flags parse");
    latchkey_server::Server::start(config).await.map_err(|e| e.to_string())
}

/// A Redis Cluster as a RedLock deployment was accepted: grants worked (every key of a
/// name shares its slot), but each node's renewals go as one script call for many names,
/// which a cluster refuses for names of other slots, so every stream-scoped RedLock
/// lease was told `lost{NOT_HELD}` once more than one name was held. Such a URL is now
/// refused at start.
#[tokio::test]
async fn a_cluster_as_a_redlock_deployment_is_refused_at_start() {
    let main = RedisServer::start();
    let nodes: Vec<RedisServer> = (0..2).map(|_| RedisServer::start()).collect();
    let cluster = format!("redis-cluster://127.0.0.1:{}", latchkey_tests::free_port());
    let err = start_with_redlock(&main.url(), &[&nodes[0].url(), &nodes[1].url(), &cluster])
        .await
        .map(|server| drop(tokio::spawn(server.stop())))
        .expect_err("refused");
    assert!(err.contains("--redlock-url") && err.contains("cluster"), "{err}");
}

/// `redis://localhost:PORT` for a server at `redis://127.0.0.1:PORT`: one Redis whose
/// URLs differ.
fn alias(redis: &RedisServer) -> String {
    format!("redis://localhost:{}", redis.port())
}

/// One Redis behind two names (a host name and its address) among the RedLock
/// deployments is a "majority" of one; as the main Redis and a node it shares its keys
/// with RedLock's. Only the same host and port twice were refused, so both started.
#[tokio::test]
async fn one_redis_behind_two_names_is_refused_at_start() {
    let nodes = Nodes::start();
    let [a, b, _] = [0, 1, 2].map(|i| nodes.nodes[i].url());
    let err = start_with_redlock(&nodes.main.url(), &[&a, &b, &alias(&nodes.nodes[0])])
        .await
        .map(|server| drop(tokio::spawn(server.stop())))
        .expect_err("two names of one node");
    assert!(
        err.contains("--redlock-url #3 (redis://localhost:") && err.contains("same Redis as --redlock-url #1"),
        "{err}"
    );
    let c = nodes.nodes[2].url();
    let err = start_with_redlock(&alias(&nodes.main), &[&a, &b, &c, &nodes.main.url()])
        .await
        .map(|server| drop(tokio::spawn(server.stop())))
        .expect_err("the main Redis as a node");
    assert!(
        err.contains("#4") && err.contains("the main Redis (--redis-url)"),
        "{err}"
    );
}

/// A TCP forwarder on a given port to a Redis that can change: a name that leads to
/// one Redis, then (its connections cut) to another.
struct Forwarder {
    target: std::sync::Arc<std::sync::atomic::AtomicU16>,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    pipes: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    async fn start(port: u16, target: &RedisServer) -> Forwarder {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.expect("bind");
        let target = std::sync::Arc::new(std::sync::atomic::AtomicU16::from(target.port()));
        let accepted = std::sync::Arc::<std::sync::atomic::AtomicUsize>::default();
        let pipes = std::sync::Arc::<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>::default();
        let (to, count, tasks) = (target.clone(), accepted.clone(), pipes.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let port = to.load(Ordering::SeqCst);
                let pipe = tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                tasks.lock().unwrap().push(pipe);
            }
        });
        Forwarder {
            target,
            accepted,
            pipes,
            accept,
        }
    }

    /// Leads to `target` from now on, cutting the connections made so far.
    fn retarget(&self, target: &RedisServer) {
        self.target.store(target.port(), std::sync::atomic::Ordering::SeqCst);
        for pipe in self.pipes.lock().unwrap().drain(..) {
            pipe.abort();
        }
    }

    /// Waits (bounded) until `n` connections more than `since` were made, then a
    /// moment for the server to ask who answers on them.
    async fn connected(&self, since: usize, n: usize) {
        let accepted = latchkey_tests::poll_until(T, || {
            self.accepted.load(std::sync::atomic::Ordering::SeqCst) >= since + n
        })
        .await;
        assert!(accepted, "the server never connected through the forwarder");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Three nodes and a server started with `flags` whose third node's URL leads nowhere
/// at first, then (once the server runs) through a forwarder to the third node, the
/// connections made.
async fn with_a_late_node(flags: &[&str]) -> (Nodes, Latchkey, latchkey_client::Client, Forwarder) {
    let nodes = Nodes::start();
    let port = latchkey_tests::free_port();
    let late = format!("redis://127.0.0.1:{port}");
    let urls = [nodes.nodes[0].url(), nodes.nodes[1].url(), late];
    let server = nodes.server_on(&urls, flags).await;
    let client = server.client().await;
    let forwarder = Forwarder::start(port, &nodes.nodes[2]).await;
    // Its command and subscriber connections.
    forwarder.connected(0, 2).await;
    (nodes, server, client, forwarder)
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.accept.abort();
        for pipe in self.pipes.lock().unwrap().drain(..) {
            pipe.abort();
        }
    }
}

/// A node that was down at start is checked once it connects, and again after each
/// reconnection (as a Sentinel's master changes at a failover): while it leads to the
/// same Redis as another node it counts for no majority. Here the third node comes up
/// as a Redis of its own and counts; then it leads to the first node's Redis, and a try
/// that the second node refuses was granted by the first node's Redis twice; then it
/// leads to a Redis of its own again.
#[tokio::test]
async fn a_node_is_checked_when_it_connects_after_start() {
    let (nodes, _server, client, forwarder) = with_a_late_node(&["--redis-timeout", "500ms"]).await;
    block(&nodes.nodes[1], "late");
    let lease = client
        .lock("late")
        .redlock(true)
        .try_once()
        .acquire()
        .await
        .expect("the first and the late node grant");
    lease.release().await.unwrap();
    let before = forwarder.accepted.load(std::sync::atomic::Ordering::SeqCst);
    forwarder.retarget(&nodes.nodes[0]);
    forwarder.connected(before, 2).await;
    let err = client
        .lock("late")
        .redlock(true)
        .try_once()
        .acquire()
        .await
        .expect_err("one Redis is no majority");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    assert_eq!(nodes.nodes[0].cli(&["EXISTS", "late"]).trim(), "0", "given back");
    // A Redis of its own again: it counts again.
    let before = forwarder.accepted.load(std::sync::atomic::Ordering::SeqCst);
    forwarder.retarget(&nodes.nodes[2]);
    forwarder.connected(before, 2).await;
    let lease = client
        .lock("late")
        .redlock(true)
        .try_once()
        .acquire()
        .await
        .expect("the first and the late node grant again");
    lease.release().await.unwrap();
}

/// A node that comes to lead to another node's Redis counts for no majority in the
/// renewals either: both answered for that one Redis, and a lease the other nodes had
/// lost was renewed as held by a majority of one. Here the late node leads to the
/// first node's Redis once the lease is granted, and the second node loses the lock:
/// only one Redis holds it, and the holder is told so.
#[tokio::test]
async fn renewals_count_a_redis_behind_two_nodes_once() {
    let flags = ["--redis-timeout", "500ms", "--watchdog-timeout", "1500ms"];
    let (nodes, _server, client, forwarder) = with_a_late_node(&flags).await;
    let lease = client
        .lock("twice")
        .redlock(true)
        .try_once()
        .acquire()
        .await
        .expect("every node grants");
    let before = forwarder.accepted.load(std::sync::atomic::Ordering::SeqCst);
    forwarder.retarget(&nodes.nodes[0]);
    forwarder.connected(before, 2).await;
    nodes.nodes[1].cli(&["DEL", "twice"]);
    let reason = tokio::time::timeout(Duration::from_secs(3), lease.lost())
        .await
        .expect("told within the lease, not renewed by one Redis counted twice");
    assert_eq!(reason, latchkey_client::LostReason::NotHeld);
}

/// A Sentinel's master is a deployment: its run id is the master's. Named through its
/// Sentinel and directly it is one Redis, refused at start; through its Sentinel beside
/// two others it grants.
#[tokio::test]
async fn a_sentinel_managed_node_is_its_master() {
    let nodes = Nodes::start();
    let mut sentinel = latchkey_tests::RedisSentinel::start();
    let master = sentinel.master().url();
    let err = start_with_redlock(&nodes.main.url(), &[&sentinel.url(), &master, &nodes.nodes[1].url()])
        .await
        .map(|server| drop(tokio::spawn(server.stop())))
        .expect_err("the master twice");
    assert!(
        err.contains("#2") && err.contains("same Redis as --redlock-url #1"),
        "{err}"
    );
    let urls = [sentinel.url(), nodes.nodes[1].url(), nodes.nodes[2].url()];
    let server = nodes.server_on(&urls, &[]).await;
    block(&nodes.nodes[1], "watched");
    let lease = server
        .client()
        .await
        .lock("watched")
        .redlock(true)
        .try_once()
        .acquire()
        .await
        .expect("the master and the third node grant");
    assert_eq!(sentinel.master().cli(&["EXISTS", "watched"]).trim(), "1");
    lease.release().await.unwrap();
}

/// A RedLock node down at start is skipped when the scripts are loaded (it loads them on
/// first use): each script waited out the Redis timeout on it, one after another, before
/// the server reported SERVING, every script one `--redis-timeout`.
#[tokio::test]
async fn a_node_down_at_start_does_not_hold_up_serving() {
    let nodes = Nodes::start();
    let down = format!("redis://127.0.0.1:{}", latchkey_tests::free_port());
    let urls = [nodes.nodes[0].url(), nodes.nodes[1].url(), down];
    let asked = Instant::now();
    let server = nodes.server_on(&urls, &["--redis-timeout", "500ms"]).await;
    // The start waits the Redis timeout for the node that does not connect.
    assert!(
        asked.elapsed() < Duration::from_secs(3),
        "SERVING after {:?}",
        asked.elapsed()
    );
    let lease = server
        .client()
        .await
        .lock("two-up")
        .redlock(true)
        .acquire()
        .await
        .expect("two of three");
    lease.release().await.unwrap();
}

/// A RedLock node busy running another application's script at start is asked who it
/// is until it answers, and counts once it does: the start's read gave up after the
/// Redis timeout, and only a reconnection asked again, so a node that stayed connected
/// sat out every majority for as long as the server ran.
#[tokio::test]
async fn a_node_busy_at_start_counts_once_it_answers() {
    let nodes = Nodes::start();
    let busy_node = &nodes.nodes[2];
    busy_node.cli(&["CONFIG", "SET", "busy-reply-threshold", "100"]);
    let busy = "local s = redis.call('time')[1] while redis.call('time')[1] - s < 3 do end";
    let script = {
        let port = busy_node.port().to_string();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new("redis-cli")
                .args(["-p", &port, "EVAL", busy, "0"])
                .output()
        })
    };
    let server = nodes.server(&["--redis-timeout", "500ms"]).await;
    let client = server.client().await;
    bounded(T, "the script", script).await.unwrap().expect("redis-cli ran");
    // The first node goes silent: a majority needs the node that was busy.
    nodes.nodes[0].freeze();
    let deadline = Instant::now() + T;
    let granted = loop {
        let lock = client.lock("busy-at-start").redlock(true).try_once();
        match lock.acquire().await {
            Ok(lease) => break Some(lease),
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(_) => break None,
        }
    };
    nodes.nodes[0].resume();
    let lease = granted.expect("the second and the third node grant");
    lease.release().await.unwrap();
}

/// Releases that a silent node missed are sent again once it answers, by one task per
/// node: each release kept a task of its own alive for as long as its lease could last
/// (an hour here), calling the node every few seconds, so their number grew with the
/// release rate times the lease.
#[tokio::test]
async fn releases_a_silent_node_missed_share_one_retry() {
    const N: usize = 100;
    let nodes = Nodes::start();
    let (server, proxy) = nodes.server_with_proxy(&["--redis-timeout", "300ms"]).await;
    let client = server.client().await;
    let tasks = || tokio::runtime::Handle::current().metrics().num_alive_tasks();
    let before = tasks();
    let mut leases = Vec::new();
    for i in 0..N {
        let lease = client
            .lock(format!("many/{i}"))
            .redlock(true)
            .lease(Duration::from_secs(3600))
            .acquire()
            .await
            .expect("three nodes grant");
        leases.push(lease);
    }
    let held_on_third = || {
        nodes.nodes[2]
            .cli(&["KEYS", "many/*"])
            .lines()
            .filter(|l| !l.is_empty())
            .count()
    };
    assert_eq!(held_on_third(), N);
    proxy.freeze();
    for released in futures::future::join_all(leases.into_iter().map(|l| l.release())).await {
        released.expect("two of three gave back");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = tasks();
    assert!(
        after < before + 20,
        "{after} tasks alive after {N} releases a node missed, {before} before"
    );
    proxy.thaw();
    let thawed = Instant::now();
    while held_on_third() > 0 {
        assert!(thawed.elapsed() < T, "{} holds left on the node", held_on_third());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// RedLock nodes with passwords of their own in their URLs, beside a main Redis whose
/// password comes from `--redis-password-file`: the file fills in only what a URL
/// leaves out. It replaced every node's password, and no RedLock request was served.
#[tokio::test]
async fn redlock_urls_keep_their_own_passwords_beside_a_password_file() {
    let main = RedisServer::start_with(&["--requirepass", "main-secret"]);
    let nodes: Vec<RedisServer> = (0..3)
        .map(|i| RedisServer::start_with(&["--requirepass", &format!("node-secret-{i}")]))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("redis-password");
    std::fs::write(&file, "main-secret\n").unwrap();
    let urls: Vec<String> = nodes.iter().map(RedisServer::url_with_password).collect();
    let server = server_with_redlock(&main, &urls, &["--redis-password-file", file.to_str().unwrap()]).await;
    let client = server.client().await;
    let lease = tokio::time::timeout(T, client.lock("own-passwords").redlock(true).try_once().acquire())
        .await
        .expect("answered in time")
        .expect("a majority of the nodes grants");
    lease.release().await.unwrap();
    let plain = client
        .lock("own-passwords")
        .try_once()
        .acquire()
        .await
        .expect("the main Redis grants");
    plain.release().await.unwrap();
}

/// A RedLock fixed lease of a named owner who holds the lock through another stream too:
/// its end gives back its hold on every node, though its release reaches two of them
/// 15 ms later than its try did. It ended only its clock drift early (12 ms of a
/// second), its release found the hold record past its lease there and gave back
/// nothing, and the owner's other stream kept a majority counted twice: after its
/// release the lock stayed held for its TTL. Now it ends a tenth early (100 ms at most)
/// as on the main Redis. A server starved of CPU past that margin gives back nothing
/// either, as it must (docs/safety.md, findings left): such an attempt, its give-back
/// forwarded by a proxy less than 30 ms before a node's lease ends, is run again. (The
/// loss notice's time does not say: the server can be descheduled between
/// telling the loss and sending the give-back.)
#[tokio::test]
async fn a_redlock_fixed_lease_of_a_reentrant_owner_gives_back_its_hold_when_it_ends() {
    let nodes = Nodes::start();
    let release = latchkey_server::scripts::Scripts::new(false).release;
    let (p0, p1) = (
        Proxy::to_redis(&nodes.nodes[0]).await,
        Proxy::to_redis(&nodes.nodes[1]).await,
    );
    let urls = [p0.redis_url(), p1.redis_url(), nodes.nodes[2].url()];
    let server = nodes.server_on(&urls, &[]).await;
    let client = server.client().await;
    for attempt in 0..3 {
        let name = format!("re-{attempt}");
        let lock = || client.lock(&name).redlock(true).owner("o");
        let outer = lock().acquire().await.expect("the owner's first hold");
        // No node took the fixed lease before this, so none ends its record before this
        // plus a second.
        let asked = Instant::now();
        let fixed = lock().lease(Duration::from_secs(1)).acquire().await.expect("reentered");
        assert_eq!(fixed.hold_count(), 2);
        assert_eq!(fixed.lease(), Some(Duration::from_millis(900)), "a tenth early");
        for proxy in [&p0, &p1] {
            proxy.hold_back_matching(Some((release.sha().as_bytes(), Duration::from_millis(15))));
        }
        assert_eq!(
            bounded(T, "the fixed lease's end", fixed.lost()).await,
            LostReason::LeaseExpired
        );
        let counts = || {
            nodes
                .nodes
                .iter()
                .map(|n| n.cli(&["HGET", &name, "o"]).trim().to_owned())
                .collect::<Vec<_>>()
        };
        let given_back = latchkey_tests::poll_until(T, || counts().iter().all(|c| c == "1")).await;
        // A give-back forwarded by then reaches its node inside the lease.
        let late = |p: &Proxy| p.first_held().is_some_and(|t| t > asked + Duration::from_millis(970));
        let on_time = !late(&p0) && !late(&p1);
        for proxy in [&p0, &p1] {
            proxy.hold_back_matching(None);
        }
        if !on_time && !given_back {
            outer.release().await.expect("released");
            continue;
        }
        assert!(given_back, "the owner's count on the nodes: {:?}", counts());
        outer.release().await.expect("released");
        let next = client
            .lock(&name)
            .redlock(true)
            .wait(Duration::from_secs(2))
            .acquire()
            .await;
        next.expect("free once the owner's last hold went")
            .release()
            .await
            .expect("released");
        return;
    }
    panic!("the server sent its give-back late in every attempt");
}

/// RedLock nodes whose ACL keeps the server's user from the keys it needs refuse every
/// script: the client hears what Redis said (`FAILED_PRECONDITION`, `REDIS_REFUSED`),
/// as from the main Redis, not an outage to retry (`UNAVAILABLE`, "only 0 RedLock
/// deployments answered"). The try's give-back, refused too, puts nothing in doubt: the
/// stream's end sent refused revoking releases to every node again and again for a
/// minute.
#[tokio::test]
async fn redlock_nodes_that_refuse_the_server_are_told_as_such() {
    let acl = [
        "--user", "default", "off", "--user", "app1", "on", ">pw", "~app1:*", "&*", "+@all",
    ];
    let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start_with(&acl)).collect();
    let main = RedisServer::start();
    let mut args = vec![
        "--redis-url".to_owned(),
        main.url(),
        "--key-prefix".to_owned(),
        "app1:".to_owned(),
    ];
    // A short Redis timeout: a release sent again goes out after it. The nodes were
    // started just now: they count at once.
    args.extend(["--redis-timeout", "300ms", "--redlock-restart-delay", "0s"].map(str::to_owned));
    for node in &nodes {
        let url = format!("redis://app1:pw@127.0.0.1:{}", node.port());
        args.extend(["--redlock-url".to_owned(), url]);
    }
    let server = LatchkeyProcess::spawn(&args);
    let port = server.metrics_port().expect("metrics enabled");
    let client = server.serving_client().await;
    let err = client
        .lock("orders")
        .redlock(true)
        .try_once()
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert_eq!(err.reason().as_deref(), Some("REDIS_REFUSED"), "{err}");
    let releases = || metric(&scrape_metrics(port), "latchkey_redis_errors_total{script=\"release\"}").unwrap_or(0.0);
    // The try's give-back and the stream's end, refused on every node; then, past the
    // pauses of releases sent again (the Redis timeout, doubling), nothing more.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let refused = releases();
    assert!(
        refused >= 3.0,
        "the try's give-back was refused on every node: {refused}"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(releases(), refused, "no refused release is sent again");
}

/// Waits until `node`, restarted, was asked `INFO` by someone else than this wait (the
/// server asks each node who it is once it connected again; each look here is an
/// `INFO commandstats`, counted after it answers).
async fn asked_who_it_is(node: &RedisServer) {
    let mut looks = 0;
    let asked = latchkey_tests::poll_until(T, || {
        let calls = node.command_calls("info");
        looks += 1;
        calls >= looks
    })
    .await;
    assert!(asked, "the server asked {} who it is", node.url());
}

/// A node that restarted counts for no majority until it has been up for the longest
/// lease (`--redlock-restart-delay`): it may have forgotten a grant still held. A lease
/// granted while the third node was down is held on a bare majority; once the third
/// node is back and the first restarts, both are empty, and they granted the lock to a
/// second client while the first still held it, told nothing.
#[tokio::test]
async fn a_restarted_node_sits_out_the_longest_lease() {
    let mut nodes = Nodes::start();
    let delay = Duration::from_secs(3);
    let flags = [
        "--watchdog-timeout",
        "3s",
        "--redlock-restart-delay",
        "3s",
        "--redis-timeout",
        "300ms",
    ];
    let server = nodes.server(&flags).await;
    let client = server.client().await;
    let redlock = |name: &str| client.lock(name).redlock(true).try_once();
    // A grant once the nodes count.
    let granted = || async {
        loop {
            if let Ok(lease) = redlock("rl").acquire().await {
                return lease;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    // The nodes started just now: none counts before it has been up for the delay.
    let err = redlock("rl").acquire().await.expect_err("no node counts yet");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(err.to_string().contains("--redlock-restart-delay"), "{err}");
    let first = bounded(delay * 3, "the nodes to count", granted()).await;
    first.release().await.unwrap();

    nodes.nodes[2].stop();
    let first = redlock("rl").acquire().await.expect("the first and second node grant");
    nodes.nodes[2].restart();
    nodes.nodes[0].restart();
    asked_who_it_is(&nodes.nodes[0]).await;
    asked_who_it_is(&nodes.nodes[2]).await;
    let second = redlock("rl").acquire().await;
    assert!(
        second.is_err(),
        "a second holder (token {:?}) while the first holds",
        second.map(|l| l.fencing_token())
    );
    // The first holder's lease is held on one node of three now: it is told.
    let reason = bounded(delay * 2, "the first holder told", first.lost()).await;
    assert_eq!(reason, LostReason::NotHeld);
    // Once the restarted nodes sat out the delay, they grant again.
    let second = bounded(delay * 3, "the restarted nodes to count", granted()).await;
    second.release().await.unwrap();
}

/// A grant a majority made but whose fencing counters fewer than a majority raised is
/// given back, and the try answers UNAVAILABLE as when too few nodes answer: nobody
/// holds the lock. It answered DEADLINE_EXCEEDED, the lock busy.
#[tokio::test]
async fn a_grant_whose_raise_no_majority_answers_is_unavailable() {
    let nodes = Nodes::start();
    let (p1, p2) = (
        Proxy::to_redis(&nodes.nodes[1]).await,
        Proxy::to_redis(&nodes.nodes[2]).await,
    );
    let urls = [nodes.nodes[0].url(), p1.redis_url(), p2.redis_url()];
    let server = nodes.server_on(&urls, &["--watchdog-timeout", "2s"]).await;
    let raise = latchkey_server::scripts::Scripts::new(false)
        .fence_raise
        .sha()
        .to_owned();
    for proxy in [&p1, &p2] {
        proxy.hold_back_matching(Some((raise.as_bytes(), Duration::from_secs(2))));
    }
    let client = server.client().await;
    let err = client.lock("fr").redlock(true).try_once().acquire().await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    for proxy in [&p1, &p2] {
        proxy.hold_back_matching(None);
    }
    let given_back = latchkey_tests::poll_until(T, || nodes.holders("fr") == 0).await;
    assert!(given_back, "{} nodes still hold it", nodes.holders("fr"));
}

/// Each RedLock node's subscriber is pinged every second: once its channels were
/// subscribed its connection only received, and one that died without a word (an idle
/// flow a NAT dropped) went unnoticed, its unlock messages lost and the server's
/// waiters asleep until the holder's lease ran out.
#[tokio::test]
async fn every_redlock_subscriber_is_probed() {
    let nodes = Nodes::start();
    let server = nodes.server(&[]).await;
    let client = server.client().await;
    let held = client.lock("probe").redlock(true).acquire().await.unwrap();
    let lock = client.lock("probe").redlock(true).wait(Duration::from_secs(30));
    let (waiting, _) = latchkey_tests::server::spawn_queued(lock, T).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    for node in &nodes.nodes {
        let clients = node.cli(&["CLIENT", "LIST"]);
        let subscriber = clients
            .lines()
            .find(|l| l.split(' ').any(|f| f.starts_with("sub=") && f != "sub=0"))
            .unwrap_or_else(|| panic!("no subscriber on {}: {clients}", node.url()));
        let idle: u64 = subscriber
            .split(' ')
            .find_map(|f| f.strip_prefix("idle="))
            .and_then(|i| i.parse().ok())
            .expect("an idle field");
        assert!(idle <= 2, "a RedLock subscriber idle for {idle} s: {subscriber}");
    }
    waiting.abort();
    held.release().await.unwrap();
}

/// On a server without RedLock deployments, a RedLock request is
/// FAILED_PRECONDITION REDLOCK_NOT_CONFIGURED whatever its fixed lease: a lease past the
/// RedLock bounds (of deployments the server does not have) was INVALID_ARGUMENT on
/// `open.lease`, and a client that shortened it learned only then.
#[tokio::test]
async fn redlock_on_a_server_without_deployments_is_not_configured_whatever_its_lease() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let plain = client.lock("nc").redlock(true).try_once().acquire().await.unwrap_err();
    assert_eq!(plain.code(), Code::FailedPrecondition, "{plain}");
    let long = client
        .lock("nc")
        .redlock(true)
        .lease(Duration::from_secs(60))
        .try_once()
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(
        (long.code(), long.reason().as_deref()),
        (Code::FailedPrecondition, Some("REDLOCK_NOT_CONFIGURED")),
        "{long}"
    );
}

/// RedLock grants of one name from two servers, mixed fixed leases, named owners and
/// try-once tries: every grant's token is larger than the one before.
#[tokio::test]
async fn redlock_tokens_grow_across_servers_and_options() {
    let nodes = Nodes::start();
    let s1 = nodes.server(&[]).await;
    let s2 = nodes.server(&[]).await;
    let c1 = s1.client().await;
    let c2 = s2.client().await;
    let seen = latchkey_tests::server::Grants::default();
    let mut tasks = Vec::new();
    for i in 0..6 {
        let client = if i % 2 == 0 { c2.clone() } else { c1.clone() };
        let seen = seen.clone();
        tasks.push(tokio::spawn(async move {
            for round in 0..40 {
                let mut lock = client.lock("rt").redlock(true);
                let what = match (i + round) % 4 {
                    0 => {
                        lock = lock.lease(Duration::from_secs(2)).wait(T);
                        "fixed"
                    }
                    1 => {
                        lock = lock.owner(format!("own{i}")).wait(T);
                        "owner"
                    }
                    2 => {
                        lock = lock.try_once();
                        "once"
                    }
                    _ => {
                        lock = lock.wait(T);
                        "plain"
                    }
                };
                let lease = match lock.acquire().await {
                    Ok(lease) => lease,
                    Err(e) if e.code() == Code::DeadlineExceeded && what == "once" => continue,
                    Err(e) => panic!("{what}: {e}"),
                };
                seen.record(lease.fencing_token(), format!("{i}/{round} {what}"));
                lease.release().await.expect("released");
            }
        }));
    }
    for t in tasks {
        bounded(Duration::from_secs(120), "workers", t).await.unwrap();
    }
    seen.assert_increasing();
    assert_eq!(nodes.holders("rt"), 0);
}

/// A RedLock lock and the main Redis's lock of the same name are two locks, each with
/// its own waiters: `--max-waiters-per-lock` counted them together, and a waiter of the
/// main lock was refused because the RedLock one had its maximum on this server.
#[tokio::test]
async fn a_redlock_lock_and_the_main_lock_of_its_name_have_their_own_waiters() {
    let nodes = Nodes::start();
    let server = nodes.server(&["--max-waiters-per-lock", "1"]).await;
    let client = server.client().await;
    let _redlock = client.lock("both").redlock(true).acquire().await.unwrap();
    let (on_redlock, _) = spawn_queued(client.lock("both").redlock(true).wait(T), T).await;
    let _main = client.lock("both").acquire().await.expect("the main lock is free");
    let (on_main, _) = spawn_queued(client.lock("both").wait(T), T).await;
    on_redlock.abort();
    on_main.abort();
}
