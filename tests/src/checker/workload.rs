//! The clients: tasks that loop acquire → critical section → release on a few hot
//! locks, recording every attempt. The critical section runs to its end even if the
//! lease is lost meanwhile (as a paused process would), so the resource's fence, not
//! the client's good manners, is what keeps the register right.

use super::history::{now_us, Attempt, End, Failure, History, Hold, Target};
use super::resource::Resource;
use super::verify::kind_name;
use latchkey_client::{Client, Error, Lease, LockKind};
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How the clients behave.
#[derive(Debug, Clone)]
pub struct Workload {
    /// The locks contended for; each client picks one at random per round.
    pub targets: Vec<Target>,
    /// Client tasks per endpoint.
    pub clients_per_endpoint: usize,
    /// The longest critical section (each one lasts a random part of it).
    pub hold: Duration,
    /// The longest critical section of the long-holding clients, which outlast a
    /// lease so that faults find holders the watchdog is renewing.
    pub long_hold: Duration,
    /// Long-holding client tasks per endpoint, on top of `clients_per_endpoint`.
    pub long_clients_per_endpoint: usize,
    /// `wait_timeout` of every acquire.
    pub wait: Duration,
    /// HTTP/2 keepalive of the clients, so a dead connection is noticed in seconds.
    pub keepalive: Duration,
}

/// Pause after a failed acquire before the next one.
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Slack over `wait` before a client gives up on an acquire that never answers.
const ANSWER_SLACK: Duration = Duration::from_secs(10);

/// Starts the clients: `clients_per_endpoint` tasks and `long_clients_per_endpoint`
/// long-holding ones on each endpoint, numbered from
/// `first_id`. They stop starting new rounds once `stop` is cancelled.
pub fn start(
    endpoints: &[String],
    workload: &Workload,
    resource: &Resource,
    history: &History,
    stop: &CancellationToken,
    first_id: u32,
) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    let mut id = first_id;
    for endpoint in endpoints {
        let clients = workload.clients_per_endpoint + workload.long_clients_per_endpoint;
        for i in 0..clients {
            let client = connect(endpoint, workload.keepalive);
            let mut workload = workload.clone();
            if i >= workload.clients_per_endpoint {
                workload.hold = workload.long_hold;
            }
            let run = Runner {
                id,
                client,
                workload,
                resource: resource.clone(),
                history: history.clone(),
                announce: false,
            };
            tasks.spawn(run.rounds(stop.clone()));
            id += 1;
        }
    }
    tasks
}

/// A lazily connected client whose keepalive notices a dead link within `keepalive`
/// twice over; it reconnects on its own when the server comes back.
pub fn connect(endpoint: &str, keepalive: Duration) -> Client {
    let channel = latchkey_client::endpoint(endpoint)
        .expect("a valid endpoint")
        .http2_keep_alive_interval(keepalive)
        .keep_alive_timeout(keepalive)
        .connect_lazy();
    Client::from_channel(channel)
}

/// One client task.
#[derive(Debug)]
pub struct Runner {
    /// The client's number in the history.
    pub id: u32,
    /// Its connection.
    pub client: Client,
    /// What it does.
    pub workload: Workload,
    /// The registers.
    pub resource: Resource,
    /// Where it records.
    pub history: History,
    /// Prints `holding TOKEN` on stdout once granted, for a parent process that
    /// stops or kills this one while it holds.
    pub announce: bool,
}

impl Runner {
    async fn rounds(self, stop: CancellationToken) {
        while !stop.is_cancelled() {
            let target = &self.workload.targets[fastrand::usize(..self.workload.targets.len())];
            let hold = self.workload.hold.mul_f64(fastrand::f64());
            let attempt = self.round(target, hold).await;
            let failed = attempt.outcome.is_err();
            self.history.push(attempt);
            if failed {
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
    }

    /// One acquire, critical section and release of `target`.
    pub async fn round(&self, target: &Target, hold: Duration) -> Attempt {
        let requested_at = now_us();
        let mut builder = self
            .client
            .lock(target.name.clone())
            .kind(target.kind)
            .wait(self.workload.wait);
        if target.kind == LockKind::Semaphore {
            builder = builder.limit(target.limit);
        }
        let acquired = tokio::time::timeout(self.workload.wait + ANSWER_SLACK, builder.acquire()).await;
        let resolved_at = now_us();
        let outcome = match acquired {
            Ok(Ok(lease)) => Ok(self.hold(target, lease, hold).await),
            Ok(Err(e)) => {
                // The history keeps the code; the words go to the test's output, shown
                // when it fails, to be read beside the fault windows' times.
                if e.code() != tonic::Code::DeadlineExceeded {
                    eprintln!(
                        "at {resolved_at}µs client {}'s {} acquire of {} failed: {e}",
                        self.id,
                        kind_name(target.kind),
                        target.name
                    );
                }
                Err(Failure::Status(e.code()))
            }
            Err(_) => Err(Failure::Unanswered),
        };
        Attempt {
            target: target.clone(),
            client: self.id,
            requested_at,
            resolved_at,
            outcome,
        }
    }

    async fn hold(&self, target: &Target, lease: Lease, hold: Duration) -> Hold {
        let acquired_at = now_us();
        let token = lease.fencing_token();
        if self.announce {
            println!("holding {token}");
        }
        // When the holder hears it lost the lock: the verifier allows another holder
        // beside it only once it was told (or, under a fault, told soon enough).
        let work = critical_section(&self.resource, target, token, hold);
        tokio::pin!(work);
        let mut lost_at = None;
        let section = tokio::select! {
            section = &mut work => section,
            _ = lease.lost() => {
                lost_at = Some(now_us());
                work.await
            }
        };
        let end = now_us();
        let ended = match lease.lost_reason() {
            Some(reason) => {
                lost_at.get_or_insert(end);
                End::Lost(reason.to_string())
            }
            None => match lease.release().await {
                Ok(()) => End::Released,
                Err(Error::Lost(reason)) => {
                    lost_at = Some(now_us());
                    End::Lost(reason.to_string())
                }
                Err(e) => End::Unconfirmed(e.to_string()),
            },
        };
        Hold {
            token,
            acquired_at,
            end,
            ended,
            lost_at,
            wrote: section.wrote,
            refused: section.refused,
            disturbed: section.disturbed,
        }
    }
}

/// What one critical section did to the resource.
#[derive(Debug, Clone, Copy, Default)]
pub struct Section {
    /// The fenced write was accepted.
    pub wrote: bool,
    /// The token was refused as stale.
    pub refused: bool,
    /// The resource saw another holder where none may be.
    pub disturbed: bool,
}

/// The work done under the lock. Writers (mutex, fair, write) read the register,
/// pause, and write it plus one; readers check it does not move; semaphore holders
/// count themselves in and out. A Redis error of the resource counts as nothing done.
pub async fn critical_section(resource: &Resource, target: &Target, token: u64, hold: Duration) -> Section {
    let name = target.name.as_str();
    let mut s = Section::default();
    match target.kind {
        LockKind::Read => {
            let before = resource.peek(name, token).await.ok().flatten();
            tokio::time::sleep(hold).await;
            let after = resource.peek(name, token).await.ok().flatten();
            s.refused = before.is_none() || after.is_none();
            s.disturbed = before.is_some() && after.is_some() && before != after;
        }
        LockKind::Semaphore => {
            let inside = resource.enter(name).await.unwrap_or(0);
            s.disturbed = inside > i64::from(target.limit);
            tokio::time::sleep(hold).await;
            let _ = resource.leave(name).await;
        }
        _ => {
            let plain = resource.plain_read(name).await.unwrap_or(0);
            let Ok(Some(count)) = resource.read(name, token).await else {
                s.refused = true;
                return s;
            };
            tokio::time::sleep(hold).await;
            // The unfenced twin is written whatever happened, as an unfenced resource
            // would be.
            let _ = resource.plain_write(name, plain + 1).await;
            match resource.write(name, token, count + 1).await {
                Ok(true) => s.wrote = true,
                Ok(false) => s.refused = true,
                Err(_) => {}
            }
        }
    }
    s
}
