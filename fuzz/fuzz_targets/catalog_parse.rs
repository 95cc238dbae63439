//! The catalog parser (wire/src/catalog.rs `Catalog::parse`) and the
//! period arithmetic every limit of a parsed catalog is used with.
//!
//! A catalog that parses respects the contract: limit and ad ids 1..=64
//! bytes, every ad lists at least one limit, each once, every listed limit
//! and every parent exists, parent chains end, `limits_above_ad` ends and
//! covers the ad's own limits. Written back as JSON it parses to the same
//! catalog. For every daily limit, the day of an instant taken from the
//! input contains that instant (or is day 0 if the instant's local date is
//! before 1970), and a day chosen by the input starts and
//! ends where its neighbours do (the day's first and last instant are in
//! it, the next day's first is not).
#![no_main]

use std::sync::Arc;

use adspend_wire::catalog::{day_start, local_day, Catalog, Limit, Period};
use adspend_wire::impression::MAX_TS_MS;
use adspend_wire::types::{LIFETIME_BUCKET, MAX_ID_LEN};
use chrono::{DateTime, NaiveDate};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value};

fn id_ok(id: &str) -> bool {
    (1..=MAX_ID_LEN).contains(&id.len())
}

fn to_json(catalog: &Catalog) -> Value {
    let mut limits = Map::new();
    for (id, l) in &catalog.limits {
        let mut spec = json!({
            "budget_micros": l.budget_micros,
            "period": l.period.as_str(),
            "time_zone": l.time_zone.name(),
        });
        if let Some(p) = &l.parent {
            spec["parent"] = json!(&**p);
        }
        limits.insert(id.to_string(), spec);
    }
    let mut ads = Map::new();
    for (ad, ls) in &catalog.ads {
        ads.insert(
            ad.to_string(),
            json!(ls.iter().map(|l| &*l.id).collect::<Vec<_>>()),
        );
    }
    json!({"limits": limits, "ads": ads})
}

/// The instant and the day to check: the document's own top-level `ts` and
/// `day` numbers if it has them (the catalog ignores unknown top-level
/// fields, so the fuzzer can steer them), else a hash of the input.
fn seeds(data: &[u8]) -> (i64, u32) {
    let doc: Value = serde_json::from_slice(data).unwrap_or(Value::Null);
    let hash = data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    });
    let ts = doc.get("ts").and_then(Value::as_i64).unwrap_or(hash as i64);
    let day = doc.get("day").and_then(Value::as_u64).unwrap_or(hash >> 40);
    // The limiter books no event outside 0..=MAX_TS_MS (the line parser's).
    (ts.rem_euclid(MAX_TS_MS + 1), (day % 80_000) as u32)
}

fn check_periods(limit: &Limit, ts: i64, day: u32) {
    let bucket = limit.bucket_of(ts);
    if limit.period == Period::Lifetime {
        assert_eq!(bucket, LIFETIME_BUCKET);
        return;
    }
    let tz = limit.time_zone;
    let now = DateTime::from_timestamp_millis(ts).expect("in range");
    let bounds = limit.period_at(now);
    assert_eq!(bounds.bucket, bucket, "period_at and bucket_of disagree");
    let (start, end) = (bounds.start.expect("daily"), bounds.end.expect("daily"));
    if now.with_timezone(&tz).date_naive() < NaiveDate::from_ymd_opt(1970, 1, 1).expect("date") {
        // West of Greenwich the first hours after the epoch are 1969
        // locally; buckets are unsigned, so they are day 0 (catalog.rs).
        assert_eq!(bucket, 0, "a local date before 1970 is day 0");
        return;
    }
    assert!(
        start <= now && now < end,
        "{} in {}: local day {bucket} is [{start}, {end})",
        now,
        tz.name()
    );
    let start = day_start(tz, day);
    let end = day_start(tz, day + 1);
    assert!(
        start <= end,
        "day {day} in {} ends before it starts",
        tz.name()
    );
    if start < end {
        let first = start.timestamp_millis();
        let last = end.timestamp_millis() - 1;
        assert_eq!(
            local_day(tz, first),
            day,
            "{}: first instant {start} of day {day}",
            tz.name()
        );
        assert_eq!(
            local_day(tz, last),
            day,
            "{}: last instant before {end} of day {day}",
            tz.name()
        );
        assert_ne!(
            local_day(tz, end.timestamp_millis()),
            day,
            "{}: day {day} goes on past the start {end} of the next",
            tz.name()
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(catalog) = Catalog::parse("fuzz", data) else {
        return;
    };
    for (id, limit) in &catalog.limits {
        assert!(id_ok(id), "limit id of {} bytes", id.len());
        assert_eq!(id, &limit.id);
        if let Some(parent) = &limit.parent {
            assert!(
                catalog.limit(parent).is_some(),
                "parent {parent:?} of {id:?} missing"
            );
        }
        let mut cursor = limit.parent.clone();
        let mut steps = 0;
        while let Some(p) = cursor {
            steps += 1;
            assert!(
                steps <= catalog.limits.len(),
                "parent chain of {id:?} does not end"
            );
            cursor = catalog.limits[&p].parent.clone();
        }
    }
    for (ad, limits) in &catalog.ads {
        assert!(id_ok(ad), "ad id of {} bytes", ad.len());
        assert!(!limits.is_empty(), "ad {ad:?} lists no limits");
        for (i, l) in limits.iter().enumerate() {
            assert!(
                catalog.limits.get(&l.id).is_some_and(|c| Arc::ptr_eq(c, l)),
                "ad {ad:?} lists {:?}, not the catalog's",
                l.id
            );
            assert!(
                limits[..i].iter().all(|o| o.id != l.id),
                "ad {ad:?} lists {:?} twice",
                l.id
            );
        }
        let above = catalog.limits_above_ad(ad).expect("known ad");
        assert!(above.len() <= catalog.limits.len());
        for l in limits {
            assert!(above.iter().any(|a| a.id == l.id));
        }
    }
    let written = serde_json::to_vec(&to_json(&catalog)).expect("serializes");
    let reparsed = Catalog::parse("fuzz-written", &written).expect("a written catalog parses");
    assert_eq!(reparsed, catalog, "catalog JSON round trip");

    let (ts, day) = seeds(data);
    for limit in catalog.limits.values() {
        check_periods(limit, ts, day);
    }
});
