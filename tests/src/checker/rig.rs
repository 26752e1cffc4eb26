//! The system under test and the faults: a Redis (standalone, or a 3-master cluster
//! with a replica each), two latchkey replicas as processes, a proxy in front of the
//! first one, and a separate Redis for the protected resource.

use crate::latchkey::LatchkeyProcess;
use crate::proxy::Proxy;
use crate::{RedisCluster, RedisServer};
use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// The timing of the servers under test: short, so faults resolve in seconds.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// `--watchdog-timeout`: a dead replica's leases end within this.
    pub watchdog: Duration,
    /// The clients' HTTP/2 keepalive interval and timeout. The servers' are three times
    /// it ([`Timing::server_keepalive`]), so that, as with the defaults, a holder cut off
    /// from its server learns it before the server lets its lock go.
    pub keepalive: Duration,
    /// `--redis-timeout`.
    pub redis_timeout: Duration,
    /// `--fair-wait-timeout`: a dead replica's fair waiters leave the queue within this.
    pub fair_wait: Duration,
}

impl Timing {
    /// The servers' `--keepalive-interval` and `--keepalive-timeout`: a client's
    /// keepalive notices a dead link within two of its own, before a server's can.
    pub fn server_keepalive(&self) -> Duration {
        self.keepalive * 3
    }
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            watchdog: Duration::from_millis(1500),
            keepalive: Duration::from_secs(1),
            redis_timeout: Duration::from_millis(500),
            fair_wait: Duration::from_secs(1),
        }
    }
}

/// One fault the checker injects while clients hold and wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL a latchkey replica, wait past the watchdog timeout, start it again.
    KillReplica,
    /// SIGTERM a latchkey replica (graceful), start it again.
    TermReplica,
    /// Stop Redis for a second and start it again, empty.
    RestartRedis,
    /// Stop forwarding between some clients and a replica until keepalive notices.
    DropNetwork,
    /// `CLUSTER FAILOVER` of the master serving a hot lock to its replica.
    Failover,
    /// SIGKILL the master serving a hot lock; its replica takes over; restart it.
    KillMaster,
}

impl Fault {
    /// Every fault, by name.
    pub const ALL: [(&'static str, Fault); 6] = [
        ("kill-replica", Fault::KillReplica),
        ("term-replica", Fault::TermReplica),
        ("restart-redis", Fault::RestartRedis),
        ("drop-network", Fault::DropNetwork),
        ("failover", Fault::Failover),
        ("kill-master", Fault::KillMaster),
    ];

    /// The faults a deployment supports: a cluster is not restarted whole, a
    /// standalone Redis has no failover.
    pub fn defaults(cluster: bool) -> Vec<Fault> {
        let mut faults = vec![Fault::KillReplica, Fault::TermReplica, Fault::DropNetwork];
        if cluster {
            faults.extend([Fault::Failover, Fault::KillMaster]);
        } else {
            faults.push(Fault::RestartRedis);
        }
        faults
    }
}

impl FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Fault::ALL
            .iter()
            .find(|(name, _)| *name == s)
            .map(|(_, f)| *f)
            .ok_or_else(|| {
                let names: Vec<&str> = Fault::ALL.iter().map(|(n, _)| *n).collect();
                format!("unknown fault {s:?}; one of {}", names.join(", "))
            })
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = Fault::ALL.iter().find(|(_, x)| x == self).map_or("?", |(n, _)| *n);
        f.write_str(name)
    }
}

/// The Redis the locks live in.
#[derive(Debug)]
pub enum LockRedis {
    /// One server.
    Standalone(RedisServer),
    /// Three masters with a replica each.
    Cluster(RedisCluster),
}

impl LockRedis {
    /// The URL the servers are given.
    pub fn url(&self) -> String {
        match self {
            LockRedis::Standalone(r) => r.url(),
            LockRedis::Cluster(c) => c.url(),
        }
    }

    /// Ports of the nodes that are up (masters first in a cluster).
    pub fn live_ports(&self) -> Vec<u16> {
        match self {
            LockRedis::Standalone(r) => vec![r.port()],
            LockRedis::Cluster(c) => {
                let mut ports = c.master_ports();
                ports.extend(c.replica_ports());
                ports
            }
        }
    }

    /// Ports of the masters that are up.
    pub fn master_ports(&self) -> Vec<u16> {
        match self {
            LockRedis::Standalone(r) => vec![r.port()],
            LockRedis::Cluster(c) => c.master_ports(),
        }
    }
}

/// Everything a run needs.
#[derive(Debug)]
pub struct Rig {
    /// Where the locks live.
    pub redis: LockRedis,
    /// Where the registers live; never faulted.
    pub resource: RedisServer,
    /// Two latchkey replicas on `redis`.
    pub servers: Vec<LatchkeyProcess>,
    /// A proxy in front of `servers[0]`, for [`Fault::DropNetwork`].
    pub proxy: Proxy,
    /// The servers' timing.
    pub timing: Timing,
    faults_done: usize,
}

impl Rig {
    /// Starts the Redis, the resource Redis, two replicas and the proxy.
    pub async fn start(cluster: bool, timing: Timing, extra_args: &[String]) -> Rig {
        let redis = if cluster {
            LockRedis::Cluster(RedisCluster::start(3, 1))
        } else {
            LockRedis::Standalone(RedisServer::start())
        };
        let resource = RedisServer::start();
        let mut args = vec![
            "--redis-url".to_owned(),
            redis.url(),
            "--no-metrics".to_owned(),
            "--watchdog-timeout".to_owned(),
            humantime::format_duration(timing.watchdog).to_string(),
            "--redis-timeout".to_owned(),
            humantime::format_duration(timing.redis_timeout).to_string(),
            "--keepalive-interval".to_owned(),
            humantime::format_duration(timing.server_keepalive()).to_string(),
            "--keepalive-timeout".to_owned(),
            humantime::format_duration(timing.server_keepalive()).to_string(),
            "--fair-wait-timeout".to_owned(),
            humantime::format_duration(timing.fair_wait).to_string(),
        ];
        args.extend_from_slice(extra_args);
        let servers = vec![LatchkeyProcess::spawn(&args), LatchkeyProcess::spawn(&args)];
        let proxy = Proxy::start(&format!("127.0.0.1:{}", servers[0].port())).await;
        Rig {
            redis,
            resource,
            servers,
            proxy,
            timing,
            faults_done: 0,
        }
    }

    /// The endpoints clients use: each replica directly, and the first through the
    /// proxy.
    pub fn endpoints(&self) -> Vec<String> {
        let mut endpoints: Vec<String> = self.servers.iter().map(LatchkeyProcess::endpoint).collect();
        endpoints.push(self.proxy.endpoint());
        endpoints
    }

    /// The locks among `names` that `fault` can reach: for a failover, those whose
    /// slots the master of `hot` serves; `None` (every lock) for the others, which reach
    /// a latchkey replica, its link or the whole Redis. A killed master reaches every
    /// lock too: the Redis client sends nothing to any master until the killed one
    /// leaves the slot map (docs/safety.md, "A killed cluster master stops every slot
    /// until its failover"). Ask before the fault: a failover moves the slots. Blocks
    /// the thread, as [`Rig::inject`] does.
    pub fn reach(&self, fault: Fault, hot: &str, names: &[String]) -> Option<BTreeSet<String>> {
        let (Fault::Failover, LockRedis::Cluster(cluster)) = (fault, &self.redis) else {
            return None;
        };
        tokio::task::block_in_place(|| {
            let master = cluster.master_for_key(hot);
            Some(
                names
                    .iter()
                    .filter(|n| cluster.master_for_key(n) == master)
                    .cloned()
                    .collect(),
            )
        })
    }

    /// Injects `fault` and brings the system back; `hot` names a lock whose master a
    /// cluster fault hits. Returns when the fault is over (not yet settled). Blocks
    /// the thread (process waits), so call it from a multi-threaded runtime.
    pub async fn inject(&mut self, fault: Fault, hot: &str) {
        let replica = self.faults_done % self.servers.len();
        self.faults_done += 1;
        let pause = self.timing.watchdog + Duration::from_millis(500);
        match fault {
            Fault::KillReplica => {
                self.servers[replica].kill();
                tokio::time::sleep(pause).await;
                tokio::task::block_in_place(|| self.servers[replica].restart());
            }
            Fault::TermReplica => {
                self.servers[replica].terminate();
                let exited = tokio::task::block_in_place(|| self.servers[replica].wait_exit(Duration::from_secs(15)));
                assert!(exited.is_some(), "replica did not stop on SIGTERM");
                tokio::time::sleep(Duration::from_millis(500)).await;
                tokio::task::block_in_place(|| self.servers[replica].restart());
            }
            Fault::RestartRedis => {
                let LockRedis::Standalone(redis) = &mut self.redis else {
                    panic!("restart-redis needs a standalone Redis");
                };
                redis.stop();
                tokio::time::sleep(Duration::from_secs(1)).await;
                tokio::task::block_in_place(|| redis.restart());
            }
            Fault::DropNetwork => {
                self.proxy.freeze();
                // Until the servers' keepalive has noticed, at most two of theirs.
                tokio::time::sleep(self.timing.server_keepalive() * 2 + Duration::from_secs(1)).await;
                self.proxy.thaw();
            }
            Fault::Failover | Fault::KillMaster => self.cluster_fault(fault, hot).await,
        }
    }

    async fn cluster_fault(&mut self, fault: Fault, hot: &str) {
        let LockRedis::Cluster(cluster) = &mut self.redis else {
            panic!("{fault} needs a cluster");
        };
        tokio::task::block_in_place(|| {
            let master = cluster.master_for_key(hot);
            if fault == Fault::Failover {
                let replica = cluster.replicas_of(master)[0];
                cluster.failover(replica);
                return;
            }
            cluster.kill_node(master);
            cluster.wait_settled("fail over after a master kill");
            cluster.restart_node(master);
            cluster.wait_settled("take the old master back as a replica");
        });
    }
}
