//! The catalogue of Lua scripts. Every change to a lock goes through one of these,
//! run by SHA (EVALSHA) and loaded again when Redis answers NOSCRIPT (after a restart,
//! a failover or `SCRIPT FLUSH`).

use fred::interfaces::{LuaInterface, MetricsInterface};
use fred::prelude::{FromValue, Key, Value};
use fred::types::{ClusterHash, CustomCommand};

mod prelude;

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
        C: LuaInterface + MetricsInterface + Send + Sync,
    {
        self.loaded(client, &keys, || {
            client.evalsha(self.sha.as_str(), keys.clone(), args.clone())
        })
        .await
    }

    /// Runs `call`, which sends this script by SHA with `keys`; on NOSCRIPT it loads the
    /// script on the node of their slot through `client` and runs `call` again. A call
    /// redirected by the cluster (no client follows a redirection, see
    /// `redis::builder`) did not run: it goes once more, which after a `MOVED` reaches
    /// the slot's new master. A call finding `client`'s queue at
    /// [`SCRIPT_QUEUE_MAX`](crate::redis::SCRIPT_QUEUE_MAX) fails at once.
    pub async fn loaded<T, C, F>(&self, client: &C, keys: &[Key], call: impl Fn() -> F) -> Result<T, fred::error::Error>
    where
        C: LuaInterface + MetricsInterface + Send + Sync,
        F: std::future::Future<Output = Result<T, fred::error::Error>>,
    {
        // Refused here, before fred's own bound: fred keeps counting a command it
        // refused, and a count that never comes back to zero leaves the commands that do
        // not flush its socket (SCRIPT LOAD, INFO, SUBSCRIBE) unsent until one that does.
        if client.command_queue_len() >= crate::redis::SCRIPT_QUEUE_MAX {
            let full = "the connection's command queue is full (Redis away or too slow)";
            return Err(fred::error::Error::new(fred::error::ErrorKind::Backpressure, full));
        }
        let result = match self.loaded_here(client, keys, &call).await {
            Err(e) if crate::redis::redirected(&e) => self.loaded_here(client, keys, &call).await,
            other => other,
        };
        match result {
            Err(e) => Err(crate::redis::unwrapped(client, e).await),
            ok => ok,
        }
    }

    /// [`Script::loaded`] on the node the client routes the call to. A `SCRIPT FLUSH`
    /// (or a restart) may land between the load and the call sent after it, whose
    /// round trip a busy server stretches to milliseconds: the script is loaded again,
    /// up to [`LOADS`] times.
    async fn loaded_here<T, C, F>(
        &self,
        client: &C,
        keys: &[Key],
        call: &impl Fn() -> F,
    ) -> Result<T, fred::error::Error>
    where
        C: LuaInterface + Send + Sync,
        F: std::future::Future<Output = Result<T, fred::error::Error>>,
    {
        let mut loads = 0;
        loop {
            match call().await {
                Err(e) if e.details().starts_with("NOSCRIPT") && loads < LOADS => {
                    loads += 1;
                    self.load_for(client, keys).await?;
                }
                other => return other,
            }
        }
    }

    /// Loads the script on the node of `keys`' slot alone: fred sends a load for every
    /// master from the connection's one routing task and waits for each, so a paused
    /// master would stop every call on that connection meanwhile. (The slot is worked
    /// out here only: most calls never need it.)
    async fn load_for<C: LuaInterface + Send + Sync>(
        &self,
        client: &C,
        keys: &[Key],
    ) -> Result<(), fred::error::Error> {
        let slot = keys.first().map_or(0, Key::cluster_hash);
        let load = CustomCommand::new_static("SCRIPT", ClusterHash::Custom(slot), false);
        let args = vec![Value::from("LOAD"), Value::from(self.lua.as_str())];
        Box::pin(client.custom::<(), _>(load, args)).await
    }
}

/// Most loads of one call's script after NOSCRIPT answers: each further one follows a
/// flush that landed between the previous load and its call.
const LOADS: usize = 3;

/// Helpers the scripts share (`lib.lua`): clocks, tokens, kinds, the fair queue.
const LIB: &str = include_str!("lib.lua");

/// What a script of the catalogue starts with: of the deployment's constants and the
/// shared helpers, those `body` uses ([`prelude::needed`]). The constants: the publish
/// and subscriber-count commands (sharded on a cluster), how long a revoked hold record
/// stays, how long a hold record outlives its lease, how a stream's own owner id
/// starts.
fn header(cluster: bool, body: &str) -> String {
    let (publish, numsub) = if cluster {
        ("spublish", "shardnumsub")
    } else {
        ("publish", "numsub")
    };
    let revoked = crate::lock::millis(crate::lock::REVOKED_FOR);
    let grace = crate::lock::millis(crate::lock::RECORD_GRACE);
    let prefix = crate::service::SERVER_ID_PREFIX;
    let all = format!(
        "local PUBLISH = '{publish}'\nlocal PUBSUB_NUMSUB = '{numsub}'\nlocal REVOKED_MS = {revoked}\n\
         local GRACE_MS = {grace}\nlocal SERVER_ID_PREFIX = '{prefix}'\n{LIB}\n"
    );
    prelude::needed(&all, body)
}

/// A script of the catalogue: the first line of a cluster's script's `flags`, the
/// header, then its own body.
fn with_lib(name: &'static str, cluster: bool, flags: Option<&str>, body: &str) -> Script {
    let shebang = flags.map_or(String::new(), |f| shebang(cluster, f));
    Script::new(name, format!("{shebang}{}{body}", header(cluster, body)))
}

/// The scripts a batch can run, by name (`batch.lua`'s `run`), with their bodies.
const BATCHED: [(&str, &str); 13] = [
    ("mutex_acquire", include_str!("mutex_acquire.lua")),
    ("fair_acquire", include_str!("fair_acquire.lua")),
    ("fair_leave", include_str!("fair_leave.lua")),
    ("release", include_str!("release.lua")),
    ("handoff", include_str!("handoff.lua")),
    ("read_acquire", include_str!("read_acquire.lua")),
    ("write_acquire", include_str!("write_acquire.lua")),
    ("read_release", include_str!("read_release.lua")),
    ("write_release", include_str!("write_release.lua")),
    ("semaphore_acquire", include_str!("semaphore_acquire.lua")),
    ("semaphore_release", include_str!("semaphore_release.lua")),
    ("force_release", include_str!("force_release.lua")),
    ("describe", include_str!("describe.lua")),
];

/// The script that runs the calls of one round (`batch.lua`): `run(name, KEYS, ARGV)`
/// holds every batched script's body as one branch, so a call builds no closure per
/// script. The branches are split over a few functions, [`BRANCHES_PER_RUN`] each, each
/// passing a name it lacks to the next: a Lua function of Redis's takes at most 60
/// outside variables (the helpers of `lib.lua` its bodies name), which one function of
/// every body reached. On a cluster a batch spans the slots of one node, which Redis 7
/// allows only to scripts declaring `allow-cross-slot-keys`, and `CLUSTER` has it check
/// each call's keys before running it.
fn batch(cluster: bool) -> Script {
    let mut lua = format!("local CLUSTER = {cluster}\n");
    let groups: Vec<_> = BATCHED.chunks(BRANCHES_PER_RUN).collect();
    // Defined last to first, each before the one that passes names on to it.
    for (i, group) in groups.iter().enumerate().rev() {
        let function = if i == 0 { "run".to_owned() } else { format!("run_{i}") };
        lua.push_str(&format!("local function {function}(name, KEYS, ARGV)\n"));
        for (j, (name, body)) in group.iter().enumerate() {
            let branch = if j == 0 { "if" } else { "elseif" };
            lua.push_str(&format!("{branch} name == '{name}' then\n{body}\n"));
        }
        lua.push_str("end\n");
        match i + 1 < groups.len() {
            true => lua.push_str(&format!("return run_{}(name, KEYS, ARGV)\nend\n", i + 1)),
            false => lua.push_str("error('no script ' .. tostring(name))\nend\n"),
        }
    }
    lua.push_str(include_str!("batch.lua"));
    with_lib("batch", cluster, Some("allow-cross-slot-keys"), &lua)
}

/// Batched scripts per function of the batch (see [`batch`]).
const BRANCHES_PER_RUN: usize = 7;

/// The first line declaring a cluster's script's `flags` (Redis 7); none on a
/// standalone Redis, which may be 6.2.
fn shebang(cluster: bool, flags: &str) -> String {
    match cluster {
        true => format!("#!lua flags={flags}\n"),
        false => String::new(),
    }
}

/// The body of a batched script.
fn body(name: &str) -> &'static str {
    BATCHED.iter().find(|(n, _)| *n == name).map_or("", |(_, body)| body)
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
    /// Runs the calls of one round in one (`batch.lua`).
    pub batch: Script,
}

impl Scripts {
    /// The catalogue. On a cluster the watchdog's batch spans the slots of one node,
    /// which Redis 7 allows only to scripts declaring `allow-cross-slot-keys`. There a
    /// renewal declares `allow-oom` too: a script with flags and without it is refused
    /// whole at the memory limit, and a renewal only lengthens what exists (a
    /// standalone Redis, 6.2 on, takes no flags; it refuses only a deny-oom command
    /// before a script's first write, which `renew.lua` keeps from its leases' way).
    pub fn new(cluster: bool) -> Self {
        let flagged = |name, flags| with_lib(name, cluster, Some(flags), include_str!("renew.lua"));
        let lib = |name| with_lib(name, cluster, None, body(name));
        Self {
            mutex_acquire: lib("mutex_acquire"),
            fair_acquire: lib("fair_acquire"),
            fair_leave: lib("fair_leave"),
            release: lib("release"),
            handoff: lib("handoff"),
            read_acquire: lib("read_acquire"),
            write_acquire: lib("write_acquire"),
            read_release: lib("read_release"),
            write_release: lib("write_release"),
            semaphore_acquire: lib("semaphore_acquire"),
            semaphore_release: lib("semaphore_release"),
            renew: flagged("renew", "allow-cross-slot-keys,allow-oom"),
            renew_one_slot: flagged("renew_one_slot", "allow-oom"),
            force_release: lib("force_release"),
            describe: lib("describe"),
            fence_raise: Script::new("fence_raise", include_str!("fence_raise.lua")),
            batch: batch(cluster),
        }
    }

    /// The script called `name`.
    pub fn by_name(&self, name: &str) -> Option<&Script> {
        self.all().into_iter().find(|s| s.name() == name)
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
            &self.batch,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Lua 5.1 takes at most 60 outside variables in a function; a batch function whose
    /// bodies name more fails to load, with an error far from the change that made it.
    /// Words of comments count too, so the count errs high, never low.
    #[test]
    fn each_function_of_the_batch_names_fewer_helpers_than_lua_allows() {
        let every_body: String = BATCHED.iter().map(|(_, body)| *body).collect();
        let header = header(true, &every_body);
        let defined: HashSet<&str> = header
            .lines()
            .filter_map(|l| l.strip_prefix("local "))
            .flat_map(prelude::bound)
            .collect();
        let groups: Vec<_> = BATCHED.chunks(BRANCHES_PER_RUN).collect();
        for (i, group) in groups.iter().enumerate() {
            let named: HashSet<&str> = group
                .iter()
                .flat_map(|(_, body)| prelude::words(body))
                .filter(|w| defined.contains(w))
                .collect();
            let names: Vec<&str> = group.iter().map(|(name, _)| *name).collect();
            // Each function but the last names the next one too.
            let outside = named.len() + usize::from(i + 1 < groups.len());
            assert!(outside <= 60, "{names:?} name {outside} outside variables");
        }
    }

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

    /// lib.lua's names, each with the `local` line that binds it.
    fn definitions() -> std::collections::HashMap<&'static str, &'static str> {
        let bindings = LIB
            .lines()
            .filter_map(|l| l.strip_prefix("local ").map(|rest| (l, rest)));
        bindings
            .flat_map(|(line, rest)| prelude::bound(rest).into_iter().map(move |n| (n, line)))
            .collect()
    }

    #[test]
    fn every_helper_a_script_names_is_defined_in_it_and_a_lone_script_carries_fewer() {
        let definitions = definitions();
        for cluster in [false, true] {
            let s = Scripts::new(cluster);
            for script in s.all() {
                let lua = script.lua();
                let code = lua.lines().map(|l| l.split("--").next().unwrap_or(""));
                for name in code.flat_map(prelude::words) {
                    if let Some(line) = definitions.get(name) {
                        assert!(
                            lua.lines().any(|l| l == *line),
                            "{}: {name} used, not defined",
                            script.name()
                        );
                    }
                }
            }
            let defined = |script: &Script| script.lua().lines().filter(|l| l.starts_with("local ")).count();
            assert!(
                defined(&s.mutex_acquire) * 2 < defined(&s.batch),
                "{}",
                defined(&s.mutex_acquire)
            );
            assert!(s.batch.lua().starts_with("#!lua") == cluster);
            assert!(s.renew.lua().starts_with("#!lua") == cluster);
        }
    }
}
