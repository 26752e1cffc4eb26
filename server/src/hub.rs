//! The pub/sub hub: one Redis subscription per lock channel for the whole server,
//! however many local waiters. A message wakes only the local waiters that can
//! proceed: one exclusive waiter, every reader, or as many semaphore waiters as the
//! freed permits fit; each re-checks through its script. A claim's grant (a release
//! on any server gave a mutex waiter here the lock) wakes that waiter alone, with its
//! fencing token; one that no waiter here stands for any more is passed on to be given
//! back ([`Hub::unclaimed`]).
//!
//! Subscriptions are reconciled by one task: waiters only record which channels they
//! need, so subscribe and unsubscribe commands can never be reordered by racing tasks.
//! Once subscribed, it checks that a message of its own comes back (a Redis user may
//! be refused SUBSCRIBE without the Redis client noticing).

use crate::redis::Backend;
use crate::sparse::Sparse;
use fred::clients::{Client, SubscriberClient};
use fred::interfaces::ClientLike;
use fred::interfaces::{ClusterInterface, EventInterface, MetricsInterface, PubsubInterface};
use fred::types::cluster::ClusterRouting;
use fred::types::{ClusterStateChange, Message};
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{broadcast, Notify};
use tokio_util::sync::CancellationToken;

/// How long a failed subscribe waits before it is tried again.
const RETRY_DELAY: Duration = Duration::from_millis(200);
/// How often the subscriber re-reads the cluster's slot map: a slot that moved without
/// a reconnect takes its sharded subscriptions with it (fred does not notice), and this
/// server may send no command for it (its waiters only listen). The subscriptions of
/// the channels that moved follow them, and their waiters look again.
const CLUSTER_CHECK: Duration = Duration::from_secs(2);
/// How often every sharded subscription is sent again, moved or not: a safety net.
const CLUSTER_RESYNC: Duration = Duration::from_secs(30);
/// How often the subscriptions the Redis client tracks are checked against the channels
/// that have waiters: a cluster re-sync sends every tracked one again, including one
/// whose unsubscribe was cut off by a disconnect.
const SWEEP: Duration = Duration::from_secs(5);
/// Channels per SUBSCRIBE or UNSUBSCRIBE command.
const SUBSCRIBE_CHUNK: usize = 500;
/// How often a burst of sharded (un)subscribes looks for room in the Redis client's
/// command queue (see [`paced`]).
const QUEUE_ROOM_PAUSE: Duration = Duration::from_millis(1);
/// How long a burst of sharded (un)subscribes waits for room in the Redis client's
/// command queue before the rest fail, to be retried as any failed (un)subscribe: the
/// client takes nothing from its queue while it reconnects (a master down), and the
/// hub's other work waits for the round.
const QUEUE_ROOM_WAIT: Duration = Duration::from_secs(1);
/// Force-release notices buffered for the watchdog.
const FORCE_BUFFER: usize = 1024;
/// Unclaimed grants buffered for their give-back.
const UNCLAIMED_BUFFER: usize = 1024;
/// What the delivery check publishes on the force-release channel, then the hub's id.
const PROBE_PREFIX: &str = "latchkey:probe:";
/// How long the delivery check waits for its own message.
const PROBE_WAIT: Duration = Duration::from_secs(5);
/// How often the delivery check sends its message again while it waits.
const PROBE_EVERY: Duration = Duration::from_secs(1);
/// How long the delivery check tries to send its message while Redis does not take it.
const PROBE_GIVE_UP: Duration = Duration::from_secs(60);
/// How often channels whose last waiter left are unsubscribed, together: nobody waits
/// for an unsubscribe, and a hot fair lock, whose every waiter has a channel of its
/// own, would otherwise send Redis one UNSUBSCRIBE per grant. (A burst of
/// [`SUBSCRIBE_CHUNK`] goes at once.)
const UNSUBSCRIBE_EVERY: Duration = Duration::from_millis(50);

/// The hub. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Hub {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    changed: Notify,
    next_id: AtomicU64,
    force_channel: String,
    force_tx: broadcast::Sender<Notice>,
    unclaimed_tx: broadcast::Sender<Unclaimed>,
    /// This server's id, which its hold ids start with (`<server id>:<n>`): only its
    /// own claims' grants are passed on.
    server_id: Box<str>,
    /// The delivery check's message, and its arrival.
    probe: String,
    probed: Notify,
    /// Every message comes once per subscriber (a RedLock release publishes on every
    /// node): one while a wake is pending is a copy of the release that made it.
    echoed: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    channels: HashMap<String, Channel>,
    /// Channels that gained their first waiter since the reconciler last ran.
    added: Vec<String>,
    /// Channels that lost their last waiter since the reconciler last ran.
    removed: Vec<String>,
    /// Those of them that were subscribed when their last waiter left: this server
    /// listens there, with nobody waiting, until their unsubscribe goes.
    idle: HashSet<String>,
    /// The subscriber's reconnections heard so far ([`Hub::unready_everyone`]): a
    /// subscription answered before the latest was made on a connection gone since.
    reconnects: u64,
}

/// Whether a channel's subscription is in place, shared by the channel and its
/// waiters. (Not a `watch` channel: its state is 344 bytes, this one's 56; a waiter
/// on a name nobody else here waits for has one, a mutex waiter two: its lock's
/// channel and its presence.)
#[derive(Debug)]
struct Ready {
    subscribed: AtomicBool,
    changed: Notify,
}

impl Ready {
    fn new(subscribed: bool) -> Arc<Self> {
        Arc::new(Self {
            subscribed: AtomicBool::new(subscribed),
            changed: Notify::new(),
        })
    }

    fn get(&self) -> bool {
        self.subscribed.load(Ordering::Acquire)
    }

    fn set(&self, subscribed: bool) {
        self.subscribed.store(subscribed, Ordering::Release);
        if subscribed {
            self.changed.notify_waiters();
        }
    }

    /// Until the subscription is in place. (Registered for the notice before the
    /// check, so a `set` in between is not missed.)
    async fn wait(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.get() {
                return;
            }
            changed.await;
        }
    }
}

#[derive(Debug)]
struct Channel {
    waiters: VecDeque<Arc<Slot>>,
    ready: Arc<Ready>,
    /// The lock of the channel's first waiter (see [`lock_id`]), and whether waiters of
    /// another lock joined since: Redisson's names make one lock's unlock channel
    /// another's fair owner channel (`orders` with owner `w1`, and `{orders}:w1`).
    first_lock: u64,
    mixed: bool,
}

impl Channel {
    fn new(ready: Arc<Ready>) -> Self {
        Self {
            waiters: VecDeque::new(),
            ready,
            first_lock: 0,
            mixed: false,
        }
    }

    fn push(&mut self, slot: Arc<Slot>) {
        if slot.lock != 0 {
            if self.first_lock == 0 {
                self.first_lock = slot.lock;
            }
            self.mixed |= slot.lock != self.first_lock;
        }
        self.waiters.push_back(slot);
    }
}

/// A lock key's short id in the hub, 0 for none (an observer's).
fn lock_id(lock: &str) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault};
    if lock.is_empty() {
        return 0;
    }
    BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
        .hash_one(lock)
        .max(1)
}

/// Counts a waiter in `latchkey_waiters`: Acquire streams waiting for a lock. An
/// observer (a Watch's reader, a waiter's presence) waits for none and is left out.
fn count_waiter(want: Want, delta: i64) {
    if want != Want::Watch {
        crate::metrics::waiters(delta);
    }
}

/// What a waiter needs to proceed, so a message wakes only those who can.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// The lock to itself (mutex, fair, writer).
    Exclusive,
    /// A share of it (reader): every waiting reader can proceed together.
    Shared,
    /// This many semaphore permits.
    Permits(u32),
    /// Nothing: an observer (Watch, or a waiter's presence, see
    /// [`Waiter::present_on`]) that hears every message and never takes a wake-up
    /// from a waiter.
    Watch,
}

#[derive(Debug)]
struct Slot {
    id: u64,
    want: Want,
    /// The lock it waits for ([`lock_id`]).
    lock: u64,
    notify: Notify,
    /// Set by a wake not yet taken, so a waiter that leaves passes it on.
    woken: AtomicBool,
    /// Set by a wake taken whose try has not answered yet: a waiter that leaves then
    /// (its client cancelled during the try) passes the wake on too, as nobody will
    /// read that try's answer and pass it on if it finds the lock taken.
    trying: AtomicBool,
    /// The hold id of a waiter that may be granted by a claim (see `grant_claim` in
    /// `lib.lua`).
    hold: Option<Box<str>>,
    /// The fencing token of a claim's grant not yet taken; 0 for none.
    granted: AtomicU64,
    /// The owner a client named for the waiter: streams of one owner share the lock,
    /// and the grant to one wakes the others ([`Hub::wake_owner`]).
    owner: Option<Box<str>>,
    /// When to look again at the latest, as a claim's grant to another waiter told, and
    /// until when the waiter sleeps (see [`Waiter::sleep_until`]); the word that an
    /// earlier time was told.
    recheck: Mutex<Recheck>,
    retimed: Notify,
}

/// A waiter's times to look again (see [`Waiter::sleep_until`]).
#[derive(Debug, Default)]
struct Recheck {
    /// The earliest end of a lease granted to another waiter's claim, not yet taken.
    by: Option<tokio::time::Instant>,
    /// When the sleeping waiter looks again of its own accord.
    sleeping_until: Option<tokio::time::Instant>,
    /// The end of the holder's lease its last try learned (a single mutex's): should
    /// the waiter leave without the lock, the others for it are told it (see
    /// [`Waiter::learned_end`]).
    learned: Option<tokio::time::Instant>,
}

/// What the watchdog hears from the force-release channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// ForceRelease broke the lock with this key: the holds with a token at or below
    /// `floor` (a notice from a server that sends none: every hold).
    Forced {
        /// The lock key.
        key: String,
        /// The break floor: later grants have tokens above it.
        floor: u64,
    },
    /// The channel is subscribed again after a reconnect: notices sent meanwhile were
    /// missed, so every lease, fixed ones too, should be checked in Redis.
    Missed,
}

/// A claim's grant that no waiter here stands for: its stream left, or a promoted
/// replica kept the claim after the old master had granted it or the waiter's own try
/// had taken the lock. Nobody renews the grant, so it is given back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unclaimed {
    /// The lock key.
    pub lock: String,
    /// The claim's hold id (`<server id>:<n>`).
    pub hold: String,
    /// The owner the lock was granted to.
    pub owner: String,
}

/// A force-release message, `<key>\n<floor>` (`<key>` alone from a server that sends no
/// floor).
fn forced(message: &str) -> Notice {
    let with_floor = message
        .rsplit_once('\n')
        .and_then(|(key, floor)| Some((floor.parse().ok()?, key)));
    let (floor, key) = with_floor.unwrap_or((u64::MAX, message));
    Notice::Forced {
        key: key.to_owned(),
        floor,
    }
}

/// One local waiter, registered on a lock channel until dropped.
#[derive(Debug)]
pub struct Waiter {
    inner: Arc<Inner>,
    channel: String,
    slot: Arc<Slot>,
    ready: Arc<Ready>,
    /// This server's presence on the lock, for a waiter that may leave a claim
    /// ([`Waiter::present_on`]).
    presence: Option<Box<Waiter>>,
}

impl Hub {
    /// A hub of the server `server_id` whose force-release notices arrive on
    /// `force_channel`.
    pub fn new(force_channel: String, server_id: &str) -> Self {
        let (force_tx, _) = broadcast::channel(FORCE_BUFFER);
        let (unclaimed_tx, _) = broadcast::channel(UNCLAIMED_BUFFER);
        Self {
            inner: Arc::new(Inner {
                state: Mutex::default(),
                changed: Notify::new(),
                next_id: AtomicU64::new(1),
                force_channel,
                force_tx,
                unclaimed_tx,
                server_id: server_id.into(),
                probe: format!("{PROBE_PREFIX}{server_id}"),
                probed: Notify::new(),
                echoed: AtomicBool::new(false),
            }),
        }
    }

    /// The id of the server this hub serves.
    pub fn server_id(&self) -> &str {
        &self.inner.server_id
    }

    /// Registers a waiter on `channel` if its subscription is in place already (other
    /// local waiters keep it): a waiter that joins before its first try cannot miss
    /// an unlock that follows the try, so it needs no second try.
    /// The check and the registration are one step under the hub's lock: the last
    /// waiter of the channel leaving in between would unsubscribe it, and this waiter
    /// would then count on a subscription that is not there.
    pub fn join(
        &self,
        channel: &str,
        lock: &str,
        want: Want,
        hold: Option<&str>,
        owner: Option<&str>,
    ) -> Option<Waiter> {
        let mut state = self.inner.lock();
        let ch = state.channels.get_mut(channel).filter(|ch| ch.ready.get())?;
        let slot = self.slot(lock, want, hold, owner);
        ch.push(slot.clone());
        let ready = ch.ready.clone();
        drop(state);
        Some(self.waiter(channel, slot, ready))
    }

    /// Registers a waiter on `channel`; the first waiter of a channel subscribes it.
    /// `lock`: the lock key it waits for ("" for an observer); `hold`: the waiter's
    /// hold id, when a claim's grant may reach it; `owner`: the owner a client named,
    /// if any.
    pub fn register(&self, channel: &str, lock: &str, want: Want, hold: Option<&str>, owner: Option<&str>) -> Waiter {
        let slot = self.slot(lock, want, hold, owner);
        let mut state = self.inner.lock();
        let ready = match state.channels.get_mut(channel) {
            Some(ch) => {
                ch.push(slot.clone());
                ch.ready.clone()
            }
            None => {
                let ready = Ready::new(false);
                let mut ch = Channel::new(ready.clone());
                ch.push(slot.clone());
                state.channels.insert(channel.to_owned(), ch);
                state.added.push(channel.to_owned());
                self.inner.changed.notify_one();
                ready
            }
        };
        drop(state);
        self.waiter(channel, slot, ready)
    }

    /// A new waiter's slot.
    fn slot(&self, lock: &str, want: Want, hold: Option<&str>, owner: Option<&str>) -> Arc<Slot> {
        Arc::new(Slot {
            id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
            want,
            lock: lock_id(lock),
            notify: Notify::new(),
            woken: AtomicBool::new(false),
            trying: AtomicBool::new(false),
            hold: hold.map(Box::from),
            granted: AtomicU64::new(0),
            owner: owner.map(Box::from),
            recheck: Mutex::default(),
            retimed: Notify::new(),
        })
    }

    /// The handle of a slot just added to `channel`'s waiters.
    fn waiter(&self, channel: &str, slot: Arc<Slot>, ready: Arc<Ready>) -> Waiter {
        count_waiter(slot.want, 1);
        Waiter {
            inner: self.inner.clone(),
            channel: channel.to_owned(),
            slot,
            ready,
            presence: None,
        }
    }

    /// Whether this server's subscription to `channel` is in place (confirmed, and not
    /// lost to a reconnect since).
    pub fn listens(&self, channel: &str) -> bool {
        let state = self.inner.lock();
        state.channels.get(channel).is_some_and(|ch| ch.ready.get())
    }

    /// Whether this server's subscription to `channel` is in place (or its unsubscribe
    /// not sent yet) with nobody but observers waiting on it: a release of this server
    /// then passes nobody here over.
    pub fn listens_idle(&self, channel: &str) -> bool {
        let state = self.inner.lock();
        match state.channels.get(channel) {
            Some(ch) => ch.ready.get() && ch.waiters.iter().all(|s| s.want == Want::Watch),
            None => state.idle.contains(channel),
        }
    }

    /// Lock keys named by ForceRelease on any server, and word when such notices may
    /// have been missed (a reconnect).
    pub fn force_released(&self) -> broadcast::Receiver<Notice> {
        self.inner.force_tx.subscribe()
    }

    /// Grants of this server's claims that no waiter here took.
    pub fn unclaimed(&self) -> broadcast::Receiver<Unclaimed> {
        self.inner.unclaimed_tx.subscribe()
    }

    /// Runs the reconciler and a message reader per subscriber until `stop` is cancelled.
    /// The readers' receivers are taken here, before the first subscription: a message
    /// (the delivery check's own, at start) that came before a spawned reader first ran
    /// would otherwise be lost.
    pub async fn run(self, feed: Feed, stop: CancellationToken) {
        self.inner.echoed.store(feed.subscribers.len() > 1, Ordering::Release);
        let readers: Vec<_> = feed
            .subscribers
            .iter()
            .map(|sub| {
                let (messages, reconnects) = (sub.message_rx(), sub.reconnect_rx());
                tokio::spawn(self.clone().read(messages, reconnects, stop.clone()))
            })
            .collect();
        // A reader that panicked would leave its connection's messages undelivered and
        // every waiter to its recheck: the hub ends with it, and the server stops.
        let readers = async {
            if let Err(e) = futures::future::try_join_all(readers).await {
                if e.is_panic() {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        };
        tokio::join!(self.reconcile(&feed, stop), readers);
    }

    /// Delivers messages: lock channels wake waiters, the force-release channel goes
    /// to the watchdog. A lagging or reconnected subscriber wakes everyone to re-check.
    async fn read(
        self,
        mut messages: broadcast::Receiver<Message>,
        mut reconnects: broadcast::Receiver<fred::types::config::Server>,
        stop: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                msg = messages.recv() => match msg {
                    Ok(msg) => self.deliver(msg),
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "pub/sub reader lagged; waking every waiter");
                        // ForceRelease notices may be among those missed.
                        let _ = self.inner.force_tx.send(Notice::Missed);
                        self.wake_everyone();
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                Ok(_) = reconnects.recv() => {
                    // Counted as everything is unready: the reconciler, once told,
                    // subscribes them again and marks them ready.
                    self.unready_everyone();
                    self.inner.changed.notify_one();
                    self.wake_everyone();
                }
            }
        }
    }

    fn deliver(&self, msg: Message) {
        if *msg.channel == *self.inner.force_channel {
            match msg.value.as_string() {
                Some(m) if m == self.inner.probe => self.inner.probed.notify_one(),
                // Every server hears every server's delivery check: one line, where a
                // break's message is two (a lock's key, which holds no control
                // character, may start as a check does).
                Some(m) if m.starts_with(PROBE_PREFIX) && !m.contains('\n') => {}
                Some(m) => {
                    let _ = self.inner.force_tx.send(forced(&m));
                }
                None => {}
            }
            return;
        }
        let value = msg.value.as_string();
        if let Some(grant) = value.as_deref().and_then(claim_granted) {
            // Looked for even when the channel has no waiter left: its subscription
            // outlives the last one a moment.
            let taken = (self.inner.lock().channels.get(&*msg.channel)).is_some_and(|ch| grant_claim(ch, &grant));
            let unclaimed = !taken && *self.inner.server_id == *server_of(grant.hold);
            if let (true, Some((lock, owner))) = (unclaimed, grant.holder) {
                let _ = self.inner.unclaimed_tx.send(Unclaimed {
                    lock: lock.to_owned(),
                    hold: grant.hold.to_owned(),
                    owner: owner.to_owned(),
                });
            }
            return;
        }
        let mut state = self.inner.lock();
        let Some(ch) = state.channels.get_mut(&*msg.channel) else {
            return;
        };
        // Semaphore messages carry the permits now free; others carry no count.
        let echoed = self.inner.echoed.load(Ordering::Acquire);
        on_message(ch, value.and_then(|v| v.parse::<u32>().ok()), echoed);
    }

    /// Whether a waiter whose client named its owner waits on `channel` here.
    pub fn has_named_owners(&self, channel: &str) -> bool {
        let state = self.inner.lock();
        state
            .channels
            .get(channel)
            .is_some_and(|ch| ch.waiters.iter().any(|s| s.want != Want::Watch && s.owner.is_some()))
    }

    /// Wakes the waiters on `channel` whose client named `owner`: another stream of that
    /// owner was just granted the lock, which they now reenter (a handoff or a try
    /// publishes nothing, and an unlock message wakes one writer, not every stream of an
    /// owner).
    pub fn wake_owner(&self, channel: &str, owner: &str) {
        let state = self.inner.lock();
        if let Some(ch) = state.channels.get(channel) {
            ch.waiters
                .iter()
                .filter(|s| s.want != Want::Watch && s.owner.as_deref() == Some(owner))
                .for_each(|s| s.wake());
        }
    }

    fn wake_everyone(&self) {
        let mut state = self.inner.lock();
        for ch in state.channels.values_mut() {
            for slot in &ch.waiters {
                slot.wake();
            }
        }
    }

    /// After a reconnect the hub, not the Redis client, subscribes again: it knows which
    /// channels still have waiters. Whether the subscriber reconnected since `handled`
    /// (which it then catches up); every channel is then queued, and in `again`, for
    /// its waiters to check once it is subscribed once more.
    fn resubscribe_after_reconnect(&self, handled: &mut u64, again: &mut HashSet<String>) -> bool {
        let mut state = self.inner.lock();
        if state.reconnects == *handled {
            return false;
        }
        *handled = state.reconnects;
        let wanted: Vec<String> = state.channels.keys().cloned().collect();
        again.extend(wanted.iter().cloned());
        state.added.extend(wanted);
        true
    }

    /// After a reconnect no channel is subscribed until the reconciler says so: a
    /// newcomer waits for its subscription before its try, as on a new channel.
    fn unready_everyone(&self) {
        let mut state = self.inner.lock();
        state.reconnects += 1;
        for ch in state.channels.values() {
            ch.ready.set(false);
        }
        // Nor does an idle channel listen any more: a release here would count this
        // server among its listeners (`listens_idle`), which Redis no longer does, and
        // grant a claim in place of waking a listener it left uncounted.
        state.idle.clear();
    }

    /// Wakes the waiters of the channels in `again` that are subscribed once more
    /// after a reconnect: an unlock published while the subscription was gone reached
    /// nobody, so each waiter checks again. Channels still to subscribe stay in `again`.
    fn wake_resubscribed(&self, again: &mut HashSet<String>, active: &HashSet<String>) {
        if again.is_empty() {
            return;
        }
        let state = self.inner.lock();
        again.retain(|c| {
            let Some(ch) = state.channels.get(c) else { return false };
            if !active.contains(c) {
                return true;
            }
            ch.waiters.iter().for_each(|s| s.wake());
            false
        });
    }

    /// Brings Redis subscriptions in line with the channels that have waiters.
    async fn reconcile(self, feed: &Feed, stop: CancellationToken) {
        let mut subscribed = Subscribed::default();
        // Channels subscribed again after a reconnect whose waiters are still to wake.
        let mut again = HashSet::new();
        let mut force_subscribed = false;
        // Checks, after the first subscription and after each reconnect, that messages
        // arrive.
        let mut checked_by = feed.checked_by.clone();
        // Force-release notices may have gone unheard: before the first subscription of
        // the force channel (a lease may be granted first) and after a reconnect. Once it
        // is subscribed, the watchdog checks every lease at once.
        let mut force_unheard = true;
        // The command clients' slot-map changes (a script call answered MOVED): the
        // subscriber's own re-syncs announce one too, and must not trigger the next.
        let mut cluster_changes: Vec<_> = feed.changes.iter().map(|c| c.cluster_change_rx()).collect();
        // Each subscriber's slot map as the hub last saw it (see `Feed::resync_cluster`).
        let mut seen: Vec<Option<ClusterRouting>> = vec![None; feed.subscribers.len()];
        let mut check = tokio::time::interval(CLUSTER_CHECK);
        let mut resync = tokio::time::interval(CLUSTER_RESYNC);
        let mut sweep = tokio::time::interval(SWEEP);
        let mut unsubscribe = tokio::time::interval(UNSUBSCRIBE_EVERY);
        unsubscribe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Whether the next round unsubscribes what was left (a tick, a failed unsubscribe).
        let mut flush = false;
        // The subscriber's reconnections this loop has subscribed again after.
        let mut reconnects_handled = 0;
        // The force channel's subscription must be made again: its master left the
        // slot map, or its slot moved (see `Feed::resync_cluster`).
        let mut carrier_moved = false;
        loop {
            if std::mem::take(&mut carrier_moved) {
                force_subscribed = false;
                force_unheard = true;
                checked_by = feed.checked_by.clone();
            }
            if self.resubscribe_after_reconnect(&mut reconnects_handled, &mut again) {
                // What was subscribed may still be on other RedLock nodes, so it is
                // doubtful until settled.
                subscribed.doubtful.extend(subscribed.active.drain());
                force_subscribed = false;
                force_unheard = true;
                // A new connection, perhaps to a Redis whose ACL changed: check again.
                checked_by = feed.checked_by.clone();
            }
            if !force_subscribed {
                force_subscribed = feed
                    .change(vec![self.inner.force_channel.clone()], true, false)
                    .await
                    .is_ok();
                if let Some(publisher) = checked_by.take_if(|_| force_subscribed) {
                    tokio::spawn(self.clone().check_delivery(publisher));
                }
                if force_subscribed && std::mem::take(&mut force_unheard) {
                    let _ = self.inner.force_tx.send(Notice::Missed);
                }
            }
            let (added, removed) = self.take_changes(std::mem::take(&mut flush));
            let (failed, unsubscribe_failed) = self.apply(feed, &mut subscribed, added, removed).await;
            self.wake_resubscribed(&mut again, &subscribed.active);
            let retry = !failed.is_empty() || unsubscribe_failed || !force_subscribed;
            flush = unsubscribe_failed;
            if !failed.is_empty() {
                self.inner.lock().added.extend(failed);
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.inner.changed.notified(), if !retry => {}
                _ = tokio::time::sleep(RETRY_DELAY), if retry => {}
                _ = cluster_changed(&mut cluster_changes), if feed.cluster => {
                    carrier_moved |= feed.resync_cluster(false, &mut seen, &mut again).await;
                }
                _ = check.tick(), if feed.cluster => {
                    carrier_moved |= feed.resync_cluster(false, &mut seen, &mut again).await;
                }
                _ = resync.tick(), if feed.cluster => {
                    carrier_moved |= feed.resync_cluster(true, &mut seen, &mut again).await;
                }
                _ = sweep.tick() => self.sweep(feed, &mut subscribed).await,
                _ = unsubscribe.tick(), if self.inner.has_removed() => flush = true,
            }
        }
    }

    /// The channels that gained their first waiter, and, when `flush` or a full batch
    /// waits, those that lost their last. The latter listen idle until their
    /// unsubscribe has gone ([`Hub::settle_idle`]): a release counts this server's
    /// subscription as a listener that no claim stands for until then.
    fn take_changes(&self, flush: bool) -> (Vec<String>, Vec<String>) {
        let mut state = self.inner.lock();
        // A full batch goes at once, tick or not.
        let removed = if flush || state.removed.len() >= SUBSCRIBE_CHUNK {
            std::mem::take(&mut state.removed)
        } else {
            Vec::new()
        };
        // A channel whose subscription failed comes back once per round, and once more
        // with every channel at a reconnect: subscribed once.
        (in_subscription_order(std::mem::take(&mut state.added)), removed)
    }

    /// Once a batch of `removed` channels was applied: none listens idle any more but
    /// those `still_subscribed` (an unsubscribe that failed, queued to go again). One a
    /// waiter joined and left meanwhile is queued again too, but not subscribed.
    fn settle_idle(&self, removed: &[String], still_subscribed: impl Fn(&str) -> bool) {
        let mut state = self.inner.lock();
        for channel in removed.iter().filter(|c| !still_subscribed(c)) {
            state.idle.remove(channel);
        }
    }

    /// Subscribes `added` and unsubscribes `removed` where still needed; returns the
    /// channels whose subscription failed, and whether an unsubscribe failed (its
    /// channels are queued again).
    async fn apply(
        &self,
        feed: &Feed,
        subscribed: &mut Subscribed,
        added: Vec<String>,
        removed: Vec<String>,
    ) -> (Vec<String>, bool) {
        // Only the channels of this round are looked at: a burst of thousands of new
        // waiters must not make every round walk every channel.
        let (to_sub, to_unsub, reconnects) = {
            let state = self.inner.lock();
            let to_sub: Vec<String> = added
                .iter()
                .filter(|c| state.channels.contains_key(*c) && !subscribed.active.contains(*c))
                .cloned()
                .collect();
            // A channel nobody waits on any more goes, if it is or may be subscribed
            // (a retried channel whose waiters left comes back through `added`).
            let to_unsub: HashSet<String> = (removed.iter().cloned())
                .chain(added.iter().cloned())
                .filter(|c| !state.channels.contains_key(c) && subscribed.holds(c))
                .collect();
            (to_sub, Vec::from_iter(to_unsub), state.reconnects)
        };
        // Those subscribed for sure: a doubtful one (a reconnect's, a failed call's) may be
        // no subscription at all, and does not listen idle when its unsubscribe fails.
        let sure: HashSet<String> = to_unsub
            .iter()
            .filter(|c| subscribed.active.contains(*c))
            .cloned()
            .collect();
        subscribed.forget(&to_unsub);
        let mut unsubscribe_failed = false;
        if !to_unsub.is_empty() {
            if let Err(e) = feed.change(to_unsub.clone(), false, feed.cluster).await {
                // Redis may still have them on this connection (or, with RedLock, on
                // another node): keep them and retry, or they leak in Redis. As doubtful,
                // not subscribed: part of the change may have gone through (one slot's
                // SUNSUBSCRIBE refused and the others applied, or an UNSUBSCRIBE that timed
                // out run once Redis answered), and a waiter back on such a channel before
                // the retry must subscribe it again, not be told it listens.
                tracing::warn!(error = %e, "unsubscribe failed; retrying");
                subscribed.doubtful.extend(to_unsub.iter().cloned());
                let mut state = self.inner.lock();
                let still: Vec<String> = (to_unsub.iter())
                    .filter(|c| !state.channels.contains_key(*c) && sure.contains(*c))
                    .cloned()
                    .collect();
                // Unless a reconnect came meanwhile: the new connection has none of them.
                if state.reconnects == reconnects {
                    state.idle.extend(still);
                }
                state.removed.extend(to_unsub);
                unsubscribe_failed = true;
            }
        }
        // Settled before the round's subscriptions, which may take many round trips: the
        // unsubscribe reached Redis, and a release meanwhile would count this server
        // among the listeners it no longer is, and pass over one without a claim.
        self.settle_idle(&removed, |c| subscribed.holds(c));
        let failed = feed.subscribe(&to_sub).await;
        // A timed-out SUBSCRIBE may still reach Redis later: until a retry or an
        // unsubscribe settles it, the channel may be subscribed.
        subscribed.doubtful.extend(failed.iter().cloned());
        let failed_set: HashSet<&String> = failed.iter().collect();
        for c in to_sub.into_iter().filter(|c| !failed_set.contains(c)) {
            subscribed.doubtful.remove(&c);
            subscribed.active.insert(c);
        }
        self.mark_ready(&added, &subscribed.active, reconnects);
        subscribed.report();
        (failed, unsubscribe_failed)
    }

    /// Publishes a message of its own on the force-release channel, once subscribed (at
    /// start and after a reconnect), and waits for it. Redis refuses SUBSCRIBE to a user
    /// whose ACL lacks it, yet the Redis client reports the subscription made: waiters
    /// would hear no unlock and wait for the holder's TTL, and ForceRelease notices
    /// would come only with the next renewal. Nothing here can mend that; it is said
    /// loudly instead. The message goes out again every [`PROBE_EVERY`] until one comes
    /// back or [`PROBE_WAIT`] ends: a first one may reach Redis before the subscription
    /// it should come back through.
    async fn check_delivery(self, publisher: Client) {
        // One left from an earlier check proves nothing about this connection.
        let _ = self.inner.probed.notified().now_or_never();
        let started = tokio::time::Instant::now();
        let mut deadline = started + PROBE_WAIT;
        let failed = loop {
            let sent = publisher
                .publish::<i64, _, _>(self.inner.force_channel.as_str(), self.inner.probe.as_str())
                .await;
            match sent {
                // Redis away, or this connection not back yet after a restart (which the
                // health checks report): the wait for the message starts once a PUBLISH
                // went out. A Redis away for long leaves the check to its next reconnect.
                Err(e) if crate::redis::transient(&e) => {
                    if started.elapsed() >= PROBE_GIVE_UP {
                        tracing::debug!(error = %e, "pub/sub delivery not checked: redis did not take the probe");
                        return;
                    }
                    tokio::time::sleep(PROBE_EVERY).await;
                    deadline = tokio::time::Instant::now() + PROBE_WAIT;
                    continue;
                }
                Err(e) => break Some(format!("PUBLISH failed: {e}")),
                Ok(_) => {}
            }
            let until = deadline.min(tokio::time::Instant::now() + PROBE_EVERY);
            if tokio::time::timeout_at(until, self.inner.probed.notified())
                .await
                .is_ok()
            {
                break None;
            }
            if until >= deadline {
                break Some(format!("no message came back within {PROBE_WAIT:?}"));
            }
        };
        if let Some(why) = failed {
            tracing::error!(
                channel = %self.inner.force_channel,
                "pub/sub does not deliver to this server ({why}): its waiters hear no unlock \
                 from other servers or Redisson clients and wait for the holder's TTL, and \
                 ForceRelease notices come with the next renewal; check that the Redis user \
                 may SUBSCRIBE, SSUBSCRIBE and PUBLISH (`+@pubsub`) on latchkey's and \
                 Redisson's channels (`&*`)"
            );
        }
    }

    /// Unsubscribes what the Redis client still tracks but no waiter needs. A
    /// subscriber that is not connected is left for a later sweep: its unsubscribe
    /// would wait out the Redis timeout (a RedLock node down), holding up this feed's
    /// new subscriptions every sweep, and its reconnection subscribes what it tracks.
    /// Channels listening idle are left to their flush, due within a tick: until it,
    /// this server's releases count this server among their listeners
    /// (`listens_idle`), which an unsubscribe here would make untrue.
    async fn sweep(&self, feed: &Feed, subscribed: &mut Subscribed) {
        for sub in feed.subscribers.iter().filter(|sub| sub.is_connected()) {
            for sharded in [false, true] {
                let tracked = if sharded {
                    sub.tracked_shard_channels()
                } else {
                    sub.tracked_channels()
                };
                let stale: Vec<String> = {
                    let state = self.inner.lock();
                    tracked
                        .iter()
                        .map(|c| c.to_string())
                        .filter(|c| *c != self.inner.force_channel && !state.channels.contains_key(c))
                        .filter(|c| !state.idle.contains(c))
                        .collect()
                };
                if stale.is_empty() {
                    continue;
                }
                tracing::debug!(channels = stale.len(), "unsubscribing channels no waiter needs");
                match change(sub, stale.clone(), false, sharded).await {
                    Ok(()) => subscribed.forget(&stale),
                    Err(e) => {
                        tracing::warn!(error = %e, "unsubscribing stale channels failed; retrying");
                        subscribed.doubt(&stale);
                    }
                }
            }
        }
        subscribed.report();
    }

    /// Tells the waiters of this round's channels that messages now reach them, unless
    /// the subscriber reconnected since the round began (`reconnects` then): its
    /// subscriptions went with the old connection, and the next round makes them
    /// again. Marked ready meanwhile, a channel's newcomers would skip the
    /// subscribe-then-try order, and its claims be left where no message reaches.
    fn mark_ready(&self, added: &[String], subscribed: &HashSet<String>, reconnects: u64) {
        let state = self.inner.lock();
        if state.reconnects != reconnects {
            return;
        }
        for name in added.iter().filter(|c| subscribed.contains(*c)) {
            if let Some(ch) = state.channels.get(name) {
                ch.ready.set(true);
            }
        }
    }
}

/// The reconciler's view of Redis: channels subscribed, and channels whose subscribe
/// failed without saying whether Redis applied it.
#[derive(Debug, Default)]
struct Subscribed {
    active: HashSet<String>,
    doubtful: HashSet<String>,
    /// `active`'s size as last added to `latchkey_pubsub_subscriptions`, which a
    /// server's hubs (the main Redis's, the RedLock deployments') share.
    reported: usize,
}

impl Subscribed {
    /// Adds the change in this hub's subscriptions since its last report to the gauge.
    fn report(&mut self) {
        let now = self.active.len();
        crate::metrics::subscriptions(now as i64 - self.reported as i64);
        self.reported = now;
    }

    /// Whether `channel` is or may be subscribed.
    fn holds(&self, channel: &str) -> bool {
        self.active.contains(channel) || self.doubtful.contains(channel)
    }

    /// `channels` may have been unsubscribed (a change that failed in part): none counts
    /// as subscribed, so a waiter that comes for one subscribes it again.
    fn doubt(&mut self, channels: &[String]) {
        for c in channels {
            if self.active.remove(c) {
                self.doubtful.insert(c.clone());
            }
        }
    }

    /// `channels` were unsubscribed (or are about to be).
    fn forget(&mut self, channels: &[String]) {
        for c in channels {
            self.active.remove(c);
            self.doubtful.remove(c);
        }
        self.active.shrink_if_sparse();
        self.doubtful.shrink_if_sparse();
    }
}

/// `channels` once each, presence channels last: each connection's subscriptions go in
/// order, and a presence subscribed again after a reconnect before its lock's channel
/// counted this server as listening there (`lib.lua`'s `claimants`): a release granted
/// its claim in place of waking a Redisson waiter, the one listener it counted.
fn in_subscription_order(mut channels: Vec<String>) -> Vec<String> {
    channels.sort_unstable();
    channels.dedup();
    channels.sort_by_key(|c| crate::keys::is_presence(c));
    channels
}

impl Inner {
    /// Whether channels wait to be unsubscribed.
    fn has_removed(&self) -> bool {
        !self.lock().removed.is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state stays consistent even if a holder panicked: every change is a
        // single insert or removal.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The connections a hub listens on: the main Redis's subscriber, or one subscriber
/// per RedLock deployment (a channel listens once a majority of them has it).
#[derive(Debug, Clone)]
pub struct Feed {
    subscribers: Vec<SubscriberClient>,
    cluster: bool,
    /// On a cluster, the command clients whose slot-map changes (MOVED answers to
    /// script calls) say that sharded subscriptions may have to follow a slot.
    changes: Vec<Client>,
    /// The command client that checks that messages arrive (the main Redis's).
    checked_by: Option<Client>,
}

impl Feed {
    /// The main Redis's subscriber.
    pub fn main(backend: &Backend) -> Self {
        Self {
            subscribers: vec![backend.subscriber().clone()],
            cluster: backend.is_cluster(),
            changes: backend.pool().clients().to_vec(),
            checked_by: Some(backend.pool().next().clone()),
        }
    }

    /// One subscriber per RedLock deployment; `None` without RedLock.
    pub fn redlock(backend: &Backend) -> Option<Self> {
        let subscribers: Vec<SubscriberClient> = backend.redlock_nodes().iter().map(|n| n.subscriber.clone()).collect();
        (!subscribers.is_empty()).then_some(Self {
            subscribers,
            cluster: false,
            changes: Vec::new(),
            checked_by: None,
        })
    }

    /// Subscribes (or unsubscribes) channels on every subscriber, and answers once a
    /// majority of them succeeded a subscription (one, an unsubscription). A RedLock
    /// release publishes only on the nodes where it freed a hold, a majority of them
    /// at the least, which shares a node with any majority of subscriptions: a
    /// subscription counted once one node had it missed a release published on the
    /// others before their subscription reached them, and its waiter slept until the
    /// holder's TTL on a free lock. A node that does not answer (down or frozen; it
    /// resubscribes when back) holds back no channel while a majority answers. The
    /// slower calls go on by themselves, each queued on its own connection ahead of
    /// whatever follows there.
    async fn change(&self, channels: Vec<String>, subscribe: bool, sharded: bool) -> Result<(), fred::error::Error> {
        if channels.is_empty() {
            return Ok(());
        }
        let needed = if subscribe { self.subscribers.len() / 2 + 1 } else { 1 };
        let mut done = 0;
        let mut calls: FuturesUnordered<_> = self
            .subscribers
            .iter()
            .map(|sub| {
                let (sub, channels) = (sub.clone(), channels.clone());
                async move { change(&sub, channels, subscribe, sharded).await }
            })
            .collect();
        let mut failure = None;
        while let Some(result) = calls.next().await {
            match result {
                Ok(()) => done += 1,
                Err(e) => failure = Some(e),
            }
            if done >= needed {
                if !calls.is_empty() {
                    tokio::spawn(async move { while calls.next().await.is_some() {} });
                }
                return Ok(());
            }
        }
        Err(failure.unwrap_or_else(|| fred::error::Error::new(fred::error::ErrorKind::Unknown, "no subscriber")))
    }

    /// Subscribes `channels`; returns those whose subscription failed. On a cluster each
    /// sharded channel is subscribed on its own, and counts on its own: a master down
    /// holds back no other master's channels, which would otherwise stay unready (their
    /// waiters waiting for the subscription, then looking again every second) until it
    /// is back or failed over.
    async fn subscribe(&self, channels: &[String]) -> Vec<String> {
        let failed = match self.subscribers.as_slice() {
            [sub] if self.cluster => ssubscribe_each(sub, channels.to_vec()).await,
            _ => match self.change(channels.to_vec(), true, self.cluster).await {
                Ok(()) => Vec::new(),
                // Refused by Redis, not cut off from it (each alone would wait as long).
                Err(e) if channels.len() > 1 && !crate::redis::transient(&e) => self.subscribe_each(channels).await,
                Err(e) => channels.iter().map(|c| (c.clone(), e.clone())).collect(),
            },
        };
        if let Some((_, e)) = failed.first() {
            tracing::warn!(error = %e, channels = failed.len(), "subscribe failed; retrying");
        }
        failed.into_iter().map(|(c, _)| c).collect()
    }

    /// Subscribes each of `channels` on its own, after a SUBSCRIBE of them all failed:
    /// Redis refuses the whole command for one channel it refuses (an ACL without it),
    /// and that channel, tried again with every channel added meanwhile, would keep
    /// every later one from being subscribed. One at a time: the Redis client takes a
    /// SUBSCRIBE for answered once written, and an error Redis sends for it is read as
    /// the reply to the PING behind it, which must be that channel's own.
    async fn subscribe_each(&self, channels: &[String]) -> Vec<(String, fred::error::Error)> {
        let mut failed = Vec::new();
        for channel in channels {
            if let Err(e) = self.change(vec![channel.clone()], true, self.cluster).await {
                failed.push((channel.clone(), e));
            }
        }
        failed
    }

    /// Re-reads the slot map and subscribes each sharded channel whose slot moved on its
    /// new owner (on a move fred drops the old owner's `sunsubscribe`, and no reconnect
    /// follows); with `all`, every sharded channel, a safety net for moves unseen.
    /// Returns the channels that moved: a release published on the new owner before the
    /// subscription reached it was heard by nobody, so their waiters look again.
    ///
    /// A move is found against `seen`, each subscriber's map as the hub last saw it, not
    /// against the map fred has cached: fred re-reads the map itself when a subscribe is
    /// answered `MOVED` (a new channel of a moved slot), and a move it found that way
    /// would look like none. `seen` is kept until the moved channels are subscribed
    /// again, so a failed re-subscribe is tried at the next check.
    ///
    /// Also returns whether the plain subscription (the force-release channel's, made
    /// on the owner of the slot of the subscriber's id) must be made again: its master
    /// left the slot map (the Redis client drops its connection there, with no
    /// reconnect, and the subscription goes with it), or that slot moved to another
    /// master (as a reshard drains a master, a step at a time: the subscription stays
    /// where it was made until that master leaves, when the slot's owner seen last is
    /// the new one). A second subscription beside the first costs nothing: a notice
    /// heard twice breaks nothing more.
    async fn resync_cluster(
        &self,
        all: bool,
        seen: &mut [Option<ClusterRouting>],
        moved: &mut HashSet<String>,
    ) -> bool {
        let mut carrier_moved = false;
        for (sub, seen) in self.subscribers.iter().zip(seen.iter_mut()) {
            let before = seen.take().or_else(|| sub.cached_cluster_state());
            if let Err(e) = sub.sync_cluster().await {
                tracing::warn!(error = %e, "re-reading the cluster's slots failed");
                *seen = before;
                continue;
            }
            let after = sub.cached_cluster_state();
            let owner =
                |routing: &Option<ClusterRouting>, slot| routing.as_ref().and_then(|r| r.get_server(slot)).cloned();
            let slot = carrier_slot(sub);
            let carrier = owner(&before, slot);
            if let (Some(carrier), Some(routing)) = (&carrier, &after) {
                if !routing.unique_primary_nodes().contains(carrier) {
                    tracing::warn!(%carrier, "the master carrying the force-release subscription left; subscribing again");
                    carrier_moved = true;
                } else if owner(&after, slot).is_some_and(|now| &now != carrier) {
                    tracing::info!(%carrier, "the force-release subscription's slot moved; subscribing there too");
                    carrier_moved = true;
                }
            }
            let tracked: Vec<String> = sub.tracked_shard_channels().iter().map(|c| c.to_string()).collect();
            let lost = match &after {
                Some(routing) => lost_masters(sub, routing, &tracked).await,
                None => HashSet::new(),
            };
            let (elsewhere, stayed): (Vec<String>, Vec<String>) = tracked.into_iter().partition(|c| {
                let slot = fred::util::redis_keyslot(c.as_bytes());
                let now = owner(&after, slot);
                owner(&before, slot) != now || now.is_some_and(|master| lost.contains(&master))
            });
            let resend = in_subscription_order(if all {
                [&elsewhere[..], &stayed[..]].concat()
            } else {
                elsewhere.clone()
            });
            match change(sub, resend, true, true).await {
                Ok(()) => *seen = after,
                Err(e) => {
                    tracing::warn!(error = %e, "re-subscribing sharded channels failed");
                    *seen = before;
                }
            }
            moved.extend(elsewhere);
        }
        carrier_moved
    }
}

/// Until any of `changes` announces a new slot map (a receiver that lagged counts as
/// one); never without receivers.
async fn cluster_changed(changes: &mut [broadcast::Receiver<Vec<ClusterStateChange>>]) {
    if changes.is_empty() {
        return std::future::pending().await;
    }
    let next = changes.iter_mut().map(|rx| {
        Box::pin(async move {
            loop {
                match rx.recv().await {
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => return,
                    // Its client is gone (the server is stopping): no more news from it.
                    Err(broadcast::error::RecvError::Closed) => std::future::pending::<()>().await,
                }
            }
        })
    });
    futures::future::select_all(next).await;
}

/// The masters that hold fewer of `sub`'s sharded subscriptions than it tracks for them
/// (`CLIENT INFO`'s `ssub` on its connection there): a master drops a slot's
/// subscriptions when the slot leaves it, by a move or a failover, and a slot that left
/// and came back between two checks shows its owner unchanged in the slot map. (A
/// subscribe is tracked once the master took it, and an unsubscribe once it was sent:
/// neither makes a master hold fewer.) A master that does not answer in time is left
/// for the next check.
async fn lost_masters(
    sub: &SubscriberClient,
    routing: &ClusterRouting,
    tracked: &[String],
) -> HashSet<fred::types::config::Server> {
    let mut expected: HashMap<fred::types::config::Server, usize> = HashMap::new();
    for channel in tracked {
        if let Some(master) = routing.get_server(fred::util::redis_keyslot(channel.as_bytes())) {
            *expected.entry(master.clone()).or_default() += 1;
        }
    }
    let checks = expected.into_iter().map(|(master, expected)| async move {
        let options = fred::types::config::Options {
            cluster_node: Some(master.clone()),
            timeout: Some(CLUSTER_CHECK / 2),
            max_attempts: Some(1),
            ..Default::default()
        };
        let client_info = fred::types::CustomCommand::new_static("CLIENT", fred::types::ClusterHash::Random, false);
        let info: String = sub
            .with_options(&options)
            .custom(client_info, vec!["INFO"])
            .await
            .ok()?;
        let held: usize = info
            .split_whitespace()
            .find_map(|f| f.strip_prefix("ssub="))?
            .parse()
            .ok()?;
        (held < expected).then(|| {
            tracing::warn!(%master, held, expected, "a master dropped sharded subscriptions; subscribing again");
            master
        })
    });
    futures::future::join_all(checks).await.into_iter().flatten().collect()
}

/// The slot by which the Redis client routes the subscriber's plain (un)subscribes on a
/// cluster: its id's, so that they all reach one master, the carrier.
fn carrier_slot(sub: &SubscriberClient) -> u16 {
    fred::util::redis_keyslot(ClientLike::id(sub).as_bytes())
}

/// Subscribes (or unsubscribes) channels; sharded subscribes go one channel per command,
/// sharded unsubscribes one slot per command.
async fn change(
    sub: &SubscriberClient,
    channels: Vec<String>,
    subscribe: bool,
    sharded: bool,
) -> Result<(), fred::error::Error> {
    if !sharded {
        // Bounded commands: a burst of thousands of new channels is sent in chunks, so
        // no single command outlives the Redis timeout. Every chunk is queued at once,
        // in order: a change queued later on this connection (a slow RedLock node's
        // call goes on in the background) comes behind them all, where one chunk at a
        // time let an UNSUBSCRIBE overtake the later chunks of a SUBSCRIBE before it,
        // leaving their channels subscribed until the sweep.
        let chunks = channels.chunks(SUBSCRIBE_CHUNK).map(|chunk| {
            let chunk = chunk.to_vec();
            async move {
                match subscribe {
                    true => sub.subscribe(chunk).await,
                    false => sub.unsubscribe(chunk).await,
                }
            }
        });
        futures::future::try_join_all(chunks).await?;
        // The Redis client answers a plain (un)subscribe once it is written, not once
        // Redis has it: a PING behind it on the same connection is answered only after
        // Redis ran it. Until then an unlock published may reach nobody here, and a
        // waiter must not take its channel for subscribed. On a cluster the Redis
        // client sends plain (un)subscribes to the node its id hashes to, and a keyless
        // PING to any node: the PING goes by the same hash.
        if subscribe {
            let carrier = fred::types::config::Options {
                cluster_hash: Some(fred::types::ClusterHash::Custom(carrier_slot(sub))),
                ..Default::default()
            };
            ClientLike::with_options(sub, &carrier).ping::<()>(None).await?;
        }
        return Ok(());
    }
    if subscribe {
        return match ssubscribe_each(sub, channels).await.into_iter().next() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        };
    }
    let mut by_slot: HashMap<u16, Vec<String>> = HashMap::new();
    for c in channels {
        by_slot
            .entry(fred::util::redis_keyslot(c.as_bytes()))
            .or_default()
            .push(c);
    }
    let groups = by_slot.into_values();
    paced(sub, groups, |group| sub.sunsubscribe(group), |_, e| Err(e))
        .await
        .into_iter()
        .collect()
}

/// Sends one command on `sub` for each of `items` (`send`), in order, each only while
/// the Redis client's command queue has room
/// ([`SUBSCRIBE_QUEUE_MAX`](crate::redis::SUBSCRIBE_QUEUE_MAX)); returns their
/// outputs, and `unsent`'s for those still waiting for room after [`QUEUE_ROOM_WAIT`].
/// A burst of sharded channels goes in a command each: sent at once (the channels of a
/// thousand fair waiters subscribed again after a reconnect), it overflowed the queue,
/// whose refusals leave the client's count of queued commands too high for good, and
/// every later (un)subscribe unsent until a ping flushes it. The queue holds only what
/// the client has not written yet: a master that does not answer holds up no command
/// behind it, as a bound on the commands awaiting their replies would.
async fn paced<I, F: Future>(
    sub: &SubscriberClient,
    items: impl IntoIterator<Item = I>,
    send: impl Fn(I) -> F,
    unsent: impl Fn(I, fred::error::Error) -> F::Output,
) -> Vec<F::Output> {
    let mut running = FuturesUnordered::new();
    let mut outputs = Vec::new();
    let mut items = items.into_iter();
    let mut refused = None;
    for item in items.by_ref() {
        if !queue_room(sub, &mut running, &mut outputs).await {
            refused = Some(item);
            break;
        }
        running.push(send(item));
        // Polled once now, so that its command is sent (and queued) before the next.
        if let std::task::Poll::Ready(Some(output)) = futures::poll!(running.next()) {
            outputs.push(output);
        }
    }
    if let Some(first) = refused {
        let full = "the subscriber's command queue stayed full (Redis away or too slow)";
        let full = fred::error::Error::new(fred::error::ErrorKind::Backpressure, full);
        outputs.extend(std::iter::once(first).chain(items).map(|i| unsent(i, full.clone())));
    }
    while let Some(output) = running.next().await {
        outputs.push(output);
    }
    outputs
}

/// Waits, for at most [`QUEUE_ROOM_WAIT`], until `sub`'s command queue has room for a
/// burst's next command, taking the outputs of the burst's calls that end meanwhile;
/// whether it has.
async fn queue_room<F: Future>(
    sub: &SubscriberClient,
    running: &mut FuturesUnordered<F>,
    outputs: &mut Vec<F::Output>,
) -> bool {
    let until = tokio::time::Instant::now() + QUEUE_ROOM_WAIT;
    while sub.command_queue_len() >= crate::redis::SUBSCRIBE_QUEUE_MAX {
        if tokio::time::Instant::now() >= until {
            return false;
        }
        tokio::select! {
            Some(output) = running.next() => outputs.push(output),
            () = tokio::time::sleep(QUEUE_ROOM_PAUSE) => {}
        }
    }
    true
}

/// Subscribes sharded channels, one SSUBSCRIBE each: Redis confirms each channel of
/// one, and the Redis client takes only the first confirmation for the command's reply;
/// the others would answer the commands behind it on the connection (an error of a
/// later one, MOVED or NOPERM, taken for a success). They go in order, [`paced`].
/// Returns the channels that failed, with their errors.
async fn ssubscribe_each(sub: &SubscriberClient, channels: Vec<String>) -> Vec<(String, fred::error::Error)> {
    let send = |c: String| async move {
        let result = sub.ssubscribe(c.as_str()).await;
        result.err().map(|e| (c, e))
    };
    paced(sub, channels, send, |c, e| Some((c, e)))
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// A claim's grant, `latchkey:granted\n<hold id>\n<token>\n<lock>\n<owner>\n<lease ms>`.
#[derive(Debug, PartialEq, Eq)]
struct ClaimGrant<'a> {
    hold: &'a str,
    token: u64,
    /// The lock key and the owner granted (an older server sends neither).
    holder: Option<(&'a str, &'a str)>,
    /// The lease granted (an older server sends none). Owners hold no control
    /// characters, so it follows the owner unmistakably.
    lease: Option<Duration>,
}

/// The server part of a hold id, `<server id>:<n>`.
fn server_of(hold: &str) -> &str {
    hold.rsplit_once(':').map_or(hold, |(server, _)| server)
}

fn claim_granted(message: &str) -> Option<ClaimGrant<'_>> {
    let mut parts = message.strip_prefix("latchkey:granted\n")?.splitn(4, '\n');
    let hold = parts.next()?;
    let token = parts.next()?.parse().ok().filter(|t| *t > 0)?;
    let holder = parts.next().zip(parts.next());
    let (holder, lease) = match holder.and_then(|(lock, rest)| Some((lock, rest.rsplit_once('\n')?))) {
        Some((lock, (owner, lease))) => (Some((lock, owner)), lease.parse().ok().map(Duration::from_millis)),
        None => (holder, None),
    };
    Some(ClaimGrant {
        hold,
        token,
        holder,
        lease,
    })
}

/// Hands a claim's grant to its waiter, if it is here still, and tells the observers:
/// the lock changed hands. Nobody else wakes (the lock is taken) but the streams of
/// the owner granted, which reenter. The other exclusive waiters look again by the
/// time the granted lease would run out: the lease they were told of may end later,
/// and if the new holder's server stops, nothing tells them it lapsed. Returns whether
/// its waiter took it.
fn grant_claim(ch: &Channel, grant: &ClaimGrant) -> bool {
    let mut taken = false;
    let owner = grant.holder.map(|(_, owner)| owner);
    let look_again_by = grant.lease.map(|lease| tokio::time::Instant::now() + lease);
    for slot in &ch.waiters {
        if slot.want == Want::Watch {
            slot.wake();
        } else if slot.hold.as_deref() == Some(grant.hold) {
            slot.granted.store(grant.token, Ordering::Release);
            slot.wake();
            taken = true;
        } else if owner.is_some() && slot.owner.as_deref() == owner {
            // Another stream of the owner its client named, here or on another server,
            // was granted the lock: this one reenters (as `wake_owner` does locally).
            slot.wake();
        } else if let (Want::Exclusive, Some(by)) = (slot.want, look_again_by) {
            slot.look_again_by(by);
        }
    }
    taken
}

/// A message on the channel: its observers (Watch readers) look again, as the lock
/// changed, and the waiters that can proceed are woken ([`wake`]). A waiter that hands
/// on a wake it did not use wakes waiters only: that says nothing of the lock.
fn on_message(ch: &mut Channel, free: Option<u32>, echoed: bool) {
    ch.waiters
        .iter()
        .filter(|s| s.want == Want::Watch)
        .for_each(|s| s.wake());
    wake(ch, free, echoed);
}

/// Wakes the local waiters that can proceed, longest-waiting first: the first
/// exclusive waiter; or every reader (and a writer, to learn the lock's TTL); or
/// semaphore waiters while `free` permits last (every one, with no count). With
/// `echoed` messages (one per RedLock node for one release), an exclusive waiter is
/// woken only while none has a wake pending: each copy woke another, and one release
/// cost a try on every node for each node.
fn wake(ch: &mut Channel, free: Option<u32>, echoed: bool) {
    let Some(first) = ch.waiters.iter().map(|s| s.want).find(|w| *w != Want::Watch) else {
        return;
    };
    match first {
        Want::Exclusive | Want::Watch if ch.mixed => {
            // A channel two locks share: the message may be either's, so each lock's
            // first waiter not woken already looks (one of them in vain).
            let mut looked: Vec<u64> = Vec::new();
            for slot in ch.waiters.iter().filter(|s| s.want != Want::Watch) {
                if !looked.contains(&slot.lock) && !slot.woken.load(Ordering::Acquire) {
                    looked.push(slot.lock);
                    slot.wake();
                }
            }
        }
        Want::Exclusive | Want::Watch => {
            // The longest-waiting one not woken already. One that woke and lost the
            // lock to another server keeps its place: this server's waiters are woken
            // in arrival order, so none waits for a run of lost races.
            let mut exclusive = ch.waiters.iter().filter(|s| s.want != Want::Watch);
            if echoed && exclusive.clone().any(|s| s.woken.load(Ordering::Acquire)) {
                return;
            }
            if let Some(slot) = exclusive.find(|s| !s.woken.load(Ordering::Acquire)) {
                slot.wake();
            }
        }
        Want::Shared => {
            // Every reader; and the first writer, unless a writer has a wake pending,
            // so that a writer's try learns how long the lock is held now: asleep on
            // the TTL it was told before (an earlier writer's, maybe a fixed lease of
            // minutes), it would sleep past a lock the readers then leave free without
            // a message (their last hold running out).
            ch.waiters
                .iter()
                .filter(|s| s.want == Want::Shared)
                .for_each(|s| s.wake());
            let mut writers = ch.waiters.iter().filter(|s| s.want == Want::Exclusive);
            if !writers.clone().any(|s| s.woken.load(Ordering::Acquire)) {
                writers.next().inspect(|s| s.wake());
            }
        }
        Want::Permits(_) => {
            // A message with no count (a grant whose hold may run out before the time
            // its waiters were told to look again: `semaphore_acquire.lua`) has every
            // waiter look again, and learn when.
            let Some(free) = free else {
                ch.waiters
                    .iter()
                    .filter(|s| matches!(s.want, Want::Permits(_)))
                    .for_each(|s| s.wake());
                return;
            };
            wake_fitting(ch.waiters.iter(), free);
        }
    }
}

/// Wakes the permit waiters among `slots` that fit in `free` permits, in order.
/// Semaphores are not first-come: a waiter wanting more permits than are free does not
/// hold back one behind it that fits.
fn wake_fitting<'a>(slots: impl Iterator<Item = &'a Arc<Slot>>, mut free: u32) {
    for slot in slots {
        let Want::Permits(n) = slot.want else { continue };
        if n > free {
            continue;
        }
        free -= n;
        slot.wake();
    }
}

impl Slot {
    /// Only the wake that raises the flag notifies: one that comes while a wake is
    /// pending is the same wake (the waiter looks after both), so the flag and the
    /// waiter's permit stay one. A notify beside a flag the waiter had just cleared
    /// would leave it a wake the hub takes for none: not passed on if it then left.
    fn wake(&self) {
        if !self.woken.swap(true, Ordering::AcqRel) {
            self.notify.notify_one();
        }
    }

    /// Whether `other` waits for this waiter's lock to itself, as this one does: a
    /// holder's end one of them learned holds for the other.
    fn shares_exclusively(&self, other: &Slot) -> bool {
        other.want == Want::Exclusive && other.lock == self.lock
    }

    /// Has the waiter look again by `by` at the latest: at once if it sleeps longer
    /// now, else at its next sleep (its try under way may have learned an older
    /// holder's TTL).
    fn look_again_by(&self, by: tokio::time::Instant) {
        let mut recheck = self.recheck.lock().unwrap_or_else(|e| e.into_inner());
        recheck.by = Some(recheck.by.map_or(by, |t| t.min(by)));
        if recheck.sleeping_until.is_some_and(|until| by < until) {
            self.retimed.notify_one();
        }
    }
}

impl Waiter {
    /// Waits (at most `limit`) until the channel's subscription is confirmed, so an
    /// unlock after the next try cannot be missed.
    /// With a presence, until that is subscribed too.
    pub async fn subscribed(&self, limit: Duration) {
        let ready = async {
            self.ready.wait().await;
            if let Some(presence) = self.presence.as_ref() {
                presence.ready.wait().await;
            }
        };
        let _ = tokio::time::timeout(limit, ready).await;
    }

    /// Whether the channel's subscription is in place: until it is, an unlock may reach
    /// nobody here.
    pub fn is_subscribed(&self) -> bool {
        self.ready.get()
    }

    /// Keeps this server present on the lock while the waiter lasts: subscribed to
    /// `presence`, its presence channel (`LockKeys::presence`), on which nothing is
    /// published. A release grants a claim only to a server present there, so a claim
    /// a crashed server left is dropped, not granted to nobody.
    pub fn present_on(mut self, presence: &str) -> Self {
        let hub = Hub {
            inner: self.inner.clone(),
        };
        self.presence = Some(Box::new(hub.register(presence, "", Want::Watch, None, None)));
        self
    }

    /// Whether a try of this waiter may leave a claim: a claim granted while this
    /// server does not listen on the channel would hold the lock for nobody, and one
    /// left before its presence is subscribed would be dropped as a crashed server's.
    pub fn may_claim(&self) -> bool {
        self.is_subscribed() && self.presence.as_ref().is_some_and(|p| p.is_subscribed())
    }

    /// Leaves the channel as if woken: the next waiter that can proceed is woken
    /// instead. For a waiter that moves to another channel (a multi-lock now blocked on
    /// another name) after a wake it did not turn into a grant: the lock it woke for may
    /// be free for the others. At worst a spurious wake, which costs one re-check.
    pub fn pass_on(self) {
        self.slot.woken.store(true, Ordering::Release);
    }

    /// Wakes the readers waiting on the channel. For a writer woken for a lock that it
    /// then found taken: the lock may be held for reading (a writer's release that left
    /// its owner's read holds, a reader of another client that came first), which the
    /// readers waiting behind the writer could share; no message would wake them. At
    /// worst a spurious wake each, which costs one re-check.
    pub fn wake_readers(&self) {
        let state = self.inner.lock();
        if let Some(ch) = state.channels.get(&self.channel) {
            ch.waiters
                .iter()
                .filter(|s| s.want == Want::Shared)
                .for_each(|s| s.wake());
        }
    }

    /// Has the other writers waiting on the channel look again by `by` at the latest.
    /// For a writer woken for a read/write lock it then found held until `by`: a
    /// message that cut the lock's TTL (a reader's release, a partial write's) wakes
    /// one writer here, and the others, asleep on the longer TTL they were told before,
    /// would sleep past the lock its holds then leave free without a message.
    pub fn writers_look_again_by(&self, by: tokio::time::Instant) {
        let state = self.inner.lock();
        if let Some(ch) = state.channels.get(&self.channel) {
            (ch.waiters.iter())
                .filter(|s| self.slot.shares_exclusively(s) && !Arc::ptr_eq(s, &self.slot))
                .for_each(|s| s.look_again_by(by));
        }
    }

    /// What a mutex waiter's last try learned: the lock held until `by` (`None`: not
    /// held, no end, or granted). Should the waiter leave without the lock, the other
    /// waiters for it look again by then. A release wakes one waiter here; when another
    /// client took the lock on a shorter lease (a Java thread's fixed lease), that
    /// waiter learns it, and the others sleep on the longer TTL they were told before,
    /// past the new lease's silent end. The woken waiter looks again by then itself,
    /// unless it leaves first (its wait over, its client gone).
    pub fn learned_end(&self, by: Option<tokio::time::Instant>) {
        self.slot.recheck.lock().unwrap_or_else(|e| e.into_inner()).learned = by;
    }

    /// Wakes the semaphore waiters on the channel that want fewer permits than this
    /// one. For a semaphore waiter woken for permits it then did not get (a waiter of
    /// another server took some first): the wake spent the freed permits on it and
    /// passed over those behind it, and what is left may be enough for one wanting
    /// fewer, which no message would wake. At worst a spurious wake each, which costs
    /// one re-check.
    pub fn wake_fewer(&self) {
        let Want::Permits(mine) = self.slot.want else { return };
        let state = self.inner.lock();
        if let Some(ch) = state.channels.get(&self.channel) {
            ch.waiters
                .iter()
                .filter(|s| matches!(s.want, Want::Permits(n) if n < mine))
                .for_each(|s| s.wake());
        }
    }

    /// Waits for an unlock message on the channel. The wake counts as in use until
    /// [`Waiter::answered`].
    pub async fn woken(&self) {
        loop {
            self.slot.notify.notified().await;
            self.slot.trying.store(true, Ordering::Release);
            if self.slot.woken.swap(false, Ordering::AcqRel) {
                return;
            }
            self.slot.trying.store(false, Ordering::Release);
        }
    }

    /// The try that followed a wake has answered: the waiter passes its wake on itself
    /// if it must (see [`Waiter::wake_fewer`]).
    pub fn answered(&self) {
        self.slot.trying.store(false, Ordering::Release);
    }

    /// Sleeps until `until`, or until an earlier time a claim's grant to another waiter
    /// told (the granted lease's end): the waiter then looks again, and learns the new
    /// holder's TTL.
    pub async fn sleep_until(&self, until: tokio::time::Instant) {
        let mut until = until;
        loop {
            {
                let mut recheck = self.slot.recheck.lock().unwrap_or_else(|e| e.into_inner());
                until = recheck.by.take().map_or(until, |by| until.min(by));
                recheck.sleeping_until = Some(until);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(until) => break,
                _ = self.slot.retimed.notified() => {}
            }
        }
        self.slot
            .recheck
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .sleeping_until = None;
    }

    /// The fencing token of the grant a release gave this waiter's claim, once.
    pub fn claim_granted(&self) -> Option<u64> {
        let token = self.slot.granted.swap(0, Ordering::AcqRel);
        (token > 0).then_some(token)
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        count_waiter(self.slot.want, -1);
        let mut state = self.inner.lock();
        let Some(ch) = state.channels.get_mut(&self.channel) else {
            return;
        };
        ch.waiters.retain(|s| s.id != self.slot.id);
        // A mutex waiter that leaves, not granted, with what its last try learned (see
        // `Waiter::learned_end`): the others for the lock look again by then (now, if it
        // has passed: nobody has looked since). Rare: a wait that ran out, a client gone.
        let learned = self.slot.recheck.lock().unwrap_or_else(|e| e.into_inner()).learned;
        if let Some(by) = learned.map(|by| by.max(tokio::time::Instant::now())) {
            (ch.waiters.iter())
                .filter(|s| self.slot.shares_exclusively(s))
                .for_each(|s| s.look_again_by(by));
        }
        if ch.waiters.is_empty() {
            let subscribed = ch.ready.get();
            state.channels.remove(&self.channel);
            state.channels.shrink_if_sparse();
            if subscribed {
                state.idle.insert(self.channel.clone());
            }
            state.removed.push(std::mem::take(&mut self.channel));
            // The first one starts the reconciler's clock; a full batch goes at once.
            if state.removed.len() == 1 || state.removed.len() >= SUBSCRIBE_CHUNK {
                self.inner.changed.notify_one();
            }
        } else if self.slot.woken.load(Ordering::Acquire) || self.slot.trying.load(Ordering::Acquire) {
            // This waiter leaves with a wake it never used, or used on a try whose
            // answer nobody reads: hand it on. Its permits go to waiters not woken
            // already (those count on permits of their own).
            match self.slot.want {
                Want::Permits(n) => wake_fitting(ch.waiters.iter().filter(|s| !s.woken.load(Ordering::Acquire)), n),
                Want::Watch => {}
                _ => wake(ch, None, false),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presence_channels_are_subscribed_after_the_lock_channels() {
        let keys = crate::keys::Keys::new("app:");
        let (a, b) = (keys.lock("a"), keys.lock("b"));
        let added = vec![
            a.presence("s1"),
            b.channel(),
            a.channel(),
            b.presence("s1"),
            a.channel(),
        ];
        let ordered = in_subscription_order(added);
        assert_eq!(
            ordered,
            [a.channel(), b.channel(), a.presence("s1"), b.presence("s1")],
            "once each, every lock channel before any presence"
        );
    }

    fn channel(wants: &[Want]) -> Channel {
        let waiters = wants
            .iter()
            .enumerate()
            .map(|(id, &want)| {
                Arc::new(Slot {
                    id: id as u64,
                    want,
                    lock: 1,
                    notify: Notify::new(),
                    woken: AtomicBool::new(false),
                    trying: AtomicBool::new(false),
                    hold: Some(format!("h{id}").into()),
                    granted: AtomicU64::new(0),
                    owner: None,
                    recheck: Mutex::default(),
                    retimed: Notify::new(),
                })
            })
            .collect();
        Channel {
            waiters,
            ready: Ready::new(true),
            first_lock: 1,
            mixed: false,
        }
    }

    fn message(channel: &str, value: &str) -> Message {
        Message {
            channel: channel.into(),
            value: value.into(),
            kind: fred::types::MessageKind::Message,
            server: fred::types::config::Server::new("127.0.0.1", 6379),
        }
    }

    fn woken(ch: &Channel) -> Vec<u64> {
        ch.waiters
            .iter()
            .filter(|s| s.woken.load(Ordering::Acquire))
            .map(|s| s.id)
            .collect()
    }

    /// A RedLock release publishes on every node: its copies wake one exclusive waiter
    /// of the server, not one each (each woke another, and one release cost a try on
    /// every node for each node). Unlock messages of the main Redis are releases each.
    #[test]
    fn copies_of_one_release_wake_one_waiter() {
        let mut ch = channel(&[Want::Watch, Want::Exclusive, Want::Exclusive, Want::Exclusive]);
        for _ in 0..3 {
            on_message(&mut ch, None, true);
        }
        assert_eq!(woken(&ch), [0, 1], "the watcher and the first waiter");
        for _ in 0..3 {
            on_message(&mut ch, None, false);
        }
        assert_eq!(woken(&ch), [0, 1, 2, 3], "one waiter per release");
    }

    /// A waiter that leaves with a wake it did not use hands it on to the next waiter,
    /// not to the observers: nothing of the lock changed, and each woke a Watch to read
    /// Redis again for nothing.
    #[test]
    fn a_wake_handed_on_wakes_no_observer() {
        let hub = Hub::new("force".into(), "srv");
        let watch = hub.register("c", "", Want::Watch, None, None);
        let first = hub.register("c", "c", Want::Exclusive, None, None);
        let second = hub.register("c", "c", Want::Exclusive, None, None);
        on_message(
            hub.inner.lock().channels.get_mut("c").expect("the channel"),
            None,
            false,
        );
        assert!(
            watch.slot.woken.swap(false, Ordering::AcqRel),
            "the message woke the observer"
        );
        assert!(first.slot.woken.load(Ordering::Acquire));
        drop(first);
        assert!(second.slot.woken.load(Ordering::Acquire), "the wake handed on");
        assert!(!watch.slot.woken.load(Ordering::Acquire), "the observer woken again");
    }

    /// A woken waiter that lost its try (its wake taken, the lock gone elsewhere) is
    /// woken again by the next unlock, before anyone behind it.
    #[test]
    fn an_exclusive_waiter_that_lost_keeps_its_place() {
        let mut ch = channel(&[Want::Watch, Want::Exclusive, Want::Exclusive, Want::Exclusive]);
        on_message(&mut ch, None, false);
        assert_eq!(woken(&ch), [0, 1], "the watcher and the first waiter");
        // A second unlock before the first waiter ran: the next one tries too.
        on_message(&mut ch, None, false);
        assert_eq!(woken(&ch), [0, 1, 2]);
        // Both lost their tries.
        ch.waiters.iter().for_each(|s| s.woken.store(false, Ordering::Release));
        on_message(&mut ch, None, false);
        assert_eq!(woken(&ch), [0, 1], "the first waiter again");
        let order: Vec<u64> = ch.waiters.iter().map(|s| s.id).collect();
        assert_eq!(order, [0, 1, 2, 3], "nobody moved");
    }

    /// A wait for the subscription ends when it is in place, not before, and at once
    /// when it is already.
    #[tokio::test]
    async fn a_wait_for_the_subscription_ends_once_it_is_in_place() {
        let ready = Ready::new(false);
        let waiting = tokio::spawn({
            let ready = ready.clone();
            async move { ready.wait().await }
        });
        tokio::task::yield_now().await;
        ready.set(false);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "not subscribed yet");
        ready.set(true);
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("woken by the subscription")
            .unwrap();
        tokio::time::timeout(Duration::from_secs(1), ready.wait())
            .await
            .expect("in place already");
    }

    /// After a reconnect a channel's waiters are woken once it is subscribed again (an
    /// unlock sent while it was not reached nobody), and not before; until then the
    /// channel is not ready, so a newcomer waits for the subscription before its try.
    #[test]
    fn waiters_check_again_once_their_channel_is_subscribed_again() {
        let hub = Hub::new("force".into(), "s1");
        let first = hub.register("c", "lk", Want::Exclusive, None, None);
        hub.inner.lock().channels["c"].ready.set(true);
        assert!(
            hub.join("c", "lk", Want::Exclusive, None, None).is_some(),
            "subscribed: a newcomer joins"
        );
        hub.unready_everyone();
        assert!(
            hub.join("c", "lk", Want::Exclusive, None, None).is_none(),
            "a reconnect: not subscribed"
        );
        let mut again = HashSet::from(["c".to_owned(), "gone".to_owned()]);
        hub.wake_resubscribed(&mut again, &HashSet::new());
        assert!(!first.slot.woken.load(Ordering::Acquire), "not subscribed yet");
        assert_eq!(
            again,
            HashSet::from(["c".to_owned()]),
            "a channel nobody waits on is dropped"
        );
        hub.wake_resubscribed(&mut again, &HashSet::from(["c".to_owned()]));
        assert!(first.slot.woken.load(Ordering::Acquire), "woken once subscribed");
        assert!(again.is_empty());
    }

    /// A semaphore waiter that fits the permits set free is woken, even behind one
    /// that wants more.
    #[test]
    fn a_semaphore_waiter_that_fits_is_not_held_back() {
        let mut ch = channel(&[Want::Permits(5), Want::Permits(1), Want::Permits(1)]);
        on_message(&mut ch, Some(1), false);
        assert_eq!(woken(&ch), [1]);
        on_message(&mut ch, Some(5), false);
        assert_eq!(woken(&ch), [0, 1], "five free: the first takes them all");
        on_message(&mut ch, None, false);
        assert_eq!(woken(&ch), [0, 1, 2], "no count: every waiter looks again");
    }

    /// A semaphore waiter that leaves with a wake it never used hands its permits to a
    /// waiter that fits and was not woken: those woken already count on permits of
    /// their own. They went to the first that fitted, woken already, and the waiter
    /// that needed them slept until its recheck.
    #[test]
    fn a_semaphore_waiters_unused_wake_goes_to_one_not_woken() {
        let hub = Hub::new("force".into(), "s1");
        let waiters: Vec<Waiter> = (0..3)
            .map(|_| hub.register("s", "lk", Want::Permits(1), None, None))
            .collect();
        hub.inner.lock().channels["s"].ready.set(true);
        hub.deliver(message("s", "2"));
        let woken = |w: &Waiter| w.slot.woken.load(Ordering::Acquire);
        assert_eq!(waiters.iter().map(woken).collect::<Vec<_>>(), [true, true, false]);
        let mut waiters = waiters.into_iter();
        let (first, leaving, last) = (
            waiters.next().unwrap(),
            waiters.next().unwrap(),
            waiters.next().unwrap(),
        );
        drop(leaving);
        assert!(woken(&first) && woken(&last), "the permit went to the one not woken");
    }

    /// A reader that lagged behind the subscriber's messages may have missed
    /// ForceRelease notices: the watchdog is told to check every lease, as after a
    /// reconnect. It was told nothing, and the holders heard of a break that was among
    /// the dropped messages only at their next renewal.
    #[tokio::test]
    async fn a_lagging_reader_tells_the_watchdog_notices_were_missed() {
        let hub = Hub::new("force".into(), "s1");
        let mut notices = hub.force_released();
        let (tx, messages) = broadcast::channel(2);
        let (_reconnect_tx, reconnects) = broadcast::channel(1);
        for value in ["orders\n5", "a\n6", "b\n7"] {
            tx.send(message("force", value)).unwrap();
        }
        let stop = CancellationToken::new();
        let reader = tokio::spawn(hub.clone().read(messages, reconnects, stop.clone()));
        let mut heard = Vec::new();
        while heard.len() < 3 {
            let notice = tokio::time::timeout(Duration::from_secs(5), notices.recv()).await;
            heard.push(notice.expect("a notice in time").expect("open"));
        }
        stop.cancel();
        reader.await.unwrap();
        assert!(heard.contains(&Notice::Missed), "{heard:?}");
    }

    /// A claim's grant goes to the waiter it names, and to the observers, and wakes
    /// nobody else: the lock is taken.
    #[test]
    fn a_claims_grant_wakes_its_waiter_alone() {
        let grant = |hold, token, holder, lease: Option<u64>| ClaimGrant {
            hold,
            token,
            holder,
            lease: lease.map(Duration::from_millis),
        };
        assert_eq!(
            claim_granted("latchkey:granted\ns1:7\n42\n{a}:b\nme:1\n30000"),
            Some(grant("s1:7", 42, Some(("{a}:b", "me:1")), Some(30000)))
        );
        assert_eq!(
            claim_granted("latchkey:granted\ns1:7\n42\n{a}:b\nme:1"),
            Some(grant("s1:7", 42, Some(("{a}:b", "me:1")), None)),
            "an older server's"
        );
        assert_eq!(
            claim_granted("latchkey:granted\ns1:7\n42"),
            Some(grant("s1:7", 42, None, None)),
            "an older server's still"
        );
        assert_eq!(claim_granted("0"), None, "Redisson's unlock message");
        assert_eq!(claim_granted("latchkey:granted\ns1:7\nx"), None);
        let ch = channel(&[Want::Exclusive, Want::Watch, Want::Exclusive]);
        assert!(grant_claim(&ch, &grant("h2", 42, None, Some(5000))));
        assert!(
            !grant_claim(&ch, &grant("h9", 43, None, None)),
            "no waiter stands for it"
        );
        assert_eq!(woken(&ch), [1, 2]);
        let told = ch.waiters[0].recheck.lock().unwrap().by.take();
        assert!(
            told.is_some(),
            "the other waiter looks again by the granted lease's end"
        );
        assert_eq!(ch.waiters[2].granted.load(Ordering::Acquire), 42);
        assert_eq!(ch.waiters[0].granted.load(Ordering::Acquire), 0);
    }

    /// A grant of this server's claim that no waiter here took is passed on to be given
    /// back, with the lock and owner it names; one a waiter took is not, nor another
    /// server's.
    #[tokio::test]
    async fn a_claims_grant_nobody_takes_is_passed_on() {
        let hub = Hub::new("force".into(), "s1");
        let mut unclaimed = hub.unclaimed();
        let waiter = hub.register("ch", "lk", Want::Exclusive, Some("s1:8"), None);
        hub.deliver(message("ch", "latchkey:granted\ns1:8\n43\nlk\nme"));
        assert_eq!(waiter.claim_granted(), Some(43));
        assert!(unclaimed.try_recv().is_err(), "taken by its waiter");
        hub.deliver(message("ch", "latchkey:granted\ns2:7\n44\nlk\nme"));
        assert!(unclaimed.try_recv().is_err(), "another server's claim");
        drop(waiter);
        hub.deliver(message("ch", "latchkey:granted\ns1:7\n45\nlk\nme"));
        let expected = Unclaimed {
            lock: "lk".into(),
            hold: "s1:7".into(),
            owner: "me".into(),
        };
        assert_eq!(unclaimed.try_recv().ok(), Some(expected), "no waiter here any more");
    }

    /// A waiter holds one wake at a time: unlocks while it is pending make no second,
    /// and one after it took its wake is pending again. Its flag and its permit agree,
    /// so a waiter that leaves passes on exactly the wake it has.
    #[tokio::test]
    async fn a_waiter_holds_one_wake_at_a_time() {
        let hub = Hub::new("force".into(), "s1");
        let waiter = hub.register("ch", "lk", Want::Shared, None, None);
        hub.deliver(message("ch", "0"));
        hub.deliver(message("ch", "0"));
        assert!(waiter.woken().now_or_never().is_some(), "woken");
        assert!(!waiter.slot.woken.load(Ordering::Acquire));
        assert!(waiter.woken().now_or_never().is_none(), "one wake for both unlocks");
        hub.deliver(message("ch", "0"));
        assert!(waiter.slot.woken.load(Ordering::Acquire));
        assert!(waiter.woken().now_or_never().is_some(), "the next unlock's");
    }

    #[test]
    fn a_force_notice_names_its_floor_and_key() {
        let notice = |key: &str, floor| Notice::Forced {
            key: key.to_owned(),
            floor,
        };
        assert_eq!(
            forced("orders\n1700000000000001"),
            notice("orders", 1_700_000_000_000_001)
        );
        assert_eq!(
            forced("7 a b\n7"),
            notice("7 a b", 7),
            "a key may hold spaces and digits"
        );
        assert_eq!(forced("orders"), notice("orders", u64::MAX), "no floor: every hold");
        assert_eq!(
            forced("2024 report"),
            notice("2024 report", u64::MAX),
            "an older server's key"
        );
    }

    /// A channel whose last waiter left listens idle only if it was subscribed: one
    /// whose subscription never came is no listener a release may count as this
    /// server's own.
    #[test]
    fn only_a_subscribed_channel_listens_idle_after_its_last_waiter() {
        let hub = Hub::new("force".into(), "srv");
        drop(hub.register("never", "never", Want::Exclusive, None, None));
        assert!(!hub.listens_idle("never"));
        let waiter = hub.register("heard", "heard", Want::Exclusive, None, None);
        hub.mark_ready(&["heard".to_owned()], &HashSet::from(["heard".to_owned()]), 0);
        assert!(!hub.listens_idle("heard"), "someone waits");
        drop(waiter);
        assert!(hub.listens_idle("heard"), "subscribed, nobody waiting");
    }

    /// A reconnect takes every subscription with it, an idle channel's too: it listened
    /// idle on, and a release here counted this server among listeners Redis no longer
    /// had.
    #[test]
    fn no_channel_listens_idle_after_a_reconnect() {
        let hub = Hub::new("force".into(), "srv");
        let waiter = hub.register("c", "c", Want::Exclusive, None, None);
        hub.mark_ready(&["c".to_owned()], &HashSet::from(["c".to_owned()]), 0);
        drop(waiter);
        assert!(hub.listens_idle("c"), "subscribed, nobody waiting");
        hub.unready_everyone();
        assert!(!hub.listens_idle("c"), "the reconnect took the subscription");
    }

    /// A channel whose last waiter left listens idle until its unsubscribe has gone, not
    /// only until its batch is taken: the UNSUBSCRIBE's round trip (up to a Redis
    /// timeout) lay between the two, when a release here counted the subscription as a
    /// listener that no claim stands for, and published where it could grant a claim.
    #[test]
    fn a_channel_listens_idle_until_its_unsubscribe_went() {
        let hub = Hub::new("force".into(), "srv");
        let waiter = hub.register("c", "c", Want::Exclusive, None, None);
        hub.mark_ready(&["c".to_owned()], &HashSet::from(["c".to_owned()]), 0);
        drop(waiter);
        let (_, removed) = hub.take_changes(true);
        assert_eq!(removed, ["c"]);
        assert!(hub.listens_idle("c"), "the unsubscribe is still on its way");
        // A waiter came and left while it was: queued to go again, not subscribed.
        drop(hub.register("c", "c", Want::Exclusive, None, None));
        hub.settle_idle(&removed, |_| false);
        assert!(!hub.listens_idle("c"), "unsubscribed");
        // One whose unsubscribe failed still listens.
        let waiter = hub.register("d", "d", Want::Exclusive, None, None);
        hub.mark_ready(&["d".to_owned()], &HashSet::from(["d".to_owned()]), 0);
        drop(waiter);
        let (_, removed) = hub.take_changes(true);
        hub.settle_idle(&removed, |_| true);
        assert!(hub.listens_idle("d"), "still subscribed");
    }

    /// A subscription answered on a connection that a reconnect replaced since leaves
    /// its channel unready: the next round subscribes it again. (Marked ready, the
    /// channel's newcomers skipped the subscribe-then-try order until then.) A channel
    /// queued twice, by a failed subscribe and by a reconnect, is subscribed once.
    #[test]
    fn a_subscription_from_before_a_reconnect_marks_nothing_ready() {
        let hub = Hub::new("force".into(), "srv");
        let waiter = hub.register("c", "c", Want::Exclusive, None, None);
        let subscribed = HashSet::from(["c".to_owned()]);
        hub.unready_everyone();
        hub.mark_ready(&["c".to_owned()], &subscribed, 0);
        assert!(!waiter.is_subscribed(), "subscribed on the connection gone since");
        hub.mark_ready(&["c".to_owned()], &subscribed, 1);
        assert!(waiter.is_subscribed());
        hub.inner.lock().added.extend(["c".to_owned(), "c".to_owned()]);
        let (added, _) = hub.take_changes(false);
        assert_eq!(added, ["c"]);
    }
}
