//! An in-process latchkey server on a free loopback port, for tests that need many
//! servers cheaply; crash tests use [`crate::LatchkeyProcess`] instead.

use latchkey_client::ConnectOptions;
use latchkey_proto::v1::lock_service_client::LockServiceClient;
use latchkey_proto::v1::{acquire_request::Action, AcquireRequest, AcquireResponse, Open, Release};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// How long a test waits for a server to report SERVING.
pub const SERVING_TIMEOUT: Duration = Duration::from_secs(15);

/// The flags of a server whose renewals count once one replica has them
/// (`--sync-replicas`), with the shortest `--watchdog-timeout` a 300 ms
/// `--sync-timeout` allows: an unacknowledged lease is told lost within seconds.
pub const SYNCED_RENEWALS: [&str; 6] = [
    "--sync-replicas",
    "1",
    "--sync-timeout",
    "300ms",
    "--watchdog-timeout",
    "12s",
];

/// A latchkey server running inside the test process.
#[derive(Debug)]
pub struct Latchkey {
    server: Option<latchkey_server::Server>,
    endpoint: String,
    /// TLS and credentials of the harness's own calls (health, [`Latchkey::client`]).
    options: ConnectOptions,
}

impl Latchkey {
    /// A server on `redis_url` with default settings, once it is SERVING.
    pub async fn start(redis_url: &str) -> Latchkey {
        Self::start_with(redis_url, &[]).await
    }

    /// A server on `redis_url` with extra flags, once it is SERVING.
    pub async fn start_with(redis_url: &str, args: &[&str]) -> Latchkey {
        Self::start_secure(redis_url, args, ConnectOptions::new()).await
    }

    /// A server on `redis_url` with extra flags (TLS, auth), reached with `options`
    /// (`https://` when they carry a CA), once it is SERVING.
    pub async fn start_secure(redis_url: &str, args: &[&str], options: ConnectOptions) -> Latchkey {
        let me = Self::launch(redis_url, args, options).await;
        me.wait_health(ServingStatus::Serving, SERVING_TIMEOUT).await;
        me
    }

    /// A server on `redis_url` with extra flags, as soon as it listens (SERVING or not).
    pub async fn launch(redis_url: &str, args: &[&str], options: ConnectOptions) -> Latchkey {
        // Server logs go to the test's captured output (shown when it fails).
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
            .with_test_writer()
            .try_init();
        let mut argv = vec!["--listen", "127.0.0.1:0", "--no-metrics", "--redis-url", redis_url];
        argv.extend_from_slice(args);
        let config = latchkey_server::config::Config::from_args(argv).expect("test flags parse");
        let server = latchkey_server::Server::start(config).await.expect("server starts");
        let scheme = if options.uses_tls() { "https" } else { "http" };
        let endpoint = format!("{scheme}://{}", server.local_addr());
        Latchkey {
            server: Some(server),
            endpoint,
            options,
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// A connected client library handle (with the harness's TLS and credentials).
    pub async fn client(&self) -> latchkey_client::Client {
        self.client_with(&self.options).await.expect("client connects")
    }

    /// A client library handle with other TLS settings or credentials.
    pub async fn client_with(
        &self,
        options: &ConnectOptions,
    ) -> Result<latchkey_client::Client, latchkey_client::Error> {
        latchkey_client::Client::connect_with(&self.endpoint, options).await
    }

    /// A connection of its own to the server, for a generated client of any service.
    pub async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(self.endpoint.clone())
            .expect("endpoint")
            .connect()
            .await
            .expect("connects")
    }

    /// A connected generated client, for protocol-level tests.
    pub async fn raw(&self) -> LockServiceClient<Channel> {
        LockServiceClient::new(self.channel().await)
    }

    /// The overall health status.
    pub async fn health(&self) -> Option<ServingStatus> {
        let channel = self.options.endpoint(&self.endpoint).ok()?.connect().await.ok()?;
        let mut health = HealthClient::new(channel);
        let reply = health.check(HealthCheckRequest { service: String::new() }).await.ok()?;
        ServingStatus::try_from(reply.into_inner().status).ok()
    }

    /// Checks for `limit` (some health checks, one a second) that health reads
    /// NOT_SERVING, and never SERVING: `why` names what keeps every grant from
    /// succeeding.
    pub async fn never_serving(&self, limit: Duration, why: &str) {
        let deadline = tokio::time::Instant::now() + limit;
        let mut answered = false;
        while tokio::time::Instant::now() < deadline {
            let health = self.health().await;
            assert_ne!(health, Some(ServingStatus::Serving), "{why}");
            answered |= health == Some(ServingStatus::NotServing);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(answered, "health answered NOT_SERVING");
    }

    /// Waits (bounded) until health reports `want`; panics otherwise.
    pub async fn wait_health(&self, want: ServingStatus, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while self.health().await != Some(want) {
            assert!(tokio::time::Instant::now() < deadline, "health never became {want:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Graceful shutdown.
    pub async fn stop(mut self) {
        if let Some(server) = self.server.take() {
            server.stop().await.expect("graceful stop");
        }
    }
}

/// An open raw `Acquire` stream: the request sender and the response stream.
#[derive(Debug)]
pub struct RawStream {
    /// Requests to the server; drop it to half-close.
    pub tx: Option<mpsc::Sender<AcquireRequest>>,
    /// Events from the server, once its response headers came.
    rx: Answer,
}

/// The server answers an `Acquire` with its first event (or only a status): the call
/// runs in a task until then, so requests can be sent meanwhile.
#[derive(Debug)]
enum Answer {
    Pending(tokio::task::JoinHandle<Result<tonic::Response<Streaming<AcquireResponse>>, tonic::Status>>),
    Streaming(Box<Streaming<AcquireResponse>>),
    Ended,
}

impl RawStream {
    /// Opens an `Acquire` stream and sends `open` first (unless `None`).
    pub async fn open(client: &mut LockServiceClient<Channel>, open: Option<Open>) -> RawStream {
        let (tx, rx) = mpsc::channel(8);
        if let Some(open) = open {
            tx.send(AcquireRequest {
                action: Some(Action::Open(open)),
            })
            .await
            .expect("queue open");
        }
        let mut client = client.clone();
        let call = tokio::spawn(async move { client.acquire(ReceiverStream::new(rx)).await });
        RawStream {
            tx: Some(tx),
            rx: Answer::Pending(call),
        }
    }

    /// Sends one action.
    pub async fn send(&self, action: Action) {
        if let Some(tx) = &self.tx {
            tx.send(AcquireRequest { action: Some(action) }).await.expect("send");
        }
    }

    /// Sends `release`.
    pub async fn release(&self) {
        self.send(Action::Release(Release {})).await;
    }

    /// Half-closes the request side.
    pub fn half_close(&mut self) {
        self.tx = None;
    }

    /// The next event or status, waiting at most `limit`.
    pub async fn next(&mut self, limit: Duration) -> Result<Option<AcquireResponse>, tonic::Status> {
        tokio::time::timeout(limit, self.read())
            .await
            .expect("stream answered in time")
    }

    async fn read(&mut self) -> Result<Option<AcquireResponse>, tonic::Status> {
        if let Answer::Pending(call) = &mut self.rx {
            match call.await.expect("the call task") {
                Ok(response) => self.rx = Answer::Streaming(Box::new(response.into_inner())),
                Err(status) => {
                    self.rx = Answer::Ended;
                    return Err(status);
                }
            }
        }
        match &mut self.rx {
            Answer::Streaming(events) => events.message().await,
            _ => Ok(None),
        }
    }
}

impl Drop for RawStream {
    /// Dropping the stream cancels the call, answered or not.
    fn drop(&mut self) {
        if let Answer::Pending(call) = &self.rx {
            call.abort();
        }
    }
}

/// An `Open` for `name` with every other field at its default.
pub fn open(name: &str) -> Open {
    Open {
        name: name.to_owned(),
        ..Default::default()
    }
}

/// A proto duration.
pub fn pd(d: Duration) -> prost_types::Duration {
    prost_types::Duration::try_from(d).expect("duration fits")
}

/// The next state of `watch`, within `limit`; panics when none came or the stream
/// ended.
pub async fn next_state(watch: &mut latchkey_client::LockWatch, limit: Duration) -> latchkey_proto::v1::LockState {
    tokio::time::timeout(limit, watch.next())
        .await
        .unwrap_or_else(|_| panic!("no state within {limit:?}"))
        .expect("stream ok")
        .expect("stream open")
}

/// Reads `watch` until a state satisfies `want`, within `limit` in all.
pub async fn watch_until(
    watch: &mut latchkey_client::LockWatch,
    limit: Duration,
    want: impl Fn(&latchkey_proto::v1::LockState) -> bool,
) -> latchkey_proto::v1::LockState {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let state = next_state(watch, deadline.saturating_duration_since(tokio::time::Instant::now())).await;
        if want(&state) {
            return state;
        }
    }
}

/// Waits (bounded) until `name` has `n` claims in Redis (waiters of servers that leave
/// one for a release to grant).
pub async fn claims_reach(redis: &crate::RedisServer, name: &str, n: usize) {
    let key = format!("latchkey_claims:{{{name}}}");
    let reached = crate::poll_until(Duration::from_secs(10), || {
        redis.cli(&["ZCARD", &key]).trim() == n.to_string()
    })
    .await;
    if !reached {
        let claims = redis.cli(&["ZRANGE", &key, "0", "-1"]);
        panic!("{n} claims on {name}; there are: {claims}");
    }
}

/// Lua that grants the first claim (in `KEYS[2]`, the claims of lock `KEYS[1]`) as
/// another server's release does (grant_claim in lib.lua), the fencing counter
/// `KEYS[3]`, hold records under `ARGV[1]`; a script goes on from it with `hold_id`,
/// `token`, `owner` and `lease` in scope, and returns [`GRANTED_MESSAGE`] to publish
/// it when the test chooses.
pub const GRANT_FIRST_CLAIM: &str = r"
    local claim = redis.call('zrange', KEYS[2], 0, 0)[1]
    local hold_id, lease, grace, owner = string.match(claim, '^([^\n]*)\n(%d+)\n(%d+)\n(.*)$')
    redis.call('zrem', KEYS[2], claim)
    local token = redis.call('incr', KEYS[3])
    redis.call('del', KEYS[1])
    redis.call('hset', KEYS[1], owner, 1)
    redis.call('pexpire', KEYS[1], lease)
    redis.call('set', ARGV[1] .. hold_id, token, 'px', lease + grace)
";

/// The end of a script that began with [`GRANT_FIRST_CLAIM`]: the grant's message.
pub const GRANTED_MESSAGE: &str = r"
    return 'latchkey:granted\n' .. hold_id .. '\n' .. token .. '\n' .. KEYS[1] .. '\n' .. owner .. '\n' .. lease
";

/// A lock request running in its own task, started by [`spawn_queued`].
pub type Waiting = tokio::task::JoinHandle<Result<latchkey_client::Lease, latchkey_client::Error>>;

/// Takes `name` and releases it: a lock cycle, as a warm-up (scripts loaded,
/// connections made) or a check that the name is free.
pub async fn cycle(client: &latchkey_client::Client, name: &str) {
    let lease = client.lock(name).acquire().await.expect("acquires");
    lease.release().await.expect("releases");
}

/// Awaits `waiters` as they are granted, whichever comes first, each released at once,
/// none more than `within` after the one before; panics on any failure.
pub async fn each_granted(waiters: Vec<Waiting>, within: Duration) {
    each_granted_then(waiters, within, || async {}).await
}

/// [`each_granted`], each lease released only once `held` (a check or a hold while it
/// is held) is done.
pub async fn each_granted_then<F, H>(mut waiters: Vec<Waiting>, within: Duration, mut held: F)
where
    F: FnMut() -> H,
    H: std::future::Future<Output = ()>,
{
    while !waiters.is_empty() {
        let next = futures::future::select_all(waiters);
        let (granted, _, rest) = crate::bounded(within, "the next waiter", next).await;
        let lease = granted.expect("waiter task").expect("granted in turn");
        held().await;
        lease.release().await.expect("released");
        waiters = rest;
    }
}

/// Holds a lease of every kind on `client`, each on a name of its own under `prefix`,
/// and `semaphores` semaphores (enough that one often comes first in a renewal batch).
pub async fn a_lease_of_every_kind(
    client: &latchkey_client::Client,
    prefix: &str,
    semaphores: usize,
) -> Vec<latchkey_client::Lease> {
    use latchkey_client::LockKind;
    let mut leases = Vec::new();
    for kind in [LockKind::Mutex, LockKind::Fair, LockKind::Read, LockKind::Write] {
        let lock = client.lock(format!("{prefix}{kind:?}")).kind(kind);
        leases.push(lock.acquire().await.expect("granted"));
    }
    for i in 0..semaphores {
        let semaphore = client
            .lock(format!("{prefix}semaphore/{i}"))
            .kind(LockKind::Semaphore)
            .limit(2);
        leases.push(semaphore.acquire().await.expect("granted"));
    }
    leases
}

/// A generated client on a connection of its own to `endpoint` whose HTTP/2 windows
/// stay at the protocol's default (64 KiB), never grown: a client that stops reading
/// leaves the server no send window on it soon (see [`fill_window`]).
pub async fn small_window_client(endpoint: &str) -> LockServiceClient<Channel> {
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .expect("endpoint")
        .initial_connection_window_size(65_535)
        .initial_stream_window_size(65_535)
        .connect()
        .await
        .expect("small-window client connects");
    LockServiceClient::new(channel)
}

/// Opens a Watch of `watched` on `far` (a [`small_window_client`]) that is never read,
/// while `near` (another client) keeps changing that lock with 1 000-byte owners until
/// its states used up the connection's window: the server can send nothing more on
/// `far`'s connection. The Watch is returned to be kept.
pub async fn fill_window(
    far: &mut LockServiceClient<Channel>,
    near: &latchkey_client::Client,
    watched: &str,
) -> Streaming<latchkey_proto::v1::LockState> {
    let request = latchkey_proto::v1::WatchRequest {
        name: watched.to_owned(),
    };
    let watch = far.watch(request).await.expect("watch").into_inner();
    let owner = "o".repeat(1000);
    for _ in 0..150 {
        let lock = near.lock(watched.to_owned()).owner(owner.clone());
        lock.acquire()
            .await
            .expect("granted")
            .release()
            .await
            .expect("released");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    watch
}

/// A health Watch (the overall status) on a connection of its own to `endpoint`.
pub async fn health_watch(endpoint: &str) -> Streaming<tonic_health::pb::HealthCheckResponse> {
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .expect("endpoint")
        .connect()
        .await
        .expect("health client connects");
    let request = HealthCheckRequest { service: String::new() };
    HealthClient::new(channel)
        .watch(request)
        .await
        .expect("health watch")
        .into_inner()
}

/// A request for `permits` of `name`, a semaphore of `limit`.
pub fn semaphore(
    client: &latchkey_client::Client,
    name: &str,
    limit: u32,
    permits: u32,
) -> latchkey_client::LockBuilder {
    client
        .lock(name)
        .kind(latchkey_client::LockKind::Semaphore)
        .limit(limit)
        .permits(permits)
}

/// Starts `lock` (a request that waits) in a task and returns once the server has
/// told it `queued`, with that event; panics if that takes longer than `within`.
pub async fn spawn_queued(
    lock: latchkey_client::LockBuilder,
    within: Duration,
) -> (Waiting, latchkey_proto::v1::Queued) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut tx = Some(tx);
    let lock = lock.on_queued(move |q| {
        if let Some(tx) = tx.take() {
            let _ = tx.send(*q);
        }
    });
    let task = tokio::spawn(lock.acquire());
    let queued = tokio::time::timeout(within, rx)
        .await
        .expect("queued in time")
        .expect("a Queued event before the request ended");
    (task, queued)
}

/// The grants of one name in the order they were made, each token with what granted it,
/// shared by the tasks that take the name in turn.
#[derive(Debug, Clone, Default)]
pub struct Grants(std::sync::Arc<std::sync::Mutex<Vec<(u64, String)>>>);

impl Grants {
    /// Records a grant's `token`, while its lease is held (so in grant order).
    pub fn record(&self, token: u64, what: String) {
        self.0.lock().expect("grants").push((token, what));
    }

    /// Panics unless every grant's token is larger than the one before.
    pub fn assert_increasing(&self) {
        let grants = self.0.lock().expect("grants");
        for w in grants.windows(2) {
            assert!(w[1].0 > w[0].0, "token went down: {:?} then {:?}", w[0], w[1]);
        }
    }
}

/// Starts a fair waiter on `name` as `owner` (its stream's own when `None`) that waits
/// up to a minute and keeps its lease once granted; returns its task, which yields the
/// lease, once the waiter is queued (bounded by 10 s).
pub async fn holding_fair_waiter(
    client: &latchkey_client::Client,
    name: &str,
    owner: Option<&str>,
) -> tokio::task::JoinHandle<latchkey_client::Lease> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut tx = Some(tx);
    let mut lock = client
        .lock(name)
        .kind(latchkey_client::LockKind::Fair)
        .wait(Duration::from_secs(60));
    if let Some(owner) = owner {
        lock = lock.owner(owner);
    }
    let lock = lock.on_queued(move |_| {
        if let Some(tx) = tx.take() {
            let _ = tx.send(());
        }
    });
    let task = tokio::spawn(async move { lock.acquire().await.expect("a holding waiter acquires") });
    tokio::time::timeout(Duration::from_secs(10), rx)
        .await
        .expect("the waiter is queued in time")
        .expect("the waiter got a Queued event");
    task
}

/// An Acquire stream to `endpoint` that sent `open` (with `token` as its bearer token), on a
/// connection of its own that gives the server no HTTP/2 flow-control credit: the
/// server can send it nothing but headers, and HTTP/2 then polls its response no
/// more (a client that stopped reading). Returned once the headers came; the stream
/// lasts while both halves are kept.
pub async fn uncredited(
    endpoint: &str,
    open: Open,
    token: Option<&str>,
) -> (mpsc::Sender<AcquireRequest>, Streaming<AcquireResponse>) {
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .expect("endpoint")
        .initial_stream_window_size(0)
        .connect()
        .await
        .expect("uncredited client connects");
    let (tx, rx) = mpsc::channel(8);
    let open = AcquireRequest {
        action: Some(Action::Open(open)),
    };
    tx.send(open).await.expect("the request stream is open");
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    if let Some(token) = token {
        let bearer = format!("Bearer {token}").parse().expect("a token fit for a header");
        request.metadata_mut().insert("authorization", bearer);
    }
    let mut client = LockServiceClient::new(channel);
    let response = crate::bounded(
        Duration::from_secs(10),
        "the acquire's headers",
        client.acquire(request),
    )
    .await;
    (tx, response.expect("the acquire's headers").into_inner())
}
