//! What a run leaves in Redis once every client is done: nothing but fencing counters
//! (which keep tokens increasing and expire on their own) and the last token passed in
//! memory beside them (which expires with them), revoked hold records (which
//! keep a grant that reaches Redis after its release from granting; they expire too),
//! mutexes' passing markers (which expire a lease after the last pass) and turns (2 ms),
//! and each server's force-release subscription.

use super::rig::LockRedis;
use crate::process::{redis_cli, redis_cli_each, subscribed_channels};
use std::collections::HashSet;
use std::time::Duration;

/// The only channel a server stays subscribed to with no waiters.
const FORCE_RELEASE_CHANNEL: &str = "latchkey:force_release";
/// Keys that may stay, as long as they expire.
const FENCE_PREFIX: &str = "latchkey_fence:";
/// The last token passed in memory beside a fencing counter (README "Passing in
/// memory"), which expires with it.
const FENCE_PASSED_PREFIX: &str = "latchkey_fence_passed:";
/// Passing markers (README "Bounded passing"), which may stay as long as they expire.
const PASSING_PREFIX: &str = "latchkey_passing:";
/// A server's turn on a hot mutex (README "Claims"), which lives 2 ms.
const TURN_PREFIX: &str = "latchkey_turn:";
/// Hold records, which may stay as long as they expire if they are revoked ones.
const HOLD_PREFIX: &str = "latchkey_hold:";
/// What a revoked hold record holds.
const REVOKED: &str = "revoked";

/// Waits up to `limit` for Redis to hold no lock state and no lock subscription, and
/// returns what is still there (empty when clean).
pub async fn wait_clean(redis: &LockRedis, limit: Duration) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let left = tokio::task::block_in_place(|| leftovers(redis));
        if left.is_empty() || tokio::time::Instant::now() >= deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Keys other than expiring markers (`expiring_marker`) on every master,
/// and subscriptions other than the force-release channel on every node.
pub fn leftovers(redis: &LockRedis) -> Vec<String> {
    let mut left = Vec::new();
    for port in redis.master_ports() {
        let scanned = redis_cli(port, None, &["--scan"]);
        let keys: Vec<&str> = scanned.lines().filter(|k| !k.is_empty()).collect();
        let pttls = redis_cli_each(port, &keys.iter().map(|k| vec!["PTTL", *k]).collect::<Vec<_>>());
        let holds: Vec<&str> = keys.iter().copied().filter(|k| k.starts_with(HOLD_PREFIX)).collect();
        let held = redis_cli_each(port, &holds.iter().map(|k| vec!["GET", *k]).collect::<Vec<_>>());
        let revoked: HashSet<&str> = holds
            .iter()
            .zip(&held)
            .filter(|(_, value)| value.as_str() == REVOKED)
            .map(|(k, _)| *k)
            .collect();
        for (key, pttl) in keys.iter().zip(&pttls) {
            let pttl: i64 = pttl.trim().parse().unwrap_or(-1);
            // -2: it expired between the scan and the PTTL.
            if pttl != -2 && (!expiring_marker(key, &revoked) || pttl < 0) {
                left.push(format!("key {key:?} left on {port} (pttl {pttl})"));
            }
        }
    }
    for port in redis.live_ports() {
        let role = redis_cli(port, None, &["ROLE"])
            .lines()
            .next()
            .unwrap_or("?")
            .to_owned();
        for channel in subscribed_channels(port) {
            if channel != FORCE_RELEASE_CHANNEL {
                left.push(format!("subscription {channel:?} left on {port} ({role})"));
            }
        }
    }
    left
}

/// A fencing counter or the token passed beside it, a passing marker, or a revoked
/// hold record (left by a release whose grant's outcome was unknown, so that a late
/// grant grants nothing): markers that expire.
fn expiring_marker(key: &str, revoked: &HashSet<&str>) -> bool {
    key.starts_with(FENCE_PREFIX)
        || key.starts_with(FENCE_PASSED_PREFIX)
        || key.starts_with(PASSING_PREFIX)
        || key.starts_with(TURN_PREFIX)
        || revoked.contains(key)
}
