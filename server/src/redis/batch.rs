//! Script calls of one scheduler round share one Redis call. fred writes every
//! command with a write of its own; a server answering thousands of lock operations a
//! second would make one write per operation, and Redis one read and one script run.
//!
//! While few calls are in flight a call goes alone, at once. Beyond that, calls queue
//! here: the first call of a round starts a task that lets the other ready tasks run,
//! so their calls join the round, then sends the round, a lone call as itself and
//! several as one `batch.lua` call per Redis node, which runs each call as its own
//! script would.

use crate::scripts::{Script, Scripts};
use fred::error::{Error, ErrorKind};
use fred::interfaces::ClusterInterface;
use fred::prelude::{Client, Key, Pool, Value};
use latchkey_proto::coalesce::ReadyTasksFirst;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// Calls in flight from which a call joins a round rather than going alone.
const BATCH_FROM: usize = 4;
/// Most calls in one batch: a burst (thousands of waiters trying at once) goes out as
/// several batches, so no single script holds Redis for long, and the connection's
/// write and read buffers, which keep the size of the largest command and reply they
/// carried, stay small.
const BATCH_MAX: usize = 64;

/// One queued call.
struct Call {
    script: &'static str,
    keys: Vec<Key>,
    args: Vec<Value>,
    reply: oneshot::Sender<Result<Value, Error>>,
}

/// The queue of the current round and what sending it needs.
pub struct Batcher {
    pool: Pool,
    scripts: Arc<Scripts>,
    cluster: bool,
    queue: Mutex<Vec<Call>>,
    /// Calls sent and not yet answered.
    in_flight: AtomicUsize,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher").field("cluster", &self.cluster).finish()
    }
}

impl Batcher {
    /// Batches the calls sent through `pool`.
    pub fn new(pool: Pool, scripts: Arc<Scripts>, cluster: bool) -> Self {
        Self {
            pool,
            scripts,
            cluster,
            queue: Mutex::default(),
            in_flight: AtomicUsize::new(0),
        }
    }

    /// Runs `script` with the calls of this round; its reply, or the error Redis gave
    /// it (NOSCRIPT included: the caller loads the script again).
    pub async fn call(self: &Arc<Self>, script: &Script, keys: Vec<Key>, args: Vec<Value>) -> Result<Value, Error> {
        let counted = InFlight::count(&self.in_flight);
        // Few calls in flight: a round would hold this one for no company. (Boxed: a
        // script call's future is large, and every try's future, which would hold it
        // even on the batched path, is moved once.)
        if counted.others() < BATCH_FROM {
            return Box::pin(script.eval(self.pool.next_connected(), keys, args)).await;
        }
        let (reply, answer) = oneshot::channel();
        let call = Call {
            script: script.name(),
            keys,
            args,
            reply,
        };
        let first = {
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            queue.push(call);
            queue.len() == 1
        };
        if first {
            let batcher = self.clone();
            tokio::spawn(async move { batcher.round().await });
        }
        answer.await.unwrap_or_else(|_| Err(Error::new_canceled()))
    }

    /// Sends the calls queued by the time every other ready task has run.
    async fn round(&self) {
        ReadyTasksFirst::default().await;
        let calls = std::mem::take(&mut *self.queue.lock().unwrap_or_else(|e| e.into_inner()));
        let sends = self
            .by_node(calls)
            .into_iter()
            .flat_map(|group| at_most(BATCH_MAX, group))
            .map(|group| self.send(group));
        futures::future::join_all(sends).await;
    }

    /// Groups calls by the node that serves their keys (one group off a cluster): a
    /// script may span the slots of one node only.
    fn by_node(&self, calls: Vec<Call>) -> Vec<Vec<Call>> {
        let routing = self
            .cluster
            .then(|| self.pool.next_connected().cached_cluster_state())
            .flatten();
        let Some(routing) = routing else {
            return vec![calls];
        };
        let mut groups: HashMap<String, Vec<Call>> = HashMap::new();
        for call in calls {
            let slot = call.keys.first().map_or(0, Key::cluster_hash);
            let node = routing.get_server(slot).map(|s| s.to_string()).unwrap_or_default();
            groups.entry(node).or_default().push(call);
        }
        groups.into_values().collect()
    }

    async fn send(&self, mut calls: Vec<Call>) {
        let client = self.pool.next_connected();
        if calls.len() == 1 {
            if let Some(call) = calls.pop() {
                self.send_alone(client, call).await;
            }
            return;
        }
        let batch = || batch_args(&calls, self.cluster);
        match self.scripts.batch.eval_with::<Value, _>(client, batch).await {
            Ok(Value::Array(replies)) if replies.len() == 2 * calls.len() => {
                let mut replies = replies.into_iter();
                for call in calls {
                    let flag = replies.next().unwrap_or(Value::Null);
                    let value = replies.next().unwrap_or(Value::Null);
                    let _ = call.reply.send(unwrap_reply(flag, value));
                }
            }
            Ok(other) => {
                let error = Error::new(ErrorKind::Parse, format!("batch returned {other:?}"));
                for call in calls {
                    let _ = call.reply.send(Err(error.clone()));
                }
            }
            // The calls may have run, or may still: each is told, as it would be alone.
            Err(e) if unknown_outcome(&e) => {
                for call in calls {
                    let _ = call.reply.send(Err(e.clone()));
                }
            }
            // Refused before it ran (a slot that moved, a node that is loading, ...):
            // each call goes alone, with fred's redirections.
            Err(e) => {
                tracing::debug!(error = %e, calls = calls.len(), "batch refused; its calls go alone");
                futures::future::join_all(calls.into_iter().map(|call| self.send_alone(client, call))).await;
            }
        }
    }

    async fn send_alone(&self, client: &Client, call: Call) {
        let reply = match self.scripts.by_name(call.script) {
            Some(script) => script.eval(client, call.keys, call.args).await,
            None => Err(Error::new(ErrorKind::Unknown, format!("no script {}", call.script))),
        };
        let _ = call.reply.send(reply);
    }
}

/// Splits a group of calls into batches of at most `max`, in order.
fn at_most(max: usize, calls: Vec<Call>) -> Vec<Vec<Call>> {
    let mut calls = calls.into_iter().peekable();
    let mut batches = Vec::new();
    while calls.peek().is_some() {
        batches.push(calls.by_ref().take(max).collect());
    }
    batches
}

/// `batch.lua`'s keys and arguments for `calls` (copies share their bytes). On a
/// cluster the keys go in the arguments, but for the first, which routes the call.
fn batch_args(calls: &[Call], cluster: bool) -> (Vec<Key>, Vec<Value>) {
    let calls: Vec<BatchedCall<'_>> = calls
        .iter()
        .map(|c| (c.script, c.keys.as_slice(), c.args.as_slice()))
        .collect();
    batch_layout(&calls, cluster)
}

/// One call of a batch: its script's name, keys and arguments.
pub type BatchedCall<'a> = (&'a str, &'a [Key], &'a [Value]);

/// The keys and arguments of one `batch.lua` call running `calls` in order (its layout
/// is described there). Public for the tests and the bench, which send batches as a
/// server's round does.
pub fn batch_layout(calls: &[BatchedCall<'_>], cluster: bool) -> (Vec<Key>, Vec<Value>) {
    let key_count = calls.iter().map(|(_, keys, _)| keys.len()).sum();
    let arg_count: usize = calls.iter().map(|(_, _, args)| args.len()).sum();
    let mut keys = Vec::with_capacity(key_count);
    let mut args = Vec::with_capacity(2 + 3 * calls.len() + arg_count + key_count);
    args.push(Value::from(calls.len() as i64));
    args.push(Value::from(if cluster { "a" } else { "k" }));
    for (script, call_keys, call_args) in calls {
        args.push(Value::from(*script));
        args.push(Value::from(call_keys.len() as i64));
        args.push(Value::from(call_args.len() as i64));
    }
    for (_, _, call_args) in calls {
        args.extend(call_args.iter().cloned());
    }
    for (_, call_keys, _) in calls {
        keys.extend(call_keys.iter().cloned());
    }
    if cluster {
        args.extend(keys.drain(..).map(|k| Value::from(k.into_bytes())));
        keys.extend(calls.iter().find_map(|(_, call_keys, _)| call_keys.first().cloned()));
    }
    (keys, args)
}

/// One call's reply from `batch.lua`: its flag (1 when it ran) and its reply or error.
fn unwrap_reply(flag: Value, value: Value) -> Result<Value, Error> {
    match flag.as_i64() {
        Some(1) => Ok(value),
        _ => Err(Error::new(
            ErrorKind::Unknown,
            value.as_string().unwrap_or_else(|| "a batched call failed".into()),
        )),
    }
}

/// Whether an error leaves it open whether the call ran.
fn unknown_outcome(e: &Error) -> bool {
    matches!(e.kind(), ErrorKind::Timeout | ErrorKind::IO | ErrorKind::Canceled)
}

/// Counts a call in flight until dropped.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn count(calls: &'a AtomicUsize) -> Self {
        calls.fetch_add(1, Ordering::Relaxed);
        Self(calls)
    }

    /// The other calls in flight.
    fn others(&self) -> usize {
        self.0.load(Ordering::Relaxed).saturating_sub(1)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(i: i64) -> Call {
        Call {
            script: "mutex_acquire",
            keys: Vec::new(),
            args: vec![Value::from(i)],
            reply: oneshot::channel().0,
        }
    }

    #[test]
    fn a_burst_goes_out_in_bounded_batches_in_order() {
        let batches = at_most(BATCH_MAX, (0..150).map(call).collect());
        let sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
        assert_eq!(sizes, [64, 64, 22]);
        let order: Vec<i64> = batches.iter().flatten().filter_map(|c| c.args[0].as_i64()).collect();
        assert_eq!(order, (0..150).collect::<Vec<_>>());
        assert_eq!(at_most(BATCH_MAX, Vec::new()).len(), 0);
    }
}
