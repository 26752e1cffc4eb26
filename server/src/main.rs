//! `latchkey-server`: parses the configuration, starts logging and runs until
//! SIGTERM or SIGINT.

use clap::Parser;
use latchkey_server::config::{Config, LogFormat};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = Config::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match config.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs.init(),
    }
    match latchkey_server::run(config, latchkey_server::shutdown::signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "latchkey-server failed");
            std::process::ExitCode::FAILURE
        }
    }
}
