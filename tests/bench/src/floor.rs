//! `grpc-floor`: the gRPC hop alone. A `LockService` whose locks live in its memory, with
//! no Redis behind them: an `Open` of a free name is granted at once, one of a held name
//! is told `Queued` and waits in line, and a release hands the name to the next in line
//! (first come, first served, as latchkey serves a server's own waiters). It is served
//! like latchkey-server (tonic's HTTP/2 transport with Nagle off, coalesced writes, one
//! process of its own; tonic's default keepalive and window settings, which messages
//! this small never reach) and driven through the same Rust client: what no gRPC lock server that serves its
//! waiters in order can beat on this machine. Against it, latchkey's figures show what
//! its own work costs (the Redis calls, sessions, the watchdog), and the floor against
//! the direct protocol shows what the hop costs.

use futures::{Stream, StreamExt};
use latchkey_proto::coalesce::Coalesced;
use latchkey_proto::v1::acquire_request::Action;
use latchkey_proto::v1::acquire_response::Event;
use latchkey_proto::v1::lock_service_server::{LockService, LockServiceServer};
use latchkey_proto::v1::{
    AcquireRequest, AcquireResponse, Acquired, DescribeRequest, ForceReleaseRequest, ForceReleaseResponse, ListRequest,
    ListResponse, LockState, Queued, Released, WatchRequest,
};
use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

/// The line the floor process prints once it listens, followed by its port.
const LISTENING: &str = "grpc-floor listening on 127.0.0.1:";
/// How long the floor process may take to print it.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// A running floor process, killed on drop.
pub struct Floor {
    child: Child,
    port: u16,
}

impl Floor {
    /// Starts this binary as a floor server (`--serve-floor`) with `worker_threads`
    /// runtime threads, and waits for the port it bound.
    pub fn spawn(worker_threads: usize) -> Option<Self> {
        let mut child = Command::new(std::env::current_exe().ok()?)
            .args(["--serve-floor", "--server-worker-threads", &worker_threads.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .ok()?;
        // Its first line, read beside this thread so that the wait has a bound.
        let stdout = child.stdout.take()?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(START_TIMEOUT).unwrap_or_default();
        let Some(port) = line.trim().strip_prefix(LISTENING).and_then(|p| p.parse().ok()) else {
            eprintln!("grpc-floor did not start ({line:?}); skipping it");
            let _ = child.kill();
            let _ = child.wait();
            return None;
        };
        Some(Self { child, port })
    }

    /// The endpoint the Rust client connects to.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The process, for the CPU the runs are charged.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Serves the floor on a free loopback port until killed; prints the port first.
pub async fn serve() -> Result<(), String> {
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    println!("{LISTENING}{port}");
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(LockServiceServer::new(Floors::default()))
        .serve_with_incoming(incoming.map(|io| io.map(Coalesced::new)))
        .await
        .map_err(|e| e.to_string())
}

/// The names held, each with its line of waiters, and the last token given.
#[derive(Debug, Default)]
struct Table {
    held: HashMap<String, VecDeque<oneshot::Sender<u64>>>,
    token: u64,
}

/// The floor's locks, shared by every stream.
#[derive(Debug, Default, Clone)]
struct Floors(Arc<Mutex<Table>>);

impl Floors {
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `name` now (its token), or lines up for it.
    fn take(&self, name: &str) -> Result<u64, Turn> {
        let mut table = self.table();
        if let Some(line) = table.held.get_mut(name) {
            let (tx, rx) = oneshot::channel();
            line.push_back(tx);
            return Err(Turn {
                rx,
                floors: self.clone(),
                name: name.to_owned(),
            });
        }
        table.held.insert(name.to_owned(), VecDeque::new());
        table.token += 1;
        Ok(table.token)
    }

    /// Hands `name` to the next waiter still waiting, or frees it.
    fn give_back(&self, name: &str) {
        let mut table = self.table();
        table.token += 1;
        let token = table.token;
        let Some(line) = table.held.get_mut(name) else {
            return;
        };
        while let Some(next) = line.pop_front() {
            if next.send(token).is_ok() {
                return;
            }
        }
        table.held.remove(name);
    }
}

/// A held name, given back however its stream ends.
struct Hold {
    floors: Floors,
    name: String,
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.floors.give_back(&self.name);
    }
}

/// A place in a name's line. Dropped with a grant in it that nobody took (the stream
/// ended just as its turn came), it hands the name on.
#[derive(Debug)]
struct Turn {
    rx: oneshot::Receiver<u64>,
    floors: Floors,
    name: String,
}

impl Drop for Turn {
    fn drop(&mut self) {
        if self.rx.try_recv().is_ok() {
            self.floors.give_back(&self.name);
        }
    }
}

/// Where one stream stands.
enum Step {
    /// Waiting for `Open`.
    Open(Floors, Streaming<AcquireRequest>),
    /// Told `Queued`, waiting in line.
    Waiting(Streaming<AcquireRequest>, Turn),
    /// Holding until the release.
    Held(Streaming<AcquireRequest>, Hold),
    Done,
}

type Events = Pin<Box<dyn Stream<Item = Result<AcquireResponse, Status>> + Send>>;

impl Step {
    /// The next event and where the stream stands after it; `None` ends the stream.
    async fn next(self) -> Option<(Result<AcquireResponse, Status>, Step)> {
        match self {
            Step::Open(floors, mut requests) => {
                let Ok(Some(AcquireRequest {
                    action: Some(Action::Open(open)),
                })) = requests.message().await
                else {
                    return Some((Err(Status::invalid_argument("open: expected first")), Step::Done));
                };
                match floors.take(&open.name) {
                    Ok(token) => Some(acquired(floors, requests, open.name, token)),
                    Err(turn) => Some((
                        Ok(event(Event::Queued(Queued::default()))),
                        Step::Waiting(requests, turn),
                    )),
                }
            }
            Step::Waiting(requests, mut turn) => match (&mut turn.rx).await {
                Ok(token) => Some(acquired(turn.floors.clone(), requests, turn.name.clone(), token)),
                Err(_) => None,
            },
            Step::Held(mut requests, hold) => match requests.message().await {
                Ok(
                    Some(AcquireRequest {
                        action: Some(Action::Release(_)),
                    })
                    | None,
                ) => {
                    drop(hold);
                    Some((Ok(event(Event::Released(Released {}))), Step::Done))
                }
                _ => None,
            },
            Step::Done => None,
        }
    }
}

fn acquired(
    floors: Floors,
    requests: Streaming<AcquireRequest>,
    name: String,
    token: u64,
) -> (Result<AcquireResponse, Status>, Step) {
    let grant = Acquired {
        fencing_token: token,
        hold_count: 1,
        ..Acquired::default()
    };
    let hold = Hold { floors, name };
    (Ok(event(Event::Acquired(grant))), Step::Held(requests, hold))
}

#[tonic::async_trait]
impl LockService for Floors {
    type AcquireStream = Events;
    type WatchStream = Pin<Box<dyn Stream<Item = Result<LockState, Status>> + Send>>;

    /// `Acquired` (after `Queued` when the name is held), then `Released` on `Release`
    /// or half-close, as latchkey answers.
    async fn acquire(&self, req: Request<Streaming<AcquireRequest>>) -> Result<Response<Events>, Status> {
        let start = Step::Open(self.clone(), req.into_inner());
        let events = futures::stream::unfold(start, Step::next);
        Ok(Response::new(Box::pin(events)))
    }

    async fn describe(&self, _: Request<DescribeRequest>) -> Result<Response<LockState>, Status> {
        grants_only()
    }

    async fn list(&self, _: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        grants_only()
    }

    async fn force_release(&self, _: Request<ForceReleaseRequest>) -> Result<Response<ForceReleaseResponse>, Status> {
        grants_only()
    }

    async fn watch(&self, _: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        grants_only()
    }
}

/// The answer to every call but `Acquire`: the floor measures grants only.
fn grants_only<T>() -> Result<T, Status> {
    Err(Status::unimplemented("grpc-floor grants only"))
}

fn event(event: Event) -> AcquireResponse {
    AcquireResponse { event: Some(event) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The turn of a waiter that is still in line, or a panic.
    fn wait(floors: &Floors, name: &str) -> Turn {
        floors.take(name).expect_err("the name is held")
    }

    #[test]
    fn a_name_goes_to_its_waiters_in_order_then_is_free() {
        let floors = Floors::default();
        let first = floors.take("n").expect("a free name");
        let (mut a, mut b) = (wait(&floors, "n"), wait(&floors, "n"));
        floors.give_back("n");
        let second = a.rx.try_recv().expect("the first waiter's turn");
        assert!(second > first);
        assert!(b.rx.try_recv().is_err(), "the second waiter still waits");
        floors.give_back("n");
        assert!(b.rx.try_recv().expect("the second waiter's turn") > second);
        floors.give_back("n");
        assert!(floors.take("n").is_ok(), "free once the line is empty");
    }

    #[test]
    fn a_turn_left_with_its_grant_in_it_hands_the_name_on() {
        let floors = Floors::default();
        floors.take("n").expect("a free name");
        let (a, mut b) = (wait(&floors, "n"), wait(&floors, "n"));
        floors.give_back("n");
        drop(a);
        assert!(b.rx.try_recv().is_ok(), "the next waiter has the name the first left");
    }

    #[test]
    fn a_waiter_gone_before_its_turn_is_passed_over() {
        let floors = Floors::default();
        floors.take("n").expect("a free name");
        drop(wait(&floors, "n"));
        floors.give_back("n");
        assert!(floors.take("n").is_ok(), "nobody took the name");
    }
}
