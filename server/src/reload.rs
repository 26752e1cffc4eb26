//! Reload on change: polls a set of files and hands their contents to a callback
//! whenever any of them changed. Polling (rather than inotify) also sees files
//! replaced through symlink swaps, as Kubernetes does for mounted Secrets.

use std::future::Future;
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
        let read = tokio::select! {
            _ = stop.cancelled() => return,
            read = read_off_thread(&paths) => read,
        };
        let read = read.map_err(|(i, e)| match i {
            Some(i) => format!("{}: {e}", paths[i].display()),
            None => format!("reading the watched files: {e}"),
        });
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

/// Every file of `paths`, read on a blocking thread: a read may hang (a hung network
/// mount, a FIFO put in a file's place), and on a worker thread it would stop every
/// task there, at start the signal's too. A read still going after [`HUNG_READ`] is
/// logged once. An error gives the index of the file that failed, none when the
/// reading task did not end (the runtime stopping).
async fn read_off_thread(paths: &[PathBuf]) -> Result<Vec<Vec<u8>>, (Option<usize>, String)> {
    let mut reading = tokio::task::spawn_blocking({
        let paths = paths.to_vec();
        move || read_each(&paths)
    });
    let read = match tokio::time::timeout(HUNG_READ, &mut reading).await {
        Ok(read) => read,
        Err(_) => {
            tracing::warn!(files = ?paths, "reading a watched file hangs; nothing is applied until it ends");
            reading.await
        }
    };
    match read {
        Ok(read) => read.map_err(|(i, e)| (Some(i), e)),
        Err(e) => Err((None, e.to_string())),
    }
}

/// Reads every file; an error gives the index of the one that failed.
fn read_each(paths: &[PathBuf]) -> Result<Vec<Vec<u8>>, (usize, String)> {
    let read_one = |(i, path): (usize, &PathBuf)| std::fs::read(path).map_err(|e| (i, e.to_string()));
    paths.iter().enumerate().map(read_one).collect()
}

/// How far apart the reads at start are that must agree (see [`read_settled`]): short,
/// as a start waits for one pause for the auth file and one for the TLS files; a
/// writer is seldom still between its writes so long.
const SETTLE: Duration = Duration::from_millis(100);

/// Reads at start past which a file that keeps changing is refused: 5 s of them.
const SETTLE_READS: u32 = 50;

/// The contents of every file in `paths`, once two reads [`SETTLE`] apart agree: at
/// start as at a reload (see [`watch`]), a file caught half-written can parse, and an
/// auth file cut before an identity's `actions` gives it the default ones (acquire and
/// inspect) until the watcher saw the rest; a CA bundle cut after its first
/// certificate refuses the others' clients as long. The first read must succeed; a
/// later one that fails (an editor replacing the file) counts as a change. An error
/// gives the index of the file at fault.
pub async fn read_settled(paths: &[PathBuf]) -> Result<Vec<Vec<u8>>, (usize, String)> {
    settled(paths, || tokio::time::sleep(SETTLE)).await
}

/// [`read_settled`], awaiting `pause()` between reads.
async fn settled<F: Future<Output = ()>>(
    paths: &[PathBuf],
    mut pause: impl FnMut() -> F,
) -> Result<Vec<Vec<u8>>, (usize, String)> {
    let read = || async { read_off_thread(paths).await.map_err(|(i, e)| (i.unwrap_or(0), e)) };
    // None after a failed read: the next one starts anew.
    let mut last = Some(read().await?);
    let mut at_fault = 0;
    let mut failed = None;
    for _ in 0..SETTLE_READS {
        pause().await;
        match (read().await, last.take()) {
            (Ok(now), Some(last)) if now == last => return Ok(now),
            (Ok(now), before) => {
                let differs = |before: &Vec<Vec<u8>>| now.iter().zip(before).position(|(now, was)| now != was);
                at_fault = before.as_ref().and_then(differs).unwrap_or(at_fault);
                (last, failed) = (Some(now), None);
            }
            (Err((file, e)), _) => (at_fault, failed) = (file, Some(e)),
        }
    }
    let still = || format!("still changing after {SETTLE_READS} reads {SETTLE:?} apart");
    Err((at_fault, failed.unwrap_or_else(still)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    /// At start, a file caught mid-write is read again until two reads agree; a read
    /// that fails after the first counts as a change; one that never settles is
    /// refused, naming it.
    #[tokio::test]
    async fn a_file_read_at_start_is_what_it_settles_to() {
        let dir = tempfile::tempdir().unwrap();
        let paths = vec![dir.path().join("cert.pem"), dir.path().join("auth.toml")];
        std::fs::write(&paths[0], "cert").unwrap();
        // An identity cut before its `actions` parses, with the default ones.
        let cut = "[[identity]]\nname = \"audit\"\ntokens = [\"t\"]\nprefixes = [\"\"]\n";
        let whole = format!("{cut}actions = [\"inspect\"]\n");
        std::fs::write(&paths[1], "[[identity]]\n").unwrap();
        // Cut, gone, cut again (two reads that agree around a failed one), then whole.
        let mut writes = [Some(cut), None, Some(cut), Some(&*whole)].into_iter();
        let read = settled(&paths, || {
            match writes.next() {
                Some(Some(more)) => std::fs::write(&paths[1], more).unwrap(),
                Some(None) => std::fs::remove_file(&paths[1]).unwrap(),
                None => {}
            }
            std::future::ready(())
        });
        assert_eq!(read.await.unwrap(), vec![b"cert".to_vec(), whole.as_bytes().to_vec()]);

        let mut n = 0;
        let err = settled(&paths, || {
            n += 1;
            std::fs::write(&paths[1], n.to_string()).unwrap();
            std::future::ready(())
        })
        .await
        .unwrap_err();
        assert_eq!(err.0, 1, "the file at fault: {err:?}");
        assert!(err.1.contains("still changing"), "{err:?}");
        // One that keeps coming and going is named, not the first file.
        let mut n = 0;
        let err = settled(&paths, || {
            n += 1;
            match n % 2 {
                0 => std::fs::write(&paths[1], n.to_string()).unwrap(),
                _ => std::fs::remove_file(&paths[1]).unwrap(),
            }
            std::future::ready(())
        })
        .await
        .unwrap_err();
        assert_eq!(err.0, 1, "the file at fault: {err:?}");
        std::fs::remove_file(&paths[0]).unwrap();
        let missing = settled(&paths, || std::future::ready(())).await;
        assert_eq!(missing.unwrap_err().0, 0, "the file not there");
    }

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
