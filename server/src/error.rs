//! Errors typed at their cause, and the one table that turns them into gRPC statuses
//! with a `google.rpc.ErrorInfo` clients can branch on.

use std::collections::HashMap;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The `ErrorInfo.domain` of every latchkey error.
pub const ERROR_DOMAIN: &str = "latchkey";

/// Everything that can go wrong while serving a request.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field is wrong in any state.
    #[error("{field}{}: {reason}", index.map(|i| format!("[{i}]")).unwrap_or_default())]
    InvalidArgument {
        /// The offending field, as named in the proto.
        field: &'static str,
        /// Which element of a repeated field (the first is 0).
        index: Option<usize>,
        /// What is wrong with it.
        reason: String,
    },
    /// The wait for a lock ran out.
    #[error("lock {name:?} was not acquired within the wait timeout")]
    WaitTimeout {
        /// The lock's name.
        name: String,
    },
    /// The name is held as a kind that excludes this request.
    #[error("lock {name:?} is held as another kind of lock")]
    WrongKind {
        /// The lock's name.
        name: String,
    },
    /// The lease ended without the client asking (after the `lost` event).
    #[error("the lease of lock {name:?} was lost: {reason}")]
    LeaseLost {
        /// The lock's name.
        name: String,
        /// The `Lost.Reason` name.
        reason: &'static str,
    },
    /// A semaphore is live with another limit.
    #[error("semaphore {name:?} is live with a limit of {limit}")]
    LimitMismatch {
        /// The semaphore's name.
        name: String,
        /// The live semaphore's limit.
        limit: i64,
    },
    /// RedLock was asked for, but fewer than three deployments are configured.
    #[error("RedLock needs at least three --redlock-url deployments on this server")]
    RedlockNotConfigured,
    /// Too few RedLock deployments answered to ever reach a majority.
    #[error("only {reachable} RedLock deployments answered in time (a node restarted within --redlock-restart-delay is not asked); a majority needs {needed}")]
    RedlockQuorumUnreachable {
        /// Deployments that answered.
        reachable: usize,
        /// The majority.
        needed: usize,
    },
    /// A RedLock release that no majority of deployments confirmed either way (still
    /// held, or gone): the lock may be held on a majority until its nodes' retries
    /// reach them, or may have been lost unseen on one.
    #[error("the release is unconfirmed: {held} RedLock deployments had the hold and {gone} no longer had it, the others did not answer in time; a majority needs {needed} (the release goes on in the background)")]
    RedlockReleaseUnconfirmed {
        /// Deployments that still had the hold.
        held: usize,
        /// Deployments that no longer had it.
        gone: usize,
        /// The majority.
        needed: usize,
    },
    /// The call carries no credential, or one the auth file does not know.
    #[error("{0}")]
    Unauthenticated(String),
    /// The caller's identity may not do this to this lock name.
    #[error("identity {identity:?} may not {action} lock {name:?}")]
    PermissionDenied {
        /// The caller's identity.
        identity: String,
        /// The action refused (`acquire`, `inspect`, `force_release`, `list`).
        action: &'static str,
        /// The lock name (for `list`, the prefix followed by `*`).
        name: String,
    },
    /// A server limit was hit.
    #[error("{0}")]
    ResourceExhausted(String),
    /// Redis failed or did not answer in time, or refused the call (see
    /// [`refused_by_redis`]).
    #[error("{}", redis_message(.0))]
    Redis(#[from] fred::error::Error),
    /// A grant was not acknowledged by enough replicas.
    #[error("the grant was not acknowledged by {wanted} replicas in time")]
    NotReplicated {
        /// The replicas asked for.
        wanted: u32,
    },
    /// Redis's answer to a grant came so late that the lease could have run out there
    /// meanwhile: the grant was given back. The bound is the lease asked for, or
    /// `--watchdog-timeout`.
    #[error(
        "redis answered the grant after its lease could have run out there (its replies are slower than \
         {bound} allows); the grant was given back, try again"
    )]
    GrantLate {
        /// What bounded the wait: the fixed lease, or `--watchdog-timeout`.
        bound: &'static str,
    },
    /// Redis answered something the scripts never return.
    #[error("unexpected reply from redis: {0}")]
    Protocol(String),
    /// The server is shutting down.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The server could not start.
    #[error("{0}")]
    Startup(String),
    /// The server stopped serving on its own: its listener failed, or a task it cannot
    /// serve without (renewals, the pub/sub readers) ended.
    #[error("{0}")]
    Stopped(String),
}

impl Error {
    /// A give-back that no majority of RedLock nodes confirmed: each node that did not
    /// answer is sent it again by its own queue (`redlock::Retry`), so it needs no retry
    /// of the whole.
    pub fn retried_by_its_nodes(&self) -> bool {
        matches!(self, Self::RedlockReleaseUnconfirmed { .. })
    }

    /// An `InvalidArgument` error for `field`.
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field,
            index: None,
            reason: reason.into(),
        }
    }

    /// An invalid field's error for its element at `index` (of a repeated field).
    pub fn at_index(self, index: usize) -> Self {
        match self {
            Self::InvalidArgument { field, reason, .. } => Self::InvalidArgument {
                field,
                index: Some(index),
                reason,
            },
            other => other,
        }
    }

    fn code_and_reason(&self) -> (Code, &'static str) {
        match self {
            Self::InvalidArgument { .. } => (Code::InvalidArgument, "INVALID_ARGUMENT"),
            Self::WaitTimeout { .. } => (Code::DeadlineExceeded, "WAIT_TIMEOUT"),
            Self::WrongKind { .. } => (Code::FailedPrecondition, "WRONG_KIND"),
            Self::LimitMismatch { .. } => (Code::FailedPrecondition, "LIMIT_MISMATCH"),
            Self::LeaseLost { .. } => (Code::Aborted, "LEASE_LOST"),
            Self::RedlockNotConfigured => (Code::FailedPrecondition, "REDLOCK_NOT_CONFIGURED"),
            Self::RedlockQuorumUnreachable { .. } | Self::RedlockReleaseUnconfirmed { .. } => {
                (Code::Unavailable, "REDLOCK_QUORUM_UNREACHABLE")
            }
            Self::Unauthenticated(_) => (Code::Unauthenticated, "UNAUTHENTICATED"),
            Self::PermissionDenied { .. } => (Code::PermissionDenied, "PERMISSION_DENIED"),
            Self::ResourceExhausted(_) => (Code::ResourceExhausted, "LIMIT_REACHED"),
            Self::Redis(e) if refused_by_redis(e) => (Code::FailedPrecondition, "REDIS_REFUSED"),
            Self::Redis(_) => (Code::Unavailable, "REDIS_UNAVAILABLE"),
            Self::NotReplicated { .. } => (Code::Unavailable, "NOT_REPLICATED"),
            Self::GrantLate { .. } => (Code::Unavailable, "GRANT_LATE"),
            Self::Protocol(_) => (Code::Internal, "PROTOCOL"),
            Self::ShuttingDown => (Code::Unavailable, "SHUTTING_DOWN"),
            Self::Startup(_) => (Code::Internal, "STARTUP"),
            Self::Stopped(_) => (Code::Internal, "STOPPED"),
        }
    }

    fn metadata(&self) -> HashMap<String, String> {
        let mut m = HashMap::new();
        match self {
            Self::InvalidArgument { field, index, .. } => {
                m.insert("field".to_owned(), (*field).to_owned());
                if let Some(index) = index {
                    m.insert("index".to_owned(), index.to_string());
                }
            }
            Self::WaitTimeout { name } | Self::WrongKind { name } => {
                m.insert("lockName".to_owned(), name.clone());
            }
            Self::LimitMismatch { name, limit } => {
                m.insert("lockName".to_owned(), name.clone());
                m.insert("limit".to_owned(), limit.to_string());
            }
            Self::LeaseLost { name, reason } => {
                m.insert("lockName".to_owned(), name.clone());
                m.insert("lostReason".to_owned(), (*reason).to_owned());
            }
            Self::PermissionDenied { identity, action, name } => {
                m.insert("identity".to_owned(), identity.clone());
                m.insert("action".to_owned(), (*action).to_owned());
                m.insert("lockName".to_owned(), name.clone());
            }
            _ => {}
        }
        m
    }
}

/// Whether Redis refused a call for good: an ACL that does not let latchkey's user at
/// its keys, channels or commands, or a command this Redis does not have. Retrying does
/// not help, so it is no outage to wait out: the client hears what Redis said.
pub fn refused_by_redis(e: &fred::error::Error) -> bool {
    let details = e.details().to_ascii_lowercase();
    // Redis 7.0 words an ACL refusal inside a script "The user executing the script
    // can't …", 7.2 "No permissions to access …"; outside one, "NOPERM …".
    [
        "noperm",
        "no permissions",
        "can't access",
        "can't publish",
        "can't run",
        "unknown command",
    ]
    .iter()
    .any(|words| details.contains(words))
}

fn redis_message(e: &fred::error::Error) -> String {
    if refused_by_redis(e) {
        format!("redis refused the call: {}", e.details())
    } else {
        // Redis's own words (its memory limit, a load, a failover) tell an operator why.
        format!("redis is unavailable: {}", e.details())
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let (code, reason) = e.code_and_reason();
        let details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, e.metadata());
        Status::with_error_details(code, e.to_string(), details)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acl_refusals_and_missing_commands_are_refusals_not_outages() {
        use fred::error::{Error as RedisError, ErrorKind};
        let refused = [
            "NOPERM this user has no permissions to access one of the keys used as arguments",
            "ERR The user executing the script can't publish to the channel mentioned in the command script: redisson_lock__channel:{a}",
            "ERR The user executing the script can't access at least one of the keys mentioned in the command script: x",
            "ERR user_script:12: No permissions to access a key script: 1, on @user_script:12.",
            "ERR unknown command 'getdel', with args beginning with: 'x'",
        ];
        for details in refused {
            let e = Error::Redis(RedisError::new(ErrorKind::Unknown, details));
            assert_eq!(
                e.code_and_reason(),
                (Code::FailedPrecondition, "REDIS_REFUSED"),
                "{details}"
            );
            assert!(e.to_string().contains(details), "{e}");
        }
        for details in [
            "Connection closed.",
            "LOADING Redis is loading the dataset in memory",
            "OOM command not allowed",
        ] {
            let e = Error::Redis(RedisError::new(ErrorKind::IO, details));
            assert_eq!(
                e.code_and_reason(),
                (Code::Unavailable, "REDIS_UNAVAILABLE"),
                "{details}"
            );
        }
    }

    #[test]
    fn statuses_carry_code_reason_and_field() {
        let s = Status::from(Error::invalid("open.name", "must not be empty"));
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(s.message(), "open.name: must not be empty");
        let info = s.get_details_error_info().unwrap();
        assert_eq!(info.reason, "INVALID_ARGUMENT");
        assert_eq!(info.metadata["field"], "open.name");

        let s = Status::from(Error::WaitTimeout { name: "a".into() });
        assert_eq!(s.code(), Code::DeadlineExceeded);
        assert!(s.message().contains("\"a\""));
    }
}
