//! A watched lock's states, read off the connection as they come.
//!
//! Every call of a [`crate::Client`] shares one HTTP/2 connection, and the connection's
//! flow-control window is given back only as a stream's data is read. A watch nobody
//! reads for a while (a status page, a task busy elsewhere) would keep the server's
//! states in that window: a few such watches of a busy or large lock fill it, and then
//! no lease on the connection hears `acquired` or `lost`, and no release its answer.
//! So each watch is read by a task of its own, which keeps the latest state for
//! [`LockWatch::next`]; a reader slower than the changes skips to the latest, as the
//! server's own states are one per read of the lock, not one per change.

use crate::Error;
use latchkey_proto::v1::LockState;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tonic::Streaming;

/// The states of one watched lock, from [`crate::Client::watch`]. Dropping it ends the
/// watch.
#[derive(Debug)]
pub struct LockWatch {
    latest: Arc<Latest>,
    reader: JoinHandle<()>,
}

/// What the reader has that [`LockWatch::next`] has not returned yet.
#[derive(Debug, Default)]
struct Latest {
    slot: Mutex<Slot>,
    changed: Notify,
}

#[derive(Debug, Default)]
struct Slot {
    state: Option<LockState>,
    /// How the watch ended, until returned; then `ended` alone.
    end: Option<Result<(), Error>>,
    ended: bool,
}

impl LockWatch {
    pub(crate) fn new(stream: Streaming<LockState>) -> Self {
        let latest = Arc::new(Latest::default());
        let reader = tokio::spawn(read(stream, latest.clone()));
        Self { latest, reader }
    }

    /// The latest state not returned yet (waiting for one); `None` when the server
    /// ended the watch.
    pub async fn next(&mut self) -> Result<Option<LockState>, Error> {
        loop {
            if let Some(next) = self.latest.take() {
                return next;
            }
            // One reader, one waiter: a change stored before this wait left a permit.
            self.latest.changed.notified().await;
        }
    }
}

impl Drop for LockWatch {
    fn drop(&mut self) {
        // Dropping the stream with the task cancels the call.
        self.reader.abort();
    }
}

impl Latest {
    fn slot(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The state, else the end, else nothing new.
    fn take(&self) -> Option<Result<Option<LockState>, Error>> {
        let mut slot = self.slot();
        if let Some(state) = slot.state.take() {
            return Some(Ok(Some(state)));
        }
        match slot.end.take() {
            Some(end) => Some(end.map(|()| None)),
            None => slot.ended.then_some(Ok(None)),
        }
    }
}

/// Reads the watch's states into `latest` until it ends.
async fn read(mut stream: Streaming<LockState>, latest: Arc<Latest>) {
    loop {
        let message = stream.message().await;
        let ended = {
            let mut slot = latest.slot();
            match message {
                Ok(Some(state)) => slot.state = Some(state),
                Ok(None) => slot.end = Some(Ok(())),
                Err(status) => slot.end = Some(Err(status.into())),
            }
            slot.ended = slot.end.is_some();
            slot.ended
        };
        latest.changed.notify_one();
        if ended {
            return;
        }
    }
}
