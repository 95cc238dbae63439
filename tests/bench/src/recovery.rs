//! Aggregator recovery: SIGKILL, spend published while it is down, restart,
//! and the time until the pacer equals the truth again. Warm: the local LMDB
//! survives. Cold: the data dir is wiped, so the aggregator downloads the
//! latest snapshot from S3 (moto) and replays from its checkpoint in etcd.
//! Both at the same state, built before the first kill.

use std::time::{Duration, Instant};

use anyhow::Context as _;

use super::e2e;
use super::workload::{Workload, WorkloadSpec};
use adspend_harness::pipeline::{try_metric, Backends};
use adspend_sim::check::wait_for_match;
use adspend_sim::{generate_catalog, CatalogSpec};

pub struct Recovery {
    pub warm_secs: Vec<f64>,
    pub cold_secs: Vec<f64>,
    pub snapshot_bytes: u64,
    pub dedupe_ids: u64,
}

/// Events published while the aggregator is down, per kill.
const WHILE_DOWN: u64 = 20_000;

/// Most ads whose catalog fits etcd's default 2 MiB request limit.
pub const MAX_ADS: u32 = 10_000;

pub async fn run(ads: u32, events: u64, batch: usize, runs: usize) -> anyhow::Result<Recovery> {
    let ads = ads.min(MAX_ADS);
    let catalog = generate_catalog(&CatalogSpec::for_ads(ads), 5)?;
    let spec = |events, seed| WorkloadSpec {
        ads,
        events,
        batch,
        duplicate_rate: 0.05,
        seed,
    };
    let base = Workload::generate_for(catalog.clone(), &spec(events, 1))?;
    let (p, ports) = e2e::start_with_ports(
        catalog.clone(),
        true,
        Backends {
            etcd: true,
            s3: true,
        },
        // One shard, whose snapshot and dedupe window it measures.
        &[("ADSPEND_AGGREGATOR_WRITERS".into(), "1".into())],
    )
    .await?;
    let client = p.client().await;
    e2e::publish_all(
        &client,
        "impressions.bench",
        base.messages.iter().cloned(),
        256,
    )
    .await?;
    let mut truth = base.truth.clone();
    let (c, _) = wait_for_match(&p.pacer_url(), &truth, Duration::from_secs(600)).await?;
    anyhow::ensure!(
        c.mismatches().is_empty(),
        "the pipeline did not reach the truth before the first kill"
    );

    let mut result = Recovery {
        warm_secs: Vec::new(),
        cold_secs: Vec::new(),
        snapshot_bytes: 0,
        dedupe_ids: 0,
    };
    let mut p = p;
    // Restarts keep the environment, so the port too.
    let metrics_port = ports.aggregator;
    for step in 0..runs * 2 {
        let cold = step % 2 == 1;
        // A checkpoint that includes everything so far, so warm and cold
        // restarts replay the same stretch (what was published while down).
        let checkpoints =
            |port| try_metric(port, "adspend_aggregator_checkpoints_total{outcome=\"ok\"}");
        let before = checkpoints(metrics_port).await?;
        adspend_harness::wait_until_ok(
            Duration::from_secs(60),
            Duration::from_millis(200),
            || async {
                anyhow::ensure!(
                    checkpoints(metrics_port).await? > before,
                    "no new checkpoint yet"
                );
                Ok(())
            },
        )
        .await
        .context("waiting for a checkpoint")?;
        result.snapshot_bytes = try_metric(
            metrics_port,
            "adspend_aggregator_snapshot_bytes{shard=\"all\"}",
        )
        .await? as u64;
        result.dedupe_ids =
            try_metric(metrics_port, "adspend_aggregator_dedupe_ids{shard=\"all\"}").await? as u64;

        let aggregator = p.aggregator.as_mut().expect("aggregator running");
        aggregator.kill();
        if cold {
            let lmdb = p.aggregator_dir().join("lmdb");
            std::fs::remove_dir_all(&lmdb).with_context(|| format!("wiping {}", lmdb.display()))?;
        }
        let extra = Workload::generate_for(catalog.clone(), &spec(WHILE_DOWN, 100 + step as u64))?;
        e2e::publish_all(
            &client,
            "impressions.bench",
            extra.messages.iter().cloned(),
            256,
        )
        .await?;
        truth.absorb(&extra.truth);
        // The pacer holds the old sums; wait until the limiter has emitted
        // the new spend, so the clock starts with work queued for the aggregator.
        tokio::time::sleep(Duration::from_secs(1)).await;

        let started = Instant::now();
        let aggregator = p.aggregator.as_mut().expect("aggregator");
        aggregator.restart();
        let (c, _) = wait_for_match(&p.pacer_url(), &truth, Duration::from_secs(300)).await?;
        let secs = started.elapsed().as_secs_f64();
        anyhow::ensure!(
            c.mismatches().is_empty(),
            "after restart {step} the pacer differs from the truth:\n{}",
            c.render(10)
        );
        let expected = if cold { "cold" } else { "warm" };
        let log = p.aggregator.as_ref().expect("aggregator").log_tail(400);
        anyhow::ensure!(
            log.lines()
                .any(|l| l.contains("aggregator running") && l.contains(expected)),
            "the restarted aggregator did not report a {expected} start:\n{log}"
        );
        println!(
            "bench:   recovery {}: {secs:.2}s ({} MB snapshot, {} ids)",
            if cold { "cold" } else { "warm" },
            result.snapshot_bytes / 1_000_000,
            result.dedupe_ids
        );
        if cold {
            result.cold_secs.push(secs);
        } else {
            result.warm_secs.push(secs);
        }
    }
    Ok(result)
}
