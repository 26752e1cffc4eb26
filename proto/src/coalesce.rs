//! Write coalescing for gRPC connections.
//!
//! HTTP/2 multiplexes many lock streams on one connection, and h2 flushes its
//! connection every time it is polled with something to send. tokio runs a woken task
//! at once (the LIFO slot), so a connection task woken by one stream's event flushes
//! that one frame: a server answering 20 000 lock cycles a second made ~4 `writev`
//! calls per cycle, and on loopback each one also runs the receiver's TCP stack.
//!
//! [`Coalesced`] takes the bytes h2 writes into a buffer and holds a flush back until
//! the tasks that are ready have run ([`ReadyTasksFirst`]): frames from all the streams
//! that had something to say in that round leave in one write. When nothing else is
//! ready the flush goes out at once: a lone stream pays one extra poll, not a timer.
//!
//! A client flushes without waiting ([`Coalesced::eager`]): its writes are mostly
//! releases and opens that someone waits for, and a process whose tasks wait on a hot
//! lock would hold each release behind all its other ready tasks. Frames written
//! before the flush still leave in one write.

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes buffered before a write goes out without waiting for the flush.
const HIGH_WATER: usize = 64 * 1024;
/// A buffer grown past this by a burst is given back once drained.
const KEEP_CAPACITY: usize = 16 * 1024;

/// An IO whose writes are gathered and flushed once the runtime is otherwise idle.
pub struct Coalesced<IO> {
    io: IO,
    pending: Vec<u8>,
    /// How much of `pending` the inner IO has taken.
    written: usize,
    /// A flush waiting for the other ready tasks to run.
    deferral: ReadyTasksFirst,
    /// Whether a flush waits for the other ready tasks at all.
    defers: bool,
}

impl<IO> std::fmt::Debug for Coalesced<IO> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalesced")
            .field("pending", &(self.pending.len() - self.written))
            .finish()
    }
}

impl<IO> Coalesced<IO> {
    /// Wraps `io`, each flush waiting for the other ready tasks (a server's connection).
    pub fn new(io: IO) -> Self {
        Self {
            io,
            pending: Vec::new(),
            written: 0,
            deferral: ReadyTasksFirst::default(),
            defers: true,
        }
    }

    /// Wraps `io`, flushing at once (a client's connection).
    pub fn eager(io: IO) -> Self {
        Self {
            defers: false,
            ..Self::new(io)
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
            if this.defers {
                // Wait once for the other ready tasks, whose frames then join this write.
                ready!(Pin::new(&mut this.deferral).poll(cx));
                this.deferral = ReadyTasksFirst::default();
            }
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

/// A future that lets every task that is ready run before it completes: its first
/// poll wakes its own task and returns pending, which puts the task at the back of
/// the runtime's queue (unlike a task woken by another, which tokio runs next). Work
/// the other tasks hand over meanwhile (frames to write, calls to send) then goes out
/// in one batch.
#[derive(Debug, Default)]
pub struct ReadyTasksFirst {
    yielded: bool,
}

impl Future for ReadyTasksFirst {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.yielded {
            return Poll::Ready(());
        }
        self.yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Waker;

    /// A socket that records each write it is given.
    #[derive(Default)]
    struct Recorder(Vec<Vec<u8>>);

    impl AsyncWrite for Recorder {
        fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            self.0.push(buf.to_vec());
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// Writes two frames and flushes once; returns whether the flush was ready at its
    /// first poll, and the writes the socket saw once it was.
    fn two_frames_flushed(mut io: Coalesced<Recorder>) -> (bool, Vec<Vec<u8>>) {
        let mut cx = Context::from_waker(Waker::noop());
        for frame in [&b"ab"[..], &b"cd"[..]] {
            assert!(matches!(
                Pin::new(&mut io).poll_write(&mut cx, frame),
                Poll::Ready(Ok(2))
            ));
        }
        let at_once = Pin::new(&mut io).poll_flush(&mut cx).is_ready();
        if !at_once {
            assert!(io.io.0.is_empty(), "nothing written before the other tasks ran");
            assert!(Pin::new(&mut io).poll_flush(&mut cx).is_ready());
        }
        (at_once, io.io.0)
    }

    /// A server's flush waits once for the other ready tasks; the frames leave in one
    /// write.
    #[test]
    fn a_flush_waits_for_the_ready_tasks_and_writes_once() {
        let (at_once, writes) = two_frames_flushed(Coalesced::new(Recorder::default()));
        assert!(!at_once);
        assert_eq!(writes, [b"abcd".to_vec()]);
    }

    /// A client's flush goes out at its first poll, the frames still in one write.
    #[test]
    fn an_eager_flush_goes_out_at_once_in_one_write() {
        let (at_once, writes) = two_frames_flushed(Coalesced::eager(Recorder::default()));
        assert!(at_once);
        assert_eq!(writes, [b"abcd".to_vec()]);
    }
}
