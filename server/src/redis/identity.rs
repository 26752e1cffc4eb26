//! Which Redis each RedLock deployment is: the `run_id` of `INFO server`, read when its
//! connection is made and after each reconnection. One Redis reached through two
//! `--redlock-url`s (a host name and its address, an alias, a Sentinel's master named
//! directly too), or the main Redis among them, would count twice toward a majority; a
//! URL check before connecting cannot tell. Such a node counts for no majority: the
//! server refuses to start when it sees it at start, and after that (a node that was
//! down at start, a Sentinel that failed over) it logs an error and counts the node
//! out until it leads elsewhere.

use fred::prelude::*;
use fred::types::InfoKind;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::broadcast::error::RecvError;
use tokio::task::JoinHandle;

/// What a RedLock node is known to be.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Identity {
    /// Not connected, or (re)connected and not asked yet: counts for no majority.
    Unknown,
    /// `INFO server`'s `run_id`.
    Known(String),
    /// `INFO` refused (an ACL user without it): counts, unchecked, as said at start.
    Unreadable,
}

/// The identities of the RedLock nodes and of the main Redis, and which nodes count.
#[derive(Debug)]
pub struct Identities {
    /// Each node's flag and URL, without credentials, for messages.
    labels: Vec<String>,
    /// Whether node i counts toward a majority, read on every try.
    counts: Vec<AtomicBool>,
    /// Once start has checked: later refusals are logged.
    started: AtomicBool,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    nodes: Vec<Identity>,
    /// The main Redis's run ids (every primary of a cluster); empty while unknown.
    main: Vec<String>,
    /// Why node i counts for nothing, when it does not.
    refused: Vec<Option<String>>,
}

impl Identities {
    /// Nothing known yet: no node counts.
    pub fn new(labels: Vec<String>) -> Self {
        let n = labels.len();
        Self {
            counts: (0..n).map(|_| AtomicBool::new(false)).collect(),
            labels,
            started: AtomicBool::new(false),
            state: Mutex::new(State {
                nodes: vec![Identity::Unknown; n],
                main: Vec::new(),
                refused: vec![None; n],
            }),
        }
    }

    /// Whether node `i` counts toward a majority: its Redis is known (or cannot be
    /// asked) and is neither the main Redis nor one an earlier node leads to.
    pub fn counts(&self, i: usize) -> bool {
        self.counts.get(i).is_some_and(|c| c.load(Ordering::Acquire))
    }

    /// Node `i`'s flag and URL, without credentials.
    pub fn label(&self, i: usize) -> &str {
        &self.labels[i]
    }

    /// Why nodes count for nothing now.
    pub fn refusals(&self) -> Vec<String> {
        self.lock().refused.iter().flatten().cloned().collect()
    }

    /// From now on, a node refused is an error in the log.
    pub fn started(&self) {
        self.started.store(true, Ordering::Release);
    }

    fn set_node(&self, i: usize, identity: Identity) {
        let mut state = self.lock();
        if let Some(slot) = state.nodes.get_mut(i) {
            *slot = identity;
        }
        self.recount(&mut state);
    }

    fn set_main(&self, ids: Vec<String>) {
        let mut state = self.lock();
        state.main = ids;
        self.recount(&mut state);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Decides again which nodes count: of the nodes that lead to one Redis the first
    /// counts, and none that leads to the main Redis.
    fn recount(&self, state: &mut State) {
        let mut seen: HashMap<&str, &str> = state
            .main
            .iter()
            .map(|id| (id.as_str(), "the main Redis (--redis-url)"))
            .collect();
        let mut refused = vec![None; state.nodes.len()];
        for (i, identity) in state.nodes.iter().enumerate() {
            let label = self.labels[i].as_str();
            let counts = match identity {
                Identity::Known(id) => match seen.get(id.as_str()) {
                    Some(other) => {
                        refused[i] = Some(format!(
                            "{label} leads to the same Redis as {other} (run_id {id}): a majority must be of independent deployments"
                        ));
                        false
                    }
                    None => {
                        seen.insert(id, label);
                        true
                    }
                },
                Identity::Unreadable => true,
                // Asked again after a reconnection: whatever it was refused for stands
                // until it answers.
                Identity::Unknown => {
                    refused[i] = state.refused[i].clone();
                    false
                }
            };
            self.counts[i].store(counts, Ordering::Release);
        }
        if self.started.load(Ordering::Acquire) {
            for (i, (was, now)) in state.refused.iter().zip(&refused).enumerate() {
                match (was, now) {
                    (None, Some(why)) => tracing::error!("{why}; it counts for no RedLock majority"),
                    (Some(_), None) => tracing::warn!("{} leads to a Redis of its own again", self.labels[i]),
                    _ => {}
                }
            }
        }
        state.refused = refused;
    }
}

/// The `run_id` of the Redis `client` talks to.
async fn run_id(client: &impl ClientLike) -> Result<String, fred::error::Error> {
    let info: String = client.info(Some(InfoKind::Server)).await?;
    info.lines()
        .find_map(|l| l.trim().strip_prefix("run_id:"))
        .map(str::to_owned)
        .ok_or_else(|| fred::error::Error::new(fred::error::ErrorKind::Protocol, "INFO server has no run_id"))
}

/// The run ids of the main Redis: its one server, or every primary of a cluster.
async fn main_ids(client: &Client, cluster: bool) -> Result<Vec<String>, fred::error::Error> {
    if !cluster {
        return Ok(vec![run_id(client).await?]);
    }
    let primaries = client
        .cached_cluster_state()
        .map(|s| s.unique_primary_nodes())
        .unwrap_or_default();
    let mut ids = Vec::with_capacity(primaries.len());
    for server in primaries {
        ids.push(run_id(&client.with_cluster_node(server)).await?);
    }
    Ok(ids)
}

/// Asks `question` of `client`'s Redis, each ask bounded by `timeout`, again while it
/// stays connected and does not answer: `None` once it is disconnected (its next
/// connection asks again), an error when Redis refuses.
async fn ask<T, Q>(
    client: &Client,
    timeout: Duration,
    question: impl Fn() -> Q,
) -> Result<Option<T>, fred::error::Error>
where
    Q: std::future::Future<Output = Result<T, fred::error::Error>>,
{
    loop {
        match tokio::time::timeout(timeout, question()).await {
            Ok(Ok(answer)) => return Ok(Some(answer)),
            Ok(Err(e)) if !super::transient(&e) => return Err(e),
            _ if !client.is_connected() => return Ok(None),
            _ => tokio::time::sleep(timeout).await,
        }
    }
}

/// Asks node `label`'s Redis who it is. A refusal (no permission for `INFO`) makes it
/// unreadable, said once.
async fn read_node(client: &Client, label: &str, timeout: Duration) -> Identity {
    match ask(client, timeout, || run_id(client)).await {
        Ok(Some(id)) => Identity::Known(id),
        Ok(None) => Identity::Unknown,
        Err(e) => {
            tracing::warn!(
                error = %e,
                "{label}: INFO refused, so whether it is another --redlock-url's Redis (or the main one) is not checked"
            );
            Identity::Unreadable
        }
    }
}

/// Reads the main Redis's run ids, until it answers or is disconnected (its next
/// connection reads them again).
async fn read_main(client: &Client, cluster: bool, timeout: Duration) -> Option<Vec<String>> {
    ask(client, timeout, || main_ids(client, cluster)).await.ok().flatten()
}

/// Checks the nodes and the main Redis now, each within `timeout` (a node or a main
/// Redis that is down is checked once it connects), and again after each of their
/// reconnections, in tasks returned to be aborted when the server stops.
pub async fn check(
    identities: &Arc<Identities>,
    nodes: &[Client],
    main: &Client,
    cluster: bool,
    timeout: Duration,
) -> Vec<JoinHandle<()>> {
    // Listening first: no connection made after this goes unchecked.
    let mut watchers: Vec<JoinHandle<()>> = nodes
        .iter()
        .enumerate()
        .map(|(i, client)| {
            let (identities, client) = (identities.clone(), client.clone());
            let mut events = client.reconnect_rx();
            tokio::spawn(async move {
                while !matches!(events.recv().await, Err(RecvError::Closed)) {
                    identities.set_node(i, Identity::Unknown);
                    let identity = read_node(&client, &identities.labels[i], timeout).await;
                    identities.set_node(i, identity);
                }
            })
        })
        .collect();
    let (identities_main, client) = (identities.clone(), main.clone());
    let mut events = client.reconnect_rx();
    watchers.push(tokio::spawn(async move {
        while !matches!(events.recv().await, Err(RecvError::Closed)) {
            if let Some(ids) = read_main(&client, cluster, timeout).await {
                identities_main.set_main(ids);
            }
        }
    }));
    let now = nodes.iter().enumerate().map(|(i, client)| async move {
        let read = async {
            client.wait_for_connect().await.ok()?;
            let identity = read_node(client, &identities.labels[i], timeout).await;
            Some(identity)
        };
        if let Ok(Some(identity)) = tokio::time::timeout(timeout, read).await {
            identities.set_node(i, identity);
        }
    });
    let main_now = async {
        let read = async {
            main.wait_for_connect().await.ok()?;
            read_main(main, cluster, timeout).await
        };
        if let Ok(Some(ids)) = tokio::time::timeout(timeout, read).await {
            identities.set_main(ids);
        }
    };
    tokio::join!(futures::future::join_all(now), main_now);
    watchers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels() -> Vec<String> {
        (1..=3).map(|i| format!("--redlock-url #{i}")).collect()
    }

    #[test]
    fn one_redis_counts_once_and_never_beside_the_main_one() {
        let ids = Identities::new(labels());
        assert!(!ids.counts(0), "unknown");
        for (i, id) in ["a", "b", "a"].into_iter().enumerate() {
            ids.set_node(i, Identity::Known(id.into()));
        }
        assert_eq!((ids.counts(0), ids.counts(1), ids.counts(2)), (true, true, false));
        assert!(ids.refusals()[0].contains("#3 leads to the same Redis as --redlock-url #1"));
        ids.set_main(vec!["b".into()]);
        assert_eq!((ids.counts(0), ids.counts(1), ids.counts(2)), (true, false, false));
        // The third node fails over to a Redis of its own: it counts again.
        ids.set_node(2, Identity::Known("c".into()));
        ids.set_node(1, Identity::Unreadable);
        assert_eq!((ids.counts(0), ids.counts(1), ids.counts(2)), (true, true, true));
        assert!(ids.refusals().is_empty());
    }
}
