//! The end of a group: its commit, under the lease and the changes lock,
//! and what follows a commit (metrics, set-aside tuples, the pusher's and
//! the checkpointer's hand-offs).

use adspend_common::{failpoint, now_ms};
use adspend_wire::types::SumEntry;
use heed::RwTxn;

use super::accumulate::Pass;
use super::{GroupStats, Incoming, Writer};
use crate::error::Error;
use crate::store::PeriodClock;
use crate::telemetry::{
    APPLY_COMMITS_TOTAL, DUPLICATES_DROPPED_TOTAL, LAST_APPLIED_SEQ, SPEND_SET_ASIDE_TOTAL,
    TUPLES_APPLIED_TOTAL,
};

impl Writer {
    /// Store the new last applied sequence and commit. In cluster mode the
    /// commit waits for a valid lease (the last thing before it), and fails
    /// if the lease is lost.
    pub(super) fn commit(
        &mut self,
        mut wtxn: RwTxn<'_>,
        applied_through: u64,
        changed: &[SumEntry],
        log_added: Option<[u8; 16]>,
        evicted: &[[u8; 16]],
        clock: PeriodClock,
    ) -> Result<(), Error> {
        let store = &self.store;
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
                changed,
                log_added.map(|key| (key, self.new_ids.as_slice())),
                evicted,
                applied_through,
            );
            changes.clock(clock);
        }
        failpoint::hit("aggregator.after_commit");
        self.last_applied_seq = applied_through;
        self.period_clock = clock;
        Ok(())
    }

    /// After the commit: metrics, tuples set aside (logged, then sent to be
    /// dead lettered), the changed sums to the pusher and the markers'
    /// sequences to the checkpointer.
    pub(super) fn effects(
        &mut self,
        last: &Incoming,
        pass: Pass<'_>,
        changed: Vec<SumEntry>,
    ) -> GroupStats {
        let Pass {
            mut stats,
            applied_through,
            source_ms,
            markers,
            overflowed,
            late_tuples,
            late_micros,
            late_oldest,
            ..
        } = pass;
        stats.late_tuples = late_tuples;
        let open = self.period_clock.closed_below;
        self.late
            .add(&self.shard, late_tuples, late_micros, late_oldest, open);
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
        stats
    }
}
