//! `RedissonFairLock` (`RFairLock`): the FIFO lock, a queue list and a timeout sorted
//! set beside the lock hash; each waiter is woken on its own channel.

use super::{eval, lock_channel, now_ms, prefix_name, scripts, unlock_with_latch};
use super::{wait_for_unlocks, DEFAULT_LOCK_WATCHDOG_TIMEOUT_MS, UNLOCK_MESSAGE};
use super::{PublishCommand, Subscription, DEFAULT_FAIR_LOCK_WAIT_TIMEOUT_MS};
use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

/// A Redisson fair lock on `name` held as one owner.
#[derive(Debug)]
pub struct RedissonFairLock {
    client: Client,
    name: String,
    owner: String,
    publish: PublishCommand,
    thread_wait_ms: i64,
    internal_lease_ms: AtomicI64,
}

impl RedissonFairLock {
    /// A fair lock `name` held as `owner`, with the default 5 s `fairLockWaitTimeout`
    /// and `PUBLISH`.
    pub fn new(client: &Client, name: &str, owner: &str) -> RedissonFairLock {
        RedissonFairLock {
            client: client.clone(),
            name: name.to_owned(),
            owner: owner.to_owned(),
            publish: PublishCommand::Publish,
            thread_wait_ms: DEFAULT_FAIR_LOCK_WAIT_TIMEOUT_MS,
            internal_lease_ms: AtomicI64::new(DEFAULT_LOCK_WATCHDOG_TIMEOUT_MS),
        }
    }

    /// Uses `publish` for unlock messages (and the matching subscribe command).
    pub fn with_publish(mut self, publish: PublishCommand) -> RedissonFairLock {
        self.publish = publish;
        self
    }

    /// Sets `fairLockWaitTimeout`, how long a queued waiter keeps its place.
    pub fn with_thread_wait(mut self, wait_ms: i64) -> RedissonFairLock {
        self.thread_wait_ms = wait_ms;
        self
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The owner id.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The queue list, `redisson_lock_queue:{name}`.
    pub fn queue_name(&self) -> String {
        prefix_name("redisson_lock_queue", &self.name)
    }

    /// The timeout sorted set, `redisson_lock_timeout:{name}`.
    pub fn timeout_set_name(&self) -> String {
        prefix_name("redisson_lock_timeout", &self.name)
    }

    /// This owner's wake-up channel, `redisson_lock__channel:{name}:<owner>`.
    pub fn owner_channel(&self) -> String {
        format!("{}:{}", lock_channel(&self.name), self.owner)
    }

    /// One `tryLockInnerAsync` (`EVAL_LONG`) with the configured thread wait: `None`
    /// when acquired, else a TTL to wait; a refused owner is enqueued.
    pub async fn try_lock(&self, lease_ms: i64) -> Option<i64> {
        self.try_lock_waiting(self.thread_wait_ms, lease_ms).await
    }

    /// The same with an explicit `wait_ms` (Java passes `waitTime` when positive).
    pub async fn try_lock_waiting(&self, wait_ms: i64, lease_ms: i64) -> Option<i64> {
        let ttl: Option<i64> = eval(
            &self.client,
            "RedissonFairLock.tryLock",
            scripts::FAIR_TRY_LOCK,
            self.keys(),
            vec![
                lease_ms.to_string(),
                self.owner.clone(),
                wait_ms.to_string(),
                now_ms().to_string(),
            ],
        )
        .await;
        if ttl.is_none() {
            self.internal_lease_ms.store(lease_ms, Ordering::Relaxed);
        }
        ttl
    }

    /// Java's `tryLock()` (`EVAL_NULL_BOOLEAN`): one attempt that never enqueues;
    /// whether it acquired.
    pub async fn try_lock_once(&self, lease_ms: i64) -> bool {
        let refused: Option<i64> = eval(
            &self.client,
            "RedissonFairLock.tryLockOnce",
            scripts::FAIR_TRY_LOCK_ONCE,
            self.keys(),
            vec![
                lease_ms.to_string(),
                self.owner.clone(),
                now_ms().to_string(),
                self.thread_wait_ms.to_string(),
            ],
        )
        .await;
        if refused.is_none() {
            self.internal_lease_ms.store(lease_ms, Ordering::Relaxed);
        }
        refused.is_none()
    }

    /// Java's `tryLock(waitTime, leaseTime)`: queues, waits on the owner channel, and
    /// leaves the queue (`acquireFailedAsync`) when `wait` passes. Whether it acquired.
    pub async fn lock(&self, wait: Duration, lease_ms: i64) -> bool {
        let wait_ms = i64::try_from(wait.as_millis()).expect("wait fits i64");
        if self.try_lock_waiting(wait_ms, lease_ms).await.is_none() {
            return true;
        }
        let deadline = Instant::now() + wait;
        let sub = self.subscribe().await;
        let acquired = wait_for_unlocks(sub, deadline, || self.try_lock_waiting(wait_ms, lease_ms)).await;
        if !acquired {
            self.acquire_failed(wait_ms).await;
        }
        acquired
    }

    /// `acquireFailedAsync`: removes this owner from the queue and gives its wait time
    /// back to those behind it.
    pub async fn acquire_failed(&self, wait_ms: i64) {
        let _: Option<i64> = eval(
            &self.client,
            "RedissonFairLock.acquireFailed",
            scripts::FAIR_ACQUIRE_FAILED,
            vec![self.queue_name(), self.timeout_set_name()],
            vec![self.owner.clone(), wait_ms.to_string()],
        )
        .await;
    }

    /// `unlockInnerAsync`: `None` when not held by this owner, `Some(false)` when a
    /// hold remains, `Some(true)` when released (the queue head is woken).
    pub async fn unlock(&self) -> Option<bool> {
        let mut keys = self.keys();
        keys.push(lock_channel(&self.name));
        unlock_with_latch(
            &self.client,
            "RedissonFairLock.unlock",
            scripts::FAIR_UNLOCK,
            &self.name,
            keys,
            vec![
                UNLOCK_MESSAGE.to_owned(),
                self.internal_lease_ms.load(Ordering::Relaxed).to_string(),
                self.owner.clone(),
                now_ms().to_string(),
                self.publish.as_str().to_owned(),
            ],
        )
        .await
    }

    /// The watchdog renewal (`RedissonBaseLock.renewExpirationAsync`).
    pub async fn renew(&self, lease_ms: i64) -> bool {
        let renewed: i64 = eval(
            &self.client,
            "RedissonFairLock.renew",
            scripts::LOCK_RENEW,
            vec![self.name.clone()],
            vec![lease_ms.to_string(), self.owner.clone()],
        )
        .await;
        renewed == 1
    }

    /// `forceUnlockAsync`: deletes the lock and wakes the queue head.
    pub async fn force_unlock(&self) -> bool {
        let mut keys = self.keys();
        keys.push(lock_channel(&self.name));
        let deleted: i64 = eval(
            &self.client,
            "RedissonFairLock.forceUnlock",
            scripts::FAIR_FORCE_UNLOCK,
            keys,
            vec![
                UNLOCK_MESSAGE.to_owned(),
                now_ms().to_string(),
                self.publish.as_str().to_owned(),
            ],
        )
        .await;
        deleted == 1
    }

    /// The owners queued now, head first (`LRANGE` of the queue).
    pub async fn queue(&self) -> Vec<String> {
        // Through CUSTOM: the workspace's fred build has no list interface.
        let lrange = CustomCommand::new_static("LRANGE", ClusterHash::FirstKey, false);
        self.client
            .custom(lrange, vec![self.queue_name(), "0".to_owned(), "-1".to_owned()])
            .await
            .unwrap_or_else(|err| panic!("LRANGE {}: {err}", self.queue_name()))
    }

    /// Subscribes to this owner's wake-up channel.
    pub async fn subscribe(&self) -> Subscription {
        Subscription::open(&self.client, &self.owner_channel(), self.publish).await
    }

    fn keys(&self) -> Vec<String> {
        vec![self.name.clone(), self.queue_name(), self.timeout_set_name()]
    }
}
