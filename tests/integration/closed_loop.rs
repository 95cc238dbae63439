//! The closed-loop simulator against a live pipeline: ad servers ask
//! `POST /v1/decisions` before they serve, over a compressed day, with a few
//! tight budgets.
//!
//! "Stopped" is defined against what the pacer said, not against time: a
//! watcher polls `GET /v1/limits`; let `t(L)` be the instant an answer
//! saying limit `L` is exhausted was received. Every decision request sent
//! after `t(L)` for an ad under `L` must come back not servable, so no
//! impression of such an ad comes from a request sent after `t(L)`. Requests
//! sent before `t(L)` are in flight and may still serve. This holds exactly
//! because exhaustion cannot be undone here: lifetime budgets (no period
//! rolls over), one fixed cost per impression (the pacer's typical event
//! cost never moves) and budgets of k and a half events (the remainder is
//! never within rounding of one event).

use std::collections::BTreeMap;
use std::time::Duration;

use adspend_harness::NatsOptions;
use adspend_sim::{
    loop_watch, run_closed_loop, Catalog, CostDistribution, LeaseMode, Limit, LoopConfig, Period,
    ServeMode,
};
use tokio_util::sync::CancellationToken;

use crate::support::{assert_exact, Backends, Pipeline};

const COST: u64 = 1_000_000;

/// One account over two campaigns over six ad sets, four ads each; budgets
/// in events (plus half an event). Campaign 1 runs out before ad set 3.
fn tight_catalog() -> Catalog {
    let mut catalog = Catalog::default();
    let mut limit = |id: &str, events: u64, parent: Option<&str>| {
        let limit = Limit {
            budget_micros: events * COST + COST / 2,
            period: Period::Lifetime,
            time_zone: "UTC".into(),
            parent: parent.map(str::to_owned),
        };
        catalog.limits.insert(id.to_owned(), limit);
    };
    limit("account-1", 1_000_000, None);
    limit("campaign-1", 100, Some("account-1"));
    limit("campaign-2", 1_000_000, Some("account-1"));
    for (adset, events, campaign) in [
        ("adset-1", 20, "campaign-1"),
        ("adset-2", 30, "campaign-1"),
        ("adset-3", 200, "campaign-1"),
        ("adset-4", 60, "campaign-2"),
        ("adset-5", 80, "campaign-2"),
        ("adset-6", 1_000_000, "campaign-2"),
    ] {
        limit(adset, events, Some(campaign));
    }
    for i in 0..24 {
        let adset = format!("adset-{}", i / 4 + 1);
        let campaign = catalog.limits[&adset].parent.clone().unwrap();
        let ad = vec![adset, campaign, "account-1".to_owned()];
        catalog.ads.insert(format!("ad-{}", i + 1), ad);
    }
    catalog.validate().unwrap();
    catalog
}

/// Two ad servers over a 20 s day against the tight catalog, one cost.
fn tight_loop(pacer_url: String, seed: u64) -> LoopConfig {
    LoopConfig {
        pacer_url,
        servers: 2,
        day: Duration::from_secs(20),
        duration: Duration::from_secs(20),
        peak_rate: 300.0,
        decision_batch: 50,
        zipf_exponent: 0.0,
        cost: CostDistribution::Uniform {
            min: COST,
            max: COST,
        },
        seed,
        progress_interval: Duration::from_secs(5),
        ..LoopConfig::default()
    }
}

// Was ignored as intermittent under load (issue 11): one run had adset-5 at
// 82 events against a budget of 80.5 and a stated bound of 1 event. The
// pacer's lag guard now counts what it served within the lag as in flight
// (the multipliers decisions were answered with, not only the tick's
// sample) and states the bound over the longest lag seen. With the tick's
// sample alone it failed so again (1 of 3 runs); with the answers counted it
// passed 5 runs in a row, 2 of them beside a busy loop on one core.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_that_ask_stop_serving_exhausted_limits_and_stay_exact() {
    let catalog = tight_catalog();
    let mut p = Pipeline::start_with(Backends::default(), NatsOptions::default(), catalog).await;
    p.spawn_all().await;
    let config = tight_loop(p.pacer_url(), 5);
    let stop_watch = CancellationToken::new();
    let watch = loop_watch::spawn(
        p.pacer_url(),
        None,
        Duration::from_millis(100),
        stop_watch.clone(),
    );
    let client = p.client().await;
    let outcome = run_closed_loop(
        &client,
        &config,
        &p.catalog,
        CancellationToken::new(),
        |_| {},
    )
    .await
    .expect("closed loop");
    stop_watch.cancel();
    let seen = watch.await.unwrap();
    let progress = &outcome.progress;
    eprintln!("closed loop: {progress:?}");
    assert_eq!(progress.decision_errors, 0, "{progress:?}");
    assert!(
        progress.served > 0 && progress.not_servable > 0,
        "{progress:?}"
    );
    assert_eq!(
        progress.acked, progress.served,
        "every served impression acknowledged"
    );

    // Exact: the pipeline's sums are the truth of what was served.
    let truth = &outcome.truth;
    assert_exact(&p.settle(truth, Duration::from_secs(60)).await, truth);

    // Exhausted limits stopped being served.
    let stopped: BTreeMap<&str, _> = seen
        .iter()
        .filter_map(|(id, s)| s.seen_exhausted.map(|t| (id.as_str(), t)))
        .collect();
    for id in ["adset-1", "campaign-1", "adset-4", "adset-5"] {
        assert!(stopped.contains_key(id), "{id} was never seen exhausted");
    }
    // adset-2 (30.5 events) is not required to run out itself: when its
    // pacing slows it near its budget while adset-3 (200.5) is served on,
    // campaign-1 (100.5), asserted above, runs out first and stops its ads
    // (seen once on a loaded machine). Either way the check below holds
    // every ad to the instant any limit above it was seen exhausted.
    assert!(!stopped.contains_key("adset-6") && !stopped.contains_key("account-1"));
    for (ad, limits) in &p.catalog.ads {
        let record = &outcome.ads[ad];
        for limit in limits {
            let Some(&t) = stopped.get(limit.as_str()) else {
                continue;
            };
            assert!(
                record.last_servable_asked.is_none_or(|asked| asked < t),
                "{ad}: a decision asked after {limit} was reported exhausted came back servable"
            );
            assert!(
                record.last_served_asked.is_none_or(|asked| asked < t),
                "{ad}: served from a decision asked after {limit} was reported exhausted"
            );
        }
    }
    for id in stopped.keys() {
        let refused: u64 = p
            .catalog
            .ads
            .iter()
            .filter(|(_, limits)| limits.iter().any(|l| l == id))
            .map(|(ad, _)| outcome.ads[ad].not_servable)
            .sum();
        assert!(refused > 0, "no decision under {id} was refused");
    }

    // Spend within the budget plus the overspend bound stated at the stop.
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let last = loop_watch::fetch(&http, &p.pacer_url(), None)
        .await
        .unwrap();
    for l in &last {
        let budget = p.catalog.limits[&l.limit_id].budget_micros;
        eprintln!(
            "{}: spend {} of budget {budget}, bound at stop {:?}, largest stated {:?}",
            l.limit_id,
            l.spend_micros,
            seen.get(&l.limit_id).and_then(|s| s.bound_at_stop),
            seen.get(&l.limit_id).map(|s| s.max_bound)
        );
        assert_eq!(l.budget_micros, budget);
        assert_eq!(l.spend_micros, truth.limits[&l.limit_id].lifetime_micros);
        if l.spend_micros <= budget {
            continue;
        }
        let bound = seen
            .get(&l.limit_id)
            .and_then(|s| s.bound_at_stop)
            .unwrap_or(l.overspend_bound_micros);
        assert!(
            l.spend_micros - budget <= bound,
            "{}: spend {} over budget {budget} by more than the stated bound {bound}",
            l.limit_id,
            l.spend_micros
        );
    }
}

/// Ad servers that lease before they serve, and whose impressions reach the
/// stream two seconds late: no limit ends over its budget (CONTRACT.md
/// "Spend leases": with every impression under a lease, reported within its
/// expiry plus the grace, and none beyond a grant, nothing can take a limit
/// over), the small budgets demand outran are mostly spent, and the totals
/// are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_that_lease_never_take_a_limit_over_its_budget_whatever_the_delay() {
    let catalog = tight_catalog();
    let mut p = Pipeline::start_with(Backends::default(), NatsOptions::default(), catalog).await;
    // The grace covers the 2 s delay, with a second to spare: unused grants
    // come back to be granted again within the run.
    p.aggregator = Some(p.spawn("aggregator"));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn_with(
        "pacer",
        adspend_harness::free_port(),
        &[("ADSPEND_PACER_LEASE_GRACE_MS", "3000")],
    ));
    p.wait_pacer().await;
    let config = LoopConfig {
        mode: ServeMode::Leases(LeaseMode::with_ttl(Duration::from_secs(3))),
        publish_delay: Duration::from_secs(2),
        ..tight_loop(p.pacer_url(), 6)
    };
    let client = p.client().await;
    let outcome = run_closed_loop(
        &client,
        &config,
        &p.catalog,
        CancellationToken::new(),
        |_| {},
    )
    .await
    .expect("closed loop");
    let progress = &outcome.progress;
    eprintln!("closed loop with leases: {progress:?}");
    assert_eq!(progress.leases.errors, 0, "{progress:?}");
    assert!(
        progress.leases.granted > 0 && progress.served > 0,
        "{progress:?}"
    );
    assert_eq!(
        progress.acked, progress.served,
        "every served impression acknowledged"
    );
    let truth = &outcome.truth;
    assert_exact(&p.settle(truth, Duration::from_secs(60)).await, truth);
    for (id, limit) in &p.catalog.limits {
        let spent = truth.limits.get(id).map_or(0, |l| l.lifetime_micros);
        assert!(
            spent <= limit.budget_micros,
            "{id}: spend {spent} over its budget {} with every impression under a lease",
            limit.budget_micros
        );
    }
    // Demand outran the small budgets and leases let most of them be
    // spent (how much a lease holds back unused is the pacing benchmark's
    // to measure, docs/PACING.md; at the end of a run some is still held).
    for id in ["adset-1", "adset-2", "adset-4"] {
        let spent = truth.limits.get(id).map_or(0, |l| l.lifetime_micros);
        let budget = p.catalog.limits[id].budget_micros;
        assert!(
            2 * spent > budget,
            "{id}: {spent} of {budget} spent: the leases left most of it unspent"
        );
    }
}
