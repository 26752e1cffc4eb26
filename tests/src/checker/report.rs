//! The verdict of a run: per-lock counts and the broken rules, printed as a table.

use super::history::Micros;
use super::resource::Register;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

/// What the run looked like for one lock name.
#[derive(Debug, Clone, Default)]
pub struct LockReport {
    /// The kinds asked for on this name.
    pub kinds: BTreeSet<String>,
    /// Acquires sent.
    pub attempts: usize,
    /// Holds granted.
    pub acquisitions: usize,
    /// Failed acquires by status code.
    pub failures: BTreeMap<String, usize>,
    /// Holds that ended told `lost`, by reason.
    pub lost: BTreeMap<String, usize>,
    /// Overlaps of conflicting holds whose earlier holder had been told `lost`.
    pub overlaps: usize,
    /// Holds whose token the register refused as stale.
    pub refused: usize,
    /// Writes the register accepted.
    pub writes: usize,
    /// The register after the run.
    pub register: Register,
    /// Longest request → grant.
    pub max_wait: Duration,
    /// The kind asked for by that longest wait.
    pub max_wait_kind: &'static str,
    /// Longest release → next grant with a waiter present, outside faults.
    pub max_handoff: Duration,
    /// The same inside fault windows or after a lost hold.
    pub max_fault_handoff: Duration,
    /// When the last hold was granted: after the last fault, the service recovered.
    pub last_grant: Micros,
}

/// The verdict of one run.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Per lock name.
    pub locks: BTreeMap<String, LockReport>,
    /// Every broken rule, in words.
    pub violations: Vec<String>,
}

impl Report {
    /// Sums over every lock: (acquisitions, overlaps, lost notices, refused stale
    /// tokens, max wait, max handoff, max handoff under faults).
    pub fn totals(&self) -> Totals {
        let mut t = Totals::default();
        for l in self.locks.values() {
            t.attempts += l.attempts;
            t.acquisitions += l.acquisitions;
            t.overlaps += l.overlaps;
            t.lost += l.lost.values().sum::<usize>();
            t.refused += l.refused;
            t.writes += l.writes;
            t.failures += l.failures.values().sum::<usize>();
            t.max_wait = t.max_wait.max(l.max_wait);
            t.max_handoff = t.max_handoff.max(l.max_handoff);
            t.max_fault_handoff = t.max_fault_handoff.max(l.max_fault_handoff);
        }
        t
    }
}

/// Sums over every lock of a [`Report`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Totals {
    /// Acquires sent.
    pub attempts: usize,
    /// Holds granted.
    pub acquisitions: usize,
    /// Failed acquires.
    pub failures: usize,
    /// Allowed overlaps (the earlier holder was told `lost`).
    pub overlaps: usize,
    /// Lost notices.
    pub lost: usize,
    /// Holds refused by the fence.
    pub refused: usize,
    /// Register writes accepted.
    pub writes: usize,
    /// Longest request → grant.
    pub max_wait: Duration,
    /// Longest handoff outside faults.
    pub max_handoff: Duration,
    /// Longest handoff inside faults.
    pub max_fault_handoff: Duration,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<14} {:<16} {:>7} {:>6} {:>6} {:>5} {:>7} {:>8} {:>17} {:>9} {:>9}",
            "lock", "kinds", "acq", "fail", "lost", "ovl", "refused", "register", "max-wait", "handoff", "fault-ho"
        )?;
        for (name, l) in &self.locks {
            let kinds: Vec<&str> = l.kinds.iter().map(String::as_str).collect();
            writeln!(
                f,
                "{:<14} {:<16} {:>7} {:>6} {:>6} {:>5} {:>7} {:>8} {:>17} {:>9} {:>9}",
                name,
                kinds.join("+"),
                l.acquisitions,
                l.failures.values().sum::<usize>(),
                l.lost.values().sum::<usize>(),
                l.overlaps,
                l.refused,
                l.register.count,
                format!("{}({})", ms(l.max_wait), l.max_wait_kind),
                ms(l.max_handoff),
                ms(l.max_fault_handoff),
            )?;
        }
        let mut lost: BTreeMap<&str, usize> = BTreeMap::new();
        let mut failures: BTreeMap<&str, usize> = BTreeMap::new();
        for l in self.locks.values() {
            l.lost.iter().for_each(|(k, n)| *lost.entry(k).or_default() += n);
            l.failures
                .iter()
                .for_each(|(k, n)| *failures.entry(k).or_default() += n);
        }
        writeln!(f, "lost notices: {lost:?}")?;
        writeln!(f, "failed acquires: {failures:?}")?;
        match self.violations.len() {
            0 => writeln!(f, "violations: none"),
            n => {
                writeln!(f, "violations: {n}")?;
                self.violations.iter().take(20).try_for_each(|v| writeln!(f, "  {v}"))
            }
        }
    }
}

fn ms(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}
