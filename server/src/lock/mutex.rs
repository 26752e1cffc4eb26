//! The reentrant mutex on Redisson's `RLock` layout: a hash at the lock's key whose
//! field is the owner id and whose value is the hold count. Its release serves the
//! fair lock too (same hash; it also wakes the first fair waiter).

use super::{acquire, lease_args, Attempt, Request};
use crate::error::Error;
use crate::redis::Backend;
use fred::prelude::Value;
use std::time::Duration;

/// Tries once to take one hold (`mutex_acquire.lua`).
pub async fn try_acquire(backend: &Backend, req: &Request, lease: Duration) -> Result<Attempt, Error> {
    let k = &req.keys;
    let keys = vec![
        k.lock.as_str().into(),
        k.fence.as_str().into(),
        k.hold(&req.hold_id).into(),
        k.queue.as_str().into(),
    ];
    let args = lease_args(lease, req.owner.clone());
    acquire(backend, &backend.scripts().mutex_acquire, keys, args, req).await
}

/// Gives back one mutex or fair hold (`release.lua`); `Ok(false)` when it was not held.
pub async fn release(backend: &Backend, req: &Request) -> Result<bool, Error> {
    let k = &req.keys;
    let keys = vec![
        k.lock.as_str().into(),
        k.channel.as_str().into(),
        k.hold(&req.hold_id).into(),
        k.queue.as_str().into(),
        k.timeouts.as_str().into(),
    ];
    let args = vec![Value::from(req.owner.as_str()), Value::from(backend.publish_command())];
    let remaining: i64 = backend.eval(&backend.scripts().release, keys, args).await?;
    Ok(remaining >= 0)
}
