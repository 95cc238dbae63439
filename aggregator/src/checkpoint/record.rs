//! Checkpoint records: where the last snapshot is and which stream sequence
//! it covers, written with a compare-and-swap on the owner epoch so that a
//! stale aggregator cannot overwrite a newer owner's record (DESIGN.md rule 5:
//! leases are not mutual exclusion, so every write is fenced).
//!
//! In etcd the record is also fenced by its own revision, so that it never
//! goes back within one owner: a commit that timed out may still be applied
//! later, after a newer one, and would otherwise put back an older record
//! whose snapshots the collector has deleted. Reads after taking ownership
//! must be answered at the revision that took it or later: etcd 3.4 can
//! answer from a member left behind by a pause (etcd-io/etcd#20418).
//!
//! Two backends: etcd (`Txn` comparing the epoch key) and, in single-machine
//! mode, files in the data directory replaced by fsynced atomic rename.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, GetResponse, Txn, TxnOp, TxnOpResponse, TxnResponse};
use serde::{Deserialize, Serialize};

use adspend_common::error::{Error, Result};
use adspend_common::etcd::{txn_got_value, Background};

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
        /// The etcd revision at which this store took ownership (0 before):
        /// a read answered at an older one comes from a member that is
        /// behind, and is asked again.
        owned_at: i64,
        /// The record key's revision as this owner last read or wrote it;
        /// `None` until read, and after a commit whose outcome is unknown.
        record_rev: Option<i64>,
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
        Self::open_with(&etcd, data_dir, shard, &Background::own()).await
    }

    /// etcd when `etcd` names endpoints (over TLS when its settings say so),
    /// else files under `data_dir/checkpoint`.
    pub(crate) async fn open_with(
        etcd: &adspend_common::config::EtcdArgs,
        data_dir: &Path,
        shard: &str,
        background: &Background,
    ) -> Result<Self> {
        if etcd.endpoints().is_empty() {
            let dir = data_dir.join("checkpoint");
            std::fs::create_dir_all(&dir).map_err(Error::io("create", &dir))?;
            return Ok(CheckpointStore::Local {
                dir,
                shard: shard.to_string(),
            });
        }
        let client = adspend_common::etcd::connect(etcd, background).await?;
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
            owned_at: 0,
            record_rev: None,
        }
    }

    /// Take ownership: atomically increment the shard's owner epoch and return
    /// it. Every later write of the previous owner fails its comparison.
    pub async fn acquire_epoch(&mut self) -> Result<u64> {
        match self {
            CheckpointStore::Etcd {
                client,
                epoch_key,
                owned_at,
                record_rev,
                ..
            } => {
                let current = client
                    .get(epoch_key.as_str(), None)
                    .await
                    .map_err(etcd_err("get", epoch_key))?;
                let mut current = current
                    .kvs()
                    .first()
                    .map(|kv| (kv.value().to_vec(), kv.mod_revision()));
                loop {
                    let (epoch, compare) = match &current {
                        Some((value, revision)) => (
                            parse_epoch(epoch_key, value)?,
                            Compare::mod_revision(epoch_key.as_str(), CompareOp::Equal, *revision),
                        ),
                        None => (
                            0,
                            Compare::create_revision(epoch_key.as_str(), CompareOp::Equal, 0),
                        ),
                    };
                    let next = epoch + 1;
                    // On a lost race, the answer carries the epoch as it
                    // stands (a read could come from a member behind).
                    let txn = Txn::new()
                        .when(vec![compare])
                        .and_then(vec![TxnOp::put(epoch_key.as_str(), next.to_string(), None)])
                        .or_else(vec![TxnOp::get(epoch_key.as_str(), None)]);
                    let response = client.txn(txn).await.map_err(etcd_err("txn", epoch_key))?;
                    if response.succeeded() {
                        *owned_at = revision_of(&response);
                        *record_rev = None;
                        return Ok(next);
                    }
                    current = txn_get(&response, 0).and_then(|get| {
                        let kv = get.kvs().first()?;
                        Some((kv.value().to_vec(), kv.mod_revision()))
                    });
                }
            }
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
    #[cfg(test)]
    pub(crate) async fn current_epoch(&mut self) -> Result<u64> {
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
                client,
                record_key,
                owned_at,
                record_rev,
                ..
            } => {
                let response =
                    read_at_least(client, record_key, *owned_at, STALE_READ_PATIENCE).await?;
                let kv = response.kvs().first();
                *record_rev = Some(kv.map_or(0, |kv| kv.mod_revision()));
                match kv {
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
                record_rev,
                ..
            } => {
                // An unknown revision (-1 matches no key) fails the first
                // attempt, whose answer then carries the record's revision.
                let mut expected = record_rev.take().unwrap_or(-1);
                for _ in 0..COMMIT_ATTEMPTS {
                    let txn = Txn::new()
                        .when(vec![
                            Compare::value(
                                epoch_key.as_str(),
                                CompareOp::Equal,
                                record.epoch.to_string(),
                            ),
                            Compare::mod_revision(record_key.as_str(), CompareOp::Equal, expected),
                        ])
                        .and_then(vec![TxnOp::put(record_key.as_str(), json.clone(), None)])
                        .or_else(vec![
                            TxnOp::get(epoch_key.as_str(), None),
                            TxnOp::get(record_key.as_str(), None),
                        ]);
                    // On an error the outcome is unknown: `record_rev` stays
                    // `None`, so a late apply of this txn cannot be built on.
                    let response = client.txn(txn).await.map_err(etcd_err("txn", record_key))?;
                    if response.succeeded() {
                        *record_rev = Some(revision_of(&response));
                        return Ok(());
                    }
                    // The or_else's first get: the epoch key.
                    let current = txn_got_value(&response);
                    if current.as_deref().map(str::trim) != Some(record.epoch.to_string().as_str())
                    {
                        return Err(Error::Fenced {
                            shard: shard.clone(),
                            ours: record.epoch,
                            current: current.unwrap_or_else(|| "<none>".into()),
                        });
                    }
                    // Still the owner, but the record moved: an earlier commit
                    // of ours whose answer was lost has landed since. Record
                    // over it only if it is older than this one: one that is
                    // ahead means another writer holds this epoch too.
                    let found = txn_get(&response, 1);
                    let found = found.as_ref().and_then(|get| get.kvs().first());
                    let moved_to = found.map_or(0, |kv| kv.mod_revision());
                    let found_seq = found
                        .and_then(|kv| serde_json::from_slice::<CheckpointRecord>(kv.value()).ok())
                        .map(|r| r.seq);
                    if let Some(found_seq) = found_seq.filter(|&s| s > record.seq) {
                        return Err(Error::Fenced {
                            shard: shard.clone(),
                            ours: record.epoch,
                            current: format!(
                                "{} (its record at sequence {found_seq} is ahead of this one at {})",
                                record.epoch, record.seq
                            ),
                        });
                    }
                    if expected >= 0 {
                        tracing::warn!(
                            shard = shard.as_str(),
                            expected,
                            found = moved_to,
                            "checkpoint record changed under its owner (an earlier commit applied late); recording over it"
                        );
                    }
                    expected = moved_to;
                }
                Err(Error::Timeout {
                    what: format!(
                        "recording the checkpoint in {record_key} (its revision kept moving)"
                    ),
                    after: Duration::ZERO,
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

/// Attempts of one commit: an unknown record revision, then one that moved.
const COMMIT_ATTEMPTS: usize = 4;

/// How long a read after taking ownership waits for an etcd member that is
/// behind before giving up (the shard's start then retries).
const STALE_READ_PATIENCE: Duration = Duration::from_secs(30);

/// The revision a response was answered at (0 if it carries no header).
fn revision_of(response: &TxnResponse) -> i64 {
    response.header().map_or(0, |h| h.revision())
}

/// The `index`th operation's answer of a transaction, if it was a get.
fn txn_get(response: &TxnResponse, index: usize) -> Option<GetResponse> {
    match response.op_responses().into_iter().nth(index)? {
        TxnOpResponse::Get(get) => Some(get),
        _ => None,
    }
}

/// `key` read at revision `at_least` or later. A member behind answers at
/// an older revision: ask again (the client may pick another member) until
/// `patience` is spent.
pub async fn read_at_least(
    client: &mut etcd_client::Client,
    key: &str,
    at_least: i64,
    patience: Duration,
) -> Result<GetResponse> {
    let started = Instant::now();
    let mut warned = false;
    loop {
        let response = client.get(key, None).await.map_err(etcd_err("get", key))?;
        let revision = response.header().map_or(0, |h| h.revision());
        if revision >= at_least {
            return Ok(response);
        }
        if started.elapsed() >= patience {
            return Err(Error::Timeout {
                what: format!(
                    "reading {key} at etcd revision {at_least} or later (the member answering stays at {revision})"
                ),
                after: patience,
            });
        }
        if !warned {
            warned = true;
            tracing::warn!(
                key,
                revision,
                at_least,
                "an etcd member answered from behind the revision this owner took over at; asking again"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
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
mod tests;
