//! What the machine is still doing for the run before, which the next
//! measured run must not pay for.
//!
//! On a virtual machine with free page reporting (virtio-balloon), Linux
//! hands memory it freed back to the hypervisor, in 2 MiB blocks, starting
//! a couple of seconds after the free. A finished pipeline frees gigabytes
//! at once (its NATS store's page cache when its directory is deleted, its
//! processes' heaps), and the reporting then runs for 15-65 s. A
//! freshness run started meanwhile had a p99 of 175-524 ms where the same
//! run on a settled machine had 97-120 ms (`docs/BENCHMARKS.md`,
//! "Freshness after a sustained run").

use std::path::Path;
use std::time::{Duration, Instant};

/// The memory reported to the hypervisor since boot; absent without free
/// page reporting.
const REPORTED_KIB: &str = "/sys/module/page_reporting/parameters/reported_kib";
/// Unchanged this long counts as done: longer than the kernel's delay
/// (2 s) between a free and the reporting of it.
const STILL_FOR: Duration = Duration::from_secs(4);
const POLL: Duration = Duration::from_millis(250);
/// The longest wait; a machine whose reporting never settles is measured
/// as it is.
const AT_MOST: Duration = Duration::from_secs(120);

/// How long [`wait_for_page_reporting`] waited, and how much it saw
/// reported meanwhile.
#[derive(Debug, Clone, Copy)]
pub struct Settled {
    pub waited: Duration,
    pub reported_mib: u64,
}

/// Waits until the machine has stopped reporting freed memory to the
/// hypervisor (the count unchanged for [`STILL_FOR`], at most
/// [`AT_MOST`]); `None` on a machine without free page reporting.
pub async fn wait_for_page_reporting() -> Option<Settled> {
    wait_until_still(Path::new(REPORTED_KIB), STILL_FOR, POLL).await
}

/// [`wait_for_page_reporting`], saying how long it waited when the run
/// before had freed anything.
pub async fn settle() {
    if let Some(settled) = wait_for_page_reporting().await {
        if settled.reported_mib > 0 {
            println!(
                "bench:   waited {:.1} s while {} MiB freed by the run before went back to the hypervisor",
                settled.waited.as_secs_f64(),
                super::report::number(settled.reported_mib as f64)
            );
        }
    }
}

/// Waits until the count in `path` (KiB) has not changed for `still`.
async fn wait_until_still(path: &Path, still: Duration, poll: Duration) -> Option<Settled> {
    let read = || -> Option<u64> { std::fs::read_to_string(path).ok()?.trim().parse().ok() };
    let first = read()?;
    let started = Instant::now();
    let mut last = first;
    let mut still_since = started;
    while started.elapsed() < AT_MOST {
        tokio::time::sleep(poll).await;
        let now = read()?;
        if now != last {
            last = now;
            still_since = Instant::now();
        } else if still_since.elapsed() >= still {
            break;
        }
    }
    Some(Settled {
        waited: started.elapsed(),
        reported_mib: last.saturating_sub(first) / 1024,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waits_while_the_count_grows_and_reports_what_it_saw() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("reported_kib");
        std::fs::write(&path, "1024\n").unwrap();
        let writer = {
            let path = path.clone();
            tokio::spawn(async move {
                for kib in [2048, 4096, 9216] {
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    std::fs::write(&path, format!("{kib}\n")).unwrap();
                }
            })
        };
        let still = Duration::from_millis(400);
        let settled = wait_until_still(&path, still, Duration::from_millis(20))
            .await
            .expect("a count to follow");
        writer.await.unwrap();
        assert_eq!(settled.reported_mib, 8, "from 1,024 to 9,216 KiB");
        assert!(settled.waited >= Duration::from_millis(450) + still);
    }

    #[tokio::test]
    async fn no_count_no_wait() {
        let missing = Path::new("/nonexistent/reported_kib");
        assert!(wait_until_still(missing, STILL_FOR, POLL).await.is_none());
    }
}
