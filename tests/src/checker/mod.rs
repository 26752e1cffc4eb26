//! A fault-injection checker in the spirit of Jepsen. Client tasks loop acquire →
//! critical section → release on a few hot locks of every kind, over two latchkey
//! replicas, while faults are injected; each critical section does a fenced
//! read-modify-write on a register in a Redis of its own. Afterwards the history is
//! verified: no conflicting holds overlapped unless the earlier one was told `lost`,
//! tokens increase in grant order, the register counts exactly the accepted writes,
//! waiters were woken promptly once the lock was free, and nothing was left in Redis.
//!
//! - `history`: what is recorded, one [`Attempt`] per acquire.
//! - `resource`: the fenced register.
//! - `workload`: the client tasks.
//! - `rig`: the Redis, the replicas, the proxy and the [`Fault`]s.
//! - `verify`: the checks; `report`: the [`Report`] they produce.
//! - `leftovers`: keys and subscriptions left in Redis.
//! - `names`: many distinct names at once; resources back to their baseline.

pub mod history;
pub mod leftovers;
pub mod names;
pub mod report;
pub mod resource;
pub mod rig;
pub mod verify;
pub mod workload;

pub use history::{now_us, Attempt, End, Failure, History, Hold, Target};
pub use report::{LockReport, Report, Totals};
pub use resource::{Register, Resource};
pub use rig::{Fault, LockRedis, Rig, Timing};
pub use verify::{verify, Bounds, Window};
pub use workload::Workload;

use latchkey_client::LockKind;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// One run of the checker.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// A 3-master cluster with replicas instead of a standalone Redis.
    pub cluster: bool,
    /// What the clients do.
    pub workload: Workload,
    /// The faults, injected one after the other, evenly spread over `duration`.
    pub faults: Vec<Fault>,
    /// How long the clients run (at least until the last fault has settled).
    pub duration: Duration,
    /// The servers' timing.
    pub timing: Timing,
    /// What the verifier holds the run to.
    pub bounds: Bounds,
}

impl Scenario {
    /// A scenario with the default hot locks (one of each kind plus a read/write pair),
    /// the default timing and bounds, and `faults` over `duration`.
    pub fn new(cluster: bool, faults: Vec<Fault>, duration: Duration) -> Scenario {
        let timing = Timing::default();
        Scenario {
            cluster,
            workload: Workload {
                targets: hot_locks(),
                clients_per_endpoint: 4,
                hold: Duration::from_millis(30),
                long_hold: timing.watchdog,
                long_clients_per_endpoint: 1,
                wait: Duration::from_secs(10),
                keepalive: timing.keepalive,
            },
            faults,
            duration,
            bounds: Bounds {
                handoff: Duration::from_secs(1),
                // A dead replica's lock lives out its lease; a fair queue waits out a
                // dead replica's waiter; a failover takes the node timeout.
                fault_handoff: Duration::from_secs(10),
                // A renewal round finds a hold Redis lost (a third of the lease), plus
                // the Redis timeout of a call out when the fault struck, with room.
                lost_grace: timing.watchdog + timing.redis_timeout,
            },
            timing,
        }
    }
}

/// The hot locks: a mutex, a fair lock, a read/write lock (readers and writers) and a
/// semaphore of 2 permits.
pub fn hot_locks() -> Vec<Target> {
    vec![
        Target::new("hot/mutex", LockKind::Mutex, 0),
        Target::new("hot/fair", LockKind::Fair, 0),
        Target::new("hot/rw", LockKind::Read, 0),
        Target::new("hot/rw", LockKind::Read, 0),
        Target::new("hot/rw", LockKind::Write, 0),
        Target::new("hot/sem", LockKind::Semaphore, 2),
    ]
}

/// Runs `scenario` on a fresh rig and returns the verdict, with the fault windows.
pub async fn run(scenario: &Scenario) -> (Report, Vec<Window>) {
    let mut rig = Rig::start(scenario.cluster, scenario.timing, &[]).await;
    let (report, windows) = run_on(&mut rig, scenario).await;
    (report, windows)
}

/// Runs `scenario` on `rig`.
pub async fn run_on(rig: &mut Rig, scenario: &Scenario) -> (Report, Vec<Window>) {
    let resource = Resource::connect(&rig.resource.url()).await;
    let history = History::default();
    let stop = CancellationToken::new();
    let mut clients = workload::start(&rig.endpoints(), &scenario.workload, &resource, &history, &stop, 0);
    let started = tokio::time::Instant::now();
    let slice = scenario.duration / (scenario.faults.len() as u32 + 1);
    let settle = scenario.timing.watchdog + scenario.timing.fair_wait + Duration::from_secs(1);
    let mut windows = Vec::new();
    let names: Vec<String> = scenario.workload.targets.iter().map(|t| t.name.clone()).collect();
    for (i, fault) in scenario.faults.iter().enumerate() {
        tokio::time::sleep_until(started + slice * (i as u32 + 1)).await;
        let hot = &scenario.workload.targets[i % scenario.workload.targets.len()].name;
        let locks = rig.reach(*fault, hot, &names);
        let start = now_us();
        tracing::info!(%fault, "injecting");
        rig.inject(*fault, hot).await;
        let recovered = now_us();
        windows.push(Window {
            fault: fault.to_string(),
            start,
            recovered,
            end: recovered + micros(settle),
            locks,
        });
    }
    // However long the faults took, the clients run on past the last settling, so
    // the run shows the service recovered.
    let after_faults = tokio::time::Instant::now() + settle * 2;
    tokio::time::sleep_until((started + scenario.duration).max(after_faults)).await;
    stop.cancel();
    let limit = scenario.workload.wait + Duration::from_secs(20);
    // A client that panicked left its attempt unrecorded: the history would be short
    // of a hold the checks cannot see.
    let joined = tokio::time::timeout(limit, async {
        while let Some(client) = clients.join_next().await {
            client.expect("a client task panicked");
        }
    })
    .await;
    assert!(joined.is_ok(), "clients did not finish within {limit:?}");
    let attempts = history.snapshot();
    let mut report = verify(
        &attempts,
        &registers(&resource, &scenario.workload).await,
        &windows,
        scenario.bounds,
    );
    let recovery = verify::check_recovered(&report, &windows);
    report.violations.extend(recovery);
    let linger = scenario.timing.watchdog + Duration::from_secs(5);
    report
        .violations
        .extend(leftovers::wait_clean(&rig.redis, linger).await);
    (report, windows)
}

async fn registers(resource: &Resource, workload: &Workload) -> BTreeMap<String, Register> {
    let mut registers = BTreeMap::new();
    for t in &workload.targets {
        let register = resource.register(&t.name).await.expect("read a register");
        registers.insert(t.name.clone(), register);
    }
    registers
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
