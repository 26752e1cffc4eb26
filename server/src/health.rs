//! Readiness: whether this server can grant, told three ways at once. `grpc.health.v1`
//! answers SERVING (the kubelet's gRPC probe, grpcurl), the metrics listener's `/ready`
//! answers 200 (an `httpGet` probe, which works when the gRPC listener speaks TLS or
//! asks for client certificates, where the kubelet's gRPC probe cannot connect), and
//! the `latchkey_serving` gauge reads 1 (alerts; set from `/ready`'s value as the
//! metrics are scraped). All three follow one Redis ping.

use crate::redis::Backend;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// How often the health check pings Redis.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// The service name `grpc.health.v1.Health` reports besides the overall status.
const SERVICE: &str = "latchkey.v1.LockService";

/// Where a server's readiness is told.
#[derive(Debug)]
pub struct Readiness {
    reporter: HealthReporter,
    ready: watch::Sender<bool>,
}

impl Readiness {
    /// Starts NOT_SERVING (tonic-health starts the overall status at SERVING: a probe
    /// must not pass before Redis answered); `ready` is what `/ready` reads. Scripts are
    /// loaded once Redis answers, but a failed load does not hold SERVING back: a call
    /// loads its script again when Redis answers `NOSCRIPT`.
    pub async fn new(reporter: HealthReporter, ready: watch::Sender<bool>) -> Readiness {
        let readiness = Readiness { reporter, ready };
        readiness.set(false).await;
        readiness
    }

    /// Tells every reader at once.
    async fn set(&self, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for service in ["", SERVICE] {
            self.reporter.set_service_status(service, status).await;
        }
        self.ready.send_replace(serving);
    }

    /// Clears the gRPC statuses at shutdown, after NOT_SERVING: a health Watch lasts
    /// as long as its status, so the watchers' streams end and their connections can
    /// close.
    pub async fn clear(mut self) {
        for service in ["", SERVICE] {
            self.reporter.clear_service_status(service).await;
        }
    }
}

/// Keeps readiness in line with Redis: SERVING while it answers, until `stop`; then
/// NOT_SERVING, and the readiness goes back to the shutdown.
pub async fn follow(backend: Arc<Backend>, readiness: Readiness, stop: CancellationToken) -> Readiness {
    // Stopped at any point, a probe in flight included: it must not say SERVING after.
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = probe(&backend, &readiness) => {}
    }
    readiness.set(false).await;
    readiness
}

/// Pings Redis every [`INTERVAL`] and reports each change; never returns.
async fn probe(backend: &Backend, readiness: &Readiness) {
    let mut serving = None;
    let mut scripts_loaded = false;
    loop {
        let probe = backend.ping().await;
        let up = probe.is_ok();
        if up && !scripts_loaded {
            scripts_loaded = backend.load_scripts().await.is_ok();
        }
        if serving != Some(up) {
            readiness.set(up).await;
            if up {
                tracing::info!("redis reachable: SERVING");
            } else if let Err(e) = &probe {
                tracing::warn!(error = %e, "redis unreachable or unable to grant: NOT_SERVING");
            }
            serving = Some(up);
        }
        tokio::time::sleep(INTERVAL).await;
    }
}
