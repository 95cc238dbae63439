//! A server's lease book, and the JSON of `POST /v1/leases` against the
//! contract's shapes.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

const UNIT: u64 = 1_000_000;
const T0: i64 = 1_800_000_000_000;

fn policy() -> LeasePolicy {
    LeasePolicy {
        ttl: Duration::from_secs(10),
        margin: Duration::from_secs(1),
        ask_share: 0.5,
        release: true,
    }
}

/// Costs of one unit to two units; renewals 200 ms ahead.
fn book(ads: usize) -> LeaseBook {
    let cost = CostDistribution::Uniform {
        min: UNIT,
        max: 2 * UNIT,
    };
    LeaseBook::new(policy(), &cost, ads, Duration::from_millis(200))
}

fn grant(ad: &str, id: Option<&str>, micros: u64, expires_at_ms: i64) -> LeaseGrant {
    LeaseGrant {
        ad_id: ad.to_owned(),
        lease_id: id.map(str::to_owned),
        granted_micros: micros,
        expires_at_ms,
    }
}

#[test]
fn a_server_never_serves_beyond_its_grant() {
    let mut b = book(1);
    let g = grant("ad-1", Some("L1"), 5 * UNIT, T0 + 10_000);
    assert_eq!(b.grant(0, 6 * UNIT, &g, T0), Ok(Granted::Lease(5 * UNIT)));
    assert_eq!(b.spend(0, 2 * UNIT, T0).as_deref(), Some("\"L1\""));
    assert_eq!(b.spend(0, 2 * UNIT, T0 + 1).as_deref(), Some("\"L1\""));
    // One unit left: a two-unit impression does not fit, a one-unit one does.
    assert_eq!(b.spend(0, 2 * UNIT, T0 + 2), None);
    assert_eq!(b.spend(0, UNIT, T0 + 3).as_deref(), Some("\"L1\""));
    assert_eq!(b.spend(0, 1, T0 + 4), None);
    // Zero-cost impressions still need a live lease, and take nothing.
    assert_eq!(b.spend(0, 0, T0 + 5).as_deref(), Some("\"L1\""));
}

#[test]
fn a_server_never_serves_within_the_margin_of_the_expiry() {
    let mut b = book(1);
    let expires = T0 + 10_000;
    b.grant(
        0,
        100 * UNIT,
        &grant("ad-1", Some("L1"), 100 * UNIT, expires),
        T0,
    )
    .unwrap();
    // The margin is one second by the server's clock.
    assert!(b.spend(0, UNIT, expires - 1_001).is_some());
    assert_eq!(b.spend(0, UNIT, expires - 1_000), None);
    assert_eq!(b.spend(0, UNIT, expires + 5_000), None);
    // An ad without a lease serves nothing.
    assert_eq!(book(1).spend(0, 0, T0), None);
}

#[test]
fn an_expired_lease_is_let_go_and_leased_again() {
    let mut b = book(1);
    let expires = T0 + 10_000;
    b.note_requests(0, 1, T0);
    b.grant(
        0,
        100 * UNIT,
        &grant("ad-1", Some("L1"), 100 * UNIT, expires),
        T0,
    )
    .unwrap();
    assert_eq!(b.spend(0, UNIT, expires), None);
    assert!(b.ask(0, true, expires).is_some());
    b.grant(
        0,
        2 * UNIT,
        &grant("ad-1", Some("L2"), 2 * UNIT, expires + 10_000),
        expires,
    )
    .unwrap();
    assert_eq!(b.spend(0, UNIT, expires + 1).as_deref(), Some("\"L2\""));
}

#[test]
fn a_server_asks_again_when_its_lease_runs_low_or_nears_its_end() {
    let mut b = book(1);
    b.note_requests(0, 1, T0);
    assert!(b.ask(0, true, T0).is_some(), "no lease: ask");
    let expires = T0 + 10_000;
    b.grant(
        0,
        10 * UNIT,
        &grant("ad-1", Some("L1"), 10 * UNIT, expires),
        T0,
    )
    .unwrap();
    assert_eq!(b.ask(0, true, T0), None, "plenty left, far from the end");
    // Below the highest cost (two units): one more impression may not fit.
    for _ in 0..9 {
        b.spend(0, UNIT, T0 + 1).unwrap();
    }
    assert!(b.ask(0, true, T0 + 1).is_some(), "low: ask");

    let mut b = book(1);
    b.note_requests(0, 1, T0);
    b.grant(
        0,
        10 * UNIT,
        &grant("ad-1", Some("L1"), 10 * UNIT, expires),
        T0,
    )
    .unwrap();
    // Usable until expires - 1000; renewed 200 ms before that.
    assert_eq!(b.ask(0, true, expires - 1_201), None);
    assert!(
        b.ask(0, true, expires - 1_200).is_some(),
        "near its end: ask"
    );
}

#[test]
fn an_ask_covers_the_expected_spend_over_part_of_the_ttl_and_one_costly_impression() {
    let mut b = book(2);
    // Nothing seen yet: the highest cost, once.
    assert_eq!(b.ask(0, true, T0), Some(2 * UNIT));
    // 100 requests a second for three seconds, a unit and a half each.
    for i in 1..=30 {
        b.note_requests(0, 10, T0 + i * 100);
        b.note_cost(UNIT);
        b.note_cost(2 * UNIT);
    }
    let now = T0 + 3_000;
    let rate = b.ads[0].rate_at(now);
    assert!((70.0..=100.0).contains(&rate), "{rate} requests/s");
    // Half of the usable 9 s: 4.5 s of spend at that rate.
    let want = (rate * (1.5 * UNIT as f64) * 4.5).ceil() as u64;
    assert_eq!(b.ask(0, true, now), Some(want));
    // A rarely requested ad asks for one impression at the highest cost,
    // and is not leased ahead without a request.
    b.note_requests(1, 1, T0);
    assert_eq!(b.ask(1, true, now), Some(2 * UNIT));
    assert_eq!(b.ask(1, false, now), None);
    // A busy one is leased ahead of its requests.
    assert!(b.ask(0, false, now).is_some());
}

#[test]
fn a_zero_grant_keeps_what_the_ad_held_and_backs_off() {
    let mut b = book(1);
    b.note_requests(0, 1, T0);
    b.grant(
        0,
        2 * UNIT,
        &grant("ad-1", Some("L1"), 2 * UNIT, T0 + 10_000),
        T0,
    )
    .unwrap();
    b.spend(0, UNIT, T0).unwrap();
    assert!(b.ask(0, true, T0).is_some());
    assert_eq!(
        b.grant(0, 2 * UNIT, &grant("ad-1", None, 0, T0 + 10_000), T0),
        Ok(Granted::Zero)
    );
    assert_eq!(b.spend(0, UNIT, T0 + 1).as_deref(), Some("\"L1\""));
    assert_eq!(b.ask(0, true, T0 + 499), None, "backing off");
    assert!(b.ask(0, true, T0 + 500).is_some());
    b.grant(0, 2 * UNIT, &grant("ad-1", None, 0, T0 + 10_000), T0 + 500)
        .unwrap();
    assert_eq!(b.ask(0, true, T0 + 1_499), None, "twice as long");
    assert!(b.ask(0, true, T0 + 1_500).is_some());
}

#[test]
fn grants_that_break_the_contract_are_refused_and_change_nothing() {
    let mut b = book(1);
    let over = grant("ad-1", Some("L1"), 3 * UNIT, T0 + 10_000);
    assert!(b.grant(0, 2 * UNIT, &over, T0).is_err());
    let no_id = grant("ad-1", None, UNIT, T0 + 10_000);
    assert!(b.grant(0, 2 * UNIT, &no_id, T0).is_err());
    assert_eq!(b.spend(0, 0, T0), None);
}

#[test]
fn a_new_grant_keeps_the_replaced_lease_and_spends_it_first() {
    let mut b = book(1);
    let g1 = grant("ad-1", Some("L1"), 3 * UNIT, T0 + 10_000);
    b.grant(0, 3 * UNIT, &g1, T0).unwrap();
    b.spend(0, UNIT, T0).unwrap();
    let g2 = grant("ad-1", Some("L2"), 3 * UNIT, T0 + 20_000);
    b.grant(0, 3 * UNIT, &g2, T0).unwrap();
    // L1's two units go first; an impression L1 cannot pay takes L2's.
    assert_eq!(b.spend(0, UNIT, T0).as_deref(), Some("\"L1\""));
    assert_eq!(b.spend(0, 2 * UNIT, T0).as_deref(), Some("\"L2\""));
    assert_eq!(b.spend(0, UNIT, T0).as_deref(), Some("\"L1\""));
    assert_eq!(b.spend(0, UNIT, T0).as_deref(), Some("\"L2\""));
    assert_eq!(b.spend(0, 1, T0), None, "both spent");
    // A third grant lets the first go: two leases at most.
    let mut b = book(1);
    for (i, at) in [(1, 10_000), (2, 20_000), (3, 30_000)] {
        let id = format!("L{i}");
        b.grant(
            0,
            3 * UNIT,
            &grant("ad-1", Some(&id), 3 * UNIT, T0 + at),
            T0,
        )
        .unwrap();
    }
    for _ in 0..6 {
        assert_ne!(b.spend(0, UNIT, T0).as_deref(), Some("\"L1\""));
    }
    assert_eq!(b.spend(0, UNIT, T0), None);
}

#[test]
fn the_older_lease_stops_paying_at_its_usable_end_and_counts_toward_low_water() {
    let mut b = book(1);
    b.note_requests(0, 1, T0);
    b.grant(
        0,
        9 * UNIT,
        &grant("ad-1", Some("L1"), 9 * UNIT, T0 + 5_000),
        T0,
    )
    .unwrap();
    b.grant(0, UNIT, &grant("ad-1", Some("L2"), UNIT, T0 + 20_000), T0)
        .unwrap();
    // L2 alone is below the highest cost, but with L1's nine units the ad
    // has enough: no ask.
    assert_eq!(b.ask(0, true, T0), None);
    // Past L1's usable end (expiry less the one-second margin) L2 pays,
    // and the ad is low.
    assert_eq!(b.spend(0, UNIT, T0 + 4_000).as_deref(), Some("\"L2\""));
    assert!(b.ask(0, true, T0 + 4_000).is_some());
}

fn release(id: &str, served: u64) -> LeaseRelease {
    LeaseRelease {
        lease_id: id.into(),
        served_micros: served,
    }
}

#[test]
fn a_lease_let_go_with_something_left_is_released_with_what_it_served() {
    let mut b = book(2);
    let g = |id, micros, expires| grant("ad", Some(id), micros, expires);
    b.grant(0, 9 * UNIT, &g("L1", 9 * UNIT, T0 + 10_000), T0)
        .unwrap();
    b.grant(1, 4 * UNIT, &g("M1", 4 * UNIT, T0 + 10_000), T0)
        .unwrap();
    b.spend(0, 2 * UNIT, T0).unwrap();
    b.spend(1, 4 * UNIT, T0).unwrap();
    assert_eq!(b.take_releases(T0 + 8_999), vec![]);
    // L1's usable end (one second before its expiry) passes: released with
    // the 2 units it served. M1, spent to the end, needs no release.
    assert_eq!(b.take_releases(T0 + 9_000), vec![release("L1", 2 * UNIT)]);
    assert_eq!(b.take_releases(T0 + 9_500), vec![]);
    assert_eq!(b.spend(0, UNIT, T0 + 9_500), None, "L1 is gone");
    // A third grant lets the first of the ad's pair go: released too.
    b.grant(0, 3 * UNIT, &g("L2", 3 * UNIT, T0 + 20_000), T0 + 9_500)
        .unwrap();
    b.grant(0, 3 * UNIT, &g("L3", 3 * UNIT, T0 + 20_000), T0 + 9_600)
        .unwrap();
    b.spend(0, UNIT, T0 + 9_700).unwrap();
    b.grant(0, 3 * UNIT, &g("L4", 3 * UNIT, T0 + 20_000), T0 + 9_800)
        .unwrap();
    assert_eq!(b.take_releases(T0 + 9_800), vec![release("L2", UNIT)]);
    // One let go by spend() at its usable end is released as well.
    assert_eq!(b.spend(0, UNIT, T0 + 19_000), None);
    assert_eq!(
        b.take_releases(T0 + 19_000),
        vec![release("L3", 0), release("L4", 0)]
    );
}

#[test]
fn a_book_that_does_not_release_lets_go_silently() {
    let mut b = LeaseBook::new(
        LeasePolicy {
            release: false,
            ..policy()
        },
        &CostDistribution::Uniform { min: 1, max: 2 },
        1,
        Duration::from_millis(200),
    );
    b.grant(0, 9, &grant("ad", Some("L1"), 9, T0 + 10_000), T0)
        .unwrap();
    assert_eq!(b.take_releases(T0 + 60_000), vec![]);
    assert_eq!(b.spend(0, 1, T0 + 60_000), None);
    assert_eq!(
        ServeMode::Leases(LeasePolicy {
            release: false,
            ..policy()
        })
        .name(),
        "leases unreleased"
    );
}

#[test]
fn the_release_request_is_the_contract_s_json() {
    let body = ReleaseRequest {
        leases: &[release("a.1.0", 5)],
    };
    assert_eq!(
        serde_json::to_value(&body).unwrap(),
        serde_json::json!({"leases": [{"lease_id": "a.1.0", "served_micros": 5}]})
    );
    let answer: ReleaseResponse = serde_json::from_str(
        r#"{"leases": [{"lease_id": "a.1.0", "released": false, "held_micros": 0}]}"#,
    )
    .unwrap();
    assert!(!answer.leases[0].released);
}

#[test]
fn asks_put_waiting_requests_first_and_stop_at_the_batch() {
    let mut b = book(4);
    for ad in 0..4 {
        b.note_requests(ad, 1 + 10 * u64::from(ad), T0);
    }
    // Ad 3 holds a live lease that is running low; 0..=2 hold none.
    b.grant(
        3,
        2 * UNIT,
        &grant("ad-4", Some("L"), 2 * UNIT, T0 + 10_000),
        T0,
    )
    .unwrap();
    b.spend(3, UNIT, T0).unwrap();
    let all = b.asks(&[0, 1, 3], 10, T0);
    assert_eq!(all.iter().map(|a| a.0).collect::<Vec<_>>(), [0, 1, 2, 3]);
    // Two at most: the two waiting requests without a lease.
    let two = b.asks(&[0, 1, 3], 2, T0);
    assert_eq!(two.iter().map(|a| a.0).collect::<Vec<_>>(), [0, 1]);
}

#[test]
fn the_lease_request_is_the_contract_s_json() {
    let request = LeaseRequest {
        ads: vec![
            LeaseAsk {
                ad_id: "ad-1",
                micros: 2_000_000,
            },
            LeaseAsk {
                ad_id: "ad-\"2",
                micros: 1,
            },
        ],
        ttl_ms: 30_000,
    };
    assert_eq!(
        serde_json::to_value(&request).unwrap(),
        serde_json::json!({
            "ads": [
                {"ad_id": "ad-1", "micros": 2_000_000},
                {"ad_id": "ad-\"2", "micros": 1}
            ],
            "ttl_ms": 30_000
        })
    );
}

#[test]
fn the_lease_answer_is_read_as_the_contract_writes_it() {
    let body = r#"{"leases": [
        {"ad_id": "ad-1", "lease_id": "01J9Z", "granted_micros": 1500000, "expires_at_ms": 1800000030000},
        {"ad_id": "ad-2", "granted_micros": 0, "expires_at_ms": 1800000030000, "reason": "exhausted"}
    ]}"#;
    let answer: LeaseResponse = serde_json::from_str(body).unwrap();
    assert_eq!(
        answer.leases,
        [
            grant("ad-1", Some("01J9Z"), 1_500_000, 1_800_000_030_000),
            grant("ad-2", None, 0, 1_800_000_030_000)
        ]
    );
    // A grant without its amount or expiry is not an answer.
    assert!(serde_json::from_str::<LeaseResponse>(
        r#"{"leases": [{"ad_id": "ad-1", "lease_id": "x", "expires_at_ms": 1}]}"#
    )
    .is_err());
}

#[test]
fn a_lease_id_reaches_the_impression_as_a_json_string() {
    let mut b = book(1);
    let g = grant("ad-1", Some("we\"ird\\id"), UNIT, T0 + 10_000);
    b.grant(0, UNIT, &g, T0).unwrap();
    let id = b.spend(0, UNIT, T0).unwrap();
    assert_eq!(serde_json::from_str::<String>(&id).unwrap(), "we\"ird\\id");
}

#[test]
fn lease_policies_are_checked() {
    LeasePolicy::default().validate().unwrap();
    policy().validate().unwrap();
    for bad in [
        LeasePolicy {
            ttl: Duration::from_millis(999),
            margin: Duration::ZERO,
            ..policy()
        },
        LeasePolicy {
            ttl: Duration::from_millis(600_001),
            ..policy()
        },
        LeasePolicy {
            ttl: Duration::from_micros(10_000_500),
            ..policy()
        },
        LeasePolicy {
            margin: Duration::from_millis(5_001),
            ..policy()
        },
        LeasePolicy {
            ask_share: 0.0,
            ..policy()
        },
        LeasePolicy {
            ask_share: 1.5,
            ..policy()
        },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
    assert!(ServeMode::Decisions.validate().is_ok());
    assert_eq!(ServeMode::Leases(policy()).name(), "leases");
}

proptest! {
    /// Whatever the grants, costs and clock: what a lease pays for never
    /// exceeds its grant, and nothing is paid within the margin of its
    /// expiry.
    #[test]
    fn spend_stays_within_every_grant_and_before_every_expiry(
        steps in prop::collection::vec((0u8..4, 0u64..3_000_000, 0i64..700), 1..200),
    ) {
        let mut b = book(1);
        let mut now = T0;
        let mut grants: HashMap<String, (u64, i64)> = HashMap::new();
        let mut spent: HashMap<String, u64> = HashMap::new();
        for (i, (op, amount, dt)) in steps.into_iter().enumerate() {
            now += dt;
            if op == 0 {
                let id = format!("L{i}");
                let expires = now + (amount as i64 % 12_000);
                let g = grant("ad-1", Some(&id), amount, expires);
                if b.grant(0, amount, &g, now).is_ok() && amount > 0 {
                    grants.insert(id, (amount, expires));
                }
            } else if let Some(id) = b.spend(0, amount, now) {
                let id: String = serde_json::from_str(&id).unwrap();
                let (granted, expires) = grants[&id];
                prop_assert!(now < expires - 1_000, "served at {now}, expiry {expires}");
                let total = spent.entry(id).or_default();
                *total += amount;
                prop_assert!(*total <= granted, "{total} spent of {granted}");
            }
        }
    }
}
