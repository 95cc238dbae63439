//! Fencing: a stale owner coming back after a new one took over.

use std::time::{Duration, Instant};

use adspend_harness::free_port;

use crate::support::{assert_exact, sim_config, Pipeline, BUCKET};

use super::{
    checksum, etcd_record, log_len, log_since, merged, names_number, publish_marker, report,
    running_line, snapshot_object, spawn_aggregator, wait_record, ETCD_S3, SETTLE, START,
};

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
    let truth = merged(&[&before, &during]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    wait_record(&p, "the second owner's epoch", |r| r.epoch == second_epoch).await;

    let mut seen = p.lifetimes().await.unwrap();
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
        let now = p.lifetimes().await.unwrap();
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
    let truth = merged(&[&truth, &after]);
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
            // A full base at its checkpoint: the object a stale owner could
            // overwrite is a whole snapshot.
            ("ADSPEND_CHECKPOINT_MAX_DELTAS", "0"),
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
    // A base is a multipart upload (counted at its completion), a delta a
    // single PUT; the stale owner may have sent either.
    let checkpoint = format!(
        " /{BUCKET}/snapshots/all/{:020}-{:020}",
        record.checkpoint_id, record.seq
    );
    let uploads = requests
        .lines()
        .filter(|l| l.contains(&checkpoint))
        .filter(|l| {
            (l.contains("\"POST ") && l.contains("?uploadId="))
                || (l.contains("\"PUT ") && !l.contains('?'))
        })
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
