//! The short form of the fault-injection checker (`latchkey_tests::checker`): clients
//! over two replicas while replicas are killed and stopped, Redis restarts, the network
//! drops and the cluster fails over; plus client processes killed and paused while
//! they hold. The long form: `tests/checker/run` (see docs/safety.md).

use latchkey_client::LockKind;
use latchkey_tests::checker::workload::{self, Runner, Workload};
use latchkey_tests::checker::{
    self, Attempt, End, Failure, Fault, History, Report, Resource, Scenario, Target, Window,
};
use latchkey_tests::{LatchkeyProcess, RedisServer};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};

/// The runs share two cores with everything else: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn assert_clean(report: &Report, windows: &[Window]) {
    println!("{report}");
    for w in windows {
        println!(
            "fault {} for {}ms (from {}µs, over at {}µs, settled at {}µs) on {}",
            w.fault,
            (w.end - w.start) / 1000,
            w.start,
            w.recovered,
            w.end,
            w.locks.as_ref().map_or("every lock".to_owned(), |l| format!("{l:?}"))
        );
    }
    // The violations include a lock not granted after the last fault.
    assert!(report.violations.is_empty(), "{report}");
    for (name, lock) in &report.locks {
        assert!(lock.acquisitions > 20, "{name} was hardly used:\n{report}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_replicas_through_kills_restarts_and_a_partition() {
    let _serial = SERIAL.lock().await;
    let faults = vec![
        Fault::KillReplica,
        Fault::TermReplica,
        Fault::RestartRedis,
        Fault::DropNetwork,
    ];
    let mut scenario = Scenario::new(false, faults, Duration::from_secs(32));
    // Two long holders per endpoint, so that the faults find holds to break: with one,
    // about one run in six saw none told `lost`.
    scenario.workload.long_clients_per_endpoint = 2;
    // The faults fall at random times, and a slow run can still see none hit a holder
    // (CI, once in some hundred runs): every run must be clean, and one in three must
    // have told a holder `lost`, or the faults tested nothing.
    for run in 1..=3 {
        let (report, windows) = checker::run(&scenario).await;
        assert_clean(&report, &windows);
        if report.totals().lost > 0 {
            return;
        }
        println!("run {run}: a fault hit no holder");
    }
    panic!("in three runs no fault hit a holder");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_with_replicas_through_failover_and_a_master_kill() {
    let _serial = SERIAL.lock().await;
    let scenario = Scenario::new(true, vec![Fault::Failover, Fault::KillMaster], Duration::from_secs(24));
    let (report, windows) = checker::run(&scenario).await;
    assert_clean(&report, &windows);
}

/// A client process running the checker's `hold` command.
struct HoldProcess {
    child: Child,
    lines: tokio::io::Lines<BufReader<ChildStdout>>,
}

impl HoldProcess {
    fn spawn(server: &str, resource: &str, lock: &str, hold: Duration) -> HoldProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_latchkey-checker"))
            .args(["hold", "--server", server, "--resource", resource, "--lock", lock])
            .args(["--hold", &format!("{}ms", hold.as_millis())])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the checker's hold process");
        let stdout = child.stdout.take().expect("piped stdout");
        HoldProcess {
            child,
            lines: BufReader::new(stdout).lines(),
        }
    }

    /// Waits for the grant and returns its token.
    async fn holding(&mut self) -> u64 {
        let line = self.line().await;
        let token = line
            .strip_prefix("holding ")
            .unwrap_or_else(|| panic!("unexpected {line:?}"));
        token.parse().expect("a token")
    }

    /// Waits for the attempt line printed at the end.
    async fn attempt(&mut self) -> Attempt {
        let line = self.line().await;
        Attempt::from_line(&line).unwrap_or_else(|| panic!("unexpected {line:?}"))
    }

    async fn line(&mut self) -> String {
        let next = tokio::time::timeout(Duration::from_secs(30), self.lines.next_line()).await;
        next.expect("the hold process answered in time")
            .expect("read its stdout")
            .expect("it printed a line")
    }

    fn signal(&self, signal: Signal) {
        let pid = self.child.id().expect("running");
        kill(Pid::from_raw(i32::try_from(pid).expect("pid fits")), signal).expect("signal the hold process");
    }
}

/// An in-process client on `server` that records into `history`.
async fn runner(server: &LatchkeyProcess, resource: &RedisServer, history: &History, wait: Duration) -> Runner {
    Runner {
        id: 1,
        client: workload::connect(&server.endpoint(), Duration::from_secs(1)),
        workload: Workload {
            targets: vec![],
            clients_per_endpoint: 1,
            hold: Duration::from_millis(50),
            long_hold: Duration::ZERO,
            long_clients_per_endpoint: 0,
            wait,
            keepalive: Duration::from_secs(1),
        },
        resource: Resource::connect(&resource.url()).await,
        history: history.clone(),
        announce: false,
    }
}

fn spawn_server(redis: &RedisServer, keepalive: &str) -> LatchkeyProcess {
    let args: Vec<String> = [
        "--redis-url",
        &redis.url(),
        "--no-metrics",
        "--watchdog-timeout",
        "1500ms",
        "--keepalive-interval",
        keepalive,
        "--keepalive-timeout",
        keepalive,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    LatchkeyProcess::spawn(&args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_client_process_frees_its_lock_at_once() {
    let _serial = SERIAL.lock().await;
    let (redis, resource) = (RedisServer::start(), RedisServer::start());
    let server = spawn_server(&redis, "10s");
    let mut holder = HoldProcess::spawn(
        &server.endpoint(),
        &resource.url(),
        "proc/kill",
        Duration::from_secs(60),
    );
    let token = holder.holding().await;
    let history = History::default();
    let waiter = runner(&server, &resource, &history, Duration::from_secs(10)).await;
    let target = Target::new("proc/kill", LockKind::Mutex, 0);
    let waiting = tokio::spawn(async move { waiter.round(&target, Duration::from_millis(50)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.signal(Signal::SIGKILL);
    let (killed, killed_us) = (Instant::now(), checker::now_us());
    let attempt = waiting.await.expect("the waiter ran");
    let hold = attempt.outcome.expect("the waiter acquires");
    let waited = killed.elapsed();
    // It waited for the killed holder: granted beside it, it would read as at once too.
    assert!(hold.acquired_at > killed_us, "granted before the kill");
    println!(
        "SIGKILL: waiter granted {waited:?} after the kill, token {} > {token}",
        hold.token
    );
    assert!(waited < Duration::from_secs(1), "granted {waited:?} after the kill");
    assert!(hold.token > token && hold.wrote);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_client_keeps_its_lock_while_its_stream_lives() {
    let _serial = SERIAL.lock().await;
    let (redis, resource) = (RedisServer::start(), RedisServer::start());
    // Keepalive longer than the pause: the stream lives, the watchdog keeps renewing.
    let server = spawn_server(&redis, "20s");
    let mut holder = HoldProcess::spawn(
        &server.endpoint(),
        &resource.url(),
        "proc/pause",
        Duration::from_secs(4),
    );
    holder.holding().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    holder.signal(Signal::SIGSTOP);
    let history = History::default();
    let waiter = runner(&server, &resource, &history, Duration::from_secs(3)).await;
    // Twice the 1.5 s lease passes while the holder is stopped.
    let attempt = waiter
        .round(&Target::new("proc/pause", LockKind::Mutex, 0), Duration::ZERO)
        .await;
    assert_eq!(
        attempt.outcome,
        Err(Failure::Status(tonic::Code::DeadlineExceeded)),
        "the paused holder kept its lock"
    );
    holder.signal(Signal::SIGCONT);
    let hold = holder.attempt().await.outcome.expect("it held");
    println!("SIGSTOP within keepalive: {hold:?}");
    assert!(hold.wrote && hold.ended == End::Released, "{hold:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_paused_past_keepalive_is_fenced_off() {
    let _serial = SERIAL.lock().await;
    let (redis, resource_redis) = (RedisServer::start(), RedisServer::start());
    let server = spawn_server(&redis, "1s");
    let mut holder = HoldProcess::spawn(
        &server.endpoint(),
        &resource_redis.url(),
        "proc/fence",
        Duration::from_secs(3),
    );
    let stale = holder.holding().await;
    // Past the fenced read (it raised the register's token to the holder's), inside the
    // pause of the critical section.
    let resource = Resource::connect(&resource_redis.url()).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while !resource.register("proc/fence").await.is_ok_and(|r| r.token == stale) {
        assert!(Instant::now() < deadline, "the holder never read the register");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    holder.signal(Signal::SIGSTOP);
    let stopped = Instant::now();
    let stopped_at = checker::now_us();
    let history = History::default();
    let waiter = runner(&server, &resource_redis, &history, Duration::from_secs(10)).await;
    let target = Target::new("proc/fence", LockKind::Mutex, 0);
    let newer = waiter.round(&target, Duration::from_millis(50)).await;
    let granted = stopped.elapsed();
    holder.signal(Signal::SIGCONT);
    let resumed_at = checker::now_us();
    let old = holder.attempt().await;
    let (new_hold, old_hold) = (
        newer.outcome.clone().expect("granted"),
        old.outcome.clone().expect("held"),
    );
    println!("SIGSTOP past keepalive: new holder after {granted:?}: {new_hold:?}\nstale holder: {old_hold:?}");
    assert!(
        granted < Duration::from_secs(5),
        "keepalive freed the lock: {granted:?}"
    );
    assert!(new_hold.token > stale && new_hold.wrote);
    assert!(old_hold.refused && !old_hold.wrote, "the fence refused the stale write");
    assert!(matches!(old_hold.ended, End::Lost(_)), "{:?}", old_hold.ended);
    let register = resource.register("proc/fence").await.expect("register");
    println!("register {register:?}");
    assert_eq!(register.count, 1, "only the current holder's write counted");
    // Both holders got past their fenced read and wrote the unfenced twin, so the one
    // refusal was the stale holder's write.
    assert_eq!(register.plain_writes, 2, "the stale holder wrote after its pause");
    assert_eq!(register.refused, 1);
    // Unfenced, the stale write lands: both holders wrote "0 + 1", one update is lost.
    assert_eq!(register.plain, 1, "the unfenced twin lost an update");
    // The pause is the fault: a stopped process hears nothing until it runs again.
    let pause = Window {
        fault: "SIGSTOP".into(),
        start: stopped_at,
        recovered: resumed_at,
        end: resumed_at,
        locks: None,
    };
    let report = checker::verify(
        &[old, newer],
        &[("proc/fence".to_owned(), register)].into_iter().collect(),
        &[pause],
        scenario_bounds(),
    );
    assert!(report.violations.is_empty(), "{report}");
    assert_eq!(report.totals().overlaps, 1, "{report}");
}

fn scenario_bounds() -> checker::Bounds {
    Scenario::new(false, vec![], Duration::ZERO).bounds
}

/// What a run leaves in Redis is every key but the markers that expire (fencing
/// counters, passing markers, revoked hold records), read with one `redis-cli` per
/// node: the `names` run, which ends with 20 000 fencing counters, now checks it too.
#[test]
fn leftovers_are_the_keys_but_the_expiring_markers() {
    use latchkey_tests::checker::{leftovers::leftovers, rig::LockRedis};
    use latchkey_tests::process::redis_cli;
    let redis = RedisServer::start();
    let port = redis.port();
    let set = |args: &[&str]| assert_eq!(redis_cli(port, None, args).trim(), "OK");
    set(&["SET", "latchkey_fence:{a}", "7", "PX", "60000"]);
    set(&["SET", "latchkey_passing:{a b}", "x", "PX", "60000"]);
    set(&["SET", "latchkey_hold:{a}:1", "revoked", "PX", "60000"]);
    set(&["SET", "latchkey_hold:{a}:2", "granted", "PX", "60000"]);
    set(&["SET", "latchkey_fence:{stuck}", "3"]);
    set(&["SET", "latchkey:{a \"quoted\" name}", "1"]);
    let redis = LockRedis::Standalone(redis);
    let mut left = leftovers(&redis);
    left.sort();
    assert_eq!(left.len(), 3, "{left:#?}");
    assert_eq!(
        left[..2],
        [
            format!("key \"latchkey:{{a \\\"quoted\\\" name}}\" left on {port} (pttl -1)"),
            format!("key \"latchkey_fence:{{stuck}}\" left on {port} (pttl -1)"),
        ],
    );
    // A hold record that is not revoked is lock state, whatever its expiry.
    let hold = format!("key \"latchkey_hold:{{a}}:2\" left on {port} (pttl ");
    assert!(left[2].starts_with(&hold), "{left:#?}");
}
