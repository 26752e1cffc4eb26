//! `latchkey-server`: parses the configuration, starts logging and runs until
//! SIGTERM, SIGINT or SIGHUP.

use clap::Parser;
use latchkey_server::config::{Config, LogFormat};
use tracing_subscriber::EnvFilter;

/// jemalloc: a server holding tens of thousands of streams allocates and frees in
/// bursts; jemalloc hands freed memory back to the system in the background (glibc's
/// malloc keeps its high-water mark) and is cheaper per allocation.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// How long the exit waits for blocking threads (DNS lookups) once the server stopped.
const EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

fn main() -> std::process::ExitCode {
    #[cfg(not(target_env = "msvc"))]
    return_freed_memory_promptly();
    let config = Config::parse();
    let filter = match log_filter() {
        Ok(filter) => filter,
        Err(e) => {
            eprintln!("latchkey-server: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if config.worker_threads > 0 {
        runtime.worker_threads(config.worker_threads);
    }
    match runtime.enable_all().build() {
        Ok(runtime) => {
            let code = runtime.block_on(serve(config, filter));
            // Not waiting on blocking threads still out: a host name's lookup for a
            // Redis reconnect, stuck on a DNS server that does not answer, would hold
            // the exit past its bound.
            runtime.shutdown_timeout(EXIT_WAIT);
            code
        }
        Err(e) => {
            eprintln!("latchkey-server: cannot start its runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The log filter: `RUST_LOG` when set, else `info`. A filter that does not parse stops
/// the start, naming it: running at `info` instead would hide the trail asked for (a
/// `debug` target) or flood the log that was to be quiet (`warn`), unsaid.
fn log_filter() -> Result<EnvFilter, String> {
    let given = match std::env::var(EnvFilter::DEFAULT_ENV) {
        Ok(given) => given,
        Err(std::env::VarError::NotPresent) => String::new(),
        Err(e) => return Err(format!("RUST_LOG: {e}")),
    };
    // Spaces around a directive would be read as part of its target.
    let directives: Vec<&str> = given.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
    if directives.is_empty() {
        return Ok(EnvFilter::new("info"));
    }
    if !directives.iter().any(|d| covers_the_server(d)) {
        return Err(format!(
            "RUST_LOG={given:?} turns on no line of the server's own (a word that is no level, \
             a misspelt one too, reads as a target): give a level (info, debug, ...) or a \
             latchkey target (info,latchkey::lease=debug; latchkey_server=debug)"
        ));
    }
    EnvFilter::try_new(directives.join(",")).map_err(|e| format!("RUST_LOG={given:?} is not a log filter: {e}"))
}

/// Whether directive `d` sets a level for the server's own lines: a level alone, a
/// span filter (`[acquire]=debug`), or a target of latchkey's: one that matches
/// `latchkey_server` or `latchkey::lease` or a module of theirs (targets match by
/// prefix, so `latchkey-server=debug`, the binary's name, matches nothing). A word that
/// is no level is a target to `RUST_LOG`, so `inof` alone would turn every line off,
/// unsaid.
fn covers_the_server(d: &str) -> bool {
    const TARGETS: [&str; 2] = ["latchkey_server", "latchkey::lease"];
    if d.starts_with('[') {
        return true;
    }
    let target = d.split(['=', '[']).next().unwrap_or("");
    let ours = |t: &str| t.starts_with(target) || target.starts_with(&format!("{t}::"));
    target.parse::<tracing_subscriber::filter::LevelFilter>().is_ok() || TARGETS.iter().any(|t| ours(t))
}

/// Whether text logs carry colours: on a terminal, unless `NO_COLOR` says otherwise. A
/// log written to a file or a journal gets none, so `grep 'lock="a"'` finds its lines.
fn colours() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Starts logging and runs the server until a signal.
async fn serve(config: Config, filter: EnvFilter) -> std::process::ExitCode {
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colours())
        .with_writer(std::io::stderr);
    match config.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs.init(),
    }
    // Each connection takes a descriptor; the process's limit, not the library's to set.
    latchkey_server::serve::raise_fd_limit();
    match latchkey_server::run(config, latchkey_server::shutdown::signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "latchkey-server failed");
            std::process::ExitCode::FAILURE
        }
    }
}

/// How long freed pages stay with jemalloc before they go back to the system.
#[cfg(not(target_env = "msvc"))]
const DIRTY_DECAY_MS: isize = 1_000;

/// Shortens jemalloc's decay of freed pages from its default 10 s to
/// [`DIRTY_DECAY_MS`]: after a burst of streams (thousands of waiters at once) the
/// server's RSS is back near its baseline within seconds, which matters to a sidecar
/// under a memory limit. The background threads do the purging, off the request path.
#[cfg(not(target_env = "msvc"))]
fn return_freed_memory_promptly() {
    use tikv_jemalloc_ctl::{arenas, Access, AsName};
    // Arenas made from now on, then the ones that already exist (a slot without an
    // arena refuses the write, which is fine).
    let _ = b"arenas.dirty_decay_ms\0".name().write(DIRTY_DECAY_MS);
    for i in 0..arenas::narenas::read().unwrap_or(0) {
        let _ = format!("arena.{i}.dirty_decay_ms\0")
            .as_bytes()
            .name()
            .write(DIRTY_DECAY_MS);
    }
}
