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
/// skipped until it can (an editor may be writing it).
pub async fn watch(
    paths: Vec<PathBuf>,
    loaded: Vec<Vec<u8>>,
    stop: CancellationToken,
    mut changed: impl FnMut(&[Vec<u8>]) + Send,
) {
    let mut last = loaded;
    let mut reported = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(RELOAD_INTERVAL) => {}
        }
        match read_all(&paths) {
            Ok(now) => {
                reported = false;
                if last != now {
                    changed(&now);
                    last = now;
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

/// Reads every file, naming the one that fails.
pub fn read_all(paths: &[PathBuf]) -> Result<Vec<Vec<u8>>, String> {
    paths
        .iter()
        .map(|p| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display())))
        .collect()
}
