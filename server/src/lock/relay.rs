//! The relay: a hot mutex or fair lock passed between this server's own waiters in
//! memory, with Redis recording the passes behind it.
//!
//! A handoff (`handoff.rs`) writes every grant to Redis before the waiter hears of it:
//! a release, a script, then the grant, and a hot lock changes hands no faster than
//! that chain. Once a handoff found that this server alone listens for a mutex (or
//! that every waiter in a fair lock's queue is its own), the lock goes on from holder
//! to waiter here, in line order, at the speed of the gRPC hop, while a
//! recorder writes the passes to Redis one script at a time (`handoff.lua` with the
//! token it was told). Passes made while a recording is in flight, or within 2 ms of
//! the last, are recorded together: the next script passes the lock from the last
//! recorded holder to the current one.
//!
//! What keeps it safe:
//! - The lock is never free in Redis during a run: Redis holds it for a hold of this
//!   server's chain (at most one recording behind the holder), so no other server or
//!   Redisson client takes it.
//! - Tokens handed in memory were reserved in Redis first (the counter raised past
//!   them by a script that found the chain's hold live): any later grant elsewhere, and
//!   ForceRelease's break floor, answers a larger one.
//! - A recording that fails (the recorded hold was gone: its lease ran out or
//!   ForceRelease broke it; or Redis did not answer) ends the run: the holder told in
//!   memory hears that its lease is lost at once, and whatever the script may have
//!   granted is given back.
//! - Passes stop while a recording has gone unanswered for 10 ms: a Redis that restarts
//!   or is cut off stops them, and the holder hears that its lease is lost once the
//!   recording fails, as a holder does whose lock Redis lost.
//! - Passing stops once a recording finds, for a mutex, another listener (a server, a
//!   Redisson client), a fair waiter queued, or the lock passed on for 2 s (bounded
//!   passing); for a fair lock, a waiter of anyone else in its queue. The next release
//!   then goes through Redis as a handoff does.
//! - A fair waiter is passed the lock only once its try queued it, and not while a try
//!   of it runs: the recording takes it from the queue, and a later try would queue it
//!   again.
//! - Only holds that no other stream can reenter (the stream's own owner) with a
//!   stream-scoped lease are passed, and never to a waiter in doubt. A waiter's claim
//!   (`handoff.rs`) is forgotten by the next recording; no release elsewhere can grant
//!   it meanwhile, the lock never being free.

use super::handoff::Outcome;
use super::{Grant, Kind, Locks, Request};
use crate::sparse::Sparse;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How many tokens a recording reserves past the one it records: the passes that may
/// run ahead of Redis.
pub(super) const RESERVE: u64 = 256;

/// How long after a recording the passes made since wait for the next: one script then
/// records them all. A hot lock changes hands every 100–300 µs here; one recording per
/// pass would cost Redis a script per grant, as a handoff does.
const PACE: Duration = Duration::from_millis(2);

/// How long a recording may go unanswered before passes in memory stop. A Redis that
/// stops answering (restarting, cut off) thereby stops the passes within this much;
/// the holder then waits for the recording, and hears it failed.
const AHEAD: Duration = Duration::from_millis(10);

/// The runs of passes in memory, by lock key.
#[derive(Debug, Default)]
pub struct Relay {
    runs: Mutex<HashMap<String, Run>>,
}

/// One lock passed in memory.
#[derive(Debug)]
struct Run {
    /// The hold Redis records as holding the lock (as of the last answer).
    recorded: Arc<Request>,
    /// The hold that has the lock now.
    holder: Arc<Request>,
    /// The holder's token.
    token: u64,
    /// The holders passed the lock since the last recording: a mutex's claims are
    /// forgotten, a fair lock's waiters leave its queue.
    passed: Vec<Arc<Request>>,
    /// The highest token reserved in Redis.
    reserved: u64,
    /// The last recording allowed more passes.
    more: bool,
    /// When the recording in flight was sent, if one is.
    sent: Option<Instant>,
    /// A recorder runs.
    recording: bool,
    /// Cancelled when a recording failed: the holders told in memory lost their lease.
    broken: CancellationToken,
    /// Told when the recorder stops.
    idle: Arc<Notify>,
    /// Ends the recorder's pause: the holder is releasing, and waits for the record.
    hurry: Arc<Notify>,
}

impl Run {
    /// The recorder's pause before it records the passes made since its last
    /// recording, or none when there are none, or when the reserved tokens run low.
    fn paced(&self) -> Option<impl Future<Output = ()> + use<>> {
        if self.recorded.hold_id == self.holder.hold_id || self.token + RESERVE / 2 >= self.reserved {
            return None;
        }
        let (hurry, broken) = (self.hurry.clone(), self.broken.clone());
        Some(async move {
            tokio::select! {
                _ = tokio::time::sleep(PACE) => {}
                _ = hurry.notified() => {}
                _ = broken.cancelled() => {}
            }
        })
    }
}

impl Relay {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Run>> {
        // Every change is a single insert, removal or field update.
        self.runs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether a lock may be passed in memory to `req`'s stream, or from it: a single mutex
/// or fair lock that no other stream can reenter, whose lease is the stream's, not in
/// doubt.
pub(super) fn relays(req: &Request) -> bool {
    matches!(req.kind, Kind::Mutex | Kind::Fair) && req.own_owner && req.fixed_lease.is_none() && !req.is_doubted()
}

/// Whether a waiter may be passed the lock in memory now: a fair waiter only once its
/// place in the queue is known, and not while a try of it runs (a try after the pass
/// was recorded would queue it again).
fn passes_to(req: &Request) -> bool {
    relays(req) && (req.kind != Kind::Fair || req.is_queued_idle())
}

impl Locks {
    /// A handoff granted `next` in Redis with tokens up to `reserved` set aside: passes
    /// in memory start from it, while `more` (this server alone listens).
    pub(super) fn start_run(&self, next: &Arc<Request>, token: u64, more: bool, reserved: u64) {
        if !more || reserved <= token || !relays(next) {
            return;
        }
        let run = Run {
            recorded: next.clone(),
            holder: next.clone(),
            token,
            passed: Vec::new(),
            reserved,
            more: true,
            sent: None,
            recording: false,
            broken: CancellationToken::new(),
            idle: Arc::default(),
            hurry: Arc::default(),
        };
        // A run that broke and whose holder has not released yet is replaced.
        tracing::debug!(lock = next.name(), holder = %next.hold_id, token, reserved, "passing in memory starts");
        self.relay.lock().insert(next.keys.lock.clone(), run);
    }

    /// For a release of `req`: when it holds its lock in a run that may go on, passes
    /// the lock to the next waiter in line here, in memory, and returns true.
    pub(super) fn pass_in_memory(&self, req: &Request) -> bool {
        let mut runs = self.relay.lock();
        let Some(run) = runs.get_mut(&req.keys.lock) else {
            return false;
        };
        let ahead = run.sent.is_none_or(|sent| sent.elapsed() < AHEAD) && run.token < run.reserved;
        if run.holder.hold_id != req.hold_id || !run.more || !ahead || run.broken.is_cancelled() {
            return false;
        }
        let Some(entry) = self.lines.reserve_if(&req.keys.lock, &req.hold_id, passes_to) else {
            return false;
        };
        run.token += 1;
        run.holder = entry.req.clone();
        run.passed.push(entry.req.clone());
        let token = run.token;
        let _ = entry.req.unconfirmed.set((token, run.broken.clone()));
        tracing::debug!(lock = req.name(), from = %req.hold_id, to = %entry.req.hold_id, token, "passed in memory");
        let start = !std::mem::replace(&mut run.recording, true);
        drop(runs);
        crate::metrics::handed_off();
        crate::metrics::passed_in_memory();
        self.lines
            .settle(self, entry, Outcome::Granted(Grant::handed(token), Instant::now()));
        if start {
            self.background.spawn(self.clone().record(req.keys.lock.clone()));
        }
        true
    }

    /// `req` lost its lease: the lock it held in a run is passed on through Redis, if
    /// at all, so that no waiter is told of a grant that cannot be recorded.
    pub fn break_run(&self, req: &Request) {
        if let Some(run) = self.relay.lock().get(&req.keys.lock) {
            if run.holder.hold_id == req.hold_id {
                run.broken.cancel();
            }
        }
    }

    /// Before any other release of `req`: when it holds its lock in a run, ends the run
    /// once Redis records `req` as the holder, so the release that follows finds its
    /// hold there. Returns true when the run broke instead: Redis may not hold the lock
    /// for `req`, and its release hands nothing over; the hold Redis last recorded is
    /// given back in the background.
    pub(super) async fn end_run(&self, req: &Request) -> bool {
        loop {
            let idle = {
                let mut runs = self.relay.lock();
                let Some(run) = runs.get_mut(&req.keys.lock) else {
                    return false;
                };
                if run.holder.hold_id != req.hold_id {
                    return false;
                }
                if !run.recording {
                    let broken = run.broken.is_cancelled();
                    let recorded = run.recorded.clone();
                    runs.remove(&req.keys.lock);
                    runs.shrink_if_sparse();
                    drop(runs);
                    if broken && recorded.hold_id != req.hold_id {
                        // Redis may still hold the lock for an earlier hold of the run.
                        self.release_later(recorded, false);
                    }
                    return broken;
                }
                run.hurry.notify_one();
                let idle = run.idle.clone();
                idle.notified_owned()
            };
            idle.await;
        }
    }

    /// What a recording tells Redis of the holders passed the lock since the last one:
    /// a mutex's claims, a fair lock's owner ids.
    fn passed_args(&self, passed: &[Arc<Request>]) -> Vec<String> {
        passed
            .iter()
            .filter_map(|r| match r.kind {
                Kind::Fair => Some(r.owner.clone()),
                _ => r.is_claimed().then(|| r.claim(self.lease_of(r))),
            })
            .collect()
    }

    /// Records the passes of the run on `lock`, one script at a time, until Redis holds
    /// it for the current holder or a recording fails.
    async fn record(self, lock: String) {
        loop {
            let (from, to, token, passed) = {
                let mut runs = self.relay.lock();
                let Some(run) = runs.get_mut(&lock) else {
                    return;
                };
                if run.recorded.hold_id == run.holder.hold_id || run.broken.is_cancelled() {
                    run.recording = false;
                    run.idle.notify_waiters();
                    return;
                }
                let passed = std::mem::take(&mut run.passed);
                run.sent = Some(Instant::now());
                (run.recorded.clone(), run.holder.clone(), run.token, passed)
            };
            let reply = self
                .handoff_script(&from, &to, Some((token, self.passed_args(&passed))))
                .await;
            let pace = {
                let mut runs = self.relay.lock();
                let Some(run) = runs.get_mut(&lock) else {
                    return;
                };
                match reply {
                    Ok([1, granted, more, reserved]) if granted == token as i64 => {
                        run.recorded = to;
                        run.sent = None;
                        run.more = more == 1;
                        run.reserved = run.reserved.max(reserved as u64);
                        run.paced()
                    }
                    failed => {
                        tracing::info!(lock = to.name(), reply = ?failed, "a pass in memory could not be recorded; its holder's lease is lost");
                        run.broken.cancel();
                        run.recording = false;
                        run.idle.notify_waiters();
                        drop(runs);
                        if failed.is_err() {
                            // The script may have run: give back both holds it may have left.
                            self.release_later(to, true);
                            self.release_later(from, true);
                        }
                        // Fair holders passed the lock in memory leave the queue.
                        for req in passed.into_iter().filter(|r| r.kind == Kind::Fair) {
                            self.leave_later(req);
                        }
                        return;
                    }
                }
            };
            if let Some(pace) = pace {
                pace.await;
            }
        }
    }
}
