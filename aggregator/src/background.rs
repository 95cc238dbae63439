//! Checkpoint work at a lower CPU priority than the pipeline.
//!
//! A checkpoint's copy of the LMDB and its writes to a `file://` store take
//! a core for a second or more. At full priority that second is taken from
//! the writer, the limiter and NATS on the same machine, and every impression
//! in flight is that much later in the pacer (`docs/BENCHMARKS.md`,
//! "Checkpoints in the background"). Each job here runs on a thread of its
//! own whose nice value is [`NICE`] higher than the service's: it gets what
//! the pipeline leaves over, and all of a core when the pipeline is idle.
//! Nothing waits on such a thread while holding a lock the writer needs.

use tokio::sync::oneshot;

/// How much lower than the service a checkpoint thread runs (added to its
/// nice value; the kernel caps it at 19).
pub(crate) const NICE: i32 = 10;

/// Run `job` on a new thread of lower CPU priority and wait for its result.
/// `what` names the thread (`ckpt-<what>`), so profiles show the job.
pub(crate) async fn run<T: Send + 'static>(
    what: &str,
    job: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<T> {
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name(format!("ckpt-{what}"))
        .spawn(move || {
            lower_priority();
            let _ = tx.send(job());
        })?;
    rx.await
        .map_err(|_| std::io::Error::other(format!("checkpoint thread {what} panicked")))
}

/// Raise the calling thread's nice value by [`NICE`]. On Linux a nice value
/// belongs to the thread, not the process. Failure only leaves the thread
/// at the service's priority.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: getpriority/setpriority take plain integers and touch no
        // memory of ours; `who = 0` is the calling thread.
        #[allow(unsafe_code)]
        let result = unsafe {
            let current = libc::getpriority(libc::PRIO_PROCESS, 0);
            libc::setpriority(libc::PRIO_PROCESS, 0, (current + NICE).min(19))
        };
        if result != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "checkpoint thread keeps the service's priority"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_job_runs_at_a_lower_priority_and_returns_its_result() {
        #[allow(unsafe_code)]
        // SAFETY: as in `lower_priority`.
        let service = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        #[allow(unsafe_code)]
        let (name, nice) = run("test", || {
            (
                std::thread::current().name().map(str::to_string),
                // SAFETY: as in `lower_priority`.
                unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) },
            )
        })
        .await
        .unwrap();
        assert_eq!(name.as_deref(), Some("ckpt-test"));
        assert_eq!(nice, (service + NICE).min(19));
        // The caller's own thread is untouched.
        #[allow(unsafe_code)]
        // SAFETY: as in `lower_priority`.
        let after = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        assert_eq!(after, service);
    }

    #[tokio::test]
    async fn a_panicking_job_is_an_error_not_a_hang() {
        let result = run("panics", || -> u8 { panic!("job failed") }).await;
        assert!(result.is_err());
    }
}
