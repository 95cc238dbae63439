use std::sync::Arc;

use adspend_wire::catalog::{local_day, Catalog};
use adspend_wire::types::{SumEntry, SumsUpdate, LIFETIME_BUCKET};
use chrono::{DateTime, Utc};

use super::*;

#[test]
fn a_threshold_is_crossed_when_spend_reaches_it() {
    let t = [50, 75, 100, 150];
    assert_eq!(crossed(&t, 1_000, 0), &[] as &[u16]);
    assert_eq!(crossed(&t, 1_000, 499), &[] as &[u16]);
    assert_eq!(crossed(&t, 1_000, 500), &[50]);
    assert_eq!(crossed(&t, 1_000, 749), &[50]);
    assert_eq!(crossed(&t, 1_000, 1_000), &[50, 75, 100]);
    assert_eq!(crossed(&t, 1_000, 10_000), &t);
    // Percent of an odd budget: 50% of 3 micros is 1.5, reached at 2.
    assert_eq!(crossed(&[50], 3, 1), &[] as &[u16]);
    assert_eq!(crossed(&[50], 3, 2), &[50]);
    // No overflow at the extremes; a zero budget is crossed by any spend.
    assert_eq!(crossed(&[1000], u64::MAX, u64::MAX), &[] as &[u16]);
    assert_eq!(crossed(&[100], u64::MAX, u64::MAX), &[100]);
    assert_eq!(crossed(&[1, 1000], 0, 1), &[1, 1000]);
}

fn catalog() -> Catalog {
    Catalog::parse(
        "t",
        br#"{"limits": {
              "day": {"budget_micros": 1000, "period": "daily", "time_zone": "America/New_York",
                      "alerts": [50, 75, 100]},
              "life": {"budget_micros": 200, "period": "lifetime", "alerts": [10, 100]},
              "quiet": {"budget_micros": 10, "period": "lifetime"}},
            "ads": {}}"#,
    )
    .unwrap()
}

fn now() -> DateTime<Utc> {
    "2026-03-10T15:00:00Z".parse().unwrap()
}

fn push(state: &mut SpendState, seq: u64, day_spend: u64, life_spend: u64) {
    let day = local_day(
        "America/New_York".parse().unwrap(),
        now().timestamp_millis(),
    );
    let entry = |limit: &str, bucket, micros| SumEntry {
        limit: limit.into(),
        bucket,
        bucket_micros: micros,
        lifetime_micros: micros,
        lifetime_events: seq,
    };
    let update = SumsUpdate {
        shard: "all".into(),
        epoch: 1,
        seq,
        push_seq: seq,
        full: false,
        watermark_ms: 1,
        source_ms: 1,
        entries: vec![
            entry("day", day, day_spend),
            entry("life", LIFETIME_BUCKET, life_spend),
            entry("quiet", LIFETIME_BUCKET, 1_000),
        ],
    };
    state.apply(&update, now().timestamp_millis());
}

fn thresholds(found: &[(Key, Alert)]) -> Vec<(&str, Option<&str>, u16, u64)> {
    found
        .iter()
        .map(|(_, a)| {
            let start = a.period_start.as_deref();
            (
                a.limit_id.as_str(),
                start,
                a.threshold_percent,
                a.spend_micros,
            )
        })
        .collect()
}

const DAY_START: &str = "2026-03-10T04:00:00.000Z";

#[test]
fn a_pass_finds_each_crossing_once_in_threshold_order() {
    let (catalog, mut state, mut marks) = (catalog(), SpendState::default(), Marks::default());
    push(&mut state, 1, 400, 5);
    assert!(pass(&catalog, &state, &mut marks, now()).is_empty());
    push(&mut state, 2, 800, 20);
    let found = pass(&catalog, &state, &mut marks, now());
    assert_eq!(
        thresholds(&found),
        [
            ("day", Some(DAY_START), 50, 800),
            ("day", Some(DAY_START), 75, 800),
            ("life", None, 10, 20)
        ]
    );
    // Not queued yet (say the queue was full): found again.
    assert_eq!(pass(&catalog, &state, &mut marks, now()).len(), 3);
    for (key, alert) in found {
        marks.queued(key, alert.threshold_percent, 0);
    }
    assert!(pass(&catalog, &state, &mut marks, now()).is_empty());
    push(&mut state, 3, 1_000, 20);
    let found = pass(&catalog, &state, &mut marks, now());
    assert_eq!(thresholds(&found), [("day", Some(DAY_START), 100, 1_000)]);
}

#[test]
fn announced_elsewhere_or_given_up_is_what_marks_say() {
    let (catalog, mut state, mut marks) = (catalog(), SpendState::default(), Marks::default());
    push(&mut state, 1, 900, 200);
    let day: Key = (Arc::from("day"), Some(DAY_START.to_string()));
    // Another pacer announced 75 (and so 50): only 100 of "life" is left… and
    // "life"'s two.
    marks.announced(day.clone(), 75, 0);
    let found = pass(&catalog, &state, &mut marks, now());
    assert_eq!(
        thresholds(&found),
        [("life", None, 10, 200), ("life", None, 100, 200)]
    );
    let life: Key = (Arc::from("life"), None);
    marks.queued(life.clone(), 100, 0);
    assert!(pass(&catalog, &state, &mut marks, now()).is_empty());
    // The announcer gave up: detected again.
    marks.failed(&life);
    assert_eq!(pass(&catalog, &state, &mut marks, now()).len(), 2);
    marks.announced(life, 10, 0);
    assert_eq!(
        thresholds(&pass(&catalog, &state, &mut marks, now())),
        [("life", None, 100, 200)]
    );
}

#[test]
fn yesterday_is_looked_at_too_and_old_marks_are_forgotten() {
    let (catalog, mut state, mut marks) = (catalog(), SpendState::default(), Marks::default());
    push(&mut state, 1, 600, 0);
    // The next day, in New York: "day"'s spend was yesterday's.
    let tomorrow = now() + chrono::Duration::days(1);
    let found = pass(&catalog, &state, &mut marks, tomorrow);
    assert_eq!(thresholds(&found), [("day", Some(DAY_START), 50, 600)]);
    let (key, alert) = found.into_iter().next().unwrap();
    marks.announced(
        key.clone(),
        alert.threshold_percent,
        now().timestamp_millis(),
    );
    // Looked at by each pass, so kept; gone an hour after the last look.
    let later = tomorrow + chrono::Duration::hours(2);
    pass(&catalog, &state, &mut marks, later);
    assert_eq!(marks.get(&key).announced, 50);
    let two_days = now() + chrono::Duration::days(3);
    pass(&catalog, &state, &mut marks, two_days);
    pass(
        &catalog,
        &state,
        &mut marks,
        two_days + chrono::Duration::hours(2),
    );
    assert_eq!(marks.get(&key), Mark::default());
}

#[test]
fn covers_means_same_period_and_at_least_the_threshold() {
    let alert = |period: Option<&str>, t| Alert {
        limit_id: "day".into(),
        period_start: period.map(str::to_string),
        threshold_percent: t,
        spend_micros: 1,
        budget_micros: 1,
        at_ms: 1,
    };
    let last = alert(Some(DAY_START), 75);
    assert!(last.covers(&alert(Some(DAY_START), 50)));
    assert!(last.covers(&alert(Some(DAY_START), 75)));
    assert!(!last.covers(&alert(Some(DAY_START), 100)));
    assert!(!last.covers(&alert(Some("2026-03-11T04:00:00.000Z"), 50)));
    assert!(!last.covers(&alert(None, 50)));
    assert_eq!(
        alert(Some(DAY_START), 50).id(),
        "alert/day/2026-03-10T04:00:00.000Z/50"
    );
    assert_eq!(alert(None, 100).id(), "alert/day/lifetime/100");
}
