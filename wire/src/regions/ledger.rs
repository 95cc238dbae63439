//! [`LimitLedger`]: one limit's allotment at one region, for one period:
//! this region's own `given` counters and the last it heard of every other
//! region. Pure arithmetic; the pacer owns the clock, the network and the
//! persistence around it.
//!
//! Overflow: every sum of counters is taken in `i128` (at most
//! [`MAX_REGIONS`] terms of `u64`, so it cannot overflow) and clamped into
//! `u64` at the end; spend plus leased and the spend sums saturate; a
//! `given` counter that would pass `u64::MAX` takes only what fits. None of
//! these bounds is reached by a deployment whose reports are its own; they
//! keep a corrupt one from panicking or wrapping.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

use super::name::{RegionError, RegionName};
use super::report::{LimitEntry, RegionReport, MAX_REGIONS};
use crate::types::Micros;

/// `budget` split evenly over `regions` (sorted by name), the remainder
/// (`budget mod n`) going one micro each to the first regions in that
/// order, so that the shares add up to `budget` exactly. 0 for a region not
/// in the set.
pub fn initial_share(
    budget: Micros,
    regions: &BTreeSet<RegionName>,
    region: &RegionName,
) -> Micros {
    let Some(index) = regions.iter().position(|r| r == region) else {
        return 0;
    };
    // `regions` is not empty here, and its length fits a u64.
    let n = regions.len() as u64;
    let extra = u64::from((index as u64) < budget % n);
    budget / n + extra
}

/// Who sent the entry being merged: the header of its [`RegionReport`].
#[derive(Clone, Copy, Debug)]
pub struct Origin<'a> {
    pub region: &'a RegionName,
    pub seq: u64,
    pub as_of_ms: i64,
}

impl RegionReport {
    pub fn origin(&self) -> Origin<'_> {
        Origin {
            region: &self.region,
            seq: self.seq,
            as_of_ms: self.as_of_ms,
        }
    }
}

/// What [`LimitLedger::merge`] did with an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Merged {
    /// Same period; some figure moved.
    Changed,
    /// Same period; nothing in it was news (a duplicate or an older report).
    Unchanged,
    /// From a newer period: the ledger moved to that period, then took it.
    NewPeriod,
    /// From an older period: ignored.
    OlderPeriod,
    /// From a region outside the deployment's set: ignored, because its
    /// gifts were never part of the budget's split.
    UnknownRegion,
    /// For another limit: ignored.
    OtherLimit,
}

/// The last this region heard of another one in the current period: the
/// maximum of each grow-only counter over every report merged, and the
/// gauges of the report with the highest `seq`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Heard {
    /// `seq` of the report the gauges come from.
    pub seq: u64,
    pub as_of_ms: i64,
    pub spend_micros: Micros,
    pub lifetime_spend_micros: Micros,
    pub leased_micros: Micros,
    pub want_micros: Micros,
    /// Never holds a zero, so that "absent" and "0" compare equal.
    pub given: BTreeMap<RegionName, Micros>,
    pub received: BTreeMap<RegionName, Micros>,
}

/// One limit's budget as split among regions, as one region keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitLedger {
    limit_id: String,
    region: RegionName,
    /// Every region of the deployment, this one included.
    regions: BTreeSet<RegionName>,
    budget: Micros,
    period_start_ms: i64,
    /// Micros this region has handed to each other one in the period; never
    /// holds a zero.
    given: BTreeMap<RegionName, Micros>,
    heard: BTreeMap<RegionName, Heard>,
}

impl LimitLedger {
    /// A ledger for `limit_id` at `region`, whose deployment is `regions`
    /// (`region` is added to them if missing; the same set at every
    /// region, or the initial shares do not add up).
    pub fn new(
        limit_id: impl Into<String>,
        region: RegionName,
        regions: impl IntoIterator<Item = RegionName>,
        budget: Micros,
        period_start_ms: i64,
    ) -> Result<LimitLedger, RegionError> {
        let mut regions: BTreeSet<RegionName> = regions.into_iter().collect();
        regions.insert(region.clone());
        if regions.len() > MAX_REGIONS {
            return Err(RegionError::TooMany {
                count: regions.len(),
                max: MAX_REGIONS,
            });
        }
        Ok(LimitLedger {
            limit_id: limit_id.into(),
            region,
            regions,
            budget,
            period_start_ms,
            given: BTreeMap::new(),
            heard: BTreeMap::new(),
        })
    }

    pub fn limit_id(&self) -> &str {
        &self.limit_id
    }

    pub fn region(&self) -> &RegionName {
        &self.region
    }

    pub fn budget(&self) -> Micros {
        self.budget
    }

    pub fn period_start_ms(&self) -> i64 {
        self.period_start_ms
    }

    /// The last heard of `region` in this period, if anything.
    pub fn heard(&self, region: &RegionName) -> Option<&Heard> {
        self.heard.get(region)
    }

    /// What this region has given `to` in this period.
    pub fn given_to(&self, to: &RegionName) -> Micros {
        self.given.get(to).copied().unwrap_or(0)
    }

    /// What this region has credited from `from`'s gifts in this period.
    pub fn received_from(&self, from: &RegionName) -> Micros {
        self.heard
            .get(from)
            .and_then(|h| h.given.get(&self.region))
            .copied()
            .unwrap_or(0)
    }

    /// A catalog edit: the initial shares follow the new budget at once. A
    /// smaller budget may leave the allotment below what is already spent
    /// or leased; [`room`](Self::room) is then 0 until it is back above.
    pub fn set_budget(&mut self, budget: Micros) {
        self.budget = budget;
    }

    /// Moves to a later period (this region's pacer crossed into it, or
    /// another region's report said so): everything counted restarts at 0.
    /// An earlier or equal start changes nothing. Returns whether it moved.
    pub fn roll_to(&mut self, period_start_ms: i64) -> bool {
        if period_start_ms <= self.period_start_ms {
            return false;
        }
        self.period_start_ms = period_start_ms;
        self.given.clear();
        self.heard.clear();
        true
    }

    /// This region's initial share of the budget.
    pub fn initial_share(&self) -> Micros {
        initial_share(self.budget, &self.regions, &self.region)
    }

    /// This region's allotment, exact: its initial share, plus what it
    /// heard others give it, minus what it gave. Negative only after the
    /// budget was lowered below what was given away.
    pub fn allotment_exact(&self) -> i128 {
        let credited: i128 = self
            .heard
            .values()
            .filter_map(|h| h.given.get(&self.region))
            .map(|&m| i128::from(m))
            .sum();
        let debited: i128 = self.given.values().map(|&m| i128::from(m)).sum();
        i128::from(self.initial_share()) + credited - debited
    }

    /// This region's allotment: what its pacers' grants may use in total
    /// ([`allotment_exact`](Self::allotment_exact) clamped into `u64`).
    pub fn allotment(&self) -> Micros {
        clamp_micros(self.allotment_exact())
    }

    /// `region`'s allotment as it computed it at its last report heard
    /// here: its initial share plus what it said it received, minus what it
    /// said it gave. This region's own for itself; 0 for one never heard.
    pub fn allotment_of(&self, region: &RegionName) -> Micros {
        if region == &self.region {
            return self.allotment();
        }
        let Some(h) = self.heard.get(region) else {
            return 0;
        };
        let received: i128 = h.received.values().map(|&m| i128::from(m)).sum();
        let given: i128 = h.given.values().map(|&m| i128::from(m)).sum();
        clamp_micros(
            i128::from(initial_share(self.budget, &self.regions, region)) + received - given,
        )
    }

    /// What this region may still grant: its allotment less its own spend
    /// and leases in flight, never below 0.
    pub fn room(&self, spend: Micros, leased: Micros) -> Micros {
        self.allotment()
            .saturating_sub(spend.saturating_add(leased))
    }

    /// The limit's spend in the period across regions: `own_spend` plus the
    /// last heard of every other region (saturating).
    pub fn global_spend(&self, own_spend: Micros) -> Micros {
        self.heard
            .values()
            .fold(own_spend, |sum, h| sum.saturating_add(h.spend_micros))
    }

    /// The limit's lifetime spend across regions, as [`global_spend`](Self::global_spend).
    pub fn global_lifetime_spend(&self, own_lifetime_spend: Micros) -> Micros {
        self.heard.values().fold(own_lifetime_spend, |sum, h| {
            sum.saturating_add(h.lifetime_spend_micros)
        })
    }

    /// Hands up to `amount` of this region's room to `to` by raising
    /// `given[to]`: never more than the room, so the allotment stays at or
    /// above `spend + leased`. Returns what was given: 0 to itself or to a
    /// region outside the set. The caller publishes the new counter only
    /// after keeping it (the debit must outlive a restart).
    pub fn give(
        &mut self,
        to: &RegionName,
        amount: Micros,
        spend: Micros,
        leased: Micros,
    ) -> Micros {
        if to == &self.region || !self.regions.contains(to) {
            return 0;
        }
        let already = self.given_to(to);
        let gift = amount
            .min(self.room(spend, leased))
            .min(Micros::MAX - already);
        if gift > 0 {
            self.given.insert(to.clone(), already + gift);
        }
        gift
    }

    /// What `to` has not yet said it credited of this region's gifts.
    pub fn in_transit_to(&self, to: &RegionName) -> Micros {
        let acknowledged = self
            .heard
            .get(to)
            .and_then(|h| h.received.get(&self.region))
            .copied()
            .unwrap_or(0);
        self.given_to(to).saturating_sub(acknowledged)
    }

    /// Which regions to give how much, to be applied with
    /// [`give`](Self::give); sorted by region, no zeros. Deterministic.
    ///
    /// Policy: this region keeps the larger of a reserve
    /// (`reserve_permille` ‰ of its allotment, rounded up; values above
    /// 1000 count as 1000) and its own unmet demand `own_want`, and may
    /// give the rest of its room. A region's need is its last heard
    /// `want_micros` less what this region gave it that it had not yet
    /// credited when it reported (so a want is not answered twice). When
    /// the spare covers every need, each gets its need; otherwise the spare
    /// is split in proportion to the needs (floored), and the micros the
    /// flooring leaves go one each to the greatest needs (ties by name).
    pub fn plan_gifts(
        &self,
        spend: Micros,
        leased: Micros,
        own_want: Micros,
        reserve_permille: u16,
    ) -> Vec<(RegionName, Micros)> {
        let permille = u128::from(reserve_permille.min(1000));
        let reserve = (u128::from(self.allotment()) * permille).div_ceil(1000);
        // At most the allotment, which is a u64.
        let keep = Micros::try_from(reserve)
            .unwrap_or(Micros::MAX)
            .max(own_want);
        let spare = self.room(spend, leased).saturating_sub(keep);
        if spare == 0 {
            return Vec::new();
        }
        let needs: Vec<(&RegionName, Micros)> = self
            .heard
            .iter()
            .filter(|(r, _)| *r != &self.region && self.regions.contains(*r))
            .map(|(r, h)| (r, h.want_micros.saturating_sub(self.in_transit_to(r))))
            .filter(|&(_, need)| need > 0)
            .collect();
        let total: u128 = needs.iter().map(|&(_, n)| u128::from(n)).sum();
        if total <= u128::from(spare) {
            return needs.into_iter().map(|(r, n)| (r.clone(), n)).collect();
        }
        // spare < total, so each share is below its need and below spare.
        let mut shares: Vec<(&RegionName, Micros, Micros)> = needs
            .iter()
            .map(|&(r, need)| {
                let share = u128::from(spare) * u128::from(need) / total;
                (r, need, Micros::try_from(share).unwrap_or(0))
            })
            .collect();
        let handed: Micros = shares.iter().map(|s| s.2).sum();
        // Fewer micros than recipients are left: one each, greatest need first.
        let mut leftover = spare - handed;
        let mut order: Vec<usize> = (0..shares.len()).collect();
        order.sort_by(|&a, &b| {
            shares[b]
                .1
                .cmp(&shares[a].1)
                .then(shares[a].0.cmp(shares[b].0))
        });
        for i in order {
            if leftover == 0 {
                break;
            }
            shares[i].2 += 1;
            leftover -= 1;
        }
        shares
            .into_iter()
            .filter(|s| s.2 > 0)
            .map(|(r, _, share)| (r.clone(), share))
            .collect()
    }

    /// Folds in `entry` of a report from `from`. Within the period each
    /// grow-only figure takes the maximum and the gauges follow the highest
    /// `seq`, so a duplicate or an older report changes nothing; an older
    /// period is ignored and a newer one moves the ledger to it
    /// ([`roll_to`](Self::roll_to)) first.
    ///
    /// An entry from this very region (its own last report, read back after
    /// a restart) restores its `given` counters, never lowering them.
    pub fn merge(&mut self, from: Origin<'_>, entry: &LimitEntry) -> Merged {
        if entry.limit_id != self.limit_id {
            return Merged::OtherLimit;
        }
        if !self.regions.contains(from.region) {
            return Merged::UnknownRegion;
        }
        let rolled = match entry.period_start_ms.cmp(&self.period_start_ms) {
            Ordering::Less => return Merged::OlderPeriod,
            Ordering::Equal => false,
            Ordering::Greater => self.roll_to(entry.period_start_ms),
        };
        let changed = if from.region == &self.region {
            let known = |r: &RegionName| r != &self.region && self.regions.contains(r);
            max_into(&mut self.given, &entry.given, known)
        } else {
            let regions = &self.regions;
            let heard = self.heard.entry(from.region.clone()).or_default();
            merge_heard(heard, from, entry, |r| {
                r != from.region && regions.contains(r)
            })
        };
        match (rolled, changed) {
            (true, _) => Merged::NewPeriod,
            (false, true) => Merged::Changed,
            (false, false) => Merged::Unchanged,
        }
    }

    /// This region's entry for its next report.
    pub fn entry(
        &self,
        spend: Micros,
        lifetime_spend: Micros,
        leased: Micros,
        want: Micros,
    ) -> LimitEntry {
        LimitEntry {
            limit_id: self.limit_id.clone(),
            period_start_ms: self.period_start_ms,
            spend_micros: spend,
            lifetime_spend_micros: lifetime_spend,
            leased_micros: leased,
            want_micros: want,
            given: self.given.clone(),
            received: self
                .heard
                .iter()
                .filter_map(|(r, h)| Some((r.clone(), *h.given.get(&self.region)?)))
                .collect(),
        }
    }
}

/// Raises `into[k]` to `from[k]` for every key `keep` accepts; returns
/// whether anything rose. Zeros are never stored.
fn max_into(
    into: &mut BTreeMap<RegionName, Micros>,
    from: &BTreeMap<RegionName, Micros>,
    keep: impl Fn(&RegionName) -> bool,
) -> bool {
    let mut rose = false;
    for (region, &micros) in from.iter().filter(|(r, _)| keep(r)) {
        if micros > into.get(region).copied().unwrap_or(0) {
            into.insert(region.clone(), micros);
            rose = true;
        }
    }
    rose
}

fn merge_heard(
    heard: &mut Heard,
    from: Origin<'_>,
    entry: &LimitEntry,
    keep: impl Fn(&RegionName) -> bool + Copy,
) -> bool {
    let before = heard.clone();
    heard.spend_micros = heard.spend_micros.max(entry.spend_micros);
    heard.lifetime_spend_micros = heard.lifetime_spend_micros.max(entry.lifetime_spend_micros);
    max_into(&mut heard.given, &entry.given, keep);
    max_into(&mut heard.received, &entry.received, keep);
    // Nothing heard yet takes the gauges whatever the seq (0 included); a
    // repeat of the same seq carries the same gauges.
    if from.seq > heard.seq || before == Heard::default() {
        heard.seq = from.seq;
        heard.as_of_ms = from.as_of_ms;
        heard.leased_micros = entry.leased_micros;
        heard.want_micros = entry.want_micros;
    }
    *heard != before
}

fn clamp_micros(exact: i128) -> Micros {
    Micros::try_from(exact.max(0)).unwrap_or(Micros::MAX)
}

#[cfg(test)]
mod tests;
