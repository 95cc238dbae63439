//! The lease book: per ad, the leases an ad server holds, answering
//! [`LeaseBook::try_spend`] from memory on the bidder's hot path.
//!
//! A call takes a read lock on one of the book's shards (by the ad id's
//! hash) and the ad's own mutex, for a few arithmetic steps: no network
//! call, no allocation, and no lock held across anything that waits.
//! Threads that spend on different ads touch different locks. Renewals,
//! zero-grant back-off and releases happen in the background
//! ([`crate::Renewer`]) through [`LeaseBook::plan_at`], [`LeaseBook::install`]
//! and [`LeaseBook::take_releases`], which a caller with its own scheduler
//! may drive instead.

use std::hash::{BuildHasher, BuildHasherDefault};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use rustc_hash::{FxHashMap, FxHasher};

use crate::api::{Grant, Release};

mod ad;
#[cfg(test)]
mod tests;

use ad::AdLeases;
pub use ad::Refusal;

/// How a book leases: the rules of docs/LEASES.md, in numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeasePolicy {
    /// Asked of the pacer as `ttl_ms` (whole milliseconds, 1 s to 10 min).
    pub ttl: Duration,
    /// A lease serves nothing once the clock is within this much of its
    /// expiry: room for this machine's clock being behind the pacer's, so
    /// no impression is stamped after the expiry the pacer counts with.
    pub margin: Duration,
    /// Each ask covers the ad's expected spend over this share of a
    /// lease's usable life (ttl less margin), and at least its costliest
    /// impression seen.
    pub ask_share: f64,
    /// A lease is renewed when its usable end is this close, or when less
    /// is left than the ad spends in this long (the low-water mark): longer
    /// than a grant takes to arrive.
    pub lead: Duration,
}

impl Default for LeasePolicy {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(30),
            margin: Duration::from_secs(1),
            ask_share: 0.5,
            lead: Duration::from_millis(500),
        }
    }
}

/// Why a policy cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("lease policy: {0}")]
pub struct PolicyError(String);

impl LeasePolicy {
    /// Checks the policy against the contract's `ttl_ms` range and itself.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let ttl_ms = self.ttl.as_millis();
        if !(1_000..=600_000).contains(&ttl_ms)
            || !self.ttl.subsec_nanos().is_multiple_of(1_000_000)
        {
            return Err(PolicyError(format!(
                "ttl {:?} must be whole milliseconds within 1000..=600000 ms",
                self.ttl
            )));
        }
        if self.margin * 2 > self.ttl {
            return Err(PolicyError(format!(
                "margin {:?} must be at most half the ttl {:?}",
                self.margin, self.ttl
            )));
        }
        if !(self.ask_share > 0.0 && self.ask_share <= 1.0) {
            return Err(PolicyError(format!(
                "ask_share {} must be within (0, 1]",
                self.ask_share
            )));
        }
        if self.lead + self.margin >= self.ttl {
            return Err(PolicyError(format!(
                "lead {:?} plus margin {:?} must be shorter than the ttl {:?}",
                self.lead, self.margin, self.ttl
            )));
        }
        Ok(())
    }

    pub(crate) fn ttl_ms(&self) -> u64 {
        self.ttl.as_millis() as u64
    }

    fn margin_ms(&self) -> i64 {
        self.margin.as_millis() as i64
    }

    fn lead_ms(&self) -> i64 {
        self.lead.as_millis() as i64
    }

    /// Seconds of spend one ask covers.
    fn ask_secs(&self) -> f64 {
        self.ttl.saturating_sub(self.margin).as_secs_f64() * self.ask_share
    }
}

/// One ad to lease for, and how much to ask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    pub ad_id: Arc<str>,
    pub micros: u64,
}

type Entry = Arc<Mutex<AdLeases>>;
type Shard = RwLock<FxHashMap<Arc<str>, Entry>>;

const SHARDS: usize = 64;
/// The past's weight in the demand rate at each [`LeaseBook::plan_at`] a
/// second apart (shorter gaps weigh it more).
const KEEP_PER_SEC: f64 = 0.6;

/// An ad server's leases, shared by its threads (cheap to clone).
#[derive(Clone, Debug)]
pub struct LeaseBook {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    policy: LeasePolicy,
    shards: Box<[Shard]>,
    hasher: BuildHasherDefault<FxHasher>,
    last_plan_ms: Mutex<Option<i64>>,
}

/// This machine's clock, unix milliseconds.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl LeaseBook {
    /// An empty book; ads join it at their first [`LeaseBook::try_spend`]
    /// (or [`LeaseBook::want`]).
    pub fn new(policy: LeasePolicy) -> Result<Self, PolicyError> {
        policy.validate()?;
        Ok(Self {
            inner: Arc::new(Inner {
                policy,
                shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
                hasher: BuildHasherDefault::default(),
                last_plan_ms: Mutex::new(None),
            }),
        })
    }

    pub fn policy(&self) -> LeasePolicy {
        self.inner.policy
    }

    fn shard(&self, ad: &str) -> &Shard {
        let h = self.inner.hasher.hash_one(ad) as usize;
        &self.inner.shards[(h >> 7) % SHARDS]
    }

    fn entry(&self, ad: &str) -> Entry {
        if let Some(e) = self.shard(ad).read().expect("book shard").get(ad) {
            return e.clone();
        }
        self.shard(ad)
            .write()
            .expect("book shard")
            .entry(Arc::from(ad))
            .or_default()
            .clone()
    }

    /// Takes `cost` micros out of `ad_id`'s lease and returns the lease id
    /// to put on the impression, or why nothing was taken. The older of the
    /// ad's two leases pays first; a lease within the policy's margin of
    /// its expiry pays nothing. Every call, refused or not, is demand the
    /// next renewal asks for.
    ///
    /// ```
    /// use adspend_client::{LeaseBook, LeasePolicy, Refusal};
    /// let book = LeaseBook::new(LeasePolicy::default()).unwrap();
    /// // Nothing is leased yet: refused, and the ad is now wanted.
    /// assert_eq!(book.try_spend("ad-1", 1_500), Err(Refusal::NoLease));
    /// assert_eq!(book.plan_at(0).len(), 1);
    /// ```
    pub fn try_spend(&self, ad_id: &str, cost: u64) -> Result<Arc<str>, Refusal> {
        self.try_spend_at(ad_id, cost, now_ms())
    }

    /// [`LeaseBook::try_spend`] at a given clock (unix ms).
    pub fn try_spend_at(&self, ad_id: &str, cost: u64, now_ms: i64) -> Result<Arc<str>, Refusal> {
        let margin = self.inner.policy.margin_ms();
        {
            let shard = self.shard(ad_id).read().expect("book shard");
            if let Some(e) = shard.get(ad_id) {
                return e.lock().expect("ad leases").spend(cost, now_ms, margin);
            }
        }
        self.entry(ad_id)
            .lock()
            .expect("ad leases")
            .spend(cost, now_ms, margin)
    }

    /// Adds `ad_id` to the book with an expected spend of `micros_per_sec`,
    /// so it is leased before its first request.
    pub fn want(&self, ad_id: &str, micros_per_sec: f64, max_cost: u64) {
        let e = self.entry(ad_id);
        let mut a = e.lock().expect("ad leases");
        a.rate = a.rate.max(micros_per_sec);
        a.max_cost = a.max_cost.max(max_cost);
    }

    /// What is left of `ad_id`'s usable leases now.
    pub fn left(&self, ad_id: &str) -> u64 {
        self.left_at(ad_id, now_ms())
    }

    /// [`LeaseBook::left`] at a given clock (unix ms): what the ad's leases
    /// not yet within the margin of their expiry have left. Lets nothing go
    /// and counts no demand.
    pub fn left_at(&self, ad_id: &str, now_ms: i64) -> u64 {
        let margin = self.inner.policy.margin_ms();
        self.shard(ad_id)
            .read()
            .expect("book shard")
            .get(ad_id)
            .map_or(0, |e| {
                e.lock().expect("ad leases").usable_left(now_ms, margin)
            })
    }

    /// The asks to send now: every ad with demand that holds no usable
    /// lease, or whose lease nears its usable end or has less left than
    /// the ad spends in the policy's lead. Each is marked as asking until
    /// [`LeaseBook::install`] or [`LeaseBook::ask_failed`].
    pub fn plan_at(&self, now_ms: i64) -> Vec<Ask> {
        let p = self.inner.policy;
        let elapsed_secs = {
            let mut last = self.inner.last_plan_ms.lock().expect("plan clock");
            let elapsed = last.map_or(1.0, |l| ((now_ms - l).max(1) as f64) / 1000.0);
            *last = Some(now_ms);
            elapsed
        };
        let keep = KEEP_PER_SEC.powf(elapsed_secs);
        let (margin, lead) = (p.margin_ms(), p.lead_ms());
        let mut asks = Vec::new();
        for shard in self.inner.shards.iter() {
            for (ad, e) in shard.read().expect("book shard").iter() {
                let mut a = e.lock().expect("ad leases");
                let recent = a.requests > 0;
                a.fold_demand(elapsed_secs, keep);
                a.sweep(now_ms, margin);
                if a.asking || now_ms < a.retry_at_ms || (!recent && a.rate * p.ask_secs() < 1.0) {
                    continue;
                }
                let max_cost = a.max_cost.max(1) as f64;
                let low_water = max_cost.max(a.rate * lead as f64 / 1000.0);
                let ends_soon = a
                    .lease
                    .as_ref()
                    .is_none_or(|l| now_ms + lead >= l.expires_at_ms.saturating_sub(margin));
                if ends_soon || (a.usable_left(now_ms, margin) as f64) < low_water {
                    a.asking = true;
                    asks.push(Ask {
                        ad_id: ad.clone(),
                        micros: (a.rate * p.ask_secs()).max(max_cost).ceil() as u64,
                    });
                }
            }
        }
        asks
    }

    /// Records the pacer's answer to an ask: a lease (replacing the ad's
    /// newest, which is kept and spent first while it has something left),
    /// or a zero grant (the ad is not asked for again for a back-off).
    pub fn install(&self, grant: &Grant, now_ms: i64) {
        self.entry(&grant.ad_id).lock().expect("ad leases").install(
            grant.lease_id.as_deref(),
            grant.granted_micros,
            grant.expires_at_ms,
            now_ms,
        );
    }

    /// An ask that got no answer: asked again at the next plan.
    pub fn ask_failed(&self, ad_id: &str) {
        self.entry(ad_id).lock().expect("ad leases").ask_failed();
    }

    /// Lets go every lease past its usable end, and returns the release of
    /// every lease let go with something left since the last call: what
    /// was served under it, so the pacers free the rest at once.
    pub fn take_releases(&self, now_ms: i64) -> Vec<Release> {
        let margin = self.inner.policy.margin_ms();
        let mut out = Vec::new();
        for shard in self.inner.shards.iter() {
            for e in shard.read().expect("book shard").values() {
                let mut a = e.lock().expect("ad leases");
                a.sweep(now_ms, margin);
                out.append(&mut a.releases);
            }
        }
        out
    }

    /// Lets go of every lease now (at shutdown) and returns their releases.
    pub fn release_all(&self) -> Vec<Release> {
        self.take_releases(i64::MAX)
    }
}
