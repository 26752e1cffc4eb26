//! `latchkey run`: acquire, run the command with the lease in its environment,
//! stop it if the lease is lost, release when it exits.

use std::ffi::OsString;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use clap::{Args, ValueEnum};
use latchkey_client::{Client, Error, Lease, LockKind, LockState, LostReason, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, Signal as UnixSignal, SignalKind};

use crate::{EXIT_CANNOT_EXECUTE, EXIT_FAILURE, EXIT_LOST, EXIT_NOT_FOUND, EXIT_TIMEOUT};

/// How long a stopped command gets between SIGTERM and SIGKILL by default.
const DEFAULT_GRACE: &str = "10s";
/// The longest grace: the clock a grace is added to fits no time too far away. A year
/// as a duration is written (`1y`: 365.25 days).
const MAX_GRACE: Duration = Duration::from_secs(31_557_600);

/// How soon after a signal passed on an exit counts as the signal's, at the least,
/// whatever the grace: with none (`--grace 0s`), a wrapper that died of the signal at
/// once would otherwise have the lock released under the rest of its group.
const SIGNALLED_EXIT_WINDOW: Duration = Duration::from_secs(1);

/// `--grace`: a duration of at most a year.
fn parse_grace(text: &str) -> Result<Duration, String> {
    let grace = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if grace > MAX_GRACE {
        return Err("must be at most a year".into());
    }
    Ok(grace)
}

/// Arguments of `latchkey run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The lock's name.
    name: String,
    /// Wait at most this long for the lock (e.g. 10s, 500ms; 0s tries once).
    /// Default: wait until acquired.
    #[arg(long, value_parser = humantime::parse_duration)]
    wait: Option<Duration>,
    /// A fixed lease: the lock expires after this long even if the command still
    /// runs (the command is then stopped). Default: held while the command runs.
    #[arg(long, value_parser = humantime::parse_duration)]
    lease: Option<Duration>,
    /// The reentrancy identity. Default: a fresh id made by the server. The server
    /// refuses ids starting with `latchkey-`, the id `mode` and ids ending in `:write`.
    /// Not empty: the protocol reads "" as not given (`--owner "$OWNER"` with the
    /// variable unset would turn reentrancy off).
    #[arg(long, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    owner: Option<String>,
    /// The kind of lock.
    #[arg(long, value_enum, default_value_t = Kind::Mutex)]
    kind: Kind,
    /// Semaphore only: permits to take (default 1). At least 1: the protocol reads 0 as
    /// not given, which would take one permit, or pass on a lock of another kind.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    permits: Option<u32>,
    /// Semaphore only, required with `--kind semaphore`: the semaphore's number of
    /// permits (at least 1).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), required_if_eq("kind", "semaphore"))]
    limit: Option<u32>,
    /// When the lease is lost, or the command exits within this long of a signal
    /// passed on while others of its group run on: time between SIGTERM and SIGKILL to
    /// the command's group (at most a year).
    #[arg(long, value_parser = parse_grace, default_value = DEFAULT_GRACE)]
    grace: Duration,
    /// Do not report waiting on stderr.
    #[arg(long, short)]
    quiet: bool,
    /// Run the command in latchkey's process group, so that it may read from the
    /// terminal and gets the terminal's signals (Ctrl-C, Ctrl-Z) itself. A lost lease then
    /// stops only the command's own process, not the processes it started.
    /// Default: a process group of its own, every process of which is stopped.
    #[arg(long)]
    foreground: bool,
    /// The command and its arguments (after `--`), any bytes (a file name need not be
    /// UTF-8).
    #[arg(required = true, trailing_var_arg = true)]
    command: Vec<OsString>,
}

/// Lock kinds as written on the command line.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum Kind {
    Mutex,
    Fair,
    Read,
    Write,
    Semaphore,
}

impl From<Kind> for LockKind {
    fn from(kind: Kind) -> Self {
        match kind {
            Kind::Mutex => LockKind::Mutex,
            Kind::Fair => LockKind::Fair,
            Kind::Read => LockKind::Read,
            Kind::Write => LockKind::Write,
            Kind::Semaphore => LockKind::Semaphore,
        }
    }
}

pub async fn run(client: &Client, args: RunArgs) -> Result<u8, Error> {
    // Ctrl-Z while queued stops latchkey the default way (its handler comes with the
    // command), and a grant made meanwhile waits in its socket: read on `fg` as if just
    // made, though the server may have given the lock to another since (its keepalive
    // unanswered, or the lock lost in Redis). A resume heard during the wait has the
    // server asked before the command starts, as on a resume while it runs.
    let resumes = Resumes::count();
    let lease = match acquire(client, &args).await {
        Err(err) if err.is_timeout() => {
            print_err!("latchkey: {}", timeout_message(&args.name, args.wait));
            return Ok(EXIT_TIMEOUT);
        }
        other => other?,
    };
    // Listening before the command starts: a signal sent once it runs is passed on.
    // Held until `run` returns: a signal that comes during the release below is taken
    // and dropped (the release is bounded by `RELEASE_TIMEOUT`), never ends latchkey
    // before it has released.
    let mut signals = match Signals::listen(!args.foreground) {
        Ok(signals) => signals,
        Err(err) => {
            print_err!("latchkey: cannot listen for signals: {err}");
            release(lease).await;
            return Ok(EXIT_FAILURE);
        }
    };
    // A lease lost in the moment since the grant (a short `--lease`, a break) never
    // starts the command.
    let mut lost = lease.lost_reason();
    if lost.is_none() && resumes.some() {
        lost = lost_while_stopped(client, &lease, args.kind.into(), None).await;
    }
    if let Some(reason) = lost {
        print_err!(
            "latchkey: lost lock {:?}: {reason}; the command was not started",
            args.name
        );
        return Ok(EXIT_LOST);
    }
    let mut child = match spawn(&args.command, &lease, args.foreground) {
        Ok(child) => child,
        Err(err) => {
            print_err!("latchkey: cannot run {:?}: {err}", args.command[0]);
            release(lease).await;
            return Ok(spawn_exit_code(&err));
        }
    };
    let command = Supervised {
        pid: child.id(),
        child: &mut child,
        group: !args.foreground,
    };
    match supervise(command, &mut signals, client, &lease, args.kind.into(), args.grace).await {
        // A release that finds the lease lost (the lock vanished, or a notice came as the
        // command exited) means the command may have run without the lock for a while.
        Ok(Outcome::Exited(status)) => match release(lease).await {
            Some(reason) => {
                print_err!(
                    "latchkey: lost lock {:?}: {reason}; it may have run without it",
                    args.name
                );
                Ok(EXIT_LOST)
            }
            None => {
                if let Some(signal) = status.signal() {
                    die_by(signal);
                }
                Ok(exit_code(status))
            }
        },
        Ok(Outcome::Lost) => Ok(EXIT_LOST),
        Err(err) => {
            print_err!("latchkey: waiting for the command: {err}");
            Ok(EXIT_FAILURE)
        }
    }
}

/// Resumes (SIGCONT) since [`Resumes::count`]: counted in the signal's handler itself,
/// so one is seen by the time latchkey, resumed, reads a grant that came meanwhile (a
/// listener of the runtime's hears of it only once its driver has read its pipe, which
/// may come after the grant's socket).
static RESUMES: AtomicUsize = AtomicUsize::new(0);

/// The resumes counted from here on.
struct Resumes {
    from: usize,
}

impl Resumes {
    /// Starts counting (SIGCONT keeps its default: continuing a stopped process).
    #[allow(unsafe_code)]
    fn count() -> Self {
        use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet};
        extern "C" fn resumed(_: nix::libc::c_int) {
            RESUMES.fetch_add(1, Ordering::SeqCst);
        }
        let action = SigAction::new(SigHandler::Handler(resumed), SaFlags::SA_RESTART, SigSet::empty());
        // SAFETY: the handler makes one atomic addition, which is async-signal-safe; no
        // other part of latchkey handles SIGCONT. An exec resets it for the command.
        if let Err(err) = unsafe { sigaction(Signal::SIGCONT, &action) } {
            print_err!("latchkey: cannot listen for SIGCONT: {err}");
        }
        Self {
            from: RESUMES.load(Ordering::SeqCst),
        }
    }

    /// Whether latchkey was resumed since.
    fn some(&self) -> bool {
        RESUMES.load(Ordering::SeqCst) != self.from
    }
}

async fn acquire(client: &Client, args: &RunArgs) -> Result<Lease, Error> {
    let mut builder = client.lock(&args.name).kind(args.kind.into());
    if let Some(wait) = args.wait {
        builder = builder.wait(wait);
    }
    if let Some(lease) = args.lease {
        builder = builder.lease(lease);
    }
    if let Some(owner) = &args.owner {
        builder = builder.owner(owner);
    }
    if let Some(permits) = args.permits {
        builder = builder.permits(permits);
    }
    if let Some(limit) = args.limit {
        builder = builder.limit(limit);
    }
    if !args.quiet {
        let name = args.name.clone();
        builder = builder.on_queued(move |_| print_err!("latchkey: waiting for lock {name:?}"));
    }
    builder.acquire().await
}

fn timeout_message(name: &str, wait: Option<Duration>) -> String {
    match wait {
        Some(wait) if !wait.is_zero() => {
            format!("lock {name:?} not acquired within {}", humantime::format_duration(wait))
        }
        _ => format!("lock {name:?} is held by someone else"),
    }
}

/// Starts the command with the lease described in its environment, in a process group
/// of its own unless `foreground`: a lost lease must stop whatever the command
/// started too (a shell's children, a build's jobs), and a group is what one signal
/// reaches (as coreutils' `timeout` runs its command).
fn spawn(command: &[OsString], lease: &Lease, foreground: bool) -> io::Result<Child> {
    let (program, args) = command
        .split_first()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no command given"))?;
    let mut command = Command::new(program);
    command
        .args(args)
        .env("LATCHKEY_LOCK_NAME", lease.name())
        .env("LATCHKEY_FENCING_TOKEN", lease.fencing_token().to_string())
        .env("LATCHKEY_OWNER", lease.owner());
    if !foreground {
        command.process_group(0);
    }
    dies_with_latchkey(&mut command);
    reaps_its_command(&mut command);
    command.spawn()
}

/// Has the command killed (SIGKILL) when `latchkey` dies without stopping it (killed
/// itself, by SIGKILL or the OOM killer): its connection then closes and the server
/// gives the lock to the next holder, so the command must not run on. The signal
/// comes when the spawning thread ends: the main thread, which runs `main`'s future.
/// It reaches the command's own process only: the processes it started live on.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn dies_with_latchkey(command: &mut Command) {
    let latchkey = nix::unistd::getpid();
    // SAFETY: the closure runs between fork and exec and makes only async-signal-safe
    // system calls (prctl, getppid), with no allocation on success.
    unsafe {
        command.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // latchkey died before the prctl took effect: nothing would signal.
            if nix::unistd::getppid() != latchkey {
                return Err(io::Error::other("latchkey exited"));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn dies_with_latchkey(_command: &mut Command) {}

/// Has latchkey reap its command when it was started with SIGCHLD ignored (a Perl
/// `$SIG{CHLD} = 'IGNORE'` before `system`, some supervisors): the kernel then reaps
/// children itself, and the wait for the command fails, losing its exit status and,
/// after a lost lease, the group's SIGKILL. latchkey takes the default back; the
/// command keeps the ignoring, as it would without latchkey.
#[allow(unsafe_code)]
fn reaps_its_command(command: &mut Command) {
    use nix::sys::signal::{signal, SigHandler};
    if !ignored_at_start(Signal::SIGCHLD as i32) {
        return;
    }
    // SAFETY: the default disposition; no handler of this process is replaced (it
    // was ignored), and latchkey has no child yet that it could have reaped.
    let _ = unsafe { signal(Signal::SIGCHLD, SigHandler::SigDfl) };
    // SAFETY: the closure runs between fork and exec and makes one async-signal-safe
    // system call (sigaction), with no allocation.
    unsafe {
        command.pre_exec(|| {
            signal(Signal::SIGCHLD, SigHandler::SigIgn)?;
            Ok(())
        });
    }
}

fn spawn_exit_code(err: &io::Error) -> u8 {
    match err.kind() {
        io::ErrorKind::NotFound => EXIT_NOT_FOUND,
        _ => EXIT_CANNOT_EXECUTE,
    }
}

/// How the supervised command ended.
#[derive(Debug)]
enum Outcome {
    /// It exited on its own (or after a forwarded signal).
    Exited(ExitStatus),
    /// The lease was lost and the command was stopped.
    Lost,
}

/// The signals that end a process by default, besides the terminal's, that `run` passes
/// on to the command rather than let end latchkey, and with it the lock, under a
/// running command: SIGUSR1 and SIGUSR2, which a service is often sent to reopen its
/// logs or reload, the timers' and limits' (`timeout -s ALRM`, a CPU limit's SIGXCPU),
/// SIGABRT (systemd's at a watchdog's timeout; an abort of latchkey's own still ends it,
/// as abort(3) raises it again once the handler returned); and the real-time signals
/// ([`passed_on`]). Not the faults' (SIGBUS, SIGSYS, SIGTRAP, SIGSEGV, ...): a handler
/// that returns from a real fault would have it fault again without end.
const PASSED_ON: [Signal; 11] = [
    Signal::SIGABRT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGALRM,
    Signal::SIGVTALRM,
    Signal::SIGPROF,
    Signal::SIGIO,
    Signal::SIGPWR,
    Signal::SIGXCPU,
    Signal::SIGXFSZ,
    Signal::SIGSTKFLT,
];

/// [`PASSED_ON`] by number, and the real-time signals (SIGRTMIN to SIGRTMAX-1, 34 to
/// 63 with glibc), which nix's `Signal` does not know. SIGRTMAX itself is beyond what
/// tokio listens for ("signal too large"): it still ends latchkey (the client's README
/// says so).
fn passed_on() -> impl Iterator<Item = i32> {
    use nix::libc;
    PASSED_ON
        .into_iter()
        .map(|s| s as i32)
        .chain(libc::SIGRTMIN()..libc::SIGRTMAX())
}

/// The signals `run` passes on to the command, and the one that suspends both.
#[derive(Debug)]
struct Signals {
    /// Each `None` when it was ignored at start ([`ignored_at_start`]).
    interrupt: Option<UnixSignal>,
    terminate: Option<UnixSignal>,
    hangup: Option<UnixSignal>,
    quit: Option<UnixSignal>,
    /// The others of [`passed_on`] not ignored at start, by number.
    passed: Vec<(i32, UnixSignal)>,
    /// SIGTSTP (Ctrl-Z), listened for only when the command has a group of its own:
    /// with `--foreground` the terminal stops the command itself, and latchkey keeps
    /// the default (it stops). SIGTTIN and SIGTTOU keep theirs: latchkey reads no
    /// terminal, and while the command runs writes to one only to say a signal could
    /// not be sent (a lost lease is reported once the command was stopped); and with
    /// `stty tostop` a handled SIGTTOU would have a write from the background try
    /// again, and be signalled again, without end.
    suspend: Option<UnixSignal>,
    /// SIGWINCH (the terminal's window resized), listened for only when the command
    /// has a group of its own: the terminal sends it to its foreground group, which
    /// the command then is not in.
    resize: Option<UnixSignal>,
}

impl Signals {
    /// The next signal received.
    async fn next(&mut self) -> Received {
        tokio::select! {
            () = delivered(&mut self.interrupt) => Received::Forward(Signal::SIGINT as i32),
            () = delivered(&mut self.terminate) => Received::Forward(Signal::SIGTERM as i32),
            () = delivered(&mut self.hangup) => Received::Forward(Signal::SIGHUP as i32),
            () = delivered(&mut self.quit) => Received::Forward(Signal::SIGQUIT as i32),
            signal = passed(&mut self.passed) => Received::Forward(signal),
            () = delivered(&mut self.suspend) => Received::Suspend,
            () = delivered(&mut self.resize) => Received::Forward(Signal::SIGWINCH as i32),
        }
    }

    fn listen(group: bool) -> io::Result<Self> {
        let (suspend, resize) = match group {
            true => (
                listen_unless_ignored(Signal::SIGTSTP as i32)?,
                listen_unless_ignored(Signal::SIGWINCH as i32)?,
            ),
            false => (None, None),
        };
        Ok(Self {
            interrupt: listen_unless_ignored(Signal::SIGINT as i32)?,
            terminate: listen_unless_ignored(Signal::SIGTERM as i32)?,
            hangup: listen_unless_ignored(Signal::SIGHUP as i32)?,
            quit: listen_unless_ignored(Signal::SIGQUIT as i32)?,
            passed: passed_on()
                .filter_map(|sig| listen_unless_ignored(sig).transpose().map(|s| s.map(|s| (sig, s))))
                .collect::<io::Result<_>>()?,
            suspend,
            resize,
        })
    }
}

/// A stream of `sig`, or `None` when it was ignored at start.
fn listen_unless_ignored(sig: i32) -> io::Result<Option<UnixSignal>> {
    match ignored_at_start(sig) {
        true => Ok(None),
        false => signal(SignalKind::from_raw(sig)).map(Some),
    }
}

/// Whether `signal` is ignored, as `nohup` leaves SIGHUP and a shell script SIGINT and
/// SIGQUIT for a job it runs in the background: such a signal is neither listened for
/// nor passed on, and the command inherits the ignoring, as it would without latchkey
/// (listening replaced the ignoring, and a `nohup`-ed command died at logout).
/// By number, through libc: nix's `Signal` knows no real-time signal.
#[allow(unsafe_code)]
fn ignored_at_start(signal: i32) -> bool {
    use nix::libc;
    // SAFETY: a `sigaction` is plain data, for which zeroes are a value.
    let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: with no new action it only reads the disposition, into `current`.
    let read = unsafe { libc::sigaction(signal, std::ptr::null(), &mut current) };
    read == 0 && current.sa_sigaction == libc::SIG_IGN
}

/// The next delivery of `signal`; never when it is not listened for.
async fn delivered(signal: &mut Option<UnixSignal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// The next delivery of any of `signals`, and which; never when there are none.
async fn passed(signals: &mut [(i32, UnixSignal)]) -> i32 {
    std::future::poll_fn(|cx| {
        (signals.iter_mut())
            .find_map(|(sig, s)| s.poll_recv(cx).is_ready().then_some(*sig))
            .map_or(std::task::Poll::Pending, std::task::Poll::Ready)
    })
    .await
}

/// What woke [`supervise`] besides the command's end and a lost lease.
#[derive(Debug, Clone, Copy)]
enum Received {
    /// A signal to pass on, by number.
    Forward(i32),
    /// SIGTSTP: stop the command and latchkey.
    Suspend,
}

/// The running command, and whether it leads a process group of its own.
#[derive(Debug)]
struct Supervised<'a> {
    child: &'a mut Child,
    /// The command's process id, kept from the start: the group it leads keeps this id
    /// after the process itself has been reaped.
    pid: Option<u32>,
    group: bool,
}

/// Waits for the command, passing on the signals that ask latchkey to stop and
/// stopping the command if the lease is lost. In a group of its own the command gets
/// SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGWINCH and [`PASSED_ON`]: it is out of the
/// terminal's foreground group, so Ctrl-C reaches latchkey alone; so does Ctrl-Z
/// (SIGTSTP), which stops the command's group and then latchkey ([`suspend`]). With
/// `--foreground` it shares latchkey's group, where the terminal signals both; only
/// SIGTERM, SIGHUP and [`PASSED_ON`], which usually come to latchkey alone, are passed
/// on (a terminal's hangup reaches the whole foreground group, so the command then
/// hears SIGHUP twice). latchkey releases once the command exits.
/// The signals are passed on in the same way while a lost lease's command is stopped
/// ([`stop`]).
async fn supervise(
    command: Supervised<'_>,
    signals: &mut Signals,
    client: &Client,
    lease: &Lease,
    kind: LockKind,
    grace: Duration,
) -> io::Result<Outcome> {
    let learning = learn_listing(client, lease, kind);
    tokio::pin!(learning);
    // How the server lists the lease's holder, once learned.
    let mut listed: Option<Option<String>> = None;
    // When a signal was last passed on to the command's group, and whether it was a
    // SIGINT or SIGTERM (the first Ctrl-C of the stop it may bring).
    let mut signalled: Option<tokio::time::Instant> = None;
    let mut interrupted = false;
    loop {
        let received = tokio::select! {
            // A loss heard with the command's exit stops what the command left in its
            // group too: they may have run without the lock.
            biased;
            reason = lease.lost() => return stop_lost(command, signals, lease.name(), reason, grace).await,
            status = command.child.wait() => {
                // An exit a signal passed on may have brought (within the grace of it,
                // a second at least: SIGNALLED_EXIT_WINDOW),
                // the rest of the group still running: it got the signal too, and is
                // stopped as a lost lease's command is before the release. A wrapper
                // shell that died of it at once (`sh start.sh` running a service
                // without `exec`) would otherwise leave the service running on, in its
                // shutdown or for good, while another client takes the lock. (What a
                // command leaves running when it exits on its own is left alone.)
                let soon = signalled.is_some_and(|at| at.elapsed() < grace.max(SIGNALLED_EXIT_WINDOW));
                if status.is_ok() && soon && command.group && group_lives(&command) {
                    return stop(command, signals, grace, usize::from(interrupted))
                        .await
                        .map(Outcome::Exited);
                }
                return exited(&command, status);
            }
            learned = &mut learning, if listed.is_none() => {
                listed = Some(learned);
                continue;
            }
            received = signals.next() => received,
        };
        match received {
            Received::Forward(signal) => {
                forward(&command, signal);
                // A resize asks nothing to end: an exit after it is the command's own.
                if signal != Signal::SIGWINCH as i32 {
                    signalled = Some(tokio::time::Instant::now());
                    interrupted = is_interrupt(signal);
                }
            }
            Received::Suspend => {
                // The listing asked as the command started is waited for (it is
                // bounded): it tells of the state then, and a stopped latchkey would
                // not hear it. A loss heard meanwhile stops the command at once.
                if listed.is_none() {
                    tokio::select! {
                        biased;
                        reason = lease.lost() => return stop_lost(command, signals, lease.name(), reason, grace).await,
                        learned = &mut learning => listed = Some(learned),
                    }
                }
                let listed = listed.as_ref().and_then(Option::as_deref);
                if let Some(reason) = suspend(&command, client, lease, kind, listed).await {
                    return stop_lost(command, signals, lease.name(), reason, grace).await;
                }
            }
        }
    }
}

/// The command's exit. A wait that failed (something else reaped the command) leaves
/// it unknown whether the command still runs: it is killed, its group with it, before
/// the error ends the lease, as [`stop`] does.
fn exited(command: &Supervised<'_>, status: io::Result<ExitStatus>) -> io::Result<Outcome> {
    if status.is_err() {
        send_signal(command, Signal::SIGKILL);
    }
    Ok(Outcome::Exited(status?))
}

/// Passes a signal latchkey received on to the command: in a group of its own, every
/// one; with `--foreground` all but the terminal's (SIGINT, SIGQUIT) while the terminal
/// sends them to latchkey's group, which reached the command already. In a group of
/// its own SIGCONT follows, as in `stop`: the terminal stops a background group that
/// reads from it (SIGTTIN), and a stopped command would keep the signal pending, and
/// the lock, for good. Not after a resize, which asks nothing to end: a group stopped on
/// purpose (`kill -STOP`) stays stopped.
fn forward(command: &Supervised<'_>, signal: i32) {
    if command.group {
        send_number(command, signal);
        if signal != Signal::SIGWINCH as i32 {
            send_signal(command, Signal::SIGCONT);
        }
    } else if (signal != Signal::SIGINT as i32 && signal != Signal::SIGQUIT as i32) || !in_the_terminals_foreground() {
        send_number(command, signal);
    }
}

/// Whether latchkey's process group is its controlling terminal's foreground group, to
/// which the terminal sends Ctrl-C and Ctrl-\. Without a terminal (a container, a
/// supervisor, `setsid`), or in the background, a SIGINT or SIGQUIT came to latchkey
/// alone (`kill`, a container's stop signal): dropped, it left the command running,
/// and the lock held.
fn in_the_terminals_foreground() -> bool {
    std::fs::File::open("/dev/tty")
        .and_then(|tty| Ok(nix::unistd::tcgetpgrp(tty)?))
        .is_ok_and(|foreground| foreground == nix::unistd::getpgrp())
}

/// Stops the command of a lost lease, then says so. In that order: a report that
/// blocks (stderr is a full pipe) must not hold up the stop, the lock being gone.
async fn stop_lost(
    command: Supervised<'_>,
    signals: &mut Signals,
    name: &str,
    reason: LostReason,
    grace: Duration,
) -> io::Result<Outcome> {
    let stopped = stop(command, signals, grace, 0).await;
    print_err!("latchkey: lost lock {name:?}: {reason}; the command was stopped");
    stopped.map(|_| Outcome::Lost)
}

/// How long a resumed latchkey waits for the server's word on its lock before it lets
/// the command run again (see [`suspend`]).
const RESUME_CHECK: Duration = Duration::from_secs(2);

/// The pause before a resumed latchkey asks again (a broken connection, a lock not yet
/// shown held).
const RESUME_RETRY: Duration = Duration::from_millis(50);

/// Ctrl-Z (SIGTSTP), the command in a group of its own: stops the group (SIGSTOP, which
/// it cannot ignore), then latchkey itself (SIGSTOP, as SIGTSTP has a handler now).
/// Stopped, latchkey answers no keepalive, and the server gives the lock to another
/// client after its keepalive timeout; the command must not run meanwhile. On SIGCONT
/// (`fg`, `bg`), the lease's reason when it was lost meanwhile ([`lost_while_stopped`]):
/// the group is then stopped as for any lost lease, never resumed before. Otherwise the
/// group is resumed.
async fn suspend(
    command: &Supervised<'_>,
    client: &Client,
    lease: &Lease,
    kind: LockKind,
    listed: Option<&str>,
) -> Option<LostReason> {
    // A lease lost already is stopped as such, not suspended.
    if let Some(reason) = lease.lost_reason() {
        return Some(reason);
    }
    send_signal(command, Signal::SIGSTOP);
    if let Err(err) = nix::sys::signal::raise(Signal::SIGSTOP) {
        print_err!("latchkey: cannot stop: {err}");
    }
    // Resumed.
    let lost = lost_while_stopped(client, lease, kind, listed).await;
    if lost.is_none() {
        send_signal(command, Signal::SIGCONT);
    }
    lost
}

/// Why the lease was lost while latchkey was stopped, asked of the server: a Describe of
/// the lock (within [`RESUME_CHECK`]). The lease's own stream cannot be trusted to have
/// read its connection's end by then: the Describe may be answered on a new connection
/// first. So the answer itself decides: a lock whose holders include the lease's owner
/// is held. One whose holders do not is asked of again until the check's end, and is
/// lost (`NotHeld`) if it stays so: a lock passed to the lease in memory shows in Redis
/// only once the server recorded the pass, a moment later. After a broken connection
/// the Describe is asked again too. A server that answers but will not tell this caller
/// (no `inspect` permission) leaves the lease's stream to go by. With no answer at all
/// (a host gone, a network dropping every packet: the socket hears of no end), the
/// stream is waited on until the keepalive has had its say ([`KEEPALIVE_VERDICT`]):
/// the stop took the margin by which a holder behind a silent connection hears of its
/// loss before the server gives the lock to another.
async fn lost_while_stopped(
    client: &Client,
    lease: &Lease,
    kind: LockKind,
    listed: Option<&str>,
) -> Option<LostReason> {
    let deadline = tokio::time::Instant::now() + RESUME_CHECK;
    let mut not_held = false;
    let mut refused = false;
    loop {
        let answer = tokio::time::timeout_at(deadline, client.describe(lease.name())).await;
        if let Some(reason) = lease.lost_reason() {
            return Some(reason);
        }
        match answer {
            Ok(Ok(state)) if held_by(&state, lease.owner(), lease.fencing_token(), kind, listed) => return None,
            Ok(Ok(_)) => not_held = true,
            Ok(Err(err)) if err.is_unavailable() => {}
            Ok(Err(err)) => {
                refused = may_not_ask(&err);
                break;
            }
            Err(_) => break,
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            break;
        }
        tokio::time::sleep_until((now + RESUME_RETRY).min(deadline)).await;
    }
    if let Some(reason) = lease.lost_reason().or(not_held.then_some(LostReason::NotHeld)) {
        return Some(reason);
    }
    if refused {
        return None;
    }
    tokio::time::timeout(KEEPALIVE_VERDICT, lease.lost()).await.ok()
}

/// How long after a resume the client's keepalive has found a silent connection dead:
/// its first ping goes out at once (the interval went by while stopped), and one more
/// interval covers a ping sent just before the stop.
const KEEPALIVE_VERDICT: Duration = KEEPALIVE_INTERVAL.saturating_add(KEEPALIVE_TIMEOUT);

/// Whether the server answered the Describe with a refusal to tell this caller: no
/// `inspect` permission, no identity it accepts, or no Describe at all.
fn may_not_ask(err: &Error) -> bool {
    matches!(
        err.code(),
        tonic::Code::PermissionDenied | tonic::Code::Unauthenticated | tonic::Code::Unimplemented
    )
}

/// Whether `owner` is among the lock's holders: as it is, as the server listed the
/// lease's holder when it was the latest grant (`listed`, see [`learn_listing`]), or as
/// the server scopes an owner under auth (`<identity>/<owner>`, an identity's name has
/// no `/`); for a write lease, with the lock in write mode. A write lock lost while
/// stopped, then read by the same named owner from elsewhere, lists the owner among
/// its readers: the command would resume as the only writer beside other readers. A
/// holder matched through a scope only (its owner ends in `/<owner>`) may be another
/// owner altogether (`team/w1` beside `w1` with auth off, where owners are not
/// scoped): on a lock one holder holds at a time (mutex, fair, write) it counts only
/// while the lock's latest grant is the lease's own. The owner itself counts whatever
/// the latest grant, as given or as listed: another stream of it (a nested `latchkey
/// run --owner`) reenters and draws a later token.
fn held_by(state: &LockState, owner: &str, token: u64, kind: LockKind, listed: Option<&str>) -> bool {
    if kind == LockKind::Write && state.kind() != LockKind::Write {
        return false;
    }
    let latest = !exclusive(kind) || state.last_fencing_token == token;
    state.holders.iter().any(|holder| {
        holder.owner == owner || listed == Some(holder.owner.as_str()) || latest && scoped(&holder.owner, owner)
    })
}

/// Whether `holder` reads as `owner` scoped by an identity: `<identity>/<owner>`.
fn scoped(holder: &str, owner: &str) -> bool {
    holder
        .strip_suffix(owner)
        .and_then(|scoped| scoped.strip_suffix('/'))
        .is_some_and(|identity| !identity.is_empty() && !identity.contains('/'))
}

/// Whether one holder holds a lock of `kind` at a time.
fn exclusive(kind: LockKind) -> bool {
    matches!(kind, LockKind::Mutex | LockKind::Fair | LockKind::Write)
}

/// Learns, once the command runs, how the server lists the lease's holder on a lock
/// one holder holds at a time: under auth, scoped by the caller's identity, which the
/// client is not told. Asked while the lease's grant is the lock's latest (a Describe
/// within [`RESUME_CHECK`]), the one holder listed is the lease's. After a Ctrl-Z the
/// owner so listed counts as the lease's whatever the latest grant: a nested `latchkey
/// run --owner` that reentered under auth drew a later token, and the lease, held
/// still, read as lost. Nothing is learned from a later grant, a refusal or no answer.
async fn learn_listing(client: &Client, lease: &Lease, kind: LockKind) -> Option<String> {
    if !exclusive(kind) {
        return None;
    }
    let answer = tokio::time::timeout(RESUME_CHECK, client.describe(lease.name())).await;
    let state = answer.ok()?.ok()?;
    match state.holders.as_slice() {
        [holder]
            if state.last_fencing_token == lease.fencing_token()
                && (holder.owner == lease.owner() || scoped(&holder.owner, lease.owner())) =>
        {
            Some(holder.owner.clone())
        }
        _ => None,
    }
}

/// SIGTERM, then SIGKILL if the command is still running after `grace`. In a group
/// of its own, what the command started gets the same grace: SIGKILL goes to the
/// group when the grace is over unless the group has ended, even if the command's own
/// process ended first, since nothing of it may run on without the lock. SIGCONT
/// follows SIGTERM, so a stopped command (Ctrl-Z, a read from the terminal) gets it,
/// and not before: a stopped command never runs again before it has been told.
///
/// During the grace, SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to latchkey are passed on
/// as while the command ran ([`forward`]), and the second SIGINT or SIGTERM (a second
/// Ctrl-C, counting the `asked` that brought the stop) ends the grace at once: SIGKILL.
/// SIGTSTP is ignored: the lock is gone, and the command must end, not wait stopped.
async fn stop(
    command: Supervised<'_>,
    signals: &mut Signals,
    grace: Duration,
    mut asked: usize,
) -> io::Result<ExitStatus> {
    /// What ended a wait of the grace.
    enum Event {
        Exited(io::Result<ExitStatus>),
        Poll,
        GraceOver,
        Received(Received),
    }
    let deadline = tokio::time::Instant::now() + grace;
    send_signal(&command, Signal::SIGTERM);
    send_signal(&command, Signal::SIGCONT);
    let mut status = None;
    loop {
        if status.is_some() && !(command.group && group_lives(&command)) {
            break;
        }
        let event = tokio::select! {
            waited = command.child.wait(), if status.is_none() => Event::Exited(waited),
            () = tokio::time::sleep(GROUP_POLL), if status.is_some() => Event::Poll,
            () = tokio::time::sleep_until(deadline) => Event::GraceOver,
            received = signals.next() => Event::Received(received),
        };
        match event {
            Event::Exited(exited) => status = Some(exited),
            Event::Poll | Event::Received(Received::Suspend) => {}
            Event::GraceOver => break,
            Event::Received(Received::Forward(signal)) => {
                if is_interrupt(signal) {
                    asked += 1;
                    if asked >= 2 {
                        break;
                    }
                }
                forward(&command, signal);
            }
        }
    }
    // A wait that failed still ends in the group's SIGKILL, then says why.
    let status = match status {
        Some(status) => status,
        None => {
            send_signal(&command, Signal::SIGKILL);
            command.child.wait().await
        }
    };
    if command.group {
        send_signal(&command, Signal::SIGKILL);
    }
    status
}

/// Whether `signal` asks to end now: SIGINT or SIGTERM, of which a second ends a stop's
/// grace.
fn is_interrupt(signal: i32) -> bool {
    signal == Signal::SIGINT as i32 || signal == Signal::SIGTERM as i32
}

/// How often `stop` looks whether the command's group has ended.
const GROUP_POLL: Duration = Duration::from_millis(20);

/// The process (or, in a group of its own, the group) signals go to; `None` once the
/// command's own process was reaped and it leads no group: nothing to signal.
fn target(command: &Supervised<'_>) -> Option<Pid> {
    match command.group {
        true => Some(Pid::from_raw(-i32::try_from(command.pid?).ok()?)),
        // A reaped process's id may already be another's.
        false => Some(Pid::from_raw(i32::try_from(command.child.id()?).ok()?)),
    }
}

/// Whether any process of the command's group is still running. A zombie does not
/// count (where `/proc` tells): one whose parent does not reap it (latchkey as a
/// container's PID 1, which adopts the group's orphans and reaps none) has ended all
/// the same, and counted it would hold a stop, and the release, for the whole grace.
fn group_lives(command: &Supervised<'_>) -> bool {
    let signalled = target(command).is_some_and(|to| kill(to, None).is_ok());
    match (command.group, command.pid) {
        (true, Some(group)) if signalled => runs_in_group(group).unwrap_or(true),
        _ => signalled,
    }
}

/// Whether a process of group `group` runs (is no zombie), read from `/proc`; `None`
/// where it cannot be read.
fn runs_in_group(group: u32) -> Option<bool> {
    let group = group.to_string();
    let stats = std::fs::read_dir("/proc").ok()?.filter_map(|entry| {
        let pid = entry.ok()?.file_name();
        std::fs::read_to_string(format!("/proc/{}/stat", pid.to_str()?)).ok()
    });
    let mut read = false;
    for stat in stats {
        read = true;
        // After the command name (which may hold spaces): the state, the parent, the
        // group.
        let fields: Vec<&str> = match stat.rsplit_once(')') {
            Some((_, rest)) => rest.split_whitespace().take(3).collect(),
            None => continue,
        };
        if fields.get(2) == Some(&group.as_str()) && fields.first() != Some(&"Z") {
            return Some(true);
        }
    }
    read.then_some(false)
}

fn send_signal(command: &Supervised<'_>, signal: Signal) {
    send_number(command, signal as i32);
}

/// Sends signal number `signal` (a real-time one too, which nix's `kill` cannot).
#[allow(unsafe_code)]
fn send_number(command: &Supervised<'_>, signal: i32) {
    use nix::libc;
    let Some(to) = target(command) else { return };
    // SAFETY: kill(2) with a process or group id and a signal number touches no memory.
    match nix::errno::Errno::result(unsafe { libc::kill(to.as_raw(), signal) }) {
        // A group whose processes have all ended.
        Err(nix::errno::Errno::ESRCH) if command.group => {}
        Err(err) => print_err!("latchkey: cannot send {} to the command: {err}", signal_name(signal)),
        Ok(_) => {}
    }
}

/// `SIGTERM`, or `SIGRTMIN+n` for a real-time signal.
fn signal_name(signal: i32) -> String {
    match Signal::try_from(signal) {
        Ok(known) => known.to_string(),
        Err(_) => format!("SIGRTMIN+{}", signal - nix::libc::SIGRTMIN()),
    }
}

/// Releases the lease; the reason when it turned out lost. Any other failure is a
/// warning: the server gives the lock back once Redis answers.
async fn release(lease: Lease) -> Option<LostReason> {
    let name = lease.name().to_owned();
    match lease.release().await {
        Ok(()) => None,
        Err(Error::Lost(reason)) => Some(reason),
        Err(err) => {
            print_err!("latchkey: warning: releasing lock {name:?}: {err}");
            None
        }
    }
}

/// Ends latchkey by the signal that killed its command (the lock released already), as
/// coreutils `timeout` does: a parent that asks how its child ended (systemd on a
/// stop, a shell loop on Ctrl-C, xargs) sees the command's ending, not a normal exit;
/// a shell still reads 128+N. Returns only if the signal did not end latchkey.
/// By number, through libc: nix's `Signal` knows no real-time signal (34 to 64).
#[allow(unsafe_code)]
fn die_by(signal: i32) {
    use nix::libc;
    // No core of latchkey for a signal that dumps one: the command's is what matters.
    let _ = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_CORE, 0, 0);
    // SAFETY: puts back the default action, which runs no code of this process (the
    // runtime's handler, replaced, only fed the signal streams, whose work is done),
    // then raises the signal; a number that is no signal fails both, harmlessly.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}

/// The command's exit code, or 128+N when signal N killed it (as in a shell).
fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(EXIT_FAILURE),
        (None, Some(signal)) => u8::try_from(128 + signal).unwrap_or(EXIT_FAILURE),
        (None, None) => EXIT_FAILURE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Cli, Cmd};
    use clap::Parser;
    use latchkey_client::DEFAULT_SERVER;

    #[test]
    fn run_parses_durations_and_command() {
        let cli = Cli::try_parse_from([
            "latchkey", "run", "job", "--wait", "500ms", "--lease", "30s", "--", "sh", "-c", "exit 3",
        ])
        .expect("parses");
        let Cmd::Run(args) = cli.command else { panic!("not run") };
        assert_eq!(args.wait, Some(Duration::from_millis(500)));
        assert_eq!(args.lease, Some(Duration::from_secs(30)));
        assert_eq!(args.grace, Duration::from_secs(10));
        assert_eq!(args.command, ["sh", "-c", "exit 3"]);
        assert_eq!(cli.server, DEFAULT_SERVER);
    }

    #[test]
    fn run_defaults_wait_forever() {
        let cli = Cli::try_parse_from(["latchkey", "--server", "unix:///s", "run", "j", "true"]).expect("parses");
        let Cmd::Run(args) = cli.command else { panic!("not run") };
        assert_eq!((args.wait, args.lease), (None, None));
        assert_eq!(cli.server, "unix:///s");
        assert!(Cli::try_parse_from(["latchkey", "run", "j"]).is_err());
    }

    /// `--permits 0` took one permit, and passed on a mutex, where `--permits 1` is
    /// refused: the protocol reads 0 as not given.
    #[test]
    fn run_refuses_zero_permits_and_a_zero_limit() {
        let run = |limit: &str, permits: &str| {
            let args = [
                "run",
                "s",
                "--kind",
                "semaphore",
                "--limit",
                limit,
                "--permits",
                permits,
                "--",
                "true",
            ];
            Cli::try_parse_from(["latchkey"].into_iter().chain(args))
        };
        assert!(run("3", "0").is_err());
        assert!(run("0", "1").is_err());
        // A semaphore without its limit is a usage error too, not the server's refusal.
        let no_limit = ["latchkey", "run", "s", "--kind", "semaphore", "--", "true"];
        let Err(err) = Cli::try_parse_from(no_limit) else {
            panic!("a semaphore without --limit parsed")
        };
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument, "{err}");
        let Cmd::Run(args) = run("3", "2").expect("parses").command else {
            panic!("not run")
        };
        assert_eq!((args.permits, args.limit), (Some(2), Some(3)));
    }

    /// `--owner ""` (`--owner "$OWNER"` with the variable unset) went out unset: a fresh
    /// owner per stream, so runs meant to share an owner waited on each other. It is a
    /// usage error, as `--permits 0` is, before any connection.
    #[test]
    fn run_refuses_an_empty_owner() {
        let run = |owner: &str| Cli::try_parse_from(["latchkey", "run", "j", "--owner", owner, "--", "true"]);
        assert!(run("").is_err());
        let Cmd::Run(args) = run("w1").expect("parses").command else {
            panic!("not run")
        };
        assert_eq!(args.owner.as_deref(), Some("w1"));
    }

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(7 << 8)), 7);
        assert_eq!(exit_code(ExitStatus::from_raw(9)), 137);
        assert_eq!(exit_code(ExitStatus::from_raw(15)), 143);
    }

    #[test]
    fn spawn_errors_map_like_a_shell() {
        let not_found = io::Error::from(io::ErrorKind::NotFound);
        assert_eq!(spawn_exit_code(&not_found), EXIT_NOT_FOUND);
        let denied = io::Error::from(io::ErrorKind::PermissionDenied);
        assert_eq!(spawn_exit_code(&denied), EXIT_CANNOT_EXECUTE);
    }

    #[test]
    fn a_lock_is_held_by_its_owner_as_given_or_scoped_by_an_identity() {
        let holders = |owners: &[&str]| LockState {
            kind: LockKind::Mutex.into(),
            holders: owners
                .iter()
                .map(|owner| latchkey_client::Holder {
                    owner: (*owner).to_owned(),
                    ..Default::default()
                })
                .collect(),
            last_fencing_token: 7,
            ..Default::default()
        };
        let mutex = LockKind::Mutex;
        assert!(held_by(&holders(&["w1"]), "w1", 7, mutex, None));
        assert!(held_by(&holders(&["other", "alice/w1"]), "w1", 7, mutex, None));
        assert!(!held_by(&holders(&["aw1", "w10"]), "w1", 7, mutex, None));
        assert!(!held_by(&holders(&[]), "w1", 7, mutex, None));
        // An identity's name has no `/`: `ops/x/w1` is another owner's.
        assert!(!held_by(&holders(&["ops/x/w1", "/w1"]), "w1", 7, LockKind::Read, None));
        // A write lease is held only while the lock is in write mode: its owner among
        // the readers holds no write.
        let mut read = holders(&["w1"]);
        read.set_kind(LockKind::Read);
        assert!(!held_by(&read, "w1", 7, LockKind::Write, None));
        assert!(held_by(&read, "w1", 7, LockKind::Read, None));
        let mut written = holders(&["w1"]);
        written.set_kind(LockKind::Write);
        assert!(held_by(&written, "w1", 7, LockKind::Write, None));
    }

    /// A lock one holder holds at a time is the lease's only while its latest grant is
    /// the lease's: with auth off, `team/w1` is another owner than `w1`, whose later
    /// grant read as the lease's own after a Ctrl-Z, and the command was resumed beside
    /// it.
    #[test]
    fn a_later_grant_to_an_owner_that_reads_alike_is_anothers() {
        let state = |token: u64, read: bool| LockState {
            kind: if read { LockKind::Read } else { LockKind::Mutex }.into(),
            holders: vec![latchkey_client::Holder {
                owner: "team/w1".to_owned(),
                ..Default::default()
            }],
            last_fencing_token: token,
            ..Default::default()
        };
        for kind in [LockKind::Mutex, LockKind::Fair] {
            assert!(!held_by(&state(9, false), "w1", 7, kind, None), "{kind:?}");
            assert!(held_by(&state(7, false), "w1", 7, kind, None), "{kind:?}");
        }
        // Readers share a lock: the latest grant may be another reader's.
        assert!(held_by(&state(9, true), "w1", 7, LockKind::Read, None));
        // The owner itself holds whatever the latest grant: another of its streams
        // reentered since.
        let mut reentered = state(9, false);
        reentered.holders[0].owner = "w1".to_owned();
        assert!(held_by(&reentered, "w1", 7, LockKind::Mutex, None));
        // Under auth the owner is listed scoped by the caller's identity: as learned while
        // the lease's grant was the latest, it counts after a reentry too, and only so.
        let scoped = state(9, false);
        assert!(held_by(&scoped, "w1", 7, LockKind::Mutex, Some("team/w1")));
        assert!(!held_by(&scoped, "w1", 7, LockKind::Mutex, Some("alice/w1")));
    }

    #[test]
    fn timeout_messages() {
        assert!(timeout_message("a", None).contains("held by someone else"));
        let waited = timeout_message("a", Some(Duration::from_secs(10)));
        assert!(waited.contains("within 10s"), "{waited}");
    }
}
