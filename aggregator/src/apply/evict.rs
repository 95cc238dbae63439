//! The dedupe window's eviction: the writer drops log entries (and their
//! ids) that fell out of the window, inside the group's write transaction.

use heed::RwTxn;

use super::{GroupStats, Writer, MAX_EVICT_PER_TXN};
use crate::dedupe;
use crate::error::Error;
use crate::store::log_key_time;
use crate::telemetry::{
    DEDUPE_EVICTED_TOTAL, DEDUPE_IDS, DEDUPE_MEMORY_BYTES, DEDUPE_WINDOW_SECONDS,
    DEDUPE_WINDOW_TARGET_SECONDS,
};

impl Writer {
    /// Drop the log entries older than the window (in stream time) or beyond
    /// the count bound, oldest first, and their ids from the set. Whole
    /// entries go, so the count bound may be undershot by one transaction's
    /// ids. Returns the keys of the entries deleted.
    pub(super) fn evict(
        &mut self,
        wtxn: &mut RwTxn<'_>,
        clock_ms: u64,
        stats: &mut GroupStats,
    ) -> Result<Vec<[u8; 16]>, Error> {
        let store = self.store.clone();
        let cutoff = clock_ms.saturating_sub(self.dedupe.window_ms);
        let mut evicted = 0u64;
        let mut by_count = 0u64;
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
                let count = (ids.len() / 16) as u64;
                evicted += count;
                if time >= cutoff {
                    by_count += count;
                }
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
        self.window_gauges(clock_ms, oldest_kept, evicted, by_count);
        stats.evicted = evicted;
        Ok(doomed)
    }

    /// The window's gauges and counters, and its report for the pusher.
    fn window_gauges(&self, clock_ms: u64, oldest: Option<u64>, evicted: u64, by_count: u64) {
        let shard = || self.shard.clone();
        let effective_ms = oldest.map(|oldest| clock_ms.saturating_sub(oldest));
        let table_bytes = self.ids.table_bytes();
        metrics::gauge!(DEDUPE_IDS, "shard" => shard()).set(self.ids.len() as f64);
        if let Some(ms) = effective_ms {
            metrics::gauge!(DEDUPE_WINDOW_SECONDS, "shard" => shard()).set(ms as f64 / 1000.0);
        }
        metrics::gauge!(DEDUPE_WINDOW_TARGET_SECONDS, "shard" => shard())
            .set(self.dedupe.window_ms as f64 / 1000.0);
        metrics::gauge!(DEDUPE_MEMORY_BYTES, "shard" => shard()).set(table_bytes as f64);
        if evicted > by_count {
            metrics::counter!(DEDUPE_EVICTED_TOTAL, "shard" => shard(), "by" => "time")
                .increment(evicted - by_count);
        }
        if by_count > 0 {
            metrics::counter!(DEDUPE_EVICTED_TOTAL, "shard" => shard(), "by" => "count")
                .increment(by_count);
        }
        self.window
            .set(effective_ms, self.ids.len() as u64, table_bytes, by_count);
    }
}
