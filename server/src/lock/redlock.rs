//! RedLock (Redisson `RedissonRedLock`, the Redlock algorithm): the same mutex taken on
//! N ≥ 3 independent Redis deployments. A grant needs a majority (N/2+1) of nodes
//! within a per-node timeout far below the lease, and a validity (lease − elapsed −
//! clock drift) left; otherwise every node that may have granted is released.

use super::{lease_args, Attempt, GiveBack, Grant, Request, REVOKED_FOR};
use crate::error::Error;
use crate::redis::{Backend, Node};
use crate::scripts::Script;
use fred::prelude::{EventInterface, Key, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The longest a node may take to answer one try.
pub const MAX_NODE_TIMEOUT: Duration = Duration::from_millis(500);
/// The shortest per-node timeout, however short the lease.
const MIN_NODE_TIMEOUT: Duration = Duration::from_millis(5);

/// The majority of `nodes`.
pub fn quorum(nodes: usize) -> usize {
    nodes / 2 + 1
}

/// How long one node may take: a tenth of the lease, at most `MAX_NODE_TIMEOUT`.
pub fn node_timeout(lease: Duration) -> Duration {
    (lease / 10).clamp(MIN_NODE_TIMEOUT, MAX_NODE_TIMEOUT)
}

/// The clock drift allowed for a lease (the Redlock paper's 1% plus 2 ms).
pub fn drift(lease: Duration) -> Duration {
    lease / 100 + Duration::from_millis(2)
}

/// Ok when the server has RedLock deployments: three `--redlock-url`s or more.
pub fn configured(backend: &Backend) -> Result<(), Error> {
    match backend.redlock_nodes().len() {
        3.. => Ok(()),
        _ => Err(Error::RedlockNotConfigured),
    }
}

/// One try on every node at once.
pub async fn try_acquire(backend: &Arc<Backend>, req: &Request, lease: Duration) -> Result<Attempt, Error> {
    configured(backend)?;
    let nodes = backend.redlock_nodes();
    let started = Instant::now();
    let per_node = node_timeout(lease);
    // Listening before the tries: fred tells of a reconnection before it sends a call
    // again on the new connection, so a grant from a node that reconnected meanwhile
    // (restarted, it forgot what it held) is known here, whether or not the identity
    // watch has counted that node out yet.
    let reconnects: Vec<_> = nodes.iter().map(|node| node.client.reconnect_rx()).collect();
    // A node that counts for no majority (one Redis that another node, or the main
    // Redis, leads to as well; one not checked yet) is not asked.
    let tries = nodes.iter().enumerate().map(|(i, node)| async move {
        match backend.redlock_counts(i) {
            true => Some(try_node(backend, node, req, lease, per_node).await),
            false => None,
        }
    });
    let answers = futures::future::join_all(tries).await;
    let validity = lease.checked_sub(started.elapsed() + drift(lease));
    // A node found restarted while the try was on its way (its reconnection, a try
    // the client sent again there) counts no more: its grant is given back below.
    let granted: Vec<&Grant> = (answers.iter().enumerate())
        .filter(|(i, _)| backend.redlock_counts(*i) && reconnects[*i].is_empty())
        .filter_map(|(_, a)| a.as_ref()?.as_ref().ok()?.as_ref().ok())
        .collect();
    // A node that refused the call for good (an ACL) is no outage.
    let refusals = answers.iter().flatten().filter(|a| refused(a)).count();
    let failed = answers
        .iter()
        .flatten()
        .filter(|a| matches!(a, Err(Error::Redis(_) | Error::Protocol(_))) && !refused(a))
        .count();
    let unreachable = failed + answers.iter().filter(|a| a.is_none()).count();
    let wrong_kind = answers
        .iter()
        .flatten()
        .filter(|a| matches!(a, Err(Error::WrongKind { .. })))
        .count();
    if failed > 0 {
        // A node that failed or timed out may still grant when the try reaches it.
        req.doubt();
    }
    // A majority granted, but too few nodes raised their counters, or too late: no
    // holder is told busy for it (nobody holds the lock), as for too few answers.
    let mut unraised = None;
    if granted.len() >= quorum(nodes.len()) && validity.is_some_and(|v| !v.is_zero()) {
        let grant = majority_grant(&granted);
        // Tokens grow from one majority to the next only through nodes whose counter
        // was raised: a majority of them, which every later majority shares a node with.
        // The raise takes time too (up to a node's timeout): the grant must still be
        // valid once it is done.
        let raised = raise_fences(backend, req, grant.fencing_token, lease).await;
        let validity = lease.checked_sub(started.elapsed() + drift(lease));
        if raised >= quorum(nodes.len()) && validity.is_some_and(|v| !v.is_zero()) {
            return Ok(Attempt::Acquired(grant));
        }
        unraised = Some(raised.min(quorum(nodes.len()) - 1));
    }
    // Given back on each node asked but those that answered busy, which took nothing:
    // one that failed or timed out may still have granted, and one that refused may
    // have refused only the script's announcement, after it took the lock (Redis keeps
    // a script's writes before its error). (A grant that reaches a node later is the
    // stream's next try's, through its hold record; a node this give-back misses puts
    // the stream in doubt, so its end gives back there.) The tokens this attempt drew
    // stay drawn: a counter is never lowered, as another grant's raise may have found
    // it at that very token and counted it as raised. Tokens need not be dense. Each
    // node gets the try's timeout for it, as for the try: one that does not answer
    // holds up the answer no longer.
    let may_hold = |a: &Option<Result<Result<Grant, Option<Duration>>, Error>>| {
        a.as_ref().is_some_and(|a| !matches!(a, Ok(Err(_))))
    };
    let holding: Vec<usize> = (0..answers.len()).filter(|i| may_hold(&answers[*i])).collect();
    if !holding.is_empty() {
        let _ = release_within(backend, req, GiveBack::Retry, None, per_node, &holding).await;
    }
    if granted.is_empty() {
        req.gave_back.store(0, Ordering::Relaxed);
    } else {
        req.gave_back.fetch_add(1, Ordering::Relaxed);
    }
    if nodes.len() - wrong_kind < quorum(nodes.len()) {
        return Err(Error::WrongKind {
            name: req.name().to_owned(),
        });
    }
    if nodes.len() - refusals - wrong_kind < quorum(nodes.len()) {
        // What Redis said, as the main Redis's refusals are told: no retry helps.
        let refusal = answers.into_iter().flatten().find(refused).and_then(Result::err);
        return Err(refusal.unwrap_or(Error::RedlockNotConfigured));
    }
    let reachable = unraised.unwrap_or(nodes.len() - unreachable - refusals - wrong_kind);
    if reachable < quorum(nodes.len()) {
        return Err(Error::RedlockQuorumUnreachable {
            reachable,
            needed: quorum(nodes.len()),
        });
    }
    let recheck = answers
        .iter()
        .flatten()
        .filter_map(|a| a.as_ref().ok()?.as_ref().err().copied().flatten())
        .min();
    Ok(Attempt::Busy {
        recheck,
        position: 0,
        blocked: 0,
        holder_ttl: recheck,
    })
}

/// Whether a node's answer is a refusal of Redis's for good (an ACL that keeps the
/// server from the keys): the call ran nothing, and sending it again changes nothing.
fn refused<T>(answer: &Result<T, Error>) -> bool {
    matches!(answer, Err(Error::Redis(e)) if crate::error::refused_by_redis(e))
}

/// Whether a node's answer leaves the call's outcome unknown: it failed, and not by a
/// refusal for good (which ran nothing).
fn unknown<T>(answer: &Result<T, Error>) -> bool {
    answer.is_err() && !refused(answer)
}

/// One node's answer: a grant, or busy with the holder's TTL there.
async fn try_node(
    backend: &Backend,
    node: &Node,
    req: &Request,
    lease: Duration,
    limit: Duration,
) -> Result<Result<Grant, Option<Duration>>, Error> {
    let k = &req.keys;
    let keys: Vec<Key> = [k.lock.clone(), k.fence(), k.hold(&req.hold_id), k.timeouts()]
        .into_iter()
        .map(Key::from)
        .collect();
    // No claim; a replayed grant (an earlier try of this stream that reached the node
    // late) draws a new token: see mutex_acquire.lua.
    let mut args = lease_args(lease, req.owner.clone());
    args.extend([Value::from(""), Value::from("1")]);
    let script = &backend.redlock_scripts().mutex_acquire;
    let call = backend.eval_on::<Vec<i64>, _>(&node.client, script, keys, args);
    let reply = match within(script, limit, call).await {
        // A foreign key under the name (a fencing counter that is no counter) fails the
        // script before its first write: this node refuses the name, as the main Redis
        // does, and nothing is in doubt.
        Err(Error::Redis(e)) if super::foreign_key(&e) => {
            return Err(Error::WrongKind {
                name: req.name().to_owned(),
            })
        }
        reply => reply?,
    };
    match reply.as_slice() {
        [1, token, count, ..] => Ok(Ok(Grant {
            fencing_token: *token as u64,
            hold_count: *count as u32,
            fencing_tokens: Vec::new(),
            hold_counts: Vec::new(),
        })),
        [0, ttl, ..] => Ok(Err(super::ttl_of(*ttl))),
        [2, ..] => Err(Error::WrongKind {
            name: req.name().to_owned(),
        }),
        other => Err(Error::Protocol(format!("mutex_acquire returned {other:?}"))),
    }
}

/// The grant of a majority: the largest token of its nodes. Every node's counter is then
/// raised to it, so the next majority (which shares a node with this one) answers more.
fn majority_grant(granted: &[&Grant]) -> Grant {
    Grant {
        fencing_token: granted.iter().map(|g| g.fencing_token).max().unwrap_or_default(),
        hold_count: granted.iter().map(|g| g.hold_count).max().unwrap_or(1),
        fencing_tokens: Vec::new(),
        hold_counts: Vec::new(),
    }
}

/// `call`, a call of `script` on one node, given up after `limit`: a node that does
/// not answer holds up a grant, a busy answer, a release or a renewal no longer than
/// its try may take. A call cut off counts as a failed call of `script` in the metrics:
/// a frozen node, whose calls all end so, would otherwise show nowhere while the
/// deployment rides on its last majority.
pub async fn within<T>(
    script: &Script,
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(limit, call).await {
        Ok(answer) => answer,
        Err(_) => {
            crate::metrics::redis_call(script.name(), limit, false);
            tracing::debug!(script = script.name(), "a RedLock node did not answer in time");
            Err(Error::Protocol("a RedLock node did not answer in time".into()))
        }
    }
}

/// Raises every node's fencing counter to the majority's token; how many nodes that
/// count toward a majority did.
async fn raise_fences(backend: &Backend, req: &Request, token: u64, lease: Duration) -> usize {
    let keep = super::millis(lease + super::RECORD_GRACE);
    let raises = backend.redlock_nodes().iter().map(|node| {
        let keys = vec![Key::from(req.keys.fence())];
        let args = vec![Value::from(token.to_string()), Value::from(keep)];
        let script = &backend.redlock_scripts().fence_raise;
        within(
            script,
            node_timeout(lease),
            backend.eval_on::<i64, _>(&node.client, script, keys, args),
        )
    });
    let raised = futures::future::join_all(raises).await;
    raised
        .iter()
        .enumerate()
        .filter(|(i, r)| r.is_ok() && backend.redlock_counts(*i))
        .count()
}

/// Where a release gives back what its nodes did not answer for, once the stream is
/// over: in the background, until each node answers, the server shuts down, or no
/// node can hold anything of the stream any more.
#[derive(Debug, Clone, Copy)]
pub struct Retry<'a> {
    /// Runs the retries.
    pub background: &'a TaskTracker,
    /// The server's shutdown: each retry then makes one last call.
    pub stop: &'a CancellationToken,
    /// How long the hold could last.
    pub lease: Duration,
}

/// Gives back the hold on every node; true when a majority of nodes still had it,
/// false when a majority answered that they no longer had it (the lock was lost), and
/// [`Error::RedlockReleaseUnconfirmed`] otherwise: the lock may still be held on a
/// majority until the retries reach them, or may have been lost on one. With `revoke`
/// (a stream some try of which had an unknown outcome), each node keeps a revoked hold
/// record, so a try still on its way grants nothing. A node that does not answer may
/// still hold the lock, and counts against every other majority: the stream is then in
/// doubt (its later releases revoke), and with `retry` the release goes on there in
/// the background.
pub async fn release(
    backend: &Arc<Backend>,
    req: &Request,
    revoke: bool,
    retry: Option<Retry<'_>>,
) -> Result<bool, Error> {
    let every: Vec<usize> = (0..backend.redlock_nodes().len()).collect();
    let giving = GiveBack::revoking(revoke);
    release_within(backend, req, giving, retry, MAX_NODE_TIMEOUT, &every).await
}

/// [`release`] on `nodes` (indexes), each given up after `limit`.
async fn release_within(
    backend: &Arc<Backend>,
    req: &Request,
    giving: GiveBack,
    retry: Option<Retry<'_>>,
    limit: Duration,
    nodes: &[usize],
) -> Result<bool, Error> {
    let keys: Vec<Key> = super::mutex::release_keys(&req.keys, &req.hold_id)
        .into_iter()
        .map(Key::from)
        .collect();
    let args = super::mutex::release_args(req.owner.as_str(), giving, "", false);
    let releases = nodes
        .iter()
        .map(|node| release_on(backend, *node, keys.clone(), args.clone(), limit));
    let results = futures::future::join_all(releases).await;
    if results.iter().any(unknown) {
        req.doubt();
    }
    if let Some(retry) = retry {
        // A revoked record matters as long as a try may still arrive; a hold, as long
        // as its lease.
        let window = if giving == GiveBack::Revoke {
            retry.lease.max(REVOKED_FOR)
        } else {
            retry.lease
        };
        let until = Instant::now() + window;
        for (&node, _) in nodes.iter().zip(&results).filter(|(_, r)| unknown(r)) {
            let again = Again {
                keys: keys.clone(),
                args: args.clone(),
                until,
            };
            if backend.redlock_nodes()[node].pending.push(again) {
                retry
                    .background
                    .spawn(send_again(backend.clone(), node, retry.stop.clone()));
            }
        }
    }
    // Released when a majority still had the hold, lost when a majority no longer had
    // it; otherwise a majority may have lost it unseen (a node that did not answer may
    // be one), and the release confirms nothing.
    let needed = quorum(results.len());
    let held = results.iter().filter(|r| matches!(r, Ok(n) if *n > 0)).count();
    let gone = results.iter().filter(|r| matches!(r, Ok(0))).count();
    match (held >= needed, gone >= needed) {
        (true, _) => Ok(true),
        (_, true) => Ok(false),
        _ => Err(Error::RedlockReleaseUnconfirmed { held, gone, needed }),
    }
}

/// `release.lua` on node `node`, given up after `limit` (a release of unknown outcome
/// puts the stream in doubt, and is sent again).
async fn release_on(
    backend: &Backend,
    node: usize,
    keys: Vec<Key>,
    args: Vec<Value>,
    limit: Duration,
) -> Result<i64, Error> {
    let client = &backend.redlock_nodes()[node].client;
    let script = &backend.redlock_scripts().release;
    within(script, limit, backend.eval_on(client, script, keys, args)).await
}

/// The most releases kept for one node that does not answer; past it the oldest are
/// dropped (the node then keeps those holds until their leases end).
const MOST_PENDING: usize = 100_000;
/// How many pending releases go to a node at once once it answers.
const RESEND_BATCH: usize = 64;
/// The longest pause between two calls to a node that does not answer.
const LONGEST_PAUSE: Duration = Duration::from_secs(10);

/// A release to send again to one node, until `until`. Its arguments are those of the
/// release that missed the node: a non-revoking one came from a stream no try of which
/// was in doubt then (a try still in flight would have put it in doubt first).
#[derive(Debug)]
struct Again {
    keys: Vec<Key>,
    args: Vec<Value>,
    until: Instant,
}

/// The releases one RedLock node did not answer, sent again by one task per node
/// ([`send_again`]) while there are any: a node that stays down costs one call per
/// pause, whatever the release rate, and no task per release.
#[derive(Debug, Default)]
pub struct Pending {
    state: std::sync::Mutex<PendingState>,
}

#[derive(Debug, Default)]
struct PendingState {
    releases: std::collections::VecDeque<Again>,
    /// A task sends them.
    sending: bool,
}

/// Missed releases dropped, logged sparingly: a node down drops one for each release.
static DROPPED: crate::repeated::Repeated = crate::repeated::Repeated::new();

impl Pending {
    fn lock(&self) -> std::sync::MutexGuard<'_, PendingState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a release; true when no task sends this node's yet (the caller starts one).
    fn push(&self, again: Again) -> bool {
        let mut state = self.lock();
        state.releases.push_back(again);
        if state.releases.len() > MOST_PENDING {
            state.releases.pop_front();
            if let Some(left_out) = DROPPED.due() {
                tracing::warn!(
                    left_out,
                    "a RedLock node has missed {MOST_PENDING} releases: the oldest is dropped"
                );
            }
        }
        !std::mem::replace(&mut state.sending, true)
    }

    /// Up to `n` releases still worth sending, oldest first (those past their window
    /// are dropped); none means the task stops, and the next push starts another.
    fn take(&self, n: usize) -> Vec<Again> {
        let mut state = self.lock();
        let now = Instant::now();
        state.releases.retain(|a| a.until > now);
        let n = n.min(state.releases.len());
        let taken: Vec<Again> = state.releases.drain(..n).collect();
        if taken.is_empty() {
            state.sending = false;
        }
        taken
    }

    /// Puts back releases the node did not answer, first in line.
    fn put_back(&self, releases: Vec<Again>) {
        let mut state = self.lock();
        for again in releases.into_iter().rev() {
            state.releases.push_front(again);
        }
    }

    /// Forgets every release (the server stops and the node does not answer).
    fn clear(&self) {
        let mut state = self.lock();
        state.releases.clear();
        state.sending = false;
    }
}

/// Sends node `node`'s pending releases until none is left: one release first, after
/// one Redis timeout and then twice as long each time it fails (at most
/// [`LONGEST_PAUSE`]); once it is answered, the others in batches without pause. Once
/// `stop` is cancelled (the server shuts down) it makes one last try, and drops what is
/// left if the node does not answer it.
async fn send_again(backend: Arc<Backend>, node: usize, stop: CancellationToken) {
    let pending = &backend.redlock_nodes()[node].pending;
    let mut pause = backend.timeout();
    let send = |again: &Again| {
        let (keys, args) = (again.keys.clone(), again.args.clone());
        release_on(&backend, node, keys, args, MAX_NODE_TIMEOUT)
    };
    loop {
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.cancelled() => {}
        }
        let last = stop.is_cancelled();
        let probe = pending.take(1);
        let Some(first) = probe.first() else { return };
        if unknown(&send(first).await) {
            if last {
                pending.clear();
                return;
            }
            pending.put_back(probe);
            pause = (pause * 2).min(LONGEST_PAUSE);
            continue;
        }
        pause = backend.timeout();
        loop {
            let batch = pending.take(RESEND_BATCH);
            if batch.is_empty() {
                return;
            }
            let answers = futures::future::join_all(batch.iter().map(send)).await;
            let missed: Vec<Again> = batch
                .into_iter()
                .zip(answers)
                .filter_map(|(again, answer)| unknown(&answer).then_some(again))
                .collect();
            if !missed.is_empty() {
                if !last {
                    pending.put_back(missed);
                }
                break;
            }
        }
        if last {
            pending.clear();
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quorum_and_timing() {
        assert_eq!((quorum(3), quorum(4), quorum(5)), (2, 3, 3));
        assert_eq!(node_timeout(Duration::from_secs(30)), MAX_NODE_TIMEOUT);
        assert_eq!(node_timeout(Duration::from_secs(1)), Duration::from_millis(100));
        assert_eq!(drift(Duration::from_secs(10)), Duration::from_millis(102));
    }
}
