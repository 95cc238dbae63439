//! One ad's leases and demand: the rules of docs/LEASES.md for a single ad,
//! with the clock passed in, so they are tested without a pacer or a timer.
//!
//! An ad holds at most two leases: the newest, and the one it replaced
//! while that has something left, spent first (what a renewal leaves of it
//! would otherwise stay held at the pacers until expiry plus their grace).
//! A lease serves nothing once the clock is within the margin of its
//! expiry. A lease let go with something left (its usable end passed, or a
//! third grant pushed it out) is released with what was served under it.

use std::sync::Arc;

use crate::api::Release;

/// A live lease: what is left of its grant, and its expiry by the pacer.
#[derive(Debug, Clone)]
pub(crate) struct Lease {
    pub(crate) id: Arc<str>,
    pub(crate) granted: u64,
    pub(crate) remaining: u64,
    pub(crate) expires_at_ms: i64,
}

impl Lease {
    fn release(&self) -> Release {
        Release {
            lease_id: self.id.to_string(),
            served_micros: self.granted - self.remaining,
        }
    }
}

/// Why [`AdLeases::spend`] took nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The ad holds no lease (none asked yet, or the pacer granted 0).
    NoLease,
    /// Every lease the ad holds is within the margin of its expiry.
    Expired,
    /// No lease the ad holds has enough left for this cost.
    TooLittleLeft,
}

/// One ad's state in a book.
#[derive(Debug, Default)]
pub(crate) struct AdLeases {
    pub(crate) lease: Option<Lease>,
    pub(crate) older: Option<Lease>,
    /// Since the renewer last looked: requests (served or refused) and the
    /// micros they wanted.
    pub(crate) requests: u64,
    pub(crate) wanted_micros: u64,
    /// The highest cost asked for this ad.
    pub(crate) max_cost: u64,
    /// Micros per second wanted, exponentially weighted.
    pub(crate) rate: f64,
    /// No ask before this instant (after zero grants).
    pub(crate) retry_at_ms: i64,
    pub(crate) zeros_in_a_row: u32,
    /// Whether an ask is out (one at a time per ad).
    pub(crate) asking: bool,
    /// Leases let go with something left, not yet released.
    pub(crate) releases: Vec<Release>,
}

/// After a zero grant an ad is not asked for again for this long, doubled
/// on each zero in a row up to [`ZERO_BACKOFF_MAX_MS`].
const ZERO_BACKOFF_MS: i64 = 250;
const ZERO_BACKOFF_MAX_MS: i64 = 8_000;

impl AdLeases {
    /// Takes `cost` out of a usable lease (the older first) and returns its
    /// id, or says why not. Every call counts as demand.
    pub(crate) fn spend(
        &mut self,
        cost: u64,
        now_ms: i64,
        margin_ms: i64,
    ) -> Result<Arc<str>, Refusal> {
        self.requests += 1;
        self.wanted_micros = self.wanted_micros.saturating_add(cost);
        self.max_cost = self.max_cost.max(cost);
        let mut refusal = Refusal::NoLease;
        for slot in [&mut self.older, &mut self.lease] {
            let Some(lease) = slot.as_mut() else { continue };
            if now_ms >= lease.expires_at_ms.saturating_sub(margin_ms) {
                let gone = slot.take();
                let_go(&mut self.releases, gone);
                if refusal == Refusal::NoLease {
                    refusal = Refusal::Expired;
                }
                continue;
            }
            if lease.remaining < cost {
                refusal = Refusal::TooLittleLeft;
                continue;
            }
            lease.remaining -= cost;
            return Ok(lease.id.clone());
        }
        Err(refusal)
    }

    /// Lets go every lease whose usable end has passed at `now_ms`.
    pub(crate) fn sweep(&mut self, now_ms: i64, margin_ms: i64) {
        for slot in [&mut self.older, &mut self.lease] {
            if slot
                .as_ref()
                .is_some_and(|l| now_ms >= l.expires_at_ms.saturating_sub(margin_ms))
            {
                let gone = slot.take();
                let_go(&mut self.releases, gone);
            }
        }
    }

    /// Folds the demand seen since the last look into the rate, over
    /// `elapsed_secs`, weighting the past by `keep` (0..1).
    pub(crate) fn fold_demand(&mut self, elapsed_secs: f64, keep: f64) {
        if elapsed_secs > 0.0 {
            let recent = self.wanted_micros as f64 / elapsed_secs;
            self.rate = self.rate * keep + recent * (1.0 - keep);
        }
        self.requests = 0;
        self.wanted_micros = 0;
    }

    /// What is left of the leases usable at `now_ms`.
    pub(crate) fn usable_left(&self, now_ms: i64, margin_ms: i64) -> u64 {
        [&self.older, &self.lease]
            .into_iter()
            .flatten()
            .filter(|l| now_ms < l.expires_at_ms.saturating_sub(margin_ms))
            .map(|l| l.remaining)
            .sum()
    }

    /// Installs a grant of `granted` micros (0: nothing) under `lease_id`.
    /// The lease it replaces is kept while it has something left; one kept
    /// before that is let go.
    pub(crate) fn install(
        &mut self,
        lease_id: Option<&str>,
        granted: u64,
        expires_at_ms: i64,
        now_ms: i64,
    ) {
        self.asking = false;
        let (Some(id), true) = (lease_id, granted > 0) else {
            self.zeros_in_a_row = self.zeros_in_a_row.saturating_add(1);
            let backoff = ZERO_BACKOFF_MS << (self.zeros_in_a_row - 1).min(8);
            self.retry_at_ms = now_ms + backoff.min(ZERO_BACKOFF_MAX_MS);
            return;
        };
        self.zeros_in_a_row = 0;
        self.retry_at_ms = 0;
        let replaced = self.lease.replace(Lease {
            id: id.into(),
            granted,
            remaining: granted,
            expires_at_ms,
        });
        let dropped = std::mem::replace(&mut self.older, replaced.filter(|l| l.remaining > 0));
        let_go(&mut self.releases, dropped);
    }

    /// An ask that failed (the pacer unreachable): asked again next time.
    pub(crate) fn ask_failed(&mut self) {
        self.asking = false;
    }
}

/// A lease let go: released if something is left of it.
fn let_go(releases: &mut Vec<Release>, lease: Option<Lease>) {
    if let Some(lease) = lease.filter(|l| l.remaining > 0) {
        releases.push(lease.release());
    }
}
