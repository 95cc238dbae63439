//! The truth books each impression once, in each limit's local day, and
//! refuses an overflow without booking anything.

use super::*;
use crate::catalog::tests::limit;

fn zoned_catalog() -> Catalog {
    let mut c = Catalog::default();
    let daily = |zone: &str| limit(1_000_000, Period::Daily, zone, None);
    c.limits.insert("ny".into(), daily("America/New_York"));
    c.limits.insert("ktm".into(), daily("Asia/Kathmandu"));
    c.limits.insert("adl".into(), daily("Australia/Adelaide"));
    c.limits.insert("utc".into(), daily("UTC"));
    c.limits.insert(
        "life".into(),
        limit(5, Period::Lifetime, "Asia/Kolkata", None),
    );
    c.ads.insert(
        "ad-all".into(),
        ["ny", "ktm", "adl", "utc", "life"]
            .map(String::from)
            .to_vec(),
    );
    c.ads.insert("ad-ny".into(), vec!["ny".into()]);
    c
}

fn at(rfc3339: &str) -> i64 {
    DateTime::parse_from_rfc3339(rfc3339)
        .unwrap()
        .timestamp_millis()
}

fn impression(id: &str, ad: &str, cost: u64, ts: i64) -> Impression {
    Impression {
        id: id.into(),
        ad_id: ad.into(),
        cost_micros: cost,
        ts,
    }
}

fn daily<'t>(truth: &'t Truth, limit: &str) -> Vec<(&'t str, u64)> {
    truth.limits[limit]
        .daily
        .iter()
        .map(|(d, n)| (d.as_str(), *n))
        .collect()
}

#[test]
fn truth_books_each_impression_once_in_each_limits_local_day() {
    let mut truth = TruthBuilder::new(&zoned_catalog()).unwrap();
    let events = [
        // 01:30 EST in New York, the night clocks go forward.
        impression("e1", "ad-all", 1, at("2026-03-08T06:30:00Z")),
        // 23:59:59.999 EST on the 7th.
        impression("e2", "ad-ny", 10, at("2026-03-08T04:59:59.999Z")),
        // 23:59 EDT on the 8th: the offset changed during the day.
        impression("e3", "ad-ny", 100, at("2026-03-09T03:59:00Z")),
        impression("e4", "ad-ny", 1000, at("2026-03-09T04:00:00Z")),
        // Kathmandu (+05:45) and Adelaide (+10:30 in January) midnights.
        impression("k1", "ad-all", 10_000, at("2026-01-14T18:14:59.999Z")),
        impression("k2", "ad-all", 100_000, at("2026-01-14T18:15:00Z")),
        impression("a1", "ad-all", 1_000_000, at("2026-01-14T13:29:59Z")),
    ];
    for event in &events {
        assert_eq!(truth.record(event).unwrap(), Recorded::Counted, "{event:?}");
    }
    // A verbatim duplicate and a same-id re-send with other values both
    // count once, as the first.
    assert_eq!(truth.record(&events[0]).unwrap(), Recorded::Duplicate);
    let imposter = impression("e1", "ad-ny", 7, at("2026-03-10T12:00:00Z"));
    assert_eq!(truth.record(&imposter).unwrap(), Recorded::Duplicate);
    // Bad ones are not booked.
    let unknown = impression("u1", "ad-missing", 5, at("2026-03-08T06:30:00Z"));
    assert_eq!(
        truth.record(&unknown).unwrap(),
        Recorded::Rejected(BadKind::UnknownAd)
    );
    let long = impression(&"x".repeat(65), "ad-ny", 5, at("2026-03-08T06:30:00Z"));
    assert_eq!(
        truth.record(&long).unwrap(),
        Recorded::Rejected(BadKind::IdTooLong)
    );
    let empty = impression("", "ad-ny", 5, at("2026-03-08T06:30:00Z"));
    assert_eq!(
        truth.record(&empty).unwrap(),
        Recorded::Rejected(BadKind::IdTooLong)
    );
    assert_eq!(truth.unique_events(), 7);

    let truth = truth.finish(Default::default());
    assert_eq!(truth.stats.unique_events, 7);
    assert_eq!(
        daily(&truth, "ny"),
        [
            ("2026-01-14", 1_110_000), // k1, k2, a1 are all on the 14th in New York
            ("2026-03-07", 10),
            ("2026-03-08", 101),
            ("2026-03-09", 1000),
        ]
    );
    assert_eq!(
        daily(&truth, "ktm"),
        [
            ("2026-01-14", 1_010_000),
            ("2026-01-15", 100_000),
            ("2026-03-08", 1)
        ]
    );
    // 13:29:59 UTC is 23:59:59 in Adelaide; the Kathmandu midnights are after
    // Adelaide's, on the 15th.
    assert_eq!(
        daily(&truth, "adl"),
        [
            ("2026-01-14", 1_000_000),
            ("2026-01-15", 110_000),
            ("2026-03-08", 1)
        ]
    );
    assert_eq!(
        daily(&truth, "utc"),
        [("2026-01-14", 1_110_000), ("2026-03-08", 1)]
    );
    assert_eq!(truth.limits["ny"].lifetime_micros, 1_111_111);
    assert_eq!(truth.limits["life"].lifetime_micros, 1_110_001);
    assert!(truth.limits["life"].daily.is_empty());

    let json = serde_json::to_value(&truth).unwrap();
    assert!(json["limits"]["life"].get("daily").is_none(), "{json}");
    assert_eq!(json["limits"]["ny"]["daily"]["2026-03-08"], 101);
    assert_eq!(serde_json::from_value::<Truth>(json).unwrap(), truth);
}

#[test]
fn truth_overflow_is_an_error_and_books_nothing() {
    let mut truth = TruthBuilder::new(&zoned_catalog()).unwrap();
    let ts = at("2026-03-08T06:30:00Z");
    truth
        .record(&impression("a", "ad-all", u64::MAX - 1, ts))
        .unwrap();
    // "life" is listed last: the earlier limits must not have been changed.
    assert!(truth.record(&impression("b", "ad-all", 2, ts)).is_err());
    let truth = truth.finish(Default::default());
    assert_eq!(truth.limits["ny"].lifetime_micros, u64::MAX - 1);
    assert_eq!(truth.stats.unique_events, 1);
}

#[test]
fn differences_name_the_limits_that_differ() {
    let mut expected = BTreeMap::new();
    expected.insert(
        "campaign-1".to_owned(),
        LimitTruth {
            lifetime_micros: 5,
            daily: BTreeMap::from([("2026-01-01".to_owned(), 5)]),
        },
    );
    expected.insert("adset-1".to_owned(), LimitTruth::default());
    let mut actual = expected.clone();
    assert_eq!(differences(&expected, &actual), None);
    // Missing on one side is the same as all zeros.
    actual.remove("adset-1");
    assert_eq!(differences(&expected, &actual), None);

    actual.get_mut("campaign-1").unwrap().daily.clear();
    actual.insert(
        "ghost".to_owned(),
        LimitTruth {
            lifetime_micros: 1,
            daily: BTreeMap::new(),
        },
    );
    let mismatch = differences(&expected, &actual).unwrap();
    assert!(mismatch.starts_with("2 limits differ"), "{mismatch}");
    assert!(
        mismatch.contains("campaign-1") && mismatch.contains("ghost"),
        "{mismatch}"
    );
    assert!(!mismatch.contains("adset-1"), "{mismatch}");
}

#[test]
fn local_dates_follow_each_zone_across_midnight_and_dst() {
    let date = |zone: &str, rfc3339: &str| {
        day_key(local_date(zone.parse().unwrap(), at(rfc3339)).unwrap())
    };
    // The New York day of the spring-forward night runs 05:00Z..04:00Z.
    assert_eq!(
        date("America/New_York", "2026-03-08T04:59:59.999Z"),
        "2026-03-07"
    );
    assert_eq!(
        date("America/New_York", "2026-03-08T05:00:00Z"),
        "2026-03-08"
    );
    assert_eq!(
        date("America/New_York", "2026-03-09T03:59:59Z"),
        "2026-03-08"
    );
    assert_eq!(date("Asia/Kathmandu", "2026-01-14T18:15:00Z"), "2026-01-15");
    assert_eq!(date("UTC", "1969-12-31T23:59:59.999Z"), "1969-12-31");
    assert!(local_date(chrono_tz::UTC, i64::MAX).is_err());
}
