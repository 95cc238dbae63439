//! `ADSPEND_OBJECT_STORE_URL` parsed: where snapshots go.

use std::path::PathBuf;

use adspend_common::env;
use adspend_common::Error;

/// Where snapshots go: `ADSPEND_OBJECT_STORE_URL` parsed. A setting only;
/// the store is opened when the aggregator starts
/// ([`SnapshotStore::open`](crate::snapshot_store::SnapshotStore::open)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SnapshotUrl {
    /// `file:///dir`.
    File { url: String, dir: PathBuf },
    /// `s3://bucket/prefix` (credentials and endpoint from `AWS_*`).
    S3 {
        url: String,
        bucket: String,
        prefix: String,
    },
}

impl SnapshotUrl {
    pub(crate) fn parse(url: &str) -> Result<Self, Error> {
        if let Some(path) = url.strip_prefix("file://") {
            if path.is_empty() {
                return Err(Self::bad(url, "no directory after file://"));
            }
            return Ok(SnapshotUrl::File {
                url: url.to_string(),
                dir: PathBuf::from(path),
            });
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(Self::bad(url, "no bucket after s3://"));
            }
            return Ok(SnapshotUrl::S3 {
                url: url.to_string(),
                bucket: bucket.to_string(),
                prefix: prefix.trim_matches('/').to_string(),
            });
        }
        Err(Self::bad(
            url,
            "expected file:///<dir> or s3://<bucket>/<prefix>",
        ))
    }

    pub(crate) fn as_str(&self) -> &str {
        match self {
            SnapshotUrl::File { url, .. } | SnapshotUrl::S3 { url, .. } => url,
        }
    }

    /// The setting's error for `url`, naming it.
    pub(crate) fn bad(url: &str, reason: impl Into<String>) -> Error {
        Error::Config {
            name: env::OBJECT_STORE_URL,
            value: url.to_string(),
            reason: reason.into(),
        }
    }
}
