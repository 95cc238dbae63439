//! How long this process may still act as a partition's owner.
//!
//! An etcd lease is not mutual exclusion (Jepsen, etcd 3.4.3): a process that
//! was paused wakes up believing it still owns. The keepalive loop of
//! [`crate::cluster::lease`] moves the deadline forward on every answered
//! keepalive (to the time the request was sent plus half the TTL, on the
//! monotonic clock); the writer and the checkpointer look at it before they
//! commit and stop once it has passed, whatever they believe. The owner epoch
//! (checked by etcd on every checkpoint record and by the pacer on every
//! push) fences whatever slips through between two looks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often a paused writer looks at the deadline again.
const PAUSE_POLL: Duration = Duration::from_millis(20);

/// The lease is lost for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Revoked;

#[derive(Debug)]
pub struct Validity {
    base: Instant,
    /// Nanoseconds after `base` until which the lease is held; 0 = revoked.
    until_nanos: AtomicU64,
}

impl Validity {
    /// Valid for `for_at_least` from now.
    pub(crate) fn new(for_at_least: Duration) -> Self {
        let validity = Validity {
            base: Instant::now(),
            until_nanos: AtomicU64::new(0),
        };
        validity.extend_to(Instant::now() + for_at_least);
        validity
    }

    /// Move the deadline to `until` if that is later (answers can arrive out
    /// of order).
    pub(crate) fn extend_to(&self, until: Instant) {
        let nanos = until.saturating_duration_since(self.base).as_nanos();
        let nanos = u64::try_from(nanos).unwrap_or(u64::MAX).max(1);
        self.until_nanos.fetch_max(nanos, Ordering::AcqRel);
    }

    /// From now on, never valid again.
    pub(crate) fn revoke(&self) {
        self.until_nanos.store(0, Ordering::Release);
    }

    /// Revoked for good (the lease is lost), as opposed to lapsed: a lapsed
    /// deadline comes back when etcd answers a keepalive again.
    pub(crate) fn is_revoked(&self) -> bool {
        self.until_nanos.load(Ordering::Acquire) == 0
    }

    /// Blocks the calling (non-async) thread while the deadline has lapsed
    /// but is not revoked: an etcd election or a slow answer pauses the
    /// writer instead of ending it. Ok once valid; Err once revoked.
    pub(crate) fn wait_blocking(&self) -> Result<(), Revoked> {
        while !self.is_valid() {
            if self.is_revoked() {
                return Err(Revoked);
            }
            std::thread::sleep(PAUSE_POLL);
        }
        Ok(())
    }

    /// [`Validity::wait_blocking`] for async callers.
    pub(crate) async fn wait(&self) -> Result<(), Revoked> {
        while !self.is_valid() {
            if self.is_revoked() {
                return Err(Revoked);
            }
            tokio::time::sleep(PAUSE_POLL).await;
        }
        Ok(())
    }

    pub(crate) fn is_valid(&self) -> bool {
        let until = self.until_nanos.load(Ordering::Acquire);
        let now = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        now < until
    }

    /// Time left (zero once expired or revoked).
    #[cfg(test)]
    pub(crate) fn remaining(&self) -> Duration {
        let until = self.until_nanos.load(Ordering::Acquire);
        let now = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(until.saturating_sub(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expires_extends_and_revokes() {
        let validity = Validity::new(Duration::from_millis(30));
        assert!(validity.is_valid());
        std::thread::sleep(Duration::from_millis(40));
        assert!(!validity.is_valid(), "a deadline in the past is not valid");
        validity.extend_to(Instant::now() + Duration::from_secs(5));
        assert!(validity.is_valid());
        // An older answer arriving late does not shorten the deadline.
        validity.extend_to(Instant::now());
        assert!(validity.remaining() > Duration::from_secs(4));
        validity.revoke();
        assert!(!validity.is_valid());
        assert!(validity.is_revoked());
        assert_eq!(validity.remaining(), Duration::ZERO);
    }

    #[test]
    fn a_lapsed_deadline_pauses_until_extended_and_a_revoked_one_ends() {
        let validity = std::sync::Arc::new(Validity::new(Duration::from_millis(10)));
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            !validity.is_valid() && !validity.is_revoked(),
            "lapsed, not revoked"
        );
        let extender = {
            let validity = validity.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                validity.extend_to(Instant::now() + Duration::from_secs(5));
            })
        };
        let paused = Instant::now();
        assert_eq!(validity.wait_blocking(), Ok(()));
        assert!(
            paused.elapsed() >= Duration::from_millis(90),
            "it waited for the answer"
        );
        extender.join().unwrap();
        let revoker = {
            let validity = validity.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                validity.revoke();
            })
        };
        // Valid now: no wait. Then revoked while waiting: an error.
        assert_eq!(validity.wait_blocking(), Ok(()));
        revoker.join().unwrap();
        assert_eq!(validity.wait_blocking(), Err(Revoked));
    }
}
