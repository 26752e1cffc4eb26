//! The lock implementations under test, behind one `acquire`/`release` shape:
//! latchkey (mutex or fair, through the Rust client), the Redisson `RLock` protocol
//! driven directly against Redis with Redisson's pub/sub waiting, etcd's v3 lock with
//! a session lease, and the `rslock` Redlock client.

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
/// The session lease of an etcd lock (no keep-alive needed within a run).
const ETCD_LEASE_SECS: i64 = 60;

/// One lock implementation, cheap to clone per task.
#[derive(Clone)]
pub enum Peer {
    /// latchkey through its Rust client.
    Latchkey { client: Latchkey, kind: LockKind },
    /// Redisson's RLock scripts and pub/sub, straight against Redis.
    Redisson(Arc<Redisson>),
    /// etcd's v3 lock service.
    Etcd(Box<etcd_client::Client>),
    /// The rslock Redlock client against one Redis.
    Rslock(Arc<rslock::LockManager>),
}

/// A held lock.
pub enum Held {
    /// A latchkey lease.
    Latchkey(Lease),
    /// A Redisson hold: name and owner.
    Redisson(String, String),
    /// An etcd lock key and its session lease.
    Etcd(Vec<u8>, i64),
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
            Peer::Etcd(client) => etcd_lock((**client).clone(), name).await,
            Peer::Rslock(lm) => loop {
                if let Ok(lock) = lm.lock(name.as_bytes(), Duration::from_secs(30)).await {
                    return Ok(Held::Rslock(lock));
                }
            },
        }
    }

    /// Gives `held` back.
    pub async fn release(&self, held: Held) -> Result<(), String> {
        match (self, held) {
            (_, Held::Latchkey(lease)) => lease.release().await.map_err(|e| e.to_string()),
            (Peer::Redisson(r), Held::Redisson(name, owner)) => r.unlock(&name, &owner).await,
            (Peer::Etcd(client), Held::Etcd(key, lease)) => {
                let mut client = (**client).clone();
                client.unlock(key).await.map_err(|e| e.to_string())?;
                client.lease_revoke(lease).await.map(|_| ()).map_err(|e| e.to_string())
            }
            (Peer::Rslock(lm), Held::Rslock(lock)) => {
                lm.unlock(&lock).await;
                Ok(())
            }
            _ => Err("a hold released through another peer".into()),
        }
    }
}

async fn etcd_lock(mut client: etcd_client::Client, name: &str) -> Result<Held, String> {
    let lease = client
        .lease_grant(ETCD_LEASE_SECS, None)
        .await
        .map_err(|e| e.to_string())?
        .id();
    let options = etcd_client::LockOptions::new().with_lease(lease);
    let locked = client.lock(name, Some(options)).await.map_err(|e| e.to_string())?;
    Ok(Held::Etcd(locked.key().to_vec(), lease))
}

/// The Redisson `RLock` protocol: EVALSHA of its scripts, and one shared subscription
/// per lock channel whose unlock message wakes one waiting task (Redisson's
/// `LockPubSub` with its semaphore).
pub struct Redisson {
    client: Client,
    subscriber: SubscriberClient,
    try_lock: Script,
    unlock: Script,
    channels: Mutex<HashMap<String, Arc<Notify>>>,
}

impl Redisson {
    /// Connects to `url` and starts the message loop.
    pub async fn connect(url: &str) -> Result<Arc<Self>, Error> {
        let mut config = Config::from_url(url)?;
        config.version = fred::types::RespVersion::RESP3;
        let builder = Builder::from_config(config);
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
                            n.notify_one();
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
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

    async fn lock(&self, name: &str, owner: &str) -> Result<(), String> {
        let Some(mut ttl) = self.try_lock(name, owner).await? else {
            return Ok(());
        };
        let channel = lock_channel(name);
        let notify = self.subscribe(&channel).await?;
        loop {
            let wait = Duration::from_millis(u64::try_from(ttl).unwrap_or(1).max(1));
            let _ = tokio::time::timeout(wait, notify.notified()).await;
            match self.try_lock(name, owner).await? {
                None => return Ok(()),
                Some(t) => ttl = t,
            }
        }
    }

    async fn subscribe(&self, channel: &str) -> Result<Arc<Notify>, String> {
        let (notify, new) = {
            let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
            match channels.get(channel) {
                Some(n) => (n.clone(), false),
                None => {
                    let n = Arc::new(Notify::new());
                    channels.insert(channel.to_owned(), n.clone());
                    (n, true)
                }
            }
        };
        if new {
            self.subscriber.subscribe(channel).await.map_err(|e| e.to_string())?;
        }
        Ok(notify)
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
        let _: Option<i64> = self
            .unlock
            .evalsha(&self.client, keys, args)
            .await
            .map_err(|e| e.to_string())?;
        let _: i64 = self.client.del(latch).await.map_err(|e| e.to_string())?;
        Ok(())
    }
}
