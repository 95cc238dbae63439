//! A full data directory is an outage, not a verdict: the aggregator holds
//! its partitions and waits for space instead of exiting.
//!
//! A write that fails for want of space (`ENOSPC`, `EDQUOT`, or LMDB's
//! `EIO` for a write cut short on a file system with almost nothing free)
//! leaves nothing
//! half done: an LMDB commit that fails is aborted whole, the epoch file is
//! written aside and renamed. So the step is simply tried again, with
//! backoff, until space returns ([`SpaceWait`]). Meanwhile nothing is
//! applied or pushed, so the pacer shows the shard's limits stale, and the
//! operator sees one ERROR per [`LOG_EVERY`] naming the directory, its free
//! space and what it needs, and `adspend_aggregator_disk_full` at 1. The
//! data directory's free space is exported all the time ([`watch_free`]) so
//! that an alert fires before it fills.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::Error;
use crate::telemetry::{DATA_DIR_FREE_BYTES, DATA_DIR_SIZE_BYTES, DISK_FULL};

/// One ERROR per this while a shard waits for space.
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(60);
/// How often the data directory's free space is exported.
const WATCH_EVERY: Duration = Duration::from_secs(10);
const BACKOFF_FIRST: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// What the aggregator asks to be freed at the least: room for a few
/// commits and the lock file. A checkpoint also copies the LMDB data file
/// into `tmp/`, so the message names that file's size too.
const HEADROOM_BYTES: u64 = 64 << 20;

/// Whether `error` is a write that failed for want of space. LMDB reports
/// a write the disk cut short as EIO, not ENOSPC: an EIO from LMDB counts
/// when the file system it writes to has less than [`HEADROOM_BYTES`]
/// free; elsewhere it stays what it says, a failing disk.
pub(crate) fn is_full(error: &Error) -> bool {
    match error {
        Error::Lmdb {
            source: heed::Error::Io(io),
            path,
            ..
        } => {
            no_space(io)
                || (io.raw_os_error() == Some(libc::EIO)
                    && space(path).is_some_and(|(free, _)| free < HEADROOM_BYTES))
        }
        Error::Common(adspend_common::Error::Io { source, .. }) => no_space(source),
        _ => false,
    }
}

fn no_space(io: &std::io::Error) -> bool {
    io.kind() == std::io::ErrorKind::StorageFull
        || io.kind() == std::io::ErrorKind::QuotaExceeded
        || matches!(io.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// Free and total bytes of the file system that holds `dir` (for an
/// unprivileged process: what it may still write).
pub(crate) fn space(dir: &Path) -> Option<(u64, u64)> {
    let stat = nix::sys::statvfs::statvfs(dir).ok()?;
    let unit = stat.fragment_size() as u64;
    Some((
        stat.blocks_available() as u64 * unit,
        stat.blocks() as u64 * unit,
    ))
}

/// Export the free space of `dir` every [`WATCH_EVERY`] until `cancel`.
pub(crate) fn watch_free(dir: PathBuf, tasks: &TaskTracker, cancel: CancellationToken) {
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(WATCH_EVERY);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Some((free, total)) = space(&dir) {
                metrics::gauge!(DATA_DIR_FREE_BYTES).set(free as f64);
                metrics::gauge!(DATA_DIR_SIZE_BYTES).set(total as f64);
            }
        }
    });
}

/// One shard waiting for space in `dir`: the backoff between tries, and
/// the last ERROR, so that there is one per [`LOG_EVERY`].
pub(crate) struct SpaceWait {
    dir: PathBuf,
    shard: String,
    /// What the step that failed was doing.
    what: &'static str,
    since: Instant,
    backoff: Duration,
    logged: Option<Instant>,
    tries: u64,
}

impl SpaceWait {
    pub(crate) fn new(dir: &Path, shard: &str, what: &'static str) -> Self {
        SpaceWait {
            dir: dir.to_path_buf(),
            shard: shard.to_string(),
            what,
            since: Instant::now(),
            backoff: BACKOFF_FIRST,
            logged: None,
            tries: 0,
        }
    }

    /// The step that waits now (several steps of a start share one wait).
    pub(crate) fn at(&mut self, what: &'static str) -> &mut Self {
        self.what = what;
        self
    }

    /// Note that the step failed with `error` (a full disk); how long to
    /// wait before trying again.
    fn failed(&mut self, error: &Error) -> Duration {
        self.tries += 1;
        metrics::gauge!(DISK_FULL, "shard" => self.shard.clone()).set(1.0);
        if self.logged.is_none_or(|at| at.elapsed() >= LOG_EVERY) {
            self.logged = Some(Instant::now());
            let (free, total) = space(&self.dir).unwrap_or((0, 0));
            let lmdb_bytes = std::fs::metadata(self.dir.join("lmdb").join(crate::store::DATA_FILE))
                .map_or(0, |m| m.len());
            tracing::error!(
                shard = self.shard,
                dir = %self.dir.display(),
                free_bytes = free,
                total_bytes = total,
                needs_bytes = HEADROOM_BYTES,
                lmdb_data_bytes = lmdb_bytes,
                waiting_s = self.since.elapsed().as_secs(),
                tries = self.tries,
                step = self.what,
                error = %error,
                "data directory full: holding the shard and waiting for space (free at least 64 MiB, and as much as the LMDB data file for checkpoints); its limits go stale meanwhile, nothing is lost"
            );
        }
        let wait = self.backoff;
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        wait
    }

    /// Wait after `error` on an async task. `false` when `cancel` came first.
    pub(crate) async fn wait(&mut self, error: &Error, cancel: &CancellationToken) -> bool {
        let wait = self.failed(error);
        tokio::select! {
            _ = cancel.cancelled() => false,
            _ = tokio::time::sleep(wait) => true,
        }
    }

    /// Wait after `error` on a blocking thread, looking at `stopping` every
    /// 100 ms. `false` when it said stop.
    pub(crate) fn wait_blocking(&mut self, error: &Error, stopping: impl Fn() -> bool) -> bool {
        let until = Instant::now() + self.failed(error);
        while Instant::now() < until {
            if stopping() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(100).min(until - Instant::now()));
        }
        !stopping()
    }

    /// The step went through: say so once (the gauge is cleared on drop).
    pub(crate) fn resumed(self) {
        tracing::info!(
            shard = self.shard,
            dir = %self.dir.display(),
            waited_ms = self.since.elapsed().as_millis() as u64,
            tries = self.tries,
            step = self.what,
            "space returned to the data directory; going on"
        );
    }
}

/// However the wait ends (space, stop, another error), the shard is no
/// longer waiting.
impl Drop for SpaceWait {
    fn drop(&mut self) {
        metrics::gauge!(DISK_FULL, "shard" => self.shard.clone()).set(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_lack_of_space_is_a_full_disk() {
        let enospc = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let lmdb = Error::lmdb(Path::new("/data/lmdb"), "commit")(heed::Error::Io(enospc));
        assert!(is_full(&lmdb), "{lmdb}");
        let edquot = std::io::Error::from_raw_os_error(libc::EDQUOT);
        let epoch = Error::Common(adspend_common::Error::io("write", "/data/epoch.tmp")(
            edquot,
        ));
        assert!(is_full(&epoch), "{epoch}");

        // EIO on a file system with room: a failing disk, not a full one.
        let roomy = tempfile::tempdir().unwrap();
        let eio = std::io::Error::from_raw_os_error(libc::EIO);
        let broken = Error::lmdb(roomy.path(), "commit")(heed::Error::Io(eio));
        let (free, _) = space(roomy.path()).unwrap();
        assert_eq!(is_full(&broken), free < HEADROOM_BYTES, "{broken}");
        let map_full = Error::lmdb(Path::new("/data/lmdb"), "commit")(heed::Error::Mdb(
            heed::MdbError::MapFull,
        ));
        assert!(!is_full(&map_full), "a full map is a setting: {map_full}");
    }

    #[test]
    fn the_space_of_a_directory_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let (free, total) = space(dir.path()).expect("statvfs");
        assert!(total > 0 && free <= total, "{free} of {total}");
    }

    #[test]
    fn a_blocking_wait_ends_when_told_to_stop() {
        let mut wait = SpaceWait::new(Path::new("/nonexistent"), "all", "commit");
        let full = Error::lmdb(Path::new("/x"), "commit")(heed::Error::Io(
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        ));
        assert!(
            wait.wait_blocking(&full, || false),
            "waits, then tries again"
        );
        assert!(!wait.wait_blocking(&full, || true), "told to stop");
    }
}
