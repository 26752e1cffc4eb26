//! Errors of the client library: a bad target, a transport failure, a status the
//! server ended a call with, or a lease that was lost.

use crate::lease::LostReason;
use tonic::{Code, Status};

/// Everything a latchkey call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server address is not `http://host:port` or `unix:///path`.
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
    /// The connection to the server could not be set up.
    #[error("cannot connect to the latchkey server at {target}: {}", chain(.source))]
    Transport {
        /// The address as given.
        target: String,
        /// Why the connection failed.
        #[source]
        source: tonic::transport::Error,
    },
    /// The server ended the call with this status.
    #[error("{} ({:?})", .0.message(), .0.code())]
    Status(#[from] Status),
    /// The lease ended without the client asking.
    #[error("lease lost: {0}")]
    Lost(LostReason),
    /// The server broke the `Acquire` protocol (for example, ended the stream
    /// before `Acquired`).
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl Error {
    /// The gRPC code of the error. A status keeps its own code; the other
    /// variants map to the nearest one (`Transport` → `UNAVAILABLE`,
    /// `InvalidTarget` and `InvalidOptions` → `INVALID_ARGUMENT`, `Lost` → `ABORTED`, `Protocol` →
    /// `INTERNAL`).
    pub fn code(&self) -> Code {
        match self {
            Error::InvalidTarget { .. } | Error::InvalidOptions(_) => Code::InvalidArgument,
            Error::Transport { .. } => Code::Unavailable,
            Error::Status(status) => status.code(),
            Error::Lost(_) => Code::Aborted,
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

    /// True when a wait for a lock ran out (`DEADLINE_EXCEEDED`), including a
    /// try-once attempt on a held lock.
    pub fn is_timeout(&self) -> bool {
        self.code() == Code::DeadlineExceeded
    }

    /// True when the server could not be reached or is unavailable; retrying
    /// the same call later may work.
    pub fn is_unavailable(&self) -> bool {
        self.code() == Code::Unavailable
    }
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
    fn status_keeps_its_code_and_message() {
        let err = Error::from(Status::deadline_exceeded("lock \"a\" not acquired in 1s"));
        assert_eq!(err.code(), Code::DeadlineExceeded);
        assert!(err.is_timeout());
        assert_eq!(err.to_string(), "lock \"a\" not acquired in 1s (DeadlineExceeded)");
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
    }
}
