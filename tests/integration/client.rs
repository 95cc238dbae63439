//! A bidder built on `adspend-client` against the real pipeline: it serves
//! only what `LeaseBook::try_spend` lets it, publishes every impression
//! (some twice) with the crate's publisher, and keeps going through a
//! pacer restart and a NATS restart. At the end the pacer's spend equals
//! what was served (each impression once, duplicates and retries
//! included), no campaign passed its budget, every impression carried a
//! lease the pacer granted, and every release said exactly what was served
//! under its lease.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use adspend_client::{
    Impression, LeaseBook, LeasePolicy, Pacer, PacerConfig, Publisher, PublisherConfig, Renewer,
    Retry,
};
use adspend_harness::wait_until_ok;
use adspend_wire::lease::LeaseId;
use serde_json::Value;

use crate::leases::{spawn_pacer, start, wait_field, wait_healthy, BUDGET, FIRST_SPEND};

/// Small against the budgets (900,000 left on each campaign), so the
/// bidder is still serving after the restarts.
const COST: u64 = 200;
const ADS: [(&str, &str); 3] = [("a-1", "camp-a"), ("a-2", "camp-a"), ("b-1", "camp-b")];

/// What the bidder served, impression by impression.
#[derive(Default)]
struct Served {
    by_campaign: HashMap<&'static str, u64>,
    by_lease: HashMap<String, u64>,
    impressions: u64,
    duplicates: u64,
}

/// Bids on every ad every 2 ms for `secs`, serving what the book allows.
async fn bid_for(book: &LeaseBook, publisher: &Publisher, served: &mut Served, secs: u64) {
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        for (ad, campaign) in ADS {
            let Ok(lease_id) = book.try_spend(ad, COST) else {
                continue;
            };
            assert!(
                LeaseId::parse(&lease_id).is_some(),
                "served under {lease_id:?}, not a lease id the pacer grants"
            );
            served.impressions += 1;
            let impression = Impression {
                id: format!("client-{}", served.impressions),
                ad_id: ad.into(),
                cost_micros: COST,
                ts_ms: adspend_common::now_ms(),
                lease_id: Some(lease_id.clone()),
            };
            *served.by_campaign.entry(campaign).or_default() += COST;
            *served.by_lease.entry(lease_id.to_string()).or_default() += COST;
            if served.impressions.is_multiple_of(25) {
                served.duplicates += 1;
                publisher.publish(impression.clone()).await.expect("open");
            }
            publisher.publish(impression).await.expect("open");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// [`bid_for`] until `more` impressions past what is served now, or
/// `within` seconds: after a restart the pacer reads its ledger and the
/// renewer's asks fail until it answers.
async fn bid_until(
    book: &LeaseBook,
    publisher: &Publisher,
    served: &mut Served,
    more: u64,
    within: u64,
) {
    let want = served.impressions + more;
    let until = Instant::now() + Duration::from_secs(within);
    while served.impressions < want && Instant::now() < until {
        bid_for(book, publisher, served, 1).await;
    }
    assert!(
        served.impressions >= want,
        "fewer than {more} impressions served in {within} s after a restart"
    );
}

async fn lease_view(addr: &str, id: &str) -> Option<Value> {
    let response = reqwest::get(format!("http://{addr}/v1/leases/{id}"))
        .await
        .ok()?;
    response.status().is_success().then_some(())?;
    response.json().await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bidder_on_the_crate_is_exact_through_a_pacer_and_a_nats_restart() {
    let mut p = start().await;
    // A grace long enough that every lease of the run is still live (and
    // shows its release) when the test reads it.
    let settings = [("ADSPEND_PACER_LEASE_GRACE_MS", "120000")];
    let mut pacer_proc = spawn_pacer(&p, &settings);
    let addr = pacer_proc.addr.clone();
    wait_healthy(&addr).await;
    wait_field(&addr, "camp-a", "spend_micros", FIRST_SPEND).await;

    let pacer = Pacer::new(PacerConfig {
        retry: Retry {
            tries: 3,
            ..Retry::default()
        },
        ..PacerConfig::new(format!("http://{addr}"))
    })
    .expect("pacer client");
    let book = LeaseBook::new(LeasePolicy {
        ttl: Duration::from_secs(4),
        margin: Duration::from_millis(500),
        ask_share: 0.5,
        lead: Duration::from_millis(500),
    })
    .expect("policy");
    let renewer = Renewer::start(book.clone(), pacer.clone(), Duration::from_millis(50));
    let publisher = Publisher::start(
        p.client().await,
        PublisherConfig {
            linger: Duration::from_millis(20),
            ..PublisherConfig::new("client")
        },
    );
    let mut served = Served::default();

    bid_until(&book, &publisher, &mut served, 50, 60).await;

    // The pacer restarts: the book serves on from what it holds, and
    // renewals resume once the pacer is back.
    pacer_proc.process.kill();
    bid_for(&book, &publisher, &mut served, 1).await;
    pacer_proc.process.restart();
    wait_healthy(&addr).await;
    bid_until(&book, &publisher, &mut served, 50, 60).await;

    // NATS restarts: publishes are retried, grants resume after it.
    p.nats.kill();
    bid_for(&book, &publisher, &mut served, 1).await;
    p.nats.restart().await;
    bid_until(&book, &publisher, &mut served, 50, 60).await;

    let stats = renewer.shutdown().await;
    let report = publisher.close().await;
    assert!(
        report.undelivered.is_empty(),
        "{} impressions undelivered",
        report.undelivered.len()
    );
    assert_eq!(
        report.delivered,
        served.impressions + served.duplicates,
        "every publish (duplicates included) acknowledged"
    );
    eprintln!(
        "client: {} impressions ({} published twice) under {} leases; {} grants, {} zero, {} asks failed, {} releases ({} not taken); {} publish retries",
        served.impressions,
        served.duplicates,
        served.by_lease.len(),
        stats.grants.load(std::sync::atomic::Ordering::Relaxed),
        stats.zero_grants.load(std::sync::atomic::Ordering::Relaxed),
        stats.failed_asks.load(std::sync::atomic::Ordering::Relaxed),
        stats.releases.load(std::sync::atomic::Ordering::Relaxed),
        stats.releases_not_taken.load(std::sync::atomic::Ordering::Relaxed),
        report.retries,
    );

    // Exactly what was served, each impression once.
    for campaign in ["camp-a", "camp-b"] {
        let want = FIRST_SPEND + served.by_campaign.get(campaign).copied().unwrap_or(0);
        assert!(want <= BUDGET, "{campaign}: served past its budget: {want}");
        wait_field(&addr, campaign, "lifetime_spend_micros", want).await;
    }
    // Every lease served under: its reported spend is what was served, and
    // its release (every one is released at shutdown, or let go empty)
    // says the same. A report frees a lease only once every shard has
    // caught up past it, so the last ones may still be on their way.
    let mut released = 0;
    for (id, micros) in &served.by_lease {
        let view = wait_until_ok(
            Duration::from_secs(30),
            Duration::from_millis(100),
            || async {
                let view = lease_view(&addr, id)
                    .await
                    .ok_or_else(|| anyhow::anyhow!("lease {id} not live at the pacer"))?;
                let reported = view["reported_micros"].as_u64();
                anyhow::ensure!(
                    reported == Some(*micros),
                    "lease {id}: reported {reported:?}, served {micros}: {view}"
                );
                Ok(view)
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
        if let Some(said) = view["served_micros"].as_u64() {
            assert_eq!(said, *micros, "lease {id} released with {said}: {view}");
            released += 1;
        }
    }
    assert!(released > 0, "no lease served under was released");
}
