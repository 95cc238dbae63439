//! Crashes of the other components: NATS, etcd and the pacer.

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use adspend_harness::{free_port, wait_until, wait_until_ok};
use adspend_sim::SimConfig;
use tokio_util::sync::CancellationToken;

use crate::support::{assert_exact, sim_config, Backends, Pipeline};

use super::{
    current_record, log_len, log_since, merged, pacer_total, report, spend_bounds, wait_applied,
    wait_limiter_drained, wait_record, SETTLE,
};

/// kill -9 of NATS mid-run and a restart on the same store: every service
/// reconnects, and the pacer equals the truth of what reached the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_crash_mid_run_keeps_totals_exact() {
    let started = Instant::now();
    let mut p = Pipeline::start(Backends::default(), 300).await;
    p.spawn_all().await;
    let client = p.client().await;
    let catalog = p.catalog.clone();
    let config = SimConfig {
        events: Some(24_000),
        rate: 4_000.0,
        duplicate_rate: 0.1,
        batch: 25,
        seed: 61,
        ack_timeout: Duration::from_secs(5),
        ..SimConfig::default()
    };
    let publisher = tokio::spawn(async move {
        adspend_sim::run(&client, &config, &catalog, CancellationToken::new()).await
    });
    wait_until(
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async { pacer_total(&p).await > 0 },
    )
    .await
    .expect("no spend reached the pacer before the crash");

    assert!(!publisher.is_finished(), "the run ended before the crash");
    p.nats.kill();
    // The outage itself: a fixed time by definition.
    tokio::time::sleep(Duration::from_secs(1)).await;
    p.nats.restart().await;
    let sent = publisher.await.unwrap().expect("simulator");
    let client = p.client().await;
    let truth = adspend_sim::stream_truth::truth_from_stream(&client, &p.catalog)
        .await
        .expect("truth from IMPRESSIONS");
    assert!(
        truth.stats.unique_events >= sent.stats.unique_events,
        "the stream lost acknowledged impressions: {} in it, {} acknowledged",
        truth.stats.unique_events,
        sent.stats.unique_events
    );
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    for service in [&mut p.limiter, &mut p.aggregator, &mut p.pacer] {
        let service = service.as_mut().unwrap();
        assert!(service.is_running(), "{}", service.log_tail(20));
    }
    eprintln!(
        "recovery::nats_crash: {} messages failed during the outage",
        sent.stats.messages_failed
    );
    report("nats_crash", started);
}

/// After a NATS crash and restart, new spend reaches the pacer again within
/// seconds: the pacer's answers are meant to be fresh within a fraction of a
/// second, and every second of staleness is overspend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spend_flows_again_within_seconds_after_a_nats_restart() {
    let started = Instant::now();
    let mut p = Pipeline::start(Backends::default(), 200).await;
    p.spawn_all().await;
    let before = p.publish(&sim_config(2_000, 62)).await;
    assert_exact(&p.settle(&before, SETTLE).await, &before);

    p.nats.kill();
    p.nats.restart().await;
    let restarted = Instant::now();
    let after = p.publish(&sim_config(2_000, 63)).await;
    assert_eq!(after.stats.messages_failed, 0);
    let truth = merged(&[&before, &after]);
    let fresh = p.settle(&truth, Duration::from_secs(5)).await;
    if !fresh.mismatches().is_empty() {
        let late = p.settle(&truth, SETTLE).await;
        let caught_up = restarted.elapsed();
        let stalled = log_since(p.aggregator.as_ref().unwrap(), 0)
            .lines()
            .filter(|l| l.contains("SPEND consumer"))
            .collect::<Vec<_>>()
            .join("\n");
        panic!(
            "5s after NATS came back the pacer still missed {} of {} micros ({} limits \
             behind); it caught up {} after {caught_up:?}. Aggregator:\n{stalled}",
            fresh.total_truth() - fresh.total_pacer(),
            fresh.total_truth(),
            fresh.mismatches().len(),
            if late.mismatches().is_empty() {
                "only"
            } else {
                "NOT even"
            },
        );
    }
    report("spend_flows_again_after_nats_restart", started);
}

/// kill -9 of etcd mid-run: checkpoints fail while it is down (logged, the
/// aggregator keeps applying and pushing), resume after its restart, failed
/// attempts leave no stray snapshots for long, and the totals are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_crash_mid_run_pauses_checkpoints_only() {
    let started = Instant::now();
    let mut p = Pipeline::start(
        Backends {
            etcd: true,
            s3: false,
        },
        300,
    )
    .await;
    p.spawn_all().await;
    let mut aggregator = p.aggregator.take().unwrap();
    let client = p.client().await;
    let catalog = p.catalog.clone();
    // Publishing goes on until spend is seen reaching the pacer with etcd
    // down: a fixed count could run out first on a loaded machine, while the
    // checkpoint attempt is still waiting out etcd's timeout.
    let config = SimConfig {
        events: None,
        rate: 3_000.0,
        duplicate_rate: 0.1,
        batch: 25,
        seed: 71,
        ..SimConfig::default()
    };
    let stop_publishing = CancellationToken::new();
    let stop = stop_publishing.clone();
    let publisher =
        tokio::spawn(async move { adspend_sim::run(&client, &config, &catalog, stop).await });
    let before = wait_record(&p, "a sequence", |r| r.seq > 0).await;

    let offset = log_len(&aggregator);
    p.etcd.as_mut().unwrap().kill();
    aggregator
        .wait_for_log("checkpoint failed", Duration::from_secs(20))
        .await
        .expect("a checkpoint attempt while etcd is down");
    // Freshness does not wait for durability.
    let total = pacer_total(&p).await;
    wait_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async { pacer_total(&p).await > total },
    )
    .await
    .expect("spend stopped reaching the pacer while etcd was down");
    assert!(aggregator.is_running(), "{}", aggregator.log_tail(20));
    stop_publishing.cancel();

    let restarted_ms = adspend_common::now_ms();
    p.etcd.as_mut().unwrap().restart().await;
    let resumed = wait_record(&p, "a checkpoint after etcd's restart", |r| {
        r.created_ms >= restarted_ms && r.checkpoint_id > before.checkpoint_id
    })
    .await;
    assert!(resumed.seq > before.seq);
    let sent = publisher.await.unwrap().expect("simulator");
    assert_eq!(sent.stats.messages_failed, 0);
    assert_exact(&p.settle(&sent, SETTLE).await, &sent);
    assert!(aggregator.is_running(), "{}", aggregator.log_tail(20));
    assert!(
        !log_since(&aggregator, offset).contains("aggregator stopping"),
        "{}",
        aggregator.log_tail(20)
    );
    // Objects uploaded by the failed attempts are collected: what remains is
    // the recorded chain (base and deltas) and the chains of the two older
    // bases kept.
    let shard_dir = p.aggregator_dir().join("snapshots/all");
    let id = |name: &str| name.get(..20).and_then(|id| id.parse::<u64>().ok());
    wait_until_ok(
        Duration::from_secs(10),
        Duration::from_millis(200),
        || async {
            let record = current_record(&p).await?;
            let base = record.snapshot_key.rsplit('/').next().and_then(id);
            let names: Vec<String> = std::fs::read_dir(&shard_dir)?
                .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect::<Result<_, _>>()?;
            let bases = names.iter().filter(|n| n.ends_with(".mdb")).count();
            let stray: Vec<&String> = names
                .iter()
                .filter(|n| {
                    let key = format!("all/{n}");
                    key != record.snapshot_key
                        && !record.deltas.iter().any(|d| d.key == key)
                        && id(n) >= base
                })
                .collect();
            anyhow::ensure!(
                bases <= 3 && stray.is_empty(),
                "{bases} bases, not named by the record: {stray:?}"
            );
            Ok(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("snapshots left: {e:#}"));
    report("etcd_crash", started);
}

/// kill -9 of the pacer: what is applied while it is down reaches it only
/// through the full resync it asks for on start, and it equals the truth.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pacer_crash_rebuilds_state_by_full_resync() {
    let started = Instant::now();
    let mut p = Pipeline::start(Backends::default(), 300).await;
    let aggregator_port = free_port();
    p.aggregator = Some(p.spawn_with("aggregator", aggregator_port, &[]));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let before = p.publish(&sim_config(5_000, 81)).await;
    assert_exact(&p.settle(&before, SETTLE).await, &before);

    let mut pacer = p.pacer.take().unwrap();
    let status = pacer.kill();
    assert_eq!(status.signal(), Some(9), "{status:?}");
    let during = p.publish(&sim_config(5_000, 82)).await;
    wait_limiter_drained(&p).await;
    // Applied (and pushed to nobody) before the pacer comes back.
    let (_, last) = spend_bounds(&p).await;
    wait_applied(aggregator_port, last).await;

    pacer.restart();
    p.pacer = Some(pacer);
    p.wait_pacer().await;
    let truth = merged(&[&before, &during]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    report("pacer_crash", started);
}
