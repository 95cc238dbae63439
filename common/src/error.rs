//! Errors of the shared backends. Each variant names what it was doing and
//! with which resource, so that the one line an operator sees is enough.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot decode {what}: {reason}")]
    Decode { what: &'static str, reason: String },

    #[error("invalid catalog {source_name}: {reason}")]
    Catalog { source_name: String, reason: String },

    #[error("invalid setting {name}={value:?}: {reason}")]
    Config {
        name: &'static str,
        value: String,
        reason: String,
    },

    #[error("cannot reach NATS at {url}: {reason}")]
    NatsConnect { url: String, reason: String },

    #[error("NATS JetStream {op} failed: {reason}")]
    JetStream { op: String, reason: String },

    #[error("cannot reach etcd at {endpoints}: {reason}")]
    EtcdConnect { endpoints: String, reason: String },

    #[error("etcd {op} on {key} failed: {reason}")]
    Etcd {
        op: &'static str,
        key: String,
        reason: String,
    },

    #[error("fenced: owner epoch {ours} of shard {shard} was superseded by epoch {current}")]
    Fenced {
        shard: String,
        ours: u64,
        current: String,
    },

    #[error("object store {url}: {op} {key} failed: {reason}")]
    ObjectStore {
        url: String,
        op: &'static str,
        key: String,
        reason: String,
    },

    #[error("snapshot {key} is corrupt: {reason}")]
    SnapshotCorrupt { key: String, reason: String },

    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot bind {what} on {addr}: {reason}")]
    Bind {
        what: &'static str,
        addr: String,
        reason: String,
    },
}

impl Error {
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }

    pub fn jetstream(op: impl Into<String>) -> impl FnOnce(String) -> Self {
        let op = op.into();
        move |reason| Error::JetStream { op, reason }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
