//! `latchkey`: the command-line client. `run` holds a lock while a command runs;
//! `describe`, `list`, `force-release` and `watch` inspect and break locks. Built
//! only on the `latchkey_client` library.

/// Writes a line to stderr, as `eprintln!` does, but ignores a failed write: `eprintln!`
/// panics when stderr's reader has gone (`latchkey run ... 2>&1 | logger`, the logger
/// dead), which ended `latchkey` at once, before it could stop or release anything.
macro_rules! print_err {
    ($($arg:tt)*) => {
        $crate::write_err(::std::format_args!($($arg)*))
    };
}

mod format;
mod run;

use std::io::Write;
use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};
use latchkey_client::{Client, ConnectOptions, Error, DEFAULT_SERVER};
use std::path::PathBuf;

/// Any other failure: a bad argument, a refused request, an RPC error.
const EXIT_FAILURE: u8 = 1;
/// The wait for the lock ran out (or `--wait 0s` found it held).
const EXIT_TIMEOUT: u8 = 3;
/// The server could not be reached or is unavailable (sysexits `EX_UNAVAILABLE`).
const EXIT_UNAVAILABLE: u8 = 69;
/// The lease was lost while the command ran; the command was stopped
/// (sysexits `EX_TEMPFAIL`: re-running may succeed).
const EXIT_LOST: u8 = 75;
/// The command was found but could not be started (as in a shell).
const EXIT_CANNOT_EXECUTE: u8 = 126;
/// The command was not found (as in a shell).
const EXIT_NOT_FOUND: u8 = 127;

/// Command-line client of the latchkey lock service.
///
/// Exit codes: the command's own code for `run` (128+N if killed by signal N);
/// 1 other failure; 2 usage error; 3 the wait for the lock ran out; 69 the server
/// is unreachable; 75 the lease was lost while the command ran; 126/127 the
/// command could not be started / was not found.
#[derive(Debug, Parser)]
#[command(name = "latchkey", version)]
struct Cli {
    /// The latchkey server: http://host:port, https://host:port (with --ca) or
    /// unix:///path/to.sock.
    #[arg(long, global = true, env = "LATCHKEY_SERVER", default_value = DEFAULT_SERVER)]
    server: String,
    /// CA certificate (PEM) that signed the server's certificate; turns TLS on
    /// (use an https:// or unix:// server address). An https:// address without it
    /// trusts the system's CAs.
    #[arg(long, global = true, env = "LATCHKEY_CA")]
    ca: Option<PathBuf>,
    /// Client certificate (PEM) for a server that requires mTLS.
    #[arg(long, global = true, env = "LATCHKEY_CERT", requires = "key")]
    cert: Option<PathBuf>,
    /// Private key (PEM) of --cert.
    #[arg(long, global = true, env = "LATCHKEY_KEY", requires = "cert")]
    key: Option<PathBuf>,
    /// Verify the server's certificate for this name instead of the address's host
    /// (localhost over a Unix socket). Only over TLS.
    #[arg(long, global = true, env = "LATCHKEY_TLS_DOMAIN")]
    tls_domain: Option<String>,
    /// Bearer token sent with every call (prefer the environment variable: command
    /// lines are visible to other users).
    #[arg(long, global = true, env = "LATCHKEY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the bearer token. Given on the command line, a token or a token
    /// file wins over the other one's environment variable.
    #[arg(long, global = true, env = "LATCHKEY_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Hold a lock while a command runs, then release it.
    Run(run::RunArgs),
    /// Show one lock: holders, waiters, last fencing token.
    Describe {
        /// The lock's name.
        name: String,
    },
    /// List the held locks whose names start with PREFIX (all held locks without one).
    List {
        /// The name prefix.
        prefix: Option<String>,
    },
    /// Break a lock whatever its holders; their leases end as force-released.
    ForceRelease {
        /// The lock's name.
        name: String,
    },
    /// Print the lock's state now and after every change, until interrupted.
    Watch {
        /// The lock's name.
        name: String,
    },
}

/// The command line, each option whose environment variable is set but empty read as
/// if it were unset: `LATCHKEY_CA=` (a Kubernetes `value: ""`) turns a setting off
/// rather than giving it an empty value, which clap refuses or the client misreads.
fn command() -> clap::Command {
    let mut command = Cli::command();
    let empty: Vec<clap::Id> = (command.get_arguments())
        .filter(|a| a.get_env().and_then(std::env::var_os).is_some_and(|v| v.is_empty()))
        .map(|a| a.get_id().clone())
        .collect();
    for id in empty {
        command = command.mut_arg(id, |a| a.env(None));
    }
    command
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match parse() {
        Ok(cli) => cli,
        Err(err) => {
            let _ = err.print();
            return ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(EXIT_FAILURE));
        }
    };
    ExitCode::from(dispatch(cli).await)
}

async fn dispatch(cli: Cli) -> u8 {
    let options = match options(&cli) {
        Ok(options) => options,
        Err(message) => {
            print_err!("latchkey: {message}");
            return EXIT_FAILURE;
        }
    };
    let client = match Client::connect_with(&cli.server, &options).await {
        Ok(client) => client,
        Err(err) => return report(&err),
    };
    let outcome = match cli.command {
        Cmd::Run(args) => run::run(&client, args).await,
        Cmd::Describe { name } => describe(&client, &name).await,
        Cmd::List { prefix } => list(&client, prefix.unwrap_or_default()).await,
        Cmd::ForceRelease { name } => force_release(&client, &name).await,
        Cmd::Watch { name } => watch(&client, &name).await,
    };
    outcome.unwrap_or_else(|err| report(&err))
}

/// The command line, with one token source kept: a token or token file given there
/// wins over the other's environment variable (clap's `conflicts_with` would count the
/// variable as given too); two from the same place are an error.
fn parse() -> Result<Cli, clap::Error> {
    let matches = command().try_get_matches()?;
    let mut cli = Cli::from_arg_matches(&matches)?;
    let (token, file) = (source(&matches, "token"), source(&matches, "token_file"));
    match (token, file) {
        (Some(t), Some(f)) if t == f => {
            return Err(Cli::command().error(
                clap::error::ErrorKind::ArgumentConflict,
                "give a token (--token, LATCHKEY_TOKEN) or a token file (--token-file, LATCHKEY_TOKEN_FILE), not both",
            ))
        }
        (Some(t), Some(f)) if t < f => cli.token = None,
        (Some(_), Some(_)) => cli.token_file = None,
        _ => {}
    }
    Ok(cli)
}

/// Where argument `id` (a global one too) took its value, when it has one.
fn source(matches: &ArgMatches, id: &str) -> Option<ValueSource> {
    let mut found = matches.value_source(id);
    let mut matches = matches;
    while let Some((_, sub)) = matches.subcommand() {
        found = found.max(sub.value_source(id));
        matches = sub;
    }
    found
}

/// TLS and token settings from the flags; the files are read here.
fn options(cli: &Cli) -> Result<ConnectOptions, String> {
    let read = |p: &PathBuf| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
    let mut options = ConnectOptions::new();
    if let Some(ca) = &cli.ca {
        options = options.ca_pem(read(ca)?);
    }
    if let (Some(cert), Some(key)) = (&cli.cert, &cli.key) {
        options = options.identity_pem(read(cert)?, read(key)?);
    }
    if let Some(domain) = &cli.tls_domain {
        options = options.domain_name(domain.clone());
    }
    let token = match (&cli.token, &cli.token_file) {
        (Some(token), _) => Some(token.clone()),
        (None, Some(file)) => Some(String::from_utf8_lossy(&read(file)?).trim().to_owned()),
        (None, None) => None,
    };
    if let Some(token) = token {
        options = options.token(token);
    }
    Ok(options)
}

/// Prints the error and returns its exit code.
fn report(err: &Error) -> u8 {
    print_err!("latchkey: {err}");
    error_exit_code(err)
}

/// The exit code of an error. A wait for the lock that ran out is the server's
/// `WAIT_TIMEOUT` (`run` tells its own); any other `DEADLINE_EXCEEDED`, a call that got
/// no answer in time (from the client or a proxy), may get one when tried again, as an
/// unavailable server may.
fn error_exit_code(err: &Error) -> u8 {
    match err {
        Error::Lost(_) => EXIT_LOST,
        _ if err.reason().as_deref() == Some("WAIT_TIMEOUT") => EXIT_TIMEOUT,
        _ if err.code() == tonic::Code::DeadlineExceeded || err.is_unavailable() => EXIT_UNAVAILABLE,
        _ => EXIT_FAILURE,
    }
}

/// Writes `text` to stdout. `Err` holds the exit code when it could not be written: 0
/// when its reader went away (`latchkey watch NAME | head -1`), which ends the command
/// quietly as it ends other Unix tools (`println!` panicked there), 1 otherwise.
fn print_out(text: &str) -> Result<(), u8> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => Err(0),
        Err(err) => {
            print_err!("latchkey: cannot write the output: {err}");
            Err(EXIT_FAILURE)
        }
    }
}

/// Writes `line` and a newline to stderr, ignoring failures (see `print_err!`): an error
/// report has nowhere else to go.
fn write_err(line: std::fmt::Arguments<'_>) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{line}");
}

/// The exit code of a command that ends by printing `text`.
fn print_last(text: &str) -> u8 {
    print_out(text).err().unwrap_or(0)
}

async fn describe(client: &Client, name: &str) -> Result<u8, Error> {
    let state = client.describe(name).await?;
    Ok(print_last(&format::details(&state)))
}

async fn list(client: &Client, prefix: String) -> Result<u8, Error> {
    let locks = client.list_all(prefix).await?;
    Ok(print_last(&format::table(&locks)))
}

async fn force_release(client: &Client, name: &str) -> Result<u8, Error> {
    let text = match client.force_release(name).await? {
        true => format!("released lock {name:?}\n"),
        false => format!("lock {name:?} was not held\n"),
    };
    Ok(print_last(&text))
}

async fn watch(client: &Client, name: &str) -> Result<u8, Error> {
    let mut states = client.watch(name).await?;
    while let Some(state) = states.next().await? {
        if let Err(code) = print_out(&format!("{}\n", format::summary(&state))) {
            return Ok(code);
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_distinct_codes() {
        let code = |s: tonic::Status| error_exit_code(&Error::from(s));
        // A proxy's deadline, no wait of the server's.
        assert_eq!(code(tonic::Status::deadline_exceeded("x")), EXIT_UNAVAILABLE);
        use tonic_types::StatusExt;
        let info =
            tonic_types::ErrorDetails::with_error_info("WAIT_TIMEOUT", "latchkey", std::collections::HashMap::new());
        let waited = tonic::Status::with_error_details(tonic::Code::DeadlineExceeded, "x", info);
        assert_eq!(code(waited), EXIT_TIMEOUT);
        let silent = Error::NoAnswer {
            waited: std::time::Duration::from_secs(10),
        };
        assert_eq!(error_exit_code(&silent), EXIT_UNAVAILABLE);
        assert_eq!(code(tonic::Status::unavailable("x")), EXIT_UNAVAILABLE);
        assert_eq!(code(tonic::Status::invalid_argument("x")), EXIT_FAILURE);
        let lost = Error::Lost(latchkey_client::LostReason::NotHeld);
        assert_eq!(error_exit_code(&lost), EXIT_LOST);
    }
}
