//! What the dedupe window holds, as the writer last saw it, for the
//! operator: the effective window (the stream time between the oldest id
//! still held and the newest), the ids and the set's table bytes. The
//! writer updates it with every eviction pass; the pusher reports it to the
//! pacers ([`Report`], `GET /v1/shards`) every [`REPORT_EVERY`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use adspend_common::dedupe_window::Report;

use crate::config::DedupeLimits;

/// How often the pusher reports the window.
pub(crate) const REPORT_EVERY: Duration = Duration::from_secs(5);

/// No oldest id known yet (the window holds none).
const UNKNOWN: u64 = u64::MAX;

/// Shared between the writer (stores) and the pusher (reads).
#[derive(Debug)]
pub(crate) struct Window {
    limits: DedupeLimits,
    effective_ms: AtomicU64,
    ids: AtomicU64,
    table_bytes: AtomicU64,
    /// Ids evicted by the count bound (before their time) since the start.
    evicted_by_count: AtomicU64,
}

impl Window {
    pub(crate) fn new(limits: DedupeLimits) -> Self {
        Window {
            limits,
            effective_ms: AtomicU64::new(UNKNOWN),
            ids: AtomicU64::new(0),
            table_bytes: AtomicU64::new(0),
            evicted_by_count: AtomicU64::new(0),
        }
    }

    /// After an eviction pass: `effective_ms` is `None` when the window
    /// holds no id.
    pub(crate) fn set(
        &self,
        effective_ms: Option<u64>,
        ids: u64,
        table_bytes: u64,
        evicted_by_count: u64,
    ) {
        self.effective_ms
            .store(effective_ms.unwrap_or(UNKNOWN), Ordering::Relaxed);
        self.ids.store(ids, Ordering::Relaxed);
        self.table_bytes.store(table_bytes, Ordering::Relaxed);
        self.evicted_by_count
            .fetch_add(evicted_by_count, Ordering::Relaxed);
    }

    pub(crate) fn report(&self, shard: &str, at_ms: i64) -> Report {
        let effective = self.effective_ms.load(Ordering::Relaxed);
        Report {
            shard: shard.to_string(),
            effective_ms: (effective != UNKNOWN).then_some(effective),
            configured_ms: self.limits.window_ms,
            ids: self.ids.load(Ordering::Relaxed),
            max_ids: self.limits.max_ids,
            memory_bytes: self.table_bytes.load(Ordering::Relaxed),
            evicted_by_count: self.evicted_by_count.load(Ordering::Relaxed),
            at_ms,
        }
    }
}
