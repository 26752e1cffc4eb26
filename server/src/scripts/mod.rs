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

/// Every script the server runs, built once at start-up.
#[derive(Debug, Clone)]
pub struct Scripts {
    /// Takes one hold of a mutex.
    pub mutex_acquire: Script,
    /// Gives back one hold of a mutex.
    pub mutex_release: Script,
    /// Renews a batch of stream-scoped leases (the watchdog).
    pub renew: Script,
    /// The same, for a batch of leases in one slot (the fallback on a cluster).
    pub renew_one_slot: Script,
    /// Breaks a lock (ForceRelease).
    pub force_release: Script,
    /// Reads a lock (Describe, List).
    pub describe: Script,
}

impl Scripts {
    /// The catalogue. On a cluster the watchdog's batch spans the slots of one node,
    /// which Redis 7 allows only to scripts declaring `allow-cross-slot-keys`.
    pub fn new(cluster: bool) -> Self {
        let renew = include_str!("renew.lua");
        let batch = if cluster {
            format!("#!lua flags=allow-cross-slot-keys\n{renew}")
        } else {
            renew.to_owned()
        };
        Self {
            mutex_acquire: Script::new("mutex_acquire", include_str!("mutex_acquire.lua")),
            mutex_release: Script::new("mutex_release", include_str!("mutex_release.lua")),
            renew: Script::new("renew", batch),
            renew_one_slot: Script::new("renew_one_slot", renew),
            force_release: Script::new("force_release", include_str!("force_release.lua")),
            describe: Script::new("describe", include_str!("describe.lua")),
        }
    }

    /// All scripts, to load them at start-up and to check their SHAs.
    pub fn all(&self) -> [&Script; 6] {
        [
            &self.mutex_acquire,
            &self.mutex_release,
            &self.renew,
            &self.renew_one_slot,
            &self.force_release,
            &self.describe,
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
