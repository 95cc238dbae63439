//! Start-up: decide between the local LMDB (warm restart) and the snapshot
//! named by the checkpoint record (cold restore), per DESIGN.md rule 2.

use std::path::Path;

use crate::checkpoint::record::CheckpointRecord;
use crate::snapshot_store::SnapshotStore;

use futures::StreamExt;

use crate::checkpoint::delta::Delta;
use crate::error::Error;
use crate::store::{Store, DATA_FILE};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// No record and no local state.
    Fresh,
    /// Local LMDB of the recorded lineage, at or past the record.
    Warm,
    /// Downloaded and verified the recorded snapshot.
    Cold,
    /// The recorded snapshot was gone: rebuilt from an empty state by
    /// replaying `SPEND` ([`crate::checkpoint::missing`]).
    Rebuilt,
}

impl Start {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Start::Fresh => "fresh",
            Start::Warm => "warm",
            Start::Cold => "cold",
            Start::Rebuilt => "rebuilt",
        }
    }
}

fn new_lineage() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let mut seed = nanos.to_be_bytes().to_vec();
    seed.extend_from_slice(&std::process::id().to_be_bytes());
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&seed))
}

/// A new history: an empty store gets a lineage of its own.
fn fresh(store: Store) -> Result<(Store, String, Start), Error> {
    let lineage = new_lineage();
    let mut txn = store.write_txn()?;
    store.set_lineage(&mut txn, &lineage)?;
    txn.commit().map_err(store.err("commit"))?;
    Ok((store, lineage, Start::Fresh))
}

/// A new history in place of whatever `lmdb_dir` held: an empty store of a
/// new lineage whose last applied sequence is `start_after` (0: the whole
/// stream is replayed). For a recorded snapshot that is gone
/// ([`crate::checkpoint::missing`]).
pub(crate) fn rebuild(
    lmdb_dir: &Path,
    map_size: usize,
    start_after: u64,
) -> Result<(Store, String, Start), Error> {
    if lmdb_dir.exists() {
        std::fs::remove_dir_all(lmdb_dir).map_err(adspend_common::Error::io("remove", lmdb_dir))?;
    }
    let (store, lineage, _) = fresh(Store::open(lmdb_dir, map_size)?)?;
    if start_after > 0 {
        let mut txn = store.write_txn()?;
        store.set_last_applied_seq(&mut txn, start_after)?;
        txn.commit().map_err(store.err("commit"))?;
    }
    if let Some(parent) = lmdb_dir.parent() {
        crate::store::fsync_dir(parent)?;
    }
    Ok((store, lineage, Start::Rebuilt))
}

/// A failed fetch of `key`, named by `record`: a [`Error::SnapshotMissing`]
/// when the store answered that it is not there.
fn fetch_failed(
    snapshots: &SnapshotStore,
    record: &CheckpointRecord,
    key: &str,
) -> impl FnOnce(adspend_common::Error) -> Error {
    let missing = Error::SnapshotMissing {
        url: snapshots.url().to_string(),
        key: key.to_string(),
        checkpoint_id: record.checkpoint_id,
        seq: record.seq,
    };
    move |e| {
        if crate::snapshot_store::is_not_found(&e) {
            missing
        } else {
            e.into()
        }
    }
}

/// Deltas fetched ahead of the one being applied during a restore.
const DELTA_FETCHES: usize = 4;

/// Check the downloaded base against the record, then bring it to the
/// record's sequence with the record's deltas, in order, each verified
/// (size and checksum as recorded, same lineage, a sequence range that
/// covers where the state stands).
async fn verify_and_apply_deltas(
    restored: &Store,
    record: &CheckpointRecord,
    snapshots: &SnapshotStore,
) -> Result<(), Error> {
    let (lineage, mut seq) = restored.position()?;
    let first_needed = record.deltas.first().map_or(record.seq, |d| d.seq);
    if lineage.as_deref() != Some(record.lineage.as_str())
        || (record.deltas.is_empty() && seq < record.seq)
        || seq > first_needed
    {
        return Err(Error::SnapshotMismatch {
            key: record.snapshot_key.clone(),
            reason: format!(
                "snapshot has lineage {lineage:?} at sequence {seq}, record says {} at {} with {} deltas",
                record.lineage,
                record.seq,
                record.deltas.len()
            ),
        });
    }
    // Fetched into memory, a few ahead of the one being applied (no local
    // file, no fsync); each applied in a transaction of its own.
    let mut fetches = futures::stream::iter(record.deltas.clone())
        .map(|delta_ref| {
            let snapshots = snapshots.clone();
            async move {
                let fetched = snapshots.get(&delta_ref.key).await;
                (delta_ref, fetched)
            }
        })
        .buffered(DELTA_FETCHES);
    while let Some((delta_ref, fetched)) = fetches.next().await {
        let (bytes, checksum) = fetched.map_err(fetch_failed(snapshots, record, &delta_ref.key))?;
        let size = bytes.len() as u64;
        if size != delta_ref.size_bytes || checksum != delta_ref.checksum {
            return Err(adspend_common::Error::SnapshotCorrupt {
                key: format!("{}/{}", snapshots.url(), delta_ref.key),
                reason: format!(
                    "expected {} bytes with {}, got {size} bytes with {checksum}",
                    delta_ref.size_bytes, delta_ref.checksum
                ),
            }
            .into());
        }
        let mismatch = |reason: String| Error::SnapshotMismatch {
            key: delta_ref.key.clone(),
            reason,
        };
        let delta = Delta::decode(&bytes).map_err(mismatch)?;
        let (from, to) = (delta.changes.from_seq, delta.changes.to_seq);
        if delta.lineage != record.lineage {
            return Err(mismatch(format!(
                "delta of lineage {}, record says {}",
                delta.lineage, record.lineage
            )));
        }
        if !(from..=to).contains(&seq) || to != delta_ref.seq {
            return Err(mismatch(format!(
                "delta covers sequences {from}..={to} (record says it ends at {}), the state is at {seq}",
                delta_ref.seq
            )));
        }
        delta.apply(restored)?;
        seq = to;
    }
    if !record.deltas.is_empty() && seq != record.seq {
        return Err(Error::SnapshotMismatch {
            key: record.snapshot_key.clone(),
            reason: format!("deltas end at {seq}, record says {}", record.seq),
        });
    }
    Ok(())
}

/// Open the shard's LMDB at `lmdb_dir`, restoring it first if needed: the
/// record's base and deltas are downloaded from `snapshots`, verified and
/// applied under `tmp_dir`, then swapped in for `lmdb_dir`. The downloads
/// are awaited; the file and LMDB work in between runs on the calling task.
pub async fn open_or_restore(
    lmdb_dir: &Path,
    tmp_dir: &Path,
    record: Option<&CheckpointRecord>,
    snapshots: &SnapshotStore,
    map_size: usize,
) -> Result<(Store, String, Start), Error> {
    if lmdb_dir.join(DATA_FILE).exists() {
        let store = Store::open(lmdb_dir, map_size)?;
        let (lineage, seq) = store.position()?;
        match (record, lineage) {
            (None, Some(lineage)) => return Ok((store, lineage, Start::Warm)),
            (Some(r), Some(lineage)) if lineage == r.lineage && seq >= r.seq => {
                return Ok((store, lineage, Start::Warm))
            }
            (Some(r), lineage) => {
                tracing::warn!(
                    local_lineage = lineage.as_deref().unwrap_or("none"),
                    local_seq = seq,
                    record_lineage = r.lineage,
                    record_seq = r.seq,
                    "local state is not usable; restoring the recorded snapshot"
                );
                store.close();
            }
            (None, None) => {
                return fresh(store);
            }
        }
    }
    let Some(record) = record else {
        let store = Store::open(lmdb_dir, map_size)?;
        return fresh(store);
    };
    let restore_dir = tmp_dir.join("restore");
    let _ = std::fs::remove_dir_all(&restore_dir);
    std::fs::create_dir_all(&restore_dir)
        .map_err(adspend_common::Error::io("create", &restore_dir))?;
    let key = &record.snapshot_key;
    let (size, checksum) = snapshots
        .download(key, &restore_dir.join(DATA_FILE))
        .await
        .map_err(fetch_failed(snapshots, record, key))?;
    if size != record.size_bytes || checksum != record.checksum {
        return Err(adspend_common::Error::SnapshotCorrupt {
            key: format!("{}/{key}", snapshots.url()),
            reason: format!(
                "expected {} bytes with {}, got {size} bytes with {checksum}",
                record.size_bytes, record.checksum
            ),
        }
        .into());
    }
    adspend_common::failpoint::hit("aggregator.during_restore");
    {
        let restored = Store::open(&restore_dir, map_size)?;
        let result = verify_and_apply_deltas(&restored, record, snapshots).await;
        restored.close();
        result?;
    }
    if lmdb_dir.exists() {
        std::fs::remove_dir_all(lmdb_dir).map_err(adspend_common::Error::io("remove", lmdb_dir))?;
    }
    std::fs::rename(&restore_dir, lmdb_dir)
        .map_err(adspend_common::Error::io("rename", lmdb_dir))?;
    if let Some(parent) = lmdb_dir.parent() {
        crate::store::fsync_dir(parent)?;
    }
    let store = Store::open(lmdb_dir, map_size)?;
    Ok((store, record.lineage.clone(), Start::Cold))
}
