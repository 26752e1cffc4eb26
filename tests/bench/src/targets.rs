//! The targets latchkey is measured against, judged on the rows of this run: each
//! target's figure, the ratio to the peer it is set against (both measured in the same
//! run on the same machine, so the ratio carries over where absolute figures do not),
//! and whether it is met. Printed after the table and written as JSON lines.

use crate::scale::{Leases, Names};
use std::collections::HashMap;

/// How far the server's RSS may end above its baseline and still count as back (the
/// slack the many-names scenario waits for).
const RSS_SLACK_KIB: u64 = 4 * 1024;
/// The server's fallback recheck of a waiter that heard nothing: a wait this long
/// means a wake-up went astray.
const RECHECK_US: u128 = latchkey_server::lock::NO_TTL_RECHECK.as_micros();

/// What the targets read of one row.
#[derive(Debug, Clone, Copy)]
pub struct Figures {
    pub cycles_per_sec: f64,
    /// Acquires measured: with none, the acquire percentiles read 0 and mean nothing.
    pub acquires: u64,
    pub acquire_p50_us: u64,
    pub acquire_p99_us: u64,
    /// The longest wait of any run of the row (not only the run the row shows).
    pub acquire_max_us: u64,
    pub handoff_p50_us: u64,
    pub handoff_p99_us: u64,
    /// Handoffs measured: with none, the handoff percentiles read 0 and mean nothing.
    pub handoffs: u64,
    pub fairness: f64,
    pub overlaps: u32,
    /// Failed acquires or releases, and tasks stranded past the drain.
    pub errors: u64,
    /// CPU of every process of the deployment per cycle (µs), the gRPC servers' part
    /// and the store's part.
    pub cpu_us_per_cycle: f64,
    pub server_us_per_cycle: f64,
    pub store_us_per_cycle: f64,
}

/// Where a row sits: scenario, peer, tasks, hold (ms).
type Key = (&'static str, &'static str, usize, u128);

/// The figures of a run, gathered row by row.
#[derive(Debug, Default)]
pub struct Run {
    rows: HashMap<(String, String, usize, u128), Figures>,
    /// Each row's runs, one per repeat in the order they ran: the i-th runs of a row's
    /// peers took their turns together, so a ratio is taken between them.
    repeats: HashMap<(String, String, usize, u128), Vec<Figures>>,
    leases: Vec<LeaseFigures>,
    names: Option<Names>,
}

#[derive(Debug, Clone, Copy)]
struct LeaseFigures {
    asked: usize,
    held: usize,
    rss_per_lease: f64,
    /// At the server's height (renewal rounds included): what it must be given.
    peak_rss_per_lease: f64,
    calls_per_100_per_period: f64,
    longest_gap_ms: f64,
    period_ms: f64,
    lost: usize,
}

/// One target's verdict: `met` is `None` when the rows it needs were not run.
#[derive(Debug)]
pub struct Verdict {
    pub target: String,
    pub measured: String,
    pub met: Option<bool>,
}

/// Which side of a bound a figure must stay.
#[derive(Debug, Clone, Copy)]
enum Bound {
    AtLeast(f64),
    AtMost(f64),
}

impl Bound {
    fn holds(self, value: f64) -> bool {
        match self {
            Bound::AtLeast(b) => value >= b,
            Bound::AtMost(b) => value <= b,
        }
    }
}

/// A target on the rows of the table: `row`'s figure, or its ratio to `against`'s.
struct Target {
    text: &'static str,
    row: Key,
    against: Option<Key>,
    metric: fn(&Figures) -> f64,
    unit: &'static str,
    bound: Bound,
}

const LATCHKEY_64: Key = ("uncontended", "latchkey", 64, 0);
const HOT_MUTEX_64: Key = ("hot", "latchkey", 64, 0);
const HOT_FAIR_64: Key = ("hot", "latchkey-fair", 64, 0);

/// The targets of the issue that read the table, in its order.
const TARGETS: [Target; 9] = [
    Target {
        text: "uncontended C=64: latchkey ≥ 0.5× the direct protocol",
        row: LATCHKEY_64,
        against: Some(("uncontended", "redisson", 64, 0)),
        metric: cycles,
        unit: "cycles/s",
        bound: Bound::AtLeast(0.5),
    },
    Target {
        text: "uncontended C=64: latchkey ≥ 8× etcd",
        row: LATCHKEY_64,
        against: Some(("uncontended", "etcd", 64, 0)),
        metric: cycles,
        unit: "cycles/s",
        bound: Bound::AtLeast(8.0),
    },
    Target {
        text: "uncontended C=16: acquire p50 ≤ 2× the direct protocol's",
        row: ("uncontended", "latchkey", 16, 0),
        against: Some(("uncontended", "redisson", 16, 0)),
        metric: |f| measured(f.acquires, f.acquire_p50_us),
        unit: "µs",
        bound: Bound::AtMost(2.0),
    },
    Target {
        text: "hot mutex C=64: grants/s ≥ the direct protocol's",
        row: HOT_MUTEX_64,
        against: Some(("hot", "redisson", 64, 0)),
        metric: cycles,
        unit: "grants/s",
        bound: Bound::AtLeast(1.0),
    },
    Target {
        text: "hot mutex C=64: acquire-wait p99 ≤ 50 ms",
        row: HOT_MUTEX_64,
        against: None,
        metric: |f| measured(f.acquires, f.acquire_p99_us) / 1000.0,
        unit: "ms",
        bound: Bound::AtMost(50.0),
    },
    Target {
        text: "hot fair C=64: ≥ 5000 grants/s",
        row: HOT_FAIR_64,
        against: None,
        metric: cycles,
        unit: "grants/s",
        bound: Bound::AtLeast(5000.0),
    },
    Target {
        text: "hot fair C=64: max/min grants ≤ 1.1×",
        row: HOT_FAIR_64,
        against: None,
        metric: |f| f.fairness,
        unit: "×",
        bound: Bound::AtMost(1.1),
    },
    Target {
        text: "hot fair C=64: handoff p99 ≤ 1 ms",
        row: HOT_FAIR_64,
        against: None,
        metric: |f| measured(f.handoffs, f.handoff_p99_us) / 1000.0,
        unit: "ms",
        bound: Bound::AtMost(1.0),
    },
    Target {
        text: "cross-replica: handoff p50 ≤ 300 µs",
        row: ("cross-replica", "latchkey-2", 2, 0),
        against: None,
        metric: |f| measured(f.handoffs, f.handoff_p50_us),
        unit: "µs",
        bound: Bound::AtMost(300.0),
    },
];

fn cycles(f: &Figures) -> f64 {
    f.cycles_per_sec
}

/// A percentile of `count` samples, NaN (never met) when the row measured none: an
/// empty histogram reads 0, which an upper bound would take for met.
fn measured(count: u64, us: u64) -> f64 {
    if count == 0 {
        f64::NAN
    } else {
        us as f64
    }
}

impl Run {
    /// Records a row of the table that ran once.
    #[cfg(test)]
    pub fn add(&mut self, scenario: &str, peer: &str, tasks: usize, hold_ms: u128, figures: Figures) {
        self.add_repeated(scenario, peer, tasks, hold_ms, figures, vec![figures]);
    }

    /// Records a row of the table: the figures it shows and those of each of its runs,
    /// in the order of the repeats.
    pub fn add_repeated(
        &mut self,
        scenario: &str,
        peer: &str,
        tasks: usize,
        hold_ms: u128,
        shown: Figures,
        runs: Vec<Figures>,
    ) {
        let key = (scenario.to_owned(), peer.to_owned(), tasks, hold_ms);
        self.rows.insert(key.clone(), shown);
        self.repeats.insert(key, runs);
    }

    /// Records a many-leases result.
    pub fn add_leases(&mut self, r: &Leases) {
        self.leases.push(LeaseFigures {
            asked: r.asked,
            held: r.held,
            rss_per_lease: r.rss_per_lease,
            peak_rss_per_lease: r.peak_rss_per_lease,
            calls_per_100_per_period: r.calls_per_100_per_period,
            longest_gap_ms: r.longest_gap_ms,
            period_ms: r.period_ms,
            lost: r.lost,
        });
    }

    /// Records the many-names result.
    pub fn set_names(&mut self, r: &Names) {
        self.names = Some(*r);
    }

    fn row(&self, (scenario, peer, tasks, hold): Key) -> Option<&Figures> {
        self.rows.get(&(scenario.to_owned(), peer.to_owned(), tasks, hold))
    }

    /// The runs of a row, one per repeat (the row's own figures when it kept none).
    fn repeats(&self, (scenario, peer, tasks, hold): Key) -> &[Figures] {
        let key = (scenario.to_owned(), peer.to_owned(), tasks, hold);
        match (self.repeats.get(&key), self.rows.get(&key)) {
            (Some(runs), _) if !runs.is_empty() => runs,
            (_, Some(shown)) => std::slice::from_ref(shown),
            _ => &[],
        }
    }

    /// The runs of `keys`'s rows from one repeat, so that a line's ratios set runs of
    /// the same minutes against each other, as the targets are judged: the repeat in
    /// which the first row ran at its median rate. `None` when a row is missing or the
    /// rows kept different numbers of repeats.
    fn one_repeat<const N: usize>(&self, keys: [Key; N]) -> Option<[&Figures; N]> {
        let runs = keys.map(|key| self.repeats(key));
        let n = runs[0].len();
        if n == 0 || runs.iter().any(|r| r.len() != n) {
            return None;
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&i, &j| runs[0][i].cycles_per_sec.total_cmp(&runs[0][j].cycles_per_sec));
        let median = order[n / 2];
        Some(runs.map(|r| &r[median]))
    }

    /// Every target, in the order of the issue.
    pub fn verdicts(&self) -> Vec<Verdict> {
        let mut v: Vec<Verdict> = TARGETS.iter().map(|t| self.judge(t)).collect();
        v.push(self.no_overlap());
        v.push(self.no_errors());
        v.push(self.no_recheck_wait());
        v.extend(self.lease_verdicts());
        v.extend(self.name_verdicts());
        v
    }

    /// One target of [`TARGETS`]: a row's figure, or its ratio to another row's, taken
    /// in each repeat (the runs that took their turns together) and judged on the
    /// median of the repeats, shown with its run's figures. Not met when a row it reads
    /// failed an acquire or a release, or overlapped: a peer whose cycles failed is not
    /// a rate to be set against.
    fn judge(&self, t: &Target) -> Verdict {
        let (Some(a), against) = (self.row(t.row), t.against.map(|k| self.row(k))) else {
            return not_run(t.text);
        };
        let b = match against {
            Some(None) => return not_run(t.text),
            Some(b) => b,
            None => None,
        };
        let runs = self.repeats(t.row);
        let set_against = t.against.map(|k| self.repeats(k));
        // (x, the figure it is set against) of each repeat.
        let pairs: Vec<(f64, Option<f64>)> = match set_against {
            Some(other) => runs
                .iter()
                .zip(other)
                .map(|(a, b)| ((t.metric)(a), Some((t.metric)(b))))
                .collect(),
            None => runs.iter().map(|a| ((t.metric)(a), None)).collect(),
        };
        let value = |(x, y): &(f64, Option<f64>)| y.map_or(*x, |y| x / y);
        if pairs.is_empty() || pairs.iter().any(|p| p.0.is_nan() || p.1.is_some_and(f64::is_nan)) {
            return Verdict {
                target: t.text.to_owned(),
                measured: "nothing measured".to_owned(),
                met: Some(false),
            };
        }
        let mut order: Vec<usize> = (0..pairs.len()).collect();
        order.sort_by(|&i, &j| value(&pairs[i]).total_cmp(&value(&pairs[j])));
        let median = pairs[order[order.len() / 2]];
        // Judged on the median, but not past a repeat that measured nothing finite (a
        // task with no grant: fairness `inf`), and shown with every repeat's value, so a
        // repeat the median outvoted is seen.
        let each: Vec<f64> = pairs.iter().map(value).collect();
        let every_finite = each.iter().all(|v| v.is_finite());
        let (x, unit) = (median.0, t.unit);
        // Whole microseconds and grants; milliseconds and ratios to two places.
        let places = match (median.1, unit) {
            (None, "µs" | "grants/s") => 0,
            _ => 2,
        };
        let (mut measured, value) = match median.1 {
            Some(y) => (format!("{x:.0} / {y:.0} {unit} = {:.2}×", x / y), x / y),
            None => {
                let space = if unit == "×" { "" } else { " " };
                (format!("{x:.places$}{space}{unit}"), x)
            }
        };
        let faults: u64 = [Some(a), b]
            .into_iter()
            .flatten()
            .map(|f| f.errors + u64::from(f.overlaps))
            .sum();
        if pairs.len() > 1 {
            let each: Vec<String> = each.iter().map(|v| format!("{v:.places$}")).collect();
            measured.push_str(&format!(" (repeats {})", each.join(", ")));
        }
        if faults > 0 {
            measured.push_str(&format!(" ({faults} errors or overlaps in its rows)"));
        }
        Verdict {
            target: t.text.to_owned(),
            measured,
            met: Some(faults == 0 && every_finite && t.bound.holds(value)),
        }
    }

    /// What a cycle costs latchkey against the direct protocol, where the two ran: the
    /// measurement behind an unmet throughput target on a machine whose cores every
    /// process shares.
    pub fn costs(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for (scenario, tasks) in [("uncontended", 64), ("hot", 64)] {
            for peer in ["latchkey", "latchkey-fair"] {
                let Some([f, direct]) = self.one_repeat([(scenario, peer, tasks, 0), (scenario, "redisson", tasks, 0)])
                else {
                    continue;
                };
                lines.push(format!(
                    "{scenario} C={tasks} {peer}: {:.0} µs of CPU per cycle (server {:.0}, store {:.0}) against the direct protocol's {:.0} (store {:.0}): {:.1}× ({:.1}×)",
                    f.cpu_us_per_cycle,
                    f.server_us_per_cycle,
                    f.store_us_per_cycle,
                    direct.cpu_us_per_cycle,
                    direct.store_us_per_cycle,
                    f.cpu_us_per_cycle / direct.cpu_us_per_cycle,
                    f.store_us_per_cycle / direct.store_us_per_cycle,
                ));
            }
        }
        lines.extend(self.floor_lines());
        lines
    }

    /// The gRPC hop alone (`grpc-floor`) between the direct protocol and latchkey: how
    /// much of the uncontended and hot targets the hop leaves, and what latchkey's own
    /// work costs beyond it.
    fn floor_lines(&self) -> Vec<String> {
        let rows = |scenario, tasks| {
            self.one_repeat([
                (scenario, "latchkey", tasks, 0),
                (scenario, "grpc-floor", tasks, 0),
                (scenario, "redisson", tasks, 0),
            ])
        };
        let mut lines = Vec::new();
        if let Some([lk, floor, direct]) = rows("uncontended", 64) {
            lines.push(format!(
                "uncontended C=64 grpc-floor (the gRPC hop, locks in memory): {:.0} cycles/s = {:.2}× the direct protocol at {:.0} µs of CPU per cycle (server {:.0}); latchkey makes {:.2}× the floor's cycles, spending {:+.0} µs (server {:+.0}, store {:+.0})",
                floor.cycles_per_sec,
                floor.cycles_per_sec / direct.cycles_per_sec,
                floor.cpu_us_per_cycle,
                floor.server_us_per_cycle,
                lk.cycles_per_sec / floor.cycles_per_sec,
                lk.cpu_us_per_cycle - floor.cpu_us_per_cycle,
                lk.server_us_per_cycle - floor.server_us_per_cycle,
                lk.store_us_per_cycle - floor.store_us_per_cycle,
            ));
        }
        if let Some([lk, floor, direct]) = rows("uncontended", 16) {
            lines.push(format!(
                "uncontended C=16 grpc-floor: acquire p50 {} µs = {:.2}× the direct protocol's; latchkey's {} µs = {:.2}× the floor's",
                floor.acquire_p50_us,
                floor.acquire_p50_us as f64 / direct.acquire_p50_us.max(1) as f64,
                lk.acquire_p50_us,
                lk.acquire_p50_us as f64 / floor.acquire_p50_us.max(1) as f64,
            ));
        }
        if let Some([lk, floor, direct]) = rows("hot", 64) {
            lines.push(format!(
                "hot C=64 grpc-floor (the hop, waiters served in order in memory): {:.0} grants/s = {:.2}× the direct protocol, handoff p50 {} µs; latchkey makes {:.2}× the floor's grants, handoff p50 {} µs",
                floor.cycles_per_sec,
                floor.cycles_per_sec / direct.cycles_per_sec,
                floor.handoff_p50_us,
                lk.cycles_per_sec / floor.cycles_per_sec,
                lk.handoff_p50_us,
            ));
        }
        lines
    }

    /// Every hot row; only the held ones can see most overlaps (a task holding for 0 ms
    /// is inside for a few instructions, so a second grant would have to reach its
    /// client in that instant to be seen), hence the 1 ms rows of every hot scenario.
    fn no_overlap(&self) -> Verdict {
        let target = "hot locks: no overlap, every peer";
        let hot: Vec<&Figures> = self
            .rows
            .iter()
            .filter(|((scenario, ..), _)| scenario != "uncontended")
            .map(|(_, f)| f)
            .collect();
        if hot.is_empty() {
            return not_run(target);
        }
        let overlaps: u32 = hot.iter().map(|f| f.overlaps).sum();
        Verdict {
            target: target.to_owned(),
            measured: format!("{overlaps} overlaps in {} rows", hot.len()),
            met: Some(overlaps == 0),
        }
    }

    /// No row of any peer failed an acquire or a release, or left a task stranded: the
    /// figures of a row with errors leave those tasks' waits and grants out.
    fn no_errors(&self) -> Verdict {
        let target = "every row: no failed acquire or release, every peer";
        if self.rows.is_empty() {
            return not_run(target);
        }
        let errors: u64 = self.rows.values().map(|f| f.errors).sum();
        Verdict {
            target: target.to_owned(),
            measured: format!("{errors} errors in {} rows", self.rows.len()),
            met: Some(errors == 0),
        }
    }

    /// No latchkey row's waiter waited as long as the server's fallback recheck: every
    /// waiter was woken by the release that let it in.
    fn no_recheck_wait(&self) -> Verdict {
        let target = "latchkey rows: every wait under the 1 s recheck";
        let longest = self
            .rows
            .iter()
            .filter(|((_, peer, ..), _)| peer.starts_with("latchkey"))
            .max_by_key(|(_, f)| f.acquire_max_us);
        let Some(((scenario, peer, tasks, hold), f)) = longest else {
            return not_run(target);
        };
        Verdict {
            target: target.to_owned(),
            measured: format!(
                "longest {:.1} ms ({scenario} {peer} C={tasks} hold {hold}ms)",
                f.acquire_max_us as f64 / 1000.0
            ),
            met: Some(u128::from(f.acquire_max_us) < RECHECK_US),
        }
    }

    /// The many-leases runs against the lease targets: the largest against all of
    /// them (the 100 000 leases), every other against what each must read
    /// (every lease held, none late, none lost), as the largest alone was before.
    fn lease_verdicts(&self) -> Vec<Verdict> {
        let largest = self.leases.iter().map(|l| l.asked).max();
        (self.leases.iter())
            .flat_map(|l| lease_verdicts(l, Some(l.asked) == largest))
            .collect()
    }

    fn name_verdicts(&self) -> Vec<Verdict> {
        let Some(r) = self.names else {
            return Vec::new();
        };
        let n = r.names;
        let (rss_unconnected, rss_closed) = (r.rss_kib.0 as i64, r.rss_kib.3 as i64);
        let rss_delta = rss_closed - rss_unconnected;
        let (before, after) = r.heap;
        let heap_delta = after.live as i64 - before.live as i64;
        let metadata_delta = after.metadata as i64 - before.metadata as i64;
        let again_delta = r.rss_again_kib as i64 - rss_closed;
        vec![
            Verdict {
                target: format!("{n} contended names: zero failures"),
                measured: match r.contended {
                    true => format!("{} failures", r.failures),
                    false => format!("{} failures, not every name contended", r.failures),
                },
                met: Some(r.failures == 0 && r.contended),
            },
            Verdict {
                target: format!("{n} contended names: subscriptions back to baseline"),
                measured: format!("{} → {} channels", r.channels.0, r.channels.2),
                met: Some(r.channels.2 <= r.channels.0),
            },
            Verdict {
                target: format!("{n} contended names: memory back to baseline (RSS within 4 MiB)"),
                measured: format!(
                    "RSS {rss_delta:+} KiB (live heap {heap_delta:+}, allocator metadata {metadata_delta:+}); a second burst {again_delta:+} KiB"
                ),
                met: Some(rss_delta <= RSS_SLACK_KIB as i64),
            },
        ]
    }
}

fn not_run(target: &str) -> Verdict {
    Verdict {
        target: target.to_owned(),
        measured: "not run".to_owned(),
        met: None,
    }
}

impl Verdict {
    /// A line of the printed summary.
    pub fn line(&self) -> String {
        let met = match self.met {
            Some(true) => "met",
            Some(false) => "NOT MET",
            None => "-",
        };
        format!("{:<66} {:<44} {met}", self.target, self.measured)
    }

    /// A JSON line.
    pub fn json(&self) -> String {
        let met = self.met.map_or("null".to_owned(), |m| m.to_string());
        format!(
            "{{\"target\":\"{}\",\"measured\":\"{}\",\"met\":{met}}}",
            self.target, self.measured
        )
    }
}

/// A many-leases run against the lease targets: all of them when it is the run they
/// are `targeted` at, else those every run must meet.
fn lease_verdicts(l: &LeaseFigures, targeted: bool) -> Vec<Verdict> {
    let n = l.asked;
    let mut verdicts = vec![Verdict {
        target: format!("{n} held leases: every one granted"),
        measured: format!("{} of {n} held", l.held),
        met: Some(l.held == n),
    }];
    if targeted {
        verdicts.extend(sized_verdicts(l));
    }
    verdicts.push(lateness_verdict(l));
    verdicts
}

/// The lease targets set for the largest run: memory and renewal calls per lease.
fn sized_verdicts(l: &LeaseFigures) -> [Verdict; 2] {
    let n = l.asked;
    [
        Verdict {
            target: format!("{n} held leases: ≤ 4 KiB server RSS per lease"),
            measured: format!("{:.0} B (peak {:.0} B)", l.rss_per_lease, l.peak_rss_per_lease),
            met: Some(l.rss_per_lease.max(l.peak_rss_per_lease) <= 4096.0),
        },
        Verdict {
            target: format!("{n} held leases: ≤ 1 Redis call per 100 leases per period"),
            measured: format!("{:.2} calls", l.calls_per_100_per_period),
            met: Some(l.calls_per_100_per_period <= 1.0),
        },
    ]
}

/// Whether every lease of a run was renewed on time and none lost.
fn lateness_verdict(l: &LeaseFigures) -> Verdict {
    let n = l.asked;
    // Late: confirmed past the period and half of it, the bound the server itself
    // sets a round's confirmation (`Watchdog::misses_its_round`: a grant that would
    // be confirmed later is renewed at once); a lease is told lost at the timeout.
    Verdict {
        target: format!("{n} held leases: none renewed late, none lost"),
        measured: format!(
            "longest gap {:.0} of a {:.0} ms period, {} lost",
            l.longest_gap_ms, l.period_ms, l.lost
        ),
        met: Some(l.longest_gap_ms <= l.period_ms * 1.5 && l.lost == 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scale::Heap;

    fn figures(cycles_per_sec: f64) -> Figures {
        Figures {
            cycles_per_sec,
            acquires: 10_000,
            acquire_p50_us: 100,
            acquire_p99_us: 20_000,
            acquire_max_us: 30_000,
            handoff_p50_us: 250,
            handoff_p99_us: 900,
            handoffs: 1000,
            fairness: 1.0,
            overlaps: 0,
            errors: 0,
            cpu_us_per_cycle: 90.0,
            server_us_per_cycle: 35.0,
            store_us_per_cycle: 25.0,
        }
    }

    fn verdict<'a>(verdicts: &'a [Verdict], starts: &str) -> &'a Verdict {
        verdicts
            .iter()
            .find(|v| v.target.starts_with(starts))
            .expect("a verdict")
    }

    #[test]
    fn ratios_are_taken_within_the_run() {
        let mut run = Run::default();
        run.add("uncontended", "latchkey", 64, 0, figures(20_000.0));
        run.add("uncontended", "redisson", 64, 0, figures(50_000.0));
        run.add("uncontended", "etcd", 64, 0, figures(2_000.0));
        let v = run.verdicts();
        let direct = verdict(&v, "uncontended C=64: latchkey ≥ 0.5×");
        assert_eq!(direct.met, Some(false));
        assert!(direct.measured.ends_with("= 0.40×"), "{}", direct.measured);
        assert_eq!(verdict(&v, "uncontended C=64: latchkey ≥ 8× etcd").met, Some(true));
        // Rows not run are said to be so, not judged.
        assert_eq!(verdict(&v, "hot fair C=64: ≥ 5000").met, None);
        assert_eq!(verdict(&v, "hot locks").met, None);
    }

    /// The repeats of a row against those of the row it is set against, pair by pair
    /// (they took their turns together), and the median of those ratios: not the ratio
    /// of two medians, which may come from different minutes of the run.
    #[test]
    fn ratios_are_paired_within_each_repeat() {
        let mut run = Run::default();
        let runs = |cycles: [f64; 3]| cycles.map(figures).to_vec();
        let (latchkey, direct) = (
            runs([25_000.0, 10_000.0, 30_000.0]),
            runs([20_000.0, 40_000.0, 60_000.0]),
        );
        // The rows show their runs of median cycles: 25 000 and 40 000 (0.63×).
        run.add_repeated("uncontended", "latchkey", 64, 0, latchkey[0], latchkey);
        run.add_repeated("uncontended", "redisson", 64, 0, direct[1], direct);
        let v = run.verdicts();
        let paired = verdict(&v, "uncontended C=64: latchkey ≥ 0.5×");
        // 1.25×, 0.25× and 0.50× by repeat.
        assert_eq!(
            paired.measured,
            "30000 / 60000 cycles/s = 0.50× (repeats 1.25, 0.25, 0.50)"
        );
        assert_eq!(paired.met, Some(true));
    }

    /// A repeat in which a task had no grant (fairness `inf`) fails the target, though
    /// the median of the repeats is within it, and every repeat's value is shown.
    #[test]
    fn a_repeat_with_a_task_left_without_grants_fails_the_fairness_target() {
        let mut run = Run::default();
        let runs: Vec<Figures> = [1.03, 1.04, f64::INFINITY]
            .map(|fairness| Figures {
                fairness,
                ..figures(8_000.0)
            })
            .to_vec();
        run.add_repeated("hot", "latchkey-fair", 64, 0, runs[1], runs);
        let v = run.verdicts();
        let fair = verdict(&v, "hot fair C=64: max/min grants");
        assert_eq!(fair.measured, "1.04× (repeats 1.03, 1.04, inf)");
        assert_eq!(fair.met, Some(false));
    }

    /// A target is not met on a row that failed cycles, its own or its peer's: a peer's
    /// errors make its rate look low, not latchkey's high.
    #[test]
    fn errors_in_either_row_fail_a_target() {
        let mut run = Run::default();
        run.add("uncontended", "latchkey", 64, 0, figures(40_000.0));
        let failing = Figures {
            errors: 2,
            ..figures(50_000.0)
        };
        run.add("uncontended", "redisson", 64, 0, failing);
        let v = run.verdicts();
        let ratio = verdict(&v, "uncontended C=64: latchkey ≥ 0.5×");
        assert_eq!(ratio.met, Some(false));
        assert!(
            ratio.measured.ends_with("= 0.80× (2 errors or overlaps in its rows)"),
            "{}",
            ratio.measured
        );
    }

    #[test]
    fn a_cycles_cost_is_set_against_the_direct_protocols() {
        let mut run = Run::default();
        run.add("uncontended", "latchkey", 64, 0, figures(20_000.0));
        let direct = Figures {
            cpu_us_per_cycle: 30.0,
            store_us_per_cycle: 12.5,
            ..figures(50_000.0)
        };
        run.add("uncontended", "redisson", 64, 0, direct);
        let costs = run.costs();
        assert_eq!(costs.len(), 1, "{costs:?}");
        assert!(costs[0].ends_with(": 3.0× (2.0×)"), "{}", costs[0]);
    }

    /// A cost line sets the runs of one repeat against each other, not the two rows'
    /// shown runs, which may come from repeats minutes apart.
    #[test]
    fn a_cycles_cost_is_taken_within_one_repeat() {
        let run_of = |rate, cpu| Figures {
            cpu_us_per_cycle: cpu,
            store_us_per_cycle: 10.0,
            ..figures(rate)
        };
        let mut run = Run::default();
        // latchkey's median rate is its first repeat's; the direct protocol's, its second's.
        let latchkey = vec![run_of(20_000.0, 90.0), run_of(30_000.0, 60.0), run_of(10_000.0, 100.0)];
        let direct = vec![run_of(50_000.0, 30.0), run_of(55_000.0, 10.0), run_of(60_000.0, 20.0)];
        run.add_repeated("uncontended", "latchkey", 64, 0, latchkey[0], latchkey);
        run.add_repeated("uncontended", "redisson", 64, 0, direct[1], direct);
        let costs = run.costs();
        assert_eq!(costs.len(), 1, "{costs:?}");
        assert!(costs[0].ends_with(": 3.0× (1.0×)"), "{}", costs[0]);
    }

    #[test]
    fn the_floor_sits_between_the_direct_protocol_and_latchkey() {
        let mut run = Run::default();
        run.add("uncontended", "latchkey", 64, 0, figures(20_000.0));
        run.add("uncontended", "redisson", 64, 0, figures(50_000.0));
        let floor = Figures {
            cpu_us_per_cycle: 50.0,
            server_us_per_cycle: 15.0,
            store_us_per_cycle: 0.0,
            ..figures(40_000.0)
        };
        run.add("uncontended", "grpc-floor", 64, 0, floor);
        run.add("hot", "latchkey", 64, 0, figures(3_000.0));
        run.add("hot", "redisson", 64, 0, figures(6_000.0));
        run.add("hot", "grpc-floor", 64, 0, figures(4_500.0));
        let costs = run.costs();
        let hot = costs
            .iter()
            .find(|l| l.starts_with("hot C=64 grpc-floor"))
            .expect("a hot floor line");
        assert!(hot.contains("4500 grants/s = 0.75× the direct protocol"), "{hot}");
        assert!(hot.contains("latchkey makes 0.67× the floor's grants"), "{hot}");
        let line = costs.iter().find(|l| l.contains("grpc-floor")).expect("a floor line");
        assert!(line.contains("40000 cycles/s = 0.80× the direct protocol"), "{line}");
        assert!(
            line.contains("latchkey makes 0.50× the floor's cycles, spending +40 µs (server +20, store +25)"),
            "{line}"
        );
    }

    #[test]
    fn memory_is_judged_on_the_first_burst_and_the_second_is_shown() {
        let mut run = Run::default();
        run.set_names(&names(true));
        let v = run.verdicts();
        let memory = verdict(&v, "20000 contended names: memory back");
        assert_eq!(memory.met, Some(false));
        assert_eq!(
            memory.measured,
            "RSS +8000 KiB (live heap +1000, allocator metadata +4500); a second burst +500 KiB"
        );
        assert_eq!(verdict(&v, "20000 contended names: subscriptions").met, Some(true));
        assert_eq!(verdict(&v, "20000 contended names: zero failures").met, Some(true));
    }

    #[test]
    fn a_burst_whose_waiters_did_not_all_listen_fails_the_failures_target() {
        let mut run = Run::default();
        run.set_names(&names(false));
        let v = run.verdicts();
        let failures = verdict(&v, "20000 contended names: zero failures");
        assert_eq!(failures.met, Some(false));
        assert_eq!(failures.measured, "0 failures, not every name contended");
    }

    /// A many-names result with no failure, its waiters all listening or not.
    fn names(contended: bool) -> Names {
        Names {
            names: 20_000,
            failures: 0,
            contended,
            channels: (13, 20_013, 13),
            rss_kib: (26_000, 28_000, 62_000, 34_000),
            peak_kib: 280_000,
            rss_again_kib: 34_500,
            heap: (
                Heap {
                    live: 14_000,
                    resident: 18_000,
                    metadata: 2_000,
                },
                Heap {
                    live: 15_000,
                    resident: 23_000,
                    metadata: 6_500,
                },
            ),
        }
    }

    #[test]
    fn an_overlap_anywhere_fails_the_target() {
        let mut run = Run::default();
        run.add("hot", "latchkey", 64, 0, figures(3_000.0));
        run.add(
            "hot",
            "rslock",
            64,
            1,
            Figures {
                overlaps: 2,
                ..figures(500.0)
            },
        );
        let v = run.verdicts();
        assert_eq!(verdict(&v, "hot locks").met, Some(false));
        assert_eq!(verdict(&v, "hot mutex C=64: acquire-wait").met, Some(true));
    }

    #[test]
    fn a_latchkey_wait_as_long_as_the_recheck_fails_the_check() {
        let mut run = Run::default();
        run.add("hot", "latchkey-fair-2", 16, 0, figures(2_000.0));
        run.add(
            "hot",
            "redisson",
            64,
            1,
            Figures {
                acquire_max_us: 1_500_000,
                ..figures(400.0)
            },
        );
        let v = run.verdicts();
        assert_eq!(
            verdict(&v, "latchkey rows").met,
            Some(true),
            "a peer's long wait is its own"
        );
        run.add(
            "hot",
            "latchkey-fair-2",
            16,
            0,
            Figures {
                acquire_max_us: 1_010_690,
                ..figures(2_000.0)
            },
        );
        let v = run.verdicts();
        let stalled = verdict(&v, "latchkey rows");
        assert_eq!(stalled.met, Some(false));
        assert_eq!(
            stalled.measured,
            "longest 1010.7 ms (hot latchkey-fair-2 C=16 hold 0ms)"
        );
    }

    #[test]
    fn a_handoff_target_with_no_handoff_measured_is_not_met() {
        let mut run = Run::default();
        let none = Figures {
            handoffs: 0,
            handoff_p50_us: 0,
            handoff_p99_us: 0,
            ..figures(300.0)
        };
        run.add("cross-replica", "latchkey-2", 2, 0, none);
        let v = run.verdicts();
        let cross = verdict(&v, "cross-replica");
        assert_eq!((cross.met, cross.measured.as_str()), (Some(false), "nothing measured"));
    }

    #[test]
    fn an_acquire_target_with_no_acquire_measured_is_not_met() {
        let mut run = Run::default();
        let none = Figures {
            acquires: 0,
            acquire_p50_us: 0,
            acquire_p99_us: 0,
            ..figures(0.0)
        };
        run.add("hot", "latchkey", 64, 0, none);
        let v = run.verdicts();
        let wait = verdict(&v, "hot mutex C=64: acquire-wait p99");
        assert_eq!(wait.met, Some(false));
    }

    #[test]
    fn an_error_in_any_row_fails_the_check() {
        let mut run = Run::default();
        run.add("hot", "latchkey", 64, 0, figures(3_000.0));
        assert_eq!(verdict(&run.verdicts(), "every row: no failed").met, Some(true));
        run.add(
            "uncontended",
            "etcd",
            64,
            0,
            Figures {
                errors: 3,
                ..figures(500.0)
            },
        );
        let v = run.verdicts();
        let errors = verdict(&v, "every row: no failed");
        assert_eq!(
            (errors.met, errors.measured.as_str()),
            (Some(false), "3 errors in 2 rows")
        );
    }

    /// A many-leases result of 100 000 leases asked, `held` of them held, with these
    /// bytes of RSS per lease held and at the height.
    fn leases(held: usize, rss_per_lease: f64, peak_rss_per_lease: f64) -> Leases {
        Leases {
            asked: 100_000,
            held,
            rss_per_lease,
            peak_rss_per_lease,
            calls_per_100_per_period: 0.2,
            calls_per_sec: 6.0,
            commands_per_sec: 600.0,
            redis_cpu_percent: 5.0,
            lost: 0,
            fill_secs: 10.0,
            slowest_round_ms: 2_500.0,
            longest_gap_ms: 11_200.0,
            period_ms: 10_000.0,
        }
    }

    /// The verdict on `target` of a run whose many-leases result is `l`: met, and what
    /// was measured.
    fn lease_verdict(l: Leases, target: &str) -> (Option<bool>, String) {
        let mut run = Run::default();
        run.add_leases(&l);
        let v = run.verdicts();
        let found = verdict(&v, target);
        (found.met, found.measured.clone())
    }

    #[test]
    fn leases_not_all_granted_fail_the_lease_targets() {
        assert_eq!(
            lease_verdict(
                leases(95_000, 3_000.0, 3_100.0),
                "100000 held leases: every one granted"
            ),
            (Some(false), "95000 of 100000 held".to_owned())
        );
    }

    /// A lease confirmed past its period and half of it was renewed late, though none
    /// was lost.
    #[test]
    fn a_renewal_half_a_period_late_fails_the_lateness_target() {
        let target = "100000 held leases: none renewed late";
        let on_time = leases(100_000, 3_300.0, 3_400.0);
        let late = Leases {
            longest_gap_ms: 15_100.0,
            ..on_time
        };
        let verdicts = [on_time, late].map(|l| lease_verdict(l, target));
        assert_eq!(
            verdicts[0],
            (Some(true), "longest gap 11200 of a 10000 ms period, 0 lost".to_owned())
        );
        assert_eq!(verdicts[1].0, Some(false));
    }

    /// Each many-leases run is judged on what every run must read, not only the
    /// largest: 10 000 leases with one lost beside 100 000 without. The memory target
    /// reads the largest only.
    #[test]
    fn every_many_leases_run_is_judged() {
        let mut run = Run::default();
        let small = Leases {
            asked: 10_000,
            held: 10_000,
            lost: 1,
            ..leases(100_000, 3_300.0, 3_400.0)
        };
        run.add_leases(&small);
        run.add_leases(&leases(100_000, 3_300.0, 3_400.0));
        let v = run.verdicts();
        assert_eq!(verdict(&v, "10000 held leases: none renewed late").met, Some(false));
        assert_eq!(verdict(&v, "100000 held leases: none renewed late").met, Some(true));
        assert!(!v.iter().any(|v| v.target.starts_with("10000 held leases: ≤")));
    }

    /// The memory a server must be given is its height: a renewal round's own copies
    /// of the leases' keys count.
    #[test]
    fn a_peak_over_4_kib_per_lease_fails_the_memory_target() {
        let target = "100000 held leases: ≤ 4 KiB server RSS per lease";
        assert_eq!(
            lease_verdict(leases(100_000, 3_300.0, 4_950.0), target),
            (Some(false), "3300 B (peak 4950 B)".to_owned())
        );
    }
}
