//! Shutdown: the SIGTERM/SIGINT future, and the drain every stream selects on.

use std::future::Future;
use tokio::signal::unix::{signal as listen, SignalKind};

/// Listens for SIGTERM and SIGINT from the call on, and resolves on the first. The
/// handlers are in place at once, not when the future is first polled: as a
/// container's PID 1 (the image has no init) the server is sent no signal it has no
/// handler for, and a SIGTERM while it starts (Redis slow to answer) was dropped, the
/// server serving on until the grace period's SIGKILL.
pub fn signal() -> impl Future<Output = ()> {
    let term = listen(SignalKind::terminate());
    let int = listen(SignalKind::interrupt());
    async move {
        match (term, int) {
            (Ok(mut term), Ok(mut int)) => tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received"),
                _ = int.recv() => tracing::info!("SIGINT received"),
            },
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM and SIGINT; stopping on SIGINT only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}
