//! The bidder's hot path: `decide` for batches of ads against a large
//! catalog with spend on every limit and a full freshness window (10,000
//! pushes over five minutes). Prints decisions/s and batch latency.
//!
//! cargo bench -p adspend-pacer --bench decisions

use std::time::{Duration, Instant};

use adspend_pacer::pacing::{decide, tick, SpendState};
use adspend_wire::catalog::Catalog;
use adspend_wire::types::{SumEntry, SumsUpdate, LIFETIME_BUCKET};
use chrono::Utc;

const ACCOUNTS: usize = 1_000;
const CAMPAIGNS_PER_ACCOUNT: usize = 5;
const ADSETS_PER_CAMPAIGN: usize = 4;
const ADS_PER_ADSET: usize = 5;
const BATCH: usize = 100;

fn main() {
    let mut limits = serde_json::Map::new();
    let mut ads = serde_json::Map::new();
    let mut ad_ids = Vec::new();
    for a in 0..ACCOUNTS {
        let account = format!("account-{a}");
        limits.insert(
            account.clone(),
            serde_json::json!({"budget_micros": 1_000_000_000_000u64, "period": "lifetime"}),
        );
        for c in 0..CAMPAIGNS_PER_ACCOUNT {
            let campaign = format!("campaign-{a}-{c}");
            limits.insert(campaign.clone(), serde_json::json!({"budget_micros": 100_000_000_000u64, "period": "daily", "time_zone": "America/New_York", "parent": account}));
            for s in 0..ADSETS_PER_CAMPAIGN {
                let adset = format!("adset-{a}-{c}-{s}");
                limits.insert(adset.clone(), serde_json::json!({"budget_micros": 10_000_000_000u64, "period": "daily", "time_zone": "Asia/Kolkata", "parent": campaign}));
                for n in 0..ADS_PER_ADSET {
                    let ad = format!("ad-{a}-{c}-{s}-{n}");
                    ads.insert(ad.clone(), serde_json::json!([adset, campaign, account]));
                    ad_ids.push(ad);
                }
            }
        }
    }
    let doc = serde_json::json!({"limits": limits, "ads": ads}).to_string();
    let catalog = Catalog::parse("bench", doc.as_bytes()).expect("catalog");
    let now = Utc::now();
    let mut state = SpendState::default();
    let entries: Vec<SumEntry> = catalog
        .limits
        .values()
        .map(|l| SumEntry {
            limit: l.id.to_string(),
            bucket: if l.bucket_of(now.timestamp_millis()) == LIFETIME_BUCKET {
                LIFETIME_BUCKET
            } else {
                l.bucket_of(now.timestamp_millis())
            },
            bucket_micros: l.budget_micros / 3,
            lifetime_micros: l.budget_micros / 3,
            lifetime_events: 1_000,
        })
        .collect();
    state.apply(
        &SumsUpdate {
            shard: "all".into(),
            epoch: 1,
            seq: 1,
            push_seq: 1,
            full: true,
            watermark_ms: now.timestamp_millis(),
            source_ms: now.timestamp_millis(),
            entries,
        },
        now.timestamp_millis(),
    );
    // Realistic pushes: one every 30 ms over the five-minute lag window,
    // so it holds its full 10,000 freshness samples as a live pacer's does.
    let limit_ids: Vec<&str> = catalog.limits.keys().map(|id| &**id).collect();
    let start_ms = now.timestamp_millis() - 300_000;
    for i in 0..10_000u64 {
        let at = start_ms + 30 * i as i64;
        let limit = limit_ids[(i as usize * 7919) % limit_ids.len()];
        state.apply(
            &SumsUpdate {
                shard: "all".into(),
                epoch: 1,
                seq: 2 + i,
                push_seq: 2 + i,
                full: false,
                watermark_ms: at,
                // Lags of 20 to 420 ms, spread.
                source_ms: at - 20 - (i * 37 % 400) as i64,
                entries: vec![SumEntry {
                    limit: limit.to_string(),
                    bucket: LIFETIME_BUCKET,
                    bucket_micros: 0,
                    lifetime_micros: 0,
                    lifetime_events: 0,
                }],
            },
            at,
        );
    }
    tick(
        &mut state,
        &catalog,
        now,
        1.0 / 60.0,
        false,
        &Default::default(),
    );
    println!(
        "decisions bench: {} limits, {} ads, batches of {BATCH} ads (each ad: 3 limits through parents)",
        catalog.limits.len(),
        ad_ids.len()
    );
    let mut latencies: Vec<Duration> = Vec::new();
    let mut decided = 0usize;
    let mut servable = 0usize;
    let started = Instant::now();
    let mut cursor = 0usize;
    while started.elapsed() < Duration::from_secs(3) {
        let t = Instant::now();
        for _ in 0..BATCH {
            cursor = (cursor + 7919) % ad_ids.len();
            let d = decide(&catalog, &state, ad_ids[cursor].clone(), now);
            servable += usize::from(d.servable);
            decided += 1;
        }
        latencies.push(t.elapsed());
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    let pct = |p: f64| latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)];
    println!(
        "decide: {:.0} decisions/s on one core; batch of {BATCH}: p50 {:?} p99 {:?} max {:?} ({} servable of {})",
        decided as f64 / elapsed.as_secs_f64(),
        pct(0.50),
        pct(0.99),
        latencies.last().unwrap(),
        servable,
        decided
    );
}
