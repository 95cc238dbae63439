//! Local state lost: the aggregator's LMDB wiped after a SIGKILL.

use std::os::unix::process::ExitStatusExt;
use std::time::Instant;

use crate::support::{assert_exact, sim_config, Pipeline, BUCKET};

use super::{
    etcd_record, log_len, log_since, merged, report, running_line, snapshot_object, wait_record,
    wipe_lmdb, ETCD_S3, SETTLE, START,
};

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

    let truth = merged(&[&before, &during]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    assert!(lmdb.join("data.mdb").exists());
    // Checkpoints go on in the restored lineage, under the new epoch.
    let next = wait_record(&p, "the new epoch", |r| r.epoch == epoch).await;
    assert!(next.checkpoint_id > record.checkpoint_id, "{next:?}");
    assert_eq!(next.lineage, record.lineage);
    assert!(aggregator.is_running());
    report("wiped_local_state", started);
}
