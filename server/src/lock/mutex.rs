//! The reentrant mutex on Redisson's `RLock` layout: a hash at the lock's key whose
//! field is the owner id and whose value is the hold count. One script call takes or
//! gives back the holds of several names of one cluster slot (a multi-lock's group).
//! Its release serves the fair lock too (same hash; it also wakes the first fair waiter).

use super::{acquire, lease_args, Attempt, Request};
use crate::error::Error;
use crate::keys::LockKeys;
use crate::redis::Backend;
use fred::prelude::{Key, Value};
use std::time::Duration;

/// Tries once to take one hold of every name in `names`, all or none (`mutex_acquire.lua`);
/// a single name's waiter leaves `claim` when busy ("" for none).
pub async fn try_acquire(
    backend: &Backend,
    names: &[LockKeys],
    req: &Request,
    lease: Duration,
    claim: &str,
) -> Result<Attempt, Error> {
    let keys: Vec<Key> = names
        .iter()
        .flat_map(|k| acquire_keys(k, &req.hold_id))
        .map(Key::from)
        .collect();
    let mut args = lease_args(lease, req.owner.clone());
    args.push(Value::from(claim));
    acquire(backend, &backend.scripts().mutex_acquire, keys, args, names).await
}

/// The keys `mutex_acquire.lua` takes for one name: lock, fencing counter, the stream's
/// hold record, fair waiters' deadlines.
pub fn acquire_keys(k: &LockKeys, hold_id: &str) -> [String; 4] {
    [k.lock.clone(), k.fence(), k.hold(hold_id), k.timeouts()]
}

/// The keys `release.lua` takes for one name (and `handoff.lua` starts with): lock,
/// unlock channel, the stream's hold record, fair queue, fair deadlines.
pub fn release_keys(k: &LockKeys, hold_id: &str) -> [String; 5] {
    [k.lock.clone(), k.channel(), k.hold(hold_id), k.queue(), k.timeouts()]
}

/// What a give-back leaves in place of the hold record it takes (`release.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveBack {
    /// The stream's hold, given back for good: a revoked record stands in place of one
    /// revoked, lapsed or broken (ForceRelease) already.
    Release,
    /// A try of the stream had an unknown outcome and may still be on its way: a
    /// revoked record stands, whatever was there.
    Revoke,
    /// What a try that answered took, its stream trying again: a revoked record stays,
    /// a lapsed or broken one goes (left revoked, it would answer every later try of
    /// the stream busy on a name nobody holds).
    Retry,
    /// What a failed recording of a pass in memory may have left the stream (a single
    /// mutex or fair hold; [`Holder::passed`] the pass's token): as `Revoke`, unless the
    /// record holds another grant, the stream's own try's, which its stream holds.
    Passed,
}

impl GiveBack {
    /// A release for good, revoking when told to.
    pub fn revoking(revoke: bool) -> Self {
        match revoke {
            true => GiveBack::Revoke,
            false => GiveBack::Release,
        }
    }

    /// The release scripts' argument for it (`take_record`'s `revoke` and `retrying`).
    pub fn flag(self) -> &'static str {
        match self {
            GiveBack::Release => "0",
            GiveBack::Revoke => "1",
            GiveBack::Retry => "2",
            GiveBack::Passed => "3",
        }
    }
}

/// `release.lua`'s arguments: the owner, what the give-back leaves, the claim to forget
/// ("" for none), whether this server listens on the first name's channel with nobody
/// waiting.
pub fn release_args(owner: &str, giving: GiveBack, claim: &str, idle: bool) -> Vec<Value> {
    let idle = if idle { "1" } else { "0" };
    vec![
        Value::from(owner),
        Value::from(giving.flag()),
        Value::from(claim),
        Value::from(idle),
    ]
}

/// Who gives a hold back: the stream's hold id and the owner.
pub struct Holder<'a> {
    pub hold_id: &'a str,
    pub owner: &'a str,
    /// For a queued fair waiter whose grant its replicas did not acknowledge, given back
    /// as its stream tries again: it goes back to the head of the queue, for this long
    /// (`release.lua`'s ARGV[5]).
    pub keeps_place: Option<Duration>,
    /// With [`GiveBack::Passed`], the token the pass told the stream (ARGV[6]).
    pub passed: Option<u64>,
}

impl<'a> From<&'a Request> for Holder<'a> {
    fn from(req: &'a Request) -> Self {
        Self {
            hold_id: &req.hold_id,
            owner: &req.owner,
            keeps_place: None,
            passed: None,
        }
    }
}

/// Gives back one hold of every name in `names` (`release.lua`), forgetting the stream's
/// `claim` ("" for none); `idle`: this server listens on the first name's channel with
/// nobody waiting. `Ok(false)` when any was no longer held.
pub async fn release(
    backend: &Backend,
    names: &[LockKeys],
    holder: Holder<'_>,
    giving: GiveBack,
    claim: &str,
    idle: bool,
) -> Result<bool, Error> {
    let keys: Vec<Key> = names
        .iter()
        .flat_map(|k| release_keys(k, holder.hold_id))
        .map(Key::from)
        .collect();
    let mut args = release_args(holder.owner, giving, claim, idle);
    let stays = holder.keeps_place.map(super::millis);
    match (stays, holder.passed) {
        (Some(stay), _) => args.push(Value::from(stay)),
        (None, Some(_)) => args.push(Value::from("")),
        (None, None) => {}
    }
    if let Some(token) = holder.passed {
        args.push(Value::from(token.to_string()));
    }
    let released: i64 = backend.eval(&backend.scripts().release, keys, args).await?;
    Ok(released == names.len() as i64)
}
