//! A stall never looks fresh: while the limiter is stuck (frozen here with
//! SIGSTOP, as a hung or cut-off limiter), the aggregators are idle and
//! look caught up and keep sending heartbeats, yet every limit turns stale
//! within the threshold, its lag grows from now, and its ads are not
//! servable; once the limiter goes on, the limits are fresh and exact.

use std::time::Duration;

use adspend_harness::wait_until_ok;
use adspend_sim::Truth;
use anyhow::{bail, Context};
use serde_json::Value;

use crate::support::{assert_exact, sim_config, Backends, Pipeline};

/// The smallest threshold the pacer takes.
const STALE_AFTER_MS: i64 = 2_000;

/// (stale, lag_ms) of every limit.
async fn freshness(http: &reqwest::Client, url: &str) -> anyhow::Result<Vec<(String, bool, i64)>> {
    let page: Value = http
        .get(format!("{url}/v1/limits?limit=1000"))
        .send()
        .await?
        .json()
        .await?;
    let limits = page["limits"].as_array().context("limits")?;
    Ok(limits
        .iter()
        .map(|l| {
            (
                l["limit_id"].as_str().unwrap_or_default().to_string(),
                l["stale"].as_bool().unwrap_or(false),
                l["lag_ms"].as_i64().unwrap_or(-1),
            )
        })
        .collect())
}

/// Waits (20 s at most) until no limit is stale.
async fn all_fresh(http: &reqwest::Client, url: &str) -> anyhow::Result<()> {
    wait_until_ok(
        Duration::from_secs(20),
        Duration::from_millis(200),
        || async {
            let limits = freshness(http, url).await?;
            if limits.iter().any(|(_, stale, _)| *stale) {
                bail!("stale: {limits:?}");
            }
            Ok(())
        },
    )
    .await
}

/// The decision for `ad`: (servable, marked stale).
async fn decision(http: &reqwest::Client, url: &str, ad: &str) -> anyhow::Result<(bool, bool)> {
    let answer: Value = http
        .post(format!("{url}/v1/decisions"))
        .json(&serde_json::json!({ "ad_ids": [ad] }))
        .send()
        .await?
        .json()
        .await?;
    let decision = &answer["decisions"][0];
    Ok((
        decision["servable"].as_bool().context("servable")?,
        decision["stale"].as_bool().unwrap_or(false),
    ))
}

/// All three services, the pacer at the smallest stale threshold, and
/// spend published and settled exactly (simulator seed `seed`).
async fn start(seed: u64) -> (Pipeline, Truth) {
    let mut p = Pipeline::start(Backends::default(), 20).await;
    let stale_after = STALE_AFTER_MS.to_string();
    p.aggregator = Some(p.spawn("aggregator"));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn_with(
        "pacer",
        adspend_harness::free_port(),
        &[("ADSPEND_PACER_STALE_AFTER_MS", stale_after.as_str())],
    ));
    p.wait_pacer().await;
    let truth = p.publish(&sim_config(1_000, seed)).await;
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);
    (p, truth)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_limiter_makes_every_limit_stale_though_aggregators_look_caught_up() {
    let (mut p, mut truth) = start(81).await;
    let http = reqwest::Client::new();
    let url = p.pacer_url();
    let ad = p.catalog.ads.keys().next().expect("an ad").clone();
    all_fresh(&http, &url)
        .await
        .expect("fresh while the limiter runs");
    assert_eq!(decision(&http, &url, &ad).await.unwrap(), (true, false));

    // The pacer hears the limiter's reports (what tells it about input).
    wait_until_ok(
        Duration::from_secs(20),
        Duration::from_millis(200),
        || async {
            let sources: Value = http
                .get(format!("{url}/v1/sources"))
                .send()
                .await?
                .json()
                .await?;
            let limiters = sources["limiters"].as_array().context("limiters")?;
            if limiters.is_empty() || limiters.iter().any(|l| l["stale"] != false) {
                bail!("no fresh limiter report: {sources}");
            }
            Ok(())
        },
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "the pacer hears the limiter: {e:#}\n{}\n{}",
            p.pacer.as_ref().unwrap().log_tail(40),
            p.limiter.as_ref().unwrap().log_tail(20)
        )
    });

    // The limiter stops; ad servers go on publishing.
    p.limiter.as_mut().unwrap().pause().expect("SIGSTOP");
    truth.absorb(&p.publish(&sim_config(500, 82)).await);
    let limits = wait_until_ok(
        Duration::from_secs(20),
        Duration::from_millis(200),
        || async {
            let limits = freshness(&http, &url).await?;
            if limits
                .iter()
                .any(|(_, stale, lag)| !*stale || *lag <= STALE_AFTER_MS)
            {
                let sources = http
                    .get(format!("{url}/v1/sources"))
                    .send()
                    .await?
                    .text()
                    .await?;
                bail!("not every limit stale with its lag past the threshold: {limits:?}; sources {sources}");
            }
            Ok(limits)
        },
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "every limit stale while the limiter is stuck: {e:#}\n{}\n{}",
            p.pacer.as_ref().unwrap().log_tail(40),
            p.limiter.as_ref().unwrap().log_tail(20)
        )
    });
    assert_eq!(limits.len(), p.catalog.limits.len());
    assert_eq!(
        decision(&http, &url, &ad).await.unwrap(),
        (false, true),
        "a stale limit's ad is not servable"
    );
    let shards: Value = http
        .get(format!("{url}/v1/shards"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for shard in shards["shards"].as_array().expect("shards") {
        assert_eq!(shard["stale"], true, "{shard}");
        assert!(
            shard["lag_ms"].as_i64().unwrap() > STALE_AFTER_MS,
            "{shard}"
        );
    }

    // It goes on: fresh and exact again.
    p.limiter.as_mut().unwrap().resume().expect("SIGCONT");
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);
    all_fresh(&http, &url)
        .await
        .expect("fresh again once the limiter goes on");
    assert!(!decision(&http, &url, &ad).await.unwrap().1, "not stale");
}

/// A partition whose owner is alive and pushing heartbeats but applies
/// nothing (its writer stuck in a commit, by a failure point that stalls
/// it) is a partition with no progress: its watermark stops, so its limits
/// turn stale with their lag growing from now, though the shard pushes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_pushes_but_applies_nothing_turns_its_limits_stale() {
    let (mut p, mut truth) = start(83).await;
    let http = reqwest::Client::new();
    let url = p.pacer_url();

    // The same aggregator again, its first commit stalled for 12 s.
    p.aggregator.as_mut().unwrap().kill();
    p.aggregator = Some(p.spawn_with(
        "aggregator",
        adspend_harness::free_port(),
        &[("ADSPEND_FAILPOINTS", "aggregator.before_commit@1~12000")],
    ));
    truth.absorb(&p.publish(&sim_config(300, 84)).await);
    wait_until_ok(
        Duration::from_secs(10),
        Duration::from_millis(200),
        || async {
            let limits = freshness(&http, &url).await?;
            if limits
                .iter()
                .any(|(_, stale, lag)| !*stale || *lag <= STALE_AFTER_MS)
            {
                bail!("not every limit stale: {limits:?}");
            }
            let shards: Value = http
                .get(format!("{url}/v1/shards"))
                .send()
                .await?
                .json()
                .await?;
            let now = adspend_common::now_ms();
            for shard in shards["shards"].as_array().context("shards")? {
                let updated = shard["updated_ms"].as_i64().context("updated_ms")?;
                if now - updated > STALE_AFTER_MS {
                    bail!("the shard must still be pushing: {shard}");
                }
            }
            Ok(())
        },
    )
    .await
    .expect("stale while the owner pushes but applies nothing");
    let aggregator = p.aggregator.as_mut().unwrap();
    assert!(
        aggregator
            .log_tail(200)
            .contains("FAILPOINT STALLED: aggregator.before_commit"),
        "the stall fired"
    );
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);
    all_fresh(&http, &url)
        .await
        .expect("fresh once it applies again");
}
