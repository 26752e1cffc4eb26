//! The Lua catalogue against a real Redis: every SHA equals what `SCRIPT LOAD`
//! returns, scripts reload after `SCRIPT FLUSH`, and mutating scripts are safe to
//! retry (a replayed acquire or release never counts a hold twice).

use fred::prelude::*;
use latchkey_server::keys::{Keys, LockKeys};
use latchkey_server::lock::{release_args, GiveBack};
use latchkey_server::redis::{batch_layout, BatchedCall};
use latchkey_server::scripts::{Script, Scripts};
use latchkey_tests::redisson::{random_owner, RedissonReadLock};
use latchkey_tests::server::Latchkey;
use latchkey_tests::{bounded, redis_client, RedisServer};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

async fn run(client: &Client, script: &Script, keys: Vec<String>, args: Vec<Value>) -> Value {
    let keys = keys.into_iter().map(Key::from).collect();
    script.eval(client, keys, args).await.expect("script runs")
}

/// The leases `renew.lua`'s answer ({lost, failed, error}) says are lost; none of them
/// may have failed.
fn lost_of(answer: Value) -> Vec<i64> {
    let parts: Vec<Value> = answer.convert().expect("an array");
    let failed: Vec<i64> = parts[1].clone().convert().expect("failed");
    assert!(
        failed.is_empty(),
        "renewals Redis refused: {failed:?} ({:?})",
        parts.get(2)
    );
    parts[0].clone().convert().expect("lost")
}

/// One lease's seven arguments of `renew.lua`, owner `o`: its kind's tag, the lock,
/// its hold record (a semaphore's: the hold id), the fencing counter, the kind's extra
/// key and the token its stream was told.
fn renewal(tag: &str, k: &LockKeys, hold: String, extra: String, token: &str) -> [Value; 7] {
    [
        tag.to_owned(),
        k.lock.clone(),
        hold,
        k.fence(),
        "o".to_owned(),
        extra,
        token.to_owned(),
    ]
    .map(Value::from)
}

/// A client of `redis` subscribed to `channel`, once Redis counts `listeners` on it (a
/// subscribe's answer may come before Redis counts it).
async fn listener(redis: &RedisServer, channel: &str, listeners: usize) -> Client {
    let client = redis_client(&redis.url()).await;
    client.subscribe(channel).await.unwrap();
    let count = || redis.subscribers(channel) as usize;
    let counted = latchkey_tests::poll_until(T, || count() == listeners).await;
    assert!(counted, "{listeners} listening on {channel}: {:?}", count());
    client
}

/// A fresh Redis, a client of it and the script catalogue of a standalone Redis.
async fn catalogue() -> (RedisServer, Client, Scripts) {
    let redis = RedisServer::start();
    let client = redis_client(&redis.url()).await;
    (redis, client, Scripts::new(false))
}

/// `mutex_acquire`'s keys and arguments: `owner`'s stream `hold` takes `k` for 30 s.
fn mutex_acquire(k: &LockKeys, hold: &str, owner: &str) -> (Vec<String>, Vec<Value>) {
    (
        vec![k.lock.clone(), k.fence(), k.hold(hold), k.queue()],
        vec![Value::from(30_000), Value::from(owner), Value::from(5_000)],
    )
}

/// `owner`'s stream `hold` tries `k` (`mutex_acquire`, 30 s lease): the reply.
async fn take(client: &Client, scripts: &Scripts, k: &LockKeys, hold: &str, owner: &str) -> Vec<i64> {
    let (keys, args) = mutex_acquire(k, hold, owner);
    run(client, &scripts.mutex_acquire, keys, args).await.convert().unwrap()
}

/// `release`'s keys and arguments for `owner`'s stream `hold`, leaving what `giving` says.
fn release(k: &LockKeys, hold: &str, owner: &str, giving: GiveBack) -> (Vec<String>, Vec<Value>) {
    (
        vec![k.lock.clone(), k.channel(), k.hold(hold), k.queue(), k.timeouts()],
        release_args(owner, giving, "", false),
    )
}

/// `owner`'s stream of the same name releases `k` with `handoff.lua`, naming `next`'s
/// stream (a mutex waiter, 30 s lease): the reply.
async fn hand_off(client: &Client, scripts: &Scripts, k: &LockKeys, owner: &str, next: &str) -> Vec<i64> {
    relay(client, scripts, k, owner, next, Pass::default()).await
}

/// What a handoff to a waiter of the kind `fair` (else a mutex) says of passes in
/// memory: the token the waiter was told (a recording), the tokens to reserve past the
/// grant's, and the holders passed the lock before it since the last recording.
#[derive(Default)]
struct Pass<'a> {
    fair: bool,
    told: Option<u64>,
    reserve: u64,
    passed: &'a [&'a str],
    /// Fair waiters a recording queues.
    joins: &'a [&'a str],
    /// The releasing stream's claim, or "".
    own_claim: &'a str,
}

impl<'a> Pass<'a> {
    /// A fair lock's recording of `told`, reserving 64 tokens, with the holders
    /// `passed` the lock since the last one and the waiters it `joins` to the queue.
    fn fair_recording(told: i64, passed: &'a [&'a str], joins: &'a [&'a str]) -> Self {
        Pass {
            fair: true,
            told: Some(told as u64),
            reserve: 64,
            passed,
            joins,
            own_claim: "",
        }
    }
}

impl Pass<'static> {
    /// A mutex handoff (`told`: None) or recording (`told`: the token) reserving 64
    /// tokens.
    fn mutex(told: Option<u64>) -> Self {
        Pass {
            told,
            reserve: 64,
            ..Pass::default()
        }
    }
}

/// How long a queued fair waiter stays queued without polling.
const FAIR_STAY_MS: i64 = 30_000;

/// As [`hand_off`], with what `pass` says.
async fn relay(client: &Client, scripts: &Scripts, k: &LockKeys, owner: &str, next: &str, pass: Pass<'_>) -> Vec<i64> {
    let keys = vec![
        k.lock.clone(),
        k.channel(),
        k.hold(owner),
        k.queue(),
        k.timeouts(),
        k.fence(),
        k.hold(next),
    ];
    let args = [
        owner,
        next,
        if pass.fair { "fair" } else { "mutex" },
        "30000",
        "5000",
        "",
        &pass.told.map_or(String::new(), |t| t.to_string()),
        &pass.reserve.to_string(),
    ];
    let mut args: Vec<Value> = args.iter().map(|a| Value::from(*a)).collect();
    // How long a queued fair waiter stays, the releasing stream's claim; for a
    // recording, the passed holders and the joins.
    args.push(Value::from(FAIR_STAY_MS));
    args.push(Value::from(pass.own_claim));
    if pass.told.is_some() {
        args.push(Value::from(pass.passed.len() as i64));
        args.extend(pass.passed.iter().chain(pass.joins).map(|a| Value::from(*a)));
    }
    run(client, &scripts.handoff, keys, args).await.convert().unwrap()
}

#[tokio::test]
async fn every_sha_matches_script_load() {
    let redis = RedisServer::start();
    let client = redis_client(&redis.url()).await;
    for cluster in [false, true] {
        for script in Scripts::new(cluster).all() {
            let sha: String = client.script_load(script.lua()).await.expect("loads");
            assert_eq!(sha, script.sha(), "{}", script.name());
        }
    }
}

#[tokio::test]
async fn scripts_reload_after_a_flush() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    client.lock("a").acquire().await.unwrap().release().await.unwrap();
    redis.cli(&["SCRIPT", "FLUSH"]);
    client
        .lock("a")
        .acquire()
        .await
        .expect("NOSCRIPT is answered by a reload")
        .release()
        .await
        .unwrap();
}

/// A flush that lands between a load and the call sent after it (a round trip that a
/// busy server stretches to milliseconds) is answered by one more load: here the
/// first two sends of the call each follow a flush of their own.
#[tokio::test]
async fn a_flush_between_the_reload_and_its_call_is_answered_by_another_load() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("reflushed");
    let (keys, args) = mutex_acquire(&k, "h1", "owner");
    let keys: Vec<Key> = keys.into_iter().map(Key::from).collect();
    let sends = std::sync::atomic::AtomicUsize::new(0);
    let script = &scripts.mutex_acquire;
    let reply: Value = script
        .loaded(&client, &keys, || async {
            if sends.fetch_add(1, Ordering::Relaxed) < 2 {
                client.script_flush(false).await?;
            }
            client.evalsha(script.sha(), keys.clone(), args.clone()).await
        })
        .await
        .expect("each NOSCRIPT is answered by a load");
    assert_eq!(sends.load(Ordering::Relaxed), 3, "two NOSCRIPTs, then the call ran");
    assert!(matches!(reply, Value::Array(_)), "a grant: {reply:?}");
    assert_eq!(redis.cli(&["HGET", "reflushed", "owner"]).trim(), "1");
}

/// A burst of streams after `SCRIPT FLUSH`: the calls beyond the first few share a
/// `batch.lua` call, which finds NOSCRIPT, loads the batch and sends its packed calls
/// again.
#[tokio::test]
async fn a_batch_reloads_after_a_flush() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    redis.cli(&["SCRIPT", "FLUSH"]);
    let cycles = (0..32).map(|i| {
        let client = client.clone();
        async move { client.lock(format!("burst{i}")).acquire().await?.release().await }
    });
    for cycle in futures::future::join_all(cycles).await {
        cycle.expect("NOSCRIPT is answered by a reload, batched or alone");
    }
    let batch = Scripts::new(false).batch;
    assert_eq!(
        redis.cli(&["SCRIPT", "EXISTS", batch.sha()]).trim(),
        "1",
        "the burst went out in batches"
    );
}

/// `SCRIPT FLUSH`, again and again, while many streams run at once (their calls
/// batched) reaches no client: a batch that finds `NOSCRIPT` and the lone calls alike
/// load their script again and are sent once more, so every acquire and release
/// succeeds.
#[tokio::test]
async fn a_script_flush_under_batched_load_reaches_no_client() {
    let redis = RedisServer::start();
    let server = Latchkey::start_with(&redis.url(), &["--redis-timeout", "2s"]).await;
    let client = server.client().await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..32 {
        let client = client.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            let mut cycles = 0;
            while !stop.load(Ordering::Relaxed) {
                let name = format!("flush/{}", i % 8);
                match tokio::time::timeout(T, client.lock(name.as_str()).wait(T).acquire()).await {
                    Ok(Ok(lease)) => {
                        if let Err(e) = lease.release().await {
                            failures.push(format!("release {name}: {e}"));
                        }
                        cycles += 1;
                    }
                    Ok(Err(e)) => failures.push(format!("acquire {name}: {:?} {e}", e.code())),
                    Err(_) => failures.push(format!("acquire {name}: no answer")),
                }
            }
            (cycles, failures)
        }));
    }
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(redis.cli(&["SCRIPT", "FLUSH"]).trim(), "OK");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let mut cycles = 0;
    let mut failures = Vec::new();
    for task in tasks {
        let (c, f) = bounded(T * 2, "streams end", task).await.unwrap();
        cycles += c;
        failures.extend(f);
    }
    assert!(cycles > 100, "the streams cycled: {cycles}");
    assert!(failures.is_empty(), "{} failures: {failures:?}", failures.len());
}

#[tokio::test]
async fn a_replayed_acquire_or_release_counts_once() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("replay");
    let acquire = |hold: &str| mutex_acquire(&k, hold, "owner");
    let release = |hold: &str| release(&k, hold, "owner", GiveBack::Release);
    let (keys, args) = acquire("h1");
    let first = run(&client, &scripts.mutex_acquire, keys.clone(), args.clone()).await;
    let again = run(&client, &scripts.mutex_acquire, keys, args).await;
    assert_eq!(first, again, "a replayed grant returns the same token and count");
    assert_eq!(redis.cli(&["HGET", "replay", "owner"]).trim(), "1");

    // A second stream of the same owner is a real reentrant hold.
    let (keys, args) = acquire("h2");
    run(&client, &scripts.mutex_acquire, keys, args).await;
    assert_eq!(redis.cli(&["HGET", "replay", "owner"]).trim(), "2");

    let (keys, args) = release("h1");
    assert_eq!(
        run(&client, &scripts.release, keys.clone(), args.clone()).await,
        Value::Integer(1)
    );
    assert_eq!(
        run(&client, &scripts.release, keys, args).await,
        Value::Integer(0),
        "a replayed release gives back nothing"
    );
    assert_eq!(redis.cli(&["HGET", "replay", "owner"]).trim(), "1", "one hold left");
    let (keys, args) = release("h2");
    assert_eq!(run(&client, &scripts.release, keys, args).await, Value::Integer(1));
    assert_eq!(redis.cli(&["EXISTS", "replay"]).trim(), "0");
}

/// Every command a script ran since the counters were reset, by name
/// (`INFO commandstats`, the scripts' own calls included).
fn commands_run(redis: &RedisServer) -> Vec<(String, usize)> {
    let mut run: Vec<(String, usize)> = redis
        .command_stats()
        .into_iter()
        .filter(|s| s.command != "evalsha" && !s.command.starts_with("config"))
        .map(|s| (s.command, s.calls as usize))
        .collect();
    run.sort();
    run
}

/// `owner`'s stream `hold` tries the fair lock `k` (`fair_acquire`, 30 s lease, joining
/// the queue when busy): the reply.
async fn take_fair(client: &Client, scripts: &Scripts, k: &LockKeys, hold: &str, owner: &str) -> Vec<i64> {
    let keys = latchkey_server::lock::fair_acquire_keys(k, hold).to_vec();
    let args = vec![
        Value::from(30_000),
        Value::from(owner),
        Value::from(5_000),
        Value::from(60_000),
        Value::from("1"),
    ];
    run(client, &scripts.fair_acquire, keys, args).await.convert().unwrap()
}

#[tokio::test]
async fn an_uncontended_cycle_runs_only_the_commands_it_needs() {
    let (redis, client, scripts) = catalogue().await;
    for fair in [false, true] {
        let k = Keys::default().lock(if fair { "lean-fair" } else { "lean" });
        let take = |hold: &'static str| {
            let (client, scripts, k) = (&client, &scripts, &k);
            async move {
                match fair {
                    true => take_fair(client, scripts, k, hold, "owner").await,
                    false => take(client, scripts, k, hold, "owner").await,
                }
            }
        };
        // The name's first grant creates its fencing counter: not this cycle.
        assert_eq!(take("h0").await[0], 1);
        let (keys, args) = release(&k, "h0", "owner", GiveBack::Release);
        run(&client, &scripts.release, keys, args).await;

        redis.cli(&["CONFIG", "RESETSTAT"]);
        assert_eq!(take("h1").await[0], 1, "granted");
        let (keys, args) = release(&k, "h1", "owner", GiveBack::Release);
        assert_eq!(run(&client, &scripts.release, keys, args).await, Value::Integer(1));
        let expected = [
            // The grant: one check that the name is free (no queue) and the stream has
            // no record to replay, the token (the counter, raised to Redis' clock when
            // behind it, its life never shortened), the hold, the stream's record, and
            // Watch's message.
            ("exists", 2),
            ("incr", 1),
            ("time", 1),
            ("set", 2),
            ("pexpire", 1),
            ("hincrby", 1),
            ("publish", 3),
            // The release: the break floor, the record and what is left of its lease,
            // the holds, the lock; one check that nobody is queued or claimed, then
            // Redisson's unlock message and Watch's (above).
            ("get", 1),
            ("pttl", 2),
            ("getdel", 1),
            ("hmget", 1),
            ("del", 1),
        ];
        let mut expected: Vec<(String, usize)> = expected.iter().map(|(c, n)| (c.to_string(), *n)).collect();
        expected.sort();
        assert_eq!(
            commands_run(&redis),
            expected,
            "fair {fair}: 17 commands, no queue read, no subscriber count"
        );
        assert_eq!(redis.cli(&["EXISTS", &k.lock]).trim(), "0");
    }
}

#[tokio::test]
async fn a_grant_that_arrives_after_its_release_grants_nothing() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("late-grant");
    // The release of a grant whose reply timed out runs first (another connection, a
    // reconnect): it finds no record and leaves a revoked one.
    let (release_keys, release_args) = release(&k, "h", "owner", GiveBack::Revoke);
    assert_eq!(
        run(&client, &scripts.release, release_keys, release_args).await,
        Value::Integer(0)
    );
    let reply = take(&client, &scripts, &k, "h", "owner").await;
    assert_eq!(reply[0], 0, "the late grant is refused: {reply:?}");
    assert_eq!(
        redis.cli(&["EXISTS", "late-grant"]).trim(),
        "0",
        "nobody holds the lock"
    );
    // Another stream of the same owner is not affected.
    let reply = take(&client, &scripts, &k, "h2", "owner").await;
    assert_eq!(reply[0], 1, "{reply:?}");
    // The revoked hold's release, run again (its reply timed out too), leaves the
    // owner's other hold alone.
    let (release_keys, release_args) = release(&k, "h", "owner", GiveBack::Revoke);
    assert_eq!(
        run(&client, &scripts.release, release_keys, release_args).await,
        Value::Integer(0)
    );
    assert_eq!(redis.cli(&["HGET", "late-grant", "owner"]).trim(), "1");
}

/// A replayed grant starts its lease again: the server counts the lease from the try
/// that heard of the grant, which may come long after the try that made it.
#[tokio::test]
async fn a_replayed_grant_starts_its_lease_again() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("replayed");
    take(&client, &scripts, &k, "h", "owner").await;
    // Most of the lease went by before the stream heard of its grant.
    redis.cli(&["PEXPIRE", "replayed", "1000"]);
    redis.cli(&["PEXPIRE", &k.hold("h"), "6000"]);
    let reply = take(&client, &scripts, &k, "h", "owner").await;
    assert_eq!(reply[0], 1, "{reply:?}");
    let ttl = |key: &str| -> i64 { redis.cli(&["PTTL", key]).trim().parse().unwrap() };
    assert!(
        ttl("replayed") > 25_000,
        "the lock's lease starts again: {}",
        ttl("replayed")
    );
    assert!(ttl(&k.hold("h")) > 30_000, "and so does its record's");
}

/// A stream one of whose tries failed (it may still be on its way) was granted by a
/// later try, and releases: its release revokes the record it gives back, so the
/// failed try, coming last, grants nothing.
#[tokio::test]
async fn a_doubted_try_that_comes_after_the_streams_release_grants_nothing() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("doubted");
    take(&client, &scripts, &k, "h", "owner").await;
    let (release_keys, release_args) = release(&k, "h", "owner", GiveBack::Revoke);
    assert_eq!(
        run(&client, &scripts.release, release_keys, release_args).await,
        Value::Integer(1),
        "the hold is given back"
    );
    assert_eq!(redis.cli(&["GET", &k.hold("h")]).trim(), "revoked");
    let reply = take(&client, &scripts, &k, "h", "owner").await;
    assert_eq!(reply[0], 0, "the late try is refused: {reply:?}");
    assert_eq!(redis.cli(&["EXISTS", "doubted"]).trim(), "0", "nobody holds the lock");
}

/// A handoff that comes late, after its candidate left and revoked its hold record
/// (the handoff's reply had timed out), frees the lock instead of granting it.
#[tokio::test]
async fn a_late_handoff_to_a_revoked_candidate_grants_nothing() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("late-handoff");
    take(&client, &scripts, &k, "holder", "holder").await;
    // The candidate's stream left: its background release found no record and
    // revoked it.
    let (release_keys, release_args) = release(&k, "next", "next", GiveBack::Revoke);
    run(&client, &scripts.release, release_keys, release_args).await;
    let reply = hand_off(&client, &scripts, &k, "holder", "next").await;
    assert_eq!(reply, [1, -2, 0, 0], "released, granted to nobody, freed for all");
    assert_eq!(redis.cli(&["EXISTS", "late-handoff"]).trim(), "0", "the lock is free");
    assert_eq!(redis.cli(&["GET", &k.hold("next")]).trim(), "revoked");
}

/// The give-back of what a failed recording of a pass in memory may have left a stream
/// (`GiveBack::Passed`, with the token the pass told it) takes only a record of that
/// token: a record of the stream's own try, which took the lock the broken run let go,
/// stays with its lock, and no record at all is revoked, so a recording that comes late
/// grants nothing.
#[tokio::test]
async fn a_give_back_of_a_pass_takes_only_the_pass_s_grant() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("passed");
    let give_back = |told: u64| {
        let (keys, mut args) = release(&k, "w", "w", GiveBack::Passed);
        args.extend([Value::from(""), Value::from(told.to_string())]);
        run(&client, &scripts.release, keys, args)
    };
    // The stream's own grant, another token than the pass told it: it stays.
    let own = take(&client, &scripts, &k, "w", "w").await;
    let record = redis.cli(&["GET", &k.hold("w")]);
    assert_eq!(
        give_back(own[1] as u64 - 1).await,
        Value::Integer(0),
        "nothing given back"
    );
    assert_eq!(
        redis.cli(&["GET", &k.hold("w")]),
        record,
        "the own grant's record stays"
    );
    assert_eq!(redis.cli(&["HGET", "passed", "w"]).trim(), "1", "and its lock");
    // The record of the pass's own token (the recording ran): given back, revoked.
    assert_eq!(
        give_back(own[1] as u64).await,
        Value::Integer(1),
        "the pass's grant goes"
    );
    assert_eq!(redis.cli(&["EXISTS", "passed"]).trim(), "0");
    assert_eq!(redis.cli(&["GET", &k.hold("w")]).trim(), "revoked");
    // No record (the recording did not run yet): revoked, so it grants nothing later.
    redis.cli(&["DEL", &k.hold("w")]);
    assert_eq!(give_back(7).await, Value::Integer(0));
    assert_eq!(redis.cli(&["GET", &k.hold("w")]).trim(), "revoked");
}

/// A renewal batch whose lock key is now another kind (the name expired and was taken
/// as another lock) reports that lease lost and renews the rest: no WRONGTYPE error
/// fails the whole batch. So is a hold whose record holds another grant's token than
/// the one its stream was told (a claim granted again after a failover).
#[tokio::test]
async fn a_renewal_of_a_key_now_of_another_kind_is_a_lost_lease() {
    let (redis, client, scripts) = catalogue().await;
    let (sem, held, mutex) = (
        Keys::default().lock("was-sem"),
        Keys::default().lock("held"),
        Keys::default().lock("was-mutex"),
    );
    for (k, owner) in [(&held, "o"), (&sem, "other")] {
        let (keys, args) = mutex_acquire(k, "h", owner);
        run(&client, &scripts.mutex_acquire, keys, args).await;
    }
    // A mutex hold whose key expired and was taken as a semaphore: its record remains.
    redis.cli(&["ZADD", "was-mutex", "1", "x"]);
    redis.cli(&["SET", &mutex.hold("h"), "7", "PX", "60000"]);
    let token = redis.cli(&["GET", &held.hold("h")]).trim().to_owned();
    let mut args = vec![Value::from(60_000), Value::from(5_000)];
    args.extend(renewal("s", &sem, "h".to_owned(), sem.semaphore(), "0"));
    args.extend(renewal("h", &held, held.hold("h"), String::new(), &token));
    args.extend(renewal("h", &mutex, mutex.hold("h"), String::new(), "0"));
    args.extend(renewal("h", &held, held.hold("h"), String::new(), "1"));
    let keys = vec![held.lock.clone(), held.fence()];
    let lost = lost_of(run(&client, &scripts.renew, keys, args).await);
    assert_eq!(
        lost,
        [1, 3, 4],
        "the semaphore now a mutex, the mutex now a sorted set, a grant not the stream's"
    );
    let ttl: i64 = redis.cli(&["PTTL", "held"]).trim().parse().unwrap();
    assert!(ttl > 30_000, "the live lease is renewed: {ttl}");
}

/// A replayed grant (a try whose reply was lost, found by the stream's next try) starts
/// its lease again, and its fencing counter's life with it: the counter outlives the
/// hold, and Describe shows the held semaphore's token. (It used to expire while the
/// hold was held, Describe showing `last_fencing_token` 0.)
#[tokio::test]
async fn a_replayed_fixed_grant_outlives_its_fencing_counter() {
    let (redis, client, scripts) = catalogue().await;
    let server = Latchkey::start(&redis.url()).await;
    let c = server.client().await;
    let k = Keys::default().lock("replayed");
    let granted_at = std::time::Instant::now();
    let first = semaphore_try(&client, &scripts, &k, "s:1", 8_000).await;
    assert_eq!(first[0], 1, "granted: {first:?}");
    // The stream's tries failed for 7 s (Redis slow, replies timing out); the next one
    // finds the grant, whose 8 s lease starts again.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let again = semaphore_try(&client, &scripts, &k, "s:1", 8_000).await;
    assert_eq!(again, first, "the grant replayed");
    // 14 s after the grant: the replayed hold still runs (until 15 s at the earliest),
    // its counter (grant + 8 s + 5 s) is gone.
    tokio::time::sleep_until(tokio::time::Instant::from(granted_at + Duration::from_secs(14))).await;
    let state = c.describe("replayed").await.unwrap();
    assert!(state.locked, "still held: {state:?}");
    assert_eq!(
        state.last_fencing_token,
        first[1] as u64,
        "Describe of a held semaphore shows its grant's token; fencing counter PTTL {}",
        redis.cli(&["PTTL", &k.fence()]).trim()
    );
}

/// A replayed semaphore grant whose permits field is gone from the hash (see
/// `drop_permits`) answers the permits it asks, not a reply two long that the server
/// cannot read.
#[tokio::test]
async fn a_replayed_semaphore_grant_without_its_permits_field_answers_its_permits() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("replayed-field");
    let first = semaphore_try(&client, &scripts, &k, "s:1", 8_000).await;
    assert_eq!(first[0], 1, "granted: {first:?}");
    redis.cli(&["HDEL", &k.semaphore(), "p:s:1"]);
    let again = semaphore_try(&client, &scripts, &k, "s:1", 8_000).await;
    assert_eq!(again, first, "the grant replayed, with the permits it asks");
}

/// A semaphore try refused for another limit that took out expired holds tells the
/// waiters of the permits they freed, as a busy or granting try does. (It used to answer
/// before publishing: the waiters learned of them at the hold's end at the latest.)
#[tokio::test]
async fn a_semaphore_try_of_another_limit_tells_of_the_permits_it_freed() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("sem-other-limit");
    // The long one first: a try after the short one's end would take it out itself.
    assert_eq!(semaphore_try(&client, &scripts, &k, "long", 60_000).await[0], 1);
    assert_eq!(semaphore_try(&client, &scripts, &k, "short", 1).await[0], 1);
    let waiter = listener(&redis, &k.semaphore_channel(), 1).await;
    let mut told = waiter.message_rx();
    tokio::time::sleep(Duration::from_millis(20)).await; // past the short hold's end
    let refused = semaphore_try_limited(&client, &scripts, &k, "other", 30_000, 4).await;
    assert_eq!(refused, [3, 3], "refused: the live semaphore has 3 permits");
    let message = tokio::time::timeout(T, told.recv()).await;
    let free: Option<String> = message.ok().and_then(|m| m.ok()).and_then(|m| m.value.convert().ok());
    assert_eq!(free.as_deref(), Some("2"), "the waiters are told 2 permits are free");
}

/// A semaphore try of hold `hold` with a lease of `lease_ms` (of 3 permits, taking 1):
/// the script's reply.
async fn semaphore_try(client: &Client, scripts: &Scripts, k: &LockKeys, hold: &str, lease_ms: i64) -> Vec<i64> {
    semaphore_try_limited(client, scripts, k, hold, lease_ms, 3).await
}

/// A semaphore try of hold `hold` with a lease of `lease_ms`, of `limit` permits, taking
/// 1: the script's reply.
async fn semaphore_try_limited(
    client: &Client,
    scripts: &Scripts,
    k: &LockKeys,
    hold: &str,
    lease_ms: i64,
    limit: i64,
) -> Vec<i64> {
    let keys = vec![
        k.lock.clone(),
        k.fence(),
        k.semaphore(),
        k.semaphore_channel(),
        k.hold(hold),
        k.timeouts(),
    ];
    let args = [
        lease_ms.into(),
        hold.into(),
        5_000.into(),
        1.into(),
        limit.into(),
        "o".into(),
        "publish".into(),
    ];
    run(client, &scripts.semaphore_acquire, keys, args.to_vec())
        .await
        .convert()
        .unwrap()
}

/// A semaphore hold granted afresh by a late try of its stream, after the stream's own
/// grant went (a lost write, a break whose notice was missed), is not the stream's: its
/// renewal reports the lease lost, as a mutex's does, rather than keep permits that were
/// uncounted in between.
#[tokio::test]
async fn a_semaphore_renewal_of_a_hold_granted_again_is_a_lost_lease() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("sem-again");
    let first = semaphore_try(&client, &scripts, &k, "h", 30_000).await;
    assert_eq!(first[0], 1, "granted: {first:?}");
    redis.cli(&["DEL", "sem-again", &k.semaphore()]);
    let again = semaphore_try(&client, &scripts, &k, "h", 30_000).await;
    assert_eq!(again[0], 1, "granted afresh: {again:?}");
    assert_ne!(again[1], first[1], "under a new token");
    let renew = |token: i64| {
        let mut args = vec![Value::from(30_000), Value::from(5_000)];
        args.extend(
            [
                "s",
                "sem-again",
                "h",
                &k.fence(),
                "o",
                &k.semaphore(),
                &token.to_string(),
            ]
            .map(Value::from),
        );
        run(&client, &scripts.renew, vec![k.lock.clone(), k.fence()], args)
    };
    let lost = lost_of(renew(first[1]).await);
    assert_eq!(lost, [1], "the first grant's stream has lost its hold");
    let lost = lost_of(renew(again[1]).await);
    assert!(lost.is_empty(), "the hold's own grant renews: {lost:?}");
}

/// A grant of a shorter lease never shortens the fencing counter's life: it outlives
/// every hold, so Describe reads the latest token while any is held.
#[tokio::test]
async fn a_shorter_grant_leaves_the_fencing_counter_its_life() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("fence-life");
    assert_eq!(semaphore_try(&client, &scripts, &k, "long", 60_000).await[0], 1);
    assert_eq!(semaphore_try(&client, &scripts, &k, "short", 500).await[0], 1);
    let ttl: i64 = redis.cli(&["PTTL", &k.fence()]).trim().parse().unwrap();
    assert!(ttl > 60_000, "the counter outlives the long hold: {ttl} ms left");
}

/// At Redis's memory limit (`noeviction`) a doubted stream's semaphore hold is given
/// back and its grant replayed, as a mutex's are: Redis refuses a command that may take
/// memory (SET, ZADD) before a script's first write. The give-back wrote its revoked
/// record before removing the hold, and was refused whole: the permits stayed counted
/// until the hold ran out. The replay's ZADD came before its PEXPIREs, which run only
/// to lengthen.
#[tokio::test]
async fn a_semaphore_hold_is_given_back_and_replayed_at_the_memory_limit() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("oom-permits");
    // A longer hold keeps every key past the replayed lease: the replay lengthens
    // nothing, and writes first all the same.
    for (hold, lease) in [("longer", 900_000), ("kept", 600_000), ("given", 600_000)] {
        assert_eq!(semaphore_try(&client, &scripts, &k, hold, lease).await[0], 1);
    }
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    redis.cli(&["CONFIG", "SET", "maxmemory", "1"]);
    let replayed = semaphore_try(&client, &scripts, &k, "kept", 600_000).await;
    let keys = vec![k.lock.clone(), k.semaphore(), k.semaphore_channel(), k.hold("given")];
    let args = [Value::from("given"), Value::from("publish"), Value::from("1")];
    let released = scripts
        .semaphore_release
        .eval(&client, keys.into_iter().map(Key::from).collect(), args.to_vec());
    let released = released.await;
    let record = redis.cli(&["GET", &k.hold("given")]);
    redis.cli(&["CONFIG", "SET", "maxmemory", "0"]);
    assert_eq!(replayed[0], 1, "the replay granted: {replayed:?}");
    assert_eq!(released.ok(), Some(Value::Integer(0)), "the give-back ran");
    assert_eq!(redis.cli(&["ZSCORE", &k.lock, "given"]).trim(), "", "its permits back");
    assert_eq!(record.trim(), "revoked", "its late tries take nothing");
}

/// A semaphore try that reaches Redis after its stream's give-back revoked it (its
/// reply had timed out) takes no permits.
#[tokio::test]
async fn a_semaphore_grant_that_arrives_after_its_release_takes_nothing() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("late-permits");
    let release_keys = vec![k.lock.clone(), k.semaphore(), k.semaphore_channel(), k.hold("h")];
    let release_args = vec![Value::from("h"), Value::from("publish"), Value::from("1")];
    assert_eq!(
        run(&client, &scripts.semaphore_release, release_keys, release_args).await,
        Value::Integer(-1)
    );
    let keys = vec![
        k.lock.clone(),
        k.fence(),
        k.semaphore(),
        k.semaphore_channel(),
        k.hold("h"),
        k.queue(),
    ];
    let args = [
        Value::from(30_000),
        Value::from("h"),
        Value::from(5_000),
        Value::from(1),
        Value::from(3),
    ];
    let args = args
        .into_iter()
        .chain([Value::from("o"), Value::from("publish")])
        .collect();
    let reply: Vec<i64> = run(&client, &scripts.semaphore_acquire, keys, args)
        .await
        .convert()
        .unwrap();
    assert_eq!(reply[0], 0, "busy, not granted: {reply:?}");
    assert_eq!(redis.cli(&["EXISTS", "late-permits"]).trim(), "0", "no permit taken");
}

#[tokio::test]
async fn a_replayed_acquire_after_the_lease_ran_out_is_not_a_grant() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("late");
    take(&client, &scripts, &k, "h", "owner").await;
    // The lock expired and another owner took it; the stale hold record must not count.
    redis.cli(&["DEL", "late"]);
    redis.cli(&["HSET", "late", "someone", "1"]);
    redis.cli(&["PEXPIRE", "late", "30000"]);
    let reply = take(&client, &scripts, &k, "h", "owner").await;
    assert_eq!(reply[0], 0, "busy, not granted: {reply:?}");
    assert_eq!(redis.cli(&["EXISTS", "latchkey_hold:{late}:h"]).trim(), "0");
}

/// A read/write try (`script`) of `field`'s stream `hold` on `k` with `args`: the reply.
/// A reader's field is its owner, a writer's `<owner>:write`.
async fn rw_try(client: &Client, script: &Script, k: &LockKeys, hold: &str, field: &str, args: Vec<Value>) -> Vec<i64> {
    let keys = vec![
        k.lock.clone(),
        k.fence(),
        k.hold(hold),
        k.hold_timeouts(field),
        k.timeouts(),
    ];
    run(client, script, keys, args).await.convert().unwrap()
}

/// `owner`'s stream `hold` tries to read `k` on a `lease` ms lease: the reply.
async fn read_try(client: &Client, scripts: &Scripts, k: &LockKeys, hold: &str, owner: &str, lease: &str) -> Vec<i64> {
    let args = [lease, owner, "5000", &format!("{owner}:write")]
        .map(Value::from)
        .to_vec();
    rw_try(client, &scripts.read_acquire, k, hold, owner, args).await
}

/// Stream `w` of the writer `field` tries to write `k` on a 30 s lease: the reply.
async fn write_try(client: &Client, scripts: &Scripts, k: &LockKeys, field: &str) -> Vec<i64> {
    let args = ["30000", field, "5000"].map(Value::from).to_vec();
    rw_try(client, &scripts.write_acquire, k, "w", field, args).await
}

/// Stream `h` of owner `o` reads `k` on a 300 ms lease beside the Redisson reader
/// `java`, whose renewal lengthens the read's timeout key to 30 s; returns once the
/// read's lease ran out.
async fn read_lapsing_beside_java(client: &Client, scripts: &Scripts, k: &LockKeys, java: &RedissonReadLock) {
    let granted = read_try(client, scripts, k, "h", "o", "300").await;
    assert_eq!(granted[0], 1, "{granted:?}");
    assert!(java.renew(30_000).await);
    tokio::time::sleep(Duration::from_millis(400)).await;
}

/// One stream's read granted again under its hold record after a first lapsed (a try
/// that found the record lapsed), both keys kept by a Redisson reader's renewal: two
/// keys of one value. A writer's try takes both reads off, and the Java reader's unlock
/// then frees the lock.
#[tokio::test]
async fn a_writers_try_takes_off_both_lapsed_reads_of_one_record() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("twice");
    let java = RedissonReadLock::new(&client, "twice", &random_owner());
    assert_eq!(java.try_lock(30_000).await, None, "Redisson reads");
    read_lapsing_beside_java(&client, &scripts, &k, &java).await;
    read_lapsing_beside_java(&client, &scripts, &k, &java).await;
    assert_eq!(redis.cli(&["HGET", "twice", "o"]).trim(), "2", "two lapsed reads");
    let busy = write_try(&client, &scripts, &k, "o:write").await;
    assert_eq!(busy[0], 0, "the Java reader holds: {busy:?}");
    assert_eq!(
        redis.cli(&["HEXISTS", "twice", "o"]).trim(),
        "0",
        "both lapsed reads are off"
    );
    assert_eq!(
        java.unlock().await,
        Some(true),
        "the Java reader's unlock frees the lock"
    );
}

/// A writer waiting on latchkey reads alone looks again at the lock's end, which their
/// keys set: it is woken no sooner for a shorter read, whose key ends with its lease.
/// Beside a Redisson reader, whose renewal may keep a lapsed read's key, it looks again
/// when the first latchkey read may lapse.
#[tokio::test]
async fn a_writer_looks_again_at_a_reads_lapse_only_beside_a_redisson_reader() {
    let (_redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("lapse");
    for (hold, owner, lease) in [("h1", "o1", "2000"), ("h2", "o2", "20000")] {
        let granted = read_try(&client, &scripts, &k, hold, owner, lease).await;
        assert_eq!(granted[0], 1, "{granted:?}");
    }
    let write = || async {
        let busy = write_try(&client, &scripts, &k, "w:write").await;
        assert_eq!(busy[0], 0, "{busy:?}");
        busy[1]
    };
    let alone = write().await;
    assert!(alone > 15_000, "told the lock's end: {alone}");
    let java = RedissonReadLock::new(&client, "lapse", &random_owner());
    assert_eq!(java.try_lock(1_000).await, None, "Redisson reads");
    let beside = write().await;
    assert!(beside <= 2_000, "told the shorter read's lapse: {beside}");
}

/// A key of another type under a reader's timeout key name (an application's) reads as
/// a missing key to a writer's look for lapsed reads: the try answers busy rather than
/// fail on WRONGTYPE.
#[tokio::test]
async fn a_writers_try_reads_a_foreign_timeout_key_as_missing() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("foreign-read");
    redis.cli(&["HSET", "foreign-read", "mode", "read", "o", "1"]);
    redis.cli(&["PEXPIRE", "foreign-read", "30000"]);
    redis.cli(&["HSET", &format!("{}:1", k.hold_timeouts("o")), "a", "1"]);
    let busy = write_try(&client, &scripts, &k, "w:write").await;
    assert_eq!(busy[0], 0, "{busy:?}");
    assert_eq!(redis.cli(&["HGET", "foreign-read", "o"]).trim(), "1", "the read stays");
}

/// A lapsed read's keys are renumbered as it goes, unless a key of another type (an
/// application's) is among its holder's: that one would be deleted or overwritten, and
/// the holder's keys stay as they are.
#[tokio::test]
async fn a_lapsed_read_beside_a_foreign_timeout_key_leaves_that_key_alone() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("foreign-lapse");
    let java = RedissonReadLock::new(&client, "foreign-lapse", &random_owner());
    assert_eq!(java.try_lock(30_000).await, None, "Redisson reads");
    read_lapsing_beside_java(&client, &scripts, &k, &java).await;
    let foreign = format!("{}:2", k.hold_timeouts("o"));
    redis.cli(&["HSET", &foreign, "a", "1"]);
    redis.cli(&["HSET", "foreign-lapse", "o", "2"]);
    let busy = write_try(&client, &scripts, &k, "o:write").await;
    assert_eq!(busy[0], 0, "the Java reader holds: {busy:?}");
    assert_eq!(redis.cli(&["TYPE", &foreign]).trim(), "hash", "the foreign key stays");
}

/// A read's release that reaches Redis after its lease ran out (its server cut off
/// from Redis meanwhile) beside a Redisson reader, whose renewal had lengthened the
/// read's timeout key: the release found no live record and left the read, and the
/// Java reader's unlock then kept the lock up for that key's TTL (30 s) with nobody
/// holding. The release takes its lapsed read off.
#[tokio::test]
async fn a_late_read_release_takes_off_its_read_kept_by_a_redisson_renewal() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("late-read");
    let java = RedissonReadLock::new(&client, "late-read", &random_owner());
    assert_eq!(java.try_lock(30_000).await, None, "Redisson reads");
    read_lapsing_beside_java(&client, &scripts, &k, &java).await;
    let keys = vec![
        k.lock.clone(),
        k.rw_channel(),
        k.hold("h"),
        k.hold_timeouts("o"),
        k.rw_prefix(),
    ];
    let args = ["o", "publish", GiveBack::Release.flag()].map(Value::from).to_vec();
    let remaining: i64 = run(&client, &scripts.read_release, keys, args).await.convert().unwrap();
    assert_eq!(remaining, -1, "the lease had run out");
    assert_eq!(
        redis.cli(&["HEXISTS", "late-read", "o"]).trim(),
        "0",
        "the lapsed read is off"
    );
    assert_eq!(
        java.unlock().await,
        Some(true),
        "the Java reader's unlock frees the lock"
    );
    assert_eq!(redis.cli(&["EXISTS", "late-read"]).trim(), "0");
}

/// The give-back of what a busy multi-lock or RedLock try took, its stream trying
/// again: a lapsed record (the give-back came late) goes, so the next try is granted,
/// where a release for good leaves it revoked; a revoked record (a try of unknown
/// outcome) stays revoked.
#[tokio::test]
async fn a_give_back_before_the_next_try_leaves_only_a_revoked_record_revoked() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("again");
    let hold = k.hold("h");
    for (giving, left) in [(GiveBack::Retry, ""), (GiveBack::Release, "revoked")] {
        assert_eq!(take(&client, &scripts, &k, "h", "owner").await[0], 1);
        // The lease ran out: the record lives on only within its grace.
        redis.cli(&["PEXPIRE", &hold, "1000"]);
        let (keys, args) = release(&k, "h", "owner", giving);
        run(&client, &scripts.release, keys, args).await;
        assert_eq!(redis.cli(&["GET", &hold]).trim(), left, "{giving:?}");
        redis.cli(&["DEL", &hold, "again"]);
    }
    let (keys, args) = release(&k, "h", "owner", GiveBack::Revoke);
    run(&client, &scripts.release, keys, args).await;
    let (keys, args) = release(&k, "h", "owner", GiveBack::Retry);
    run(&client, &scripts.release, keys, args).await;
    assert_eq!(redis.cli(&["GET", &hold]).trim(), "revoked");
    assert_eq!(
        take(&client, &scripts, &k, "h", "owner").await[0],
        0,
        "a late try grants nothing"
    );
}

/// `force_release`'s keys for `k`.
fn force_keys_of(k: &LockKeys) -> Vec<String> {
    vec![
        k.lock.clone(),
        k.channel(),
        k.queue(),
        k.timeouts(),
        k.rw_channel(),
        k.semaphore(),
        k.semaphore_channel(),
        k.fence(),
    ]
}

/// Two streams of one owner (`owner` set by the client): ForceRelease breaks the first
/// one's hold, the second takes the lock anew before the first's stream has ended. The
/// first's record stays behind, but renews and gives back nothing of the second's hold.
#[tokio::test]
async fn a_hold_broken_by_force_release_gives_back_nothing_of_its_owners_next_hold() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("broken");
    take(&client, &scripts, &k, "first", "o").await;
    let force_args = ["publish", "latchkey:force_release", "5000"].map(Value::from).to_vec();
    let floor: i64 = run(&client, &scripts.force_release, force_keys_of(&k), force_args.clone())
        .await
        .convert()
        .unwrap();
    assert_eq!(
        redis.cli(&["GET", &k.broken()]).trim(),
        floor.to_string(),
        "the break floor"
    );
    let floor_ttl: i64 = redis.cli(&["PTTL", &k.broken()]).trim().parse().unwrap();
    assert!(
        (30_000..=35_000).contains(&floor_ttl),
        "the floor outlives the broken lease: {floor_ttl}"
    );
    take(&client, &scripts, &k, "second", "o").await;

    // A second break of a lock on a short lease keeps the first break's floor as long.
    let short = Keys::default().lock("broken-twice");
    let (keys, mut args) = mutex_acquire(&short, "first", "o");
    args[0] = Value::from(60_000);
    run(&client, &scripts.mutex_acquire, keys, args).await;
    run(
        &client,
        &scripts.force_release,
        force_keys_of(&short),
        force_args.clone(),
    )
    .await;
    let (keys, mut args) = mutex_acquire(&short, "second", "o");
    args[0] = Value::from(1_000);
    run(&client, &scripts.mutex_acquire, keys, args).await;
    run(&client, &scripts.force_release, force_keys_of(&short), force_args).await;
    let floor_ttl: i64 = redis.cli(&["PTTL", &short.broken()]).trim().parse().unwrap();
    assert!(
        floor_ttl > 60_000,
        "the first break's records are still covered: {floor_ttl}"
    );

    let lost = renew_both(&client, &scripts, &k, [0, 0]).await;
    // Negated: ForceRelease broke it, which its stream is told even with no notice.
    assert_eq!(lost, [-1], "only the broken hold is lost");
    only_the_second_gives_back(&redis, &client, &scripts, &k).await;
}

/// Renews owner `o`'s streams `first` and `second` of `k`, each with the token its
/// stream was told (0: any live record): the leases lost.
async fn renew_both(client: &Client, scripts: &Scripts, k: &LockKeys, tokens: [i64; 2]) -> Vec<i64> {
    let mut args = vec![Value::from(30_000), Value::from(5_000)];
    for (hold, token) in ["first", "second"].into_iter().zip(tokens) {
        let token = token.to_string();
        args.extend(["h", &k.lock, &k.hold(hold), &k.fence(), "o", "", &token].map(Value::from));
    }
    let keys = vec![k.lock.clone(), k.fence()];
    lost_of(run(client, &scripts.renew, keys, args).await)
}

/// Owner `o`'s stream `first` gives back nothing of `k`, which `second` holds once;
/// then `second` frees it.
async fn only_the_second_gives_back(redis: &RedisServer, client: &Client, scripts: &Scripts, k: &LockKeys) {
    let (keys, args) = release(k, "first", "o", GiveBack::Release);
    assert_eq!(run(client, &scripts.release, keys, args).await, Value::Integer(0));
    assert_eq!(
        redis.cli(&["HGET", &k.lock, "o"]).trim(),
        "1",
        "the second stream's hold stays"
    );
    let (keys, args) = release(k, "second", "o", GiveBack::Release);
    assert_eq!(run(client, &scripts.release, keys, args).await, Value::Integer(1));
    assert_eq!(redis.cli(&["EXISTS", &k.lock]).trim(), "0");
}

/// Two streams of one owner: the first's lease runs out (its server could not reach
/// Redis in time) and the lock expires; the second takes it anew. The first's record,
/// which outlives its lease by the grace, then renews, replays and gives back nothing
/// of the second's hold: a late release of the first must not free the lock under the
/// second (and let a third stream in beside it).
#[tokio::test]
async fn a_hold_whose_lease_ran_out_gives_back_nothing_of_its_owners_next_hold() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("lapsed");
    let first = take(&client, &scripts, &k, "first", "o").await;
    // The lease ran out: the lock expired, the record has only its grace left.
    redis.cli(&["DEL", "lapsed"]);
    redis.cli(&["PEXPIRE", &k.hold("first"), "4000"]);
    let second = take(&client, &scripts, &k, "second", "o").await;
    assert_eq!((second[0], second[2]), (1, 1), "a new hold: {second:?}");

    let lost = renew_both(&client, &scripts, &k, [first[1], second[1]]).await;
    assert_eq!(lost, [1], "the lapsed lease is lost, the new one renewed");
    only_the_second_gives_back(&redis, &client, &scripts, &k).await;

    // A try retried after its lease ran out replays no grant: the lock is taken anew.
    let again = take(&client, &scripts, &k, "third", "o").await;
    redis.cli(&["PEXPIRE", &k.hold("third"), "4000"]);
    let retried = take(&client, &scripts, &k, "third", "o").await;
    assert_eq!(retried[0], 1, "granted: {retried:?}");
    assert!(
        retried[1] > again[1],
        "a new grant, not a replay: {retried:?} after {again:?}"
    );
    assert_eq!(retried[2], 2, "a second hold of the owner: {retried:?}");
}

/// `batch.lua`'s arguments for calls given as (script, keys, args), laid out as the
/// server lays out a round.
fn batch_call(calls: &[(&str, Vec<String>, Vec<Value>)]) -> (Vec<Key>, Vec<Value>) {
    let keys: Vec<Vec<Key>> = calls
        .iter()
        .map(|(_, k, _)| k.iter().map(Key::from).collect())
        .collect();
    let calls: Vec<BatchedCall<'_>> = calls
        .iter()
        .zip(&keys)
        .map(|((name, _, args), keys)| (*name, keys.as_slice(), args.as_slice()))
        .collect();
    batch_layout(&calls).expect("strings and numbers pack")
}

#[tokio::test]
async fn a_batch_answers_each_call_and_keeps_errors_apart() {
    let (redis, client, scripts) = catalogue().await;
    let (a, b) = (Keys::default().lock("batch-a"), Keys::default().lock("batch-b"));
    // b's fair queue is no list: its script fails; the calls around it do not.
    redis.cli(&["SET", &b.queue(), "not a list"]);
    let lease = || vec![Value::from(30_000), Value::from("owner"), Value::from(5_000)];
    let calls = [
        (
            "mutex_acquire",
            vec![a.lock.clone(), a.fence(), a.hold("h1"), a.queue()],
            lease(),
        ),
        (
            "fair_acquire",
            latchkey_server::lock::fair_acquire_keys(&b, "h2").to_vec(),
            [lease(), vec![Value::from(60_000), Value::from("1")]].concat(),
        ),
        (
            "describe",
            vec![a.lock.clone(), a.fence(), a.queue(), a.semaphore(), a.timeouts()],
            vec![],
        ),
    ];
    let (keys, args) = batch_call(&calls);
    let reply: Value = scripts.batch.eval(&client, keys, args).await.expect("the batch runs");
    // Two entries per call: 1 and the reply, or 0 and the error.
    let parts: Vec<Value> = reply.convert().unwrap();
    assert_eq!(parts.len(), 6, "{parts:?}");
    assert_eq!(parts[0], Value::Integer(1), "the first call ran: {parts:?}");
    let granted: Vec<i64> = parts[1].clone().convert().unwrap();
    assert_eq!((granted[0], granted[2]), (1, 1), "granted once: {granted:?}");
    assert_eq!(parts[2], Value::Integer(0), "the second call failed: {parts:?}");
    assert!(parts[3].as_string().unwrap().contains("WRONGTYPE"), "{parts:?}");
    assert_eq!(parts[4], Value::Integer(1), "the third call ran: {parts:?}");
    let described: Vec<Value> = parts[5].clone().convert().unwrap();
    assert_eq!(
        described[0].as_string().as_deref(),
        Some("lock"),
        "the third saw the first: {described:?}"
    );
}

/// A batch carries each call packed whole: names and owners of every length up to the
/// largest a request may give (1 024 bytes), in several alphabets, reach Redis byte for
/// byte.
#[tokio::test]
async fn a_batch_carries_long_and_unicode_names_whole() {
    let (redis, client, scripts) = catalogue().await;
    let names = ["ü".repeat(512), "n".repeat(300), "名".repeat(10), "x".into()];
    let owner = "o".repeat(1024);
    let calls: Vec<(&str, Vec<String>, Vec<Value>)> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let (keys, args) = mutex_acquire(&Keys::default().lock(name), &format!("h{i}"), &owner);
            ("mutex_acquire", keys, args)
        })
        .collect();
    let (keys, args) = batch_call(&calls);
    let reply: Vec<Value> = scripts.batch.eval(&client, keys, args).await.expect("the batch runs");
    assert_eq!(reply.len(), 2 * names.len(), "{reply:?}");
    for (i, name) in names.iter().enumerate() {
        assert_eq!(reply[2 * i], Value::Integer(1), "call {i} ran: {reply:?}");
        assert_eq!(
            redis.cli(&["HGET", name, &owner]).trim(),
            "1",
            "{name} is held by its owner"
        );
    }
}

#[tokio::test]
async fn concurrent_streams_share_batched_calls() {
    let redis = RedisServer::start();
    let server = Latchkey::start(&redis.url()).await;
    let client = server.client().await;
    let calls_before = redis.evalsha_calls();
    let cycles: usize = 20;
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move {
                for _ in 0..cycles {
                    let lease = client.lock(format!("batched/{i}")).acquire().await.expect("acquired");
                    lease.release().await.expect("released");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    // Each cycle is an acquire and a release: fewer script calls reached Redis.
    let operations = 64 * cycles * 2;
    let calls = redis.evalsha_calls() - calls_before;
    assert!(calls < operations, "{calls} script calls for {operations} operations");
    for i in 0..64 {
        assert_eq!(redis.cli(&["EXISTS", &format!("batched/{i}")]).trim(), "0");
    }
}

/// Redis keeps what a script wrote before an error, so a script meets a foreign key
/// under one of a name's keys before its first write, or reads it as absent. A break
/// floor of another type or no number is none (ForceRelease, which writes floors,
/// replaces whatever it finds): a release of several names used to fail at it after
/// freeing the names before it. A handoff whose fencing counter is no counter releases
/// as usual, granting nobody.
#[tokio::test]
async fn a_foreign_key_fails_a_script_before_it_writes() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("foreign");
    for floor in [["RPUSH", "not a floor"], ["SET", "not a floor"]] {
        take(&client, &scripts, &k, "holder", "holder").await;
        redis.cli(&[floor[0], &k.broken(), floor[1]]);
        let (keys, args) = release(&k, "holder", "holder", GiveBack::Release);
        assert_eq!(
            run(&client, &scripts.release, keys, args).await,
            Value::Integer(1),
            "{floor:?}"
        );
        assert_eq!(redis.cli(&["EXISTS", "foreign"]).trim(), "0", "released, {floor:?}");
        redis.cli(&["DEL", &k.broken(), &k.hold("holder")]);
    }

    take(&client, &scripts, &k, "holder", "holder").await;
    redis.cli(&["DEL", &k.fence()]);
    redis.cli(&["RPUSH", &k.fence(), "not a counter"]);
    let reply = hand_off(&client, &scripts, &k, "holder", "next").await;
    assert_eq!(reply, [1, -2, 0, 0], "released, granted to nobody, freed for all");
    assert_eq!(redis.cli(&["EXISTS", "foreign"]).trim(), "0", "the lock is free");
    assert_eq!(redis.cli(&["EXISTS", &k.hold("next")]).trim(), "0");
}

/// A server passes a hot mutex between its waiters in memory, and `handoff.lua` records
/// the passes behind it: the first handoff reserves tokens past its grant, a recording
/// grants the current holder the token it was told (passes in between need no record),
/// and a grant made anywhere after answers a token past every one reserved.
#[tokio::test]
async fn a_pass_in_memory_is_recorded_with_the_token_it_was_told() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("relay");
    take(&client, &scripts, &k, "a", "a").await;
    let reply = relay(&client, &scripts, &k, "a", "b", Pass::mutex(None)).await;
    let b = reply[1];
    assert!(b > 0, "b is granted: {reply:?}");
    assert_eq!(
        reply[2..],
        [1, b + 64],
        "more may follow (nobody else listens), 64 reserved"
    );
    assert_eq!(redis.cli(&["GET", &k.fence()]).trim(), (b + 64).to_string());

    // b passed to c in memory (token b + 1), c to d (b + 2): one recording, b to d.
    let d = b as u64 + 2;
    let reply = relay(&client, &scripts, &k, "b", "d", Pass::mutex(Some(d))).await;
    assert_eq!(reply, [1, d as i64, 1, d as i64 + 64]);
    assert_eq!(redis.cli(&["HGET", "relay", "d"]).trim(), "1", "d holds in Redis");
    assert_eq!(redis.cli(&["HEXISTS", "relay", "b"]).trim(), "0");
    assert_eq!(redis.cli(&["GET", &k.hold("d")]).trim(), d.to_string());
    assert_eq!(redis.cli(&["EXISTS", &k.hold("b"), &k.hold("c")]).trim(), "0");

    let (keys, args) = release(&k, "d", "d", GiveBack::Release);
    assert_eq!(run(&client, &scripts.release, keys, args).await, Value::Integer(1));
    let reply = take(&client, &scripts, &k, "e", "e").await;
    assert!(reply[1] > d as i64 + 64, "past every reserved token: {reply:?}");
}

/// A recording written again after a reconnect (the pool writes a call again when its
/// connection was cut before the reply) answers as its first run did: the second run
/// found the releasing hold gone and answered a failed pass, and the server told the
/// holders recorded in Redis that their leases were lost, leaving the candidate's hold,
/// which nobody renewed or gave back, to its lease.
#[tokio::test]
async fn a_recording_sent_again_answers_as_the_first_did() {
    let (_redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("relay-again");
    take(&client, &scripts, &k, "a", "a").await;
    let b = relay(&client, &scripts, &k, "a", "b", Pass::mutex(None)).await[1];
    let d = b as u64 + 2;
    let first = relay(&client, &scripts, &k, "b", "d", Pass::mutex(Some(d))).await;
    assert_eq!(first[..2], [1, d as i64]);
    let again = relay(&client, &scripts, &k, "b", "d", Pass::mutex(Some(d))).await;
    assert_eq!(again, [1, d as i64, 0, 0], "a recording sent again is no failure");
}

/// The token `describe.lua` reads as the latest grant of `k`'s lock.
async fn last_token(client: &Client, scripts: &Scripts, k: &LockKeys) -> Value {
    let keys = vec![k.lock.clone(), k.fence(), k.queue(), k.semaphore(), k.timeouts()];
    let described: Vec<Value> = run(client, &scripts.describe, keys, vec![]).await.convert().unwrap();
    described[2].clone()
}

/// Describe reads the latest grant, not the top a handoff or recording reserved past
/// it; a grant after the run, a token past them all; a foreign key under the record's
/// name, the counter.
#[tokio::test]
async fn describe_reads_the_latest_grant_not_the_reserved_top() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("relay-last");
    take(&client, &scripts, &k, "a", "a").await;
    let b = relay(&client, &scripts, &k, "a", "b", Pass::mutex(None)).await[1];
    assert_eq!(last_token(&client, &scripts, &k).await, Value::from(b.to_string()));
    // b passed to c in memory, c to d: recorded, d's token is the latest.
    let d = b + 2;
    relay(&client, &scripts, &k, "b", "d", Pass::mutex(Some(d as u64))).await;
    assert_eq!(last_token(&client, &scripts, &k).await, Value::from(d.to_string()));
    let (keys, args) = release(&k, "d", "d", GiveBack::Release);
    assert_eq!(run(&client, &scripts.release, keys, args).await, Value::Integer(1));
    let e = take(&client, &scripts, &k, "e", "e").await[1];
    assert!(e > d + 64, "past every reserved token");
    assert_eq!(last_token(&client, &scripts, &k).await, Value::from(e.to_string()));

    redis.cli(&["SET", &k.fence_passed(), &format!("{b}:{e}")]);
    assert_eq!(
        last_token(&client, &scripts, &k).await,
        Value::from(b.to_string()),
        "read as a record"
    );
    redis.cli(&["DEL", &k.fence_passed()]);
    redis.cli(&["RPUSH", &k.fence_passed(), "not a record"]);
    assert_eq!(last_token(&client, &scripts, &k).await, Value::from(e.to_string()));
}

/// A recording after which no pass may follow (another client listens now) reserves
/// nothing, and still records its holder's grant as the latest: Describe showed the
/// token of the holder the previous record named, an earlier one.
#[tokio::test]
async fn a_recording_that_ends_the_passes_is_the_latest_grant() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("relay-last-stopped");
    take(&client, &scripts, &k, "a", "a").await;
    let b = relay(&client, &scripts, &k, "a", "b", Pass::mutex(None)).await[1];
    let _us = listener(&redis, &k.channel(), 1).await;
    let _them = listener(&redis, &k.channel(), 2).await;
    let c = b + 1;
    let reply = relay(&client, &scripts, &k, "b", "c", Pass::mutex(Some(c as u64))).await;
    assert_eq!(reply[..3], [1, c, 0], "recorded, no more passes");
    assert_eq!(last_token(&client, &scripts, &k).await, Value::from(c.to_string()));
}

/// The record of the latest grant lives as long as the fencing counter: a counter that
/// a longer lease's grant left longer to live outlived it, and Describe then read the
/// reserved top as the latest grant, a token nobody was granted.
#[tokio::test]
async fn the_latest_grants_record_lives_as_long_as_the_counter() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("relay-long-counter");
    take(&client, &scripts, &k, "a", "a").await;
    redis.cli(&["PEXPIRE", &k.fence(), "600000"]);
    let b = relay(&client, &scripts, &k, "a", "b", Pass::mutex(None)).await[1];
    let lives = |key: &str| redis.cli(&["PTTL", key]).trim().parse::<i64>().unwrap();
    assert!(lives(&k.fence()) > 500_000, "the counter keeps its life");
    assert!(
        lives(&k.fence_passed()) > 500_000,
        "the record as long: {} ms",
        lives(&k.fence_passed())
    );
    assert_eq!(last_token(&client, &scripts, &k).await, Value::from(b.to_string()));
}

/// A recording whose recorded hold is gone (its lease ran out, or ForceRelease broke
/// it) grants nothing: the server then ends the lease it passed in memory.
#[tokio::test]
async fn a_pass_in_memory_whose_recorded_hold_is_gone_grants_nothing() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("relay-gone");
    take(&client, &scripts, &k, "a", "a").await;
    let b = relay(&client, &scripts, &k, "a", "b", Pass::mutex(None)).await[1];
    redis.cli(&["DEL", "relay-gone"]);
    take(&client, &scripts, &k, "x", "x").await;
    // c, passed the lock on its way to d, left a claim when it waited: its server ends
    // its lease, and no release may grant its gone stream the lock again.
    let claims = "latchkey_claims:{relay-gone}";
    let claim = |hold: &str| format!("{hold}\n30000\n5000\n{hold}");
    redis.cli(&["ZADD", claims, "9999999999999", &claim("c")]);
    let passed = [claim("c")];
    let passed: Vec<&str> = passed.iter().map(String::as_str).collect();
    let pass = Pass {
        told: Some(b as u64 + 2),
        reserve: 64,
        passed: &passed,
        ..Pass::default()
    };
    let reply = relay(&client, &scripts, &k, "b", "d", pass).await;
    assert_eq!(reply, [0, 0, 0, 0], "nothing recorded");
    assert_eq!(redis.cli(&["HGET", "relay-gone", "x"]).trim(), "1", "x keeps the lock");
    assert_eq!(redis.cli(&["EXISTS", &k.hold("d")]).trim(), "0");
    assert_eq!(redis.cli(&["ZCARD", claims]).trim(), "0", "c's claim is forgotten");
}

/// A handoff forgets the releasing stream's own claim, as a release does, whether or not
/// it still held: a claiming try of it that raced the handoff which granted it may have
/// left one, which a later release would grant to the gone stream.
#[tokio::test]
async fn a_handoff_forgets_the_releasing_streams_own_claim() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("relay-own-claim");
    let claims = "latchkey_claims:{relay-own-claim}";
    let claim = |hold: &str| format!("{hold}\n30000\n5000\n{hold}");
    take(&client, &scripts, &k, "a", "a").await;
    redis.cli(&["ZADD", claims, "9999999999999", &claim("a")]);
    let own = claim("a");
    let pass = Pass {
        own_claim: &own,
        ..Pass::default()
    };
    let reply = relay(&client, &scripts, &k, "a", "b", pass).await;
    assert!(reply[0] == 1 && reply[1] > 0, "b is granted: {reply:?}");
    assert_eq!(redis.cli(&["ZCARD", claims]).trim(), "0", "a's claim is forgotten");
    // A handoff from a hold already gone forgets its claim too.
    redis.cli(&["ZADD", claims, "9999999999999", &claim("a")]);
    let pass = Pass {
        own_claim: &own,
        ..Pass::default()
    };
    assert_eq!(relay(&client, &scripts, &k, "a", "c", pass).await, [0, 0, 0, 0]);
    assert_eq!(redis.cli(&["ZCARD", claims]).trim(), "0", "a's claim is forgotten");
}

/// A pass in memory is recorded whoever listens, since it cannot be undone; once
/// another client listens, or the lock has been passed on for 2 s, the recording says
/// that no more may follow, and the next handoff goes through Redis (and yields).
#[tokio::test]
async fn a_recording_stops_passes_when_others_listen_or_passing_ran_long() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("relay-stop");
    take(&client, &scripts, &k, "a", "a").await;
    let b = relay(&client, &scripts, &k, "a", "b", Pass::mutex(None)).await[1] as u64;
    let _us = listener(&redis, &k.channel(), 1).await;
    let them = listener(&redis, &k.channel(), 2).await;
    let reply = relay(&client, &scripts, &k, "b", "c", Pass::mutex(Some(b + 1))).await;
    assert_eq!(reply[..3], [1, b as i64 + 1, 0], "recorded, no more passes");
    them.unsubscribe(k.channel()).await.unwrap();

    // Alone again, but passed on since 3 s ago.
    let since = redis
        .cli(&["TIME"])
        .lines()
        .next()
        .unwrap()
        .trim()
        .parse::<i64>()
        .unwrap()
        * 1000
        - 3_000;
    redis.cli(&["SET", &format!("latchkey_passing:{{{}}}", k.name()), &since.to_string()]);
    let reply = relay(&client, &scripts, &k, "c", "d", Pass::mutex(Some(b + 2))).await;
    assert_eq!(reply[..3], [1, b as i64 + 2, 0], "recorded, no more passes");
    let reply = relay(&client, &scripts, &k, "d", "e", Pass::mutex(None)).await;
    assert_eq!(reply, [1, -2, 0, 0], "the next handoff yields the lock to all");
    assert_eq!(redis.cli(&["EXISTS", "relay-stop"]).trim(), "0", "the lock is free");
}

/// A server's turn on a hot mutex keeps the lock among its own waiters only while every
/// other listener on the unlock channel is a present server with a claim: one listener
/// more (a Redisson client, a waiter that left no claim) ends it, and the handoff frees
/// the lock for every waiter instead of granting the server's next one.
#[tokio::test]
async fn a_turn_gives_way_to_a_listener_without_a_claim() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("turn-unclaimed");
    assert_eq!(take(&client, &scripts, &k, "a:1", "a:1").await[0], 1);
    // Servers a and b listen, b present with a claim.
    let _a = listener(&redis, &k.channel(), 1).await;
    let _b = listener(&redis, &k.channel(), 2).await;
    let _b_present = listener(&redis, &k.presence("b"), 1).await;
    let claims = "latchkey_claims:{turn-unclaimed}";
    redis.cli(&["ZADD", claims, "9999999999999", "b:1\n30000\n5000\nb:1"]);
    redis.cli(&["SET", "latchkey_turn:{turn-unclaimed}", "a", "PX", "60000"]);

    let reply = hand_off(&client, &scripts, &k, "a:1", "a:2").await;
    assert!(
        reply[1] > 0 && reply[2] > 1,
        "in its turn, to its own waiter, passes may follow: {reply:?}"
    );
    let other = listener(&redis, &k.channel(), 3).await;
    let reply = hand_off(&client, &scripts, &k, "a:2", "a:3").await;
    assert_eq!(
        reply,
        [1, -2, 0, 0],
        "a listener without a claim: the lock is freed for all"
    );
    assert_eq!(redis.cli(&["EXISTS", "turn-unclaimed"]).trim(), "0", "free");
    assert_eq!(redis.cli(&["ZCARD", claims]).trim(), "1", "B's claim waits on");
    // That listener gone and A's turn over, A's next release grants B's claim: not
    // freed for all, which the handoff's answer tells its waiter (it tries at once).
    let _: () = other.unsubscribe(k.channel()).await.unwrap();
    assert!(
        latchkey_tests::poll_until(T, || redis.subscribers(&k.channel()) == 2).await,
        "the listener without a claim left"
    );
    assert_eq!(take(&client, &scripts, &k, "a:3", "a:3").await[0], 1);
    redis.cli(&["DEL", "latchkey_turn:{turn-unclaimed}"]);
    let reply = hand_off(&client, &scripts, &k, "a:3", "a:4").await;
    assert_eq!(reply, [1, 0, 0, 0], "released, and granted to B's claim");
    assert_eq!(
        redis.cli(&["HEXISTS", "turn-unclaimed", "b:1"]).trim(),
        "1",
        "B's claim holds"
    );
}

/// A fair waiter whose deadline is in the set but whose place in the list is gone (the
/// list deleted, or expired before its set) is queued again at the end by its next try,
/// which answers as a queued waiter's: it used to fail with a Lua error after writing.
#[tokio::test]
async fn a_fair_deadline_without_its_place_in_line_is_queued_again() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("placeless");
    assert_eq!(take_fair(&client, &scripts, &k, "h1", "holder").await[0], 1);
    assert_eq!(take_fair(&client, &scripts, &k, "h2", "waiter").await[0], 0, "queued");
    redis.cli(&["DEL", &k.queue()]);
    let reply = take_fair(&client, &scripts, &k, "h2", "waiter").await;
    assert_eq!(reply[0], 0, "still waiting: {reply:?}");
    assert_eq!(reply[2], 1, "first in line again: {reply:?}");
    assert_eq!(redis.list(&k.queue()), ["waiter"]);
}

/// A fair lock passed in memory: a recording takes the holders passed since the last
/// one and the current holder from the queue, and more passes may follow only while
/// every waiter still queued is one of this server's streams.
#[tokio::test]
async fn a_fair_pass_in_memory_takes_its_holders_from_the_queue() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("relay-fair");
    let ours = ["srv:1", "srv:2", "srv:3", "srv:4"];
    assert_eq!(take_fair(&client, &scripts, &k, ours[0], ours[0]).await[0], 1);
    for hold in &ours[1..] {
        assert_eq!(take_fair(&client, &scripts, &k, hold, hold).await[0], 0, "queued");
    }
    let pass = Pass {
        fair: true,
        reserve: 64,
        ..Pass::default()
    };
    let reply = relay(&client, &scripts, &k, ours[0], ours[1], pass).await;
    let token = reply[1] as u64;
    assert!(
        token > 0 && reply[2] == 1,
        "handed to the head, more may follow: {reply:?}"
    );
    // Another server's waiter queues behind them.
    assert_eq!(take_fair(&client, &scripts, &k, "other:1", "other:1").await[0], 0);

    // srv:2 passed to srv:3, srv:3 to srv:4 in memory: one recording.
    let pass = Pass::fair_recording(token as i64 + 2, &ours[2..3], &[]);
    let reply = relay(&client, &scripts, &k, ours[1], ours[3], pass).await;
    assert_eq!(
        reply,
        [1, token as i64 + 2, 0, 0],
        "recorded; another server waits: no tokens reserved"
    );
    assert_eq!(redis.cli(&["LRANGE", &k.queue(), "0", "-1"]).trim(), "other:1");
    assert_eq!(redis.cli(&["ZCARD", &k.timeouts()]).trim(), "1");
    assert_eq!(redis.cli(&["HGET", "relay-fair", ours[3]]).trim(), "1");
}

/// An owner a client named that ends like a stream's own owner id of the passing server
/// (`x:<server>:<n>`) is another client's waiter: no more passes in memory, as for any
/// other waiter queued (it was read as one of the server's own, and passed over).
#[tokio::test]
async fn a_named_owner_that_ends_like_a_servers_own_stops_passes() {
    let (_redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("relay-spoof");
    assert_eq!(take_fair(&client, &scripts, &k, "srv:1", "srv:1").await[0], 1);
    assert_eq!(take_fair(&client, &scripts, &k, "srv:2", "srv:2").await[0], 0, "queued");
    assert_eq!(
        take_fair(&client, &scripts, &k, "other:1", "x:srv:9").await[0],
        0,
        "queued"
    );
    let pass = Pass {
        fair: true,
        reserve: 64,
        ..Pass::default()
    };
    let reply = relay(&client, &scripts, &k, "srv:1", "srv:2", pass).await;
    assert!(reply[1] > 0, "handed to the head: {reply:?}");
    assert_eq!(
        reply[2], 0,
        "another client's waiter is queued: no more passes: {reply:?}"
    );
}

/// A deep fair queue of the passing server's own waiters is not read whole by every
/// recording (every 2 ms while the lock is passed; at 0.35 µs an entry, a third of
/// Redis' time at 3,000 waiters): past 256 queued, passes stop and the lock goes
/// through Redis, one handoff a release.
#[tokio::test]
async fn a_queue_too_deep_to_read_at_each_recording_stops_passes() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("relay-deep");
    assert_eq!(take_fair(&client, &scripts, &k, "srv:0", "srv:0").await[0], 1);
    let queue_them = "for i = 1, tonumber(ARGV[1]) do local e = 'srv:' .. i \
        redis.call('rpush', KEYS[1], e) redis.call('zadd', KEYS[2], ARGV[2], e) end";
    let far = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        + 60_000)
        .to_string();
    let pass = || Pass {
        fair: true,
        reserve: 64,
        ..Pass::default()
    };
    // 257 of the server's own, 256 once the head has the lock: passes may follow.
    redis.cli(&["EVAL", queue_them, "2", &k.queue(), &k.timeouts(), "257", &far]);
    let reply = relay(&client, &scripts, &k, "srv:0", "srv:1", pass()).await;
    assert_eq!(reply[2], 1, "256 queued: passes may follow: {reply:?}");
    // Two more: 257 once the next head has the lock.
    redis.cli(&["RPUSH", &k.queue(), "srv:258", "srv:259"]);
    redis.cli(&["ZADD", &k.timeouts(), &far, "srv:258", &far, "srv:259"]);
    let reply = relay(&client, &scripts, &k, "srv:1", "srv:2", pass()).await;
    assert!(reply[1] > 0, "handed to the head: {reply:?}");
    assert_eq!(reply[2], 0, "257 queued: no more passes: {reply:?}");
}

/// A fair waiter that lined up behind a chain passed in memory is queued by the next
/// recording, in line order, unless the chain was passed to it first; one already
/// queued keeps its place. The queue the recording made lives past every deadline.
#[tokio::test]
async fn a_fair_recording_queues_the_waiters_that_lined_up_behind_the_chain() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("relay-join");
    // Owner ids of latchkey streams (`latchkey-<server>:<n>`): their server refreshes them,
    // so the queue keeps its lifetime.
    let ours = [
        "latchkey-s:1",
        "latchkey-s:2",
        "latchkey-s:3",
        "latchkey-s:4",
        "latchkey-s:5",
        "latchkey-s:6",
        "latchkey-s:7",
    ];
    assert_eq!(take_fair(&client, &scripts, &k, ours[0], ours[0]).await[0], 1);
    assert_eq!(take_fair(&client, &scripts, &k, ours[1], ours[1]).await[0], 0, "queued");
    let pass = Pass {
        fair: true,
        reserve: 64,
        ..Pass::default()
    };
    let token = relay(&client, &scripts, &k, ours[0], ours[1], pass).await[1];
    assert!(token > 0, "handed to the head");
    let queue = || {
        redis
            .cli(&["LRANGE", &k.queue(), "0", "-1"])
            .split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert!(queue().is_empty());

    // The third and fourth lined up and were passed the lock; the fifth and sixth wait.
    let pass = Pass::fair_recording(token + 2, &ours[2..4], &ours[4..6]);
    let reply = relay(&client, &scripts, &k, ours[1], ours[3], pass).await;
    assert_eq!(reply[..3], [1, token + 2, 1], "recorded, more may follow");
    assert_eq!(queue(), [ours[4], ours[5]], "queued in line order, the passed ones not");
    let now_ms: i64 = redis
        .cli(&["TIME"])
        .split_whitespace()
        .next()
        .unwrap()
        .parse::<i64>()
        .unwrap()
        * 1000;
    for waiter in &ours[4..6] {
        let deadline: i64 = redis.cli(&["ZSCORE", &k.timeouts(), waiter]).trim().parse().unwrap();
        assert!(
            (deadline - now_ms - FAIR_STAY_MS).abs() < 2_000,
            "{waiter} stays its time"
        );
    }
    for key in [k.queue(), k.timeouts()] {
        let ttl: i64 = redis.cli(&["PTTL", &key]).trim().parse().unwrap();
        assert!(ttl > FAIR_STAY_MS, "{key} outlives the deadlines: {ttl}");
    }

    // The fifth passed the lock; the sixth (queued already) and the seventh join.
    let pass = Pass::fair_recording(token + 3, &ours[4..5], &ours[5..7]);
    let reply = relay(&client, &scripts, &k, ours[3], ours[4], pass).await;
    assert_eq!(reply[..2], [1, token + 3]);
    assert_eq!(queue(), [ours[5], ours[6]], "the sixth keeps its place, once");
    assert_eq!(redis.cli(&["ZCARD", &k.timeouts()]).trim(), "2");
}

/// Read holds' timeout keys an older latchkey made hold the lock's key alone, one
/// value for them all. A renewal of a hold whose key names no hold lengthens every such
/// key, as an older server's did: read into a map by value, all but one were lost.
#[tokio::test]
async fn a_renewal_lengthens_every_timeout_key_an_older_server_made() {
    let (redis, client, scripts) = catalogue().await;
    let k = Keys::default().lock("rw-old");
    redis.cli(&["HSET", "rw-old", "mode", "read", "o", "2"]);
    redis.cli(&["PEXPIRE", "rw-old", "30000"]);
    let prefix = k.hold_timeouts("o");
    for i in 1..=2 {
        redis.cli(&["SET", &format!("{prefix}:{i}"), "rw-old", "PX", "3000"]);
    }
    redis.cli(&["SET", &k.hold("s:1"), "5", "PX", "60000"]);
    let mut args = vec![Value::from(30_000), Value::from(5_000)];
    args.extend(["r", "rw-old", &k.hold("s:1"), &k.fence(), "o", &prefix, "5"].map(Value::from));
    let lost = lost_of(run(&client, &scripts.renew, vec![k.lock.clone(), k.fence()], args).await);
    assert!(lost.is_empty(), "{lost:?}");
    for i in 1..=2 {
        let ttl: i64 = redis.cli(&["PTTL", &format!("{prefix}:{i}")]).trim().parse().unwrap();
        assert!(ttl > 3000, "the older server's key {i} lengthened: {ttl}");
    }
}

/// A renewal (and any script) on a read-only replica (a demoted primary, its holds
/// replicated) fails with Redis's own `READONLY` error, not with an answer that lists the leases as
/// refused: the server's Redis client connects again on that error (to the promoted
/// primary, where an address moved), as it does for a batch's lone call. Caught inside
/// the script, it never reached the client, and a server whose only traffic was
/// renewals stayed on the replica.
#[tokio::test]
async fn a_renewal_on_a_read_only_replica_fails_with_its_readonly_error() {
    let (primary, replica) = RedisServer::with_replica().await;
    let scripts = Scripts::new(false);
    let held = Keys::default().lock("held");
    take(&redis_client(&primary.url()).await, &scripts, &held, "h", "o").await;
    let token = primary.cli(&["GET", &held.hold("h")]).trim().to_owned();
    let synced = latchkey_tests::poll_until(T, || replica.cli(&["EXISTS", &held.hold("h")]).trim() == "1").await;
    assert!(synced, "the hold replicated");
    let client = redis_client(&replica.url()).await;
    let mut args = vec![Value::from(60_000), Value::from(5_000)];
    args.extend(renewal("h", &held, held.hold("h"), String::new(), &token));
    let keys = vec![held.lock.clone(), held.fence()]
        .into_iter()
        .map(Key::from)
        .collect();
    let refused: Result<Value, _> = scripts.renew.eval(&client, keys, args).await;
    let err = refused.expect_err("a replica refuses the renewal");
    assert!(err.details().starts_with("READONLY "), "{err:?}");

    // Behind a lease whose renewal failed otherwise first (its hold record's name taken
    // by a hash: WRONGTYPE, read before any write), the next lease's READONLY still
    // fails the call: it was answered as that lease's failure, the reply a list.
    let foreign = Keys::default().lock("foreign");
    primary.cli(&["HSET", &foreign.hold("f"), "a", "1"]);
    let synced = latchkey_tests::poll_until(T, || replica.cli(&["EXISTS", &foreign.hold("f")]).trim() == "1").await;
    assert!(synced, "the foreign key replicated");
    let mut args = vec![Value::from(60_000), Value::from(5_000)];
    args.extend(renewal("h", &foreign, foreign.hold("f"), String::new(), "1"));
    args.extend(renewal("h", &held, held.hold("h"), String::new(), &token));
    let keys = vec![foreign.lock.clone(), foreign.fence()]
        .into_iter()
        .map(Key::from)
        .collect();
    let refused: Result<Value, _> = scripts.renew.eval(&client, keys, args).await;
    let err = refused.expect_err("a replica refuses the renewal behind another failure");
    assert!(err.details().starts_with("READONLY "), "{err:?}");

    // A script whose first write goes through `typed_call` (a semaphore release) fails
    // with it too: on Redis 6.2, raising the write's error reply failed in Redis's own
    // error handler ("attempt to concatenate local 'err' (a table value)").
    let permits = Keys::default().lock("permits");
    let keys = [
        permits.lock.clone(),
        permits.semaphore(),
        permits.semaphore_channel(),
        permits.hold("h"),
    ];
    let args = vec![Value::from("h"), Value::from("publish"), Value::from("0")];
    let refused: Result<Value, _> = scripts
        .semaphore_release
        .eval(&client, keys.into_iter().map(Key::from).collect(), args)
        .await;
    let err = refused.expect_err("a replica refuses the release");
    assert!(err.details().starts_with("READONLY "), "{err:?}");
}
