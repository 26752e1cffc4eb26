//! The verifier: reads a run's history and the registers and reports what mutual
//! exclusion, fencing and wake-ups looked like, and every rule that was broken.

use super::history::{Attempt, End, Failure, Hold, Micros, Target};
use super::report::{LockReport, Report};
use super::resource::Register;
use latchkey_client::{LockKind, RELEASE_TIMEOUT};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// A stretch of time during which a fault was in force, and the settling after it.
#[derive(Debug, Clone)]
pub struct Window {
    /// What was done.
    pub fault: String,
    /// When it began.
    pub start: Micros,
    /// When the fault was over (the process restarted, the link restored, ...).
    pub recovered: Micros,
    /// `recovered` plus the time leases and fair waiters of the fault take to settle.
    pub end: Micros,
    /// The locks the fault can reach, when it reaches only some (a cluster master's
    /// fault, the locks whose slots it serves); `None`: every lock.
    pub locks: Option<BTreeSet<String>>,
}

impl Window {
    /// Whether the fault can reach the lock `name`.
    fn reaches(&self, name: &str) -> bool {
        self.locks.as_ref().is_none_or(|locks| locks.contains(name))
    }
}

/// The bounds the verifier holds the run to.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Longest time from a release to the next grant while someone waits, outside
    /// fault windows.
    pub handoff: Duration,
    /// The same inside a fault window or after a hold that was lost: waiters must not
    /// be stranded longer than this.
    pub fault_handoff: Duration,
    /// Under a fault (Redis lost a hold: a restart, a failover), how long after another
    /// holder's grant a holder may still be learning that it lost the lock: its next
    /// renewal round and the Redis timeout. Outside faults it must know before.
    pub lost_grace: Duration,
}

/// How far a holder's `lost` may come after another holder's grant and still count as
/// before it: the two clocks are one, but the events reach two tasks one after another.
const TOLD_SLACK: Duration = Duration::from_millis(50);

/// How much later than another a fair waiter must have asked before a grant to it while
/// the other still waits counts as out of order: a waiter's place is taken by its first
/// try, which a newcomer behind others of its server makes only once it listens (the
/// server allows that a second), and which reaches Redis a moment after.
const FAIR_SLACK: Duration = Duration::from_millis(1500);

/// Checks a run: `registers` holds the register of every name after the run.
pub fn verify(
    attempts: &[Attempt],
    registers: &BTreeMap<String, Register>,
    windows: &[Window],
    bounds: Bounds,
) -> Report {
    let mut by_name: BTreeMap<&str, Vec<&Attempt>> = BTreeMap::new();
    for a in attempts {
        by_name.entry(a.target.name.as_str()).or_default().push(a);
    }
    let mut report = Report::default();
    for (name, attempts) in by_name {
        let register = registers.get(name).copied().unwrap_or_default();
        let lock = Lock::new(name, &attempts);
        let stats = lock.check(register, windows, bounds, &mut report.violations);
        report.locks.insert(name.to_owned(), stats);
    }
    report
}

/// Every lock is granted again after the last fault was over: a lock that answers
/// only errors after it (a stale slot map, a wedged semaphore) is broken though no hold
/// overlapped. No fault, no rule.
pub fn check_recovered(report: &Report, windows: &[Window]) -> Vec<String> {
    let Some(recovered) = windows.iter().map(|w| w.recovered).max() else {
        return Vec::new();
    };
    report
        .locks
        .iter()
        .filter(|(_, lock)| lock.last_grant <= recovered)
        .map(|(name, lock)| {
            format!(
                "{name}: not granted after the last fault was over at {recovered} (last grant {})",
                lock.last_grant
            )
        })
        .collect()
}

/// One name's attempts and holds, ready to check.
struct Lock<'a> {
    name: &'a str,
    attempts: &'a [&'a Attempt],
    /// Granted holds with their target, by time of grant.
    holds: Vec<(&'a Target, &'a Hold, Micros)>,
}

impl<'a> Lock<'a> {
    fn new(name: &'a str, attempts: &'a [&'a Attempt]) -> Self {
        let mut holds: Vec<_> = attempts
            .iter()
            .filter_map(|a| a.outcome.as_ref().ok().map(|h| (&a.target, h, a.requested_at)))
            .collect();
        holds.sort_by_key(|(_, h, _)| h.acquired_at);
        Lock { name, attempts, holds }
    }

    fn check(&self, register: Register, windows: &[Window], bounds: Bounds, out: &mut Vec<String>) -> LockReport {
        // A fault that cannot reach this lock excuses nothing on it.
        let windows: Vec<Window> = windows.iter().filter(|w| w.reaches(self.name)).cloned().collect();
        let windows = windows.as_slice();
        let mut r = LockReport {
            attempts: self.attempts.len(),
            acquisitions: self.holds.len(),
            last_grant: self.holds.last().map_or(0, |(_, h, _)| h.acquired_at),
            register,
            ..LockReport::default()
        };
        for a in self.attempts {
            r.kinds.insert(kind_name(a.target.kind).to_owned());
            match &a.outcome {
                Err(failure) => *r.failures.entry(failure.to_string()).or_default() += 1,
                Ok(h) => {
                    let waited = us(h.acquired_at.saturating_sub(a.requested_at));
                    if waited >= r.max_wait {
                        r.max_wait = waited;
                        r.max_wait_kind = kind_name(a.target.kind);
                    }
                    r.refused += usize::from(h.refused);
                    r.writes += usize::from(h.wrote);
                    if let End::Lost(why) = &h.ended {
                        *r.lost.entry(why.clone()).or_default() += 1;
                    }
                }
            }
        }
        r.overlaps = self.check_overlaps(windows, bounds, out);
        self.check_disturbed(out);
        self.check_tokens(out);
        self.check_register(&r, out);
        self.check_handoffs(&mut r, windows, bounds, out);
        self.check_answers(windows, out);
        self.check_fair_order(windows, out);
        r
    }

    /// Every acquire is answered; outside faults a mutex or fair waiter is granted
    /// before its `wait_timeout` (16 clients holding a few milliseconds each take turns
    /// far sooner: a timeout is a stranded waiter), and every release is confirmed.
    /// Writers may wait out their timeout behind overlapping readers (the read/write
    /// lock has no writer preference), so their timeouts are not judged.
    fn check_answers(&self, windows: &[Window], out: &mut Vec<String>) {
        for a in self.attempts {
            let waited = us(a.resolved_at.saturating_sub(a.requested_at));
            let calm = !in_fault(windows, a.requested_at, a.resolved_at);
            let waits_its_turn = matches!(a.target.kind, LockKind::Mutex | LockKind::Fair);
            match &a.outcome {
                Err(Failure::Unanswered) => out.push(format!(
                    "{}: client {}'s acquire from {} was never answered ({waited:?})",
                    self.name, a.client, a.requested_at
                )),
                Err(Failure::Status(tonic::Code::DeadlineExceeded)) if calm && waits_its_turn => out.push(format!(
                    "{}: client {}'s {} acquire from {} timed out after {waited:?} with no fault",
                    self.name,
                    a.client,
                    kind_name(a.target.kind),
                    a.requested_at
                )),
                Ok(h)
                    if matches!(h.ended, End::Unconfirmed(_))
                        && !in_fault(windows, h.end, h.end + micros(RELEASE_TIMEOUT)) =>
                {
                    out.push(format!(
                        "{}: hold {}'s release from {} was not confirmed ({:?}) with no fault",
                        self.name, h.token, h.end, h.ended
                    ))
                }
                _ => {}
            }
        }
    }

    /// Outside faults a fair lock grants in order of arrival: no waiter is granted
    /// while one that asked more than [`FAIR_SLACK`] before it still waits.
    fn check_fair_order(&self, windows: &[Window], out: &mut Vec<String>) {
        let fair: Vec<&Attempt> = self
            .attempts
            .iter()
            .copied()
            .filter(|a| a.target.kind == LockKind::Fair)
            .filter(|a| matches!(a.outcome, Ok(_) | Err(Failure::Status(tonic::Code::DeadlineExceeded))))
            .collect();
        for later in &fair {
            let Ok(granted) = &later.outcome else { continue };
            let at = granted.acquired_at;
            let overtaken = fair.iter().find(|earlier| {
                earlier.requested_at + micros(FAIR_SLACK) < later.requested_at
                    && earlier.resolved_at > at
                    && !in_fault(windows, earlier.requested_at, earlier.resolved_at)
            });
            if let Some(earlier) = overtaken {
                out.push(format!(
                    "{}: client {} (asked at {}) was granted at {at} before client {} (asked at {}, still waiting)",
                    self.name, later.client, later.requested_at, earlier.client, earlier.requested_at
                ));
            }
        }
    }

    /// No two conflicting holds overlap unless the earlier one was told `lost` before
    /// the later one's grant (or, under a fault, within [`Bounds::lost_grace`] after
    /// it); returns how many allowed overlaps there were.
    fn check_overlaps(&self, windows: &[Window], bounds: Bounds, out: &mut Vec<String>) -> usize {
        let told = |earlier: &Hold, at: Micros| told_in_time(earlier, at, windows, bounds);
        let mut allowed = 0;
        let mut active: Vec<(&Target, &Hold)> = Vec::new();
        for (target, hold, _) in &self.holds {
            active.retain(|(_, a)| a.end > hold.acquired_at);
            if target.kind == LockKind::Semaphore {
                // Each holder told `lost` in time frees one permit, no more.
                let live = active.iter().filter(|(_, a)| !told(a, hold.acquired_at)).count();
                if live >= target.limit as usize {
                    out.push(format!(
                        "{}: hold {} from {} made {} holders of {} permits without a lost notice",
                        self.name,
                        hold.token,
                        hold.acquired_at,
                        live + 1,
                        target.limit
                    ));
                } else if active.len() >= target.limit as usize {
                    allowed += 1;
                }
                active.push((target, hold));
                continue;
            }
            for (_, earlier) in active.iter().filter(|(t, _)| conflicts(t, target)) {
                if told(earlier, hold.acquired_at) {
                    allowed += 1;
                } else {
                    out.push(format!(
                        "{}: hold {} ({:?}, {}..{}, told lost at {:?}) overlapped hold {} from {} without a lost notice in time",
                        self.name,
                        earlier.token,
                        earlier.ended,
                        earlier.acquired_at,
                        earlier.end,
                        earlier.lost_at,
                        hold.token,
                        hold.acquired_at
                    ));
                }
            }
            active.push((target, hold));
        }
        allowed
    }

    /// A reader that saw the register move, or a semaphore holder that saw more
    /// holders than permits, is a violation unless a lost hold overlapped it.
    fn check_disturbed(&self, out: &mut Vec<String>) {
        for (_, h, _) in self.holds.iter().filter(|(_, h, _)| h.disturbed) {
            let excused = self
                .holds
                .iter()
                .any(|(_, g, _)| is_lost(g) && g.acquired_at < h.end && h.acquired_at < g.end);
            if !excused {
                out.push(format!(
                    "{}: hold {} saw another holder in the resource",
                    self.name, h.token
                ));
            }
        }
    }

    /// Tokens are unique, and a grant asked for (shared kinds) or received
    /// (exclusive kinds) after another hold ended carries a larger token.
    fn check_tokens(&self, out: &mut Vec<String>) {
        let mut seen = BTreeSet::new();
        for (_, h, _) in &self.holds {
            if !seen.insert(h.token) {
                out.push(format!("{}: token {} granted twice", self.name, h.token));
            }
        }
        let mut by_end: Vec<&Hold> = self.holds.iter().map(|(_, h, _)| *h).collect();
        by_end.sort_by_key(|h| h.end);
        let mut later: Vec<(Micros, &Hold)> = self
            .holds
            .iter()
            .map(|(t, h, requested)| (if t.exclusive() { h.acquired_at } else { *requested }, *h))
            .collect();
        later.sort_by_key(|(at, _)| *at);
        let (mut next, mut highest) = (0, None::<&Hold>);
        for (at, h) in later {
            while next < by_end.len() && by_end[next].end < at {
                highest = highest.max_by_token(by_end[next]);
                next += 1;
            }
            if let Some(top) = highest.filter(|top| top.token >= h.token) {
                out.push(format!(
                    "{}: token {} granted after hold {} (token {}) had ended",
                    self.name, h.token, top.acquired_at, top.token
                ));
            }
        }
    }

    /// The register counts exactly the accepted writes, and its unfenced twin agrees
    /// when no holds overlapped.
    fn check_register(&self, r: &LockReport, out: &mut Vec<String>) {
        if !self.holds.iter().any(|(t, _, _)| t.exclusive()) {
            return;
        }
        if r.register.count != r.writes as i64 {
            out.push(format!(
                "{}: the register holds {} but {} writes were accepted",
                self.name, r.register.count, r.writes
            ));
        }
        if r.overlaps == 0 && r.register.plain != r.register.count {
            out.push(format!(
                "{}: the unfenced twin holds {} but the register {} with no overlap",
                self.name, r.register.plain, r.register.count
            ));
        }
    }

    /// After each hold ends with the lock free and someone waiting, the next grant
    /// comes within the bound.
    fn check_handoffs(&self, r: &mut LockReport, windows: &[Window], bounds: Bounds, out: &mut Vec<String>) {
        let mut grants: Vec<Micros> = self.holds.iter().map(|(_, h, _)| h.acquired_at).collect();
        grants.sort_unstable();
        let mut ends: Vec<Micros> = self.holds.iter().map(|(_, h, _)| h.end).collect();
        ends.sort_unstable();
        let mut asked: Vec<Micros> = self.attempts.iter().map(|a| a.requested_at).collect();
        asked.sort_unstable();
        let mut answered: Vec<Micros> = self.attempts.iter().map(|a| a.resolved_at).collect();
        answered.sort_unstable();
        let limit = self.holds.iter().map(|(t, _, _)| t.limit).max().unwrap_or(0).max(1) as usize;
        for (_, hold, _) in &self.holds {
            let e = hold.end;
            let active = count_le(&grants, e) - count_le(&ends, e);
            let waiting = count_lt(&asked, e).saturating_sub(count_le(&answered, e));
            if active >= limit || waiting == 0 {
                continue;
            }
            let next = grants
                .get(count_le(&grants, e))
                .or_else(|| answered.get(count_le(&answered, e)));
            let Some(next) = next else { continue };
            let gap = us(next - e);
            let faulty = !matches!(hold.ended, End::Released) || in_fault(windows, e, *next);
            let (max, bound) = if faulty {
                (&mut r.max_fault_handoff, bounds.fault_handoff)
            } else {
                (&mut r.max_handoff, bounds.handoff)
            };
            *max = (*max).max(gap);
            if gap > bound {
                out.push(format!(
                    "{}: free at {e} with {waiting} waiting, next grant {gap:?} later (bound {bound:?})",
                    self.name
                ));
            }
        }
    }
}

trait MaxByToken<'a> {
    fn max_by_token(self, other: &'a Hold) -> Option<&'a Hold>;
}

impl<'a> MaxByToken<'a> for Option<&'a Hold> {
    fn max_by_token(self, other: &'a Hold) -> Option<&'a Hold> {
        match self {
            Some(h) if h.token >= other.token => Some(h),
            _ => Some(other),
        }
    }
}

fn is_lost(h: &Hold) -> bool {
    matches!(h.ended, End::Lost(_))
}

/// Whether `earlier` was told it lost the lock in time for a grant to another at `at`:
/// by a `lost` event during its section, before the grant (within [`TOLD_SLACK`]), or,
/// with a fault in force then, within the fault's grace. With no fault, a holder told
/// only by its release's answer (after its section) had its lock taken unawares,
/// however soon after the grant its short section ended.
fn told_in_time(earlier: &Hold, at: Micros, windows: &[Window], bounds: Bounds) -> bool {
    let Some(told) = earlier.lost_at.filter(|_| is_lost(earlier)) else {
        return false;
    };
    let under_fault = in_fault(windows, at, at);
    let told_in_section = told <= earlier.end;
    (told_in_section && told <= at + micros(TOLD_SLACK)) || (under_fault && told <= at + micros(bounds.lost_grace))
}

/// Whether any fault window touches `from..=to`.
fn in_fault(windows: &[Window], from: Micros, to: Micros) -> bool {
    windows.iter().any(|w| w.start <= to && from <= w.end)
}

fn micros(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// True when holds of these two kinds may not overlap.
fn conflicts(a: &Target, b: &Target) -> bool {
    a.exclusive() || b.exclusive()
}

fn count_le(sorted: &[Micros], t: Micros) -> usize {
    sorted.partition_point(|x| *x <= t)
}

fn count_lt(sorted: &[Micros], t: Micros) -> usize {
    sorted.partition_point(|x| *x < t)
}

fn us(micros: Micros) -> Duration {
    Duration::from_micros(micros)
}

/// The short name of a kind.
pub fn kind_name(kind: LockKind) -> &'static str {
    match kind {
        LockKind::Fair => "fair",
        LockKind::Read => "read",
        LockKind::Write => "write",
        LockKind::Semaphore => "semaphore",
        LockKind::Mutex | LockKind::Unspecified => "mutex",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Micros = 1000;

    fn mutex_hold(token: u64, from: Micros, to: Micros, lost_at: Option<Micros>) -> Attempt {
        let ended = match lost_at {
            Some(_) => End::Lost("NOT_HELD".into()),
            None => End::Released,
        };
        Attempt {
            target: Target::new("m", LockKind::Mutex, 0),
            client: u32::try_from(token).unwrap_or(0),
            requested_at: from,
            resolved_at: from,
            outcome: Ok(Hold {
                token,
                acquired_at: from,
                end: to,
                ended,
                lost_at,
                wrote: false,
                refused: false,
                disturbed: false,
            }),
        }
    }

    /// An attempt of `kind` asked at `from` that ended in `failure` at `to`.
    fn failed(kind: LockKind, client: u32, from: Micros, to: Micros, failure: Failure) -> Attempt {
        Attempt {
            target: Target::new("m", kind, 0),
            client,
            requested_at: from,
            resolved_at: to,
            outcome: Err(failure),
        }
    }

    /// A fair hold of `client`, asked at `asked`, held `from..to` (its token grows with
    /// `from`).
    fn fair_hold(client: u32, asked: Micros, from: Micros, to: Micros) -> Attempt {
        let mut a = mutex_hold(from + 1, from, to, None);
        a.target.kind = LockKind::Fair;
        a.client = client;
        a.requested_at = asked;
        a.resolved_at = from;
        a
    }

    fn fault(start: Micros, end: Micros) -> Window {
        Window {
            fault: "kill-redis".into(),
            start,
            recovered: start,
            end,
            locks: None,
        }
    }

    fn bounds() -> Bounds {
        Bounds {
            handoff: Duration::from_secs(1),
            fault_handoff: Duration::from_secs(10),
            lost_grace: Duration::from_millis(1500),
        }
    }

    fn violations(attempts: &[Attempt], windows: &[Window]) -> Vec<String> {
        let registers = BTreeMap::from([("m".to_owned(), Register::default())]);
        verify(attempts, &registers, windows, bounds()).violations
    }

    /// A holder told `lost` only after another was granted the lock (its lock was
    /// taken from it, and its release then found nothing) is a violation: the overlap
    /// is no lost lease but a stolen one.
    #[test]
    fn an_overlap_told_lost_after_the_other_grant_is_a_violation() {
        let history = [
            mutex_hold(1, 0, 1000 * MS, Some(900 * MS)),
            mutex_hold(2, 500 * MS, 600 * MS, None),
        ];
        let found = violations(&history, &[]);
        assert!(
            found.iter().any(|v| v.contains("without a lost notice in time")),
            "{found:?}"
        );
    }

    /// With no fault, a holder told only by its release's answer, however soon after
    /// the other grant (its section shorter than the slack), had its lock taken
    /// unawares: a violation.
    #[test]
    fn an_overlap_told_only_by_the_release_is_a_violation() {
        let history = [
            mutex_hold(1, 0, 25 * MS, Some(30 * MS)),
            mutex_hold(2, 10 * MS, 40 * MS, None),
        ];
        assert!(!violations(&history, &[]).is_empty());
    }

    /// Told before the other grant: allowed (a paused or slow holder runs on).
    #[test]
    fn an_overlap_told_lost_before_the_other_grant_is_allowed() {
        let history = [
            mutex_hold(1, 0, 1000 * MS, Some(400 * MS)),
            mutex_hold(2, 500 * MS, 600 * MS, None),
        ];
        assert!(violations(&history, &[]).is_empty());
    }

    /// Under a fault (Redis lost the hold), told within the grace after the other
    /// grant: allowed; past it: a violation.
    #[test]
    fn under_a_fault_the_lost_notice_may_come_within_the_grace() {
        let window = Window {
            fault: "restart-redis".into(),
            start: 0,
            recovered: 200 * MS,
            end: 2000 * MS,
            locks: None,
        };
        let in_grace = [
            mutex_hold(1, 0, 1000 * MS, Some(900 * MS)),
            mutex_hold(2, 500 * MS, 600 * MS, None),
        ];
        assert!(violations(&in_grace, std::slice::from_ref(&window)).is_empty());
        let late = [
            mutex_hold(1, 0, 3000 * MS, Some(2500 * MS)),
            mutex_hold(2, 500 * MS, 600 * MS, None),
        ];
        assert!(!violations(&late, &[window]).is_empty());
    }

    /// A fault that reaches only other locks (another cluster master's) excuses
    /// nothing on this one; one that reaches it does.
    #[test]
    fn a_fault_excuses_only_the_locks_it_reaches() {
        let stranded = [failed(
            LockKind::Mutex,
            1,
            0,
            10_000 * MS,
            Failure::Status(tonic::Code::DeadlineExceeded),
        )];
        let on = |lock: &str| Window {
            locks: Some(BTreeSet::from([lock.to_owned()])),
            ..fault(5_000 * MS, 6_000 * MS)
        };
        assert!(!violations(&stranded, &[on("other")]).is_empty());
        assert!(violations(&stranded, &[on("m")]).is_empty());
    }

    /// An acquire the server never answered is a hung stream, fault or not.
    #[test]
    fn an_unanswered_acquire_is_a_violation() {
        let hung = [failed(LockKind::Read, 1, 0, 20_000 * MS, Failure::Unanswered)];
        let found = violations(&hung, &[fault(0, 30_000 * MS)]);
        assert!(found.iter().any(|v| v.contains("never answered")), "{found:?}");
    }

    /// A mutex or fair waiter that times out with no fault was stranded; a writer
    /// behind readers, or any waiter under a fault, may time out.
    #[test]
    fn a_calm_mutex_or_fair_timeout_is_a_violation() {
        let timeout = Failure::Status(tonic::Code::DeadlineExceeded);
        for kind in [LockKind::Mutex, LockKind::Fair] {
            let stranded = [failed(kind, 1, 0, 10_000 * MS, timeout)];
            assert!(!violations(&stranded, &[]).is_empty(), "{kind:?}");
            assert!(violations(&stranded, &[fault(5_000 * MS, 6_000 * MS)]).is_empty());
        }
        let writer = [failed(LockKind::Write, 1, 0, 10_000 * MS, timeout)];
        assert!(violations(&writer, &[]).is_empty());
    }

    /// A release never confirmed with no fault is a violation; one a fault cut off
    /// (the fault began before the client gave up on it) is not.
    #[test]
    fn an_unconfirmed_release_outside_faults_is_a_violation() {
        let mut history = [mutex_hold(1, 0, 100 * MS, None)];
        if let Ok(h) = &mut history[0].outcome {
            h.ended = End::Unconfirmed("timed_out".into());
        }
        assert!(!violations(&history, &[]).is_empty());
        assert!(violations(&history, &[fault(3_000 * MS, 9_000 * MS)]).is_empty());
    }

    /// A semaphore holder told `lost` frees its one permit, not every permit: with
    /// one lost holder of two permits still in its section, three live holders are
    /// one too many.
    #[test]
    fn a_semaphore_over_its_limit_beside_one_lost_holder_is_a_violation() {
        let semaphore = |token: u64, from: Micros, lost_at: Option<Micros>| {
            let mut a = mutex_hold(token, from, 1000 * MS, lost_at);
            a.target = Target::new("m", LockKind::Semaphore, 2);
            a
        };
        let lost = semaphore(1, 0, Some(100 * MS));
        let two_live = [lost.clone(), semaphore(2, 200 * MS, None), semaphore(3, 300 * MS, None)];
        assert!(violations(&two_live, &[]).is_empty());
        let three_live = [
            lost,
            semaphore(2, 200 * MS, None),
            semaphore(3, 300 * MS, None),
            semaphore(4, 400 * MS, None),
        ];
        let found = violations(&three_live, &[]);
        assert!(found.iter().any(|v| v.contains("3 holders of 2 permits")), "{found:?}");
    }

    /// A lock granted only before the last fault was over did not recover.
    #[test]
    fn a_lock_not_granted_after_the_last_fault_is_a_violation() {
        let registers = BTreeMap::from([("m".to_owned(), Register::default())]);
        let window = |recovered: Micros| Window {
            fault: "restart-redis".into(),
            start: 0,
            recovered,
            end: recovered + 1000 * MS,
            locks: None,
        };
        let history = [
            mutex_hold(1, 500 * MS, 600 * MS, None),
            failed(
                LockKind::Mutex,
                2,
                5_000 * MS,
                5_010 * MS,
                Failure::Status(tonic::Code::Unavailable),
            ),
        ];
        let report = verify(&history, &registers, &[window(1000 * MS)], bounds());
        let found = check_recovered(&report, &[window(1000 * MS)]);
        assert!(found.iter().any(|v| v.contains("not granted after")), "{found:?}");
        assert!(check_recovered(&report, &[window(100 * MS)]).is_empty());
        assert!(check_recovered(&report, &[]).is_empty());
    }

    /// A fair lock granted to a later waiter while an earlier one waits is out of
    /// order; arrivals within the slack, or a fault during the wait, excuse it.
    #[test]
    fn a_fair_waiter_overtaken_by_a_later_one_is_a_violation() {
        // Client 1 holds 0..3000 ms; client 2 asks at 100 ms, client 3 at 2000 ms; 3 is
        // granted first.
        let overtaken = [
            fair_hold(1, 0, 0, 3000 * MS),
            fair_hold(3, 2000 * MS, 3001 * MS, 3100 * MS),
            fair_hold(2, 100 * MS, 3101 * MS, 3200 * MS),
        ];
        let found = violations(&overtaken, &[]);
        assert!(found.iter().any(|v| v.contains("before client 2")), "{found:?}");
        assert!(violations(&overtaken, &[fault(200 * MS, 300 * MS)]).is_empty());
        let in_order = [
            fair_hold(1, 0, 0, 3000 * MS),
            fair_hold(2, 100 * MS, 3001 * MS, 3100 * MS),
            fair_hold(3, 2000 * MS, 3101 * MS, 3200 * MS),
        ];
        assert!(violations(&in_order, &[]).is_empty());
        let close = [
            fair_hold(1, 0, 0, 3000 * MS),
            fair_hold(3, 1000 * MS, 3001 * MS, 3100 * MS),
            fair_hold(2, 100 * MS, 3101 * MS, 3200 * MS),
        ];
        assert!(violations(&close, &[]).is_empty());
    }
}
