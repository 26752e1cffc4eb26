//! The unary inspection and administration RPCs: `Describe`, `List`, `ForceRelease`.

use super::{convert, validate, Shared};
use crate::auth::{Action, Caller};
use crate::error::Error;
use fred::prelude::Value;
use futures::{StreamExt, TryStreamExt};
use latchkey_proto::v1::{
    DescribeRequest, ForceReleaseRequest, ForceReleaseResponse, ListRequest, ListResponse, LockState,
};
use std::future::Future;
use tonic::{Response, Status};

/// Default `page_size` of List.
pub const DEFAULT_PAGE_SIZE: usize = 100;
/// Largest `page_size` of List.
pub const MAX_PAGE_SIZE: usize = 1000;
/// Locks described at once while building a List page.
const DESCRIBE_CONCURRENCY: usize = 64;

/// Runs one unary RPC, recording its metrics and mapping its error.
pub async fn unary<T>(method: &'static str, f: impl Future<Output = Result<T, Error>>) -> Result<Response<T>, Status> {
    crate::metrics::rpc_started(method);
    let mut handled = Handled {
        method,
        code: tonic::Code::Cancelled,
    };
    let result = f.await.map(Response::new).map_err(Status::from);
    handled.code = result.as_ref().map_or_else(Status::code, |_| tonic::Code::Ok);
    result
}

/// Counts a unary call as handled however it ends: one the client gave up on (its
/// deadline passed, it cancelled) is dropped before its handler returns, and counts as
/// `CANCELLED`.
struct Handled {
    method: &'static str,
    code: tonic::Code,
}

impl Drop for Handled {
    fn drop(&mut self) {
        crate::metrics::rpc_handled(self.method, self.code);
    }
}

/// `Describe`: one lock's state, if `caller` may inspect it.
pub async fn describe(shared: &Shared, req: DescribeRequest, caller: &Caller) -> Result<LockState, Error> {
    let keys = shared.lock_for(&req.name, caller, Action::Inspect)?;
    Ok(convert::to_lock_state(shared.locks.describe(&keys).await?))
}

/// The most List calls one server runs at once. Each scans the whole key space, and
/// any identity may list its own names (`inspect` is a default action): without a
/// bound, a few clients' Lists in a loop would keep Redis busy with scans, every
/// tenant's grants and renewals waiting behind them. One over it is refused at once
/// (`RESOURCE_EXHAUSTED`), rather than queued on a server a scan is slowing already.
pub const MAX_LISTINGS: usize = 4;

/// `List`: the held locks under a prefix, sorted by name, one page at a time, if
/// `caller` may list it (asked once the arguments are known good, as every method
/// names a bad argument first). Each page scans the key space (every master of a
/// cluster): it is an operator's tool, not a hot path.
pub async fn list(shared: &Shared, req: ListRequest, caller: &Caller) -> Result<ListResponse, Error> {
    let page_size = match req.page_size as usize {
        0 => DEFAULT_PAGE_SIZE,
        n if n > MAX_PAGE_SIZE => return Err(Error::invalid("page_size", format!("must be at most {MAX_PAGE_SIZE}"))),
        n => n,
    };
    // The prefix first: a token can never start with a prefix longer than a name.
    if req.prefix.len() > validate::MAX_NAME_LEN {
        return Err(Error::invalid(
            "prefix",
            format!("must be at most {} bytes", validate::MAX_NAME_LEN),
        ));
    }
    // A token is the last name of the page before, so it starts with the prefix: one
    // of another listing would silently skip or end this one.
    if req.page_token.len() > validate::MAX_PAGE_TOKEN_LEN {
        return Err(Error::invalid("page_token", "is not a token this server returned"));
    }
    if !req.page_token.is_empty() && !req.page_token.starts_with(&req.prefix) {
        return Err(Error::invalid(
            "page_token",
            "is not a token of this listing (it must come from a List with the same prefix)",
        ));
    }
    caller.check_list(&req.prefix)?;
    let _listing = shared.listings.try_acquire().map_err(|_| {
        Error::ResourceExhausted(format!(
            "{MAX_LISTINGS} List calls are running on this server; try again when one has answered"
        ))
    })?;
    let backend = shared.locks.backend();
    let keys = backend.keys();
    let pattern = format!("{}*", glob_escape(&format!("{}{}", keys.prefix(), req.prefix)));
    let mut names: Vec<String> = backend
        .scan_locks(&pattern)
        .await?
        .into_iter()
        .filter_map(fred::types::Key::into_string)
        .filter_map(|key| keys.name_of(&key).map(str::to_owned))
        .filter(|name| name.as_str() > req.page_token.as_str())
        .collect();
    names.sort();
    names.dedup();
    let mut locks = Vec::with_capacity(page_size);
    let mut rest = names.into_iter();
    // Describe in chunks until the page is full: hashes that are not locks drop out.
    while locks.len() < page_size {
        let chunk: Vec<String> = rest.by_ref().take(page_size - locks.len()).collect();
        if chunk.is_empty() {
            break;
        }
        let states = futures::stream::iter(chunk)
            .map(|name| async move {
                // Only names Describe and ForceRelease take: a whole hash tag's keys
                // (a Redisson lock `{orders}`) are another lock's.
                match validate::lock_name("name", &name, keys) {
                    Ok(k) => shared.locks.describe(&k).await.map(Some),
                    Err(_) => Ok(None),
                }
            })
            .buffered(DESCRIBE_CONCURRENCY)
            .try_collect::<Vec<_>>()
            .await?;
        locks.extend(
            states
                .into_iter()
                .flatten()
                .filter(|s| s.locked())
                .map(convert::to_lock_state),
        );
    }
    let more = rest.next().is_some();
    let next_page_token = match locks.last() {
        Some(last) if more => last.name.clone(),
        _ => String::new(),
    };
    Ok(ListResponse { locks, next_page_token })
}

/// `ForceRelease`: Redisson's forceUnlock, if `caller` may break the lock (named in the
/// log line); every server tells the holders it serves.
pub async fn force_release(
    shared: &Shared,
    req: ForceReleaseRequest,
    caller: &Caller,
) -> Result<ForceReleaseResponse, Error> {
    let backend = shared.locks.backend().clone();
    let keys = shared.lock_for(&req.name, caller, Action::ForceRelease)?;
    let by = caller.name().to_owned();
    let redis_keys = [
        &keys.lock,
        &keys.channel(),
        &keys.queue(),
        &keys.timeouts(),
        &keys.rw_channel(),
        &keys.semaphore(),
        &keys.semaphore_channel(),
        &keys.fence(),
    ]
    .into_iter()
    .map(|k| k.as_str().into())
    .collect();
    let args = vec![
        Value::from(backend.publish_command()),
        Value::from(backend.keys().force_release_channel()),
        Value::from(crate::lock::millis(crate::lock::RECORD_GRACE)),
    ];
    let watchdog = shared.watchdog.clone();
    // In a task of its own, run to its end though the client gives up: the lock is
    // broken once the script is written, and the break is logged with who broke it.
    // Among the background tasks that shutdown waits for before it closes the Redis
    // connections: one under way then still finishes, is logged and is answered.
    let broken = shared.locks.background().spawn(async move {
        // The break floor, 0 when there was no lock. Never run twice (see `eval_once`).
        // A fencing counter that holds no count refuses the break before any write: the
        // name is no lock of latchkey's, as Acquire finds it.
        let floor: u64 = match backend
            .eval_once(&backend.scripts().force_release, redis_keys, args)
            .await
        {
            Err(Error::Redis(e)) if crate::lock::foreign_key(&e) => {
                return Err(Error::WrongKind { name: req.name.clone() })
            }
            floor => floor?,
        };
        if floor > 0 {
            tracing::warn!(lock = %req.name, by, "lock force-released");
            // Tell local holders now; other servers hear the script's message.
            watchdog.force_released(&keys.lock, floor);
        }
        Ok::<_, Error>(floor)
    });
    let floor = broken
        .await
        .map_err(|e| Error::Protocol(format!("the force release failed: {e}")))??;
    Ok(ForceReleaseResponse { released: floor > 0 })
}

/// Escapes Redis glob characters so a prefix matches only itself.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::glob_escape;

    #[test]
    fn glob_characters_are_escaped() {
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
        assert_eq!(glob_escape("plain:"), "plain:");
    }
}
