//! Pushes changed sums to the pacer over core NATS, continuously (every
//! `interval`), decoupled from checkpoints: freshness does not wait for
//! durability. Values are absolute and stamped `(epoch, seq)`, so a lost or
//! repeated push cannot make the pacer wrong, only late; a gap in `push_seq`
//! or a restarted pacer asks for the full state on `adspend.resync`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use adspend_common::nats::{progress_subject, sums_subject, Progress, SUMS_RESYNC_SUBJECT};
use adspend_wire::codec::encode_sums;
use adspend_wire::types::{SumEntry, SumsUpdate, LIFETIME_BUCKET};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::apply::Dirty;
use crate::dedupe::window::{self, Window};
use crate::error::Error;
use crate::store::{parse_lifetime, parse_sum_key, Store};
use crate::telemetry::SUMS_PUSHES_TOTAL;

const ENTRIES_PER_PUSH: usize = 10_000;
/// An empty push at least this often, so the pacer sees the watermark move.
const HEARTBEAT: Duration = Duration::from_secs(1);
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the applied sequence is reported (when it moved), apart from
/// the pushes: the limiters' window counts what a report has not yet
/// covered, so a report every push interval alone would make the queue
/// look a push interval of tuples longer than it is.
const PROGRESS_EVERY: Duration = Duration::from_millis(10);

pub(crate) struct Pusher {
    pub(crate) client: async_nats::Client,
    pub(crate) store: Arc<Store>,
    pub(crate) dirty: Arc<Dirty>,
    pub(crate) shard: String,
    pub(crate) epoch: u64,
    pub(crate) interval: Duration,
    push_seq: u64,
    last_push: Instant,
    progress: Option<ProgressReport>,
    /// What the shard's dedupe window holds, reported every
    /// [`window::REPORT_EVERY`].
    window: Option<Arc<Window>>,
    /// The shard's watermark gauge, set every interval whether or not a
    /// push goes out, so that a stuck writer shows as a frozen value.
    watermark: metrics::Gauge,
}

/// The shard's applied sequence for the limiters' flow control, sent every
/// [`PROGRESS_EVERY`] it moved and at least every [`HEARTBEAT`].
struct ProgressReport {
    subject: String,
    partitions: Option<Vec<u32>>,
    sent_seq: u64,
    sent_at: Instant,
}

impl Pusher {
    pub(crate) fn new(
        client: async_nats::Client,
        store: Arc<Store>,
        dirty: Arc<Dirty>,
        shard: String,
        epoch: u64,
        interval: Duration,
    ) -> Self {
        Pusher {
            watermark: crate::telemetry::watermark(&shard),
            client,
            store,
            dirty,
            shard,
            epoch,
            interval,
            push_seq: 0,
            last_push: Instant::now(),
            progress: None,
            window: None,
        }
    }

    /// Also report what the dedupe window holds on
    /// `adspend.sums.window.<shard>` (the pacers' `GET /v1/shards`).
    pub(crate) fn with_window(mut self, window: Arc<Window>) -> Self {
        self.window = Some(window);
        self
    }

    /// Also report how far the shard has applied (its `partitions`, `None`
    /// for all) on `adspend.progress.<shard>`.
    pub(crate) fn with_progress(mut self, partitions: Option<Vec<u32>>) -> Self {
        self.progress = Some(ProgressReport {
            subject: progress_subject(&self.shard),
            partitions,
            sent_seq: 0,
            sent_at: Instant::now(),
        });
        self
    }

    pub(crate) async fn run(mut self, cancel: CancellationToken) -> Result<(), Error> {
        let mut resync = self
            .client
            .subscribe(SUMS_RESYNC_SUBJECT)
            .await
            .map_err(Error::task("pusher subscription to sums resync requests"))?;
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut progress = tokio::time::interval(PROGRESS_EVERY.min(self.interval));
        progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut window = tokio::time::interval(window::REPORT_EVERY);
        window.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // A pacer that started before us has no state from us yet.
        self.push_full().await;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = ticker.tick() => {
                    let (_, watermark_ms) = self.dirty.position();
                    if watermark_ms > 0 {
                        self.watermark.set(watermark_ms as f64 / 1000.0);
                    }
                    self.push_changes().await;
                }
                _ = window.tick(), if self.window.is_some() => self.report_window().await,
                _ = progress.tick(), if self.progress.is_some() => {
                    let (seq, _) = self.dirty.position();
                    self.report_progress(seq).await;
                }
                request = resync.next() => {
                    if request.is_some() {
                        self.push_full().await;
                    }
                }
            }
        }
        self.push_changes().await;
        Ok(())
    }

    async fn push_changes(&mut self) {
        let (entries, seq, watermark_ms, source_ms) = self.dirty.take();
        if entries.is_empty() && self.last_push.elapsed() < HEARTBEAT {
            return;
        }
        self.publish(
            entries,
            seq,
            watermark_ms,
            source_ms.unwrap_or(watermark_ms),
            false,
        )
        .await;
    }

    async fn report_progress(&mut self, seq: u64) {
        let Some(report) = self.progress.as_mut() else {
            return;
        };
        if seq == report.sent_seq && report.sent_at.elapsed() < HEARTBEAT {
            return;
        }
        let progress = Progress {
            partitions: report.partitions.clone(),
            applied_seq: seq,
        };
        // Core NATS, at most once: a lost report is replaced by the next.
        let publish = self
            .client
            .publish(report.subject.clone(), progress.encode().into());
        match tokio::time::timeout(PUBLISH_TIMEOUT, publish).await {
            Ok(Ok(())) => {
                report.sent_seq = seq;
                report.sent_at = Instant::now();
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "progress report failed"),
            Err(_) => tracing::debug!("progress report timed out"),
        }
    }

    async fn report_window(&self) {
        let Some(window) = &self.window else { return };
        let report = window.report(&self.shard, adspend_common::now_ms());
        // Core NATS, at most once: the next report replaces a lost one.
        let publish = self.client.publish(
            adspend_common::dedupe_window::subject(&self.shard),
            report.encode().into(),
        );
        match tokio::time::timeout(PUBLISH_TIMEOUT, publish).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "dedupe window report failed"),
            Err(_) => tracing::debug!("dedupe window report timed out"),
        }
    }

    async fn push_full(&mut self) {
        let store = self.store.clone();
        let read = tokio::task::spawn_blocking(move || read_full(&store)).await;
        let (entries, seq) = match read {
            Ok(Ok(full)) => full,
            Ok(Err(e)) => {
                return tracing::error!(error = %e, "reading full state for resync failed")
            }
            Err(e) => return tracing::error!(error = %e, "resync task failed"),
        };
        let (_, watermark_ms) = self.dirty.position();
        self.publish(entries, seq, watermark_ms, watermark_ms, true)
            .await;
    }

    async fn publish(
        &mut self,
        entries: Vec<SumEntry>,
        seq: u64,
        watermark_ms: i64,
        source_ms: i64,
        full: bool,
    ) {
        let subject = sums_subject(&self.shard);
        let mut chunks: Vec<Vec<SumEntry>> = entries
            .chunks(ENTRIES_PER_PUSH)
            .map(<[_]>::to_vec)
            .collect();
        if chunks.is_empty() {
            chunks.push(Vec::new());
        }
        for entries in chunks {
            self.push_seq += 1;
            let update = SumsUpdate {
                shard: self.shard.clone(),
                epoch: self.epoch,
                seq,
                push_seq: self.push_seq,
                full,
                watermark_ms,
                source_ms,
                entries,
            };
            // Core NATS: at most once. Loss shows up as a push_seq gap and
            // the pacer asks for a resync.
            let publish = self
                .client
                .publish(subject.clone(), encode_sums(&update).into());
            match tokio::time::timeout(PUBLISH_TIMEOUT, publish).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "sums push failed"),
                // NATS unreachable and the client's buffer full: drop it; the
                // pacer notices the push_seq gap and resyncs.
                Err(_) => tracing::warn!("sums push timed out"),
            }
        }
        metrics::counter!(SUMS_PUSHES_TOTAL).increment(1);
        self.last_push = Instant::now();
    }
}

/// Lifetime sums of every limit and the recent daily buckets (yesterday and
/// later in any time zone), with the sequence they are consistent with.
pub(crate) fn read_full(store: &Store) -> Result<(Vec<SumEntry>, u64), Error> {
    let txn = store.read_txn()?;
    let seq = store.last_applied_seq(&txn)?;
    let mut entries = Vec::new();
    let mut lifetimes = std::collections::HashMap::new();
    for item in store
        .lifetime
        .iter(&txn)
        .map_err(store.err("iterate lifetime"))?
    {
        let (limit, value) = item.map_err(store.err("iterate lifetime"))?;
        let (total, events) = parse_lifetime(value)
            .ok_or_else(|| store.corrupt(format!("the lifetime sum of {limit}"), value))?;
        lifetimes.insert(limit.to_string(), (total, events));
        entries.push(SumEntry {
            limit: limit.to_string(),
            bucket: LIFETIME_BUCKET,
            bucket_micros: total,
            lifetime_micros: total,
            lifetime_events: events,
        });
    }
    let today = (adspend_common::now_ms() / 86_400_000) as u32;
    let oldest_wanted = today.saturating_sub(2);
    for item in store.sums.iter(&txn).map_err(store.err("iterate sums"))? {
        let (key, total) = item.map_err(store.err("iterate sums"))?;
        let Some((limit, bucket)) = parse_sum_key(key) else {
            continue;
        };
        if bucket >= oldest_wanted {
            entries.push(SumEntry {
                limit: limit.to_string(),
                bucket,
                bucket_micros: total,
                lifetime_micros: lifetimes.get(limit).map_or(0, |l| l.0),
                lifetime_events: lifetimes.get(limit).map_or(0, |l| l.1),
            });
        }
    }
    Ok((entries, seq))
}
