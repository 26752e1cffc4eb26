//! The handoff: a release hands the freed lock straight to the next waiter of this
//! server, inside the release script (`handoff.lua`). A hot lock then changes hands in
//! one script call instead of a release, an unlock message and the waiter's own try,
//! and it is never free in between, so a newcomer cannot overtake the waiters.
//!
//! Mutex and fair waiters line up here per lock, as well as on the hub. A releasing
//! stream reserves the first in line and names it to the script. The script grants it
//! only when that is right for everyone: a fair lock's waiter must head the Redis queue;
//! a mutex goes local only while no other server or Redisson client listens for it.
//! Otherwise the script releases as usual and the hub's wake-ups take over.
//!
//! Once a handoff finds that only this server's waiters want the lock, the next
//! releases pass it on in memory and Redis records them behind (`relay.rs`).
//!
//! Redis holds the truth: a handed grant is a hold record of the waiter's stream, which
//! the waiter's own next try would find (scripts replay held records). So a waiter that
//! leaves while a handoff to it is in flight costs nothing but a background release.
//!
//! Across servers, a mutex waiter's busy try leaves a claim in Redis ([`Locks::claims`]
//! says which may), and a release on any server that frees the lock grants it to a
//! claim when no listener without one would be passed over (`grant_claim` in
//! `lib.lua`). The grant reaches the waiter through the hub, and again by its hold
//! record should the message be lost; a grant no waiter here took is given back.

use super::relay::{More, Recording};
use super::{millis, GiveBack, Grant, Locks, Redo, Reply, Request, RECORD_GRACE};
use crate::error::Error;
use crate::hub::Unclaimed;
use crate::keys::LockKeys;
use crate::sparse::Sparse;
use fred::prelude::{Key, Value};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::sync::Notify;
use tokio::time::Instant;

/// The hold ids of this server's streams that left a claim, while they live: a claim's
/// grant that no waiter took is given back only when its stream is gone (a stream that
/// holds may have taken it already, should the message come twice).
#[derive(Debug, Default)]
pub struct Claimants {
    live: Mutex<HashSet<String>>,
}

/// A stream's entry in [`Claimants`], removed when the stream's request is dropped.
pub struct Claimant {
    claimants: Arc<Claimants>,
    hold_id: String,
}

impl Claimants {
    /// Registers the stream `hold_id`.
    pub(super) fn enter(self: &Arc<Self>, hold_id: &str) -> Claimant {
        self.lock().insert(hold_id.to_owned());
        Claimant {
            claimants: self.clone(),
            hold_id: hold_id.to_owned(),
        }
    }

    fn is_live(&self, hold_id: &str) -> bool {
        self.lock().contains(hold_id)
    }

    fn lock(&self) -> MutexGuard<'_, HashSet<String>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl std::fmt::Debug for Claimant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Claimant").field(&self.hold_id).finish()
    }
}

impl Drop for Claimant {
    fn drop(&mut self) {
        let mut live = self.claimants.lock();
        live.remove(&self.hold_id);
        live.shrink_if_sparse();
    }
}

/// The local waiters of each lock, in the order they lined up.
#[derive(Debug, Default)]
pub struct Lines {
    lines: Mutex<HashMap<String, VecDeque<Arc<Entry>>>>,
    /// How many waiters here that no line holds (multi-locks) wait on each lock.
    unlined: Mutex<HashMap<String, usize>>,
}

/// A waiter that no line holds (a multi-lock's, on the name that blocks it), counted
/// on its lock while it waits there: the lock then goes by Redis, neither handed over
/// nor passed in memory to the waiters in line, nor granted to their claims, which
/// would keep it from this waiter for as long as they keep coming.
#[derive(Debug)]
pub struct Unlined {
    lines: Arc<Lines>,
    lock: String,
}

impl Drop for Unlined {
    fn drop(&mut self) {
        let mut unlined = self.lines.unlined.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = unlined.get_mut(&self.lock) {
            *count -= 1;
            if *count == 0 {
                unlined.remove(&self.lock);
            }
        }
    }
}

impl Lines {
    /// Whether a waiter that no line holds waits on `lock` here.
    fn has_unlined(&self, lock: &str) -> bool {
        self.unlined
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(lock)
    }
}

/// One waiting stream.
#[derive(Debug)]
pub(super) struct Entry {
    /// The waiter's request: who the script grants to, and what to release if the
    /// waiter left meanwhile.
    pub(super) req: Arc<Request>,
    state: Mutex<State>,
    /// Tells the waiter its state changed.
    settled: Notify,
    /// A release that named it failed: that script may still run late and grant it, so
    /// its hold record is given back however it leaves, unless it took the lock.
    doubted: AtomicBool,
    /// When the holder's lease ends as its last busy try was told (the holder's TTL):
    /// the bound on the recheck of the waiters behind it, which skip their own try.
    holder_until: Mutex<Option<Instant>>,
}

/// Where a waiter's handoff stands.
#[derive(Debug, Clone)]
enum State {
    /// In line.
    Waiting,
    /// Named to a release script that has not answered yet.
    Reserved,
    /// Granted by a release, not yet taken by the waiter.
    Granted(Grant, Instant),
    /// A release that named it failed: it may have been granted, it should look.
    Unsure,
    /// A release named it and gave the lock to another (the head of the Redis queue is
    /// elsewhere): in line again. A waiter woken while it was named let that wake-up
    /// pass for the grant it expected, and must hear of it.
    Declined,
    /// The waiter holds the lock (or anything its stream was granted) itself.
    Taken,
    /// The waiter left without taking anything.
    Gone,
}

/// What a waiter learns from a release that named it.
#[derive(Debug)]
pub enum Handed {
    /// The lock is its, since the instant the release asked for it.
    Granted(Grant, Instant),
    /// The release failed: try again, a grant may be waiting in Redis.
    Unsure,
    /// The release gave the lock to another: the waiter is in line again.
    Declined,
}

/// A waiter's place in its lock's line; leaving the line when dropped.
#[derive(Debug)]
pub struct Place {
    locks: Locks,
    entry: Arc<Entry>,
    /// How many waiters of the same kind were in line before it.
    ahead: usize,
}

/// What the release did for the reserved waiter.
pub(super) enum Outcome {
    /// The release script granted it the lock.
    Granted(Grant, Instant),
    /// The lock was passed to it in memory (`relay.rs`): Redis holds it for a hold of
    /// the run, recorded as this waiter's only by a later recording.
    Passed(Grant, Instant),
    /// The lock went elsewhere, or stays held. `freed`: the release freed it with the
    /// unlock message that every server's waiters hear.
    NotHanded {
        freed: bool,
    },
    Unknown,
}

/// The token `handoff.lua` answers when it freed the lock with the unlock message.
const FREED: i64 = -2;

impl Lines {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, VecDeque<Arc<Entry>>>> {
        // Every change is a single insert or removal: the map stays consistent.
        self.lines.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserves the waiter a release of `lock` should name: the first in line. (Fair
    /// waiters line up right after joining the Redis queue, so the orders agree but
    /// for two that joined at the same moment; then the script declines.)
    /// Never the releasing stream itself (a background release after a failed try).
    fn reserve(&self, lock: &str, releasing: &str) -> Option<Arc<Entry>> {
        self.reserve_if(lock, releasing, |_| true)
    }

    /// Reserves the first in line, as [`Lines::reserve`] does, when it is `eligible`.
    pub(super) fn reserve_if(
        &self,
        lock: &str,
        releasing: &str,
        eligible: impl Fn(&Request) -> bool,
    ) -> Option<Arc<Entry>> {
        let mut lines = self.lock();
        let line = lines.get_mut(lock)?;
        let index = line
            .iter()
            .position(|e| e.req.hold_id != releasing && e.state().in_line())?;
        let entry = line[index].clone();
        // Checked and reserved under one lock of its state: a fair waiter's try starts
        // only while it waits (Place::start_try).
        let mut state = entry.state();
        if !state.in_line() || !eligible(&entry.req) {
            return None;
        }
        *state = State::Reserved;
        drop(state);
        line.remove(index);
        if line.is_empty() {
            lines.remove(lock);
            lines.shrink_if_sparse();
        }
        Some(entry)
    }

    /// Records what the release did for `entry`.
    pub(super) fn settle(&self, locks: &Locks, entry: Arc<Entry>, outcome: Outcome) {
        let mut lines = self.lock();
        let mut state = entry.state();
        match (&*state, outcome) {
            (State::Reserved, Outcome::Granted(grant, at) | Outcome::Passed(grant, at)) => {
                *state = State::Granted(grant, at)
            }
            (State::Reserved, outcome) => {
                *state = match outcome {
                    Outcome::Unknown => {
                        entry.doubted.store(true, Ordering::Release);
                        State::Unsure
                    }
                    // A mutex waiter hears the unlock message as every other server's
                    // waiters do: told at the release's answer, it would try ahead of
                    // them all (and on a loaded machine win every race).
                    Outcome::NotHanded { freed: true } if entry.req.kind == super::Kind::Mutex => State::Waiting,
                    _ => State::Declined,
                };
                drop(state);
                lines
                    .entry(entry.req.keys.lock.clone())
                    .or_default()
                    .push_front(entry.clone());
            }
            // It left meanwhile: give back what it may have been granted, through Redis.
            // The passing in memory its grant started has nobody to pass from (the
            // relay's lock is taken after the lines' lock is let go, never under it).
            (State::Gone, Outcome::Granted(..)) => {
                drop(state);
                drop(lines);
                locks.forget_run(&entry.req);
                locks.release_later(entry.req.clone(), false);
            }
            // It left as the lock was passed to it: given back as its release would, once
            // Redis records it as the holder (the run's holder, nobody may pass the lock
            // on from it), or, should the recording fail, the hold Redis last recorded.
            // Not as a grant of the script: Redis has no hold record of it yet, and the
            // chain's recorded hold would stay, renewed by nobody, for a whole lease.
            // A release that may have granted it (Unknown) gives back whatever is there.
            (State::Gone, Outcome::Passed(..) | Outcome::Unknown) => locks.release_later(entry.req.clone(), true),
            (State::Gone, Outcome::NotHanded { .. }) if entry.doubted() => locks.release_later(entry.req.clone(), true),
            _ => return,
        }
        entry.settled.notify_one();
    }
}

/// A waiter reserved for a handoff whose answer has not come. Should the release be
/// dropped meanwhile (its stream reset, its connection closed), the script may still
/// run and grant the lock: the waiter is settled as unsure, so it looks at once (its
/// replay finds such a grant) or, gone, gives back whatever it was granted, instead of
/// staying reserved with nobody to tell it.
struct Reservation<'a> {
    locks: &'a Locks,
    next: Option<Arc<Entry>>,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Some(next) = self.next.take() {
            self.locks.lines.settle(self.locks, next, Outcome::Unknown);
        }
    }
}

impl State {
    /// Whether the waiter stands in line, as no release's candidate.
    fn in_line(&self) -> bool {
        matches!(self, State::Waiting | State::Declined)
    }
}

impl Entry {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn doubted(&self) -> bool {
        self.doubted.load(Ordering::Acquire)
    }

    /// Whether the release that named it has not answered yet. A try of its that was
    /// in flight may have found the grant first (its hold record): it then holds the
    /// lock itself (`Taken`), and may have released it since.
    pub(super) fn is_reserved(&self) -> bool {
        matches!(*self.state(), State::Reserved)
    }
}

impl Locks {
    /// Whether a release of `req` may hand its lock over, and a waiter of `req` take it:
    /// a single mutex or fair lock on the main Redis, whose grants need no replica
    /// acknowledgement (the handoff's grant is not followed by WAIT).
    pub(super) fn hands_off(&self, req: &Request) -> bool {
        matches!(req.kind, super::Kind::Mutex | super::Kind::Fair)
            && !req.redlock
            && req.multi.is_empty()
            && !self.backend.waits_for_replicas()
    }

    /// Whether a waiting try of `req` may leave a claim for a release on any server to
    /// grant: a single mutex that hands off, for a waiter that waits, whose lease is the
    /// stream's (a fixed lease would count from the grant, which its server hears of a
    /// little later).
    pub fn claims(&self, req: &Request) -> bool {
        req.kind == super::Kind::Mutex
            && req.fixed_lease.is_none()
            && req.wait != Some(std::time::Duration::ZERO)
            && self.hands_off(req)
    }

    /// Lines `req` up for a handoff (`None` for the kinds that do not hand off).
    pub fn line_up(&self, req: &Arc<Request>) -> Option<Place> {
        if !self.hands_off(req) {
            return None;
        }
        let entry = Arc::new(Entry {
            req: req.clone(),
            state: Mutex::new(State::Waiting),
            settled: Notify::new(),
            doubted: AtomicBool::new(false),
            holder_until: Mutex::new(None),
        });
        let mut lines = self.lines.lock();
        let line = lines.entry(req.keys.lock.clone()).or_default();
        let ahead = line.iter().filter(|e| e.req.kind == req.kind).count();
        line.push_back(entry.clone());
        Some(Place {
            locks: self.clone(),
            entry,
            ahead,
        })
    }

    /// Gives back `req`'s hold and, when that frees the lock, grants it to the waiter
    /// reserved in `lines`; without a waiter, the plain release.
    /// A hold passed in memory goes first to the next waiter in memory (`relay.rs`),
    /// and is answered once Redis recorded a later holder; or it waits until Redis
    /// records it.
    pub(super) async fn release_handing_off(&self, req: &Request) -> Result<bool, Error> {
        // Shutting down, every stream here ends: the lock goes as a plain release's does
        // (to another server's claim or waiters), not to a waiter here that would be
        // told `lost{SHUTDOWN}` as soon as it was granted.
        let stopping = self.stop.is_cancelled();
        if let Some(confirmation) = (!stopping).then(|| self.pass_in_memory(req)).flatten() {
            // The next holder has the lock already; this one hears how its turn went
            // once Redis recorded a later holder (within a pace and a round trip).
            return Ok(confirmation.held(self.backend.timeout()).await);
        }
        let broken = self.end_run(req).await;
        let next = (!stopping && !broken && !self.unheard(req))
            .then(|| self.lines.reserve(&req.keys.lock, &req.hold_id))
            .flatten();
        let Some(next) = next else {
            return self.release_plain(req, GiveBack::Release).await;
        };
        let mut reservation = Reservation {
            locks: self,
            next: Some(next.clone()),
        };
        let asked = Instant::now();
        let reply = self.handoff_script(req, &next.req, None).await;
        reservation.next = None;
        let outcome = match &reply {
            Ok([_, token, more, reserved]) if *token > 0 => {
                crate::metrics::handed_off();
                // A late answer, past which Redis granted the lock again: the waiter looks.
                if self.start_run(&next, *token as u64, More::of(*more), *reserved as u64, asked) {
                    Outcome::Unknown
                } else {
                    Outcome::Granted(Grant::handed(*token as u64), asked)
                }
            }
            // The releasing hold was not there: either it had ended, or this is a
            // command sent again after a reconnect whose first run did the handoff.
            Ok([0, ..]) | Err(_) => Outcome::Unknown,
            Ok([_, token, ..]) => Outcome::NotHanded { freed: *token == FREED },
        };
        self.lines.settle(self, next, outcome);
        reply.map(|[released, ..]| released > 0)
    }

    /// Whether a release of `req`'s lock goes by Redis, to no waiter in line here: its
    /// lock is a mutex whose channel this server does not listen on now, or a waiter
    /// no line holds waits for it here ([`Unlined`]). A mutex goes to a waiter here (by
    /// a handoff, or a pass in memory) only while this server is the channel's one
    /// subscriber, or in its turn with every other subscriber a server with a claim
    /// (handoff.lua counts them): with its own subscription still on its way
    /// (a first waiter, a reconnect), the one counted is another's, whose waiter came
    /// first.
    pub(super) fn unheard(&self, req: &Request) -> bool {
        (req.kind == super::Kind::Mutex && !self.hub.listens(&req.keys.channel()))
            || self.lines.has_unlined(&req.keys.lock)
    }

    /// Counts a waiter that no line holds on `lock` (see [`Unlined`]) until the guard
    /// is dropped.
    pub fn wait_unlined(&self, lock: &str) -> Unlined {
        *self
            .lines
            .unlined
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(lock.to_owned())
            .or_default() += 1;
        Unlined {
            lines: self.lines.clone(),
            lock: lock.to_owned(),
        }
    }

    /// Whether a waiter here of `req`'s lock may leave a claim: not while a waiter that
    /// no line holds waits for it here (a release granting claims would keep the lock
    /// from that waiter).
    pub fn may_claim(&self, req: &Request) -> bool {
        !self.lines.has_unlined(&req.keys.lock)
    }

    /// Gives back the grants of this server's claims that no waiter here took and whose
    /// stream is gone, until shutdown: a promoted replica kept the claim after the old
    /// master had granted it or the stream's own try had taken the lock. Nobody renews
    /// such a grant, and the lock would stay held for a whole lease. (A stream that left
    /// gives back what its claim may have been granted itself too; the second give-back
    /// finds nothing. A stream that lives and holds learns of a grant not its own at its
    /// next renewal.)
    pub async fn give_back_unclaimed(self, mut unclaimed: broadcast::Receiver<Unclaimed>) {
        loop {
            let next = tokio::select! {
                _ = self.stop.cancelled() => return,
                next = unclaimed.recv() => next,
            };
            match next {
                Ok(grant) if !self.claimants.is_live(&grant.hold) => {
                    self.background.spawn(self.clone().give_back_grant(grant));
                }
                Ok(_) | Err(RecvError::Lagged(_)) => {}
                Err(RecvError::Closed) => return,
            }
        }
    }

    /// Gives back one such grant, tried again (see [`Locks::redo_later`]) for as long as
    /// its lease could last: a give-back that failed once (Redis away a moment) would
    /// otherwise leave the lock held by nobody for the whole lease.
    async fn give_back_grant(self, grant: Unclaimed) {
        let keys = self.backend.keys();
        let Some(lock) = keys.name_of(&grant.lock).and_then(|name| keys.lock_checked(name)) else {
            return;
        };
        let give_up = Instant::now() + self.watchdog_lease;
        if self.gave_back_grant(&lock, &grant).await != Reply::Done {
            self.redo_later(Redo::Unclaimed { lock, grant, give_up });
        }
    }

    /// Gives back once a grant nobody claims, the lock `lock`'s.
    pub(super) async fn gave_back_grant(&self, lock: &LockKeys, grant: &Unclaimed) -> Reply {
        let idle = self.passes_own_over(&lock.channel());
        let holder = super::mutex::Holder {
            hold_id: &grant.hold,
            owner: &grant.owner,
            keeps_place: None,
            passed: None,
        };
        let names = std::slice::from_ref(lock);
        let released = super::mutex::release(&self.backend, names, holder, GiveBack::Release, "", idle).await;
        match &released {
            Ok(released) => {
                tracing::debug!(lock = lock.name(), owner = %grant.owner, released, "gave back an unclaimed grant")
            }
            Err(e) => tracing::debug!(lock = lock.name(), error = %e, "giving back an unclaimed grant failed"),
        }
        Reply::of(&released)
    }

    /// Runs `handoff.lua` from `req` to `next`; `told`, for a pass in memory that the
    /// script records: the token `next` was told, and what else Redis learns.
    pub(super) async fn handoff_script(
        &self,
        req: &Request,
        next: &Request,
        told: Option<Recording>,
    ) -> Result<[i64; 4], Error> {
        let k = &req.keys;
        let keys: Vec<Key> = super::mutex::release_keys(k, &req.hold_id)
            .into_iter()
            .chain([k.fence(), k.hold(&next.hold_id)])
            .map(Key::from)
            .collect();
        let token = told.as_ref().map(|r| r.token);
        let args = [
            Value::from(req.owner.as_str()),
            Value::from(next.owner.as_str()),
            Value::from(if next.kind == super::Kind::Fair {
                "fair"
            } else {
                "mutex"
            }),
            Value::from(millis(self.lease_of(next))),
            Value::from(millis(RECORD_GRACE)),
            Value::from(next.claim_to_forget(self.lease_of(next))),
            token.map_or(Value::from(""), |t| Value::from(t.to_string())),
            Value::from(if super::relay::relays(next) {
                super::relay::RESERVE as i64
            } else {
                0
            }),
        ]
        .into_iter()
        // ARGV[9]: how long a queued fair waiter stays; ARGV[10]: the releasing stream's
        // claim; a recording's ARGV[11..] after.
        .chain([
            Value::from(millis(self.fair_wait)),
            Value::from(req.claim_to_forget(self.lease_of(req))),
        ])
        .chain(told.into_iter().flat_map(super::relay::Recording::args))
        .collect();
        let reply: Vec<i64> = self.backend.eval(&self.backend.scripts().handoff, keys, args).await?;
        match reply.as_slice() {
            [released, token, more, reserved] => Ok([*released, *token, *more, *reserved]),
            other => Err(Error::Protocol(format!("handoff returned {other:?}"))),
        }
    }
}

impl Place {
    /// A busy try of this waiter was told the holder's lease ends at `until`.
    pub fn told_holder_until(&self, until: Instant) {
        *self.entry.holder_until.lock().unwrap_or_else(|e| e.into_inner()) = Some(until);
    }

    /// The latest end of the holder's lease that a waiter of this line was told, if one
    /// was: a waiter that skipped its try (it waits behind others of its kind) looks
    /// again then, as they do, rather than after a second (a try that would leave a
    /// claim beside theirs and might be granted before them).
    pub fn line_holder_until(&self) -> Option<Instant> {
        let lines = self.locks.lines.lock();
        let line = lines.get(&self.entry.req.keys.lock)?;
        line.iter()
            .filter_map(|e| *e.holder_until.lock().unwrap_or_else(|e| e.into_inner()))
            .max()
    }

    /// Whether a waiter that leaves a claim stands ahead of this one in this server's
    /// line now. Its claim is the server's: a second one, which a release could grant
    /// first, would let this waiter overtake it (and a server with two claims take two
    /// turns in a row from another's waiters).
    pub fn claimant_ahead(&self) -> bool {
        let lines = self.locks.lines.lock();
        let Some(line) = lines.get(&self.entry.req.keys.lock) else {
            return false;
        };
        line.iter()
            .take_while(|e| !Arc::ptr_eq(e, &self.entry))
            .any(|e| self.locks.claims(&e.req))
    }

    /// Whether waiters of the same kind stood in this server's line when it joined.
    pub fn behind_its_kind(&self) -> bool {
        self.ahead > 0
    }

    /// Its place in line when it joined, counted from 1: a fair waiter's place in the
    /// queue while every waiter there is this server's.
    pub fn position(&self) -> u32 {
        u32::try_from(self.ahead + 1).unwrap_or(u32::MAX)
    }

    /// Waits until a release named this waiter and answered. A release that gave the
    /// lock to another is told only to a waiter that `let_a_wake_up_pass` (it skipped
    /// its try as it was named); any other keeps waiting.
    pub async fn handed(&self, let_a_wake_up_pass: bool) -> Handed {
        loop {
            let settled = self.entry.settled.notified();
            {
                let mut state = self.entry.state();
                match &*state {
                    State::Granted(grant, at) => {
                        let handed = Handed::Granted(grant.clone(), *at);
                        *state = State::Taken;
                        return handed;
                    }
                    State::Unsure => {
                        *state = State::Waiting;
                        return Handed::Unsure;
                    }
                    State::Declined => {
                        *state = State::Waiting;
                        if let_a_wake_up_pass {
                            return Handed::Declined;
                        }
                    }
                    _ => {}
                }
            }
            settled.await;
        }
    }

    /// Whether a release that named this waiter failed, so that it may yet be granted
    /// without being told: the waiter then checks often rather than at the holder's TTL.
    pub fn doubted(&self) -> bool {
        self.entry.doubted()
    }

    /// Whether a release named this waiter (reserved it, granted it, or left it
    /// unsure): what [`Place::start_try`] refuses a try for, read without starting one.
    pub fn named_by_release(&self) -> bool {
        !self.entry.state().in_line()
    }

    /// A fair waiter's try may start: it is counted while it runs, and no lock is
    /// passed to the waiter in memory meanwhile (a try after the pass was recorded would
    /// queue it again). `None` once a release reserved or granted it: its grant is on
    /// its way, and a try would gain nothing.
    pub fn start_try(&self) -> Option<TryGuard> {
        let mut state = self.entry.state();
        if !state.in_line() {
            return None;
        }
        // A try looks for itself: a decline has nothing more to tell it.
        *state = State::Waiting;
        self.entry.req.trying.fetch_add(1, Ordering::AcqRel);
        Some(TryGuard(self.entry.req.clone()))
    }

    /// The waiter was granted by its own try: whatever a release handed it is the same
    /// hold (its record), now the stream's to release.
    pub fn taken(&self) {
        *self.entry.state() = State::Taken;
    }
}

/// A fair waiter's try in flight ([`Place::start_try`]).
#[derive(Debug)]
pub struct TryGuard(Arc<Request>);

impl Drop for TryGuard {
    fn drop(&mut self) {
        self.0.trying.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let lines = &self.locks.lines;
        let mut map = lines.lock();
        let lock = &self.entry.req.keys.lock;
        if let Some(line) = map.get_mut(lock) {
            line.retain(|e| !Arc::ptr_eq(e, &self.entry));
            if line.is_empty() {
                map.remove(lock);
                map.shrink_if_sparse();
            }
        }
        let mut state = self.entry.state();
        match *state {
            // A grant it never took: give it back, revoking, as its stream is gone. Never
            // passed on in memory: the stream's other give-back (it left a claim, or a
            // try of its may have granted it) revokes in Redis, and must not free the
            // lock under a waiter this one passed it to.
            State::Granted(..) => self.locks.release_later(self.entry.req.clone(), true),
            // A release may have granted it: give back whatever is there.
            State::Unsure => self.locks.release_later(self.entry.req.clone(), true),
            _ if state.in_line() && self.entry.doubted() => self.locks.release_later(self.entry.req.clone(), true),
            _ => {}
        }
        if !matches!(*state, State::Taken) {
            *state = State::Gone;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream stays registered as a claimant as long as its entry lives: its claim's
    /// grant, should it come twice, is never given back while the stream may hold it.
    #[test]
    fn a_claimant_is_live_until_its_entry_is_dropped() {
        let claimants = Arc::new(Claimants::default());
        let entry = claimants.enter("s:1");
        assert!(claimants.is_live("s:1"));
        assert!(!claimants.is_live("s:2"));
        drop(entry);
        assert!(!claimants.is_live("s:1"));
    }
}
