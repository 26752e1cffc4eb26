//! The reentrant mutex on Redisson's `RLock` layout: a hash at the lock's key whose
//! field is the owner id and whose value is the hold count.

use super::{Attempt, Grant, Request, RECORD_GRACE};
use crate::error::Error;
use crate::redis::Backend;
use fred::prelude::Value;
use std::time::Duration;

/// Tries once to take one hold (`mutex_acquire.lua`).
pub async fn try_acquire(backend: &Backend, req: &Request, lease: Duration) -> Result<Attempt, Error> {
    let keys = vec![
        req.keys.lock.as_str().into(),
        req.keys.fence.as_str().into(),
        req.keys.hold(&req.hold_id).into(),
    ];
    let args = vec![
        Value::from(millis(lease)),
        Value::from(req.owner.as_str()),
        Value::from(millis(RECORD_GRACE)),
    ];
    let script = &backend.scripts().mutex_acquire;
    let reply: Vec<i64> = backend
        .eval_grant(script, keys, args, |r: &Vec<i64>| r.first() == Some(&1))
        .await?;
    match reply.as_slice() {
        [1, token, count] => Ok(Attempt::Acquired(Grant {
            fencing_token: *token as u64,
            hold_count: *count as u32,
        })),
        [0, ttl] => Ok(Attempt::Busy { ttl: ttl_of(*ttl) }),
        [2] => Err(Error::WrongKind {
            name: req.name().to_owned(),
        }),
        other => Err(Error::Protocol(format!("mutex_acquire returned {other:?}"))),
    }
}

/// Gives back one hold (`mutex_release.lua`); `Ok(false)` when it was not held.
pub async fn release(backend: &Backend, req: &Request) -> Result<bool, Error> {
    let keys = vec![
        req.keys.lock.as_str().into(),
        req.keys.channel.as_str().into(),
        req.keys.hold(&req.hold_id).into(),
    ];
    let args = vec![Value::from(req.owner.as_str()), Value::from(backend.publish_command())];
    let remaining: i64 = backend.eval(&backend.scripts().mutex_release, keys, args).await?;
    Ok(remaining >= 0)
}

/// A PTTL reply as a duration; negative replies (no key, no expiry) have none.
pub(crate) fn ttl_of(pttl: i64) -> Option<Duration> {
    u64::try_from(pttl).ok().map(Duration::from_millis)
}

/// A duration in whole milliseconds, at least 1 (Redis refuses a zero expiry).
pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}
