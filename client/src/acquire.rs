//! One `Acquire` request: [`LockBuilder`] collects the `Open` options, opens the
//! stream, skips `Queued` and hands the stream to a [`Lease`] on `Acquired`.

use std::fmt;
use std::time::Duration;

use latchkey_proto::v1::{
    acquire_request::Action, acquire_response::Event, AcquireRequest, AcquireResponse, Acquired, LockKind, Open, Queued,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::{Error, Lease, LostReason};

/// Called with each `Queued` event while a request waits.
type QueuedCallback = Box<dyn FnMut(&Queued) + Send>;

/// Options for one `Acquire` request, from [`Client::lock`](crate::Client::lock).
pub struct LockBuilder {
    client: crate::Inner,
    names: Vec<String>,
    /// From `lock_all`: the lease has one fencing token per name, also for a list of
    /// one name (sent as a plain lock, whose grant carries no list of tokens).
    multi: bool,
    open: Open,
    /// Whether `owner` and `permits` were given: `open` cannot tell `""` and `0` from
    /// unset (proto3 sends neither), so `acquire` refuses them by these (a builder does
    /// not panic).
    owner_given: bool,
    permits_given: bool,
    on_queued: Option<QueuedCallback>,
}

impl fmt::Debug for LockBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockBuilder")
            .field("names", &self.names)
            .field("open", &self.open)
            .field("on_queued", &self.on_queued.is_some())
            .finish()
    }
}

impl LockBuilder {
    pub(crate) fn new(client: crate::Inner, names: Vec<String>, multi: bool) -> Self {
        let open = match names.as_slice() {
            [name] => Open {
                name: name.clone(),
                ..Open::default()
            },
            _ => Open {
                names: names.clone(),
                ..Open::default()
            },
        };
        LockBuilder {
            client,
            names,
            multi,
            open,
            owner_given: false,
            permits_given: false,
            on_queued: None,
        }
    }

    /// The kind of lock. Default: [`LockKind::Mutex`] (reentrant, non-fair).
    pub fn kind(mut self, kind: LockKind) -> Self {
        self.open.kind = kind as i32;
        self
    }

    /// Waits at most `wait` for the lock, then fails with `DEADLINE_EXCEEDED`
    /// ([`Error::is_timeout`]). Default: wait until acquired.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.open.wait_timeout = Some(to_proto(wait));
        self
    }

    /// Tries once and fails at once if the lock is taken (a zero wait).
    /// Default: wait until acquired.
    pub fn try_once(self) -> Self {
        self.wait(Duration::ZERO)
    }

    /// A fixed lease: the lock expires after `lease` even if the [`Lease`] is
    /// kept, and [`Lease::lost`] resolves with [`LostReason::LeaseExpired`].
    /// Default: the lock is held as long as the `Lease`, renewed by the
    /// server's watchdog.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.open.lease = Some(to_proto(lease));
        self
    }

    /// The reentrancy identity: requests with the same owner hold the lock
    /// together (hold count > 1). Default: a fresh id made by the server.
    /// An empty one fails [`acquire`](Self::acquire) with [`Error::InvalidRequest`]:
    /// it would go out unset, and reentrancy silently off (an unset variable's `""`).
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.open.owner = owner.into();
        self.owner_given = true;
        self
    }

    /// Semaphore only: how many permits to take. Default: 1.
    /// 0 fails [`acquire`](Self::acquire) with [`Error::InvalidRequest`]: it would go
    /// out unset, and take 1 permit (on a mutex, pass where 1 is refused).
    pub fn permits(mut self, permits: u32) -> Self {
        self.open.permits = permits;
        self.permits_given = true;
        self
    }

    /// Semaphore only: the semaphore's number of permits; must match a live
    /// semaphore of the same name. Required for a semaphore (the server refuses 0).
    pub fn limit(mut self, limit: u32) -> Self {
        self.open.limit = limit;
        self
    }

    /// Takes the lock on the server's RedLock deployments with a majority
    /// quorum. Default: false (the main Redis).
    pub fn redlock(mut self, redlock: bool) -> Self {
        self.open.redlock = redlock;
        self
    }

    /// Calls `f` when the server says the request has to wait. Default: none.
    pub fn on_queued(mut self, f: impl FnMut(&Queued) + Send + 'static) -> Self {
        self.on_queued = Some(Box::new(f));
        self
    }

    /// Opens the `Acquire` stream and waits until the lock is granted.
    ///
    /// Fails with the server's status: `DEADLINE_EXCEEDED` when the wait ran
    /// out, `INVALID_ARGUMENT`, `FAILED_PRECONDITION`, `UNAVAILABLE`, …; with
    /// [`Error::InvalidRequest`] before any call for an argument that cannot be sent.
    pub async fn acquire(mut self) -> Result<Lease, Error> {
        self.check()?;
        let asked = tokio::time::Instant::now();
        let (requests, rx) = mpsc::channel(4);
        let open = AcquireRequest {
            action: Some(Action::Open(self.open.clone())),
        };
        // The channel is new and has room, so this cannot fail.
        let _ = requests.try_send(open);
        let mut inner = self.client.clone();
        let mut responses = inner.acquire(ReceiverStream::new(rx)).await?.into_inner();
        let mut acquired = self.wait_acquired(&mut responses).await?;
        if self.multi && acquired.fencing_tokens.is_empty() {
            acquired.fencing_tokens.push(acquired.fencing_token);
        }
        let ends = self.fixed_lease_end(asked, &acquired);
        Ok(Lease::start(self.names, acquired, requests, responses, ends))
    }

    /// The arguments given that would go out unset, and be read as the default.
    fn check(&self) -> Result<(), Error> {
        let refused = |field, reason| Err(Error::InvalidRequest { field, reason });
        if self.owner_given && self.open.owner.is_empty() {
            return refused("owner", "must not be empty (unset: a fresh owner per stream)");
        }
        if self.permits_given && self.open.permits == 0 {
            return refused("permits", "must be at least 1 (unset: 1)");
        }
        Ok(())
    }

    /// When a fixed lease asked for at `asked` has ended in Redis at the latest: its
    /// holder is told then even if the server's `lost` cannot reach it (a silent
    /// partition). The server counts the lease from its try, `waited` after it read the
    /// request, so after `asked + waited`; `acquired.lease` is how long it lasts from
    /// there, less than asked for by what the server takes off its end.
    fn fixed_lease_end(&self, asked: tokio::time::Instant, acquired: &Acquired) -> Option<tokio::time::Instant> {
        let asked_for = duration_from_proto(&self.open.lease?)?;
        let granted = acquired
            .lease
            .and_then(|l| duration_from_proto(&l))
            .unwrap_or(asked_for);
        // A server older than `acquired.lease`'s shortening sends the lease asked for: a
        // RedLock grant is never longer than its validity (the drift allowed, 1% plus
        // 2 ms, taken off).
        let lease = match self.open.redlock {
            true => granted.min(asked_for.saturating_sub(asked_for / 100 + Duration::from_millis(2))),
            false => granted,
        };
        let waited = acquired
            .waited
            .and_then(|w| duration_from_proto(&w))
            .unwrap_or_default();
        asked.checked_add(waited)?.checked_add(lease)
    }

    async fn wait_acquired(&mut self, responses: &mut Streaming<AcquireResponse>) -> Result<Acquired, Error> {
        loop {
            let response = responses
                .message()
                .await?
                .ok_or_else(|| Error::Protocol("the server ended the stream before granting the lock".into()))?;
            match response.event {
                Some(Event::Acquired(acquired)) => return Ok(acquired),
                Some(Event::Queued(queued)) => {
                    if let Some(f) = self.on_queued.as_mut() {
                        f(&queued);
                    }
                }
                Some(Event::Lost(lost)) => return Err(Error::Lost(LostReason::from_proto(lost.reason))),
                Some(Event::Released(_)) => return Err(Error::Protocol("unexpected event before acquired".into())),
                // An event this client does not know (a newer server's), skipped as it
                // is once the lock is held.
                None => {}
            }
        }
    }
}

/// A proto duration from the server as a std one; `None` for a negative one, which no
/// server sends. prost-types' conversion negates a negative one's seconds, which
/// overflows for the least `i64` (a panic where overflow is checked).
pub fn duration_from_proto(d: &prost_types::Duration) -> Option<Duration> {
    if d.seconds < 0 || d.nanos < 0 {
        return None;
    }
    Duration::try_from(*d).ok()
}

/// Converts to a proto duration, saturating at the largest representable one.
fn to_proto(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        // Below one billion, so it fits.
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Client, DEFAULT_SERVER};

    /// A negative duration (the least `i64` seconds overflowed prost-types' negation,
    /// a panic where overflow is checked) reads as none.
    #[test]
    fn a_negative_proto_duration_reads_as_none() {
        for seconds in [i64::MIN, -1] {
            assert_eq!(duration_from_proto(&prost_types::Duration { seconds, nanos: 0 }), None);
        }
        assert_eq!(
            duration_from_proto(&prost_types::Duration { seconds: 0, nanos: -1 }),
            None
        );
        let d = prost_types::Duration { seconds: 2, nanos: 5 };
        assert_eq!(duration_from_proto(&d), Some(Duration::new(2, 5)));
    }

    #[tokio::test]
    async fn builder_defaults_leave_open_unset() {
        let client = Client::connect_lazy(DEFAULT_SERVER).expect("valid target");
        let open = client.lock("a").open;
        assert_eq!(open.name, "a");
        assert_eq!(open.kind, LockKind::Unspecified as i32);
        assert!(open.wait_timeout.is_none(), "default waits forever");
        assert!(open.lease.is_none(), "default is a watchdog lease");
        assert!(open.owner.is_empty() && open.names.is_empty());
    }

    #[tokio::test]
    async fn builder_sets_every_option() {
        let client = Client::connect_lazy(DEFAULT_SERVER).expect("valid target");
        let open = client
            .lock("s")
            .kind(LockKind::Semaphore)
            .try_once()
            .lease(Duration::from_millis(1500))
            .owner("me")
            .permits(2)
            .limit(5)
            .open;
        assert_eq!(open.kind, LockKind::Semaphore as i32);
        assert_eq!(open.wait_timeout, Some(prost_types::Duration::default()));
        let lease = open.lease.expect("lease set");
        assert_eq!((lease.seconds, lease.nanos), (1, 500_000_000));
        assert_eq!((open.owner.as_str(), open.permits, open.limit), ("me", 2, 5));
    }

    /// proto3 sends neither 0 nor "": `permits(0)` took 1 permit (and passed on a mutex,
    /// where `permits(1)` is refused), `owner("")` a fresh owner per stream, so that two
    /// streams meant to share an owner waited on each other. Both are refused before any
    /// call (nothing listens at the address), with the field named; the last value given
    /// counts.
    #[tokio::test]
    async fn zero_permits_and_an_empty_owner_are_refused_before_any_call() {
        let client = Client::connect_lazy("http://127.0.0.1:1").expect("valid target");
        for (builder, field) in [
            (client.lock("m").permits(0), "permits"),
            (
                client.lock("s").kind(LockKind::Semaphore).limit(2).permits(0),
                "permits",
            ),
            (client.lock("m").owner(""), "owner"),
            (client.lock("m").owner(String::new()), "owner"),
        ] {
            let err = builder.acquire().await.expect_err("refused");
            assert!(
                matches!(err, Error::InvalidRequest { field: f, .. } if f == field),
                "{err:?}"
            );
            assert_eq!(err.code(), tonic::Code::InvalidArgument);
            assert!(err.to_string().starts_with(&format!("{field} must ")), "{err}");
        }
        let err = client.lock("m").owner("").acquire().await.expect_err("refused");
        assert_eq!(
            err.to_string(),
            "owner must not be empty (unset: a fresh owner per stream)"
        );
        let err = client.lock("m").permits(0).acquire().await.expect_err("refused");
        assert_eq!(err.to_string(), "permits must be at least 1 (unset: 1)");
        // A valid value given last stands; the call then goes out (and finds no server).
        let err = client
            .lock("m")
            .permits(0)
            .permits(1)
            .owner("")
            .owner("me")
            .try_once()
            .acquire()
            .await;
        assert!(err.expect_err("no server").is_unavailable());
    }

    #[tokio::test]
    async fn multi_lock_uses_names() {
        let client = Client::connect_lazy(DEFAULT_SERVER).expect("valid target");
        let open = client.lock_all(["a", "b"]).open;
        assert!(open.name.is_empty());
        assert_eq!(open.names, ["a", "b"]);
    }

    #[test]
    fn huge_durations_saturate() {
        assert_eq!(to_proto(Duration::MAX).seconds, i64::MAX);
    }
}
