//! The lock implementations under test, behind one `acquire`/`release` shape:
//! latchkey (mutex or fair, through the Rust client), the Redisson `RLock` protocol
//! driven directly against Redis with Redisson's pub/sub waiting, etcd's v3 lock with
//! a session lease (one per task, as an etcd session keeps for many locks), and the
//! `rslock` Redlock client.

use fred::clients::SubscriberClient;
use fred::prelude::*;
use fred::types::scripts::Script;
use latchkey_client::{Client as Latchkey, Lease, LockKind};
use latchkey_tests::redisson::scripts::{LOCK_TRY_LOCK, LOCK_UNLOCK};
use latchkey_tests::redisson::{lock_channel, prefix_name};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// Redisson's default lease for a lock without a lease time (the watchdog timeout).
const REDISSON_LEASE_MS: i64 = 30_000;
/// The session lease of a task's etcd locks: granted at its first lock and revoked at
/// its end, longer than any run (so no keep-alive is needed within one).
const ETCD_LEASE_SECS: i64 = 3600;

/// One lock implementation, cheap to clone per task.
#[derive(Clone)]
pub enum Peer {
    /// latchkey through its Rust client.
    Latchkey { client: Latchkey, kind: LockKind },
    /// Redisson's RLock scripts and pub/sub, straight against Redis.
    Redisson(Arc<Redisson>),
    /// etcd's v3 lock service, and each task's session lease by its owner.
    Etcd(Box<etcd_client::Client>, Arc<Mutex<HashMap<String, i64>>>),
    /// The rslock Redlock client against one Redis.
    Rslock(Arc<rslock::LockManager>),
}

/// A held lock.
pub enum Held {
    /// A latchkey lease.
    Latchkey(Lease),
    /// A Redisson hold: name and owner.
    Redisson(String, String),
    /// An etcd lock key.
    Etcd(Vec<u8>),
    /// An rslock lock.
    Rslock(rslock::Lock),
}

impl Peer {
    /// Takes `name`, waiting as long as it takes.
    pub async fn acquire(&self, name: &str, owner: &str) -> Result<Held, String> {
        match self {
            Peer::Latchkey { client, kind } => {
                let lease = client
                    .lock(name)
                    .kind(*kind)
                    .acquire()
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Held::Latchkey(lease))
            }
            Peer::Redisson(r) => r
                .lock(name, owner)
                .await
                .map(|()| Held::Redisson(name.to_owned(), owner.to_owned())),
            Peer::Etcd(client, sessions) => etcd_lock((**client).clone(), sessions, name, owner).await,
            // Busy: try again (the crate's own retries are spent); any other error is one.
            Peer::Rslock(lm) => loop {
                match lm.lock(name.as_bytes(), Duration::from_secs(30)).await {
                    Ok(lock) => return Ok(Held::Rslock(lock)),
                    Err(rslock::LockError::Unavailable) => continue,
                    Err(e) => return Err(e.to_string()),
                }
            },
        }
    }

    /// Gives `held` back.
    pub async fn release(&self, held: Held) -> Result<(), String> {
        match (self, held) {
            (_, Held::Latchkey(lease)) => lease.release().await.map_err(|e| e.to_string()),
            (Peer::Redisson(r), Held::Redisson(name, owner)) => r.unlock(&name, &owner).await,
            (Peer::Etcd(client, _), Held::Etcd(key)) => {
                let mut client = (**client).clone();
                client.unlock(key).await.map(|_| ()).map_err(|e| e.to_string())
            }
            (Peer::Rslock(lm), Held::Rslock(lock)) => {
                lm.unlock(&lock).await;
                Ok(())
            }
            _ => Err("a hold released through another peer".into()),
        }
    }

    /// Ends what a task kept for its locks: an etcd task's session lease.
    pub async fn end(&self, owner: &str) {
        if let Peer::Etcd(client, sessions) = self {
            let lease = sessions.lock().unwrap_or_else(|e| e.into_inner()).remove(owner);
            if let Some(lease) = lease {
                let _ = (**client).clone().lease_revoke(lease).await;
            }
        }
    }
}

/// etcd's v3 lock with the task's session lease (`owner`'s), granted at its first lock.
async fn etcd_lock(
    mut client: etcd_client::Client,
    sessions: &Mutex<HashMap<String, i64>>,
    name: &str,
    owner: &str,
) -> Result<Held, String> {
    let known = sessions.lock().unwrap_or_else(|e| e.into_inner()).get(owner).copied();
    let lease = match known {
        Some(lease) => lease,
        None => {
            let lease = client
                .lease_grant(ETCD_LEASE_SECS, None)
                .await
                .map_err(|e| e.to_string())?
                .id();
            sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(owner.to_owned(), lease);
            lease
        }
    };
    let options = etcd_client::LockOptions::new().with_lease(lease);
    let locked = client.lock(name, Some(options)).await.map_err(|e| e.to_string())?;
    Ok(Held::Etcd(locked.key().to_vec()))
}

/// The Redisson `RLock` protocol: EVALSHA of its scripts, and one shared subscription
/// per lock channel whose unlock message wakes one waiting task (Redisson's
/// `LockPubSub` with its semaphore).
pub struct Redisson {
    client: Client,
    subscriber: SubscriberClient,
    try_lock: Script,
    unlock: Script,
    channels: Mutex<HashMap<String, Arc<Channel>>>,
}

/// A lock channel's waiting tasks: an unlock message wakes one (Redisson's
/// `RedissonLockEntry`), once the subscription is confirmed for all of them.
#[derive(Default)]
struct Channel {
    notify: Notify,
    subscribed: tokio::sync::OnceCell<()>,
}

impl Redisson {
    /// Connects to `url` and starts the message loop.
    pub async fn connect(url: &str) -> Result<Arc<Self>, Error> {
        let mut config = Config::from_url(url)?;
        config.version = fred::types::RespVersion::RESP3;
        let mut builder = Builder::from_config(config);
        // Redisson reads every unlock message; a reader behind by more than the
        // channel holds would lose some and leave their waiters to their TTL.
        builder.with_performance_config(|p| p.broadcast_channel_capacity = 1 << 16);
        let client = builder.build()?;
        let subscriber = builder.build_subscriber_client()?;
        client.init().await?;
        subscriber.init().await?;
        let me = Arc::new(Self {
            client,
            subscriber,
            try_lock: Script::from_lua(LOCK_TRY_LOCK),
            unlock: Script::from_lua(LOCK_UNLOCK),
            channels: Mutex::default(),
        });
        me.try_lock.load(&me.client).await?;
        me.unlock.load(&me.client).await?;
        let reader = me.clone();
        tokio::spawn(async move {
            let mut rx = reader.subscriber.message_rx();
            loop {
                match rx.recv().await {
                    Ok(msg) => {
                        if let Some(n) = reader
                            .channels
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .get(&*msg.channel)
                        {
                            n.notify.notify_one();
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(lost)) => {
                        // Not Redisson's behaviour: say so, and wake every waiter, as
                        // some of the lost messages were theirs.
                        eprintln!("redisson peer: {lost} unlock messages lost by its reader");
                        let channels = reader.channels.lock().unwrap_or_else(|e| e.into_inner());
                        for c in channels.values() {
                            c.notify.notify_waiters();
                            c.notify.notify_one();
                        }
                    }
                    Err(_) => return,
                }
            }
        });
        Ok(me)
    }

    async fn try_lock(&self, name: &str, owner: &str) -> Result<Option<i64>, String> {
        let args = vec![Value::from(REDISSON_LEASE_MS), Value::from(owner)];
        self.try_lock
            .evalsha(&self.client, vec![name.to_owned()], args)
            .await
            .map_err(|e| e.to_string())
    }

    /// Redisson's `lock()`: a try; else subscribe (confirmed), then try and wait for an
    /// unlock message or the holder's TTL, in turn.
    async fn lock(&self, name: &str, owner: &str) -> Result<(), String> {
        if self.try_lock(name, owner).await?.is_none() {
            return Ok(());
        }
        let channel = self.subscribe(&lock_channel(name)).await?;
        loop {
            let Some(ttl) = self.try_lock(name, owner).await? else {
                return Ok(());
            };
            let wait = Duration::from_millis(u64::try_from(ttl).unwrap_or(1).max(1));
            let _ = tokio::time::timeout(wait, channel.notify.notified()).await;
        }
    }

    /// The channel's waiters, once its subscription is in place (a PING behind the
    /// SUBSCRIBE is answered after Redis ran it; the Redis client answers a SUBSCRIBE
    /// once written).
    async fn subscribe(&self, name: &str) -> Result<Arc<Channel>, String> {
        let channel = {
            let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
            channels.entry(name.to_owned()).or_default().clone()
        };
        channel
            .subscribed
            .get_or_try_init(|| async {
                self.subscriber.subscribe(name).await?;
                self.subscriber.ping::<()>(None).await
            })
            .await
            .map_err(|e| e.to_string())?;
        Ok(channel)
    }

    async fn unlock(&self, name: &str, owner: &str) -> Result<(), String> {
        let latch = format!(
            "{}:{}",
            prefix_name("redisson_unlock_latch", name),
            uuid::Uuid::new_v4()
        );
        let keys = vec![name.to_owned(), lock_channel(name), latch.clone()];
        let args = vec![
            Value::from("0"),
            Value::from(REDISSON_LEASE_MS),
            Value::from(owner),
            Value::from("publish"),
            Value::from(13_500),
        ];
        let unlocked: Option<i64> = self
            .unlock
            .evalsha(&self.client, keys, args)
            .await
            .map_err(|e| e.to_string())?;
        // Redisson throws `IllegalMonitorStateException` there: the lock was not held.
        if unlocked.is_none() {
            return Err(format!("{name}: unlocked while not held by {owner}"));
        }
        // Redisson deletes the latch without waiting for the answer.
        let client = self.client.clone();
        tokio::spawn(async move { client.del::<i64, _>(latch).await });
        Ok(())
    }
}
