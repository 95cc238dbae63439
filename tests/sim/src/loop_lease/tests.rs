//! A server's adapter around the crate's lease book: what it feeds the
//! book, which asks it sends, and what it releases. The book's own rules
//! (older lease first, the margin, never past a grant, zero-grant back-off,
//! releases saying what was served) are the crate's tests'.

use adspend_client::Grant;

use super::*;

const UNIT: u64 = 1_000_000;
const T0: i64 = 1_800_000_000_000;

fn mode() -> LeaseMode {
    LeaseMode::with_ttl(Duration::from_secs(10))
}

fn ids(n: usize) -> (Vec<String>, HashMap<String, u32>) {
    let ids: Vec<String> = (0..n).map(|i| format!("ad-{i}")).collect();
    let by_id = ids.iter().cloned().zip(0..).collect();
    (ids, by_id)
}

/// Costs of one unit to two units.
fn leases(mode: LeaseMode, ads: usize) -> ServerLeases {
    let cost = CostDistribution::Uniform {
        min: UNIT,
        max: 2 * UNIT,
    };
    ServerLeases::new(mode, &cost, ads).unwrap()
}

fn grant(ad: &str, id: &str, micros: u64, expires_at_ms: i64) -> Grant {
    Grant {
        ad_id: ad.into(),
        lease_id: Some(id.into()),
        granted_micros: micros,
        expires_at_ms,
    }
}

fn ads_of(asks: &[Ask]) -> Vec<&str> {
    asks.iter().map(|a| &*a.ad_id).collect()
}

#[test]
fn an_ad_is_leased_in_the_tick_of_its_first_request_for_at_least_the_highest_cost() {
    let (ids, by_id) = ids(3);
    let mut l = leases(mode(), 3);
    assert!(l.asks(&[], &by_id, 10, T0).is_empty(), "no request, no ask");
    let requested = l.note_requests(&[1, 1], &ids, T0);
    assert_eq!(requested, [1]);
    let asks = l.asks(&requested, &by_id, 10, T0);
    assert_eq!(ads_of(&asks), ["ad-1"]);
    assert!(asks[0].micros >= 2 * UNIT, "{asks:?}");
    // Granted in the same tick: its requests are served under the lease.
    l.book()
        .install(&grant("ad-1", "L1", asks[0].micros, T0 + 10_000), T0);
    assert_eq!(&*l.book().try_spend_at("ad-1", 2 * UNIT, T0).unwrap(), "L1");
}

#[test]
fn an_ask_covers_the_request_rate_times_the_mean_cost_over_part_of_the_ttl() {
    let (ids, by_id) = ids(1);
    let mut l = leases(mode(), 1);
    // 100 requests a second for three seconds, a unit and a half each,
    // every ask unanswered (asked again each tick).
    let mut last = Vec::new();
    for i in 1..=30 {
        let now = T0 + i * 100;
        let requested = l.note_requests(&[0; 10], &ids, now);
        l.note_cost(UNIT);
        l.note_cost(2 * UNIT);
        last = l.asks(&requested, &by_id, 10, now);
        for ask in &last {
            l.book().ask_failed(&ask.ad_id);
        }
    }
    let now = T0 + 3_000;
    let rate = l.rate_at(0, now);
    assert!((70.0..=100.0).contains(&rate), "{rate} requests/s");
    // Half of the usable 9 s: 4.5 s of spend at that rate, less what the
    // book's demand average lets go of in the 100 ms since its last plan.
    let expected = rate * 1.5 * UNIT as f64 * 4.5;
    let asked = last[0].micros as f64;
    assert!(
        (0.9 * expected..=expected + 1.0).contains(&asked),
        "asked {asked}, expected about {expected}"
    );
}

#[test]
fn asks_put_waiting_requests_first_stop_at_the_batch_and_leave_the_rest_for_later() {
    let (ids, by_id) = ids(4);
    let mut l = leases(mode(), 4);
    let mut all = Vec::new();
    for ad in 0..4u32 {
        all.extend(std::iter::repeat_n(ad, 1 + 10 * ad as usize));
    }
    l.note_requests(&all, &ids, T0);
    // Ad 3 holds a live lease that is running low (less than the highest
    // cost left); 0..=2 hold none. Ads 0, 1 and 3 have requests waiting.
    l.book()
        .install(&grant("ad-3", "L", 2 * UNIT, T0 + 10_000), T0);
    l.book().try_spend_at("ad-3", UNIT, T0).unwrap();
    let two = l.asks(&[0, 1, 3], &by_id, 2, T0);
    assert_eq!(
        ads_of(&two),
        ["ad-0", "ad-1"],
        "the two waiting without a lease"
    );
    for ask in &two {
        l.book().ask_failed(&ask.ad_id);
    }
    // Those left out were not marked as asked: all four come next time,
    // in the catalog's order.
    let all = l.asks(&[0, 1, 3], &by_id, 10, T0 + 100);
    assert_eq!(ads_of(&all), ["ad-0", "ad-1", "ad-2", "ad-3"]);
}

#[test]
fn a_mode_that_does_not_release_drops_the_releases() {
    let (ids, _) = ids(1);
    for release in [true, false] {
        let mut l = leases(LeaseMode { release, ..mode() }, 1);
        l.note_requests(&[0], &ids, T0);
        l.book()
            .install(&grant("ad-0", "L1", 9 * UNIT, T0 + 10_000), T0);
        l.book()
            .install(&grant("ad-0", "L2", 9 * UNIT, T0 + 20_000), T0);
        l.book().try_spend_at("ad-0", 2 * UNIT, T0).unwrap();
        // L1 passes its usable end (expiry less the 1 s margin) with 7
        // units left; L2, untouched, goes at the end of the run.
        let at_end = l.take_releases(T0 + 9_000);
        let at_stop = l.release_all();
        if release {
            assert_eq!(
                at_end,
                [Release {
                    lease_id: "L1".into(),
                    served_micros: 2 * UNIT
                }]
            );
            assert_eq!(
                at_stop,
                [Release {
                    lease_id: "L2".into(),
                    served_micros: 0
                }]
            );
        } else {
            assert_eq!((at_end, at_stop), (vec![], vec![]));
        }
        // Either way the book let them go: nothing more is served.
        assert!(l.book().try_spend_at("ad-0", 1, T0 + 9_000).is_err());
    }
    let unreleased = ServeMode::Leases(LeaseMode {
        release: false,
        ..mode()
    });
    assert_eq!(unreleased.name(), "leases unreleased");
    assert_eq!(ServeMode::Leases(mode()).name(), "leases");
    assert_eq!(ServeMode::Decisions.name(), "decisions");
}

#[test]
fn lease_modes_are_checked_by_the_crate_s_policy() {
    ServeMode::Leases(LeaseMode::default()).validate().unwrap();
    ServeMode::Leases(mode()).validate().unwrap();
    ServeMode::Decisions.validate().unwrap();
    // The loop's default lead leaves the shortest ttl usable with the
    // widest margin.
    let mut shortest = LeaseMode::with_ttl(Duration::from_secs(1));
    shortest.policy.margin = Duration::from_millis(500);
    ServeMode::Leases(shortest).validate().unwrap();
    let bad = |f: fn(&mut LeasePolicy)| {
        let mut m = mode();
        f(&mut m.policy);
        ServeMode::Leases(m).validate().unwrap_err().to_string()
    };
    assert!(bad(|p| p.ttl = Duration::from_millis(999)).contains("ttl"));
    assert!(bad(|p| p.ttl = Duration::from_millis(600_001)).contains("ttl"));
    assert!(bad(|p| p.ttl = Duration::from_micros(10_000_500)).contains("ttl"));
    assert!(bad(|p| p.margin = Duration::from_millis(5_001)).contains("margin"));
    assert!(bad(|p| p.ask_share = 0.0).contains("ask_share"));
    assert!(bad(|p| p.ask_share = 1.5).contains("ask_share"));
    assert!(bad(|p| p.lead = Duration::from_secs(9)).contains("lead"));
    assert_eq!(mode().ttl_ms(), 10_000);
}

#[test]
fn an_ad_without_a_request_now_is_leased_ahead_only_if_it_expects_one_within_an_ask() {
    let (ids, by_id) = ids(2);
    let mut l = leases(mode(), 2);
    // Ad 0 had one request (half a request a second over the 2 s window:
    // two within the 4.5 s an ask covers), ad 1 one request 4 s earlier
    // (about 0.07 a second: less than one within an ask).
    l.note_requests(&[1], &ids, T0 - 4_000);
    l.note_requests(&[0], &ids, T0);
    let asks = l.asks(&[], &by_id, 10, T0);
    assert_eq!(ads_of(&asks), ["ad-0"]);
    l.book().ask_failed("ad-0");
    // Ad 1's ask was handed back, not dropped: a request brings it back.
    let requested = l.note_requests(&[1], &ids, T0 + 100);
    let asks = l.asks(&requested, &by_id, 10, T0 + 100);
    assert_eq!(ads_of(&asks), ["ad-0", "ad-1"]);
}
