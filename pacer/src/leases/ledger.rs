//! The leases every pacer has granted, as this pacer has folded them from
//! the shared ledger stream, and what each still holds of its limits'
//! budgets.
//!
//! A lease holds `granted - covered` of every limit above its ad, where
//! `covered` is the spend reported under the lease so far (never more than
//! `granted`). Once its ad server has released it, saying what it served
//! under it, it holds only `served - covered`: the rest will never be
//! spent. It holds that until it has expired and the pipeline has caught
//! up past its expiry plus the grace; then it is retired and holds
//! nothing. [`Ledger::held`] is that sum per limit: the spend in flight the
//! grants must leave room for.
//!
//! Pure bookkeeping: folding grants and releases in stream order
//! ([`Ledger::fold`]),
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

/// An ad server is done with a lease and says how much it served under
/// it: the lease holds no more than that from then on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Release {
    /// The lease id as handed out.
    pub(crate) lease_id: String,
    pub(crate) served_micros: u64,
}

/// One message of the ledger stream: the grants and releases of one
/// commit.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Batch {
    /// The pacer that granted them (its instance name, for operators).
    pub(crate) pacer: String,
    pub(crate) at_ms: i64,
    pub(crate) grants: Vec<Grant>,
    /// Absent in commits written before releases existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) releases: Vec<Release>,
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
    /// What its ad server said it served under it when it released it
    /// (the first release counts; later ones change nothing).
    pub(crate) served: Option<u64>,
}

impl Lease {
    /// What the lease holds of each of its limits: what may still be
    /// spent, or was spent and not yet reported, under it.
    pub(crate) fn holds(&self) -> u64 {
        self.granted
            .min(self.served.unwrap_or(u64::MAX))
            .saturating_sub(self.covered)
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

/// What releases have freed, all pacers' together, since this pacer
/// started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Released {
    pub(crate) leases: u64,
    /// Granted, not served, and freed by the release (before expiry plus
    /// the grace).
    pub(crate) micros: u64,
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
    released: Released,
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

    pub(crate) fn released(&self) -> Released {
        self.released
    }

    /// Lease `id` went from holding `before` to holding `after` of each of
    /// its limits.
    fn rehold(&mut self, id: &LeaseId, before: u64, after: u64) {
        let Some(lease) = self.leases.get(id) else {
            return;
        };
        for limit in &lease.limits {
            if let Some(held) = self.held.get_mut(limit) {
                held.micros = (held.micros + after).saturating_sub(before);
            }
        }
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
    /// (0 micros) hold nothing and are not kept. A release of a lease that
    /// is not live (retired, or never granted) changes nothing.
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
                served: None,
            };
            for limit in &lease.limits {
                let held = self.held.entry(limit.clone()).or_default();
                held.micros += lease.holds();
                held.leases += 1;
            }
            self.leases.insert(id, lease);
        }
        for release in &batch.releases {
            self.release(release);
        }
    }

    fn release(&mut self, release: &Release) {
        let Some(id) = LeaseId::parse(&release.lease_id) else {
            return;
        };
        let Some(lease) = self.leases.get_mut(&id) else {
            return;
        };
        if lease.served.is_some() {
            return;
        }
        let before = lease.holds();
        lease.served = Some(release.served_micros);
        let after = lease.holds();
        self.released.leases += 1;
        self.released.micros += before - after;
        self.rehold(&id, before, after);
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
        let before = lease.holds();
        lease.reported = reported;
        lease.covered = lease.covered.max(reported.min(lease.granted));
        let after = lease.holds();
        self.rehold(&id, before, after);
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
mod tests;
