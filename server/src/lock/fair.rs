//! The fair lock on Redisson's `RFairLock` layout: the `RLock` hash, a queue list of
//! waiting owner ids and a sorted set of their deadlines (Redis time). Waiters are
//! granted in arrival order; each is woken on its own channel, so a release wakes only
//! the next in line. A waiter's server keeps its deadline fresh by polling; a crashed
//! server's waiters pass their deadline and are dropped from the head of the queue.

use super::{acquire, lease_args, millis, Attempt, Request};
use crate::error::Error;
use crate::keys::LockKeys;
use crate::redis::Backend;
use fred::prelude::{Key, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Tries once to take one hold; with `queue` (a request that may wait), joins the queue
/// (or refreshes its place) and answers when to poll again: before its deadline passes,
/// or earlier.
pub async fn try_acquire(
    backend: &Backend,
    req: &Request,
    lease: Duration,
    stay: Duration,
    queue: bool,
) -> Result<Attempt, Error> {
    let keys = acquire_keys(&req.keys, &req.hold_id).map(Key::from).to_vec();
    let mut args = lease_args(lease, req.owner.clone());
    args.push(Value::from(millis(stay)));
    args.push(Value::from(if queue { "1" } else { "0" }));
    let attempt = acquire(
        backend,
        &backend.scripts().fair_acquire,
        keys,
        args,
        std::slice::from_ref(&req.keys),
    )
    .await?;
    Ok(match attempt {
        // Poll three times per deadline, so one slow answer never costs the place.
        Attempt::Busy {
            recheck,
            position,
            blocked,
            holder_ttl,
        } if position > 0 => Attempt::Busy {
            recheck: Some(recheck.map_or(stay / 3, |r| r.min(stay / 3))),
            position,
            blocked,
            holder_ttl,
        },
        other => other,
    })
}

/// The keys `fair_acquire.lua` takes: lock, fencing counter, the stream's hold record,
/// queue, deadlines, unlock channel.
pub fn acquire_keys(k: &LockKeys, hold_id: &str) -> [String; 6] {
    [
        k.lock.clone(),
        k.fence(),
        k.hold(hold_id),
        k.queue(),
        k.timeouts(),
        k.channel(),
    ]
}

/// Leaves the queue (`fair_leave.lua`) and wakes the next waiter if the lock is free;
/// the queue keys outlive the deadlines left in it by `stay`.
pub async fn leave(backend: &Backend, req: &Request, stay: Duration) -> Result<(), Error> {
    let k = &req.keys;
    let keys = vec![
        k.lock.as_str().into(),
        k.channel().into(),
        k.queue().into(),
        k.timeouts().into(),
    ];
    let args = vec![
        Value::from(req.owner.as_str()),
        Value::from(backend.publish_command()),
        Value::from(millis(stay)),
    ];
    let _: i64 = backend.eval(&backend.scripts().fair_leave, keys, args).await?;
    Ok(())
}

/// This server's waiting fair streams whose client named their owner, by lock and
/// owner. The queue holds owner ids, so such streams share one place in it, which only
/// the last of them to stop waiting gives up: the others would lose their place and
/// queue again at the end, behind everyone who came after them.
#[derive(Debug, Default)]
pub struct SharedPlaces(Mutex<Places>);

/// The waiting streams of each (lock, client-named owner).
type Places = HashMap<(String, String), Vec<Arc<Request>>>;

impl SharedPlaces {
    fn lock(&self) -> std::sync::MutexGuard<'_, Places> {
        // Every change is a single update of one list.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The stream `req` starts waiting for its lock.
    pub fn enter(&self, req: &Arc<Request>) {
        let key = (req.keys.lock.clone(), req.owner.clone());
        self.lock().entry(key).or_default().push(req.clone());
    }

    /// Whether a stream of `owner` waits for `lock` here.
    pub fn waiting(&self, lock: &str, owner: &str) -> bool {
        self.lock().contains_key(&(lock.to_owned(), owner.to_owned()))
    }

    /// Whether a stream of `req`'s owner other than `req` waits here for its lock in the
    /// place its owner holds in the queue (a try of it answered queued).
    pub fn queued_besides(&self, req: &Request) -> bool {
        let key = (req.keys.lock.clone(), req.owner.clone());
        self.lock()
            .get(&key)
            .is_some_and(|fellows| fellows.iter().any(|f| f.hold_id != req.hold_id && f.is_queued()))
    }

    /// The stream `req` stops waiting for its lock: true when it was the last of its
    /// owner here.
    pub fn leave(&self, req: &Request) -> bool {
        let mut places = self.lock();
        let key = (req.keys.lock.clone(), req.owner.clone());
        let Some(fellows) = places.get_mut(&key) else {
            return true;
        };
        fellows.retain(|f| f.hold_id != req.hold_id);
        if fellows.is_empty() {
            places.remove(&key);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::SharedPlaces;
    use crate::keys::Keys;
    use crate::service::validate;
    use latchkey_proto::v1::{LockKind, Open};
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    /// A fair waiting stream `id` of the client-named owner "shared".
    fn stream(id: &str) -> Arc<super::Request> {
        let open = Open {
            name: "a".into(),
            kind: LockKind::Fair.into(),
            owner: "shared".into(),
            ..Open::default()
        };
        Arc::new(validate::open(open, &Keys::default(), None, id.into()).unwrap())
    }

    /// A give-back keeps its owner's place for another stream queued in it: not for the
    /// stream giving back, nor for one whose first try has not answered yet.
    #[test]
    fn a_place_is_kept_only_for_another_stream_queued_in_it() {
        let (a, b) = (stream("s:1"), stream("s:2"));
        let places = SharedPlaces::default();
        places.enter(&a);
        a.queued.store(true, Ordering::Release);
        assert!(!places.queued_besides(&a), "the stream itself");
        places.enter(&b);
        assert!(!places.queued_besides(&a), "another not queued yet");
        b.queued.store(true, Ordering::Release);
        assert!(places.queued_besides(&a) && places.queued_besides(&b));
        assert!(!places.leave(&b), "a waits still");
        assert!(!places.queued_besides(&a) && places.waiting("a", "shared"));
        assert!(places.leave(&a) && !places.waiting("a", "shared"));
    }
}
