//! Which Redis each RedLock deployment is: the `run_id` of `INFO server`, read when its
//! connection is made and after each reconnection. One Redis reached through two
//! `--redlock-url`s (a host name and its address, an alias, a Sentinel's master named
//! directly too), or the main Redis among them, would count twice toward a majority; a
//! URL check before connecting cannot tell. Such a node counts for no majority: the
//! server refuses to start when it sees it at start, and after that (a node that was
//! down at start, a Sentinel that failed over) it logs an error and counts the node
//! out until it leads elsewhere.
//!
//! A node that restarted forgets the grants it held unless it wrote each one to disk
//! before answering; a failover to a replica may lose the last of them. Such a node,
//! with the free votes of a node that missed a grant (down or slow at the time), would
//! grant a lock still held: the Redlock algorithm's delayed restart keeps it out of
//! every majority until the longest lease it may have forgotten is over
//! (`--redlock-restart-delay`). Its `uptime_in_seconds` tells a restart to a server
//! that never saw it before (one started since); a new `run_id` on a reconnection
//! tells a failover too.

use fred::prelude::*;
use fred::types::InfoKind;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
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
    /// How long a restarted node counts for nothing (`--redlock-restart-delay`).
    restart_delay: Duration,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    nodes: Vec<Identity>,
    /// The main Redis's run ids (every primary of a cluster); empty while unknown.
    main: Vec<String>,
    /// Why node i counts for nothing, when it does not.
    refused: Vec<Option<String>>,
    /// Node i's `run_id` when last known: another one on a reconnection is a restart
    /// or a failover.
    last: Vec<Option<String>>,
    /// Until when node i, restarted, counts for no majority.
    out_until: Vec<Option<Instant>>,
}

impl Identities {
    /// Nothing known yet: no node counts. A node restarted less than `restart_delay`
    /// ago will count once it has been up that long.
    pub fn new(labels: Vec<String>, restart_delay: Duration) -> Self {
        let n = labels.len();
        Self {
            counts: (0..n).map(|_| AtomicBool::new(false)).collect(),
            labels,
            started: AtomicBool::new(false),
            restart_delay,
            state: Mutex::new(State {
                nodes: vec![Identity::Unknown; n],
                main: Vec::new(),
                refused: vec![None; n],
                last: vec![None; n],
                out_until: vec![None; n],
            }),
        }
    }

    /// Whether node `i` counts toward a majority: its Redis is known (or cannot be
    /// asked), is neither the main Redis nor one an earlier node leads to, and has
    /// not restarted within the restart delay.
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

    /// Node `i` is `identity` now, up for `up` when it said so.
    fn set_node(&self, i: usize, identity: Identity, up: Option<Duration>) {
        let mut state = self.lock();
        if let Identity::Known(id) = &identity {
            self.sit_out(&mut state, i, id, up);
        }
        if let Some(slot) = state.nodes.get_mut(i) {
            *slot = identity;
        }
        self.recount(&mut state);
    }

    /// Keeps node `i` (run id `id`, up for `up`) out of every majority until it has
    /// been up for the restart delay, or for the delay from now when it answers with
    /// another run id than before (a failover's replica may have been up for long).
    /// Never shortens a wait under way: a reconnection to the same new Redis answers
    /// with its run id, now the last one, and its uptime would cut short the wait its
    /// first answer began.
    fn sit_out(&self, state: &mut State, i: usize, id: &str, up: Option<Duration>) {
        let now = Instant::now();
        let restarted = up.and_then(|up| self.restart_delay.checked_sub(up));
        let replaced = state.last[i].as_deref().is_some_and(|last| last != id);
        let left = match replaced {
            true => Some(self.restart_delay),
            false => restarted,
        };
        state.last[i] = Some(id.to_owned());
        let Some(left) = left.filter(|left| !left.is_zero()) else {
            return;
        };
        let until = now + left;
        state.out_until[i] = Some(state.out_until[i].map_or(until, |before| before.max(until)));
        let why = match replaced {
            true => "answers as another Redis than before (a restart or a failover)".to_owned(),
            false => format!("started {}s ago", up.unwrap_or_default().as_secs()),
        };
        tracing::warn!(
            "{} {why}: it counts for no RedLock majority for {}s more, as it may have forgotten grants still held (--redlock-restart-delay)",
            self.labels[i],
            left.as_secs_f64().ceil()
        );
    }

    /// When the next node that sits out may count again.
    fn back_at(&self, i: usize) -> Option<Instant> {
        self.lock().out_until.get(i).copied().flatten()
    }

    /// Counts again the nodes whose time out is over.
    fn sat_out(&self) {
        let mut state = self.lock();
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
        let now = Instant::now();
        let mut back = vec![false; state.nodes.len()];
        for (slot, back) in state.out_until.iter_mut().zip(&mut back) {
            *back = slot.is_some_and(|until| until <= now);
            *slot = slot.filter(|until| *until > now);
        }
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
            let counts = counts && state.out_until[i].is_none();
            if back[i] && counts {
                tracing::info!(
                    "{} sat out its restart delay: it counts toward RedLock majorities",
                    self.labels[i]
                );
            }
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

/// The `run_id` of the Redis `client` talks to, and how long it has been up
/// (`uptime_in_seconds`, when it says).
async fn run_id(client: &impl ClientLike) -> Result<(String, Option<Duration>), fred::error::Error> {
    let info: String = client.info(Some(InfoKind::Server)).await?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .map(str::to_owned)
    };
    let up = field("uptime_in_seconds:")
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs);
    field("run_id:")
        .map(|id| (id, up))
        .ok_or_else(|| fred::error::Error::new(fred::error::ErrorKind::Protocol, "INFO server has no run_id"))
}

/// The run ids of the main Redis: its one server, or every primary of a cluster.
async fn main_ids(client: &Client, cluster: bool) -> Result<Vec<String>, fred::error::Error> {
    if !cluster {
        return Ok(vec![run_id(client).await?.0]);
    }
    let primaries = client
        .cached_cluster_state()
        .map(|s| s.unique_primary_nodes())
        .unwrap_or_default();
    let mut ids = Vec::with_capacity(primaries.len());
    for server in primaries {
        ids.push(run_id(&client.with_cluster_node(server)).await?.0);
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

/// Asks node `i`'s Redis who it is, and how long it has been up, and sets what it
/// answers. A refusal (no permission for `INFO`) makes it unreadable, said once.
async fn read_node(identities: &Identities, i: usize, client: &Client, timeout: Duration) {
    let (identity, up) = match ask(client, timeout, || run_id(client)).await {
        Ok(Some((id, up))) => (Identity::Known(id), up),
        Ok(None) => (Identity::Unknown, None),
        Err(e) => {
            tracing::warn!(
                error = %e,
                "{}: INFO refused, so whether it is another --redlock-url's Redis (or the main one), or restarted lately, is not checked",
                identities.labels[i]
            );
            (Identity::Unreadable, None)
        }
    };
    identities.set_node(i, identity, up);
}

/// Reads the main Redis's run ids, until it answers or is disconnected (its next
/// connection reads them again).
async fn read_main(identities: &Identities, client: &Client, cluster: bool, timeout: Duration) {
    if let Ok(Some(ids)) = ask(client, timeout, || main_ids(client, cluster)).await {
        identities.set_main(ids);
    }
}

/// Checks the nodes and the main Redis now, waiting `timeout` for their answers (a
/// node or a main Redis that is down is checked once it connects), and again after
/// each of their reconnections, in tasks returned to be aborted when the server stops.
/// A Redis that is slow to answer (busy running a long script) is asked on in the
/// background: it counts once it answers, not only after a reconnection.
pub async fn check(
    identities: &Arc<Identities>,
    nodes: &[Client],
    main: &Client,
    cluster: bool,
    timeout: Duration,
) -> Vec<JoinHandle<()>> {
    let (mut watchers, mut first_reads) = (Vec::new(), Vec::new());
    for (i, client) in nodes.iter().enumerate() {
        let (read, first) = tokio::sync::oneshot::channel();
        watchers.push(tokio::spawn(watch_node(
            identities.clone(),
            i,
            client.clone(),
            timeout,
            read,
        )));
        first_reads.push(first);
    }
    let (read, first) = tokio::sync::oneshot::channel();
    watchers.push(tokio::spawn(watch_main(
        identities.clone(),
        main.clone(),
        cluster,
        timeout,
        read,
    )));
    first_reads.push(first);
    let _ = tokio::time::timeout(timeout, futures::future::join_all(first_reads)).await;
    watchers
}

/// Waits up to `timeout` for `client` to connect, as at start: whether it did.
async fn connected(client: &Client, timeout: Duration) -> bool {
    let _ = tokio::time::timeout(timeout, client.wait_for_connect()).await;
    client.is_connected()
}

/// Reads node `i` now and after each of its reconnections, one read at a time (a read
/// of an older connection never overwrites a newer one's), telling `read` when the
/// first is done; counts it again when a restart delay it sits out is over.
async fn watch_node(
    identities: Arc<Identities>,
    i: usize,
    client: Client,
    timeout: Duration,
    read: tokio::sync::oneshot::Sender<()>,
) {
    // Listening first: no connection made after this goes unchecked.
    let mut events = client.reconnect_rx();
    if connected(&client, timeout).await {
        read_node(&identities, i, &client, timeout).await;
    }
    let _ = read.send(());
    loop {
        // Only this task reads node i, so its time out is known here.
        let back = identities.back_at(i);
        let sat_out = async { tokio::time::sleep_until(back.unwrap_or_else(Instant::now).into()).await };
        tokio::select! {
            event = events.recv() => {
                if matches!(event, Err(RecvError::Closed)) {
                    return;
                }
                identities.set_node(i, Identity::Unknown, None);
                read_node(&identities, i, &client, timeout).await;
            }
            () = sat_out, if back.is_some() => identities.sat_out(),
        }
    }
}

/// Reads the main Redis's run ids now and after each of its reconnections, telling
/// `read` when the first read is done.
async fn watch_main(
    identities: Arc<Identities>,
    client: Client,
    cluster: bool,
    timeout: Duration,
    read: tokio::sync::oneshot::Sender<()>,
) {
    let mut events = client.reconnect_rx();
    if connected(&client, timeout).await {
        read_main(&identities, &client, cluster, timeout).await;
    }
    let _ = read.send(());
    while !matches!(events.recv().await, Err(RecvError::Closed)) {
        read_main(&identities, &client, cluster, timeout).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels() -> Vec<String> {
        (1..=3).map(|i| format!("--redlock-url #{i}")).collect()
    }

    /// Up for an hour: sits out no restart delay.
    const LONG_UP: Option<Duration> = Some(Duration::from_secs(3600));

    #[test]
    fn one_redis_counts_once_and_never_beside_the_main_one() {
        let ids = Identities::new(labels(), Duration::from_secs(30));
        assert!(!ids.counts(0), "unknown");
        for (i, id) in ["a", "b", "a"].into_iter().enumerate() {
            ids.set_node(i, Identity::Known(id.into()), LONG_UP);
        }
        assert_eq!((ids.counts(0), ids.counts(1), ids.counts(2)), (true, true, false));
        assert!(ids.refusals()[0].contains("#3 leads to the same Redis as --redlock-url #1"));
        ids.set_main(vec!["b".into()]);
        assert_eq!((ids.counts(0), ids.counts(1), ids.counts(2)), (true, false, false));
        // The third node is replaced by a Redis of its own: it counts again once it
        // sat out the delay (a failover's replica may lack grants), the second once
        // it is told apart from the main Redis.
        ids.set_node(2, Identity::Known("c".into()), LONG_UP);
        ids.set_node(1, Identity::Unreadable, None);
        assert_eq!((ids.counts(0), ids.counts(1), ids.counts(2)), (true, true, false));
        assert!(ids.refusals().is_empty());
    }

    #[test]
    fn a_restarted_node_counts_once_it_sat_out_the_delay() {
        let delay = Duration::from_millis(200);
        let ids = Identities::new(labels(), delay);
        // Up for less than the delay: a restart this server did not see.
        ids.set_node(0, Identity::Known("a".into()), Some(Duration::ZERO));
        ids.set_node(1, Identity::Known("b".into()), LONG_UP);
        assert_eq!((ids.counts(0), ids.counts(1)), (false, true));
        // Back with another run id after a reconnection, however long it has been up.
        ids.set_node(1, Identity::Unknown, None);
        ids.set_node(1, Identity::Known("b2".into()), LONG_UP);
        assert!(!ids.counts(1), "a failover sits out too");
        // The same Redis after a reconnection: no restart.
        ids.set_node(2, Identity::Known("c".into()), LONG_UP);
        ids.set_node(2, Identity::Unknown, None);
        ids.set_node(2, Identity::Known("c".into()), LONG_UP);
        assert!(ids.counts(2));
        let back = ids.back_at(1).expect("sits out");
        assert!(back <= Instant::now() + delay);
        std::thread::sleep(delay);
        ids.sat_out();
        assert_eq!((ids.counts(0), ids.counts(1)), (true, true));
        assert_eq!(ids.back_at(0), None);
    }

    /// A reconnection to the Redis a failover put behind a node (another run id, up for
    /// less than the delay) leaves its wait whole. It cut the wait to what that Redis's
    /// uptime left, though a replica promoted may lack grants still held: a holder on a
    /// bare majority and another client could both hold the lock meanwhile.
    #[test]
    fn a_reconnection_leaves_a_failed_over_node_its_whole_wait() {
        let delay = Duration::from_secs(30);
        let ids = Identities::new(labels(), delay);
        ids.set_node(1, Identity::Known("b".into()), LONG_UP);
        ids.set_node(1, Identity::Unknown, None);
        ids.set_node(1, Identity::Known("b2".into()), Some(Duration::from_secs(20)));
        let whole = ids.back_at(1).expect("sits out");
        ids.set_node(1, Identity::Unknown, None);
        ids.set_node(1, Identity::Known("b2".into()), Some(Duration::from_secs(21)));
        let after = ids.back_at(1).expect("still sits out");
        assert!(after >= whole, "cut short by {:?}", whole - after);
        assert!(!ids.counts(1));
    }

    #[test]
    fn no_restart_delay_counts_a_node_at_once() {
        let ids = Identities::new(labels(), Duration::ZERO);
        ids.set_node(0, Identity::Known("a".into()), Some(Duration::ZERO));
        ids.set_node(0, Identity::Known("a2".into()), Some(Duration::ZERO));
        assert!(ids.counts(0));
    }
}
