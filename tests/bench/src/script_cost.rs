//! `script-cost`: what Redis spends inside the scripts per uncontended lock cycle,
//! apart from the rest of the machine. A Redis of its own is kept busy by a few calls
//! in flight, and its own count of `EVALSHA` time (`INFO commandstats`) is divided by
//! the cycles run. latchkey's calls are the server's batch script carrying five
//! acquire-and-release pairs each, laid out as a server's round lays them out, and
//! (`-lone` rows) its acquire and release scripts one `EVALSHA` each, as a server sends
//! them while fewer than four calls are in flight; Redisson's are its lock and unlock
//! scripts, one `EVALSHA` each (the unlock latch's `DEL`, a command of its own outside
//! the scripts, is left out). Leaving out the
//! network, the gRPC hop and the scheduler makes this the bench's steadiest figure, the
//! one to read a change of the scripts by.

use fred::prelude::*;
use fred::types::scripts::Script as FredScript;
use latchkey_server::keys::{Keys, LockKeys};
use latchkey_server::lock;
use latchkey_server::redis::{batch_layout, BatchedCall};
use latchkey_server::scripts::Scripts;
use latchkey_tests::redis::CommandStat;
use latchkey_tests::redisson::lock_channel;
use latchkey_tests::redisson::scripts::{LOCK_TRY_LOCK, LOCK_UNLOCK};
use latchkey_tests::{redis_client, RedisServer};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Numbers the Redisson unlocks' latches (they expire on their own).
static LATCHES: AtomicU64 = AtomicU64::new(0);

/// Calls in flight at once, as many as the rows' C=64 tasks (they share one
/// connection, pipelined): a busy Redis, whose scripts run warm.
const IN_FLIGHT: usize = 64;
/// Lock cycles in one latchkey batch: the size of a round at C=64 is about ten calls.
const PAIRS: usize = 5;
/// Lock cycles per measured run (and a tenth as warm-up).
const CYCLES: usize = 100_000;
/// Measured runs; the lowest is shown (the others were disturbed by the machine).
const RUNS: usize = 3;

/// One measured peer.
pub struct Cost {
    /// `latchkey`, `latchkey-fair` (each also `-lone`) or `redisson`.
    pub peer: &'static str,
    /// Redis' time inside the scripts per lock cycle, µs.
    pub micros: f64,
    /// Commands the scripts ran per cycle.
    pub commands: f64,
}

impl Cost {
    /// The bench's line for it.
    pub fn line(&self) -> String {
        format!(
            "script-cost    {:<18}  Redis inside the scripts {:>6.2} µs per cycle  {:>5.1} commands per cycle",
            self.peer, self.micros, self.commands
        )
    }

    /// Its JSON line.
    pub fn json(&self) -> String {
        format!(
            "{{\"scenario\":\"script-cost\",\"peer\":\"{}\",\"redis_us_per_cycle\":{:.3},\"commands_per_cycle\":{:.2}}}",
            self.peer, self.micros, self.commands
        )
    }
}

/// Measures latchkey's mutex and fair lock and Redisson's lock, those of them among the
/// `wanted` peers, each on a fresh Redis.
pub async fn measure(wanted: &[String]) -> Vec<Cost> {
    let mut costs = Vec::new();
    let peers = [
        ("latchkey", "latchkey"),
        ("latchkey", "latchkey-lone"),
        ("latchkey-fair", "latchkey-fair"),
        ("latchkey-fair", "latchkey-fair-lone"),
        ("redisson", "redisson"),
    ];
    for (_, row) in peers.into_iter().filter(|(p, _)| wanted.iter().any(|w| w == p)) {
        let redis = RedisServer::start();
        let client = redis_client(&redis.url()).await;
        let calls = Calls::load(&client, row).await;
        costs.push(lowest(&redis, &client, &calls, row).await);
    }
    costs
}

/// The lowest of [`RUNS`] measured runs, after a warm-up.
async fn lowest(redis: &RedisServer, client: &Client, calls: &Calls, peer: &'static str) -> Cost {
    drive(client, calls, CYCLES / 10).await;
    let mut best: Option<Cost> = None;
    for _ in 0..RUNS {
        redis.cli(&["CONFIG", "RESETSTAT"]);
        let cycles = drive(client, calls, CYCLES).await as f64;
        let (usec, commands) = evalsha_time(&redis.command_stats());
        let cost = Cost {
            peer,
            micros: usec as f64 / cycles,
            commands: commands as f64 / cycles,
        };
        if best.as_ref().is_none_or(|b| cost.micros < b.micros) {
            best = Some(cost);
        }
    }
    best.expect("at least one run")
}

/// `EVALSHA`'s time in µs and the count of the commands the scripts ran, from `INFO
/// commandstats` (every command but `EVALSHA` and the bench's own `CONFIG` and `INFO`).
fn evalsha_time(stats: &[CommandStat]) -> (u64, u64) {
    let (mut usec, mut commands) = (0, 0);
    for s in stats {
        match s.command.as_str() {
            "evalsha" => usec = s.usec,
            n if n.starts_with("config") || n == "info" => {}
            _ => commands += s.calls,
        }
    }
    (usec, commands)
}

/// One call's keys and arguments.
type Call = (Vec<Key>, Vec<Value>);

/// What one in-flight task sends, again and again: each call runs `cycles` lock cycles.
struct Calls {
    sha: String,
    /// One call per task.
    per_task: Vec<Call>,
    /// The release script and one release per task, sent after each acquire (`None`
    /// for latchkey's batches).
    unlock: Option<(String, Vec<Call>)>,
    /// Whether each unlock takes a latch of its own (Redisson's).
    latched: bool,
    cycles: usize,
}

impl Calls {
    /// Loads the peer's scripts and builds each task's calls on names of its own.
    async fn load(client: &Client, peer: &str) -> Self {
        let load = |lua: String| async move {
            let script = FredScript::from_lua(lua);
            script.load(client).await.expect("the script loads");
            script.sha1().to_string()
        };
        if peer == "redisson" {
            let name = |t: usize| format!("script-cost:redisson:{t}");
            let lock = (0..IN_FLIGHT)
                .map(|t| {
                    (
                        vec![Key::from(name(t))],
                        vec![Value::from(30_000), Value::from("owner")],
                    )
                })
                .collect();
            let unlock = (0..IN_FLIGHT)
                .map(|t| {
                    // The latch (the third key) is set per call.
                    let keys = [name(t), lock_channel(&name(t)), String::new()];
                    let args = [Value::from("0"), Value::from(30_000), Value::from("owner")];
                    let args = [&args[..], &[Value::from("publish"), Value::from(13_500)]].concat();
                    (keys.map(Key::from).to_vec(), args)
                })
                .collect();
            return Self {
                sha: load(LOCK_TRY_LOCK.to_owned()).await,
                per_task: lock,
                unlock: Some((load(LOCK_UNLOCK.to_owned()).await, unlock)),
                latched: true,
                cycles: 1,
            };
        }
        let scripts = Scripts::new(false);
        let fair = peer.starts_with("latchkey-fair");
        if peer.ends_with("-lone") {
            let (acquire, release): (Vec<_>, Vec<_>) = (0..IN_FLIGHT)
                .map(|t| {
                    let [(_, ak, aa), (_, rk, ra)] = pair(t, 0, fair);
                    ((ak, aa), (rk, ra))
                })
                .unzip();
            let script = if fair {
                &scripts.fair_acquire
            } else {
                &scripts.mutex_acquire
            };
            return Self {
                sha: load(script.lua().to_owned()).await,
                per_task: acquire,
                unlock: Some((load(scripts.release.lua().to_owned()).await, release)),
                latched: false,
                cycles: 1,
            };
        }
        let per_task = (0..IN_FLIGHT).map(|t| batch(t, fair)).collect();
        Self {
            sha: load(scripts.batch.lua().to_owned()).await,
            per_task,
            unlock: None,
            latched: false,
            cycles: PAIRS,
        }
    }
}

/// Task `t`'s batch: an acquire and a release on each of [`PAIRS`] names of its own,
/// with the keys and arguments the server builds for a stream.
fn batch(t: usize, fair: bool) -> Call {
    let parts: Vec<(&str, Vec<Key>, Vec<Value>)> = (0..PAIRS).flat_map(|i| pair(t, i, fair)).collect();
    let calls: Vec<BatchedCall<'_>> = parts.iter().map(|(s, k, a)| (*s, k.as_slice(), a.as_slice())).collect();
    batch_layout(&calls).expect("strings and numbers pack")
}

/// Task `t`'s acquire and release of its name `i`, as scripts' names, keys and
/// arguments.
fn pair(t: usize, i: usize, fair: bool) -> [(&'static str, Vec<Key>, Vec<Value>); 2] {
    let k = Keys::default().lock(&format!("script-cost:{t}:{i}"));
    let hold = format!("bench:{t}");
    let keys = lock::release_keys(&k, &hold).map(Key::from).to_vec();
    let args = lock::release_args("owner", lock::GiveBack::Release, "", false);
    [acquire(&k, &hold, fair), ("release", keys, args)]
}

/// One stream's acquire of `k`, a 30 s lease (a fair waiter stays queued 60 s).
fn acquire(k: &LockKeys, hold: &str, fair: bool) -> (&'static str, Vec<Key>, Vec<Value>) {
    let mut args = lock::lease_args(Duration::from_secs(30), "owner".to_owned());
    if fair {
        args.extend([Value::from(60_000), Value::from("1")]);
        let keys = lock::fair_acquire_keys(k, hold).map(Key::from).to_vec();
        ("fair_acquire", keys, args)
    } else {
        args.push(Value::from(""));
        let keys = lock::mutex_acquire_keys(k, hold).map(Key::from).to_vec();
        ("mutex_acquire", keys, args)
    }
}

/// Runs about `cycles` lock cycles from [`IN_FLIGHT`] tasks; the cycles run.
async fn drive(client: &Client, calls: &Calls, cycles: usize) -> usize {
    let batches = (cycles / (IN_FLIGHT * calls.cycles)).max(1);
    let tasks = (0..IN_FLIGHT).map(|t| async move {
        for _ in 0..batches {
            let (keys, args) = calls.per_task[t].clone();
            let _: Value = client.evalsha(&calls.sha, keys, args).await.expect("the call runs");
            if let Some((sha, unlock)) = &calls.unlock {
                let (mut keys, args) = unlock[t].clone();
                // Each unlock has a latch of its own, as Redisson's has (a latch found
                // set answers for an unlock already done, and unlocks nothing).
                if calls.latched {
                    let n = LATCHES.fetch_add(1, Ordering::Relaxed);
                    keys[2] = Key::from(format!("script-cost:latch:{n}"));
                }
                let _: Value = client.evalsha(sha, keys, args).await.expect("the unlock runs");
            }
        }
    });
    futures::future::join_all(tasks).await;
    IN_FLIGHT * batches * calls.cycles
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_give_the_scripts_time_and_their_commands() {
        let stats = "# Commandstats\r\ncmdstat_evalsha:calls=10,usec=500,usec_per_call=50.00,rejected_calls=0,failed_calls=0\r\n\
                     cmdstat_get:calls=20,usec=9,usec_per_call=0.45\r\ncmdstat_config|resetstat:calls=1,usec=40\r\n\
                     cmdstat_info:calls=1,usec=30\r\ncmdstat_publish:calls=10,usec=3";
        let stats = latchkey_tests::redis::parse_command_stats(stats);
        assert_eq!(evalsha_time(&stats), (500, 30));
    }
}
