//! Following Sentinel's master. fred asks Sentinel which node is the master only when a
//! connection is made: one made while a frozen master's handshake was pending, and
//! answered once it woke after its failover, stays on the old master, which takes
//! writes until Sentinel demotes it (for good, when Sentinel cannot reach it). Each
//! health round asks Sentinel and moves the connections that are elsewhere.

use super::builder;
use fred::prelude::*;
use fred::types::config::Server;
use fred::types::{ClusterHash, CustomCommand};
use std::time::Duration;

/// Connections to the sentinels of the main Redis, and the service they are asked for.
#[derive(Debug)]
pub(super) struct Follower {
    sentinels: Vec<Client>,
    service: String,
}

impl Follower {
    /// A follower when `config` names a Sentinel-managed master, connected to each of
    /// its sentinels with the master's credentials and TLS (as fred reaches them).
    pub fn of(config: &Config, timeout: Duration) -> Result<Option<Self>, fred::error::Error> {
        let ServerConfig::Sentinel {
            hosts,
            service_name,
            username,
            password,
        } = &config.server
        else {
            return Ok(None);
        };
        let sentinels = hosts
            .iter()
            .map(|host| {
                let sentinel = Config {
                    server: ServerConfig::Centralized { server: host.clone() },
                    username: username.clone(),
                    password: password.clone(),
                    tls: config.tls.clone(),
                    // A sentinel out of reach at start is tried again, as after a
                    // drop: fred ends a connection whose first try fails fast for
                    // good, and its sentinel would never be asked.
                    fail_fast: false,
                    ..Config::default()
                };
                let client = builder(sentinel, timeout).build()?;
                client.connect();
                Ok(client)
            })
            .collect::<Result<_, fred::error::Error>>()?;
        Ok(Some(Self {
            sentinels,
            service: service_name.clone(),
        }))
    }

    /// The master the first sentinel (in the URL's order) that answers names. Every
    /// sentinel is asked at once: one after another, sentinels that do not answer would
    /// each hold the health round up for a Redis timeout.
    pub async fn master(&self) -> Option<(String, u16)> {
        let command = CustomCommand::new_static("SENTINEL", ClusterHash::Random, false);
        let asks = self.sentinels.iter().filter(|s| s.is_connected()).map(|sentinel| {
            let args = vec!["get-master-addr-by-name", self.service.as_str()];
            sentinel.custom::<Vec<String>, _>(command.clone(), args)
        });
        let answers = futures::future::join_all(asks).await;
        answers.into_iter().find_map(|answer| match answer.as_deref() {
            Ok([host, port]) => Some((host.clone(), port.parse().ok()?)),
            _ => None,
        })
    }

    /// Closes the connections to the sentinels.
    pub async fn quit(&self) {
        futures::future::join_all(self.sentinels.iter().map(|s| s.quit())).await;
    }
}

/// Checks that Redis tells `client`'s connection its id (`CLIENT ID`): the Redis client
/// learns which node each connection reaches from that answer alone, and without it
/// ([`Follower`]'s check finds no connection at all: an ACL without `client|id`) no
/// connection would be moved off a deposed master after a failover. Only a refusal
/// fails it; whether Redis answers, the other checks tell.
pub(super) async fn tells_connection_ids(client: &impl ClientLike) -> Result<(), crate::error::Error> {
    let command = CustomCommand::new_static("CLIENT", ClusterHash::Random, false);
    match client.custom::<i64, _>(command, vec!["ID"]).await {
        Err(e) if crate::error::refused_by_redis(&e) => Err(crate::error::Error::Startup(format!(
            "redis refuses CLIENT ID ({}): behind Sentinel, latchkey's user needs it (ACL +client|id) to tell which node each connection reaches after a failover",
            e.details()
        ))),
        _ => Ok(()),
    }
}

/// Whether a connection to `servers` is to another node than `master`.
pub(super) fn strays(servers: &[Server], master: &(String, u16)) -> bool {
    servers
        .iter()
        .any(|s| (&*s.host, s.port) != (master.0.as_str(), master.1))
}

/// Makes `client`'s connection again (to the master Sentinel names now) when it is to
/// another node than `master`. Waits at most `timeout`: fred answers only once the new
/// connection is made, which a master out of reach never lets happen, and the health
/// round that calls this must go on to report it. Not for a client reconnecting
/// already (fred keeps trying, through Sentinel): fred still lists its lost connection,
/// and each ask, left queued behind the reconnection, made the connection once more
/// when the master came back, a connection per round that had passed.
pub(super) async fn follow(client: &impl ClientLike, master: &(String, u16), timeout: Duration) {
    if !client.is_connected() {
        return;
    }
    let servers = client.active_connections();
    if strays(&servers, master) {
        tracing::warn!(connected = ?servers, master = ?master, "a connection is to a node Sentinel no longer names the master; moving it");
        let _ = tokio::time::timeout(timeout, client.force_reconnection()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::strays;
    use fred::types::config::Server;

    #[test]
    fn a_connection_strays_when_it_is_to_another_node() {
        let master = ("127.0.0.1".to_owned(), 6380);
        assert!(!strays(&[Server::new("127.0.0.1", 6380)], &master));
        assert!(strays(&[Server::new("127.0.0.1", 6379)], &master));
        assert!(strays(&[Server::new("10.0.0.1", 6380)], &master));
        assert!(!strays(&[], &master));
    }
}
