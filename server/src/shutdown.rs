//! Shutdown: the signals' future, and the end of the streams that would not hear
//! of it otherwise.

use futures::future::BoxFuture;
use futures::FutureExt;
use http_body::Frame;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::signal::unix::{signal as listen, Signal, SignalKind};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::body::Body;
use tonic::codegen::{http, Bytes, Service};
use tonic::server::NamedService;
use tonic::Status;

/// Listens for SIGTERM, SIGINT and SIGHUP from the call on, and resolves on the first.
/// The handlers are in place at once, not when the future is first polled: as a
/// container's PID 1 (the image has no init) the server is sent no signal it has no
/// handler for, and a SIGTERM while it starts (Redis slow to answer) was dropped, the
/// server serving on until the grace period's SIGKILL. SIGHUP (a closed terminal, an
/// ended ssh session) stops it as the others do: by default it ended the server without
/// a release, every lock held until its lease ran out (the files reload on their own).
/// A SIGHUP ignored at start (`nohup`) stays ignored. Later signals are caught and
/// dropped: a wrapper's SIGTERM after the terminal's SIGINT does not cut the drain short.
pub fn signal() -> impl Future<Output = ()> {
    let signals = Signals::listen();
    async move {
        match signals {
            Ok(mut signals) => {
                // Awaited outside the macro, which evaluates its arguments only when
                // its level is on: at RUST_LOG=warn the server stopped as it started.
                let name = signals.next().await;
                tracing::info!("{name} received");
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM, SIGINT and SIGHUP; stopping on SIGINT only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}

/// The signals that stop the server.
struct Signals {
    term: Signal,
    int: Signal,
    /// None when SIGHUP was ignored at start.
    hup: Option<Signal>,
}

impl Signals {
    fn listen() -> std::io::Result<Self> {
        let hup = match ignored_at_start(SignalKind::hangup()) {
            true => None,
            false => Some(listen(SignalKind::hangup())?),
        };
        Ok(Self {
            term: listen(SignalKind::terminate())?,
            int: listen(SignalKind::interrupt())?,
            hup,
        })
    }

    /// The name of the next signal that comes.
    async fn next(&mut self) -> &'static str {
        let hup = async {
            match &mut self.hup {
                Some(hup) => hup.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
            _ = hup => "SIGHUP",
        }
    }
}

/// Whether `signal` is ignored, as `nohup` leaves SIGHUP: listening would replace the
/// ignoring. Read from the kernel's mask of ignored signals in `/proc/self/status`
/// (the server forbids the unsafe code a `sigaction` query takes); not ignored where
/// it cannot be read.
fn ignored_at_start(signal: SignalKind) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let mask = status.lines().find_map(|l| l.strip_prefix("SigIgn:")).map(str::trim);
    let mask = mask.and_then(|m| u64::from_str_radix(m, 16).ok()).unwrap_or(0);
    let bit = u32::try_from(signal.as_raw_value() - 1).ok();
    bit.is_some_and(|bit| bit < 64 && mask & (1 << bit) != 0)
}

/// A service whose streams end once shutdown begins: the request's as if its client
/// had half-closed, the response's `UNAVAILABLE` (`SHUTTING_DOWN`). Reflection's stream
/// answers until its client half-closes, which a tool such as grpcui or Evans does
/// only at the end of its session: graceful shutdown waited for it up to the close
/// timeout. (The lock service's streams hear of the shutdown themselves, and health's
/// end with its statuses.)
#[derive(Debug, Clone)]
pub struct EndsAtShutdown<S> {
    inner: S,
    stop: CancellationToken,
}

impl<S> EndsAtShutdown<S> {
    /// `inner`, its streams ended when `stop` is cancelled.
    pub fn new(inner: S, stop: CancellationToken) -> Self {
        Self { inner, stop }
    }
}

impl<S: NamedService> NamedService for EndsAtShutdown<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for EndsAtShutdown<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let stop = self.stop.clone();
        let response = self.inner.call(req.map(|body| UntilShutdown::wrap(body, &stop, None)));
        let status = || Status::from(crate::error::Error::ShuttingDown);
        let until = move |body| UntilShutdown::wrap(body, &stop, Some(status()));
        response.map(|r| r.map(|r| r.map(until))).boxed()
    }
}

/// A body that ends once shutdown begins, between two of its frames: with `status` in
/// its trailers, a response (whose messages go whole, one or more to a frame); a
/// request without, as its client's half-close (a message longer than a frame may be
/// cut: its stream then ends as it would anyway, with the response's status).
struct UntilShutdown {
    body: Body,
    stop: Pin<Box<WaitForCancellationFutureOwned>>,
    status: Option<Status>,
    ended: bool,
}

impl UntilShutdown {
    fn wrap(body: Body, stop: &CancellationToken, status: Option<Status>) -> Body {
        Body::new(Self {
            body,
            stop: Box::pin(stop.clone().cancelled_owned()),
            status,
            ended: false,
        })
    }
}

impl http_body::Body for UntilShutdown {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if self.stop.as_mut().poll(cx).is_pending() {
            return Pin::new(&mut self.body).poll_frame(cx);
        }
        self.ended = true;
        let Some(status) = self.status.take() else {
            return Poll::Ready(None);
        };
        let mut trailers = http::HeaderMap::new();
        Poll::Ready(Some(match status.add_header(&mut trailers) {
            Ok(()) => Ok(Frame::trailers(trailers)),
            Err(e) => Err(e),
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }
}
