//! `latchkey-server`: parses the configuration, starts logging and runs until
//! SIGTERM or SIGINT.

use clap::Parser;
use latchkey_server::config::{Config, LogFormat};
use tracing_subscriber::EnvFilter;

/// jemalloc: a server holding tens of thousands of streams allocates and frees in
/// bursts; jemalloc hands freed memory back to the system in the background (glibc's
/// malloc keeps its high-water mark) and is cheaper per allocation.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    let config = Config::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if config.worker_threads > 0 {
        runtime.worker_threads(config.worker_threads);
    }
    match runtime.enable_all().build() {
        Ok(runtime) => runtime.block_on(serve(config)),
        Err(e) => {
            eprintln!("latchkey-server: cannot start its runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Starts logging and runs the server until a signal.
async fn serve(config: Config) -> std::process::ExitCode {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match config.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs.init(),
    }
    #[cfg(not(target_env = "msvc"))]
    if !config.no_metrics {
        tokio::spawn(sample_heap());
    }
    match latchkey_server::run(config, latchkey_server::shutdown::signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "latchkey-server failed");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Publishes jemalloc's heap figures every few seconds: live bytes against resident
/// bytes tells a leak (live bytes that stay) from memory the allocator keeps.
#[cfg(not(target_env = "msvc"))]
async fn sample_heap() {
    use tikv_jemalloc_ctl::{epoch, stats};
    let mut every = tokio::time::interval(std::time::Duration::from_secs(2));
    loop {
        every.tick().await;
        // The statistics are a snapshot taken when the epoch advances.
        if epoch::advance().is_err() {
            return;
        }
        if let (Ok(allocated), Ok(resident)) = (stats::allocated::read(), stats::resident::read()) {
            latchkey_server::metrics::heap(allocated, resident);
        }
    }
}
