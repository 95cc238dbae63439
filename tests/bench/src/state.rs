//! The aggregator's state alone, without NATS: the single writer's apply rate
//! (dedupe check, sums, one LMDB commit per group, exactly as `Writer::run`
//! groups messages), the dedupe log's bytes per id on disk, and the
//! checkpoint (compacted copy, upload to `file://`, fenced record) at a given
//! state size, with the ingest rate while it runs.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use adspend_aggregator::apply::{CheckpointRequest, DedupeLimits, Dirty, Incoming, Writer};
use adspend_aggregator::checkpointer::Checkpointer;
use adspend_aggregator::record::CheckpointStore;
use adspend_aggregator::snapshot_store::SnapshotStore;
use adspend_aggregator::store::Store;
use adspend_wire::types::{MsgId, SpendBatch, SpendMessage, SpendTuple};
use anyhow::Context as _;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use tokio::sync::watch;

/// Tuples per `SPEND` message, as the limiter emits at most.
pub const TUPLES_PER_MESSAGE: usize = 20_000;
/// Messages per write transaction: `Writer::run` groups up to 200,000 tuples.
const MESSAGES_PER_GROUP: usize = 10;

/// How tuples pick their limit.
#[derive(Debug, Clone, Copy)]
pub enum Skew {
    /// Every limit equally likely: the most distinct keys per transaction.
    Uniform,
    /// Zipf with this exponent over the limits, as ad traffic is.
    Zipf(f64),
}

/// Generates spend messages over a fixed set of limits with fresh ids.
pub struct Feed {
    limits: Vec<String>,
    skew: Skew,
    zipf: Option<Zipf<f64>>,
    rng: SmallRng,
    next_id: u64,
    pub next_seq: u64,
    pub stream_ms: i64,
    today: u32,
}

impl Feed {
    pub fn new(limits: usize, skew: Skew, seed: u64) -> anyhow::Result<Feed> {
        let zipf = match skew {
            Skew::Uniform => None,
            Skew::Zipf(s) => Some(Zipf::new(limits as f64, s).context("Zipf exponent")?),
        };
        let now = chrono::Utc::now().timestamp_millis();
        Ok(Feed {
            // Lengths like real limit ids ("campaign-" + a number).
            limits: (0..limits).map(|i| format!("campaign-{i:08}")).collect(),
            skew,
            zipf,
            rng: SmallRng::seed_from_u64(seed),
            next_id: seed << 40,
            next_seq: 1,
            stream_ms: now,
            today: (now / 86_400_000) as u32,
        })
    }

    fn limit(&mut self) -> usize {
        match (self.skew, &self.zipf) {
            (Skew::Zipf(_), Some(zipf)) => zipf.sample(&mut self.rng) as usize - 1,
            _ => self.rng.random_range(0..self.limits.len()),
        }
    }

    /// One message of `tuples` tuples; every tuple has a new id; a fifth of
    /// them go to lifetime limits, the rest to today's bucket.
    pub fn message(&mut self, tuples: usize) -> Incoming {
        let mut batch = Vec::with_capacity(tuples);
        let mut names: Vec<String> = Vec::new();
        let mut local: rustc_hash::FxHashMap<usize, u32> = Default::default();
        for _ in 0..tuples {
            let limit = self.limit();
            self.next_id += 1;
            let index = *local.entry(limit).or_insert_with(|| {
                names.push(self.limits[limit].clone());
                names.len() as u32 - 1
            });
            batch.push(SpendTuple {
                limit: index,
                bucket: if limit.is_multiple_of(5) {
                    adspend_wire::types::LIFETIME_BUCKET
                } else {
                    self.today
                },
                cost_micros: self.rng.random_range(100..5_000_000),
                msg_id: MsgId(
                    xxhash_rust::xxh3::xxh3_128(&self.next_id.to_le_bytes()).to_be_bytes(),
                ),
            });
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.stream_ms += 1;
        Incoming {
            seq,
            stream_ms: self.stream_ms,
            pending: 1,
            message: SpendMessage::Batch(SpendBatch {
                source_ms: self.stream_ms,
                limits: names,
                tuples: batch,
            }),
        }
    }

    /// One transaction's worth of messages.
    pub fn group(&mut self) -> Vec<Incoming> {
        (0..MESSAGES_PER_GROUP)
            .map(|_| self.message(TUPLES_PER_MESSAGE))
            .collect()
    }

    pub fn limits(&self) -> usize {
        self.limits.len()
    }
}

/// A writer over a fresh store in `dir` that keeps every id (the window is
/// bounded by the run, not by time).
pub fn writer(dir: &Path) -> anyhow::Result<(Writer, Arc<Store>, Arc<Dirty>)> {
    let store = Arc::new(Store::open(dir, 64 << 30)?);
    let dirty = Arc::new(Dirty::new(0));
    let (tx, _rx) = watch::channel::<CheckpointRequest>((0, 0));
    let writer = Writer::new(
        store.clone(),
        DedupeLimits {
            window_ms: u64::MAX,
            max_ids: u64::MAX,
        },
        dirty.clone(),
        tx,
    )?;
    Ok((writer, store, dirty))
}

pub struct ApplyRun {
    pub tuples: u64,
    pub secs: f64,
    pub tuples_per_sec: f64,
}

/// Apply `groups` generated transactions and time only the writer.
pub fn apply_rate(
    writer: &mut Writer,
    dirty: &Dirty,
    feed: &mut Feed,
    groups: usize,
) -> anyhow::Result<ApplyRun> {
    let mut busy = Duration::ZERO;
    let mut tuples = 0u64;
    for _ in 0..groups {
        let group = feed.group();
        let started = Instant::now();
        let stats = writer.apply_group(&group)?;
        busy += started.elapsed();
        tuples += stats.applied;
        // The pusher takes the changed sums every 50 ms in the service.
        drop(dirty.take());
    }
    Ok(ApplyRun {
        tuples,
        secs: busy.as_secs_f64(),
        tuples_per_sec: tuples as f64 / busy.as_secs_f64(),
    })
}

/// Bytes on disk of the dedupe log per id it holds.
pub fn dedupe_bytes_per_id(store: &Store, ids: usize) -> anyhow::Result<f64> {
    let txn = store.read_txn()?;
    let stat = store.dedupe_log.stat(&txn)?;
    Ok(stat.non_free_page_size() as f64 / ids.max(1) as f64)
}

/// This process's resident set, bytes (`/proc/self/statm`, 4 KiB pages).
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

pub struct CheckpointRun {
    pub secs: f64,
    pub bytes: u64,
    /// Tuples/s the writer applied while the checkpoint ran, and alone in
    /// the seconds before it.
    pub ingest_during: f64,
    pub ingest_before: f64,
}

/// Progress of the background writer: (when, tuples applied so far) after
/// each group.
#[derive(Default)]
pub(crate) struct Progress {
    applied: AtomicU64,
    marks: Mutex<Vec<(Instant, u64)>>,
}

impl Progress {
    pub(crate) fn mark(&self, applied: u64) {
        self.applied.store(applied, Ordering::Relaxed);
        self.marks
            .lock()
            .expect("progress")
            .push((Instant::now(), applied));
    }

    /// Tuples applied by `t`, interpolated inside the group running then (a
    /// group takes longer than a delta checkpoint).
    pub(crate) fn at(&self, t: Instant) -> f64 {
        let marks = self.marks.lock().expect("progress");
        match marks.iter().position(|(when, _)| *when >= t) {
            None => marks.last().map_or(0.0, |(_, n)| *n as f64),
            Some(0) => 0.0,
            Some(i) => {
                let ((t0, n0), (t1, n1)) = (marks[i - 1], marks[i]);
                let share = (t - t0).as_secs_f64() / (t1 - t0).as_secs_f64().max(1e-9);
                n0 as f64 + (n1 - n0) as f64 * share
            }
        }
    }

    pub(crate) fn rate(&self, from: Instant, to: Instant) -> f64 {
        (self.at(to) - self.at(from)) / (to - from).as_secs_f64().max(1e-9)
    }

    pub(crate) fn last(&self) -> Option<Instant> {
        self.marks.lock().expect("progress").last().map(|(t, _)| *t)
    }

    /// Tuples applied so far.
    pub(crate) fn applied(&self) -> u64 {
        self.applied.load(Ordering::Relaxed)
    }

    /// When the `i`th mark was made.
    pub(crate) fn mark_time(&self, i: usize) -> Option<Instant> {
        self.marks.lock().expect("progress").get(i).map(|(t, _)| *t)
    }
}

/// Runs a checkpoint of `store` to a `file://` store under `scratch` while
/// `writer` keeps applying messages from `feed` on another thread.
pub async fn checkpoint_under_load(
    writer: Writer,
    store: Arc<Store>,
    dirty: Arc<Dirty>,
    mut feed: Feed,
    scratch: &Path,
    groups_ready: usize,
) -> anyhow::Result<(CheckpointRun, Writer, Feed)> {
    let writer_changes = writer.changes();
    // Pre-generate the load so generating it does not compete with the copy.
    let groups: Vec<Vec<Incoming>> = (0..groups_ready).map(|_| feed.group()).collect();
    let progress = Arc::new(Progress::default());
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (progress, stop) = (progress.clone(), stop.clone());
        std::thread::spawn(move || -> anyhow::Result<Writer> {
            let mut writer = writer;
            let mut applied = 0u64;
            progress.mark(0);
            for group in groups {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                applied += writer.apply_group(&group)?.applied;
                drop(dirty.take());
                progress.mark(applied);
            }
            Ok(writer)
        })
    };
    let snapshots_dir = scratch.join("snapshots");
    let snapshots = SnapshotStore::from_url(&format!("file://{}", snapshots_dir.display()))?;
    let mut records = CheckpointStore::open(&[], scratch, "bench").await?;
    let epoch = records.acquire_epoch().await?;
    let mut checkpointer = Checkpointer {
        store: store.clone(),
        snapshots,
        records,
        shard: "bench".into(),
        epoch,
        lineage: "bench".into(),
        next_id: 1,
        tmp_dir: scratch.join("tmp"),
        keep: 0,
        lease: None,
        changes: writer_changes,
        chain: None,
        max_deltas: 0,
        trim: None,
    };
    // Let the writer run alone first, for the baseline.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let seq = {
        let txn = store.read_txn()?;
        store.last_applied_seq(&txn)?
    };
    let started = Instant::now();
    let record = checkpointer.checkpoint(seq).await?;
    let ended = Instant::now();
    stop.store(true, Ordering::Relaxed);
    let writer = load
        .join()
        .map_err(|_| anyhow::anyhow!("writer thread panicked"))??;
    let secs = (ended - started).as_secs_f64();
    // The baseline: the writer alone, from its second group to the start.
    let before_from = progress.mark_time(1).unwrap_or(started);
    anyhow::ensure!(
        progress.last().is_some_and(|t| t >= ended),
        "the pre-generated load ran out before the checkpoint ended; raise groups_ready"
    );
    Ok((
        CheckpointRun {
            secs,
            bytes: record.size_bytes,
            ingest_during: progress.rate(started, ended),
            ingest_before: progress.rate(before_from, started),
        },
        writer,
        feed,
    ))
}
