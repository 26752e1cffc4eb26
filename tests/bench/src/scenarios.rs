//! The scenarios: C tasks loop acquire → hold → release for a fixed time after a
//! warm-up, on their own names (`uncontended`) or all on one name (`hot`), recording
//! latencies, handoffs, per-task grants and any overlap of two holders.

use crate::peers::Peer;
use hdrhistogram::Histogram;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the tasks have, once the measured window ends, to finish their cycle: a
/// line of waiters drains in far less unless one of them was stranded.
const DRAIN: Duration = Duration::from_secs(30);

/// What one run measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Acquire → release cycles per second in the measured window.
    pub cycles_per_sec: f64,
    /// Acquire latency (µs), from asking to holding.
    pub acquire: Histogram<u64>,
    /// Release latency (µs).
    pub release: Histogram<u64>,
    /// Hot lock: from one task's release to another task's grant (µs).
    pub handoff: Histogram<u64>,
    /// Grants per task.
    pub grants: Vec<u64>,
    /// Moments two tasks held the same name at once.
    pub overlaps: u32,
    /// Failed acquires or releases, and tasks still waiting long after the run ended.
    pub errors: u64,
    /// The longest wait of any acquire (µs), warm-up and the end's drain included, and
    /// of a task still waiting when the drain's bound ran out: what the window's
    /// figures leave out of a stall that crosses its edges.
    pub longest_wait_us: u64,
    /// CPU time per measured cycle (µs), summed over the processes of the deployment
    /// (Redis, etcd, the latchkey servers, the floor and the bench itself): what a
    /// cycle costs the machine, whoever spends it.
    pub cpu_us_per_cycle: f64,
    /// The part of it the gRPC servers spent (latchkey's and the floor).
    pub server_us_per_cycle: f64,
    /// The part of it the store spent (Redis, or etcd): what bounds a fleet of servers
    /// sharing one store.
    pub store_us_per_cycle: f64,
}

impl Default for Outcome {
    /// No cycles yet; the CPU figures unknown.
    fn default() -> Self {
        Self {
            cycles_per_sec: 0.0,
            acquire: histogram(),
            release: histogram(),
            handoff: histogram(),
            grants: Vec::new(),
            overlaps: 0,
            errors: 0,
            longest_wait_us: 0,
            cpu_us_per_cycle: f64::NAN,
            server_us_per_cycle: f64::NAN,
            store_us_per_cycle: f64::NAN,
        }
    }
}

/// The processes a run is charged: all of the deployment, and the gRPC servers and the
/// store among them.
#[derive(Debug, Clone, Default)]
pub struct Charged {
    /// Every process of the deployment.
    pub all: Vec<u32>,
    /// The gRPC servers (latchkey's and the floor).
    pub servers: Vec<u32>,
    /// The store's processes (Redis, etcd).
    pub store: Vec<u32>,
}

/// How the tasks use names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Each task its own name.
    Uncontended,
    /// Every task on one name.
    Hot,
}

/// Runs `tasks` tasks, task i through `peers[i % peers.len()]`, holding `hold`, for
/// `warmup` then `measure`; `charged` are the processes whose CPU time the run is charged.
pub async fn run(
    peers: &[Peer],
    tasks: usize,
    shape: Shape,
    (hold, warmup, measure): (Duration, Duration, Duration),
    charged: &Charged,
) -> Outcome {
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let start = Instant::now();
    let from = start + warmup;
    let until = from + measure;
    let shared = Arc::new(Shared::default());
    let cpu = tokio::spawn(cpu_between(charged.clone(), from, until));
    let mut handles = Vec::new();
    for i in 0..tasks {
        let peer = peers[i % peers.len()].clone();
        let name = match shape {
            Shape::Uncontended => format!("bench:{run_id}:{i}"),
            Shape::Hot => format!("bench:{run_id}:hot"),
        };
        let shared = shared.clone();
        let plan = Plan {
            hot: shape == Shape::Hot,
            hold,
            from,
            until,
        };
        handles.push(tokio::spawn(async move { task(peer, name, i, plan, shared).await }));
    }
    let mut outcome = Outcome::default();
    // The line drains once the window ends; a task still waiting long after is stranded.
    let drained = until + DRAIN;
    for mut handle in handles {
        let t = match tokio::time::timeout_at(drained.into(), &mut handle).await {
            Ok(Ok(t)) => t,
            // A task that failed or was stranded counts among the tasks, with no grant:
            // a fairness of `inf`, not a population without it.
            Ok(Err(_)) => {
                outcome.errors += 1;
                outcome.grants.push(0);
                continue;
            }
            Err(_) => {
                handle.abort();
                outcome.errors += 1;
                outcome.grants.push(0);
                outcome.longest_wait_us = outcome.longest_wait_us.max(micros(drained - from));
                continue;
            }
        };
        outcome.longest_wait_us = outcome.longest_wait_us.max(t.longest_wait_us);
        outcome.acquire.add(&t.acquire).ok();
        outcome.release.add(&t.release).ok();
        outcome.handoff.add(&t.handoff).ok();
        outcome.grants.push(t.grants);
        outcome.errors += t.errors;
    }
    outcome.overlaps = shared.overlaps.load(Ordering::SeqCst);
    let cycles = outcome.grants.iter().sum::<u64>();
    outcome.cycles_per_sec = cycles as f64 / measure.as_secs_f64();
    if let Ok([all_us, server_us, store_us]) = cpu.await {
        let per_cycle = |us: u64| us as f64 / cycles.max(1) as f64;
        outcome.cpu_us_per_cycle = per_cycle(all_us);
        outcome.server_us_per_cycle = per_cycle(server_us);
        outcome.store_us_per_cycle = per_cycle(store_us);
    }
    outcome
}

/// CPU time (µs) all `charged` processes, the servers and the store spent between
/// `from` and `until`.
async fn cpu_between(charged: Charged, from: Instant, until: Instant) -> [u64; 3] {
    let groups = [charged.all, charged.servers, charged.store];
    tokio::time::sleep_until(from.into()).await;
    let before = groups.each_ref().map(|pids| cpu_micros(pids));
    tokio::time::sleep_until(until.into()).await;
    let after = groups.each_ref().map(|pids| cpu_micros(pids));
    std::array::from_fn(|i| after[i].saturating_sub(before[i]))
}

/// CPU time (user and system, µs) the processes `pids` have spent so far.
pub fn cpu_micros(pids: &[u32]) -> u64 {
    // /proc counts in clock ticks of USER_HZ, 100 a second on Linux.
    const MICROS_PER_TICK: u64 = 10_000;
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            // The fields after the command name (which may hold spaces): the state
            // first, utime 12th, stime 13th.
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
        })
        .sum::<u64>()
        * MICROS_PER_TICK
}

#[derive(Default)]
struct Shared {
    inside: AtomicU32,
    overlaps: AtomicU32,
    /// The last release: when, and by which task.
    last_release: Mutex<Option<(Instant, usize)>>,
}

struct TaskStats {
    acquire: Histogram<u64>,
    release: Histogram<u64>,
    handoff: Histogram<u64>,
    grants: u64,
    errors: u64,
    longest_wait_us: u64,
}

/// What every task of a run shares: the name shape, the hold, the measured window.
#[derive(Clone, Copy)]
struct Plan {
    hot: bool,
    hold: Duration,
    from: Instant,
    until: Instant,
}

async fn task(peer: Peer, name: String, me: usize, plan: Plan, shared: Arc<Shared>) -> TaskStats {
    let Plan { hot, hold, from, until } = plan;
    let owner = format!("{}:{me}", uuid::Uuid::new_v4());
    let mut s = TaskStats {
        acquire: histogram(),
        release: histogram(),
        handoff: histogram(),
        grants: 0,
        errors: 0,
        longest_wait_us: 0,
    };
    while Instant::now() < until {
        let asked = Instant::now();
        let held = match peer.acquire(&name, &owner).await {
            Ok(h) => h,
            Err(_) => {
                s.errors += 1;
                continue;
            }
        };
        let granted = Instant::now();
        s.longest_wait_us = s.longest_wait_us.max(micros(granted - asked));
        // Only tasks sharing one name can overlap.
        if hot && shared.inside.fetch_add(1, Ordering::SeqCst) != 0 {
            shared.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        // A wait that ends in the window or after it (the drain lets it) counts,
        // whenever it was asked: a waiter starved from the warm-up on, whose wait runs
        // through the window, holds the longest wait of all (it was left out, and a
        // starving peer's tail read short). A grant counts in the window, whenever it
        // was asked (the cycle under way at the window's start included: the rate
        // divides by the whole window).
        if granted >= from {
            s.acquire.record(micros(granted - asked)).ok();
        }
        let measured = granted >= from && granted < until;
        if measured {
            // Only a shared name hands off; the other tasks leave the shared record alone.
            let last = hot.then(|| *shared.last_release.lock().unwrap_or_else(|e| e.into_inner()));
            if let Some(Some((at, by))) = last {
                if by != me && at >= asked.max(from) {
                    s.handoff.record(micros(granted - at)).ok();
                }
            }
        }
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
        if hot {
            shared.inside.fetch_sub(1, Ordering::SeqCst);
        }
        let releasing = Instant::now();
        if hot {
            *shared.last_release.lock().unwrap_or_else(|e| e.into_inner()) = Some((releasing, me));
        }
        // A cycle whose release failed is an error, not a cycle.
        let released = peer.release(held).await.is_ok();
        if !released {
            s.errors += 1;
        }
        if measured && released {
            s.release.record(micros(releasing.elapsed())).ok();
            s.grants += 1;
        }
    }
    peer.end(&owner).await;
    s
}

/// An empty latency histogram (µs, from 1 µs to 10 minutes, three significant digits).
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds")
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}
