//! Adding up a group in memory: the fresh messages' new tuples go into
//! per-limit lifetime and per-bucket sums with checked arithmetic, before
//! anything is written. [`Pass`] is what the group's steps hand along.

use adspend_wire::types::{SpendBatch, SpendMessage, SpendTuple, LIFETIME_BUCKET};
use heed::RwTxn;
use rustc_hash::FxHashMap;

use super::{checked, closed, GroupStats, Incoming, Overflowed, Writer};
use crate::error::Error;
use crate::store::{parse_lifetime, PeriodClock, Store};

/// One group's work in progress, from the skip of replayed messages to the
/// effects after its commit. The `&'g str`s are limit ids borrowed from the
/// group's messages.
pub(super) struct Pass<'g> {
    /// Set aside each tuple that would overflow its limit's lifetime sum
    /// (checked tuple by tuple) instead of failing the group.
    careful: bool,
    pub(super) stats: GroupStats,
    /// The last sequence applied by the group (so far).
    pub(super) applied_through: u64,
    /// The first sequence the group applies.
    pub(super) first_applied: Option<u64>,
    /// The latest publish time (ms) of the group's fresh messages: the
    /// stream clock of the dedupe window.
    pub(super) clock_ms: u64,
    /// The stream clock of closed periods ([`super::closed`]): the running
    /// maximum of publish times, through the message in progress.
    pub(super) stream_clock_ms: u64,
    /// The first bucket still open at `stream_clock_ms`.
    closed_below: u32,
    /// Tuples of closed buckets (added to lifetime sums only), their
    /// micros, and the oldest such bucket.
    pub(super) late_tuples: u64,
    pub(super) late_micros: u64,
    pub(super) late_oldest: u32,
    /// The earliest `source_ms` of the group's batches.
    pub(super) source_ms: Option<i64>,
    /// Sequences of markers that ask for a checkpoint.
    pub(super) markers: Vec<u64>,
    /// Per limit: (micros, tuples).
    pub(super) lifetime_deltas: FxHashMap<&'g str, (u64, u64)>,
    pub(super) bucket_deltas: FxHashMap<(&'g str, u32), u64>,
    /// Careful mode: each limit's lifetime sum as it would stand so far.
    projected: FxHashMap<&'g str, u64>,
    pub(super) overflowed: Vec<Overflowed>,
    /// The sums of the message in progress, by limit index.
    local: Vec<LocalSum>,
}

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

impl Writer {
    /// Add up the fresh messages: each batch's new tuples into the group's
    /// sums, each marker past the last one into the checkpoint requests.
    pub(super) fn accumulate<'g>(
        &mut self,
        wtxn: &RwTxn<'_>,
        fresh: &[&'g Incoming],
        pass: &mut Pass<'g>,
    ) -> Result<(), Error> {
        let mut answers = self.shard_order.fresh.iter().copied();
        for incoming in fresh {
            pass.applied_through = incoming.seq;
            pass.first_applied.get_or_insert(incoming.seq);
            let stream_ms = u64::try_from(incoming.stream_ms).unwrap_or(0);
            pass.clock_ms = pass.clock_ms.max(stream_ms);
            if stream_ms > pass.stream_clock_ms {
                pass.stream_clock_ms = stream_ms;
                pass.closed_below = closed::closed_below(stream_ms, self.closed_days);
            }
            match &incoming.message {
                SpendMessage::Batch(batch) => pass.add_batch(
                    &self.store,
                    wtxn,
                    incoming.seq,
                    batch,
                    &mut answers,
                    &mut self.new_ids,
                )?,
                SpendMessage::Marker(marker) => {
                    // One marker per partition per interval; one checkpoint each.
                    if marker.marker_id > self.last_marker {
                        self.last_marker = marker.marker_id;
                        pass.markers.push(incoming.seq);
                    }
                }
            }
        }
        Ok(())
    }
}

impl<'g> Pass<'g> {
    /// A pass over a store at `last_applied_seq` whose stream clock stands
    /// at `clock` (its `closed_below` as the setting gives it now).
    pub(super) fn new(careful: bool, last_applied_seq: u64, clock: PeriodClock) -> Self {
        Pass {
            careful,
            stats: GroupStats::default(),
            applied_through: last_applied_seq,
            first_applied: None,
            clock_ms: 0,
            stream_clock_ms: clock.stream_clock_ms,
            closed_below: clock.closed_below,
            late_tuples: 0,
            late_micros: 0,
            late_oldest: u32::MAX,
            source_ms: None,
            markers: Vec::new(),
            lifetime_deltas: FxHashMap::default(),
            bucket_deltas: FxHashMap::default(),
            projected: FxHashMap::default(),
            overflowed: Vec::new(),
            local: Vec::new(),
        }
    }

    /// Add the tuples of one batch whose ids `answers` says are new, and
    /// append those ids to `new_ids`.
    fn add_batch(
        &mut self,
        store: &Store,
        wtxn: &RwTxn<'_>,
        seq: u64,
        batch: &'g SpendBatch,
        answers: &mut impl Iterator<Item = bool>,
        new_ids: &mut Vec<u8>,
    ) -> Result<(), Error> {
        self.source_ms = Some(
            self.source_ms
                .map_or(batch.source_ms, |m: i64| m.min(batch.source_ms)),
        );
        // Sum per limit of the message first (by index, no hashing), then
        // once per limit into the group's sums.
        self.local.clear();
        self.local.resize(batch.limits.len(), LocalSum::default());
        for tuple in &batch.tuples {
            if !answers.next().expect("an answer for every tuple") {
                self.stats.duplicates_by_id += 1;
                continue;
            }
            new_ids.extend_from_slice(&tuple.msg_id.0);
            let limit = batch.limit_of(tuple);
            if self.careful && !self.fits(store, wtxn, seq, limit, tuple)? {
                continue;
            }
            self.add_tuple(limit, tuple)?;
            self.stats.applied += 1;
        }
        self.add_message_sums(batch)
    }

    /// Careful mode: whether `tuple` keeps its limit's lifetime sum within
    /// u64 micros. One that does not is set aside, and left out of the sums.
    fn fits(
        &mut self,
        store: &Store,
        wtxn: &RwTxn<'_>,
        seq: u64,
        limit: &'g str,
        tuple: &SpendTuple,
    ) -> Result<bool, Error> {
        let total = match self.projected.get_mut(limit) {
            Some(total) => total,
            None => {
                let stored = stored_lifetime(store, wtxn, limit)?;
                self.projected.entry(limit).or_insert(stored)
            }
        };
        match total.checked_add(tuple.cost_micros) {
            Some(sum) => {
                *total = sum;
                Ok(true)
            }
            None => {
                self.overflowed.push(Overflowed {
                    seq,
                    limit: limit.to_string(),
                    bucket: tuple.bucket,
                    cost_micros: tuple.cost_micros,
                    msg_id: tuple.msg_id.0,
                    lifetime_micros: *total,
                });
                Ok(false)
            }
        }
    }

    /// Add one tuple to its limit's sums of the message in progress.
    fn add_tuple(&mut self, limit: &'g str, tuple: &SpendTuple) -> Result<(), Error> {
        let sum = &mut self.local[tuple.limit as usize];
        sum.micros = checked(sum.micros, tuple.cost_micros, limit, LIFETIME_BUCKET)?;
        sum.tuples += 1;
        if tuple.bucket != LIFETIME_BUCKET && tuple.bucket < self.closed_below {
            // A closed period: lifetime only ([`super::closed`]).
            self.late_tuples += 1;
            self.late_micros = self.late_micros.saturating_add(tuple.cost_micros);
            self.late_oldest = self.late_oldest.min(tuple.bucket);
        } else if tuple.bucket != LIFETIME_BUCKET {
            if sum.bucket == tuple.bucket || sum.bucket == LIFETIME_BUCKET {
                sum.bucket = tuple.bucket;
                sum.bucket_micros =
                    checked(sum.bucket_micros, tuple.cost_micros, limit, tuple.bucket)?;
            } else {
                // A second bucket in one message (a late event).
                let delta = self.bucket_deltas.entry((limit, tuple.bucket)).or_default();
                *delta = checked(*delta, tuple.cost_micros, limit, tuple.bucket)?;
            }
        }
        Ok(())
    }

    /// Add the sums of the message just read to the group's, once per limit.
    fn add_message_sums(&mut self, batch: &'g SpendBatch) -> Result<(), Error> {
        for (sum, limit) in self.local.iter().zip(&batch.limits) {
            if sum.tuples == 0 {
                continue;
            }
            let lifetime = self.lifetime_deltas.entry(limit.as_str()).or_default();
            lifetime.0 = checked(lifetime.0, sum.micros, limit, LIFETIME_BUCKET)?;
            lifetime.1 += sum.tuples;
            if sum.bucket != LIFETIME_BUCKET {
                let delta = self
                    .bucket_deltas
                    .entry((limit.as_str(), sum.bucket))
                    .or_default();
                *delta = checked(*delta, sum.bucket_micros, limit, sum.bucket)?;
            }
        }
        Ok(())
    }
}

/// The stored lifetime sum of `limit` as the transaction sees it.
fn stored_lifetime(store: &Store, txn: &RwTxn<'_>, limit: &str) -> Result<u64, Error> {
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
