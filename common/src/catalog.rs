//! The catalog: which budget limits each ad spends against, and the budgets.
//!
//! Parsing validates everything up front (ids, references, cycles, time
//! zones) so the services never meet a half-valid catalog. Period arithmetic
//! lives here too, because the limiter books spend to a period bucket and the
//! pacer must agree on which bucket is current.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use chrono::{DateTime, Datelike, LocalResult, NaiveDate, NaiveDateTime, TimeZone, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::types::{Micros, LIFETIME_BUCKET, MAX_ID_LEN};

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

/// A validated catalog.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Catalog {
    pub limits: HashMap<Arc<str>, Arc<Limit>>,
    /// Limits each ad spends against, in catalog order.
    pub ads: HashMap<Arc<str>, Vec<Arc<Limit>>>,
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
            let id: Arc<str> = Arc::from(id.as_str());
            limits.insert(
                id.clone(),
                Arc::new(Limit {
                    id,
                    budget_micros: spec.budget_micros,
                    period: spec.period,
                    time_zone,
                    parent: spec.parent.as_deref().map(Arc::from),
                }),
            );
        }
        // Parent chains must end: walk each chain at most |limits| steps.
        for limit in limits.values() {
            let mut cursor = limit.parent.clone();
            let mut steps = 0;
            while let Some(parent) = cursor {
                steps += 1;
                if steps > limits.len() {
                    return Err(format!("limit {:?}: parent chain has a cycle", limit.id));
                }
                cursor = limits[&parent].parent.clone();
            }
        }
        let mut ads = HashMap::with_capacity(raw.ads.len());
        for (ad, ids) in raw.ads {
            check_id("ad", &ad)?;
            if ids.is_empty() {
                return Err(format!("ad {ad:?} lists no limits"));
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
            ads.insert(Arc::from(ad.as_str()), resolved);
        }
        Ok(Catalog { limits, ads })
    }

    pub fn limit(&self, id: &str) -> Option<&Arc<Limit>> {
        self.limits.get(id)
    }

    /// The limits an ad spends against, or `None` for an unknown ad.
    pub fn limits_of_ad(&self, ad_id: &str) -> Option<&[Arc<Limit>]> {
        self.ads.get(ad_id).map(Vec::as_slice)
    }

    /// Every limit above an ad: its own limits and all their ancestors,
    /// each once.
    pub fn limits_above_ad(&self, ad_id: &str) -> Option<Vec<Arc<Limit>>> {
        let direct = self.limits_of_ad(ad_id)?;
        let mut out: Vec<Arc<Limit>> = Vec::with_capacity(direct.len() + 2);
        for limit in direct {
            let mut cursor = Some(limit.clone());
            while let Some(l) = cursor {
                if out.iter().any(|seen| seen.id == l.id) {
                    break;
                }
                cursor = l.parent.as_ref().and_then(|p| self.limits.get(p)).cloned();
                out.push(l);
            }
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const EXAMPLE: &str = r#"{
      "limits": {
        "campaign-1": {"budget_micros": 100000000, "period": "daily", "time_zone": "America/New_York"},
        "adset-7":    {"budget_micros": 20000000,  "period": "lifetime", "parent": "campaign-1"}
      },
      "ads": {"ad-1": ["adset-7", "campaign-1"]}
    }"#;

    fn err_of(json: &str) -> String {
        Catalog::parse("test.json", json.as_bytes())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn parses_the_contract_example() {
        let catalog = Catalog::parse("example", EXAMPLE.as_bytes()).unwrap();
        let ad = catalog.limits_of_ad("ad-1").unwrap();
        assert_eq!(ad.len(), 2);
        assert_eq!(&*ad[0].id, "adset-7");
        assert_eq!(ad[1].time_zone, chrono_tz::America::New_York);
        assert_eq!(catalog.limit("adset-7").unwrap().time_zone, Tz::UTC);
        assert_eq!(catalog.limits_above_ad("ad-1").unwrap().len(), 2);
    }

    #[test]
    fn rejects_bad_documents_with_a_reason() {
        assert!(err_of("{").contains("test.json"));
        assert!(
            err_of(r#"{"limits":{"a":{"budget_micros":-1,"period":"daily"}}}"#)
                .contains("invalid value")
        );
        assert!(
            err_of(r#"{"limits":{"a":{"budget_micros":1.5,"period":"daily"}}}"#)
                .contains("invalid type")
        );
        assert!(
            err_of(r#"{"limits":{"a":{"budget_micros":1,"period":"weekly"}}}"#)
                .contains("unknown variant")
        );
        assert!(err_of(
            r#"{"limits":{"a":{"budget_micros":1,"period":"daily","time_zone":"Mars/Base"}}}"#
        )
        .contains("unknown time zone"));
        assert!(
            err_of(r#"{"limits":{"a":{"budget_micros":1,"period":"daily","parent":"b"}}}"#)
                .contains("parent \"b\" is not a limit")
        );
        assert!(err_of(
            r#"{"limits":{"a":{"budget_micros":1,"period":"daily","parent":"b"},
                           "b":{"budget_micros":1,"period":"daily","parent":"a"}}}"#
        )
        .contains("cycle"));
        assert!(err_of(
            r#"{"limits":{"a":{"budget_micros":1,"period":"daily"}},"ads":{"x":["b"]}}"#
        )
        .contains("limit \"b\" is not in"));
        assert!(
            err_of(r#"{"limits":{"a":{"budget_micros":1,"period":"daily"}},"ads":{"x":[]}}"#)
                .contains("lists no limits")
        );
        let long = "l".repeat(65);
        assert!(err_of(&format!(
            r#"{{"limits":{{"{long}":{{"budget_micros":1,"period":"daily"}}}}}}"#
        ))
        .contains("1..=64 bytes"));
    }

    #[test]
    fn daily_bucket_follows_the_time_zone() {
        let ny = chrono_tz::America::New_York;
        // 2026-03-08 06:30 UTC is 01:30 EST on 2026-03-08 in New York.
        let ts = Utc.with_ymd_and_hms(2026, 3, 8, 6, 30, 0).unwrap();
        let day = local_day(ny, ts.timestamp_millis());
        assert_eq!(bucket_date(day).unwrap().to_string(), "2026-03-08");
        // 04:30 UTC is still 2026-03-07 in New York.
        let ts = Utc.with_ymd_and_hms(2026, 3, 8, 4, 30, 0).unwrap();
        assert_eq!(
            bucket_date(local_day(ny, ts.timestamp_millis()))
                .unwrap()
                .to_string(),
            "2026-03-07"
        );
    }

    #[test]
    fn dst_days_are_23_and_25_hours_long() {
        let ny = chrono_tz::America::New_York;
        let spring = local_day(
            ny,
            Utc.with_ymd_and_hms(2026, 3, 8, 12, 0, 0)
                .unwrap()
                .timestamp_millis(),
        );
        let autumn = local_day(
            ny,
            Utc.with_ymd_and_hms(2026, 11, 1, 12, 0, 0)
                .unwrap()
                .timestamp_millis(),
        );
        let hours = |b: u32| (day_start(ny, b + 1) - day_start(ny, b)).num_hours();
        assert_eq!(hours(spring), 23);
        assert_eq!(hours(autumn), 25);
        // Quarter-hour offset: Kathmandu (+05:45) days start at hh:15 UTC.
        let kathmandu = chrono_tz::Asia::Kathmandu;
        let b = local_day(
            kathmandu,
            Utc.with_ymd_and_hms(2026, 6, 1, 0, 0, 0)
                .unwrap()
                .timestamp_millis(),
        );
        assert_eq!(
            day_start(kathmandu, b + 1)
                .timestamp_millis()
                .rem_euclid(3_600_000),
            15 * 60_000
        );
    }

    /// Found by fuzzing (fuzz target catalog_parse): on a day a zone skipped
    /// altogether, the previous day's end fell back to UTC midnight, so
    /// events still in that day (local time) were outside its bounds. Also
    /// a jump at midnight that is not a whole quarter hour started the day
    /// late.
    #[test]
    fn skipped_days_and_odd_jumps_at_midnight() {
        let apia = chrono_tz::Pacific::Apia;
        let utc = |s: &str| s.parse::<DateTime<Utc>>().unwrap();
        // 2011-12-29 19:00 in Apia (-10:00); the zone then went to +14:00
        // and 2011-12-30 never happened there.
        let now = utc("2011-12-30T05:00:00Z");
        let limit = Limit {
            id: Arc::from("l"),
            budget_micros: 1,
            period: Period::Daily,
            time_zone: apia,
            parent: None,
        };
        let bounds = limit.period_at(now);
        assert_eq!(
            bucket_date(bounds.bucket).unwrap().to_string(),
            "2011-12-29"
        );
        assert_eq!(bounds.start.unwrap(), utc("2011-12-29T10:00:00Z"));
        assert_eq!(bounds.end.unwrap(), utc("2011-12-30T10:00:00Z"));
        assert!(bounds.start.unwrap() <= now && now < bounds.end.unwrap());
        // The skipped day starts and ends where 2011-12-31 starts.
        let skipped = bounds.bucket + 1;
        assert_eq!(day_start(apia, skipped), day_start(apia, skipped + 1));
        assert_eq!(
            local_day(apia, bounds.end.unwrap().timestamp_millis()),
            skipped + 1
        );

        // Africa/Monrovia went from -0:44:30 to +0:00 at midnight on
        // 1972-01-07: that day began at 00:44:30.
        let monrovia = chrono_tz::Africa::Monrovia;
        let jan7 = local_day(monrovia, utc("1972-01-07T12:00:00Z").timestamp_millis());
        assert_eq!(day_start(monrovia, jan7), utc("1972-01-07T00:44:30Z"));
        let last_of_jan6 = utc("1972-01-07T00:44:29.999Z").timestamp_millis();
        assert_eq!(local_day(monrovia, last_of_jan6), jan7 - 1);
    }

    /// Found by fuzzing (fuzz target catalog_parse): the doc said a local
    /// date could not precede 1970; it can, and is booked to day 0.
    #[test]
    fn local_dates_before_1970_are_day_0() {
        let sao_paulo = chrono_tz::America::Sao_Paulo;
        assert_eq!(local_day(sao_paulo, 17), 0);
        assert_eq!(local_day(sao_paulo, 3 * 3_600_000 - 1), 0);
        assert_eq!(local_day(sao_paulo, 27 * 3_600_000), 1);
        assert_eq!(local_day(Tz::UTC, 0), 0);
    }

    /// (limits as (id, budget, daily?, parent pick), ads as limit picks).
    type CatalogShape = (Vec<(String, u64, bool, Option<usize>)>, Vec<Vec<usize>>);

    fn arb_catalog() -> impl Strategy<Value = CatalogShape> {
        let limits = prop::collection::vec(
            (
                "[a-z0-9-]{1,64}",
                any::<u64>(),
                any::<bool>(),
                any::<Option<usize>>(),
            ),
            1..20,
        );
        let ads = prop::collection::vec(prop::collection::vec(any::<usize>(), 1..4), 0..20);
        (limits, ads)
    }

    proptest! {
        /// Any catalog whose parents point strictly backwards is accepted, and
        /// every ad resolves to the limits it names.
        #[test]
        fn generated_catalogs_validate((limits, ads) in arb_catalog()) {
            let mut ids: Vec<String> = Vec::new();
            let mut doc_limits = serde_json::Map::new();
            for (i, (id, budget, daily, parent)) in limits.iter().enumerate() {
                if ids.contains(id) { continue; }
                let mut spec = serde_json::json!({"budget_micros": budget, "period": if *daily {"daily"} else {"lifetime"}, "time_zone": "Asia/Kolkata"});
                if let Some(p) = parent.filter(|_| i > 0).map(|p| p % ids.len().max(1)) {
                    if !ids.is_empty() { spec["parent"] = serde_json::json!(ids[p]); }
                }
                doc_limits.insert(id.clone(), spec);
                ids.push(id.clone());
            }
            let mut doc_ads = serde_json::Map::new();
            for (n, picks) in ads.iter().enumerate() {
                let mut chosen: Vec<String> = Vec::new();
                for p in picks { let id = &ids[p % ids.len()]; if !chosen.contains(id) { chosen.push(id.clone()); } }
                doc_ads.insert(format!("ad-{n}"), serde_json::json!(chosen));
            }
            let doc = serde_json::json!({"limits": doc_limits, "ads": doc_ads});
            let catalog = Catalog::parse("prop", doc.to_string().as_bytes()).unwrap();
            prop_assert_eq!(catalog.limits.len(), ids.len());
            for (n, picks) in ads.iter().enumerate() {
                let resolved = catalog.limits_of_ad(&format!("ad-{n}")).unwrap();
                prop_assert!(!resolved.is_empty() && resolved.len() <= picks.len());
                let above = catalog.limits_above_ad(&format!("ad-{n}")).unwrap();
                prop_assert!(above.len() >= resolved.len());
            }
        }

        /// Every instant falls in exactly the bucket whose bounds contain it.
        #[test]
        fn instant_is_inside_its_period(ts in 0i64..4_102_444_800_000, zone in 0usize..6) {
            let zones = [Tz::UTC, chrono_tz::America::New_York, chrono_tz::Asia::Kolkata,
                         chrono_tz::Asia::Kathmandu, chrono_tz::Australia::Lord_Howe, chrono_tz::America::Santiago];
            let limit = Limit { id: Arc::from("l"), budget_micros: 1, period: Period::Daily, time_zone: zones[zone], parent: None };
            let now = DateTime::<Utc>::from_timestamp_millis(ts).unwrap();
            let bounds = limit.period_at(now);
            prop_assert!(bounds.start.unwrap() <= now && now < bounds.end.unwrap());
            prop_assert_eq!(bounds.bucket, limit.bucket_of(ts));
        }
    }
}
