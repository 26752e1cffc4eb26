//! Reading one lock of any kind (`describe.lua`) into a snapshot for Describe and List.

use super::{ttl_of, Kind};
use crate::error::Error;
use crate::keys::LockKeys;
use crate::redis::Backend;
use fred::prelude::Value;
use std::borrow::Cow;
use std::collections::HashMap;
use std::time::Duration;

/// A snapshot of one lock.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    /// The lock's name.
    pub name: String,
    /// The kind it is held as; `None` when free.
    pub kind: Option<Kind>,
    /// Holders: owner id, holds (a semaphore: permits), remaining TTL.
    pub holders: Vec<(String, u32, Option<Duration>)>,
    /// Fair waiters' owner ids in queue order, those whose deadline passed left out.
    pub waiters: Vec<String>,
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

/// Reads one lock. A key that is not a lock reads as free.
pub async fn describe(backend: &Backend, keys: &LockKeys) -> Result<State, Error> {
    let redis_keys = vec![
        keys.lock.as_str().into(),
        keys.fence().into(),
        keys.queue().into(),
        keys.semaphore().into(),
        keys.timeouts().into(),
    ];
    let reply: Vec<Value> = backend
        .eval(&backend.scripts().describe, redis_keys, Vec::new())
        .await?;
    let [kind, pttl, fence, fields, queue, holds, now, readers] =
        <[Value; 8]>::try_from(reply).map_err(|r| Error::Protocol(format!("describe returned {} values", r.len())))?;
    let ttl = pttl.as_i64().and_then(ttl_of);
    let fields = pairs(fields);
    let waiters: Vec<String> = queue.into_array().into_iter().filter_map(|v| v.into_string()).collect();
    let (kind, holders) = match kind.as_str().as_deref() {
        Some("lock") if !waiters.is_empty() => (Kind::Fair, hash_holders(&fields, ttl)),
        Some("lock") => (Kind::Mutex, hash_holders(&fields, ttl)),
        Some(mode @ ("read" | "write")) => {
            let (holders, writes) = rw_holders(&fields, ttl, &pairs(readers));
            // A lapsed write dropped, the readers beside it hold the lock for reading.
            let kind = if mode == "write" && writes {
                Kind::Write
            } else {
                Kind::Read
            };
            (kind, holders)
        }
        Some("semaphore") => (
            Kind::Semaphore,
            semaphore_holders(&fields, pairs(holds), now.as_i64().unwrap_or(0)),
        ),
        _ => (Kind::Mutex, Vec::new()),
    };
    Ok(State {
        name: keys.name().to_owned(),
        kind: (!holders.is_empty()).then_some(kind),
        ttl: (!holders.is_empty()).then_some(ttl).flatten(),
        holders,
        waiters,
        last_fencing_token: fence.as_u64().unwrap_or(0),
    })
}

/// A flat field/value list as pairs of strings. Each item keeps its place (bytes that
/// are no UTF-8 read lossily): one dropped would shift every pair after it.
fn pairs(flat: Value) -> Vec<(String, String)> {
    let items: Vec<String> = flat
        .into_array()
        .iter()
        .map(|v| v.as_str_lossy().map(Cow::into_owned).unwrap_or_default())
        .collect();
    items.chunks_exact(2).map(|p| (p[0].clone(), p[1].clone())).collect()
}

/// Mutex and fair holders: every field is an owner with a positive count; a hash with
/// anything else is not a lock.
fn hash_holders(fields: &[(String, String)], ttl: Option<Duration>) -> Vec<(String, u32, Option<Duration>)> {
    let holders: Vec<_> = fields
        .iter()
        .filter_map(|(owner, count)| Some((owner.clone(), count.parse::<u32>().ok().filter(|c| *c > 0)?, ttl)))
        .collect();
    if holders.len() == fields.len() {
        sorted(holders)
    } else {
        Vec::new()
    }
}

/// Read/write holders: readers by owner, writers by owner (their `:write` suffix
/// dropped), and whether a write holds. A holder's lease is the longest of its holds'
/// (`readers`: the field, an owner or `<owner>:write`, and PTTL), within the lock's; a
/// Redisson writer's hold (-1: it has no timeout key) has the lock's. A holder none of
/// whose holds has a timeout key left (-2) holds nothing: its leases ran out (its
/// server died or lost Redis) and its field waits for the next try, renewal or release
/// to be cleaned up, as the lock scripts take it, so it is no holder.
fn rw_holders(
    fields: &[(String, String)],
    ttl: Option<Duration>,
    readers: &[(String, String)],
) -> (Vec<(String, u32, Option<Duration>)>, bool) {
    // Looked up by field: a walk of the list for each would cost the square of the
    // holders (up to 65 536 readers).
    let pttls: HashMap<&str, &str> = readers.iter().map(|(f, p)| (f.as_str(), p.as_str())).collect();
    let pttl = |field: &str| pttls.get(field)?.parse::<i64>().ok();
    let mut writes = false;
    let holders = fields
        .iter()
        .filter(|(field, _)| field != "mode")
        .filter_map(|(field, count)| {
            // A hold's own lease, within the lock's.
            let within = |own: i64| ttl_of(own).map(|own| ttl.map_or(own, |lock| lock.min(own)));
            let ttl = match pttl(field) {
                Some(-2) => return None,
                own => own.and_then(within).or(ttl),
            };
            let count = count.parse::<u32>().ok()?;
            let writer = field.strip_suffix(":write");
            writes |= writer.is_some();
            Some((writer.unwrap_or(field).to_owned(), count, ttl))
        })
        .collect();
    (sorted(holders), writes)
}

/// Semaphore holders, one per live hold of the semaphore's hash: its owner, its
/// permits, its remaining lease.
fn semaphore_holders(
    fields: &[(String, String)],
    holds: Vec<(String, String)>,
    now: i64,
) -> Vec<(String, u32, Option<Duration>)> {
    let fields: HashMap<&str, &str> = fields.iter().map(|(f, v)| (f.as_str(), v.as_str())).collect();
    let holders = holds
        .into_iter()
        .filter_map(|(id, expiry)| {
            let permits = fields.get(format!("p:{id}").as_str())?.parse().ok()?;
            let owner = fields
                .get(format!("o:{id}").as_str())
                .map_or(id.clone(), |o| (*o).to_owned());
            // In floating point: a score may be any double, `+inf` included.
            let left = expiry
                .parse::<f64>()
                .ok()
                .map(|e| (e - now as f64) as i64)
                .and_then(ttl_of);
            Some((owner, permits, left))
        })
        .collect();
    sorted(holders)
}

/// Sorted by owner, then count: a renewal that reorders one owner's holds in Redis
/// must not read to Watch as a change.
fn sorted(mut holders: Vec<(String, u32, Option<Duration>)>) -> Vec<(String, u32, Option<Duration>)> {
    holders.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    holders
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The most readers Describe reads (65 536), each with its own lease: looked up by
    /// field, in well under a second of a debug build (a walk of every reader's lease
    /// for each took about 15 s).
    #[test]
    fn many_readers_are_read_in_linear_time() {
        const READERS: usize = 65_536;
        let mut fields = vec![("mode".to_owned(), "read".to_owned())];
        fields.extend((0..READERS).map(|i| (format!("r{i}"), "1".to_owned())));
        let readers: Vec<_> = (0..READERS).map(|i| (format!("r{i}"), "5000".to_owned())).collect();
        let started = std::time::Instant::now();
        let (holders, writes) = rw_holders(&fields, Some(Duration::from_secs(60)), &readers);
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        assert_eq!(holders.len(), READERS);
        assert!(!writes);
        assert!(holders.iter().all(|(_, _, ttl)| *ttl == Some(Duration::from_secs(5))));
    }
}
