//! [`Book`]: this region's [`LimitLedger`] of every limit, for the current
//! period of each, with what the ledgers alone do not know: grants decided
//! here and not yet in the lease ledger, the unmet demand of lease asks,
//! the `seq` of this region's reports and when each region was last heard.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use adspend_wire::catalog::{Catalog, Limit, Period};
use adspend_wire::regions::{
    LimitEntry, LimitLedger, RegionName, RegionReport, LIFETIME_PERIOD_START_MS,
};
use chrono::{DateTime, Utc};

/// Per-mille of its allotment a region keeps for itself however much the
/// others want (10%).
pub(crate) const RESERVE_PERMILLE: u16 = 100;

/// What the book needs of one limit from the rest of the pacer at a report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Own {
    /// Spend in the limit's current period, as this region's pipeline has it.
    pub(crate) spend: u64,
    pub(crate) lifetime_spend: u64,
    /// Held by live leases (the lease ledger).
    pub(crate) leased: u64,
}

/// The last report header heard of a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LastHeard {
    pub(crate) seq: u64,
    pub(crate) as_of_ms: i64,
}

#[derive(Debug)]
pub(crate) struct Book {
    region: RegionName,
    regions: BTreeSet<RegionName>,
    ledgers: HashMap<Arc<str>, LimitLedger>,
    /// Granted by this pacer's committer and not yet folded into the lease
    /// ledger: already out of the room, not yet in `leased`.
    pending: HashMap<Arc<str>, u64>,
    /// Unmet demand of lease asks cut for room: this interval's, and the
    /// one before (a region asking once a second still wants between asks).
    want: HashMap<Arc<str>, [u64; 2]>,
    /// The highest `seq` of this region's reports, heard or published.
    seq: u64,
    last_heard: BTreeMap<RegionName, LastHeard>,
    /// Everything in the stream when this pacer started has been merged:
    /// until then its own `given` counters may be behind, so it neither
    /// grants within an allotment nor gives.
    ready: bool,
}

/// The start of `limit`'s period containing `now`, as the ledgers name it.
pub(crate) fn period_start_ms(limit: &Limit, now: DateTime<Utc>) -> i64 {
    match limit.period {
        Period::Lifetime => LIFETIME_PERIOD_START_MS,
        Period::Daily => limit
            .period_at(now)
            .start
            .map_or(LIFETIME_PERIOD_START_MS, |s| s.timestamp_millis()),
    }
}

impl Book {
    pub(crate) fn new(region: RegionName, regions: BTreeSet<RegionName>) -> Book {
        Book {
            region,
            regions,
            ledgers: HashMap::new(),
            pending: HashMap::new(),
            want: HashMap::new(),
            seq: 0,
            last_heard: BTreeMap::new(),
            ready: false,
        }
    }

    pub(crate) fn region(&self) -> &RegionName {
        &self.region
    }

    pub(crate) fn regions(&self) -> &BTreeSet<RegionName> {
        &self.regions
    }

    pub(crate) fn ledger(&self, limit_id: &str) -> Option<&LimitLedger> {
        self.ledgers.get(limit_id)
    }

    pub(crate) fn is_ready(&self) -> bool {
        self.ready
    }

    pub(crate) fn set_ready(&mut self) {
        self.ready = true;
    }

    #[cfg(test)]
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    pub(crate) fn last_heard(&self) -> &BTreeMap<RegionName, LastHeard> {
        &self.last_heard
    }

    fn ledger_mut(&mut self, id: &Arc<str>, period_start_ms: i64) -> &mut LimitLedger {
        let (region, regions) = (&self.region, &self.regions);
        self.ledgers.entry(id.clone()).or_insert_with(|| {
            // The regions were checked against MAX_REGIONS with the settings.
            LimitLedger::new(
                &**id,
                region.clone(),
                regions.iter().cloned(),
                0,
                period_start_ms,
            )
            .expect("the region set was checked with the settings")
        })
    }

    /// Every catalog limit gets a ledger, with its budget and its current
    /// period. Ledgers of limits gone from the catalog stay: this region's
    /// `given` counters must not be forgotten should the limit come back.
    pub(crate) fn follow_catalog(&mut self, catalog: &Catalog, now: DateTime<Utc>) {
        for limit in catalog.limits_after(None) {
            let start = period_start_ms(limit, now);
            let ledger = self.ledger_mut(&limit.id, start);
            ledger.set_budget(limit.budget_micros);
            if ledger.roll_to(start) {
                self.want.remove(&limit.id);
            }
        }
    }

    /// Folds in one report (or part of one) read from the stream. This
    /// region's own restore its `given` counters and `seq`.
    pub(crate) fn merge(&mut self, report: &RegionReport) {
        if !self.regions.contains(&report.region) {
            return;
        }
        let last = self
            .last_heard
            .entry(report.region.clone())
            .or_insert(LastHeard {
                seq: report.seq,
                as_of_ms: report.as_of_ms,
            });
        if report.seq >= last.seq {
            *last = LastHeard {
                seq: report.seq,
                as_of_ms: report.as_of_ms.max(last.as_of_ms),
            };
        }
        if report.region == self.region {
            self.seq = self.seq.max(report.seq);
        }
        for entry in &report.limits {
            let id: Arc<str> = entry.limit_id.as_str().into();
            let ledger = self.ledger_mut(&id, entry.period_start_ms);
            ledger.merge(report.origin(), entry);
        }
    }

    /// What this region may still grant of `limit_id` besides what is
    /// leased already: its allotment less its spend, `leased` and what this
    /// pacer granted that the lease ledger does not hold yet. 0 until the
    /// book is ready or for a limit it has no ledger of.
    pub(crate) fn room(&self, limit_id: &str, spend: u64, leased: u64) -> u64 {
        if !self.ready {
            return 0;
        }
        let pending = self.pending.get(limit_id).copied().unwrap_or(0);
        self.ledgers
            .get(limit_id)
            .map_or(0, |l| l.room(spend, leased.saturating_add(pending)))
    }

    /// Lease asks of `limit_id` went `micros` short for want of room.
    pub(crate) fn add_want(&mut self, limit_id: &Arc<str>, micros: u64) {
        let want = self.want.entry(limit_id.clone()).or_default();
        want[0] = want[0].saturating_add(micros);
    }

    fn want_of(&self, limit_id: &str) -> u64 {
        self.want
            .get(limit_id)
            .map_or(0, |w| w[0].saturating_add(w[1]))
    }

    /// Grants of `micros` on each of `limits` are decided, not yet held by
    /// the lease ledger.
    pub(crate) fn add_pending<'a>(&mut self, limits: impl IntoIterator<Item = (&'a str, u64)>) {
        for (limit, micros) in limits {
            *self.pending.entry(limit.into()).or_default() += micros;
        }
    }

    /// The grants [`add_pending`](Self::add_pending) took are in the lease
    /// ledger now, or were never written.
    pub(crate) fn remove_pending<'a>(&mut self, limits: impl IntoIterator<Item = (&'a str, u64)>) {
        for (limit, micros) in limits {
            if let Some(held) = self.pending.get_mut(limit) {
                *held = held.saturating_sub(micros);
                if *held == 0 {
                    self.pending.remove(limit);
                }
            }
        }
    }

    /// This region's next report: first gives what the others want and it
    /// can spare (`plan_gifts`, then `give`), then takes the next `seq`
    /// and every catalog limit's entry. `own` has the spend and leases of
    /// each limit (absent: none).
    pub(crate) fn next_report(
        &mut self,
        catalog: &Catalog,
        own: &HashMap<Arc<str>, Own>,
    ) -> (u64, Vec<LimitEntry>) {
        let mut entries = Vec::new();
        for limit in catalog.limits_after(None) {
            let o = own.get(&limit.id).copied().unwrap_or_default();
            let leased = o
                .leased
                .saturating_add(self.pending.get(&limit.id).copied().unwrap_or(0));
            let want = self.want_of(&limit.id);
            let Some(ledger) = self.ledgers.get_mut(&limit.id) else {
                continue;
            };
            if self.ready {
                for (to, micros) in ledger.plan_gifts(o.spend, leased, want, RESERVE_PERMILLE) {
                    ledger.give(&to, micros, o.spend, leased);
                }
            }
            entries.push(ledger.entry(o.spend, o.lifetime_spend, leased, want));
        }
        self.seq += 1;
        (self.seq, entries)
    }

    /// A report interval ended (whether or not this pacer published):
    /// demand older than the one before is forgotten.
    pub(crate) fn end_interval(&mut self) {
        for want in self.want.values_mut() {
            *want = [0, want[0]];
        }
        self.want.retain(|_, w| w[1] > 0);
    }
}
