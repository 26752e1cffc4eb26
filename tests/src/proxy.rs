//! A TCP proxy on loopback that can stop forwarding without closing anything, as a
//! network partition does: the peers keep their sockets and hear nothing. It can also
//! hold every chunk back for a while, as a slow network does, or cut every connection
//! made so far, as a network that drops them does, and lead new connections elsewhere
//! while those made so far stay, as an address that moved does.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Chunks one way that contain a pattern, held back for a while (see
/// [`Proxy::hold_back_matching`] and [`Proxy::hold_back_replies_matching`]).
type HoldBack = Arc<Mutex<Option<Hold>>>;

/// What to hold back, and when the first chunk held went on.
#[derive(Debug)]
struct Hold {
    pattern: Vec<u8>,
    delay: Duration,
    first: Option<Instant>,
}

impl Hold {
    fn new((pattern, delay): (&[u8], Duration)) -> Self {
        Self {
            pattern: pattern.to_vec(),
            delay,
            first: None,
        }
    }
}

/// A running proxy; dropping it stops accepting.
#[derive(Debug)]
pub struct Proxy {
    port: u16,
    frozen: Arc<AtomicBool>,
    delay_us: Arc<AtomicU64>,
    hold_back: HoldBack,
    hold_replies: HoldBack,
    /// Chunks being held back now.
    holding: Arc<AtomicUsize>,
    /// Chunks dropped while frozen, so far.
    dropped: Arc<AtomicUsize>,
    /// Connections accepted so far.
    accepted: Arc<AtomicUsize>,
    /// Where new connections lead (`host:port`).
    upstream: Arc<Mutex<String>>,
    /// The forwarding tasks of the connections made so far (two each).
    pipes: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Forwards a free loopback port to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let frozen = Arc::new(AtomicBool::new(false));
        let delay_us = Arc::new(AtomicU64::new(0));
        let (hold_back, hold_replies): (HoldBack, HoldBack) = Default::default();
        let holding = Arc::new(AtomicUsize::new(0));
        let dropped = Arc::new(AtomicUsize::new(0));
        let upstream = Arc::new(Mutex::new(upstream.to_owned()));
        let accepted = Arc::new(AtomicUsize::new(0));
        let pipes: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (flag, delay, count, tasks) = (frozen.clone(), delay_us.clone(), accepted.clone(), pipes.clone());
        let to = upstream.clone();
        let (up, down, now_held, lost) = (
            hold_back.clone(),
            hold_replies.clone(),
            holding.clone(),
            dropped.clone(),
        );
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let upstream = to.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let mut tasks = tasks.lock().unwrap_or_else(|e| e.into_inner());
                let held = |hold: &HoldBack| (hold.clone(), now_held.clone());
                let frozen = || (flag.clone(), lost.clone());
                tasks.push(tokio::spawn(pipe(cr, sw, frozen(), delay.clone(), held(&up))));
                tasks.push(tokio::spawn(pipe(sr, cw, frozen(), delay.clone(), held(&down))));
            }
        });
        Proxy {
            port,
            frozen,
            delay_us,
            hold_back,
            hold_replies,
            holding,
            dropped,
            accepted,
            upstream,
            pipes,
            accept,
        }
    }

    /// Leads the connections made from now on to `redis`, those made so far staying
    /// where they lead: a name that DNS or a Service moved to a promoted replica.
    pub fn lead_to(&self, redis: &crate::RedisServer) {
        *self.upstream.lock().unwrap_or_else(|e| e.into_inner()) = format!("127.0.0.1:{}", redis.port());
    }

    /// A proxy in front of `redis`.
    pub async fn to_redis(redis: &crate::RedisServer) -> Proxy {
        Self::start(&format!("127.0.0.1:{}", redis.port())).await
    }

    /// `redis://127.0.0.1:PORT`: a Redis URL through the proxy.
    pub fn redis_url(&self) -> String {
        format!("redis://{}", self.addr())
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Stops forwarding in both directions; bytes are read and dropped, sockets stay open
    /// (one end's close reaches the other only after a thaw).
    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    /// Forwards again. Connections that lost bytes while frozen are out of step and
    /// fail; new ones work.
    pub fn thaw(&self) {
        self.frozen.store(false, Ordering::SeqCst);
    }

    /// Closes every connection made so far (both ends see them close); new ones work.
    pub fn cut(&self) {
        for pipe in self.pipes.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            pipe.abort();
        }
    }

    /// How many chunks (in either direction) the proxy has dropped while frozen so far:
    /// what a test sent is known to be lost, not yet to be sent.
    pub fn dropped(&self) -> usize {
        self.dropped.load(Ordering::SeqCst)
    }

    /// How many connections the proxy has accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Holds back, for `delay`, each chunk toward the upstream that contains `pattern`
    /// (and so every later chunk of its connection, which stay in order), as a network
    /// slow on one connection does: a command sent on one connection then reaches the
    /// upstream after commands sent later on others. `None` ends it.
    pub fn hold_back_matching(&self, hold: Option<(&[u8], Duration)>) {
        *self.hold_back.lock().unwrap_or_else(|e| e.into_inner()) = hold.map(Hold::new);
    }

    /// When the proxy forwarded the first chunk toward the server that
    /// [`Proxy::hold_back_matching`] held back since it was last called, after its
    /// delay and however late this process ran it.
    pub fn first_held(&self) -> Option<Instant> {
        self.hold_back.lock().unwrap_or_else(|e| e.into_inner()).as_ref()?.first
    }

    /// Holds back, for `delay`, each chunk toward the client that contains `pattern`
    /// (and every later chunk of its connection): a reply that comes late, after its
    /// command ran. `None` ends it.
    pub fn hold_back_replies_matching(&self, hold: Option<(&[u8], Duration)>) {
        *self.hold_replies.lock().unwrap_or_else(|e| e.into_inner()) = hold.map(Hold::new);
    }

    /// How many chunks are being held back now (by either of the `hold_back_*` calls), each
    /// until it is forwarded. Chunks queued behind a held one on its connection are not
    /// counted: read once it is forwarded, they go at once unless held in turn.
    pub fn holding(&self) -> usize {
        self.holding.load(Ordering::SeqCst)
    }

    /// Holds every chunk back for `delay` before forwarding it (zero: none).
    pub fn set_delay(&self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.delay_us.store(us, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    (frozen, dropped): (Arc<AtomicBool>, Arc<AtomicUsize>),
    delay_us: Arc<AtomicU64>,
    (hold_back, holding): (HoldBack, Arc<AtomicUsize>),
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return hold_while_frozen(to, &frozen).await,
            Ok(n) => n,
        };
        if frozen.load(Ordering::SeqCst) {
            dropped.fetch_add(1, Ordering::SeqCst);
            continue;
        }
        let delay = delay_us.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        let held = {
            let mut h = hold_back.lock().unwrap_or_else(|e| e.into_inner());
            h.as_mut()
                .filter(|hold| buf[..n].windows(hold.pattern.len()).any(|w| w == &hold.pattern[..]))
                .map(|hold| hold.delay)
        };
        // Counted until forwarded, or until the pipe ends (a cut aborts it mid-hold).
        let counted = held.map(|_| Counted::new(&holding));
        if let Some(held) = held {
            tokio::time::sleep(held).await;
        }
        let written = to.write_all(&buf[..n]).await;
        if held.is_some() {
            let mut hold = hold_back.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(hold) = hold.as_mut() {
                hold.first.get_or_insert_with(Instant::now);
            }
        }
        drop(counted);
        if written.is_err() {
            return;
        }
    }
}

/// One chunk in [`Proxy::holding`]'s count while it lives.
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Keeps the other end open while the proxy is frozen: a close, like any byte, does not
/// cross a partition (until a thaw or a cut).
async fn hold_while_frozen(to: tokio::net::tcp::OwnedWriteHalf, frozen: &AtomicBool) {
    while frozen.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(to);
}
