//! Crash-proof exactly-once: the aggregator's local state wiped, its snapshot
//! missing or damaged, a `SPEND` log that no longer holds what it needs or
//! went backwards, a stale owner coming back, and crashes of NATS, etcd and
//! the pacer. Every test runs the services as real processes and ends either
//! with the pacer equal to the truth or with the aggregator refusing loudly
//! (non-zero exit, one `aggregator: error: ...` line) without touching state.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use adspend_aggregator::store::{Store, DEFAULT_MAP_SIZE};
use adspend_common::checkpoint::CheckpointRecord;
use adspend_common::codec::encode_spend;
use adspend_common::snapshot_store::Checksum;
use adspend_common::types::{CheckpointMarker, SpendMessage};
use adspend_tests::harness::{free_port, wait_until, wait_until_ok, ServiceProcess};
use adspend_tests::sim::{SimConfig, Truth};
use anyhow::Context;
use async_nats::jetstream;
use tokio_util::sync::CancellationToken;

use crate::support::{assert_exact, metric, sim_config, Backends, Pipeline, BUCKET};

const RECORD_KEY: &str = "/adspend/shards/all/checkpoint";
const SETTLE: Duration = Duration::from_secs(45);
const START: Duration = Duration::from_secs(30);
const LAST_APPLIED: &str = "adspend_last_applied_seq{shard=\"all\"}";
/// moto parses but never checks SigV4; a well-formed header is enough.
const DUMMY_SIGV4: &str = "AWS4-HMAC-SHA256 \
    Credential=test/20240101/us-east-1/s3/aws4_request, \
    SignedHeaders=host, Signature=0000";

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
fn log_len(process: &ServiceProcess) -> u64 {
    std::fs::metadata(process.log_path())
        .map(|m| m.len())
        .unwrap_or(0)
}

/// The log written since `offset`.
fn log_since(process: &ServiceProcess, offset: u64) -> String {
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

async fn delete_object(p: &Pipeline, key: &str) -> anyhow::Result<()> {
    let s3 = p.s3.as_ref().context("the pipeline has no S3")?;
    let url = format!("{}/{BUCKET}/{key}", s3.endpoint());
    let response = reqwest::Client::builder()
        .no_proxy()
        .build()?
        .delete(&url)
        .header(reqwest::header::AUTHORIZATION, DUMMY_SIGV4)
        .send()
        .await?;
    anyhow::ensure!(
        response.status().is_success(),
        "DELETE {url}: {}",
        response.status()
    );
    Ok(())
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
    let js = jetstream::new(p.client().await);
    wait_until_ok(Duration::from_secs(30), Duration::from_millis(100), || {
        let js = js.clone();
        async move {
            let stream = js.get_stream("IMPRESSIONS").await?;
            let info = stream.consumer_info("limiter").await?;
            anyhow::ensure!(
                info.num_pending == 0 && info.num_ack_pending == 0,
                "limiter consumer: {} pending, {} unacknowledged",
                info.num_pending,
                info.num_ack_pending
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

/// Lifetime spend per limit as the pacer serves it.
async fn pacer_lifetimes(p: &Pipeline) -> anyhow::Result<BTreeMap<String, u64>> {
    let http = reqwest::Client::builder().no_proxy().build()?;
    let limits = adspend_tests::check::fetch_limits(&http, &p.pacer_url()).await?;
    Ok(limits
        .into_iter()
        .map(|l| (l.limit_id, l.lifetime_spend_micros))
        .collect())
}

async fn pacer_total(p: &Pipeline) -> u64 {
    pacer_lifetimes(p)
        .await
        .map(|l| l.values().sum())
        .unwrap_or(0)
}

/// The truth of several runs with distinct run ids (no shared impressions).
fn merge(truths: &[&Truth]) -> Truth {
    let mut merged = Truth::default();
    for truth in truths {
        for (id, limit) in &truth.limits {
            let sum = merged.limits.entry(id.clone()).or_default();
            sum.lifetime_micros += limit.lifetime_micros;
            for (day, micros) in &limit.daily {
                *sum.daily.entry(day.clone()).or_default() += micros;
            }
        }
        let stats = &mut merged.stats;
        stats.unique_events += truth.stats.unique_events;
        stats.events_acked += truth.stats.events_acked;
        stats.messages_acked += truth.stats.messages_acked;
        stats.messages_failed += truth.stats.messages_failed;
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

// ---- 1. local state lost -------------------------------------------------

/// SIGKILL, then the local LMDB is gone: the restarted aggregator restores
/// the recorded snapshot from S3 (cold), replays, and the pacer equals the
/// truth, including what was published while it was down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wiped_local_state_restores_cold_from_s3_and_replays_exactly() {
    let started = Instant::now();
    let mut p = Pipeline::start(ETCD_S3, 300).await;
    p.spawn_all().await;
    let mut aggregator = p.aggregator.take().unwrap();
    let before = p.publish(&sim_config(10_000, 21)).await;
    assert_exact(&p.settle(&before, SETTLE).await, &before);
    wait_record(&p, "a sequence", |r| r.seq > 0).await;

    let status = aggregator.kill();
    assert_eq!(status.signal(), Some(9), "{status:?}");
    let record = etcd_record(&p).await.unwrap();
    let during = p.publish(&sim_config(5_000, 22)).await;
    let lmdb = wipe_lmdb(&p);
    let object =
        p.s3.as_ref()
            .unwrap()
            .get_object(BUCKET, &snapshot_object(&record))
            .await
            .unwrap()
            .expect("the recorded snapshot is in S3");
    assert_eq!(object.len() as u64, record.size_bytes);

    let offset = log_len(&aggregator);
    aggregator.restart();
    aggregator
        .wait_for_log("aggregator running", START)
        .await
        .expect("aggregator restarted");
    let (epoch, start, last_applied) = running_line(&log_since(&aggregator, offset));
    assert_eq!(start, "cold");
    assert!(epoch > record.epoch, "epoch {epoch} after {}", record.epoch);
    assert!(
        last_applied >= record.seq,
        "restored at {last_applied}, record at {}",
        record.seq
    );

    let truth = merge(&[&before, &during]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    assert!(lmdb.join("data.mdb").exists());
    // Checkpoints go on in the restored lineage, under the new epoch.
    let next = wait_record(&p, "the new epoch", |r| r.epoch == epoch).await;
    assert!(next.checkpoint_id > record.checkpoint_id, "{next:?}");
    assert_eq!(next.lineage, record.lineage);
    assert!(aggregator.is_running());
    report("wiped_local_state", started);
}

// ---- 2. snapshot lost or damaged -----------------------------------------

/// With the local LMDB wiped, a deleted and then a corrupted (same size,
/// other bytes) snapshot object each stop the aggregator with an error naming
/// the object key, without creating an empty LMDB or touching the record;
/// with the intact object back, it restores and is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_corrupt_s3_snapshot_refuses_to_start_naming_the_key() {
    let started = Instant::now();
    let mut p = Pipeline::start(ETCD_S3, 300).await;
    p.spawn_all().await;
    let mut aggregator = p.aggregator.take().unwrap();
    let truth = p.publish(&sim_config(5_000, 23)).await;
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    wait_record(&p, "a sequence", |r| r.seq > 0).await;
    aggregator.kill();
    let record = etcd_record(&p).await.unwrap();
    let key = snapshot_object(&record);
    let s3 = p.s3.as_ref().unwrap();
    let original = s3
        .get_object(BUCKET, &key)
        .await
        .unwrap()
        .expect("the recorded snapshot is in S3");
    assert_eq!(original.len() as u64, record.size_bytes);
    assert_eq!(checksum(&original), record.checksum);
    let lmdb = wipe_lmdb(&p);

    // Deleted.
    delete_object(&p, &key).await.unwrap();
    assert!(s3.get_object(BUCKET, &key).await.unwrap().is_none());
    let error = expect_refusal(&mut aggregator).await;
    assert!(error.contains(&record.snapshot_key), "{error}");
    assert!(!lmdb.join("data.mdb").exists(), "empty LMDB created");

    // Corrupted: same size, so only the checksum can tell.
    let mut corrupt = original.to_vec();
    let middle = corrupt.len() / 2;
    for byte in &mut corrupt[middle..middle + 64] {
        *byte ^= 0xA5;
    }
    assert_ne!(checksum(&corrupt), record.checksum);
    s3.put_object(BUCKET, &key, corrupt).await.unwrap();
    let error = expect_refusal(&mut aggregator).await;
    assert!(error.contains(&record.snapshot_key), "{error}");
    assert!(error.contains("corrupt"), "{error}");
    assert!(!lmdb.join("data.mdb").exists(), "empty LMDB created");
    assert_eq!(etcd_record(&p).await.unwrap(), record, "record changed");

    // The intact object back: the refusals left nothing behind.
    s3.put_object(BUCKET, &key, original).await.unwrap();
    let offset = log_len(&aggregator);
    aggregator.restart();
    aggregator
        .wait_for_log("aggregator running", START)
        .await
        .expect("aggregator restored");
    let (_, start, _) = running_line(&log_since(&aggregator, offset));
    assert_eq!(start, "cold");
    let more = p.publish(&sim_config(2_000, 24)).await;
    let truth = merge(&[&truth, &more]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    report("missing_or_corrupt_s3_snapshot", started);
}

/// Single-machine mode (`file://` snapshots, record in the data dir): a
/// truncated and then a deleted snapshot file refuse the start, naming the
/// key; the intact file back restores exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_corrupt_file_snapshot_refuses_to_start_naming_the_key() {
    let started = Instant::now();
    let mut p = Pipeline::start(Backends::default(), 200).await;
    p.spawn_all().await;
    let mut aggregator = p.aggregator.take().unwrap();
    let truth = p.publish(&sim_config(4_000, 25)).await;
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    wait_record(&p, "a sequence", |r| r.seq > 0).await;
    aggregator.kill();
    let record = local_record(&p).unwrap();
    let file = p
        .aggregator_dir()
        .join("snapshots")
        .join(&record.snapshot_key);
    let original = std::fs::read(&file).expect("the recorded snapshot file");
    assert_eq!(checksum(&original), record.checksum);
    let lmdb = wipe_lmdb(&p);

    // Truncated.
    std::fs::write(&file, &original[..original.len() / 2]).unwrap();
    let error = expect_refusal(&mut aggregator).await;
    assert!(error.contains(&record.snapshot_key), "{error}");
    assert!(error.contains("corrupt"), "{error}");
    assert!(!lmdb.join("data.mdb").exists(), "empty LMDB created");

    // Deleted.
    std::fs::remove_file(&file).unwrap();
    let error = expect_refusal(&mut aggregator).await;
    assert!(error.contains(&record.snapshot_key), "{error}");
    assert!(!lmdb.join("data.mdb").exists(), "empty LMDB created");
    assert_eq!(local_record(&p).unwrap(), record, "record changed");

    std::fs::write(&file, &original).unwrap();
    let offset = log_len(&aggregator);
    aggregator.restart();
    aggregator
        .wait_for_log("aggregator running", START)
        .await
        .expect("aggregator restored");
    assert_eq!(running_line(&log_since(&aggregator, offset)).1, "cold");
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    report("missing_or_corrupt_file_snapshot", started);
}

// ---- 3. retention gap ----------------------------------------------------

/// Purging only what the aggregator already applied is fine; purging one
/// message it still needs makes the restart fail naming both sequences,
/// with its LMDB and the pacer untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_gap_at_restart_refuses_naming_both_sequences() {
    let started = Instant::now();
    let mut p = Pipeline::start(Backends::default(), 200).await;
    p.spawn_all().await;
    let mut aggregator = p.aggregator.take().unwrap();
    let first = p.publish(&sim_config(3_000, 31)).await;
    assert_exact(&p.settle(&first, SETTLE).await, &first);

    // Boundary: everything up to the last applied sequence may go.
    assert!(aggregator
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());
    let (_, applied) = lmdb_position(&p);
    assert!(applied > 0);
    let second = p.publish(&sim_config(3_000, 32)).await;
    wait_limiter_drained(&p).await;
    purge_spend_before(&p, applied + 1).await;
    assert_eq!(spend_bounds(&p).await.0, applied + 1);
    aggregator.restart();
    aggregator
        .wait_for_log("aggregator running", START)
        .await
        .expect("a purge of applied messages only must not stop the aggregator");
    let truth = merge(&[&first, &second]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);

    // Gap: the next message it needs is purged.
    assert!(aggregator
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());
    let (lineage, applied) = lmdb_position(&p);
    let third = p.publish(&sim_config(3_000, 33)).await;
    wait_limiter_drained(&p).await;
    let (_, last) = spend_bounds(&p).await;
    assert!(last >= applied + 2, "last {last}, applied {applied}");
    let keep_from = applied + 2;
    purge_spend_before(&p, keep_from).await;
    assert_eq!(spend_bounds(&p).await.0, keep_from);

    let error = expect_refusal(&mut aggregator).await;
    assert!(error.contains("retention gap"), "{error}");
    assert!(names_number(&error, keep_from), "{error}");
    assert!(names_number(&error, applied + 1), "{error}");
    assert_eq!(lmdb_position(&p), (lineage, applied), "LMDB changed");
    // The pacer still shows what was applied, nothing of the third run.
    assert_exact(&p.settle(&truth, Duration::from_secs(5)).await, &truth);
    assert!(third.stats.unique_events > 0);
    report("retention_gap_at_restart", started);
}

/// A lagging aggregator (paused) whose next messages are purged before it
/// reads them must stop with a retention gap too, not skip them silently
/// (DESIGN.md rule 4: never silently skip).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_gap_while_lagging_stops_the_aggregator() {
    let started = Instant::now();
    let mut p = Pipeline::start(Backends::default(), 200).await;
    let aggregator_port = free_port();
    // One tuple per SPEND message: many messages, more than the consumer
    // has asked the server for, so some are still in the stream when purged.
    let one_tuple = [("ADSPEND_LIMITER_TUPLES_PER_MESSAGE", "1")];
    let mut aggregator = p.spawn_with("aggregator", aggregator_port, &[]);
    p.limiter = Some(p.spawn_with("limiter", free_port(), &one_tuple));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let first = p.publish(&sim_config(500, 34)).await;
    assert_exact(&p.settle(&first, SETTLE).await, &first);

    let mut limiter = p.limiter.take().unwrap();
    assert!(limiter
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());
    let (_, applied) = spend_bounds(&p).await;
    wait_applied(aggregator_port, applied).await;
    aggregator.pause().unwrap();
    limiter.restart();
    let second = p.publish(&sim_config(1_500, 35)).await;
    wait_limiter_drained(&p).await;
    let (_, last) = spend_bounds(&p).await;
    assert!(last > applied + 1_500, "only {} new", last - applied);
    purge_spend_before(&p, last).await;
    aggregator.resume().unwrap();

    let truth = merge(&[&first, &second]);
    if let Err(e) = aggregator.wait_for_exit(Duration::from_secs(20)).await {
        let comparison = p.settle(&truth, Duration::from_secs(5)).await;
        panic!(
            "the aggregator needed sequence {} but SPEND now starts at {last}, and it \
             kept running ({e}); pacer total {} vs truth {} micros, {} limits differ:\n{}",
            applied + 1,
            comparison.total_pacer(),
            comparison.total_truth(),
            comparison.mismatches().len(),
            aggregator.log_tail(10)
        );
    }
    let status = aggregator.exit_status().unwrap();
    assert_eq!(status.code(), Some(1), "{status:?}");
    let tail = aggregator.log_tail(20);
    assert!(tail.contains("retention gap"), "{tail}");
    report("retention_gap_while_lagging", started);
}

// ---- 4. log went backwards -----------------------------------------------

/// SPEND deleted and recreated (by a restarted limiter) with fewer messages
/// than the aggregator applied: the restart fails naming both sequences.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_went_backwards_refuses_naming_both_sequences() {
    let started = Instant::now();
    let mut p = Pipeline::start(Backends::default(), 200).await;
    let aggregator_port = free_port();
    let mut aggregator = p.spawn_with("aggregator", aggregator_port, &[]);
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let truth = p.publish(&sim_config(3_000, 41)).await;
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    // Markers (8 a second) make the applied sequence clearly larger than
    // what the new stream will hold.
    wait_applied(aggregator_port, 30).await;
    assert!(aggregator
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());
    let (lineage, applied) = lmdb_position(&p);
    let mut limiter = p.limiter.take().unwrap();
    assert!(limiter
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());

    let js = jetstream::new(p.client().await);
    js.delete_stream("SPEND").await.expect("delete SPEND");
    // The limiter creates SPEND when it starts; no markers for a minute, so
    // only the new impressions' batches land in it.
    let mut limiter = p.spawn_with(
        "limiter",
        free_port(),
        &[("ADSPEND_CHECKPOINT_INTERVAL_MS", "60000")],
    );
    limiter
        .wait_for_log("limiter running", START)
        .await
        .expect("limiter started");
    let few = p.publish(&sim_config(200, 42)).await;
    assert!(few.stats.unique_events > 0);
    wait_limiter_drained(&p).await;
    assert!(limiter
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());
    let (_, last) = spend_bounds(&p).await;
    assert!(
        last >= 1 && last < applied,
        "new SPEND ends at {last}, applied {applied}"
    );

    let error = expect_refusal(&mut aggregator).await;
    assert!(error.contains("log went backwards"), "{error}");
    assert!(names_number(&error, last), "{error}");
    assert!(names_number(&error, applied), "{error}");
    assert_eq!(lmdb_position(&p), (lineage, applied), "LMDB changed");
    report("log_went_backwards", started);
}

// ---- 5. fencing ----------------------------------------------------------

/// A paused aggregator is superseded by a second one with its own data dir
/// (new epoch, cold restore). Resumed, the first is fenced at its next
/// checkpoint and exits non-zero; the pacer never moves backwards and ends
/// equal to the truth with the second; the record carries the second's epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_owner_is_fenced_and_the_new_owner_stays_exact() {
    let started = Instant::now();
    let mut p = Pipeline::start(ETCD_S3, 300).await;
    p.spawn_all().await;
    let mut first = p.aggregator.take().unwrap();
    first
        .wait_for_log("aggregator running", START)
        .await
        .unwrap();
    let (first_epoch, _, _) = running_line(&log_since(&first, 0));
    let before = p.publish(&sim_config(8_000, 51)).await;
    assert_exact(&p.settle(&before, SETTLE).await, &before);
    wait_record(&p, "the first owner's epoch", |r| {
        r.epoch == first_epoch && r.seq > 0
    })
    .await;

    first.pause().unwrap();
    let second_dir = p.dir.path().join("aggregator-second");
    let mut second = spawn_aggregator(
        &p,
        "aggregator-second.log",
        free_port(),
        &[("ADSPEND_DATA_DIR", second_dir.to_str().unwrap())],
    );
    second
        .wait_for_log("aggregator running", START)
        .await
        .expect("second aggregator started");
    let (second_epoch, start, _) = running_line(&log_since(&second, 0));
    assert_eq!(start, "cold");
    assert!(second_epoch > first_epoch);
    let during = p.publish(&sim_config(8_000, 52)).await;
    let truth = merge(&[&before, &during]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    wait_record(&p, "the second owner's epoch", |r| r.epoch == second_epoch).await;

    let mut seen = pacer_lifetimes(&p).await.unwrap();
    let offset = log_len(&first);
    first.resume().unwrap();
    let deadline = Instant::now() + START;
    let status = loop {
        if let Some(status) = first.exit_status() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the stale aggregator was not fenced:\n{}",
            first.log_tail(20)
        );
        let now = pacer_lifetimes(&p).await.unwrap();
        for (limit, before) in &seen {
            let after = now.get(limit).copied().unwrap_or(0);
            assert!(
                after >= *before,
                "{limit} went back from {before} to {after}"
            );
        }
        seen = now;
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let log = log_since(&first, offset);
    assert_eq!(status.code(), Some(1), "{status:?}:\n{log}");
    let error = log
        .lines()
        .find(|l| l.starts_with("aggregator: error: "))
        .unwrap_or_else(|| panic!("no error line:\n{log}"));
    assert!(error.contains("fenced"), "{error}");
    assert!(names_number(error, first_epoch), "{error}");

    let after = p.publish(&sim_config(3_000, 53)).await;
    let truth = merge(&[&truth, &after]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    assert!(second.is_running(), "{}", second.log_tail(20));
    let record = wait_record(&p, "the second owner's epoch", |r| r.epoch == second_epoch).await;
    let object =
        p.s3.as_ref()
            .unwrap()
            .get_object(BUCKET, &snapshot_object(&record))
            .await
            .unwrap()
            .expect("the recorded snapshot is in S3");
    assert_eq!(object.len() as u64, record.size_bytes);
    assert_eq!(checksum(&object), record.checksum);
    report("stale_owner_is_fenced", started);
}

/// The stale owner's checkpoint attempt uploads its snapshot before its
/// fenced record write fails. When both owners reach the same checkpoint id
/// and sequence, both use the same object key: the stale upload must not
/// replace the object the new owner's record names. The two owners' files
/// differ here because the new one runs with a smaller dedupe bound (a
/// settings rollout); with identical settings the compacted copies happen to
/// be byte-identical, which would hide an overwrite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_owner_does_not_overwrite_the_new_owners_snapshot() {
    let started = Instant::now();
    let mut p = Pipeline::start(ETCD_S3, 300).await;
    p.spawn_all().await;
    let mut first = p.aggregator.take().unwrap();
    first
        .wait_for_log("aggregator running", START)
        .await
        .unwrap();
    let (first_epoch, _, _) = running_line(&log_since(&first, 0));
    let truth = p.publish(&sim_config(5_000, 54)).await;
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);

    // No limiter: only our markers move SPEND from here on.
    let mut limiter = p.limiter.take().unwrap();
    assert!(limiter
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());
    let settled = publish_marker(&p).await;
    let base = wait_record(&p, "the first owner at our marker", |r| {
        r.epoch == first_epoch && r.seq == settled
    })
    .await;

    first.pause().unwrap();
    let second_dir = p.dir.path().join("aggregator-second");
    let mut second = spawn_aggregator(
        &p,
        "aggregator-second.log",
        free_port(),
        &[
            ("ADSPEND_DATA_DIR", second_dir.to_str().unwrap()),
            ("ADSPEND_DEDUPE_MAX_IDS", "1000"),
        ],
    );
    second
        .wait_for_log("aggregator running", START)
        .await
        .expect("second aggregator started");
    let (second_epoch, start, restored) = running_line(&log_since(&second, 0));
    assert_eq!((start.as_str(), restored), ("cold", settled));

    let marker = publish_marker(&p).await;
    let record = wait_record(&p, "the second owner at the next marker", |r| {
        r.epoch == second_epoch && r.seq == marker
    })
    .await;
    assert_eq!(record.checkpoint_id, base.checkpoint_id + 1);
    let s3 = p.s3.as_ref().unwrap();
    let key = snapshot_object(&record);
    let object = s3.get_object(BUCKET, &key).await.unwrap().unwrap();
    assert_eq!(checksum(&object), record.checksum);

    // The first resumes at the same position with the same next checkpoint
    // id, reads the same marker, and checkpoints under the same key.
    let offset = log_len(&first);
    first.resume().unwrap();
    let status = first
        .wait_for_exit(START)
        .await
        .expect("the stale aggregator was not fenced");
    let log = log_since(&first, offset);
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("fenced"), "{log}");

    assert_eq!(etcd_record(&p).await.unwrap(), record);
    // The fault fired: both owners completed an upload for this checkpoint
    // id and sequence (under one key, or under two if keys tell owners apart).
    let requests = std::fs::read_to_string(s3.log_path()).unwrap();
    let checkpoint = format!(
        "\"POST /{BUCKET}/snapshots/all/{:020}-{:020}",
        record.checkpoint_id, record.seq
    );
    let uploads = requests
        .lines()
        .filter(|l| l.contains(&checkpoint) && l.contains("?uploadId="))
        .count();
    assert_eq!(uploads, 2, "{requests}");
    let object = s3.get_object(BUCKET, &key).await.unwrap().unwrap();
    assert!(
        object.len() as u64 == record.size_bytes && checksum(&object) == record.checksum,
        "the fenced owner (epoch {first_epoch}) replaced {key}, which the record of epoch \
         {second_epoch} names: now {} bytes with {}, recorded {} bytes with {}",
        object.len(),
        checksum(&object),
        record.size_bytes,
        record.checksum
    );
    // And so a cold restore of the current record still works.
    second.kill();
    std::fs::remove_dir_all(second_dir.join("lmdb")).unwrap();
    let offset = log_len(&second);
    second.restart();
    second
        .wait_for_log("aggregator running", START)
        .await
        .expect("cold restore of the new owner's record");
    assert_eq!(running_line(&log_since(&second, offset)).1, "cold");
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    report("stale_owner_snapshot_key", started);
}

// ---- 6-8. crashes of the other components --------------------------------

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
        adspend_tests::sim::run(&client, &config, &catalog, CancellationToken::new()).await
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
    let truth = adspend_tests::stream_truth::truth_from_stream(&client, &p.catalog)
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
    let truth = merge(&[&before, &after]);
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
    let config = SimConfig {
        events: Some(27_000),
        rate: 3_000.0,
        duplicate_rate: 0.1,
        batch: 25,
        seed: 71,
        ..SimConfig::default()
    };
    let publisher = tokio::spawn(async move {
        adspend_tests::sim::run(&client, &config, &catalog, CancellationToken::new()).await
    });
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
    // Snapshots uploaded by the failed attempts are collected: the newest
    // and the two kept ones remain.
    let shard_dir = p.aggregator_dir().join("snapshots/all");
    let count = |dir: &Path| std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
    wait_until(Duration::from_secs(10), Duration::from_millis(200), || {
        let n = count(&shard_dir);
        async move { n <= 3 }
    })
    .await
    .unwrap_or_else(|_| panic!("{} snapshots left", count(&shard_dir)));
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
    let truth = merge(&[&before, &during]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    report("pacer_crash", started);
}
