//! The catalog document of the CONTRACT (ads → limits → budgets), its
//! deterministic generator and its validation.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use anyhow::{bail, Context as _};
use chrono_tz::Tz;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Longest limit id, ad id and impression id the contract allows, in bytes.
pub const MAX_ID_BYTES: usize = 64;

/// Time zones the generator spreads limits over: whole-hour, half-hour and
/// quarter-hour offsets, northern and southern DST, and no DST at all.
pub const ZONES: &[&str] = &[
    "UTC",
    "America/New_York",
    "Europe/Berlin",
    "Asia/Kolkata",
    "Asia/Kathmandu",
    "Australia/Adelaide",
    "America/Los_Angeles",
    "Pacific/Auckland",
];

/// The catalog document, serialized exactly as the CONTRACT describes it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Catalog {
    pub limits: BTreeMap<String, Limit>,
    /// Ad id → every limit an impression of the ad is booked to.
    pub ads: BTreeMap<String, Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limit {
    pub budget_micros: u64,
    pub period: Period,
    #[serde(default = "utc")]
    pub time_zone: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

fn utc() -> String {
    "UTC".to_owned()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Period {
    Daily,
    Lifetime,
}

/// How many of each level [`generate_catalog`] creates (totals, not fan-outs).
/// Children are spread round-robin over their parents, so a parent is left
/// without children only when its level outnumbers the level below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatalogSpec {
    pub accounts: u32,
    pub campaigns: u32,
    pub adsets: u32,
    pub ads: u32,
}

impl CatalogSpec {
    /// A realistic shape for `ads` ads: about 5 ads per ad set, 4 ad sets per
    /// campaign and 5 campaigns per account.
    pub fn for_ads(ads: u32) -> Self {
        let ads = ads.max(1);
        let adsets = ads.div_ceil(5);
        let campaigns = adsets.div_ceil(4);
        let accounts = campaigns.div_ceil(5);
        Self {
            accounts,
            campaigns,
            adsets,
            ads,
        }
    }
}

impl Default for CatalogSpec {
    fn default() -> Self {
        Self::for_ads(1000)
    }
}

/// Builds a catalog that depends only on `spec` and `seed`. Ids are
/// `account-N`, `campaign-N`, `adset-N` and `ad-N` (from 1); every ad maps to
/// `[adset, campaign, account]`, which is also its chain of `parent`s.
pub fn generate_catalog(spec: &CatalogSpec, seed: u64) -> anyhow::Result<Catalog> {
    if spec.accounts == 0 || spec.campaigns == 0 || spec.adsets == 0 || spec.ads == 0 {
        bail!("catalog spec needs at least one of each level, got {spec:?}");
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut limits = BTreeMap::new();
    // Accounts take the zones in turn, from a seeded offset, so that any
    // catalog with as many accounts as ZONES uses every zone.
    let zone_offset = rng.random_range(0..ZONES.len());
    let mut zone_of: HashMap<String, &'static str> = HashMap::new();

    let mut add_level = |rng: &mut SmallRng,
                         prefix: &str,
                         count: u32,
                         parent_prefix: Option<(&str, u32)>,
                         daily_share: f64,
                         budget_units: std::ops::RangeInclusive<u64>| {
        for i in 0..count {
            let id = format!("{prefix}-{}", i + 1);
            let parent = parent_prefix.map(|(p, n)| format!("{p}-{}", i % n + 1));
            let zone = match &parent {
                None => ZONES[(zone_offset + i as usize) % ZONES.len()],
                // Most children keep their parent's zone; some do not, so
                // one ad's limits roll over at different instants.
                Some(p) if rng.random_bool(0.7) => zone_of[p],
                Some(_) => ZONES[rng.random_range(0..ZONES.len())],
            };
            let period = if rng.random_bool(daily_share) {
                Period::Daily
            } else {
                Period::Lifetime
            };
            let budget_micros = rng.random_range(budget_units.clone()) * 1_000_000;
            zone_of.insert(id.clone(), zone);
            limits.insert(
                id,
                Limit {
                    budget_micros,
                    period,
                    time_zone: zone.to_owned(),
                    parent,
                },
            );
        }
    };
    add_level(
        &mut rng,
        "account",
        spec.accounts,
        None,
        0.3,
        1_000..=100_000,
    );
    add_level(
        &mut rng,
        "campaign",
        spec.campaigns,
        Some(("account", spec.accounts)),
        0.6,
        100..=10_000,
    );
    add_level(
        &mut rng,
        "adset",
        spec.adsets,
        Some(("campaign", spec.campaigns)),
        0.5,
        10..=1_000,
    );

    let mut ads = BTreeMap::new();
    for i in 0..spec.ads {
        let adset = format!("adset-{}", i % spec.adsets + 1);
        let campaign = limits[&adset].parent.clone().expect("ad sets have parents");
        let account = limits[&campaign]
            .parent
            .clone()
            .expect("campaigns have parents");
        ads.insert(format!("ad-{}", i + 1), vec![adset, campaign, account]);
    }
    Ok(Catalog { limits, ads })
}

impl Catalog {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let bytes =
            std::fs::read(path).with_context(|| format!("reading catalog {}", path.display()))?;
        let catalog: Catalog = serde_json::from_slice(&bytes)
            .with_context(|| format!("parsing catalog {}", path.display()))?;
        catalog
            .validate()
            .with_context(|| format!("invalid catalog {}", path.display()))?;
        Ok(catalog)
    }

    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        let json = serde_json::to_vec_pretty(self)?;
        std::fs::write(path, json).with_context(|| format!("writing catalog {}", path.display()))
    }

    /// Checks what the pipeline relies on: id lengths, positive budgets, known
    /// time zones, existing parents without cycles, and ads that list only
    /// existing limits, each once.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (id, limit) in &self.limits {
            check_id("limit", id)?;
            if limit.budget_micros == 0 {
                bail!("limit {id:?} has a zero budget");
            }
            if limit.time_zone.parse::<Tz>().is_err() {
                bail!("limit {id:?} has unknown time zone {:?}", limit.time_zone);
            }
            if let Some(parent) = &limit.parent {
                if !self.limits.contains_key(parent) {
                    bail!("limit {id:?} has unknown parent {parent:?}");
                }
            }
        }
        for id in self.limits.keys() {
            self.ancestry(id)?;
        }
        for (ad, limits) in &self.ads {
            check_id("ad", ad)?;
            let mut seen = HashSet::new();
            for limit in limits {
                if !self.limits.contains_key(limit) {
                    bail!("ad {ad:?} lists unknown limit {limit:?}");
                }
                if !seen.insert(limit) {
                    bail!("ad {ad:?} lists limit {limit:?} twice");
                }
            }
        }
        Ok(())
    }

    /// `id` and every limit above it, nearest first: the limits whose
    /// budgets an impression booked to `id` also counts against.
    ///
    /// # Errors
    ///
    /// If `id` or a parent is not in the catalog, or the parents form a cycle.
    pub fn ancestry<'a>(&'a self, id: &'a str) -> anyhow::Result<Vec<&'a str>> {
        let mut chain: Vec<&str> = Vec::new();
        let mut cursor = Some(id);
        while let Some(current) = cursor {
            if chain.contains(&current) {
                bail!("limit {id:?} is on a parent cycle through {current:?}");
            }
            let Some(limit) = self.limits.get(current) else {
                bail!("limit {current:?} (above {id:?}) is not in the catalog");
            };
            chain.push(current);
            cursor = limit.parent.as_deref();
        }
        Ok(chain)
    }
}

fn check_id(kind: &str, id: &str) -> anyhow::Result<()> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        bail!(
            "{kind} id {id:?} is {} bytes, must be 1..={MAX_ID_BYTES}",
            id.len()
        );
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests;
