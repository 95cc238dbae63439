//! The leases every pacer has granted, as this pacer has folded them from
//! the shared ledger stream, and what each still holds of its limits'
//! budgets.
//!
//! A lease holds `granted - covered` of every limit above its ad, where
//! `covered` is the spend reported under the lease so far (never more than
//! `granted`). It holds that until it has expired and the pipeline has
//! caught up past its expiry plus the grace; then it is retired and holds
//! nothing. [`Ledger::held`] is that sum per limit: the spend in flight the
//! grants must leave room for.
//!
//! Pure bookkeeping: folding grants in stream order ([`Ledger::fold`]),
//! reports of spend per lease from the sums pushes ([`Ledger::report`]),
//! and retirement ([`Ledger::retire`]). A report may come before the grant
//! it is about has been folded (another pacer granted it a moment ago): it
//! waits in `early` until the grant arrives or could no longer matter.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use adspend_wire::lease::LeaseId;
use serde::{Deserialize, Serialize};

/// One grant as the ledger stream carries it. Its lease id is made from
/// its batch's stream sequence and its index in the batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Grant {
    pub(crate) ad_id: String,
    /// Every limit above the ad when it was granted.
    pub(crate) limits: Vec<String>,
    pub(crate) micros: u64,
    pub(crate) expires_at_ms: i64,
}

/// One message of the ledger stream: the grants of one commit.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Batch {
    /// The pacer that granted them (its instance name, for operators).
    pub(crate) pacer: String,
    pub(crate) at_ms: i64,
    pub(crate) grants: Vec<Grant>,
}

impl Batch {
    /// The lease id of the `index`th grant of the batch stored at `seq`.
    pub(crate) fn lease_id(seq: u64, index: usize, grant: &Grant) -> LeaseId {
        LeaseId {
            expires_at_ms: grant.expires_at_ms,
            seq,
            index: index as u32,
        }
    }
}

/// A lease the ledger holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Lease {
    pub(crate) ad_id: Arc<str>,
    pub(crate) limits: Vec<Arc<str>>,
    pub(crate) granted: u64,
    /// Spend reported under the lease, up to `granted`.
    pub(crate) covered: u64,
    /// Spend reported under the lease, all of it (may pass `granted`: the
    /// ad server went beyond its grant).
    pub(crate) reported: u64,
}

impl Lease {
    fn holds(&self) -> u64 {
        self.granted - self.covered
    }
}

/// How far past a report's push every shard must have caught up before
/// the report frees anything: room for the aggregators' clocks (each
/// stamps its own watermarks) being a little apart.
pub(crate) const REPORT_MARGIN_MS: i64 = 250;

/// What [`Ledger::retire`] took out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Retired {
    pub(crate) leases: u64,
    /// Granted and never covered by reported spend.
    pub(crate) unused_micros: u64,
}

/// What the live leases of one limit hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) micros: u64,
    pub(crate) leases: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Ledger {
    /// Live leases, in expiry order (a lease id sorts by expiry first).
    leases: BTreeMap<LeaseId, Lease>,
    /// Per limit: what its live leases hold, and how many there are.
    held: HashMap<Arc<str>, Held>,
    /// Spend reported under leases not folded yet.
    early: BTreeMap<LeaseId, u64>,
    /// Reports waiting for every shard to catch up with them: (when they
    /// may apply, the lease, the reported sum).
    pending: Vec<(i64, LeaseId, u64)>,
    /// The last ledger stream sequence folded.
    folded_seq: u64,
    /// Limit ids, shared by the leases that name them.
    names: HashMap<Arc<str>, ()>,
}

impl Ledger {
    pub(crate) fn folded_seq(&self) -> u64 {
        self.folded_seq
    }

    /// Sequences up to `seq` are gone from the stream (aged out): count
    /// them as folded.
    pub(crate) fn skip_to(&mut self, seq: u64) {
        self.folded_seq = self.folded_seq.max(seq);
    }

    pub(crate) fn live(&self) -> usize {
        self.leases.len()
    }

    /// What the live leases hold of `limit`'s budget.
    pub(crate) fn held(&self, limit: &str) -> u64 {
        self.held_by(limit).micros
    }

    /// What the live leases of `limit` hold, and how many there are.
    pub(crate) fn held_by(&self, limit: &str) -> Held {
        self.held.get(limit).copied().unwrap_or_default()
    }

    pub(crate) fn lease(&self, id: &LeaseId) -> Option<&Lease> {
        self.leases.get(id)
    }

    fn name(&mut self, limit: &str) -> Arc<str> {
        match self.names.get_key_value(limit) {
            Some((name, ())) => name.clone(),
            None => {
                let name: Arc<str> = Arc::from(limit);
                self.names.insert(name.clone(), ());
                name
            }
        }
    }

    /// Fold the batch stored at `seq`; a batch at or below the last folded
    /// sequence was folded already and changes nothing. Grants of nothing
    /// (0 micros) hold nothing and are not kept.
    pub(crate) fn fold(&mut self, seq: u64, batch: &Batch) {
        if seq <= self.folded_seq {
            return;
        }
        self.folded_seq = seq;
        for (index, grant) in batch.grants.iter().enumerate() {
            if grant.micros == 0 {
                continue;
            }
            let id = Batch::lease_id(seq, index, grant);
            let reported = self.early.remove(&id).unwrap_or(0);
            let limits: Vec<Arc<str>> = grant.limits.iter().map(|l| self.name(l)).collect();
            let lease = Lease {
                ad_id: Arc::from(grant.ad_id.as_str()),
                limits,
                granted: grant.micros,
                covered: reported.min(grant.micros),
                reported,
            };
            for limit in &lease.limits {
                let held = self.held.entry(limit.clone()).or_default();
                held.micros += lease.holds();
                held.leases += 1;
            }
            self.leases.insert(id, lease);
        }
    }

    /// A sums push complete as of `as_of_ms` says `reported` micros have
    /// been spent under `id` so far (a lifetime sum: it only grows). It
    /// frees what it covers only once [`Ledger::settle`] is told every
    /// shard has caught up past `as_of_ms` plus [`REPORT_MARGIN_MS`]: the
    /// same impressions' spend on the lease's limits travels in other
    /// partitions, maybe other shards, and until it shows there, freeing
    /// the lease would let the budget be granted twice.
    pub(crate) fn report(&mut self, id: LeaseId, reported: u64, as_of_ms: i64) {
        self.pending
            .push((as_of_ms.saturating_add(REPORT_MARGIN_MS), id, reported));
    }

    /// Apply the reports whose spend every shard has caught up with.
    pub(crate) fn settle(&mut self, caught_up_ms: i64) {
        if self.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        for (ready_ms, id, reported) in pending {
            if ready_ms <= caught_up_ms {
                self.apply_report(id, reported);
            } else {
                self.pending.push((ready_ms, id, reported));
            }
        }
    }

    fn apply_report(&mut self, id: LeaseId, reported: u64) {
        let Some(lease) = self.leases.get_mut(&id) else {
            if id.seq > self.folded_seq {
                let early = self.early.entry(id).or_default();
                *early = (*early).max(reported);
            }
            return;
        };
        if reported <= lease.reported {
            return;
        }
        lease.reported = reported;
        let covered = reported.min(lease.granted);
        let freed = covered.saturating_sub(lease.covered);
        lease.covered = lease.covered.max(covered);
        if freed > 0 {
            for limit in &lease.limits {
                if let Some(held) = self.held.get_mut(limit) {
                    held.micros = held.micros.saturating_sub(freed);
                }
            }
        }
    }

    /// Retire the leases that expired more than `grace_ms` before
    /// `caught_up_ms` (how far the pipeline has caught up), and forget
    /// early reports that could no longer matter.
    pub(crate) fn retire(&mut self, caught_up_ms: i64, grace_ms: i64) -> Retired {
        let mut retired = Retired::default();
        while let Some(entry) = self.leases.first_entry() {
            if entry.key().expires_at_ms.saturating_add(grace_ms) > caught_up_ms {
                break;
            }
            let lease = entry.remove();
            retired.leases += 1;
            retired.unused_micros += lease.holds();
            for limit in &lease.limits {
                if let Some(held) = self.held.get_mut(limit) {
                    held.micros = held.micros.saturating_sub(lease.holds());
                    held.leases = held.leases.saturating_sub(1);
                    if held.leases == 0 {
                        self.held.remove(limit);
                    }
                }
            }
        }
        while let Some(entry) = self.early.first_entry() {
            if entry.key().expires_at_ms.saturating_add(grace_ms) > caught_up_ms {
                break;
            }
            entry.remove();
        }
        if self.leases.is_empty() {
            self.names.clear();
        }
        retired
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(ad: &str, limits: &[&str], micros: u64, expires_at_ms: i64) -> Grant {
        Grant {
            ad_id: ad.into(),
            limits: limits.iter().map(|l| l.to_string()).collect(),
            micros,
            expires_at_ms,
        }
    }

    fn batch(grants: Vec<Grant>) -> Batch {
        Batch {
            pacer: "p".into(),
            at_ms: 0,
            grants,
        }
    }

    #[test]
    fn a_grant_holds_its_limits_until_covered() {
        let mut ledger = Ledger::default();
        ledger.fold(
            1,
            &batch(vec![
                grant("ad-1", &["s", "c"], 1_000, 30_000),
                grant("ad-2", &["c"], 500, 30_000),
                grant("ad-3", &["c"], 0, 30_000),
            ]),
        );
        assert_eq!((ledger.held("s"), ledger.held("c")), (1_000, 1_500));
        assert_eq!(ledger.live(), 2, "a grant of nothing is not kept");
        let first = Batch::lease_id(1, 0, &grant("", &[], 0, 30_000));
        ledger.report(first, 400, 0);
        ledger.settle(i64::MAX);
        assert_eq!((ledger.held("s"), ledger.held("c")), (600, 1_100));
        // A push that is not newer changes nothing.
        ledger.report(first, 300, 0);
        ledger.settle(i64::MAX);
        assert_eq!(ledger.held("c"), 1_100);
        // Beyond the grant: it holds nothing, and no more is freed.
        ledger.report(first, 1_700, 0);
        ledger.settle(i64::MAX);
        assert_eq!((ledger.held("s"), ledger.held("c")), (0, 500));
        assert_eq!(ledger.lease(&first).map(|l| l.reported), Some(1_700));
    }

    #[test]
    fn a_batch_folds_once() {
        let mut ledger = Ledger::default();
        let b = batch(vec![grant("ad-1", &["c"], 1_000, 30_000)]);
        ledger.fold(4, &b);
        ledger.fold(4, &b);
        ledger.fold(3, &b);
        assert_eq!(ledger.held("c"), 1_000);
        assert_eq!(ledger.folded_seq(), 4);
        ledger.fold(5, &b);
        assert_eq!(ledger.held("c"), 2_000, "a later batch is another grant");
    }

    #[test]
    fn a_report_before_its_grant_waits_for_it() {
        let mut ledger = Ledger::default();
        let g = grant("ad-1", &["c"], 1_000, 30_000);
        ledger.report(Batch::lease_id(7, 0, &g), 250, 0);
        ledger.settle(i64::MAX);
        ledger.fold(7, &batch(vec![g]));
        assert_eq!(ledger.held("c"), 750);
    }

    #[test]
    fn retired_after_expiry_plus_grace_once_caught_up() {
        let mut ledger = Ledger::default();
        ledger.fold(
            1,
            &batch(vec![
                grant("ad-1", &["c"], 1_000, 10_000),
                grant("ad-2", &["c"], 2_000, 20_000),
            ]),
        );
        let first = Batch::lease_id(1, 0, &grant("", &[], 0, 10_000));
        ledger.report(first, 100, 0);
        ledger.settle(i64::MAX);
        assert_eq!(ledger.retire(69_999, 60_000), Retired::default());
        assert_eq!(
            ledger.held_by("c"),
            Held {
                micros: 2_900,
                leases: 2
            }
        );
        assert_eq!(
            ledger.retire(70_000, 60_000),
            Retired {
                leases: 1,
                unused_micros: 900
            }
        );
        assert_eq!(ledger.held("c"), 2_000);
        assert_eq!(ledger.retire(i64::MAX, 60_000).leases, 1);
        assert_eq!(ledger.held_by("c"), Held::default());
        assert_eq!(ledger.live(), 0);
        // A report of a retired lease holds nothing and is not kept.
        ledger.report(first, 500, 0);
        ledger.settle(i64::MAX);
        assert_eq!(ledger.held("c"), 0);
        assert!(ledger.early.is_empty());
    }

    #[test]
    fn a_report_frees_nothing_until_every_shard_has_caught_up_with_it() {
        let mut ledger = Ledger::default();
        let g = grant("ad-1", &["c"], 1_000, 60_000);
        ledger.fold(1, &batch(vec![g.clone()]));
        let id = Batch::lease_id(1, 0, &g);
        // Reported by a push complete as of 10 s: the limit's own spend may
        // still be on its way from another shard.
        ledger.report(id, 600, 10_000);
        ledger.settle(10_000 + REPORT_MARGIN_MS - 1);
        assert_eq!(ledger.held("c"), 1_000);
        ledger.settle(10_000 + REPORT_MARGIN_MS);
        assert_eq!(ledger.held("c"), 400);
    }

    #[test]
    fn early_reports_are_forgotten_once_they_cannot_matter() {
        let mut ledger = Ledger::default();
        let g = grant("ad-1", &["c"], 1_000, 10_000);
        ledger.report(Batch::lease_id(9, 0, &g), 5, 0);
        ledger.settle(i64::MAX);
        assert_eq!(ledger.early.len(), 1);
        ledger.retire(70_000, 60_000);
        assert!(ledger.early.is_empty());
    }
}
