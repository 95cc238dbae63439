//! The closed loop's lease mode, on the client crate (`adspend-client`):
//! [`ServeMode`], [`LeaseMode`] (the crate's [`LeasePolicy`] and whether
//! leases are released), and [`ServerLeases`], one server's adapter around
//! the crate's [`LeaseBook`].
//!
//! The book's rules are the crate's (docs/LEASES.md): at most two leases
//! per ad, the replaced one spent first while it lasts, nothing served
//! within the margin of an expiry, and a lease let go with something left
//! released with what was served under it. The adapter adds what is the
//! simulator's own: each tick it notes the requests that arrived and tells
//! the book the expected spend of each requested ad ([`LeaseBook::want`]:
//! its request rate times the mean cost seen, at least the highest cost of
//! the loop's distribution), so an ad is leased in the tick of its first
//! request; it leases an ad without a request this tick ahead only when it
//! expects a request within what one ask covers (the book, whose demand is
//! in micros, would lease ahead any ad it has seen for half a minute); it
//! sends at most one batch of asks a tick, requests waiting without a
//! lease first; and in "leases unreleased" mode it drops the releases
//! instead of sending them. Every call takes the server's clock
//! (unix ms), so the adapter is tested without a pacer or a timer.

use std::collections::HashMap;
use std::time::Duration;

use adspend_client::api::Release;
use adspend_client::{Ask, LeaseBook, LeasePolicy};

use super::CostDistribution;

/// How a simulated ad server decides what it may serve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ServeMode {
    /// `POST /v1/decisions` for the requested ads; serve a servable ad with
    /// probability equal to its multiplier.
    Decisions,
    /// Lease spend ahead (`POST /v1/leases`) and serve only within a lease.
    Leases(LeaseMode),
}

impl ServeMode {
    /// `decisions` or `leases` as the command lines spell them; `leases
    /// unreleased` for leases never released.
    pub fn name(&self) -> &'static str {
        match self {
            ServeMode::Decisions => "decisions",
            ServeMode::Leases(m) if !m.release => "leases unreleased",
            ServeMode::Leases(_) => "leases",
        }
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        match self {
            ServeMode::Decisions => Ok(()),
            ServeMode::Leases(m) => Ok(m.policy.validate()?),
        }
    }
}

/// How a server in lease mode leases.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseMode {
    /// The client crate's policy: ttl, margin, ask share and lead.
    pub policy: LeasePolicy,
    /// Release each lease let go with something left, saying what was
    /// served under it; without, what is left stays held at the pacers
    /// until expiry plus their grace.
    pub release: bool,
}

/// The renewal lead of [`LeaseMode::default`]: two of the loop's default
/// 100 ms ticks, the time a new lease takes to arrive after its ask.
pub const LEAD: Duration = Duration::from_millis(200);

impl Default for LeaseMode {
    /// The crate's default policy (30 s ttl, 1 s margin, half the usable
    /// life asked) with a [`LEAD`] of two ticks, releasing.
    fn default() -> Self {
        Self {
            policy: LeasePolicy {
                lead: LEAD,
                ..LeasePolicy::default()
            },
            release: true,
        }
    }
}

impl LeaseMode {
    /// The default mode with leases of `ttl`.
    pub fn with_ttl(ttl: Duration) -> Self {
        let mut mode = Self::default();
        mode.policy.ttl = ttl;
        mode
    }

    /// The `ttl_ms` of `POST /v1/leases`.
    pub(crate) fn ttl_ms(&self) -> u64 {
        u64::try_from(self.policy.ttl.as_millis()).unwrap_or(u64::MAX)
    }
}

/// Requests per second are weighted exponentially over this window.
const RATE_WINDOW_SECS: f64 = 2.0;

/// One server's leases (the crate's book) and what it has seen of its
/// requests and costs.
#[derive(Debug)]
pub(crate) struct ServerLeases {
    book: LeaseBook,
    release: bool,
    /// The highest cost of the loop's distribution: the least an ask is.
    max_cost: u64,
    cost_sum: f64,
    costs: u64,
    /// Per ad: requests per second, exponentially weighted, as of the
    /// instant (unix ms) beside it.
    rates: Vec<(f64, i64)>,
}

impl ServerLeases {
    /// The leases of a server whose requests draw from `ads` ads.
    pub(crate) fn new(
        mode: LeaseMode,
        cost: &CostDistribution,
        ads: usize,
    ) -> anyhow::Result<Self> {
        let max_cost = match *cost {
            CostDistribution::Uniform { max, .. } | CostDistribution::LogUniform { max, .. } => max,
        };
        Ok(Self {
            book: LeaseBook::new(mode.policy)?,
            release: mode.release,
            max_cost: max_cost.max(1),
            cost_sum: 0.0,
            costs: 0,
            rates: vec![(0.0, 0); ads],
        })
    }

    pub(crate) fn book(&self) -> &LeaseBook {
        &self.book
    }

    fn rate_at(&self, ad: u32, now_ms: i64) -> f64 {
        let (rate, at_ms) = self.rates[ad as usize];
        let secs = (now_ms - at_ms).max(0) as f64 / 1000.0;
        rate * (-secs / RATE_WINDOW_SECS).exp()
    }

    /// The mean cost seen; the highest cost before any is seen.
    fn mean_cost(&self) -> f64 {
        if self.costs == 0 {
            self.max_cost as f64
        } else {
            self.cost_sum / self.costs as f64
        }
    }

    /// Notes the requests that arrived by `now_ms` (`ads`: one entry per
    /// request; `ad_ids`: the catalog's ids by number) and tells the book
    /// each requested ad's expected spend. Returns the requested ads,
    /// sorted and unique.
    pub(crate) fn note_requests(
        &mut self,
        ads: &[u32],
        ad_ids: &[String],
        now_ms: i64,
    ) -> Vec<u32> {
        let mut requested = ads.to_vec();
        requested.sort_unstable();
        for run in requested.chunk_by(|a, b| a == b) {
            let ad = run[0];
            let rate = self.rate_at(ad, now_ms) + run.len() as f64 / RATE_WINDOW_SECS;
            self.rates[ad as usize] = (rate, now_ms);
            self.book
                .want(&ad_ids[ad as usize], rate * self.mean_cost(), self.max_cost);
        }
        requested.dedup();
        requested
    }

    /// The cost of a request (served or not), for the mean cost.
    pub(crate) fn note_cost(&mut self, cost: u64) {
        self.cost_sum += cost as f64;
        self.costs += 1;
    }

    /// The asks to send now ([`LeaseBook::plan_at`]), at most `max`, in
    /// the catalog's order: those of requested ads (`requested`, sorted)
    /// holding nothing usable first, then the largest. An ad not requested
    /// now is asked for only if it expects a request within the seconds
    /// one ask covers. An ask left out is handed back to the book
    /// ([`LeaseBook::ask_failed`]), to be planned again next tick.
    pub(crate) fn asks(
        &self,
        requested: &[u32],
        ad_by_id: &HashMap<String, u32>,
        max: usize,
        now_ms: i64,
    ) -> Vec<Ask> {
        let policy = self.book.policy();
        let ask_secs = policy.ttl.saturating_sub(policy.margin).as_secs_f64() * policy.ask_share;
        let mut asks: Vec<(bool, u32, Ask)> = Vec::new();
        for ask in self.book.plan_at(now_ms) {
            let ad = ad_by_id[&*ask.ad_id];
            let now = requested.binary_search(&ad).is_ok();
            if !now && self.rate_at(ad, now_ms) * ask_secs < 1.0 {
                self.book.ask_failed(&ask.ad_id);
                continue;
            }
            let waiting = now && self.book.left_at(&ask.ad_id, now_ms) == 0;
            asks.push((waiting, ad, ask));
        }
        asks.sort_by(|(aw, a, am), (bw, b, bm)| {
            bw.cmp(aw).then(bm.micros.cmp(&am.micros)).then(a.cmp(b))
        });
        for (_, _, left_out) in asks.iter().skip(max) {
            self.book.ask_failed(&left_out.ad_id);
        }
        asks.truncate(max);
        asks.sort_unstable_by_key(|&(_, ad, _)| ad);
        asks.into_iter().map(|(_, _, ask)| ask).collect()
    }

    /// The releases of every lease let go with something left by `now_ms`
    /// ([`LeaseBook::take_releases`]); none when the mode does not release.
    pub(crate) fn take_releases(&self, now_ms: i64) -> Vec<Release> {
        self.released(self.book.take_releases(now_ms))
    }

    /// Lets go of every lease (the run is over) and returns their releases
    /// ([`LeaseBook::release_all`]); none when the mode does not release.
    pub(crate) fn release_all(&self) -> Vec<Release> {
        self.released(self.book.release_all())
    }

    fn released(&self, releases: Vec<Release>) -> Vec<Release> {
        if self.release {
            releases
        } else {
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests;
