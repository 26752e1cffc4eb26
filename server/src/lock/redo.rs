//! Background calls Redis did not answer, made again by one task: give-backs (a
//! release that failed, a try in doubt, a grant nobody claims) and fair waiters'
//! leaves of their queue. A call left undone holds a lock, or a place in line, for a
//! lease; a task per call would grow with every request that fails while Redis is away
//! or refuses, each calling Redis every Redis timeout.
//!
//! Each round, every Redis timeout, tries each node's calls on their own: the first,
//! then, once the node answered, all the others at once, so a node that is away gets
//! one call a round and a node that answers is not held up by another that does not.
//! A call Redis refused (an ACL on its keys, a command taken away for a while) was
//! answered: it holds no other call back, and is tried again less and less often. On a
//! cluster, a multi-lock's give-back, which may reach several nodes and so answers for
//! none, is made on its own each round.

use super::{GiveBack, Locks, Request};
use crate::error::Error;
use crate::keys::LockKeys;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// A refused call waits at most this many Redis timeouts between tries (doubling from
/// one): a refusal that passes (an ACL put right) is outlasted soon enough, one that
/// stands costs a call every few seconds, not one every Redis timeout.
const REFUSED_PAUSE_MAX: u32 = 16;

/// How long a round waits for the next once the server stops, and a refused call's
/// first pause then: the drain (10 s) has no room for rounds a Redis timeout apart (up
/// to 24 h) nor for a pause grown while Redis refused, and a refusal put right
/// meanwhile (an ACL) is seen within a few of these.
const STOPPING_PAUSE: Duration = Duration::from_millis(100);

/// A refused call's longest pause once the server stops: a dozen tries still fit in the
/// drain, and calls refused for good (up to [`LONG_GIVE_BACKS_ROOM`] and more) cost
/// Redis a bounded load while the server waits for them.
const STOPPING_PAUSE_MAX: Duration = Duration::from_millis(800);

/// Calls waiting to be made again past which a revoking give-back is made for a lease
/// only, not for as long as its record would stand: through a long outage, every
/// stream that ends in doubt (clients retrying hard) queues one, and five minutes of
/// them would grow the heap without bound.
pub(super) const LONG_GIVE_BACKS_ROOM: usize = 10_000;

/// A background call to make again until Redis answers.
#[derive(Debug)]
pub(super) enum Redo {
    /// A fair waiter's leave of its queue (see `Locks::leave_until_answered`).
    Leave(Arc<Request>),
    /// A give-back (see `Locks::give_back_later`), until `give_up`: a lease of the
    /// stream after the first call, past which nothing is held (a revoking one, as long
    /// as a late try of the stream may come).
    GiveBack {
        req: Arc<Request>,
        giving: Option<GiveBack>,
        give_up: Instant,
    },
    /// The give-back of a grant nobody claims (see `Locks::give_back_unclaimed`), until
    /// `give_up`.
    Unclaimed {
        lock: LockKeys,
        grant: crate::hub::Unclaimed,
        give_up: Instant,
    },
}

impl Redo {
    /// Whether the call may reach several nodes: a multi-lock's give-back, whose reply
    /// tells of all of them (one away fails it), not of the node of its first name.
    fn spans_nodes(&self) -> bool {
        matches!(self, Redo::GiveBack { req, .. } if !req.multi.is_empty())
    }

    /// The cluster slot of the lock the call is for.
    fn slot(&self) -> u16 {
        match self {
            Redo::Leave(req) | Redo::GiveBack { req, .. } => req.keys.slot(),
            Redo::Unclaimed { lock, .. } => lock.slot(),
        }
    }

    /// Whether the call has nothing left to do: a give-back past its lease.
    fn expired(&self, now: Instant) -> bool {
        match self {
            Redo::Leave(_) => false,
            Redo::GiveBack { give_up, .. } | Redo::Unclaimed { give_up, .. } => now >= *give_up,
        }
    }
}

/// How Redis took a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reply {
    /// Answered: nothing left to do.
    Done,
    /// Answered with an error (a refusal): the node is there, the call is to be made
    /// again later.
    Refused,
    /// Not answered (Redis away, slow, failing over): the node is to be asked again.
    Away,
}

impl Reply {
    /// How Redis took a call that came back `result`.
    pub(super) fn of<T>(result: &Result<T, Error>) -> Reply {
        match result {
            Ok(_) => Reply::Done,
            Err(Error::Redis(e)) if crate::redis::transient(e) => Reply::Away,
            Err(_) => Reply::Refused,
        }
    }
}

/// The calls to make again, and whether a task makes them.
#[derive(Debug, Default)]
pub(super) struct Unanswered {
    calls: Vec<Pending>,
    /// Calls a round took out of `calls` and has not put back yet.
    in_round: usize,
    retrying: bool,
}

/// A call to make again: not before `due`; refused last after `pause`.
#[derive(Debug)]
struct Pending {
    redo: Redo,
    due: Instant,
    pause: Duration,
}

impl Locks {
    /// The calls waiting to be made again, those of a round under way too.
    pub(super) fn unanswered_len(&self) -> usize {
        let unanswered = self.unanswered.lock().unwrap_or_else(|e| e.into_inner());
        unanswered.calls.len() + unanswered.in_round
    }

    /// Adds a call Redis did not answer to the others, and starts the task that makes
    /// them again when none runs. Shutdown waits for it (its drain bounds the wait): a
    /// release missed while Redis fails over would hold its lock for the lease.
    pub(super) fn redo_later(&self, redo: Redo) {
        let call = Pending {
            redo,
            due: Instant::now(),
            pause: Duration::ZERO,
        };
        let starts = {
            let mut unanswered = self.unanswered.lock().unwrap_or_else(|e| e.into_inner());
            unanswered.calls.push(call);
            !std::mem::replace(&mut unanswered.retrying, true)
        };
        if starts {
            let locks = self.clone();
            self.background.spawn(async move { locks.retry_unanswered().await });
        }
    }

    /// Makes the calls again, a round every Redis timeout, each node's on their own
    /// (see [`Locks::retry_on_node`]), until none is left. Once the server stops, the
    /// next round (at once, unless one is under way) takes every call, and rounds
    /// follow every [`STOPPING_PAUSE`]: the drain waits for them.
    async fn retry_unanswered(&self) {
        let mut was_stopping = false;
        loop {
            let stopping = self.stop.is_cancelled();
            let pause = if stopping {
                STOPPING_PAUSE
            } else {
                self.backend.timeout()
            };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = self.stop.cancelled(), if !stopping => {}
            }
            let now = Instant::now();
            let mut calls = {
                let mut unanswered = self.unanswered.lock().unwrap_or_else(|e| e.into_inner());
                unanswered.in_round = unanswered.calls.len();
                std::mem::take(&mut unanswered.calls)
            };
            calls.retain(|c| !c.redo.expired(now));
            if self.stop.is_cancelled() && !std::mem::replace(&mut was_stopping, true) {
                for call in &mut calls {
                    (call.due, call.pause) = (now, Duration::ZERO);
                }
            }
            let (due, later): (Vec<_>, Vec<_>) = calls.into_iter().partition(|c| c.due <= now);
            // On a cluster, calls that may reach several nodes answer for none of them:
            // each is made on its own (one failed by another node would hold up the
            // calls of its first name's node, or of the other such calls).
            let cluster = self.backend.is_cluster();
            let (spanning, single): (Vec<_>, Vec<_>) = due.into_iter().partition(|c| cluster && c.redo.spans_nodes());
            let nodes = self.backend.by_node(single, |c| c.redo.slot()).into_values();
            let rounds = nodes.map(|calls| self.retry_on_node(calls));
            let (left, spanning_left) = tokio::join!(futures::future::join_all(rounds), self.retry_each(spanning));
            let left = left.into_iter().flatten().chain(spanning_left);
            let mut unanswered = self.unanswered.lock().unwrap_or_else(|e| e.into_inner());
            unanswered.in_round = 0;
            unanswered.calls.extend(later.into_iter().chain(left));
            if unanswered.calls.is_empty() {
                unanswered.retrying = false;
                return;
            }
        }
    }

    /// One node's calls: the first, then, if the node answered it, all the others at
    /// once. A first the node did not answer goes last. Returns the calls still to
    /// make.
    async fn retry_on_node(&self, calls: Vec<Pending>) -> Vec<Pending> {
        let mut calls = calls.into_iter();
        let Some(first) = calls.next() else {
            return Vec::new();
        };
        let reply = self.redo(&first.redo).await;
        if reply == Reply::Away {
            return calls.chain(std::iter::once(first)).collect();
        }
        let first = self.again(first, reply);
        first
            .into_iter()
            .chain(self.retry_each(calls.collect()).await)
            .collect()
    }

    /// Calls made each on its own, all at once. Returns those still to make.
    async fn retry_each(&self, calls: Vec<Pending>) -> Vec<Pending> {
        let replies = futures::future::join_all(calls.iter().map(|c| self.redo(&c.redo))).await;
        let tried = calls.into_iter().zip(replies);
        tried.filter_map(|(call, reply)| self.again(call, reply)).collect()
    }

    /// A call as it is to be made again after `reply`, if at all: a refused one after
    /// twice its last pause (one Redis timeout at first, at most [`REFUSED_PAUSE_MAX`]
    /// of them; from [`STOPPING_PAUSE`] to [`STOPPING_PAUSE_MAX`] once the server
    /// stops), one the node did not answer at the next round.
    fn again(&self, mut call: Pending, reply: Reply) -> Option<Pending> {
        let (least, most) = match self.stop.is_cancelled() {
            true => (STOPPING_PAUSE, STOPPING_PAUSE_MAX),
            false => (self.backend.timeout(), self.backend.timeout() * REFUSED_PAUSE_MAX),
        };
        match reply {
            Reply::Done => return None,
            Reply::Refused => call.pause = (call.pause * 2).clamp(least, most),
            Reply::Away => call.pause = Duration::ZERO,
        }
        call.due = Instant::now() + call.pause;
        Some(call)
    }

    /// Makes a call once more.
    async fn redo(&self, redo: &Redo) -> Reply {
        match redo {
            Redo::Leave(req) => self.left(req).await,
            Redo::GiveBack { req, giving, .. } => self.gave_back(req, *giving, false).await,
            Redo::Unclaimed { lock, grant, .. } => self.gave_back_grant(lock, grant).await,
        }
    }
}
