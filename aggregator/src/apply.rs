//! The single writer: applies spend messages to LMDB, one write transaction
//! per group of messages, never across an `.await` (it runs on its own
//! thread, fed by a bounded channel).
//!
//! Per group: drop messages at or below the last applied sequence (replay),
//! drop tuples whose message id is in the dedupe window (re-emits and ad-server
//! retries), add the rest to the bucket and lifetime sums with checked
//! arithmetic, evict dedupe ids past the window, store the new last applied
//! sequence, commit. Then hand the changed sums to the pusher and marker
//! positions to the checkpointer.

use std::sync::{Arc, Mutex};

use adspend_common::telemetry::{
    APPLY_COMMITS_TOTAL, DEDUPE_IDS, DEDUPE_WINDOW_SECONDS, DUPLICATES_DROPPED_TOTAL,
    LAST_APPLIED_SEQ, TUPLES_APPLIED_TOTAL,
};
use adspend_common::types::{SpendMessage, SumEntry, LIFETIME_BUCKET};
use adspend_common::{failpoint, now_ms};
use heed::RwTxn;
use rustc_hash::FxHashMap;
use tokio::sync::{mpsc, watch};

use crate::dedupe::{self, IdSet};
use crate::error::Error;
use crate::store::{lifetime_value, log_key, log_key_time, parse_lifetime, sum_key, Store};

/// A message read from `SPEND`.
#[derive(Debug)]
pub struct Incoming {
    pub seq: u64,
    /// JetStream publish time of the message (unix ms): the dedupe clock.
    pub stream_ms: i64,
    /// Messages still behind this one in the stream when it was read.
    pub pending: u64,
    pub message: SpendMessage,
}

/// The dedupe window, bounded by stream time and by id count.
#[derive(Clone, Copy, Debug)]
pub struct DedupeLimits {
    pub window_ms: u64,
    pub max_ids: u64,
}

/// Most tuples in one write transaction, to bound commit latency.
const MAX_GROUP_TUPLES: usize = 200_000;
/// Most dedupe ids evicted per transaction (rounded up to whole log
/// entries); the rest go in the next ones.
const MAX_EVICT_PER_TXN: u64 = 100_000;

/// (limit, bucket, micros to add) of one period bucket.
type BucketDelta<'a> = (&'a str, u32, u64);

/// One message's sums for one of its limits.
#[derive(Clone, Copy)]
struct LocalSum {
    micros: u64,
    tuples: u64,
    /// The period bucket of `bucket_micros`; [`LIFETIME_BUCKET`] for none yet.
    bucket: u32,
    bucket_micros: u64,
}

impl Default for LocalSum {
    fn default() -> Self {
        LocalSum {
            micros: 0,
            tuples: 0,
            bucket: LIFETIME_BUCKET,
            bucket_micros: 0,
        }
    }
}

/// Checked addition of micros; an overflow names the sum.
fn checked(a: u64, b: u64, limit: &str, bucket: u32) -> Result<u64, Error> {
    a.checked_add(b).ok_or_else(|| Error::Overflow {
        limit: limit.to_string(),
        bucket,
    })
}

/// Sums changed since the pusher last looked, plus the position they reflect.
#[derive(Default)]
pub struct Dirty {
    inner: Mutex<DirtyState>,
}

#[derive(Default)]
pub struct DirtyState {
    pub entries: FxHashMap<(String, u32), SumEntry>,
    pub seq: u64,
    pub watermark_ms: i64,
    /// Earliest source publish time among batches not yet pushed.
    pub source_ms: Option<i64>,
}

impl Dirty {
    pub fn new(seq: u64) -> Self {
        Dirty {
            inner: Mutex::new(DirtyState {
                seq,
                ..Default::default()
            }),
        }
    }

    fn record(&self, entries: Vec<SumEntry>, seq: u64, watermark_ms: i64, source_ms: Option<i64>) {
        let mut state = self.inner.lock().expect("dirty lock");
        for entry in entries {
            state
                .entries
                .insert((entry.limit.clone(), entry.bucket), entry);
        }
        state.seq = seq;
        state.watermark_ms = watermark_ms;
        state.source_ms = match (state.source_ms, source_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// Take the changed entries; the position stays.
    pub fn take(&self) -> (Vec<SumEntry>, u64, i64, Option<i64>) {
        let mut state = self.inner.lock().expect("dirty lock");
        let entries = std::mem::take(&mut state.entries).into_values().collect();
        (
            entries,
            state.seq,
            state.watermark_ms,
            state.source_ms.take(),
        )
    }

    pub fn position(&self) -> (u64, i64) {
        let state = self.inner.lock().expect("dirty lock");
        (state.seq, state.watermark_ms)
    }
}

/// A checkpoint request: (request number, sequence of the marker).
pub type CheckpointRequest = (u64, u64);

pub struct Writer {
    pub store: Arc<Store>,
    pub dedupe: DedupeLimits,
    pub dirty: Arc<Dirty>,
    pub checkpoints: watch::Sender<CheckpointRequest>,
    pub last_applied_seq: u64,
    last_marker: u64,
    requests: u64,
    /// The ids of the dedupe window (see [`crate::dedupe`]).
    ids: IdSet,
    /// Packed ids first seen by the transaction in progress.
    new_ids: Vec<u8>,
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct GroupStats {
    pub applied: u64,
    pub duplicates_by_id: u64,
    pub replayed_by_seq: u64,
    pub evicted: u64,
}

impl Writer {
    pub fn new(
        store: Arc<Store>,
        dedupe: DedupeLimits,
        dirty: Arc<Dirty>,
        checkpoints: watch::Sender<CheckpointRequest>,
    ) -> Result<Self, Error> {
        let last_applied_seq = {
            let txn = store.read_txn()?;
            store.last_applied_seq(&txn)?
        };
        let ids = dedupe::load(&store)?;
        Ok(Writer {
            store,
            dedupe,
            dirty,
            checkpoints,
            last_applied_seq,
            last_marker: 0,
            requests: 0,
            ids,
            new_ids: Vec::new(),
        })
    }

    /// Message ids in the dedupe window.
    pub fn dedupe_ids(&self) -> usize {
        self.ids.len()
    }

    /// Apply until the channel closes. Blocking: run on a dedicated thread.
    pub fn run(mut self, mut rx: mpsc::Receiver<Incoming>) -> Result<(), Error> {
        let mut group: Vec<Incoming> = Vec::with_capacity(64);
        while let Some(first) = rx.blocking_recv() {
            let mut tuples = first.tuples();
            group.push(first);
            while tuples < MAX_GROUP_TUPLES {
                match rx.try_recv() {
                    Ok(next) => {
                        tuples += next.tuples();
                        group.push(next);
                    }
                    Err(_) => break,
                }
            }
            self.apply_group(&group)?;
            group.clear();
        }
        Ok(())
    }

    /// Apply messages in one write transaction. On an error nothing is
    /// committed and the in-memory dedupe set is rebuilt from LMDB, so the
    /// writer stays consistent with what is durable.
    pub fn apply_group(&mut self, group: &[Incoming]) -> Result<GroupStats, Error> {
        let result = self.try_apply_group(group);
        if result.is_err() {
            self.ids = dedupe::load(&self.store)?;
        }
        result
    }

    fn try_apply_group(&mut self, group: &[Incoming]) -> Result<GroupStats, Error> {
        let Some(last) = group.last() else {
            return Ok(GroupStats::default());
        };
        let store = self.store.clone();
        let mut wtxn = store.write_txn()?;
        let mut stats = GroupStats::default();
        let mut bucket_deltas: FxHashMap<(&str, u32), u64> = FxHashMap::default();
        // Per limit: (micros, tuples).
        let mut lifetime_deltas: FxHashMap<&str, (u64, u64)> = FxHashMap::default();
        let mut markers: Vec<u64> = Vec::new();
        let mut source_ms: Option<i64> = None;
        let mut applied_through = self.last_applied_seq;
        let mut first_applied = None;
        let mut clock_ms = 0u64;
        let mut local: Vec<LocalSum> = Vec::new();
        self.new_ids.clear();
        for incoming in group {
            if incoming.seq <= applied_through {
                stats.replayed_by_seq += incoming.tuples() as u64;
                continue;
            }
            applied_through = incoming.seq;
            first_applied.get_or_insert(incoming.seq);
            let stream_ms = u64::try_from(incoming.stream_ms).unwrap_or(0);
            clock_ms = clock_ms.max(stream_ms);
            match &incoming.message {
                SpendMessage::Batch(batch) => {
                    source_ms =
                        Some(source_ms.map_or(batch.source_ms, |m: i64| m.min(batch.source_ms)));
                    // Sum per limit of the message first (by index, no
                    // hashing), then once per limit into the group's sums.
                    local.clear();
                    local.resize(batch.limits.len(), LocalSum::default());
                    for tuple in &batch.tuples {
                        if !self.ids.insert(dedupe::id_key(&tuple.msg_id.0)) {
                            stats.duplicates_by_id += 1;
                            continue;
                        }
                        self.new_ids.extend_from_slice(&tuple.msg_id.0);
                        let limit = batch.limit_of(tuple);
                        let sum = &mut local[tuple.limit as usize];
                        sum.micros =
                            checked(sum.micros, tuple.cost_micros, limit, LIFETIME_BUCKET)?;
                        sum.tuples += 1;
                        if tuple.bucket != LIFETIME_BUCKET {
                            if sum.bucket == tuple.bucket || sum.bucket == LIFETIME_BUCKET {
                                sum.bucket = tuple.bucket;
                                sum.bucket_micros = checked(
                                    sum.bucket_micros,
                                    tuple.cost_micros,
                                    limit,
                                    tuple.bucket,
                                )?;
                            } else {
                                // A second bucket in one message (a late event).
                                let delta = bucket_deltas.entry((limit, tuple.bucket)).or_default();
                                *delta = checked(*delta, tuple.cost_micros, limit, tuple.bucket)?;
                            }
                        }
                        stats.applied += 1;
                    }
                    for (sum, limit) in local.iter().zip(&batch.limits) {
                        if sum.tuples == 0 {
                            continue;
                        }
                        let lifetime = lifetime_deltas.entry(limit.as_str()).or_default();
                        lifetime.0 = checked(lifetime.0, sum.micros, limit, LIFETIME_BUCKET)?;
                        lifetime.1 += sum.tuples;
                        if sum.bucket != LIFETIME_BUCKET {
                            let delta = bucket_deltas
                                .entry((limit.as_str(), sum.bucket))
                                .or_default();
                            *delta = checked(*delta, sum.bucket_micros, limit, sum.bucket)?;
                        }
                    }
                }
                SpendMessage::Marker(marker) => {
                    // One marker per partition per interval; one checkpoint each.
                    if marker.marker_id > self.last_marker {
                        self.last_marker = marker.marker_id;
                        markers.push(incoming.seq);
                    }
                }
            }
        }
        if let (Some(first), false) = (first_applied, self.new_ids.is_empty()) {
            store
                .dedupe_log
                .put(&mut wtxn, &log_key(clock_ms, first), &self.new_ids)
                .map_err(store.err("put dedupe log"))?;
        }
        let mut changed = Vec::with_capacity(lifetime_deltas.len() + bucket_deltas.len());
        let mut new_lifetimes: FxHashMap<&str, (u64, u64)> = FxHashMap::default();
        new_lifetimes.reserve(lifetime_deltas.len());
        // In key order, as `update_sorted` wants.
        let mut lifetime_deltas: Vec<(&str, (u64, u64))> = lifetime_deltas.into_iter().collect();
        lifetime_deltas.sort_unstable_by_key(|(limit, _)| *limit);
        store.update_sorted(
            &mut wtxn,
            store.lifetime.remap_types(),
            &lifetime_deltas,
            |current, limit, (delta, tuples)| {
                let (micros, events) = current.map_or((0, 0), parse_lifetime);
                let total = checked(micros, *delta, limit, LIFETIME_BUCKET)?;
                let events = events + tuples;
                new_lifetimes.insert(limit, (total, events));
                changed.push(SumEntry {
                    limit: limit.to_string(),
                    bucket: LIFETIME_BUCKET,
                    bucket_micros: total,
                    lifetime_micros: total,
                    lifetime_events: events,
                });
                Ok(lifetime_value(total, events))
            },
        )?;
        let mut bucket_deltas: Vec<(Vec<u8>, BucketDelta)> = bucket_deltas
            .into_iter()
            .map(|((limit, bucket), delta)| (sum_key(limit, bucket), (limit, bucket, delta)))
            .collect();
        bucket_deltas.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        store.update_sorted(
            &mut wtxn,
            store.sums.remap_types(),
            &bucket_deltas,
            |current, _, (limit, bucket, delta)| {
                let micros = current
                    .and_then(|v| v.try_into().ok())
                    .map_or(0, u64::from_be_bytes);
                let total = checked(micros, *delta, limit, *bucket)?;
                let (lifetime_micros, lifetime_events) = new_lifetimes[limit];
                changed.push(SumEntry {
                    limit: limit.to_string(),
                    bucket: *bucket,
                    bucket_micros: total,
                    lifetime_micros,
                    lifetime_events,
                });
                Ok(total.to_be_bytes())
            },
        )?;
        if clock_ms > 0 {
            stats.evicted = self.evict(&mut wtxn, clock_ms)?;
        }
        store.set_last_applied_seq(&mut wtxn, applied_through)?;
        failpoint::hit("aggregator.before_commit");
        wtxn.commit().map_err(store.err("commit"))?;
        failpoint::hit("aggregator.after_commit");
        self.last_applied_seq = applied_through;

        metrics::counter!(APPLY_COMMITS_TOTAL).increment(1);
        metrics::counter!(TUPLES_APPLIED_TOTAL).increment(stats.applied);
        metrics::counter!(DUPLICATES_DROPPED_TOTAL, "by" => "id").increment(stats.duplicates_by_id);
        metrics::counter!(DUPLICATES_DROPPED_TOTAL, "by" => "seq").increment(stats.replayed_by_seq);
        metrics::gauge!(LAST_APPLIED_SEQ).set(applied_through as f64);

        // Caught up: the sums are complete as of now; behind: as of the
        // publish time of the last message applied.
        let watermark_ms = if last.pending == 0 {
            now_ms()
        } else {
            last.stream_ms
        };
        self.dirty
            .record(changed, applied_through, watermark_ms, source_ms);
        for seq in markers {
            self.requests += 1;
            self.checkpoints.send_replace((self.requests, seq));
        }
        Ok(stats)
    }

    /// Drop the log entries older than the window (in stream time) or beyond
    /// the count bound, oldest first, and their ids from the set. Whole
    /// entries go, so the count bound may be undershot by one transaction's
    /// ids.
    fn evict(&mut self, wtxn: &mut RwTxn<'_>, clock_ms: u64) -> Result<u64, Error> {
        let store = self.store.clone();
        let cutoff = clock_ms.saturating_sub(self.dedupe.window_ms);
        let mut evicted = 0u64;
        let mut doomed: Vec<[u8; 16]> = Vec::new();
        let mut oldest_kept: Option<u64> = None;
        for entry in store
            .dedupe_log
            .iter(wtxn)
            .map_err(store.err("iterate dedupe log"))?
        {
            let (key, ids) = entry.map_err(store.err("iterate dedupe log"))?;
            let time = log_key_time(key);
            let over = self.ids.len() as u64 > self.dedupe.max_ids;
            if (time < cutoff || over) && evicted < MAX_EVICT_PER_TXN {
                for id in dedupe::packed_ids(ids) {
                    self.ids.remove(&id);
                }
                evicted += (ids.len() / 16) as u64;
                doomed.push(key.try_into().expect("16-byte key"));
            } else {
                oldest_kept = Some(time);
                break;
            }
        }
        for key in &doomed {
            store
                .dedupe_log
                .delete(wtxn, key.as_slice())
                .map_err(store.err("evict dedupe log"))?;
        }
        metrics::gauge!(DEDUPE_IDS).set(self.ids.len() as f64);
        if let Some(oldest) = oldest_kept {
            metrics::gauge!(DEDUPE_WINDOW_SECONDS)
                .set(clock_ms.saturating_sub(oldest) as f64 / 1000.0);
        }
        Ok(evicted)
    }
}

impl Incoming {
    fn tuples(&self) -> usize {
        match &self.message {
            SpendMessage::Batch(batch) => batch.tuples.len().max(1),
            SpendMessage::Marker(_) => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use adspend_common::types::{CheckpointMarker, MsgId, SpendBatch, SpendTuple};
    use std::collections::HashMap;

    /// (limit, bucket, cost, impression id)
    type T = (&'static str, u32, u64, &'static str);

    fn tuple(limit: &'static str, bucket: u32, cost: u64, imp: &'static str) -> T {
        (limit, bucket, cost, imp)
    }

    fn batch(seq: u64, stream_ms: i64, tuples: Vec<T>) -> Incoming {
        let mut limits: Vec<String> = Vec::new();
        let tuples = tuples
            .into_iter()
            .map(|(limit, bucket, cost, imp)| {
                let index = match limits.iter().position(|l| l == limit) {
                    Some(i) => i,
                    None => {
                        limits.push(limit.to_string());
                        limits.len() - 1
                    }
                };
                SpendTuple {
                    limit: index as u32,
                    bucket,
                    cost_micros: cost,
                    msg_id: MsgId::derive(limit, imp),
                }
            })
            .collect();
        Incoming {
            seq,
            stream_ms,
            pending: 1,
            message: SpendMessage::Batch(SpendBatch {
                source_ms: stream_ms,
                limits,
                tuples,
            }),
        }
    }

    fn writer(
        dir: &std::path::Path,
        dedupe: DedupeLimits,
    ) -> (Writer, watch::Receiver<CheckpointRequest>) {
        let store = Arc::new(Store::open(dir, 1 << 30).unwrap());
        let (tx, rx) = watch::channel((0, 0));
        (
            Writer::new(store, dedupe, Arc::new(Dirty::new(0)), tx).unwrap(),
            rx,
        )
    }

    fn sums(store: &Store) -> (HashMap<String, u64>, HashMap<(String, u32), u64>) {
        let txn = store.read_txn().unwrap();
        let lifetime = store
            .lifetime
            .iter(&txn)
            .unwrap()
            .map(|e| {
                e.map(|(k, v)| (k.to_string(), parse_lifetime(v).0))
                    .unwrap()
            })
            .collect();
        let buckets = store
            .sums
            .iter(&txn)
            .unwrap()
            .map(|e| {
                let (k, v) = e.unwrap();
                let (l, b) = crate::store::parse_sum_key(k).unwrap();
                ((l.to_string(), b), v)
            })
            .collect();
        (lifetime, buckets)
    }

    const WIDE: DedupeLimits = DedupeLimits {
        window_ms: u64::MAX,
        max_ids: u64::MAX,
    };

    #[test]
    fn sums_dedupes_by_id_and_skips_replays_by_seq() {
        let dir = tempfile::tempdir().unwrap();
        let (mut w, _rx) = writer(dir.path(), WIDE);
        let first = vec![batch(
            1,
            1000,
            vec![
                tuple("a", 5, 10, "i1"),
                tuple("a", 5, 7, "i2"),
                tuple("b", LIFETIME_BUCKET, 3, "i1"),
            ],
        )];
        let stats = w.apply_group(&first).unwrap();
        assert_eq!(stats.applied, 3);
        // Same sequence again (replay) and a re-emit of i1 under a new sequence.
        let again = vec![
            batch(1, 1000, vec![tuple("a", 5, 10, "i1")]),
            batch(
                2,
                1001,
                vec![tuple("a", 5, 10, "i1"), tuple("a", 6, 1, "i3")],
            ),
        ];
        let stats = w.apply_group(&again).unwrap();
        assert_eq!(
            stats,
            GroupStats {
                applied: 1,
                duplicates_by_id: 1,
                replayed_by_seq: 1,
                evicted: 0
            }
        );
        let (lifetime, buckets) = sums(&w.store);
        assert_eq!(lifetime["a"], 18);
        assert_eq!(lifetime["b"], 3);
        assert_eq!(buckets[&("a".to_string(), 5)], 17);
        assert_eq!(buckets[&("a".to_string(), 6)], 1);
        assert!(!buckets.contains_key(&("b".to_string(), LIFETIME_BUCKET)));
        assert_eq!(w.store.position().unwrap().1, 2);
        let (entries, seq, _, _) = w.dirty.take();
        assert_eq!(seq, 2);
        assert!(entries.iter().any(|e| e.limit == "a"
            && e.bucket == 6
            && e.bucket_micros == 1
            && e.lifetime_micros == 18));
    }

    #[test]
    fn a_message_with_several_buckets_of_one_limit_books_each() {
        let dir = tempfile::tempdir().unwrap();
        let (mut w, _rx) = writer(dir.path(), WIDE);
        w.apply_group(&[batch(
            1,
            1,
            vec![
                tuple("a", 5, 10, "i1"),
                tuple("a", 6, 3, "i2"),
                tuple("a", 5, 1, "i3"),
                tuple("a", 7, 2, "i4"),
            ],
        )])
        .unwrap();
        let (lifetime, buckets) = sums(&w.store);
        assert_eq!(lifetime["a"], 16);
        assert_eq!(buckets[&("a".to_string(), 5)], 11);
        assert_eq!(buckets[&("a".to_string(), 6)], 3);
        assert_eq!(buckets[&("a".to_string(), 7)], 2);
    }

    #[test]
    fn overflow_is_an_error_and_commits_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (mut w, _rx) = writer(dir.path(), WIDE);
        w.apply_group(&[batch(1, 1, vec![tuple("a", 1, u64::MAX, "i1")])])
            .unwrap();
        let err = w
            .apply_group(&[batch(2, 2, vec![tuple("a", 1, 1, "i2")])])
            .unwrap_err();
        assert!(matches!(err, Error::Overflow { .. }), "{err}");
        assert_eq!(w.store.position().unwrap().1, 1);
        // The failed group's id was not committed, so it is not a duplicate.
        let stats = w
            .apply_group(&[batch(2, 2, vec![tuple("a", 1, 0, "i2")])])
            .unwrap();
        assert_eq!((stats.applied, stats.duplicates_by_id), (1, 0));
    }

    #[test]
    fn window_evicts_by_time_and_by_count() {
        let dir = tempfile::tempdir().unwrap();
        let (mut w, _rx) = writer(
            dir.path(),
            DedupeLimits {
                window_ms: 100,
                max_ids: 3,
            },
        );
        w.apply_group(&[batch(
            1,
            1000,
            vec![tuple("a", 1, 1, "i1"), tuple("a", 1, 1, "i2")],
        )])
        .unwrap();
        // 50 ms later: within the window, i1 is still known.
        let s = w
            .apply_group(&[batch(
                2,
                1050,
                vec![tuple("a", 1, 1, "i1"), tuple("a", 1, 1, "i3")],
            )])
            .unwrap();
        assert_eq!((s.applied, s.duplicates_by_id), (1, 1));
        // Count bound 3: adding i4 (4 ids) evicts the oldest transaction's
        // entry, i1 and i2 together.
        let s = w
            .apply_group(&[batch(3, 1060, vec![tuple("a", 1, 1, "i4")])])
            .unwrap();
        assert_eq!(s.evicted, 2);
        // At t=1200 everything before t=1100 is evicted (after that group's
        // lookups): i3 and i4, so a later i3 counts again.
        let s = w
            .apply_group(&[batch(4, 1200, vec![tuple("a", 1, 1, "i5")])])
            .unwrap();
        assert_eq!(s.evicted, 2);
        let s = w
            .apply_group(&[batch(5, 1201, vec![tuple("a", 1, 1, "i3")])])
            .unwrap();
        assert_eq!((s.applied, s.duplicates_by_id), (1, 0));
        assert_eq!(w.ids.len(), 2);
        // The set is exactly what the log holds.
        assert_eq!(dedupe::load(&w.store).unwrap(), w.ids);
    }

    #[test]
    fn markers_request_one_checkpoint_per_marker_id() {
        let dir = tempfile::tempdir().unwrap();
        let (mut w, rx) = writer(dir.path(), WIDE);
        let marker = |seq, partition| Incoming {
            seq,
            stream_ms: 5,
            pending: 0,
            message: SpendMessage::Marker(CheckpointMarker {
                marker_id: 77,
                partition,
                emitted_ms: 5,
            }),
        };
        w.apply_group(&[
            batch(1, 1, vec![tuple("a", 1, 1, "i")]),
            marker(2, 0),
            marker(3, 1),
        ])
        .unwrap();
        assert_eq!(*rx.borrow(), (1, 2));
    }
}
