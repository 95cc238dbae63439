//! Spend leases in the closed loop (CONTRACT.md "Spend leases"): the lease
//! mode's policy, the JSON of `POST /v1/leases`, and one ad server's book
//! of its leases.
//!
//! The book holds at most two leases per ad: the newest and the one it
//! replaced, which is spent first while it lasts (what a renewal leaves of
//! it would otherwise stay held at the pacer, unspent, until it expired).
//! Each tick the server notes the requests that arrived
//! ([`LeaseBook::note_requests`]), asks for the leases the book wants
//! ([`LeaseBook::asks`]) in one call, records the answers
//! ([`LeaseBook::grant`]), and serves a request only when
//! [`LeaseBook::spend`] takes its cost out of a lease that still has it and
//! is not within the margin of its expiry. A lease the book lets go with
//! something left (its usable end passed, or a newer pair replaced it) is
//! released (`POST /v1/leases/release`, [`LeaseBook::take_releases`]),
//! saying what was served under it, so the pacers free the rest at once.
//! Every call takes the server's clock (unix ms), so the rules are tested
//! without a pacer or a timer.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::CostDistribution;

/// The `ttl_ms` the contract accepts.
pub(crate) const TTL_MS: std::ops::RangeInclusive<u64> = 1_000..=600_000;

/// How a simulated ad server decides what it may serve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ServeMode {
    /// `POST /v1/decisions` for the requested ads; serve a servable ad with
    /// probability equal to its multiplier.
    Decisions,
    /// Lease spend ahead (`POST /v1/leases`) and serve only within a lease.
    Leases(LeasePolicy),
}

impl ServeMode {
    /// `decisions` or `leases` as the command lines spell them; `leases
    /// unreleased` for leases never released.
    pub fn name(&self) -> &'static str {
        match self {
            ServeMode::Decisions => "decisions",
            ServeMode::Leases(p) if !p.release => "leases unreleased",
            ServeMode::Leases(_) => "leases",
        }
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        match self {
            ServeMode::Decisions => Ok(()),
            ServeMode::Leases(policy) => policy.validate(),
        }
    }
}

/// How a server in lease mode leases.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeasePolicy {
    /// Asked of the pacer as `ttl_ms`: whole milliseconds within
    /// [`TTL_MS`].
    pub ttl: Duration,
    /// A lease serves nothing once the server's clock is within this much
    /// of its `expires_at_ms`: room for the server's clock being behind the
    /// pacer's, so no impression is stamped after the expiry the pacer
    /// counts with.
    pub margin: Duration,
    /// Each ask covers the ad's expected spend over this share of a lease's
    /// usable life (ttl less the margin), and at least one impression at
    /// the highest cost.
    pub ask_share: f64,
    /// Release each lease let go with something left, saying what was
    /// served under it; without, what is left stays held at the pacers
    /// until expiry plus their grace.
    pub release: bool,
}

impl Default for LeasePolicy {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(30),
            margin: Duration::from_secs(1),
            ask_share: 0.5,
            release: true,
        }
    }
}

impl LeasePolicy {
    pub fn validate(&self) -> anyhow::Result<()> {
        let ttl_ms = self.ttl_ms();
        anyhow::ensure!(
            TTL_MS.contains(&ttl_ms) && self.ttl.subsec_nanos().is_multiple_of(1_000_000),
            "lease ttl {:?} must be whole milliseconds within {}..={} ms",
            self.ttl,
            TTL_MS.start(),
            TTL_MS.end()
        );
        anyhow::ensure!(
            self.margin * 2 <= self.ttl,
            "lease margin {:?} must be at most half the lease ttl {:?}",
            self.margin,
            self.ttl
        );
        anyhow::ensure!(
            self.ask_share > 0.0 && self.ask_share <= 1.0,
            "lease ask share {} must be within (0, 1]",
            self.ask_share
        );
        Ok(())
    }

    pub fn ttl_ms(&self) -> u64 {
        u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX)
    }

    fn margin_ms(&self) -> i64 {
        i64::try_from(self.margin.as_millis()).unwrap_or(i64::MAX)
    }

    /// Seconds of spend one ask covers.
    fn ask_secs(&self) -> f64 {
        (self.ttl.saturating_sub(self.margin)).as_secs_f64() * self.ask_share
    }
}

/// The body of `POST /v1/leases`.
#[derive(Debug, Serialize)]
pub(crate) struct LeaseRequest<'a> {
    pub(crate) ads: Vec<LeaseAsk<'a>>,
    pub(crate) ttl_ms: u64,
}

#[derive(Debug, Serialize)]
pub(crate) struct LeaseAsk<'a> {
    pub(crate) ad_id: &'a str,
    pub(crate) micros: u64,
}

/// The answer of `POST /v1/leases`: one grant per ad asked, in order.
#[derive(Debug, Deserialize)]
pub(crate) struct LeaseResponse {
    pub(crate) leases: Vec<LeaseGrant>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct LeaseGrant {
    pub(crate) ad_id: String,
    /// Absent when nothing was granted.
    #[serde(default)]
    pub(crate) lease_id: Option<String>,
    pub(crate) granted_micros: u64,
    pub(crate) expires_at_ms: i64,
}

/// The body of `POST /v1/leases/release`.
#[derive(Debug, Serialize)]
pub(crate) struct ReleaseRequest<'a> {
    pub(crate) leases: &'a [LeaseRelease],
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct LeaseRelease {
    pub(crate) lease_id: String,
    pub(crate) served_micros: u64,
}

/// The answer of `POST /v1/leases/release`, one per lease, in order.
#[derive(Debug, Deserialize)]
pub(crate) struct ReleaseResponse {
    pub(crate) leases: Vec<ReleaseAnswer>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct ReleaseAnswer {
    pub(crate) released: bool,
}

/// What a grant did to the book.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Granted {
    /// A new lease replaced whatever the ad held.
    Lease(u64),
    /// Nothing left (or not servable): the ad keeps what it held and is not
    /// asked for again until its back-off has passed.
    Zero,
}

/// Requests per second are weighted exponentially over this window.
const RATE_WINDOW_SECS: f64 = 2.0;
/// After a zero grant an ad is not asked for again for this long, doubled
/// on each zero in a row up to [`ZERO_BACKOFF_MAX_MS`].
const ZERO_BACKOFF_MS: i64 = 500;
const ZERO_BACKOFF_MAX_MS: i64 = 8_000;

/// A live lease: what is left of its grant, and its expiry by the pacer.
#[derive(Debug, Clone)]
struct Lease {
    id: Arc<str>,
    /// The lease id as a JSON string literal, quotes included, ready for
    /// the impression.
    id_json: Arc<str>,
    granted: u64,
    remaining: u64,
    expires_at_ms: i64,
}

impl Lease {
    /// The release of this lease, let go with `remaining` unspent.
    fn release(&self) -> LeaseRelease {
        LeaseRelease {
            lease_id: self.id.to_string(),
            served_micros: self.granted - self.remaining,
        }
    }
}

#[derive(Debug, Clone, Default)]
struct AdLeases {
    /// The newest lease.
    lease: Option<Lease>,
    /// The lease the newest replaced, while it has something left: spent
    /// before the newest.
    older: Option<Lease>,
    /// Requests per second, exponentially weighted, as of `rate_at_ms`.
    rate: f64,
    rate_at_ms: i64,
    /// No ask before this instant (after zero grants).
    retry_at_ms: i64,
    zeros_in_a_row: u32,
}

impl AdLeases {
    fn rate_at(&self, now_ms: i64) -> f64 {
        let secs = (now_ms - self.rate_at_ms).max(0) as f64 / 1000.0;
        self.rate * (-secs / RATE_WINDOW_SECS).exp()
    }
}

/// One server's leases, one per ad at most, and what it has seen of its
/// requests and costs.
#[derive(Debug)]
pub(crate) struct LeaseBook {
    policy: LeasePolicy,
    /// A lease is renewed this long before its usable end, and when less
    /// is left than the ad is expected to spend in this long.
    lead_ms: i64,
    max_cost: u64,
    cost_sum: f64,
    costs: u64,
    ads: Vec<AdLeases>,
    /// Leases let go with something left, not yet released.
    releases: Vec<LeaseRelease>,
}

impl LeaseBook {
    /// A book for `ads` ads; `lead` is how long a new lease may take to
    /// arrive (a couple of the server's ticks).
    pub(crate) fn new(
        policy: LeasePolicy,
        cost: &CostDistribution,
        ads: usize,
        lead: Duration,
    ) -> Self {
        let max_cost = match *cost {
            CostDistribution::Uniform { max, .. } | CostDistribution::LogUniform { max, .. } => max,
        };
        Self {
            policy,
            lead_ms: i64::try_from(lead.as_millis()).unwrap_or(i64::MAX),
            max_cost: max_cost.max(1),
            cost_sum: 0.0,
            costs: 0,
            ads: vec![AdLeases::default(); ads],
            releases: Vec::new(),
        }
    }

    /// A lease let go: released if something is left of it and the policy
    /// releases.
    fn let_go(releases: &mut Vec<LeaseRelease>, policy: &LeasePolicy, lease: Option<Lease>) {
        if let Some(lease) = lease.filter(|l| policy.release && l.remaining > 0) {
            releases.push(lease.release());
        }
    }

    /// Lets go every lease whose usable end has passed at `now_ms`, and
    /// returns the releases of every lease let go with something left
    /// since the last call (none when the policy does not release).
    pub(crate) fn take_releases(&mut self, now_ms: i64) -> Vec<LeaseRelease> {
        let margin = self.policy.margin_ms();
        for a in &mut self.ads {
            for slot in [&mut a.older, &mut a.lease] {
                if slot
                    .as_ref()
                    .is_some_and(|l| now_ms >= l.expires_at_ms.saturating_sub(margin))
                {
                    Self::let_go(&mut self.releases, &self.policy, slot.take());
                }
            }
        }
        std::mem::take(&mut self.releases)
    }

    /// `n` requests for `ad` arrived by `now_ms`.
    pub(crate) fn note_requests(&mut self, ad: u32, n: u64, now_ms: i64) {
        let a = &mut self.ads[ad as usize];
        a.rate = a.rate_at(now_ms) + n as f64 / RATE_WINDOW_SECS;
        a.rate_at_ms = now_ms;
    }

    /// The cost of a request (served or not), for the mean cost.
    pub(crate) fn note_cost(&mut self, cost: u64) {
        self.cost_sum += cost as f64;
        self.costs += 1;
    }

    /// The mean cost seen; the highest cost before any is seen.
    fn mean_cost(&self) -> f64 {
        if self.costs == 0 {
            self.max_cost as f64
        } else {
            self.cost_sum / self.costs as f64
        }
    }

    /// Micros per second `ad` is expected to spend.
    fn expected_rate(&self, ad: usize, now_ms: i64) -> f64 {
        self.ads[ad].rate_at(now_ms) * self.mean_cost()
    }

    /// The micros to ask for `ad` now, if it needs a new lease: it holds
    /// none, or its lease nears its usable end or runs low. An ad with no
    /// request this tick is leased ahead only if it expects a request
    /// within what one ask covers; otherwise it waits for its next request.
    pub(crate) fn ask(&self, ad: u32, requested_now: bool, now_ms: i64) -> Option<u64> {
        let a = &self.ads[ad as usize];
        if now_ms < a.retry_at_ms {
            return None;
        }
        let ask_secs = self.policy.ask_secs();
        if !requested_now && a.rate_at(now_ms) * ask_secs < 1.0 {
            return None;
        }
        let rate = self.expected_rate(ad as usize, now_ms);
        let needs = match &a.lease {
            None => true,
            Some(l) => {
                let low_water = (self.max_cost as f64).max(rate * self.lead_ms as f64 / 1000.0);
                let left = l.remaining + self.usable_older(a, now_ms);
                now_ms + self.lead_ms >= self.usable_until(l) || (left as f64) < low_water
            }
        };
        needs.then(|| (rate * ask_secs).max(self.max_cost as f64).ceil() as u64)
    }

    /// Every ad that needs a lease now, with the micros to ask, at most
    /// `max` of them: those with a request waiting and no lease first, then
    /// by expected spend, highest first. `requested` is sorted and unique.
    pub(crate) fn asks(&self, requested: &[u32], max: usize, now_ms: i64) -> Vec<(u32, u64)> {
        let mut wanted: Vec<(u32, u64)> = (0..self.ads.len() as u32)
            .filter_map(|ad| {
                let now = requested.binary_search(&ad).is_ok();
                self.ask(ad, now, now_ms).map(|micros| (ad, micros))
            })
            .collect();
        let waiting = |ad: u32| {
            requested.binary_search(&ad).is_ok()
                && !self.ads[ad as usize]
                    .lease
                    .as_ref()
                    .is_some_and(|l| now_ms < self.usable_until(l) && l.remaining > 0)
        };
        wanted.sort_by(|&(a, am), &(b, bm)| {
            waiting(b)
                .cmp(&waiting(a))
                .then(bm.cmp(&am))
                .then(a.cmp(&b))
        });
        wanted.truncate(max);
        wanted.sort_unstable();
        wanted
    }

    /// Records the pacer's answer to an ask of `asked` micros for `ad`.
    /// A grant above the ask, or without a lease id, is the pacer breaking
    /// the contract: an error, and the book is left as it was.
    pub(crate) fn grant(
        &mut self,
        ad: u32,
        asked: u64,
        grant: &LeaseGrant,
        now_ms: i64,
    ) -> Result<Granted, String> {
        if grant.granted_micros > asked {
            return Err(format!(
                "{}: granted {} micros, more than the {asked} asked",
                grant.ad_id, grant.granted_micros
            ));
        }
        let a = &mut self.ads[ad as usize];
        if grant.granted_micros == 0 {
            a.zeros_in_a_row = a.zeros_in_a_row.saturating_add(1);
            let backoff = ZERO_BACKOFF_MS << (a.zeros_in_a_row - 1).min(8);
            a.retry_at_ms = now_ms + backoff.min(ZERO_BACKOFF_MAX_MS);
            return Ok(Granted::Zero);
        }
        let Some(id) = &grant.lease_id else {
            return Err(format!(
                "{}: granted {} micros without a lease_id",
                grant.ad_id, grant.granted_micros
            ));
        };
        a.zeros_in_a_row = 0;
        a.retry_at_ms = 0;
        let replaced = a.lease.replace(Lease {
            id: id.as_str().into(),
            id_json: serde_json::to_string(id).expect("a string").into(),
            granted: grant.granted_micros,
            remaining: grant.granted_micros,
            expires_at_ms: grant.expires_at_ms,
        });
        // The replaced lease is kept (and one kept before it let go) while
        // it has something left; spend() lets it go at its usable end.
        let dropped = std::mem::replace(&mut a.older, replaced.filter(|l| l.remaining > 0));
        Self::let_go(&mut self.releases, &self.policy, dropped);
        Ok(Granted::Lease(grant.granted_micros))
    }

    /// Takes `cost` out of `ad`'s lease and returns the lease id (a JSON
    /// string literal) to put on the impression; `None` (nothing taken)
    /// when the ad holds no lease, the lease is within the margin of its
    /// expiry at `now_ms`, or what is left of it cannot pay `cost`.
    /// The older lease pays first when it can.
    pub(crate) fn spend(&mut self, ad: u32, cost: u64, now_ms: i64) -> Option<Arc<str>> {
        let margin = self.policy.margin_ms();
        let a = &mut self.ads[ad as usize];
        for slot in [&mut a.older, &mut a.lease] {
            let Some(lease) = slot.as_mut() else { continue };
            if now_ms >= lease.expires_at_ms.saturating_sub(margin) {
                Self::let_go(&mut self.releases, &self.policy, slot.take());
                continue;
            }
            if lease.remaining < cost {
                continue;
            }
            lease.remaining -= cost;
            return Some(lease.id_json.clone());
        }
        None
    }

    fn usable_until(&self, lease: &Lease) -> i64 {
        lease.expires_at_ms.saturating_sub(self.policy.margin_ms())
    }

    /// What is left of `a`'s older lease while it is usable at `now_ms`.
    fn usable_older(&self, a: &AdLeases, now_ms: i64) -> u64 {
        a.older
            .as_ref()
            .filter(|l| now_ms < self.usable_until(l))
            .map_or(0, |l| l.remaining)
    }
}

#[cfg(test)]
mod tests;
