//! The catalog: which budget limits each ad spends against, and the budgets.
//!
//! Parsing validates everything up front (ids, references, cycles, time
//! zones, budget alert thresholds ([`alerts`]), and the shape bounds
//! [`MAX_PARENT_DEPTH`] and [`MAX_LIMITS_ABOVE_AD`]) so the services never meet a half-valid
//! catalog, and works out each limit's ancestors once, so that a decision
//! costs what its ad's limits cost rather than a walk through the catalog.
//! Period arithmetic lives here too, because the limiter books spend to a
//! period bucket and the pacer must agree on which bucket is current.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use chrono::{DateTime, Datelike, LocalResult, NaiveDate, NaiveDateTime, TimeZone, Utc};
use chrono_tz::Tz;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::types::{Micros, LIFETIME_BUCKET, MAX_ID_LEN};

/// Most parents above one limit (a limit without a `parent` is at depth 0;
/// account → campaign → ad set puts the ad set at 2). A deeper catalog is
/// refused: every decision computes a verdict for each limit above its ad.
pub const MAX_PARENT_DEPTH: usize = 16;

/// Most distinct limits above one ad: those it lists and all their
/// ancestors. A catalog with an ad above this is refused, for the same
/// reason as [`MAX_PARENT_DEPTH`].
pub const MAX_LIMITS_ABOVE_AD: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Period {
    Daily,
    Lifetime,
}

impl Period {
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Daily => "daily",
            Period::Lifetime => "lifetime",
        }
    }
}

/// The JSON form of one limit, as operators write it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimit {
    budget_micros: Micros,
    period: Period,
    #[serde(default)]
    time_zone: Option<String>,
    #[serde(default)]
    parent: Option<String>,
    /// Budget alert thresholds, percent of the budget ([`alerts`]).
    #[serde(default)]
    alerts: Option<Vec<u32>>,
}

#[derive(Clone, Debug, Deserialize)]
struct RawCatalog {
    limits: BTreeMap<String, RawLimit>,
    #[serde(default)]
    ads: BTreeMap<String, Vec<String>>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Limit {
    pub id: Arc<str>,
    pub budget_micros: Micros,
    pub period: Period,
    pub time_zone: Tz,
    pub parent: Option<Arc<str>>,
    /// Budget alert thresholds in percent of the budget, ascending, each
    /// 1..=[`alerts::MAX_THRESHOLD_PERCENT`]; empty for none.
    pub alerts: Box<[u16]>,
}

/// Start and end of a budget period.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeriodBounds {
    pub bucket: u32,
    pub start: Option<DateTime<Utc>>,
    pub end: Option<DateTime<Utc>>,
}

impl Limit {
    /// The bucket an event at `ts_ms` (unix ms) is booked to.
    pub fn bucket_of(&self, ts_ms: i64) -> u32 {
        match self.period {
            Period::Lifetime => LIFETIME_BUCKET,
            Period::Daily => local_day(self.time_zone, ts_ms),
        }
    }

    /// The period that contains `now`.
    pub fn period_at(&self, now: DateTime<Utc>) -> PeriodBounds {
        match self.period {
            Period::Lifetime => PeriodBounds {
                bucket: LIFETIME_BUCKET,
                start: None,
                end: None,
            },
            Period::Daily => {
                let bucket = local_day(self.time_zone, now.timestamp_millis());
                PeriodBounds {
                    bucket,
                    start: Some(day_start(self.time_zone, bucket)),
                    end: Some(day_start(self.time_zone, bucket + 1)),
                }
            }
        }
    }
}

const EPOCH_DAY: NaiveDate = NaiveDate::from_ymd_opt(1970, 1, 1).expect("valid date");

/// Local calendar date of `ts_ms` in `tz`, as days since 1970-01-01. The
/// limiter rejects events before 1970 (UTC), but west of Greenwich the first
/// hours after the epoch are still 1969-12-31 locally: buckets are unsigned,
/// so those events are booked to 1970-01-01 (day 0).
pub fn local_day(tz: Tz, ts_ms: i64) -> u32 {
    let utc = DateTime::<Utc>::from_timestamp_millis(ts_ms).unwrap_or_default();
    let date = utc.with_timezone(&tz).date_naive();
    let days = date.num_days_from_ce() - EPOCH_DAY.num_days_from_ce();
    u32::try_from(days).unwrap_or(0)
}

/// The date of a bucket, for display.
pub fn bucket_date(bucket: u32) -> Option<NaiveDate> {
    if bucket == LIFETIME_BUCKET {
        return None;
    }
    EPOCH_DAY.checked_add_days(chrono::Days::new(u64::from(bucket)))
}

/// The first instant whose local time in `tz` is `local`, if any is.
fn first_instant(tz: Tz, local: NaiveDateTime) -> Option<DateTime<Utc>> {
    match tz.from_local_datetime(&local) {
        LocalResult::Single(t) => Some(t.with_timezone(&Utc)),
        LocalResult::Ambiguous(earliest, _) => Some(earliest.with_timezone(&Utc)),
        LocalResult::None => None,
    }
}

/// First instant of local day `bucket` in `tz`. Where midnight does not exist
/// (a DST jump at midnight), the day starts at the first instant that does;
/// a day the zone skipped altogether (Pacific/Apia, 2011-12-30) starts where
/// the next one does, and so has no instant.
pub fn day_start(tz: Tz, bucket: u32) -> DateTime<Utc> {
    let date = bucket_date(bucket).unwrap_or(EPOCH_DAY);
    let midnight = date
        .and_hms_opt(0, 0, 0)
        .expect("midnight exists as a naive time");
    if let Some(t) = first_instant(tz, midnight) {
        return t;
    }
    // Step over the gap a quarter hour at a time (up to two days: a
    // skipped day is 24 hours of gap), then narrow the last step to the
    // second: not every jump is a whole quarter hour (Africa/Monrovia,
    // 1972-01-07, jumped 44 min 30 s).
    let step = chrono::Duration::minutes(15);
    let mut missing = midnight;
    for _ in 0..4 * 48 {
        let next = missing + step;
        if first_instant(tz, next).is_some() {
            let mut exists = next;
            // Whole seconds: offsets change on a whole second.
            while (exists - missing).num_seconds() > 1 {
                let mid = missing + chrono::Duration::seconds((exists - missing).num_seconds() / 2);
                if first_instant(tz, mid).is_some() {
                    exists = mid;
                } else {
                    missing = mid;
                }
            }
            return first_instant(tz, exists).expect("checked above");
        }
        missing = next;
    }
    Utc.from_utc_datetime(&midnight)
}

/// Limit id → its ancestors, parent first.
type Ancestors = FxHashMap<Arc<str>, Box<[Arc<Limit>]>>;

/// A validated catalog.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Catalog {
    pub limits: HashMap<Arc<str>, Arc<Limit>>,
    /// Limits each ad spends against, in catalog order. Looked up once per
    /// impression: hashed with Fx rather than SipHash (the lookup was 11% of
    /// the limiter's time in the end-to-end profile). The keys are the
    /// catalog's own, so input cannot flood the table: an unknown ad is one
    /// miss.
    pub ads: FxHashMap<Arc<str>, Vec<Arc<Limit>>>,
    /// Each limit's ancestors, its parent first, worked out at parse time
    /// (at most [`MAX_PARENT_DEPTH`] each).
    ancestors: Ancestors,
    /// The limits in id order (pages of `GET /v1/limits` are slices of it).
    in_order: Box<[Arc<Limit>]>,
    /// The limits with budget alerts, in id order.
    alerting: Box<[Arc<Limit>]>,
}

fn check_id(kind: &str, id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_ID_LEN {
        return Err(format!(
            "{kind} id {id:?} must be 1..={MAX_ID_LEN} bytes, has {}",
            id.len()
        ));
    }
    Ok(())
}

impl Catalog {
    /// Parse and validate a catalog document; `source_name` goes into errors.
    pub fn parse(source_name: &str, json: &[u8]) -> Result<Self, Error> {
        let fail = |reason: String| Error::Catalog {
            source_name: source_name.to_string(),
            reason,
        };
        let raw: RawCatalog = serde_json::from_slice(json).map_err(|e| fail(e.to_string()))?;
        Self::from_raw(raw).map_err(fail)
    }

    fn from_raw(raw: RawCatalog) -> Result<Self, String> {
        let mut limits = HashMap::with_capacity(raw.limits.len());
        for (id, spec) in &raw.limits {
            check_id("limit", id)?;
            if id.starts_with(crate::lease::LEASE_KEY_PREFIX) {
                return Err(format!(
                    "limit {id:?}: ids beginning {:?} are kept for spend leases",
                    crate::lease::LEASE_KEY_PREFIX
                ));
            }
            let time_zone = match &spec.time_zone {
                None => Tz::UTC,
                Some(name) => name
                    .parse::<Tz>()
                    .map_err(|_| format!("limit {id:?}: unknown time zone {name:?}"))?,
            };
            if let Some(parent) = &spec.parent {
                if !raw.limits.contains_key(parent) {
                    return Err(format!("limit {id:?}: parent {parent:?} is not a limit"));
                }
            }
            let alerts = alerts::thresholds(id, spec.alerts.as_deref())?;
            let id: Arc<str> = Arc::from(id.as_str());
            limits.insert(
                id.clone(),
                Arc::new(Limit {
                    id,
                    budget_micros: spec.budget_micros,
                    period: spec.period,
                    time_zone,
                    parent: spec.parent.as_deref().map(Arc::from),
                    alerts,
                }),
            );
        }
        let ancestors = ancestors_of_each(&limits)?;
        let mut ads = FxHashMap::with_capacity_and_hasher(raw.ads.len(), Default::default());
        for (ad, ids) in raw.ads {
            check_id("ad", &ad)?;
            if ids.is_empty() {
                return Err(format!("ad {ad:?} lists no limits"));
            }
            // Checked before resolving: the list alone may be too long.
            if ids.len() > MAX_LIMITS_ABOVE_AD {
                return Err(format!(
                    "ad {ad:?} lists {} limits, more than the {MAX_LIMITS_ABOVE_AD} allowed",
                    ids.len()
                ));
            }
            let mut resolved: Vec<Arc<Limit>> = Vec::with_capacity(ids.len());
            for id in &ids {
                let limit = limits
                    .get(id.as_str())
                    .ok_or_else(|| format!("ad {ad:?}: limit {id:?} is not in \"limits\""))?;
                if resolved.iter().any(|l| l.id == limit.id) {
                    return Err(format!("ad {ad:?}: limit {id:?} is listed twice"));
                }
                resolved.push(limit.clone());
            }
            let above = distinct_above(&resolved, &ancestors).len();
            if above > MAX_LIMITS_ABOVE_AD {
                return Err(format!(
                    "ad {ad:?}: {above} limits above it (its own and their parents), \
                     more than the {MAX_LIMITS_ABOVE_AD} allowed"
                ));
            }
            ads.insert(Arc::from(ad.as_str()), resolved);
        }
        let mut in_order: Vec<Arc<Limit>> = limits.values().cloned().collect();
        in_order.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        let alerting = in_order
            .iter()
            .filter(|l| !l.alerts.is_empty())
            .cloned()
            .collect();
        Ok(Catalog {
            limits,
            ads,
            ancestors,
            in_order: in_order.into_boxed_slice(),
            alerting,
        })
    }

    pub fn limit(&self, id: &str) -> Option<&Arc<Limit>> {
        self.limits.get(id)
    }

    /// The limits an ad spends against, or `None` for an unknown ad.
    pub fn limits_of_ad(&self, ad_id: &str) -> Option<&[Arc<Limit>]> {
        self.ads.get(ad_id).map(Vec::as_slice)
    }

    /// A limit's ancestors, its parent first; empty for a root or an
    /// unknown id.
    #[cfg(test)]
    pub(crate) fn ancestors(&self, limit_id: &str) -> &[Arc<Limit>] {
        self.ancestors.get(limit_id).map_or(&[], |a| &a[..])
    }

    /// The limits whose ids sort after `after` (all of them without one),
    /// in id order: a page is a prefix, found without sorting.
    pub fn limits_after(&self, after: Option<&str>) -> &[Arc<Limit>] {
        let start = after.map_or(0, |after| {
            self.in_order.partition_point(|l| &*l.id <= after)
        });
        &self.in_order[start..]
    }

    /// The limits that carry budget alerts, in id order.
    pub fn alerting(&self) -> &[Arc<Limit>] {
        &self.alerting
    }

    /// Every limit above an ad: its own limits and all their ancestors,
    /// each once, at most [`MAX_LIMITS_ABOVE_AD`]; no walk through the
    /// catalog (the ancestors were worked out when it was parsed).
    pub fn limits_above_ad(&self, ad_id: &str) -> Option<Vec<&Arc<Limit>>> {
        let direct = self.limits_of_ad(ad_id)?;
        Some(distinct_above(direct, &self.ancestors))
    }
}

/// `direct` and their ancestors, each once, in order.
fn distinct_above<'a>(direct: &'a [Arc<Limit>], ancestors: &'a Ancestors) -> Vec<&'a Arc<Limit>> {
    let mut out: Vec<&Arc<Limit>> = Vec::with_capacity(direct.len() + 2);
    for limit in direct {
        let chain = ancestors.get(&limit.id).map_or(&[][..], |a| &a[..]);
        for l in std::iter::once(limit).chain(chain) {
            // A limit seen already brought its ancestors along.
            if out.iter().any(|seen| Arc::ptr_eq(seen, l)) {
                break;
            }
            out.push(l);
        }
    }
    out
}

/// Each limit's ancestors, parent first, or why the parent chains are
/// refused: one that loops, or one deeper than [`MAX_PARENT_DEPTH`]. Every
/// limit is climbed once (a climb stops at a limit already worked out), so
/// the cost is linear in the catalog whatever its shape.
fn ancestors_of_each(limits: &HashMap<Arc<str>, Arc<Limit>>) -> Result<Ancestors, String> {
    let mut ids: Vec<&Arc<str>> = limits.keys().collect();
    // The first offending limit in id order is the one named.
    ids.sort_unstable();
    let mut done: Ancestors = FxHashMap::with_capacity_and_hasher(limits.len(), Default::default());
    for id in ids {
        if done.contains_key(id) {
            continue;
        }
        let mut path: Vec<&Arc<Limit>> = Vec::new();
        let mut cursor = Some(&limits[id]);
        // The chain above the climb, from the first limit already known.
        let mut above: Vec<Arc<Limit>> = Vec::new();
        while let Some(limit) = cursor {
            if let Some(known) = done.get(&limit.id) {
                above.push(limit.clone());
                above.extend(known.iter().cloned());
                break;
            }
            if path.iter().any(|seen| Arc::ptr_eq(seen, limit)) {
                return Err(format!("limit {:?}: parent chain has a cycle", limit.id));
            }
            if path.len() > MAX_PARENT_DEPTH {
                return Err(too_deep(limits, id));
            }
            path.push(limit);
            cursor = limit.parent.as_ref().map(|p| &limits[p]);
        }
        if path.len() - 1 + above.len() > MAX_PARENT_DEPTH {
            return Err(too_deep(limits, id));
        }
        for limit in path.into_iter().rev() {
            done.insert(limit.id.clone(), above.clone().into_boxed_slice());
            above.insert(0, limit.clone());
        }
    }
    Ok(done)
}

/// The refusal of `id`'s chain, past [`MAX_PARENT_DEPTH`]: a cycle longer
/// than that, or too deep (climbed once more, to tell which).
fn too_deep(limits: &HashMap<Arc<str>, Arc<Limit>>, id: &Arc<str>) -> String {
    let mut seen: std::collections::HashSet<&str> = std::collections::HashSet::new();
    let mut cursor = Some(&limits[id]);
    while let Some(limit) = cursor {
        if !seen.insert(&limit.id) {
            return format!("limit {id:?}: parent chain has a cycle");
        }
        cursor = limit.parent.as_ref().map(|p| &limits[p]);
    }
    format!(
        "limit {id:?}: {} parents above it, more than the {MAX_PARENT_DEPTH} allowed",
        seen.len() - 1
    )
}

mod alerts;

#[cfg(test)]
mod tests;
