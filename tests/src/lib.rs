//! The end-to-end harness of latchkey: real `redis-server` processes (standalone,
//! cluster, sentinel), the real `latchkey-server` binary, and a Redisson stand-in that
//! speaks the Java client's lock protocol, all on free 127.0.0.1 ports and killed on
//! Drop.
//!
//! # Layout
//! - [`redis`]: [`RedisServer`], one `redis-server` in a temp dir; start, stop, restart.
//! - [`cluster`]: [`RedisCluster`], N masters with R replicas each, failover, node kills.
//! - [`sentinel`]: [`RedisSentinel`], a master watched by one sentinel.
//! - [`certs`]: [`certs::Pki`], throwaway CAs and certificates for TLS tests.
//! - [`client`]: [`redis_client`], a RESP3 fred client for a test's own commands.
//! - [`redisson`]: Redisson's lock, fair-lock and read/write-lock scripts and pub/sub.
//! - [`latchkey`]: [`LatchkeyProcess`], the server binary on free ports.
//! - [`process`]: free ports, log tails, bounded waits, raw-socket probes.
//! - [`proxy`]: a loopback TCP proxy that can freeze or slow the link.
//! - [`checker`]: the fault-injection checker (clients, faults, verifier).
//!
//! Every wait is bounded and every failure panics with the tail of the process's log.

pub mod certs;
pub mod checker;
pub mod client;
pub mod cluster;
pub mod latchkey;
pub mod process;
pub mod proxy;
pub mod redis;
pub mod redisson;
pub mod sentinel;
pub mod server;

pub use client::{redis_client, redis_client_unconnected};
pub use cluster::RedisCluster;
pub use latchkey::{gauges, http_get, metric, scrape_metrics, LatchkeyProcess};
pub use process::{bounded, free_port, poll_until};
pub use redis::RedisServer;
pub use sentinel::RedisSentinel;
