//! The `Watch` stream: one `LockState` at once, then one per change. Changes arrive by
//! pub/sub: latchkey's scripts announce every grant, release, queue change and break
//! on the lock's watch channel, and Redisson's unlock messages come on the kinds'
//! channels. Timers cover the rest: the holder's TTL, so an expiry is seen when it
//! happens, and a re-read every second, as a Redisson client announces nothing when it
//! takes a lock.

use super::{convert, Shared};
use crate::auth::{Action, Caller};
use crate::error::Error;
use crate::hub::{Waiter, Want};
use crate::keys::LockKeys;
use futures::StreamExt;
use latchkey_proto::v1::{LockState, WatchRequest};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

/// States buffered per Watch stream before the server waits for the client.
const WATCH_BUFFER: usize = 8;
/// How long a new watcher waits for its subscriptions before the first state.
const SUBSCRIBE_WAIT: Duration = Duration::from_secs(1);
/// A lock is re-read at least this often: a Redisson client takes a lock, or another
/// hold of one, without a message.
const QUIET_RECHECK: Duration = Duration::from_secs(1);

/// Starts one Watch stream, if `caller` may inspect the lock: its states, then the
/// status it ends with. The status goes apart from the states, which a client that
/// reads slowly leaves queued: it never waits for room (shutdown does not wait on such
/// a client), and it comes after them rather than never (the stream would end OK,
/// which tells a client the watch is over for good).
pub(super) fn start(
    shared: Arc<Shared>,
    req: WatchRequest,
    caller: &Caller,
    places: impl Send + 'static,
) -> Result<super::StateStream, Error> {
    let keys = shared.lock_for(&req.name, caller, Action::Inspect)?;
    let (tx, rx) = mpsc::channel(WATCH_BUFFER);
    let (end_tx, end_rx) = oneshot::channel::<Status>();
    let sessions = shared.sessions.clone();
    sessions.spawn(async move {
        let _places = places;
        // `run` ends without a status only when the client went away.
        let code = match run(&shared, &keys, &tx).await {
            Ok(()) => tonic::Code::Cancelled,
            Err(status) => {
                let code = status.code();
                let _ = end_tx.send(status);
                code
            }
        };
        crate::metrics::rpc_handled("Watch", code);
    });
    let end = futures::stream::once(end_rx).filter_map(|end| std::future::ready(end.ok().map(Err)));
    Ok(Box::pin(ReceiverStream::new(rx).chain(end)))
}

async fn run(shared: &Shared, keys: &LockKeys, tx: &mpsc::Sender<Result<LockState, Status>>) -> Result<(), Status> {
    let channels = [
        &keys.watch(),
        &keys.channel(),
        &keys.rw_channel(),
        &keys.semaphore_channel(),
    ];
    let watchers: Vec<Waiter> = channels
        .iter()
        .map(|c| shared.hub.register(c, "", Want::Watch, None, None))
        .collect();
    // The subscriptions at once, within one SUBSCRIBE_WAIT; shutdown or a client that
    // left ends the wait.
    let subscribed = futures::future::join_all(watchers.iter().map(|w| w.subscribed(SUBSCRIBE_WAIT)));
    tokio::select! {
        _ = shared.shutdown.cancelled() => return Err(Error::ShuttingDown.into()),
        _ = tx.closed() => return Ok(()),
        _ = subscribed => {}
    }
    let mut last: Option<LockState> = None;
    loop {
        let mut recheck = None;
        match shared.locks.describe(keys).await {
            Ok(state) => {
                let state = convert::to_lock_state(state);
                recheck = state.ttl.and_then(|t| Duration::try_from(t).ok());
                if last.as_ref().is_none_or(|l| !same(l, &state)) {
                    match send_until_shutdown(shared, tx, Ok(state.clone())).await {
                        None => return Err(Error::ShuttingDown.into()),
                        Some(false) => return Ok(()),
                        Some(true) => {}
                    }
                    last = Some(state);
                }
            }
            // Once the first state is out, a Redis that does not answer for a while (a
            // restart, a failover) ends no Watch: it reads again until Redis answers.
            Err(Error::Redis(e)) if crate::redis::transient(&e) && last.is_some() => {
                tracing::debug!(lock = %keys.lock, error = %e, "watch read failed; reading again");
            }
            Err(e) => return Err(e.into()),
        }
        let expiry = recheck.filter(|_| last.as_ref().is_some_and(|l| l.locked));
        let until =
            Instant::now() + expiry.map_or(QUIET_RECHECK, |ttl| (ttl + Duration::from_millis(1)).min(QUIET_RECHECK));
        let any_change = futures::future::select_all(watchers.iter().map(|w| Box::pin(w.woken())));
        tokio::select! {
            _ = shared.shutdown.cancelled() => return Err(Error::ShuttingDown.into()),
            _ = tx.closed() => return Ok(()),
            _ = any_change => {}
            _ = tokio::time::sleep_until(until) => {}
        }
    }
}

/// Sends `item` unless shutdown comes first: a client that stopped reading must not
/// hold up shutdown. `None` when shutdown came, else whether the client still listens.
async fn send_until_shutdown(
    shared: &Shared,
    tx: &mpsc::Sender<Result<LockState, Status>>,
    item: Result<LockState, Status>,
) -> Option<bool> {
    tokio::select! {
        biased;
        sent = tx.send(item) => Some(sent.is_ok()),
        _ = shared.shutdown.cancelled() => None,
    }
}

/// Two states are the same change-wise when they differ at most in remaining TTLs.
fn same(a: &LockState, b: &LockState) -> bool {
    let holders = |s: &LockState| {
        s.holders
            .iter()
            .map(|h| (h.owner.clone(), h.hold_count))
            .collect::<Vec<_>>()
    };
    a.kind == b.kind
        && a.locked == b.locked
        && a.last_fencing_token == b.last_fencing_token
        && a.waiters == b.waiters
        && holders(a) == holders(b)
}
