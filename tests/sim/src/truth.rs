//! Ground truth: what the pipeline must report once it has consumed every
//! acknowledged message, computed independently of the pipeline's code.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Context as _};
use chrono::{DateTime, NaiveDate};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

use super::catalog::{Catalog, Period, MAX_ID_BYTES};
use super::event::BadKind;

/// One impression as the CONTRACT defines it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Impression {
    pub id: String,
    pub ad_id: String,
    pub cost_micros: u64,
    /// Unix epoch milliseconds.
    pub ts: i64,
}

/// The truth document written by `adsim run --truth-out`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Truth {
    /// Every limit of the catalog, with zero spend where nothing was booked.
    pub limits: BTreeMap<String, LimitTruth>,
    pub stats: Stats,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LimitTruth {
    pub lifetime_micros: u64,
    /// Local date (`YYYY-MM-DD` in the limit's zone) → spend; daily limits only.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub daily: BTreeMap<String, u64>,
}

/// Counters of one run. `*_sent` count every event put into a message that
/// was handed to NATS; `*_acked` and `unique_events` only those in messages
/// JetStream acknowledged, the only ones the truth is built from.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Stats {
    pub run_id: String,
    pub seed: u64,
    pub messages_published: u64,
    pub messages_acked: u64,
    /// Publish errors and missing or negative acks: such a message may or may
    /// not be in the stream, so its events are left out of the truth.
    pub messages_failed: u64,
    pub events_sent: u64,
    pub events_acked: u64,
    /// Distinct good impressions in acknowledged messages.
    pub unique_events: u64,
    pub duplicates_sent: u64,
    pub bad_events_sent: BTreeMap<String, u64>,
    pub bad_events_acked: BTreeMap<String, u64>,
    pub elapsed_ms: u64,
    pub events_per_sec: f64,
}

impl Truth {
    /// Adds the spend and the acknowledged counts of `other`, a truth over
    /// the same catalog whose impressions are distinct from this one's.
    pub fn absorb(&mut self, other: &Truth) {
        for (limit, theirs) in &other.limits {
            let ours = self.limits.entry(limit.clone()).or_default();
            ours.lifetime_micros += theirs.lifetime_micros;
            for (day, micros) in &theirs.daily {
                *ours.daily.entry(day.clone()).or_default() += micros;
            }
        }
        self.stats.unique_events += other.stats.unique_events;
        self.stats.events_sent += other.stats.events_sent;
        self.stats.events_acked += other.stats.events_acked;
        self.stats.duplicates_sent += other.stats.duplicates_sent;
        self.stats.messages_published += other.stats.messages_published;
        self.stats.messages_acked += other.stats.messages_acked;
        self.stats.messages_failed += other.stats.messages_failed;
    }

    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let bytes =
            std::fs::read(path).with_context(|| format!("reading truth {}", path.display()))?;
        serde_json::from_slice(&bytes).with_context(|| format!("parsing truth {}", path.display()))
    }

    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        let json = serde_json::to_vec_pretty(self)?;
        std::fs::write(path, json).with_context(|| format!("writing truth {}", path.display()))
    }
}

/// `None` if `actual` equals `expected` for every limit, lifetime and per
/// local day (a limit missing from one side counts as all zeros); otherwise
/// how many limits differ and the first few of them.
pub fn differences(
    expected: &BTreeMap<String, LimitTruth>,
    actual: &BTreeMap<String, LimitTruth>,
) -> Option<String> {
    const SHOWN: usize = 3;
    let empty = LimitTruth::default();
    let differing: Vec<String> = expected
        .keys()
        .chain(actual.keys().filter(|id| !expected.contains_key(*id)))
        .filter_map(|id| {
            let want = expected.get(id).unwrap_or(&empty);
            let got = actual.get(id).unwrap_or(&empty);
            (want != got).then(|| {
                format!(
                    "{id}: expected lifetime {} daily {:?}, got lifetime {} daily {:?}",
                    want.lifetime_micros, want.daily, got.lifetime_micros, got.daily
                )
            })
        })
        .collect();
    if differing.is_empty() {
        return None;
    }
    let shown = differing[..differing.len().min(SHOWN)].join("; ");
    Some(format!("{} limits differ: {shown}", differing.len()))
}

/// The catalog turned into dense indices, shared by the generator and the
/// truth so that neither hashes strings per event.
#[derive(Debug)]
pub struct CatalogIndex {
    pub(crate) ad_ids: Vec<String>,
    pub(crate) ad_by_id: HashMap<String, u32>,
    /// Each ad id as a JSON string literal, quotes included.
    pub(crate) ad_json: Vec<Box<str>>,
    ad_limits: Vec<Box<[u32]>>,
    limit_ids: Vec<String>,
    /// Index into `zones` for daily limits, `None` for lifetime limits.
    limit_zone: Vec<Option<usize>>,
    zones: Vec<Tz>,
}

impl CatalogIndex {
    /// Limits an impression of ad number `ad` books to.
    pub fn limits_of(&self, ad: u32) -> usize {
        self.ad_limits[ad as usize].len()
    }

    pub fn new(catalog: &Catalog) -> anyhow::Result<Self> {
        catalog.validate()?;
        let limit_ids: Vec<String> = catalog.limits.keys().cloned().collect();
        let limit_pos: HashMap<&str, u32> = catalog
            .limits
            .keys()
            .enumerate()
            .map(|(i, id)| (id.as_str(), i as u32))
            .collect();
        let mut zones: Vec<Tz> = Vec::new();
        let mut limit_zone = Vec::with_capacity(limit_ids.len());
        for limit in catalog.limits.values() {
            let zone = match limit.period {
                Period::Lifetime => None,
                Period::Daily => {
                    let tz: Tz = limit
                        .time_zone
                        .parse()
                        .map_err(|_| anyhow!("unknown time zone {:?}", limit.time_zone))?;
                    Some(zones.iter().position(|z| *z == tz).unwrap_or_else(|| {
                        zones.push(tz);
                        zones.len() - 1
                    }))
                }
            };
            limit_zone.push(zone);
        }
        let mut index = Self {
            ad_ids: Vec::with_capacity(catalog.ads.len()),
            ad_by_id: HashMap::with_capacity(catalog.ads.len()),
            ad_json: Vec::with_capacity(catalog.ads.len()),
            ad_limits: Vec::with_capacity(catalog.ads.len()),
            limit_ids,
            limit_zone,
            zones,
        };
        for (ad, limits) in &catalog.ads {
            index.ad_by_id.insert(ad.clone(), index.ad_ids.len() as u32);
            index.ad_ids.push(ad.clone());
            index
                .ad_json
                .push(serde_json::to_string(ad)?.into_boxed_str());
            index
                .ad_limits
                .push(limits.iter().map(|l| limit_pos[l.as_str()]).collect());
        }
        Ok(index)
    }
}

/// Accumulates the truth. Feed it impressions with [`TruthBuilder::record`];
/// the simulator uses a faster path keyed by its own event sequence numbers.
#[derive(Debug)]
pub struct TruthBuilder {
    index: Arc<CatalogIndex>,
    lifetime: Vec<u64>,
    /// Per limit: local date in the limit's zone → spend.
    daily: Vec<HashMap<NaiveDate, u64>>,
    unique: u64,
    seen_ids: HashSet<String>,
    /// Bit per simulator sequence number: one bit per event keeps the
    /// duplicate check cheap for runs of hundreds of millions of events.
    seen_seqs: Vec<u64>,
    /// Per zone of the index: the local day of the event being booked.
    day_scratch: Vec<Option<NaiveDate>>,
}

/// What [`TruthBuilder::record`] did with an impression.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    Counted,
    Duplicate,
    Rejected(BadKind),
}

impl TruthBuilder {
    pub fn new(catalog: &Catalog) -> anyhow::Result<Self> {
        Ok(Self::from_index(Arc::new(CatalogIndex::new(catalog)?)))
    }

    pub fn from_index(index: Arc<CatalogIndex>) -> Self {
        let limits = index.limit_ids.len();
        Self {
            index,
            lifetime: vec![0; limits],
            daily: vec![HashMap::new(); limits],
            unique: 0,
            seen_ids: HashSet::new(),
            seen_seqs: Vec::new(),
            day_scratch: Vec::new(),
        }
    }

    /// Books `event` once per distinct `id`. Invalid ids and unknown ads are
    /// rejected as the pipeline rejects them; the other bad kinds cannot be
    /// represented by an [`Impression`].
    pub fn record(&mut self, event: &Impression) -> anyhow::Result<Recorded> {
        if event.id.is_empty() || event.id.len() > MAX_ID_BYTES {
            return Ok(Recorded::Rejected(BadKind::IdTooLong));
        }
        let Some(&ad) = self.index.ad_by_id.get(&event.ad_id) else {
            return Ok(Recorded::Rejected(BadKind::UnknownAd));
        };
        if self.seen_ids.contains(&event.id) {
            return Ok(Recorded::Duplicate);
        }
        self.book(ad, event.cost_micros, event.ts)
            .with_context(|| format!("booking impression {:?}", event.id))?;
        self.seen_ids.insert(event.id.clone());
        Ok(Recorded::Counted)
    }

    /// Books the simulator's event number `seq` unless it was booked before;
    /// returns whether it was new.
    pub fn record_seq(&mut self, seq: u64, ad: u32, cost: u64, ts: i64) -> anyhow::Result<bool> {
        let (word, bit) = ((seq / 64) as usize, 1u64 << (seq % 64));
        if word >= self.seen_seqs.len() {
            self.seen_seqs.resize((word + 1).next_power_of_two(), 0);
        }
        if self.seen_seqs[word] & bit != 0 {
            return Ok(false);
        }
        self.book(ad, cost, ts)
            .with_context(|| format!("booking simulated impression #{seq}"))?;
        self.seen_seqs[word] |= bit;
        Ok(true)
    }

    /// Adds the cost to every limit of the ad, all or nothing.
    fn book(&mut self, ad: u32, cost: u64, ts: i64) -> anyhow::Result<()> {
        let index = &*self.index;
        let limits = &index.ad_limits[ad as usize];
        self.day_scratch.clear();
        self.day_scratch.resize(index.zones.len(), None);
        // Check every sum before changing any, so an error leaves no trace.
        for &limit in limits.iter() {
            let limit = limit as usize;
            let id = &index.limit_ids[limit];
            self.lifetime[limit]
                .checked_add(cost)
                .ok_or_else(|| anyhow!("lifetime spend of {id} overflows u64"))?;
            if let Some(zone) = index.limit_zone[limit] {
                let day = match self.day_scratch[zone] {
                    Some(day) => day,
                    None => {
                        let day = local_date(index.zones[zone], ts)?;
                        self.day_scratch[zone] = Some(day);
                        day
                    }
                };
                let spent = self.daily[limit].get(&day).copied().unwrap_or(0);
                spent
                    .checked_add(cost)
                    .ok_or_else(|| anyhow!("daily spend of {id} overflows u64"))?;
            }
        }
        // Validation guarantees an ad lists a limit once, so nothing above
        // was checked against a sum this loop changes first.
        for &limit in limits.iter() {
            let limit = limit as usize;
            self.lifetime[limit] += cost;
            if let Some(zone) = index.limit_zone[limit] {
                let day = self.day_scratch[zone].expect("computed above");
                *self.daily[limit].entry(day).or_insert(0) += cost;
            }
        }
        self.unique += 1;
        Ok(())
    }

    /// Distinct impressions booked so far.
    pub fn unique_events(&self) -> u64 {
        self.unique
    }

    pub fn finish(self, stats: Stats) -> Truth {
        self.current(stats)
    }

    /// The truth booked so far, leaving the builder to go on booking.
    pub fn current(&self, mut stats: Stats) -> Truth {
        stats.unique_events = self.unique;
        let limits = self
            .index
            .limit_ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let daily = self.daily[i]
                    .iter()
                    .map(|(&day, &spent)| (day_key(day), spent))
                    .collect();
                let truth = LimitTruth {
                    lifetime_micros: self.lifetime[i],
                    daily,
                };
                (id.clone(), truth)
            })
            .collect();
        Truth { limits, stats }
    }
}

/// The local date of `ts_ms` (Unix epoch milliseconds) in `zone`: the day
/// a daily limit in that zone books an impression of that instant to.
pub fn local_date(zone: Tz, ts_ms: i64) -> anyhow::Result<NaiveDate> {
    let utc = DateTime::from_timestamp_millis(ts_ms)
        .ok_or_else(|| anyhow!("timestamp {ts_ms} ms is out of range"))?;
    Ok(utc.with_timezone(&zone).date_naive())
}

/// `YYYY-MM-DD`: how the truth, and whatever is compared with it, keys a day.
pub fn day_key(date: NaiveDate) -> String {
    date.format("%Y-%m-%d").to_string()
}

#[cfg(test)]
mod tests;
