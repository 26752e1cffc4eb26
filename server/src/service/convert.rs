//! Domain → proto conversions for the RPC edge.

use crate::lock::{Grant, Kind, State};
use latchkey_proto::v1::{acquire_response::Event, lost::Reason, Acquired, Holder, LockKind, LockState, Lost, Waiter};
use std::time::Duration;

/// The `acquired` event of a grant whose lease counts from `waited` after the stream's
/// `open` was read. `fencing_tokens` goes with a multi-lock's grant only, as the API
/// says: a client may tell a multi-lock by it.
pub fn to_acquired(grant: &Grant, owner: &str, lease: Duration, waited: Duration, multi: bool) -> Event {
    Event::Acquired(Acquired {
        fencing_token: grant.fencing_token,
        hold_count: grant.hold_count,
        owner: owner.to_owned(),
        lease: Some(to_duration(lease)),
        fencing_tokens: if multi {
            grant.fencing_tokens.clone()
        } else {
            Vec::new()
        },
        waited: Some(to_duration(waited)),
    })
}

/// The `lost` event for `reason`.
pub fn to_lost(reason: Reason) -> Event {
    Event::Lost(Lost { reason: reason as i32 })
}

/// The proto snapshot of a lock.
pub fn to_lock_state(state: State) -> LockState {
    LockState {
        locked: state.locked(),
        kind: state.kind.map_or(LockKind::Unspecified, to_kind) as i32,
        holders: state
            .holders
            .into_iter()
            .map(|(owner, hold_count, ttl)| Holder {
                owner,
                hold_count,
                ttl: ttl.map(to_duration),
            })
            .collect(),
        waiters: state
            .waiters
            .into_iter()
            .zip(1..)
            .map(|(owner, position)| Waiter { owner, position })
            .collect(),
        last_fencing_token: state.last_fencing_token,
        ttl: state.ttl.map(to_duration),
        name: state.name,
    }
}

/// The proto kind.
pub fn to_kind(kind: Kind) -> LockKind {
    match kind {
        Kind::Mutex => LockKind::Mutex,
        Kind::Fair => LockKind::Fair,
        Kind::Read => LockKind::Read,
        Kind::Write => LockKind::Write,
        Kind::Semaphore => LockKind::Semaphore,
    }
}

/// A proto duration.
pub fn to_duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration::try_from(d).unwrap_or(prost_types::Duration {
        seconds: i64::MAX,
        nanos: 0,
    })
}
