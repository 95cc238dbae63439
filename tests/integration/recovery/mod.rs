//! Crash-proof exactly-once: the aggregator's local state wiped, its snapshot
//! missing or damaged, a `SPEND` log that no longer holds what it needs or
//! went backwards, a stale owner coming back, and crashes of NATS, etcd and
//! the pacer. Every test runs the services as real processes and ends either
//! with the pacer equal to the truth or with the aggregator refusing loudly
//! (non-zero exit, one `aggregator: error: ...` line) without touching state.
//!
//! One file per kind of fault: [`local_state`] (the LMDB wiped),
//! [`snapshots`] (the recorded snapshot missing or corrupt),
//! [`stream_integrity`] (a retention gap, the log going backwards),
//! [`fencing`] (a stale owner coming back) and [`crashes`] (NATS, etcd, the
//! pacer); the helpers they share are here.

mod crashes;
mod deltas;
mod fencing;
mod local_state;
mod snapshots;
mod stream_integrity;

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use adspend_aggregator::record::CheckpointRecord;
use adspend_aggregator::snapshot_store::Checksum;
use adspend_aggregator::store::{Store, DEFAULT_MAP_SIZE};
use adspend_harness::limiter_progress::limiter_backlog;
use adspend_harness::{wait_until, wait_until_ok, ServiceProcess};
use adspend_sim::Truth;
use adspend_wire::codec::encode_spend;
use adspend_wire::types::{CheckpointMarker, SpendMessage};
use anyhow::Context;
use async_nats::jetstream;

use crate::support::{metric, Backends, Pipeline};

const RECORD_KEY: &str = "/adspend/shards/all/checkpoint";
const SETTLE: Duration = Duration::from_secs(45);
const START: Duration = Duration::from_secs(30);
const LAST_APPLIED: &str = "adspend_aggregator_last_applied_seq{shard=\"all\"}";
const ETCD_S3: Backends = Backends {
    etcd: true,
    s3: true,
};

// ---- helpers -------------------------------------------------------------

/// An aggregator with its own log file, so two aggregators of one test (or
/// two runs whose output must be told apart) do not share one.
fn spawn_aggregator(
    p: &Pipeline,
    log: &str,
    metrics_port: u16,
    extra: &[(&str, &str)],
) -> ServiceProcess {
    let mut env = p.env();
    env.retain(|(k, _)| !extra.iter().any(|(e, _)| e == k));
    env.push((
        "ADSPEND_METRICS_ADDR".into(),
        format!("127.0.0.1:{metrics_port}"),
    ));
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    ServiceProcess::builder("aggregator")
        .envs(env)
        .log_file(p.dir.path().join(log))
        .spawn()
}

/// Where the next run of `process` starts writing its log.
pub(crate) fn log_len(process: &ServiceProcess) -> u64 {
    std::fs::metadata(process.log_path())
        .map(|m| m.len())
        .unwrap_or(0)
}

/// The log written since `offset`.
pub(crate) fn log_since(process: &ServiceProcess, offset: u64) -> String {
    let mut file = std::fs::File::open(process.log_path()).expect("open service log");
    file.seek(SeekFrom::Start(offset))
        .expect("seek service log");
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).expect("read service log");
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The value of field `name` on the first line of `log` containing `message`.
fn log_field(log: &str, message: &str, name: &str) -> Option<String> {
    let line = log.lines().find(|l| l.contains(message))?;
    let needle = format!(" {name}=");
    let start = line.find(&needle)? + needle.len();
    let value = line[start..].split_whitespace().next()?;
    Some(value.trim_matches('"').to_string())
}

/// Fields of the "aggregator running" line of one run: (epoch, start,
/// last applied sequence).
fn running_line(log: &str) -> (u64, String, u64) {
    let field = |name| {
        log_field(log, "aggregator running", name)
            .unwrap_or_else(|| panic!("no {name} on the \"aggregator running\" line:\n{log}"))
    };
    (
        field("epoch").parse().expect("epoch is a number"),
        field("start"),
        field("last_applied_seq")
            .parse()
            .expect("last_applied_seq is a number"),
    )
}

/// Whether `text` holds `n` as a whole number (not as part of a longer one).
fn names_number(text: &str, n: u64) -> bool {
    text.split(|c: char| !c.is_ascii_digit())
        .any(|token| token == n.to_string())
}

/// Restart a stopped aggregator that must refuse to start: it exits 1
/// without ever running, with one `aggregator: error: ...` line, which is
/// returned.
async fn expect_refusal(aggregator: &mut ServiceProcess) -> String {
    let offset = log_len(aggregator);
    aggregator.restart();
    let status = match aggregator.wait_for_exit(START).await {
        Ok(status) => status,
        Err(e) => panic!(
            "the aggregator did not refuse to start: {e}\n{}",
            aggregator.log_tail(30)
        ),
    };
    let log = log_since(aggregator, offset);
    assert_eq!(status.code(), Some(1), "exit status {status:?}:\n{log}");
    assert!(
        !log.contains("aggregator running"),
        "it ran before failing:\n{log}"
    );
    log.lines()
        .find(|l| l.starts_with("aggregator: error: "))
        .unwrap_or_else(|| panic!("no `aggregator: error:` line:\n{log}"))
        .to_string()
}

async fn etcd_record(p: &Pipeline) -> anyhow::Result<CheckpointRecord> {
    let etcd = p.etcd.as_ref().context("the pipeline has no etcd")?;
    let bytes = etcd
        .get(RECORD_KEY)
        .await?
        .context("no checkpoint record in etcd")?;
    Ok(serde_json::from_slice(&bytes)?)
}

fn local_record(p: &Pipeline) -> anyhow::Result<CheckpointRecord> {
    let path = p.aggregator_dir().join("checkpoint/checkpoint.json");
    let bytes = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
    Ok(serde_json::from_slice(&bytes)?)
}

async fn current_record(p: &Pipeline) -> anyhow::Result<CheckpointRecord> {
    if p.etcd.is_some() {
        etcd_record(p).await
    } else {
        local_record(p)
    }
}

/// Wait for a checkpoint record that `accept`s.
async fn wait_record(
    p: &Pipeline,
    what: &str,
    accept: impl Fn(&CheckpointRecord) -> bool,
) -> CheckpointRecord {
    let accept = &accept;
    wait_until_ok(
        Duration::from_secs(30),
        Duration::from_millis(100),
        move || async move {
            let record = current_record(p).await?;
            anyhow::ensure!(accept(&record), "the record is {record:?}");
            Ok(record)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("no checkpoint record with {what}: {e:#}"))
}

fn checksum(bytes: &[u8]) -> String {
    let mut sum = Checksum::default();
    sum.update(bytes);
    sum.finish()
}

fn snapshot_object(record: &CheckpointRecord) -> String {
    format!("snapshots/{}", record.snapshot_key)
}

/// The aggregator's LMDB read directly while it is stopped: (lineage, last
/// applied sequence).
fn lmdb_position(p: &Pipeline) -> (Option<String>, u64) {
    let dir = p.aggregator_dir().join("lmdb");
    assert!(
        dir.join("data.mdb").exists(),
        "no LMDB in {}",
        dir.display()
    );
    let store = Store::open(&dir, DEFAULT_MAP_SIZE).expect("open the aggregator's LMDB");
    let position = store.position().expect("read the LMDB position");
    store.env.prepare_for_closing().wait();
    position
}

async fn spend_bounds(p: &Pipeline) -> (u64, u64) {
    let js = jetstream::new(p.client().await);
    let mut stream = js.get_stream("SPEND").await.expect("SPEND exists");
    let state = &stream.info().await.expect("SPEND info").state;
    (state.first_sequence, state.last_sequence)
}

async fn purge_spend_before(p: &Pipeline, keep_from: u64) {
    let js = jetstream::new(p.client().await);
    let stream = js.get_stream("SPEND").await.expect("SPEND exists");
    stream
        .purge()
        .sequence(keep_from)
        .await
        .expect("purge SPEND");
}

/// Wait until the limiter has handled and acknowledged every impression,
/// i.e. its output is in `SPEND`.
async fn wait_limiter_drained(p: &Pipeline) {
    let client = p.client().await;
    wait_until_ok(Duration::from_secs(30), Duration::from_millis(100), || {
        let client = client.clone();
        async move {
            let backlog = limiter_backlog(&client).await?;
            anyhow::ensure!(
                backlog == Some((0, 0)),
                "limiter consumers (pending, unacknowledged): {backlog:?}"
            );
            Ok(())
        }
    })
    .await
    .expect("the limiter did not drain IMPRESSIONS");
}

/// Wait until the aggregator (metrics on `port`) applied `seq`.
async fn wait_applied(port: u16, seq: u64) {
    wait_until(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async { metric(port, LAST_APPLIED).await >= seq as f64 },
    )
    .await
    .unwrap_or_else(|_| panic!("the aggregator did not apply sequence {seq}"));
}

/// A checkpoint marker of our own on `spend.0`; returns its sequence.
async fn publish_marker(p: &Pipeline) -> u64 {
    let js = jetstream::new(p.client().await);
    let now = adspend_common::now_ms();
    let payload = encode_spend(&SpendMessage::Marker(CheckpointMarker {
        marker_id: now as u64,
        partition: 0,
        emitted_ms: now,
    }));
    js.publish("spend.0", payload.into())
        .await
        .expect("publish marker")
        .await
        .expect("marker acknowledged")
        .sequence
}

async fn pacer_total(p: &Pipeline) -> u64 {
    p.lifetimes().await.map(|l| l.values().sum()).unwrap_or(0)
}

/// The truth of several runs with distinct run ids (no shared impressions).
fn merged(truths: &[&Truth]) -> Truth {
    let mut merged = Truth::default();
    for truth in truths {
        merged.absorb(truth);
    }
    merged
}

fn wipe_lmdb(p: &Pipeline) -> PathBuf {
    let lmdb = p.aggregator_dir().join("lmdb");
    assert!(
        lmdb.join("data.mdb").exists(),
        "no local LMDB to wipe in {}",
        lmdb.display()
    );
    std::fs::remove_dir_all(&lmdb).expect("wipe the local LMDB");
    lmdb
}

fn report(test: &str, started: Instant) {
    eprintln!("recovery::{test}: {:.1}s", started.elapsed().as_secs_f64());
}
