//! The catalogue of Lua scripts. Every change to a lock goes through one of these,
//! run by SHA (EVALSHA) and loaded again when Redis answers NOSCRIPT (after a restart,
//! a failover or `SCRIPT FLUSH`).

use fred::interfaces::LuaInterface;
use fred::prelude::{FromValue, Key, Value};

/// One named Lua script and its SHA-1.
#[derive(Debug, Clone)]
pub struct Script {
    name: &'static str,
    lua: String,
    sha: String,
}

impl Script {
    fn new(name: &'static str, lua: impl Into<String>) -> Self {
        let lua = lua.into();
        let sha = fred::util::sha1_hash(&lua);
        Self { name, lua, sha }
    }

    /// The script's name, for logs and metrics.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The script's source.
    pub fn lua(&self) -> &str {
        &self.lua
    }

    /// The SHA-1 Redis knows the script by.
    pub fn sha(&self) -> &str {
        &self.sha
    }

    /// Runs the script by SHA; on NOSCRIPT it loads the script and runs it again.
    pub async fn eval<R, C>(&self, client: &C, keys: Vec<Key>, args: Vec<Value>) -> Result<R, fred::error::Error>
    where
        R: FromValue,
        C: LuaInterface + Send + Sync,
    {
        match client.evalsha(self.sha.as_str(), keys.clone(), args.clone()).await {
            Err(e) if e.details().starts_with("NOSCRIPT") => {
                client.script_load_cluster::<(), _>(self.lua.as_str()).await?;
                client.evalsha(self.sha.as_str(), keys, args).await
            }
            other => other,
        }
    }
}

/// Helpers every script starts with (`lib.lua`): clocks, tokens, kinds, the fair queue.
const LIB: &str = include_str!("lib.lua");

/// A script of the catalogue: the publish and subscriber-count commands of the
/// deployment (sharded on a cluster), the shared helpers, then its own body.
fn with_lib(name: &'static str, cluster: bool, body: &str) -> Script {
    let (publish, numsub) = if cluster {
        ("spublish", "shardnumsub")
    } else {
        ("publish", "numsub")
    };
    Script::new(
        name,
        format!("local PUBLISH = '{publish}'\nlocal PUBSUB_NUMSUB = '{numsub}'\n{LIB}\n{body}"),
    )
}

/// Every script the server runs, built once at start-up.
#[derive(Debug, Clone)]
pub struct Scripts {
    /// Takes one hold of a mutex.
    pub mutex_acquire: Script,
    /// Takes one hold of a fair lock, or queues for it.
    pub fair_acquire: Script,
    /// A fair waiter leaves the queue.
    pub fair_leave: Script,
    /// Gives back one hold of a mutex or fair lock.
    pub release: Script,
    /// Gives back one hold of a mutex or fair lock and hands it to a local waiter.
    pub handoff: Script,
    /// Takes one read hold.
    pub read_acquire: Script,
    /// Takes one write hold.
    pub write_acquire: Script,
    /// Gives back one read hold.
    pub read_release: Script,
    /// Gives back one write hold.
    pub write_release: Script,
    /// Takes semaphore permits.
    pub semaphore_acquire: Script,
    /// Gives back semaphore permits.
    pub semaphore_release: Script,
    /// Renews a batch of stream-scoped leases (the watchdog).
    pub renew: Script,
    /// The same, for a batch of leases in one slot (the fallback on a cluster).
    pub renew_one_slot: Script,
    /// Breaks a lock (ForceRelease).
    pub force_release: Script,
    /// Reads a lock (Describe, List).
    pub describe: Script,
    /// Raises a fencing counter (RedLock).
    pub fence_raise: Script,
    /// Forgets a token never handed out (a rolled-back RedLock attempt).
    pub fence_forget: Script,
}

impl Scripts {
    /// The catalogue. On a cluster the watchdog's batch spans the slots of one node,
    /// which Redis 7 allows only to scripts declaring `allow-cross-slot-keys`.
    pub fn new(cluster: bool) -> Self {
        let renew = include_str!("renew.lua");
        let batch = with_lib("renew", cluster, renew);
        let batch = if cluster {
            Script::new("renew", format!("#!lua flags=allow-cross-slot-keys\n{}", batch.lua()))
        } else {
            batch
        };
        Self {
            mutex_acquire: with_lib("mutex_acquire", cluster, include_str!("mutex_acquire.lua")),
            fair_acquire: with_lib("fair_acquire", cluster, include_str!("fair_acquire.lua")),
            fair_leave: with_lib("fair_leave", cluster, include_str!("fair_leave.lua")),
            release: with_lib("release", cluster, include_str!("release.lua")),
            handoff: with_lib("handoff", cluster, include_str!("handoff.lua")),
            read_acquire: with_lib("read_acquire", cluster, include_str!("read_acquire.lua")),
            write_acquire: with_lib("write_acquire", cluster, include_str!("write_acquire.lua")),
            read_release: with_lib("read_release", cluster, include_str!("read_release.lua")),
            write_release: with_lib("write_release", cluster, include_str!("write_release.lua")),
            semaphore_acquire: with_lib("semaphore_acquire", cluster, include_str!("semaphore_acquire.lua")),
            semaphore_release: with_lib("semaphore_release", cluster, include_str!("semaphore_release.lua")),
            renew: batch,
            renew_one_slot: with_lib("renew_one_slot", cluster, renew),
            force_release: with_lib("force_release", cluster, include_str!("force_release.lua")),
            describe: with_lib("describe", cluster, include_str!("describe.lua")),
            fence_raise: Script::new("fence_raise", include_str!("fence_raise.lua")),
            fence_forget: Script::new("fence_forget", include_str!("fence_forget.lua")),
        }
    }

    /// All scripts, to load them at start-up and to check their SHAs.
    pub fn all(&self) -> [&Script; 17] {
        [
            &self.mutex_acquire,
            &self.fair_acquire,
            &self.fair_leave,
            &self.release,
            &self.handoff,
            &self.read_acquire,
            &self.write_acquire,
            &self.read_release,
            &self.write_release,
            &self.semaphore_acquire,
            &self.semaphore_release,
            &self.renew,
            &self.renew_one_slot,
            &self.force_release,
            &self.describe,
            &self.fence_raise,
            &self.fence_forget,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shas_are_sha1_of_the_source() {
        let s = Scripts::new(false);
        for script in s.all() {
            assert_eq!(script.sha().len(), 40, "{}", script.name());
            assert_eq!(script.sha(), fred::util::sha1_hash(script.lua()));
        }
        assert_eq!(s.renew.sha(), s.renew_one_slot.sha());
        assert_ne!(Scripts::new(true).renew.sha(), s.renew.sha());
    }
}
