//! `POST /v1/decisions` over HTTP on a running pipeline: an ad is servable
//! exactly when no limit above it (its own and their parents) is exhausted.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use adspend_sim::check::fetch_limits;
use adspend_sim::SimConfig;

use crate::support::{assert_exact, Backends, Pipeline};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_follow_the_limits_above_each_ad() {
    let mut p = Pipeline::start(Backends::default(), 60).await;
    p.spawn_all().await;
    // Enough spend that some small limits are exhausted.
    let truth = p
        .publish(&SimConfig {
            events: Some(20_000),
            batch: 50,
            seed: 4,
            ..SimConfig::default()
        })
        .await;
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);

    let http = reqwest::Client::new();
    let limits = fetch_limits(&http, &p.pacer_url()).await.unwrap();
    let exhausted: BTreeSet<&str> = limits
        .iter()
        .filter(|l| l.exhausted)
        .map(|l| l.limit_id.as_str())
        .collect();
    assert!(
        !exhausted.is_empty(),
        "the run exhausted no limit; the test needs some"
    );
    let mut ads: Vec<String> = p.catalog.ads.keys().cloned().collect();
    ads.push("no-such-ad".into());
    let response: serde_json::Value = http
        .post(format!("{}/v1/decisions", p.pacer_url()))
        .json(&serde_json::json!({ "ad_ids": ads }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let decisions = response["decisions"].as_array().expect("decisions array");
    assert_eq!(decisions.len(), ads.len());
    let mut servable_count = BTreeMap::new();
    for (ad, decision) in ads.iter().zip(decisions) {
        assert_eq!(decision["ad_id"], ad.as_str());
        let servable = decision["servable"].as_bool().unwrap();
        let multiplier = decision["multiplier"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&multiplier));
        if ad == "no-such-ad" {
            assert!(!servable);
            assert_eq!(decision["error"], "unknown ad");
            continue;
        }
        // Every limit above the ad, through the parent chain.
        let mut above: Vec<&str> = Vec::new();
        for limit in &p.catalog.ads[ad] {
            above.extend(p.catalog.ancestry(limit).unwrap());
        }
        let expected = !above.iter().any(|id| exhausted.contains(id));
        assert_eq!(servable, expected, "ad {ad}: limits above {above:?}");
        if !servable {
            assert_eq!(multiplier, 0.0);
        }
        *servable_count.entry(servable).or_insert(0) += 1;
    }
    assert!(
        servable_count.get(&false).copied().unwrap_or(0) > 0,
        "{servable_count:?}"
    );
}
