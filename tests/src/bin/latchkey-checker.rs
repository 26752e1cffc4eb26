//! The long form of the fault-injection checker, and the client process the short
//! form kills and stops.
//!
//! ```sh
//! cargo build --release -p latchkey-server -p latchkey-tests --bin latchkey-checker
//! target/release/latchkey-checker run --duration 5m               # standalone, its faults
//! target/release/latchkey-checker run --cluster --duration 5m     # cluster, its faults
//! target/release/latchkey-checker names --count 20000             # resources under 20k names
//! ```

use clap::{Parser, Subcommand};
use latchkey_client::LockKind;
use latchkey_tests::checker::workload::{self, Runner, Workload};
use latchkey_tests::checker::{self, Fault, Resource, Scenario, Target};
use std::process::ExitCode;
use std::time::Duration;

/// Fault-injection checker for latchkey.
#[derive(Debug, Parser)]
#[command(name = "latchkey-checker")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs clients over two replicas while injecting faults, then verifies.
    Run(RunArgs),
    /// One client process: acquire `lock`, run one critical section, release, and
    /// print the attempt as a line (the short form kills and stops this process).
    Hold(HoldArgs),
    /// Contends many distinct names at once across two replicas and checks that
    /// subscriptions, memory and file descriptors return to their baseline.
    Names(checker::names::NamesArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// A 3-master cluster with a replica each instead of a standalone Redis.
    #[arg(long)]
    cluster: bool,
    /// How long the clients run.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Faults, injected in turn and repeated over the run (default: every fault the
    /// deployment supports).
    #[arg(long, value_delimiter = ',')]
    faults: Vec<Fault>,
    /// How many times the fault list is repeated over the run.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Client tasks per endpoint (three endpoints: each replica and the proxy).
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// The longest critical section.
    #[arg(long, default_value = "30ms", value_parser = humantime::parse_duration)]
    hold: Duration,
}

#[derive(Debug, clap::Args)]
struct HoldArgs {
    /// The latchkey endpoint.
    #[arg(long)]
    server: String,
    /// The Redis URL of the resource.
    #[arg(long)]
    resource: String,
    /// The lock (a mutex).
    #[arg(long)]
    lock: String,
    /// How long the critical section lasts.
    #[arg(long, value_parser = humantime::parse_duration)]
    hold: Duration,
    /// The client number recorded in the history.
    #[arg(long, default_value_t = 1000)]
    client: u32,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();
    match Cli::parse().command {
        Command::Run(args) => run(args).await,
        Command::Hold(args) => hold(args).await,
        Command::Names(args) => checker::names::run(&args).await,
    }
}

async fn run(args: RunArgs) -> ExitCode {
    let mut faults = args.faults.clone();
    if faults.is_empty() {
        faults = Fault::defaults(args.cluster);
    }
    let faults: Vec<Fault> = faults
        .iter()
        .copied()
        .cycle()
        .take(faults.len() * args.rounds)
        .collect();
    let mut scenario = Scenario::new(args.cluster, faults, args.duration);
    scenario.workload.clients_per_endpoint = args.clients;
    scenario.workload.hold = args.hold;
    println!(
        "{} run of {:?}, faults {:?}",
        if args.cluster { "cluster" } else { "standalone" },
        args.duration,
        scenario.faults
    );
    let (report, windows) = checker::run(&scenario).await;
    for w in &windows {
        println!("fault {} for {}ms", w.fault, (w.end - w.start) / 1000);
    }
    print!("{report}");
    let t = report.totals();
    println!(
        "totals: attempts {} acquisitions {} failed {} overlaps {} lost {} refused {} writes {} max-wait {:?} max-handoff {:?} max-fault-handoff {:?}",
        t.attempts, t.acquisitions, t.failures, t.overlaps, t.lost, t.refused, t.writes, t.max_wait, t.max_handoff, t.max_fault_handoff
    );
    if report.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

async fn hold(args: HoldArgs) -> ExitCode {
    let resource = Resource::connect(&args.resource).await;
    let runner = Runner {
        id: args.client,
        client: workload::connect(&args.server, Duration::from_secs(1)),
        workload: Workload {
            targets: vec![],
            clients_per_endpoint: 1,
            hold: args.hold,
            long_hold: Duration::ZERO,
            long_clients_per_endpoint: 0,
            wait: Duration::from_secs(30),
            keepalive: Duration::from_secs(1),
        },
        resource,
        history: checker::History::default(),
        announce: true,
    };
    let target = Target::new(&args.lock, LockKind::Mutex, 0);
    let attempt = runner.round(&target, args.hold).await;
    println!("{}", attempt.to_line());
    ExitCode::SUCCESS
}
