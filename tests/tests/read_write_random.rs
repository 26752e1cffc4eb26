//! The read/write lock under a random mix: readers and writers on one name over two
//! servers, named owners shared between tasks (reentrant reads and writes, a read under
//! the owner's own write let go in either order), fixed and watchdog leases, and two
//! Redisson clients polling beside them. Checked: no conflicting holds of different
//! owners overlap, no hold is lost, no latchkey reader waits out its wait, and nothing
//! but fencing counters and expiring hold records is left in Redis at the end.

use latchkey_client::{Client, Lease, LockKind};
use latchkey_tests::checker::{leftovers, LockRedis};
use latchkey_tests::redisson::{random_owner, RedissonReadLock, RedissonWriteLock};
use latchkey_tests::server::Latchkey;
use latchkey_tests::{redis_client, RedisServer};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
struct Hold {
    owner: String,
    write: bool,
    token: u64,
    from: Instant,
    to: Instant,
    lost: bool,
}

#[derive(Default)]
struct Log {
    holds: Vec<Hold>,
    timeouts: Vec<(usize, bool, Duration)>,
    errors: Vec<String>,
}

type Shared = Arc<Mutex<Log>>;

fn pick<T: Clone>(items: &[T]) -> T {
    items[fastrand::usize(..items.len())].clone()
}

async fn take(
    client: &Client,
    name: &str,
    owner: &Option<String>,
    write: bool,
    fixed: Option<Duration>,
) -> Result<Lease, latchkey_client::Error> {
    let mut b = client
        .lock(name)
        .kind(if write { LockKind::Write } else { LockKind::Read })
        .wait(Duration::from_secs(8));
    if let Some(o) = owner {
        b = b.owner(o.as_str());
    }
    if let Some(l) = fixed {
        b = b.lease(l);
    }
    b.acquire().await
}

fn record(log: &Shared, owner: &str, write: bool, lease: &Lease, from: Instant) {
    let to = Instant::now();
    log.lock().unwrap().holds.push(Hold {
        owner: owner.to_owned(),
        write,
        token: lease.fencing_token(),
        from,
        to,
        lost: lease.is_lost(),
    });
}

/// A fixed lease of 0.6–3 s half the time, else a watchdog lease.
fn maybe_fixed() -> Option<Duration> {
    fastrand::bool().then(|| Duration::from_millis(fastrand::u64(600..3000)))
}

async fn worker(task: usize, client: Client, name: String, log: Shared, until: Instant) {
    let owners = ["o1", "o2", "o3"];
    while Instant::now() < until {
        let owner: Option<String> = if fastrand::u8(..3) == 0 {
            None
        } else {
            Some(pick(&owners).to_owned())
        };
        let fixed = maybe_fixed();
        let hold_for = |fixed: Option<Duration>| {
            let max = fixed.map_or(400, |l| (l.as_millis() as u64) / 3);
            Duration::from_millis(fastrand::u64(0..max.max(1)))
        };
        let pattern = fastrand::u8(..10);
        let write = pattern < 4;
        let asked = Instant::now();
        let first = match take(&client, &name, &owner, write, fixed).await {
            Ok(l) => l,
            Err(e) => {
                if e.code() == tonic::Code::DeadlineExceeded {
                    log.lock().unwrap().timeouts.push((task, write, asked.elapsed()));
                } else {
                    log.lock().unwrap().errors.push(format!("task {task} take: {e}"));
                }
                continue;
            }
        };
        let from = Instant::now();
        let who = first.owner().to_owned();
        if write && pattern < 2 && owner.is_some() {
            // The writer also reads, then lets go in either order.
            let read_fixed = maybe_fixed();
            let cap_ms = [fixed, read_fixed]
                .iter()
                .flatten()
                .map(|l| l.as_millis() as u64 / 4)
                .min()
                .unwrap_or(400);
            let nap = || Duration::from_millis(fastrand::u64(0..cap_ms.max(1)));
            tokio::time::sleep(nap()).await;
            let second = match take(&client, &name, &Some(who.clone()), false, read_fixed).await {
                Ok(l) => l,
                Err(e) => {
                    log.lock()
                        .unwrap()
                        .errors
                        .push(format!("task {task} read under own write: {e}"));
                    record(&log, &who, true, &first, from);
                    let _ = first.release().await;
                    continue;
                }
            };
            let rfrom = Instant::now();
            let write_first = fastrand::bool();
            let (a, b, aw) = if write_first {
                (first, second, true)
            } else {
                (second, first, false)
            };
            let (afrom, bfrom) = if write_first { (from, rfrom) } else { (rfrom, from) };
            tokio::time::sleep(nap()).await;
            record(&log, &who, aw, &a, afrom);
            if let Err(e) = a.release().await {
                log.lock().unwrap().errors.push(format!("task {task} release a: {e}"));
            }
            tokio::time::sleep(nap()).await;
            record(&log, &who, !aw, &b, bfrom);
            if let Err(e) = b.release().await {
                log.lock().unwrap().errors.push(format!("task {task} release b: {e}"));
            }
        } else {
            tokio::time::sleep(hold_for(fixed)).await;
            record(&log, &who, write, &first, from);
            if let Err(e) = first.release().await {
                log.lock()
                    .unwrap()
                    .errors
                    .push(format!("task {task} release: {e} (write {write}, fixed {fixed:?})"));
            }
        }
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..30))).await;
    }
}

/// A Redisson client's thread: read or write with a 5 s lease, polling `tryLock` every
/// 20 ms for up to 5 s, holding for up to 300 ms.
async fn java_worker(task: usize, url: String, name: String, log: Shared, until: Instant) {
    let conn = redis_client(&url).await;
    while Instant::now() < until {
        let owner = random_owner();
        let write = fastrand::u8(..3) == 0;
        let read = RedissonReadLock::new(&conn, &name, &owner);
        let writer = RedissonWriteLock::new(&conn, &name, &owner);
        let asked = Instant::now();
        let mut got = false;
        while asked.elapsed() < Duration::from_secs(5) {
            let busy = if write {
                writer.try_lock(5_000).await
            } else {
                read.try_lock(5_000).await
            };
            if busy.is_none() {
                got = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if !got {
            log.lock().unwrap().timeouts.push((task, write, asked.elapsed()));
            continue;
        }
        let from = Instant::now();
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..300))).await;
        let to = Instant::now();
        log.lock().unwrap().holds.push(Hold {
            owner: owner.clone(),
            write,
            token: 0,
            from,
            to,
            lost: false,
        });
        let unlocked = if write {
            writer.unlock().await
        } else {
            read.unlock().await
        };
        if unlocked.is_none() {
            log.lock()
                .unwrap()
                .errors
                .push(format!("java task {task} write {write}: unlock found no hold"));
        }
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..50))).await;
    }
}

/// Eight tasks over two servers and two Redisson clients on one name for 15 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_and_writers_of_shared_owners_never_overlap() {
    let redis = RedisServer::start();
    let a = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "3s"]).await;
    let b = Latchkey::start_with(&redis.url(), &["--watchdog-timeout", "3s"]).await;
    let name = "fuzz-rw".to_owned();
    let log: Shared = Arc::default();
    let until = Instant::now() + Duration::from_secs(15);
    let mut tasks = Vec::new();
    for task in 0..8 {
        let client = if task % 2 == 0 {
            a.client().await
        } else {
            b.client().await
        };
        tasks.push(tokio::spawn(worker(task, client, name.clone(), log.clone(), until)));
    }
    for task in 100..102 {
        tasks.push(tokio::spawn(java_worker(
            task,
            redis.url(),
            name.clone(),
            log.clone(),
            until,
        )));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("worker ends")
            .unwrap();
    }
    let log = std::mem::take(&mut *log.lock().unwrap());
    let mut violations = Vec::new();
    for (i, x) in log.holds.iter().enumerate() {
        for y in &log.holds[i + 1..] {
            if x.lost || y.lost || x.owner == y.owner || !(x.write || y.write) {
                continue;
            }
            let (first, then) = if x.from < y.from { (x, y) } else { (y, x) };
            if then.from < first.to {
                violations.push(format!("{first:?}\n  overlaps\n{then:?}"));
            } else if first.token != 0 && then.token != 0 && then.token <= first.token {
                // Redisson's holds have no token.
                violations.push(format!("{first:?}\n  fenced after\n{then:?}"));
            }
        }
    }
    let lost = log.holds.iter().filter(|h| h.lost).count();
    let reader_timeouts: Vec<_> = log.timeouts.iter().filter(|t| !t.1 && t.0 < 100).collect();
    eprintln!(
        "holds {} (writes {}), lost {lost}, timeouts {:?}, errors {:?}",
        log.holds.len(),
        log.holds.iter().filter(|h| h.write).count(),
        log.timeouts,
        log.errors
    );
    assert!(
        violations.is_empty(),
        "{} conflicting overlaps:\n{}",
        violations.len(),
        violations.join("\n")
    );
    assert!(log.errors.is_empty(), "errors: {:?}", log.errors);
    assert!(lost == 0, "{lost} holds lost");
    assert!(reader_timeouts.is_empty(), "readers timed out: {reader_timeouts:?}");
    let redis = LockRedis::Standalone(redis);
    let left = leftovers::wait_clean(&redis, Duration::from_secs(5)).await;
    assert!(left.is_empty(), "left in Redis after every stream ended: {left:?}");
}
