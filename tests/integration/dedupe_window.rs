//! The dedupe window says what it holds: with a count bound far below what
//! the traffic needs, the aggregator's gauges show the window cut short
//! (effective below the configured window, ids evicted by count) and the
//! pacer's `GET /v1/shards` shows the same per shard.

use std::time::Duration;

use adspend_harness::{free_port, wait_until_ok};
use adspend_sim::SimConfig;
use serde_json::Value;

use crate::support::{metric_value, metrics_body, Backends, Pipeline};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_cut_by_the_count_bound_shows_in_metrics_and_shards() {
    let mut p = Pipeline::start(Backends::default(), 50).await;
    let metrics = free_port();
    p.aggregator = Some(p.spawn_with("aggregator", metrics, &[("ADSPEND_DEDUPE_MAX_IDS", "1000")]));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let config = SimConfig {
        events: Some(6_000),
        rate: 3_000.0,
        duplicate_rate: 0.0,
        batch: 50,
        seed: 3,
        ..SimConfig::default()
    };
    p.publish(&config).await;

    let body = wait_until_ok(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let body = metrics_body(metrics).await?;
            let evicted = metric_value(
                &body,
                "adspend_aggregator_dedupe_evicted_total{shard=\"all\",by=\"count\"}",
            )
            .unwrap_or(0.0);
            anyhow::ensure!(evicted > 0.0, "nothing evicted by count yet");
            Ok(body)
        },
    )
    .await
    .expect("the count bound evicts");
    let window = metric_value(
        &body,
        "adspend_aggregator_dedupe_window_seconds{shard=\"all\"}",
    )
    .expect("the effective window");
    let target = metric_value(
        &body,
        "adspend_aggregator_dedupe_window_target_seconds{shard=\"all\"}",
    )
    .expect("the configured window");
    assert_eq!(target, 120.0, "the harness's ADSPEND_DEDUPE_WINDOW_MS");
    assert!(window < target, "{window} s");
    let ids = metric_value(&body, "adspend_aggregator_dedupe_ids{shard=\"all\"}").unwrap();
    assert!(ids <= 1_000.0, "{ids}");
    let memory = metric_value(
        &body,
        "adspend_aggregator_dedupe_memory_bytes{shard=\"all\"}",
    );
    assert!(memory.is_some_and(|m| m >= 17.0 * ids), "{memory:?}");

    // The pacer hears it within a report interval (5 s).
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let url = format!("{}/v1/shards", p.pacer_url());
    let shard = wait_until_ok(
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let shards: Value = http.get(&url).send().await?.json().await?;
            let shard = shards["shards"]
                .as_array()
                .and_then(|s| s.iter().find(|s| s["shard"] == "all"))
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("no shard \"all\": {shards}"))?;
            anyhow::ensure!(
                shard["dedupe_window"]["cut_by_count"] == true,
                "not cut yet: {shard}"
            );
            Ok(shard)
        },
    )
    .await
    .expect("the pacer shows the window cut");
    let window = &shard["dedupe_window"];
    assert_eq!(window["configured_ms"], 120_000, "{shard}");
    assert_eq!(window["max_ids"], 1_000, "{shard}");
    let effective = window["effective_ms"]
        .as_u64()
        .expect("an effective window");
    assert!(effective < 120_000, "{shard}");
    assert!(window["ids"].as_u64().unwrap() <= 1_000, "{shard}");
    assert!(window["memory_bytes"].as_u64().unwrap() > 0, "{shard}");
}
