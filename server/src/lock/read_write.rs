//! The read/write lock on Redisson's `RReadWriteLock` layout: one hash with a `mode`
//! field (read or write), reader fields `<owner>` and writer fields `<owner>:write`,
//! each with a timeout key per hold. Many readers or one writer; the writer may also read.

use super::{acquire, lease_args, Attempt, GiveBack, Kind, Request};
use crate::error::Error;
use crate::redis::Backend;
use fred::prelude::{Key, Value};
use std::time::Duration;

/// Tries once to take one read or write hold.
pub async fn try_acquire(backend: &Backend, req: &Request, lease: Duration) -> Result<Attempt, Error> {
    let k = &req.keys;
    let mut keys: Vec<Key> = vec![k.lock.as_str().into(), k.fence().into(), k.hold(&req.hold_id).into()];
    let mut args = lease_args(lease, req.field());
    keys.push(k.hold_timeouts(&req.field()).into());
    keys.push(k.timeouts().into());
    let script = if req.kind == Kind::Read {
        args.push(Value::from(format!("{}:write", req.owner)));
        &backend.scripts().read_acquire
    } else {
        &backend.scripts().write_acquire
    };
    acquire(backend, script, keys, args, std::slice::from_ref(&req.keys)).await
}

/// Gives back one read or write hold; `Ok(false)` when it was not held.
pub async fn release(backend: &Backend, req: &Request, giving: GiveBack) -> Result<bool, Error> {
    let k = &req.keys;
    let mut keys: Vec<Key> = vec![
        k.lock.as_str().into(),
        k.rw_channel().into(),
        k.hold(&req.hold_id).into(),
    ];
    keys.push(k.hold_timeouts(&req.owner).into());
    let mut args = vec![
        Value::from(req.field()),
        Value::from(backend.publish_command()),
        Value::from(giving.flag()),
    ];
    // A writer's own read holds, which its last release leaves the lock to.
    let script = if req.kind == Kind::Read {
        keys.push(k.rw_prefix().into());
        &backend.scripts().read_release
    } else {
        keys.push(k.hold_timeouts(&req.field()).into());
        args.push(Value::from(req.owner.as_str()));
        &backend.scripts().write_release
    };
    let remaining: i64 = backend.eval(script, keys, args).await?;
    Ok(remaining >= 0)
}
