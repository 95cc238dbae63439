//! Checkpoints, in the order of DESIGN.md's protocol: the marker's sequence is
//! already committed (the writer asks only after its commit) → consistent copy
//! of LMDB from a read transaction while the writer keeps going → upload
//! (complete or absent) → checkpoint record, fenced by the owner epoch → GC of
//! older snapshots. A crash between any two steps leaves the previous
//! checkpoint in force. Requests that arrive while one is running coalesce
//! into the newest.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::checkpoint::record::{CheckpointRecord, CheckpointStore, DeltaRef};
use crate::snapshot_store::SnapshotStore;
use adspend_common::{failpoint, now_ms};
use heed::CompactionOption;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::delta::Changes;
use crate::checkpoint::trim::{base_seq, SpendTrim};
use crate::error::Error;
use crate::fence::Validity;
use crate::handoff::CheckpointRequest;
use crate::store::{Store, DATA_FILE};
use crate::telemetry::{
    CHAIN_LOST_TOTAL, CHECKPOINTS_COALESCED_TOTAL, CHECKPOINTS_TOTAL, CHECKPOINT_SECONDS,
    CHECKPOINT_UPLOADED_BYTES_TOTAL, SNAPSHOT_BYTES,
};

mod failures;

pub(crate) use failures::{Failing, Reason};

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
    /// The writer's changes since the last checkpoint ([`Writer::changes`](crate::apply::Writer::changes)).
    pub changes: Arc<Mutex<Changes>>,
    /// The recorded checkpoint the next delta extends; `None` makes the
    /// next checkpoint a new base. Set it only when the store stands
    /// exactly at the record (same lineage, same sequence).
    pub chain: Option<CheckpointRecord>,
    /// Deltas on one base before a new base is copied (0: every checkpoint
    /// is a full copy). A new base is also copied once the deltas add up
    /// to the base's size.
    pub max_deltas: usize,
    /// Trims the shard's `SPEND` partitions after each checkpoint; `None`
    /// keeps them whole (benchmarks, unit tests).
    pub trim: Option<SpendTrim>,
}

impl Checkpointer {
    /// Serve checkpoint requests until `cancel` (or the writer is gone);
    /// gives itself back so that a handover can take a last checkpoint after
    /// the writer's final commit.
    pub(crate) async fn run(
        mut self,
        mut requests: watch::Receiver<CheckpointRequest>,
        cancel: CancellationToken,
    ) -> Result<Self, Error> {
        let mut last_request = requests.borrow().0;
        let mut failing = Failing::default();
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
                    failing.recovered(&self.shard, &record);
                    metrics::counter!(CHECKPOINTS_TOTAL, "outcome" => "ok").increment(1);
                    let kind = if record.deltas.is_empty() {
                        "base"
                    } else {
                        "delta"
                    };
                    metrics::histogram!(CHECKPOINT_SECONDS, "kind" => kind)
                        .record(started.elapsed().as_secs_f64());
                    metrics::gauge!(SNAPSHOT_BYTES, "shard" => self.shard.clone())
                        .set(record.size_bytes as f64);
                    crate::telemetry::last_checkpoint(&self.shard)
                        .set(record.created_ms as f64 / 1000.0);
                    tracing::debug!(
                        id = record.checkpoint_id,
                        seq = record.seq,
                        kind,
                        deltas = record.deltas.len(),
                        elapsed_ms = started.elapsed().as_millis() as u64,
                        "checkpoint recorded"
                    );
                }
                Err(e) if e.lost_ownership() => return Err(e),
                Err(e) => {
                    // The previous checkpoint stays in force; the next marker retries.
                    metrics::counter!(CHECKPOINTS_TOTAL, "outcome" => "failed").increment(1);
                    let reason = failing.failed(&self.shard, &self.snapshots, &e);
                    if reason == Reason::BucketMissing {
                        // Whatever the chain named went with the bucket.
                        self.chain = None;
                        failures::create_bucket(&self.shard, &self.snapshots).await;
                    }
                }
            }
        }
    }

    /// Take a checkpoint covering at least `marker_seq`: a delta on top of
    /// the recorded chain when there is one to extend, else a new base.
    pub async fn checkpoint(&mut self, marker_seq: u64) -> Result<CheckpointRecord, Error> {
        let extend = self
            .chain
            .as_ref()
            .filter(|chain| {
                chain.deltas.len() < self.max_deltas && chain.delta_bytes() < chain.size_bytes
            })
            .cloned();
        // A delta is only as good as the objects it extends: a store that
        // lost them (restarted empty) gets a new base instead.
        let extend = match extend {
            Some(chain) => {
                let keys = self.snapshots.list(&self.shard).await?;
                self.chain_intact(&chain, &keys).then_some((chain, keys))
            }
            None => None,
        };
        let result = match extend {
            // A delta that fails puts what it took back, or resets the chain
            // when it cannot (see `delta`).
            Some((chain, keys)) => self.delta(chain, keys).await,
            None => {
                let result = self.base(marker_seq).await;
                if result.is_err() {
                    self.chain = None;
                }
                result
            }
        };
        if let Ok(record) = &result {
            self.chain = Some(record.clone());
        }
        result
    }

    /// Whether every object `chain` names is among `keys` (the shard's
    /// objects); if not, says so and drops the chain, so that this
    /// checkpoint copies a new base.
    fn chain_intact(&mut self, chain: &CheckpointRecord, keys: &[String]) -> bool {
        let gone: Vec<&str> = std::iter::once(chain.snapshot_key.as_str())
            .chain(chain.deltas.iter().map(|d| d.key.as_str()))
            .filter(|key| keys.binary_search_by(|k| k.as_str().cmp(key)).is_err())
            .collect();
        if gone.is_empty() {
            return true;
        }
        metrics::counter!(CHAIN_LOST_TOTAL, "shard" => self.shard.clone()).increment(1);
        tracing::error!(
            shard = self.shard,
            store = self.snapshots.url(),
            checkpoint = chain.checkpoint_id,
            gone = gone.join(","),
            "objects of the recorded checkpoint are gone from the store (it lost them); \
             this checkpoint copies a new base instead of a delta on them"
        );
        self.chain = None;
        false
    }

    /// Upload the changes since the last checkpoint and record them as the
    /// next link of `chain`; `keys` are the shard's objects before it.
    async fn delta(
        &mut self,
        chain: CheckpointRecord,
        keys: Vec<String>,
    ) -> Result<CheckpointRecord, Error> {
        let id = self.next_id;
        let changes = self.changes.clone();
        let lineage = self.lineage.clone();
        // Taken at the service's priority (the writer takes the same lock
        // for each commit); the encoding refers to the ids, copying none.
        let encoded = tokio::task::spawn_blocking(move || -> Result<_, Error> {
            let taken = changes.lock().expect("changes lock").take();
            let pieces = taken
                .encode_pieces(&lineage)
                .map_err(Error::task("delta encoding"))?;
            Ok((taken, pieces))
        })
        .await
        .map_err(Error::task("delta encoding"));
        let (taken, pieces) = match encoded {
            Ok(Ok(encoded)) => encoded,
            Ok(Err(e)) | Err(e) => {
                // What was taken is gone: the next checkpoint is a base.
                self.chain = None;
                return Err(e);
            }
        };
        // A base copied while the writer committed stands at or after where
        // its changes were reset; absolute values make that range fine.
        if !(taken.from_seq..=taken.to_seq).contains(&chain.seq) {
            self.chain = None;
            return Err(Error::SnapshotMismatch {
                key: format!("{}/{id}", self.shard),
                reason: format!(
                    "changes cover sequences {}..={} but the chain is at {}",
                    taken.from_seq, taken.to_seq, chain.seq
                ),
            });
        }
        let seq = taken.to_seq;
        let key = format!("{}/{id:020}-{seq:020}-e{}.delta", self.shard, self.epoch);
        tracing::debug!(
            id,
            seq,
            key,
            sums = taken.sums(),
            ids = taken.ids_added(),
            size = pieces.iter().map(|p| p.len()).sum::<usize>(),
            "checkpoint: delta encoded; uploading"
        );
        let result = self
            .upload_and_record(chain, id, seq, key, pieces, keys)
            .await;
        if result.is_err() {
            // Nothing was recorded (or, if the record's outcome is unknown,
            // a record this chain plus the put-back changes still covers):
            // the next delta carries these changes too, on the same chain.
            self.changes.lock().expect("changes lock").put_back(taken);
        }
        result
    }

    /// Upload one encoded delta and record it as the next link of `chain`.
    async fn upload_and_record(
        &mut self,
        chain: CheckpointRecord,
        id: u64,
        seq: u64,
        key: String,
        pieces: Vec<bytes::Bytes>,
        keys: Vec<String>,
    ) -> Result<CheckpointRecord, Error> {
        self.check_lease().await?;
        let (size_bytes, checksum) = self.snapshots.put(&key, pieces).await?;
        failpoint::hit("aggregator.after_upload");
        self.check_lease().await?;
        let mut record = chain;
        record.deltas.push(DeltaRef {
            key: key.clone(),
            seq,
            checksum,
            size_bytes,
        });
        record.checkpoint_id = id;
        record.seq = seq;
        record.epoch = self.epoch;
        record.created_ms = now_ms();
        self.records.commit(&record).await?;
        self.next_id += 1;
        failpoint::hit("aggregator.after_record");
        metrics::counter!(CHECKPOINT_UPLOADED_BYTES_TOTAL, "kind" => "delta").increment(size_bytes);
        let oldest_kept = self.collect_garbage(&record, Some(keys)).await;
        self.trim_spend(oldest_kept).await;
        Ok(record)
    }

    /// A compacted copy of the whole LMDB as a new base; the changes
    /// accumulated so far are dropped (the copy holds them).
    async fn base(&mut self, marker_seq: u64) -> Result<CheckpointRecord, Error> {
        let id = self.next_id;
        let dir = self.tmp_dir.join(format!("snap-{id}"));
        let file = dir.join(DATA_FILE);
        let store = self.store.clone();
        let changes = self.changes.clone();
        let copy_dir = dir.clone();
        // Reset under the writer's commit lock, before the copy's read
        // transaction begins: the next delta starts at a sequence at or
        // below the copy's, which a delta's absolute values allow (see
        // `delta`). Taken at the service's priority, so that the writer
        // never waits on the lock behind a low-priority thread.
        tokio::task::spawn_blocking(move || {
            changes.lock().expect("changes lock").take();
        })
        .await
        .map_err(Error::task("snapshot copy"))?;
        let seq = crate::background::run("copy", move || -> Result<u64, Error> {
            let _ = std::fs::remove_dir_all(&copy_dir);
            std::fs::create_dir_all(&copy_dir)
                .map_err(adspend_common::Error::io("create", &copy_dir))?;
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
            // The copy's own position, exactly: the record then says where
            // a restore of this base stands, and deltas can follow it.
            let copied = Store::open(&copy_dir, store.map_size())?;
            let position = copied.position();
            copied.close();
            Ok(position?.1)
        })
        .await
        .map_err(Error::task("snapshot copy"))??;
        debug_assert!(seq >= marker_seq);
        // The epoch keeps a stale owner (same next id) from overwriting the
        // new owner's object; names still sort by checkpoint id for GC.
        let key = format!("{}/{id:020}-{seq:020}-e{}.mdb", self.shard, self.epoch);
        self.check_lease().await?;
        tracing::debug!(id, seq, key, "checkpoint: copied; uploading");
        let (size_bytes, checksum) = self.snapshots.upload(&key, &file).await?;
        tracing::debug!(id, seq, size_bytes, "checkpoint: uploaded; recording");
        failpoint::hit("aggregator.after_upload");
        self.check_lease().await?;
        let record = CheckpointRecord {
            checkpoint_id: id,
            seq,
            snapshot_key: key.clone(),
            checksum,
            size_bytes,
            epoch: self.epoch,
            lineage: self.lineage.clone(),
            created_ms: now_ms(),
            deltas: Vec::new(),
        };
        self.records.commit(&record).await?;
        self.next_id += 1;
        failpoint::hit("aggregator.after_record");
        metrics::counter!(CHECKPOINT_UPLOADED_BYTES_TOTAL, "kind" => "base").increment(size_bytes);
        let _ = tokio::fs::remove_dir_all(&dir).await;
        let oldest_kept = self.collect_garbage(&record, None).await;
        self.trim_spend(oldest_kept).await;
        Ok(record)
    }

    /// Waits out a lapsed lease (keepalives unanswered, etcd may yet
    /// confirm it); fails once it is revoked.
    async fn check_lease(&self) -> Result<(), Error> {
        match &self.lease {
            Some(lease) => lease.wait().await.map_err(|_| Error::LeaseLost {
                shard: self.shard.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Trim `SPEND` below the oldest kept base's position, when known.
    async fn trim_spend(&mut self, oldest_kept: Option<u64>) {
        if let (Some(trim), Some(oldest_kept)) = (self.trim.as_mut(), oldest_kept) {
            trim.trim(&self.shard, oldest_kept).await;
        }
    }

    /// Delete what no kept chain needs: the chains older than the newest
    /// `keep + 1` bases (the recorded chain's and `keep` before it), and in
    /// the recorded chain's range the objects it does not name (failed
    /// attempts, which reuse the checkpoint id). Nothing the record names
    /// is deleted, nor an object whose name does not parse or whose id is
    /// past the record's (another owner's). `keys`: the shard's objects as
    /// listed before this checkpoint's upload, if they were (the new object
    /// is named by the record, so it need not be among them). Returns the
    /// position of the oldest base kept, when the listing and names tell.
    async fn collect_garbage(
        &self,
        record: &CheckpointRecord,
        keys: Option<Vec<String>>,
    ) -> Option<u64> {
        let keys = match keys {
            Some(keys) => keys,
            None => match self.snapshots.list(&self.shard).await {
                Ok(keys) => keys,
                Err(e) => {
                    tracing::warn!(error = %e, "snapshot GC: listing failed");
                    return None;
                }
            },
        };
        let base_id = object_id(&record.snapshot_key)?;
        let mut older_bases: Vec<u64> = keys
            .iter()
            .filter(|k| k.ends_with(".mdb"))
            .filter_map(|k| object_id(k))
            .filter(|&id| id < base_id)
            .collect();
        older_bases.sort_unstable_by(|a, b| b.cmp(a));
        older_bases.dedup();
        let cutoff = older_bases
            .get(..self.keep.min(older_bases.len()))
            .and_then(|kept| kept.last().copied())
            .unwrap_or(base_id);
        let named =
            |key: &str| key == record.snapshot_key || record.deltas.iter().any(|d| d.key == key);
        // Every base that stays (an undeletable one too) may be restored.
        let mut oldest_kept = base_seq(&record.snapshot_key)?;
        for key in &keys {
            let doomed = match object_id(key) {
                Some(id) if id < cutoff => true,
                Some(id) => id >= base_id && id <= record.checkpoint_id,
                None => false,
            };
            if doomed && !named(key) {
                match self.snapshots.delete(key).await {
                    Ok(()) => continue,
                    Err(e) => tracing::warn!(error = %e, "snapshot GC: delete failed"),
                }
            }
            if key.ends_with(".mdb") {
                oldest_kept = oldest_kept.min(base_seq(key)?);
            }
        }
        Some(oldest_kept)
    }
}

/// The checkpoint id at the start of an object's name
/// (`<shard>/<id:020>-<seq:020>-e<epoch>.<mdb|delta>`).
fn object_id(key: &str) -> Option<u64> {
    let name = key.rsplit('/').next()?;
    name.get(..20)?.parse().ok()
}
