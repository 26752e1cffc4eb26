//! Reload on change: polls a set of files and hands their contents to a callback
//! whenever any of them changed. Polling (rather than inotify) also sees files
//! replaced through symlink swaps, as Kubernetes does for mounted Secrets.

use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often watched files are read again.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// Calls `changed` with the contents of every file in `paths` each time one of them
/// changes, until `stop`. A file that cannot be read is reported once and skipped
/// until it can (an editor may be writing it).
pub async fn watch(paths: Vec<PathBuf>, stop: CancellationToken, mut changed: impl FnMut(&[Vec<u8>]) + Send) {
    let mut last = read_all(&paths).ok();
    let mut reported = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(RELOAD_INTERVAL) => {}
        }
        match read_all(&paths) {
            Ok(now) => {
                reported = false;
                if last.as_ref() != Some(&now) {
                    changed(&now);
                    last = Some(now);
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
