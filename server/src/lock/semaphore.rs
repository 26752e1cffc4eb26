//! The counting semaphore: `limit` permits, each hold taking `permits` of them for its
//! lifetime. Holds are members of a sorted set scored by their expiry (Redis time), so
//! the permits of a crashed server come back when its leases end.

use super::{acquire, millis, Attempt, Request, RECORD_GRACE};
use crate::error::Error;
use crate::redis::Backend;
use fred::prelude::Value;
use std::time::Duration;

/// Tries once to take `req.permits` permits.
pub async fn try_acquire(backend: &Backend, req: &Request, lease: Duration) -> Result<Attempt, Error> {
    let k = &req.keys;
    let keys = vec![
        k.lock.as_str().into(),
        k.fence().into(),
        k.semaphore().into(),
        k.semaphore_channel().into(),
        k.hold(&req.hold_id).into(),
        k.timeouts().into(),
    ];
    let args = vec![
        Value::from(millis(lease)),
        Value::from(req.hold_id.as_str()),
        Value::from(millis(RECORD_GRACE)),
        Value::from(i64::from(req.permits)),
        Value::from(i64::from(req.limit)),
        Value::from(req.owner.as_str()),
        Value::from(backend.publish_command()),
    ];
    acquire(
        backend,
        &backend.scripts().semaphore_acquire,
        keys,
        args,
        std::slice::from_ref(&req.keys),
    )
    .await
}

/// Gives the permits back; `Ok(false)` when the hold had already ended. With `revoke`
/// (a grant whose outcome is unknown), a hold not found is revoked, so that grant
/// grants nothing if it reaches Redis later.
pub async fn release(backend: &Backend, req: &Request, revoke: bool) -> Result<bool, Error> {
    let k = &req.keys;
    let keys = vec![
        k.lock.as_str().into(),
        k.semaphore().into(),
        k.semaphore_channel().into(),
        k.hold(&req.hold_id).into(),
    ];
    let args = vec![
        Value::from(req.hold_id.as_str()),
        Value::from(backend.publish_command()),
        Value::from(if revoke { "1" } else { "0" }),
    ];
    let result: i64 = backend.eval(&backend.scripts().semaphore_release, keys, args).await?;
    Ok(result >= 0)
}
