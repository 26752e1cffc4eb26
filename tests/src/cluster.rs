//! `RedisCluster`: a real Redis Cluster of `redis-server` processes built with
//! `redis-cli --cluster create`, with failover and node-kill helpers for tests.

use crate::process::{self, redis_answers, redis_cli};
use crate::redis::info_field;
use crate::redis::RedisTls;
use crate::redis::{RedisServer, REDIS_CLI};
use std::process::Command;
use std::time::Duration;

/// `--cluster-node-timeout` of every node, in milliseconds: short, so failure detection
/// and failover happen within a few seconds in tests.
pub const CLUSTER_NODE_TIMEOUT_MS: u64 = 2000;

/// How long the cluster may take to form, or to settle after a failover.
pub const CLUSTER_SETTLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Number of hash slots of a Redis Cluster.
const CLUSTER_SLOTS: usize = 16384;

/// A running Redis Cluster on 127.0.0.1: `masters` primaries holding all 16384 slots,
/// each with `replicas_per_master` replicas. Drop kills every node.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    /// Each node's TLS port, in start order, when started with TLS.
    tls_ports: Vec<u16>,
}

impl RedisCluster {
    /// Starts `masters + masters * replicas_per_master` cluster-enabled nodes on free
    /// ports, joins them with `redis-cli --cluster create` and waits until every node
    /// reports `cluster_state:ok` with all slots covered and every replica in sync.
    /// `redis-cli` requires at least 3 masters.
    pub fn start(masters: usize, replicas_per_master: usize) -> RedisCluster {
        Self::start_with(masters, replicas_per_master, None)
    }

    /// A cluster of `masters` masters whose nodes also serve TLS (each on a TLS port
    /// of its own) and talk to each other over TLS (`tls-cluster yes`), so clients
    /// connecting over TLS are told the TLS ports. [`RedisCluster::tls_url`] reaches it.
    pub fn start_tls(masters: usize, tls: &RedisTls) -> RedisCluster {
        Self::start_with(masters, 0, Some(tls))
    }

    fn start_with(masters: usize, replicas_per_master: usize, tls: Option<&RedisTls>) -> RedisCluster {
        assert!(
            masters >= 3,
            "redis-cli --cluster create needs at least 3 masters, got {masters}"
        );
        let total = masters + masters * replicas_per_master;
        let timeout = CLUSTER_NODE_TIMEOUT_MS.to_string();
        let nodes: Vec<RedisServer> = (0..total)
            .map(|_| RedisServer::start_with_fresh(|| node_args(&timeout, tls)))
            .collect();
        let tls_ports = match tls {
            Some(_) => nodes
                .iter()
                .map(|n| n.tls_port().expect("a TLS node has a TLS port"))
                .collect(),
            None => Vec::new(),
        };
        let cluster = RedisCluster { nodes, tls_ports };
        cluster.create(replicas_per_master);
        cluster.wait_settled("form");
        cluster
    }

    /// The fred cluster URL: `redis-cluster://127.0.0.1:P1?node=127.0.0.1:P2&node=…`.
    pub fn url(&self) -> String {
        let mut ports = self.nodes.iter().map(RedisServer::port);
        let first = ports.next().expect("a cluster has nodes");
        let rest: Vec<String> = ports.map(|p| format!("node=127.0.0.1:{p}")).collect();
        if rest.is_empty() {
            format!("redis-cluster://127.0.0.1:{first}")
        } else {
            format!("redis-cluster://127.0.0.1:{first}?{}", rest.join("&"))
        }
    }

    /// `rediss-cluster://127.0.0.1:T1?node=127.0.0.1:T2&…` on the TLS ports, when
    /// started with [`RedisCluster::start_tls`].
    pub fn tls_url(&self) -> Option<String> {
        let (first, rest) = self.tls_ports.split_first()?;
        let rest: Vec<String> = rest.iter().map(|p| format!("node=127.0.0.1:{p}")).collect();
        Some(format!("rediss-cluster://127.0.0.1:{first}?{}", rest.join("&")))
    }

    /// Every node, masters and replicas, in start order.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The ports of every node, in start order.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(RedisServer::port).collect()
    }

    /// The node listening on `port`; panics when the cluster has none.
    pub fn node(&self, port: u16) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| n.port() == port)
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    /// Ports of the masters that are up now, sorted, as the cluster itself reports them
    /// (`CLUSTER NODES`), so they follow failovers.
    pub fn master_ports(&self) -> Vec<u16> {
        self.topology()
            .into_iter()
            .filter(|n| n.is_master)
            .map(|n| n.port)
            .collect()
    }

    /// Ports of the replicas that are up now, sorted.
    pub fn replica_ports(&self) -> Vec<u16> {
        self.topology()
            .into_iter()
            .filter(|n| !n.is_master)
            .map(|n| n.port)
            .collect()
    }

    /// Ports of the live replicas of the master on `master_port`.
    pub fn replicas_of(&self, master_port: u16) -> Vec<u16> {
        let nodes = self.topology();
        let id = nodes
            .iter()
            .find(|n| n.port == master_port)
            .map(|n| n.id.clone())
            .unwrap_or_else(|| panic!("no live cluster node on port {master_port}"));
        nodes
            .into_iter()
            .filter(|n| n.master_id == id)
            .map(|n| n.port)
            .collect()
    }

    /// The first of `name(0)`, `name(1)`, … whose slot the master on `port` serves.
    pub fn name_on(&self, port: u16, name: impl Fn(usize) -> String) -> String {
        (0..100_000)
            .map(name)
            .find(|n| self.master_for_key(n) == port)
            .expect("a name on the master")
    }

    /// The port of the master serving `key`'s hash slot (`CLUSTER KEYSLOT` + `CLUSTER
    /// NODES`).
    pub fn master_for_key(&self, key: &str) -> u16 {
        let port = self.any_live_port();
        let slot: u16 = redis_cli(port, None, &["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .expect("CLUSTER KEYSLOT answers an integer");
        self.topology()
            .into_iter()
            .find(|n| n.is_master && n.slots.iter().any(|(lo, hi)| (*lo..=*hi).contains(&slot)))
            .map(|n| n.port)
            .unwrap_or_else(|| panic!("no live master serves slot {slot} of {key:?}"))
    }

    /// Runs `CLUSTER FAILOVER` on the replica on `replica_port` and waits until it is a
    /// master and the cluster is healthy again.
    pub fn failover(&self, replica_port: u16) {
        let reply = redis_cli(replica_port, None, &["CLUSTER", "FAILOVER"]);
        assert!(
            reply.trim() == "OK",
            "CLUSTER FAILOVER on {replica_port} answered {reply:?}"
        );
        let became_master = process::wait_until(
            CLUSTER_SETTLE_TIMEOUT,
            || true,
            || redis_cli(replica_port, None, &["ROLE"]).lines().next() == Some("master"),
        );
        if became_master.is_err() {
            self.fail(&format!("replica {replica_port} did not become master"));
        }
        self.wait_settled("settle after failover");
    }

    /// Moves every slot of the master on `from` to the master on `to` (a scale-in; the
    /// slots must hold no keys) and waits until the cluster has settled: `from` stays a
    /// master with no slots, which clients then drop from their slot maps.
    pub fn empty_master(&self, from: u16, to: u16) {
        self.move_slots(from, to, &self.slots_of(from));
    }

    /// The slot ranges of the master on `port`.
    pub fn slots_of(&self, port: u16) -> Vec<(u16, u16)> {
        self.topology()
            .into_iter()
            .find(|n| n.port == port && n.is_master)
            .unwrap_or_else(|| panic!("no master on port {port}"))
            .slots
    }

    /// Moves the slot `ranges` (holding no keys) of the master on `from` to the master
    /// on `to`, as a step of a scale-in, and waits until the cluster has settled.
    pub fn move_slots(&self, from: u16, to: u16, ranges: &[(u16, u16)]) {
        for port in [from, to] {
            for (lo, hi) in ranges {
                let reply = redis_cli(
                    port,
                    None,
                    &["CLUSTER", "DELSLOTSRANGE", &lo.to_string(), &hi.to_string()],
                );
                assert_eq!(reply.trim(), "OK", "DELSLOTSRANGE on {port}");
            }
        }
        for (lo, hi) in ranges {
            let reply = redis_cli(
                to,
                None,
                &["CLUSTER", "ADDSLOTSRANGE", &lo.to_string(), &hi.to_string()],
            );
            assert_eq!(reply.trim(), "OK", "ADDSLOTSRANGE on {to}");
        }
        redis_cli(to, None, &["CLUSTER", "BUMPEPOCH"]);
        self.wait_settled("settle after moving slots");
    }

    /// Moves `slot` with its keys from the master on `from` to the master on `to`, as a
    /// resharding does: [`RedisCluster::migrate_keys`], then
    /// [`RedisCluster::hand_over`].
    pub fn move_slot_with_keys(&self, slot: u16, from: u16, to: u16) {
        self.migrate_keys(slot, from, to);
        self.hand_over(slot, from, to);
    }

    /// The second half of a slot's move: the master on `to` owns `slot`, told to it,
    /// then to `from`, then to the other masters.
    pub fn hand_over(&self, slot: u16, from: u16, to: u16) {
        let to_id = self.node_id(to);
        let others = self.master_ports().into_iter().filter(|p| *p != to && *p != from);
        for port in [to, from].into_iter().chain(others) {
            self.set_slot(port, slot, &["NODE", &to_id]);
        }
    }

    /// The first half of a slot's move: IMPORTING and MIGRATING
    /// ([`RedisCluster::start_migrating`]), then MIGRATE of every key of the slot. The
    /// slot still belongs to `from` until [`RedisCluster::hand_over`].
    pub fn migrate_keys(&self, slot: u16, from: u16, to: u16) {
        self.start_migrating(slot, from, to);
        let old = self.node(from);
        let keys = old.cli(&["CLUSTER", "GETKEYSINSLOT", &slot.to_string(), "1000"]);
        let keys: Vec<&str> = keys.lines().map(str::trim).filter(|k| !k.is_empty()).collect();
        if !keys.is_empty() {
            let to = to.to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", to.as_str(), "", "0", "5000", "KEYS"];
            args.extend(keys.iter().copied());
            let reply = old.cli(&args);
            assert_eq!(reply.trim(), "OK", "MIGRATE {keys:?}: {reply}");
        }
    }

    /// Starts moving `slot` from the master on `from` to the master on `to`: IMPORTING
    /// on `to`, MIGRATING on `from`.
    pub fn start_migrating(&self, slot: u16, from: u16, to: u16) {
        let (from_id, to_id) = (self.node_id(from), self.node_id(to));
        self.set_slot(to, slot, &["IMPORTING", &from_id]);
        self.set_slot(from, slot, &["MIGRATING", &to_id]);
    }

    /// The cluster id of the node on `port`.
    pub fn node_id(&self, port: u16) -> String {
        self.node(port).cli(&["CLUSTER", "MYID"]).trim().to_owned()
    }

    /// `CLUSTER SETSLOT <slot> <state…>` on the node on `port`.
    pub fn set_slot(&self, port: u16, slot: u16, state: &[&str]) {
        let slot = slot.to_string();
        let args: Vec<&str> = ["CLUSTER", "SETSLOT", slot.as_str()]
            .into_iter()
            .chain(state.iter().copied())
            .collect();
        let reply = self.node(port).cli(&args);
        assert_eq!(reply.trim(), "OK", "{port} {args:?}: {reply}");
    }

    /// SIGKILLs the node on `port` (its nodes.conf stays, so it can be restarted).
    pub fn kill_node(&mut self, port: u16) {
        self.node_mut(port).stop();
    }

    /// Restarts a killed node on the same port; it rejoins the cluster from its
    /// nodes.conf. Waits until it answers, not until the cluster has settled (see
    /// [`RedisCluster::wait_settled`]).
    pub fn restart_node(&mut self, port: u16) {
        self.node_mut(port).restart();
    }

    /// Waits until every live node reports `cluster_state:ok`, all slots assigned and
    /// ok, and knows every node, and every live replica's link to its master is up.
    pub fn wait_settled(&self, what: &str) {
        let total = self.nodes.len();
        let settled = process::wait_until(CLUSTER_SETTLE_TIMEOUT, || true, || self.is_settled(total));
        if settled.is_err() {
            self.fail(&format!("cluster did not {what} within {CLUSTER_SETTLE_TIMEOUT:?}"));
        }
    }

    fn create(&self, replicas_per_master: usize) {
        let addrs: Vec<String> = self.ports().iter().map(|p| format!("127.0.0.1:{p}")).collect();
        // It waits for the nodes to agree without a bound of its own.
        let output = process::output_within(
            Command::new(REDIS_CLI)
                .args(["--cluster", "create"])
                .args(&addrs)
                .args(["--cluster-replicas", &replicas_per_master.to_string(), "--cluster-yes"]),
            CLUSTER_SETTLE_TIMEOUT,
        );
        if !output.status.success() {
            self.fail(&format!(
                "redis-cli --cluster create failed ({}):\n{}{}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }

    fn is_settled(&self, total: usize) -> bool {
        let live: Vec<u16> = self.ports().into_iter().filter(|p| redis_answers(*p)).collect();
        let known = total.to_string();
        let slots = CLUSTER_SLOTS.to_string();
        let healthy = live.iter().all(|port| {
            let info = redis_cli(*port, None, &["CLUSTER", "INFO"]);
            let field = |name: &str| info_field(&info, name);
            field("cluster_state") == Some("ok")
                && field("cluster_slots_assigned") == Some(&slots)
                && field("cluster_slots_ok") == Some(&slots)
                && field("cluster_known_nodes") == Some(&known)
                && replica_in_sync(*port)
        });
        // Gossip spreads a failover node by node; wait until every node tells the same
        // story so clients and `master_ports()` see one topology.
        let mut views = live.iter().map(|port| roles_seen_by(*port));
        let first = views.next();
        healthy && views.all(|view| Some(&view) == first.as_ref())
    }

    fn topology(&self) -> Vec<ClusterNode> {
        let port = self.any_live_port();
        let mut nodes: Vec<ClusterNode> = redis_cli(port, None, &["CLUSTER", "NODES"])
            .lines()
            .filter_map(ClusterNode::parse)
            .filter(|n| !n.failed && redis_answers(n.port))
            .collect();
        nodes.sort_by_key(|n| n.port);
        nodes
    }

    fn any_live_port(&self) -> u16 {
        self.ports()
            .into_iter()
            .find(|p| redis_answers(*p))
            .unwrap_or_else(|| panic!("no cluster node answers"))
    }

    fn node_mut(&mut self, port: u16) -> &mut RedisServer {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    fn fail(&self, what: &str) -> ! {
        let mut report = format!("{what}\n");
        for node in &self.nodes {
            let port = node.port();
            let info = if redis_answers(port) {
                redis_cli(port, None, &["CLUSTER", "NODES"])
            } else {
                "<not answering>".to_owned()
            };
            report.push_str(&format!(
                "--- node {port}: CLUSTER NODES\n{info}--- log tail\n{}\n",
                node.log_tail()
            ));
        }
        panic!("{report}");
    }
}

/// A cluster node's command line, with a bus port (and a TLS port, with `tls`) of its
/// own picked afresh: Redis 7 lets the bus port be chosen, and the default port+10000
/// may be taken or above 65535.
fn node_args(node_timeout: &str, tls: Option<&RedisTls>) -> Vec<String> {
    let bus_port = process::free_port().to_string();
    // The config file is relative to --dir, so it lives in the node's own temp dir.
    let mut args: Vec<String> = [
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-node-timeout",
        node_timeout,
        "--cluster-port",
        &bus_port,
    ]
    .map(str::to_owned)
    .to_vec();
    if let Some(tls) = tls {
        let port = process::free_port().to_string();
        args.extend(["--tls-port", &port, "--tls-cluster", "yes"].map(str::to_owned));
        args.extend(tls.args());
    }
    args
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
struct ClusterNode {
    id: String,
    port: u16,
    is_master: bool,
    failed: bool,
    master_id: String,
    slots: Vec<(u16, u16)>,
}

impl ClusterNode {
    fn parse(line: &str) -> Option<ClusterNode> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 8 {
            return None;
        }
        // "127.0.0.1:7000@17000[,hostname]"
        let addr = fields[1].split('@').next()?;
        let port = addr.rsplit(':').next()?.parse().ok()?;
        let flags: Vec<&str> = fields[2].split(',').collect();
        let slots = fields[8..]
            .iter()
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| match s.split_once('-') {
                Some((lo, hi)) => Some((lo.parse().ok()?, hi.parse().ok()?)),
                None => s.parse().ok().map(|one| (one, one)),
            })
            .collect();
        Some(ClusterNode {
            id: fields[0].to_owned(),
            port,
            is_master: flags.contains(&"master"),
            failed: flags.contains(&"fail") || flags.contains(&"fail?") || flags.contains(&"noaddr"),
            master_id: fields[3].to_owned(),
            slots,
        })
    }
}

/// The roles one node believes in: sorted (port, master port or 0) for every node it
/// does not consider failed.
fn roles_seen_by(port: u16) -> Vec<(u16, u16)> {
    let nodes: Vec<ClusterNode> = redis_cli(port, None, &["CLUSTER", "NODES"])
        .lines()
        .filter_map(ClusterNode::parse)
        .filter(|n| !n.failed)
        .collect();
    let port_of = |id: &str| nodes.iter().find(|n| n.id == id).map_or(0, |n| n.port);
    let mut roles: Vec<(u16, u16)> = nodes
        .iter()
        .map(|n| (n.port, if n.is_master { 0 } else { port_of(&n.master_id) }))
        .collect();
    roles.sort_unstable();
    roles
}

/// True for a master, or for a replica whose link to its master is up.
fn replica_in_sync(port: u16) -> bool {
    let info = redis_cli(port, None, &["INFO", "replication"]);
    match info_field(&info, "role") {
        Some("master") => true,
        _ => info_field(&info, "master_link_status") == Some("up"),
    }
}
