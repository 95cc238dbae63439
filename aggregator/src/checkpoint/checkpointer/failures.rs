//! Checkpoints that fail: counted by reason, logged loudly but boundedly (the
//! first failure of a run, then one line every [`LOG_EVERY`] with the count,
//! and one when they resume), and a bucket S3 lost created again. The
//! previous checkpoint stays in force meanwhile and every marker retries, so
//! checkpoints resume by themselves once the store is back.

use std::time::{Duration, Instant};

use adspend_common::Error as CommonError;

use crate::checkpoint::record::CheckpointRecord;
use crate::error::Error;
use crate::snapshot_store::{is_bucket_missing, Created, SnapshotStore};
use crate::telemetry::CHECKPOINT_FAILURES_TOTAL;

/// At most one ERROR line this often while checkpoints keep failing.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// Why a checkpoint failed, as the `reason` label says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    /// S3 answered that the bucket does not exist.
    BucketMissing,
    /// The object store failed otherwise.
    Store,
    /// The checkpoint record could not be read or written (etcd, the file).
    Record,
    /// A local file: the copy, a `file://` object, the record file.
    Io,
    Other,
}

impl Reason {
    pub(crate) fn of(error: &Error) -> Reason {
        match error {
            Error::Common(e) if is_bucket_missing(e) => Reason::BucketMissing,
            Error::Common(CommonError::ObjectStore { .. }) => Reason::Store,
            Error::Common(
                CommonError::Etcd { .. }
                | CommonError::EtcdConnect { .. }
                | CommonError::Timeout { .. }
                | CommonError::Decode { .. },
            ) => Reason::Record,
            Error::Common(CommonError::Io { .. }) => Reason::Io,
            _ => Reason::Other,
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::BucketMissing => "bucket_missing",
            Reason::Store => "store",
            Reason::Record => "record",
            Reason::Io => "io",
            Reason::Other => "other",
        }
    }
}

/// The current run of failed checkpoints of one shard.
#[derive(Debug, Default)]
pub(crate) struct Failing {
    since: Option<Instant>,
    count: u64,
    logged: Option<Instant>,
}

impl Failing {
    /// Count and (boundedly) log a failed checkpoint; returns its reason.
    pub(crate) fn failed(
        &mut self,
        shard: &str,
        snapshots: &SnapshotStore,
        error: &Error,
    ) -> Reason {
        let reason = Reason::of(error);
        metrics::counter!(
            CHECKPOINT_FAILURES_TOTAL,
            "shard" => shard.to_string(),
            "reason" => reason.as_str()
        )
        .increment(1);
        self.count += 1;
        let since = *self.since.get_or_insert_with(Instant::now);
        if self.logged.is_some_and(|at| at.elapsed() < LOG_EVERY) {
            tracing::debug!(shard, reason = reason.as_str(), error = %error, "checkpoint failed");
            return reason;
        }
        self.logged = Some(Instant::now());
        let (failures, failing_for_s) = (self.count, since.elapsed().as_secs());
        if reason == Reason::BucketMissing {
            tracing::error!(
                shard,
                store = snapshots.url(),
                bucket = snapshots.bucket().unwrap_or_default(),
                failures,
                failing_for_s,
                error = %error,
                "checkpoint failed: S3 has no such bucket (the store lost it?); creating it \
                 again. Until a checkpoint is recorded the last one stays in force, and SPEND \
                 must keep everything after it"
            );
        } else {
            tracing::error!(
                shard,
                reason = reason.as_str(),
                failures,
                failing_for_s,
                error = %error,
                "checkpoint failed; the last recorded checkpoint stays in force and every \
                 marker retries"
            );
        }
        reason
    }

    /// A checkpoint was recorded: ends the run of failures, if any.
    pub(crate) fn recovered(&mut self, shard: &str, record: &CheckpointRecord) {
        let Some(since) = self.since.take() else {
            return;
        };
        tracing::warn!(
            shard,
            failures = self.count,
            failed_for_s = since.elapsed().as_secs(),
            checkpoint = record.checkpoint_id,
            seq = record.seq,
            kind = if record.deltas.is_empty() {
                "base"
            } else {
                "delta"
            },
            "checkpoints resumed"
        );
        self.count = 0;
        self.logged = None;
    }
}

/// After S3 said the bucket is gone: create it again, so that the next
/// marker's checkpoint (a new base) can land.
pub(super) async fn create_bucket(shard: &str, snapshots: &SnapshotStore) {
    let bucket = snapshots.bucket().unwrap_or_default();
    match snapshots.create_bucket().await {
        Ok(Some(Created::Yes)) => tracing::warn!(
            shard,
            bucket,
            "created the snapshot bucket again; the next checkpoint copies a new base"
        ),
        Ok(_) => {}
        Err(error) => tracing::error!(
            shard,
            bucket,
            error,
            "creating the snapshot bucket again failed: create it (e.g. `aws s3 mb \
             s3://<bucket>`); checkpoints resume by themselves once it exists"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_name_the_failing_part() {
        let etcd = Error::Common(CommonError::Timeout {
            what: "etcd txn".into(),
            after: Duration::from_secs(1),
        });
        assert_eq!(Reason::of(&etcd), Reason::Record);
        let io = Error::Common(CommonError::io("write", "/x")(std::io::Error::other("EIO")));
        assert_eq!(Reason::of(&io), Reason::Io);
        let store = |source: object_store::Error| {
            Error::Common(CommonError::ObjectStore {
                url: "s3://b/p".into(),
                op: "upload",
                key: "p1/x.mdb".into(),
                source: Box::new(source),
            })
        };
        let no_bucket = store(object_store::Error::NotFound {
            path: "p1/x.mdb".into(),
            source:
                "Client error with status 404 Not Found: <Error><Code>NoSuchBucket</Code></Error>"
                    .into(),
        });
        assert_eq!(Reason::of(&no_bucket), Reason::BucketMissing);
        let refused = store(object_store::Error::Generic {
            store: "S3",
            source: "connection refused".into(),
        });
        assert_eq!(Reason::of(&refused), Reason::Store);
        assert_eq!(
            Reason::of(&Error::task("copy")(std::io::Error::other("x"))),
            Reason::Other
        );
    }
}
