//! The client's stream handling against a scripted in-process `LockService`
//! (no Redis): acquire, queued, release, drop, lost, paging, Unix sockets. The
//! real server is exercised by the end-to-end tests in `tests/`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use latchkey_client::{Client, Error, LostReason};
use latchkey_proto::v1::{
    acquire_request::Action, acquire_response::Event, lock_service_server::LockService,
    lock_service_server::LockServiceServer, lost::Reason, AcquireRequest, AcquireResponse, Acquired, DescribeRequest,
    ForceReleaseRequest, ForceReleaseResponse, ListRequest, ListResponse, LockState, Lost, Queued, Released,
    WatchRequest,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream, UnixListenerStream};
use tonic::{Request, Response, Status, Streaming};

type Events = mpsc::Sender<Result<AcquireResponse, Status>>;

/// Behaves by lock name: `busy` times out, `queued` queues first, `lose` is
/// force-released right after the grant, `vanish` ends the stream right after
/// it, `unasked` is confirmed released right after it though nobody asked,
/// `lose-on-cue` is force-released on the test's cue (and described 3 s late), `newer`
/// is sent an event this client does not know (as from a newer server) before its
/// grant; every other name is granted and held until released.
#[derive(Debug, Default, Clone)]
struct Fake {
    releases: Arc<AtomicUsize>,
    /// The cue on which `lose-on-cue` is force-released.
    lose: Arc<tokio::sync::Notify>,
}

fn event(event: Event) -> Result<AcquireResponse, Status> {
    Ok(AcquireResponse { event: Some(event) })
}

impl Fake {
    async fn hold(self, mut inbound: Streaming<AcquireRequest>, events: Events) {
        // A Release message or a half-close both release; a cancel (error)
        // releases with no answer.
        loop {
            match inbound.message().await {
                Ok(Some(AcquireRequest {
                    action: Some(Action::Release(_)),
                })) => break,
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(_) => {
                    self.releases.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            }
        }
        self.releases.fetch_add(1, Ordering::SeqCst);
        let _ = events.send(event(Event::Released(Released {}))).await;
    }
}

#[tonic::async_trait]
impl LockService for Fake {
    type AcquireStream = ReceiverStream<Result<AcquireResponse, Status>>;
    type WatchStream = ReceiverStream<Result<LockState, Status>>;

    async fn acquire(
        &self,
        request: Request<Streaming<AcquireRequest>>,
    ) -> Result<Response<Self::AcquireStream>, Status> {
        let mut inbound = request.into_inner();
        let Some(Action::Open(open)) = inbound.message().await?.and_then(|m| m.action) else {
            return Err(Status::invalid_argument("open: must come first"));
        };
        if open.name == "busy" {
            return Err(Status::deadline_exceeded("lock \"busy\" not acquired"));
        }
        let (tx, rx) = mpsc::channel(8);
        if open.name == "newer" {
            let _ = tx.send(Ok(AcquireResponse { event: None })).await;
        }
        if open.name == "queued" {
            let queued = Queued {
                position: 2,
                holder_ttl: None,
            };
            let _ = tx.send(event(Event::Queued(queued))).await;
        }
        let acquired = Acquired {
            fencing_token: 7,
            hold_count: 1,
            owner: if open.owner.is_empty() {
                "generated".into()
            } else {
                open.owner
            },
            lease: Some(prost_types::Duration { seconds: 30, nanos: 0 }),
            fencing_tokens: vec![],
            waited: None,
        };
        let _ = tx.send(event(Event::Acquired(acquired))).await;
        if open.name == "vanish" {
            // Dropping the sender ends the response stream with OK.
            drop(tx);
            drop(inbound);
        } else if open.name == "lose-on-cue" {
            let cue = self.lose.clone();
            tokio::spawn(async move {
                let _inbound = inbound;
                cue.notified().await;
                let lost = Lost {
                    reason: Reason::ForceReleased as i32,
                };
                let _ = tx.send(event(Event::Lost(lost))).await;
                let _ = tx.send(Err(Status::aborted("force-released"))).await;
            });
        } else if open.name == "unasked" {
            // A release nobody asked for, the stream left open.
            let _ = tx.send(event(Event::Released(Released {}))).await;
            tokio::spawn(async move {
                let _keep = (inbound, tx);
                tokio::time::sleep(Duration::from_secs(30)).await;
            });
        } else if open.name == "lose" {
            let lost = Lost {
                reason: Reason::ForceReleased as i32,
            };
            let _ = tx.send(event(Event::Lost(lost))).await;
            let _ = tx.send(Err(Status::aborted("force-released"))).await;
        } else {
            tokio::spawn(self.clone().hold(inbound, tx));
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn describe(&self, request: Request<DescribeRequest>) -> Result<Response<LockState>, Status> {
        let name = request.into_inner().name;
        if name == "lose-on-cue" {
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        Ok(Response::new(LockState {
            name,
            last_fencing_token: 7,
            ..LockState::default()
        }))
    }

    async fn list(&self, request: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        let page = request.into_inner().page_token;
        let (name, next) = if page.is_empty() { ("a", "p2") } else { ("b", "") };
        let locks = vec![LockState {
            name: name.into(),
            ..LockState::default()
        }];
        Ok(Response::new(ListResponse {
            locks,
            next_page_token: next.into(),
        }))
    }

    async fn force_release(
        &self,
        request: Request<ForceReleaseRequest>,
    ) -> Result<Response<ForceReleaseResponse>, Status> {
        let released = request.into_inner().name == "held";
        Ok(Response::new(ForceReleaseResponse { released }))
    }

    async fn watch(&self, _: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("watch"))
    }
}

async fn start_tcp(fake: Fake) -> Client {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let incoming = TcpListenerStream::new(listener);
    let router = tonic::transport::Server::builder().add_service(LockServiceServer::new(fake));
    tokio::spawn(router.serve_with_incoming(incoming));
    Client::connect(&format!("http://{addr}")).await.expect("connect")
}

async fn eventually(what: &str, check: impl Fn() -> bool) {
    for _ in 0..100 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn acquire_then_release() {
    let fake = Fake::default();
    let client = start_tcp(fake.clone()).await;
    let lease = client.lock("a").owner("me").acquire().await.expect("acquired");
    assert_eq!((lease.name(), lease.owner(), lease.fencing_token()), ("a", "me", 7));
    assert_eq!(lease.hold_count(), 1);
    assert_eq!(lease.lease(), Some(Duration::from_secs(30)));
    assert!(!lease.is_lost());
    lease.release().await.expect("released");
    assert_eq!(fake.releases.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn drop_half_closes_and_releases() {
    let fake = Fake::default();
    let client = start_tcp(fake.clone()).await;
    let lease = client.lock("a").acquire().await.expect("acquired");
    assert_eq!(lease.owner(), "generated");
    drop(lease);
    eventually("release on drop", || fake.releases.load(Ordering::SeqCst) == 1).await;
}

#[tokio::test]
async fn queued_is_reported_then_acquired() {
    let client = start_tcp(Fake::default()).await;
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    let lease = client
        .lock("queued")
        .on_queued(move |q| counter.store(q.position as usize, Ordering::SeqCst))
        .acquire()
        .await
        .expect("acquired");
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    lease.release().await.expect("released");
}

/// A newer server may send events this client does not know while it waits (prost
/// reads an unknown event as none): they are skipped, as they are once the lock is
/// held, not taken for a broken stream.
#[tokio::test]
async fn an_unknown_event_before_the_grant_is_skipped() {
    let client = start_tcp(Fake::default()).await;
    let lease = client.lock("newer").acquire().await.expect("acquired");
    lease.release().await.expect("released");
}

#[tokio::test]
async fn timeout_keeps_its_code() {
    let client = start_tcp(Fake::default()).await;
    let err = client.lock("busy").try_once().acquire().await.expect_err("busy");
    assert!(err.is_timeout(), "{err}");
}

#[tokio::test]
async fn lost_resolves_with_the_reason() {
    let client = start_tcp(Fake::default()).await;
    let lease = client.lock("lose").acquire().await.expect("acquired");
    let reason = tokio::time::timeout(Duration::from_secs(5), lease.lost())
        .await
        .expect("lost");
    assert_eq!(reason, LostReason::ForceReleased);
    assert!(lease.is_lost());
    let err = lease.release().await.expect_err("already lost");
    assert!(matches!(err, Error::Lost(LostReason::ForceReleased)));
}

#[tokio::test]
async fn admin_calls() {
    let client = start_tcp(Fake::default()).await;
    assert_eq!(client.describe("x").await.expect("describe").last_fencing_token, 7);
    let names: Vec<String> = client
        .list_all("")
        .await
        .expect("list")
        .into_iter()
        .map(|l| l.name)
        .collect();
    assert_eq!(names, ["a", "b"]);
    assert!(client.force_release("held").await.expect("force"));
    assert!(!client.force_release("free").await.expect("force"));
    let err = client.watch("x").await.expect_err("unimplemented");
    assert_eq!(err.code(), tonic::Code::Unimplemented);
}

#[tokio::test]
async fn connects_over_a_unix_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("latchkey.sock");
    let listener = tokio::net::UnixListener::bind(&path).expect("bind");
    let router = tonic::transport::Server::builder().add_service(LockServiceServer::new(Fake::default()));
    tokio::spawn(router.serve_with_incoming(UnixListenerStream::new(listener)));
    let client = Client::connect(&format!("unix://{}", path.display()))
        .await
        .expect("connect");
    let lease = client.lock("a").acquire().await.expect("acquired");
    lease.release().await.expect("released");
}

/// A release the server confirms unasked ends the lease for every reader alike: `lost`
/// resolved while `is_lost` said held and a later `release` said Ok.
#[tokio::test]
async fn a_release_confirmed_unasked_reads_as_lost_everywhere() {
    let client = start_tcp(Fake::default()).await;
    let lease = client.lock("unasked").acquire().await.expect("acquired");
    let reason = tokio::time::timeout(Duration::from_secs(5), lease.lost())
        .await
        .expect("lost");
    assert_eq!(reason, LostReason::Disconnected);
    assert!(lease.is_lost());
    assert_eq!(lease.lost_reason(), Some(LostReason::Disconnected));
    let err = lease.release().await.expect_err("no longer held");
    assert!(matches!(err, Error::Lost(LostReason::Disconnected)), "{err}");
}

#[tokio::test]
async fn stream_ending_without_reason_is_disconnected() {
    let client = start_tcp(Fake::default()).await;
    let lease = client.lock("vanish").acquire().await.expect("acquired");
    let reason = tokio::time::timeout(Duration::from_secs(5), lease.lost())
        .await
        .expect("lost");
    assert_eq!(reason, LostReason::Disconnected);
}

async fn cli(client_addr: &str, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .arg("--server")
        .arg(client_addr)
        .args(args)
        .output()
        .await
        .expect("latchkey runs")
}

async fn start_tcp_addr(fake: Fake) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let router = tonic::transport::Server::builder().add_service(LockServiceServer::new(fake));
    tokio::spawn(router.serve_with_incoming(TcpListenerStream::new(listener)));
    format!("http://{addr}")
}

#[tokio::test]
async fn cli_run_passes_the_token_and_the_exit_code() {
    let fake = Fake::default();
    let addr = start_tcp_addr(fake.clone()).await;
    let script = "echo $LATCHKEY_LOCK_NAME $LATCHKEY_FENCING_TOKEN $LATCHKEY_OWNER; exit 5";
    let out = cli(&addr, &["run", "job", "--owner", "me", "--", "sh", "-c", script]).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "job 7 me");
    assert_eq!(out.status.code(), Some(5));
    assert_eq!(fake.releases.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn cli_run_exit_codes() {
    let addr = start_tcp_addr(Fake::default()).await;
    let busy = cli(&addr, &["run", "busy", "--wait", "0s", "--", "true"]).await;
    assert_eq!(busy.status.code(), Some(3), "{busy:?}");
    let lost = cli(&addr, &["run", "lose", "--grace", "1s", "--", "sleep", "30"]).await;
    assert_eq!(lost.status.code(), Some(75), "{lost:?}");
    let missing = cli(&addr, &["run", "a", "--", "/nonexistent/cmd"]).await;
    assert_eq!(missing.status.code(), Some(127), "{missing:?}");
    let down = cli("http://127.0.0.1:1", &["describe", "a"]).await;
    assert_eq!(down.status.code(), Some(69), "{down:?}");
}

/// Ctrl-Z as the command starts, while the listing asked then (a Describe, 3 s slow
/// here) is unanswered, then the lease lost: latchkey waited for the listing, the loss
/// unread, then stopped the command's group and itself with the lease lost, until
/// someone resumed it. It now stops the command for the loss at once.
#[tokio::test]
async fn cli_run_a_loss_while_ctrl_z_waits_for_the_listing_stops_the_command() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    use tokio::io::AsyncBufReadExt;
    let fake = Fake::default();
    let addr = start_tcp_addr(fake.clone()).await;
    let mut latchkey = tokio::process::Command::new(env!("CARGO_BIN_EXE_latchkey"))
        .arg("--server")
        .arg(&addr)
        .args([
            "run",
            "lose-on-cue",
            "--grace",
            "1s",
            "--",
            "sh",
            "-c",
            "echo started; exec sleep 30",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn latchkey");
    let pid = Pid::from_raw(latchkey.id().expect("latchkey runs") as i32);
    let mut lines = tokio::io::BufReader::new(latchkey.stdout.take().expect("stdout")).lines();
    let first = tokio::time::timeout(Duration::from_secs(10), lines.next_line()).await;
    assert_eq!(
        first.expect("started in time").expect("stdout").as_deref(),
        Some("started")
    );
    kill(pid, Signal::SIGTSTP).expect("SIGTSTP");
    // Positioning only: latchkey takes the signal and waits for the listing.
    tokio::time::sleep(Duration::from_millis(200)).await;
    fake.lose.notify_one();
    // Within a second of the loss: the listing's own bound (2 s from the command's start)
    // would end the wait only later.
    let ended = tokio::time::timeout(Duration::from_millis(1_000), latchkey.wait()).await;
    if ended.is_err() {
        let _ = kill(pid, Signal::SIGCONT);
    }
    let status = ended.expect("latchkey ends on the loss, not stopped").expect("status");
    assert_eq!(status.code(), Some(75), "{status:?}");
}

#[tokio::test]
async fn cli_admin_commands() {
    let addr = start_tcp_addr(Fake::default()).await;
    let listed = cli(&addr, &["list"]).await;
    let stdout = String::from_utf8_lossy(&listed.stdout).to_string();
    assert!(
        listed.status.success() && stdout.contains("\na ") && stdout.contains("\nb "),
        "{stdout}"
    );
    let described = cli(&addr, &["describe", "x"]).await;
    assert!(String::from_utf8_lossy(&described.stdout).contains("fencing token: 7"));
    let forced = cli(&addr, &["force-release", "held"]).await;
    assert!(String::from_utf8_lossy(&forced.stdout).contains("released lock \"held\""));
    let watched = cli(&addr, &["watch", "x"]).await;
    assert_eq!(watched.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&watched.stderr).contains("(Unimplemented)"));
}

/// One HTTP/2 frame: length, type, flags, stream id, payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut bytes = u32::try_from(payload.len()).expect("a short payload").to_be_bytes()[1..].to_vec();
    bytes.extend([kind, flags]);
    bytes.extend(stream.to_be_bytes());
    bytes.extend(payload);
    bytes
}

/// A peer that speaks just enough HTTP/2 to refuse the first call with GOAWAY
/// (`NO_ERROR`, last stream 0), as the server's HTTP/2 layer does when its keepalive
/// gives up on a client that stopped answering (a `latchkey run` stopped by Ctrl-Z):
/// that call was never seen by the server. Returns the address.
async fn refusing_with_goaway() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const SETTINGS: u8 = 0x4;
    const HEADERS: u8 = 0x1;
    const GOAWAY: u8 = 0x7;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut preface = [0; 24];
        socket.read_exact(&mut preface).await.expect("the client's preface");
        socket.write_all(&frame(SETTINGS, 0, 0, &[])).await.expect("settings");
        loop {
            let mut header = [0; 9];
            socket.read_exact(&mut header).await.expect("a frame");
            let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
            let mut payload = vec![0; length];
            socket.read_exact(&mut payload).await.expect("its payload");
            match header[3] {
                SETTINGS if header[4] & 0x1 == 0 => socket.write_all(&frame(SETTINGS, 0x1, 0, &[])).await.expect("ack"),
                HEADERS => break,
                _ => {}
            }
        }
        // Last stream 0, NO_ERROR: the call's stream is refused unseen.
        socket.write_all(&frame(GOAWAY, 0, 0, &[0; 8])).await.expect("goaway");
        // Closed once the client has gone.
        let _ = socket.read_to_end(&mut Vec::new()).await;
    });
    format!("http://{addr}")
}

/// A call refused by a server's GOAWAY was never seen by it: the connection was
/// closing. tonic reports it `INTERNAL` (an HTTP/2 `NO_ERROR` from the peer); it is
/// `UNAVAILABLE`, so asking again works. (`latchkey run`, resumed by `fg` after the
/// server's keepalive closed its connection, took the `INTERNAL` of its first Describe
/// for an answer it may not have, and resumed the command without the lock.)
#[tokio::test]
async fn a_call_refused_by_a_closing_connection_is_unavailable() {
    let client = Client::connect(&refusing_with_goaway().await).await.expect("connect");
    let err = tokio::time::timeout(Duration::from_secs(10), client.describe("a"))
        .await
        .expect("answered in time")
        .expect_err("refused");
    assert!(err.is_unavailable(), "{err:?}");
    assert!(
        err.to_string().starts_with("the connection to the server broke"),
        "{err}"
    );
}
