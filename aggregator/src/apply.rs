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
    APPLY_COMMITS_TOTAL, DUPLICATES_DROPPED_TOTAL, LAST_APPLIED_SEQ, SPEND_SET_ASIDE_TOTAL,
    TUPLES_APPLIED_TOTAL,
};
use adspend_common::types::{SpendMessage, SumEntry, LIFETIME_BUCKET};
use adspend_common::{failpoint, now_ms};
use heed::RwTxn;
use rustc_hash::FxHashMap;
use tokio::sync::{mpsc, watch};

use crate::dedupe::{self, IdSet, ShardOrder};
use crate::delta::Changes;
use crate::error::Error;
use crate::fence::Validity;
pub use crate::handoff::{CheckpointRequest, Dirty, DirtyState, Incoming};
use crate::store::{lifetime_value, log_key, parse_lifetime, sum_key, Store};

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

/// A tuple set aside because adding it would take its limit's lifetime sum
/// past u64 micros. Checking the lifetime sum is enough: every tuple adds to
/// it, so no bucket sum exceeds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overflowed {
    pub seq: u64,
    pub limit: String,
    pub bucket: u32,
    pub cost_micros: u64,
    pub msg_id: [u8; 16],
    /// The lifetime sum it would have been added to.
    pub lifetime_micros: u64,
}

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

/// Each message of `group` with whether it comes after `through` and every
/// message before it: a replay's messages, at or below the last applied
/// sequence, are skipped by sequence. One rule for both of the writer's
/// passes over a group.
fn by_sequence(group: &[Incoming], mut through: u64) -> impl Iterator<Item = (&Incoming, bool)> {
    group.iter().map(move |incoming| {
        let new = incoming.seq > through;
        if new {
            through = incoming.seq;
        }
        (incoming, new)
    })
}

/// Checked addition of micros; an overflow names the sum.
fn checked(a: u64, b: u64, limit: &str, bucket: u32) -> Result<u64, Error> {
    a.checked_add(b).ok_or_else(|| Error::Overflow {
        limit: limit.to_string(),
        bucket,
    })
}

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
    /// The ids of the group in progress, in stream order, and which of them
    /// are new (kept between groups: no allocation per group).
    group_ids: Vec<u128>,
    shard_order: ShardOrder,
    /// The shard, as the `shard` label of the writer's gauges.
    shard: String,
    /// In cluster mode, the lease this writer applies under: no commit once
    /// it has lapsed.
    lease: Option<Arc<Validity>>,
    /// What changed since the last checkpoint took it ([`crate::delta`]),
    /// updated under the same lock as each commit.
    changes: Arc<Mutex<Changes>>,
    /// Where tuples set aside for overflow go, after their commit (to be
    /// dead lettered).
    overflowed: Option<mpsc::UnboundedSender<Overflowed>>,
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct GroupStats {
    pub applied: u64,
    pub duplicates_by_id: u64,
    pub replayed_by_seq: u64,
    pub evicted: u64,
    /// Tuples set aside because they would overflow their limit's sum.
    pub overflowed: u64,
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
            group_ids: Vec::new(),
            shard_order: ShardOrder::default(),
            shard: "all".to_string(),
            lease: None,
            changes: Arc::new(Mutex::new(Changes::at(last_applied_seq))),
            overflowed: None,
        })
    }

    /// Label the writer's gauges with `shard` and, in cluster mode, refuse to
    /// commit once `lease` has lapsed.
    pub fn for_shard(mut self, shard: &str, lease: Option<Arc<Validity>>) -> Self {
        self.shard = shard.to_string();
        self.lease = lease;
        self
    }

    /// Send tuples set aside for overflow to `tx` once their group commits.
    pub fn with_overflow_sink(mut self, tx: mpsc::UnboundedSender<Overflowed>) -> Self {
        self.overflowed = Some(tx);
        self
    }

    /// What changed since the last checkpoint, for the checkpointer.
    pub fn changes(&self) -> Arc<Mutex<Changes>> {
        self.changes.clone()
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
    ///
    /// A sum that would overflow sends the group through again tuple by
    /// tuple ([`Writer::try_apply_group`] with `careful`), setting aside
    /// exactly the tuples that would overflow; the decision depends only on
    /// the stored sums and the order of the stream, so a replay grouped
    /// differently decides the same.
    pub fn apply_group(&mut self, group: &[Incoming]) -> Result<GroupStats, Error> {
        let last_marker = self.last_marker;
        let mut result = self.try_apply_group(group, false);
        if matches!(result, Err(Error::Overflow { .. })) {
            self.ids = dedupe::load(&self.store)?;
            self.last_marker = last_marker;
            result = self.try_apply_group(group, true);
        }
        if result.is_err() {
            self.ids = dedupe::load(&self.store)?;
            self.last_marker = last_marker;
        } else {
            // Between groups: the set's doublings, a few at a time.
            self.ids
                .grow_ahead(usize::try_from(self.dedupe.max_ids).unwrap_or(usize::MAX));
        }
        result
    }

    /// The stored lifetime sum of `limit` as the transaction sees it.
    fn stored_lifetime(&self, txn: &RwTxn<'_>, limit: &str) -> Result<u64, Error> {
        let store = &self.store;
        match store
            .lifetime
            .get(txn, limit)
            .map_err(store.err("get lifetime"))?
        {
            None => Ok(0),
            Some(value) => parse_lifetime(value)
                .map(|(micros, _)| micros)
                .ok_or_else(|| store.corrupt(format!("the lifetime sum of {limit}"), value)),
        }
    }

    fn try_apply_group(&mut self, group: &[Incoming], careful: bool) -> Result<GroupStats, Error> {
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
        // Careful mode: each limit's lifetime sum as it would stand so far.
        let mut projected: FxHashMap<&str, u64> = FxHashMap::default();
        let mut overflowed: Vec<Overflowed> = Vec::new();
        self.new_ids.clear();
        // Which ids are new is decided for the whole group first, shard by
        // shard (see `IdSet::insert_in_shard_order`); the loop below reads
        // the answers in the same order, skipping the same messages.
        self.group_ids.clear();
        for (incoming, _) in by_sequence(group, applied_through).filter(|(_, new)| *new) {
            if let SpendMessage::Batch(batch) = &incoming.message {
                let ids = batch.tuples.iter().map(|t| dedupe::id_key(&t.msg_id.0));
                self.group_ids.extend(ids);
            }
        }
        self.ids
            .insert_in_shard_order(&self.group_ids, &mut self.shard_order);
        let mut answers = self.shard_order.fresh.iter().copied();
        for (incoming, new) in by_sequence(group, applied_through) {
            if !new {
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
                        if !answers.next().expect("an answer for every tuple") {
                            stats.duplicates_by_id += 1;
                            continue;
                        }
                        self.new_ids.extend_from_slice(&tuple.msg_id.0);
                        let limit = batch.limit_of(tuple);
                        if careful {
                            let total = match projected.get_mut(limit) {
                                Some(total) => total,
                                None => {
                                    let stored = self.stored_lifetime(&wtxn, limit)?;
                                    projected.entry(limit).or_insert(stored)
                                }
                            };
                            match total.checked_add(tuple.cost_micros) {
                                Some(sum) => *total = sum,
                                None => {
                                    overflowed.push(Overflowed {
                                        seq: incoming.seq,
                                        limit: limit.to_string(),
                                        bucket: tuple.bucket,
                                        cost_micros: tuple.cost_micros,
                                        msg_id: tuple.msg_id.0,
                                        lifetime_micros: *total,
                                    });
                                    continue;
                                }
                            }
                        }
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
        let log_added = match (first_applied, self.new_ids.is_empty()) {
            (Some(first), false) => {
                let key = log_key(clock_ms, first);
                store
                    .dedupe_log
                    .put(&mut wtxn, &key, &self.new_ids)
                    .map_err(store.err("put dedupe log"))?;
                Some(key)
            }
            _ => None,
        };
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
                let (micros, events) = match current {
                    None => (0, 0),
                    Some(value) => parse_lifetime(value).ok_or_else(|| {
                        store.corrupt(format!("the lifetime sum of {limit}"), value)
                    })?,
                };
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
        let evicted = if clock_ms > 0 {
            self.evict(&mut wtxn, clock_ms, &mut stats)?
        } else {
            Vec::new()
        };
        store.set_last_applied_seq(&mut wtxn, applied_through)?;
        failpoint::hit("aggregator.before_commit");
        if let Some(lease) = &self.lease {
            // Keepalives unanswered (an etcd election, a slow member):
            // pause with the group uncommitted until etcd confirms the lease
            // again. Revoked, it is lost: dropping the transaction discards
            // the group.
            if lease.wait_blocking().is_err() {
                return Err(Error::LeaseLost {
                    shard: self.shard.clone(),
                });
            }
        }
        {
            // A checkpoint takes the changes under this lock, so what it
            // takes is exactly what the commits before it made durable.
            let mut changes = self.changes.lock().expect("changes lock");
            wtxn.commit().map_err(store.err("commit"))?;
            changes.absorb(
                &changed,
                log_added.map(|key| (key, self.new_ids.as_slice())),
                &evicted,
                applied_through,
            );
        }
        failpoint::hit("aggregator.after_commit");
        self.last_applied_seq = applied_through;

        metrics::counter!(APPLY_COMMITS_TOTAL).increment(1);
        metrics::counter!(TUPLES_APPLIED_TOTAL).increment(stats.applied);
        metrics::counter!(DUPLICATES_DROPPED_TOTAL, "by" => "id").increment(stats.duplicates_by_id);
        metrics::counter!(DUPLICATES_DROPPED_TOTAL, "by" => "seq").increment(stats.replayed_by_seq);
        metrics::gauge!(LAST_APPLIED_SEQ, "shard" => self.shard.clone())
            .set(applied_through as f64);

        // Caught up: the sums are complete as of now; behind: as of the
        // publish time of the last message applied.
        let watermark_ms = if last.pending == 0 {
            now_ms()
        } else {
            last.stream_ms
        };
        stats.overflowed = overflowed.len() as u64;
        for tuple in overflowed {
            metrics::counter!(SPEND_SET_ASIDE_TOTAL, "reason" => "sum_overflow").increment(1);
            tracing::error!(
                seq = tuple.seq,
                limit = tuple.limit,
                bucket = tuple.bucket,
                cost_micros = tuple.cost_micros,
                lifetime_micros = tuple.lifetime_micros,
                "spend tuple set aside: it would take the limit's sum past u64 micros"
            );
            if let Some(tx) = &self.overflowed {
                let _ = tx.send(tuple);
            }
        }
        self.dirty
            .record(changed, applied_through, watermark_ms, source_ms);
        for seq in markers {
            self.requests += 1;
            self.checkpoints.send_replace((self.requests, seq));
        }
        Ok(stats)
    }
}

mod evict;

#[cfg(test)]
mod tests;
