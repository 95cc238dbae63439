//! Spend leases' sums are kept only while they can matter: the writer
//! deletes the lifetime sum of every lease key whose lease expired more
//! than [`LEASE_RETENTION_MS`] ago (in stream time, the clock eviction
//! uses), inside the group's write transaction, at most once a
//! [`PRUNE_EVERY_MS`] of that clock. Per-lease state stays bounded by the
//! leases granted in the last hour or so.
//!
//! A deleted sum is not written to the checkpoint delta: a restore from
//! an older chain brings it back, and the next pass deletes it again. A
//! pacer that still counts such a lease (its grace is longer than the
//! retention) keeps the largest sum it was sent, so a pruned sum only ever
//! makes it hold the lease's budget longer, never shorter.

use adspend_wire::lease::{lease_of_key, LEASE_KEY_PREFIX, LEASE_RETENTION_MS};
use heed::RwTxn;

use super::Writer;
use crate::error::Error;

/// Stream time between two passes.
pub(super) const PRUNE_EVERY_MS: u64 = 60_000;

impl Writer {
    /// Delete the sums of leases past retention, if a pass is due at
    /// `clock_ms`; returns how many were deleted.
    pub(super) fn prune_leases(
        &mut self,
        wtxn: &mut RwTxn<'_>,
        clock_ms: u64,
    ) -> Result<u64, Error> {
        if clock_ms < self.next_lease_prune_ms {
            return Ok(0);
        }
        self.next_lease_prune_ms = clock_ms + PRUNE_EVERY_MS;
        let cutoff = clock_ms.saturating_sub(LEASE_RETENTION_MS) as i64;
        let store = self.store.clone();
        let mut doomed: Vec<String> = Vec::new();
        for entry in store
            .lifetime
            .prefix_iter(wtxn, LEASE_KEY_PREFIX)
            .map_err(store.err("iterate lease sums"))?
        {
            let (key, _) = entry.map_err(store.err("iterate lease sums"))?;
            if lease_of_key(key).is_some_and(|lease| lease.expires_at_ms < cutoff) {
                doomed.push(key.to_string());
            }
        }
        for key in &doomed {
            store
                .lifetime
                .delete(wtxn, key)
                .map_err(store.err("prune lease sums"))?;
        }
        Ok(doomed.len() as u64)
    }
}
