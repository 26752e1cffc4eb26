//! `RedissonReadLock` and `RedissonWriteLock`, the halves of `RReadWriteLock`: one hash
//! with a `mode` field (`read`/`write`), per-hold reader timeout keys
//! `{name}:<owner>:rwlock_timeout:<n>`, and the channel `redisson_rwlock:{name}`.

use super::{eval, prefix_name, scripts, suffix_name, unlock_with_latch};
use super::{wait_for_unlocks, READ_UNLOCK_MESSAGE, UNLOCK_MESSAGE};
use super::{PublishCommand, Subscription, DEFAULT_LOCK_WATCHDOG_TIMEOUT_MS};
use fred::prelude::*;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

/// The channel both halves publish on: `redisson_rwlock:{name}`.
pub fn rwlock_channel(name: &str) -> String {
    prefix_name("redisson_rwlock", name)
}

/// The read half of a Redisson read/write lock, held as one owner.
#[derive(Debug)]
pub struct RedissonReadLock {
    client: Client,
    name: String,
    owner: String,
    publish: PublishCommand,
}

impl RedissonReadLock {
    /// The read lock of `name` held as `owner`, publishing with `PUBLISH`.
    pub fn new(client: &Client, name: &str, owner: &str) -> RedissonReadLock {
        RedissonReadLock {
            client: client.clone(),
            name: name.to_owned(),
            owner: owner.to_owned(),
            publish: PublishCommand::Publish,
        }
    }

    /// Uses `publish` for unlock messages (and the matching subscribe command).
    pub fn with_publish(mut self, publish: PublishCommand) -> RedissonReadLock {
        self.publish = publish;
        self
    }

    /// The channel, `redisson_rwlock:{name}`.
    pub fn channel(&self) -> String {
        rwlock_channel(&self.name)
    }

    /// This owner's reader timeout prefix, `{name}:<owner>:rwlock_timeout`; hold `n`
    /// lives at `<prefix>:<n>`.
    pub fn timeout_prefix(&self) -> String {
        format!("{}:rwlock_timeout", suffix_name(&self.name, &self.owner))
    }

    /// `getKeyPrefix`: the timeout prefix cut before `:<owner>`, i.e. `{name}`.
    fn key_prefix(&self) -> String {
        let prefix = self.timeout_prefix();
        let cut = format!(":{}", self.owner);
        prefix.split(cut.as_str()).next().unwrap_or_default().to_owned()
    }

    /// `tryLockInnerAsync`: `None` when acquired (also under this owner's own write
    /// lock), else the lock's PTTL.
    pub async fn try_lock(&self, lease_ms: i64) -> Option<i64> {
        eval(
            &self.client,
            "RedissonReadLock.tryLock",
            scripts::READ_TRY_LOCK,
            vec![self.name.clone(), self.timeout_prefix()],
            vec![
                lease_ms.to_string(),
                self.owner.clone(),
                format!("{}:write", self.owner),
            ],
        )
        .await
    }

    /// `unlockInnerAsync`: `None` when not held, `Some(false)` when the hash stays
    /// (other readers or holds), `Some(true)` when deleted and "0" published.
    pub async fn unlock(&self) -> Option<bool> {
        unlock_with_latch(
            &self.client,
            "RedissonReadLock.unlock",
            scripts::READ_UNLOCK,
            &self.name,
            vec![
                self.name.clone(),
                self.channel(),
                self.timeout_prefix(),
                self.key_prefix(),
            ],
            vec![
                UNLOCK_MESSAGE.to_owned(),
                self.owner.clone(),
                self.publish.as_str().to_owned(),
            ],
        )
        .await
    }

    /// The read lock's watchdog renewal: the hash and every reader timeout key.
    pub async fn renew(&self, lease_ms: i64) -> bool {
        let renewed: i64 = eval(
            &self.client,
            "RedissonReadLock.renew",
            scripts::READ_RENEW,
            vec![self.name.clone(), self.key_prefix()],
            vec![lease_ms.to_string(), self.owner.clone()],
        )
        .await;
        renewed == 1
    }

    /// `forceUnlockAsync`: deletes the lock when in read mode.
    pub async fn force_unlock(&self) -> bool {
        let deleted: i64 = eval(
            &self.client,
            "RedissonReadLock.forceUnlock",
            scripts::READ_FORCE_UNLOCK,
            vec![self.name.clone(), self.channel()],
            vec![UNLOCK_MESSAGE.to_owned(), self.publish.as_str().to_owned()],
        )
        .await;
        deleted == 1
    }

    /// Subscribes to `redisson_rwlock:{name}`.
    pub async fn subscribe(&self) -> Subscription {
        Subscription::open(&self.client, &self.channel(), self.publish).await
    }

    /// Java's `readLock().tryLock(wait, lease)`: tries, then listens on the lock's
    /// channel and tries again on each message (or when the TTL it was told runs out)
    /// until `wait` passes. Whether it acquired.
    pub async fn lock(&self, wait: Duration, lease_ms: i64) -> bool {
        if self.try_lock(lease_ms).await.is_none() {
            return true;
        }
        let deadline = Instant::now() + wait;
        let sub = self.subscribe().await;
        wait_for_unlocks(sub, deadline, || self.try_lock(lease_ms)).await
    }
}

/// The write half of a Redisson read/write lock; its hash field is `<owner>:write`.
#[derive(Debug)]
pub struct RedissonWriteLock {
    client: Client,
    name: String,
    field: String,
    publish: PublishCommand,
    internal_lease_ms: AtomicI64,
}

impl RedissonWriteLock {
    /// The write lock of `name` held as `owner`, publishing with `PUBLISH`.
    pub fn new(client: &Client, name: &str, owner: &str) -> RedissonWriteLock {
        RedissonWriteLock {
            client: client.clone(),
            name: name.to_owned(),
            field: format!("{owner}:write"),
            publish: PublishCommand::Publish,
            internal_lease_ms: AtomicI64::new(DEFAULT_LOCK_WATCHDOG_TIMEOUT_MS),
        }
    }

    /// Uses `publish` for unlock messages (and the matching subscribe command).
    pub fn with_publish(mut self, publish: PublishCommand) -> RedissonWriteLock {
        self.publish = publish;
        self
    }

    /// The hash field, `<owner>:write`.
    pub fn field(&self) -> &str {
        &self.field
    }

    /// The channel, `redisson_rwlock:{name}`.
    pub fn channel(&self) -> String {
        rwlock_channel(&self.name)
    }

    /// `tryLockInnerAsync`: `None` when acquired or re-entered, else the lock's PTTL.
    pub async fn try_lock(&self, lease_ms: i64) -> Option<i64> {
        let ttl: Option<i64> = eval(
            &self.client,
            "RedissonWriteLock.tryLock",
            scripts::WRITE_TRY_LOCK,
            vec![self.name.clone()],
            vec![lease_ms.to_string(), self.field.clone()],
        )
        .await;
        if ttl.is_none() {
            self.internal_lease_ms.store(lease_ms, Ordering::Relaxed);
        }
        ttl
    }

    /// `unlockInnerAsync`: `None` when not held, `Some(false)` when a hold remains,
    /// `Some(true)` when released ("1" published unless readers remain).
    pub async fn unlock(&self) -> Option<bool> {
        unlock_with_latch(
            &self.client,
            "RedissonWriteLock.unlock",
            scripts::WRITE_UNLOCK,
            &self.name,
            vec![self.name.clone(), self.channel()],
            vec![
                READ_UNLOCK_MESSAGE.to_owned(),
                self.internal_lease_ms.load(Ordering::Relaxed).to_string(),
                self.field.clone(),
                self.publish.as_str().to_owned(),
            ],
        )
        .await
    }

    /// The watchdog renewal of `<owner>:write`.
    pub async fn renew(&self, lease_ms: i64) -> bool {
        let renewed: i64 = eval(
            &self.client,
            "RedissonWriteLock.renew",
            scripts::LOCK_RENEW,
            vec![self.name.clone()],
            vec![lease_ms.to_string(), self.field.clone()],
        )
        .await;
        renewed == 1
    }

    /// `forceUnlockAsync`: deletes the lock when in write mode and publishes "1".
    pub async fn force_unlock(&self) -> bool {
        let deleted: i64 = eval(
            &self.client,
            "RedissonWriteLock.forceUnlock",
            scripts::WRITE_FORCE_UNLOCK,
            vec![self.name.clone(), self.channel()],
            vec![READ_UNLOCK_MESSAGE.to_owned(), self.publish.as_str().to_owned()],
        )
        .await;
        deleted == 1
    }

    /// Subscribes to `redisson_rwlock:{name}`.
    pub async fn subscribe(&self) -> Subscription {
        Subscription::open(&self.client, &self.channel(), self.publish).await
    }
}
