//! The relay: a hot mutex or fair lock passed between this server's own waiters in
//! memory, with Redis recording the passes behind it.
//!
//! A handoff (`handoff.rs`) writes every grant to Redis before the waiter hears of it:
//! a release, a script, then the grant, and a hot lock changes hands no faster than
//! that chain. Once a handoff found that this server alone listens for a mutex or is in
//! its turn (lib.lua's `turn_left`: a claim of its was granted within 2 ms, and every
//! other listener is a server with a claim; the passes then stop when the turn ends),
//! or that every waiter in a fair lock's queue is its own, the lock goes on from holder
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
//!   granted is given back (a hold record of the pass's token: a waiter's own try may
//!   have taken the lock the broken hold let go, and that grant stays).
//! - Passes stop while a recording has gone unanswered for 10 ms: a Redis that restarts
//!   or is cut off stops them, and the holder hears that its lease is lost once the
//!   recording fails, as a holder does whose lock Redis lost.
//! - Passing stops once a recording finds, for a mutex, another listener (a server, a
//!   Redisson client) outside this server's turn, a fair waiter queued, or the lock
//!   passed on for 2 s (bounded passing); for a fair lock, a waiter of anyone else in
//!   its queue; and at the end of this server's turn, which Redis's answer tells. The
//!   next release then goes through Redis as a handoff does. It does too once Redis's
//!   last answer is older than [`FRESH`] (less under a short watchdog timeout: the
//!   holder passed the lock counts its lease from the pass, Redis from that answer's
//!   call): what Redis last said is stale by then; and
//!   for a mutex while this server's subscription to its channel is not in place (a
//!   reconnect): the one listener Redis counts may then be another server's.
//! - A fair waiter is passed the lock only once it is queued (by its try, or by the
//!   next recording), and not while a try of it runs: the recording takes it from the
//!   queue, and a later try would queue it again.
//! - Only holds that no other stream can reenter (the stream's own owner) with a
//!   stream-scoped lease are passed, and never to a waiter in doubt. A waiter's claim
//!   (`handoff.rs`) is forgotten by the next recording; no release elsewhere can grant
//!   it meanwhile, the lock never being free.
//!
//! A fair waiter that lines up behind the chain does not try: the next recording queues
//! it in Redisson's queue, behind the waiters there, unless the lock was passed to it
//! first. It tries for itself should the run end first, or should no recording have
//! queued it within [`JOIN_WAIT`] (a holder that holds for long passes nothing): a
//! waiter of another client that queues meanwhile is ahead of it, as it would be of a
//! waiter whose try was that much later. Once queued by a recording, its first try is
//! the refresh of its place, a third of `--fair-wait-timeout` later.

use super::handoff::{Entry, Outcome};
use super::{Grant, Kind, Locks, Request, Unrecorded};
use crate::sparse::Sparse;
use fred::prelude::Value;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{watch, Notify};
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

/// How long what Redis last said of a run (this server's waiters alone listening or
/// queued; in a turn, no longer than the turn) is taken as standing, with no
/// recording on its way: after a longer hold a waiter of another client may have come,
/// and the next release asks Redis. Long enough that a busy machine's scheduling does
/// not stop a hot chain.
const FRESH: Duration = Duration::from_millis(100);

/// How long a fair waiter that lined up behind the chain waits for a recording to queue
/// it before it tries for itself (which queues it, or refreshes its place). A hot
/// lock's waiters are passed the lock well within it; one that a recording queued
/// waits longer ([`Locks::refresh_wait`]).
pub const JOIN_WAIT: Duration = Duration::from_millis(50);

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
    /// What the last answer said of more passes: a turn's ([`More::For`]) counts from
    /// `answered`.
    more: More,
    /// When the call Redis last answered for the run (its handoff, then each
    /// recording) was sent: `more` says how things stood then, and Redis extended the
    /// chain's hold no earlier.
    answered: Instant,
    /// When the recording in flight was sent, if one is.
    sent: Option<Instant>,
    /// A recorder runs.
    recording: bool,
    /// Broken off when a recording failed: the holders told in memory lost their lease.
    unrecorded: Unrecorded,
    /// Fair waiters that lined up behind the chain without a try (`join_in_memory`):
    /// the next recording queues them in Redis.
    joining: Vec<Arc<Request>>,
    /// Those the recording in flight queues.
    sending: Vec<Arc<Request>>,
    /// Those of `sending` whose stream ended meanwhile: they leave the queue once the
    /// recording answered.
    left: Vec<Arc<Request>>,
    /// Cancelled when the run ends, breaks, or stops (its holder lost its lease,
    /// `break_run`): no more passes (the recorder still records those made, unless it
    /// broke), and a waiter that joined in memory tries for itself, which queues it if
    /// no recording did.
    ended: CancellationToken,
    /// Told when the recorder stops.
    idle: Arc<Notify>,
    /// Ends the recorder's pause: the holder is releasing, and waits for the record.
    hurry: Arc<Notify>,
    /// The token of the latest hold Redis recorded: the holders before it held the lock
    /// in Redis all their turn.
    recorded_token: watch::Sender<u64>,
}

/// What a holder that passed its lock on in memory waits for before it is told
/// `released`: the next recording. Its release came before Redis had its say: had the
/// chain's hold been broken (ForceRelease, a Redis that lost the lock), another client
/// may have held the lock during its turn, and it must hear `lost` as a release through
/// Redis would.
pub(super) struct Confirmation {
    recorded: watch::Receiver<u64>,
    broken: CancellationToken,
    /// The holder's token: a recording of a later one covers its turn.
    token: u64,
}

impl Confirmation {
    /// True once a recording of a later holder succeeded, false when the run broke
    /// first. Past a bound (a recorder that never answers: each of its calls fails
    /// within the Redis timeout, `redis_timeout`, and a recording may take four: the
    /// one before it, then its script reloaded after a restart, EVALSHA, SCRIPT LOAD,
    /// EVALSHA), or should the run end with neither, true, as before the recording.
    pub(super) async fn held(mut self, redis_timeout: Duration) -> bool {
        let bound = redis_timeout.saturating_mul(4).saturating_add(PACE + AHEAD);
        let token = self.token;
        let covered = self.recorded.wait_for(|recorded| *recorded > token);
        let broken = self.broken.clone();
        tokio::select! {
            biased;
            covered = covered => covered.is_ok() || !broken.is_cancelled(),
            // Polled after the recordings: a later recording that broke the run came
            // after one that covered this holder, if there was one.
            _ = broken.cancelled() => false,
            _ = tokio::time::sleep(bound) => true,
        }
    }
}

/// What a handoff's answer says of passes in memory to come (`more` in handoff.lua's
/// reply).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum More {
    /// None may follow.
    No,
    /// Passes may go on (this server alone listens for the mutex, or every waiter of
    /// the fair lock is its own), while Redis's answers stay fresh.
    Yes,
    /// As [`More::Yes`], for this long from when the call was sent: what was left of
    /// this server's turn.
    For(Duration),
}

impl More {
    /// The reply's `more`: 0 none, 1 yes, 1 + the ms a turn has left.
    pub(super) fn of(reply: i64) -> More {
        match reply {
            ..=0 => More::No,
            1 => More::Yes,
            ms => More::For(Duration::from_millis(ms.unsigned_abs() - 1)),
        }
    }
}

impl Run {
    /// Whether the run may go on passing by what Redis last said: a recording on its
    /// way, sent within [`AHEAD`], will say more; and Redis's last answer must be
    /// `within` old at most ([`Locks::pass_within`]).
    fn heard_of_late(&self, within: Duration) -> bool {
        // A turn's end stops the passes, whatever else Redis said last.
        if let More::For(left) = self.more {
            if self.answered.elapsed() >= left {
                return false;
            }
        }
        self.answered.elapsed() < within && self.sent.is_none_or(|sent| sent.elapsed() < AHEAD)
    }

    /// The recorder's pause before it records the passes made since its last
    /// recording, or none when there are none, or when the reserved tokens run low.
    fn paced(&self) -> Option<impl Future<Output = ()> + use<>> {
        if self.recorded.hold_id == self.holder.hold_id || self.token + RESERVE / 2 >= self.reserved {
            return None;
        }
        let (hurry, broken) = (self.hurry.clone(), self.unrecorded.broken.clone());
        Some(async move {
            tokio::select! {
                _ = tokio::time::sleep(PACE) => {}
                _ = hurry.notified() => {}
                _ = broken.cancelled() => {}
            }
        })
    }
}

/// What a recording tells Redis besides the token it records.
pub(super) struct Recording {
    /// The token the holder was told.
    pub(super) token: u64,
    /// The holders passed the lock since the last recording: a mutex's claims, a fair
    /// lock's owner ids.
    passed: Vec<String>,
    /// The owner ids of the fair waiters to queue, in line order.
    joins: Vec<String>,
}

impl Recording {
    /// The script's arguments after the fair stay and the releasing stream's claim
    /// (`handoff.lua`'s ARGV[11..]).
    pub(super) fn args(self) -> impl Iterator<Item = Value> {
        std::iter::once(Value::from(self.passed.len() as i64))
            .chain(self.passed.into_iter().chain(self.joins).map(Value::from))
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
    relayable(req) && !req.is_doubted()
}

/// Passes in memory lost to a Redis error, written to the log: at most one line in 10 s,
/// since a Redis outage fails every hot lock's recording at once.
static UNRECORDED: crate::repeated::Repeated = crate::repeated::Repeated::new();
/// Passes in memory Redis answered with no recording of theirs (a chain a ForceRelease
/// broke, or one taken over), written to the log as sparingly, apart: the faults above
/// are never left out for these.
static NOT_RECORDED: crate::repeated::Repeated = crate::repeated::Repeated::new();

/// Logs a pass in memory to the holder of `lock` that Redis did not record: an error (a
/// fault, a warning), or a reply that is no recording of this pass. Its holder's lease
/// is lost either way.
fn unrecorded_pass<T: std::fmt::Debug>(lock: &str, reply: &Result<T, crate::error::Error>) {
    match reply {
        Err(e) => {
            if let Some(left_out) = UNRECORDED.due() {
                tracing::warn!(lock, error = %e, left_out, "a pass in memory could not be recorded; its holder's lease is lost")
            }
        }
        Ok(reply) => {
            if let Some(left_out) = NOT_RECORDED.due() {
                tracing::info!(
                    lock,
                    ?reply,
                    left_out,
                    "a pass in memory was not recorded by Redis; its holder's lease is lost"
                )
            }
        }
    }
}

/// What [`relays`] asks of the request itself, which never changes: a single mutex or
/// fair lock of the stream's own owner, on the stream's lease.
fn relayable(req: &Request) -> bool {
    matches!(req.kind, Kind::Mutex | Kind::Fair) && req.own_owner && req.fixed_lease.is_none()
}

/// Whether a waiter may be passed the lock in memory now: a fair waiter only once its
/// place in the queue is known, and not while a try of it runs (a try after the pass
/// was recorded would queue it again).
fn passes_to(req: &Request) -> bool {
    relays(req) && (req.kind != Kind::Fair || req.is_queued_idle())
}

impl Locks {
    /// A handoff asked at `asked` granted `next` in Redis with tokens up to `reserved`
    /// set aside: passes in memory start from it, as `more` allows (this server alone
    /// listens, or for what is left of its turn). Not when `next` took the grant by a
    /// try of its own before this answer came: it holds the lock as any holder does and
    /// may have passed it on since, so a
    /// run from its grant would be stale, and would replace the run of a later grant.
    /// (Should the try's answer come just after, with a grant of its own, the run is
    /// dropped then: `holds_grant`.) Returns true when the answer came after a run of
    /// a later grant started here (tokens only grow): Redis let this grant go before
    /// (a ForceRelease whose notice is on its way), and `next` is to look for itself
    /// rather than be told it; that run goes on.
    pub(super) fn start_run(&self, entry: &Entry, token: u64, more: More, reserved: u64, asked: Instant) -> bool {
        let next = &entry.req;
        // The entry's state is read under the runs' lock: the waiter's release, should
        // it take the grant now, passes the lock on from this run.
        let mut runs = self.relay.lock();
        if runs.get(&next.keys.lock).is_some_and(|run| run.token > token) {
            return true;
        }
        if more == More::No || reserved <= token || !relays(next) || !entry.is_reserved() {
            return false;
        }
        let unrecorded = Unrecorded::default();
        let run = Run {
            recorded: next.clone(),
            holder: next.clone(),
            token,
            passed: Vec::new(),
            reserved,
            more,
            answered: asked,
            sent: None,
            recording: false,
            ended: unrecorded.broken.child_token(),
            unrecorded,
            joining: Vec::new(),
            sending: Vec::new(),
            left: Vec::new(),
            idle: Arc::default(),
            hurry: Arc::default(),
            recorded_token: watch::Sender::new(token),
        };
        tracing::debug!(lock = next.name(), holder = %next.hold_id, token, reserved, "passing in memory starts");
        // A run that broke and whose holder has not released yet is replaced.
        let replaced = runs.insert(next.keys.lock.clone(), run);
        drop(runs);
        if let Some(old) = replaced {
            // Redis granted the lock past the old run: whoever it passed the lock to and
            // did not record holds nothing there, and is told its lease is lost.
            old.unrecorded.break_off(false);
            self.leave_behind(old);
        }
        false
    }

    /// For a candidate that left before its handoff's grant reached it: the run that
    /// grant started is dropped, so its give-back goes through Redis, which checks the
    /// hold record, and is never passed on in memory from a hold another give-back of
    /// the stream may have freed already.
    pub(super) fn forget_run(&self, req: &Request) {
        let run = {
            let mut runs = self.relay.lock();
            match runs.get(&req.keys.lock) {
                Some(run) if run.holder.hold_id == req.hold_id => runs.remove(&req.keys.lock),
                _ => None,
            }
        };
        if let Some(run) = run {
            self.leave_behind(run);
        }
    }

    /// `req` is told a grant of `token`. Returns what tells it that its pass in memory
    /// was not recorded, when the grant is that pass. Otherwise it holds a grant of its
    /// own try (or claim), and a run it heads may be stale:
    /// - passed the lock in memory, its try's grant came first: Redis let it take the
    ///   lock, so the chain's hold was gone. The run breaks (its holders told in memory
    ///   hold nothing there, and no pass goes on from `req` with tokens below its own),
    ///   and the relay gives back nothing for `req`: its stream releases its own grant.
    /// - handed the lock by a handoff that started a run, its try's grant came after
    ///   that answer: Redis had let the handoff's grant go (ForceRelease broke it, its
    ///   lease ran out) and the try took the lock anew. Passing on from the run would
    ///   hand out the broken grant's tokens (at or below the break floor), and its break
    ///   would tell `req` its own grant was lost: the run is dropped.
    ///
    /// `unconfirmed` is read under the runs' lock, under which a pass sets it: a pass
    /// that reserved `req` as its try answered is seen here.
    pub fn holds_grant(&self, req: &Request, token: u64) -> Option<Unrecorded> {
        // Not `relays`: the stream may have come in doubt since it was passed the lock
        // or its run started.
        if !relayable(req) {
            return None;
        }
        let mut runs = self.relay.lock();
        let passed = req.unconfirmed.get();
        if let Some((_, unrecorded)) = passed.filter(|(told, _)| *told == token) {
            return Some(unrecorded.clone());
        }
        if passed.is_some() {
            req.own_grant.store(true, Ordering::Release);
        }
        let run = runs
            .get(&req.keys.lock)
            .filter(|run| run.holder.hold_id == req.hold_id)?;
        if passed.is_some() {
            tracing::info!(
                lock = req.name(),
                "a waiter passed the lock in memory took it in Redis itself; the run breaks"
            );
            run.unrecorded.break_off(false);
        } else if run.recorded.hold_id == req.hold_id && run.token != token {
            let run = runs.remove(&req.keys.lock);
            drop(runs);
            if let Some(run) = run {
                self.leave_behind(run);
            }
        }
        None
    }

    /// Ends a run taken out of the map. The fair waiters it leaves in Redisson's queue
    /// leave it: those that left while a recording queued them, and the holders it
    /// passed the lock to that no recording took out of the queue (a broken run's),
    /// whose owner ids would otherwise head the queue until their deadlines ran out.
    fn leave_behind(&self, run: Run) {
        run.ended.cancel();
        // A release waiting for this run's recorder (`end_run`) looks again: the
        // recorder of a run replaced or dropped stops without telling.
        run.idle.notify_waiters();
        for req in run.left {
            self.leave_later(req);
        }
        // The holder, told its lease is lost, releases by itself (forgetting its claim).
        self.forget_unrecorded(run.passed, &run.holder.hold_id);
    }

    /// What the holders a run passed the lock to, and no recording took to Redis, left
    /// there as waiters: a fair waiter's place in the queue (it leaves), a mutex
    /// waiter's claim (given back, with whatever the pass may have left it: its own
    /// grant stays). A recording forgets both; past a broken run, a release could grant
    /// such a claim to a stream no longer waiting, the lock then held by nobody for a
    /// lease while that stream lived. The mutex holder `releasing` gives back its own.
    fn forget_unrecorded(&self, passed: Vec<Arc<Request>>, releasing: &str) {
        for req in passed {
            match req.kind {
                Kind::Fair => self.leave_later(req),
                _ if req.is_claimed() && req.hold_id != releasing => self.give_back_passed(req),
                _ => {}
            }
        }
    }

    /// For a fair waiter that lined up behind this server's own waiters of a lock
    /// passed in memory: the next recording queues it in Redis, in place of a try of its
    /// own, and it may be passed the lock meanwhile. Returns what tells it the run ended
    /// (it then tries), or `None` when no run may queue it.
    pub fn join_in_memory(&self, req: &Arc<Request>) -> Option<CancellationToken> {
        if req.kind != Kind::Fair || !relays(req) || req.wait == Some(Duration::ZERO) {
            return None;
        }
        let mut runs = self.relay.lock();
        let run = runs.get_mut(&req.keys.lock)?;
        if run.more == More::No
            || !run.heard_of_late(self.pass_within())
            || run.ended.is_cancelled()
            || run.holder.kind != Kind::Fair
        {
            return None;
        }
        req.queued.store(true, Ordering::Release);
        run.joining.push(req.clone());
        crate::metrics::queued_in_memory();
        Some(run.ended.clone())
    }

    /// How long a fair waiter that joined in memory and was queued by a recording may
    /// still wait before its first try, which refreshes its place in the queue: until a
    /// third of `--fair-wait-timeout` from that recording (its place lasts all of it).
    /// Passes and the run's end reach it meanwhile, without a try and a subscription of
    /// its own. `None` once that try is due, or before a recording queued it.
    pub fn refresh_wait(&self, req: &Request) -> Option<Duration> {
        let queued = req.queued_by_recording.get()?;
        let due = *queued + self.fair_wait / 3;
        Some(due.saturating_duration_since(Instant::now())).filter(|left| !left.is_zero())
    }

    /// For a fair waiter that joined in memory and now tries for itself (the run ended,
    /// no recording queued it within [`JOIN_WAIT`], or the refresh of the place one made
    /// came due): its try queues it, so no recording is to, and when its stream ends it
    /// leaves the queue as any waiter does.
    pub fn tries_for_itself(&self, req: &Request) {
        if let Some(run) = self.relay.lock().get_mut(&req.keys.lock) {
            run.joining.retain(|r| r.hold_id != req.hold_id);
        }
    }

    /// For a fair waiter that leaves: true when the run was to queue it and now will
    /// not, or queues it in the recording in flight (it leaves once that answered).
    pub(super) fn leaves_with_run(&self, req: &Arc<Request>) -> bool {
        let mut runs = self.relay.lock();
        let Some(run) = runs.get_mut(&req.keys.lock) else {
            return false;
        };
        if let Some(i) = run.joining.iter().position(|r| r.hold_id == req.hold_id) {
            run.joining.remove(i);
            return true;
        }
        if run.sending.iter().any(|r| r.hold_id == req.hold_id) {
            run.left.push(req.clone());
            return true;
        }
        false
    }

    /// How old Redis's last answer for a run may be at a pass: [`FRESH`], or less under
    /// a short watchdog timeout (`watchdog::pass_age_limit`). The holder passed the lock
    /// counts its lease from the pass, Redis from that answer's call: the difference
    /// comes off the margin in which the holder hears that its lease is lost (Redis cut
    /// off from this server alone) before Redis may expire the lock.
    fn pass_within(&self) -> Duration {
        FRESH.min(crate::watchdog::pass_age_limit(self.watchdog_lease))
    }

    /// For a release of `req`: when it holds its lock in a run that may go on, passes
    /// the lock to the next waiter in line here, in memory, and returns what confirms
    /// that `req` held it all its turn.
    pub(super) fn pass_in_memory(&self, req: &Request) -> Option<Confirmation> {
        if self.unheard(req) {
            return None;
        }
        let mut runs = self.relay.lock();
        let run = runs.get_mut(&req.keys.lock)?;
        let ahead = run.heard_of_late(self.pass_within()) && run.token < run.reserved;
        if run.holder.hold_id != req.hold_id || run.more == More::No || !ahead || run.ended.is_cancelled() {
            return None;
        }
        let entry = self.lines.reserve_if(&req.keys.lock, &req.hold_id, passes_to)?;
        let confirmation = Confirmation {
            recorded: run.recorded_token.subscribe(),
            broken: run.unrecorded.broken.clone(),
            token: run.token,
        };
        req.passed_on.store(true, Ordering::Release);
        run.token += 1;
        run.holder = entry.req.clone();
        run.passed.push(entry.req.clone());
        let token = run.token;
        let _ = entry.req.unconfirmed.set((token, run.unrecorded.clone()));
        tracing::debug!(lock = req.name(), from = %req.hold_id, to = %entry.req.hold_id, token, "passed in memory");
        let start = (!std::mem::replace(&mut run.recording, true)).then(|| run.idle.clone());
        drop(runs);
        crate::metrics::handed_off();
        crate::metrics::passed_in_memory();
        self.lines
            .settle(self, entry, Outcome::Passed(Grant::handed(token), Instant::now()));
        if let Some(idle) = start {
            self.background.spawn(self.clone().record(req.keys.lock.clone(), idle));
        }
        Some(confirmation)
    }

    /// `req` lost its lease: the lock it held in a run is passed on through Redis, if
    /// at all, so that no waiter is told of a grant that cannot be recorded.
    /// The passes before it are still recorded: a lease lost to a shutdown, or to a
    /// break whose notice came before a recording's answer, says nothing of their turns
    /// (a recording that finds the chain's hold gone fails, and they hear it then).
    pub fn break_run(&self, req: &Request) {
        if let Some(run) = self.relay.lock().get(&req.keys.lock) {
            if run.holder.hold_id == req.hold_id {
                run.ended.cancel();
            }
        }
    }

    /// What a failed or dropped recording may have left `req` in Redis goes back,
    /// unless its stream holds a grant of its own there. Redis decides which it holds
    /// when `req` was passed the lock in memory: `own_grant` is set once its stream
    /// hears its try's answer, which may come after the recording's failure, and a
    /// give-back by that flag alone would free the stream's own grant under it. A
    /// stream that took the pass and passed the lock on (`passed_on`) had no try on its
    /// way (a waiter takes a pass only between its tries, and tries no more): whatever
    /// Redis holds for it goes back, the pass's record or its claim's grant, which a
    /// release may have made once the broken run's hold was given back, with nobody
    /// waiting to take it (the lock was held by nobody for a lease).
    fn give_back_passed(&self, req: Arc<Request>) {
        if req.own_grant.load(Ordering::Acquire) {
            return;
        }
        match req.unconfirmed.get() {
            Some(_) if !req.passed_on.load(Ordering::Acquire) => self.give_back_pass_later(req),
            _ => self.release_later(req, true),
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
                    let broken = run.unrecorded.broken.is_cancelled();
                    let recorded = run.recorded.clone();
                    let run = runs.remove(&req.keys.lock);
                    runs.shrink_if_sparse();
                    drop(runs);
                    if let Some(run) = run {
                        self.leave_behind(run);
                    }
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

    /// Undoes what a recording that failed, or whose run is gone (broken, and replaced
    /// while the recording was on its way), may have left in Redis. The script may have
    /// run (an error), or run before (a call the pool wrote again after a reconnect):
    /// both holds it may have left go back, as nobody holds them now, and what the
    /// holders it was to record left as waiters goes (no later recording names them).
    fn unrecorded(&self, from: Arc<Request>, to: Arc<Request>, passed: Vec<Arc<Request>>) {
        self.forget_unrecorded(passed, &to.hold_id);
        self.give_back_passed(to);
        self.give_back_passed(from);
    }

    /// What a recording of `token` tells Redis of the holders `passed` the lock since
    /// the last one (a mutex's claims, a fair lock's owner ids) and of the waiters it
    /// queues.
    fn recording(&self, token: u64, passed: &[Arc<Request>], joins: &[Arc<Request>]) -> Recording {
        let passed = passed
            .iter()
            .filter_map(|r| match r.kind {
                Kind::Fair => Some(r.owner.clone()),
                _ => r.is_claimed().then(|| r.claim(self.lease_of(r))),
            })
            .collect();
        let joins = joins.iter().map(|r| r.owner.clone()).collect();
        Recording { token, passed, joins }
    }

    /// Records the passes of the run on `lock` whose `idle` this is, one script at a
    /// time, until Redis holds it for the current holder or a recording fails. It stops
    /// when that run is gone: a run that replaced it has a recorder of its own.
    async fn record(self, lock: String, idle: Arc<Notify>) {
        loop {
            let (from, to, token, passed, joins) = {
                let mut runs = self.relay.lock();
                let Some(run) = runs.get_mut(&lock).filter(|r| Arc::ptr_eq(&r.idle, &idle)) else {
                    return;
                };
                if run.recorded.hold_id == run.holder.hold_id || run.unrecorded.broken.is_cancelled() {
                    run.recording = false;
                    run.idle.notify_waiters();
                    return;
                }
                let passed = std::mem::take(&mut run.passed);
                // A waiter passed the lock before it was queued is not queued at all.
                let joins: Vec<_> = std::mem::take(&mut run.joining)
                    .into_iter()
                    .filter(|j| passed.iter().all(|p| p.hold_id != j.hold_id))
                    .collect();
                run.sending.clone_from(&joins);
                run.sent = Some(Instant::now());
                let (from, to) = (run.recorded.clone(), run.holder.clone());
                (from, to, run.token, passed, joins)
            };
            let reply = self
                .handoff_script(&from, &to, Some(self.recording(token, &passed, &joins)))
                .await;
            let (pace, left) = {
                let mut runs = self.relay.lock();
                // A run that broke may be replaced while its recording is in flight: its
                // holder was told its lease is lost, and whatever Redis granted it goes back.
                let Some(run) = runs.get_mut(&lock).filter(|r| Arc::ptr_eq(&r.idle, &idle)) else {
                    drop(runs);
                    self.unrecorded(from, to, passed);
                    return;
                };
                run.sending.clear();
                let left = std::mem::take(&mut run.left);
                match reply {
                    Ok([1, granted, more, reserved]) if granted == token as i64 => {
                        to.pass_recorded.store(true, Ordering::Release);
                        // Redis wrote what it said no earlier than the call was sent.
                        let sent = run.sent.take().unwrap_or_else(Instant::now);
                        // The script queues them only on a pass to a fair waiter (a name
                        // used as a mutex too may have passed to a mutex waiter).
                        if to.kind == Kind::Fair {
                            for joined in &joins {
                                let _ = joined.queued_by_recording.set(sent);
                            }
                        }
                        run.recorded = to;
                        run.recorded_token.send_replace(token);
                        run.answered = sent;
                        run.more = More::of(more);
                        run.reserved = run.reserved.max(reserved as u64);
                        (run.paced(), left)
                    }
                    failed => {
                        unrecorded_pass(to.name(), &failed);
                        // `-1`: the chain's recorded hold at or below the break floor.
                        run.unrecorded.break_off(matches!(failed, Ok([0, -1, ..])));
                        run.recording = false;
                        run.idle.notify_waiters();
                        drop(runs);
                        for req in left {
                            self.leave_later(req);
                        }
                        self.unrecorded(from, to, passed);
                        return;
                    }
                }
            };
            // Waiters that left while this recording queued them leave the queue now.
            for req in left {
                self.leave_later(req);
            }
            if let Some(pace) = pace {
                pace.await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::More;
    use std::time::Duration;

    #[test]
    fn a_turns_answer_says_how_long_passes_may_go_on() {
        assert_eq!(More::of(0), More::No);
        assert_eq!(More::of(1), More::Yes);
        assert_eq!(More::of(3), More::For(Duration::from_millis(2)));
    }
}
