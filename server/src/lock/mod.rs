//! The domain core: lock requests, grants and the Redis operations of each lock kind.
//! Nothing here knows about gRPC.

mod mutex;

pub use mutex::millis;

use crate::error::Error;
use crate::keys::LockKeys;
use crate::redis::Backend;
use std::sync::Arc;
use std::time::Duration;

/// How long hold records and the fencing counter outlive the lease, so a release at
/// the very end of a fixed lease still finds its record.
pub const RECORD_GRACE: Duration = Duration::from_secs(5);

/// The kind of lock a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Reentrant, non-fair (Redisson `RLock`).
    Mutex,
}

/// A checked request for one hold of one lock.
#[derive(Debug, Clone)]
pub struct Request {
    /// Keys of the lock.
    pub keys: LockKeys,
    /// The kind asked for.
    pub kind: Kind,
    /// Unset: wait forever; zero: try once.
    pub wait: Option<Duration>,
    /// Fixed lease; unset: the watchdog's lease for the stream's lifetime.
    pub fixed_lease: Option<Duration>,
    /// The reentrancy identity.
    pub owner: String,
    /// Unique per stream: names the hold record that makes scripts safe to retry.
    pub hold_id: String,
}

impl Request {
    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.keys.name
    }
}

/// A granted hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Strictly increasing per lock name.
    pub fencing_token: u64,
    /// The owner's holds, this one included.
    pub hold_count: u32,
}

/// The outcome of one try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The hold is granted.
    Acquired(Grant),
    /// Someone else holds the lock for (at most) `ttl` more.
    Busy {
        /// The holder's remaining TTL, when it has one.
        ttl: Option<Duration>,
    },
}

/// The lock operations, dispatched by kind.
#[derive(Debug, Clone)]
pub struct Locks {
    backend: Arc<Backend>,
    watchdog_lease: Duration,
}

impl Locks {
    /// Lock operations on `backend`; stream-scoped leases last `watchdog_lease`.
    pub fn new(backend: Arc<Backend>, watchdog_lease: Duration) -> Self {
        Self {
            backend,
            watchdog_lease,
        }
    }

    /// The backend the locks live on.
    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }

    /// The lease a grant of `req` starts with.
    pub fn lease_of(&self, req: &Request) -> Duration {
        req.fixed_lease.unwrap_or(self.watchdog_lease)
    }

    /// Tries once to take the lock.
    pub async fn try_acquire(&self, req: &Request) -> Result<Attempt, Error> {
        let attempt = match req.kind {
            Kind::Mutex => mutex::try_acquire(&self.backend, req, self.lease_of(req)).await,
        };
        if let Err(Error::NotReplicated { .. }) = &attempt {
            // The grant may not survive a failover: give it back rather than hand out a
            // lock that could be granted twice.
            let _ = self.release(req).await;
        }
        attempt
    }

    /// Gives back this request's hold; `Ok(false)` when it was no longer held.
    pub async fn release(&self, req: &Request) -> Result<bool, Error> {
        match req.kind {
            Kind::Mutex => mutex::release(&self.backend, req).await,
        }
    }
}

/// A snapshot of one lock, for Describe and List.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    /// The lock's name.
    pub name: String,
    /// The kind it is held as; `None` when free.
    pub kind: Option<Kind>,
    /// Owner ids and their hold counts.
    pub holders: Vec<(String, u32)>,
    /// The lock's remaining TTL.
    pub ttl: Option<Duration>,
    /// The latest fencing token of the name, 0 when unknown.
    pub last_fencing_token: u64,
}

impl State {
    /// True while someone holds the lock.
    pub fn locked(&self) -> bool {
        !self.holders.is_empty()
    }
}

impl Locks {
    /// Reads one lock (`describe.lua`). A key that is not a lock reads as free.
    pub async fn describe(&self, keys: &crate::keys::LockKeys) -> Result<State, Error> {
        use fred::prelude::Value;
        let script = &self.backend.scripts().describe;
        let redis_keys = vec![keys.lock.as_str().into(), keys.fence.as_str().into()];
        let reply: Vec<Value> = self.backend.eval(script, redis_keys, Vec::new()).await?;
        let [kind, pttl, fence, fields] = <[Value; 4]>::try_from(reply)
            .map_err(|r| Error::Protocol(format!("describe returned {} values", r.len())))?;
        let mut state = State {
            name: keys.name.clone(),
            last_fencing_token: fence.as_u64().unwrap_or(0),
            ..State::default()
        };
        if kind.as_str().as_deref() != Some("hash") {
            return Ok(state);
        }
        let Some(holders) = holders(fields) else {
            return Ok(state);
        };
        state.holders = holders;
        state.kind = Some(Kind::Mutex);
        state.ttl = pttl.as_i64().and_then(mutex::ttl_of);
        Ok(state)
    }
}

/// The owner → hold count pairs of a lock hash; `None` when the hash is not a lock
/// (a value that is not a positive count).
fn holders(fields: fred::prelude::Value) -> Option<Vec<(String, u32)>> {
    let map = fields.into_map().ok()?;
    let mut holders = Vec::with_capacity(map.len());
    for (field, value) in map.inner() {
        let owner = field.into_string()?;
        let count = value.as_u64().and_then(|c| u32::try_from(c).ok()).filter(|c| *c > 0)?;
        holders.push((owner, count));
    }
    holders.sort();
    Some(holders)
}
