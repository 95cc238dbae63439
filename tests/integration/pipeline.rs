//! End to end: simulator → limiter → NATS → aggregator → pacer equals the
//! ground truth exactly, with duplicates in the input.

use std::time::Duration;

use adspend_aggregator::record::CheckpointRecord;
use adspend_common::service::Context;
use adspend_harness::free_port;
use clap::Parser;

use crate::support::{assert_exact, sim_config, Backends, Pipeline, BUCKET};

/// The services run in-process through their `run` functions, configured
/// through the same flags an operator would use, validated once, with the
/// pacer's listener bound here; every task they track ends on shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_process_pipeline_is_exact_with_duplicates() {
    let p = Pipeline::start(Backends::default(), 300).await;
    let args = |extra: &[String]| -> Vec<String> {
        let mut args = vec![
            "svc".to_string(),
            format!("--nats-url={}", p.nats.url()),
            format!("--metrics-addr=127.0.0.1:{}", free_port()),
        ];
        args.extend_from_slice(extra);
        args
    };
    let catalog = format!("--catalog={}", p.catalog_path.display());
    let partitions = "--partitions=4".to_string();
    let context = Context::new();
    let limiter = adspend_limiter::Config::parse_from(args(&[
        partitions.clone(),
        catalog.clone(),
        "--checkpoint-interval-ms=300".into(),
    ]))
    .validate()
    .unwrap();
    let aggregator = adspend_aggregator::Config::parse_from(args(&[
        partitions,
        format!("--data-dir={}", p.aggregator_dir().display()),
        // One shard, whose record and snapshot the test reads below.
        "--writers=1".into(),
    ]))
    .validate()
    .unwrap();
    let pacer = adspend_pacer::Config::parse_from(args(&[catalog]))
        .validate()
        .unwrap();
    let pacer_listeners = adspend_pacer::Listeners {
        api: tokio::net::TcpListener::bind(&p.pacer_addr).await.unwrap(),
        ops: None,
    };
    let tasks = [
        tokio::spawn({
            let c = context.clone();
            async move {
                adspend_aggregator::run(aggregator, c)
                    .await
                    .map_err(|e| e.to_string())
            }
        }),
        tokio::spawn({
            let c = context.clone();
            async move {
                adspend_limiter::run(limiter, c)
                    .await
                    .map_err(|e| e.to_string())
            }
        }),
        tokio::spawn({
            let c = context.clone();
            async move {
                adspend_pacer::run(pacer, pacer_listeners, c)
                    .await
                    .map_err(|e| e.to_string())
            }
        }),
    ];
    p.wait_pacer().await;

    let truth = p.publish(&sim_config(20_000, 1)).await;
    assert!(truth.stats.duplicates_sent > 1000, "{:?}", truth.stats);
    let comparison = p.settle(&truth, Duration::from_secs(60)).await;
    assert_exact(&comparison, &truth);

    // Checkpoints happened along the way: a record naming a snapshot file.
    let record_path = p.aggregator_dir().join("checkpoint/checkpoint.json");
    adspend_harness::wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        let path = record_path.clone();
        async move { path.exists() }
    })
    .await
    .expect("no checkpoint record was written");
    let record: CheckpointRecord =
        serde_json::from_slice(&std::fs::read(&record_path).unwrap()).unwrap();
    assert!(record.seq > 0);
    let snapshot = p
        .aggregator_dir()
        .join("snapshots")
        .join(&record.snapshot_key);
    assert_eq!(
        std::fs::metadata(&snapshot).unwrap().len(),
        record.size_bytes
    );

    context.shutdown.cancel();
    for task in tasks {
        let result = tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .expect("service did not stop on shutdown")
            .expect("service task panicked");
        assert_eq!(result, Ok(()));
    }
    context.tasks.close();
    tokio::time::timeout(Duration::from_secs(20), context.tasks.wait())
        .await
        .expect("tracked tasks still running after shutdown");
}

/// Real processes, snapshots in the S3 server, checkpoint records and the
/// catalog in etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_with_s3_snapshots_and_etcd_checkpoints_is_exact() {
    let mut p = Pipeline::start(
        Backends {
            etcd: true,
            s3: true,
        },
        300,
    )
    .await;
    p.spawn_all().await;
    let truth = p.publish(&sim_config(20_000, 2)).await;
    let comparison = p.settle(&truth, Duration::from_secs(60)).await;
    assert_exact(&comparison, &truth);

    let etcd = p.etcd.as_ref().unwrap();
    let s3 = p.s3.as_ref().unwrap();
    let record: CheckpointRecord = adspend_harness::wait_until_ok(
        Duration::from_secs(10),
        Duration::from_millis(200),
        || async {
            let bytes = etcd
                .get("/adspend/shards/all/checkpoint")
                .await?
                .ok_or_else(|| anyhow::anyhow!("no checkpoint record in etcd yet"))?;
            let record: CheckpointRecord = serde_json::from_slice(&bytes)?;
            anyhow::ensure!(record.seq > 0, "record at sequence 0");
            Ok(record)
        },
    )
    .await
    .expect("no checkpoint record in etcd");
    let keys = s3.list_keys(BUCKET, "snapshots/").await.unwrap();
    assert!(
        keys.contains(&format!("snapshots/{}", record.snapshot_key)),
        "{} not among {keys:?}",
        record.snapshot_key
    );
    let object = s3
        .get_object(BUCKET, &format!("snapshots/{}", record.snapshot_key))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(object.len() as u64, record.size_bytes);
    // Old chains are collected: at most the recorded base and the two kept
    // older ones, each with its deltas.
    let bases = keys.iter().filter(|k| k.ends_with(".mdb")).count();
    assert!(bases <= 3, "{keys:?}");

    for service in [p.limiter.as_mut(), p.aggregator.as_mut(), p.pacer.as_mut()] {
        let status = service.unwrap().terminate(Duration::from_secs(20)).unwrap();
        assert!(status.success(), "{status:?}");
    }
}

/// `ADSPEND_NATS_URL` may list several servers of one cluster; a service
/// starts while the first one listed is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_url_list_reaches_the_live_server() {
    let mut p = Pipeline::start(Backends::default(), 50).await;
    let urls = format!("nats://127.0.0.1:{},{}", free_port(), p.nats.url());
    let services = [
        ("aggregator", "aggregator running"),
        ("limiter", "limiter running"),
    ];
    for (service, running) in services {
        let mut process = p.spawn_with(service, free_port(), &[("ADSPEND_NATS_URL", &urls)]);
        process
            .wait_for_log(running, Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("{service} with {urls}: {e}"));
        match service {
            "aggregator" => p.aggregator = Some(process),
            _ => p.limiter = Some(process),
        }
    }
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let truth = p.publish(&sim_config(1_000, 41)).await;
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);
}
