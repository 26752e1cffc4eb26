//! Write coalescing for gRPC connections.
//!
//! HTTP/2 multiplexes many lock streams on one connection, and h2 flushes its
//! connection every time it is polled with something to send. tokio runs a woken task
//! at once (the LIFO slot), so a connection task woken by one stream's event flushes
//! that one frame: a server answering 20 000 lock cycles a second made ~4 `writev`
//! calls per cycle, and on loopback each one also runs the receiver's TCP stack.
//!
//! [`Coalesced`] takes the bytes h2 writes into a buffer and holds a flush back until
//! the runtime has run every other task that is ready ([`tokio::task::yield_now`]
//! defers the wake-up until then). Frames from all the streams that had something to
//! say in that round leave in one write. When nothing else is ready the flush goes out
//! at once: a lone stream pays one extra poll, not a timer.

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes buffered before a write goes out without waiting for the flush.
const HIGH_WATER: usize = 64 * 1024;
/// A buffer grown past this by a burst is given back once drained.
const KEEP_CAPACITY: usize = 16 * 1024;

type Deferral = Pin<Box<dyn Future<Output = ()> + Send>>;

/// An IO whose writes are gathered and flushed once the runtime is otherwise idle.
pub struct Coalesced<IO> {
    io: IO,
    pending: Vec<u8>,
    /// How much of `pending` the inner IO has taken.
    written: usize,
    /// A flush waiting for the other ready tasks to run.
    deferral: Option<Deferral>,
}

impl<IO> std::fmt::Debug for Coalesced<IO> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalesced")
            .field("pending", &(self.pending.len() - self.written))
            .finish()
    }
}

impl<IO> Coalesced<IO> {
    /// Wraps `io`.
    pub fn new(io: IO) -> Self {
        Self {
            io,
            pending: Vec::new(),
            written: 0,
            deferral: None,
        }
    }

    /// The wrapped IO.
    pub fn get_ref(&self) -> &IO {
        &self.io
    }
}

impl<IO: AsyncWrite + Unpin> Coalesced<IO> {
    /// Writes out everything buffered.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.pending.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.pending[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.pending.clear();
        self.written = 0;
        if self.pending.capacity() > KEEP_CAPACITY {
            self.pending.shrink_to(KEEP_CAPACITY);
        }
        Poll::Ready(Ok(()))
    }

    /// Makes room before buffering more: past [`HIGH_WATER`] the buffer is written out.
    fn poll_room(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.pending.len() >= HIGH_WATER {
            ready!(self.poll_drain(cx))?;
        }
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Coalesced<IO> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Coalesced<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        ready!(self.poll_room(cx))?;
        self.pending.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        ready!(self.poll_room(cx))?;
        let mut n = 0;
        for buf in bufs {
            self.pending.extend_from_slice(buf);
            n += buf.len();
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.written < this.pending.len() {
            // Wait once for the other ready tasks, whose frames then join this write.
            let deferral = this.deferral.get_or_insert_with(|| Box::pin(tokio::task::yield_now()));
            ready!(deferral.as_mut().poll(cx));
            this.deferral = None;
            ready!(this.poll_drain(cx))?;
        }
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for Coalesced<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}
