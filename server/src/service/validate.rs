//! Turns a proto `Open` into a checked `lock::Request`; each rejection names its field.

use crate::error::Error;
use crate::keys::{Keys, LockKeys, READ_TIMEOUT_MARKER};
use crate::lock::{Kind, Request};
use crate::service::SERVER_ID_PREFIX;
use latchkey_proto::v1::{LockKind, Open};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, AtomicUsize};
use std::sync::OnceLock;
use std::time::Duration;

/// Longest lock name, in bytes.
pub const MAX_NAME_LEN: usize = 1024;
/// Longest owner id, in bytes.
pub const MAX_OWNER_LEN: usize = 1024;
/// Longest fixed lease: Redis refuses expiries far beyond it, and no lock should
/// outlive its holder by more.
pub const MAX_LEASE: Duration = Duration::from_secs(365 * 86_400);
/// Most names in one multi-lock.
pub const MAX_NAMES: usize = 64;
/// Longest `page_token`, in bytes.
pub const MAX_PAGE_TOKEN_LEN: usize = MAX_NAME_LEN;

/// Checks `open`. `fresh_id` names this stream: it is the hold id, and the owner when
/// the request gives none. `longest_redlock`: the longest fixed RedLock lease
/// (`--redlock-restart-delay`, when set).
pub fn open(open: Open, keys: &Keys, longest_redlock: Option<Duration>, fresh_id: String) -> Result<Request, Error> {
    let kind = kind(open.kind)?;
    if open.redlock && (kind != Kind::Mutex || !open.names.is_empty()) {
        return Err(Error::invalid("open.redlock", "takes one LOCK_KIND_MUTEX name"));
    }
    let (permits, limit) = permits(kind, open.permits, open.limit)?;
    let (keys, multi, order) = if open.names.is_empty() {
        // An empty list of names, as a client's multi-lock of none sends it, is this.
        if open.name.is_empty() {
            return Err(Error::invalid(
                "open.name",
                "must not be empty (nor open.names, for a multi-lock)",
            ));
        }
        (lock_name("open.name", &open.name, keys)?, Vec::new(), Vec::new())
    } else {
        multi(kind, &open.name, &open.names, keys)?
    };
    let wait = open
        .wait_timeout
        .map(|d| duration("open.wait_timeout", d))
        .transpose()?;
    // In whole milliseconds, as Redis keeps it: the server's end of the lease and
    // `acquired.lease` then never run past Redis's.
    let whole_ms = |l: Duration| Duration::from_millis(u64::try_from(l.as_millis()).unwrap_or(u64::MAX));
    let fixed_lease = open
        .lease
        .map(|d| duration("open.lease", d).map(whole_ms))
        .transpose()?;
    if fixed_lease.is_some_and(|l| l < Duration::from_millis(1) || l > MAX_LEASE) {
        return Err(Error::invalid(
            "open.lease",
            "must be between 1ms and 365 days when set",
        ));
    }
    // A RedLock grant is valid for its lease less the time its try and its fence raise
    // took (up to the nodes' timeout each) and the drift allowed: a shorter lease is
    // never valid once granted, and its waiter would take and give back the lock on
    // every node, again and again.
    let redlock_floor = |l| crate::lock::redlock::drift(l) + 2 * crate::lock::redlock::node_timeout(l);
    if open.redlock && fixed_lease.is_some_and(|l| l <= redlock_floor(l)) {
        return Err(Error::invalid(
            "open.lease",
            "a RedLock lease must be longer than a try and its fence raise may take on the nodes (a tenth of it each, at least 5ms) plus the clock drift allowed for it (1% of it plus 2ms)",
        ));
    }
    // A restarted node sits out no longer than that: a lease past it could be
    // forgotten by a node that counts again, and granted twice.
    if let (true, Some(lease), Some(longest)) = (open.redlock, fixed_lease, longest_redlock) {
        if lease > longest {
            return Err(Error::invalid(
                "open.lease",
                format!(
                    "a RedLock lease may be at most {}ms, the server's --redlock-restart-delay (a restarted node counts for no majority that long)",
                    longest.as_millis()
                ),
            ));
        }
    }
    let own_owner = open.owner.is_empty();
    let owner = owner(open.owner, &fresh_id)?;
    Ok(Request {
        keys,
        kind,
        wait,
        fixed_lease,
        owner,
        own_owner,
        hold_id: fresh_id,
        permits,
        limit,
        multi,
        order,
        redlock: open.redlock,
        doubted: AtomicBool::new(false),
        gave_back_unknown: AtomicBool::new(false),
        claimed: OnceLock::new(),
        unconfirmed: OnceLock::new(),
        pass_recorded: AtomicBool::new(false),
        passed_on: AtomicBool::new(false),
        own_grant: AtomicBool::new(false),
        multi_blocked: AtomicUsize::new(0),
        multi_sorted_tries: AtomicU8::new(0),
        queued: AtomicBool::new(false),
        queued_by_recording: OnceLock::new(),
        trying: AtomicU32::new(0),
        gave_back: AtomicU32::new(0),
    })
}

/// A multi-lock's names: checked, sorted into the order they are taken, and the
/// client's order as indexes into that.
fn multi(
    kind: Kind,
    name: &str,
    names: &[String],
    keys: &Keys,
) -> Result<(LockKeys, Vec<LockKeys>, Vec<usize>), Error> {
    if !name.is_empty() {
        return Err(Error::invalid("open.name", "must be empty when open.names is set"));
    }
    if kind != Kind::Mutex {
        return Err(Error::invalid("open.kind", "a multi-lock takes LOCK_KIND_MUTEX names"));
    }
    if names.len() < 2 || names.len() > MAX_NAMES {
        return Err(Error::invalid(
            "open.names",
            format!("must hold 2 to {MAX_NAMES} names"),
        ));
    }
    // Taken by cluster slot, then by name: one order for every client, in which the
    // names of one slot stand together, for one script to take them.
    let mut taken = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let keys = lock_name("open.names", n, keys).map_err(|e| e.at_index(i))?;
            Ok((keys.slot(), n, keys))
        })
        .collect::<Result<Vec<_>, Error>>()?;
    taken.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
    // A name's repeat stands next to it in that order.
    if let Some(repeat) = taken.windows(2).find(|w| w[0].1 == w[1].1) {
        let mut at = names
            .iter()
            .enumerate()
            .filter(|(_, n)| *n == repeat[0].1)
            .map(|(i, _)| i);
        let (first, again) = (at.next().unwrap_or(0), at.next().unwrap_or(0));
        return Err(Error::invalid("open.names", format!("repeats the name at index {first}")).at_index(again));
    }
    let order = names
        .iter()
        .filter_map(|n| taken.iter().position(|t| t.1 == n))
        .collect();
    let multi: Vec<LockKeys> = taken.into_iter().map(|(_, _, k)| k).collect();
    Ok((multi[0].clone(), multi, order))
}

/// The permits and limit of a semaphore request (1 permit by default); other kinds
/// take neither.
fn permits(kind: Kind, permits: u32, limit: u32) -> Result<(u32, u32), Error> {
    if kind != Kind::Semaphore {
        if permits != 0 {
            return Err(Error::invalid("open.permits", "applies only to LOCK_KIND_SEMAPHORE"));
        }
        if limit != 0 {
            return Err(Error::invalid("open.limit", "applies only to LOCK_KIND_SEMAPHORE"));
        }
        return Ok((1, 0));
    }
    if limit == 0 {
        return Err(Error::invalid(
            "open.limit",
            "must be at least 1 for LOCK_KIND_SEMAPHORE",
        ));
    }
    let permits = permits.max(1);
    if permits > limit {
        return Err(Error::invalid(
            "open.permits",
            format!("must not exceed open.limit ({limit})"),
        ));
    }
    Ok((permits, limit))
}

/// Checks a lock name in field `field` and builds its keys.
pub fn lock_name(field: &'static str, name: &str, keys: &Keys) -> Result<LockKeys, Error> {
    if name.is_empty() {
        return Err(Error::invalid(field, "must not be empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(Error::invalid(field, format!("must be at most {MAX_NAME_LEN} bytes")));
    }
    if name.chars().any(char::is_control) {
        return Err(Error::invalid(field, "must not contain control characters"));
    }
    // A read hold's timeout keys, `{<lock>}:<owner>:rwlock_timeout:<n>` in Redisson's
    // layout, would otherwise be lock names too, under the prefix `{<lock>}`: a reader
    // of one lock would overwrite (SET) the lock of whoever holds that name.
    if name.contains(READ_TIMEOUT_MARKER) {
        return Err(Error::invalid(
            field,
            format!("must not contain \"{READ_TIMEOUT_MARKER}\": such names are read locks' timeout keys"),
        ));
    }
    if !braces_pair_up(name) {
        return Err(Error::invalid(
            field,
            "braces must pair up into non-empty hash tags such as {tag}: no {}, no unclosed or nested {, no stray }",
        ));
    }
    let keys = keys.lock_checked(name).ok_or_else(|| {
        Error::invalid(
            field,
            "braces must form a non-empty hash tag such as {tag}, so every key of the lock shares one cluster slot",
        )
    })?;
    if whole_tag(&keys.lock) {
        return Err(Error::invalid(
            field,
            "must not be one whole hash tag such as {tag}: its keys would be those of the lock tag",
        ));
    }
    match keys.record_prefix() {
        Some(record) => Err(Error::invalid(
            field,
            format!(
                "must not start with \"{record}:\" (after the server's key prefix): such keys are other locks' records"
            ),
        )),
        None => Ok(keys),
    }
}

/// Whether a lock key is one whole hash tag, `{X}` with no other brace. Redisson's
/// naming rule gives it every key and channel of the lock `X` (`prefix:{X}` for both):
/// the unlock channel, the claims, the fencing counter, the break floor. A release of
/// `X` would grant a claim of a waiter of `{X}` while another held it, and ForceRelease
/// of `X` break the holders of `{X}`.
fn whole_tag(lock: &str) -> bool {
    lock.strip_prefix('{')
        .and_then(|l| l.strip_suffix('}'))
        .is_some_and(|inner| !inner.contains(['{', '}']))
}

/// Whether every brace of `name` belongs to a non-empty `{tag}`, one after another.
/// Redis reads the hash tag from the first `{` to the next `}`; a stray `}` (or one of
/// a nested pair) is part of no tag, and Redisson's naming rule, which braces the name
/// in derived keys only when it holds no `{`, gives `X}` the keys of `{X}}`: two locks
/// that share their channel, claims, counter and records. Checked on the name the
/// client gave; the server's key prefix is the operator's.
pub(crate) fn braces_pair_up(name: &str) -> bool {
    let mut tag: Option<usize> = None;
    for c in name.chars() {
        tag = match (c, tag) {
            ('{', None) => Some(0),
            ('}', Some(len)) if len > 0 => None,
            ('{' | '}', _) => return false,
            (_, Some(len)) => Some(len + 1),
            (_, None) => None,
        };
    }
    tag.is_none()
}

fn kind(raw: i32) -> Result<Kind, Error> {
    match LockKind::try_from(raw) {
        Ok(LockKind::Unspecified | LockKind::Mutex) => Ok(Kind::Mutex),
        Ok(LockKind::Fair) => Ok(Kind::Fair),
        Ok(LockKind::Read) => Ok(Kind::Read),
        Ok(LockKind::Write) => Ok(Kind::Write),
        Ok(LockKind::Semaphore) => Ok(Kind::Semaphore),
        Err(_) => Err(Error::invalid("open.kind", format!("unknown lock kind {raw}"))),
    }
}

fn owner(owner: String, fresh_id: &str) -> Result<String, Error> {
    if owner.is_empty() {
        return Ok(fresh_id.to_owned());
    }
    if owner.len() > MAX_OWNER_LEN {
        return Err(Error::invalid(
            "open.owner",
            format!("must be at most {MAX_OWNER_LEN} bytes"),
        ));
    }
    if owner.chars().any(char::is_control) {
        return Err(Error::invalid("open.owner", "must not contain control characters"));
    }
    if owner.starts_with(SERVER_ID_PREFIX) {
        return Err(Error::invalid(
            "open.owner",
            format!("ids starting with \"{SERVER_ID_PREFIX}\" are made by the server for one stream alone; give an owner of your own to share holds"),
        ));
    }
    if owner == "mode" || owner.ends_with(":write") {
        return Err(Error::invalid(
            "open.owner",
            "\"mode\" and ids ending in \":write\" are reserved by the read/write lock layout",
        ));
    }
    Ok(owner)
}

/// A non-negative proto duration in field `field`.
pub fn duration(field: &'static str, d: prost_types::Duration) -> Result<Duration, Error> {
    // The proto's rule: seconds and nanos carry one sign.
    if (d.seconds > 0 && d.nanos < 0) || (d.seconds < 0 && d.nanos > 0) {
        return Err(Error::invalid(field, "seconds and nanos must not differ in sign"));
    }
    if d.seconds < 0 || d.nanos < 0 {
        return Err(Error::invalid(field, "must not be negative"));
    }
    if d.nanos >= 1_000_000_000 {
        return Err(Error::invalid(field, "nanos must be below one second"));
    }
    Duration::try_from(d).map_err(|e| Error::invalid(field, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_named(name: &str) -> Open {
        Open {
            name: name.to_owned(),
            ..Default::default()
        }
    }

    /// A malformed duration is told apart from a negative one.
    #[test]
    fn durations_name_what_is_wrong() {
        let message = |seconds, nanos| match duration("f", prost_types::Duration { seconds, nanos }) {
            Err(Error::InvalidArgument { field, reason, .. }) => {
                assert_eq!(field, "f");
                reason
            }
            other => panic!("{seconds}s {nanos}ns: {other:?}"),
        };
        assert!(message(1, -1).contains("sign"));
        assert!(message(-1, 1).contains("sign"));
        for (seconds, nanos) in [(-1, 0), (0, -1), (-1, -1)] {
            assert!(message(seconds, nanos).contains("negative"), "{seconds}s {nanos}ns");
        }
        assert!(message(0, 1_000_000_000).contains("nanos"));
        assert_eq!(
            duration("f", prost_types::Duration { seconds: 1, nanos: 5 }).unwrap(),
            Duration::new(1, 5)
        );
    }

    fn field_of(e: Error) -> &'static str {
        match e {
            Error::InvalidArgument { field, .. } => field,
            other => panic!("not invalid: {other:?}"),
        }
    }

    #[test]
    fn accepts_a_plain_open_with_defaults() {
        let r = open(open_named("orders"), &Keys::default(), None, "srv:1".into()).unwrap();
        assert_eq!(r.owner, "srv:1");
        assert_eq!(r.hold_id, "srv:1");
        assert_eq!(r.wait, None);
        assert_eq!(r.fixed_lease, None);
        // A multi-lock's names of one slot stand together in the taken order.
        let names = ["a{x}", "b", "c{x}"].map(String::from).to_vec();
        let r = open(
            Open {
                names,
                ..open_named("")
            },
            &Keys::default(),
            None,
            "s:3".into(),
        )
        .unwrap();
        let taken: Vec<&str> = r.multi.iter().map(LockKeys::name).collect();
        assert!(taken.windows(2).any(|w| w == ["a{x}", "c{x}"]), "{taken:?}");
        // A fixed lease counts whole milliseconds, as Redis does.
        let part = prost_types::Duration {
            seconds: 0,
            nanos: 1_900_000,
        };
        let r = open(
            Open {
                lease: Some(part),
                ..open_named("a")
            },
            &Keys::default(),
            None,
            "s:2".into(),
        )
        .unwrap();
        assert_eq!(r.fixed_lease, Some(Duration::from_millis(1)));
        assert_eq!(r.kind, Kind::Mutex);
    }

    #[test]
    fn every_bad_field_is_named() {
        let keys = Keys::default();
        let bad = |o: Open| field_of(open(o, &keys, None, "x".into()).unwrap_err());
        assert_eq!(bad(open_named("")), "open.name");
        assert_eq!(bad(open_named(&"a".repeat(1025))), "open.name");
        assert_eq!(bad(open_named("a\nb")), "open.name");
        assert_eq!(bad(open_named("{}")), "open.name");
        assert_eq!(bad(open_named("{orders}")), "open.name");
        assert_eq!(bad(open_named("{orders}:o:rwlock_timeout:1")), "open.name");
        for name in ["job}", "{job}}", "a{b", "a{{b}}", "{a{b}c}", "}{a}"] {
            assert_eq!(bad(open_named(name)), "open.name", "{name}");
        }
        for name in ["{a}{b}", "x{orders}", "{orders}:1", "a{b}c{d}e", "plain"] {
            assert!(open(open_named(name), &keys, None, "x".into()).is_ok(), "{name}");
        }
        let neg = prost_types::Duration { seconds: -1, nanos: 0 };
        assert_eq!(
            bad(Open {
                wait_timeout: Some(neg),
                ..open_named("a")
            }),
            "open.wait_timeout"
        );
        assert_eq!(
            bad(Open {
                lease: Some(neg),
                ..open_named("a")
            }),
            "open.lease"
        );
        assert_eq!(
            bad(Open {
                lease: Some(Default::default()),
                ..open_named("a")
            }),
            "open.lease"
        );
        assert_eq!(
            bad(Open {
                kind: 99,
                ..open_named("a")
            }),
            "open.kind"
        );
        assert_eq!(
            bad(Open {
                permits: 2,
                ..open_named("a")
            }),
            "open.permits"
        );
        assert_eq!(
            bad(Open {
                limit: 2,
                ..open_named("a")
            }),
            "open.limit"
        );
        assert_eq!(
            bad(Open {
                owner: "o\u{7}".into(),
                ..open_named("a")
            }),
            "open.owner"
        );
        assert_eq!(
            bad(Open {
                owner: "x".repeat(1025),
                ..open_named("a")
            }),
            "open.owner"
        );
        assert_eq!(
            bad(Open {
                owner: "o:write".into(),
                ..open_named("a")
            }),
            "open.owner"
        );
        assert_eq!(
            bad(Open {
                redlock: true,
                lease: Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 2_000_000
                }),
                ..open_named("a")
            }),
            "open.lease"
        );
        // Its try and its fence raise may each take 5 ms, and 2.1 ms of drift: none
        // would be left of 12 ms.
        assert_eq!(
            bad(Open {
                redlock: true,
                lease: Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 12_000_000
                }),
                ..open_named("a")
            }),
            "open.lease"
        );
        // No longer than a restarted node sits out.
        let redlock_for = |seconds| Open {
            redlock: true,
            lease: Some(prost_types::Duration { seconds, nanos: 0 }),
            ..open_named("a")
        };
        let longest = Some(Duration::from_secs(30));
        let err = open(redlock_for(31), &keys, longest, "x".into()).unwrap_err();
        assert_eq!(field_of(err), "open.lease");
        assert!(open(redlock_for(30), &keys, longest, "x".into()).is_ok());
        assert!(open(redlock_for(31), &keys, None, "x".into()).is_ok(), "no bound");
        // Another stream's own owner, as `acquired.owner` or Describe shows it.
        assert_eq!(
            bad(Open {
                owner: crate::service::new_server_id() + ":7",
                ..open_named("a")
            }),
            "open.owner"
        );
        let semaphore = LockKind::Semaphore as i32;
        assert_eq!(
            bad(Open {
                kind: semaphore,
                ..open_named("s")
            }),
            "open.limit"
        );
        assert_eq!(
            bad(Open {
                kind: semaphore,
                limit: 2,
                permits: 3,
                ..open_named("s")
            }),
            "open.permits"
        );
    }

    #[test]
    fn semaphore_permits_default_to_one() {
        let o = Open {
            kind: LockKind::Semaphore as i32,
            limit: 3,
            ..open_named("s")
        };
        let r = open(o, &Keys::default(), None, "x".into()).unwrap();
        assert_eq!((r.kind, r.permits, r.limit), (Kind::Semaphore, 1, 3));
    }

    #[test]
    fn accepts_the_longest_name_and_unicode() {
        assert!(open(open_named(&"é".repeat(512)), &Keys::default(), None, "x".into()).is_ok());
    }
}
