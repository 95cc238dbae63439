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

use adspend_wire::types::SpendMessage;
use tokio::sync::{mpsc, watch};

use crate::checkpoint::delta::Changes;
pub use crate::config::DedupeLimits;
use crate::dedupe::window::Window;
use crate::dedupe::{self, IdSet, ShardOrder};
use crate::disk;
use crate::error::Error;
use crate::fence::Validity;
pub use crate::handoff::{CheckpointRequest, Dirty, Incoming};
#[cfg(test)] // named by the tests through `super::*`
use crate::store::parse_lifetime;
use crate::store::{PeriodClock, Store};
use adspend_wire::types::LIFETIME_BUCKET;

use self::accumulate::Pass;

/// Most tuples in one write transaction, to bound commit latency.
const MAX_GROUP_TUPLES: usize = 200_000;
/// Most dedupe ids evicted per transaction (rounded up to whole log
/// entries); the rest go in the next ones.
const MAX_EVICT_PER_TXN: u64 = 100_000;

/// A tuple set aside because adding it would take its limit's lifetime sum
/// past u64 micros. Checking the lifetime sum is enough: every tuple adds to
/// it, so no bucket sum exceeds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Overflowed {
    pub(crate) seq: u64,
    pub(crate) limit: String,
    pub(crate) bucket: u32,
    pub(crate) cost_micros: u64,
    pub(crate) msg_id: [u8; 16],
    /// The lifetime sum it would have been added to.
    pub(crate) lifetime_micros: u64,
}

/// Checked addition of micros; an overflow names the sum.
fn checked(a: u64, b: u64, limit: &str, bucket: u32) -> Result<u64, Error> {
    a.checked_add(b).ok_or_else(|| Error::Overflow {
        limit: limit.to_string(),
        bucket,
    })
}

pub struct Writer {
    pub(crate) store: Arc<Store>,
    pub(crate) dedupe: DedupeLimits,
    pub(crate) dirty: Arc<Dirty>,
    pub(crate) checkpoints: watch::Sender<CheckpointRequest>,
    pub(crate) last_applied_seq: u64,
    last_marker: u64,
    requests: u64,
    /// The ids of the dedupe window (see [`crate::dedupe`]).
    ids: IdSet,
    /// What the window holds, for the pusher's report.
    window: Arc<Window>,
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
    /// What changed since the last checkpoint took it ([`crate::checkpoint::delta`]),
    /// updated under the same lock as each commit.
    changes: Arc<Mutex<Changes>>,
    /// Where tuples set aside for overflow go, after their commit (to be
    /// dead lettered).
    overflowed: Option<mpsc::UnboundedSender<Overflowed>>,
    /// Stream time of the next pass over lease sums ([`prune`]).
    next_lease_prune_ms: u64,
    /// `ADSPEND_CLOSED_PERIOD_DAYS` ([`closed`]).
    closed_days: u64,
    /// The stream clock as of the last commit.
    period_clock: PeriodClock,
    late: closed::LateReport,
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct GroupStats {
    pub applied: u64,
    pub(crate) duplicates_by_id: u64,
    pub(crate) replayed_by_seq: u64,
    pub(crate) evicted: u64,
    /// Tuples set aside because they would overflow their limit's sum.
    pub(crate) overflowed: u64,
    /// Sums of spend leases deleted past their retention.
    pub(crate) leases_pruned: u64,
    /// Tuples of closed periods, added to lifetime sums only.
    pub(crate) late_tuples: u64,
    /// Period sums deleted because their period closed.
    pub(crate) closed_sums_dropped: u64,
}

impl Writer {
    pub fn new(
        store: Arc<Store>,
        dedupe: DedupeLimits,
        dirty: Arc<Dirty>,
        checkpoints: watch::Sender<CheckpointRequest>,
    ) -> Result<Self, Error> {
        let (last_applied_seq, period_clock) = {
            let txn = store.read_txn()?;
            (store.last_applied_seq(&txn)?, store.period_clock(&txn)?)
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
            window: Arc::new(Window::new(dedupe)),
            new_ids: Vec::new(),
            group_ids: Vec::new(),
            shard_order: ShardOrder::default(),
            shard: "all".to_string(),
            lease: None,
            changes: Arc::new(Mutex::new(Changes::at(last_applied_seq))),
            overflowed: None,
            next_lease_prune_ms: 0,
            closed_days: closed::DEFAULT_CLOSED_PERIOD_DAYS,
            period_clock,
            late: closed::LateReport::default(),
        })
    }

    /// Drop the sums of periods closed for more than `days` (the default is
    /// [`closed::DEFAULT_CLOSED_PERIOD_DAYS`]).
    pub fn with_closed_period_days(mut self, days: u64) -> Self {
        self.closed_days = days;
        self
    }

    /// Label the writer's gauges with `shard` and, in cluster mode, refuse to
    /// commit once `lease` has lapsed.
    pub(crate) fn for_shard(mut self, shard: &str, lease: Option<Arc<Validity>>) -> Self {
        self.shard = shard.to_string();
        self.lease = lease;
        self
    }

    /// Send tuples set aside for overflow to `tx` once their group commits.
    pub(crate) fn with_overflow_sink(mut self, tx: mpsc::UnboundedSender<Overflowed>) -> Self {
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

    /// Bytes of the dedupe window's in-memory tables.
    pub fn dedupe_table_bytes(&self) -> u64 {
        self.ids.table_bytes()
    }

    /// What the dedupe window holds, as of the last commit.
    pub(crate) fn window(&self) -> Arc<Window> {
        self.window.clone()
    }

    /// Apply until the channel closes. Blocking: run on a dedicated thread.
    pub(crate) fn run(mut self, mut rx: mpsc::Receiver<Incoming>) -> Result<(), Error> {
        let mut group: Vec<Incoming> = Vec::with_capacity(64);
        // A shard's start is a lifecycle event, and so is its first commit:
        // the last step of a failover on the aggregator's side.
        let mut applied_any = false;
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
            if !self.apply_patiently(&group, &rx)? {
                break;
            }
            if !applied_any {
                applied_any = true;
                tracing::info!(
                    shard = self.shard.as_str(),
                    seq = self.last_applied_seq,
                    messages = group.len(),
                    "first SPEND messages applied since the shard started"
                );
            }
            group.clear();
        }
        Ok(())
    }

    /// [`Writer::apply_group`], waiting for space while the data directory
    /// is full ([`crate::disk`]): the group is tried again until it commits.
    /// `false` when the shard stopped meanwhile (the channel closed): the
    /// group is not applied, and whoever applies next replays it.
    fn apply_patiently(
        &mut self,
        group: &[Incoming],
        rx: &mpsc::Receiver<Incoming>,
    ) -> Result<bool, Error> {
        let mut waiting: Option<disk::SpaceWait> = None;
        loop {
            match self.apply_group(group) {
                Ok(_) => {
                    if let Some(waiting) = waiting {
                        waiting.resumed();
                    }
                    return Ok(true);
                }
                Err(e) if disk::is_full(&e) => {
                    let store = self.store.path();
                    let dir = store.parent().unwrap_or(store);
                    let waiting = waiting
                        .get_or_insert_with(|| disk::SpaceWait::new(dir, &self.shard, "commit"));
                    if !waiting.wait_blocking(&e, || rx.is_closed()) {
                        return Ok(false);
                    }
                }
                Err(e) => return Err(e),
            }
        }
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

    /// Apply `group` in one write transaction, as a sequence of steps: skip
    /// replayed messages, dedupe, add up (checked; `careful` sets aside the
    /// tuples that would overflow), write the log entry and the sums, evict,
    /// commit, then the effects that follow a commit.
    fn try_apply_group(&mut self, group: &[Incoming], careful: bool) -> Result<GroupStats, Error> {
        let Some(last) = group.last() else {
            return Ok(GroupStats::default());
        };
        let store = self.store.clone();
        let mut wtxn = store.write_txn()?;
        let clock = PeriodClock {
            closed_below: closed::closed_below(self.period_clock.stream_clock_ms, self.closed_days),
            ..self.period_clock
        };
        let mut pass = Pass::new(careful, self.last_applied_seq, clock);
        let fresh = skip_replayed(group, self.last_applied_seq, &mut pass.stats);
        self.dedupe(&fresh);
        self.accumulate(&wtxn, &fresh, &mut pass)?;
        let log_added = self.log_new_ids(&mut wtxn, &pass)?;
        let mut changed = self.write_sums(&mut wtxn, &mut pass)?;
        let (clock, dropped) = self.drop_closed(&mut wtxn, pass.stream_clock_ms)?;
        pass.stats.closed_sums_dropped = dropped;
        // Added earlier in the group, closed by its end: gone already.
        changed.retain(|e| e.bucket == LIFETIME_BUCKET || e.bucket >= clock.closed_below);
        let evicted = if pass.clock_ms > 0 {
            pass.stats.leases_pruned = self.prune_leases(&mut wtxn, pass.clock_ms)?;
            self.evict(&mut wtxn, pass.clock_ms, &mut pass.stats)?
        } else {
            Vec::new()
        };
        self.commit(
            wtxn,
            pass.applied_through,
            &changed,
            log_added,
            &evicted,
            clock,
        )?;
        Ok(self.effects(last, pass, changed))
    }

    /// Decide which ids of the fresh messages are new, for the whole group
    /// at once, shard by shard (see `IdSet::insert_in_shard_order`); the
    /// answers, in stream order, are in `shard_order.fresh`, read by
    /// [`Writer::accumulate`] over the same messages.
    fn dedupe(&mut self, fresh: &[&Incoming]) {
        self.new_ids.clear();
        self.group_ids.clear();
        for incoming in fresh {
            if let SpendMessage::Batch(batch) = &incoming.message {
                let ids = batch.tuples.iter().map(|t| dedupe::id_key(&t.msg_id.0));
                self.group_ids.extend(ids);
            }
        }
        self.ids
            .insert_in_shard_order(&self.group_ids, &mut self.shard_order);
    }
}

/// The messages of `group` past `through` and every message before them; a
/// replay's messages, at or below the last applied sequence, are skipped by
/// sequence and counted in `stats`.
fn skip_replayed<'g>(
    group: &'g [Incoming],
    mut through: u64,
    stats: &mut GroupStats,
) -> Vec<&'g Incoming> {
    let mut fresh = Vec::with_capacity(group.len());
    for incoming in group {
        if incoming.seq > through {
            through = incoming.seq;
            fresh.push(incoming);
        } else {
            stats.replayed_by_seq += incoming.tuples() as u64;
        }
    }
    fresh
}

mod accumulate;
pub(crate) mod closed;
mod commit;
mod evict;
mod prune;
mod sums;

#[cfg(test)]
mod tests;
