//! Every `latchkey_*` metric, recorded through the `metrics` facade and served in
//! Prometheus text format on `--metrics-listen`.

use crate::lock::Kind;
use latchkey_proto::v1::lost::Reason;
use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::collections::HashMap;
use std::hash::Hash;
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock, RwLock};
use std::time::Duration;
use tokio::sync::watch;

/// Handles of one metric, registered on first use, by their label values. The facade's
/// macros build, hash and look up the metric's key on every call: about 4 % of a busy
/// server's CPU, at ten calls per lock cycle. A kept handle records at once. A handle
/// belongs to the recorder installed when it was made; the server installs its
/// recorder when it starts, before any stream.
/// Read-mostly: every label set is registered once, then only read, by any number of
/// worker threads at once.
struct Handles<L, H>(OnceLock<RwLock<HashMap<L, H>>>);

impl<L: Eq + Hash, H: Clone> Handles<L, H> {
    const fn new() -> Self {
        Self(OnceLock::new())
    }

    fn get(&self, labels: L, register: impl FnOnce() -> H) -> H {
        let map = self.0.get_or_init(RwLock::default);
        if let Some(handle) = map.read().unwrap_or_else(|e| e.into_inner()).get(&labels) {
            return handle.clone();
        }
        let mut map = map.write().unwrap_or_else(|e| e.into_inner());
        map.entry(labels).or_insert_with(register).clone()
    }
}

/// Histogram buckets in seconds, from 100 µs to 10 min: lock waits run to minutes
/// (a `wait_timeout` of several), and a wait past the last bucket reads only as +Inf.
const BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

/// The recorder's handle, which renders the metrics: one per process (a second server
/// in one process, in tests, serves the first one's). Behind a lock, not a `OnceLock`:
/// two servers starting at once must not keep the handle of one recorder and install
/// the other, every scrape then rendering a recorder nothing records to.
static RECORDER: Mutex<Option<PrometheusHandle>> = Mutex::new(None);

/// Installs the recorder, exports the counters and gauges at zero (see
/// [`export_zeros`]) and starts the Prometheus listener on `listen`, whose `/ready`
/// answers what `ready` holds (see [`crate::health`]). Fails when the process has
/// another global recorder, whose metrics latchkey could not render.
pub fn install(listen: SocketAddr, ready: watch::Receiver<bool>) -> Result<(), String> {
    let listener = std::net::TcpListener::bind(listen)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .and_then(tokio::net::TcpListener::from_std)
        .map_err(|e| format!("--metrics-listen {listen}: {e}"))?;
    let mut installed = RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    let handle = match &*installed {
        Some(handle) => handle.clone(),
        None => {
            let recorder = PrometheusBuilder::new()
                .set_buckets(BUCKETS)
                .map_err(|e| e.to_string())?
                .build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder)
                .map_err(|e| format!("the metrics recorder could not be installed: {e}"))?;
            tokio::spawn(upkeep(handle.clone()));
            installed.insert(handle).clone()
        }
    };
    drop(installed);
    export_zeros();
    tokio::spawn(serve(listener, handle, ready));
    Ok(())
}

/// Drains the histograms' recent samples every few seconds, as the exporter's own
/// installer does: between scrapes (or with none) they would pile up.
async fn upkeep(handle: PrometheusHandle) {
    let mut every = tokio::time::interval(Duration::from_secs(5));
    loop {
        every.tick().await;
        handle.run_upkeep();
    }
}

/// Answers `/ready` with the server's readiness (200 `SERVING` or 503 `NOT_SERVING`)
/// and every other request on `listener` with the metrics (the liveness probes read
/// `/health`: answering at all is the sign of life). Accepting pauses after a failure, as the gRPC listeners' does (with the
/// descriptors used up, it would spin a core), and a connection that sends no request
/// head within [`crate::serve::FIRST_BYTES_TIMEOUT`] is closed, idle between
/// requests too: a silent one would hold its descriptor for good.
async fn serve(listener: tokio::net::TcpListener, handle: PrometheusHandle, ready: watch::Receiver<bool>) {
    use futures::StreamExt;
    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper_util::rt::{TokioIo, TokioTimer};
    let incoming = crate::serve::accepted(tokio_stream::wrappers::TcpListenerStream::new(listener));
    let mut incoming = std::pin::pin!(incoming);
    while let Some(stream) = incoming.next().await {
        let handle = handle.clone();
        let ready = ready.clone();
        let answer = hyper::service::service_fn(move |request: hyper::Request<_>| {
            let response = hyper::Response::builder();
            let response = if request.uri().path() == "/ready" {
                let (status, text) = if *ready.borrow() {
                    (hyper::StatusCode::OK, "SERVING\n")
                } else {
                    (hyper::StatusCode::SERVICE_UNAVAILABLE, "NOT_SERVING\n")
                };
                response
                    .status(status)
                    .header("content-type", "text/plain")
                    .body(Full::new(Bytes::from(text)))
            } else {
                // Set from this listener's own server as it is scraped: the gauge is the
                // process's, and another server of it (in tests, an embedder's) has its own
                // readiness.
                serving(*ready.borrow());
                response
                    .header("content-type", "text/plain; version=0.0.4")
                    .body(Full::new(Bytes::from(handle.render())))
            };
            async move { response }
        });
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(crate::serve::FIRST_BYTES_TIMEOUT)
            .serve_connection(TokioIo::new(stream), answer);
        tokio::spawn(async move {
            let _ = connection.await;
        });
    }
}

/// Every lock kind's label; the match below stops compiling when a kind is added.
const KINDS: [Kind; 5] = [Kind::Mutex, Kind::Fair, Kind::Read, Kind::Write, Kind::Semaphore];
const _: fn(Kind) = |kind| match kind {
    Kind::Mutex | Kind::Fair | Kind::Read | Kind::Write | Kind::Semaphore => {}
};

/// The outcomes [`acquisition`] is told.
const OUTCOMES: [&str; 4] = ["acquired", "timeout", "cancelled", "error"];

/// The RPCs of `LockService`, as [`rpc_started`] names them.
pub const METHODS: [&str; 5] = ["Acquire", "Describe", "List", "ForceRelease", "Watch"];

/// Registers every counter and gauge at zero, for each label value known in advance
/// (kind and outcome, lost reason, method, script), without changing one already
/// counting. A metric is exported once registered: an idle server shows in dashboards
/// and alerts with zeros, not as a series that is not there until its first event.
/// Histograms (their buckets would be many lines of zeros), `rpc_handled_total` (a
/// method for every status code), the certificates' expiry (only with TLS files) and
/// the longest renewal gap appear with their first value.
fn export_zeros() {
    streams(0);
    leases(0);
    waiters(0);
    subscriptions(0);
    renewed(0);
    renewal_failed(0);
    counter!("latchkey_handoffs_total").increment(0);
    counter!("latchkey_passes_in_memory_total").increment(0);
    counter!("latchkey_fair_queued_in_memory_total").increment(0);
    tls_handshake_failed(0);
    unheard_cut(0);
    for kind in KINDS.map(Kind::as_str) {
        for outcome in OUTCOMES {
            counter!("latchkey_acquisitions_total", "kind" => kind, "outcome" => outcome).increment(0);
        }
    }
    for reason in [
        Reason::LeaseExpired,
        Reason::NotHeld,
        Reason::ForceReleased,
        Reason::Shutdown,
    ] {
        counter!("latchkey_leases_lost_total", "reason" => reason.as_str_name()).increment(0);
    }
    for method in METHODS {
        counter!("latchkey_rpc_started_total", "method" => method).increment(0);
    }
    // The script names are the catalogue's (the same with and without a cluster).
    for script in crate::scripts::Scripts::new(false).all() {
        counter!("latchkey_redis_errors_total", "script" => script.name()).increment(0);
    }
}

/// Whether the server can grant: 1 while `grpc.health.v1` says SERVING.
fn serving(serving: bool) {
    gauge!("latchkey_serving").set(if serving { 1.0 } else { 0.0 });
}

/// Authenticated `Acquire` streams found deaf to a reload that refused them, whose
/// connections were cut.
pub fn unheard_cut(n: u64) {
    counter!("latchkey_unheard_streams_cut_total").increment(n);
}

/// An RPC started.
pub fn rpc_started(method: &'static str) {
    static STARTED: Handles<&str, Counter> = Handles::new();
    STARTED
        .get(method, || counter!("latchkey_rpc_started_total", "method" => method))
        .increment(1);
}

/// An RPC ended with `code`.
pub fn rpc_handled(method: &'static str, code: tonic::Code) {
    static HANDLED: Handles<(&str, tonic::Code), Counter> = Handles::new();
    let register = || counter!("latchkey_rpc_handled_total", "method" => method, "code" => code_name(code));
    HANDLED.get((method, code), register).increment(1);
}

/// A status code's name as the label shows it (no string made per call).
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "Ok",
        Cancelled => "Cancelled",
        Unknown => "Unknown",
        InvalidArgument => "InvalidArgument",
        DeadlineExceeded => "DeadlineExceeded",
        NotFound => "NotFound",
        AlreadyExists => "AlreadyExists",
        PermissionDenied => "PermissionDenied",
        ResourceExhausted => "ResourceExhausted",
        FailedPrecondition => "FailedPrecondition",
        Aborted => "Aborted",
        OutOfRange => "OutOfRange",
        Unimplemented => "Unimplemented",
        Internal => "Internal",
        Unavailable => "Unavailable",
        DataLoss => "DataLoss",
        Unauthenticated => "Unauthenticated",
    }
}

/// An acquisition ended with `outcome` (acquired, timeout, error, cancelled) after `waited`.
pub fn acquisition(kind: &'static str, outcome: &'static str, waited: Duration) {
    static ENDED: Handles<(&str, &str), Counter> = Handles::new();
    static WAITED: Handles<&str, Histogram> = Handles::new();
    let register = || counter!("latchkey_acquisitions_total", "kind" => kind, "outcome" => outcome);
    ENDED.get((kind, outcome), register).increment(1);
    WAITED
        .get(kind, || histogram!("latchkey_acquire_wait_seconds", "kind" => kind))
        .record(waited.as_secs_f64());
}

/// A waiter was granted `took` after what let it in: the unlock message that woke it,
/// or the start of the release that handed it the lock.
pub fn handoff(took: Duration) {
    static HANDOFF: Handles<(), Histogram> = Handles::new();
    HANDOFF
        .get((), || histogram!("latchkey_handoff_seconds"))
        .record(took.as_secs_f64());
}

/// A release handed its lock straight to a local waiter.
pub fn handed_off() {
    static HANDED: Handles<(), Counter> = Handles::new();
    HANDED.get((), || counter!("latchkey_handoffs_total")).increment(1);
}

/// A release passed its mutex or fair lock to a local waiter in memory, Redis recording
/// it after.
pub fn passed_in_memory() {
    static PASSED: Handles<(), Counter> = Handles::new();
    PASSED
        .get((), || counter!("latchkey_passes_in_memory_total"))
        .increment(1);
}

/// A fair waiter lined up behind a lock passed in memory, to be queued in Redis by the
/// next recording rather than by a try of its own.
pub fn queued_in_memory() {
    static QUEUED: Handles<(), Counter> = Handles::new();
    QUEUED
        .get((), || counter!("latchkey_fair_queued_in_memory_total"))
        .increment(1);
}

/// Publishes jemalloc's heap figures every 2 s: bytes in live allocations against
/// bytes of memory it keeps resident (what RSS shows of the heap), which tells a leak
/// (live bytes that stay) from memory the allocator keeps; and the allocator's own
/// metadata, part of the resident bytes, which grows with the most memory the heap ever
/// spanned and is never given back (what a burst of streams leaves behind). Meaningful
/// where jemalloc is the process's allocator (the `latchkey-server` binary).
#[cfg(not(target_env = "msvc"))]
pub async fn sample_heap() {
    use tikv_jemalloc_ctl::{epoch, stats};
    let mut every = tokio::time::interval(Duration::from_secs(2));
    loop {
        every.tick().await;
        // The statistics are a snapshot taken when the epoch advances.
        if epoch::advance().is_err() {
            return;
        }
        if let (Ok(allocated), Ok(resident)) = (stats::allocated::read(), stats::resident::read()) {
            gauge!("latchkey_heap_allocated_bytes").set(allocated as f64);
            gauge!("latchkey_heap_resident_bytes").set(resident as f64);
        }
        if let Ok(metadata) = stats::metadata::read() {
            gauge!("latchkey_heap_metadata_bytes").set(metadata as f64);
        }
    }
}

/// Open Acquire streams changed by `delta`. Watch streams, which `--max-streams` bounds
/// too, are not counted here.
pub fn streams(delta: i64) {
    static STREAMS: Handles<(), Gauge> = Handles::new();
    STREAMS
        .get((), || gauge!("latchkey_streams_open"))
        .increment(delta as f64);
}

/// Held leases changed by `delta`.
pub fn leases(delta: i64) {
    static LEASES: Handles<(), Gauge> = Handles::new();
    LEASES
        .get((), || gauge!("latchkey_leases_held"))
        .increment(delta as f64);
}

/// Waiters changed by `delta`.
pub fn waiters(delta: i64) {
    static WAITERS: Handles<(), Gauge> = Handles::new();
    WAITERS.get((), || gauge!("latchkey_waiters")).increment(delta as f64);
}

/// A hub's lock-channel subscriptions changed by `delta` (every hub of the server adds
/// its own).
pub fn subscriptions(delta: i64) {
    gauge!("latchkey_pubsub_subscriptions").increment(delta as f64);
}

/// `n` leases were renewed.
pub fn renewed(n: usize) {
    counter!("latchkey_watchdog_renewals_total").increment(n as u64);
}

/// `n` lease renewals failed (Redis error).
pub fn renewal_failed(n: usize) {
    counter!("latchkey_watchdog_renewal_failures_total").increment(n as u64);
}

/// A watchdog round took `took`.
pub fn renewal_round(took: Duration) {
    histogram!("latchkey_watchdog_round_seconds").record(took.as_secs_f64());
}

/// A lease went `gap` between two confirmations by Redis, the longest yet.
pub fn renewal_gap(gap: Duration) {
    gauge!("latchkey_watchdog_renewal_gap_max_seconds").set(gap.as_secs_f64());
}

/// The certificates of `--tls-<flag>` (`cert`, `client-ca`) run out at `end` (Unix
/// seconds): the soonest end among them, as loaded at start or by the last reload.
pub fn certificate_expiry(flag: &'static str, end: i64) {
    gauge!("latchkey_tls_certificate_expiry_timestamp_seconds", "file" => flag).set(end as f64);
}

/// `n` TLS handshakes were refused (an untrusted, expired or missing client
/// certificate, a client that does not trust the server's).
pub fn tls_handshake_failed(n: u64) {
    counter!("latchkey_tls_handshake_failures_total").increment(n);
}

/// A lease was lost for `reason`.
pub fn lost(reason: &'static str) {
    counter!("latchkey_leases_lost_total", "reason" => reason).increment(1);
}

/// A Redis script call took `took`.
pub fn redis_call(script: &'static str, took: Duration, ok: bool) {
    static TOOK: Handles<&str, Histogram> = Handles::new();
    TOOK.get(
        script,
        || histogram!("latchkey_redis_command_seconds", "script" => script),
    )
    .record(took.as_secs_f64());
    if !ok {
        counter!("latchkey_redis_errors_total", "script" => script).increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::Handles;

    #[test]
    fn a_handle_is_registered_once_per_label_set() {
        static HANDLES: Handles<&str, u32> = Handles::new();
        let mut registered = 0;
        for label in ["a", "b", "a", "a", "b"] {
            HANDLES.get(label, || {
                registered += 1;
                registered
            });
        }
        assert_eq!(registered, 2);
        assert_eq!((HANDLES.get("a", || 99), HANDLES.get("b", || 99)), (1, 2));
    }

    #[test]
    fn code_names_are_the_debug_names() {
        for i in 0..=16 {
            let code = tonic::Code::from_i32(i);
            assert_eq!(super::code_name(code), format!("{code:?}"));
        }
    }
}
