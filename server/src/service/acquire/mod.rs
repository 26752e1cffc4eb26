//! One `Acquire` stream, as an explicit state machine:
//! Open → (Queued) → Acquired → Released | Lost, or an error status.
//!
//! The stream is the lease: every way the stream ends releases the hold. The session
//! runs inside the response stream ([`SessionStream`]): HTTP/2 polls it for the next
//! event, so an event leaves without a task switch or a channel. Opening and waiting
//! (`waiting`) and releasing (`holding::finish`) are async steps; while the lock is held
//! nothing runs, and the stream keeps only a small [`holding::Held`] record that is
//! polled for the lease's end. A stream the client reset is dropped together with its
//! session, whose guards give back in the background whatever it held or might have
//! been granted.

mod holding;
mod waiting;

use super::Shared;
use crate::auth::{Caller, Standing};
use crate::error::Error;
use holding::Held;
use latchkey_proto::v1::{acquire_response::Event, AcquireRequest, AcquireResponse, Released};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_stream::Stream;
use tokio_util::task::task_tracker::TaskTrackerToken;
use tonic::{Status, Streaming};

/// Events the session has produced and HTTP/2 has not yet taken: at most a few per
/// stream (queued, acquired, released or lost, the status). Its buffer is given back
/// once drained, so a held lease keeps none.
#[derive(Default)]
struct Outbox(Mutex<Vec<Result<AcquireResponse, Status>>>);

impl Outbox {
    fn push(&self, item: Result<AcquireResponse, Status>) {
        self.items().push(item);
    }

    fn pop(&self) -> Option<Result<AcquireResponse, Status>> {
        let mut items = self.items();
        if items.is_empty() {
            return None;
        }
        let item = items.remove(0);
        if items.is_empty() {
            *items = Vec::new();
        }
        Some(item)
    }

    fn is_empty(&self) -> bool {
        self.items().is_empty()
    }

    /// The status, when it is the first item.
    fn take_refusal(&self) -> Option<Status> {
        let mut items = self.items();
        match items.first() {
            Some(Err(_)) => items.remove(0).err(),
            _ => None,
        }
    }

    fn items(&self) -> std::sync::MutexGuard<'_, Vec<Result<AcquireResponse, Status>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A step of the session that runs until the lock is held (or the stream is over).
type Step = Pin<Box<dyn Future<Output = Option<Box<Held>>> + Send>>;

/// Where the session stands.
enum Phase {
    /// Opening, waiting or releasing.
    Running(Step),
    /// Holding the lock.
    Held(Box<Held>),
    /// Over: only queued events remain.
    Ended,
}

/// The response stream of one `Acquire`: it runs the session and yields its events.
pub struct SessionStream {
    phase: Phase,
    outbox: Arc<Outbox>,
}

impl std::fmt::Debug for SessionStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let phase = match self.phase {
            Phase::Running(_) => "running",
            Phase::Held(_) => "held",
            Phase::Ended => "ended",
        };
        f.debug_struct("SessionStream").field("phase", &phase).finish()
    }
}

impl SessionStream {
    /// Starts the session of one stream; nothing runs until it is polled.
    pub(in crate::service) fn new(
        shared: Arc<Shared>,
        caller: Caller,
        standing: Option<Box<Standing>>,
        inbound: Streaming<AcquireRequest>,
        deadline: Option<Instant>,
        permit: OwnedSemaphorePermit,
        connection: impl Send + Sync + 'static,
    ) -> Self {
        let outbox = Arc::new(Outbox::default());
        let tracked = shared.sessions.token();
        let session = Session {
            shared,
            caller,
            standing,
            inbound,
            outbox: outbox.clone(),
            deadline,
            half_closed: false,
            accounting: Accounting::new(tracked, permit, connection),
        };
        Self {
            phase: Phase::Running(Box::pin(waiting::start(session))),
            outbox,
        }
    }

    /// Runs the session until its first event, which is then the stream's first item;
    /// a stream refused before any event ends with that status alone.
    pub(in crate::service) async fn first_event(&mut self) -> Result<(), Status> {
        std::future::poll_fn(|cx| {
            self.drive(cx);
            match matches!(self.phase, Phase::Ended) || !self.outbox.is_empty() {
                true => Poll::Ready(()),
                false => Poll::Pending,
            }
        })
        .await;
        self.outbox.take_refusal().map_or(Ok(()), Err)
    }

    /// Advances the session until it waits for something or has an event to send.
    fn drive(&mut self, cx: &mut Context<'_>) {
        while self.outbox.is_empty() {
            match &mut self.phase {
                Phase::Running(step) => match step.as_mut().poll(cx) {
                    Poll::Ready(Some(held)) => self.phase = Phase::Held(held),
                    Poll::Ready(None) => self.phase = Phase::Ended,
                    Poll::Pending => return,
                },
                Phase::Held(held) => match held.poll_end(cx) {
                    Poll::Ready(end) => {
                        let Phase::Held(held) = std::mem::replace(&mut self.phase, Phase::Ended) else {
                            return;
                        };
                        self.phase = Phase::Running(Box::pin(holding::finish(held, end)));
                    }
                    Poll::Pending => return,
                },
                Phase::Ended => return,
            }
        }
    }
}

impl Stream for SessionStream {
    type Item = Result<AcquireResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.drive(cx);
        match self.outbox.pop() {
            Some(item) => Poll::Ready(Some(item)),
            None if matches!(self.phase, Phase::Ended) => Poll::Ready(None),
            None => Poll::Pending,
        }
    }
}

/// What a session holds for its whole life, given back however it ends: the stream
/// bounds, the shutdown drain's count, the gauges.
struct Accounting {
    _tracked: TaskTrackerToken,
    _permit: OwnedSemaphorePermit,
    _connection: Box<dyn Send + Sync>,
    /// The status the stream ended with; unset when the client reset it.
    code: Option<tonic::Code>,
}

impl Accounting {
    fn new(tracked: TaskTrackerToken, permit: OwnedSemaphorePermit, connection: impl Send + Sync + 'static) -> Self {
        crate::metrics::streams(1);
        Self {
            _tracked: tracked,
            _permit: permit,
            _connection: Box::new(connection),
            code: None,
        }
    }
}

impl Drop for Accounting {
    fn drop(&mut self) {
        crate::metrics::rpc_handled("Acquire", self.code.unwrap_or(tonic::Code::Cancelled));
        crate::metrics::streams(-1);
    }
}

/// Why waiting or holding ended early.
enum Ended {
    /// The client cancelled or disconnected: nothing more to send.
    Gone,
    /// The client sent `release` while waiting: it is answered `released`.
    Withdrawn,
    /// The stream ends with this status.
    Status(Status),
}

impl Ended {
    /// How a stream ends after an error reading it (see [`refused_read`]).
    fn from_read(status: Status) -> Self {
        refused_read(status).map_or(Ended::Gone, Ended::Status)
    }
}

impl From<Error> for Ended {
    fn from(e: Error) -> Self {
        Ended::Status(e.into())
    }
}

/// The status a stream ends with after an error reading it, when the client is still
/// there to hear it: a message that does not decode (the codec answers
/// INVALID_ARGUMENT naming the field), one over `--max-message-size`, or one whose
/// framing is broken (tonic answers INTERNAL with no transport error under it: the
/// client ended its side in the middle of a message, or flagged one compressed with no
/// encoding). `None`: the client reset the stream or its connection went (an HTTP/2
/// error is under the status), and nothing more is sent.
fn refused_read(status: Status) -> Option<Status> {
    match status.code() {
        tonic::Code::InvalidArgument => Some(status),
        tonic::Code::Internal if std::error::Error::source(&status).is_none() => {
            Some(Error::invalid("message", status.message()).into())
        }
        tonic::Code::OutOfRange => Some(crate::service::edge::too_large(&status)),
        _ => None,
    }
}

/// One stream's context, handed from step to step.
struct Session {
    shared: Arc<Shared>,
    /// Who opened the stream; every name of the request is checked against it.
    caller: Caller,
    /// The caller, checked again at each auth file reload while the stream waits or
    /// holds (none with auth off).
    standing: Option<Box<Standing>>,
    inbound: Streaming<AcquireRequest>,
    outbox: Arc<Outbox>,
    /// When the call's gRPC deadline passes: the wait ends by then.
    deadline: Option<Instant>,
    /// The client half-closed while waiting: release as soon as granted.
    half_closed: bool,
    accounting: Accounting,
}

impl Session {
    fn send(&self, event: Event) {
        self.outbox.push(Ok(AcquireResponse { event: Some(event) }));
    }

    /// Ends the stream: OK after a release (answered `released` when asked while
    /// waiting), nothing more for a client that left (counted cancelled), or the status.
    fn end(&mut self, outcome: Result<(), Ended>) {
        let status = match outcome {
            Err(Ended::Gone) => return,
            Ok(()) => None,
            Err(Ended::Withdrawn) => {
                self.send(Event::Released(Released {}));
                None
            }
            Err(Ended::Status(status)) => Some(status),
        };
        self.accounting.code = Some(status.as_ref().map_or(tonic::Code::Ok, Status::code));
        if let Some(status) = status {
            self.outbox.push(Err(status));
        }
    }
}
