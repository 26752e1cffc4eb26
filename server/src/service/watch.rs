//! The `Watch` stream: one `LockState` at once, then one per change. Changes arrive by
//! pub/sub: latchkey's scripts announce every grant, release, queue change and break
//! on the lock's watch channel, and Redisson's unlock messages come on the kinds'
//! channels. The mutex's unlock channel is listened on only while a Redisson client
//! holds the mutex: the release scripts count its listeners, and a listener with no
//! waiter behind it would stop a hot mutex being passed in memory or granted to claims.
//! Timers cover the rest: the holder's TTL, so an expiry is seen when it happens, and a
//! re-read every second, as a Redisson client announces nothing when it takes a lock.
//! The watchers of one lock on one server share its reader: a change costs one read of
//! Redis however many watch it.

use super::{convert, Shared};
use crate::auth::{self, Action, Caller, Standing};
use crate::error::Error;
use crate::hub::{Waiter, Want};
use crate::keys::LockKeys;
use futures::StreamExt;
use latchkey_proto::v1::{LockKind, LockState};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

/// States buffered per Watch stream before the server waits for the client.
const WATCH_BUFFER: usize = 8;
/// How long a new reader waits for its subscriptions before the first state.
const SUBSCRIBE_WAIT: Duration = Duration::from_secs(1);
/// A lock is re-read at least this often: a Redisson client takes a lock, or another
/// hold of one, without a message.
const QUIET_RECHECK: Duration = Duration::from_secs(1);
/// After each read a reader rests this many times as long as the read took (at most
/// [`QUIET_RECHECK`]) before the next: a read costs Redis in proportion to the lock's
/// queue (a millisecond and more for a fair lock of thousands of waiters), and such a
/// lock changes at every join, leave and grant, so that read after read would keep Redis
/// busy. Resting, a reader takes at most a fifth of the time; the changes meanwhile are
/// seen by the next read, as a slow client skips states.
const READ_REST: u32 = 4;

/// What a reader last read (nothing yet, a state, or the error that ended it), and
/// which of its reads that was: a follower's first state comes from a read started
/// after it joined.
#[derive(Debug, Default)]
struct Read {
    number: u64,
    result: Option<Result<LockState, Status>>,
}

/// The readers of the locks this server's Watch streams follow, by lock key. A reader
/// lives while a watcher follows it: the last to leave ends it.
#[derive(Debug, Default)]
pub struct Readers(Mutex<HashMap<String, Arc<Reader>>>);

/// One lock's reader, as its followers and the registry see it.
#[derive(Debug)]
struct Reader {
    /// What it read last; a follower hears of each change.
    states: watch::Sender<Read>,
    /// A new follower asks for a read of its own first state: the last one may be a
    /// message behind what the client did just before it asked to watch.
    refresh: Notify,
    /// The error of each read that failed while Redis did not answer. Followers that
    /// have a state wait on (the reader reads again); one still waiting for its first
    /// state ends with it, as a Watch whose first read fails does.
    failures: watch::Sender<Option<Status>>,
    /// The reads started so far, counted before each is sent.
    reads: AtomicU64,
}

/// What a follower hears from its reader: the states, and the reads that failed.
struct Following {
    states: watch::Receiver<Read>,
    failures: watch::Receiver<Option<Status>>,
    /// The first read whose state it may show: one in flight when it joined may
    /// have been answered before what its client did just before it asked to watch.
    first: u64,
}

impl Readers {
    /// Follows the reader of `keys`, started when there is none; the first state comes
    /// from a read made after the call.
    fn follow(&self, shared: &Arc<Shared>, keys: &LockKeys) -> Following {
        let mut readers = self.readers();
        if let Some(reader) = readers.get(&keys.lock).filter(|r| !r.states.is_closed()) {
            let follower = Following {
                states: reader.states.subscribe(),
                failures: reader.failures.subscribe(),
                first: reader.reads.load(Ordering::SeqCst) + 1,
            };
            reader.refresh.notify_one();
            return follower;
        }
        let (states, follower) = watch::channel(Read::default());
        let (failures, failed) = watch::channel(None);
        let follower = Following {
            states: follower,
            failures: failed,
            first: 1,
        };
        let reader = Arc::new(Reader {
            states,
            refresh: Notify::new(),
            failures,
            reads: AtomicU64::new(0),
        });
        readers.insert(keys.lock.clone(), reader.clone());
        let (shared, keys) = (shared.clone(), keys.clone());
        shared.sessions.clone().spawn(async move {
            loop {
                let unfollowed = read(&shared, &keys, &reader).await;
                if shared.watched.retire(&keys.lock, &reader, unfollowed) {
                    break;
                }
            }
        });
        follower
    }

    /// Takes the reader of `lock` out of the registry once its read ended, unless a new
    /// reader took its place (this one had no follower left). False when it is to read
    /// again instead: it ended for want of followers, and one has come since. That one
    /// found the reader open just as the last follower left (a follower leaves without
    /// the registry's lock); left to a reader that ended, it would end too, with no
    /// state and `SHUTTING_DOWN` from a server that is not stopping.
    fn retire(&self, lock: &str, reader: &Arc<Reader>, unfollowed: bool) -> bool {
        let mut readers = self.readers();
        if !readers.get(lock).is_some_and(|r| Arc::ptr_eq(r, reader)) {
            return true;
        }
        if unfollowed && reader.states.receiver_count() > 0 {
            return false;
        }
        readers.remove(lock);
        true
    }

    fn readers(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Reader>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Starts one Watch stream of the lock `keys` (which `caller` may inspect): its states,
/// then the status it ends with. The status goes apart from the states, which a client that
/// reads slowly leaves queued: it never waits for room (shutdown does not wait on such
/// a client), and it comes after them rather than never (the stream would end OK,
/// which tells a client the watch is over for good).
pub(super) fn start(
    shared: Arc<Shared>,
    keys: LockKeys,
    caller: &Caller,
    places: impl Send + 'static,
) -> super::StateStream {
    let standing = Standing::new(shared.auth.as_deref(), caller, None);
    let (tx, rx) = mpsc::channel(WATCH_BUFFER);
    let (end_tx, end_rx) = oneshot::channel::<Status>();
    let sessions = shared.sessions.clone();
    sessions.spawn(async move {
        let _places = places;
        let following = shared.watched.follow(&shared, &keys);
        // `forward` ends without a status only when the client went away.
        let code = match forward(&shared, following, standing, keys.name(), &tx).await {
            Ok(()) => tonic::Code::Cancelled,
            Err(status) => {
                let code = status.code();
                let _ = end_tx.send(status);
                code
            }
        };
        crate::metrics::rpc_handled("Watch", code);
    });
    let end = futures::stream::once(end_rx).filter_map(|end| std::future::ready(end.ok().map(Err)));
    Box::pin(ReceiverStream::new(rx).chain(end))
}

/// Sends the client each state of the reader that differs from the last it sent; a
/// client that reads slowly skips the states that came meanwhile. An auth file reload
/// that takes the caller's right to inspect the lock away ends the stream, and so does a
/// read that fails before the first state went out.
async fn forward(
    shared: &Shared,
    following: Following,
    mut standing: Option<Box<Standing>>,
    name: &str,
    tx: &mpsc::Sender<Result<LockState, Status>>,
) -> Result<(), Status> {
    let Following {
        mut states,
        mut failures,
        first,
    } = following;
    let mut last: Option<LockState> = None;
    loop {
        tokio::select! {
            // A revocation first: no state goes out after it.
            biased;
            e = auth::revoked(standing.as_deref_mut(), Action::Inspect, [name]) => return Err(e.into()),
            _ = shared.shutdown.cancelled() => return Err(Error::ShuttingDown.into()),
            _ = tx.closed() => return Ok(()),
            changed = states.changed() => {
                // The reader ends without an error only at shutdown.
                if changed.is_err() && !matches!(states.borrow().result, Some(Err(_))) {
                    return Err(Error::ShuttingDown.into());
                }
            }
            // Gone with the reader only once `states` said why.
            Ok(()) = failures.changed(), if last.is_none() => {
                if let Some(status) = failures.borrow_and_update().clone() {
                    return Err(status);
                }
                continue;
            }
        }
        // Compared before it is copied: every follower of the lock is woken by each read
        // a newcomer asks for, most of them to find nothing changed (a fair queue of
        // thousands is large to copy for nothing).
        let state = {
            let read = states.borrow_and_update();
            match &read.result {
                Some(Err(status)) => return Err(status.clone()),
                Some(Ok(state)) if read.number >= first && last.as_ref().is_none_or(|l| !same(l, state)) => {
                    state.clone()
                }
                _ => continue,
            }
        };
        // A client that reads slowly holds the send up: a revocation ends it too.
        let sent = tokio::select! {
            biased;
            e = auth::revoked(standing.as_deref_mut(), Action::Inspect, [name]) => return Err(e.into()),
            sent = send_until_shutdown(shared, tx, Ok(state.clone())) => sent,
        };
        match sent {
            None => return Err(Error::ShuttingDown.into()),
            Some(false) => return Ok(()),
            Some(true) => {}
        }
        last = Some(state);
    }
}

/// Reads the lock once subscribed, again on each message and timer and for each new
/// follower, and publishes every state (its followers hear of changes, and of the
/// read a new follower asked for), until the last follower leaves, shutdown, or an
/// error other than a passing one once a state was read (published as the last).
/// True when it ended because no follower was left.
async fn read(shared: &Shared, keys: &LockKeys, reader: &Reader) -> bool {
    let states = &reader.states;
    let channels = [&keys.watch(), &keys.rw_channel(), &keys.semaphore_channel()];
    let watchers: Vec<Waiter> = channels.iter().map(|c| listen(shared, c)).collect();
    if !subscribed(shared, states, &watchers).await {
        return !shared.shutdown.is_cancelled();
    }
    // The unlock channel, while a Redisson client holds the lock.
    let mut unlock: Option<Waiter> = None;
    let mut read_once = false;
    let mut asked = false;
    loop {
        let mut recheck = None;
        let mut locked = false;
        let mut redisson = unlock.is_some();
        let number = reader.reads.fetch_add(1, Ordering::SeqCst) + 1;
        let started = Instant::now();
        // A read waiting on a Redis that does not answer gives way to shutdown, which
        // would otherwise wait out its Redis timeout, and to the last follower leaving,
        // whose reader would keep its subscriptions meanwhile (and a Watch opened then,
        // finding it ended, would start one more).
        let read = tokio::select! {
            _ = shared.shutdown.cancelled() => return false,
            _ = states.closed() => return true,
            read = shared.locks.describe(keys) => read,
        };
        match read {
            Ok(state) => {
                let state = convert::to_lock_state(state);
                recheck = state.ttl.and_then(|t| Duration::try_from(t).ok());
                locked = state.locked;
                redisson = redisson_holds(&state);
                states.send_if_modified(|read| {
                    let changed = !matches!(&read.result, Some(Ok(last)) if same(last, &state));
                    *read = Read {
                        number,
                        result: Some(Ok(state)),
                    };
                    changed || std::mem::take(&mut asked)
                });
                read_once = true;
            }
            // Once a state is out, a Redis that does not answer for a while (a restart,
            // a failover) ends no Watch: it reads again until Redis answers.
            Err(Error::Redis(e)) if crate::redis::transient(&e) && read_once => {
                tracing::debug!(lock = %keys.lock, error = %e, "watch read failed; reading again");
                reader.failures.send_replace(Some(Error::Redis(e).into()));
            }
            Err(e) => {
                states.send_replace(Read {
                    number,
                    result: Some(Err(e.into())),
                });
                return false;
            }
        }
        if redisson != unlock.is_some() {
            unlock = redisson.then(|| listen(shared, &keys.channel()));
            // Listening from now on, the lock is read again: a release before the
            // subscription was in place is seen by that read.
            if let Some(waiter) = &unlock {
                if !subscribed(shared, states, std::slice::from_ref(waiter)).await {
                    return !shared.shutdown.is_cancelled();
                }
                continue;
            }
        }
        let expiry = recheck.filter(|_| locked);
        let until =
            Instant::now() + expiry.map_or(QUIET_RECHECK, |ttl| (ttl + Duration::from_millis(1)).min(QUIET_RECHECK));
        let rested = Instant::now() + (started.elapsed() * READ_REST).min(QUIET_RECHECK);
        tokio::select! {
            _ = shared.shutdown.cancelled() => return false,
            _ = states.closed() => return true,
            _ = tokio::time::sleep_until(rested) => {}
        }
        let any_change = futures::future::select_all(watchers.iter().chain(&unlock).map(|w| Box::pin(w.woken())));
        tokio::select! {
            _ = shared.shutdown.cancelled() => return false,
            _ = states.closed() => return true,
            _ = reader.refresh.notified() => asked = true,
            _ = any_change => {}
            _ = tokio::time::sleep_until(until) => {}
        }
    }
}

/// A reader's subscription to `channel`, as an observer: it waits for no lock.
fn listen(shared: &Shared, channel: &str) -> Waiter {
    shared.hub.register(channel, "", Want::Watch, None, None)
}

/// Waits for `watchers`' subscriptions at once, within one SUBSCRIBE_WAIT; false when
/// shutdown or the last follower leaving ended the wait.
async fn subscribed(shared: &Shared, states: &watch::Sender<Read>, watchers: &[Waiter]) -> bool {
    let subscribed = futures::future::join_all(watchers.iter().map(|w| w.subscribed(SUBSCRIBE_WAIT)));
    tokio::select! {
        _ = shared.shutdown.cancelled() => false,
        _ = states.closed() => false,
        _ = subscribed => true,
    }
}

/// Whether a Redisson client may hold the mutex `state` shows, which announces its
/// release (an `RLock`'s unlock) only on the unlock channel. Redisson's fair unlock
/// publishes on its next waiter's channel alone, and its read/write locks and
/// semaphores on channels a Watch always listens on. A client-named owner of Redisson's
/// shape is taken for one: while it holds, the Watch is a listener there again.
fn redisson_holds(state: &LockState) -> bool {
    state.kind() == LockKind::Mutex && state.holders.iter().any(|h| redisson_owner(&h.owner))
}

/// Whether `owner` has the shape of a Redisson client's owner id, `<UUID>:<thread id>`
/// (a latchkey stream's starts with its server's id, `latchkey-<UUID>:<n>`), the thread
/// id a Java long, negative too (as `lib.lua`'s `REDISSON_ID`).
fn redisson_owner(owner: &str) -> bool {
    owner.rsplit_once(':').is_some_and(|(client, thread)| {
        let digits = thread.strip_prefix('-').unwrap_or(thread);
        client.len() == 36
            && uuid::Uuid::try_parse(client).is_ok()
            && !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
    })
}

/// Sends `item` unless shutdown comes first: a client that stopped reading must not
/// hold up shutdown. `None` when shutdown came, else whether the client still listens.
async fn send_until_shutdown(
    shared: &Shared,
    tx: &mpsc::Sender<Result<LockState, Status>>,
    item: Result<LockState, Status>,
) -> Option<bool> {
    tokio::select! {
        biased;
        sent = tx.send(item) => Some(sent.is_ok()),
        _ = shared.shutdown.cancelled() => None,
    }
}

/// Two states are the same change-wise when they differ at most in remaining TTLs.
fn same(a: &LockState, b: &LockState) -> bool {
    a.kind == b.kind
        && a.locked == b.locked
        && a.last_fencing_token == b.last_fencing_token
        && a.waiters == b.waiters
        && a.holders.len() == b.holders.len()
        && (a.holders.iter().zip(&b.holders)).all(|(x, y)| x.owner == y.owner && x.hold_count == y.hold_count)
}

#[cfg(test)]
mod tests {
    use super::{redisson_holds, redisson_owner, Read, Reader, Readers};
    use latchkey_proto::v1::{Holder, LockKind, LockState};
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;
    use tokio::sync::{watch, Notify};

    fn new_reader() -> (Arc<Reader>, watch::Receiver<Read>) {
        let (states, follower) = watch::channel(Read::default());
        let reader = Reader {
            states,
            refresh: Notify::new(),
            failures: watch::channel(None).0,
            reads: AtomicU64::new(0),
        };
        (Arc::new(reader), follower)
    }

    /// The last follower leaves as another joins: the joiner found the reader open
    /// (the leaving takes no lock), and the reader, seeing no follower, ended its read.
    /// It reads again for the joiner rather than leave it to a reader gone.
    #[test]
    fn a_reader_whose_last_follower_left_as_another_came_reads_again() {
        let readers = Readers::default();
        let (reader, first) = new_reader();
        readers.readers().insert("l".into(), reader.clone());
        drop(first);
        let joiner = reader.states.subscribe();
        assert!(!readers.retire("l", &reader, true), "it reads again for the joiner");
        assert!(readers.readers().contains_key("l"));
        assert!(readers.retire("l", &reader, false), "ended by an error or shutdown");
        assert!(!readers.readers().contains_key("l"));
        drop(joiner);
        let (newer, follower) = new_reader();
        readers.readers().insert("l".into(), newer.clone());
        assert!(readers.retire("l", &reader, true), "a reader that took its place");
        assert!(Arc::ptr_eq(&readers.readers()["l"], &newer), "is kept");
        drop(follower);
        assert!(readers.retire("l", &newer, true), "no follower left");
        assert!(readers.readers().is_empty());
    }

    #[test]
    fn only_a_mutex_held_by_a_redisson_shaped_owner_is_listened_for() {
        let state = |kind: LockKind, owner: &str| LockState {
            kind: kind as i32,
            locked: true,
            holders: vec![Holder {
                owner: owner.to_owned(),
                hold_count: 1,
                ttl: None,
            }],
            ..LockState::default()
        };
        let java = "0a1b2c3d-4e5f-6789-abcd-ef0123456789:1";
        assert!(redisson_holds(&state(LockKind::Mutex, java)));
        for kind in [LockKind::Fair, LockKind::Read, LockKind::Write, LockKind::Semaphore] {
            assert!(!redisson_holds(&state(kind, java)), "{kind:?}");
        }
        assert!(!redisson_holds(&state(LockKind::Mutex, "node-1")));
    }

    #[test]
    fn only_redisson_shaped_owners_are_taken_for_redisson_clients() {
        assert!(redisson_owner("0a1b2c3d-4e5f-6789-abcd-ef0123456789:1"));
        assert!(redisson_owner("0A1B2C3D-4E5F-6789-ABCD-EF0123456789:42"));
        assert!(
            redisson_owner("0a1b2c3d-4e5f-6789-abcd-ef0123456789:-42"),
            "a negative thread id"
        );
        for owner in [
            "latchkey-0a1b2c3d-4e5f-6789-abcd-ef0123456789:7",
            "0a1b2c3d-4e5f-6789-abcd-ef0123456789",
            "0a1b2c3d-4e5f-6789-abcd-ef0123456789:",
            "0a1b2c3d-4e5f-6789-abcd-ef0123456789:-",
            "0a1b2c3d-4e5f-6789-abcd-ef0123456789:x1",
            "0a1b2c3d4e5f6789abcdef0123456789:1",
            "node-1",
        ] {
            assert!(!redisson_owner(owner), "{owner}");
        }
    }
}
