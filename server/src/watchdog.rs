//! The watchdog: one scheduler keeps every stream-scoped lease of this server alive,
//! renewing them (and checking the fixed ones) every third of the watchdog timeout in
//! batched scripts (many leases per round trip, grouped by node on a cluster; RedLock
//! leases on a loop of their own, so a silent RedLock node never delays the main
//! Redis's). A lease found not held, or broken by ForceRelease on any server, is
//! reported to the stream that owns it, and so is the server's shutdown.

use crate::auth::{Action, Caller, Policy};
use crate::error::Error;
use crate::hub::Notice;
use crate::lock::{Grant, Renewal, Request, RECORD_GRACE};
use crate::redis::{routes_to, Backend, Replication};
use crate::sparse::Sparse;
use fred::clients::Client;
use fred::prelude::{FromValue, Key, Value};
use fred::util::redis_keyslot;
use futures::future::{BoxFuture, FutureExt};
use futures::stream::{FuturesUnordered, StreamExt};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, oneshot, Notify};
use tokio_util::sync::CancellationToken;

/// Leases renewed by one script call.
pub const RENEW_BATCH: usize = 500;
/// How soon a round that failed (Redis down) is tried again, at most (see
/// [`retry_delay`]).
const RETRY_DELAY: Duration = Duration::from_secs(1);
/// How many renewal batches go to a node at once. Redis runs them one after another
/// anyway; a few in flight keep it busy, and only theirs are built at a time: every
/// batch of a round built at once held 1.6 KB per lease of 100 000 (the leases' keys
/// copied into the calls, and encoded) beside the 3.3 KB a held lease costs.
const BATCHES_IN_FLIGHT: usize = 8;
/// How many per-slot renewal calls (after a node-wide batch failed) run at once.
const SLOT_CALLS: usize = 32;

/// Why a lease ended without its stream asking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostReason {
    /// The lock is gone or held by someone else.
    NotHeld,
    /// An operator broke the lock.
    ForceReleased,
    /// The server is stopping (it releases the lock itself).
    Shutdown,
    /// An auth file reload took the caller's right to the lock away: the lease is no
    /// longer renewed, whether or not its stream is polled to end it.
    Revoked,
}

/// A lost lease, as the watchdog tells its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lost {
    /// Why.
    pub reason: LostReason,
    /// Which of its names: the index in `Request::all_keys` (0 for a single lock, or
    /// when no one name was lost).
    pub part: usize,
}

/// The lease registry and its renewal scheduler. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Watchdog {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    leases: Mutex<Leases>,
    next_id: AtomicU64,
    timeout: Duration,
    redis_timeout: Duration,
    backend: Arc<Backend>,
    recheck: Recheck,
}

/// The registered leases, and whether the server is stopping (a lease registered
/// then is told so at once).
#[derive(Debug, Default)]
struct Leases {
    entries: HashMap<u64, Entry>,
    /// The leases of the main Redis by the hash of each lock key they hold (a collision
    /// costs a comparison), as (hash, lease id): a ForceRelease notice looks at its
    /// lock's leases, not the whole table, which registrations and releases wait for
    /// meanwhile. Ordered, so that a key's leases are a range, and a lease of a name of
    /// many holders (readers, a semaphore's) is added and taken out in O(log n).
    by_lock: BTreeSet<(u64, u64)>,
    stopping: bool,
    /// The break floors ForceRelease notices brought in the last timeout, by lock key,
    /// with when each was heard: a grant whose reply was still on its way (held back by
    /// `WAIT`, a handoff, a claim) is registered after the notice that broke it.
    breaks: HashMap<String, (u64, Instant)>,
    /// When notices were last missed (a reconnect, a lagging reader): a grant asked
    /// before then and registered after the round that checked the leases was not in
    /// it, and a break it missed may have broken it.
    missed_at: Option<Instant>,
    /// The longest a lease went between two confirmations by Redis (each as of its
    /// call's asking): how far the renewals lag behind their period, told as
    /// `latchkey_watchdog_renewal_gap_max_seconds`.
    longest_gap: Duration,
    /// When the main Redis's last round, and the RedLock loop's, took their list of
    /// leases: a grant asked before then and registered after was in neither.
    round_started: Option<Instant>,
    redlock_round_started: Option<Instant>,
}

#[derive(Debug)]
struct Entry {
    /// The held request: its renewals are built for each round from it.
    req: Arc<Request>,
    renew: bool,
    /// When Redis last confirmed the lease's (first) name (measured before the call,
    /// so the estimate errs early): past `timeout` after it, Redis has let the lock
    /// expire.
    renewed_at: Instant,
    /// The same for a multi-lock's other names, empty otherwise: they may live on
    /// other cluster nodes, renewed by other batches, so one node's answers never
    /// vouch for another's names.
    others_renewed_at: Box<[Instant]>,
    /// The fencing token of the (first) name, and of a multi-lock's other names (empty
    /// otherwise): a ForceRelease ends only the holds it broke, not one granted after
    /// it whose notice came late.
    token: u64,
    other_tokens: Box<[u64]>,
    lost: Option<oneshot::Sender<Lost>>,
    /// Who holds it, under auth: checked again at each auth file reload.
    caller: Option<Arc<Caller>>,
    /// A reload took the caller's right to the lock away: renewed no more.
    revoked: bool,
}

/// How often the leases Redis has not confirmed of late are checked: a notice comes
/// up to one check after its limit (notice_limit), which must leave its holder most of
/// the margin that limit keeps before Redis can expire the lock: a check at least every
/// quarter of it, every second at most. (Every second whatever the margin left a holder
/// on a Redis timeout of 50 ms and a 30 s timeout about 60 ms, not 1.05 s.)
fn expiry_check_every(timeout: Duration, redis_timeout: Duration) -> Duration {
    let margin = timeout.saturating_sub(notice_limit(timeout, redis_timeout, false));
    (timeout / 10)
        .min(margin / 4)
        .clamp(Duration::from_millis(20), Duration::from_secs(1))
}

/// How long after Redis last confirmed a lease its holder is told it lost it
/// (`NOT_HELD`): a little before Redis expires the lock. A failing round may take the
/// Redis timeout and the retry delay before it could have renewed. Redis counts the
/// lease on its own clock, which may run ahead of this server's by as much as NTP slews
/// one (up to 500 ppm): a thousandth of the timeout more, as a fixed lease ends early
/// (`Request::fixed_lease_valid`), which a long timeout's margin would not cover. A
/// RedLock lease's nodes each count its `timeout` on their own clock, which may run fast by the drift
/// allowed (`redlock::drift`), as a grant's validity assumes: the holder is told that
/// much earlier still, so that it keeps the main Redis's time to hear the notice before
/// a majority of fast nodes could free the lock and another client take it.
fn notice_limit(timeout: Duration, redis_timeout: Duration, redlock: bool) -> Duration {
    let mut margin = redis_timeout.saturating_add(RETRY_DELAY).min(timeout / 3) + timeout / 1000;
    if redlock {
        margin += crate::lock::redlock::drift(timeout);
    }
    timeout.saturating_sub(margin)
}

/// How old Redis's last word may be when a lock is passed in memory (`lock/relay.rs`),
/// whose holder counts its lease from the pass: a quarter of the least margin
/// `notice_limit` keeps for a lease of `timeout`, whatever the Redis timeout. With an
/// expiry check every quarter of the margin at most, the holder still hears its lease
/// lost half the margin before Redis may expire the lock.
pub(crate) fn pass_age_limit(timeout: Duration) -> Duration {
    (RETRY_DELAY.min(timeout / 3) + timeout / 1000) / 4
}

/// How soon the leases of a round that failed are tried again: [`RETRY_DELAY`], or a
/// quarter of a round's period if shorter. The retry must come well before the next
/// round: under a short timeout the notice margin is a third of it (`notice_limit`), so
/// a lease's notice comes due with the round after a failed one, and a retry a whole
/// period later (a second at most) had a lease whose one round failed at once (a
/// reconnect, a failover's first `READONLY`) told lost while Redis held it.
fn retry_delay(timeout: Duration) -> Duration {
    RETRY_DELAY.min(timeout / 12)
}

/// Whether renewal rounds that wait up to `replica_wait` for the replicas after their
/// last call (`--sync-replicas`) confirm a lease before its notice: the next round a
/// period after the last confirmation, its wait, and one retry after a missed
/// acknowledgement (`retry_delay` later, and its wait). A round's own calls come on
/// top (seconds for 100 000 leases).
pub fn replica_wait_fits(timeout: Duration, redis_timeout: Duration, replica_wait: Duration) -> bool {
    timeout / 3 + replica_wait * 2 + retry_delay(timeout) < notice_limit(timeout, redis_timeout, false)
}

/// One registered lease; dropping it stops renewal before the release runs, so a
/// renewal never outlives its release.
#[derive(Debug)]
pub struct Lease {
    id: u64,
    inner: Arc<Inner>,
    lost: oneshot::Receiver<Lost>,
}

/// A lease a round renews, as taken from the lease table.
struct Picked {
    id: u64,
    req: Arc<Request>,
    check_only: bool,
    /// The lease's token on its (first) name, if that name is due; the same for a
    /// multi-lock's other names (their index in `Request::all_keys`), empty otherwise:
    /// a lease of one name (the common case) takes no allocation.
    first: Option<u64>,
    others: Vec<(usize, u64)>,
}

impl Picked {
    fn due(self) -> impl Iterator<Item = Due> {
        let Picked {
            id,
            req,
            check_only,
            first,
            others,
        } = self;
        let tokens = first.map(|token| (0, token)).into_iter().chain(others);
        tokens.map(move |(part, token)| Due {
            id,
            check_only,
            part,
            slot: redis_keyslot(req.keys_of(part).lock.as_bytes()),
            req: Arc::downgrade(&req),
            token,
        })
    }
}

/// One lease of a renewal round. Its keys are built only as its batch is sent (see
/// [`Request::renewal`]).
struct Due {
    id: u64,
    /// A fixed lease: checked, not extended.
    check_only: bool,
    /// Which name of the lease (its index in `Request::all_keys`).
    part: usize,
    slot: u16,
    /// Not kept alive by the round: a request lives as long as its stream, and a claim
    /// grant nobody takes is given back only once its stream's request is gone
    /// (`Claimants`); a round of many leases, or one waiting on a silent node, would
    /// hold that back for its whole length.
    req: Weak<Request>,
    /// The grant's fencing token on this name, which its hold record must still hold;
    /// 0 for a RedLock, whose nodes each record their own.
    token: u64,
}

impl Due {
    /// This name's renewal, unless its stream has ended (its lease is released: there
    /// is nothing to renew).
    fn renewal(&self) -> Option<Renewal> {
        Some(self.req.upgrade()?.renewal(self.part))
    }
}

/// A node's renewal round under `--sync-replicas`: the client its calls and its reads
/// of the node's replication all go through (see `Backend::replication`), and the
/// renewed leases it confirms once the replicas have their renewals.
struct Synced {
    client: Client,
    held: Mutex<Vec<HeldLease>>,
}

/// A renewal Redis made, not yet confirmed: which lease, which of its names and its
/// slot, and when it was asked (what it is confirmed as of).
struct HeldLease {
    id: u64,
    part: usize,
    slot: u16,
    asked: Instant,
}

/// Renewal rounds not confirmed for want of the replicas, logged at most every ten
/// seconds.
static UNREPLICATED: crate::repeated::Repeated = crate::repeated::Repeated::new();

/// How a batch of renewals went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Batch {
    /// Every lease renewed, or found gone.
    Settled,
    /// Some lease neither: tried again after [`retry_delay`].
    Unsettled,
    /// Redis did not answer in time: the node's other batches would wait as long.
    Unanswered,
}

/// What has a renewal loop act before its next round: missed ForceRelease notices,
/// from the notice loop to the main loop (the next round is run at once), and grants
/// registered too late for the next round (see `Watchdog::misses_its_round`).
#[derive(Debug, Default)]
struct Recheck {
    asked: Notify,
    /// A grant registered too late for the next round: the main Redis's loop renews
    /// the leases its last round left unconfirmed at once.
    late: Notify,
    /// The same for the RedLock loop.
    late_redlock: Notify,
}

impl Recheck {
    /// Asks for a round at once; one asked during a round runs right after it
    /// (`Notify` keeps the permit).
    fn ask(&self) {
        self.asked.notify_one();
    }

    /// Asks the loop renewing `redlock` leases (or the main Redis's) to renew what its
    /// last round left unconfirmed, at once.
    fn late(&self, redlock: bool) {
        if redlock {
            self.late_redlock.notify_one();
        } else {
            self.late.notify_one();
        }
    }
}

impl Watchdog {
    /// A watchdog renewing leases to `timeout` on `backend`, whose commands take at
    /// most `redis_timeout`.
    pub fn new(backend: Arc<Backend>, timeout: Duration, redis_timeout: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                leases: Mutex::default(),
                next_id: AtomicU64::new(1),
                timeout,
                redis_timeout,
                backend,
                recheck: Recheck::default(),
            }),
        }
    }

    /// Registers a granted hold, whose lease counts from `from` (before the grant was
    /// asked: a reply that came late must not leave the server believing in a lease
    /// Redis has let expire). `renew` is false for a fixed lease, which is only
    /// checked: still held, and not broken by ForceRelease.
    pub fn register(&self, req: &Arc<Request>, renew: bool, grant: &Grant, from: Instant, caller: &Caller) -> Lease {
        let (tx, rx) = oneshot::channel();
        let (token, other_tokens) = match req.tokens_by_key(grant).split_first() {
            Some((first, others)) if !others.is_empty() => (*first, others.into()),
            _ => (grant.fencing_token, Box::default()),
        };
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let mut entry = Entry {
            req: req.clone(),
            renew,
            renewed_at: from,
            others_renewed_at: vec![from; req.all_keys().len().saturating_sub(1)].into_boxed_slice(),
            token,
            other_tokens,
            lost: Some(tx),
            caller: matches!(caller, Caller::Identity(..)).then(|| Arc::new(caller.clone())),
            revoked: false,
        };
        // Counted before anything can report it lost, which counts it out.
        crate::metrics::leases(1);
        let mut leases = self.inner.lock();
        if leases.stopping {
            entry.report(LostReason::Shutdown, 0);
        }
        // A break kept here may have broken the grant, heard though it was before the
        // grant's lease counts from: a claim's grant, made by another server's release,
        // counts from its waiter's last try, and a lock passed in memory was granted its
        // token when Redis reserved it, before the pass. A break's floor tells: every
        // grant it broke has a token at or below it, every later one above. Only an
        // older server's notice, which has no floor (`u64::MAX`), counts just when heard
        // since the grant was asked (a pass in memory: always; nobody was there to stop
        // it).
        let passed = req
            .unconfirmed
            .get()
            .is_some_and(|(told, _)| *told == grant.fencing_token);
        let broken = req.all_keys().iter().position(|k| {
            let heard_since = leases
                .breaks
                .get(&k.lock)
                .filter(|(floor, heard)| passed || *floor != u64::MAX || *heard >= from);
            heard_since.is_some_and(|(floor, _)| entry.broken_by(&k.lock, *floor))
        });
        if let Some(part) = broken {
            entry.report(LostReason::ForceReleased, part);
        }
        let missed_since = leases.missed_at.is_some_and(|missed| missed >= from);
        let late = renew && self.misses_its_round(&leases, req, from);
        leases.entries.insert(id, entry);
        leases.index(id, req);
        drop(leases);
        // Missed notices concern the main Redis's leases (ForceRelease breaks no RedLock
        // hold), and its round renews this one too; a RedLock lease asks its own loop.
        if missed_since && !req.redlock {
            self.inner.recheck.ask();
        } else if late {
            self.inner.recheck.late(req.redlock);
        }
        Lease {
            id,
            inner: self.inner.clone(),
            lost: rx,
        }
    }

    /// Whether a lease of `req` counted from `from` is as good as over: past the time its
    /// holder would be told it lost it (a fixed lease: past its end). A grant heard that
    /// late (a reply slower than the watchdog timeout allows) may have lapsed in Redis,
    /// and another client may hold the lock.
    pub fn lapsed(&self, req: &Request, from: Instant) -> bool {
        from.elapsed() + self.replica_wait(req) >= self.notice_after(req)
    }

    /// Whether a lease of `req` counted from `from`, registered now, would be told it
    /// is lost before the next round renews it. A grant whose reply came late (a busy
    /// Redis, a retried call, `WAIT`) was asked before the last round took its leases;
    /// a fresh one has at least a third of the timeout after the next round, and a late
    /// one with less than half that is renewed at once. With a short timeout (1.5 s:
    /// rounds every 0.5 s, told lost 1 s after Redis last confirmed) a grant answered
    /// 0.8 s late was told `NOT_HELD` while Redis held it. With `--sync-replicas` the
    /// round's confirmation comes after its wait for the replicas too.
    fn misses_its_round(&self, leases: &Leases, req: &Request, from: Instant) -> bool {
        let started = match req.redlock {
            true => leases.redlock_round_started,
            false => leases.round_started,
        };
        let period = self.inner.timeout / 3;
        let confirmed_by = |round| round + period + period / 2 + self.replica_wait(req);
        started.is_some_and(|round| from + self.notice_after(req) < confirmed_by(round))
    }

    /// How long after its renewal a lease of `req` may wait for the replicas
    /// (`--sync-replicas`): none for a fixed lease, which is not renewed, nor for a
    /// RedLock's, whose nodes are not replicated.
    fn replica_wait(&self, req: &Request) -> Duration {
        match req.redlock || req.fixed_lease_valid().is_some() {
            true => Duration::ZERO,
            false => self.inner.backend.replica_wait(),
        }
    }

    /// Whether a lease of `req` counted from `from` has most of its time ahead (a tenth
    /// at most gone): one granted since `from` may count from it, its first renewal round
    /// still well within its time.
    pub fn fresh(&self, req: &Request, from: Instant) -> bool {
        from.elapsed() < self.notice_after(req) / 10
    }

    /// How long after its grant a lease of `req` is told it is lost, unless renewed (a
    /// fixed lease: when it ends).
    fn notice_after(&self, req: &Request) -> Duration {
        req.fixed_lease_valid()
            .unwrap_or_else(|| notice_limit(self.inner.timeout, self.inner.redis_timeout, req.redlock))
    }

    /// Renews every third of the timeout until `stop`; also reports force-releases.
    pub async fn run(self, forced: broadcast::Receiver<Notice>, stop: CancellationToken) {
        tokio::join!(
            self.notices(forced, stop.clone()),
            self.renewals(stop.clone()),
            self.redlock_renewals(stop.clone()),
            self.expiries(stop.clone()),
            self.stopping(stop)
        );
    }

    /// Tells every lease the server is stopping, as soon as it is.
    async fn stopping(&self, stop: CancellationToken) {
        stop.cancelled().await;
        let mut leases = self.inner.lock();
        leases.stopping = true;
        for entry in leases.entries.values_mut() {
            entry.report(LostReason::Shutdown, 0);
        }
    }

    /// Checks, on its own clock, for leases Redis has not confirmed for nearly a whole
    /// timeout: a renewal round stuck on a dead Redis must not delay the notice.
    async fn expiries(&self, stop: CancellationToken) {
        let mut tick = tokio::time::interval(expiry_check_every(self.inner.timeout, self.inner.redis_timeout));
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => self.expire_unconfirmed(),
            }
        }
    }

    /// Handles ForceRelease notices as they come, on their own loop: a renewal round
    /// stuck on a slow Redis must not delay them.
    async fn notices(&self, mut forced: broadcast::Receiver<Notice>, stop: CancellationToken) {
        loop {
            let notice = tokio::select! {
                _ = stop.cancelled() => return,
                notice = forced.recv() => notice,
            };
            match notice {
                Ok(Notice::Forced { key, floor }) => self.force_released(&key, floor),
                // Notices were missed: find out which leases are gone right away.
                Ok(Notice::Missed) | Err(broadcast::error::RecvError::Lagged(_)) => {
                    self.inner.lock().missed_at = Some(Instant::now());
                    self.inner.recheck.ask();
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    }

    /// Renews the main Redis's leases, and checks its fixed ones, every third of the
    /// timeout, sooner when notices were missed (see `Recheck`). Each node's renewals
    /// run on their own: a node that does not answer holds back the next renewal of its
    /// own leases, never another node's (a round that waited for every node let one
    /// paused master cost the leases on all of them). After a failed batch, the leases
    /// the round left unconfirmed are tried again after [`retry_delay`], wherever they
    /// live now (a failover moves them to another node); the others wait for the next
    /// round. A node a round skipped because its call was still out is renewed as soon
    /// as that call ends.
    async fn renewals(&self, stop: CancellationToken) {
        let period = self.inner.timeout / 3;
        let retry = retry_delay(self.inner.timeout);
        let mut round = tokio::time::Instant::now() + period;
        let mut round_started = Instant::now();
        let mut retry_at: Option<tokio::time::Instant> = None;
        let mut running: FuturesUnordered<BoxFuture<'_, (String, bool)>> = FuturesUnordered::new();
        let mut busy: HashSet<String> = HashSet::new();
        // Nodes a round found busy: their leases are renewed as soon as the call out
        // ends. A recheck after missed notices asked while a call was out (a round of
        // many leases takes seconds) would otherwise wait for the next round, a third
        // of the timeout, to find the leases a break took.
        let mut owed: HashSet<String> = HashSet::new();
        loop {
            let wake = retry_at.map_or(round, |at| at.min(round));
            let every_lease = tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep_until(wake) => tokio::time::Instant::now() >= round,
                _ = self.inner.recheck.asked.notified() => true,
                _ = self.inner.recheck.late.notified() => false,
                Some((node, ok)) = running.next() => {
                    busy.remove(&node);
                    let now = tokio::time::Instant::now();
                    let at = if owed.remove(&node) { Some(now) } else { (!ok).then_some(now + retry) };
                    if let Some(at) = at {
                        retry_at = Some(retry_at.map_or(at, |r| r.min(at)));
                    }
                    continue;
                }
            };
            retry_at = None;
            if every_lease {
                round = tokio::time::Instant::now() + period;
                round_started = Instant::now();
                self.inner.lock().round_started = Some(round_started);
            }
            // Fixed leases are checked in every round, not only after missed notices: a
            // lock gone from Redis (deleted, flushed, evicted, lost in a failover that
            // broke no connection) may be taken by another client at once, and its
            // holder must hear of it before its lease ends.
            let unconfirmed = (!every_lease).then_some(round_started);
            let due = self.due(|e| !e.req.redlock, unconfirmed);
            // One client of the pool for the round: its slot map groups the leases, and
            // with `--sync-replicas` it carries each node's calls (see `renew_node`).
            let client = self.inner.backend.pool().next_connected().clone();
            for (node, leases) in self.inner.backend.by_node_on(&client, due, |d| d.slot) {
                if busy.insert(node.clone()) {
                    let client = client.clone();
                    running.push(async move { (node.clone(), self.renew_node(&node, client, leases).await) }.boxed());
                } else {
                    owed.insert(node);
                }
            }
        }
    }

    /// Renews one node's leases of the main Redis, which also checks that every fixed
    /// lease is still held; false when a batch failed and should be retried. RedLock
    /// leases are not in it (see `redlock_renewals`). Once a batch goes unanswered no
    /// other is sent: each would wait out the Redis timeout in its turn, the round
    /// lasting that many timeouts, where the retry (the whole round again, after
    /// [`retry_delay`]) comes after one. With `--sync-replicas` the round's calls all go
    /// through `client`, and the renewed leases are confirmed only once the node's
    /// replicas have the round's renewals (see [`Watchdog::confirm_replicated`]).
    async fn renew_node(&self, node: &str, client: Client, due: Vec<Due>) -> bool {
        let started = Instant::now();
        let backend = &self.inner.backend;
        let replication = match backend.waits_for_replicas() {
            true => Some(backend.replication(&client, node).await),
            false => None,
        };
        let synced = replication.is_some().then(|| Synced {
            client,
            held: Mutex::default(),
        });
        let mut batches = chunked(due).into_iter();
        let mut running = FuturesUnordered::new();
        let renew = |b| self.renew_batch(b, synced.as_ref());
        running.extend(batches.by_ref().take(BATCHES_IN_FLIGHT).map(renew));
        let mut settled = true;
        while let Some(batch) = running.next().await {
            settled &= batch == Batch::Settled;
            if batch == Batch::Unanswered {
                let left: Vec<Due> = batches.by_ref().flatten().collect();
                crate::metrics::renewal_failed(leases_of(&left));
            }
            running.extend(batches.next().map(renew));
        }
        drop(running);
        if let (Some(before), Some(synced)) = (replication, synced) {
            settled &= self.confirm_replicated(node, before, synced).await;
        }
        crate::metrics::renewal_round(started.elapsed());
        settled
    }

    /// Confirms the leases a round of node `node` renewed once its replicas have the
    /// renewals (`--sync-replicas`): a renewal only the primary had would not outlive
    /// its failover, the promoted replica letting the lock expire a renewal period or
    /// more before its holder was told. When they do not within the sync timeout, none
    /// is confirmed: the round is tried again after [`retry_delay`], and a lease whose
    /// last acknowledged renewal runs out is told lost, as when Redis is away. `before`
    /// is the node's replication as the round began: a failover since then may have
    /// lost what the round wrote. A lease whose slot the round's client no longer
    /// routes to the node was renewed elsewhere (see `routes_to`): it waits for the
    /// retry, grouped anew.
    async fn confirm_replicated(&self, node: &str, before: Result<Replication, Error>, synced: Synced) -> bool {
        let Synced { client, held } = synced;
        let held = held.into_inner().unwrap_or_else(|e| e.into_inner());
        if held.is_empty() {
            return true;
        }
        let replicated = match before {
            Ok(before) => self.inner.backend.replicated(&client, node, &before).await,
            Err(e) => Err(e),
        };
        let (here, elsewhere): (Vec<HeldLease>, Vec<HeldLease>) = match replicated {
            Ok(true) => held.into_iter().partition(|h| routes_to(&client, h.slot, node)),
            _ => (Vec::new(), held),
        };
        let mut leases = self.inner.lock();
        for HeldLease { id, part, asked, .. } in here {
            leases.confirm(id, part, asked);
        }
        drop(leases);
        if elsewhere.is_empty() {
            return true;
        }
        let leases = elsewhere.iter().map(|h| h.id).collect::<HashSet<_>>().len();
        crate::metrics::renewal_failed(leases);
        if let Some(left_out) = UNREPLICATED.due() {
            match replicated {
                Err(e) => tracing::warn!(error = %e, leases, left_out, "lease renewals not confirmed: cannot tell whether the replicas have them"),
                Ok(false) => tracing::warn!(leases, left_out, "lease renewals not acknowledged by the replicas --sync-replicas asks for (or a failover came between): not confirmed"),
                Ok(true) => tracing::info!(leases, left_out, "lease renewals made on a node their slot has left: confirmed at the retry"),
            }
        }
        false
    }

    /// Stops renewing the leases whose caller `policy` no longer lets acquire each of
    /// their names, and tells their streams: a stream that HTTP/2 does not poll (its
    /// client gives no flow-control credit) would otherwise keep its lock renewed, its
    /// own check of the reload never run. Redis lets such a lock expire within a
    /// timeout; a stream that is polled releases it at once. The checks (each looks the
    /// credential up among all the policy's tokens, leases × tokens in all) run with the
    /// lease table let go: under it, no grant could register meanwhile. Those registered
    /// during the checks are checked with it held again.
    pub fn revoke_where_refused(&self, policy: &Policy) {
        let refused = |caller: &Caller, req: &Request| {
            let names = req.all_keys().iter().map(|k| k.name());
            crate::auth::still_allowed(caller, policy, Action::Acquire, names).is_err()
        };
        let held: Vec<(u64, Arc<Caller>, Arc<Request>)> = (self.inner.lock().entries.iter())
            .filter(|(_, e)| !e.revoked)
            .filter_map(|(id, e)| Some((*id, e.caller.clone()?, e.req.clone())))
            .collect();
        let checked: HashSet<u64> = held.iter().map(|(id, ..)| *id).collect();
        let mut revoked: Vec<u64> = (held.into_iter())
            .filter(|(_, caller, req)| refused(caller, req))
            .map(|(id, ..)| id)
            .collect();
        let mut leases = self.inner.lock();
        // Leases registered during the check are checked here (few).
        let since = (leases.entries.iter()).filter(|(id, e)| !e.revoked && !checked.contains(id));
        let refused_since = since.filter(|(_, e)| e.caller.as_deref().is_some_and(|c| refused(c, &e.req)));
        revoked.extend(refused_since.map(|(id, _)| *id));
        for id in revoked {
            if let Some(entry) = leases.entries.get_mut(&id).filter(|e| !e.revoked) {
                entry.revoked = true;
                entry.report(LostReason::Revoked, 0);
            }
        }
    }

    /// Revokes the leases each reload of `policies` refuses (`revoke_where_refused`),
    /// until the server stops; off the async threads, as many checks take long.
    pub async fn follow_policies(
        self,
        mut policies: tokio::sync::watch::Receiver<Arc<Policy>>,
        stop: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                changed = policies.changed() => if changed.is_err() { return },
            }
            let policy = policies.borrow_and_update().clone();
            let watchdog = self.clone();
            let _ = tokio::task::spawn_blocking(move || watchdog.revoke_where_refused(&policy)).await;
        }
    }

    /// The renewals of the leases `wanted` picks, one per name; with `unconfirmed_since`,
    /// only of the names Redis has not confirmed since then. Only the picking holds the
    /// lease table: each renewal's keys (several strings per name, and its slot) are
    /// built after it is let go. Built under it, 100 000 leases held it 115–145 ms a
    /// round (12–17 ms now), every grant's registration and every release waiting.
    fn due(&self, wanted: impl Fn(&Entry) -> bool, unconfirmed_since: Option<Instant>) -> Vec<Due> {
        let picked: Vec<Picked> = self
            .inner
            .lock()
            .entries
            .iter()
            .filter(|(_, e)| wanted(e) && e.renewable())
            // A retry builds no renewal for a lease the round confirmed whole.
            .filter(|(_, e)| unconfirmed_since.is_none_or(|since| e.oldest_confirmation().1 < since))
            .map(|(id, e)| e.picked(*id, unconfirmed_since))
            .collect();
        picked.into_iter().flat_map(Picked::due).collect()
    }

    /// Renews RedLock leases, and checks the fixed ones, every third of the timeout, on a
    /// loop of their own: a RedLock node that stops answering (a minority RedLock
    /// tolerates) must never hold up the main Redis's rounds. A fixed lease is checked as
    /// the main Redis's are: a majority of nodes that lost the lock (restarted empty,
    /// flushed) may grant it to another at once. The leases a round could neither
    /// confirm nor find gone (no majority answered) are tried again after
    /// [`retry_delay`], as the main Redis's are: a majority back after a pause of two
    /// rounds must find them renewed, not told lost while every node still holds them.
    async fn redlock_renewals(&self, stop: CancellationToken) {
        if self.inner.backend.redlock_nodes().is_empty() {
            return;
        }
        let period = self.inner.timeout / 3;
        let retry = retry_delay(self.inner.timeout);
        // On a fixed schedule: a round's length does not push the next one back.
        let mut rounds = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        rounds.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut round_started = Instant::now();
        let mut retry_at: Option<tokio::time::Instant> = None;
        loop {
            let unconfirmed_since = tokio::select! {
                _ = stop.cancelled() => return,
                _ = rounds.tick() => {
                    round_started = Instant::now();
                    self.inner.lock().redlock_round_started = Some(round_started);
                    None
                }
                _ = tokio::time::sleep_until(retry_at.unwrap_or_else(tokio::time::Instant::now)), if retry_at.is_some() => {
                    Some(round_started)
                }
                _ = self.inner.recheck.late_redlock.notified() => Some(round_started),
            };
            retry_at = None;
            if !self.renew_redlock(unconfirmed_since).await {
                retry_at = Some(tokio::time::Instant::now() + retry);
            }
        }
    }

    /// One RedLock round (with `unconfirmed_since`, a retry of the leases not confirmed
    /// since then): every chunk on every node at once, each call bounded by the
    /// per-node timeout of a lease. A lease stays held while a majority renewed (or, a
    /// fixed one, still holds) it. False when some lease was left unsettled: neither
    /// renewed nor found gone by a majority.
    async fn renew_redlock(&self, unconfirmed_since: Option<Instant>) -> bool {
        let due = self.due(|e| e.req.redlock, unconfirmed_since);
        if due.is_empty() {
            return true;
        }
        let asked = Instant::now();
        let (held, gone) = self.redlock_answers(&due).await;
        crate::metrics::renewal_round(asked.elapsed());
        let nodes = self.inner.backend.redlock_nodes().len();
        let quorum = crate::lock::redlock::quorum(nodes);
        crate::metrics::renewed(renewed(&due, held.iter().map(|n| *n >= quorum)));
        let unanswered: Vec<&Due> = due
            .iter()
            .zip(held.iter().zip(&gone))
            .filter(|(_, (h, g))| **h < quorum && **g <= nodes - quorum)
            .map(|(d, _)| d)
            .collect();
        crate::metrics::renewal_failed(leases_of(unanswered.iter().copied()));
        let settled = unanswered.is_empty();
        let mut leases = self.inner.lock();
        for ((d, held), gone) in due.iter().zip(held).zip(gone) {
            let Some(entry) = leases.entries.get_mut(&d.id) else {
                continue;
            };
            if gone > nodes - quorum {
                // A majority can no longer hold it.
                entry.report(LostReason::NotHeld, d.part);
            } else if held >= quorum {
                let gap = entry.confirm(d.part, asked);
                leases.confirmed_after(gap);
            }
        }
        settled
    }

    /// Per lease of `due`: how many nodes renewed it, and how many answered it is gone.
    /// A node that did not answer in time counts as neither; the expiry check covers a
    /// long silence. So does a node that counts for no majority (it leads to another
    /// node's Redis, or one not yet told apart): its answers would count that Redis twice.
    async fn redlock_answers(&self, due: &[Due]) -> (Vec<usize>, Vec<usize>) {
        let backend = &self.inner.backend;
        let script = &backend.redlock_scripts().renew_one_slot;
        let limit = crate::lock::redlock::node_timeout(self.inner.timeout);
        let calls = due.chunks(RENEW_BATCH).enumerate().flat_map(|(i, batch)| {
            let counted = backend.redlock_nodes().iter().enumerate();
            counted
                .filter(|(n, _)| backend.redlock_counts(*n))
                .map(move |(_, node)| async move {
                    let answer =
                        crate::lock::redlock::within(script, limit, self.call_on(&node.client, script, batch)).await;
                    (i * RENEW_BATCH, batch.len(), answer)
                })
        });
        let mut held = vec![0usize; due.len()];
        let mut gone = vec![0usize; due.len()];
        for (start, n, answer) in futures::future::join_all(calls).await {
            let Ok(answer) = answer else { continue };
            for (i, outcome) in answer.outcomes(n).into_iter().enumerate() {
                // A renewal the node refused counts as an answer neither way.
                match outcome {
                    Outcome::Held => held[start + i] += 1,
                    Outcome::Lost(_) => gone[start + i] += 1,
                    Outcome::Failed | Outcome::Unsent => {}
                }
            }
        }
        (held, gone)
    }

    /// Reports leases Redis has not confirmed for (nearly) a whole timeout: their lock
    /// has expired there, or is about to, whatever happens next.
    fn expire_unconfirmed(&self) {
        let now = Instant::now();
        let limit = notice_limit(self.inner.timeout, self.inner.redis_timeout, false);
        let redlock_limit = notice_limit(self.inner.timeout, self.inner.redis_timeout, true);
        let mut leases = self.inner.lock();
        // A grant asked before a break it has not been registered for after a whole
        // timeout has expired in Redis anyway.
        let timeout = self.inner.timeout;
        leases
            .breaks
            .retain(|_, (_, heard)| now.duration_since(*heard) < timeout);
        let mut told = 0;
        for entry in leases.entries.values_mut() {
            let limit = if entry.req.redlock { redlock_limit } else { limit };
            let (part, confirmed) = entry.oldest_confirmation();
            if entry.renew && now.duration_since(confirmed) >= limit {
                told += usize::from(entry.report(LostReason::NotHeld, part));
            }
        }
        drop(leases);
        unconfirmed(told);
    }

    async fn renew_batch(&self, batch: Vec<Due>, synced: Option<&Synced>) -> Batch {
        let backend = &self.inner.backend;
        let asked = Instant::now();
        let settled = |ok: bool| if ok { Batch::Settled } else { Batch::Unsettled };
        match self.call(synced, &backend.scripts().renew, &batch).await {
            Ok(answer) => {
                // On a cluster the refused leases are told of by their own slots' calls.
                let failed = self.confirm(&batch, answer, asked, !backend.is_cluster(), synced);
                if failed.is_empty() || !backend.is_cluster() {
                    return settled(failed.is_empty());
                }
                // A lease whose slot moved away from a node that still serves the batch's
                // first is refused alone there ("non local key"), and the call, routed
                // by that first lease, is redirected nowhere: the refused leases go again
                // in calls of their own slots, which are (and teach the Redis client the
                // new slot map).
                let mut failed = failed.into_iter().peekable();
                let refused = (batch.into_iter().enumerate())
                    .filter(|(i, _)| failed.next_if_eq(i).is_some())
                    .map(|(_, d)| d)
                    .collect();
                settled(self.renew_by_slot(refused, synced).await)
            }
            // A slot may have moved under a node-wide batch: fall back to one call per slot.
            // Not for a node that did not answer in time, nor one that refused the call as
            // a whole: each slot's call would wait out the timeout there too, or be
            // refused alike, a call per slot of the batch (nearly one per lease) at every
            // retry; the round is tried again as a whole.
            Err(e) if backend.is_cluster() && slot_moved(&e) => settled(self.renew_by_slot(batch, synced).await),
            Err(e) => {
                tracing::warn!(error = %e, leases = batch.len(), "lease renewal failed");
                crate::metrics::renewal_failed(leases_of(&batch));
                if timed_out(&e) {
                    Batch::Unanswered
                } else {
                    Batch::Unsettled
                }
            }
        }
    }

    /// One call per slot, [`SLOT_CALLS`] at a time: one after another, a node that does
    /// not answer would cost each slot the Redis timeout in turn.
    async fn renew_by_slot(&self, batch: Vec<Due>, synced: Option<&Synced>) -> bool {
        let mut by_slot: HashMap<u16, Vec<Due>> = HashMap::new();
        for d in batch {
            by_slot.entry(d.slot).or_default().push(d);
        }
        let calls = by_slot.into_values().map(|group| async move {
            let asked = Instant::now();
            match self
                .call(synced, &self.inner.backend.scripts().renew_one_slot, &group)
                .await
            {
                Ok(answer) => self.confirm(&group, answer, asked, true, synced).is_empty(),
                Err(e) => {
                    tracing::warn!(error = %e, leases = group.len(), "lease renewal failed");
                    crate::metrics::renewal_failed(leases_of(&group));
                    false
                }
            }
        });
        let results: Vec<bool> = futures::stream::iter(calls)
            .buffer_unordered(SLOT_CALLS)
            .collect()
            .await;
        results.into_iter().all(|ok| ok)
    }

    /// Renews `batch` on the main Redis: through the round's client with
    /// `--sync-replicas`, else the pool's next.
    async fn call(
        &self,
        synced: Option<&Synced>,
        script: &crate::scripts::Script,
        batch: &[Due],
    ) -> Result<Renewed, crate::error::Error> {
        // One connection of the pool for the call: a script redirected after a slot moved
        // goes once more on the connection that learned the new map (`Script::loaded`).
        let client = synced.map_or_else(|| self.inner.backend.pool().next_connected(), |s| &s.client);
        self.call_on(client, script, batch).await
    }

    async fn call_on<C: fred::interfaces::LuaInterface + fred::interfaces::MetricsInterface + Send + Sync>(
        &self,
        client: &C,
        script: &crate::scripts::Script,
        batch: &[Due],
    ) -> Result<Renewed, crate::error::Error> {
        let mut keys: Vec<Key> = Vec::new();
        let mut args = Vec::with_capacity(batch.len() * 7 + 2);
        args.push(Value::from(crate::lock::millis(self.inner.timeout)));
        args.push(Value::from(crate::lock::millis(RECORD_GRACE)));
        // The batch's leases whose stream still lives, by their index in `batch`.
        let mut sent = Vec::with_capacity(batch.len());
        let renewable = self.still_renewable(batch);
        for (i, d) in batch.iter().enumerate().filter(|(i, _)| renewable[*i]) {
            let Some(r) = d.renewal() else { continue };
            if keys.is_empty() {
                keys = vec![r.lock.as_str().into(), r.fence.as_str().into()];
            }
            args.push(Value::from(if d.check_only { check_tag(r.tag) } else { r.tag }));
            args.extend([r.lock, r.hold, r.fence, r.field, r.extra].map(Value::from));
            args.push(Value::from(d.token.to_string()));
            sent.push(i);
        }
        if sent.is_empty() {
            return Ok(Renewed::default().of_sent(&sent, batch.len()));
        }
        let answer: Renewed = self.inner.backend.eval_on(client, script, keys, args).await?;
        Ok(answer.of_sent(&sent, batch.len()))
    }

    /// Which of `batch`'s leases are still to be renewed. A batch is built once the
    /// batches ahead of it answered, when Redis is slow long after its round picked
    /// its leases: one told lost or revoked meanwhile is renewed no more (its lock
    /// would otherwise be held for nobody a timeout longer).
    fn still_renewable(&self, batch: &[Due]) -> Vec<bool> {
        let leases = self.inner.lock();
        (batch.iter())
            .map(|d| leases.entries.get(&d.id).is_some_and(Entry::renewable))
            .collect()
    }

    /// Records a batch's answer: the leases it found lost are reported, those whose
    /// renewal Redis refused are left for the retry (logged and counted when
    /// `report_refused`), the others are confirmed as of `asked`, or, renewed ones,
    /// held in `synced` until the replicas have them (`--sync-replicas`; a fixed lease is
    /// not renewed: its confirmation counts for nothing). Returns the refused ones'
    /// indexes in `batch`, in order.
    fn confirm(
        &self,
        batch: &[Due],
        answer: Renewed,
        asked: Instant,
        report_refused: bool,
        synced: Option<&Synced>,
    ) -> Vec<usize> {
        let outcomes = answer.outcomes(batch.len());
        let failed: Vec<usize> = (outcomes.iter().enumerate())
            .filter(|(_, o)| **o == Outcome::Failed)
            .map(|(i, _)| i)
            .collect();
        if let Some(&first) = failed.first().filter(|_| report_refused) {
            let error = answer.error.as_deref().unwrap_or("");
            let lock = batch[first].renewal().map(|r| r.lock).unwrap_or_default();
            tracing::warn!(error, leases = failed.len(), %lock, "redis refused lease renewals");
            crate::metrics::renewal_failed(leases_of(failed.iter().map(|&i| &batch[i])));
        }
        crate::metrics::renewed(renewed(batch, outcomes.iter().map(|o| *o == Outcome::Held)));
        let mut leases = self.inner.lock();
        for (d, outcome) in batch.iter().zip(outcomes) {
            // A lease released meanwhile is no longer registered: nothing to report.
            let Some(entry) = leases.entries.get_mut(&d.id) else {
                continue;
            };
            match (outcome, synced.filter(|_| !d.check_only)) {
                (Outcome::Held, Some(synced)) => {
                    synced.held.lock().unwrap_or_else(|e| e.into_inner()).push(HeldLease {
                        id: d.id,
                        part: d.part,
                        slot: d.slot,
                        asked,
                    })
                }
                (Outcome::Held, None) => {
                    let gap = entry.confirm(d.part, asked);
                    leases.confirmed_after(gap);
                }
                (Outcome::Lost(reason), _) => {
                    entry.report(reason, d.part);
                }
                (Outcome::Failed | Outcome::Unsent, _) => {}
            }
        }
        failed
    }

    /// Tells the leases ForceRelease broke on the lock key `key`: those holding it with
    /// a token at or below the break's `floor`.
    pub fn force_released(&self, key: &str, floor: u64) {
        let mut leases = self.inner.lock();
        let heard = Instant::now();
        let kept = leases.breaks.entry(key.to_owned()).or_insert((floor, heard));
        *kept = (kept.0.max(floor), heard);
        for id in leases.holding(key) {
            let entry = leases.entries.get_mut(&id).filter(|e| e.broken_by(key, floor));
            if let Some(entry) = entry {
                let part = entry.part_of(key).unwrap_or(0);
                entry.report(LostReason::ForceReleased, part);
            }
        }
    }
}

/// How many leases of `batch` a round renewed (`kept` by lease): a fixed lease is only
/// checked, not renewed. A multi-lock counts once, by its first name.
fn renewed(batch: &[Due], kept: impl Iterator<Item = bool>) -> usize {
    batch
        .iter()
        .zip(kept)
        .filter(|(d, kept)| *kept && !d.check_only && d.part == 0)
        .count()
}

/// Whether a node-wide batch failed for where its slots are served: its first lease's
/// slot moved (a redirection), or is being migrated. Calls of each slot get past that;
/// not past a node that refuses every call (`NOREPLICAS`, `MISCONF`, `LOADING`,
/// `CLUSTERDOWN`, its queue full), nor one that does not answer.
fn slot_moved(e: &crate::error::Error) -> bool {
    let crate::error::Error::Redis(e) = e else {
        return false;
    };
    let details = e.details().trim_start();
    crate::redis::redirected(e)
        || ["MOVED", "ASK", "TRYAGAIN", "CROSSSLOT"]
            .iter()
            .any(|code| details.starts_with(code))
        || details.contains("non local key")
}

/// Whether a call failed for want of an answer in time (`--redis-timeout`).
fn timed_out(e: &crate::error::Error) -> bool {
    matches!(e, crate::error::Error::Redis(e) if *e.kind() == fred::error::ErrorKind::Timeout)
}

/// How many renewed leases `batch` holds, a multi-lock once whichever of its names it
/// holds (a failed batch of a multi-lock's later names counts it failed); a fixed
/// lease, only checked, not at all (as in `renewed`).
fn leases_of<'a>(batch: impl IntoIterator<Item = &'a Due>) -> usize {
    batch
        .into_iter()
        .filter(|d| !d.check_only)
        .map(|d| d.id)
        .collect::<HashSet<_>>()
        .len()
}

/// `renew.lua`'s answer for a batch.
#[derive(Debug, Default)]
struct Renewed {
    /// The 1-based indexes of the leases no longer held, negated for those
    /// ForceRelease broke (the break's notice may never have reached this server: a
    /// subscription not yet made, or made again after a reconnect).
    lost: Vec<i64>,
    /// The 1-based indexes of the leases whose renewal Redis refused.
    failed: Vec<i64>,
    /// The first refusal's text.
    error: Option<String>,
    /// The 0-based indexes of the batch's leases the call left out (`of_sent`).
    unsent: Vec<usize>,
}

/// What became of one lease of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Held,
    Lost(LostReason),
    /// Neither renewed nor found gone: Redis refused its renewal.
    Failed,
    /// Left out of the call: told lost or revoked after its round picked it. Neither
    /// confirmed nor retried (a confirmation would count a renewal that never was).
    Unsent,
}

impl Renewed {
    /// The answer of a call that carried only the batch's leases at `sent` (their
    /// indexes in a batch of `n`), told by their indexes in the batch; the others read
    /// as unsent.
    fn of_sent(mut self, sent: &[usize], n: usize) -> Self {
        let in_batch = |i: &mut i64| {
            let at = (i.unsigned_abs().checked_sub(1))
                .and_then(|k| usize::try_from(k).ok())
                .and_then(|k| sent.get(k));
            if let Some(at) = at.and_then(|&at| i64::try_from(at + 1).ok()) {
                *i = i.signum() * at;
            }
        };
        self.lost.iter_mut().chain(self.failed.iter_mut()).for_each(in_batch);
        // `sent` rises: the indexes missing from it, in one pass.
        let mut sent = sent.iter().copied().peekable();
        self.unsent = (0..n).filter(|&i| sent.next_if_eq(&i).is_none()).collect();
        self
    }

    /// The outcome of each of the batch's `n` leases.
    fn outcomes(&self, n: usize) -> Vec<Outcome> {
        let mut outcomes = vec![Outcome::Held; n];
        let lost = self.lost.iter().map(|&i| {
            let reason = if i < 0 {
                LostReason::ForceReleased
            } else {
                LostReason::NotHeld
            };
            (i, Outcome::Lost(reason))
        });
        for (i, outcome) in lost.chain(self.failed.iter().map(|&i| (i, Outcome::Failed))) {
            let index = i.unsigned_abs().checked_sub(1).and_then(|i| usize::try_from(i).ok());
            if let Some(slot) = index.and_then(|i| outcomes.get_mut(i)) {
                *slot = outcome;
            }
        }
        for &i in &self.unsent {
            if let Some(slot) = outcomes.get_mut(i) {
                *slot = Outcome::Unsent;
            }
        }
        outcomes
    }
}

impl FromValue for Renewed {
    fn from_value(value: Value) -> Result<Self, fred::error::Error> {
        let Value::Array(parts) = value else {
            let kind = fred::error::ErrorKind::Parse;
            return Err(fred::error::Error::new(kind, format!("renewal answer: {value:?}")));
        };
        let mut parts = parts.into_iter();
        let mut next = || parts.next().unwrap_or(Value::Null);
        Ok(Self {
            lost: next().convert()?,
            failed: next().convert()?,
            error: next().convert()?,
            unsent: Vec::new(),
        })
    }
}

/// The tag under which `renew.lua` checks a lease without extending it: in capitals.
fn check_tag(tag: &'static str) -> &'static str {
    match tag {
        "h" => "H",
        "w" => "W",
        "r" => "R",
        "s" => "S",
        other => other,
    }
}

fn chunked(group: Vec<Due>) -> Vec<Vec<Due>> {
    let mut out = Vec::with_capacity(group.len() / RENEW_BATCH + 1);
    let mut it = group.into_iter().peekable();
    while it.peek().is_some() {
        out.push(it.by_ref().take(RENEW_BATCH).collect());
    }
    out
}

impl Entry {
    /// What a round needs of the lease to renew its names (those Redis has not
    /// confirmed since `unconfirmed_since`, if given).
    fn picked(&self, id: u64, unconfirmed_since: Option<Instant>) -> Picked {
        let due = |part: usize| unconfirmed_since.is_none_or(|since| self.confirmed_at(part) < since);
        let token = |part: usize| self.token_of(part).filter(|_| !self.req.redlock).unwrap_or(0);
        Picked {
            id,
            req: self.req.clone(),
            check_only: !self.renew,
            first: due(0).then(|| token(0)),
            others: (1..self.req.all_keys().len())
                .filter(|&part| due(part))
                .map(|part| (part, token(part)))
                .collect(),
        }
    }

    /// The lease's token on name `part` (its index in `Request::all_keys`).
    fn token_of(&self, part: usize) -> Option<u64> {
        match part.checked_sub(1) {
            None => Some(self.token),
            Some(other) => self.other_tokens.get(other).copied(),
        }
    }

    /// The name Redis confirmed least recently (its part), and when.
    fn oldest_confirmation(&self) -> (usize, Instant) {
        let others = self.others_renewed_at.iter().enumerate();
        others.fold((0, self.renewed_at), |oldest, (i, at)| match *at < oldest.1 {
            true => (i + 1, *at),
            false => oldest,
        })
    }

    /// When Redis last confirmed name `part` of the lease.
    fn confirmed_at(&self, part: usize) -> Instant {
        match part.checked_sub(1) {
            None => self.renewed_at,
            Some(other) => self.others_renewed_at.get(other).copied().unwrap_or(self.renewed_at),
        }
    }

    /// Redis confirmed name `part` of the lease as of `asked`; answers how long after
    /// the last confirmation.
    fn confirm(&mut self, part: usize, asked: Instant) -> Duration {
        let last = match part.checked_sub(1) {
            None => &mut self.renewed_at,
            Some(other) => match self.others_renewed_at.get_mut(other) {
                Some(at) => at,
                None => return Duration::ZERO,
            },
        };
        let gap = asked.saturating_duration_since(*last);
        *last = asked;
        gap
    }

    /// The lease's token on the lock key `key`, if it holds that key.
    fn token_on(&self, key: &str) -> Option<u64> {
        self.token_of(self.part_of(key)?)
    }

    /// Which of the lease's names has the lock key `key`.
    fn part_of(&self, key: &str) -> Option<usize> {
        self.req.all_keys().iter().position(|k| k.lock == key)
    }

    /// Whether a ForceRelease of the lock key `key` with the break floor `floor` broke
    /// this lease: it holds `key` with a token at or below the floor. ForceRelease
    /// breaks the main Redis's lock: a RedLock hold of the same name lives on the
    /// RedLock nodes, its tokens theirs.
    fn broken_by(&self, key: &str, floor: u64) -> bool {
        !self.req.redlock && self.token_on(key).is_some_and(|token| token <= floor)
    }

    /// Whether a round renews the lease. Not once told it is lost (or revoked), though
    /// its stream may not yet have ended (one HTTP/2 does not poll): nobody believes
    /// they hold it, and a multi-lock's other names go with the lost one. Nor a pass in
    /// memory not yet recorded, which has no hold record to renew: the relay's
    /// recording writes it, or tells the stream its lease is lost.
    fn renewable(&self) -> bool {
        self.lost.is_some() && !self.revoked && !self.req.awaits_record(self.token)
    }

    /// Tells the lease's stream it is lost (once), and which name `part` was. The lease
    /// is no longer held from then on, though its stream may end much later (a client
    /// that gives no flow-control credit holds it up). True if this was the telling.
    fn report(&mut self, reason: LostReason, part: usize) -> bool {
        let Some(tx) = self.lost.take() else {
            return false;
        };
        let _ = tx.send(Lost { reason, part });
        crate::metrics::leases(-1);
        true
    }
}

/// Leases told lost for want of Redis's confirmation, written to the log: at most one
/// line in 10 s. Each lease's own line says `NOT_HELD`, as a lock gone from Redis does;
/// this one says the cause is the server's renewals, which an outage fails for every
/// lease at once (over a renewal period's sweeps, as their last confirmations spread).
static UNCONFIRMED: crate::repeated::Repeated = crate::repeated::Repeated::new();
/// Leases told lost since the last such line.
static UNCONFIRMED_SINCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Counts `leases` more told lost, Redis not having confirmed them in time, and logs
/// every lease told since the last line once a line is due: called at every sweep, so
/// the leases told just after a line are logged within its 10 s, not with the next
/// outage.
fn unconfirmed(leases: usize) {
    use std::sync::atomic::Ordering::Relaxed;
    let pending = UNCONFIRMED_SINCE.fetch_add(leases as u64, Relaxed) + leases as u64;
    if pending > 0 && UNCONFIRMED.due().is_some() {
        let leases = UNCONFIRMED_SINCE.swap(0, Relaxed);
        tracing::warn!(
            leases,
            "leases told lost: Redis has not confirmed their renewals in time"
        );
    }
}

impl Leases {
    /// Redis confirmed name `part` of lease `id` as of `asked`, if it is still held.
    fn confirm(&mut self, id: u64, part: usize, asked: Instant) {
        if let Some(gap) = self.entries.get_mut(&id).map(|e| e.confirm(part, asked)) {
            self.confirmed_after(gap);
        }
    }

    /// A lease was confirmed `gap` after its last confirmation.
    fn confirmed_after(&mut self, gap: Duration) {
        if gap > self.longest_gap {
            self.longest_gap = gap;
            crate::metrics::renewal_gap(gap);
        }
    }

    /// Lists lease `id` of `req` under each of its lock keys. A RedLock lease is not:
    /// ForceRelease breaks no RedLock hold (see `Entry::broken_by`).
    fn index(&mut self, id: u64, req: &Request) {
        if req.redlock {
            return;
        }
        for key in req.all_keys() {
            self.by_lock.insert((key_hash(&key.lock), id));
        }
    }

    /// Takes lease `id` of `req` off the lists of its lock keys.
    fn unindex(&mut self, id: u64, req: &Request) {
        if req.redlock {
            return;
        }
        for key in req.all_keys() {
            self.by_lock.remove(&(key_hash(&key.lock), id));
        }
    }

    /// The leases that may hold the lock key `key` (those of another key of the same
    /// hash too).
    fn holding(&self, key: &str) -> Vec<u64> {
        let hash = key_hash(key);
        self.by_lock
            .range((hash, 0)..=(hash, u64::MAX))
            .map(|&(_, id)| id)
            .collect()
    }
}

/// A lock key's hash for [`Leases::by_lock`].
fn key_hash(key: &str) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    BuildHasherDefault::<DefaultHasher>::default().hash_one(key)
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Leases> {
        // Every change is a single insert or removal, so the map stays consistent.
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Lease {
    /// Ready once the watchdog finds the lease lost; pending while it is held.
    pub fn poll_lost(&mut self, cx: &mut Context<'_>) -> Poll<Lost> {
        match Pin::new(&mut self.lost).poll(cx) {
            Poll::Ready(Ok(reason)) => Poll::Ready(reason),
            // The registry never drops a sender without sending.
            Poll::Ready(Err(_)) | Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut inner = self.inner.lock();
        if let Some(entry) = inner.entries.remove(&self.id) {
            inner.entries.shrink_if_sparse();
            inner.unindex(self.id, &entry.req);
            // Unless reported lost, which counted it out.
            if entry.lost.is_some() {
                crate::metrics::leases(-1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_negated_index_is_a_broken_lease_and_a_failed_one_neither_held_nor_lost() {
        let answer = Renewed {
            lost: vec![2, -4, 0, 9, -9],
            failed: vec![5, 0, 7],
            error: Some("OOM command not allowed".to_owned()),
            unsent: Vec::new(),
        };
        let (held, not_held, broken) = (
            Outcome::Held,
            Outcome::Lost(LostReason::NotHeld),
            Outcome::Lost(LostReason::ForceReleased),
        );
        assert_eq!(answer.outcomes(5), [held, not_held, held, broken, Outcome::Failed]);
    }

    /// `renew.lua` answers `{lost, failed}`, and the first refusal's text when one was.
    #[test]
    fn a_renewal_answer_is_read_with_or_without_a_refusal() {
        let ints = |v: &[i64]| Value::Array(v.iter().map(|&i| Value::Integer(i)).collect());
        let answer = Renewed::from_value(Value::Array(vec![ints(&[1, -2]), ints(&[])])).unwrap();
        assert_eq!((answer.lost, answer.failed, answer.error), (vec![1, -2], vec![], None));
        let refused = Value::Array(vec![ints(&[]), ints(&[3]), Value::from("OOM command not allowed")]);
        let answer = Renewed::from_value(refused).unwrap();
        assert_eq!(answer.failed, [3]);
        assert_eq!(answer.error.as_deref(), Some("OOM command not allowed"));
        assert!(Renewed::from_value(Value::Integer(1)).is_err(), "not an answer");
    }

    /// A round's leases keep no stream's request alive: a claim grant nobody takes is
    /// given back only once its stream's request is gone, and a round (seconds for
    /// 100 000 leases, longer against a silent node) would hold that back.
    #[test]
    fn a_round_keeps_no_request_alive() {
        let open = latchkey_proto::v1::Open {
            name: "a".into(),
            ..Default::default()
        };
        let req = crate::service::validate::open(open, &crate::keys::Keys::default(), None, "s:1".into());
        let req = Arc::new(req.expect("a valid request"));
        let picked = Picked {
            id: 1,
            req: req.clone(),
            check_only: false,
            first: Some(7),
            others: Vec::new(),
        };
        let due: Vec<Due> = picked.due().collect();
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].renewal().map(|r| r.lock), Some(req.keys.lock.clone()));
        drop(req);
        assert!(due[0].renewal().is_none(), "the stream's request is gone");
    }

    /// A lease told lost (or revoked) after its round picked it is renewed no more when
    /// its batch is built: behind slow batches that may be seconds later, and its lock
    /// would be held for nobody a timeout longer.
    #[tokio::test]
    async fn a_lease_told_lost_after_its_round_picked_it_is_not_renewed() {
        let config = crate::config::Config::from_args(Vec::<&str>::new()).expect("valid flags");
        let backend = Arc::new(Backend::connect(&config).expect("a backend"));
        let watchdog = Watchdog::new(backend, config.watchdog_timeout, config.redis_timeout);
        let open = latchkey_proto::v1::Open {
            name: "a".into(),
            ..Default::default()
        };
        let req = crate::service::validate::open(open, &crate::keys::Keys::default(), None, "s:1".into());
        let req = Arc::new(req.expect("a valid request"));
        let grant = Grant {
            fencing_token: 7,
            hold_count: 1,
            fencing_tokens: Vec::new(),
            hold_counts: Vec::new(),
        };
        let _lease = watchdog.register(&req, true, &grant, Instant::now(), &Caller::Anyone);
        let picked = watchdog.due(|_| true, None);
        assert_eq!(watchdog.still_renewable(&picked), [true]);
        for entry in watchdog.inner.lock().entries.values_mut() {
            entry.report(LostReason::NotHeld, 0);
        }
        assert_eq!(watchdog.still_renewable(&picked), [false], "told lost since");
    }

    /// A ForceRelease notice finds the leases of its lock key through the index: every
    /// lease holding it (a multi-lock by each of its names), and none once released.
    #[test]
    fn the_leases_of_a_lock_key_are_found_until_released() {
        let request = |name: &str, names: &[&str]| {
            let open = latchkey_proto::v1::Open {
                name: name.into(),
                names: names.iter().map(|n| n.to_string()).collect(),
                ..Default::default()
            };
            let keys = crate::keys::Keys::default();
            crate::service::validate::open(open, &keys, None, "s:1".into()).expect("a valid request")
        };
        let (a, also_a, multi) = (request("a", &[]), request("a", &[]), request("", &["b", "a"]));
        let mut leases = Leases::default();
        leases.index(1, &a);
        leases.index(2, &also_a);
        leases.index(3, &multi);
        let mut holding_a = leases.holding(&a.keys.lock);
        holding_a.sort_unstable();
        assert_eq!(holding_a, [1, 2, 3]);
        let b = &multi.all_keys()[0].lock;
        assert_eq!(leases.holding(b), [3]);
        leases.unindex(1, &a);
        leases.unindex(3, &multi);
        assert_eq!(leases.holding(&a.keys.lock), [2]);
        assert!(leases.holding(b).is_empty());
        leases.unindex(2, &also_a);
        assert!(leases.by_lock.is_empty(), "no key left listed");
    }

    /// With `--sync-replicas` a lease's first renewal is confirmed only after the round's
    /// wait for the replicas: a grant heard so late that the wait would end past its
    /// notice is as good as lapsed (given back `GRANT_LATE`), where without it the
    /// round would have confirmed it in time.
    #[tokio::test]
    async fn with_sync_replicas_a_late_grant_counts_the_replicas_wait() {
        let watchdog = |args: &[&str]| {
            let config = crate::config::Config::from_args(args).expect("valid flags");
            let backend = Arc::new(Backend::connect(&config).expect("a backend"));
            Watchdog::new(backend, config.watchdog_timeout, config.redis_timeout)
        };
        let synced = watchdog(&[
            "--sync-replicas",
            "1",
            "--sync-timeout",
            "300ms",
            "--watchdog-timeout",
            "12s",
        ]);
        let unsynced = watchdog(&["--watchdog-timeout", "12s"]);
        let open = latchkey_proto::v1::Open {
            name: "a".into(),
            ..Default::default()
        };
        let keys = crate::keys::Keys::default();
        let req = crate::service::validate::open(open, &keys, None, "s:1".into()).expect("a valid request");
        // Told lost 8.988 s after its last renewal; the replicas' wait is 1.5 s.
        let from = Instant::now() - Duration::from_secs(8);
        assert!(
            synced.lapsed(&req, from),
            "its first renewal would be confirmed too late"
        );
        assert!(!unsynced.lapsed(&req, from), "without the wait it is still in time");
        assert!(!synced.lapsed(&req, Instant::now() - Duration::from_secs(7)));
    }

    /// A holder passed the lock in memory, whose lease counts from the pass while Redis
    /// counts from the run's last answered call, hears its loss at least half the
    /// margin before Redis may expire the lock, whatever the timeouts. (Passes were
    /// made up to 112 ms after that call, past the whole margin left at 300 ms after the
    /// expiry check's delay.)
    #[test]
    fn a_pass_in_memory_leaves_its_holder_half_the_notice_margin() {
        let ms = Duration::from_millis;
        for timeout in [ms(300), ms(450), ms(1_000), ms(1_500), ms(30_000)] {
            for redis_timeout in [ms(10), ms(50), ms(500), ms(2_000)] {
                let margin = timeout - notice_limit(timeout, redis_timeout, false);
                let late = pass_age_limit(timeout) + expiry_check_every(timeout, redis_timeout);
                assert!(
                    late <= margin / 2,
                    "timeout {timeout:?}, Redis timeout {redis_timeout:?}: told {late:?} late of {margin:?}"
                );
            }
        }
    }

    /// A call that left out leases whose stream ended is read by the batch's indexes.
    #[test]
    fn an_answer_without_the_ended_leases_is_read_by_the_batchs_indexes() {
        let answer = Renewed {
            lost: vec![1, -2],
            failed: vec![3],
            error: None,
            unsent: Vec::new(),
        };
        let answer = answer.of_sent(&[0, 2, 3], 4);
        assert_eq!(
            (answer.lost.as_slice(), answer.failed.as_slice()),
            (&[1, -3][..], &[4][..])
        );
        let outcomes = answer.outcomes(4);
        assert_eq!(outcomes[1], Outcome::Unsent, "left out: neither confirmed nor retried");
        assert_eq!(outcomes[2], Outcome::Lost(LostReason::ForceReleased));
        assert_eq!(outcomes[3], Outcome::Failed);
    }

    /// A multi-lock is one lease in the renewal counters, whichever of its names a
    /// batch holds; a renewed one counts by its first name. A fixed lease, only
    /// checked, counts in neither counter.
    #[test]
    fn a_multi_lock_counts_once() {
        let due = |id: u64, part: usize| Due {
            id,
            check_only: id == 3,
            part,
            slot: 0,
            req: Weak::new(),
            token: 0,
        };
        let batch = [due(1, 0), due(1, 1), due(1, 2), due(2, 0)];
        assert_eq!(leases_of(&batch), 2);
        assert_eq!(leases_of(&batch[1..3]), 1, "a multi-lock's later names alone");
        assert_eq!(renewed(&batch, [true; 4].into_iter()), 2);
        assert_eq!(renewed(&batch[1..3], [true; 2].into_iter()), 0);
        let with_fixed = [due(1, 0), due(3, 0)];
        assert_eq!(
            leases_of(&with_fixed),
            1,
            "a fixed lease's failed check is no failed renewal"
        );
        assert_eq!(renewed(&with_fixed, [true; 2].into_iter()), 1);
    }

    /// A RedLock holder cut off from a majority is told before nodes whose clocks run
    /// fast by the drift allowed can have freed the lock, with as much time to hear it
    /// as a main Redis's holder has before its lock expires: it was told at the main
    /// Redis's margin (which a 10-minute timeout's 6 s drift exceeds), then at the
    /// drift alone for long timeouts, at the moment fast nodes could free the lock.
    #[test]
    fn a_redlock_holder_is_told_before_fast_nodes_free_the_lock() {
        let redis_timeout = Duration::from_secs(2);
        for secs in [3, 30, 150, 600, 3600] {
            let timeout = Duration::from_secs(secs);
            let limit = notice_limit(timeout, redis_timeout, true);
            let fast_expiry = timeout - crate::lock::redlock::drift(timeout);
            let main_slack = timeout - notice_limit(timeout, redis_timeout, false);
            assert!(
                fast_expiry - limit >= main_slack,
                "{timeout:?}: told at {limit:?}, {:?} before fast nodes free the lock",
                fast_expiry - limit
            );
            assert!(limit + expiry_check_every(timeout, redis_timeout) < fast_expiry);
        }
        let main = notice_limit(Duration::from_secs(600), redis_timeout, false);
        assert_eq!(main, Duration::from_millis(596_400));
    }

    /// A holder is told, an expiry check late, before a Redis whose clock runs ahead of
    /// this server's by what NTP may slew (500 ppm) frees the lock, with the Redis
    /// timeout's margin left: a 1-hour timeout with a 100 ms Redis timeout was told
    /// 1 s after such a Redis had freed the lock.
    #[test]
    fn a_holder_is_told_before_a_fast_redis_frees_the_lock() {
        for redis_ms in [10, 100, 2000] {
            let redis_timeout = Duration::from_millis(redis_ms);
            for secs in [3, 30, 1800, 3600, 86_400] {
                let timeout = Duration::from_secs(secs);
                let fast_expiry = timeout - timeout / 2000;
                let latest = notice_limit(timeout, redis_timeout, false) + expiry_check_every(timeout, redis_timeout);
                assert!(
                    latest + redis_timeout.min(timeout / 4) / 2 < fast_expiry,
                    "{redis_timeout:?}, {timeout:?}: told at {latest:?} at the latest, the lock free at {fast_expiry:?}"
                );
            }
        }
    }

    /// A round that failed at once is tried again, and answered, before its leases'
    /// notice, whatever the timeouts, for RedLock leases too (whose notice comes earlier
    /// by the nodes' drift). With a retry a round's period later under a watchdog
    /// timeout of 3 s or less, it came as the notice came due.
    #[test]
    fn a_failed_round_is_tried_again_before_its_leases_notice() {
        for redis_ms in [10, 100, 2000] {
            let redis_timeout = Duration::from_millis(redis_ms);
            for timeout_ms in [300, 1000, 1500, 3000, 6000, 30_000, 600_000] {
                let timeout = Duration::from_millis(timeout_ms);
                // Confirmed by one round, failed by the next a period later, retried,
                // its calls taking up to a hundredth of the timeout.
                let retried = timeout / 3 + retry_delay(timeout) + timeout / 100;
                for redlock in [false, true] {
                    let limit = notice_limit(timeout, redis_timeout, redlock);
                    assert!(
                        retried < limit,
                        "{redis_timeout:?}, {timeout:?}, RedLock {redlock}: retried by {retried:?}, told lost at {limit:?}"
                    );
                }
            }
        }
    }

    /// A notice that comes one expiry check after its limit still leaves its holder
    /// three quarters of the margin before Redis can expire the lock, whatever the
    /// timeouts: with a check every second, a 50 ms Redis timeout and a 30 s watchdog
    /// timeout left about 50 ms of a 1.05 s margin.
    #[test]
    fn a_late_check_leaves_most_of_the_notice_margin() {
        for redis_ms in [10, 50, 500, 2000, 5000] {
            let redis_timeout = Duration::from_millis(redis_ms);
            for timeout_ms in [1000, 1500, 10_000, 30_000, 600_000] {
                let timeout = Duration::from_millis(timeout_ms);
                let limit = notice_limit(timeout, redis_timeout, false);
                let margin = timeout - limit;
                let latest = limit + expiry_check_every(timeout, redis_timeout);
                assert!(
                    timeout - latest >= margin * 3 / 4,
                    "{redis_timeout:?}, {timeout:?}: told at {latest:?} at the latest, of a margin of {margin:?}"
                );
            }
        }
    }
}
