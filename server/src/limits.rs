//! Bounds a misbehaving client cannot push the server past: Acquire and Watch
//! streams per connection and waiters per lock and per server. Each is a counter with an RAII
//! permit; the maps only hold keys with a live permit, so they are bounded by the
//! streams themselves. Going over answers RESOURCE_EXHAUSTED (ErrorInfo
//! `LIMIT_REACHED`) with a message naming the flag.

use crate::error::Error;
use crate::serve::Peer;
use crate::sparse::Sparse;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// The configured bounds.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// `--max-streams`: Acquire and Watch streams of the whole server.
    pub streams: usize,
    /// `--max-streams-per-connection`.
    pub streams_per_connection: usize,
    /// `--max-waiters`.
    pub waiters: usize,
    /// `--max-waiters-per-lock`.
    pub waiters_per_lock: usize,
}

/// The live counts against [`Bounds`]. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Limits {
    bounds: Bounds,
    /// Streams by connection.
    connections: Counter<StreamsOn>,
    waiters: Counter<Waited>,
}

/// A lock as its waiters are counted: a RedLock lock lives on other Redis deployments
/// than the main lock of its name, and the two have their own waiters and their own
/// `--max-waiters-per-lock`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Waited {
    /// The lock's name.
    pub name: String,
    /// Whether it is taken on the RedLock deployments.
    pub redlock: bool,
}

impl Limits {
    /// The bounds these limits enforce.
    pub fn bounds(&self) -> &Bounds {
        &self.bounds
    }

    /// Counts starting at zero.
    pub fn new(bounds: Bounds) -> Self {
        Self {
            bounds,
            connections: Counter::default(),
            waiters: Counter::default(),
        }
    }

    /// One more Acquire or Watch stream on the connection `peer`, TCP or Unix socket
    /// (a request served without a listener has none and is not counted). Watch
    /// streams count too: past the bound, HTTP/2 itself would queue a connection's new
    /// streams, unary calls included, without a word.
    pub fn stream(&self, peer: Option<&Peer>) -> Result<Option<Permit<StreamsOn>>, Error> {
        let Some(peer) = peer else { return Ok(None) };
        let max = self.bounds.streams_per_connection;
        let on = StreamsOn {
            id: peer.id,
            cut: peer.cut.clone(),
        };
        self.connections.enter(on, max, usize::MAX).map(Some).map_err(|_| {
            Error::ResourceExhausted(format!(
                "this connection holds its maximum of {max} Acquire and Watch streams (--max-streams-per-connection)"
            ))
        })
    }

    /// Cuts every connection that carries an Acquire or Watch stream now: a shutdown's
    /// streams that did not end in time. The others, unary calls under way among them
    /// (a ForceRelease waiting on a slow Redis), close with the server's graceful end.
    pub fn cut_connections_with_streams(&self) {
        for on in self.connections.lock().per_key.keys() {
            on.cut.cancel();
        }
    }

    /// One more waiter on the lock `lock`.
    pub fn waiter(&self, lock: Waited) -> Result<Permit<Waited>, Error> {
        let (per_lock, total) = (self.bounds.waiters_per_lock, self.bounds.waiters);
        self.waiters
            .enter(lock, per_lock, total)
            .map_err(|(full, lock)| match full {
                Full::Key => self.lock_full(&lock.name),
                Full::Total => self.server_full(),
            })
    }

    /// The refusal a newcomer to the lock `lock` that finds it busy will meet now, if
    /// any: this server holds `--max-waiters`, or the lock its `--max-waiters-per-lock`.
    pub fn no_waiter_room(&self, lock: &Waited) -> Option<Error> {
        if self.waiters.total() >= self.bounds.waiters {
            return Some(self.server_full());
        }
        (self.waiting_on(lock) >= self.bounds.waiters_per_lock).then(|| self.lock_full(&lock.name))
    }

    /// The refusal of one more waiter on this server.
    fn server_full(&self) -> Error {
        let total = self.bounds.waiters;
        Error::ResourceExhausted(format!(
            "this server holds its maximum of {total} waiters (--max-waiters)"
        ))
    }

    /// This server's waiters of the lock `lock`.
    pub fn waiting_on(&self, lock: &Waited) -> usize {
        self.waiters.count(lock)
    }

    /// The refusal of one more waiter on the lock `name`.
    fn lock_full(&self, name: &str) -> Error {
        let per_lock = self.bounds.waiters_per_lock;
        Error::ResourceExhausted(format!(
            "lock {name:?} has its maximum of {per_lock} waiters on this server (--max-waiters-per-lock)"
        ))
    }

    /// Counts `waiter` on the lock `lock` from now on, when `lock` has room for one more
    /// waiter: a multi-lock waits for whichever of its names blocked it last, and
    /// counted on a name it no longer waits for it would turn that name's waiters away.
    /// Without room it stays counted where it is: a stream already waiting is never
    /// ended for it (a multi-lock's waiters move between their names as their tries
    /// cross), and the name it moves to is never counted past its bound.
    pub fn move_waiter(&self, waiter: &mut Permit<Waited>, lock: &Waited) {
        self.waiters.move_to(waiter, lock, self.bounds.waiters_per_lock);
    }

    /// Waiters counted now, for tests and metrics.
    pub fn waiting(&self) -> usize {
        self.waiters.total()
    }
}

/// Which bound was hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Full {
    Key,
    Total,
}

/// Counts per key and in total; a key is dropped with its last permit.
#[derive(Debug)]
struct Counter<K> {
    inner: Arc<Mutex<Counts<K>>>,
}

impl<K> Default for Counter<K> {
    fn default() -> Self {
        Self {
            inner: Arc::new(Mutex::new(Counts {
                per_key: HashMap::new(),
                total: 0,
            })),
        }
    }
}

impl<K> Clone for Counter<K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

#[derive(Debug)]
struct Counts<K> {
    per_key: HashMap<K, usize>,
    total: usize,
}

impl<K: Hash + Eq> Counts<K> {
    /// One fewer under `key`; a key counting none is forgotten.
    fn leave_key(&mut self, key: &K) {
        if let Some(n) = self.per_key.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                self.per_key.remove(key);
                self.per_key.shrink_if_sparse();
            }
        }
    }
}

impl<K: Hash + Eq + Clone> Counter<K> {
    /// Counts one more under `key`; refused, the key comes back with the bound it met.
    fn enter(&self, key: K, per_key: usize, total: usize) -> Result<Permit<K>, (Full, K)> {
        let mut counts = self.lock();
        if counts.total >= total {
            return Err((Full::Total, key));
        }
        // Looked up before any entry is made: a refused key leaves none behind (a bound
        // of 0 refuses every key, and a client chooses as many names as it likes).
        if counts.per_key.get(&key).copied().unwrap_or(0) >= per_key {
            return Err((Full::Key, key));
        }
        *counts.per_key.entry(key.clone()).or_insert(0) += 1;
        counts.total += 1;
        Ok(Permit {
            counter: self.clone(),
            key: Some(key),
        })
    }

    /// Moves `permit` to `key` when `key` has fewer than `per_key`; the total stays.
    fn move_to<Q>(&self, permit: &mut Permit<K>, key: &Q, per_key: usize)
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if permit.key.as_ref().is_none_or(|held| held.borrow() == key) {
            return;
        }
        let mut counts = self.lock();
        if counts.per_key.get(key).copied().unwrap_or(0) >= per_key {
            return;
        }
        if let Some(old) = permit.key.replace(key.to_owned()) {
            counts.leave_key(&old);
        }
        *counts.per_key.entry(key.to_owned()).or_insert(0) += 1;
    }

    fn leave(&self, key: &K) {
        let mut counts = self.lock();
        counts.total = counts.total.saturating_sub(1);
        counts.leave_key(key);
    }

    fn total(&self) -> usize {
        self.lock().total
    }

    /// How many are counted under `key`.
    fn count<Q>(&self, key: &Q) -> usize
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.lock().per_key.get(key).copied().unwrap_or(0)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts<K>> {
        // Counts stay consistent even if a holder panicked: each change is one step.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A connection as the streams on it count it: by its [`Peer::id`], with the token
/// that cuts it.
#[derive(Debug, Clone)]
pub struct StreamsOn {
    id: u64,
    cut: CancellationToken,
}

impl PartialEq for StreamsOn {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for StreamsOn {}

impl Hash for StreamsOn {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.id.hash(state);
    }
}

/// One counted stream or waiter; dropping it gives the place back.
#[derive(Debug)]
pub struct Permit<K: Hash + Eq + Clone> {
    counter: Counter<K>,
    key: Option<K>,
}

impl<K: Hash + Eq + Clone> Drop for Permit<K> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.counter.leave(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection numbered `id`.
    fn peer(id: u64) -> Peer {
        Peer {
            id,
            addr: None,
            certs: None,
            cut: Default::default(),
        }
    }

    fn limits(per_conn: usize, total: usize, per_lock: usize) -> Limits {
        Limits::new(Bounds {
            streams: 100,
            streams_per_connection: per_conn,
            waiters: total,
            waiters_per_lock: per_lock,
        })
    }

    /// The main Redis's lock `name`.
    fn main(name: &str) -> Waited {
        Waited {
            name: name.to_owned(),
            redlock: false,
        }
    }

    /// A RedLock lock and the main lock of one name count their waiters apart.
    #[test]
    fn a_redlock_lock_and_the_main_lock_of_its_name_have_their_own_bounds() {
        let l = limits(10, 10, 1);
        let redlock = Waited {
            redlock: true,
            ..main("a")
        };
        let _on_redlock = l.waiter(redlock.clone()).unwrap();
        assert!(l.no_waiter_room(&main("a")).is_none());
        let _on_main = l.waiter(main("a")).unwrap();
        assert!(l.waiter(redlock).is_err() && l.waiter(main("a")).is_err());
    }

    #[test]
    fn a_waiter_moves_to_a_lock_with_room_and_stays_put_otherwise() {
        let l = limits(10, 3, 1);
        let mut moving = l.waiter(main("a")).unwrap();
        let b = l.waiter(main("b")).unwrap();
        // "b" is full: still counted on "a", whose next waiter is refused.
        l.move_waiter(&mut moving, &main("b"));
        assert!(l.waiter(main("a")).is_err());
        drop(b);
        // Moved: "a" has room, "b" none, and the total is unchanged.
        l.move_waiter(&mut moving, &main("b"));
        let a = l.waiter(main("a")).unwrap();
        assert!(l.waiter(main("b")).is_err());
        assert_eq!(l.waiting(), 2);
        drop((moving, a));
        assert_eq!(l.waiting(), 0);
        assert!(l.waiter(main("a")).is_ok() && l.waiter(main("b")).is_ok());
    }

    #[test]
    fn waiters_are_bounded_per_lock_and_in_total() {
        let l = limits(10, 3, 2);
        let a1 = l.waiter(main("a")).unwrap();
        let _a2 = l.waiter(main("a")).unwrap();
        let err = l.waiter(main("a")).unwrap_err().to_string();
        assert!(err.contains("--max-waiters-per-lock") && err.contains("\"a\""), "{err}");
        let _b = l.waiter(main("b")).unwrap();
        let err = l.waiter(main("c")).unwrap_err().to_string();
        assert!(err.contains("--max-waiters)"), "{err}");
        drop(a1);
        assert!(l.waiter(main("c")).is_ok());
    }

    #[test]
    fn counts_go_back_to_zero_and_keys_are_dropped() {
        let l = limits(1, 10, 10);
        let s = l.stream(Some(&peer(1))).unwrap();
        assert!(l.stream(Some(&peer(1))).is_err());
        assert!(l.stream(Some(&peer(2))).is_ok());
        assert!(l.stream(None).unwrap().is_none());
        drop(s);
        assert!(l.stream(Some(&peer(1))).is_ok());
        let w = l.waiter(main("x")).unwrap();
        drop(w);
        assert_eq!(l.waiting(), 0);
        assert!(l.waiters.lock().per_key.is_empty());
        assert!(l.connections.lock().per_key.is_empty());
    }

    /// The shutdown's cut reaches the connections that carry a stream now, and only
    /// those: one whose streams ended, and one that never had any, stay.
    #[test]
    fn the_cut_reaches_only_connections_with_streams() {
        let l = limits(2, 10, 10);
        let (streaming, ended, idle) = (peer(1), peer(2), peer(3));
        let _open = l.stream(Some(&streaming)).unwrap();
        drop(l.stream(Some(&ended)).unwrap());
        l.cut_connections_with_streams();
        assert!(streaming.cut.is_cancelled());
        assert!(!ended.cut.is_cancelled() && !idle.cut.is_cancelled());
    }

    /// A bound of 0 refuses every key and keeps none of them.
    #[test]
    fn refused_keys_leave_no_entry() {
        let l = limits(0, 10, 0);
        assert!(l.waiter(main("a")).is_err() && l.waiter(main("b")).is_err());
        assert!(l.stream(Some(&peer(1))).is_err());
        assert!(l.waiters.lock().per_key.is_empty());
        assert!(l.connections.lock().per_key.is_empty());
    }
}
