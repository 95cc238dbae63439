//! Incremental checkpoints at scale, without NATS: one store grown to each
//! dedupe-id count in turn (1,000,000 limits), and at each size a full base
//! copy, then a delta checkpoint of a fixed change (the same hot limits and
//! new ids per interval) while the writer keeps applying, then a cold
//! restore of base + deltas. The delta's time and bytes should stay flat as
//! the state grows; the base's grow with it.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use adspend_aggregator::apply::{Incoming, Writer};
use adspend_aggregator::checkpointer::Checkpointer;
use adspend_aggregator::record::CheckpointStore;
use adspend_aggregator::restore;
use adspend_aggregator::snapshot_store::SnapshotStore;
use adspend_aggregator::store::Store;

use super::state::{self, Feed, Progress, Skew};

/// One size of the table.
#[derive(Debug, Clone)]
pub struct DeltaRow {
    pub ids: usize,
    pub base_secs: f64,
    pub base_bytes: u64,
    pub delta_secs: f64,
    pub delta_bytes: u64,
    /// Tuples applied between the two deltas (the interval's change).
    pub interval_tuples: u64,
    /// The writer's rate during the delta checkpoint, and alone over the
    /// interval just before it.
    pub ingest_during: f64,
    pub ingest_before: f64,
    /// Download and apply of base + deltas into a fresh directory.
    pub restore_secs: f64,
}

/// Grows one store through `sizes` (dedupe ids, ascending) and measures a
/// row at each. `hot_limits` limits and `interval_ids` new ids change per
/// interval.
pub struct DeltaBench {
    pub limits: usize,
    pub sizes: Vec<usize>,
    pub hot_limits: usize,
    pub interval_ids: usize,
}

impl DeltaBench {
    pub async fn run(
        &self,
        scratch: &Path,
        mut row_done: impl FnMut(&DeltaRow),
    ) -> anyhow::Result<Vec<DeltaRow>> {
        let (mut writer, store, dirty) = state::writer(&scratch.join("lmdb"))?;
        let snapshots =
            SnapshotStore::from_url(&format!("file://{}", scratch.join("snapshots").display()))?;
        let mut records = CheckpointStore::open(&[], scratch, "bench").await?;
        let epoch = records.acquire_epoch().await?;
        let mut checkpointer = Checkpointer {
            store: store.clone(),
            snapshots: snapshots.clone(),
            records,
            shard: "bench".into(),
            epoch,
            lineage: "bench".into(),
            next_id: 1,
            tmp_dir: scratch.join("tmp"),
            keep: 0,
            lease: None,
            changes: writer.changes(),
            chain: None,
            max_deltas: 1_000,
            trim: None,
        };
        {
            let mut txn = store.write_txn()?;
            store.set_lineage(&mut txn, "bench")?;
            txn.commit()?;
        }
        // Every limit once (in order would be kinder to LMDB than traffic
        // is: uniform draws, about two per limit), then Zipf for the bulk.
        let mut uniform = Feed::new(self.limits, Skew::Uniform, 11)?;
        let mut zipf = Feed::new(self.limits, Skew::Zipf(1.0), 12)?;
        let mut hot = Feed::new(self.hot_limits, Skew::Uniform, 13)?;
        let mut next_seq = 1u64;
        let mut applied = 0usize;
        let mut rows = Vec::new();
        for (i, &size) in self.sizes.iter().enumerate() {
            let fill_started = Instant::now();
            while applied < size {
                let feed = if applied < 2 * self.limits {
                    &mut uniform
                } else {
                    &mut zipf
                };
                feed.next_seq = next_seq;
                let group = feed.group();
                next_seq = feed.next_seq;
                applied += writer.apply_group(&group)?.applied as usize;
                drop(dirty.take());
            }
            println!(
                "bench:   deltas: store at {} ids, {} limits ({:.0}s to fill)",
                applied,
                self.limits,
                fill_started.elapsed().as_secs_f64()
            );
            // The writer applies the hot limits' traffic on its own thread:
            // alone first (a warm-up), then paused for a full base (no
            // load, so the base's own time is clear), then again until
            // `interval_ids` more are applied, and the delta on top of the
            // base is measured while it keeps applying.
            hot.next_seq = next_seq;
            // Enough for the 1.5 s warm-up at up to 8M tuples/s and the
            // interval, with room after (4M/s ran out once, on an idle
            // machine).
            let tuples = 12_000_000 + 3 * self.interval_ids;
            let groups: Vec<Vec<Incoming>> = (0..tuples.div_ceil(state::TUPLES_PER_MESSAGE * 10))
                .map(|_| hot.group())
                .collect();
            next_seq = hot.next_seq + 1;
            let progress = Arc::new(Progress::default());
            let stop = Arc::new(AtomicBool::new(false));
            let paused = Arc::new(AtomicBool::new(false));
            let idle = Arc::new(AtomicBool::new(false));
            let load = {
                let (progress, stop, dirty) = (progress.clone(), stop.clone(), dirty.clone());
                let (paused, idle) = (paused.clone(), idle.clone());
                std::thread::spawn(move || -> anyhow::Result<(Writer, u64)> {
                    let mut writer = writer;
                    let (mut last_seq, mut applied) = (0, 0);
                    progress.mark(0);
                    for group in groups {
                        while paused.load(Ordering::Acquire) && !stop.load(Ordering::Relaxed) {
                            idle.store(true, Ordering::Release);
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        idle.store(false, Ordering::Release);
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        applied += writer.apply_group(&group)?.applied;
                        last_seq = group.last().map_or(last_seq, |m| m.seq);
                        drop(dirty.take());
                        progress.mark(applied);
                    }
                    Ok((writer, last_seq))
                })
            };
            let count = || progress.applied();
            let finished = |load: &std::thread::JoinHandle<_>| load.is_finished();
            while count() == 0 && !finished(&load) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // Warm-up: the hot limits' pages come into the cache.
            tokio::time::sleep(Duration::from_millis(1_500)).await;

            paused.store(true, Ordering::Release);
            while !idle.load(Ordering::Acquire) && !finished(&load) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            checkpointer.chain = None;
            let seq = store.position()?.1;
            let started = Instant::now();
            let base = checkpointer.checkpoint(seq).await?;
            let base_secs = started.elapsed().as_secs_f64();
            anyhow::ensure!(base.deltas.is_empty(), "expected a base");
            paused.store(false, Ordering::Release);

            let (interval_start, interval_from) = (Instant::now(), count());
            while count() < interval_from + self.interval_ids as u64 && !finished(&load) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if finished(&load) {
                let outcome = load
                    .join()
                    .map_err(|_| anyhow::anyhow!("writer thread panicked"))?;
                anyhow::bail!(
                    "the writer stopped before the interval was applied: {:?}",
                    outcome.err()
                );
            }
            let seq = store.position()?.1;
            let (t0, n0) = (Instant::now(), count());
            let record = checkpointer.checkpoint(seq).await?;
            let t1 = Instant::now();
            // Let the group running at t1 finish, for the interpolation.
            tokio::time::sleep(Duration::from_millis(300)).await;
            stop.store(true, Ordering::Relaxed);
            let (back, _) = load
                .join()
                .map_err(|_| anyhow::anyhow!("writer thread panicked"))??;
            writer = back;
            anyhow::ensure!(
                progress.last().is_some_and(|t| t >= t1),
                "the pre-generated load ran out before the delta checkpoint ended"
            );
            anyhow::ensure!(record.deltas.len() == 1, "expected one delta on the base");
            let delta = record.deltas.last().expect("one delta");
            applied = writer.dedupe_ids();

            // Cold restore of the chain into a fresh directory.
            let restore_dir = scratch.join(format!("restore-{i}"));
            std::fs::create_dir_all(restore_dir.join("tmp"))?;
            let started = Instant::now();
            let (restored, _, start) = restore::open_or_restore(
                &restore_dir.join("lmdb"),
                &restore_dir.join("tmp"),
                Some(&record),
                &snapshots,
                store.map_size(),
            )
            .await?;
            let restore_secs = started.elapsed().as_secs_f64();
            anyhow::ensure!(start == restore::Start::Cold);
            anyhow::ensure!(restored.position()?.1 == record.seq);
            close(restored);
            std::fs::remove_dir_all(&restore_dir)?;

            let row = DeltaRow {
                ids: applied,
                base_secs,
                base_bytes: base.size_bytes,
                delta_secs: (t1 - t0).as_secs_f64(),
                delta_bytes: delta.size_bytes,
                interval_tuples: n0 - interval_from,
                ingest_during: progress.rate(t0, t1),
                // The writer alone over the interval just before the delta
                // (the first seconds after a fill run faster or slower as
                // LMDB's pages warm).
                ingest_before: progress.rate(interval_start, t0),
                restore_secs,
            };
            row_done(&row);
            rows.push(row);
        }
        Ok(rows)
    }
}

fn close(store: Store) {
    store.env.prepare_for_closing().wait();
}
