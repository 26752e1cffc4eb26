//! The Redis connections: a command pool for scripts (their calls batched by
//! `batch`), a connection for scripts that must never run twice, a subscriber for the
//! hub, and an exclusive pool for grants that wait for replicas (Redis `WAIT` blocks
//! its connection). Standalone, cluster and sentinel deployments come from the URL
//! scheme.

mod batch;
mod identity;
mod replication;
mod sentinel;

pub use replication::{replica_wait, routes_to, Replication};

use crate::config::Config;
use crate::error::Error;
use crate::keys::Keys;
use crate::scripts::{Script, Scripts};
use batch::Batcher;
pub use batch::{batch_layout, BatchedCall};
use fred::clients::{ExclusivePool, SubscriberClient};
use fred::prelude::*;
use fred::types::config::{ClusterDiscoveryPolicy, ReconnectError, UnresponsiveConfig};
use fred::types::{ClusterHash, CustomCommand, RespVersion};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// A node connection's task: dropped, the connection ends.
type NodeConnection = tokio_util::task::AbortOnDropHandle<Result<(), fred::error::Error>>;

/// Connections in the command pool; auto-pipelining lets each carry many streams.
pub const POOL_SIZE: usize = 4;

/// Commands a Redis client keeps queued for its connection at most; more fail at once
/// (`Backpressure`, a failure that passes: waiters in line try again). While the
/// connection is down fred writes nothing and keeps every command queued, those that
/// timed out too, until it is back: unbounded, the retries of waiters in line, renewals
/// and releases grew the heap for as long as Redis was away (about 480 bytes a call,
/// 0.8 MiB/s with 2 000 waiters). Connected, the queue holds only what its task has not
/// written yet: a burst of 40 000 streams' first tries, in batches of up to 64 calls
/// over the pool's connections, queues about 160 on each.
const COMMAND_QUEUE_MAX: usize = 1024;
/// Commands a script call finds queued for its connection at most; more, and it fails
/// at once as fred's bound does (see `Script::loaded`). Below that bound, so that fred
/// refuses nothing in practice: the few other commands (pings, subscriptions, `INFO`)
/// have the rest.
pub const SCRIPT_QUEUE_MAX: usize = COMMAND_QUEUE_MAX * 3 / 4;
/// Commands a burst of sharded (un)subscribes leaves queued for the subscriber at most
/// (`hub::paced`), so that the subscriber's own pings and other calls find room.
pub const SUBSCRIBE_QUEUE_MAX: usize = COMMAND_QUEUE_MAX / 2;
/// Connections kept for grants that wait for replica acknowledgements.
pub const SYNC_POOL_SIZE: usize = 4;
/// Messages the subscriber buffers before a slow reader lags (it then re-checks).
pub const PUBSUB_BUFFER: usize = 16_384;

/// One independent RedLock deployment: a connection for scripts, one for pub/sub, and
/// the releases it missed.
#[derive(Debug)]
pub struct Node {
    /// Runs the lock scripts on this node.
    pub client: Client,
    /// Hears this node's unlock messages.
    pub subscriber: SubscriberClient,
    /// The releases this node did not answer, to send again once it does.
    pub pending: crate::lock::redlock::Pending,
    /// Its sentinels, when the node is a Sentinel-managed master: followed as the main
    /// Redis's are (see `sentinel`), or a server whose connections stayed on a master
    /// cut off from its sentinels would count it as the node while other servers,
    /// asking Sentinel, count the new master: two majorities at once.
    sentinel: Option<sentinel::Follower>,
    /// How the logs name it: `--redlock-url #N (<url without its password>)`.
    label: String,
    /// What the probe's pings heard of it (see [`Node::answered`]).
    heard: std::sync::Mutex<Heard>,
}

/// What the probe's pings heard of a RedLock node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Heard {
    /// Nothing yet: failed pings since the start, while its connection may still be
    /// coming up.
    Nothing(u8),
    Answering,
    Silent,
}

/// Failed pings from the start before a node that never answered is said to be silent:
/// its subscriber may still be connecting (TLS, a Sentinel's lookup) at the first.
const SILENT_FROM_THE_START: u8 = 3;

impl Node {
    /// Logs when this node stops answering the probe's ping, or answers again. RedLock
    /// holds while a majority answers, so no other line would say a node is down: an
    /// operator down to the last majority should hear of each node lost (and of a node
    /// that did not answer its first pings since the start).
    fn answered(&self, ping: &Result<(), fred::error::Error>) {
        let mut heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        let (now, news) = heard.after(ping.is_ok());
        *heard = now;
        drop(heard);
        match (news, ping) {
            (Some(true), _) => tracing::info!(node = %self.label, "a RedLock node answers again"),
            (Some(false), Err(e)) => tracing::warn!(node = %self.label, error = %e, "a RedLock node does not answer"),
            _ => {}
        }
    }
}

impl Heard {
    /// What the probe has heard after one more ping, and whether that is news:
    /// `Some(true)` a silent node answering again, `Some(false)` a node gone silent (or
    /// silent since the start, after its first pings).
    fn after(self, answered: bool) -> (Heard, Option<bool>) {
        let now = match (self, answered) {
            (_, true) => Heard::Answering,
            (Heard::Nothing(n), false) if n + 1 < SILENT_FROM_THE_START => Heard::Nothing(n + 1),
            (_, false) => Heard::Silent,
        };
        let news = match (self, now) {
            (Heard::Silent, Heard::Answering) => Some(true),
            (Heard::Answering | Heard::Nothing(_), Heard::Silent) => Some(false),
            _ => None,
        };
        (now, news)
    }
}

/// `--sync-replicas`: the exclusive connections a grant and its `WAIT` share, how many
/// replicas must acknowledge, and how long `WAIT` may take.
type SyncReplicas = (ExclusivePool, u32, Duration);

/// A script and its `WAIT` on one connection of `--sync-replicas`' pool.
struct SyncedCall {
    client: fred::clients::WithOptions<Client>,
    slot: u16,
    wanted: i64,
    millis: i64,
}

impl SyncedCall {
    /// Runs `script` then `WAIT` in one pipeline: the script's reply, and how many
    /// replicas acknowledged its writes.
    async fn run<R: FromValue>(
        &self,
        script: &Script,
        keys: &[Key],
        args: &[Value],
    ) -> Result<(R, i64), fred::error::Error> {
        let pipeline = fred::clients::Pipeline::from(self.client.clone());
        let mut call: Vec<Value> = Vec::with_capacity(2 + keys.len() + args.len());
        call.push(Value::from(script.sha()));
        call.push(Value::from(keys.len() as i64));
        call.extend(keys.iter().map(|k| Value::from(k.clone())));
        call.extend(args.iter().cloned());
        let evalsha = CustomCommand::new_static("EVALSHA", ClusterHash::Custom(self.slot), false);
        pipeline.custom::<(), _>(evalsha, call).await?;
        pipeline.wait::<()>(self.wanted, self.millis).await?;
        let mut replies = pipeline.try_all::<Value>().await.into_iter();
        let reply = replies.next().unwrap_or(Ok(Value::Null))?.convert()?;
        let acked = replies.next().unwrap_or(Ok(Value::Null))?.convert()?;
        Ok((reply, acked))
    }
}

/// The server's view of its Redis deployment.
#[derive(Debug)]
pub struct Backend {
    pool: Pool,
    /// Writes each command once (see [`Backend::eval_once`]).
    once: Client,
    subscriber: SubscriberClient,
    redlock: Vec<Node>,
    sync: Option<SyncReplicas>,
    /// The sentinels of a Sentinel-managed main Redis, asked where its master is.
    sentinel: Option<sentinel::Follower>,
    scripts: Arc<Scripts>,
    /// The scripts as a standalone Redis runs them (plain `PUBLISH`): every RedLock node
    /// is one, whatever the main Redis is, and its waiters listen with `SUBSCRIBE`.
    redlock_scripts: Arc<Scripts>,
    batcher: Arc<Batcher>,
    keys: Keys,
    cluster: bool,
    timeout: Duration,
    /// Which Redis each RedLock node is, and which nodes count toward a majority.
    identities: Arc<identity::Identities>,
    /// How long a restarted RedLock node sits out, and the longest RedLock lease
    /// (`--redlock-restart-delay`; 0: no bound).
    redlock_restart_delay: Duration,
    /// The main Redis's configuration, for a connection of its own to a cluster node
    /// missing from the slot map (see [`Backend::scan_locks`]).
    node_config: fred::prelude::Config,
    /// Tasks that live as long as the connections: the RedLock nodes' checks after each
    /// reconnection, and the log of connections the main Redis refuses.
    watchers: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Once the main Redis answered which commands it has: what it lacks, if anything
    /// (see [`lacking`]).
    lacks: OnceLock<Option<String>>,
    /// Once the URL's first node of a `redis-cluster://` URL answered: whether it is a
    /// Redis without cluster mode (see [`Backend::seed_without_cluster`]). Asked once:
    /// a cluster whose ACL refuses the command check would otherwise cost a connection
    /// to the seed at every health check.
    seed_lacks: OnceLock<Option<String>>,
}

impl Backend {
    /// Builds the clients and starts connecting. It does not wait for Redis: the
    /// server starts NOT_SERVING and becomes SERVING once Redis answers.
    pub fn connect(config: &Config) -> Result<Self, Error> {
        let redis_config = redis_config(config, &config.redis_url, "--redis-url")?;
        let cluster = redis_config.server.is_clustered();
        let sentinel = sentinel::Follower::of(&redis_config, config.redis_timeout)?;
        let node_config = redis_config.clone();
        let builder = builder(redis_config, config.redis_timeout);
        let pool = builder.build_pool(POOL_SIZE)?;
        let subscriber = subscriber_client(&builder)?;
        let once = once_client(&builder)?;
        pool.connect_pool();
        subscriber.connect();
        once.connect();
        let sync = if config.sync_replicas > 0 {
            let sync = written_once(&builder).build_exclusive_pool(SYNC_POOL_SIZE)?;
            Some((sync, config.sync_replicas, config.sync_timeout))
        } else {
            None
        };
        let labels: Vec<String> = (config.redlock_urls.iter().enumerate())
            .map(|(i, url)| format!("--redlock-url #{} ({url})", i + 1))
            .collect();
        let redlock = (config.redlock_urls.iter().zip(&labels))
            .map(|(url, label)| redlock_node(config, &url[..], label))
            .collect::<Result<Vec<_>, _>>()?;
        let scripts = Arc::new(Scripts::new(cluster));
        let redlock_scripts = match cluster {
            true => Arc::new(Scripts::new(false)),
            false => scripts.clone(),
        };
        Ok(Self {
            batcher: Arc::new(Batcher::new(pool.clone(), scripts.clone(), cluster)),
            pool,
            once,
            subscriber,
            redlock,
            sync,
            sentinel,
            scripts,
            redlock_scripts,
            keys: Keys::new(config.key_prefix.clone()),
            cluster,
            timeout: config.redis_timeout,
            identities: Arc::new(identity::Identities::new(labels, config.redlock_restart_delay())),
            redlock_restart_delay: config.redlock_restart_delay(),
            node_config,
            watchers: std::sync::Mutex::default(),
            lacks: OnceLock::new(),
            seed_lacks: OnceLock::new(),
        })
    }

    /// Starts the exclusive pool's connections (it needs an async context) and gives
    /// the RedLock deployments (and the main Redis beside them) a bounded moment to
    /// connect, so the first RedLock request does not spend its per-node timeout on
    /// connecting. Refuses to start when two RedLock nodes, or one and the main Redis,
    /// are one Redis (see [`identity`]); a node that is down is checked once it
    /// connects.
    pub async fn start(&self) -> Result<(), Error> {
        if let Some((sync, ..)) = &self.sync {
            sync.connect_pool().await;
        }
        let refusals = log_refused_connections(&self.once);
        self.watchers.lock().unwrap_or_else(|e| e.into_inner()).push(refusals);
        // The main Redis is asked again by the health checks until it answers.
        let nodes = (self.redlock.iter().enumerate())
            .map(|(i, n)| lacking(&n.client, self.identities.label(i), false, self.timeout));
        let (main, nodes) = tokio::join!(self.main_lacks(), futures::future::join_all(nodes));
        let lacks: Vec<String> = main.into_iter().chain(nodes.into_iter().flatten().flatten()).collect();
        if !lacks.is_empty() {
            self.quit().await;
            return Err(Error::Startup(lacks.join("; ")));
        }
        if self.redlock.is_empty() {
            return Ok(());
        }
        let nodes: Vec<Client> = self.redlock.iter().map(|n| n.client.clone()).collect();
        // Boxed: the start's future is deep enough already.
        let check = identity::check(&self.identities, &nodes, &self.once, self.cluster, self.timeout);
        let watchers = Box::pin(check).await;
        self.watchers.lock().unwrap_or_else(|e| e.into_inner()).extend(watchers);
        let refused = self.identities.refusals();
        self.identities.started();
        if !refused.is_empty() {
            self.quit().await;
            return Err(Error::Startup(refused.join("; ")));
        }
        Ok(())
    }

    /// Whether RedLock node `node` counts toward a majority: the Redis it leads to is
    /// known, and is neither the main Redis nor another node's.
    pub fn redlock_counts(&self, node: usize) -> bool {
        self.identities.counts(node)
    }

    /// The longest fixed RedLock lease (`--redlock-restart-delay`; `None`: any): a
    /// restarted node sits out no longer, so a lease past it could be granted again.
    pub fn longest_redlock_lease(&self) -> Option<Duration> {
        Some(self.redlock_restart_delay).filter(|d| !d.is_zero())
    }

    /// Whether grants wait for replica acknowledgements (`--sync-replicas`).
    pub fn waits_for_replicas(&self) -> bool {
        self.sync.is_some()
    }

    /// The bound on one Redis command.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The script catalogue.
    pub fn scripts(&self) -> &Scripts {
        &self.scripts
    }

    /// The scripts the RedLock nodes run.
    pub fn redlock_scripts(&self) -> &Scripts {
        &self.redlock_scripts
    }

    /// The key builder.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// True on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// Groups `items` by the node that serves their slot (see [`by_node`]).
    pub fn by_node<T>(&self, items: Vec<T>, slot: impl Fn(&T) -> u16) -> HashMap<String, Vec<T>> {
        by_node(&self.pool, self.cluster, items, slot)
    }

    /// [`Backend::by_node`] as `client`'s slot map has it.
    pub fn by_node_on<T>(&self, client: &Client, items: Vec<T>, slot: impl Fn(&T) -> u16) -> HashMap<String, Vec<T>> {
        by_node_on(client, self.cluster, items, slot)
    }

    /// The command that publishes unlock messages: sharded on a cluster, as Redisson
    /// does on Redis 7, so both hear each other.
    pub fn publish_command(&self) -> &'static str {
        if self.cluster {
            "spublish"
        } else {
            "publish"
        }
    }

    /// The subscriber connection (the hub's).
    pub fn subscriber(&self) -> &SubscriberClient {
        &self.subscriber
    }

    /// The command pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The independent RedLock deployments (`--redlock-url`).
    pub fn redlock_nodes(&self) -> &[Node] {
        &self.redlock
    }

    /// Runs a script from the catalogue on the main Redis, with the other calls of
    /// this scheduler round (see `batch`).
    pub async fn eval<R: FromValue>(&self, script: &Script, keys: Vec<Key>, args: Vec<Value>) -> Result<R, Error> {
        let started = std::time::Instant::now();
        let reply = match self.batcher.call(script, keys, args).await {
            Ok(value) => value.convert(),
            Err(e) => Err(e),
        };
        Self::record(script, started, reply)
    }

    /// Runs a script that must never run twice, on a connection that writes each command
    /// once: the pool's send a call again on their new connection when a reconnection
    /// cut it off, which may be after Redis ran it. ForceRelease breaks whatever holds
    /// the lock when it runs: a second run would break the grant of a waiter the first
    /// one woke. A call cut off fails instead, its outcome unknown to the caller.
    pub async fn eval_once<R: FromValue>(&self, script: &Script, keys: Vec<Key>, args: Vec<Value>) -> Result<R, Error> {
        self.eval_on(&self.once, script, keys, args).await
    }

    /// Runs a script from the catalogue through `client` (the pool, or a RedLock node).
    pub async fn eval_on<R: FromValue, C: LuaInterface + MetricsInterface + Send + Sync>(
        &self,
        client: &C,
        script: &Script,
        keys: Vec<Key>,
        args: Vec<Value>,
    ) -> Result<R, Error> {
        let started = std::time::Instant::now();
        let result = script.eval(client, keys, args).await;
        Self::record(script, started, result)
    }

    /// Counts a script call in the metrics and types its error.
    fn record<R>(
        script: &Script,
        started: std::time::Instant,
        result: Result<R, fred::error::Error>,
    ) -> Result<R, Error> {
        crate::metrics::redis_call(script.name(), started.elapsed(), result.is_ok());
        result.map_err(|e| {
            let left_out = if crate::error::refused_by_redis(&e) { REFUSED.due() } else { None };
            if let Some(left_out) = left_out {
                tracing::warn!(script = script.name(), error = %e, left_out, "redis refused a script: every call like it fails");
            } else {
                tracing::debug!(script = script.name(), error = %e, "redis script failed");
            }
            Error::Redis(e)
        })
    }

    /// Loads every script on every primary, so the first calls need no reload; on the
    /// RedLock deployments too, where a node that is down is skipped (it reloads on use).
    pub async fn load_scripts(&self) -> Result<(), Error> {
        for script in self.scripts.all() {
            self.pool.next().script_load_cluster::<(), _>(script.lua()).await?;
        }
        // The RedLock nodes run the standalone scripts, whatever the main Redis is; all at
        // once, and a node that is not connected, or fails a load, is left for good: each
        // call to it would wait out the Redis timeout, one script after another, before
        // the server reports SERVING.
        let loads = self
            .redlock
            .iter()
            .filter(|n| n.client.is_connected())
            .map(|node| async move {
                for script in self.redlock_scripts.all() {
                    if node.client.script_load::<(), _>(script.lua()).await.is_err() {
                        return;
                    }
                }
            });
        futures::future::join_all(loads).await;
        Ok(())
    }

    /// Checks that Redis answers on every connection (the pool's, the one-shot, the
    /// idle ones of replicated grants; on a cluster, from every primary) and on the
    /// subscriber. All at once, none skipped after a failure: fred finds a connection
    /// whose Redis stopped answering (a frozen master, a partition) only by a command
    /// in flight on it, and only then moves it (after a Sentinel failover, to the new
    /// master); an idle one would stay on the old master and write there once it woke.
    /// Then, once all answered, that Redis lets latchkey's user at a lock's keys (see
    /// [`probe_keys`]).
    pub async fn ping(&self) -> Result<(), Error> {
        // With `--sync-replicas N`, every grant waits for N replicas: fewer means none.
        let wanted = self.sync.as_ref().map_or(0, |(_, wanted, _)| *wanted);
        let unwritten = self.keys.lock(PROBE_NAME).hold(UNWRITTEN_HOLD);
        let ping = |c| ping_client(c, self.cluster, wanted, &unwritten, self.timeout);
        let pool = futures::future::join_all(self.pool.clients().iter().map(ping));
        let (pool, once, sync, subscriber) = tokio::join!(
            pool,
            ping_client(&self.once, self.cluster, 0, &unwritten, self.timeout),
            self.ping_idle_sync(),
            ping_subscriber(&self.subscriber, self.cluster),
        );
        // Sentinel is asked whatever the pings found: a master that answers but
        // refuses writes (`min-replicas-to-write` with its replicas gone) fails them
        // all, and nothing else moves the connections off it.
        self.follow_sentinel().await;
        pool.into_iter().chain([once, sync]).collect::<Result<(), _>>()?;
        if self.sentinel.is_some() {
            sentinel::tells_connection_ids(&self.once).await?;
        }
        if let Some(lacks) = self.main_lacks().await {
            return Err(Error::Startup(lacks));
        }
        subscriber?;
        probe_keys(&self.once, &self.keys).await
    }

    /// Moves every connection that is to another node than the master Sentinel names
    /// (see `sentinel`), when the main Redis is Sentinel-managed.
    async fn follow_sentinel(&self) {
        let Some(follower) = &self.sentinel else {
            return;
        };
        let Some(master) = follower.master().await else {
            return;
        };
        let (master, timeout) = (&master, self.timeout);
        let pool = self.pool.clients().iter().chain([&self.once]);
        tokio::join!(
            futures::future::join_all(pool.map(|c| sentinel::follow(c, master, timeout))),
            futures::future::join_all(
                self.idle_sync()
                    .map(|c| async move { sentinel::follow(&*c, master, timeout).await })
            ),
            sentinel::follow(&self.subscriber, master, timeout),
        );
    }

    /// Pings the connections of replicated grants that no grant is using (one in use
    /// has a command in flight already).
    async fn ping_idle_sync(&self) -> Result<(), Error> {
        let pings = futures::future::join_all(self.idle_sync().map(|c| async move { c.ping::<()>(None).await }));
        Ok(pings.await.into_iter().collect::<Result<(), _>>()?)
    }

    /// The connections of replicated grants that no grant is using, held meanwhile.
    fn idle_sync(&self) -> impl Iterator<Item = tokio::sync::MutexGuard<'_, Client>> {
        let clients = self.sync.iter().flat_map(|(sync, _, _)| sync.clients());
        clients.filter_map(|c| c.try_lock().ok())
    }

    /// What the main Redis lacks, once it answered (asked until then); logged once.
    async fn main_lacks(&self) -> Option<String> {
        if self.lacks.get().is_none() {
            let answer = match lacking(&self.once, "--redis-url", self.cluster, self.timeout).await {
                None if self.cluster => self.seed_without_cluster().await.filter(Option::is_some),
                answer => answer,
            };
            if let Some(answer) = answer {
                if let Some(lacks) = &answer {
                    tracing::error!("{lacks}");
                }
                let _ = self.lacks.set(answer);
            }
        }
        self.lacks.get().cloned().flatten()
    }

    /// Runs a script that may grant a hold. With `--sync-replicas`, a grant (as told
    /// by `granted`) is sent only after that many replicas acknowledged it (Redis
    /// `WAIT`, Redisson's replica-sync check); WAIT counts the writes of its own
    /// connection, so the script runs on the same exclusive connection.
    pub async fn eval_grant<R: FromValue>(
        &self,
        script: &Script,
        keys: Vec<Key>,
        args: Vec<Value>,
        granted: impl Fn(&R) -> bool,
    ) -> Result<R, Error> {
        match &self.sync {
            // Boxed: a future holds its largest branch, and every try's is moved once.
            Some(sync) => Box::pin(self.eval_synced(sync, script, keys, args, granted)).await,
            None => self.eval(script, keys, args).await,
        }
    }

    /// [`Backend::eval_grant`] with `--sync-replicas`: the script and its `WAIT` go as
    /// one pipeline, written once, on one connection. `WAIT` counts only the writes made
    /// on its own connection: sent after the script's reply, it could go out on a new
    /// connection (a reconnect in between; fred also writes a command again after a
    /// reconnect), which counts none, and confirm at once a grant the promoted replica
    /// never had.
    async fn eval_synced<R: FromValue>(
        &self,
        (pool, wanted, timeout): &SyncReplicas,
        script: &Script,
        keys: Vec<Key>,
        args: Vec<Value>,
        granted: impl Fn(&R) -> bool,
    ) -> Result<R, Error> {
        let slot = keys.first().map(|k| k.cluster_hash()).unwrap_or_default();
        // While replicas do not acknowledge, or Redis is away, every connection may be
        // held by a grant's WAIT for the whole sync timeout: a try waits its turn no
        // longer than a command may take, and is then refused as a call Redis did not
        // answer (the script never ran: no grant to be unreplicated, and a waiter in
        // line tries again).
        let busy = "no connection for replicated grants came free within the Redis timeout";
        let client = in_time(self.timeout, busy, first_free(pool)).await?;
        // WAIT itself may take the whole sync timeout: the command timeout comes on top.
        // Written once (a pipeline cut off is not written again; one sent while the
        // connection is down waits for it whole, and fred still writes it once the
        // connection is back, after its caller gave up): a failure leaves the grant in
        // doubt, which its stream gives back.
        let opts = Options {
            cluster_hash: Some(ClusterHash::Custom(slot)),
            timeout: Some(*timeout + self.timeout),
            max_attempts: Some(1),
            ..Default::default()
        };
        let synced = SyncedCall {
            client: client.with_options(&opts),
            slot,
            wanted: i64::from(*wanted),
            millis: i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX),
        };
        let started = std::time::Instant::now();
        let result = script
            .loaded(&*client, &keys, || synced.run(script, &keys, &args))
            .await;
        if client.is_connected()
            && result
                .as_ref()
                .is_err_and(|e| *e.kind() == fred::error::ErrorKind::Timeout)
        {
            // fred checks no connection with a WAIT in flight for silence: one whose
            // Redis went silent (a frozen primary, a lost network path) would stay as
            // it is, every grant sent on it timing out, until TCP gives up. It is made
            // again before the next grant gets it. (Not one reconnecting already: the
            // ask would wait behind that reconnection and make it once more after.)
            let _ = tokio::time::timeout(self.timeout, client.force_reconnection()).await;
        }
        let (reply, acked): (R, i64) = Self::record(script, started, result)?;
        if granted(&reply) && acked < i64::from(*wanted) {
            return Err(Error::NotReplicated { wanted: *wanted });
        }
        Ok(reply)
    }

    /// Every key matching `pattern` that can be a lock: hashes (mutex, fair,
    /// read/write) and sorted sets (semaphores), on every primary of a cluster. Page by
    /// page, each `SCAN` a call of its own under the command timeout: fred's scan
    /// streams put none on theirs (while Redis is away their first page never comes).
    /// On a cluster the masters are those of the slot map read anew: fred's cached map
    /// is corrected by no keyless call (a master added since the client last met a
    /// `MOVED` would be left out). A slot that moved during the scan, from a master not
    /// yet scanned to one already scanned, would leave its keys out: the map is read
    /// again after the scan, and a scan it does not match is made again, up to
    /// [`LIST_SCANS`] times, then refused as a Redis that does not answer is. A slot
    /// still migrating keeps its place in the map while its keys move one by one: the
    /// masters importing a slot before or after the scan are scanned once more at its
    /// end, where every key that left a master during the scan has arrived (a key
    /// listed twice is one name to the caller).
    pub async fn scan_locks(&self, pattern: &str) -> Result<Vec<Key>, Error> {
        let client = self.pool.next();
        if !self.cluster {
            return scan_nodes(client, vec![None], pattern).await;
        }
        let mut map = slot_map(client, self.timeout).await?;
        for _ in 0..LIST_SCANS {
            let primaries: std::collections::BTreeSet<&Server> = map.iter().map(|(_, _, primary)| primary).collect();
            let primaries: Vec<Server> = primaries.into_iter().cloned().collect();
            let mut rescan = importing(client, &primaries).await?;
            let mut keys = scan_nodes(client, primaries.iter().cloned().map(Some).collect(), pattern).await?;
            rescan.extend(importing(client, &primaries).await?);
            let Migrations { mapped, unmapped } = rescan;
            keys.extend(scan_nodes(client, mapped.into_iter().map(Some).collect(), pattern).await?);
            for node in unmapped {
                keys.extend(self.scan_unmapped(node, pattern).await?);
            }
            let after = slot_map(client, self.timeout).await?;
            if after == map {
                return Ok(keys);
            }
            map = after;
        }
        let moving = "the cluster's slots kept moving while the locks were listed; retry";
        Err(Error::Redis(fred::error::Error::new(
            fred::error::ErrorKind::Cluster,
            moving,
        )))
    }

    /// The lock keys of `pattern` on a cluster node the slot map does not list (a master
    /// importing its first slot), through a connection of its own: a command the pool
    /// sent there would find no route, and fred would reconnect the whole client.
    async fn scan_unmapped(&self, node: Server, pattern: &str) -> Result<Vec<Key>, Error> {
        // Its connection ends with this call, had the List's caller gone away too.
        let (client, _connection) = self.node_client(node, "a cluster node importing a slot").await?;
        let scanned = scan_nodes(&client, vec![None], pattern).await;
        let _ = tokio::time::timeout(self.timeout, client.quit()).await;
        scanned
    }

    /// A connection of its own to `node` of the main Redis (`what`, for the error when
    /// it does not answer), made with one try: a node that cannot be reached leaves no
    /// task reconnecting to it. The connection ends when the handle is dropped.
    async fn node_client(&self, node: Server, what: &str) -> Result<(Client, NodeConnection), Error> {
        let mut config = self.node_config.clone();
        config.server = ServerConfig::Centralized { server: node };
        config.fail_fast = true;
        let mut builder = builder(config, self.timeout);
        builder.set_policy(ReconnectPolicy::new_constant(1, 0));
        let client = builder.build()?;
        let connection = tokio_util::task::AbortOnDropHandle::new(client.connect());
        in_time(
            self.timeout,
            format!("{what} did not answer"),
            client.wait_for_connect(),
        )
        .await??;
        Ok((client, connection))
    }

    /// Whether a `redis-cluster://` URL names a Redis without cluster mode: fred's
    /// cluster client never connects to one (its `CLUSTER SLOTS` is refused, and tried
    /// again for good), so the server would start and serve nothing, saying only that
    /// the slot map is not known. Asked of the URL's first node, when the cluster did
    /// not answer; the message refuses the start. `Some(None)`: a cluster node, or one
    /// that refuses to say; `None`: no answer yet.
    async fn seed_without_cluster(&self) -> Option<Option<String>> {
        if let Some(known) = self.seed_lacks.get() {
            return Some(known.clone());
        }
        let ServerConfig::Clustered { hosts, .. } = &self.node_config.server else {
            return Some(None);
        };
        let (client, _connection) = self.node_client(hosts.first()?.clone(), "the URL's node").await.ok()?;
        let info = tokio::time::timeout(
            self.timeout,
            client.info::<String>(Some(fred::types::InfoKind::Cluster)),
        )
        .await;
        let _ = tokio::time::timeout(self.timeout, client.quit()).await;
        // A refusal (an ACL without INFO) is an answer; a passing error (LOADING, a
        // dropped connection) is asked again.
        let info = info.ok()?.map_or_else(|e| (!transient(&e)).then(String::new), Some)?;
        let lacks = info.contains("cluster_enabled:0").then(|| {
            "--redis-url: a redis-cluster:// URL names a Redis without cluster mode, which the cluster's client never \
             connects to (give it as redis://, or enable cluster mode)"
                .to_owned()
        });
        Some(self.seed_lacks.get_or_init(|| lacks).clone())
    }

    /// The break floor a ForceRelease left at `key` (`latchkey_broken`); None when there
    /// is none or Redis did not answer: read only to say why a hold was gone.
    pub async fn break_floor(&self, key: &str) -> Option<u64> {
        let floor: Result<Option<u64>, _> = self.pool.next().get(key).await;
        floor.ok().flatten()
    }

    /// Closes every connection.
    pub async fn quit(&self) {
        for watcher in self.watchers.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            watcher.abort();
        }
        let _ = self.subscriber.quit().await;
        let _ = self.pool.quit().await;
        let _ = self.once.quit().await;
        for node in &self.redlock {
            let _ = node.subscriber.quit().await;
            let _ = node.client.quit().await;
            if let Some(sentinel) = &node.sentinel {
                sentinel.quit().await;
            }
        }
        if let Some((sync, ..)) = &self.sync {
            let _ = sync.quit().await;
        }
        if let Some(sentinel) = &self.sentinel {
            sentinel.quit().await;
        }
    }
}

/// Probes the primaries `client` talks to (see [`probe_primary`]; `unwritten` is
/// [`probe_writes`]' key). On a cluster, a probe that fails is made again on a fresh
/// slot map: an idle client's map (the probe's own client's) still names a master that
/// a manual failover demoted (it answers `READONLY`) or that left the cluster, until a
/// keyed call meets `MOVED`, while every slot is served.
async fn ping_client(
    client: &Client,
    cluster: bool,
    replicas: u32,
    unwritten: &str,
    timeout: Duration,
) -> Result<(), Error> {
    if !cluster {
        return probe_primary(client, replicas, unwritten).await;
    }
    if probe_primaries(client, replicas, unwritten).await.is_ok() {
        return Ok(());
    }
    sync_cluster(client, timeout).await?;
    probe_primaries(client, replicas, unwritten).await
}

/// Reads `client`'s slot map again, within `timeout`. fred answers once its task takes
/// the call, which it does not while it reconnects to a master that is down (it waits
/// for every primary): unbounded, a health round waited for as long as the master was
/// away, health SERVING, and a List hung. Not asked of a client reconnecting (whose
/// reconnection reads the map anyway): each read asked would wait, queued, and all run
/// one after another once the master was back.
async fn sync_cluster(client: &Client, timeout: Duration) -> Result<(), Error> {
    if !client.is_connected() {
        let reconnecting = "the connection to the cluster is being made again";
        return Err(Error::Redis(fred::error::Error::new(
            fred::error::ErrorKind::IO,
            reconnecting,
        )));
    }
    let late = "the cluster's slot map was not read in time";
    Ok(in_time(timeout, late, client.sync_cluster()).await??)
}

/// `future`'s output, or past `timeout` a timeout naming `what`, as a call Redis did
/// not answer in time.
async fn in_time<T>(
    timeout: Duration,
    what: impl Into<std::borrow::Cow<'static, str>>,
    future: impl std::future::Future<Output = T>,
) -> Result<T, Error> {
    tokio::time::timeout(timeout, future)
        .await
        .map_err(|_| Error::Redis(fred::error::Error::new(fred::error::ErrorKind::Timeout, what)))
}

/// Probes each primary of `client`'s cached slot map, and that it sees the cluster up.
async fn probe_primaries(client: &Client, replicas: u32, unwritten: &str) -> Result<(), Error> {
    let primaries = client.cached_cluster_state().map(|s| s.unique_primary_nodes());
    let Some(primaries) = primaries.filter(|p| !p.is_empty()) else {
        return Err(Error::Protocol("the cluster's slot map is not known yet".into()));
    };
    for server in primaries {
        let node = client.with_cluster_node(server);
        probe_primary(&node, replicas, unwritten).await?;
        // Redis answers keyless commands, the probe's, while the cluster is down; every
        // script with a key is then refused `CLUSTERDOWN`.
        let info: String = node.cluster_info().await?;
        if !info.lines().any(|l| l.trim() == "cluster_state:ok") {
            let down = fred::error::Error::new(fred::error::ErrorKind::Cluster, "CLUSTERDOWN cluster_state is not ok");
            return Err(Error::Redis(down));
        }
    }
    Ok(())
}

/// Pings each RedLock node's subscriber every `every` until `stop`, and moves a
/// Sentinel-managed node's connections to the master its sentinels name. Its connection
/// only receives once its channels are subscribed, and fred notices a connection that
/// died without a word (an idle flow a NAT dropped) only by a command it does not
/// answer: without one, every unlock message of that node would be lost, and its
/// waiters would sleep out the holder's lease. A node that is down is skipped at once
/// (it is reconnecting); one that does not answer is made again, its channels
/// subscribed again and its waiters woken. Health does not depend on it: RedLock
/// tolerates a minority of nodes down.
pub async fn probe_redlock_subscribers(
    backend: Arc<Backend>,
    every: Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    let opts = fred::types::config::Options {
        fail_fast: true,
        timeout: Some(backend.timeout),
        ..Default::default()
    };
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let pings = backend.redlock.iter().map(|node| async {
            let answered = ClientLike::with_options(&node.subscriber, &opts).ping::<()>(None).await;
            node.answered(&answered);
            follow_node_sentinel(node, backend.timeout, answered.is_ok()).await;
        });
        futures::future::join_all(pings).await;
    }
}

/// Moves a RedLock node's connections to the master its sentinels name, when it is
/// Sentinel-managed (its identity watch then sees another Redis, and the node sits out
/// as after a restart); and, when the node `answered` the probe's ping, checks that
/// its connections can be followed.
async fn follow_node_sentinel(node: &Node, timeout: Duration, answered: bool) {
    let Some(follower) = &node.sentinel else {
        return;
    };
    if let Some(master) = follower.master().await {
        tokio::join!(
            sentinel::follow(&node.client, &master, timeout),
            sentinel::follow(&node.subscriber, &master, timeout),
        );
    }
    // Not while the node is away or silent: the round, every node's, would wait out
    // another timeout.
    if !answered || !node.client.is_connected() {
        return;
    }
    if let Err(e) = sentinel::tells_connection_ids(&node.client).await {
        if let Some(left_out) = UNFOLLOWED.due() {
            tracing::error!(error = %e, left_out, "a RedLock node behind Sentinel cannot be followed");
        }
    }
}

/// RedLock nodes behind Sentinel whose connections cannot be followed, logged at most
/// every ten seconds.
static UNFOLLOWED: crate::repeated::Repeated = crate::repeated::Repeated::new();

/// Pings the subscriber on each of its connections. On a cluster a keyless PING goes to
/// one primary; the connections to the others only receive (a sharded subscribe arms no
/// liveness check of the Redis client), so one that died without a word (an idle flow
/// dropped by a NAT) would lose that primary's messages for good, unnoticed.
async fn ping_subscriber(sub: &SubscriberClient, cluster: bool) -> Result<(), fred::error::Error> {
    if !cluster {
        return sub.ping::<()>(None).await;
    }
    let primaries = sub.cached_cluster_state().map(|s| s.unique_primary_nodes());
    for server in primaries.unwrap_or_default() {
        let node = fred::types::config::Options {
            cluster_node: Some(server),
            ..Default::default()
        };
        ClientLike::with_options(sub, &node).ping::<()>(None).await?;
    }
    Ok(())
}

/// Checks that a primary takes writes and has at least `replicas` replicas that
/// acknowledge them.
async fn probe_primary(client: &impl ClientLike, replicas: u32, unwritten: &str) -> Result<(), Error> {
    probe_writes(client, unwritten).await?;
    if replicas == 0 {
        return Ok(());
    }
    // Every replicated grant ends in `WAIT`: a user Redis refuses it (an ACL without
    // it) could be granted nothing. `WAIT 0 0` answers at once.
    let wait = CustomCommand::new_static("WAIT", ClusterHash::Random, false);
    let _: i64 = client.custom(wait, vec![Value::from(0), Value::from(0)]).await?;
    let info: String = client.info(Some(fred::types::InfoKind::Replication)).await?;
    if replication::acknowledging(&info) < replicas as usize {
        return Err(Error::NotReplicated { wanted: replicas });
    }
    Ok(())
}

/// A script that writes nothing but may: Redis 7 checks a script with a shebang and no
/// flags before running it, and refuses it as it would refuse a write.
const WRITE_PROBE: &str = "#!lua\nreturn 1";

/// The write probe for Redis 6.2, which cannot compile a shebang and refuses a write
/// only once a script calls a command that writes: `SET … XX` of a key that never
/// exists, which writes nothing (nor is anything replicated) and is refused as any
/// write is (a replica, too few replicas, out of memory, a failed save).
const WRITE_PROBE_6_2: &str = "return redis.call('set', KEYS[1], '', 'XX')";

/// The hold id of [`WRITE_PROBE_6_2`]'s key: a hold record of the lock
/// [`PROBE_NAME`] that no grant makes (a grant's hold id is a UUID).
const UNWRITTEN_HOLD: &str = "health-probe";

/// The lock whose keys the health check offers Redis (see [`probe_keys`]).
const PROBE_NAME: &str = "latchkey-health";

/// A script given keys it never touches: Redis checks a caller's key permissions on a
/// script's declared keys before running it. No shebang, so that Redis 6.2 runs it too.
const KEY_PROBE: &str = "return 1";

/// Checks that Redis lets latchkey's user at keys shaped as a lock's: the lock key of
/// [`PROBE_NAME`] and its fencing counter, which every grant writes. An ACL confining
/// the user to a key pattern that fits the prefix but not the derived keys (`~app1:*`
/// where they are `latchkey_fence:{app1:…}`), or to reading, lets every keyless probe
/// through and refuses every grant `NOPERM`. Only a refusal fails it: Redis checks a
/// call's permissions before it redirects it (a slot moving) or finds its slot
/// unserved, and the other checks tell whether Redis answers.
async fn probe_keys(client: &Client, keys: &Keys) -> Result<(), Error> {
    let lock = keys.lock(PROBE_NAME);
    let probed = vec![lock.fence(), lock.lock];
    match client.eval::<Value, _, _, _>(KEY_PROBE, probed.clone(), ()).await {
        Err(e) if crate::error::refused_by_redis(&e) => {
            let why = format!(
                "{} (the keys of the lock {PROBE_NAME:?}, {}: an ACL must let latchkey's user at every lock's keys)",
                e.details(),
                probed.join(" ")
            );
            Err(Error::Redis(fred::error::Error::new(e.kind().clone(), why)))
        }
        _ => Ok(()),
    }
}

/// What the Redis `client` talks to lacks of the commands latchkey runs, if anything:
/// `GETDEL` (6.2: every release runs it; an older Redis would grant and never release,
/// each lock held for a whole lease) and, on a cluster, sharded pub/sub (`SPUBLISH`,
/// 7.0). Asked through a script, whose answer is a list of 0 and 1: `COMMAND INFO`'s
/// own RESP3 answer is one the Redis client cannot decode, and it would drop the
/// connection. `None` when Redis does not answer in `timeout`, or refuses: not known.
/// A cluster node named as one Redis lacks the rest of its cluster (`cluster_node`).
async fn lacking(client: &Client, label: &str, cluster: bool, timeout: Duration) -> Option<Option<String>> {
    if !cluster {
        if let Some(Some(node)) = cluster_node(client, label, timeout).await {
            return Some(Some(node));
        }
    }
    const HAS: &str = "local has = {} for i, c in ipairs(ARGV) do \
        has[i] = redis.call('command', 'info', c)[1] and 1 or 0 end return has";
    let needed: &[&str] = if cluster { &["GETDEL", "SPUBLISH"] } else { &["GETDEL"] };
    let args = needed.iter().map(|c| Value::from(*c));
    let Ok(Ok(has)) = tokio::time::timeout(timeout, eval_anywhere::<Vec<i64>>(client, HAS, &[], args)).await else {
        return None;
    };
    let missing: Vec<&str> = (needed.iter().enumerate())
        .filter(|(i, _)| has.get(*i) != Some(&1))
        .map(|(_, c)| *c)
        .collect();
    Some((!missing.is_empty()).then(|| {
        format!(
            "{label}: Redis lacks {}: latchkey needs Redis 6.2 or newer (7.0 on a cluster, for sharded pub/sub)",
            missing.join(" and ")
        )
    }))
}

/// Whether the Redis a standalone `client` talks to is a node of a Redis Cluster of
/// several shards, as a seed address or a Service in front of a cluster can be: it
/// answers keyless commands, health's among them, but a script whose name lives on
/// another shard answers `MOVED`, which a standalone client does not follow (a cluster
/// of one shard serves every name). `None`: not known (no answer in `timeout`); a Redis
/// that refuses `CLUSTER INFO` (not a cluster, or an ACL) is taken for none.
async fn cluster_node(client: &Client, label: &str, timeout: Duration) -> Option<Option<String>> {
    let info = tokio::time::timeout(timeout, client.cluster_info::<String>())
        .await
        .ok()?;
    let shards = info.ok().and_then(|info| {
        let size = info.lines().find_map(|l| l.trim().strip_prefix("cluster_size:"))?;
        size.parse::<u32>().ok()
    });
    let node = shards.is_some_and(|shards| shards > 1);
    Some(node.then(|| {
        format!(
            "{label}: this Redis is a node of a Redis Cluster of several shards, and a redis:// or rediss:// URL \
             does not follow the cluster to the shards where most names live (give a cluster as redis-cluster://; a \
             RedLock deployment is one Redis)"
        )
    }))
}

/// Refusals by Redis, logged sparingly: a misconfigured ACL refuses every call.
static REFUSED: crate::repeated::Repeated = crate::repeated::Repeated::new();

/// Connections the main Redis refused, logged sparingly.
static REFUSED_CONNECTIONS: crate::repeated::Repeated = crate::repeated::Repeated::new();

/// Logs the connection errors of the main Redis that no retry cures, a wrong password
/// or user (`WRONGPASS`) or a refused TLS handshake: fred tries again for good and says
/// so at debug only, and health's `NOT_SERVING` would name no cause but a timeout.
fn log_refused_connections(client: &Client) -> tokio::task::JoinHandle<()> {
    let mut errors = client.error_rx();
    tokio::spawn(async move {
        loop {
            match errors.recv().await {
                Ok((e, _)) if matches!(e.kind(), fred::error::ErrorKind::Auth | fred::error::ErrorKind::Tls) => {
                    if let Some(left_out) = REFUSED_CONNECTIONS.due() {
                        tracing::error!(error = %e, left_out, "--redis-url: Redis refused the connection; trying again");
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                _ => {}
            }
        }
    })
}

/// Checks that Redis answers, runs scripts and takes writes, so no lock can be granted
/// while it refuses them (an ACL without `+@scripting`, or a Sentinel's port, answers
/// `PING` all the same). Redis 6.2, which cannot compile a shebang, is asked to write
/// to `unwritten`, a key that never exists (see [`WRITE_PROBE_6_2`]).
async fn probe_writes(client: &impl ClientLike, unwritten: &str) -> Result<(), Error> {
    match eval_anywhere::<()>(client, WRITE_PROBE, &[], std::iter::empty()).await {
        Err(e) if e.details().contains("Error compiling script") => {
            match eval_anywhere::<Value>(client, WRITE_PROBE_6_2, &[unwritten], std::iter::empty()).await {
                Ok(_) => Ok(()),
                Err(e) => Err(unwrapped(client, e).await.into()),
            }
        }
        Err(e) => Err(e.into()),
        Ok(()) => Ok(()),
    }
}

/// Runs the script `body` with `keys` and `args` on whichever node `client` leads to
/// (keys, if any, it serves): a custom command, as fred runs a script on a chosen
/// cluster node only that way.
async fn eval_anywhere<R: FromValue>(
    client: &impl ClientLike,
    body: &'static str,
    keys: &[&str],
    args: impl Iterator<Item = Value>,
) -> Result<R, fred::error::Error> {
    let eval = fred::types::CustomCommand::new_static("EVAL", ClusterHash::Random, false);
    let head = [Value::from(body), Value::from(keys.len() as i64)].into_iter();
    let args: Vec<Value> = head.chain(keys.iter().map(|k| Value::from(*k))).chain(args).collect();
    client.custom(eval, args).await
}

/// Connects one RedLock deployment (without waiting for it): one Redis, standalone or
/// behind Sentinel, never a cluster (see [`Config::validate`]).
fn redlock_node(config: &Config, url: &str, label: &str) -> Result<Node, Error> {
    let redis_config = redis_config(config, url, "--redlock-url")?;
    if redis_config.server.is_clustered() {
        return Err(Error::Startup(
            "--redlock-url: a RedLock deployment is not a cluster".into(),
        ));
    }
    let sentinel = sentinel::Follower::of(&redis_config, config.redis_timeout)?;
    let builder = builder(redis_config, config.redis_timeout);
    let client = builder.build()?;
    let subscriber = subscriber_client(&builder)?;
    client.connect();
    subscriber.connect();
    Ok(Node {
        client,
        subscriber,
        pending: Default::default(),
        sentinel,
        label: label.to_owned(),
        heard: std::sync::Mutex::new(Heard::Nothing(0)),
    })
}

/// The fred configuration of a Redis URL (RESP3, ACL user, password file, CA bundle).
/// Errors name the flag, never the URL: it may carry a password.
fn redis_config(config: &Config, url: &str, flag: &str) -> Result<fred::prelude::Config, Error> {
    let mut redis =
        fred::prelude::Config::from_url(url).map_err(|e| Error::Startup(format!("{flag}: {}", e.details())))?;
    redis.version = RespVersion::RESP3;
    redis.fail_fast = false;
    // A cluster's slot map is read again from the nodes it last listed, not only from
    // the URL's: with those seeds down (a node in maintenance, a replica that died),
    // fred would ask them alone, without end, and no command would go meanwhile.
    if redis.server.is_clustered() {
        let _ = redis
            .server
            .set_cluster_discovery_policy(ClusterDiscoveryPolicy::UseCache);
    }
    // The flags fill in what a URL leaves out: a RedLock node's URL may carry its own.
    if let (Some(user), None) = (&config.redis_username, &redis.username) {
        redis.username = Some(user.clone());
    }
    if let (Some(path), None) = (&config.redis_password_file, &redis.password) {
        let password = std::fs::read_to_string(path)
            .map_err(|e| Error::Startup(format!("--redis-password-file {}: {e}", path.display())))?;
        redis.password = Some(password.trim_end_matches(['\r', '\n']).to_owned());
    }
    // The CA turns TLS on for every URL, rediss:// or not: a redis:// URL given with
    // a CA must not quietly connect in plaintext.
    if let Some(path) = &config.redis_tls_ca {
        redis.tls = Some(crate::tls::redis_tls(path)?);
    }
    Ok(redis)
}

/// How many times a List scans a cluster whose slots moved during its scan.
const LIST_SCANS: usize = 3;

/// Each slot range of a cluster with its primary, read anew.
async fn slot_map(client: &Client, timeout: Duration) -> Result<Vec<(u16, u16, Server)>, Error> {
    sync_cluster(client, timeout).await?;
    let state = client.cached_cluster_state();
    let slots = state.as_ref().map_or(&[][..], |s| s.slots());
    let mut map: Vec<(u16, u16, Server)> = slots.iter().map(|r| (r.start, r.end, r.primary.clone())).collect();
    map.sort_by_key(|(start, ..)| *start);
    Ok(map)
}

/// The masters a slot migrates between, by the slot map's name where it lists them.
#[derive(Default)]
struct Migrations {
    mapped: std::collections::BTreeSet<Server>,
    /// Targets that serve no slot yet (a node being added), missing from the slot map.
    unmapped: std::collections::BTreeSet<Server>,
}

impl Migrations {
    fn extend(&mut self, other: Migrations) {
        self.mapped.extend(other.mapped);
        self.unmapped.extend(other.unmapped);
    }
}

/// The masters importing a slot from or into one of `primaries`, as `CLUSTER NODES`
/// shows on each node's own line: `[slot-<-source]` on the importing master, and
/// `[slot->-target]` on the migrating one. A target is named as the slot map names it,
/// found by its node id (the table's address may be an IP where the map has a host
/// name); one the map does not list is named by the table's address.
async fn importing(client: &Client, primaries: &[Server]) -> Result<Migrations, Error> {
    let nodes = CustomCommand::new_static("CLUSTER", ClusterHash::Random, false);
    let state = client.cached_cluster_state();
    let slots = state.as_ref().map_or(&[][..], |s| s.slots());
    let mut found = Migrations::default();
    for primary in primaries {
        let on_node = client.with_options(&Options {
            cluster_node: Some(primary.clone()),
            ..Default::default()
        });
        let table: String = on_node.custom(nodes.clone(), vec!["NODES"]).await?;
        let own = table
            .lines()
            .find(|line| line.split(' ').nth(2).is_some_and(|f| f.contains("myself")));
        let Some(own) = own else { continue };
        if own.contains("-<-") {
            found.mapped.insert(primary.clone());
        }
        for target in own
            .split(' ')
            .filter_map(|f| f.split_once("->-"))
            .map(|(_, id)| id.trim_end_matches(']'))
        {
            match slots.iter().find(|range| &*range.id == target) {
                Some(range) => {
                    found.mapped.insert(range.primary.clone());
                }
                None => found.unmapped.extend(node_address(&table, target)),
            }
        }
    }
    Ok(found)
}

/// The address of the node `id` in a `CLUSTER NODES` table (`<id> <ip:port@bus[,host]> …`):
/// its host name where it announces one (what its TLS certificate names), else its IP;
/// none while it has no address yet (`:0`, a node in its handshake).
fn node_address(table: &str, id: &str) -> Option<Server> {
    let line = table.lines().find(|line| line.split(' ').next() == Some(id))?;
    let (address, bus) = line.split(' ').nth(1)?.split_once('@')?;
    let (ip, port) = address.rsplit_once(':')?;
    let port: u16 = port.parse().ok().filter(|port| *port != 0)?;
    // Redis 7.2 may follow the host name with `,key=value` fields.
    let host = bus
        .split(',')
        .nth(1)
        .filter(|host| !host.is_empty() && !host.contains('='));
    let host = host.unwrap_or(ip);
    (!host.is_empty()).then(|| Server::new(host, port))
}

/// The keys of `pattern` that can be locks (hashes and sorted sets) on each of
/// `nodes` (`None`: the one node of a standalone Redis).
async fn scan_nodes(client: &Client, nodes: Vec<Option<Server>>, pattern: &str) -> Result<Vec<Key>, Error> {
    let scan = CustomCommand::new_static("SCAN", ClusterHash::Random, false);
    let mut keys = Vec::new();
    for node in nodes {
        let on_node = client.with_options(&Options {
            cluster_node: node,
            ..Default::default()
        });
        for kind in ["hash", "zset"] {
            let mut cursor = "0".to_owned();
            loop {
                let args = [cursor.as_str(), "MATCH", pattern, "COUNT", "1000", "TYPE", kind];
                let (next, page): (String, Vec<Key>) = on_node.custom(scan.clone(), args.to_vec()).await?;
                keys.extend(page);
                if next == "0" {
                    break;
                }
                cursor = next;
            }
        }
    }
    Ok(keys)
}

/// A Redis URL taken apart: `scheme://credentials@hosts/tail` (the credentials left
/// out: [`redact_url`] takes them apart its own way).
struct Parts<'a> {
    scheme: &'a str,
    /// Whether credentials come before the hosts (`user:password@`).
    credentials: bool,
    hosts: &'a str,
    /// The database and options, from the first `/` or `?`.
    tail: &'a str,
}

fn url_parts(url: &str) -> Parts<'_> {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let (credentials, rest) = credentials_end(rest).map_or((false, rest), |at| (true, &rest[at + 1..]));
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (hosts, tail) = rest.split_at(end);
    Parts {
        scheme,
        credentials,
        hosts,
        tail,
    }
}

/// The query parameters of a Redis URL that fred reads: an `@` in their values ends no
/// credentials.
const URL_PARAMETERS: [&str; 4] = ["node", "sentinelServiceName", "sentinelUsername", "sentinelPassword"];

/// Where the credentials of a URL's `rest` (past the scheme) end: at its last `@` that
/// stands in no value of a query parameter fred reads. Not at the first `/` or `?`, as
/// a URL parser reads it: a password with one unencoded would be read as the host,
/// and quoted by errors and logs (`default:pa?ss=word@main` too, whose `ss` is no
/// parameter). Nor at an `@` of such a parameter's value (`sentinelPassword=p@ss`),
/// which would take the hosts for credentials and show the rest of that password.
fn credentials_end(rest: &str) -> Option<usize> {
    let mut ats = rest.match_indices('@').map(|(at, _)| at).rev();
    ats.find(|&at| {
        let before = &rest[..at];
        let in_value = before.rfind(['?', '&']).is_some_and(|start| {
            let key = before[start + 1..].split_once('=').map(|(key, _)| key);
            before[..=start].contains('?')
                && key.is_some_and(|k| URL_PARAMETERS.iter().any(|p| p.eq_ignore_ascii_case(k)))
        });
        !in_value
    })
}

/// Groups `items` by the node that serves their slot, named by its address: a script
/// spans the slots of one node only, and calls to a node that does not answer hold up
/// no other node's. One group, named "", off a cluster or before the slot map is known.
pub fn by_node<T>(pool: &Pool, cluster: bool, items: Vec<T>, slot: impl Fn(&T) -> u16) -> HashMap<String, Vec<T>> {
    by_node_on(pool.next_connected(), cluster, items, slot)
}

/// [`by_node`] as `client`'s slot map has it.
fn by_node_on<T>(client: &Client, cluster: bool, items: Vec<T>, slot: impl Fn(&T) -> u16) -> HashMap<String, Vec<T>> {
    let mut groups: HashMap<String, Vec<T>> = HashMap::new();
    if items.is_empty() {
        return groups;
    }
    let routing = cluster.then(|| client.cached_cluster_state()).flatten();
    let Some(routing) = routing else {
        groups.insert(String::new(), items);
        return groups;
    };
    for item in items {
        let node = routing
            .get_server(slot(&item))
            .map(|s| s.to_string())
            .unwrap_or_default();
        groups.entry(node).or_default().push(item);
    }
    groups
}

/// Whether a Redis URL names a cluster (`redis-cluster://`, `rediss-cluster://`): fred
/// picks the deployment from the scheme's suffix alone.
pub fn is_cluster_url(url: &str) -> bool {
    url_parts(url).scheme.to_ascii_lowercase().ends_with("-cluster")
}

/// Where a Redis URL leads, as far as the URL tells: each `host:port` it names, the
/// scheme's default port filled in (26379 for sentinels, else 6379), and for a Sentinel
/// URL each sentinel with the service name (one Sentinel group may watch several
/// masters). Two URLs that share one lead to one deployment; what a URL cannot tell (a
/// host name and its address, an alias) the RedLock nodes' run ids do (see
/// [`identity`]).
pub fn url_endpoints(url: &str) -> Vec<String> {
    let Parts {
        scheme, hosts, tail, ..
    } = url_parts(url);
    let scheme = scheme.to_ascii_lowercase();
    if scheme.contains("unix") {
        return vec![format!("unix:{}", tail.split('?').next().unwrap_or(tail))];
    }
    let query = tail.split_once('?').map_or("", |(_, q)| q);
    let param = |name: &'static str| {
        query
            .split('&')
            .filter_map(|p| p.split_once('='))
            .filter(move |(k, _)| *k == name)
            .map(|(_, v)| v)
    };
    let port = if scheme.ends_with("-sentinel") { 26379 } else { 6379 };
    let endpoint = |authority: &str| {
        let a = authority.to_ascii_lowercase();
        let has_port = match a.strip_prefix('[') {
            Some(v6) => v6.contains("]:"),
            None => a.contains(':'),
        };
        if has_port {
            a
        } else {
            format!("{a}:{port}")
        }
    };
    let mut endpoints: Vec<String> = std::iter::once(hosts).chain(param("node")).map(endpoint).collect();
    if scheme.ends_with("-sentinel") {
        let service = param("sentinelServiceName").next().unwrap_or_default();
        for e in &mut endpoints {
            e.push_str(&format!(" (sentinelServiceName={service})"));
        }
    }
    endpoints.sort();
    endpoints.dedup();
    endpoints
}

/// `url` with its user information and `sentinelPassword` replaced by `***`, for
/// logs and errors. User information ends where [`credentials_end`] says, wherever a
/// `/` or `?` stands before it: a password written with one unencoded (which fred
/// reads as the start of a path or query, or refuses) must not show either.
pub fn redact_url(url: &str) -> String {
    let Parts {
        scheme,
        credentials,
        hosts,
        tail,
    } = url_parts(url);
    let authority = match credentials {
        true => format!("***@{hosts}"),
        false => hosts.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let params: Vec<String> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((k, _)) if k.eq_ignore_ascii_case("sentinelPassword") => format!("{k}=***"),
                    _ => p.to_owned(),
                })
                .collect();
            format!("{path}?{}", params.join("&"))
        }
        None => tail.to_owned(),
    };
    if scheme.is_empty() {
        format!("{authority}{tail}")
    } else {
        format!("{scheme}://{authority}{tail}")
    }
}

/// A subscriber: the only client that receives messages, so the only one with a deep
/// message buffer (every fred client preallocates its buffers).
fn subscriber_client(builder: &Builder) -> Result<SubscriberClient, fred::error::Error> {
    let mut builder = builder.clone();
    builder.with_performance_config(|p| p.broadcast_channel_capacity = PUBSUB_BUFFER);
    // A (un)subscribe cut off by a disconnect is not sent again on the new connection:
    // its caller has already been told it failed and decides again (the hub retries
    // what is still needed), while a late resend could subscribe a channel that nobody
    // waits on any more, which nothing would then unsubscribe.
    written_once(&builder).build_subscriber_client()
}

/// The connection of [`Backend::eval_once`]: a command cut off by a disconnect is not
/// written again on the new connection.
fn once_client(builder: &Builder) -> Result<Client, fred::error::Error> {
    written_once(builder).build()
}

/// `builder` for connections that write each command once.
fn written_once(builder: &Builder) -> Builder {
    let mut builder = builder.clone();
    builder.with_connection_config(|c| c.max_command_attempts = 1);
    builder
}

/// Whether a call was redirected by the cluster (no client follows a redirection, see
/// [`builder`]): Redis ran nothing of it.
pub fn redirected(e: &fred::error::Error) -> bool {
    *e.kind() == fred::error::ErrorKind::Routing && e.details() == "Too many redirections."
}

/// A builder with timeouts on everything and reconnection forever. Its clients follow
/// no cluster redirection: fred sends a command answered `ASK` to the slot's old master
/// again after the `ASKING` (never to the node that asked), until its attempts run out,
/// and then stops serving the client for good, every later command timing out. A
/// redirected call fails alone instead ([`redirected`]), after a `MOVED` with the slot
/// map brought up to date; scripts then go once more (`Script::loaded`).
fn builder(config: fred::prelude::Config, timeout: Duration) -> Builder {
    // A Redis that is loading its data answers `LOADING` on the connection it has:
    // reconnecting (fred's default) gains nothing, and each reconnection of the
    // subscriber wakes every waiter, whose tries meet `LOADING` again. Such a call fails
    // alone (`transient`). A read-only reply still reconnects, to find a promoted
    // primary; behind Sentinel a loading node may be a demoted primary in a full resync,
    // so there `LOADING` reconnects too, which asks Sentinel for the primary again.
    let mut reconnect_errors = vec![ReconnectError::ClusterDown, ReconnectError::ReadOnly];
    if matches!(config.server, ServerConfig::Sentinel { .. }) {
        reconnect_errors.push(ReconnectError::Loading);
    }
    let mut builder = Builder::from_config(config);
    builder
        .with_performance_config(|p| {
            p.default_command_timeout = timeout;
        })
        .with_connection_config(|c| {
            c.connection_timeout = timeout;
            c.internal_command_timeout = timeout;
            c.max_command_buffer_len = COMMAND_QUEUE_MAX;
            c.max_redirections = 0;
            c.reconnect_errors = reconnect_errors;
            c.unresponsive = UnresponsiveConfig {
                max_timeout: Some(timeout),
                interval: (timeout / 4).max(Duration::from_millis(50)),
            };
        })
        .set_policy(ReconnectPolicy::new_exponential(0, 50, 1_000, 2));
    builder
}

/// Whether a call failed before it was sent: its connection's command queue was full
/// (fred's bound, or the server's own below it in `Script::loaded`). It ran nothing.
pub fn unsent(e: &fred::error::Error) -> bool {
    *e.kind() == fred::error::ErrorKind::Backpressure
}

/// Whether a Redis failure may pass (a waiter in line or a Watch keeps going and tries
/// again): the connection or the reply, fred giving up on a command through a reconnect
/// storm or a slot move ([`gave_up`]), or a Redis that is loading, failing over or busy,
/// or refusing writes for now (too few replicas for `min-replicas-to-write`, a failed
/// background save, its memory limit: the outages health reports NOT_SERVING for),
/// by its error codes; not the command itself.
pub fn transient(e: &fred::error::Error) -> bool {
    use fred::error::ErrorKind;
    const PASSING: [&str; 9] = [
        "LOADING",
        "READONLY",
        "MASTERDOWN",
        "TRYAGAIN",
        "CLUSTERDOWN",
        "BUSY",
        "NOREPLICAS",
        "MISCONF",
        "OOM",
    ];
    matches!(
        e.kind(),
        ErrorKind::IO
            | ErrorKind::Timeout
            | ErrorKind::Canceled
            | ErrorKind::Backpressure
            | ErrorKind::Routing
            | ErrorKind::Cluster
    ) || gave_up(e)
        || PASSING.iter().any(|code| e.details().trim_start().starts_with(code))
}

/// The error a script's command raised, as Redis 7 answers it, where Redis 6.2 answers
/// it as the script's own: `ERR Error running script (call to f_…): @user_script:18:
/// WRONGTYPE …`, and for a command refused before it ran, `…: @user_script:1:
/// @user_script: 1: -READONLY …`. Read with its code first, it tells a passing outage
/// from the call's own fault ([`transient`], a foreign key) as on Redis 7; and a
/// read-only reply has `client` connect again, which fred does for a reply that starts
/// with `READONLY` only: behind an address that moved (a demoted primary whose
/// connections were left open), every call would fail until a restart.
pub async fn unwrapped(client: &impl ClientLike, e: fred::error::Error) -> fred::error::Error {
    let Some(raised) = raised_in_script(e.details()) else {
        return e;
    };
    let e = fred::error::Error::new(e.kind().clone(), raised.to_owned());
    if raised.starts_with("READONLY") && reconnection_due(client.id()) {
        // Bounded: the reconnection goes on in fred after the wait (its end is awaited
        // only to send the next try to the new node).
        let _ = tokio::time::timeout(READONLY_RECONNECT, client.force_reconnection()).await;
    }
    e
}

/// How long a call refused by a read-only Redis 6.2 waits for the reconnection it asks,
/// and how often a client is made to connect again so at most.
const READONLY_RECONNECT: Duration = Duration::from_secs(1);

/// Whether the client `id` is to connect again for a read-only reply: not when it was
/// made to within [`READONLY_RECONNECT`]. Every call in flight on the connection is
/// answered so, and each reconnection fred is made to do sends the commands in flight
/// again (an attempt of each counted, up to its failure): one for the lot, not one
/// per reply.
fn reconnection_due(id: &str) -> bool {
    static LAST: std::sync::LazyLock<std::sync::Mutex<HashMap<String, std::time::Instant>>> =
        std::sync::LazyLock::new(Default::default);
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    let now = std::time::Instant::now();
    if last
        .get(id)
        .is_some_and(|at| now.duration_since(*at) < READONLY_RECONNECT)
    {
        return false;
    }
    last.insert(id.to_owned(), now);
    true
}

/// The command's error inside Redis 6.2's answer for a script that raised it, or
/// `None` for another error ([`unwrapped`]).
fn raised_in_script(details: &str) -> Option<&str> {
    let (_, raised) = (details.strip_prefix("ERR Error running script (call to ")?).split_once("): @user_script:")?;
    let (_, raised) = raised.split_once(": ")?;
    let refused = raised.strip_prefix("@user_script: ").and_then(|r| r.split_once(": -"));
    Some(refused.map_or(raised, |(_, e)| e))
}

/// Whether fred gave up on a command after its attempts ran out: written on an earlier
/// attempt, it may have run. (Plain errors, told apart only by their text.)
pub fn gave_up(e: &fred::error::Error) -> bool {
    const GAVE_UP: [&str; 2] = ["Too many failed write attempts.", "Failed to route command."];
    *e.kind() == fred::error::ErrorKind::Unknown && GAVE_UP.contains(&e.details())
}

/// The first connection of `pool` to come free. (fred's `ExclusivePool::acquire`, with
/// every connection busy, waits for the one it tried first, which a stalled flow may
/// keep busy for a Redis timeout and more while the others grant a try a millisecond:
/// the tries queued on it would be refused.)
async fn first_free(pool: &ExclusivePool) -> tokio::sync::OwnedMutexGuard<Client> {
    let waits = pool.clients().iter().map(|c| Box::pin(c.clone().lock_owned()));
    futures::future::select_all(waits).await.0
}

#[cfg(test)]
mod tests {
    use super::Heard;

    /// A node is said silent when it stops answering, or after its first three pings
    /// from the start (its connection may still be coming up at the first), once, and
    /// said back when it answers again; a node that answers is no news.
    #[test]
    fn a_redlock_nodes_silence_and_return_are_news_once() {
        let pings = |answers: &[bool]| {
            let mut heard = Heard::Nothing(0);
            let mut news = Vec::new();
            for &answered in answers {
                let (now, said) = heard.after(answered);
                heard = now;
                news.push(said);
            }
            (heard, news)
        };
        assert_eq!(pings(&[true, true]), (Heard::Answering, vec![None, None]));
        let (heard, news) = pings(&[false, false, false, false, true]);
        assert_eq!(heard, Heard::Answering);
        assert_eq!(
            news,
            [None, None, Some(false), None, Some(true)],
            "down from the start, then back"
        );
        let (_, news) = pings(&[false, true, false, true]);
        assert_eq!(
            news,
            [None, None, Some(false), Some(true)],
            "up, then a flap: each change said"
        );
    }

    use super::{first_free, raised_in_script, reconnection_due, redact_url, transient};

    #[test]
    fn a_client_is_made_to_connect_again_once_for_a_wave_of_read_only_replies() {
        assert!(reconnection_due("wave-a"));
        assert!(!reconnection_due("wave-a"), "again within the second");
        assert!(reconnection_due("wave-b"), "another client's own");
    }

    /// Redis 6.2.14's answers for a script whose command failed (a run of it), and
    /// Redis 7.0's, which needs no unwrapping.
    #[test]
    fn the_error_a_script_raised_on_redis_6_2_is_read_as_its_commands() {
        let script = "ERR Error running script (call to f_4a9b759b9092fed26f7b6a8b27cf4d521164e5d9): ";
        let cases = [
            (
                "@user_script:18: WRONGTYPE Operation against a key holding the wrong kind of value",
                "WRONGTYPE Operation against a key holding the wrong kind of value",
            ),
            (
                "@user_script:1: @user_script: 1: -READONLY You can't write against a read only replica.",
                "READONLY You can't write against a read only replica.",
            ),
            (
                "@user_script:1: @user_script: 1: -NOREPLICAS Not enough good replicas to write.",
                "NOREPLICAS Not enough good replicas to write.",
            ),
        ];
        for (raised, command) in cases {
            assert_eq!(raised_in_script(&format!("{script}{raised}")), Some(command));
        }
        let redis_7 = "READONLY You can't write against a read only replica. script: 4a9b, on @user_script:18.";
        assert_eq!(raised_in_script(redis_7), None);
        assert_eq!(raised_in_script("NOSCRIPT No matching script."), None);
    }

    #[test]
    fn a_cluster_node_is_dialled_by_its_announced_host_name_else_its_ip() {
        use super::node_address;
        use fred::types::config::Server;
        let table = "a1 10.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460\n\
            b2 10.0.0.2:7001@17001,redis-b.example,shard-id=ff master - 0 0 2 connected\n\
            c3 10.0.0.3:7002@17002,shard-id=ee master - 0 0 3 connected\n\
            d4 :0@0 master,noaddr - 0 0 0 handshake\n";
        assert_eq!(node_address(table, "a1"), Some(Server::new("10.0.0.1", 7000)));
        assert_eq!(node_address(table, "b2"), Some(Server::new("redis-b.example", 7001)));
        assert_eq!(node_address(table, "c3"), Some(Server::new("10.0.0.3", 7002)));
        assert_eq!(node_address(table, "d4"), None);
        assert_eq!(node_address(table, "e5"), None);
    }

    #[test]
    fn urls_name_their_endpoints_with_default_ports() {
        use super::url_endpoints;
        assert_eq!(url_endpoints("redis://u:p@H/2"), ["h:6379"]);
        // A password with an unencoded `?` or `/` is no host, and is never quoted.
        assert_eq!(url_endpoints("redis://default:8123?s3cr3t@main:6379"), ["main:6379"]);
        assert_eq!(url_endpoints("redis://u:pa/ss@main"), ["main:6379"]);
        // An `@` in a query parameter's value is no end of credentials.
        assert_eq!(
            url_endpoints("redis-sentinel://s1:26379/0?sentinelServiceName=m&sentinelPassword=p@ss"),
            ["s1:26379 (sentinelServiceName=m)"]
        );
        assert_eq!(
            url_endpoints("redis-sentinel://u:p@s1/0?sentinelUsername=ops@corp&sentinelServiceName=m"),
            ["s1:26379 (sentinelServiceName=m)"]
        );
        assert_eq!(url_endpoints("redis://u:p&q@main"), ["main:6379"]);
        assert_eq!(url_endpoints("redis://default:pa?ss=word@main"), ["main:6379"]);
        assert_eq!(url_endpoints("rediss://h:6380?x=1"), ["h:6380"]);
        assert_eq!(url_endpoints("redis://[::1]"), ["[::1]:6379"]);
        assert_eq!(url_endpoints("redis://[::1]:7"), ["[::1]:7"]);
        assert_eq!(
            url_endpoints("redis-cluster://a:7000?node=b:7001&node=a:7000"),
            ["a:7000", "b:7001"]
        );
        assert_eq!(
            url_endpoints("redis-sentinel://s?sentinelServiceName=m1&node=t:26380"),
            ["s:26379 (sentinelServiceName=m1)", "t:26380 (sentinelServiceName=m1)"]
        );
    }

    #[test]
    fn urls_lose_their_credentials() {
        assert_eq!(redact_url("redis://u:p@h:1/0"), "redis://***@h:1/0");
        assert_eq!(redact_url("rediss://:p@h"), "rediss://***@h");
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
        assert_eq!(
            redact_url("redis-sentinel://a:b@s:26379?sentinelServiceName=m&sentinelPassword=x"),
            "redis-sentinel://***@s:26379?sentinelServiceName=m&sentinelPassword=***"
        );
        // A password with an unencoded `?` or `/`: fred reads the first as a query.
        assert_eq!(
            redact_url("redis://default:8123?s3cr3t@node1:6379"),
            "redis://***@node1:6379"
        );
        assert_eq!(redact_url("redis://u:pa/ss@h:1/0"), "redis://***@h:1/0");
        assert_eq!(
            redact_url("redis://default:pa?ss=word@main:6379"),
            "redis://***@main:6379"
        );
        // An `@` in the sentinel password's value: the hosts show, the password not.
        assert_eq!(
            redact_url("redis-sentinel://h:26379/0?sentinelServiceName=m&sentinelPassword=pre@SecretTail&node=s2"),
            "redis-sentinel://h:26379/0?sentinelServiceName=m&sentinelPassword=***&node=s2"
        );
    }

    #[test]
    fn failures_that_pass_keep_a_waiter_and_a_watch_going() {
        use fred::error::{Error as RedisError, ErrorKind};
        assert!(transient(&RedisError::new(ErrorKind::Timeout, "Request timed out.")));
        assert!(transient(&RedisError::new(ErrorKind::IO, "Connection closed.")));
        assert!(transient(&RedisError::new(
            ErrorKind::Unknown,
            "LOADING Redis is loading"
        )));
        assert!(transient(&RedisError::new(
            ErrorKind::Unknown,
            "Too many failed write attempts."
        )));
        assert!(transient(&RedisError::new(
            ErrorKind::Unknown,
            "Failed to route command."
        )));
        for refusing_writes in [
            "NOREPLICAS Not enough good replicas to write.",
            "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
            "OOM command not allowed when used memory > 'maxmemory'.",
        ] {
            assert!(transient(&RedisError::new(ErrorKind::Unknown, refusing_writes)));
        }
        assert!(!transient(&RedisError::new(
            ErrorKind::Unknown,
            "WRONGTYPE Operation against a key"
        )));
        assert!(!transient(&RedisError::new(
            ErrorKind::Unknown,
            "ERR user_script:1: bad"
        )));
    }

    /// Every connection busy, the first to come free is taken: fred's pool waited for
    /// the one it tried first (in turn, one after another), which a stalled flow may
    /// keep busy for long. Freed in an order no such turn follows.
    #[tokio::test]
    async fn a_replicated_grant_takes_the_first_connection_to_come_free() {
        use std::sync::Arc;
        let pool = fred::types::Builder::default_centralized()
            .build_exclusive_pool(3)
            .unwrap();
        let mut held: Vec<_> = pool
            .clients()
            .iter()
            .map(|c| Some(c.clone().try_lock_owned().unwrap()))
            .collect();
        for freed in [0, 2, 1] {
            let waiting = tokio::spawn({
                let pool = pool.clone();
                async move { first_free(&pool).await }
            });
            // The waiter tried every connection, and waits.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            held[freed] = None;
            let taken = tokio::time::timeout(std::time::Duration::from_secs(1), waiting).await;
            let taken = taken.expect("the connection that came free is taken").unwrap();
            let mutex = tokio::sync::OwnedMutexGuard::mutex(&taken);
            assert!(Arc::ptr_eq(mutex, &pool.clients()[freed]), "connection {freed}");
            held[freed] = Some(taken);
        }
    }
}
