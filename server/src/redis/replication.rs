//! Which replicas have a primary's writes, under `--sync-replicas`: the health
//! check counts the replicas that acknowledge at all, and renewals wait for theirs.
//! A grant waits with `WAIT` on the connection that wrote it; a renewal round's batches
//! go on the shared pool (their connections carry every other call too, which a
//! blocking `WAIT` would hold up), so the round reads the node's replication offset
//! once its last batch is answered and waits until enough replicas acknowledge that
//! offset: every write the node made before, the round's renewals among them.

use super::Backend;
use crate::error::Error;
use fred::clients::Client;
use fred::interfaces::{ClientLike, ClusterInterface};
use fred::types::config::Options;
use fred::types::InfoKind;
use std::time::Duration;

/// How often the offsets the replicas acknowledged are read while waiting for them.
const POLL: Duration = Duration::from_millis(50);

/// How long a replica may take to acknowledge unasked: it does so every second (only
/// `WAIT` asks it sooner), and its timer may run a little late.
const ACK_WAIT: Duration = Duration::from_millis(1200);

/// The longest a renewal round waits for the replicas after its last call, given
/// `--sync-timeout`: that, and the time a replica takes to acknowledge unasked.
pub fn replica_wait(sync_timeout: Duration) -> Duration {
    sync_timeout + ACK_WAIT
}

/// A primary's replication as `INFO replication` tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replication {
    /// The replication history (`master_replid`): a failover starts a new one, and
    /// what the old primary wrote may not be in it.
    id: String,
    /// How far the primary's writes go (`master_repl_offset`).
    offset: u64,
    /// How far each online replica has acknowledged them.
    acked: Vec<u64>,
}

impl Replication {
    /// Reads an `INFO replication` answer; `None` unless it is a primary's.
    fn parse(info: &str) -> Option<Self> {
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        if field("role")? != "master" {
            return None;
        }
        let acked = online_replicas(info)
            .filter_map(|r| replica_field(r, "offset"))
            .collect();
        Some(Self {
            id: field("master_replid")?.to_owned(),
            offset: field("master_repl_offset")?.parse().ok()?,
            acked,
        })
    }

    /// Whether `wanted` replicas acknowledged every write up to `offset`.
    fn holds(&self, offset: u64, wanted: u32) -> bool {
        self.acked.iter().filter(|&&acked| acked >= offset).count() >= wanted as usize
    }
}

/// The lines of an `INFO replication` answer that describe an online replica.
fn online_replicas(info: &str) -> impl Iterator<Item = &str> {
    info.lines()
        .filter(|l| l.starts_with("slave") && l.contains("state=online"))
}

/// A number field (`offset`, `lag`) of a replica's line.
fn replica_field(line: &str, name: &str) -> Option<u64> {
    let value = line.split(',').find_map(|f| f.strip_prefix(name)?.strip_prefix('='))?;
    value.trim().parse().ok()
}

/// The replicas in an `INFO replication` answer that acknowledge writes: online, and
/// heard from within [`REPLICA_LAG_MAX`] seconds (a replica acknowledges every second;
/// a frozen one stays connected until Redis' replication timeout, a minute).
pub(super) fn acknowledging(info: &str) -> usize {
    let heard = |r: &&str| replica_field(r, "lag").is_some_and(|lag| lag <= REPLICA_LAG_MAX);
    online_replicas(info).filter(heard).count()
}

/// The most seconds since a replica's last acknowledgement for it to count as
/// acknowledging (see [`acknowledging`]).
const REPLICA_LAG_MAX: u64 = 2;

impl Backend {
    /// The replication of the main Redis's node `node` (its address as `by_node`
    /// names it; "" off a cluster) now, asked through `client`: a renewal round asks
    /// through the client it renews on, whose connection reaches the node its calls
    /// reached (another client of the pool may still be on a deposed primary).
    pub async fn replication(&self, client: &Client, node: &str) -> Result<Replication, Error> {
        let mut options = Options {
            timeout: Some(self.timeout),
            ..Default::default()
        };
        if self.cluster && node.is_empty() {
            return Err(gone("the cluster's slot map is not known yet".to_owned()));
        }
        if !node.is_empty() {
            let primaries = client.cached_cluster_state().map(|s| s.unique_primary_nodes());
            let server = primaries
                .unwrap_or_default()
                .into_iter()
                .find(|s| s.to_string() == node);
            options.cluster_node = Some(server.ok_or_else(|| gone(format!("{node} is no longer a primary")))?);
        }
        let info: String = client.with_options(&options).info(Some(InfoKind::Replication)).await?;
        Replication::parse(&info).ok_or_else(|| gone(format!("{node:?} is not a primary")))
    }

    /// Waits until the replicas `--sync-replicas` asks for acknowledge every write
    /// node `node` made before this call, which must find it in the replication
    /// history of `before` (a failover since then may have lost what it wrote): false
    /// when they do not within `--sync-timeout` and the time a replica may take to
    /// acknowledge unasked ([`ACK_WAIT`]). True at once without `--sync-replicas`.
    pub async fn replicated(&self, client: &Client, node: &str, before: &Replication) -> Result<bool, Error> {
        let Some((_, wanted, timeout)) = &self.sync else {
            return Ok(true);
        };
        let deadline = tokio::time::Instant::now() + replica_wait(*timeout);
        let mut now = self.replication(client, node).await?;
        let offset = now.offset;
        loop {
            if now.id != before.id {
                return Ok(false);
            }
            if now.holds(offset, *wanted) {
                return Ok(true);
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            tokio::time::sleep(POLL.min(left)).await;
            now = self.replication(client, node).await?;
        }
    }

    /// The longest a renewal round waits for the replicas after its last call
    /// (`--sync-replicas`; none without).
    pub fn replica_wait(&self) -> Duration {
        self.sync
            .as_ref()
            .map_or(Duration::ZERO, |(_, _, timeout)| replica_wait(*timeout))
    }
}

/// Whether `client` routes `slot` to `node` (off a cluster, always): a lease renewed
/// on a round's node whose slot it no longer routes there was renewed elsewhere (a
/// batch redirected after the slot moved, or retried by its slot), whose replicas
/// that round did not ask.
pub fn routes_to(client: &Client, slot: u16, node: &str) -> bool {
    let routing = client.cached_cluster_state();
    node.is_empty()
        || routing
            .and_then(|r| r.get_server(slot).map(|s| s.to_string()))
            .as_deref()
            == Some(node)
}

/// A node that cannot tell its replication: its renewals are not confirmed.
fn gone(why: String) -> Error {
    Error::Redis(fred::error::Error::new(fred::error::ErrorKind::Cluster, why))
}

#[cfg(test)]
mod tests {
    use super::{acknowledging, Replication};

    #[test]
    fn replicas_acknowledge_while_online_and_heard_from() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:3\r\n\
            slave0:ip=127.0.0.1,port=1,state=online,offset=10,lag=0\r\n\
            slave1:ip=127.0.0.1,port=2,state=online,offset=10,lag=9\r\n\
            slave2:ip=127.0.0.1,port=3,state=wait_bgsave,offset=0,lag=0\r\n";
        assert_eq!(acknowledging(info), 1);
        assert_eq!(acknowledging("role:master\r\nconnected_slaves:0\r\n"), 0);
    }

    #[test]
    fn a_primarys_offset_and_its_online_replicas_acknowledgements_are_read() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:3\r\n\
            slave0:ip=127.0.0.1,port=1,state=online,offset=120,lag=0\r\n\
            slave1:ip=127.0.0.1,port=2,state=online,offset=90,lag=1\r\n\
            slave2:ip=127.0.0.1,port=3,state=wait_bgsave,offset=0,lag=0\r\n\
            master_failover_state:no-failover\r\n\
            master_replid:5c1a\r\nmaster_replid2:0000\r\nmaster_repl_offset:120\r\n";
        let r = Replication::parse(info).expect("a primary's");
        assert_eq!(
            (r.id.as_str(), r.offset, r.acked.as_slice()),
            ("5c1a", 120, &[120, 90][..])
        );
        assert!(r.holds(120, 1) && r.holds(90, 2));
        assert!(!r.holds(120, 2), "one replica is behind, the third not online");
        let replica = "# Replication\r\nrole:slave\r\nmaster_replid:5c1a\r\nmaster_repl_offset:120\r\n";
        assert_eq!(Replication::parse(replica), None, "a replica's writes are not its own");
    }
}
