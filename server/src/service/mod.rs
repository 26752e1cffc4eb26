//! The gRPC edge: `LockService` validates, delegates to the domain core and converts.

mod acquire;
mod admin;
pub mod convert;
pub mod edge;
pub mod validate;
mod watch;

pub use acquire::SessionStream;

use crate::auth::{Action, Auth, Caller, Standing};
use crate::error::Error;
use crate::hub::Hub;
use crate::keys::LockKeys;
use crate::limits::Limits;
use crate::lock::Locks;
use crate::serve::Peer;
use crate::watchdog::Watchdog;
use latchkey_proto::v1::lock_service_server::LockService as LockServiceApi;
use latchkey_proto::v1::{
    AcquireRequest, DescribeRequest, ForceReleaseRequest, ForceReleaseResponse, ListRequest, ListResponse, LockState,
    WatchRequest,
};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::Semaphore;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, Streaming};

/// What every RPC shares.
#[derive(Debug)]
pub struct Shared {
    /// Lock operations.
    pub locks: Locks,
    /// The pub/sub hub of the main Redis.
    pub hub: Hub,
    /// The pub/sub hub of the RedLock deployments, when configured.
    pub redlock_hub: Option<Hub>,
    /// The lease registry and renewal scheduler.
    pub watchdog: Watchdog,
    /// Cancelled when the server starts shutting down.
    pub shutdown: CancellationToken,
    /// Every session task, so shutdown can wait for their releases.
    pub sessions: TaskTracker,
    /// Bounds the concurrent Acquire and Watch streams (`--max-streams`).
    pub streams: Arc<Semaphore>,
    /// The auth file, with `--auth-file`: every RPC needs an authenticated [`Caller`],
    /// and a reload is heard by the streams open (each [`crate::auth::Standing`]).
    pub auth: Option<Arc<Auth>>,
    /// Bounds streams per connection and waiters.
    pub limits: Limits,
    /// Bounds the List calls running at once ([`admin::MAX_LISTINGS`]).
    pub listings: Semaphore,
    /// The readers of the locks Watch streams follow.
    watched: watch::Readers,
    next_stream: AtomicU64,
}

impl Shared {
    /// Shared state; `limits` bounds the streams (of the server and of one
    /// connection) and the waiters.
    pub fn new(
        locks: Locks,
        hub: Hub,
        redlock_hub: Option<Hub>,
        watchdog: Watchdog,
        shutdown: CancellationToken,
        auth: Option<Arc<Auth>>,
        limits: Limits,
    ) -> Self {
        Self {
            locks,
            hub,
            redlock_hub,
            watchdog,
            shutdown,
            sessions: TaskTracker::new(),
            streams: Arc::new(Semaphore::new(limits.bounds().streams)),
            auth,
            limits,
            listings: Semaphore::new(admin::MAX_LISTINGS),
            watched: watch::Readers::default(),
            next_stream: AtomicU64::new(1),
        }
    }

    /// The hub a waiter of `req` listens on: a RedLock's nodes have their own.
    pub fn hub_for(&self, req: &crate::lock::Request) -> &Hub {
        match &self.redlock_hub {
            Some(hub) if req.redlock => hub,
            _ => &self.hub,
        }
    }

    /// A place for one more Acquire or Watch stream, or RESOURCE_EXHAUSTED naming the
    /// flag that bounds them.
    pub fn stream_place(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Error> {
        self.streams.clone().try_acquire_owned().map_err(|_| {
            let max = self.limits.bounds().streams;
            Error::ResourceExhausted(format!(
                "this server holds its maximum of {max} Acquire and Watch streams (--max-streams)"
            ))
        })
    }

    /// The caller of `req` (UNAUTHENTICATED when auth is on and nobody was found).
    pub fn caller<T>(&self, req: &Request<T>) -> Result<Caller, Error> {
        Caller::of(req, self.auth.is_some())
    }

    /// The keys of the lock `name` (the request's `name` field), if `caller` may take
    /// `action` on it. The name is checked first: bad input is named as such, whoever
    /// asks.
    pub fn lock_for(&self, name: &str, caller: &Caller, action: Action) -> Result<LockKeys, Error> {
        let keys = validate::lock_name("name", name, self.locks.backend().keys())?;
        caller.check(action, name)?;
        Ok(keys)
    }

    /// A process-unique id in Redisson's `<id>:<n>` shape, one per stream: the server's
    /// id (which starts with [`SERVER_ID_PREFIX`]) and a count.
    pub fn fresh_id(&self) -> String {
        format!(
            "{}:{}",
            self.hub.server_id(),
            self.next_stream.fetch_add(1, Ordering::Relaxed)
        )
    }
}

/// What every server id starts with, and so every id a server makes for a stream (its
/// hold id, and its owner when the client gives none). A client may not give an owner
/// of this form (`validate::open`), so no other stream can reenter the hold of a
/// stream that gave no owner: passing a lock in memory (`lock/relay.rs`) relies on it.
pub const SERVER_ID_PREFIX: &str = "latchkey-";

/// A new server id: [`SERVER_ID_PREFIX`] and a random UUID.
pub fn new_server_id() -> String {
    format!("{SERVER_ID_PREFIX}{}", uuid::Uuid::new_v4())
}

/// The `latchkey.v1.LockService` implementation.
#[derive(Debug, Clone)]
pub struct LockService {
    shared: Arc<Shared>,
}

impl LockService {
    /// The service over `shared`.
    pub fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }
}

/// A Watch stream's states, then the status it ends with.
pub(super) type StateStream = Pin<Box<dyn Stream<Item = Result<LockState, Status>> + Send>>;

#[tonic::async_trait]
impl LockServiceApi for LockService {
    type AcquireStream = SessionStream;
    type WatchStream = StateStream;

    async fn acquire(&self, req: Request<Streaming<AcquireRequest>>) -> Result<Response<SessionStream>, Status> {
        crate::metrics::rpc_started("Acquire");
        let mut session = self.open_session(req).map_err(|e| refused("Acquire", e))?;
        // The response headers leave with the first event (queued or acquired), in one
        // write instead of two; a stream that fails before any event is answered with
        // its status alone (the session records it).
        session.first_event().await?;
        Ok(Response::new(session))
    }

    async fn describe(&self, req: Request<DescribeRequest>) -> Result<Response<LockState>, Status> {
        let caller = self.shared.caller(&req);
        admin::unary("Describe", async {
            admin::describe(&self.shared, req.into_inner(), &caller?).await
        })
        .await
    }

    async fn list(&self, req: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        let caller = self.shared.caller(&req);
        admin::unary("List", async {
            admin::list(&self.shared, req.into_inner(), &caller?).await
        })
        .await
    }

    async fn force_release(&self, req: Request<ForceReleaseRequest>) -> Result<Response<ForceReleaseResponse>, Status> {
        let caller = self.shared.caller(&req);
        admin::unary("ForceRelease", async {
            admin::force_release(&self.shared, req.into_inner(), &caller?).await
        })
        .await
    }

    async fn watch(&self, req: Request<WatchRequest>) -> Result<Response<StateStream>, Status> {
        crate::metrics::rpc_started("Watch");
        let states = self.start_watch(req).map_err(|e| refused("Watch", e))?;
        Ok(Response::new(states))
    }
}

impl LockService {
    /// An Acquire stream's session, or why the stream is refused before it starts.
    fn open_session(&self, req: Request<Streaming<AcquireRequest>>) -> Result<SessionStream, Error> {
        // Before the bounds: a full server going away says so, and its client tries
        // another replica. (A shutdown that begins after this is heard in `read_open`.)
        if self.shared.shutdown.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        let permit = self.shared.stream_place()?;
        let connection = self.shared.limits.stream(Peer::of(&req))?;
        let caller = self.shared.caller(&req)?;
        let deadline = edge::grpc_timeout(req.metadata()).and_then(|t| tokio::time::Instant::now().checked_add(t));
        let standing = Standing::new(self.shared.auth.as_deref(), &caller, Peer::of(&req).map(|p| &p.cut));
        Ok(SessionStream::new(
            self.shared.clone(),
            caller,
            standing,
            req.into_inner(),
            deadline,
            permit,
            connection,
        ))
    }

    /// A Watch stream's states (its task records how it ends), or why it is refused: a
    /// bad name or a name the caller may not inspect before the stream limits, as every
    /// other method answers a bad argument before anything else.
    fn start_watch(&self, req: Request<WatchRequest>) -> Result<StateStream, Error> {
        if self.shared.shutdown.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        let caller = self.shared.caller(&req)?;
        let keys = self.shared.lock_for(&req.get_ref().name, &caller, Action::Inspect)?;
        let places = (self.shared.stream_place()?, self.shared.limits.stream(Peer::of(&req))?);
        Ok(watch::start(self.shared.clone(), keys, &caller, places))
    }
}

/// A stream refused before it started, counted in `latchkey_rpc_handled_total` as
/// every RPC that started is (a started stream records its own end).
fn refused(method: &'static str, e: Error) -> Status {
    let status = Status::from(e);
    crate::metrics::rpc_handled(method, status.code());
    status
}
