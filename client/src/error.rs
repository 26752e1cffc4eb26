//! Errors of the client library: a bad target, a transport failure, a status the
//! server ended a call with, or a lease that was lost.

use std::sync::Arc;
use std::time::Duration;

use crate::lease::LostReason;
use tonic::{Code, Status};

/// Everything a latchkey call can fail with. More kinds may come: match with a
/// wildcard arm, or branch on [`Error::code`] and [`Error::reason`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server address is not `http://host:port`, `https://host:port` or `unix:///path`.
    #[error("invalid server address {target:?}: {reason}")]
    InvalidTarget {
        /// The address as given.
        target: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The [`crate::ConnectOptions`] do not fit together or hold a value that cannot be
    /// sent (a token that is not printable ASCII).
    #[error("invalid connection options: {0}")]
    InvalidOptions(String),
    /// An argument of a request that cannot be sent as given, refused before any call:
    /// proto3 sends neither `0` nor `""`, and the server would read the default in its
    /// place (a semaphore's `permits(0)` took 1 permit; `owner("")` a fresh owner per
    /// stream, so no reentrancy).
    #[error("{field} {reason}")]
    InvalidRequest {
        /// The argument, as the builder's method names it (`permits`, `owner`).
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The connection to the server could not be set up.
    #[error("cannot connect to the latchkey server at {target}: {}", chain(.source))]
    Transport {
        /// The address as given.
        target: String,
        /// Why the connection failed.
        #[source]
        source: tonic::transport::Error,
    },
    /// The server ended the call with this status, or the connection broke under the
    /// call: tonic reports that as `UNKNOWN` or `CANCELLED` (a server that died, a
    /// connection reset), which this client turns into `UNAVAILABLE`, as when the
    /// server cannot be reached; the status tonic made is then its source.
    #[error("{} ({:?})", .0.message(), .0.code())]
    Status(Status),
    /// The lease ended without the client asking.
    #[error("lease lost: {0}")]
    Lost(LostReason),
    /// [`crate::Lease::release`] got no answer within `waited`
    /// ([`crate::RELEASE_TIMEOUT`]): whether the server released is unknown. The stream
    /// was then cancelled, and the server releases on a cancel once it hears of it.
    /// Its code is `DEADLINE_EXCEEDED`, but it is not a wait for the lock that ran out
    /// ([`Error::is_timeout`] is false).
    #[error(
        "no answer to the release in {}; the stream was cancelled, which releases the lock \
         on the server (DeadlineExceeded)",
        humantime::format_duration(*.waited)
    )]
    ReleaseUnconfirmed {
        /// How long the release waited for the server.
        waited: Duration,
    },
    /// A call answered once (Describe, List, ForceRelease, the opening of a Watch) got
    /// no answer within `waited` ([`crate::ConnectOptions::call_timeout`]). Its code is
    /// `DEADLINE_EXCEEDED`, but it is no wait for a lock ([`Error::is_timeout`] is
    /// false); trying again may work. A ForceRelease may have broken the lock.
    #[error(
        "no answer from the server within {} (DeadlineExceeded)",
        humantime::format_duration(*.waited)
    )]
    NoAnswer {
        /// How long the call waited for the server.
        waited: Duration,
    },
    /// The server broke the `Acquire` protocol (for example, ended the stream
    /// before `Acquired`).
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl Error {
    /// The gRPC code of the error. A status keeps its own code; the other
    /// variants map to the nearest one (`Transport` → `UNAVAILABLE`, but
    /// `FAILED_PRECONDITION` when TLS refused the connection: a certificate that does
    /// not verify, or a server that speaks no TLS, which trying again never mends;
    /// `InvalidTarget`, `InvalidOptions` and `InvalidRequest` → `INVALID_ARGUMENT`,
    /// `Lost` → `ABORTED`, `ReleaseUnconfirmed` and `NoAnswer` → `DEADLINE_EXCEEDED`, `Protocol` →
    /// `INTERNAL`).
    pub fn code(&self) -> Code {
        match self {
            Error::InvalidTarget { .. } | Error::InvalidOptions(_) | Error::InvalidRequest { .. } => {
                Code::InvalidArgument
            }
            Error::Transport { source, .. } if tls_refused(source) => Code::FailedPrecondition,
            Error::Transport { .. } => Code::Unavailable,
            Error::Status(status) => status.code(),
            Error::Lost(_) => Code::Aborted,
            Error::ReleaseUnconfirmed { .. } | Error::NoAnswer { .. } => Code::DeadlineExceeded,
            Error::Protocol(_) => Code::Internal,
        }
    }

    /// The status the server ended the call with, if that is the error.
    pub fn status(&self) -> Option<&Status> {
        match self {
            Error::Status(status) => Some(status),
            _ => None,
        }
    }

    /// The `google.rpc.ErrorInfo` the server put on its status (domain `latchkey`): its
    /// `reason` (`WAIT_TIMEOUT`, `LIMIT_MISMATCH`, `SHUTTING_DOWN`, …) and `metadata`
    /// (the field or lock it names). None for an error no server status carries.
    pub fn error_info(&self) -> Option<tonic_types::ErrorInfo> {
        use tonic_types::StatusExt;
        self.status().and_then(StatusExt::get_details_error_info)
    }

    /// The reason of [`Error::error_info`], to branch on.
    pub fn reason(&self) -> Option<String> {
        self.error_info().map(|info| info.reason)
    }

    /// True when a wait for a lock ran out (the server's `DEADLINE_EXCEEDED`),
    /// including a try-once attempt on a held lock. Not for a release or another call
    /// with no answer ([`Error::ReleaseUnconfirmed`], [`Error::NoAnswer`]).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Status(status) if status.code() == Code::DeadlineExceeded)
    }

    /// True when the server could not be reached or is unavailable, or the connection
    /// broke under the call (the server died, or closed the connection before it saw the
    /// call); retrying the same call later may work.
    pub fn is_unavailable(&self) -> bool {
        self.code() == Code::Unavailable
    }
}

impl From<Status> for Error {
    /// A status the server sent keeps its code. One tonic made for a connection TLS
    /// refused (the server refused this client's certificate once the client took the
    /// handshake for done, or a connection made again failed its handshake) becomes
    /// `FAILED_PRECONDITION`, which trying again never mends; one made for a connection
    /// that broke under the call becomes `UNAVAILABLE`. Either keeps tonic's as its
    /// source.
    fn from(status: Status) -> Self {
        let made_by_tonic = std::error::Error::source(&status).is_some();
        if made_by_tonic && tls_refused(&status) {
            let message = format!("TLS refused the connection: {}", status.message());
            let mut refused = Status::new(Code::FailedPrecondition, message);
            refused.set_source(Arc::new(status));
            return Error::Status(refused);
        }
        if !broke_under_the_call(&status) {
            return Error::Status(status);
        }
        let message = format!("the connection to the server broke: {}", status.message());
        let mut unavailable = Status::new(Code::Unavailable, message);
        unavailable.set_source(Arc::new(status));
        Error::Status(unavailable)
    }
}

/// Whether tonic made `status` for a connection that broke under the call. tonic maps
/// an HTTP/2 or hyper error with no reset reason (the socket closed or reset: the
/// server died, the network failed) to `UNKNOWN`, a request the closing connection
/// dropped to `CANCELLED`, and keeps that error as the status's source. A call the
/// server's GOAWAY refused (its keepalive gave up on this client, or it is shutting
/// down) gets the GOAWAY's reason, `INTERNAL` for `NO_ERROR`; the server never saw
/// it. A status the server sent has no source, so a server's own `UNKNOWN` stays so;
/// nor does tonic's own timeout of a call (`CANCELLED`, with `TimeoutExpired` as
/// source) count.
fn broke_under_the_call(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        let go_away = err
            .downcast_ref::<h2::Error>()
            .is_some_and(|e| e.is_go_away() && e.is_remote());
        let transport = err.is::<hyper::Error>() || err.is::<h2::Error>() || err.is::<std::io::Error>();
        if go_away || (transport && matches!(status.code(), Code::Unknown | Code::Cancelled)) {
            return true;
        }
        source = err.source();
    }
    false
}

/// Whether TLS refused the connection `err` failed on: rustls's errors reach the
/// transport as I/O errors of kind `InvalidData` (within an HTTP/2 error, which gives
/// its I/O error only when asked: it names no source).
fn tls_refused(err: &(dyn std::error::Error + 'static)) -> bool {
    let invalid_data = |e: &std::io::Error| e.kind() == std::io::ErrorKind::InvalidData;
    let mut source = err.source();
    while let Some(cause) = source {
        let io = (cause.downcast_ref::<std::io::Error>())
            .or_else(|| cause.downcast_ref::<h2::Error>().and_then(h2::Error::get_io));
        if io.is_some_and(invalid_data) {
            return true;
        }
        source = cause.source();
    }
    false
}

/// The causes of a transport error, joined with ": " and without repeats (its
/// own text is only "transport error").
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = String::new();
    let mut source = err.source();
    while let Some(cause) = source {
        let line = cause.to_string();
        if !text.contains(&line) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&line);
        }
        source = cause.source();
    }
    if text.is_empty() {
        text = err.to_string();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_servers_error_info_is_read_from_the_status() {
        use tonic_types::{ErrorDetails, StatusExt};
        let metadata: std::collections::HashMap<String, String> =
            [("field".to_owned(), "open.limit".to_owned())].into();
        let details = ErrorDetails::with_error_info("LIMIT_MISMATCH", "latchkey", metadata);
        let err = Error::from(Status::with_error_details(Code::FailedPrecondition, "limit", details));
        assert_eq!(err.reason().as_deref(), Some("LIMIT_MISMATCH"));
        assert_eq!(err.error_info().unwrap().metadata["field"], "open.limit");
        assert_eq!(Error::Lost(LostReason::NotHeld).reason(), None);
        assert_eq!(Error::from(Status::internal("no details")).reason(), None);
    }

    #[test]
    fn status_keeps_its_code_and_message() {
        let err = Error::from(Status::deadline_exceeded("lock \"a\" not acquired in 1s"));
        assert_eq!(err.code(), Code::DeadlineExceeded);
        assert!(err.is_timeout());
        assert_eq!(err.to_string(), "lock \"a\" not acquired in 1s (DeadlineExceeded)");
    }

    #[test]
    fn a_connection_that_broke_under_a_call_is_unavailable() {
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let broke = Status::from_error(Box::new(reset));
        assert_eq!(broke.code(), Code::Unknown, "tonic's mapping: {broke:?}");
        let err = Error::from(broke);
        assert!(err.is_unavailable(), "{err}");
        assert!(
            err.to_string().starts_with("the connection to the server broke"),
            "{err}"
        );
        // A status the server sent keeps its code, whatever it is.
        assert_eq!(Error::from(Status::unknown("x")).code(), Code::Unknown);
        assert_eq!(Error::from(Status::cancelled("x")).code(), Code::Cancelled);
        // An error of another kind under a local status is no broken connection.
        let other = Status::from_error("a decoder's complaint".into());
        assert_eq!(Error::from(other).code(), Code::Unknown);
    }

    #[test]
    fn an_unconfirmed_release_is_no_wait_timeout() {
        let err = Error::ReleaseUnconfirmed {
            waited: Duration::from_secs(5),
        };
        assert_eq!(err.code(), Code::DeadlineExceeded);
        assert!(!err.is_timeout());
        assert!(err.to_string().contains("no answer to the release in 5s"), "{err}");
    }

    #[test]
    fn other_variants_map_to_nearest_code() {
        assert_eq!(Error::Lost(LostReason::NotHeld).code(), Code::Aborted);
        assert_eq!(Error::Protocol("x".into()).code(), Code::Internal);
        let invalid = Error::InvalidTarget {
            target: "x".into(),
            reason: "y".into(),
        };
        assert_eq!(invalid.code(), Code::InvalidArgument);
        assert!(invalid.status().is_none());
        let request = Error::InvalidRequest {
            field: "permits",
            reason: "must be at least 1",
        };
        assert_eq!(request.code(), Code::InvalidArgument);
        assert_eq!(request.to_string(), "permits must be at least 1");
    }
}
