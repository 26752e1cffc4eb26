//! Log lines that could come once per call: a misconfigured ACL refuses every script,
//! a client with a stale token (or anyone who reaches the port) is refused on every
//! call, a RedLock node that stays down drops a missed release on each. Such a line is
//! written at most once per [`EVERY`], saying how many like it were left out since;
//! the metrics count every one.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The least time between two lines of one kind.
pub const EVERY: Duration = Duration::from_secs(10);

/// One kind of line that may repeat.
#[derive(Debug)]
pub struct Repeated {
    /// When the next line may be written, in seconds of [`since_start`].
    next: AtomicU64,
    /// How many were left out since.
    left_out: AtomicU64,
}

impl Repeated {
    /// A kind of line not written yet.
    pub const fn new() -> Self {
        Self {
            next: AtomicU64::new(0),
            left_out: AtomicU64::new(0),
        }
    }

    /// `Some(how many were left out since the last line)` when this one is to be
    /// written, None when it is left out.
    pub fn due(&self) -> Option<u64> {
        let now = since_start();
        let next = self.next.load(Relaxed);
        if now >= next
            && self
                .next
                .compare_exchange(next, now + EVERY.as_secs(), Relaxed, Relaxed)
                .is_ok()
        {
            return Some(self.left_out.swap(0, Relaxed));
        }
        self.left_out.fetch_add(1, Relaxed);
        None
    }
}

/// Seconds since the first line of any kind was asked about, on the monotonic clock:
/// a wall clock stepped back would silence the lines for as long as the step.
fn since_start() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs()
}

impl Default for Repeated {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::Repeated;

    #[test]
    fn a_line_is_written_once_then_left_out_and_counted() {
        let line = Repeated::new();
        assert_eq!(line.due(), Some(0));
        assert_eq!(line.due(), None);
        assert_eq!(line.due(), None);
        assert_eq!(line.left_out.load(std::sync::atomic::Ordering::Relaxed), 2);
        // Past the interval, the next one is written with the count.
        line.next.store(0, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(line.due(), Some(2));
    }
}
