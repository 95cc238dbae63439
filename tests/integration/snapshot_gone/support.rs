//! What the lost-snapshot tests share: the pipeline's records and metrics, the S3 objects, and the truths they compare.

use std::path::Path;
use std::time::{Duration, Instant};

use adspend_aggregator::record::CheckpointRecord;
use adspend_harness::limiter_progress::limiter_backlog;
use adspend_harness::wait_until_ok;
use adspend_sim::Truth;
use async_nats::jetstream;

use crate::support::{Backends, Pipeline, BUCKET};

pub(super) const ETCD_S3: Backends = Backends {
    etcd: true,
    s3: true,
};
pub(super) const SETTLE: Duration = Duration::from_secs(60);
pub(super) const START: Duration = Duration::from_secs(30);
pub(super) const ACCEPT_LOSS: &str = "ADSPEND_AGGREGATOR_ACCEPT_LOSS";

// ---- helpers -------------------------------------------------------------

/// The value of the series `name` whose labels include every one of
/// `labels`, on the metrics endpoint at `port`; 0 when absent.
pub(super) async fn series(port: u16, name: &str, labels: &[(&str, &str)]) -> f64 {
    let body = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .expect("metrics endpoint")
        .text()
        .await
        .expect("metrics body");
    body.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .find(|line| {
            labels
                .iter()
                .all(|(k, v)| line.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// Field `name` of the first line of `log` holding `message` and `with`.
pub(super) fn log_field(log: &str, message: &str, with: &str, name: &str) -> Option<String> {
    let line = log
        .lines()
        .find(|l| l.contains(message) && l.contains(with))?;
    let needle = format!(" {name}=");
    let start = line.find(&needle)? + needle.len();
    let value = line[start..].split_whitespace().next()?;
    Some(value.trim_matches('"').to_string())
}

pub(super) async fn record(p: &Pipeline, shard: &str) -> anyhow::Result<CheckpointRecord> {
    let bytes = match &p.etcd {
        Some(etcd) => etcd
            .get(&format!("/adspend/shards/{shard}/checkpoint"))
            .await?
            .ok_or_else(|| anyhow::anyhow!("no checkpoint record of {shard} in etcd"))?,
        None => std::fs::read(p.aggregator_dir().join("checkpoint/checkpoint.json"))?,
    };
    Ok(serde_json::from_slice(&bytes)?)
}

pub(super) async fn wait_record(
    p: &Pipeline,
    shard: &str,
    what: &str,
    accept: impl Fn(&CheckpointRecord) -> bool,
) -> CheckpointRecord {
    let accept = &accept;
    wait_until_ok(
        Duration::from_secs(45),
        Duration::from_millis(100),
        move || async move {
            let record = record(p, shard).await?;
            anyhow::ensure!(accept(&record), "the record is {record:?}");
            Ok(record)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("no checkpoint record of {shard} with {what}: {e:#}"))
}

/// Every object key a record names: its base, then its deltas.
pub(super) fn named(record: &CheckpointRecord) -> Vec<String> {
    std::iter::once(record.snapshot_key.clone())
        .chain(record.deltas.iter().map(|d| d.key.clone()))
        .collect()
}

/// Delete every S3 object under `prefix`; returns how many there were.
pub(super) async fn delete_objects(p: &Pipeline, prefix: &str) -> usize {
    let s3 = p.s3.as_ref().expect("S3");
    let keys = s3.list_keys(BUCKET, prefix).await.expect("list objects");
    for key in &keys {
        s3.delete_object(BUCKET, key).await.expect("delete object");
    }
    assert!(s3.list_keys(BUCKET, prefix).await.unwrap().is_empty());
    keys.len()
}

/// Whether S3 holds every object `record` names.
pub(super) async fn s3_holds(p: &Pipeline, record: &CheckpointRecord) -> bool {
    let s3 = p.s3.as_ref().expect("S3");
    for key in named(record) {
        match s3.get_object(BUCKET, &format!("snapshots/{key}")).await {
            Ok(Some(_)) => {}
            _ => return false,
        }
    }
    true
}

pub(super) fn wipe(lmdb: &Path) {
    assert!(
        lmdb.join("data.mdb").exists(),
        "no LMDB in {}",
        lmdb.display()
    );
    std::fs::remove_dir_all(lmdb).expect("wipe the local LMDB");
}

pub(super) async fn spend_bounds(p: &Pipeline) -> (u64, u64) {
    let js = jetstream::new(p.client().await);
    let mut stream = js.get_stream("SPEND").await.expect("SPEND");
    let state = &stream.info().await.expect("SPEND info").state;
    (state.first_sequence, state.last_sequence)
}

/// Wait until the limiter has handled every impression (its output is in
/// `SPEND`).
pub(super) async fn wait_limiter_drained(p: &Pipeline) {
    let client = p.client().await;
    wait_until_ok(Duration::from_secs(30), Duration::from_millis(100), || {
        let client = client.clone();
        async move {
            let backlog = limiter_backlog(&client).await?;
            anyhow::ensure!(backlog == Some((0, 0)), "limiter backlog {backlog:?}");
            Ok(())
        }
    })
    .await
    .expect("the limiter did not drain IMPRESSIONS");
}

pub(super) fn merged(truths: &[&Truth]) -> Truth {
    let mut merged = Truth::default();
    for truth in truths {
        merged.absorb(truth);
    }
    merged
}

/// Restart the pacer, so that what it serves comes from the aggregator's
/// current state alone (its resync), not from what it held before.
pub(super) async fn fresh_pacer(p: &mut Pipeline) {
    let pacer = p.pacer.as_mut().expect("pacer");
    pacer.kill();
    pacer.restart();
    p.wait_pacer().await;
}

pub(super) fn report(test: &str, started: Instant) {
    eprintln!(
        "snapshot_gone::{test}: {:.1}s",
        started.elapsed().as_secs_f64()
    );
}

// ---- a. the whole stream is there: rebuilt exactly ------------------------
