//! Snapshot lost or damaged: the recorded snapshot missing or corrupt, in
//! S3 and in single-machine (`file://`) mode.

use std::time::Instant;

use adspend_aggregator::record::CheckpointRecord;
use adspend_harness::ServiceProcess;

use crate::support::{assert_exact, sim_config, Backends, Pipeline, BUCKET};

use super::{
    checksum, etcd_record, expect_refusal, local_record, log_len, log_since, merged, report,
    running_line, snapshot_object, wait_record, wipe_lmdb, ETCD_S3, SETTLE, START,
};

/// With the local LMDB wiped, a corrupted (same size, other bytes)
/// snapshot object stops the aggregator with an error naming the object
/// key, without creating an empty LMDB or touching the record; with the
/// intact object back, it restores and is exact. (A deleted one is rebuilt
/// by replay while `SPEND` holds everything: `snapshot_gone.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_s3_snapshot_refuses_to_start_naming_the_key() {
    let started = Instant::now();
    let mut p = Pipeline::start(ETCD_S3, 300).await;
    p.spawn_all().await;
    let mut aggregator = p.aggregator.take().unwrap();
    let truth = p.publish(&sim_config(5_000, 23)).await;
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    wait_record(&p, "a sequence", |r| r.seq > 0).await;
    aggregator.kill();
    let record = etcd_record(&p).await.unwrap();
    wipe_lmdb(&p);
    let key = snapshot_object(&record);
    let (_, start, _) = refuse_corrupt(
        &p,
        &mut aggregator,
        &record,
        &key,
        &record.snapshot_key,
        (record.size_bytes, &record.checksum),
    )
    .await;
    assert_eq!(start, "cold");
    let more = p.publish(&sim_config(2_000, 24)).await;
    let truth = merged(&[&truth, &more]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    report("corrupt_s3_snapshot", started);
}

/// The recorded object `key` (a base or a delta, `name` in errors) with the
/// local LMDB wiped: corrupted at its recorded size (so only the checksum
/// can tell), it stops the start with an error naming it, without creating
/// an empty LMDB or touching the record. Then the intact object goes back
/// and the aggregator restarts; returns the fields of its "aggregator
/// running" line.
pub(super) async fn refuse_corrupt(
    p: &Pipeline,
    aggregator: &mut ServiceProcess,
    record: &CheckpointRecord,
    key: &str,
    name: &str,
    (size, sum): (u64, &str),
) -> (u64, String, u64) {
    let lmdb = p.aggregator_dir().join("lmdb");
    let s3 = p.s3.as_ref().unwrap();
    let original = s3
        .get_object(BUCKET, key)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("the recorded object {key} is in S3"));
    assert_eq!(original.len() as u64, size);
    assert_eq!(checksum(&original), sum);

    let mut corrupt = original.to_vec();
    let (middle, len) = (corrupt.len() / 2, corrupt.len());
    for byte in &mut corrupt[middle..(middle + 64).min(len)] {
        *byte ^= 0xA5;
    }
    assert_ne!(checksum(&corrupt), sum);
    s3.put_object(BUCKET, key, corrupt).await.unwrap();
    let error = expect_refusal(aggregator).await;
    assert!(error.contains(name) && error.contains("corrupt"), "{error}");
    assert!(!lmdb.join("data.mdb").exists(), "empty LMDB created");
    assert_eq!(&etcd_record(p).await.unwrap(), record, "record changed");

    s3.put_object(BUCKET, key, original).await.unwrap();
    let offset = log_len(aggregator);
    aggregator.restart();
    aggregator
        .wait_for_log("aggregator running", START)
        .await
        .expect("aggregator restored");
    running_line(&log_since(aggregator, offset))
}

/// Single-machine mode (`file://` snapshots, record in the data dir): a
/// truncated snapshot file refuses the start, naming the key; the intact
/// file back restores exactly. (A deleted one is rebuilt by replay while
/// `SPEND` holds everything: `snapshot_gone.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_file_snapshot_refuses_to_start_naming_the_key() {
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
    report("corrupt_file_snapshot", started);
}
