//! `grpc-floor`: the gRPC hop alone. A `LockService` that grants every `Open` at once
//! and answers every release, with no Redis and no lock behind it, served like
//! latchkey-server serves (its HTTP/2 settings, coalesced writes, one process of its
//! own) and driven through the same Rust client. What no gRPC lock server can beat on
//! this machine: the uncontended figures of latchkey against it are what latchkey's
//! own work costs (the Redis calls, sessions, the watchdog), and the floor against the
//! direct protocol is what the hop costs.

use futures::{Stream, StreamExt};
use latchkey_proto::coalesce::Coalesced;
use latchkey_proto::v1::acquire_request::Action;
use latchkey_proto::v1::acquire_response::Event;
use latchkey_proto::v1::lock_service_server::{LockService, LockServiceServer};
use latchkey_proto::v1::{
    AcquireRequest, AcquireResponse, Acquired, DescribeRequest, ForceReleaseRequest, ForceReleaseResponse, ListRequest,
    ListResponse, LockState, Released, WatchRequest,
};
use std::io::{BufRead, BufReader};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

/// The line the floor process prints once it listens, followed by its port.
const LISTENING: &str = "grpc-floor listening on 127.0.0.1:";

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
        // The first line, or end of file if the child exits: this read ends either way.
        let mut line = String::new();
        let stdout = child.stdout.take()?;
        BufReader::new(stdout).read_line(&mut line).ok()?;
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
        .add_service(LockServiceServer::new(Grants::default()))
        .serve_with_incoming(incoming.map(|io| io.map(Coalesced::new)))
        .await
        .map_err(|e| e.to_string())
}

/// Grants without a lock: each `Open` gets the next token.
#[derive(Debug, Default)]
struct Grants {
    tokens: AtomicU64,
}

type Events = Pin<Box<dyn Stream<Item = Result<AcquireResponse, Status>> + Send>>;

/// Where one stream stands: waiting for `Open`, holding, or done.
enum Step {
    Open(Streaming<AcquireRequest>, u64),
    Held(Streaming<AcquireRequest>),
    Done,
}

#[tonic::async_trait]
impl LockService for Grants {
    type AcquireStream = Events;
    type WatchStream = Pin<Box<dyn Stream<Item = Result<LockState, Status>> + Send>>;

    /// `Acquired` on `Open`, then `Released` on `Release` or half-close, as latchkey
    /// answers an uncontended lock.
    async fn acquire(&self, req: Request<Streaming<AcquireRequest>>) -> Result<Response<Events>, Status> {
        let token = self.tokens.fetch_add(1, Ordering::Relaxed) + 1;
        let events = futures::stream::unfold(Step::Open(req.into_inner(), token), |step| async move {
            match step {
                Step::Open(mut requests, token) => match requests.message().await {
                    Ok(Some(AcquireRequest {
                        action: Some(Action::Open(open)),
                    })) => {
                        let acquired = Acquired {
                            fencing_token: token,
                            hold_count: 1,
                            owner: open.owner,
                            ..Acquired::default()
                        };
                        Some((Ok(event(Event::Acquired(acquired))), Step::Held(requests)))
                    }
                    _ => Some((Err(Status::invalid_argument("open: expected first")), Step::Done)),
                },
                Step::Held(mut requests) => match requests.message().await {
                    Ok(
                        Some(AcquireRequest {
                            action: Some(Action::Release(_)),
                        })
                        | None,
                    ) => Some((Ok(event(Event::Released(Released {}))), Step::Done)),
                    _ => None,
                },
                Step::Done => None,
            }
        });
        Ok(Response::new(Box::pin(events)))
    }

    async fn describe(&self, _: Request<DescribeRequest>) -> Result<Response<LockState>, Status> {
        Err(Status::unimplemented("grpc-floor grants only"))
    }

    async fn list(&self, _: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        Err(Status::unimplemented("grpc-floor grants only"))
    }

    async fn force_release(&self, _: Request<ForceReleaseRequest>) -> Result<Response<ForceReleaseResponse>, Status> {
        Err(Status::unimplemented("grpc-floor grants only"))
    }

    async fn watch(&self, _: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("grpc-floor grants only"))
    }
}

fn event(event: Event) -> AcquireResponse {
    AcquireResponse { event: Some(event) }
}
