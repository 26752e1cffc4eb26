//! Reload on change: polls a set of files and hands their contents to a callback
//! whenever any of them changed. Polling (rather than inotify) also sees files
//! replaced through symlink swaps, as Kubernetes does for mounted Secrets.

use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often watched files are read again.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// Calls `changed` with the contents of every file in `paths` each time one of them
/// differs from what was last seen, until `stop`. `loaded` is what the caller parsed
/// at start: reading the files again here would take a change made in between as
/// the baseline and never apply it. A file that cannot be read is reported once and
/// skipped until it can (an editor may be writing it). A change is handed over once two
/// reads a poll apart agree: a file caught half-written can parse (an auth file cut
/// before an identity's `actions` would give it the default ones) and must not apply.
/// A read that hangs (logged after [`HUNG_READ`]) holds up the reloads until it ends,
/// and nothing else.
pub async fn watch(
    paths: Vec<PathBuf>,
    loaded: Vec<Vec<u8>>,
    stop: CancellationToken,
    mut changed: impl FnMut(&[Vec<u8>]) + Send,
) {
    let mut last = loaded;
    let mut pending: Option<Vec<Vec<u8>>> = None;
    let mut reported = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(RELOAD_INTERVAL) => {}
        }
        // Off the server's threads: a read may hang (a hung network mount, a FIFO put in
        // a file's place), and on a worker thread it would stop every task there.
        let reading = tokio::task::spawn_blocking({
            let paths = paths.clone();
            move || read_all(&paths)
        });
        let read = tokio::select! {
            _ = stop.cancelled() => return,
            read = until_read(reading, &paths) => read,
        };
        match read {
            Ok(now) => {
                reported = false;
                if last == now {
                    pending = None;
                } else if pending.as_ref() == Some(&now) {
                    changed(&now);
                    last = now;
                    pending = None;
                } else {
                    pending = Some(now);
                }
            }
            Err(e) if !reported => {
                tracing::warn!(error = %e, "cannot read a watched file; keeping what was loaded");
                reported = true;
            }
            Err(_) => {}
        }
    }
}

/// How long a read of the watched files may take before it is logged as hanging.
const HUNG_READ: Duration = Duration::from_secs(10);

/// The outcome of `reading`, once it ends; a read still going after [`HUNG_READ`] is
/// logged once: until it ends, no change to the files is applied.
async fn until_read(
    mut reading: tokio::task::JoinHandle<Result<Vec<Vec<u8>>, String>>,
    paths: &[PathBuf],
) -> Result<Vec<Vec<u8>>, String> {
    let read = match tokio::time::timeout(HUNG_READ, &mut reading).await {
        Ok(read) => read,
        Err(_) => {
            tracing::warn!(files = ?paths, "reading a watched file hangs; no change is applied until it ends");
            reading.await
        }
    };
    read.unwrap_or_else(|e| Err(format!("reading the watched files: {e}")))
}

/// Reads every file, naming the one that fails.
fn read_all(paths: &[PathBuf]) -> Result<Vec<Vec<u8>>, String> {
    paths
        .iter()
        .map(|p| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    /// A file caught mid-write once is not handed over; what it settles to is.
    #[tokio::test(start_paused = true)]
    async fn a_change_applies_once_two_reads_agree() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("auth.toml");
        std::fs::write(&path, "old").unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let watcher = tokio::spawn(watch(
            vec![path.clone()],
            vec![b"old".to_vec()],
            stop.clone(),
            move |now| {
                tx.send(now[0].clone()).unwrap();
            },
        ));
        let poll = || tokio::time::sleep(RELOAD_INTERVAL + Duration::from_millis(10));
        std::fs::write(&path, "half").unwrap();
        poll().await;
        std::fs::write(&path, "whole").unwrap();
        poll().await;
        assert!(rx.try_recv().is_err(), "nothing settled yet");
        poll().await;
        assert_eq!(rx.try_recv().unwrap(), b"whole");
        poll().await;
        assert!(rx.try_recv().is_err(), "handed over once");
        stop.cancel();
        watcher.await.unwrap();
    }
}
