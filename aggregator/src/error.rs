use std::path::PathBuf;

use adspend_common::error::{BoxError, Causes};
use adspend_common::Error as CommonError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Common(#[from] CommonError),

    #[error("LMDB at {path}: {op}: {source}")]
    Lmdb {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: heed::Error,
    },

    #[error("LMDB at {0} was written by an older adspend (one entry per dedupe id); this version keeps dedupe ids in a packed log. Move the directory aside (the aggregator then restores from the latest snapshot or replays the stream)")]
    OldFormat(PathBuf),

    #[error("LMDB at {path}: {what} holds {bytes:02x?}, which is not a valid value; refusing to read it as zero (restore from a snapshot: move the directory aside)")]
    CorruptValue {
        path: PathBuf,
        what: String,
        bytes: Vec<u8>,
    },

    #[error("sum overflow: limit {limit} bucket {bucket} would exceed u64 micros")]
    Overflow { limit: String, bucket: u32 },

    #[error("SPEND retention gap: stream starts at sequence {first_seq} but the aggregator needs {needed} (last applied {last_applied}); spend between them is lost from the log, refusing to continue")]
    RetentionGap {
        first_seq: u64,
        needed: u64,
        last_applied: u64,
    },

    #[error("SPEND log went backwards: stream ends at sequence {last_seq} but the aggregator already applied {last_applied}; refusing to continue")]
    LogBackwards { last_seq: u64, last_applied: u64 },

    #[error("SPEND consumer: {what}: {}", Causes(source.as_ref()))]
    Consumer {
        what: &'static str,
        #[source]
        source: BoxError,
    },

    #[error("snapshot {key} does not match its checkpoint record: {reason}")]
    SnapshotMismatch { key: String, reason: String },

    /// The store answered, and the object the checkpoint record names (the
    /// base or one of its deltas) is not there: not an outage, a loss
    /// ([`crate::checkpoint::missing`] decides the way out).
    #[error("snapshot {url}/{key}, named by checkpoint {checkpoint_id} (sequence {seq}), is gone from the store")]
    SnapshotMissing {
        url: String,
        key: String,
        checkpoint_id: u64,
        seq: u64,
    },

    #[error("lease lost: shard {shard} is no longer ours to apply")]
    LeaseLost { shard: String },

    #[error("aggregator id {id:?}: {reason}")]
    Membership { id: String, reason: String },

    #[error("{what} task failed: {}", Causes(source.as_ref()))]
    Task {
        what: &'static str,
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Whether the same step may succeed later by itself: NATS, etcd or the
    /// object store away or slow, a task that died with it. Not retryable:
    /// the data or the local state is not what it must be (a retention gap,
    /// a snapshot that does not verify, LMDB or the disk failing, a sum
    /// that would overflow), a bad setting, or ownership gone
    /// ([`Error::lost_ownership`]).
    pub(crate) fn is_retryable(&self) -> bool {
        match self {
            Error::Common(e) => e.is_retryable(),
            Error::Consumer { .. } | Error::Task { .. } => true,
            Error::Lmdb { .. }
            | Error::OldFormat(_)
            | Error::CorruptValue { .. }
            | Error::Overflow { .. }
            | Error::RetentionGap { .. }
            | Error::LogBackwards { .. }
            | Error::SnapshotMismatch { .. }
            | Error::SnapshotMissing { .. }
            | Error::Membership { .. }
            | Error::LeaseLost { .. } => false,
        }
    }

    /// The shard is someone else's now (its lease lapsed, or a newer owner
    /// epoch fenced it): stop applying it, which is no failure of ours.
    pub(crate) fn lost_ownership(&self) -> bool {
        match self {
            Error::LeaseLost { .. } => true,
            Error::Common(e) => e.is_fenced(),
            _ => false,
        }
    }

    /// Whether the aggregator must stop: neither retryable nor a move of
    /// ownership.
    pub(crate) fn is_fatal(&self) -> bool {
        !self.is_retryable() && !self.lost_ownership()
    }

    pub(crate) fn lmdb(
        path: &std::path::Path,
        op: &'static str,
    ) -> impl FnOnce(heed::Error) -> Self {
        let path = path.to_path_buf();
        move |source| Error::Lmdb { path, op, source }
    }

    pub(crate) fn consumer<E: Into<BoxError>>(what: &'static str) -> impl FnOnce(E) -> Self {
        move |source| Error::Consumer {
            what,
            source: source.into(),
        }
    }

    pub(crate) fn task<E: Into<BoxError>>(what: &'static str) -> impl FnOnce(E) -> Self {
        move |source| Error::Task {
            what,
            source: source.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use adspend_common::error::{EXIT_BAD_SETTING, EXIT_FAILURE};
    use adspend_common::service::Failure;

    #[test]
    fn outages_are_retried_ownership_moves_let_go_and_bad_data_stops() {
        let etcd_timeout = Error::Common(CommonError::Timeout {
            what: "etcd reconcile".into(),
            after: std::time::Duration::from_secs(1),
        });
        let consumer = Error::consumer("stream info")(std::io::Error::other("no responders"));
        for e in [&etcd_timeout, &consumer] {
            assert!(
                e.is_retryable() && !e.is_fatal() && !e.lost_ownership(),
                "{e}"
            );
        }

        let lease = Error::LeaseLost { shard: "p1".into() };
        let fenced = Error::Common(CommonError::Fenced {
            shard: "p1".into(),
            ours: 3,
            current: "4".into(),
        });
        for e in [&lease, &fenced] {
            assert!(
                e.lost_ownership() && !e.is_retryable() && !e.is_fatal(),
                "{e}"
            );
        }

        let gap = Error::RetentionGap {
            first_seq: 10,
            needed: 5,
            last_applied: 4,
        };
        let disk = Error::Common(CommonError::io("fsync", "/data")(std::io::Error::other(
            "EIO",
        )));
        for e in [&gap, &disk] {
            assert!(e.is_fatal() && !e.is_retryable(), "{e}");
            assert_eq!(e.exit_code(), EXIT_FAILURE, "{e}");
        }
    }

    #[test]
    fn a_bad_setting_exits_64_through_the_wrapper() {
        let e = Error::Common(CommonError::Config {
            name: "ADSPEND_AGGREGATOR_ID",
            value: "a/b".into(),
            reason: "letters".into(),
        });
        assert_eq!(e.exit_code(), EXIT_BAD_SETTING);
        assert!(e.is_fatal());
    }

    #[test]
    fn a_task_error_keeps_its_source() {
        let e = Error::task("writer")(std::io::Error::other("no threads"));
        let source = std::error::Error::source(&e).expect("a source");
        assert_eq!(source.to_string(), "no threads");
        assert_eq!(e.to_string(), "writer task failed: no threads");
    }
}
