//! What the checker records: one [`Attempt`] per acquire, with the hold it led to.
//! Times are wall-clock microseconds, so holds recorded by client processes (see
//! [`Attempt::to_line`]) share one time line with those of the checker itself.

use latchkey_client::LockKind;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch.
pub type Micros = u64;

/// Now, in [`Micros`].
pub fn now_us() -> Micros {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
}

/// One lock the clients contend for: a name and the kind they ask for. A read/write
/// lock is two targets with one name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The lock name.
    pub name: String,
    /// The kind asked for.
    pub kind: LockKind,
    /// The semaphore's limit (0 for the other kinds).
    pub limit: u32,
}

impl Target {
    /// A target of `kind` on `name`; semaphores get `limit` permits.
    pub fn new(name: &str, kind: LockKind, limit: u32) -> Target {
        Target {
            name: name.to_owned(),
            kind,
            limit,
        }
    }

    /// True for kinds that exclude every other holder.
    pub fn exclusive(&self) -> bool {
        matches!(self.kind, LockKind::Mutex | LockKind::Fair | LockKind::Write)
    }
}

/// How a hold ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The client released it and the server confirmed.
    Released,
    /// The client was told the lease ended (`lost`, or the stream broke), with why.
    Lost(String),
    /// The release was sent but not confirmed (the server died meanwhile).
    Unconfirmed(String),
}

/// A granted hold and what its critical section did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// The fencing token of the grant.
    pub token: u64,
    /// When `acquired` arrived.
    pub acquired_at: Micros,
    /// When the critical section ended (before the release was sent).
    pub end: Micros,
    /// How the hold ended.
    pub ended: End,
    /// When the holder learned it had lost the lock (a `lost` event during its critical
    /// section, or a release answered lost), if it did.
    pub lost_at: Option<Micros>,
    /// The fenced register accepted this hold's write (exclusive kinds).
    pub wrote: bool,
    /// The register refused this hold's token as stale.
    pub refused: bool,
    /// A reader saw the register change under it, or a semaphore holder saw more
    /// holders than permits: mutual exclusion failed as the resource saw it.
    pub disturbed: bool,
}

/// Why an acquire got no lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The server (or the transport) ended the acquire with this status.
    Status(tonic::Code),
    /// No answer came, though the server was told how long to wait: a hung stream.
    Unanswered,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Status(code) => write!(f, "{code:?}"),
            Failure::Unanswered => f.write_str("Unanswered"),
        }
    }
}

/// One acquire and its outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// The lock asked for.
    pub target: Target,
    /// Which client asked.
    pub client: u32,
    /// When the request was sent.
    pub requested_at: Micros,
    /// When the grant or the failure arrived.
    pub resolved_at: Micros,
    /// The hold, or why there was none.
    pub outcome: Result<Hold, Failure>,
}

impl Attempt {
    /// The attempt as one text line, for a client process to hand it to the checker.
    pub fn to_line(&self) -> String {
        let t = &self.target;
        let head = format!(
            "attempt {} {} {} {} {} {}",
            t.name, t.kind as i32, t.limit, self.client, self.requested_at, self.resolved_at
        );
        match &self.outcome {
            Err(Failure::Status(code)) => format!("{head} failed {}", *code as i32),
            Err(Failure::Unanswered) => format!("{head} unanswered"),
            Ok(h) => {
                let (ended, why) = match &h.ended {
                    End::Released => ("released", "-"),
                    End::Lost(why) => ("lost", why.as_str()),
                    End::Unconfirmed(why) => ("unconfirmed", why.as_str()),
                };
                format!(
                    "{head} held {} {} {} {} {} {} {} {} {}",
                    h.token,
                    h.acquired_at,
                    h.end,
                    u8::from(h.wrote),
                    u8::from(h.refused),
                    u8::from(h.disturbed),
                    ended,
                    why.replace(' ', "_"),
                    h.lost_at.map_or("-".to_owned(), |t| t.to_string())
                )
            }
        }
    }

    /// Parses [`Attempt::to_line`]; `None` for any other line.
    pub fn from_line(line: &str) -> Option<Attempt> {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.first() != Some(&"attempt") || f.len() < 8 {
            return None;
        }
        let num = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok());
        let kind = LockKind::try_from(f[2].parse::<i32>().ok()?).ok()?;
        let target = Target::new(f[1], kind, u32::try_from(num(3)?).ok()?);
        let outcome = match f[7] {
            "failed" => Err(Failure::Status(tonic::Code::from_i32(f.get(8)?.parse().ok()?))),
            "unanswered" => Err(Failure::Unanswered),
            "held" if f.len() >= 16 => Ok(Hold {
                token: num(8)?,
                acquired_at: num(9)?,
                end: num(10)?,
                wrote: f[11] == "1",
                refused: f[12] == "1",
                disturbed: f[13] == "1",
                ended: match f[14] {
                    "released" => End::Released,
                    "lost" => End::Lost(f[15].to_owned()),
                    _ => End::Unconfirmed(f[15].to_owned()),
                },
                lost_at: num(16),
            }),
            _ => return None,
        };
        Some(Attempt {
            target,
            client: u32::try_from(num(4)?).ok()?,
            requested_at: num(5)?,
            resolved_at: num(6)?,
            outcome,
        })
    }
}

/// Every attempt of a run, appended by many client tasks.
#[derive(Debug, Clone, Default)]
pub struct History {
    attempts: Arc<Mutex<Vec<Attempt>>>,
}

impl History {
    /// Records one attempt.
    pub fn push(&self, attempt: Attempt) {
        self.attempts.lock().expect("history lock").push(attempt);
    }

    /// A copy of everything recorded so far.
    pub fn snapshot(&self) -> Vec<Attempt> {
        self.attempts.lock().expect("history lock").clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        let hold = Attempt {
            target: Target::new("hot/m", LockKind::Write, 0),
            client: 7,
            requested_at: 10,
            resolved_at: 20,
            outcome: Ok(Hold {
                token: 99,
                acquired_at: 20,
                end: 30,
                ended: End::Lost("the lock is no longer held".into()),
                lost_at: Some(25),
                wrote: true,
                refused: false,
                disturbed: false,
            }),
        };
        let parsed = Attempt::from_line(&hold.to_line()).expect("parses");
        assert_eq!(parsed.target, hold.target);
        let Ok(h) = parsed.outcome else { panic!("held") };
        assert_eq!((h.token, h.wrote), (99, true));
        assert_eq!(h.ended, End::Lost("the_lock_is_no_longer_held".into()));
        let failed = Attempt {
            outcome: Err(Failure::Status(tonic::Code::DeadlineExceeded)),
            ..hold
        };
        assert_eq!(Attempt::from_line(&failed.to_line()), Some(failed.clone()));
        let unanswered = Attempt {
            outcome: Err(Failure::Unanswered),
            ..failed
        };
        assert_eq!(Attempt::from_line(&unanswered.to_line()), Some(unanswered));
    }
}
