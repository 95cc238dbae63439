//! Errors of the shared backends. Each variant names what it was doing and
//! with which resource, so that the one line an operator sees is enough.
//!
//! A variant that wraps a library's error keeps it as its `#[source]` (and
//! shows its causes in its message, see [`Causes`]); a `reason: String` is
//! our own text. Two questions are answered here, once, rather than by
//! matching variants at each call site: [`Error::is_retryable`] (will the
//! same step succeed later by itself?) and [`Error::exit_code`] (how the
//! process ends when the error reaches `main`).

use std::path::PathBuf;
use std::time::Duration;

/// A library error boxed, for the variants fed by several error types of
/// one client (every JetStream call has its own) or by a crate `common`
/// does not depend on.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Exit code of a bad setting, including one that does not parse:
/// `EX_USAGE` of sysexits.h. Restarting will not help; the operator must.
pub const EXIT_BAD_SETTING: u8 = 64;
/// Exit code of anything else that stops a service: a dependency that cannot
/// be reached, a port taken, data that must not be read on.
pub const EXIT_FAILURE: u8 = 1;

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

    #[error("cannot reach NATS at {url}: {}", Causes(source))]
    NatsConnect {
        url: String,
        #[source]
        source: async_nats::ConnectError,
    },

    #[error("NATS JetStream {op} failed: {}", Causes(source.as_ref()))]
    JetStream {
        op: String,
        #[source]
        source: BoxError,
    },

    #[error("cannot reach etcd at {endpoints}: {reason}")]
    EtcdConnect { endpoints: String, reason: String },

    #[error("etcd {op} on {key} failed: {}", Causes(source))]
    Etcd {
        op: &'static str,
        key: String,
        #[source]
        source: etcd_client::Error,
    },

    #[error("{what} timed out after {after:?}")]
    Timeout { what: String, after: Duration },

    #[error("fenced: owner epoch {ours} of shard {shard} was superseded by epoch {current}")]
    Fenced {
        shard: String,
        ours: u64,
        current: String,
    },

    /// `source` is an `object_store::Error` (boxed: only the aggregator
    /// depends on that crate).
    #[error("object store {url}: {op} {key} failed: {}", Causes(source.as_ref()))]
    ObjectStore {
        url: String,
        op: &'static str,
        key: String,
        #[source]
        source: BoxError,
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

    /// This region's `REGIONS` stream holds another region's reports: the
    /// service is pointed at another region's NATS, or `ADSPEND_REGION`
    /// names the wrong region. A setting, not an outage.
    #[error(
        "the REGIONS stream on this NATS is region {found:?}'s, not {expected:?}'s: \
         ADSPEND_REGION or ADSPEND_NATS_URL names the wrong region (docs/REGIONS.md)"
    )]
    RegionMismatch { expected: String, found: String },

    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

/// The wire crate's errors are the variants of the same name, same text.
impl From<adspend_wire::Error> for Error {
    fn from(error: adspend_wire::Error) -> Self {
        match error {
            adspend_wire::Error::Decode { what, reason } => Error::Decode { what, reason },
            adspend_wire::Error::Catalog {
                source_name,
                reason,
            } => Error::Catalog {
                source_name,
                reason,
            },
        }
    }
}

impl Error {
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }

    pub fn jetstream<E>(op: impl Into<String>) -> impl FnOnce(E) -> Self
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let op = op.into();
        move |source| Error::JetStream {
            op,
            source: Box::new(source),
        }
    }

    pub fn etcd(op: &'static str, key: &str) -> impl FnOnce(etcd_client::Error) -> Self {
        let key = key.to_string();
        move |source| Error::Etcd { op, key, source }
    }

    /// Whether the same step may succeed later without anyone acting: a
    /// dependency away or slow (NATS, etcd, the object store, a timeout).
    /// Not: a bad setting or catalog, data that does not verify, a fenced
    /// owner, the local disk, credentials refused.
    pub fn is_retryable(&self) -> bool {
        use async_nats::ConnectErrorKind as Nats;
        match self {
            Error::NatsConnect { source, .. } => matches!(
                source.kind(),
                Nats::TimedOut | Nats::Io | Nats::Dns | Nats::MaxReconnects
            ),
            Error::JetStream { .. }
            | Error::EtcdConnect { .. }
            | Error::Etcd { .. }
            | Error::Timeout { .. }
            | Error::ObjectStore { .. } => true,
            Error::Decode { .. }
            | Error::Catalog { .. }
            | Error::Config { .. }
            | Error::Fenced { .. }
            | Error::SnapshotCorrupt { .. }
            | Error::Io { .. }
            | Error::Bind { .. }
            | Error::RegionMismatch { .. } => false,
        }
    }

    /// Whether a newer owner epoch took over: not an outage, not ours to
    /// write any more.
    pub fn is_fenced(&self) -> bool {
        matches!(self, Error::Fenced { .. })
    }

    /// How a service ends when this error reaches `main`:
    /// [`EXIT_BAD_SETTING`] for a setting, [`EXIT_FAILURE`] for the rest.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Config { .. } | Error::RegionMismatch { .. } => EXIT_BAD_SETTING,
            _ => EXIT_FAILURE,
        }
    }
}

/// An error followed by those of its causes that its message does not
/// already show ("transport error" alone hides a refused handshake).
pub struct Causes<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Causes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut text = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(error) = cause {
            let more = error.to_string();
            if !text.contains(&more) {
                text.push_str(": ");
                text.push_str(&more);
            }
            cause = error.source();
        }
        f.write_str(&text)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Error {
        Error::Config {
            name: "ADSPEND_PARTITIONS",
            value: "0".into(),
            reason: "must be at least 1".into(),
        }
    }

    #[test]
    fn a_bad_setting_exits_64_and_is_not_retried() {
        let mismatch = Error::RegionMismatch {
            expected: "east".into(),
            found: "west".into(),
        };
        for error in [config(), mismatch] {
            assert_eq!(error.exit_code(), EXIT_BAD_SETTING, "{error}");
            assert!(!error.is_retryable(), "{error}");
        }
    }

    #[test]
    fn unreachable_dependencies_are_retryable_and_exit_1() {
        let nats = Error::NatsConnect {
            url: "nats://127.0.0.1:1".into(),
            source: async_nats::ConnectError::new(async_nats::ConnectErrorKind::TimedOut),
        };
        let timeout = Error::Timeout {
            what: "etcd reconcile".into(),
            after: Duration::from_secs(1),
        };
        let jetstream =
            Error::jetstream("create stream SPEND")(std::io::Error::other("no responders"));
        for error in [nats, timeout, jetstream] {
            assert!(error.is_retryable(), "{error}");
            assert_eq!(error.exit_code(), EXIT_FAILURE, "{error}");
        }
    }

    #[test]
    fn refused_credentials_corrupt_data_fencing_and_disk_are_fatal() {
        let refused = Error::NatsConnect {
            url: "nats://127.0.0.1:1".into(),
            source: async_nats::ConnectError::new(
                async_nats::ConnectErrorKind::AuthorizationViolation,
            ),
        };
        let corrupt = Error::SnapshotCorrupt {
            key: "s/1".into(),
            reason: "checksum".into(),
        };
        let fenced = Error::Fenced {
            shard: "p0".into(),
            ours: 1,
            current: "2".into(),
        };
        let disk = Error::io("fsync", "/data")(std::io::Error::other("no space"));
        for error in [refused, corrupt, fenced, disk] {
            assert!(!error.is_retryable(), "{error}");
            assert_eq!(error.exit_code(), EXIT_FAILURE, "{error}");
        }
    }

    #[test]
    fn the_source_is_kept_and_its_causes_shown_once() {
        let inner = std::io::Error::other("connection refused");
        let error = Error::jetstream("stream info")(inner);
        let source = std::error::Error::source(&error).expect("a source");
        assert_eq!(source.to_string(), "connection refused");
        assert_eq!(
            error.to_string(),
            "NATS JetStream stream info failed: connection refused"
        );
    }
}
