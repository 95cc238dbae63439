//! Checkpoint records: where the last snapshot is and which stream sequence
//! it covers, written with a compare-and-swap on the owner epoch so that a
//! stale aggregator cannot overwrite a newer owner's record (DESIGN.md rule 5:
//! leases are not mutual exclusion, so every write is fenced).
//!
//! Two backends: etcd (`Txn` comparing the epoch key) and, in single-machine
//! mode, files in the data directory replaced by fsynced atomic rename.

use std::path::{Path, PathBuf};

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use serde::{Deserialize, Serialize};

use adspend_common::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRecord {
    pub checkpoint_id: u64,
    /// Last `SPEND` sequence applied in the snapshot.
    pub seq: u64,
    pub snapshot_key: String,
    pub checksum: String,
    pub size_bytes: u64,
    pub epoch: u64,
    /// Identity of the LMDB history the snapshot belongs to.
    pub lineage: String,
    pub created_ms: i64,
    /// Deltas on top of the snapshot, oldest first: restore is the snapshot
    /// then each of these; `seq` is the last one's. Records written before
    /// incremental checkpoints have none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deltas: Vec<DeltaRef>,
}

/// One delta object of a checkpoint chain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaRef {
    pub key: String,
    /// Last `SPEND` sequence the delta brings the state to.
    pub seq: u64,
    pub checksum: String,
    pub size_bytes: u64,
}

impl CheckpointRecord {
    /// Bytes of the deltas on top of the snapshot.
    pub fn delta_bytes(&self) -> u64 {
        self.deltas.iter().map(|d| d.size_bytes).sum()
    }
}

pub enum CheckpointStore {
    Etcd {
        client: Box<etcd_client::Client>,
        epoch_key: String,
        record_key: String,
        shard: String,
    },
    Local {
        dir: PathBuf,
        shard: String,
    },
}

impl std::fmt::Debug for CheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckpointStore::Etcd { record_key, .. } => write!(f, "etcd:{record_key}"),
            CheckpointStore::Local { dir, .. } => write!(f, "file:{}", dir.display()),
        }
    }
}

fn etcd_err(op: &'static str, key: &str) -> impl FnOnce(etcd_client::Error) -> Error {
    Error::etcd(op, key)
}

/// An owner epoch as stored; anything else is an error naming where it was
/// read and what it held (reading it as 0 would restart the epochs, and the
/// pacer would then drop the new owner's pushes as stale).
fn parse_epoch(source: &str, bytes: &[u8]) -> Result<u64> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| Error::Decode {
            what: "owner epoch",
            reason: format!("{source} holds {:?}", String::from_utf8_lossy(bytes)),
        })
}

impl CheckpointStore {
    /// [`CheckpointStore::open_with`] plain endpoints, without TLS.
    pub async fn open(etcd_endpoints: &[String], data_dir: &Path, shard: &str) -> Result<Self> {
        let etcd = adspend_common::config::EtcdArgs::plain(etcd_endpoints.join(","));
        Self::open_with(&etcd, data_dir, shard).await
    }

    /// etcd when `etcd` names endpoints (over TLS when its settings say so),
    /// else files under `data_dir/checkpoint`.
    pub(crate) async fn open_with(
        etcd: &adspend_common::config::EtcdArgs,
        data_dir: &Path,
        shard: &str,
    ) -> Result<Self> {
        if etcd.endpoints().is_empty() {
            let dir = data_dir.join("checkpoint");
            std::fs::create_dir_all(&dir).map_err(Error::io("create", &dir))?;
            return Ok(CheckpointStore::Local {
                dir,
                shard: shard.to_string(),
            });
        }
        let client = adspend_common::etcd::connect(etcd).await?;
        Ok(Self::etcd(client, shard))
    }

    /// The shard's records in etcd over a client the caller already holds
    /// (clones share one connection).
    pub fn etcd(client: etcd_client::Client, shard: &str) -> Self {
        CheckpointStore::Etcd {
            client: Box::new(client),
            epoch_key: format!("/adspend/shards/{shard}/epoch"),
            record_key: format!("/adspend/shards/{shard}/checkpoint"),
            shard: shard.to_string(),
        }
    }

    /// Take ownership: atomically increment the shard's owner epoch and return
    /// it. Every later write of the previous owner fails its comparison.
    pub async fn acquire_epoch(&mut self) -> Result<u64> {
        match self {
            CheckpointStore::Etcd {
                client, epoch_key, ..
            } => loop {
                let current = client
                    .get(epoch_key.as_str(), None)
                    .await
                    .map_err(etcd_err("get", epoch_key))?;
                let (epoch, compare) = match current.kvs().first() {
                    Some(kv) => (
                        parse_epoch(epoch_key, kv.value())?,
                        Compare::mod_revision(
                            epoch_key.as_str(),
                            CompareOp::Equal,
                            kv.mod_revision(),
                        ),
                    ),
                    None => (
                        0,
                        Compare::create_revision(epoch_key.as_str(), CompareOp::Equal, 0),
                    ),
                };
                let next = epoch + 1;
                let txn = Txn::new().when(vec![compare]).and_then(vec![TxnOp::put(
                    epoch_key.as_str(),
                    next.to_string(),
                    None,
                )]);
                let response = client.txn(txn).await.map_err(etcd_err("txn", epoch_key))?;
                if response.succeeded() {
                    return Ok(next);
                }
            },
            CheckpointStore::Local { dir, .. } => {
                let _lock = lock_dir(dir)?;
                let path = dir.join("epoch");
                let epoch = match std::fs::read(&path) {
                    Ok(bytes) => parse_epoch(&path.display().to_string(), &bytes)?,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
                    Err(e) => return Err(Error::io("read", &path)(e)),
                };
                let next = epoch + 1;
                write_atomic(&path, next.to_string().as_bytes())?;
                Ok(next)
            }
        }
    }

    /// The shard's current owner epoch (0 if none was ever acquired).
    pub async fn current_epoch(&mut self) -> Result<u64> {
        match self {
            CheckpointStore::Etcd {
                client, epoch_key, ..
            } => {
                let response = client
                    .get(epoch_key.as_str(), None)
                    .await
                    .map_err(etcd_err("get", epoch_key))?;
                match response.kvs().first() {
                    Some(kv) => parse_epoch(epoch_key, kv.value()),
                    None => Ok(0),
                }
            }
            CheckpointStore::Local { dir, .. } => {
                let path = dir.join("epoch");
                match std::fs::read(&path) {
                    Ok(bytes) => parse_epoch(&path.display().to_string(), &bytes),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
                    Err(e) => Err(Error::io("read", &path)(e)),
                }
            }
        }
    }

    pub async fn load(&mut self) -> Result<Option<CheckpointRecord>> {
        let (source, bytes) = match self {
            CheckpointStore::Etcd {
                client, record_key, ..
            } => {
                let response = client
                    .get(record_key.as_str(), None)
                    .await
                    .map_err(etcd_err("get", record_key))?;
                match response.kvs().first() {
                    Some(kv) => (record_key.clone(), kv.value().to_vec()),
                    None => return Ok(None),
                }
            }
            CheckpointStore::Local { dir, .. } => {
                let path = dir.join("checkpoint.json");
                match std::fs::read(&path) {
                    Ok(bytes) => (path.display().to_string(), bytes),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                    Err(e) => return Err(Error::io("read", &path)(e)),
                }
            }
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::Decode {
                what: "checkpoint record",
                reason: format!("{source}: {e}"),
            })
    }

    /// Record a checkpoint if and only if `record.epoch` is still the owner
    /// epoch; otherwise [`Error::Fenced`].
    pub async fn commit(&mut self, record: &CheckpointRecord) -> Result<()> {
        let json = serde_json::to_vec(record).expect("a record always serializes");
        match self {
            CheckpointStore::Etcd {
                client,
                epoch_key,
                record_key,
                shard,
            } => {
                let txn = Txn::new()
                    .when(vec![Compare::value(
                        epoch_key.as_str(),
                        CompareOp::Equal,
                        record.epoch.to_string(),
                    )])
                    .and_then(vec![TxnOp::put(record_key.as_str(), json, None)])
                    .or_else(vec![TxnOp::get(epoch_key.as_str(), None)]);
                let response = client.txn(txn).await.map_err(etcd_err("txn", record_key))?;
                if response.succeeded() {
                    return Ok(());
                }
                let current = adspend_common::etcd::txn_got_value(&response)
                    .unwrap_or_else(|| "<none>".into());
                Err(Error::Fenced {
                    shard: shard.clone(),
                    ours: record.epoch,
                    current,
                })
            }
            CheckpointStore::Local { dir, shard } => {
                let _lock = lock_dir(dir)?;
                let current = {
                    let path = dir.join("epoch");
                    std::fs::read(&path)
                        .map_err(Error::io("read", &path))
                        .and_then(|b| parse_epoch(&path.display().to_string(), &b))?
                };
                if current != record.epoch {
                    return Err(Error::Fenced {
                        shard: shard.clone(),
                        ours: record.epoch,
                        current: current.to_string(),
                    });
                }
                write_atomic(&dir.join("checkpoint.json"), &json)
            }
        }
    }
}

/// Exclusive lock on the shard's local checkpoint directory, so that two
/// processes on one machine cannot interleave compare and write.
fn lock_dir(dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>> {
    let path = dir.join("lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(Error::io("open", &path))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, errno)| Error::io("lock", &path)(std::io::Error::from(errno)))
}

/// Replace `path` with `bytes` so that a crash leaves either the old or the
/// new content, durably: write a temporary file, fsync it, rename, fsync the
/// directory.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("tmp");
    {
        let mut file = std::fs::File::create(&tmp).map_err(Error::io("create", &tmp))?;
        file.write_all(bytes).map_err(Error::io("write", &tmp))?;
        file.sync_all().map_err(Error::io("fsync", &tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(Error::io("rename", path))?;
    crate::store::fsync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(epoch: u64, id: u64) -> CheckpointRecord {
        CheckpointRecord {
            checkpoint_id: id,
            seq: id * 10,
            snapshot_key: format!("s/{id}"),
            checksum: "x".into(),
            size_bytes: 1,
            epoch,
            lineage: "l".into(),
            created_ms: 0,
            deltas: Vec::new(),
        }
    }

    #[tokio::test]
    async fn a_garbled_epoch_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = CheckpointStore::open(&[], dir.path(), "all").await.unwrap();
        store.acquire_epoch().await.unwrap();
        let path = dir.path().join("checkpoint").join("epoch");
        std::fs::write(&path, b"x7").unwrap();
        for err in [
            store.acquire_epoch().await.unwrap_err(),
            store.current_epoch().await.unwrap_err(),
        ] {
            let text = err.to_string();
            assert!(
                text.contains("owner epoch") && text.contains("\"x7\""),
                "{text}"
            );
            assert!(text.contains(&path.display().to_string()), "{text}");
        }
        assert_eq!(std::fs::read(&path).unwrap(), b"x7", "nothing overwritten");
    }

    #[tokio::test]
    async fn local_store_fences_stale_owner() {
        let dir = tempfile::tempdir().unwrap();
        let mut first = CheckpointStore::open(&[], dir.path(), "all").await.unwrap();
        assert!(first.load().await.unwrap().is_none());
        let e1 = first.acquire_epoch().await.unwrap();
        first.commit(&record(e1, 1)).await.unwrap();
        let mut second = CheckpointStore::open(&[], dir.path(), "all").await.unwrap();
        let e2 = second.acquire_epoch().await.unwrap();
        assert_eq!(e2, e1 + 1);
        let err = first.commit(&record(e1, 2)).await.unwrap_err();
        assert!(matches!(err, Error::Fenced { .. }), "{err}");
        second.commit(&record(e2, 3)).await.unwrap();
        assert_eq!(second.load().await.unwrap().unwrap(), record(e2, 3));
    }
}
