//! Script calls of one scheduler round share one Redis call. fred writes every
//! command with a write of its own; a server answering thousands of lock operations a
//! second would make one write per operation, and Redis one read and one script run.
//!
//! While few calls are in flight a call goes alone, at once. Beyond that, calls queue
//! here: the first call of a round starts a task that lets the other ready tasks run,
//! so their calls join the round, then sends the round, a lone call as itself and
//! several as one `batch.lua` call per Redis node, which runs each call as its own
//! script would. A call the node did not run (its slot moved since the round was
//! grouped, or the node is a read-only replica) goes alone after the batch, as any lone
//! call: a `MOVED` refreshes the connection's slot map and the call goes once more
//! (`Script::loaded`).

use crate::scripts::{Script, Scripts};
use fred::error::{Error, ErrorKind};
use fred::prelude::{Client, Key, Pool, Value};
use latchkey_proto::coalesce::ReadyTasksFirst;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// Calls in flight from which a call joins a round rather than going alone.
const BATCH_FROM: usize = 4;
/// `batch.lua`'s flag of a call that ran: its reply follows.
const RAN: i64 = 1;
/// `batch.lua`'s flag of a call that did not run on the node the batch reached, so that
/// nothing of it was written and it is sent again alone: on a cluster its keys' slot is
/// served elsewhere or is being migrated (the script checks a call's keys before any of
/// its commands, as Redis checks a lone script's declared keys), or the node is a
/// read-only replica (which refuses every write). The script flags it, rather than this
/// file matching Redis's `non local key` error: that error also ends a call midway, after
/// it may have written, when a slot being migrated holds only some of its keys.
const NOT_RUN_HERE: i64 = 2;
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
        let slot = |call: &Call| call.keys.first().map_or(0, Key::cluster_hash);
        super::by_node(&self.pool, self.cluster, calls, slot)
            .into_values()
            .collect()
    }

    async fn send(&self, mut calls: Vec<Call>) {
        let client = self.pool.next_connected();
        if calls.len() == 1 {
            if let Some(call) = calls.pop() {
                self.send_alone(client, call).await;
            }
            return;
        }
        let Some((keys, args)) = batch_args(&calls) else {
            return self.send_each_alone(client, calls).await;
        };
        let started = std::time::Instant::now();
        let result = self.scripts.batch.eval::<Value, _>(client, keys, args).await;
        // The batch's own call, beside its calls' counted under their names.
        crate::metrics::redis_call(self.scripts.batch.name(), started.elapsed(), result.is_ok());
        match result {
            Ok(Value::Array(replies)) if replies.len() == 2 * calls.len() => {
                let mut replies = replies.into_iter();
                let mut elsewhere = Vec::new();
                for call in calls {
                    let flag = replies.next().unwrap_or(Value::Null);
                    let value = replies.next().unwrap_or(Value::Null);
                    match outcome(flag, value) {
                        Outcome::NotRunHere(why) => {
                            tracing::debug!(script = call.script, error = %why, "not run in its batch; sent alone");
                            elsewhere.push(call);
                        }
                        Outcome::Ran(reply) => {
                            let _ = call.reply.send(reply);
                        }
                    }
                }
                self.send_each_alone(client, elsewhere).await;
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
            // each call goes alone, once more after a redirection.
            Err(e) => {
                tracing::debug!(error = %e, calls = calls.len(), "batch refused; its calls go alone");
                self.send_each_alone(client, calls).await;
            }
        }
    }

    async fn send_each_alone(&self, client: &Client, calls: Vec<Call>) {
        futures::future::join_all(calls.into_iter().map(|call| self.send_alone(client, call))).await;
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

/// `batch.lua`'s keys and arguments for `calls`.
fn batch_args(calls: &[Call]) -> Option<(Vec<Key>, Vec<Value>)> {
    let calls: Vec<BatchedCall<'_>> = calls
        .iter()
        .map(|c| (c.script, c.keys.as_slice(), c.args.as_slice()))
        .collect();
    batch_layout(&calls)
}

/// One call of a batch: its script's name, keys and arguments.
pub type BatchedCall<'a> = (&'a str, &'a [Key], &'a [Value]);

/// The keys and arguments of one `batch.lua` call running `calls` in order: one
/// argument per call, its script's name, keys and arguments packed as MessagePack
/// (which `batch.lua` unpacks in C with Redis's `cmsgpack`), and the first key as the
/// only declared key, which routes the call on a cluster (a batch spans the slots of
/// one node). Sent as RESP arguments of their own, a call's keys and arguments are
/// about twelve, and fred encoding them one by one took a tenth of the server's
/// instructions per lock cycle. `None` when an argument is neither a string nor an
/// integer (no script of the catalogue takes one): such calls go alone. Public for the
/// tests and the bench, which send batches as a server's round does.
pub fn batch_layout(calls: &[BatchedCall<'_>]) -> Option<(Vec<Key>, Vec<Value>)> {
    let first = calls.iter().find_map(|(_, keys, _)| keys.first().cloned());
    let packed = calls
        .iter()
        .map(|(script, keys, args)| pack(script, keys, args).map(|p| Value::Bytes(p.into())))
        .collect::<Option<Vec<Value>>>()?;
    Some((first.into_iter().collect(), packed))
}

/// One call as `batch.lua` unpacks it: its script's name, the array of its keys, the
/// array of its arguments, as MessagePack strings (Lua reads both as its strings;
/// integers go in decimal, as RESP carries them).
fn pack(script: &str, keys: &[Key], args: &[Value]) -> Option<Vec<u8>> {
    let sizes = keys.iter().map(|k| k.as_bytes().len()).chain(args.iter().map(arg_size));
    let mut packed = Vec::with_capacity(script.len() + sizes.sum::<usize>() + 5 * (keys.len() + args.len() + 3));
    put_str(&mut packed, script.as_bytes());
    put_array(&mut packed, keys.iter().map(Key::as_bytes));
    // Writing to a Vec cannot fail.
    let _ = rmp::encode::write_array_len(&mut packed, args.len() as u32);
    let mut digits = itoa::Buffer::new();
    for arg in args {
        let bytes = match arg {
            Value::Bytes(b) => &b[..],
            Value::String(s) => s.as_bytes(),
            Value::Integer(i) => digits.format(*i).as_bytes(),
            _ => return None,
        };
        put_str(&mut packed, bytes);
    }
    Some(packed)
}

/// At most the bytes an argument packs to, but for its header.
fn arg_size(arg: &Value) -> usize {
    match arg {
        Value::Bytes(b) => b.len(),
        Value::String(s) => s.len(),
        // The longest i64 in decimal.
        _ => 20,
    }
}

fn put_array<'a>(packed: &mut Vec<u8>, items: impl ExactSizeIterator<Item = &'a [u8]>) {
    let _ = rmp::encode::write_array_len(packed, items.len() as u32);
    for item in items {
        put_str(packed, item);
    }
}

fn put_str(packed: &mut Vec<u8>, bytes: &[u8]) {
    let _ = rmp::encode::write_str_len(packed, bytes.len() as u32);
    packed.extend_from_slice(bytes);
}

/// What became of one call of a batch.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// It ran: its reply, or its error.
    Ran(Result<Value, Error>),
    /// It did not run on the node the batch reached ([`NOT_RUN_HERE`]), and why.
    NotRunHere(String),
}

/// One call's outcome from `batch.lua`: its flag and its reply or error message.
fn outcome(flag: Value, value: Value) -> Outcome {
    let message = |value: Value| value.as_string().unwrap_or_else(|| "a batched call failed".into());
    match flag.as_i64() {
        Some(RAN) => Outcome::Ran(Ok(value)),
        Some(NOT_RUN_HERE) => Outcome::NotRunHere(message(value)),
        _ => Outcome::Ran(Err(Error::new(ErrorKind::Unknown, message(value)))),
    }
}

/// Whether an error leaves it open whether the call ran: the connection broke or the
/// reply did not come, or fred gave up writing it again.
fn unknown_outcome(e: &Error) -> bool {
    matches!(e.kind(), ErrorKind::Timeout | ErrorKind::IO | ErrorKind::Canceled) || super::gave_up(e)
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

    /// Reads one MessagePack string off the front of `packed`.
    fn read_str<'a>(packed: &mut &'a [u8]) -> &'a [u8] {
        let len = rmp::decode::read_str_len(packed).expect("a string") as usize;
        let (bytes, rest) = packed.split_at(len);
        *packed = rest;
        bytes
    }

    fn read_strs(packed: &mut &[u8]) -> Vec<Vec<u8>> {
        let len = rmp::decode::read_array_len(packed).expect("an array");
        (0..len).map(|_| read_str(packed).to_vec()).collect()
    }

    #[test]
    fn a_call_packs_its_name_keys_and_arguments_and_the_first_key_routes() {
        let long = "k".repeat(70_000);
        let keys = [Key::from("a"), Key::from(long.as_str())];
        let args = [Value::from(30_000), Value::from("owner"), Value::from(-1)];
        let calls: [BatchedCall<'_>; 2] = [("describe", &[], &[]), ("mutex_acquire", &keys, &args)];
        let (routing, packed) = batch_layout(&calls).expect("strings and integers pack");
        assert_eq!(routing, [Key::from("a")]);
        assert_eq!(packed.len(), 2);
        let blobs: Vec<&[u8]> = packed.iter().map(|v| v.as_bytes().expect("bytes")).collect();
        let mut first = blobs[0];
        assert_eq!(read_str(&mut first), b"describe");
        assert!(read_strs(&mut first).is_empty() && read_strs(&mut first).is_empty() && first.is_empty());
        let mut second = blobs[1];
        assert_eq!(read_str(&mut second), b"mutex_acquire");
        assert_eq!(read_strs(&mut second), [b"a".to_vec(), long.into_bytes()]);
        assert_eq!(
            read_strs(&mut second),
            [b"30000".to_vec(), b"owner".to_vec(), b"-1".to_vec()]
        );
        assert!(second.is_empty());
    }

    #[test]
    fn a_call_with_an_argument_of_another_type_goes_alone() {
        let args = [Value::from("owner"), Value::Array(vec![])];
        assert!(batch_layout(&[("release", &[], &args)]).is_none());
    }

    #[test]
    fn a_call_the_node_did_not_run_is_told_apart_from_a_failed_one() {
        let ran = outcome(Value::Integer(1), Value::from("ok"));
        assert_eq!(ran, Outcome::Ran(Ok(Value::from("ok"))));
        let error = "WRONGTYPE Operation against a key holding the wrong kind of value";
        let failed = outcome(Value::Integer(0), Value::from(error));
        assert_eq!(failed, Outcome::Ran(Err(Error::new(ErrorKind::Unknown, error))));
        let moved = "ERR Script attempted to access a non local key in a cluster node";
        let elsewhere = outcome(Value::Integer(2), Value::from(moved));
        assert_eq!(elsewhere, Outcome::NotRunHere(moved.to_owned()));
    }

    #[test]
    fn a_batch_fred_gave_up_writing_again_may_have_run() {
        assert!(unknown_outcome(&Error::new(
            ErrorKind::Unknown,
            "Too many failed write attempts."
        )));
        assert!(unknown_outcome(&Error::new(
            ErrorKind::Unknown,
            "Failed to route command."
        )));
        assert!(unknown_outcome(&Error::new(ErrorKind::Timeout, "timed out")));
        assert!(!unknown_outcome(&Error::new(ErrorKind::Unknown, "LOADING")));
        assert!(!unknown_outcome(&Error::new(
            ErrorKind::Cluster,
            "MOVED 1 127.0.0.1:7000"
        )));
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
