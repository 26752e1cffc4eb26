//! A Redisson 3.x stand-in: sends Redisson's own lock scripts with its KEYS/ARGV, key
//! and channel names, so tests can prove latchkey and a Java service exclude each other
//! and wake each other on the same Redis.
//!
//! Names follow Redisson's `prefixName`/`suffixName`: a name with `{` is used as is,
//! otherwise it is wrapped in `{…}`, so every key and channel of a lock shares one slot.

mod fair;
mod read_write;
pub mod scripts;

pub use fair::RedissonFairLock;
pub use read_write::{rwlock_channel, RedissonReadLock, RedissonWriteLock};

use fred::prelude::*;
use fred::types::Message;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::broadcast::Receiver;

/// `LockPubSub.UNLOCK_MESSAGE`: published when a lock (or a read lock) is released.
pub const UNLOCK_MESSAGE: &str = "0";
/// `LockPubSub.READ_UNLOCK_MESSAGE`: published when a write lock is released; it wakes
/// every waiter.
pub const READ_UNLOCK_MESSAGE: &str = "1";
/// `Config.lockWatchdogTimeout` default: the lease of a lock taken without one.
pub const DEFAULT_LOCK_WATCHDOG_TIMEOUT_MS: i64 = 30_000;
/// How long the tests' Redisson fair-lock waiters keep their place unless they set
/// another (`with_thread_wait`): 5 s, short for the tests' sake. Redisson's own default
/// (`Config.fairLockWaitTimeout`) is 5 minutes, which
/// `a_redisson_grant_at_the_default_wait_leaves_everyone_queued_in_place` uses.
pub const DEFAULT_FAIR_LOCK_WAIT_TIMEOUT_MS: i64 = 5_000;
/// Lifetime of the unlock latch key, Redisson's `(timeout + retryInterval) *
/// retryAttempts` with the defaults 3000, 1500 and 3.
pub const UNLOCK_LATCH_TIMEOUT_MS: i64 = 13_500;

/// The command Redisson's unlock scripts publish with (`getPublishCommand()`):
/// `SPUBLISH` on a Redis 7 cluster (sharded pub/sub), `PUBLISH` elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishCommand {
    /// Classic pub/sub; subscribers use `SUBSCRIBE`.
    Publish,
    /// Sharded pub/sub; subscribers use `SSUBSCRIBE` on the channel's slot owner.
    Spublish,
}

impl PublishCommand {
    /// The command name as Redisson passes it in ARGV.
    pub fn as_str(self) -> &'static str {
        match self {
            PublishCommand::Publish => "PUBLISH",
            PublishCommand::Spublish => "SPUBLISH",
        }
    }

    /// What Redisson picks for a deployment: `SPUBLISH` for a `redis-cluster://` URL.
    pub fn for_url(url: &str) -> PublishCommand {
        if url.starts_with("redis-cluster://") || url.starts_with("rediss-cluster://") {
            PublishCommand::Spublish
        } else {
            PublishCommand::Publish
        }
    }
}

/// Redisson's `prefixName(prefix, name)`: `prefix:name` when `name` has a `{`, else
/// `prefix:{name}`.
pub fn prefix_name(prefix: &str, name: &str) -> String {
    if name.contains('{') {
        format!("{prefix}:{name}")
    } else {
        format!("{prefix}:{{{name}}}")
    }
}

/// Redisson's `suffixName(name, suffix)`: `name:suffix` when `name` has a `{`, else
/// `{name}:suffix`.
pub fn suffix_name(name: &str, suffix: &str) -> String {
    if name.contains('{') {
        format!("{name}:{suffix}")
    } else {
        format!("{{{name}}}:{suffix}")
    }
}

/// The unlock channel of an `RLock`: `redisson_lock__channel:{name}`.
pub fn lock_channel(name: &str) -> String {
    prefix_name("redisson_lock__channel", name)
}

/// A Redisson owner id, `<client uuid>:<thread id>`.
pub fn owner_id(client_uuid: &str, thread_id: u64) -> String {
    format!("{client_uuid}:{thread_id}")
}

/// A fresh owner id: a random client UUID and thread id 1.
pub fn random_owner() -> String {
    owner_id(&uuid::Uuid::new_v4().to_string(), 1)
}

/// The current time in ms since the epoch (`System.currentTimeMillis()`).
pub fn now_ms() -> i64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970");
    i64::try_from(since.as_millis()).expect("time fits i64")
}

/// Runs a script with EVAL as Redisson does and converts the reply; panics with the
/// script's role on a Redis error.
pub(crate) async fn eval<R: FromValue>(
    client: &Client,
    what: &str,
    script: &str,
    keys: Vec<String>,
    args: Vec<String>,
) -> R {
    client
        .eval(script, keys, args)
        .await
        .unwrap_or_else(|err| panic!("Redisson {what} script failed: {err}"))
}

/// Redisson's unlock latch key for one unlock request: `redisson_unlock_latch:{name}:<id>`.
pub(crate) fn unlock_latch(name: &str) -> String {
    format!(
        "{}:{}",
        prefix_name("redisson_unlock_latch", name),
        uuid::Uuid::new_v4().simple()
    )
}
/// Redisson's unlock with an unlock latch: the latch key goes last in KEYS, its
/// lifetime last in ARGV, and the latch is deleted afterwards as Redisson does. Returns
/// `None` when not held, `Some(true)` when the lock was released, `Some(false)` when a
/// hold remains.
pub(crate) async fn unlock_with_latch(
    client: &Client,
    what: &str,
    script: &str,
    name: &str,
    mut keys: Vec<String>,
    mut args: Vec<String>,
) -> Option<bool> {
    let latch = unlock_latch(name);
    keys.push(latch.clone());
    args.push(UNLOCK_LATCH_TIMEOUT_MS.to_string());
    let released: Option<i64> = eval(client, what, script, keys, args).await;
    delete_latch(client, latch).await;
    released.map(|r| r == 1)
}

/// Deletes the unlock latch after the unlock script, as `RedissonBaseLock` does.
pub(crate) async fn delete_latch(client: &Client, latch: String) {
    let _: i64 = client
        .del(latch)
        .await
        .unwrap_or_else(|err| panic!("delete Redisson unlock latch: {err}"));
}

/// Redisson's waiting loop (`RedissonLock.tryLock`, its lock kinds alike), once a first
/// try failed and `sub` listens: tries again on each message, or when the TTL the last
/// try answered runs out, until `deadline`. Whether a try acquired; `sub` is closed.
pub async fn wait_for_unlocks<F, Fut>(mut sub: Subscription, deadline: Instant, mut try_lock: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<i64>>,
{
    let acquired = loop {
        let Some(ttl) = try_lock().await else {
            break true;
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break false;
        }
        let ttl = u64::try_from(ttl).map(Duration::from_millis).unwrap_or(left);
        sub.next_message(ttl.min(left)).await;
    };
    sub.close().await;
    acquired
}

/// A dedicated pub/sub connection listening on one channel, the way Redisson's
/// `LockPubSub` waits for unlock messages.
#[derive(Debug)]
pub struct Subscription {
    client: Client,
    channel: String,
    rx: Receiver<Message>,
}

impl Subscription {
    /// Opens a new connection (same config as `client`) and `SUBSCRIBE`s, or
    /// `SSUBSCRIBE`s for [`PublishCommand::Spublish`], to `channel`. Messages published
    /// after this returns are received.
    pub async fn open(client: &Client, channel: &str, publish: PublishCommand) -> Subscription {
        let sub = client.clone_new();
        sub.init()
            .await
            .unwrap_or_else(|err| panic!("connect a subscriber for {channel}: {err}"));
        // Take the receiver before subscribing so nothing published in between is lost.
        let rx = sub.message_rx();
        let subscribed = match publish {
            PublishCommand::Publish => sub.subscribe(channel).await,
            PublishCommand::Spublish => sub.ssubscribe(channel).await,
        };
        subscribed.unwrap_or_else(|err| panic!("subscribe to {channel}: {err}"));
        Subscription {
            client: sub,
            channel: channel.to_owned(),
            rx,
        }
    }

    /// The channel listened to.
    pub fn channel(&self) -> &str {
        &self.channel
    }

    /// The next message on the channel, or `None` when `timeout` passes first.
    pub async fn next_message(&mut self, timeout: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let received = tokio::time::timeout_at(deadline, self.rx.recv()).await.ok()?;
            match received {
                Ok(message) if *message.channel == *self.channel => {
                    return Some(message.value.as_string().unwrap_or_default());
                }
                Ok(_) | Err(RecvError::Lagged(_)) => continue,
                Err(RecvError::Closed) => return None,
            }
        }
    }

    /// Closes the connection.
    pub async fn close(self) {
        let _ = self.client.quit().await;
    }
}

/// `RedissonLock` (`RLock`): the reentrant, non-fair lock, a hash at `name` whose field
/// is the owner and whose value is the hold count.
#[derive(Debug)]
pub struct RedissonLock {
    client: Client,
    name: String,
    owner: String,
    publish: PublishCommand,
    internal_lease_ms: AtomicI64,
}

impl RedissonLock {
    /// A lock `name` held as `owner` (`<uuid>:<threadId>`) through `client`, publishing
    /// with `PUBLISH` (see [`RedissonLock::with_publish`]).
    pub fn new(client: &Client, name: &str, owner: &str) -> RedissonLock {
        RedissonLock {
            client: client.clone(),
            name: name.to_owned(),
            owner: owner.to_owned(),
            publish: PublishCommand::Publish,
            internal_lease_ms: AtomicI64::new(DEFAULT_LOCK_WATCHDOG_TIMEOUT_MS),
        }
    }

    /// Uses `publish` for unlock messages (and the matching subscribe command).
    pub fn with_publish(mut self, publish: PublishCommand) -> RedissonLock {
        self.publish = publish;
        self
    }

    /// The lock's key.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The owner id (hash field).
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The unlock channel, `redisson_lock__channel:{name}`.
    pub fn channel(&self) -> String {
        lock_channel(&self.name)
    }

    /// One `tryLockInnerAsync` with a lease of `lease_ms`: `None` when acquired (or
    /// re-entered), else the holder's remaining PTTL.
    pub async fn try_lock(&self, lease_ms: i64) -> Option<i64> {
        let ttl: Option<i64> = eval(
            &self.client,
            "RedissonLock.tryLock",
            scripts::LOCK_TRY_LOCK,
            vec![self.name.clone()],
            vec![lease_ms.to_string(), self.owner.clone()],
        )
        .await;
        if ttl.is_none() {
            self.internal_lease_ms.store(lease_ms, Ordering::Relaxed);
        }
        ttl
    }

    /// Java's `tryLock(waitTime, leaseTime)`: tries, then subscribes to the channel and
    /// retries on each unlock message (or when the holder's TTL runs out) until `wait`
    /// passes. Returns whether the lock was acquired.
    pub async fn lock(&self, wait: Duration, lease_ms: i64) -> bool {
        self.lock_listening_on(&self.client, wait, lease_ms).await
    }

    /// [`RedissonLock::lock`] with the subscription on the node `listener` reaches: a
    /// replica, as Redisson's default `subscriptionMode` has it with Sentinel or
    /// master/slave servers. The tries still go to this lock's client.
    pub async fn lock_listening_on(&self, listener: &Client, wait: Duration, lease_ms: i64) -> bool {
        if self.try_lock(lease_ms).await.is_none() {
            return true;
        }
        let deadline = Instant::now() + wait;
        let sub = Subscription::open(listener, &self.channel(), self.publish).await;
        wait_for_unlocks(sub, deadline, || self.try_lock(lease_ms)).await
    }

    /// `unlockInnerAsync`: `None` when this owner does not hold the lock, `Some(false)`
    /// when a hold remains, `Some(true)` when released (and "0" published).
    pub async fn unlock(&self) -> Option<bool> {
        unlock_with_latch(
            &self.client,
            "RedissonLock.unlock",
            scripts::LOCK_UNLOCK,
            &self.name,
            vec![self.name.clone(), self.channel()],
            vec![
                UNLOCK_MESSAGE.to_owned(),
                self.internal_lease_ms.load(Ordering::Relaxed).to_string(),
                self.owner.clone(),
                self.publish.as_str().to_owned(),
            ],
        )
        .await
    }

    /// The watchdog's `renewExpirationAsync` with `lease_ms`: whether this owner still
    /// held the lock and its TTL was reset.
    pub async fn renew(&self, lease_ms: i64) -> bool {
        let renewed: i64 = eval(
            &self.client,
            "RedissonLock.renew",
            scripts::LOCK_RENEW,
            vec![self.name.clone()],
            vec![lease_ms.to_string(), self.owner.clone()],
        )
        .await;
        renewed == 1
    }

    /// `forceUnlockAsync`: deletes the lock whoever holds it and publishes "0"; whether
    /// there was a lock.
    pub async fn force_unlock(&self) -> bool {
        let deleted: i64 = eval(
            &self.client,
            "RedissonLock.forceUnlock",
            scripts::LOCK_FORCE_UNLOCK,
            vec![self.name.clone(), self.channel()],
            vec![UNLOCK_MESSAGE.to_owned(), self.publish.as_str().to_owned()],
        )
        .await;
        deleted == 1
    }

    /// `getHoldCount()`: this owner's hold count, 0 when it holds nothing.
    pub async fn hold_count(&self) -> i64 {
        let count: Option<i64> = self
            .client
            .hget(&self.name, &self.owner)
            .await
            .unwrap_or_else(|err| panic!("HGET {} {}: {err}", self.name, self.owner));
        count.unwrap_or(0)
    }

    /// Subscribes to the unlock channel (as a waiter does before waiting).
    pub async fn subscribe(&self) -> Subscription {
        Subscription::open(&self.client, &self.channel(), self.publish).await
    }

    /// Subscribes, then waits up to `timeout` for the next unlock message. Subscribe
    /// with [`RedissonLock::subscribe`] first when the unlock may already be under way.
    pub async fn wait_unlock(&self, timeout: Duration) -> Option<String> {
        let mut sub = self.subscribe().await;
        let message = sub.next_message(timeout).await;
        sub.close().await;
        message
    }
}
