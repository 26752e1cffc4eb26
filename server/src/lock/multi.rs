//! The multi-lock (Redisson `RedissonMultiLock`): every name or none. Names are taken in
//! one deterministic (sorted) order, the names of one cluster slot in one script call;
//! when a name is busy, whatever was taken is given back before waiting on that name,
//! so clients asking for overlapping sets in any order can never deadlock. The next try
//! takes that name's group first: its first call then races the single tries for it on
//! equal terms, where behind the calls for the groups before it, it would lose every
//! race for a lock others keep taking. A try so out of order that meets another holder
//! after its first group (another multi-lock, whose next try may mirror it: each takes
//! the name the other needs, again and again) has its next few tries go in the sorted
//! order ([`SORTED_TRIES`]), where two tries cannot mirror each other: one takes every
//! name. Only a few: the holder met may have been a single lock's, and a multi-lock kept
//! in the sorted order beside a hot name would lose every race for it again.

use super::mutex::{self, GiveBack};
use super::{Attempt, Grant, Request};
use crate::error::Error;
use crate::keys::LockKeys;
use crate::redis::Backend;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How many tries after a collision out of order go in the sorted order. Two: the
/// other multi-lock of a mirrored pair may try once more out of order before it meets
/// this one again and turns to the sorted order too, and their next tries then both
/// go in it.
const SORTED_TRIES: u8 = 2;

/// Tries once to take every name of `req.multi`.
pub async fn try_acquire(backend: &Backend, req: &Request, lease: Duration) -> Result<Attempt, Error> {
    let mut tokens = vec![0u64; req.multi.len()];
    let mut counts = vec![0u32; req.multi.len()];
    let mut taken: Vec<LockKeys> = Vec::new();
    let sorted = req
        .multi_sorted_tries
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    let order = match sorted.is_ok() {
        true => groups(&req.multi),
        false => blocked_first(groups(&req.multi), req.multi_blocked.load(Ordering::Relaxed)),
    };
    let out_of_order = order.first().is_some_and(|(start, _)| *start != 0);
    for (start, group) in order {
        match mutex::try_acquire(backend, group, req, lease, "").await {
            Ok(Attempt::Acquired(grant)) => {
                // Every name's count too: the client's first name may be any of the group's.
                let granted = grant.fencing_tokens.iter().zip(&grant.hold_counts);
                let slots = tokens[start..].iter_mut().zip(&mut counts[start..]);
                for ((token, count), (token_slot, count_slot)) in granted.zip(slots) {
                    (*token_slot, *count_slot) = (*token, *count);
                }
                taken.extend_from_slice(group);
            }
            Ok(Attempt::Busy {
                recheck,
                position,
                blocked,
                holder_ttl,
            }) => {
                req.multi_blocked.store(start + blocked, Ordering::Relaxed);
                if out_of_order && !taken.is_empty() {
                    req.multi_sorted_tries.store(SORTED_TRIES, Ordering::Relaxed);
                }
                // A waiter in doubt (a try of it failed) may hold a group its failed
                // call took late, which this try did not reach: every name goes back,
                // not only those it took (a name not held finds nothing to give).
                let held = if req.is_doubted() { &req.multi[..] } else { &taken[..] };
                give_back_to_retry(backend, held, req).await?;
                return Ok(Attempt::Busy {
                    recheck,
                    position,
                    blocked: start + blocked,
                    holder_ttl,
                });
            }
            Err(e) => {
                // A give-back that failed is a Redis error, which the caller retries in
                // the background: the names already taken must not stay held. Nor, in
                // doubt, a group an earlier failed call took late, which tries failing
                // before they reach it would otherwise leave held: every name goes back
                // but this call's, whose outcome a later try settles.
                let held = match req.is_doubted() {
                    true => [&req.multi[..start], &req.multi[start + group.len()..]].concat(),
                    false => taken,
                };
                give_back_to_retry(backend, &held, req).await?;
                return Err(e);
            }
        }
    }
    let fencing_tokens: Vec<u64> = req.order.iter().map(|i| tokens[*i]).collect();
    Ok(Attempt::Acquired(Grant {
        fencing_token: fencing_tokens.first().copied().unwrap_or_default(),
        hold_count: req.order.first().map_or(1, |i| counts[*i].max(1)),
        fencing_tokens,
        hold_counts: Vec::new(),
    }))
}

/// Gives back every name's hold; `Ok(false)` when any of them was no longer held.
pub async fn release(backend: &Backend, req: &Request, giving: GiveBack) -> Result<bool, Error> {
    give_back(backend, &req.multi, req, giving).await
}

/// Gives back what a try took, its stream trying again; one that fails marks the
/// stream (`Request::gave_back_unknown`): it may still run after a later try.
async fn give_back_to_retry(backend: &Backend, names: &[LockKeys], req: &Request) -> Result<bool, Error> {
    let given = give_back(backend, names, req, GiveBack::Retry).await;
    if given.is_err() {
        req.give_back_unknown();
    }
    given
}

/// Each slot's group goes whatever another's answer: a master that does not answer
/// must not keep the names on the others held (a retry sends every group again; a
/// group given back already finds nothing).
async fn give_back(backend: &Backend, names: &[LockKeys], req: &Request, giving: GiveBack) -> Result<bool, Error> {
    let calls = groups(names)
        .into_iter()
        .map(|(_, group)| mutex::release(backend, group, req.into(), giving, "", false));
    let mut all = true;
    for released in futures::future::join_all(calls).await {
        all &= released?;
    }
    Ok(all)
}

/// `groups` with the one holding the name at `index` moved first.
fn blocked_first(mut groups: Vec<(usize, &[LockKeys])>, index: usize) -> Vec<(usize, &[LockKeys])> {
    if let Some(at) = groups
        .iter()
        .position(|(start, g)| (*start..start + g.len()).contains(&index))
    {
        groups[..=at].rotate_right(1);
    }
    groups
}

/// Runs of consecutive names (in taken order) that share a cluster slot, each with the
/// index of its first name: one script call takes a run.
fn groups(names: &[LockKeys]) -> Vec<(usize, &[LockKeys])> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=names.len() {
        let boundary = i == names.len() || names[i].slot() != names[start].slot();
        if boundary {
            out.push((start, &names[start..i]));
            start = i;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::Keys;

    #[test]
    fn names_sharing_a_hash_tag_form_one_group() {
        let keys = Keys::default();
        let names: Vec<LockKeys> = ["{a}1", "{a}2", "b", "{c}1", "{c}2"]
            .iter()
            .map(|n| keys.lock(n))
            .collect();
        let groups: Vec<(usize, usize)> = groups(&names).iter().map(|(s, g)| (*s, g.len())).collect();
        assert_eq!(groups, vec![(0, 2), (2, 1), (3, 2)]);
        let starts = |index| -> Vec<usize> {
            blocked_first(super::groups(&names), index)
                .iter()
                .map(|(s, _)| *s)
                .collect()
        };
        assert_eq!(starts(0), vec![0, 2, 3]);
        assert_eq!(starts(2), vec![2, 0, 3]);
        assert_eq!(starts(4), vec![3, 0, 2]);
    }
}
