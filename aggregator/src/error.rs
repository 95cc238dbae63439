use std::path::PathBuf;

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

    #[error("SPEND consumer: {0}")]
    Consumer(String),

    #[error("snapshot {key} does not match its checkpoint record: {reason}")]
    SnapshotMismatch { key: String, reason: String },

    #[error("lease lost: shard {shard} is no longer ours to apply")]
    LeaseLost { shard: String },

    #[error("aggregator id {id:?}: {reason}")]
    Membership { id: String, reason: String },

    #[error("{0} task failed: {1}")]
    Task(&'static str, String),
}

impl Error {
    /// Whether the aggregator must stop: the data or the local state is not
    /// what it must be (a retention gap, a snapshot that does not verify,
    /// LMDB or disk failing, a sum that would overflow). The others (etcd,
    /// NATS or the object store unreachable for a while, ownership moving)
    /// are retried.
    pub fn is_fatal(&self) -> bool {
        use adspend_common::Error as C;
        match self {
            Error::Lmdb { .. }
            | Error::OldFormat(_)
            | Error::CorruptValue { .. }
            | Error::Overflow { .. }
            | Error::RetentionGap { .. }
            | Error::LogBackwards { .. }
            | Error::SnapshotMismatch { .. }
            | Error::Membership { .. } => true,
            Error::Common(e) => matches!(
                e,
                C::SnapshotCorrupt { .. } | C::Decode { .. } | C::Config { .. } | C::Io { .. }
            ),
            Error::Consumer(_) | Error::Task(..) | Error::LeaseLost { .. } => false,
        }
    }

    pub fn lmdb(path: &std::path::Path, op: &'static str) -> impl FnOnce(heed::Error) -> Self {
        let path = path.to_path_buf();
        move |source| Error::Lmdb { path, op, source }
    }
}
