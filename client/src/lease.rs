//! A held lock: `Acquired` has arrived on an `Acquire` stream and the stream is
//! still open. A background reader watches the rest of the stream for `Lost`;
//! [`Lease::release`] sends `Release`, and dropping the lease half-closes.

use std::fmt;
use std::time::Duration;

use latchkey_proto::v1::{
    acquire_request::Action, acquire_response::Event, lost::Reason, AcquireRequest, AcquireResponse, Acquired, Release,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tonic::{Status, Streaming};

use crate::Error;

/// How long a released or dropped lease waits for the server to confirm and end
/// the stream before cancelling it (a cancel releases the lock too).
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a lease ended without the holder asking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// The fixed lease ran out.
    LeaseExpired,
    /// The server's watchdog found the lock gone or held by someone else.
    NotHeld,
    /// An operator called `ForceRelease`.
    ForceReleased,
    /// The server is shutting down; it released the lock first.
    Shutdown,
    /// The stream broke (network loss, server crash, keepalive timeout) or ended
    /// without a reason; the server releases on its side when it notices.
    Disconnected,
    /// The server sent a reason this client does not know.
    Unknown(i32),
}

impl LostReason {
    /// Maps the proto `Lost.reason` value.
    pub fn from_proto(reason: i32) -> Self {
        match Reason::try_from(reason) {
            Ok(Reason::LeaseExpired) => LostReason::LeaseExpired,
            Ok(Reason::NotHeld) => LostReason::NotHeld,
            Ok(Reason::ForceReleased) => LostReason::ForceReleased,
            Ok(Reason::Shutdown) => LostReason::Shutdown,
            Ok(Reason::Unspecified) | Err(_) => LostReason::Unknown(reason),
        }
    }
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LostReason::LeaseExpired => f.write_str("the fixed lease expired"),
            LostReason::NotHeld => f.write_str("the lock is no longer held"),
            LostReason::ForceReleased => f.write_str("the lock was force-released"),
            LostReason::Shutdown => f.write_str("the server is shutting down"),
            LostReason::Disconnected => f.write_str("the connection to the server broke"),
            LostReason::Unknown(code) => write!(f, "unknown reason {code}"),
        }
    }
}

/// Where the lease stands, as seen by the background reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Held,
    Released,
    Lost(LostReason),
}

/// A held lock. Keep it alive for as long as the work needs the lock.
///
/// Dropping it half-closes the `Acquire` stream, which makes the server release
/// the lock; [`Lease::release`] does the same and waits for the confirmation.
#[derive(Debug)]
pub struct Lease {
    names: Vec<String>,
    acquired: Acquired,
    lease: Option<Duration>,
    /// Dropping this half-closes the request side of the stream.
    requests: mpsc::Sender<AcquireRequest>,
    /// Dropping this starts the reader's [`RELEASE_TIMEOUT`].
    _closing: oneshot::Sender<()>,
    phase: watch::Receiver<Phase>,
    reader: JoinHandle<Result<(), Status>>,
}

impl Lease {
    /// Wraps a stream that has just delivered `acquired` and starts its reader.
    pub(crate) fn start(
        names: Vec<String>,
        acquired: Acquired,
        requests: mpsc::Sender<AcquireRequest>,
        responses: Streaming<AcquireResponse>,
    ) -> Self {
        let (phase_tx, phase) = watch::channel(Phase::Held);
        let (closing, closed) = oneshot::channel();
        let reader = tokio::spawn(read_until_end(responses, phase_tx, closed));
        let lease = acquired.lease.and_then(|d| Duration::try_from(d).ok());
        Lease {
            names,
            acquired,
            lease,
            requests,
            _closing: closing,
            phase,
            reader,
        }
    }

    /// The lock's name (the first name of a multi-lock).
    pub fn name(&self) -> &str {
        self.names.first().map_or("", String::as_str)
    }

    /// Every name held by this lease: one, or all the names of a multi-lock.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The fencing token of this grant: strictly greater than every earlier
    /// grant's token for this name. Pass it to the resources the lock protects.
    /// For a multi-lock, the first name's token.
    pub fn fencing_token(&self) -> u64 {
        match self.acquired.fencing_tokens.first() {
            Some(token) if self.acquired.fencing_token == 0 => *token,
            _ => self.acquired.fencing_token,
        }
    }

    /// One fencing token per name of a multi-lock, in the order of the names;
    /// empty for a single lock.
    pub fn fencing_tokens(&self) -> &[u64] {
        &self.acquired.fencing_tokens
    }

    /// The owner's number of holds on the lock, this one included.
    pub fn hold_count(&self) -> u32 {
        self.acquired.hold_count
    }

    /// The owner id in force: the requested one, or the one the server made.
    pub fn owner(&self) -> &str {
        &self.acquired.owner
    }

    /// The lease in force as the server reported it: the fixed lease, or the
    /// watchdog timeout the server keeps renewing. `None` if the server sent none.
    pub fn lease(&self) -> Option<Duration> {
        self.lease
    }

    /// True once the lease has ended without the holder asking.
    pub fn is_lost(&self) -> bool {
        self.lost_reason().is_some()
    }

    /// Why the lease was lost, or `None` while it is held.
    pub fn lost_reason(&self) -> Option<LostReason> {
        match *self.phase.borrow() {
            Phase::Lost(reason) => Some(reason),
            Phase::Held | Phase::Released => None,
        }
    }

    /// Resolves when the lease ends without the holder asking, with the reason.
    /// Pending for as long as the lock is held; resolves at once if already lost.
    /// Cancel-safe, so it can sit in a `tokio::select!` beside the work.
    pub async fn lost(&self) -> LostReason {
        let mut phase = self.phase.clone();
        let ended = phase.wait_for(|p| *p != Phase::Held).await;
        match ended.map(|p| *p) {
            Ok(Phase::Lost(reason)) => reason,
            // The reader always records an end before it stops, so these arms
            // only cover a reader that panicked.
            Ok(Phase::Held | Phase::Released) | Err(_) => LostReason::Disconnected,
        }
    }

    /// Gives the lock back: sends `Release`, half-closes and waits (at most
    /// [`RELEASE_TIMEOUT`]) for `Released` and the stream's OK end.
    ///
    /// Fails with [`Error::Lost`] if the lease had already been lost, and with
    /// the status if the stream ended with an error.
    pub async fn release(self) -> Result<(), Error> {
        let Lease {
            requests,
            _closing: closing,
            phase,
            reader,
            ..
        } = self;
        if let Phase::Lost(reason) = *phase.borrow() {
            return Err(Error::Lost(reason));
        }
        let release = AcquireRequest {
            action: Some(Action::Release(Release {})),
        };
        // A failed send means the reader has already seen the stream end; its
        // outcome below says how.
        let _ = requests.send(release).await;
        drop(requests);
        drop(closing);
        let outcome = reader
            .await
            .map_err(|e| Error::Protocol(format!("lease reader failed: {e}")))?;
        let last = *phase.borrow();
        release_outcome(last, outcome)
    }
}

/// What a release returns, given the last phase and how the stream ended.
fn release_outcome(phase: Phase, outcome: Result<(), Status>) -> Result<(), Error> {
    match (phase, outcome) {
        (Phase::Lost(reason), _) => Err(Error::Lost(reason)),
        // The server confirmed; how the stream ended after that does not matter.
        (Phase::Released, _) => Ok(()),
        (Phase::Held, Err(status)) => Err(Error::Status(status)),
        (Phase::Held, Ok(())) => Err(Error::Protocol("stream ended without confirming the release".into())),
    }
}

/// Reads events until the stream ends, publishing `Released` and `Lost` as they
/// come. Once the lease is dropped or released it waits at most
/// [`RELEASE_TIMEOUT`] more, then drops the stream, which cancels the call.
async fn read_until_end(
    mut responses: Streaming<AcquireResponse>,
    phase: watch::Sender<Phase>,
    closed: oneshot::Receiver<()>,
) -> Result<(), Status> {
    let deadline = async {
        // Resolves with an error when the lease drops its sender.
        let _ = closed.await;
        tokio::time::sleep(RELEASE_TIMEOUT).await;
    };
    let outcome = tokio::select! {
        outcome = read_events(&mut responses, &phase) => outcome,
        () = deadline => Err(Status::deadline_exceeded(
            "the server did not end the stream after the release",
        )),
    };
    phase.send_if_modified(mark_ended);
    outcome
}

async fn read_events(responses: &mut Streaming<AcquireResponse>, phase: &watch::Sender<Phase>) -> Result<(), Status> {
    while let Some(response) = responses.message().await? {
        match response.event {
            Some(Event::Lost(lost)) => {
                let reason = LostReason::from_proto(lost.reason);
                phase.send_replace(Phase::Lost(reason));
            }
            Some(Event::Released(_)) => {
                phase.send_replace(Phase::Released);
            }
            Some(Event::Queued(_) | Event::Acquired(_)) | None => {}
        }
    }
    Ok(())
}

/// A stream that ends while the lease is still held has lost it.
fn mark_ended(phase: &mut Phase) -> bool {
    if *phase == Phase::Held {
        *phase = Phase::Lost(LostReason::Disconnected);
        return true;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_proto_reasons() {
        assert_eq!(
            LostReason::from_proto(Reason::LeaseExpired as i32),
            LostReason::LeaseExpired
        );
        assert_eq!(
            LostReason::from_proto(Reason::ForceReleased as i32),
            LostReason::ForceReleased
        );
        assert_eq!(LostReason::from_proto(0), LostReason::Unknown(0));
        assert_eq!(LostReason::from_proto(99), LostReason::Unknown(99));
    }

    #[test]
    fn a_held_stream_that_ends_is_disconnected() {
        let mut phase = Phase::Held;
        assert!(mark_ended(&mut phase));
        assert_eq!(phase, Phase::Lost(LostReason::Disconnected));
        let mut released = Phase::Released;
        assert!(!mark_ended(&mut released));
    }

    #[test]
    fn release_outcomes() {
        assert!(release_outcome(Phase::Released, Ok(())).is_ok());
        let lost = release_outcome(Phase::Lost(LostReason::NotHeld), Ok(()));
        assert!(matches!(lost, Err(Error::Lost(LostReason::NotHeld))));
        assert!(release_outcome(Phase::Released, Err(Status::cancelled("x"))).is_ok());
        let failed = release_outcome(Phase::Held, Err(Status::unavailable("x")));
        assert!(matches!(failed, Err(Error::Status(_))));
        assert!(release_outcome(Phase::Held, Ok(())).is_err());
    }
}
