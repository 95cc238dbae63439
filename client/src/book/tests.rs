use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::api::Grant;

const MARGIN_MS: i64 = 1_000;

fn book() -> LeaseBook {
    LeaseBook::new(LeasePolicy::default()).unwrap()
}

fn grant(ad: &str, id: &str, micros: u64, expires_at_ms: i64) -> Grant {
    Grant {
        ad_id: ad.into(),
        lease_id: (micros > 0).then(|| id.into()),
        granted_micros: micros,
        expires_at_ms,
    }
}

#[test]
fn the_older_lease_pays_first_and_is_released_with_what_it_served() {
    let b = book();
    b.install(&grant("ad", "a", 10_000, 60_000), 0);
    assert_eq!(&*b.try_spend_at("ad", 4_000, 1_000).unwrap(), "a");
    b.install(&grant("ad", "b", 10_000, 90_000), 2_000);
    // The replaced lease "a" still has 6,000: it pays first.
    assert_eq!(&*b.try_spend_at("ad", 5_000, 3_000).unwrap(), "a");
    assert_eq!(&*b.try_spend_at("ad", 5_000, 3_000).unwrap(), "b");
    // A third grant pushes "a" out with 1,000 left: released, 9,000 served.
    b.install(&grant("ad", "c", 10_000, 120_000), 4_000);
    assert_eq!(
        b.take_releases(4_000),
        vec![Release {
            lease_id: "a".into(),
            served_micros: 9_000
        }]
    );
    // At shutdown: "b" served 5,000, "c" nothing.
    let mut all = b.release_all();
    all.sort_by(|x, y| x.lease_id.cmp(&y.lease_id));
    assert_eq!(
        all,
        vec![
            Release {
                lease_id: "b".into(),
                served_micros: 5_000
            },
            Release {
                lease_id: "c".into(),
                served_micros: 0
            },
        ]
    );
}

#[test]
fn nothing_is_served_within_the_margin_of_an_expiry() {
    let b = book();
    b.install(&grant("ad", "a", 10_000, 60_000), 0);
    assert!(b.try_spend_at("ad", 1, 60_000 - MARGIN_MS - 1).is_ok());
    assert_eq!(
        b.try_spend_at("ad", 1, 60_000 - MARGIN_MS),
        Err(Refusal::Expired)
    );
    assert_eq!(
        b.take_releases(60_000),
        vec![Release {
            lease_id: "a".into(),
            served_micros: 1
        }]
    );
}

#[test]
fn an_ad_is_asked_for_at_its_low_water_mark_and_backs_off_after_a_zero_grant() {
    let b = book();
    assert_eq!(b.try_spend_at("ad", 2_000, 0), Err(Refusal::NoLease));
    let asks = b.plan_at(0);
    assert_eq!(asks.len(), 1);
    assert!(
        asks[0].micros >= 2_000,
        "at least the costliest impression: {asks:?}"
    );
    // Asking: not asked again until answered.
    assert!(b.plan_at(100).is_empty());
    b.install(&grant("ad", "", 0, 0), 200);
    let _ = b.try_spend_at("ad", 2_000, 300);
    assert!(
        b.plan_at(300).is_empty(),
        "within the zero grant's back-off"
    );
    let _ = b.try_spend_at("ad", 2_000, 600);
    assert_eq!(b.plan_at(600).len(), 1, "after the back-off");
    b.install(&grant("ad", "a", 100_000, 60_000), 700);
    let _ = b.try_spend_at("ad", 2_000, 800);
    assert!(b.plan_at(800).is_empty(), "a fresh lease with room");
    // Spent down below one impression's cost: renewed.
    while b.try_spend_at("ad", 2_000, 900).is_ok() {}
    assert_eq!(b.plan_at(900).len(), 1);
}

#[test]
fn a_failed_ask_is_asked_again() {
    let b = book();
    let _ = b.try_spend_at("ad", 10, 0);
    assert_eq!(b.plan_at(0).len(), 1);
    b.ask_failed("ad");
    let _ = b.try_spend_at("ad", 10, 50);
    assert_eq!(b.plan_at(50).len(), 1);
}

#[derive(Debug, Clone)]
enum Op {
    /// A grant of `micros` for ad `ad`, expiring `ttl` ms after now.
    Grant {
        ad: u8,
        micros: u64,
        ttl: i64,
    },
    Spend {
        ad: u8,
        cost: u64,
    },
    Advance(i64),
    Sweep,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0u8..3, 0u64..50_000, 1_000i64..20_000)
            .prop_map(|(ad, micros, ttl)| Op::Grant { ad, micros, ttl }),
        4 => (0u8..3, 1u64..8_000).prop_map(|(ad, cost)| Op::Spend { ad, cost }),
        1 => (0i64..3_000).prop_map(Op::Advance),
        1 => Just(Op::Sweep),
    ]
}

proptest! {
    /// Whatever the order of grants, spends and time: no lease pays past
    /// its grant or at or past its expiry less the margin, a lease never
    /// pays after it was released, every lease let go with something left
    /// is released once with exactly what it paid, and one let go empty is
    /// not released.
    #[test]
    fn never_past_a_grant_or_an_expiry_and_releases_say_what_was_served(
        ops in proptest::collection::vec(op(), 1..200)
    ) {
        let b = book();
        let mut now = 0i64;
        let mut leases: HashMap<String, (u64, i64)> = HashMap::new();
        let mut paid: HashMap<String, u64> = HashMap::new();
        let mut released: HashMap<String, u64> = HashMap::new();
        let mut n = 0;
        let check_releases = |rs: Vec<Release>, released: &mut HashMap<String, u64>,
                              paid: &HashMap<String, u64>, leases: &HashMap<String, (u64, i64)>| {
            for r in rs {
                prop_assert!(released.insert(r.lease_id.clone(), r.served_micros).is_none(),
                    "{} released twice", r.lease_id);
                let p = paid.get(&r.lease_id).copied().unwrap_or(0);
                prop_assert_eq!(r.served_micros, p, "release of {} must say what it paid", &r.lease_id);
                prop_assert!(p < leases[&r.lease_id].0, "{} released with nothing left", &r.lease_id);
            }
            Ok(())
        };
        for op in ops {
            match op {
                Op::Grant { ad, micros, ttl } => {
                    n += 1;
                    let id = format!("l{n}");
                    if micros > 0 {
                        leases.insert(id.clone(), (micros, now + ttl));
                    }
                    b.install(&grant(&format!("ad{ad}"), &id, micros, now + ttl), now);
                }
                Op::Spend { ad, cost } => {
                    if let Ok(id) = b.try_spend_at(&format!("ad{ad}"), cost, now) {
                        let (granted, expires) = leases[&*id];
                        prop_assert!(now < expires - MARGIN_MS, "{} paid at {now}, expires {expires}", &*id);
                        prop_assert!(!released.contains_key(&*id), "{} paid after its release", &*id);
                        let p = paid.entry(id.to_string()).or_default();
                        *p += cost;
                        prop_assert!(*p <= granted, "{} paid {} of {granted}", &*id, *p);
                    }
                }
                Op::Advance(ms) => now += ms,
                Op::Sweep => check_releases(b.take_releases(now), &mut released, &paid, &leases)?,
            }
        }
        check_releases(b.release_all(), &mut released, &paid, &leases)?;
        // Every lease with something left was released by the end.
        for (id, (granted, _)) in &leases {
            let p = paid.get(id).copied().unwrap_or(0);
            prop_assert_eq!(released.contains_key(id), p < *granted, "lease {}", id);
        }
    }
}

#[test]
fn left_at_sums_the_usable_leases_at_that_clock_and_changes_nothing() {
    let b = book();
    assert_eq!(b.left_at("ad", 0), 0, "an ad the book has never seen");
    b.install(&grant("ad", "a", 10_000, 30_000), 0);
    b.install(&grant("ad", "b", 5_000, 60_000), 0);
    b.try_spend_at("ad", 4_000, 0).unwrap();
    assert_eq!(b.left_at("ad", 0), 11_000, "both leases: 6,000 + 5,000");
    // Within the margin of "a"'s expiry only "b" counts, and asking lets
    // nothing go: "a" is still released by the next sweep, with what it paid.
    assert_eq!(b.left_at("ad", 30_000 - MARGIN_MS), 5_000);
    assert_eq!(b.left_at("ad", 60_000 - MARGIN_MS), 0);
    assert_eq!(b.left_at("ad", 0), 11_000);
    assert_eq!(
        b.take_releases(30_000),
        vec![Release {
            lease_id: "a".into(),
            served_micros: 4_000
        }]
    );
    // Not demand: a book asked only about what is left plans nothing.
    let quiet = book();
    let _ = quiet.left_at("other", 0);
    assert!(quiet.plan_at(0).is_empty());
}

#[test]
fn policies_are_checked_against_the_contract_and_themselves() {
    let ok = LeasePolicy::default();
    ok.validate().unwrap();
    let bad = |f: fn(&mut LeasePolicy)| {
        let mut p = ok;
        f(&mut p);
        assert_eq!(LeaseBook::new(p).unwrap_err(), p.validate().unwrap_err());
        p.validate().unwrap_err().to_string()
    };
    assert!(bad(|p| p.ttl = Duration::from_millis(999)).contains("ttl"));
    assert!(bad(|p| p.ttl = Duration::from_millis(600_001)).contains("ttl"));
    assert!(bad(|p| p.ttl = Duration::from_micros(30_000_500)).contains("ttl"));
    assert!(bad(|p| p.margin = Duration::from_millis(15_001)).contains("margin"));
    assert!(bad(|p| p.ask_share = 0.0).contains("ask_share"));
    assert!(bad(|p| p.ask_share = 1.5).contains("ask_share"));
    assert!(bad(|p| p.lead = Duration::from_secs(29)).contains("lead"));
}
