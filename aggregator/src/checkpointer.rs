//! Checkpoints, in the order of DESIGN.md's protocol: the marker's sequence is
//! already committed (the writer asks only after its commit) → consistent copy
//! of LMDB from a read transaction while the writer keeps going → upload
//! (complete or absent) → checkpoint record, fenced by the owner epoch → GC of
//! older snapshots. A crash between any two steps leaves the previous
//! checkpoint in force. Requests that arrive while one is running coalesce
//! into the newest.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use adspend_common::checkpoint::{CheckpointRecord, CheckpointStore};
use adspend_common::snapshot_store::SnapshotStore;
use adspend_common::telemetry::{
    CHECKPOINTS_COALESCED_TOTAL, CHECKPOINTS_TOTAL, CHECKPOINT_SECONDS, SNAPSHOT_BYTES,
};
use adspend_common::{failpoint, now_ms};
use heed::CompactionOption;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::apply::CheckpointRequest;
use crate::error::Error;
use crate::fence::Validity;
use crate::store::Store;

/// File name of the LMDB data file, in snapshots as in the environment.
pub const DATA_FILE: &str = "data.mdb";

pub struct Checkpointer {
    pub store: Arc<Store>,
    pub snapshots: SnapshotStore,
    pub records: CheckpointStore,
    pub shard: String,
    pub epoch: u64,
    pub lineage: String,
    pub next_id: u64,
    pub tmp_dir: PathBuf,
    /// Snapshots kept besides the newest.
    pub keep: usize,
    /// In cluster mode, the lease this shard is owned under: nothing is
    /// uploaded or recorded once it has lapsed.
    pub lease: Option<Arc<Validity>>,
}

impl Checkpointer {
    /// Serve checkpoint requests until `cancel` (or the writer is gone);
    /// gives itself back so that a handover can take a last checkpoint after
    /// the writer's final commit.
    pub async fn run(
        mut self,
        mut requests: watch::Receiver<CheckpointRequest>,
        cancel: CancellationToken,
    ) -> Result<Self, Error> {
        let mut last_request = requests.borrow().0;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return Ok(self),
                changed = requests.changed() => if changed.is_err() { return Ok(self) },
            }
            let (request, seq) = *requests.borrow_and_update();
            let coalesced = request.saturating_sub(last_request).saturating_sub(1);
            if coalesced > 0 {
                metrics::counter!(CHECKPOINTS_COALESCED_TOTAL).increment(coalesced);
            }
            last_request = request;
            let started = Instant::now();
            tracing::debug!(seq, "checkpoint: start");
            match self.checkpoint(seq).await {
                Ok(record) => {
                    metrics::counter!(CHECKPOINTS_TOTAL, "outcome" => "ok").increment(1);
                    metrics::histogram!(CHECKPOINT_SECONDS).record(started.elapsed().as_secs_f64());
                    metrics::gauge!(SNAPSHOT_BYTES, "shard" => self.shard.clone())
                        .set(record.size_bytes as f64);
                    tracing::debug!(
                        id = record.checkpoint_id,
                        seq = record.seq,
                        bytes = record.size_bytes,
                        "checkpoint recorded"
                    );
                }
                Err(
                    e @ (Error::Common(adspend_common::Error::Fenced { .. })
                    | Error::LeaseLost { .. }),
                ) => return Err(e),
                Err(e) => {
                    // The previous checkpoint stays in force; the next marker retries.
                    metrics::counter!(CHECKPOINTS_TOTAL, "outcome" => "failed").increment(1);
                    tracing::error!(error = %e, "checkpoint failed");
                }
            }
        }
    }

    pub async fn checkpoint(&mut self, marker_seq: u64) -> Result<CheckpointRecord, Error> {
        let id = self.next_id;
        let dir = self.tmp_dir.join(format!("snap-{id}"));
        let file = dir.join(DATA_FILE);
        let store = self.store.clone();
        let copy_dir = dir.clone();
        let seq = tokio::task::spawn_blocking(move || -> Result<u64, Error> {
            let _ = std::fs::remove_dir_all(&copy_dir);
            std::fs::create_dir_all(&copy_dir)
                .map_err(adspend_common::Error::io("create", &copy_dir))?;
            // The copy's own read transaction starts after this one, so the
            // snapshot holds at least everything through `seq`.
            let seq = {
                let txn = store.read_txn()?;
                store.last_applied_seq(&txn)?
            };
            let copy = copy_dir.join(DATA_FILE);
            store
                .env
                .copy_to_path(&copy, CompactionOption::Enabled)
                .map_err(store.err("copy"))?;
            // LMDB writes the copy in one call; a crash inside it leaves a
            // partial file, which is what this failure point leaves behind.
            failpoint::hit_after("aggregator.mid_copy", || {
                if let Ok(file) = std::fs::OpenOptions::new().write(true).open(&copy) {
                    let half = file.metadata().map(|m| m.len() / 2).unwrap_or(0);
                    let _ = file.set_len(half);
                }
            });
            Ok(seq)
        })
        .await
        .map_err(|e| Error::Task("snapshot copy", e.to_string()))??;
        debug_assert!(seq >= marker_seq);
        // The epoch keeps a stale owner (same next id) from overwriting the
        // new owner's object; names still sort by checkpoint id for GC.
        let key = format!("{}/{id:020}-{seq:020}-e{}.mdb", self.shard, self.epoch);
        self.check_lease()?;
        tracing::debug!(id, seq, key, "checkpoint: copied; uploading");
        let (size_bytes, checksum) = self.snapshots.upload(&key, &file).await?;
        tracing::debug!(id, seq, size_bytes, "checkpoint: uploaded; recording");
        failpoint::hit("aggregator.after_upload");
        self.check_lease()?;
        let record = CheckpointRecord {
            checkpoint_id: id,
            seq,
            snapshot_key: key.clone(),
            checksum,
            size_bytes,
            epoch: self.epoch,
            lineage: self.lineage.clone(),
            created_ms: now_ms(),
        };
        self.records.commit(&record).await?;
        self.next_id += 1;
        failpoint::hit("aggregator.after_record");
        let _ = tokio::fs::remove_dir_all(&dir).await;
        self.collect_garbage(&key).await;
        Ok(record)
    }

    fn check_lease(&self) -> Result<(), Error> {
        match &self.lease {
            Some(lease) if !lease.is_valid() => Err(Error::LeaseLost {
                shard: self.shard.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// Delete all but the newest `keep + 1` snapshots of this shard. Names
    /// sort by checkpoint id; the recorded one is never deleted.
    async fn collect_garbage(&self, current: &str) {
        let keys = match self.snapshots.list(&self.shard).await {
            Ok(keys) => keys,
            Err(e) => {
                tracing::warn!(error = %e, "snapshot GC: listing failed");
                return;
            }
        };
        let doomed = keys.len().saturating_sub(self.keep + 1);
        for key in keys.iter().take(doomed).filter(|k| k.as_str() != current) {
            if let Err(e) = self.snapshots.delete(key).await {
                tracing::warn!(error = %e, "snapshot GC: delete failed");
            }
        }
    }
}
