//! Human-readable renderings of `LockState` for `describe`, `list` and `watch`.

use std::fmt::Write;
use std::time::Duration;

use latchkey_client::{LockKind, LockState};

/// `mutex`, `fair`, … or `-` for a free lock.
pub fn kind(kind: i32) -> String {
    match LockKind::try_from(kind) {
        Ok(LockKind::Unspecified) => "-".into(),
        Ok(kind) => kind.as_str_name().trim_start_matches("LOCK_KIND_").to_lowercase(),
        Err(_) => format!("kind {kind}"),
    }
}

/// A proto duration to the millisecond, or `-` when unset.
pub fn ttl(ttl: Option<&prost_types::Duration>) -> String {
    let Some(std) = ttl.and_then(latchkey_client::duration_from_proto) else {
        return "-".into();
    };
    let millis = u64::try_from(std.as_millis()).unwrap_or(u64::MAX);
    humantime::format_duration(Duration::from_millis(millis)).to_string()
}

/// `owner` with its control characters escaped: owners written straight into Redis (a
/// Redisson client's hash field) are not checked by the server, and an escape sequence
/// must not reach the operator's terminal as one.
fn printable(owner: &str) -> String {
    owner
        .chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Holders as `owner×count`, comma-separated.
fn holders(state: &LockState) -> String {
    let list: Vec<String> = state
        .holders
        .iter()
        .map(|h| format!("{}×{}", printable(&h.owner), h.hold_count))
        .collect();
    list.join(",")
}

/// One line, for `watch`.
pub fn summary(state: &LockState) -> String {
    let status = if state.locked { "locked" } else { "free" };
    format!(
        "{} {status} kind={} holders=[{}] waiters={} token={} ttl={}",
        state.name,
        kind(state.kind),
        holders(state),
        state.waiters.len(),
        state.last_fencing_token,
        ttl(state.ttl.as_ref()),
    )
}

/// Several lines, for `describe`.
pub fn details(state: &LockState) -> String {
    let mut out = String::new();
    let status = if state.locked { "locked" } else { "free" };
    let _ = writeln!(out, "lock:          {}", state.name);
    let _ = writeln!(out, "state:         {status}");
    let _ = writeln!(out, "kind:          {}", kind(state.kind));
    let _ = writeln!(out, "ttl:           {}", ttl(state.ttl.as_ref()));
    let _ = writeln!(out, "fencing token: {}", state.last_fencing_token);
    let _ = writeln!(out, "holders:       {}", state.holders.len());
    for h in &state.holders {
        let ttl = ttl(h.ttl.as_ref());
        let _ = writeln!(out, "  {}  holds={}  ttl={ttl}", printable(&h.owner), h.hold_count);
    }
    let _ = writeln!(out, "waiters:       {}", state.waiters.len());
    for w in &state.waiters {
        let _ = writeln!(out, "  {}. {}", w.position, printable(&w.owner));
    }
    out
}

/// An aligned table, for `list`.
pub fn table(locks: &[LockState]) -> String {
    let width = locks.iter().map(|l| l.name.len()).max().unwrap_or(0).max(4);
    let tokens: Vec<String> = locks.iter().map(|l| l.last_fencing_token.to_string()).collect();
    let token_width = tokens.iter().map(String::len).max().unwrap_or(0).max(5);
    let mut out = format!(
        "{:<width$}  {:<9}  {:>7}  {:>7}  {:>token_width$}  TTL\n",
        "NAME", "KIND", "HOLDERS", "WAITERS", "TOKEN"
    );
    for (l, token) in locks.iter().zip(&tokens) {
        let _ = writeln!(
            out,
            "{:<width$}  {:<9}  {:>7}  {:>7}  {token:>token_width$}  {}",
            l.name,
            kind(l.kind),
            l.holders.len(),
            l.waiters.len(),
            ttl(l.ttl.as_ref()),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_client::Holder;

    #[test]
    fn formats_states() {
        let state = LockState {
            name: "orders".into(),
            kind: LockKind::Fair as i32,
            locked: true,
            holders: vec![Holder {
                owner: "o1".into(),
                hold_count: 2,
                ttl: Some(prost_types::Duration {
                    seconds: 29,
                    nanos: 512_345_678,
                }),
            }],
            last_fencing_token: 42,
            ..LockState::default()
        };
        let line = summary(&state);
        assert!(line.contains("orders locked kind=fair holders=[o1×2]"), "{line}");
        assert!(details(&state).contains("holds=2  ttl=29s 512ms"));
        assert!(table(&[state]).contains("orders"));
        assert_eq!(kind(0), "-");
    }

    #[test]
    fn escapes_control_characters_of_owners() {
        let state = LockState {
            name: "orders".into(),
            locked: true,
            holders: vec![Holder {
                owner: "svc\u{1b}[2J:1".into(),
                hold_count: 1,
                ttl: None,
            }],
            ..LockState::default()
        };
        assert!(
            summary(&state).contains("holders=[svc\\u{1b}[2J:1×1]"),
            "{}",
            summary(&state)
        );
        assert!(!details(&state).contains('\u{1b}'));
    }
}
