//! Incremental checkpoints: a cold restore is the recorded base plus every
//! recorded delta, each verified; a delta lost or damaged refuses the start
//! naming that delta, and with it back the restore lands exactly on the
//! record and stays exact.

use std::time::{Duration, Instant};

use adspend_aggregator::record::CheckpointRecord;
use adspend_tests::harness::wait_until;

use crate::support::{assert_exact, sim_config, Pipeline};

use super::snapshots::refuse_lost_then_corrupt;
use super::{
    current_record, etcd_record, merged, report, wait_record, wipe_lmdb, ETCD_S3, SETTLE, START,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_restore_applies_every_delta_and_refuses_a_damaged_one_by_name() {
    let started = Instant::now();
    let mut p = Pipeline::start(ETCD_S3, 300).await;
    p.spawn_all().await;
    let mut aggregator = p.aggregator.take().unwrap();
    let first = p.publish(&sim_config(4_000, 61)).await;
    assert_exact(&p.settle(&first, SETTLE).await, &first);
    // Spend after a base, so that deltas carry sums, not only positions.
    // The first checkpoint of each aggregator life copies a new base, and
    // a new base may be copied at any later one (after 30 deltas, or once
    // they outweigh the base). So: wait until this life has a base and a
    // delta after it, publish, wait briefly for a delta with that spend,
    // kill, and retry in a new life if the chain recorded at the kill has
    // none.
    let mut runs = vec![first];
    let record = loop {
        wait_record(&p, "a delta", |r| !r.deltas.is_empty()).await;
        let more = p.publish(&sim_config(2_000, 61 + runs.len() as u64)).await;
        runs.push(more);
        let truth = merged(&runs.iter().collect::<Vec<_>>());
        assert_exact(&p.settle(&truth, SETTLE).await, &truth);
        let _ = wait_until(
            Duration::from_secs(5),
            Duration::from_millis(100),
            || async { current_record(&p).await.is_ok_and(|r| has_spend_delta(&r)) },
        )
        .await;
        aggregator.kill();
        let record = etcd_record(&p).await.unwrap();
        if has_spend_delta(&record) {
            break record;
        }
        assert!(
            runs.len() < 8,
            "no recorded chain with spend in a delta: {record:?}"
        );
        aggregator.restart();
        aggregator
            .wait_for_log("aggregator running", START)
            .await
            .expect("aggregator restarted");
    };
    assert!(
        record.seq == record.deltas.last().unwrap().seq,
        "{record:?}"
    );
    wipe_lmdb(&p);
    let delta = record
        .deltas
        .iter()
        .find(|d| d.size_bytes > SPEND_DELTA_BYTES)
        .unwrap()
        .clone();
    let key = format!("snapshots/{}", delta.key);
    let (_, start, last_applied) = refuse_lost_then_corrupt(
        &p,
        &mut aggregator,
        &record,
        &key,
        &delta.key,
        (delta.size_bytes, &delta.checksum),
    )
    .await;
    // Base + deltas land exactly on the record, and the pacer equals the
    // truth, including what comes after.
    assert_eq!(start, "cold");
    assert_eq!(last_applied, record.seq, "restored exactly to the record");
    runs.push(p.publish(&sim_config(2_000, 99)).await);
    let truth = merged(&runs.iter().collect::<Vec<_>>());
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    p.aggregator = Some(aggregator);
    report("delta_restore", started);
}

/// A delta bigger than this carries sums and dedupe ids, not only the
/// position an idle interval records (86 bytes).
const SPEND_DELTA_BYTES: u64 = 1_000;

fn has_spend_delta(record: &CheckpointRecord) -> bool {
    record
        .deltas
        .iter()
        .any(|d| d.size_bytes > SPEND_DELTA_BYTES)
}
